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
* The one case the deletes cannot cover: an *old* event into state S arriving
  after a *newer* event of the same device was processed before S was known.
  For events older than S's registration (plus the allowed clock skew) the
  writer looks up the device's newest state-bearing write and, if it is newer
  and in another state, also deletes D from S at that newer timestamp. The
  lookup is an in-memory LRU of each device's newest write seen by this
  process (``pipeline.device_cache_size`` devices); only a device not seen
  since start-up costs one read of latest_events_by_device.
* Other gateway instances may register states; known states are re-read every
  ``pipeline.states_refresh`` seconds. Between two refreshes an instance can
  miss a brand-new state in its deletes (documented in the README).
* Events without a state update latest_events_by_device only (the device stays
  in the state partition it was in).
* The per-tenant cache of states holds at most MAX_TENANTS tenants (LRU); an
  evicted tenant is simply re-read.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from ..config import Config
from ..event import Event
from ..lru import LRU
from ..stats import Stats
from .requests import Requests
from .sink import Pending, Write
from .write_session import UNSET, Prepared, WriteSession

log = logging.getLogger(__name__)

MAX_TENANTS = 10_000


def state_bucket(device_id: str, buckets: int) -> int:
    """Stable across processes and versions (unlike hash())."""
    return zlib.crc32(device_id.encode()) % buckets if buckets > 1 else 0


@dataclass(slots=True)
class _TenantStates:
    states: dict[str, int]  # state -> registered_at (epoch ms)
    loaded_at: float = field(default_factory=time.monotonic)


