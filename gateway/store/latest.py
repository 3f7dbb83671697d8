"""Latest state: the insert-plus-delete writes of ``latest_events_by_state``
and the upsert of ``latest_events_by_device`` (schema/002_latest_events.cql).

For an event of device D with state S, written with ``USING TIMESTAMP`` equal
to the event's write timestamp (event time in µs plus a tie-break):

* INSERT D into partition (tenant, S, bucket(D));
* DELETE D from (tenant, S', bucket(D)) for every other state S' the tenant knows;
* INSERT the event into latest_events_by_device.

Because Cassandra keeps, per cell, the write with the highest timestamp (and a
tombstone wins a tie), any order of delivery converges on the newest event.

Promises and bounds:

* A state seen for the first time is recorded in ``tenant_states`` (after the
  writes already in flight have finished) before any write that uses it, so
  every later event's deletes cover it. A tenant may know at most
  ``pipeline.max_states_per_tenant`` states; an event with one more is rejected
  (reason ``too_many_states``).
* The writer knows each device's newest state-bearing write for sure: a
  read of latest_events_by_device (one per tenant and up to 100 devices of
  a chunk, ``device_id IN (...)``: ``Requests.read_keys``) the first time it meets the device since
  start-up (or since the device left its memory, an LRU of
  ``pipeline.device_cache_size`` devices), merged with what this process
  writes after. That read is started when the event is queued
  (:meth:`LatestState.read_ahead`; the pipeline's read-ahead task sends them,
  up to 100 devices to a request), so that a chunk seldom waits for it: over
  a slow link it had cost every chunk of devices met for the first time a
  round trip. At most ``pipeline.queue_size`` devices wait to be read ahead;
  past that (counted, ``newest_read_ahead_skipped``) the chunk reads them
  itself. An event older than that newest write writes nothing to the
  latest tables (counted as ``stale_latest``); its raw row is written as
  usual. This covers what the deletes alone cannot: an old event into a state
  that became known after the newer event was written (its deletes missed
  it), an old event arriving after ``gc_grace_seconds`` let compaction purge
  the newer event's deletes, and a redelivered event without ``ts`` (MQTT
  DUP), which the pipeline places behind every timed write. After an untimed
  write (``latest_events_by_device.state_untimed``) such a copy goes one µs
  after it instead: it is newer than what was acknowledged before it. Not in
  a share group (``mqtt.share_group``): there that write may be another
  member's, of an event published after the copy, and the copy stays behind it.
* In a share group another member may write the device at any time, so what
  this process knows of a device is good for one chunk only: every chunk
  reads its devices' newest writes again (read ahead as above, one request
  per tenant and up to 100 devices). Kept from one chunk to the next, it let
  a late event pass as the newest after another member's newer write, and
  where a rotation had left that write's delete behind in the old generation
  the device stayed listed and counted in two states.
* Other gateway instances may register states; known states are re-read every
  ``pipeline.states_refresh`` seconds. Between two refreshes an instance can
  miss a brand-new state in its deletes: another instance may have put a
  device there that this one then moved elsewhere, leaving it listed and
  counted in both. So a read of the states that finds one this process did
  not know (a refresh, or the fresh read before a registration) reads the
  new state's partitions, at most MISSED_READ_ROWS rows of each, and
  deletes the rows older than this process's latest write of their device
  into another state, as of that write (:meth:`LatestState._missed`; so a
  newer write into the new state stands). A new state holds few rows, and
  only rows that are leftovers get a tombstone. The deletes go with the
  tenant's next state-bearing writes, at most MISSED_PER_WRITE with each
  (counted, ``missed_deletes``). Not covered, and left to a page read of
  the state (queries.py): a device that left the device cache, rows past
  MISSED_READ_ROWS of a partition, a state that appeared while the tenant
  was out of the tenant cache, and deletes queued when the tenant left it.
* A device's bucket is ``crc32(device_id) % state_buckets``, so every
  reader and writer of a tenant must use one number: the first gateway that
  loads the tenant's states records its ``tenants.<t>.state_buckets`` beside
  them (``tenant_states.state_buckets``, a compare-and-set), and from then
  on every writer and reader (``queries.state_buckets``) uses the recorded
  number. A gateway whose config says otherwise logs a warning naming the
  key when it loads the tenant, and writes where readers read.
* Events without a state update latest_events_by_device only (the device stays
  in the state partition it was in).
* Deletes only on a change. The deletes into every other state are written by
  the first event of a device after start-up (or after its memory entry was
  evicted) and by every event whose state differs from the last one this
  process wrote for the device, which is its newest for sure; an event in the
  same state writes only its inserts. Not in a share group
  (``mqtt.share_group``): there another member may have moved the device
  since, so every event writes its deletes. So a steady device leaves no fresh
  tombstones, and those of real changes expire after ``gc_grace_seconds``.
  Safe under failures: a write that fails is retried until it lands or the
  gateway stops, and after a restart every device starts again with a full
  set of deletes.
* State generations (rotate.py). Each (tenant, state, bucket) partition is
  written in its current generation, and in the next one too while a
  rotation copies it. This module routes the writes and counts, per
  partition, the deletes sent into it and an estimate of its live rows; a
  partition whose deletes reach ``pipeline.rotate_after_deletes`` (and half
  its live rows) is *due*, and the pipeline hands the due ones to
  :class:`~gateway.store.rotate.StateRotation` after letting the writes in
  flight land. The generations are re-read with the states, every
  ``pipeline.states_refresh``.
* The per-tenant cache of states holds at most MAX_TENANTS tenants (LRU); an
  evicted tenant is simply re-read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from ..aio import gather_all
from ..config import Config
from ..event import Event
from ..identity import device_hash, state_bucket
from ..lru import LRU
from ..stats import Cache, Stats
from ..units import epoch_ms
from .requests import Requests
from .sink import Pending, Write
from .write_session import UNSET, Prepared, WriteSession

log = logging.getLogger(__name__)

MAX_TENANTS = 10_000
# A learnt state's rows read per partition for the deletes it missed, and
# those deletes sent with one event's writes (LatestState._missed).
MISSED_READ_ROWS = 5_000
MISSED_PER_WRITE = 500


@dataclass(slots=True)
class _Newest:
    write_ts: int  # of the device's newest state-bearing write known
    # Read from Cassandra (and kept up to date) since start-up; in a share
    # group, read since the last chunk of the device (LatestState._sole_writer).
    sure: bool
    event_id: int = 0  # of that write's event (0: unknown, a row from before state_event_id)
    # The state of the newest latest-table write this process has sent for the
    # device (None: none since start-up): while it stays, no deletes are needed.
    written: str | None = None
    untimed: bool = False  # that write's event had no ts (stamped with its receive time)
    written_ts: int = 0  # that latest-table write's timestamp (for LatestState._missed)


def state_value(text: str | None, num: float | None) -> str:
    """An event's value as latest_events_by_state stores it: JSON, never null."""
    return orjson.dumps(text if text is not None else num).decode()


