"""Send rows to Cassandra: grouped by partition, capped in flight, retried.

The table writers (``latest``, ``telemetry``, ``rejects``) turn a message into
:class:`Write` objects; the sink sends them through :class:`Requests`
(``requests.py``: retries and the give-up deadline). Promises:

* Rows of one partition are grouped into UNLOGGED batches of at most
  ``pipeline.batch_max_rows`` (no batch log). Groups of partitions with the
  same replicas share a request, up to the write session's
  ``batch_partitions`` (10 where the driver can tell replicas: always with
  the Python driver, with acsylla when every node holds every partition; 1
  otherwise), ``batch_max_rows`` rows and ``PACK_BYTES`` of values
  (``write_session.py``): each replica still applies every partition on its
  own, and a retry resends the whole batch (every write is idempotent).
* At most ``limit`` requests are outstanding (``limit.py``: adapted to the
  measured latency, never above ``cassandra.max_in_flight``); ``submit`` waits
  for a free slot, which is how a slow Cassandra slows the reader down.
* Every partition written is counted by :class:`HotPartitions` (``hot.py``).
* Failures are retried as ``requests.py`` says; a :class:`SinkError` from there
  stops the gateway with nothing unwritten acknowledged (in spool mode, a
  ``WritesFailing`` makes it spool until Cassandra answers: app.py).
* A message's :class:`Pending` completes only when every one of its writes has
  been acknowledged by Cassandra.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..config import PipelineConfig
from ..stats import Stats
from .hot import HotPartitions
from .requests import Requests
from .write_session import PACK_BYTES, Prepared


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


@dataclass(slots=True, init=False)
class Write:
    """One statement for one partition, on behalf of one message."""

    partition: Hashable  # (table, partition key...): rows with equal keys may be batched
    prepared: Prepared
    values: tuple[Any, ...]  # bound when sent (write_session.UNSET leaves one unset)
    pending: Pending

    # Written out: a dataclass's generated __init__ is interpreted (event.py).
    def __init__(
        self, partition: Hashable, prepared: Prepared, values: tuple[Any, ...], pending: Pending
    ) -> None:
        self.partition = partition
        self.prepared = prepared
        self.values = values
        self.pending = pending


@dataclass(slots=True)
class _Pack:
    """Partitions gathered into one request (the Python driver's path)."""

    rows: list[Write]
    statements: list[Any]
    size: int  # bytes of bound values
    partitions: int


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
        # Its own count, shown in stats.in_flight: the stats outlive a sink (a
        # gateway that spools, then opens again, in one process), and a
        # request cancelled before it ran never counted itself out, so the
        # next sink's drain() waited for good on the old sink's count.
        self._in_flight = 0
        stats.in_flight = 0
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
        # None of its requests is under way now, started or not (a request
        # cancelled before it ran never counted itself out).
        self._stats.in_flight = 0

    async def submit(self, writes: list[Write]) -> None:
        """Group by partition and send; returns once every request is sent."""
        groups: dict[Hashable, list[Write]] = {}
        for write in writes:  # a plain loop: this runs for every row
            write.pending.remaining += 1
            group = groups.get(write.partition)
            if group is None:
                groups[write.partition] = [write]
            else:
                group.append(write)
        self._hot.count([w.partition for w in writes])
        if self._session.batch_partitions > 1:
            await self._submit_packed(groups.values())
            return
        for group in groups.values():
            for start in range(0, len(group), self._max_rows):
                await self._send(group[start : start + self._max_rows])

    async def _submit_packed(self, groups: Iterable[list[Write]]) -> None:
        """Pack partitions with the same replicas into shared requests (the
        Python driver's path); bound here, so that sizes are known."""
        session = self._session
        bind, size_of = self._requests.bind, session.size
        max_rows, max_parts = self._max_rows, session.batch_partitions
        packs: dict[Hashable, _Pack] = {}
        for group in groups:
            for start in range(0, len(group), max_rows):
                rows = group[start : start + max_rows]
                statements: list[Any] = []
                size = 0
                for row in rows:  # a plain loop: this runs for every row
                    statement = bind(row.prepared, row.values)
                    statements.append(statement)
                    size += size_of(statement, row.values)
                key = session.replicas(statements[0])
                pack = packs.get(key)
                if pack is not None and (
                    len(pack.rows) + len(rows) > max_rows
                    or pack.size + size > PACK_BYTES
                    or pack.partitions >= max_parts
                ):
                    del packs[key]
                    await self._send(pack.rows, pack.statements)
                    pack = None
                if pack is None:
                    pack = packs[key] = _Pack([], [], 0, 0)
                pack.rows += rows
                pack.statements += statements
                pack.size += size
                pack.partitions += 1
        for pack in packs.values():
            await self._send(pack.rows, pack.statements)

    @property
    def idle(self) -> bool:
        return self._in_flight == 0

    async def drain(self) -> None:
        """Wait until no request is in flight (a barrier for rare schema-like work)."""
        await self._idle.wait()

    async def _send(self, rows: list[Write], statements: list[Any] | None = None) -> None:
        await self._slots.acquire()
        try:
            task = self._tasks.create_task(self._run(rows, statements))
        except RuntimeError:
            # The group is shutting down (a request failed for good): this
            # writer is being cancelled too, and must not add an error of
            # its own to the group (app.run tells WritesFailing by its type).
            self._slots.release()
            raise asyncio.CancelledError() from None
        self._in_flight += 1
        self._stats.in_flight = self._in_flight
        self._idle.clear()
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def abort(self) -> None:
        """Cancel every request in flight (spool mode: the spool still has them)."""
        for task in list(self._running):
            task.cancel()

    async def _run(self, rows: list[Write], statements: list[Any] | None) -> None:
        try:
            if statements is None:
                bind = self._requests.bind
                statements = [bind(r.prepared, r.values) for r in rows]
            one = len(statements) == 1
            request = statements[0] if one else self._session.batch(statements)
            self._stats.batch_rows.observe(len(rows))
            await self._requests.send(request, len(rows))
            for row in rows:
                row.pending.finish_one()
        finally:
            self._slots.release()
            self._in_flight -= 1
            self._stats.in_flight = self._in_flight
            if self._in_flight == 0:
                self._idle.set()
