"""Send rows to Cassandra: grouped by partition, capped in flight, retried.

The stages (``state``, ``telemetry``, ``rejects``) turn a message into
:class:`Write` objects; the sink sends them. Promises:

* Rows of one partition are grouped into UNLOGGED batches of at most
  ``pipeline.batch_max_rows`` (one partition per batch: one replica set, no
  batch log). Rows of different partitions are never batched.
* At most ``cassandra.max_in_flight`` requests are outstanding; ``submit``
  waits for a free slot, which is how a slow Cassandra slows the reader down.
* Timeouts, unavailable replicas and lost connections are retried with capped
  exponential backoff and jitter, which is safe because every write is
  idempotent (fixed keys, event-time write timestamps). After
  ``cassandra.give_up_after`` seconds of failing, or on an error retrying cannot
  fix, the sink raises :class:`SinkError` and the gateway stops: the messages
  concerned were never acknowledged, so the broker still has them.
* A message's :class:`Pending` completes only when every one of its writes has
  been acknowledged by Cassandra.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .api import GatewayMetrics
from .config import Config
from .errors import SinkError
from .metrics import Stats
from .write_session import Prepared, Rows, WriteSession

log = logging.getLogger(__name__)

BACKOFF_MIN = 0.05
BACKOFF_MAX = 10.0


class Pending:
    """The writes one message still waits for; ``on_done`` runs at zero."""

    __slots__ = ("on_done", "remaining")

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.remaining = 0
        self.on_done = on_done

    def add(self, count: int = 1) -> None:
        self.remaining += count

    def finish_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.on_done()


@dataclass(slots=True)
class Write:
    """One statement for one partition, on behalf of one message."""

    partition: Hashable  # (table, partition key...): rows with equal keys may be batched
    prepared: Prepared
    values: tuple[Any, ...]  # bound when sent (write_session.UNSET leaves one unset)
    pending: Pending


class HotPartitions:
    """Writes per partition over a window, in bounded memory.

    A partition over ``threshold`` writes in a window is logged once for that
    window, counted, and reported to ``on_hot``; at the end of each window
    ``on_window`` gets the set of partitions that were hot in it. At most
    ``max_tracked`` partitions are counted per window; writes to others are
    counted in ``Stats.untracked_writes`` only.
    """

    def __init__(
        self,
        window: float,
        threshold: int,
        max_tracked: int,
        stats: Stats,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._window = window
        self._threshold = threshold
        self._max = max_tracked
        self._stats = stats
        self._metric = metrics.hot_partitions if metrics is not None else None
        self._counts: dict[Hashable, int] = {}
        self._hot: set[Hashable] = set()
        self._started = time.monotonic()
        self.on_hot: Callable[[Hashable], None] = lambda key: None
        self.on_window: Callable[[set[Hashable]], None] = lambda hot: None

    def count(self, key: Hashable) -> None:
        now = time.monotonic()
        if now - self._started >= self._window:
            hot, self._hot = self._hot, set()
            self._counts.clear()
            self._started = now
            self.on_window(hot)
        counts = self._counts
        current = counts.get(key)
        if current is None:
            if len(counts) >= self._max:
                self._stats.untracked_writes += 1
                return
            current = 0
        current += 1
        counts[key] = current
        if current == self._threshold + 1:
            self._hot.add(key)
            self._stats.hot_partitions += 1
            table = str(key[0]) if isinstance(key, tuple) else "?"
            if self._metric is not None:
                self._metric.inc(table=table)
            log.warning(
                "hot partition %s: over %d writes in %.0f s", key, self._threshold, self._window
            )
            self.on_hot(key)


class Sink:
    """Owns the in-flight requests; ``async with`` waits for them on exit."""

    def __init__(
        self,
        session: WriteSession,
        config: Config,
        stats: Stats,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.session = session
        self._transient = session.transient
        self._batch_rows = metrics.batch_rows if metrics is not None else None
        hot = config.hot_partitions
        self.hot = HotPartitions(hot.window, hot.threshold, hot.max_tracked, stats, metrics)
        self._max_rows = config.pipeline.batch_max_rows
        self._give_up_after = config.cassandra.give_up_after
        self._slots = asyncio.BoundedSemaphore(config.cassandra.max_in_flight)
        self._stats = stats
        self._tasks = asyncio.TaskGroup()
        self._idle = asyncio.Event()
        self._idle.set()
        self._requests: set[asyncio.Task[None]] = set()
        self._failing_since: float | None = None
        # Set (and replaced) when writes succeed again after failures: requests
        # sleeping in backoff retry at once instead of finishing their sleep.
        self._recovered = asyncio.Event()

    async def __aenter__(self) -> Sink:
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._tasks.__aexit__(exc_type, exc, tb)

    async def submit(self, writes: list[Write]) -> None:
        """Group by partition and send; returns once every request is sent."""
        groups: dict[Hashable, list[Write]] = {}
        count = self.hot.count
        for write in writes:
            write.pending.add()
            count(write.partition)
            groups.setdefault(write.partition, []).append(write)
        for group in groups.values():
            for start in range(0, len(group), self._max_rows):
                await self._send(group[start : start + self._max_rows])

    @property
    def failing_for(self) -> float | None:
        """Seconds writes have been failing, or None when they succeed."""
        since = self._failing_since
        return None if since is None else time.monotonic() - since

    async def drain(self) -> None:
        """Wait until no request is in flight (a barrier for rare schema-like work)."""
        await self._idle.wait()

    async def _send(self, rows: list[Write]) -> None:
        await self._slots.acquire()
        self._stats.in_flight += 1
        self._idle.clear()
        task = self._tasks.create_task(self._run(rows))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    def abort(self) -> None:
        """Cancel every request in flight (spool mode: the spool still has them)."""
        for task in list(self._requests):
            task.cancel()

    async def _run(self, rows: list[Write]) -> None:
        try:
            if len(rows) == 1:
                request = self._bind(rows[0].prepared, rows[0].values)
            else:
                request = self.session.batch([self._bind(r.prepared, r.values) for r in rows])
            if self._batch_rows is not None:
                self._batch_rows.observe(len(rows))
            await self._execute(request, len(rows))
            for row in rows:
                row.pending.finish_one()
        finally:
            self._slots.release()
            self._stats.in_flight -= 1
            if self._stats.in_flight == 0:
                self._idle.set()

    async def execute(self, prepared: Prepared, values: tuple[Any, ...]) -> Rows:
        """One statement (a read, or a write outside the batches), with retries."""
        return await self._execute(self._bind(prepared, values), 1)

    def _bind(self, prepared: Prepared, values: tuple[Any, ...]) -> Any:
        try:
            return self.session.bind(prepared, values)
        except Exception as exc:
            # A value the driver cannot encode: a bug, not a bad message (decode
            # validated it). Stop with the statement named; nothing was acked.
            raise SinkError(f"cannot bind a value for {prepared.cql!r}: {_short(exc)}") from None

    async def _execute(self, request: Any, rows: int) -> Rows:
        """Execute with retries on transient errors; raise SinkError otherwise."""
        attempt = 0
        while True:
            self._stats.requests += 1
            self._stats.rows += rows
            try:
                result = await self.session.execute(request)
            except self._transient as exc:
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                    log.warning("Cassandra write failed, retrying: %s", _short(exc))
                if now - self._failing_since > self._give_up_after:
                    raise SinkError(
                        f"Cassandra writes failing for over {self._give_up_after:.0f} s "
                        f"(cassandra.give_up_after); last error: {_short(exc)}"
                    ) from None
                attempt += 1
                self._stats.retries += 1
                delay = min(BACKOFF_MAX, BACKOFF_MIN * 2**attempt)
                recovered = self._recovered
                try:
                    async with asyncio.timeout(delay * (0.5 + random.random() / 2)):
                        await recovered.wait()
                except TimeoutError:
                    pass
                continue
            except Exception as exc:
                raise SinkError(f"Cassandra refused a write: {_short(exc)}") from None
            if self._failing_since is not None:
                log.warning(
                    "Cassandra writes succeed again after %.1f s",
                    time.monotonic() - self._failing_since,
                )
                self._failing_since = None
                self._recovered.set()
                self._recovered = asyncio.Event()
            return result


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:297] + "..."