PartKey = tuple[str, str, int]  # (tenant, state, bucket)

# A device into a state partition (rotate.py copies rows with it too).
INSERT_STATE = (
    "INSERT INTO {keyspace}.latest_events_by_state "
    "(tenant, state, bucket, gen, device_hash, device_id, ts, value, tags) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
)
# A tenant's state_buckets, recorded unless one is already (compare-and-set;
# parameters: the number, the tenant). schema.migrate records it too.
RECORD_STATE_BUCKETS = (
    "UPDATE {keyspace}.tenant_states SET state_buckets = ? WHERE tenant = ? IF state_buckets = null"
)


@dataclass(slots=True)
class Part:
    """A state partition's generations, as this process knows them."""

    gen: int = 0
    next_gen: int | None = None  # set while a rotation copies gen into it
    live: int = 0  # estimated rows: those the last rotation copied, +entries -departures
    deletes: int = 0  # deletes this process sent into gen since it learnt it
    rotating_since: datetime | None = None  # when next_gen was set (from Cassandra)
    retired_gen: int | None = None  # left by a rotation, still to be dropped

    def gens(self) -> tuple[int, ...]:
        return (self.gen,) if self.next_gen is None else (self.gen, self.next_gen)


@dataclass(slots=True)
class _TenantStates:
    states: dict[str, int]  # state -> registered_at (epoch ms)
    buckets: int  # state_buckets, as recorded in tenant_states
    parts: dict[tuple[str, int], Part] = field(default_factory=dict)  # (state, bucket)
    loaded_at: float = field(default_factory=time.monotonic)
    # Deletes a learnt state missed (LatestState._missed), sent with the
    # tenant's next writes: (state, device, timestamp). At most
    # MISSED_READ_ROWS per partition of each state learnt.
    missed: list[tuple[str, str, int]] = field(default_factory=list)


