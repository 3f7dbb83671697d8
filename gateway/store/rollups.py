"""Roll-ups: 1-minute and 1-hour count/min/max/sum/last per device and numeric
metric (the event's ``value`` when numeric, as metric ``value``, and each
entry of ``metrics``; beside a numeric ``value``, ``metrics.value`` is not
rolled up), kept exact under shuffled, duplicated, late and
back-filled events.

How, and why this way (the tsdb-cassandra README's "re-write the window"):

* **Recompute, never increment.** A window an event touched is recomputed
  from the raw rows stored for it (``telemetry``, read exactly as ``gateway
  history`` reads it, de-duplicated by (ts, event_id)) and its row re-written
  whole. A redelivered copy is the same raw row, so it counts once; a late
  event makes its window dirty again and the re-write replaces the partial
  aggregate. Incrementing in memory would double-count redeliveries and lose
  whatever was open at a crash. The roll-up is therefore defined over the
  raw rows that are *stored*: events the sampler left out (``sampled_out``)
  are not in it.
* **Durable dirty marks.** With the raw row, in the same chunk and before the
  message is acknowledged, the pipeline writes a mark "window W of device D"
  into ``rollup_marks``, in the partition of the wall-clock minute the mark
  was written in (16 shards). So a SIGKILL after the ack loses nothing: the
  mark is in Cassandra. Partitions by writing minute, not by window, make
  back-fill and late data cost the same as fresh data, and keep the table
  append-only: marks are never deleted (no tombstones for the worker to
  read), they expire after 7 days.
* **One worker** (:class:`RollupWorker`, a task of the application object,
  on a write session of its own: the write path's driver, so acsylla where
  it is installed) at a time, of the instances with ``rollups.worker`` on:
  the one holding the lease (lease.py), the others standing by. It keeps a
  cursor in ``rollup_progress``: the first writing minute it has not
  finished. Once that minute is over plus ``rollups.grace`` it reads the
  minute's mark partitions, recomputes each marked 1-minute window, then each
  touched hour from its 1-minute rows (a merge: counts and sums add, min and
  max and the newest ``last`` carry over), and only then moves the cursor on.
  A minute's work is spread over ``rollups.spread`` (its groups evenly
  spaced): done in one burst, its reads of every raw row of the minute held
  up the ingest writes beside them for hundreds of milliseconds, once a
  minute. A minute found late (after a restart, or a pass that ran long) is
  spread over what is left before the next minute comes due, if that is
  less; once the next minute is due too (an outage), the worker goes at full
  speed. But while the write path is behind (half the broker's window of
  unacknowledged messages, or more than half the queue, waiting: a backlog
  drains after an outage; app.py, Gateway._behind), every minute is spread
  over ``rollups.spread`` however late it is, as one on time is, so the
  backlog keeps the CPU and Cassandra; the worker still gains on the clock
  (the spread is at most 50 s). ``rollup_paced_seconds_total`` counts the
  waiting.
  A crash (or a lost lease) in between repeats the minute when a worker
  next takes the lease, here or on another instance; recomputing twice
  writes the same rows. Marks left by an earlier run are picked up from the
  cursor.
* **Raw before mark.** The raw row and its mark are sent together; the
  worker reads a minute's marks ``grace`` after the minute ends, and it waits
  while Cassandra requests of this process are being retried (a raw write
  could then land after its mark), so the raw rows a mark stands for are
  there when the window is read.
* **Order between recomputations.** An aggregate is written with ``USING
  TIMESTAMP`` of the moment its raw read began: of two recomputations of a
  window (a repeat, another instance) the one that read later, and so saw at
  least as many rows, wins.

Bounds: the write side remembers marks it wrote (``rollups.mark_cache_size``
entries, LRU): one mark per (device, window, writing minute) at most, and at
the bound a forgotten mark is simply written again (idempotent, counted as
``rollup_mark_evictions``); nothing is held in memory that a crash would lose.
The worker holds one minute's marks at a time and recomputes their windows
GROUP (100) at a time (their raw rows in memory together, where 16 windows'
rows were before; the event loop yields every YIELD_ROWS rows it decodes or
aggregates): the reads go READ_IN devices to a request (``device_id IN
(...)``), and the rows written go PACK_WINDOWS windows to an UNLOGGED batch,
at most ``rollups.concurrency`` batches at once. Per window that is a few
hundredths of a read and about two tenths of a write, where it had been about
five requests of its own (6 to 8 ms of CPU per window through the Python
driver, the worker's cost for a device that sends once a minute). When it
falls behind, marks wait in Cassandra and ``rollup_lag_seconds`` grows. Sums
are ``math.fsum`` of the window's values (exactly rounded, whatever order the
rows come in); an hour's sum adds its minutes' sums. A sum beyond the range
of a double (values near 1e308 added up) is stored as null, its window's
count, min, max and last as usual (:func:`exact_sum`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from functools import partial
from typing import Any, TypeVar

import orjson
from mypy_extensions import mypyc_attr

from ..aio import all_or_none, backoff, gather_all
from ..config import MAX_BUCKET_SECONDS, Config
from ..event import Event
from ..lru import LRU
from ..stats import Cache, Stats
from ..units import duration_text
from . import queries
from .lease import Lease, LeaseLost
from .sink import Pending, Write
from .write_session import PACK_BYTES, YIELD_ROWS, Prepared, Rows, WriteSession

log = logging.getLogger(__name__)

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
MARK_SHARDS = 16
VALUE_METRIC = "value"
PROGRESS = queries.ROLLUP_PROGRESS
BEHIND_S = queries.ROLLUP_BEHIND_S
# Each read and write of the worker is tried this often on a transient error
# (a timeout, a node unavailable) before its pass fails, waiting between tries
# from REQUEST_BACKOFF (doubling, with jitter) up to REQUEST_BACKOFF_MAX
# seconds. A minute's work was all or nothing: over a flaky link, one timeout
# among its thousands of requests started the whole minute over, and a minute
# longer than the gaps between timeouts never finished.
REQUEST_ATTEMPTS = 5
REQUEST_BACKOFF = 0.5
REQUEST_BACKOFF_MAX = 8.0

T = TypeVar("T")
# A cursor starts at the minute the first instance to write marks (or the
# worker) started, never later: a compare-and-set, whoever comes first.
INIT_CURSOR = "INSERT INTO {keyspace}.rollup_progress (name, minute) VALUES (?, ?) IF NOT EXISTS"
# Windows the worker recomputes together (their raw rows are in memory at
# once: the bound on the worker's memory, GROUP windows' rows), and devices per
# read of theirs (device_id IN ...): 1,000 windows of one minute cost about 30
# reads, not 3,000.
GROUP = 100
READ_IN = 100
DAY_MS = 86_400_000
READ_AT_ONCE = 64  # a rebuild's partition reads at once
# The newest partition of each device in a range, and one device's oldest
# (RollupWorker.rebuild: which days to read).
REBUILD_NEWEST = (
    "SELECT device_id, toUnixTimestamp(bucket_start) AS bucket_ms "
    "FROM {keyspace}.telemetry_partitions "
    "WHERE tenant = ? AND device_id IN ? AND bucket_start <= ? AND bucket_start > ? "
    "PER PARTITION LIMIT 1"
)
REBUILD_OLDEST = (
    "SELECT toUnixTimestamp(bucket_start) AS bucket_ms FROM {keyspace}.telemetry_partitions "
    "WHERE tenant = ? AND device_id = ? AND bucket_start <= ? AND bucket_start > ? "
    "ORDER BY bucket_start ASC LIMIT 1"
)
# Windows (partitions) per written batch: Cassandra warns above 10 partitions
# or 5 KiB of mutations per batch. The mutations count about twice the bound
# values (expiring cells carry their TTL and deletion time): 30 rows of
# `make run`'s fleet, about 130 bytes of values each, made 7,056 bytes and a
# warning. So a batch carries at most PACK_BYTES of values (2 KiB), as the
# sink's do (write_session.PACK_BYTES).
PACK_WINDOWS = 10
# Seconds between two looks at the write path's backlog while the worker
# waits to start its next group (RollupWorker.recompute).
PACE_CHECK = 0.25
Window = tuple[str, str, int]  # (tenant, device_id, start in epoch ms)
RawRows = dict[tuple[int, int], tuple[float | None, dict[str, float]]]  # (ts, event_id) ->
_Bound = tuple[list[Any], int]  # a window's bound statements, and the bytes of their values


def _never() -> bool:
    return False


def _by_start_first(window: Window) -> tuple[str, int, str]:
    tenant, device_id, start = window
    return tenant, start, device_id


def mark_shard(tenant: str, device_id: str) -> int:
    return zlib.crc32(f"{tenant}/{device_id}".encode()) % MARK_SHARDS


def numeric_metrics(value: float | None, metrics: dict[str, float]) -> Iterable[tuple[str, float]]:
    """The (metric, value) pairs of one event that roll-ups keep: one per
    metric. A numeric top-level ``value`` is metric ``value``; a metric of that
    name beside it is left to the raw row (counting both made each such event
    count twice)."""
    if value is None:
        yield from metrics.items()
        return
    yield VALUE_METRIC, value
    for pair in metrics.items():
        if pair[0] != VALUE_METRIC:
            yield pair


class RollupMarks:
    """The write side: a durable mark per window an event touches."""

    _insert: Prepared

    def __init__(
        self,
        config: Config,
        stats: Stats,
        clock: Callable[[], float] = time.time,
        *,
        name: str = PROGRESS,
    ):
        self._stats = stats
        self._clock = clock
        self._name = name
        self._written: LRU[tuple[str, str, int, int], bool] = LRU(config.rollups.mark_cache_size)

    def caches(self) -> dict[str, Cache]:
        """Its bounded cache, for the metrics (gateway_cache_*)."""
        return {"rollup_marks_written": self._written}

    async def prepare(self, session: WriteSession) -> None:
        """Prepare, and start the worker's cursor at this minute unless it has
        one: this instance's marks are never older than the cursor, whether or
        not it runs the worker, and whenever the worker starts."""
        self._insert = await session.prepare(
            "INSERT INTO {keyspace}.rollup_marks "
            "(minute, shard, tenant, device_id, window_start) VALUES (?, ?, ?, ?, ?)",
            timestamps=(0, 4),
        )
        init = await session.prepare(INIT_CURSOR, timestamps=(1,))
        now_ms = int(self._clock() * 1000)
        await session.execute(session.bind(init, (self._name, now_ms - now_ms % MINUTE_MS)))

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        if event.value_num is None and not event.metrics:
            return []
        now_ms = int(self._clock() * 1000)
        # The minute the mark is written in (not the event's): the worker
        # reads minutes in order, so a back-filled window is found as soon
        # as a fresh one.
        minute = now_ms - now_ms % MINUTE_MS
        window = event.ts_ms - event.ts_ms % MINUTE_MS
        key = (event.tenant, event.device_id, window, minute)
        written = self._written
        if written.touch(key):
            return []
        evictions = written.evictions
        written.put(key, True)
        self._stats.rollup_mark_evictions += written.evictions - evictions
        self._stats.rollup_marks += 1
        shard = mark_shard(event.tenant, event.device_id)
        return [
            Write(
                ("rollup_marks", minute, shard),
                self._insert,
                (minute, shard, event.tenant, event.device_id, window),
                pending,
            )
        ]


@dataclass(slots=True)
class Aggregate:
    count: int
    min: float
    max: float
    sum: float | None  # None: beyond the range of a double
    last: float
    last_ts: int  # epoch ms of the newest raw row
    last_id: int  # its event id (ties in ts go to the larger)


def aggregate(samples: list[tuple[int, int, float]]) -> Aggregate:
    """(ts ms, event id, value) samples, in any order, to their aggregate."""
    values = [v for _, _, v in samples]
    last_ts, last_id, last = max(samples)
    total = exact_sum(values)
    return Aggregate(len(values), min(values), max(values), total, last, last_ts, last_id)


def exact_sum(values: list[float]) -> float | None:
    """The exactly rounded sum of finite values, whatever their order; None
    when it is beyond the range of a double. (``math.fsum`` alone raised
    OverflowError when a partial sum passed it, even for a sum that fits: a
    device sending values near 1e308 stopped every roll-up, for good.) None
    too when a value is not finite: the decoder refuses them, but a row
    written by another program may hold one, and ``inf`` with ``-inf`` made
    ``math.fsum`` raise ValueError, which stopped the worker at that minute."""
    if not all(map(math.isfinite, values)):
        return None
    try:
        return math.fsum(values)
    except OverflowError:
        exact = sum(map(Fraction, values), Fraction(0))
        try:
            return float(exact)
        except OverflowError:
            return None


def merge(parts: list[Aggregate]) -> Aggregate:
    newest = max(parts, key=lambda a: (a.last_ts, a.last_id))
    return Aggregate(
        sum(a.count for a in parts),
        min(a.min for a in parts),
        max(a.max for a in parts),
        _sum_of_sums([a.sum for a in parts]),
        newest.last,
        newest.last_ts,
        newest.last_id,
    )


def _sum_of_sums(sums: list[float | None]) -> float | None:
    known = [s for s in sums if s is not None]
    return exact_sum(known) if len(known) == len(sums) else None


def _by_start(
    windows: Mapping[Window, Iterable[str]],
) -> tuple[dict[tuple[str, int], list[str]], dict[tuple[str, int], set[str]]]:
    """Windows (with their metrics) grouped for reads ``device_id IN (...)``:
    the devices of each (tenant, start), and the metrics asked of them."""
    devices: dict[tuple[str, int], list[str]] = {}
    metrics_of: dict[tuple[str, int], set[str]] = {}
    for (tenant, device, start), metrics in windows.items():
        devices.setdefault((tenant, start), []).append(device)
        metrics_of.setdefault((tenant, start), set()).update(metrics)
    return devices, metrics_of


# Compiled (setup.py) and still open to subclasses: tests/test_rollups.py
# watches catch_up's pacing through one.
@mypyc_attr(allow_interpreted_subclasses=True)
class RollupWorker:
    """Recomputes the windows the marks name, minute by minute (module docstring)."""

    def __init__(
        self,
        session: WriteSession,
        config: Config,
        stats: Stats,
        *,
        name: str = PROGRESS,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._session = session
        self._config = config
        self._stats = stats
        self._name = name
        self._clock = clock
        self._grace_ms = int(config.rollups.grace * 1000)
        self._interval = config.rollups.interval
        self._slots = asyncio.Semaphore(config.rollups.concurrency)
        self._spread = config.rollups.spread
        # Whether the write path is behind (the application object sets
        # Gateway._behind): while it is, every minute is spread over
        # rollups.spread (module docstring).
        self.backlogged: Callable[[], bool] = _never
        self._cursor = 0
        self._retries_seen = stats.retries
        self._quiet_since = time.monotonic()
        self._behind = False  # said to be BEHIND_S behind, not yet caught up
        self._failing = False  # a pass failed and none has worked since
        self._ready = False
        self._lease = Lease(
            session, name, holder or config.mqtt.client_id, config.rollups.lease, what="roll-ups"
        )

    async def start(self, first_minute_ms: int | None = None) -> None:
        """Prepare, and read the cursor (a new one starts at this minute, or at
        ``first_minute_ms``; no mark can be older than that); it is read again
        each time this instance takes the worker's lease (run). An instance that
        writes marks starts it too (RollupMarks.prepare), so the worker of one
        instance started after another finds the other's first marks."""
        grace, timeout = self._config.rollups.grace, self._config.cassandra.request_timeout
        if grace <= timeout:
            log.warning(
                "roll-ups: rollups.grace (%s) is not above cassandra.request_timeout (%s): a "
                "mark answered later than the grace lands behind the worker, and its window "
                "is never recomputed; set the grace above the timeout",
                duration_text(grace),
                duration_text(timeout),
            )
        await self.prepare()
        now_ms = int(self._clock() * 1000)
        first = first_minute_ms if first_minute_ms is not None else now_ms - now_ms % MINUTE_MS
        await self._execute(self._init_cursor, (self._name, first))
        rows = await self._session.read(self._read_cursor, (self._name,))
        self._cursor = rows[0]["minute_ms"]
        self._ready = True

    async def prepare(self) -> None:
        """Prepare the statements: enough for :meth:`recompute` and
        :meth:`rebuild`, which need no cursor (``gateway rebuild-rollups``)."""
        prepare = self._session.prepare
        # Together: each is a round trip, a second or more over a slow link.
        (
            self._read_cursor,
            self._init_cursor,
            self._write_cursor,
            self._read_marks,
            self._read_index,
            self._read_raw,
            self._read_minutes,
            self._read_counts,
            self._write,
            self._read_times,
        ) = await gather_all(
            prepare(queries.ROLLUP_CURSOR_CQL),
            prepare(INIT_CURSOR, timestamps=(1,)),
            prepare(
                "INSERT INTO {keyspace}.rollup_progress (name, minute) VALUES (?, ?)",
                timestamps=(1,),
            ),
            prepare(
                "SELECT tenant, device_id, toUnixTimestamp(window_start) AS window_ms "
                "FROM {keyspace}.rollup_marks WHERE minute = ? AND shard = ?",
                timestamps=(0,),
            ),
            # Each read covers READ_IN devices (device_id IN ?), see recompute().
            # Timestamps are read as epoch ms, and the metrics map as JSON: cheaper
            # to decode, in either driver, than datetimes and the driver's map type.
            prepare(
                "SELECT tenant, device_id, toUnixTimestamp(bucket_start) AS bucket_ms, shard, "
                "bucket_seconds FROM {keyspace}.telemetry_partitions "
                "WHERE tenant = ? AND device_id IN ? AND bucket_start <= ? AND bucket_start > ?",
                timestamps=(2, 3),
            ),
            prepare(
                "SELECT tenant, device_id, toUnixTimestamp(ts) AS ts_ms, event_id, value_num, "
                "toJson(metrics) AS metrics FROM {keyspace}.telemetry "
                "WHERE tenant = ? AND device_id IN ? AND bucket_start = ? AND shard = ? "
                "AND ts >= ? AND ts <= ?",
                timestamps=(2, 4, 5),
            ),
            prepare(
                "SELECT tenant, device_id, metric, toUnixTimestamp(start) AS start_ms, count, "
                "min, max, sum, last, toUnixTimestamp(last_ts) AS last_ms, last_id "
                "FROM {keyspace}.rollups "
                "WHERE tenant = ? AND device_id IN ? AND step = 60 AND bucket = ? AND metric IN ? "
                "AND start >= ? AND start < ?",
                timestamps=(2, 4, 5),
            ),
            prepare(
                "SELECT tenant, device_id, metric, toUnixTimestamp(start) AS start_ms, count "
                "FROM {keyspace}.rollups WHERE tenant = ? AND device_id IN ? AND step = ? "
                "AND bucket = ? AND metric IN ? AND start = ?",
                timestamps=(3, 5),
            ),
            prepare(
                "INSERT INTO {keyspace}.rollups (tenant, device_id, step, bucket, metric, start, "
                "count, min, max, sum, last, last_ts, last_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ? AND TIMESTAMP ?",
                timestamps=(3, 5, 11),
            ),
            # Which minutes hold raw rows (rebuild): a row per device and
            # minute, grouped by Cassandra, not every row's time.
            prepare(
                "SELECT device_id, toUnixTimestamp(floor(ts, 1m)) AS window_ms "
                "FROM {keyspace}.telemetry "
                "WHERE tenant = ? AND device_id IN ? AND bucket_start = ? AND shard = ? "
                "AND ts >= ? AND ts < ? "
                "GROUP BY tenant, device_id, bucket_start, shard, floor(ts, 1m)",
                timestamps=(2, 4, 5),
            ),
        )
        await self._lease.prepare()

    async def _execute(self, prepared: Prepared, values: tuple[Any, ...]) -> Rows:
        """One write (its rows, for a lightweight transaction)."""
        session = self._session
        return await session.execute(session.bind(prepared, values))

    def _read(self, prepared: Prepared, values: tuple[Any, ...]) -> Coroutine[Any, Any, Rows]:
        return self._again(lambda: self._session.read(prepared, values))

    async def _again(self, request: Callable[[], Awaitable[T]]) -> T:
        """``request()``, tried again on a transient error up to
        REQUEST_ATTEMPTS times (each is idempotent: reads, and writes of whole
        aggregates), then its error goes to the pass (``run``)."""
        attempt = 0
        while True:
            try:
                return await request()
            except self._session.transient:
                attempt += 1
                if attempt >= REQUEST_ATTEMPTS:
                    raise
                self._stats.rollup_retries += 1
            # Waited here, not in the except clause (requests.py says why).
            delay = backoff(attempt, REQUEST_BACKOFF, REQUEST_BACKOFF_MAX)
            await asyncio.sleep(delay * (0.5 + random.random() / 2))

    @property
    def cursor_ms(self) -> int:
        return self._cursor

    @property
    def role(self) -> str:
        """For /healthz: whether this instance works or stands by, and for whom."""
        lease = self._lease
        if lease.held:
            return "working"
        return f"standing by for {lease.other!r}" if lease.other else "standing by"

    async def run(self) -> None:
        """Work while this instance holds the worker's lease (lease.py), and
        stand by while another does, until cancelled."""
        await self._lease.hold(self._passes, self._lost, self._watch)

    async def _watch(self) -> None:
        """On a standby: how far the worker (another instance's) is behind,
        from the cursor in Cassandra, so that gateway_rollup_lag_seconds shows
        a stalled worker on every instance that could take over, not only on
        one that is gone."""
        try:
            rows = await self._session.read(self._read_cursor, (self._name,))
        except Exception as exc:
            log.debug("roll-ups: the cursor could not be read: %s", exc)
            return
        behind = queries.rollup_behind_s(
            rows[0]["minute_ms"], self._clock() * 1000, self._config.rollups.grace
        )
        self._stats.rollup_lag_s = max(0.0, behind)

    def _lost(self, exc: LeaseLost) -> None:
        self._stats.rollup_lease_lost += 1
        log.warning("roll-ups: stopped working, standing by: %s", exc)

    async def _passes(self) -> None:
        """While the lease is held: read the cursor (the previous holder moved
        it on), then catch up every ``rollups.interval``. A failing pass
        (Cassandra away) is logged, counted and tried again; the cursor stays."""
        stats = self._stats
        stats.rollup_lease_taken += 1
        stats.rollup_lease_held = 1
        try:
            fresh = False
            while True:
                try:
                    if not fresh:
                        rows = await self._read(self._read_cursor, (self._name,))
                        self._cursor = rows[0]["minute_ms"]
                        fresh = True
                        log.info(
                            "roll-ups: this instance (%r) runs the worker; marks from %s on "
                            "still to do",
                            self._lease.holder,
                            queries.iso(datetime.fromtimestamp(self._cursor / 1000, UTC)),
                        )
                    await self.catch_up()
                    if self._failing:
                        log.warning("roll-ups: the worker works again")
                    self._failing = False
                except Exception as exc:
                    self._fail(exc)
                await asyncio.sleep(self._interval)
        finally:
            stats.rollup_lease_held = 0

    def _fail(self, exc: Exception) -> None:
        self._stats.rollup_failures += 1
        if not self._failing:
            log.warning("roll-ups: a pass failed, retrying: %s", exc)
        self._failing = True

    async def catch_up(self) -> int:
        """Finish every minute of marks that is due; returns how many."""
        assert self._ready, "start() first"
        stats = self._stats
        done = 0
        while True:
            now_ms = int(self._clock() * 1000)
            if stats.retries != self._retries_seen:
                # This process's writes are being retried: a raw row may land
                # after its mark. Wait until they have gone through for a grace
                # period. Checked before each minute, not once a pass: a pass
                # that catches up on many minutes (after a restart or an
                # outage) must not finish the newest while retries go on.
                self._retries_seen = stats.retries
                self._quiet_since = time.monotonic()
            due_at = self._cursor + MINUTE_MS + self._grace_ms
            # Measured before any wait: while retries hold the worker back the
            # lag grows, so a worker stalled by a flaky link shows.
            stats.rollup_lag_s = max(0.0, (now_ms - due_at) / 1000)
            self._say_lag(stats.rollup_lag_s)
            if due_at > now_ms:
                return done
            if time.monotonic() - self._quiet_since < self._grace_ms / 1000 and stats.retries:
                return done
            await self.process_minute(self._cursor, spread=self._pace(now_ms - due_at))
            self._cursor += MINUTE_MS
            cursor = (self._name, self._cursor)
            await self._again(partial(self._execute, self._write_cursor, cursor))
            done += 1

    def _say_lag(self, lag_s: float) -> None:
        """Log when the worker falls BEHIND_S behind, and when it has caught
        up again: a lag that only the gauge showed went unseen until marks
        began to expire (7 days)."""
        if lag_s >= BEHIND_S and not self._behind:
            self._behind = True
            log.warning(
                "roll-ups: %d min behind, done up to %s; catching up (after an outage or a "
                "restart it goes at full speed, or spreads each minute over rollups.spread while "
                "a backlog drains; if this lasts, the worker is slower than the "
                "marks come: gateway_rollup_lag_seconds, rollups.concurrency)",
                lag_s // 60,
                queries.iso(datetime.fromtimestamp(self._cursor / 1000, UTC)),
            )
        elif lag_s < MINUTE_MS / 1000 and self._behind:
            self._behind = False
            log.info("roll-ups: caught up")

    def _pace(self, late_ms: int) -> float:
        """Seconds to spread a minute found ``late_ms`` after it came due over
        (module docstring): ``rollups.spread``, or less when the next minute
        comes due sooner (found late, after a restart or a pass that ran
        long), so a minute's work is done before the next one's begins; none
        when the next minute is already due (an outage): full speed."""
        left = (MINUTE_MS - late_ms) / 1000
        return min(self._spread, max(0.0, left))

    async def process_minute(self, minute_ms: int, spread: float = 0.0) -> None:
        """Recompute every window marked in ``minute_ms``, then their hours,
        spread over ``spread`` seconds (:meth:`recompute`)."""
        parts = await all_or_none(
            [self._read(self._read_marks, (minute_ms, s)) for s in range(MARK_SHARDS)]
        )
        windows = {(r["tenant"], r["device_id"], r["window_ms"]) for rows in parts for r in rows}
        await self.recompute(windows, spread)

    async def recompute(self, windows: set[tuple[str, str, int]], spread: float = 0.0) -> None:
        """Recompute these 1-minute windows from the raw rows, then the hours
        they belong to from their minutes; GROUP windows at a time, their
        reads READ_IN devices to a request (``device_id IN (...)``), their
        writes packed PACK_WINDOWS windows to a request. With ``spread`` > 0
        the groups, the hours' included, are spaced evenly over that many
        seconds: group k of n is not started before k/n of it has passed."""
        # By start, then device: a group's windows share a start as far as
        # they can, and each start costs its own reads (a minute's marks are
        # mostly of one start; a rebuild's are a day of each device's).
        ordered = sorted(windows, key=_by_start_first)
        hours: dict[tuple[str, str, int], set[str]] = {}
        # The hours' groups are paced too: late in an hour, re-merging it
        # reads more rows (its minutes so far) than the minute's raw rows.
        at_most_hours = len({(t, d, start - start % HOUR_MS) for t, d, start in ordered})
        groups = math.ceil(len(ordered) / GROUP) + math.ceil(at_most_hours / GROUP)
        began = time.monotonic()
        paced = 0

        async def pace() -> None:
            nonlocal paced
            while paced < groups:
                behind = spread < self._spread and self.backlogged()
                over = self._spread if behind else spread
                wait = began + over * paced / groups - time.monotonic()
                if wait <= 0:
                    break
                if behind:
                    # Looked at again every PACE_CHECK s: once the backlog
                    # has drained, the minute goes on at its own pace.
                    wait = min(wait, PACE_CHECK)
                self._stats.rollup_paced_s += wait
                await asyncio.sleep(wait)
            paced += 1

        for first in range(0, len(ordered), GROUP):
            await pace()
            group = ordered[first : first + GROUP]
            read_at = time.time()  # before any of the group's reads began
            raw = await self._raw(group)
            computed: dict[Window, dict[str, Aggregate]] = {}
            since_yield = 0
            for w in group:
                rows = raw.get(w, {})
                computed[w] = self._minute(rows)
                since_yield += len(rows)
                if since_yield >= YIELD_ROWS:
                    since_yield = 0
                    await asyncio.sleep(0)
            await self._keep_larger(computed, 60, lambda tenant: self._config.tenant(tenant).ttl)
            writes: list[_Bound] = []
            for (tenant, device, start), aggregates in computed.items():
                ttl = int(self._config.tenant(tenant).rollup_ttl_1m)
                writes.append(self._rows(tenant, device, 60, start, aggregates, ttl, read_at))
                if aggregates:
                    key = (tenant, device, start - start % HOUR_MS)
                    hours.setdefault(key, set()).update(aggregates)
            await self._store(writes)
            self._stats.rollup_windows += len(group)
        hourly = sorted(hours.items())
        for first in range(0, len(hourly), GROUP):
            await pace()
            await self._hours(dict(hourly[first : first + GROUP]))

    async def rebuild(
        self,
        tenant: str,
        devices: list[str],
        since_ms: int,
        until_ms: int,
        progress: Callable[[int, int, int | None], None] = lambda devices, windows, day: None,
    ) -> tuple[int, set[str]]:
        """Recompute every 1-minute window of these devices that holds raw rows
        in [since_ms, until_ms), and their hours, READ_IN devices at a time;
        ``progress(devices done, windows done, the day being read or None)``
        after each day and each group. Returns the windows recomputed and the
        devices they were of. For what the marks missed (README, Known limits:
        another instance's retried marks) and rows written around the
        gateway; idempotent, and safe beside a running worker (the later
        read wins)."""
        newest, oldest = await gather_all(
            self._session.prepare(REBUILD_NEWEST, timestamps=(2, 3)),
            self._session.prepare(REBUILD_OLDEST, timestamps=(2, 3)),
        )
        low = since_ms - MAX_BUCKET_SECONDS * 1000
        done = windows = 0
        seen: set[str] = set()
        for first in range(0, len(devices), READ_IN):
            some = devices[first : first + READ_IN]
            # Only the days between the group's oldest and newest partition
            # in the range: a range back to the year 1 read one empty day
            # after another, for hours (CLI probe).
            extent = await self._extent(tenant, some, (until_ms - 1, low), newest, oldest)
            if extent is not None:
                first_ms, last_ms = extent
                begin = since_ms + max(0, first_ms - since_ms) // DAY_MS * DAY_MS
                end = min(until_ms, last_ms + MAX_BUCKET_SECONDS * 1000)
                # A day at a time: at most READ_IN devices' minutes of a day in memory.
                for day in range(begin, end, DAY_MS):
                    found = await self._windows(tenant, some, day, min(day + DAY_MS, until_ms))
                    await self.recompute(found)
                    windows += len(found)
                    seen.update(device for _, device, _ in found)
                    progress(done, windows, day)
            done += len(some)
            progress(done, windows, None)
        return windows, seen

    async def _extent(
        self,
        tenant: str,
        devices: list[str],
        span: tuple[int, int],
        newest: Prepared,
        oldest: Prepared,
    ) -> tuple[int, int] | None:
        """The start of the oldest and of the newest partition of these
        devices that start within ``span`` (newest, oldest-excluded), or None
        when they have none."""
        high, low = span
        tops = await self._read(newest, (tenant, devices, high, low))
        if not tops:
            return None
        bottoms = await all_or_none(
            [self._read(oldest, (tenant, r["device_id"], high, low)) for r in tops]
        )
        # None found (the index rows expired between the two reads): nothing to do.
        first = min((rows[0]["bucket_ms"] for rows in bottoms if rows), default=None)
        return None if first is None else (first, max(r["bucket_ms"] for r in tops))

    async def _windows(
        self, tenant: str, devices: list[str], since_ms: int, until_ms: int
    ) -> set[Window]:
        """The 1-minute windows of these devices that hold raw rows in
        [since_ms, until_ms), from every partition that may hold them."""
        low = since_ms - MAX_BUCKET_SECONDS * 1000
        index = await self._read(self._read_index, (tenant, devices, until_ms - 1, low))
        by_partition: dict[tuple[int, int], list[str]] = {}
        for p in index:
            if p["bucket_ms"] + p["bucket_seconds"] * 1000 > since_ms:
                by_partition.setdefault((p["bucket_ms"], p["shard"]), []).append(p["device_id"])

        def read_times(key: tuple[int, int], some: list[str]) -> Any:
            bucket, shard = key
            return self._read(self._read_times, (tenant, some, bucket, shard, since_ms, until_ms))

        # READ_AT_ONCE partitions' reads at a time: a day of 1-minute buckets
        # of sharded devices is thousands of partitions.
        found: set[Window] = set()
        partitions = list(by_partition.items())
        for first in range(0, len(partitions), READ_AT_ONCE):
            some = dict(partitions[first : first + READ_AT_ONCE])
            for r in await self._read_in(some, read_times):
                found.add((tenant, r["device_id"], r["window_ms"]))
        return found

    @staticmethod
    def _minute(rows: RawRows) -> dict[str, Aggregate]:
        """A window's aggregates, per metric, from its raw rows."""
        samples: dict[str, list[tuple[int, int, float]]] = {}
        for (ts, event_id), (num, metrics) in rows.items():
            for metric, value in numeric_metrics(num, metrics):
                samples.setdefault(metric, []).append((ts, event_id, value))
        return {metric: aggregate(s) for metric, s in samples.items()}

    async def _read_in(
        self, groups: dict[tuple[Any, ...], list[str]], read: Callable[..., Any]
    ) -> list[Any]:
        """Every row of ``read(key, devices)`` for each group's devices,
        READ_IN of them to a request, the requests at once."""
        reads = [
            read(key, devices[first : first + READ_IN])
            for key, devices in groups.items()
            for first in range(0, len(devices), READ_IN)
        ]
        answers = await all_or_none(reads)
        return [row for rows in answers for row in rows]

    async def _raw(self, windows: list[Window]) -> dict[Window, RawRows]:
        """Each window's raw rows, each (ts, event_id) once, from every
        partition that may hold them (found as ``gateway history`` finds
        them; only the numeric columns)."""
        by_start: dict[tuple[str, int], list[str]] = {}
        for tenant, device_id, start_ms in windows:
            by_start.setdefault((tenant, start_ms), []).append(device_id)

        def read_index(key: tuple[str, int], devices: list[str]) -> Any:
            tenant, start_ms = key
            end_ms = start_ms + MINUTE_MS - 1
            low = start_ms - MAX_BUCKET_SECONDS * 1000
            return self._read(self._read_index, (tenant, devices, end_ms, low))

        # Per device, its partitions (bucket, shard) and their longest bucket.
        longest: dict[tuple[str, str], dict[tuple[int, int], int]] = {}
        for p in await self._read_in(by_start, read_index):
            partitions = longest.setdefault((p["tenant"], p["device_id"]), {})
            key = (p["bucket_ms"], p["shard"])
            partitions[key] = max(partitions.get(key, 0), p["bucket_seconds"])
        by_partition: dict[tuple[str, int, int, int], list[str]] = {}
        for tenant, device_id, start_ms in windows:
            for (bucket, shard), seconds in longest.get((tenant, device_id), {}).items():
                if bucket <= start_ms + MINUTE_MS - 1 and bucket + seconds * 1000 > start_ms:
                    by_partition.setdefault((tenant, bucket, shard, start_ms), []).append(device_id)

        def read_raw(key: tuple[str, int, int, int], devices: list[str]) -> Any:
            tenant, bucket, shard, start_ms = key
            values = (tenant, devices, bucket, shard, start_ms, start_ms + MINUTE_MS - 1)
            return self._read(self._read_raw, values)

        out: dict[Window, RawRows] = {}
        for n, r in enumerate(await self._read_in(by_partition, read_raw), 1):
            if n % YIELD_ROWS == 0:
                await asyncio.sleep(0)
            ts = r["ts_ms"]
            # A redelivered copy can sit in two partitions (queries.history): once.
            window = (r["tenant"], r["device_id"], ts - ts % MINUTE_MS)
            metrics = orjson.loads(r["metrics"]) if r["metrics"] else None  # "null" when empty
            if metrics and None in metrics.values():
                # A NaN or infinite double (not the gateway's: the decoder
                # refuses them) reads back as null: no sample of that metric.
                metrics = {k: v for k, v in metrics.items() if v is not None}
            out.setdefault(window, {})[(ts, r["event_id"])] = (r["value_num"], metrics or {})
        return out

    async def _hours(self, hours: dict[tuple[str, str, int], set[str]]) -> None:
        """Recompute these hours (tenant, device, hour) from their minutes, for
        the metrics given."""
        read_at = time.time()
        by_hour, metrics_of = _by_start(hours)

        def read_minutes(key: tuple[str, int], devices: list[str]) -> Any:
            tenant, hour_ms = key
            bucket = queries.rollup_bucket(hour_ms, 60)
            metrics = sorted(metrics_of[key])
            values = (tenant, devices, bucket, metrics, hour_ms, hour_ms + HOUR_MS)
            return self._read(self._read_minutes, values)

        parts: dict[tuple[str, str, int], dict[str, list[Aggregate]]] = {}
        for n, r in enumerate(await self._read_in(by_hour, read_minutes), 1):
            if n % YIELD_ROWS == 0:
                await asyncio.sleep(0)
            start = r["start_ms"]
            key = (r["tenant"], r["device_id"], start - start % HOUR_MS)
            metric = r["metric"]
            if metric in hours.get(key, ()):
                parts.setdefault(key, {}).setdefault(metric, []).append(
                    Aggregate(
                        r["count"],
                        r["min"],
                        r["max"],
                        r["sum"],
                        r["last"],
                        r["last_ms"],
                        r["last_id"],
                    )
                )

        merged = {
            key: {metric: merge(p) for metric, p in minutes.items()}
            for key, minutes in sorted(parts.items())
        }
        await self._keep_larger(
            merged, 3600, lambda tenant: self._config.tenant(tenant).rollup_ttl_1m
        )
        writes = []
        for (tenant, device_id, hour_ms), aggregates in merged.items():
            ttl = int(self._config.tenant(tenant).rollup_ttl_1h)
            writes.append(self._rows(tenant, device_id, 3600, hour_ms, aggregates, ttl, read_at))
        await self._store(writes)

    async def _keep_larger(
        self,
        computed: dict[Window, dict[str, Aggregate]],
        step: int,
        source_ttl: Callable[[str], float],
    ) -> None:
        """Leave out of ``computed`` each aggregate that counts fewer rows than
        the one stored for its window, where what it was computed from (raw
        rows for a minute, minutes for an hour; their TTL ``source_ttl``) may
        have expired: those rows only ever go by TTL, so fewer means expired,
        and the stored aggregate, which counted them, stays. A copy or a late
        event arriving after that shrank the window to itself (5 events to 1).
        Only windows that old are read back; a late event into one is not
        added (it may be a copy of a counted one: the rows that would tell
        are gone). Counted: ``rollup_windows_kept``."""
        now_ms = int(self._clock() * 1000)
        span = step * 1000  # a window's rows expire no sooner than its start plus their TTL
        old = {
            window: aggregates
            for window, aggregates in computed.items()
            if aggregates and window[2] + source_ttl(window[0]) * 1000 - span <= now_ms
        }
        if not old:
            return
        by_start, metrics_of = _by_start(old)

        def read_counts(key: tuple[str, int], devices: list[str]) -> Any:
            tenant, start = key
            bucket = queries.rollup_bucket(start, step)
            values = (tenant, devices, step, bucket, sorted(metrics_of[key]), start)
            return self._read(self._read_counts, values)

        for r in await self._read_in(by_start, read_counts):
            aggregates = old.get((r["tenant"], r["device_id"], r["start_ms"]), {})
            mine = aggregates.get(r["metric"])
            if mine is not None and r["count"] is not None and r["count"] > mine.count:
                del aggregates[r["metric"]]
                self._stats.rollup_windows_kept += 1

    def _rows(
        self,
        tenant: str,
        device_id: str,
        step: int,
        start_ms: int,
        aggregates: dict[str, Aggregate],
        ttl: int,
        read_at: float,
    ) -> _Bound:
        """One window's rows, every metric (they share a partition), bound,
        with the bytes of their values."""
        bucket = queries.rollup_bucket(start_ms, step)
        # The later read wins (module docstring), in microseconds.
        stamp = int(read_at * 1_000_000)
        session = self._session
        statements: list[Any] = []
        size = 0
        for metric, agg in aggregates.items():
            values = (
                tenant,
                device_id,
                step,
                bucket,
                metric,
                start_ms,
                agg.count,
                agg.min,
                agg.max,
                agg.sum,
                agg.last,
                agg.last_ts,
                agg.last_id,
                ttl,
                stamp,
            )
            statement = session.bind(self._write, values)
            statements.append(statement)
            size += session.size(statement, values)
        return statements, size

    async def _store(self, windows: list[_Bound]) -> None:
        """Write these windows' rows: windows whose partitions have the same
        replicas share an UNLOGGED batch, up to PACK_WINDOWS of them (or the
        session's ``batch_partitions``, if fewer) and PACK_BYTES of values
        (under Cassandra's batch warnings: 10 partitions, 5 KiB), at most
        ``rollups.concurrency`` batches at once."""
        session = self._session
        most = min(PACK_WINDOWS, session.batch_partitions)
        packs: dict[Hashable, list[_Bound]] = {}
        for rows in windows:
            if rows[0]:
                packs.setdefault(session.replicas(rows[0][0]), []).append(rows)
        batches: list[list[Any]] = []
        for same in packs.values():
            batch: list[Any] = []
            partitions = size = 0
            for statements, rows_size in same:
                if partitions and (partitions == most or size + rows_size > PACK_BYTES):
                    batches.append(batch)
                    batch = []
                    partitions = size = 0
                batch += statements
                partitions += 1
                size += rows_size
            batches.append(batch)

        async def send(statements: list[Any]) -> None:
            batch = session.batch(statements)
            async with self._slots:
                await self._again(lambda: session.execute(batch))

        await all_or_none([send(batch) for batch in batches])
