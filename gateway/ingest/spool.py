"""Durable on-disk spool: the edge host's write-ahead buffer.

With ``[spool] enabled``, every message the broker hands over is appended here
first and acknowledged to the broker once the append is committed; the
pipeline then reads the spool in arrival order, writes to Cassandra, and
deletes records once Cassandra has them. So the gateway keeps taking (and
acknowledging) messages while Cassandra is unreachable or slower than ingest,
and a restart, even after SIGKILL, resumes from what is still spooled.

Why SQLite in WAL mode rather than our own segment files: it gives atomic,
checksummed, fsynced group commits and crash recovery (a torn last write is
rolled back by SQLite, never half-read) for a few hundred lines less code, and
appends plus deletes stay cheap at the rates one edge host sees. Each commit
is one transaction for a whole batch (group commit), fsynced
(``synchronous=FULL``). All SQLite calls run on one dedicated thread.

Bounds: at most ``max_records`` records and ``max_bytes`` of payload. When
full, ``append`` waits: the gateway stops acknowledging and pauses reading, and
the broker's persistent session holds the rest.

:class:`Spool` is the storage; :class:`SpoolSource` is the pipeline's source
in spool mode (it feeds the same queue as the MQTT receiver does otherwise).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

from ..stats import Stats
from .pipeline import Flow
from .receive import Delivery

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    received_ms  INTEGER NOT NULL,
    topic        TEXT NOT NULL,
    content_type TEXT,
    payload      BLOB NOT NULL,
    redelivered  INTEGER NOT NULL DEFAULT 0
)
"""

# Spools written before the DUP flag was kept get the column (false) on open.
_ADD_REDELIVERED = "ALTER TABLE spool ADD COLUMN redelivered INTEGER NOT NULL DEFAULT 0"

# (received_ms, topic, content_type, payload[, redelivered])
Appended = tuple[int, str, str | None, bytes] | tuple[int, str, str | None, bytes, bool]


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    received_ms: int
    topic: str
    content_type: str | None
    payload: bytes
    redelivered: bool = False