class LatestState:
    _insert_state: Prepared
    _delete_state: Prepared
    _insert_device: Prepared
    _select_states: Prepared
    _register: Prepared
    _newest_state: Prepared

    def __init__(self, requests: Requests, config: Config, stats: Stats) -> None:
        self._requests = requests
        self._config = config
        self._stats = stats
        self._max_states = config.pipeline.max_states_per_tenant
        self._refresh = config.pipeline.states_refresh
        self._skew_ms = int(config.limits.max_future_skew * 1000)
        self._tenants: LRU[str, _TenantStates] = LRU(
            max(MAX_TENANTS, config.pipeline.batch_max_events)
        )
        self._newest: LRU[tuple[str, str], tuple[int, str]] = LRU(config.pipeline.device_cache_size)

    async def prepare(self, session: WriteSession) -> None:
        self._insert_state = await session.prepare(
            "INSERT INTO {keyspace}.latest_events_by_state "
            "(tenant, state, bucket, device_id, ts, value, value_num) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
            timestamps=(4,),
        )
        self._delete_state = await session.prepare(
            "DELETE FROM {keyspace}.latest_events_by_state USING TIMESTAMP ? "
            "WHERE tenant = ? AND state = ? AND bucket = ? AND device_id = ?"
        )
        self._insert_device = await session.prepare(
            "INSERT INTO {keyspace}.latest_events_by_device "
            "(tenant, device_id, state, ts, value, value_num, metrics, tags) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
            timestamps=(3,),
        )
        self._select_states = await session.prepare(
            "SELECT state, registered_at FROM {keyspace}.tenant_states WHERE tenant = ?"
        )
        self._register = await session.prepare(
            "INSERT INTO {keyspace}.tenant_states (tenant, state, registered_at) "
            "VALUES (?, ?, ?) IF NOT EXISTS",
            timestamps=(2,),
        )
        self._newest_state = await session.prepare(
            "SELECT state, WRITETIME(state) AS wt FROM {keyspace}.latest_events_by_device "
            "WHERE tenant = ? AND device_id = ?"
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

    async def register(self, states: list[tuple[str, str]]) -> None:
        """Record new states in tenant_states, within each tenant's budget."""
        for tenant, state in states:
            known = await self._known(tenant)
            if state not in known.states:
                await self._register_state(tenant, state, known)

    async def prepare_chunk(self, events: list[Event]) -> tuple[list[Event], dict[int, int]]:
        """After :meth:`register`: the events whose state is over the tenant's
        budget, and for late events the extra delete timestamps (by id(event))."""
        over: list[Event] = []
        extra: dict[int, int] = {}
        unknown: list[Event] = []
        for event in events:
            if event.state is None:
                continue
            known = await self._known(event.tenant)
            if event.state not in known.states:
                over.append(event)
                continue
            key = (event.tenant, event.device_id)
            newest = self._newest.get(key)
            if event.ts_ms < known.states[event.state] + self._skew_ms:
                # Possibly older than an event processed before this state was
                # known (module docstring). What this process has seen answers
                # it; a device not seen since start-up needs one read.
                if newest is None:
                    unknown.append(event)
                elif newest[0] > event.write_ts and newest[1] != event.state:
                    extra[id(event)] = newest[0]
            self._remember(key, event.write_ts, event.state, newest)
        if unknown:
            self._stats.late_state_checks += len(unknown)
            rows = await asyncio.gather(
                *(
                    self._requests.execute(self._newest_state, (e.tenant, e.device_id))
                    for e in unknown
                )
            )
            for event, found in zip(unknown, rows, strict=True):
                if found and found[0]["wt"] is not None:
                    newest_state, newest_ts = found[0]["state"], found[0]["wt"]
                    if newest_ts > event.write_ts and newest_state != event.state:
                        extra[id(event)] = newest_ts
                    key = (event.tenant, event.device_id)
                    self._remember(key, newest_ts, newest_state, self._newest.get(key))
        return over, extra

    def _remember(
        self, key: tuple[str, str], write_ts: int, state: str, current: tuple[int, str] | None
    ) -> None:
        """Newest state-bearing write per device seen by this process (bounded LRU)."""
        if current is None or write_ts > current[0]:
            self._newest.put(key, (write_ts, state))
        else:
            self._newest.touch(key)

    def writes(self, event: Event, pending: Pending, late_delete_ts: int | None) -> list[Write]:
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
        bucket = state_bucket(device, self._config.tenant(tenant).state_buckets)
        out.append(
            Write(
                ("state", tenant, event.state, bucket),
                self._insert_state,
                (
                    tenant,
                    event.state,
                    bucket,
                    device,
                    event.ts_ms,
                    event.value_text,
                    event.value_num,
                    ts,
                ),
                pending,
            )
        )
        tenant_states = self._tenants.peek(tenant)
        # prepare_chunk loaded it, and a chunk (pipeline.batch_max_events) holds
        # fewer tenants than MAX_TENANTS, so it cannot have been evicted since.
        assert tenant_states is not None
        known = tenant_states.states
        for other in known:
            if other != event.state:
                out.append(
                    Write(
                        ("state", tenant, other, bucket),
                        self._delete_state,
                        (ts, tenant, other, bucket, device),
                        pending,
                    )
                )
        if late_delete_ts is not None:
            out.append(
                Write(
                    ("state", tenant, event.state, bucket),
                    self._delete_state,
                    (late_delete_ts, tenant, event.state, bucket, device),
                    pending,
                )
            )
        return out

    async def _known(self, tenant: str) -> _TenantStates:
        known = self._tenants.get(tenant)
        if known is not None and time.monotonic() - known.loaded_at < self._refresh:
            return known
        rows = await self._requests.execute(self._select_states, (tenant,))
        states = {row["state"]: _epoch_ms(row["registered_at"]) for row in rows}
        if known is not None:
            known.states.update(states)
            known.loaded_at = time.monotonic()
        else:
            known = _TenantStates(states)
            self._tenants.put(tenant, known)
        return known

    async def _register_state(self, tenant: str, state: str, known: _TenantStates) -> bool:
        if len(known.states) >= self._max_states:
            return False
        now_ms = int(time.time() * 1000)
        rows = await self._requests.execute(self._register, (tenant, state, now_ms))
        applied = rows[0]
        # Lightweight transaction: another instance may have registered it first.
        registered = now_ms if applied["[applied]"] else _epoch_ms(applied["registered_at"])
        known.states[state] = registered
        self._stats.states_registered += 1
        log.info(
            "tenant %r: new state %r (the tenant now has %d)", tenant, state, len(known.states)
        )
        return True


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _epoch_ms(value: object) -> int:
    """A read-back timestamp (naive UTC from one driver, aware from the other)
    as epoch ms, exactly (float seconds * 1000 could truncate one short)."""
    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=UTC)
        return (aware - _EPOCH) // timedelta(milliseconds=1)
    return 0
