"""Send rows to Cassandra: grouped by partition, capped in flight, retried.

The table writers (``latest``, ``telemetry``, ``rejects``) turn a message into
:class:`Write` objects; the sink sends them through :class:`Requests`
(``requests.py``: retries and the give-up deadline). Promises:

* Rows of one partition are grouped into UNLOGGED batches of at most
  ``pipeline.batch_max_rows`` (one partition per batch: one replica set, no
  batch log). Rows of different partitions are never batched.
* At most ``limit`` requests are outstanding (``limit.py``: adapted to the
  measured latency, never above ``cassandra.max_in_flight``); ``submit`` waits
  for a free slot, which is how a slow Cassandra slows the reader down.
* Every partition written is counted by :class:`HotPartitions` (``hot.py``).
* Failures are retried as ``requests.py`` says; a :class:`SinkError` from there
  stops the gateway with nothing unwritten acknowledged.
* A message's :class:`Pending` completes only when every one of its writes has
  been acknowledged by Cassandra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..config import PipelineConfig
from ..stats import Stats
from .hot import HotPartitions
from .requests import Requests
from .write_session import Prepared


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


class Sink:
    """Owns the in-flight requests; ``async with`` waits for them on exit."""

    def __init__(
        self,
        requests: Requests,
        config: PipelineConfig,
        hot: HotPartitions,
        stats: Stats,
    ) -> None:
        self._requests = requests
        self._session = requests.session
        self._hot = hot
        self._max_rows = config.batch_max_rows
        self._slots = requests.limit
        self._stats = stats
        self._tasks = asyncio.TaskGroup()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running: set[asyncio.Task[None]] = set()

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
        count = self._hot.count
        for write in writes:
            write.pending.add()
            count(write.partition)
            groups.setdefault(write.partition, []).append(write)
        for group in groups.values():
            for start in range(0, len(group), self._max_rows):
                await self._send(group[start : start + self._max_rows])

    @property
    def idle(self) -> bool:
        return self._stats.in_flight == 0

    async def drain(self) -> None:
        """Wait until no request is in flight (a barrier for rare schema-like work)."""
        await self._idle.wait()

    async def _send(self, rows: list[Write]) -> None:
        await self._slots.acquire()
        self._stats.in_flight += 1
        self._idle.clear()
        task = self._tasks.create_task(self._run(rows))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def abort(self) -> None:
        """Cancel every request in flight (spool mode: the spool still has them)."""
        for task in list(self._running):
            task.cancel()

    async def _run(self, rows: list[Write]) -> None:
        try:
            bind = self._requests.bind
            if len(rows) == 1:
                request = bind(rows[0].prepared, rows[0].values)
            else:
                request = self._session.batch([bind(r.prepared, r.values) for r in rows])
            self._stats.batch_rows.observe(len(rows))
            await self._requests.send(request, len(rows))
            for row in rows:
                row.pending.finish_one()
        finally:
            self._slots.release()
            self._stats.in_flight -= 1
            if self._stats.in_flight == 0:
                self._idle.set()