class Spool:
    """An ordered, durable queue of raw messages. Use as ``async with``."""

    def __init__(self, path: Path, max_records: int, max_bytes: int) -> None:
        self.path = path
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.depth = 0
        self.bytes = 0
        self.appended = 0
        self.deleted = 0
        self._oldest_ms: int | None = None
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool")
        self._room = asyncio.Event()
        self._room.set()

    async def __aenter__(self) -> Spool:
        await self._call(self._open)
        self._update_room()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._call(self._close)
        self._thread.shutdown(wait=True)

    # -- async API -----------------------------------------------------------

    @property
    def full(self) -> bool:
        return self.depth >= self.max_records or self.bytes >= self.max_bytes

    def oldest_age(self) -> float:
        """Seconds since the oldest spooled message arrived (0 when empty)."""
        if self._oldest_ms is None or self.depth == 0:
            return 0.0
        return max(0.0, time.time() - self._oldest_ms / 1000)

    async def wait_for_room(self) -> None:
        await self._room.wait()

    async def append(self, records: Sequence[Appended]) -> list[int]:
        """Commit (received_ms, topic, content_type, payload[, redelivered])
        records; their seqs."""
        seqs: list[int] = await self._call(self._append, list(records))
        self.depth += len(records)
        self.bytes += sum(len(r[3]) for r in records)
        self.appended += len(records)
        if self._oldest_ms is None and records:
            self._oldest_ms = records[0][0]
        self._update_room()
        return seqs

    async def read(self, after: int, limit: int) -> list[Record]:
        records: list[Record] = await self._call(self._read, after, limit)
        return records

    async def delete(self, seqs: Sequence[int], size: int) -> None:
        """Forget records Cassandra has; ``size`` is their payload bytes."""
        await self._call(self._delete, list(seqs))
        self.depth -= len(seqs)
        self.bytes -= size
        self.deleted += len(seqs)
        if self.depth == 0:
            self._oldest_ms = None
        else:
            self._oldest_ms = await self._call(self._oldest)
        self._update_room()

    def _update_room(self) -> None:
        if self.full:
            self._room.clear()
        else:
            self._room.set()

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- on the spool thread -------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(_SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(spool)")}
        if "redelivered" not in columns:
            db.execute(_ADD_REDELIVERED)
        count, size, oldest = db.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0), min(received_ms) FROM spool"
        ).fetchone()
        self.depth, self.bytes, self._oldest_ms = count, size, oldest
        self._db = db

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _append(self, records: list[Appended]) -> list[int]:
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            seqs = []
            for record in records:
                cursor = db.execute(
                    "INSERT INTO spool (received_ms, topic, content_type, payload, redelivered) "
                    "VALUES (?, ?, ?, ?, ?)",
                    record if len(record) == 5 else (*record, False),
                )
                assert cursor.lastrowid is not None
                seqs.append(cursor.lastrowid)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return seqs

    def _read(self, after: int, limit: int) -> list[Record]:
        db = self._db
        assert db is not None
        rows = db.execute(
            "SELECT seq, received_ms, topic, content_type, payload, redelivered FROM spool "
            "WHERE seq > ? ORDER BY seq LIMIT ?",
            (after, limit),
        ).fetchall()
        return [Record(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]

    def _delete(self, seqs: list[int]) -> None:
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        db.executemany("DELETE FROM spool WHERE seq = ?", [(s,) for s in seqs])
        db.execute("COMMIT")

    def _oldest(self) -> int | None:
        db = self._db
        assert db is not None
        row = db.execute("SELECT min(received_ms) FROM spool").fetchone()
        return None if row is None else row[0]


class _Deleted:
    """A spooled message is done once Cassandra has it: queue its delete."""

    __slots__ = ("_seq", "_size", "_source")

    def __init__(self, source: SpoolSource, seq: int, size: int) -> None:
        self._source, self._seq, self._size = source, seq, size

    def done(self) -> None:
        self._source.written(self._seq, self._size)


class Queue(Protocol):
    """Where the spool's records go: the pipeline (``Pipeline.put``)."""

    async def put(self, delivery: Delivery) -> None: ...


class SpoolSource:
    """Spool mode's source: the broker's deliveries go into the spool, and the
    spool, read in arrival order, feeds the pipeline like any other source.

    Three tasks: ``append`` commits deliveries in group commits and
    acknowledges each to the broker once committed (pausing socket reads while
    the spool is full or the inbox is as long as the pipeline's queue);
    ``feed`` reads committed records into the pipeline, waiting for room; and
    ``delete`` removes records whose writes Cassandra acknowledged.
    """

    def __init__(
        self,
        spool: Spool,
        pipeline: Queue,
        flow: Flow,
        stats: Stats,
        batch: int,
        queue_size: int,
    ) -> None:
        self.spool = spool
        self._pipeline = pipeline
        self._flow = flow
        self._stats = stats
        self._batch = batch
        self._inbox: list[Delivery] = []
        self._inbox_limit = queue_size
        self._inbox_ready = asyncio.Event()
        self._spooled = asyncio.Event()
        self._to_delete: list[tuple[int, int]] = []
        self._delete_ready = asyncio.Event()
        self._closing = False
        self._closed = asyncio.Event()
        self._writes_stopped = asyncio.Event()

    def accept(self, delivery: Delivery) -> None:
        """The receiver's handler: append first, acknowledge once committed."""
        self._inbox.append(delivery)
        self._inbox_ready.set()
        if len(self._inbox) >= self._inbox_limit:
            self._flow.pause_reading()

    def close(self) -> None:
        """No more deliveries: append what the inbox holds, stop feeding.
        What is spooled stays spooled until the next start."""
        self._closing = True
        self._closed.set()
        self._inbox_ready.set()
        self._spooled.set()

    def writes_stopped(self) -> None:
        """The writers are done: delete what they finished, then stop."""
        self._writes_stopped.set()
        self._delete_ready.set()

    def written(self, seq: int, size: int) -> None:
        self._to_delete.append((seq, size))
        self._delete_ready.set()

    async def append(self) -> None:
        spool = self.spool
        while True:
            await self._inbox_ready.wait()
            self._inbox_ready.clear()
            if not self._inbox:
                if self._closing:
                    return
                continue
            if not await self._room():
                return  # stopping while full: the inbox is unacknowledged, redelivered later
            batch, self._inbox = self._inbox, []
            await spool.append(
                [(d.received_ms, d.topic, d.content_type, d.payload, d.redelivered) for d in batch]
            )
            for delivery in batch:
                delivery.ack.done()
            self._spooled.set()
            # Full now: nothing more can arrive while reads are paused, so wait
            # for room here, then read again.
            if not await self._room():
                return
            self._flow.resume_reading()
            if self._inbox:
                self._inbox_ready.set()

    async def _room(self) -> bool:
        """Wait until the spool has room (True), or the source is closed (False)."""
        if not self.spool.full:
            return True
        self._flow.pause_reading()  # the broker keeps the rest until there is room
        self._stats.spool_full_waits += 1
        room = asyncio.ensure_future(self.spool.wait_for_room())
        closed = asyncio.ensure_future(self._closed.wait())
        await asyncio.wait((room, closed), return_when=asyncio.FIRST_COMPLETED)
        room.cancel()
        closed.cancel()
        return not self.spool.full

    async def feed(self) -> None:
        last = 0
        while not self._closing:
            # Cleared before reading, so an append during the read is not missed.
            self._spooled.clear()
            records = await self.spool.read(last, self._batch)
            if not records:
                await self._spooled.wait()
                continue
            for record in records:
                if self._closing:
                    return  # the rest stays spooled
                await self._pipeline.put(
                    Delivery(
                        record.topic,
                        record.payload,
                        record.content_type,
                        record.received_ms,
                        _Deleted(self, record.seq, len(record.payload)),
                        record.redelivered,
                    )
                )
                last = record.seq

    async def delete(self) -> None:
        while True:
            await self._delete_ready.wait()
            self._delete_ready.clear()
            batch, self._to_delete = self._to_delete, []
            if batch:
                await self.spool.delete([s for s, _ in batch], sum(n for _, n in batch))
            if self._writes_stopped.is_set() and not self._to_delete:
                return
