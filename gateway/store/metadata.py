"""Metadata on ingest: the metric names, tag keys and tag values a tenant's
devices use, and which devices carry a tag value (schema/006_metadata.cql;
the tsdb-cassandra README's metadata tables).

Off the write loop's path: for each event the pipeline asks
:meth:`Metadata.writes_now` for its rows. Where every entry is decided already
(remembered as stored, or its tenant known to be at the cap) they come at
once. Otherwise the event is *held* (:meth:`hold`: its :class:`Pending` keeps
one more count, so it is not acknowledged) and the metadata worker
(:meth:`run`, a task of the write loop) decides its entries with Cassandra's
answers, writes the new ones and then lets it go. The write loop goes on with
the next chunk meanwhile: over a slow link, a chunk of devices met for the
first time costs it the newest-write reads only, not those and then the
entry count's compare-and-set in turn. The worker takes held events in
order, every chunk queued at once (one decision for them all); at most
BACKLOG_CHUNKS chunks wait, beyond that the write loop waits for room
(``metadata_backlog_waits``). Promises:

* Written once per new entry: every entry known to be stored is remembered
  in an LRU of ``metadata.cache_size``; an entry seen again costs nothing.
  So is, per device, the set of entries of its last event if all were
  stored (another LRU of that size): an event with the same set is done
  without looking at each entry.
  Those not in the LRU (new, forgotten, or stored before a restart) are
  looked up (``metadata_reads`` counts them) with one read per partition and
  chunk, ``clustering IN (...)`` of up to 100 of them (``Requests.read_keys``;
  at most the in-flight limit of such reads at once): a chunk of 500 new devices sharing a few tag
  values costs a few reads, not a thousand, which over a slow link had cost
  several round trips per chunk. An entry found is remembered, neither
  written nor counted.
* Capped per tenant, durably and across instances: ``meta_entry_counts``
  (schema/007_metadata_counts.cql) holds each tenant's count of entries
  taken. For a chunk's new entries the gateway moves it from N to
  N + min(new, cap - N) in one lightweight transaction (``IF reserved = N``,
  reservations.py; ``metadata_reservations`` counts the attempts), awaited before any of them
  is written; those are written, the rest are not (``metadata.max_per_tenant``;
  metric names and tag keys go before tag values and devices). An instance
  that loses the race learns the count from the answer and tries again, up
  to ``reservations.MAX_ATTEMPTS`` times per chunk: instances never together pass the cap,
  and none starves another. Entries not written are counted
  (``metadata_capped``, per tenant too) and the tenant is named in the log,
  once; the event itself is stored as usual. A device's event whose entries
  are all decided, written or refused, is remembered as its shape (above),
  so its next events of that shape count nothing again.
* A tenant found at the cap is remembered (its count, in an LRU of
  ``reservations.MAX_TENANTS``): from then on its entries not in the LRU above cost no reads,
  and are counted as capped whether or not an earlier run stored them (no
  read tells them apart). A forgotten tenant costs reads again, until its
  count is seen; a tenant reset by an operator (its rows and its count
  deleted) is seen as such by each instance once it restarts.
* The count errs on the side of fewer entries, never more: it may run above
  what the tables hold, never below. A transaction retried after a timeout
  it had in fact applied counts twice; two instances that both find an entry
  absent both count it (and write the same row); a crash between the count
  and the rows leaves entries counted but not written. Entries written before
  the count existed (before this table) are not counted.
* Written with the event's other rows, before its acknowledgement; the
  values are those of stored events (decode validated them), sampled-out
  events included, since they say what devices use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from ..aio import gather_all
from ..config import Config
from ..event import Event
from ..lru import LRU, K, V
from ..stats import Cache, Stats
from .requests import Requests
from .reservations import MAX_TENANTS, Reservations
from .rollups import VALUE_METRIC
from .sink import Pending, Sink, Write
from .write_session import Prepared, WriteSession

log = logging.getLogger(__name__)

# Chunks of held events waiting for the worker; the write loop waits beyond.
BACKLOG_CHUNKS = 8

# An entry: (kind, tenant, *rest). Its row's values are entry[1:], its
# partition key entry[1:-1]. Kinds: metric name, tag key, tag value, device.
Entry = tuple[str, ...]
# Held events: each with the Pending its metadata rows (if any) go with.
Held = list[tuple[Event, Pending]]
# When the cap lets only part of a chunk's new entries in: names and keys first.
_PRIORITY = {"m": 0, "k": 1, "v": 2, "d": 3}


def entries(event: Event) -> Iterator[Entry]:
    """The metadata entries an event carries."""
    tenant = event.tenant
    if event.value_num is not None:
        yield ("m", tenant, VALUE_METRIC)
    for metric in event.metrics:
        yield ("m", tenant, metric)
    for key, value in event.tags.items():
        yield ("k", tenant, key)
        yield ("v", tenant, key, value)
        yield ("d", tenant, key, value, event.device_id)


class Metadata:
    _insert: dict[str, Prepared]
    _exists: dict[str, Prepared]

    def __init__(self, requests: Requests, sink: Sink, config: Config, stats: Stats) -> None:
        self._requests = requests
        self._sink = sink
        self._stats = stats
        self._backlog: asyncio.Queue[Held | None] = asyncio.Queue(BACKLOG_CHUNKS)
        self._working = False
        self._stopped = asyncio.Event()
        self._seen: LRU[Entry, bool] = LRU(config.metadata.cache_size)
        # Per device, the entries of an event whose every entry was known
        # stored: whether it had a value, its metric names, its tags. Most
        # devices send the same ones every time, and comparing them costs
        # less than looking up each entry (an LRU of the same size; one
        # forgotten costs those lookups again).
        self._shapes: LRU[tuple[str, str], tuple[bool, frozenset[str], dict[str, str]]] = LRU(
            config.metadata.cache_size
        )
        # Each tenant's count (reservations.py): whether the tenant is at its
        # cap (counts never go down).
        self._counts = Reservations(
            requests, "meta_entry_counts", "reserved", self._count_attempt, self._count_evicted
        )
        self._cap = config.metadata.max_per_tenant
        # Tenants this process has said are at the cap (once each, while remembered).
        self._said_capped: LRU[str, bool] = LRU(MAX_TENANTS)

    def caches(self) -> dict[str, Cache]:
        """Its bounded caches, by name, for the metrics (gateway_cache_*)."""
        return {
            "metadata_entries": self._seen,
            "metadata_shapes": self._shapes,
            "metadata_counts": self._counts.cache,
        }

    async def prepare(self, session: WriteSession) -> None:
        tables = {
            "m": ("meta_metrics", ("tenant", "metric")),
            "k": ("meta_tag_keys", ("tenant", "tag_key")),
            "v": ("meta_tag_values", ("tenant", "tag_key", "tag_value")),
            "d": ("meta_tag_devices", ("tenant", "tag_key", "tag_value", "device_id")),
        }
        # Together: each is a round trip, a second or more over a slow link.
        kinds = list(tables)
        async with asyncio.TaskGroup() as group:
            statements = group.create_task(
                gather_all(
                    *(
                        session.prepare(
                            f"INSERT INTO {{keyspace}}.{table} ({', '.join(columns)}) "
                            f"VALUES ({', '.join('?' for _ in columns)})"
                        )
                        for table, columns in tables.values()
                    ),
                    *(
                        session.prepare(
                            f"SELECT {columns[-1]} AS found FROM {{keyspace}}.{table} WHERE "
                            + " AND ".join(f"{c} = ?" for c in columns[:-1])
                            + f" AND {columns[-1]} IN ?"
                        )
                        for table, columns in tables.values()
                    ),
                )
            )
            group.create_task(self._counts.prepare(session))
        prepared = statements.result()
        self._insert = dict(zip(kinds, prepared[: len(kinds)], strict=True))
        self._exists = dict(zip(kinds, prepared[len(kinds) :], strict=True))

    def _count_attempt(self) -> None:
        self._stats.metadata_reservations += 1

    def _count_evicted(self) -> None:
        self._stats.metadata_cache_evictions += 1

    def writes_now(self, event: Event, pending: Pending) -> list[Write] | None:
        """The rows of the event's new entries if each of its entries is
        decided without asking Cassandra: remembered as stored, or its tenant
        known to be at the cap. None if not: the event is held, its pending
        has one more count (so none of its other writes can complete it) until
        the worker is done with it; hand it to :meth:`hold` with its chunk."""
        device = (event.tenant, event.device_id)
        shape = self._shapes.get(device)
        has_value = event.value_num is not None
        if (
            shape is not None
            and shape[0] == has_value
            and shape[2] == event.tags
            and event.metrics.keys() == shape[1]
        ):
            return []  # the same entries as the device's last event: stored
        seen = self._seen
        capped: dict[Entry, bool] = {}
        for entry in entries(event):
            if seen.touch(entry):
                continue  # stored already
            if not self._at_cap(entry[1]):
                pending.add()
                return None
            capped[entry] = False
        if capped:
            return self._rows(event, pending, capped)
        self._remember_shape(event)
        return []

    def _remember_shape(self, event: Event) -> None:
        """Remember the entries of an event whose every entry is decided:
        stored, or refused by a cap that never goes down. So is the next event
        of the same shape: without this a tenant at its cap had each such
        event's refused entries (and stored ones the LRU forgot) counted as
        capped again, for good."""
        shape = (event.value_num is not None, frozenset(event.metrics), event.tags)
        self._remember(self._shapes, (event.tenant, event.device_id), shape)

    def _remember(self, cache: LRU[K, V], key: K, value: V) -> None:
        """Put, counting what the cache's bound pushes out (an entry forgotten
        is looked up, and written if missing, when seen again)."""
        if cache.put(key, value) is not None:
            self._stats.metadata_cache_evictions += 1

    def _at_cap(self, tenant: str) -> bool:
        """Whether the tenant is known to have reached metadata.max_per_tenant."""
        seen = self._counts.known(tenant)
        return seen is not None and seen >= self._cap

    async def hold(self, held: Held) -> None:
        """Hand events that :meth:`writes_now` held to the worker, which gives
        back their extra count once their rows are submitted. Call it after
        the events' other writes were submitted (so each pending counts them)."""
        if not held:
            return
        if self._backlog.full():
            self._stats.metadata_backlog_waits += 1
        self._stats.metadata_held += len(held)
        await self._backlog.put(held)

    @property
    def idle(self) -> bool:
        """No event held."""
        return self._backlog.empty() and not self._working

    async def run(self) -> None:
        """The worker: decide and write the held events' entries, in the order
        they were held, until :meth:`close`."""
        backlog = self._backlog
        taken: Held | None = []
        while taken is not None:
            # Every chunk held so far, up to close()'s None.
            taken = await backlog.get()
            held: Held = []
            while taken is not None:
                held += taken
                if backlog.empty():
                    break
                taken = backlog.get_nowait()
            if not held:
                continue
            self._working = True
            decisions = await self._decide([event for event, _ in held])
            writes: list[Write] = []
            for event, pending in held:
                writes += self._rows(event, pending, decisions)
            await self._sink.submit(writes)
            for _, pending in held:
                pending.finish_one()  # the hold; its rows (if any) keep it pending
            self._working = False
        self._stopped.set()

    async def close(self) -> None:
        """Let the worker finish what is held (its rows submitted), then stop it."""
        await self._backlog.put(None)
        await self._stopped.wait()

    async def _decide(self, events: list[Event]) -> dict[Entry, bool]:
        """For the entries of these events not in the LRU: which are new and
        which of those the tenants' caps allow (True to write, False capped)."""
        chunk: dict[Entry, bool] = {}
        unknown: dict[Entry, None] = {}
        seen = self._seen
        for event in events:
            for entry in entries(event):
                if entry in seen or entry in chunk or entry in unknown:
                    continue
                if self._at_cap(entry[1]):
                    chunk[entry] = False
                else:
                    unknown[entry] = None
        if unknown:
            new: dict[str, list[Entry]] = {}
            for entry in await self._absent(list(unknown)):
                new.setdefault(entry[1], []).append(entry)
            await asyncio.gather(
                *(self._reserve(tenant, wanted, chunk) for tenant, wanted in new.items())
            )
        return chunk

    async def _absent(self, wanted: list[Entry]) -> list[Entry]:
        """The entries whose rows are not in Cassandra; the others are remembered."""
        self._stats.metadata_reads += len(wanted)
        exists = self._exists
        present = await self._requests.read_keys(
            wanted, lambda prefix: (exists[prefix[0]], prefix[1:]), "found", in_slot=True
        )
        absent: list[Entry] = []
        for entry in wanted:
            if entry in present:
                self._remember(self._seen, entry, True)
            else:
                absent.append(entry)
        return absent

    async def _reserve(self, tenant: str, wanted: list[Entry], chunk: dict[Entry, bool]) -> None:
        """Take the tenant's count up by the entries that fit under the cap:
        those are to be written (names and keys first), the rest are capped."""
        granted = (await self._counts.reserve(tenant, len(wanted), self._cap)).granted
        wanted.sort(key=lambda e: _PRIORITY[e[0]])
        for index, entry in enumerate(wanted):
            chunk[entry] = index < granted

    def _rows(self, event: Event, pending: Pending, chunk: dict[Entry, bool]) -> list[Write]:
        """The rows of the event's entries that ``chunk`` (the decisions) lets in."""
        out: list[Write] = []
        seen, stats = self._seen, self._stats
        decided = True
        for entry in entries(event):
            verdict = chunk.get(entry)
            if verdict is None:
                seen.touch(entry)  # stored already (or written earlier in this chunk)
            elif verdict:
                del chunk[entry]
                self._remember(seen, entry, True)
                stats.metadata_writes += 1
                kind, values = entry[0], entry[1:]
                out.append(Write(("meta", kind, *values[:-1]), self._insert[kind], values, pending))
            else:
                stats.metadata_capped += 1
                stats.metadata_capped_by_tenant.add(entry[1])
                if self._at_cap(entry[1]):
                    self._say_capped(entry[1])
                else:
                    # Not the cap: reservations lost to other instances, every
                    # try (Reservations.MAX_ATTEMPTS). Tried again next time.
                    decided = False
        if decided:
            self._remember_shape(event)
        return out

    def _say_capped(self, tenant: str) -> None:
        """Log, once per tenant, that it reached the cap: its lists go
        incomplete from then on, which nothing else would tell."""
        if self._said_capped.touch(tenant):
            return
        self._said_capped.put(tenant, True)
        log.warning(
            "metadata: tenant %r is at metadata.max_per_tenant (%d entries): its new metric "
            "names, tag keys, tag values and devices by tag are no longer recorded, so its "
            "metadata lists are incomplete from now on (gateway_metadata_capped_total counts "
            "them; `gateway meta count` shows the count; its events are stored as usual)",
            tenant,
            self._cap,
        )