class LatestState:
    _insert_state: Prepared
    _delete_state: Prepared
    _insert_device: Prepared
    _select_states: Prepared
    _select_parts: Prepared
    _register: Prepared
    _record_buckets: Prepared
    _newest_state: Prepared
    _select_state_rows: Prepared

    def __init__(self, requests: Requests, config: Config, stats: Stats) -> None:
        self._requests = requests
        self._config = config
        self._stats = stats
        self._max_states = config.pipeline.max_states_per_tenant
        # Whether this process alone writes its devices (topic shards: yes; a
        # share group: no, a device's events are dealt to every member, and
        # another may have moved it since this one last wrote it).
        self._sole_writer = config.mqtt.share_group is None
        self._refresh = config.pipeline.states_refresh
        self._rotate_after = config.pipeline.rotate_after_deletes
        # Partitions due for a rotation, or found mid-rotation or with a
        # generation to drop in Cassandra: rotate.py takes them (bounded by
        # the partitions of the cached tenants).
        self.due: dict[PartKey, None] = {}
        self._tenants: LRU[str, _TenantStates] = LRU(
            max(MAX_TENANTS, config.pipeline.batch_max_events)
        )
        # At least a chunk's devices, so none is forgotten within prepare_chunk.
        self._newest: LRU[tuple[str, str], _Newest] = LRU(
            max(config.pipeline.device_cache_size, config.pipeline.batch_max_events)
        )
        # Read ahead (read_ahead): devices to read, and those being read, each
        # with the future its read completes.
        self._ahead_max = config.pipeline.queue_size
        self._to_read: dict[tuple[str, str], None] = {}
        self._reading: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._wake = asyncio.Event()

    def caches(self) -> dict[str, Cache]:
        """Its bounded caches, by name, for the metrics (gateway_cache_*)."""
        return {"latest_tenants": self._tenants, "latest_newest": self._newest}

    async def prepare(self, session: WriteSession) -> None:
        # Together: each is a round trip, a second or more over a slow link.
        (
            self._insert_state,
            self._delete_state,
            self._select_parts,
            self._insert_device,
            self._select_states,
            self._record_buckets,
            self._register,
            self._newest_state,
            self._select_state_rows,
        ) = await gather_all(
            session.prepare(INSERT_STATE, timestamps=(6,)),
            session.prepare(
                "DELETE FROM {keyspace}.latest_events_by_state USING TIMESTAMP ? "
                "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? "
                "AND device_hash = ? AND device_id = ?"
            ),
            session.prepare(
                "SELECT state, bucket, gen, next_gen, rotating_since, live, retired_gen "
                "FROM {keyspace}.state_partitions WHERE tenant = ?"
            ),
            session.prepare(
                "INSERT INTO {keyspace}.latest_events_by_device (tenant, device_id, state, "
                "state_event_id, state_untimed, ts, value, value_num, metrics, tags) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
                timestamps=(5,),
            ),
            session.prepare(
                "SELECT state, registered_at, state_buckets FROM {keyspace}.tenant_states "
                "WHERE tenant = ?"
            ),
            session.prepare(RECORD_STATE_BUCKETS),
            session.prepare(
                "INSERT INTO {keyspace}.tenant_states (tenant, state, registered_at) "
                "VALUES (?, ?, ?) IF NOT EXISTS",
                timestamps=(2,),
            ),
            session.prepare(
                "SELECT device_id, WRITETIME(state) AS wt, state_event_id, state_untimed "
                "FROM {keyspace}.latest_events_by_device "
                "WHERE tenant = ? AND device_id IN ?"
            ),
            session.prepare(
                "SELECT device_id, WRITETIME(ts) AS wt FROM {keyspace}.latest_events_by_state "
                "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? LIMIT ?"
            ),
        )

    async def new_states(self, events: list[Event]) -> list[tuple[str, str]]:
        """The (tenant, state) pairs of these events that are not known yet.

        The caller lets the writes in flight land, then calls :meth:`register`:
        those writes may belong to newer events whose deletes did not cover the
        new state, and the late-event check must see them.
        """
        new: dict[tuple[str, str], None] = {}
        for event in events:
            if event.state is not None:
                known = await self._known(event.tenant)
                if event.state not in known.states:
                    new[(event.tenant, event.state)] = None
        return list(new)

    def registered(self, tenant: str, state: str | None) -> bool:
        """Whether ``state`` is among the tenant's registered states as this
        process knows them now (no read: False when the tenant is not cached)."""
        known = self._tenants.peek(tenant)
        return known is not None and state in known.states

    async def register(self, states: list[tuple[str, str]]) -> None:
        """Record new states in tenant_states, within each tenant's budget.

        A state new to this process is first looked for in a fresh read of
        the tenant's states (once per tenant and call): another instance may
        have registered it, or others, since this one last read them. So every
        instance gives a state the same verdict, and the budget holds unless
        two instances register different states at the same moment."""
        fresh: set[str] = set()
        for tenant, state in states:
            known = await self._known(tenant)
            if state in known.states:
                continue
            if tenant not in fresh:
                fresh.add(tenant)
                known = await self._known(tenant, fresh=True)
                if state in known.states:
                    continue
            await self._register_state(tenant, state, known)

    async def over_budget(self, events: list[Event]) -> list[Event]:
        """After :meth:`register`: the events whose state is over the tenant's
        budget (they are rejected, not written)."""
        over: list[Event] = []
        for event in events:
            if event.state is not None:
                known = await self._known(event.tenant)
                if event.state not in known.states:
                    over.append(event)
        return over

    def read_ahead(self, event: Event) -> None:
        """An event was just queued: have its device's newest write read if it
        is not known for sure, by the time its chunk comes (:meth:`reader`)."""
        if event.state is None:
            return
        key = (event.tenant, event.device_id)
        if key in self._to_read:
            return
        if key in self._reading:
            if self._sole_writer:
                return
            # In a share group the read under way may be used up by a chunk
            # before this event's: read again for it.
        else:
            entry = self._newest.peek(key)
            if entry is not None and entry.sure:
                return
        if len(self._to_read) + len(self._reading) >= self._ahead_max:
            self._stats.newest_read_ahead_skipped += 1  # its chunk reads it
            return
        self._to_read[key] = None
        self._wake.set()

    async def reader(self) -> None:
        """The read-ahead task: reads what :meth:`read_ahead` asks for, all
        that is asked at once, one round at a time; runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            keys = list(self._to_read)
            self._to_read.clear()
            self._stats.newest_read_ahead += len(keys)
            await self._read_marked(keys)

    async def _read_marked(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], _Newest]:
        """:meth:`_read_newest`, with the keys marked as being read meanwhile
        (a chunk that needs one waits for this read instead of reading again)."""
        done = asyncio.get_running_loop().create_future()
        mine = [key for key in keys if key not in self._reading]
        for key in mine:
            self._reading[key] = done
        try:
            return await self._read_newest(keys)
        finally:
            for key in mine:
                del self._reading[key]
            # Waiters check for themselves: a failed read leaves the devices
            # unsure, and their chunk reads them.
            done.set_result(None)

    async def prepare_chunk(self, events: list[Event], over_ids: set[int]) -> set[int]:
        """After :meth:`over_budget`: the ids of events whose latest-table
        writes must be skipped (older than the device's newest write; module
        docstring). Reads the newest write of devices not known for sure.

        The chunk holds its devices' entries itself (``held``) across its
        waits: meanwhile the read-ahead of the events queued behind it puts
        up to a queue's worth of devices into the cache, which may evict
        them (a cache smaller than a chunk plus the queue: the chunk then
        took its devices for unknown and wrote their late events).

        In a share group the chunk uses up what it read: its devices are no
        longer sure once it is prepared, and the next chunk of each reads it
        again (another member may have written it meanwhile)."""
        stale: set[int] = set()
        held: dict[tuple[str, str], _Newest] = {}
        to_read: dict[tuple[str, str], None] = {}
        for event in events:
            if event.state is None or id(event) in over_ids:
                continue
            key = (event.tenant, event.device_id)
            entry = self._newest.peek(key)
            if entry is None or not entry.sure:
                to_read[key] = None
            else:
                held[key] = entry
        if to_read:
            reading = {self._reading[key] for key in to_read if key in self._reading}
            if reading:
                await asyncio.wait(reading)  # read ahead, not back yet
                for key in list(to_read):
                    entry = self._newest.peek(key)
                    if entry is not None and entry.sure:
                        held[key] = entry
                        del to_read[key]
            if to_read:
                # Not read ahead yet (still waiting for the reader, or past
                # its bound): read here, and take them off the reader's list.
                for key in to_read:
                    self._to_read.pop(key, None)
                held |= await self._read_marked(list(to_read))
        newest = self._newest
        for event in events:
            if event.state is None or id(event) in over_ids:
                continue
            key = (event.tenant, event.device_id)
            entry = held[key]
            if newest.get(key) is not entry:
                newest.put(key, entry)  # evicted while the chunk waited: back
            if (
                self._sole_writer
                and event.untimed_resent
                and entry.untimed
                and entry.write_ts >= event.write_ts
            ):
                # Behind timed writes only. After an untimed write the copy
                # goes just after it: the broker resends what was not
                # acknowledged in order, so it is newer than what was (probe:
                # the device stayed "on" after its "off" came back). Not to
                # its receive time: a timed event behind it in the resent
                # stream must still win. Not a retained copy: it may be
                # older than anything (test_a_retained_message_never_beats...).
                # Not in a share group: the untimed write may be another
                # member's, of a later event (its "off" written by one member,
                # then the "on" before it resent to another: the device ended
                # "on"; test_an_untimed_redelivery_in_a_share_group...).
                event.write_ts = entry.write_ts + 1
            # A newer write makes this one's latest writes moot at best, and
            # harmful when its deletes missed a state or were purged.
            if entry.write_ts == event.write_ts and entry.event_id:
                if event.event_id < entry.event_id:
                    stale.add(id(event))  # a tie lost: see below
                    self._stats.stale_latest += 1
                    continue
                if event.event_id > entry.event_id:
                    # Two events of the device with one write timestamp (a
                    # collision of the tie-break): the larger event id wins,
                    # whatever the order. The loser may be written already, and
                    # a tombstone wins a tie, so the winner goes one µs later.
                    event.write_ts += 1
                    self._stats.tie_breaks += 1
            if entry.write_ts > event.write_ts:
                stale.add(id(event))
                self._stats.stale_latest += 1
                continue
            if event.write_ts > entry.write_ts:
                entry.write_ts, entry.event_id = event.write_ts, event.event_id
                entry.untimed = event.ts_from_receive
        if not self._sole_writer:
            # Used up (see above); writes() still keeps the entry's `written`.
            # The devices of over-budget events too: a read made for them is
            # as old as their chunk by the time the device's next event comes.
            for event in events:
                entry = self._newest.peek((event.tenant, event.device_id))
                if entry is not None:
                    entry.sure = False
        return stale

    async def _read_newest(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], _Newest]:
        """The newest state-bearing write of these devices, for sure: Cassandra's,
        merged with what this process has written since; their entries."""
        self._stats.newest_reads += len(keys)
        newest = self._newest_state
        stored = await self._requests.read_keys(keys, lambda prefix: (newest, prefix), "device_id")
        read: dict[tuple[str, str], _Newest] = {}
        for key in keys:
            entry = self._newest.peek(key)
            row = stored.get(key, {})
            found = row.get("wt")
            if found is not None:
                wt = int(found)
                # Its event id settles a tie (prepare_chunk); 0 (unknown) for
                # a row written before the column existed.
                event_id = row.get("state_event_id") or 0
                untimed = bool(row.get("state_untimed"))  # null (older rows): timed
                if entry is None:
                    entry = _Newest(wt, True, event_id, untimed=untimed)
                elif wt > entry.write_ts:
                    # Someone else's write, newer than this process's: forget
                    # what this process wrote (its event and its deletes).
                    entry.write_ts, entry.event_id, entry.written = wt, event_id, None
                    entry.untimed = untimed
            elif entry is None:
                entry = _Newest(-1, True)  # nothing stored, nothing seen yet
            entry.sure = True
            self._newest.put(key, entry)
            read[key] = entry
        return read

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        tenant, device = event.tenant, event.device_id
        ts = event.write_ts
        out = [
            Write(
                ("device", tenant, device),
                self._insert_device,
                (
                    tenant,
                    device,
                    event.state if event.state is not None else UNSET,
                    event.event_id if event.state is not None else UNSET,
                    event.ts_from_receive if event.state is not None else UNSET,
                    event.ts_ms,
                    event.value_text,
                    event.value_num,
                    event.metrics,
                    event.tags,
                    ts,
                ),
                pending,
            )
        ]
        if event.state is None:
            return out
        tenant_states = self._tenants.peek(tenant)
        # prepare_chunk loaded it, and a chunk (pipeline.batch_max_events) holds
        # fewer tenants than MAX_TENANTS, so it cannot have been evicted since.
        assert tenant_states is not None
        if tenant_states.missed:
            self._send_missed(tenant, tenant_states, pending, out)
        bucket = state_bucket(device, tenant_states.buckets)
        hashed = device_hash(device)
        part = self._part(tenant_states, event.state, bucket)
        value = state_value(event.value_text, event.value_num)
        for gen in part.gens():
            out.append(
                Write(
                    ("state", tenant, event.state, bucket, gen),
                    self._insert_state,
                    (
                        tenant,
                        event.state,
                        bucket,
                        gen,
                        hashed,
                        device,
                        event.ts_ms,
                        value,
                        event.tags,
                        ts,
                    ),
                    pending,
                )
            )
        entry = self._newest.peek((tenant, device))
        previous: str | None = None
        # In a share group prepare_chunk has just used the entry up (no
        # longer sure): what it holds is still this chunk's.
        if entry is not None and (entry.sure or not self._sole_writer):
            entry.written_ts = ts
            if entry.written == event.state and self._sole_writer:
                # Same state as this process's last write for the device, whose
                # deletes cover every other state: nothing to delete again.
                self._stats.deletes_saved += 1
                return out
            previous, entry.written = entry.written, event.state
        if previous != event.state:
            part.live += 1
        for other in tenant_states.states:
            if other != event.state:
                self._delete(
                    tenant_states,
                    (tenant, other, bucket),
                    hashed,
                    device,
                    ts,
                    pending,
                    out,
                    leaving=other == previous,
                )
        return out

    def _delete(
        self,
        tenant_states: _TenantStates,
        key: PartKey,
        hashed: int,
        device: str,
        ts: int,
        pending: Pending,
        out: list[Write],
        *,
        leaving: bool = False,
    ) -> None:
        """The delete of ``device`` from a state partition as of ``ts``, into
        every generation written (``out``), counted towards its rotation;
        ``leaving``: the device was in it, by this process's last write."""
        tenant, state, bucket = key
        part = self._part(tenant_states, state, bucket)
        if leaving:
            part.live -= 1
        part.deletes += 1
        self.check_due(key, part)
        for gen in part.gens():
            out.append(
                Write(
                    ("state", tenant, state, bucket, gen),
                    self._delete_state,
                    (ts, tenant, state, bucket, gen, hashed, device),
                    pending,
                )
            )

    def _send_missed(
        self, tenant: str, tenant_states: _TenantStates, pending: Pending, out: list[Write]
    ) -> None:
        """Up to MISSED_PER_WRITE of the deletes a learnt state missed
        (:meth:`_missed`), into ``out``: one event's acknowledgement waits for
        them, not for thousands."""
        sending = tenant_states.missed[:MISSED_PER_WRITE]
        del tenant_states.missed[:MISSED_PER_WRITE]
        for state, device, ts in sending:
            key = (tenant, state, state_bucket(device, tenant_states.buckets))
            self._delete(tenant_states, key, device_hash(device), device, ts, pending, out)
        self._stats.missed_deletes += len(sending)

    async def _missed(self, tenant: str, known: _TenantStates, learnt: list[str]) -> None:
        """Queue the deletes that ``learnt`` states, registered by another
        instance since this process last read the tenant's states, missed.

        Their partitions are read (at most MISSED_READ_ROWS rows each; a new
        state holds few), and a row goes when this process's latest write of
        its device is into another state and newer than the row: the deletes
        of that write did not cover a state it did not know, or were skipped
        as the device's last write here was in the same state. As of that
        write, so a newer write into the state stands."""
        reads = [
            (state, bucket, gen)
            for state in learnt
            for bucket in range(known.buckets)
            for gen in self._part(known, state, bucket).gens()
        ]
        try:
            found = await gather_all(
                *(
                    # In a slot: a tenant of many buckets reads as many partitions.
                    self._requests.execute_in_slot(
                        self._select_state_rows, (tenant, state, bucket, gen, MISSED_READ_ROWS)
                    )
                    for state, bucket, gen in reads
                )
            )
        except Exception as exc:
            # The states are learnt already: failing here would fail the
            # chunk, and its retry would not see them as new again.
            log.warning(
                "tenant %r: could not read state(s) %s for the deletes this instance "
                "missed (%s); a page read of each repairs what is left",
                tenant,
                ", ".join(repr(s) for s in learnt),
                exc,
            )
            return
        queued = len(known.missed)
        for (state, _, _), rows in zip(reads, found, strict=True):
            for row in rows:
                entry = self._newest.peek((tenant, row["device_id"]))
                if (
                    entry is not None
                    and entry.written is not None
                    and entry.written != state
                    and entry.written_ts > (row["wt"] or 0)
                ):
                    known.missed.append((state, row["device_id"], entry.written_ts))
        if len(known.missed) > queued:
            log.info(
                "tenant %r: learnt state(s) %s from another instance; deleting %d of its rows "
                "older than this instance's writes of their devices",
                tenant,
                ", ".join(repr(s) for s in learnt),
                len(known.missed) - queued,
            )

    @staticmethod
    def _part(tenant_states: _TenantStates, state: str, bucket: int) -> Part:
        part = tenant_states.parts.get((state, bucket))
        if part is None:
            part = tenant_states.parts[(state, bucket)] = Part()
        return part

    def check_due(self, key: PartKey, part: Part) -> None:
        """Mark the partition due for a rotation once enough devices left it."""
        if self._rotate_after and part.deletes >= max(self._rotate_after, part.live // 2):
            self.due[key] = None

    def part(self, key: PartKey) -> Part | None:
        """What this process knows of a partition (None: its tenant is not cached)."""
        tenant, state, bucket = key
        known = self._tenants.peek(tenant)
        return None if known is None else self._part(known, state, bucket)

    async def _known(self, tenant: str, *, fresh: bool = False) -> _TenantStates:
        known = self._tenants.get(tenant)
        if known is not None and not fresh and time.monotonic() - known.loaded_at < self._refresh:
            return known
        rows, parts = await gather_all(
            self._requests.execute(self._select_states, (tenant,)),
            self._requests.execute(self._select_parts, (tenant,)),
        )
        # A tenant with state_buckets recorded and no state yet: one row, state null.
        states = {r["state"]: stored_ms(r["registered_at"]) for r in rows if r["state"]}
        learnt: list[str] = []
        if known is not None:
            learnt = [state for state in states if state not in known.states]
            known.states.update(states)
            known.loaded_at = time.monotonic()
        else:
            recorded = rows[0]["state_buckets"] if rows else None
            known = _TenantStates(states, await self._buckets(tenant, recorded))
            self._tenants.put(tenant, known)
        for row in parts:
            self._learn(tenant, known, row)
        if learnt:
            await self._missed(tenant, known, learnt)  # its generations are known now
        return known

    async def _buckets(self, tenant: str, recorded: int | None) -> int:
        """The tenant's state_buckets: as recorded, else this config's, recorded
        now (compare-and-set: another instance may record it first)."""
        mine = self._config.tenant(tenant).state_buckets
        if recorded is None:
            rows = await self._requests.execute(self._record_buckets, (mine, tenant))
            if rows[0]["[applied]"]:
                return mine
            recorded = int(rows[0]["state_buckets"])
        if recorded != mine:  # once per load into the tenant cache
            log.warning(
                "tenant %r: its devices are in %d state buckets (recorded in Cassandra "
                "by the gateway that first wrote it), tenants.%s.state_buckets here is %d: "
                "using %d; set it to %d to match",
                tenant,
                recorded,
                tenant,
                mine,
                recorded,
                recorded,
            )
        return recorded

    def _learn(self, tenant: str, known: _TenantStates, row: dict[str, Any]) -> None:
        """Merge a state_partitions row into what this process knows: Cassandra
        is the truth, and generations only go up."""
        part = self._part(known, row["state"], row["bucket"])
        gen, next_gen = row["gen"] or 0, row["next_gen"]
        if gen > part.gen:
            part.gen, part.next_gen, part.deletes = gen, next_gen, 0
            part.live = row["live"] or 0
        elif gen == part.gen and next_gen is not None:
            part.next_gen = next_gen
        part.rotating_since = row["rotating_since"] if part.next_gen is not None else None
        part.retired_gen = row["retired_gen"]
        if part.next_gen is not None or part.retired_gen is not None:
            self.due[(tenant, row["state"], row["bucket"])] = None

    async def _register_state(self, tenant: str, state: str, known: _TenantStates) -> None:
        if len(known.states) >= self._max_states:
            return  # over the budget: its events are rejected (prepare_chunk)
        now_ms = int(time.time() * 1000)
        rows = await self._requests.execute(self._register, (tenant, state, now_ms))
        applied = rows[0]
        # Lightweight transaction: another instance may have registered it first.
        registered = now_ms if applied["[applied]"] else stored_ms(applied["registered_at"])
        known.states[state] = registered
        self._stats.states_registered += 1
        log.info(
            "tenant %r: new state %r (the tenant now has %d)", tenant, state, len(known.states)
        )


def stored_ms(value: object) -> int:
    """A read-back timestamp as epoch ms; 0 when there is none."""
    return epoch_ms(value) if isinstance(value, datetime) else 0
