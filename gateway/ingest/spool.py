"""Durable on-disk spool: the edge host's write-ahead buffer.

With ``[spool] enabled``, every message the broker hands over is appended here
first and acknowledged to the broker once the append is committed; the
pipeline then reads the spool in arrival order, writes to Cassandra, and
deletes records once Cassandra has them (within DELETE_DELAY: a SIGKILL leaves
those to be written again, idempotently). So the gateway keeps taking (and
acknowledging) messages while Cassandra is unreachable or slower than ingest,
and a restart, even after SIGKILL, resumes from what is still spooled.

Why SQLite in WAL mode rather than our own segment files: it gives atomic,
checksummed, fsynced group commits and crash recovery (a torn last write is
rolled back by SQLite, never half-read) for a few hundred lines less code, and
appends plus deletes stay cheap at the rates one edge host sees. Each commit
is one transaction for a whole batch (group commit), fsynced
(``synchronous=FULL``); a message waits up to ``spool.commit_delay`` for
others to share its commit, since each commit rewrites a few 4 KiB pages
however little it holds (SpoolSource._gather). All SQLite calls run on one
dedicated thread.

Bounds: at most ``max_records`` records and ``max_bytes`` of payload (the
last message taken may cross ``max_bytes``, so that one larger than the whole
bound still passes). At the bound the spool source takes no more: it stops
acknowledging and pauses reading, the broker's persistent session holds the
rest, and it says so (a log line at most once a minute, ``spool_state`` in
/healthz, ``gateway_spool_full`` and ``gateway_spool_full_total`` in /metrics).

A full disk (a commit fails with SQLITE_FULL): nothing of that commit is
acknowledged (SQLite rolled it back), and the source keeps the messages,
pauses reading, and retries the commit every :data:`RETRY_MIN` to
:data:`RETRY_MAX` seconds until there is room, keeping its broker session, so
the broker holds the rest meanwhile. It says so too (a log line at most once
a minute, "spool disk full at PATH ..."; ``spool_state`` and /healthz 503;
``gateway_spool_disk_full`` and ``gateway_spool_disk_full_total``). Deletes
that fail so are retried the same way; until they succeed the records stay
spooled, and a restart writes them again (idempotently). Room is counted
with what a checkpoint will need (the main file grows to take in the WAL's
new pages; without that room the WAL can never start over, and every commit
fails): near a full disk the spool checkpoints before it refuses, deletes a
slice per commit, and an empty spool whose WAL still cannot be checkpointed
starts a new file (Spool._renew). Why not stop: the
host may free room at any time, and a gateway that stays up keeps its
session, its metrics and its health answer; a restart loop would only add
log noise and lose nothing more.

The file is ours alone: one holding other tables, or a ``spool`` table of
another shape, is refused at open, untouched. So is one another process has
open (two gateways given one ``spool.path``, say two instances in one working
directory, fed Cassandra from and deleted each other's records, and their
counts drifted apart): an open holds an exclusive lock on ``PATH-lock`` while
it lasts (:meth:`Spool._lock`). A spool file removed or
replaced while open (by hand, by a cleanup job) fails the next commit with a
SpoolError, before anything of it is acknowledged: SQLite would go on
writing to the removed file, and what it acknowledged would be gone at the
next start.

:class:`Spool` is the storage; :class:`SpoolSource` is the pipeline's source
in spool mode (it feeds the same queue as the MQTT receiver does otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from ..errors import SpoolDiskFull, SpoolError
from ..stats import Stats
from ..units import utc_text
from .pipeline import Flow
from .receive import Delivery

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between commits retried on a full disk: doubling from the first to the second.
RETRY_MIN = 0.5
RETRY_MAX = 5.0
# The bound and the full disk are each logged at most this often (the status
# line, /healthz and /metrics say the rest).
LOG_EVERY = 60.0
# Room kept for deletes (each needs WAL room; without it a spool that filled
# its own file system could never delete what Cassandra has, and stayed full
# for good): appends leave this much free (takes), and a reserve file
# of this size beside the spool (PATH-reserve) is given back to deletes that
# meet a disk filled by something else.
RESERVE_BYTES = 512 * 1024
# An emptied spool file gives its free pages back when they are this many bytes.
SHRINK_ABOVE = 8 * 1024 * 1024
# The WAL is checkpointed at this many pages (of 4 KiB; SQLite's default is
# 1,000) and cut back to RESERVE_BYTES after: on a small file system a WAL of
# 4 MB took room the spooled messages needed (about 11 KB per message on 2 MB).
WAL_PAGES = 128
# Records deleted per commit near a full disk (Spool._delete_in_room).
RESERVE_SLICE = 50
# Group commits (SpoolSource): a commit's worth of deliveries, which commits
# without waiting out spool.commit_delay. Deletes wait DELETE_DELAY seconds
# for others, or until DELETE_ENOUGH are due: nothing waits for them but room
# (one a commit wrote 12 KB per message, ten 3.3 KB:
# bench/spool_commit_bytes.py), and what a crash leaves undeleted is written
# again, idempotently.
GROUP_ENOUGH = 256
DELETE_DELAY = 1.0
DELETE_ENOUGH = 1000
# Why a delete waits: a reader keeps the WAL from being checkpointed.
HELD = "held"
# A spooled record's bytes beyond its payload: its topic, times and cell.
RECORD_OVERHEAD = 128
# Seqs bound in one DELETE (SQLite allows 32,766 variables).
SQL_VARIABLES = 500
# sqlite3.connect's own (timeout=5.0), kept but while Spool._checkpoint runs.
BUSY_TIMEOUT_MS = 5000
# What a commit writes into the WAL beyond its payload: the b-tree pages it
# touches, sqlite_sequence's, and each frame's header.
COMMIT_SLACK = 16 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spool (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    received_ms  INTEGER NOT NULL,
    topic        TEXT NOT NULL,
    content_type TEXT,
    payload      BLOB NOT NULL,
    redelivered  INTEGER NOT NULL DEFAULT 0,
    received_us  INTEGER
)
"""

# What a spool table has had from the start (redelivered and received_us came later).
_COLUMNS = frozenset({"seq", "received_ms", "topic", "content_type", "payload"})

# Spools written before the DUP flag was kept get the column (false) on open,
# and those written before the receive time was kept to the µs get that one
# (null: their events without ts are ordered by the hash tie-break, as then).
_ADD_REDELIVERED = "ALTER TABLE spool ADD COLUMN redelivered INTEGER NOT NULL DEFAULT 0"
_ADD_RECEIVED_US = "ALTER TABLE spool ADD COLUMN received_us INTEGER"

# (received_ms, topic, content_type, payload[, flags[, received_us]]): the
# flags are the redelivered column, REDELIVERED | RETAINED (spools before
# RETAINED hold 0 or 1); received_us is Delivery.received_us.
Appended = (
    tuple[int, str, str | None, bytes]
    | tuple[int, str, str | None, bytes, int]
    | tuple[int, str, str | None, bytes, int, int]
)
REDELIVERED = 1  # MQTT DUP
RETAINED = 2  # a retained copy sent because we subscribed


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    received_ms: int
    topic: str
    content_type: str | None
    payload: bytes
    redelivered: bool = False
    retained: bool = False
    received_us: int = 0  # 0: not kept (an older spool's record)


class Peeked(NamedTuple):
    """What a spool file holds, read without opening it for writing."""

    depth: int  # messages
    size: int  # payload bytes
    oldest_ms: int | None  # the oldest message's receive time
    freed: int  # bytes of pages that deletes freed inside the file (appends reuse them)
    owed: int  # bytes the file grows by to take in its WAL's new pages (see takes)


def peek(path: Path, *, verify: bool = False) -> Peeked | None:
    """A spool file's contents, read only; None when there is no file.
    Raises sqlite3.Error when it cannot be read, or with ``verify`` (SQLite's
    ``quick_check``, a read of every page: `gateway check`) when it is damaged."""
    if not path.exists():
        return None
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        if verify:
            problems = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                # On one line: a report can hold several ("*** in database
                # main ***\nOn tree page 11 ..."), and check's line was cut.
                error = sqlite3.DatabaseError("; ".join(" ".join(p.split()) for p in problems))
                error.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
                raise error
        depth, size, oldest = db.execute(
            "SELECT count(*), coalesce(sum(length(payload)), 0), min(received_ms) FROM spool"
        ).fetchone()
        owed, freed = _pages(db, path)
        return Peeked(int(depth), int(size), oldest, freed, owed)


def room_needed(payload: int) -> int:
    """The room (free bytes on the file system, plus pages that deletes freed
    inside the spool) an append of ``payload`` bytes needs: it leaves the
    deletes room for their WAL. A spool that filled its own file system could
    otherwise never delete what Cassandra has (each delete needs WAL room),
    and stayed full."""
    return RESERVE_BYTES + 2 * payload


def takes(free: int, freed: int, payload: int) -> bool:
    """Whether an append of ``payload`` bytes is taken: ``free`` is the bytes
    free on the file system less what a checkpoint will grow the file by
    (Peeked.owed), ``freed`` the pages deletes freed inside it. It must leave
    the deletes their room (room_needed), and the next checkpoint the room
    to complete: the commit's WAL frames take up to about 1.4 times its
    payload of disk (449 KB for 336 KB of messages), and the file may grow by
    as much again to take them in. Without that room no
    checkpoint could complete, the WAL could never start over, and every
    commit needed it to grow: a spool that filled its own disk sat empty with
    a 1 MB WAL, refusing every message for good. `gateway check` applies the
    same rule."""
    return free + freed >= room_needed(payload) and free >= disk_needed(payload)


def disk_needed(payload: int) -> int:
    """The free disk, beyond what the next checkpoint takes, an append of
    ``payload`` bytes needs (:func:`takes`)."""
    return 3 * payload + 2 * COMMIT_SLACK


def nearest_existing(path: Path) -> Path | None:
    """``path`` or the nearest of its parents that exists (the gateway makes
    a spool's missing directories), or None."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


READ_ONLY_WHY = " (remounted so after disk errors, or outside a systemd service's ReadWritePaths=)"


def unwritable(path: Path) -> str | None:
    """Why the spool at ``path`` cannot be written, naming what is in the way,
    or None: its file system mounted read-only (a failing SD card the kernel
    remounted read-only looks exactly like this), or its file, or the
    directory it is or will be made in (the gateway makes missing ones), not
    writable by this user. SQLite opens such a file read-only, and the first
    commit would be refused. `gateway check` asks the same, file or no file."""
    where = nearest_existing(path)
    if where is None:
        return None
    with contextlib.suppress(OSError):
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            mount = where  # named by where it is mounted
            while mount != mount.parent and os.stat(mount.parent).st_dev == os.stat(mount).st_dev:
                mount = mount.parent
            # Or a sandbox's: under ProtectSystem=strict (deploy/systemd)
            # everything outside ReadWritePaths= and the StateDirectory is.
            return f"{mount} is a read-only file system" + READ_ONLY_WHY
    # The file, and the directory SQLite makes its -wal and -shm files in.
    for what in (path, path.parent) if where == path else (where,):
        if what.exists() and not os.access(what, os.W_OK):
            return f"{what} is not writable by this user"
    return None


def _pages(db: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """(owed, freed): the bytes the file at ``path`` grows by when a
    checkpoint writes the WAL's pages past its end into it, and those of the
    pages deletes freed inside it (appends reuse them first)."""
    pages, page_size, free_pages = db.execute(
        "SELECT * FROM pragma_page_count(), pragma_page_size(), pragma_freelist_count()"
    ).fetchone()
    owed = max(0, int(pages) * int(page_size) - os.stat(path).st_size)
    return owed, int(free_pages) * int(page_size)


def _full(exc: sqlite3.Error | OSError) -> bool:
    """Whether ``exc`` is SQLite's SQLITE_FULL: a write met a full disk."""
    return isinstance(exc, sqlite3.Error) and exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_FULL


def damaged(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file is damaged (or is no SQLite file at all)."""
    return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def what_to_do_with_damaged(path: Path) -> str:
    """What an operator does with a damaged spool file: the messages in it
    were acknowledged to the broker and are in no other place."""
    # With its WAL: a SIGKILLed gateway's newest commits are only there, and
    # a WAL left under the old name was dropped by the next start (161 of 500
    # messages in the probe). `.dump`, not `.recover`: Debian 12's sqlite3
    # (3.40.1) fails `.recover` with "SQL logic error" and gives nothing; and
    # `.dump` of a damaged file ends with ROLLBACK, which sed makes a COMMIT.
    return (
        f"the file is damaged: stop the gateway and move it and its WAL aside (mv {path} "
        f"{path}.damaged; mv {path}-wal {path}.damaged-wal; rm -f {path}-shm); then "
        f"`sqlite3 {path}.damaged .dump | sed '$s/^ROLLBACK; -- due to errors$/COMMIT;/' | "
        f"sqlite3 {path}` (Debian package sqlite3) puts what can still be read into a new "
        "spool, which the next start writes to Cassandra: those messages were acknowledged "
        "to the broker and are in no other place"
    )


def stranded(path: Path) -> str | None:
    """With ``spool.enabled`` false: what to say if a spool file at ``path``
    still holds messages. They were acknowledged to the broker when spooled
    and are nowhere else, so the gateway does not start over them."""
    try:
        found = peek(path)
    except sqlite3.Error as exc:
        if damaged(exc) and path.stat().st_size > 0:
            return (
                f"spool.enabled is false, but the spool {path} cannot be read ({exc}) and may "
                f"hold messages; {what_to_do_with_damaged(path)}"
            )
        return None  # not readable here: nothing of ours known to be stranded
    if found is None or found.depth == 0:
        return None
    return (
        f"spool.enabled is false, but the spool {path} holds {found.depth} messages that were "
        "acknowledged to the broker and are in no other place: run with spool.enabled = "
        "true until `gateway check` shows it empty, or remove the file to drop them"
    )


class _NoHeadroom(Exception):
    """An append would leave the deletes too little room (Spool._append)."""


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
        # Wall times: since when the spool is at its bound, and since when its
        # writes fail for a full disk (None: not so).
        self.full_since: float | None = None
        self.disk_full_since: float | None = None
        # Since when (wall time) a spool reopened by the same process (spool-
        # only mode gave way to the full gateway) was full, or its disk: said
        # already, and its times go on (carry_over).
        self.carried_full: float | None = None
        self.carried_disk: float | None = None
        self._db: sqlite3.Connection | None = None
        self._inode = 0  # the file's, at open: another means it was removed or replaced
        self._wal_inode = 0  # its WAL's, once it exists: the same
        self.reserve = path.with_name(path.name + "-reserve")
        # PATH-lock, its descriptor and inode while open (Spool._lock). Named
        # after the file SQLite opens (it follows symlinks too): two paths to
        # one spool get one lock.
        self.lock = Path(os.path.realpath(path) + "-lock")
        self._lock_fd: int | None = None
        self._lock_inode = 0
        self._reserved = False  # whether the reserve is on disk
        self._seq_floor: int | None = None  # where a new file numbers on from (_renew)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool")
        self._room = asyncio.Event()
        self._room.set()

    async def __aenter__(self) -> Spool:
        try:
            await self._call(self._open)
        except sqlite3.Error as exc:
            self._thread.shutdown(wait=True)
            raise self._error(exc, "opening it") from None
        except OSError as exc:  # its folder cannot be made
            self._thread.shutdown(wait=True)
            raise SpoolError(f"spool {self.path}: opening it failed: {exc}") from None
        except SpoolError:  # not a spool
            self._thread.shutdown(wait=True)
            raise
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

    def carry_over(self, before: Spool) -> None:
        """This file was open a moment ago as ``before`` (spool-only mode,
        spooling.py, gave way to the full gateway, or the gateway closed after
        give_up_after and spools again): since when it is full, or
        its disk is, goes on, and is not reported afresh ("room again after
        0 s"). A disk found full before is taken as still full until a write
        succeeds."""
        if before.full_since is not None and self.full:
            self.full_since = self.carried_full = before.full_since
        if before.disk_full_since is not None:
            self.disk_full_since = self.carried_disk = before.disk_full_since

    def oldest_age(self) -> float:
        """Seconds since the oldest spooled message arrived (0 when empty)."""
        if self._oldest_ms is None or self.depth == 0:
            return 0.0
        return max(0.0, time.time() - self._oldest_ms / 1000)

    def fits(self, sizes: Iterable[int]) -> int:
        """How many of the next messages (their payload sizes) may be taken:
        up to ``max_records``, and while under ``max_bytes``."""
        taken, size = 0, self.bytes
        for payload in sizes:
            if self.depth + taken >= self.max_records or size >= self.max_bytes:
                break
            taken += 1
            size += payload
        return taken

    def state(self) -> str:
        """What /healthz says of the spool: "ok", or why nothing is acknowledged."""
        if self.disk_full_since is not None:
            return (
                f"disk full at {self.path} since {utc_text(self.disk_full_since)}: "
                "acknowledgements paused, retrying"
            )
        if self.full_since is not None:
            return (
                f"full since {utc_text(self.full_since)} ({self.depth} messages, "
                f"{self.bytes} bytes; spool.max_records {self.max_records}, "
                f"spool.max_bytes {self.max_bytes}): acknowledgements paused"
            )
        return "ok"

    async def wait_for_room(self) -> None:
        await self._room.wait()

    async def append(self, records: Sequence[Appended]) -> list[int]:
        """Commit records (:data:`Appended`); their seqs.
        :class:`SpoolDiskFull` if there is no room for them: nothing of them
        was committed. Only a single message refused is
        the disk full (``disk_full_since``, /healthz): a larger commit may
        fit halved (SpoolSource._commit), and /healthz said 503 through
        almost all of each halving."""
        single = len(records) == 1
        what = "a commit of 1 message" if single else f"a commit of {len(records)} messages"
        try:
            seqs: list[int] = await self._call(self._append, list(records))
        except sqlite3.Error as exc:
            raise self._error(exc, what, full=single) from None
        except _NoHeadroom as exc:
            if single and self.disk_full_since is None:
                self.disk_full_since = time.time()
            raise SpoolDiskFull(f"spool disk full at {self.path}: {what} refused ({exc})") from None
        self.disk_full_since = None
        self.depth += len(records)
        self.bytes += sum(len(r[3]) for r in records)
        self.appended += len(records)
        if self._oldest_ms is None and records:
            self._oldest_ms = records[0][0]
        self._update_room()
        return seqs

    async def read(self, after: int, limit: int) -> list[Record]:
        try:
            records: list[Record] = await self._call(self._read, after, limit)
        except sqlite3.Error as exc:
            # A damaged page: it was a traceback, and every restart met it again.
            raise self._error(exc, f"reading the messages after #{after}") from None
        return records

    async def delete(self, seqs: Sequence[int]) -> None:
        """Forget records Cassandra has. :class:`SpoolDiskFull` if the disk
        is full even with the reserve given back: those not deleted yet are
        still there (deleting one again is a no-op)."""
        records, size, failed = await self._call(self._delete_in_room, list(seqs))
        self.depth -= records
        self.bytes -= size
        self.deleted += records
        if failed is not None:
            self._update_room()
            doing = f"deleting {len(seqs) - records} written messages"
            if isinstance(failed, sqlite3.Error):
                raise self._error(failed, doing) from None
            if isinstance(failed, OSError):
                raise SpoolError(f"spool {self.path}: {doing} failed: {failed}") from None
            if self.disk_full_since is None:
                self.disk_full_since = time.time()
            raise SpoolDiskFull(
                f"spool disk full at {self.path}: {doing} waits, as a reader of the spool "
                "(`gateway check`?) keeps its WAL from being checkpointed, and the room left "
                "is what the checkpoint will need"
            ) from None
        if not self._reserved:
            await self._call(self._restore)
        if self.disk_full_since is not None and await self._call(self._has_room):
            # A delete that went through is not room for an append: on a disk
            # another program filled, clearing it here flipped /healthz and
            # the log ("room again ... acknowledging again", then "disk full")
            # at every delete while no append could commit.
            self.disk_full_since = None
        if self.depth == 0:
            self._oldest_ms = None
            await self._call(self._shrink)
        else:
            self._oldest_ms = await self._call(self._oldest)
        self._update_room()

    def _update_room(self) -> None:
        if self.full:
            self._room.clear()
            if self.full_since is None:
                self.full_since = time.time()
        else:
            self._room.set()
            self.full_since = None

    def _error(self, exc: sqlite3.Error, doing: str, *, full: bool = True) -> SpoolError:
        # SQLITE_FULL is what a write meeting ENOSPC returns (SQLite has rolled
        # the transaction back; the connection stays usable); SHMSIZE, the WAL
        # index (the -shm file, grown on open and as the WAL grows) meeting it.
        # ``full``: whether that is the disk full (see append).
        code = exc.sqlite_errorcode
        if code & 0xFF == sqlite3.SQLITE_FULL or code == sqlite3.SQLITE_IOERR_SHMSIZE:
            if full and self.disk_full_since is None:
                self.disk_full_since = time.time()
            return SpoolDiskFull(f"spool disk full at {self.path}: {doing} failed ({exc})")
        if damaged(exc):
            return SpoolError(
                f"spool {self.path}: {doing} failed: {exc}; {what_to_do_with_damaged(self.path)}"
            )
        return SpoolError(f"spool {self.path}: {doing} failed: {exc}")

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- on the spool thread -------------------------------------------------

    def _open(self) -> None:
        # SQLite opens a file it may not write read-only, and the first commit
        # (the first message, the gateway READY by then) would be refused.
        why = unwritable(self.path)
        if why is not None:
            raise SpoolError(f"spool {self.path}: {why}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock()  # before SQLite opens (or makes) the file
        try:
            self._connect()
        except BaseException:
            self._close()
            raise

    def _lock(self) -> None:
        """Take ``PATH-lock`` for as long as this spool is open, or raise
        SpoolError naming the process that has it (its pid is written in it).

        Why flock on a file of its own, not on the database file: SQLite
        locks the database (and its -shm) with POSIX fcntl locks, which a
        process loses on closing *any* descriptor of that file, and which
        flock is emulated with on NFS; a descriptor of ours on the database
        could break SQLite's own locking. A lock file SQLite never touches
        cannot, can be taken before the database exists (two starts on a new
        path do not both make it), and stays put when the database is moved
        aside. flock is released when the descriptor closes (Spool._close)
        and when the process dies, SIGKILL included: a stale file is no lock.
        The file is never removed (removing it would let a second process
        lock a new file while the first still holds the old); one removed
        while open fails the next commit, as the database does (_same_file).
        A read-only look (peek: `gateway check`) takes no lock, so it works
        beside a running gateway, as SQLite's WAL readers do."""
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                pid = ""
            os.close(fd)
            held_by = f" (pid {pid})" if pid.isdigit() else ""
            raise SpoolError(
                f"spool {self.path}: another gateway process{held_by} has it open (it holds "
                f"{self.lock}); two gateways on one spool feed and delete each other's "
                "messages, so this one does not open it: give each gateway instance its own "
                "spool.path"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd, self._lock_inode = fd, os.fstat(fd).st_ino
        with contextlib.suppress(OSError):  # the pid only helps the message above
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _connect(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._check_ours(db)  # before anything is written to the file
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
            db.execute(f"PRAGMA journal_size_limit={RESERVE_BYTES}")
            # Debian's SQLite zeroes every page a delete frees, and so writes
            # it into the WAL: 65 frames, not 45, to delete 426 messages of
            # 530 bytes; room a full disk has not, and wear an SD card need not
            # take. The messages are in Cassandra by then; FAST still zeroes
            # what costs no extra write.
            db.execute("PRAGMA secure_delete=FAST")
            db.execute(_SCHEMA)
            columns = {row[1] for row in db.execute("PRAGMA table_info(spool)")}
            if "redelivered" not in columns:
                db.execute(_ADD_REDELIVERED)
            if "received_us" not in columns:
                db.execute(_ADD_RECEIVED_US)
            count, size, oldest = db.execute(
                "SELECT count(*), coalesce(sum(length(payload)), 0), min(received_ms) FROM spool"
            ).fetchone()
        except BaseException:
            db.close()
            raise
        self.depth, self.bytes, self._oldest_ms = count, size, oldest
        self._inode = os.stat(self.path).st_ino
        self._db = db
        self._note_wal()
        self._restore()

    def _check_ours(self, db: sqlite3.Connection) -> None:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        others = sorted(tables - {"spool", "sqlite_sequence"})
        if others:
            raise SpoolError(
                f"spool {self.path}: not a spool (it holds the tables {', '.join(others)}); "
                "left untouched"
            )
        if "spool" in tables:
            columns = {row[1] for row in db.execute("PRAGMA table_info(spool)")}
            missing = sorted(_COLUMNS - columns)
            if missing:
                raise SpoolError(
                    f"spool {self.path}: not a spool (its spool table has no "
                    f"{', '.join(missing)}); left untouched"
                )

    def _same_file(self) -> None:
        """The file and its WAL are the ones opened: what SQLite writes into a
        removed one is gone at the next start (a removed WAL takes every
        commit since the last checkpoint with it). And its lock: without it
        another process may open the spool too."""
        wal = Path(f"{self.path}-wal")
        for what, known in (
            (self.path, self._inode),
            (wal, self._wal_inode),
            (self.lock, self._lock_inode),
        ):
            if not known:
                continue
            try:
                inode = os.stat(what).st_ino
            except OSError:
                inode = -1
            if inode != known:
                raise SpoolError(
                    f"spool {self.path}: {what} was removed or replaced while open; "
                    "nothing more is acknowledged into it"
                )

    def _note_wal(self) -> None:
        if not self._wal_inode:
            with contextlib.suppress(OSError):
                self._wal_inode = os.stat(f"{self.path}-wal").st_ino

    def _restore(self) -> None:
        """Put the reserve back once there is room for it and as much again
        for the WAL: made sooner, it took the room the WAL's next frames need,
        and appends (and the deletes after them) starved."""
        if self.reserve.exists():
            self._reserved = True
            return
        if shutil.disk_usage(self.path.parent).free < 2 * RESERVE_BYTES:
            return
        try:
            with open(self.reserve, "wb") as out:
                out.write(bytes(RESERVE_BYTES))
                out.flush()
                os.fsync(out.fileno())
            self._reserved = True
        except OSError:
            with contextlib.suppress(OSError):
                self.reserve.unlink()  # a part of one is no reserve; tried again later

    def _close(self) -> None:
        try:
            if self._db is not None:
                self._db.close()
                self._db = None
        finally:
            if self._lock_fd is not None:  # after the database: then another may open it
                os.close(self._lock_fd)
                self._lock_fd = None

    def _append(self, records: list[Appended]) -> list[int]:
        db = self._db
        assert db is not None
        self._same_file()
        payload = sum(len(r[3]) for r in records)
        need = room_needed(payload)
        if not self._fits(payload):
            self._make_room()
            if not self._fits(payload):
                free, freed = self._space()
                raise _NoHeadroom(
                    f"{free + freed} bytes of room, {free} of them free on disk beside what the "
                    f"next checkpoint takes; it needs {need} of room, kept for it and for "
                    f"deletes, and {disk_needed(payload)} free on disk"
                )
            db = self._db  # a new file's, if it started one
            assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            if self._seq_floor is not None:  # a new file (_renew) numbers on
                db.execute("DELETE FROM sqlite_sequence WHERE name = 'spool'")
                db.execute(
                    "INSERT INTO sqlite_sequence (name, seq) VALUES ('spool', ?)",
                    (self._seq_floor,),
                )
            seqs = []
            for record in records:
                cursor = db.execute(
                    "INSERT INTO spool (received_ms, topic, content_type, payload, redelivered, "
                    "received_us) VALUES (?, ?, ?, ?, ?, ?)",
                    (*record, 0, 0)[:6],  # flags and received_us 0 when not given
                )
                assert cursor.lastrowid is not None
                seqs.append(cursor.lastrowid)
            db.execute("COMMIT")
            self._seq_floor = None
            self._note_wal()
        except BaseException:
            # Some errors (SQLITE_FULL among them) roll the transaction back themselves.
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return seqs

    def _space(self) -> tuple[int, int]:
        """(free, freed) as :func:`takes` counts them."""
        db = self._db
        assert db is not None
        owed, freed = _pages(db, self.path)
        return shutil.disk_usage(self.path.parent).free - owed, freed

    def _fits(self, payload: int) -> bool:
        return takes(*self._space(), payload)

    def _has_room(self) -> bool:
        """Whether an append of a small message would find its room now (not
        if that cannot be told: the next append says)."""
        try:
            return self._fits(0)
        except (OSError, sqlite3.Error):
            return False

    def _checkpoint(self) -> Literal["done", "held", "full"]:
        """Checkpoint the whole WAL into the main file and cut the WAL's file
        to nothing: "done"; "held" while another connection's read snapshot
        (`gateway check`) keeps it from completing; "full" when the main file
        cannot grow to take the WAL's pages in."""
        db = self._db
        assert db is not None
        # Not waiting for the reader (sqlite3's default: 5 s): that would hold
        # up the spool thread, and every append and delete behind it.
        db.execute("PRAGMA busy_timeout = 0")
        try:
            (busy, _, _) = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error as exc:
            if _full(exc):
                return "full"
            raise
        finally:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        return "held" if busy else "done"

    def _make_room(self) -> None:
        """An append found too little room: checkpoint the WAL (only here,
        near a full disk, is that worth a commit's wait). If the main file
        cannot grow for it, an empty spool starts a new file; one that holds
        messages waits for the deletes, which have the reserve's room."""
        if self._checkpoint() == "full" and self.depth == 0:
            self._renew()

    def _renew(self) -> None:
        """The spool is empty, but its WAL cannot be checkpointed (the main
        file cannot grow on the full disk) and so cannot start over: start a
        new file. There is nothing in it to lose; the new one numbers on from
        where this one was (in the next append's own commit: the room the
        old one gave back may be taken before), so the feed, which has read up
        to there, misses nothing. The main file goes first: the failed
        checkpoint wrote part of the WAL into it, so alone it is damaged,
        while SQLite deletes a WAL it finds without a main file."""
        db = self._db
        assert db is not None
        (count,) = db.execute("SELECT count(*) FROM spool").fetchone()
        if count:
            return
        row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'spool'").fetchone()
        # The larger: a second renew before any append committed found the
        # first one's empty sqlite_sequence, and numbering started at 1.
        self._seq_floor = max(self._seq_floor or 0, 0 if row is None else int(row[0])) or None
        wal = Path(f"{self.path}-wal")
        size = wal.stat().st_size if wal.exists() else 0
        db.close()
        self._db = None
        for name in (self.path, wal, Path(f"{self.path}-shm")):
            with contextlib.suppress(FileNotFoundError):
                name.unlink()
        self._inode = self._wal_inode = 0
        try:
            self._connect()
        except (sqlite3.Error, OSError) as exc:
            raise SpoolError(f"spool {self.path}: starting a new file failed: {exc}") from None
        log.warning(
            "spool %s: empty, but its WAL (%d bytes) could not be checkpointed on the full "
            "disk, so no message could be taken: started a new file",
            self.path,
            size,
        )

    def _read(self, after: int, limit: int) -> list[Record]:
        db = self._db
        assert db is not None
        rows = db.execute(
            "SELECT seq, received_ms, topic, content_type, payload, redelivered, received_us "
            "FROM spool WHERE seq > ? ORDER BY seq LIMIT ?",
            (after, limit),
        ).fetchall()
        return [
            Record(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                bool(r[5] & REDELIVERED),
                bool(r[5] & RETAINED),
                r[6] or 0,
            )
            for r in rows
        ]

    def _delete_in_room(
        self, seqs: list[int]
    ) -> tuple[int, int, sqlite3.Error | OSError | str | None]:
        """Delete ``seqs``: how many records and payload bytes went, and why
        it stopped short, or None: the error (SQLITE_FULL even on the
        reserve's room, or another), or :data:`HELD`.

        A delete makes the WAL grow, and the main file needs room to take
        the WAL in at a checkpoint; a delete that left it too little meant no
        checkpoint could complete, the WAL could never start over, and every
        delete after it failed (1,227 written messages spooled on a full
        disk, the reserve spent, for good). So near a full disk it
        checkpoints first and deletes a slice per commit; while a reader
        keeps the checkpoint from completing it waits rather than take that
        room; and a delete that meets a full disk gives the reserve back to
        the file system and goes on on its room, then puts it back if there
        is room for it. All on the spool thread, so no append takes the room
        meanwhile."""
        records = size = 0
        self._same_file()
        pending = [seqs]
        while pending:
            part = pending[0]
            try:
                if self._space()[0] < self._wal_for(len(part)):
                    if len(part) > RESERVE_SLICE:  # near a full disk: a slice per commit
                        pending = _sliced([seq for later in pending for seq in later])
                        continue
                    if self._checkpoint() == "held":
                        return records, size, HELD
                gone, payload = self._delete(part)
            except (sqlite3.Error, OSError) as exc:
                if not _full(exc) or not self._reserved:
                    return records, size, exc
                with contextlib.suppress(FileNotFoundError):
                    self.reserve.unlink()
                self._reserved = False
                log.warning(
                    "spool disk full at %s: gave back its reserve of %d bytes, so that "
                    "what Cassandra has can be deleted",
                    self.path,
                    RESERVE_BYTES,
                )
                pending = _sliced([seq for later in pending for seq in later])
                continue
            records, size = records + gone, size + payload
            del pending[0]
        return records, size, None

    def _wal_for(self, records: int) -> int:
        """The WAL a delete of ``records`` may take, at most: four times
        their bytes, on average. Not just the pages they are on: the b-tree
        rebalances, and writes their neighbours too (544 KB of WAL to delete
        323 messages of 530 bytes; at twice, the checkpoint after it found no
        room to complete, and no delete got through again)."""
        record = self.bytes // max(1, self.depth) + RECORD_OVERHEAD
        return 4 * records * record + COMMIT_SLACK

    def _delete(self, seqs: list[int]) -> tuple[int, int]:
        """Delete ``seqs`` in one commit: how many records and payload bytes
        went (one deleted before is no longer there, and not counted)."""
        db = self._db
        assert db is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            records = size = 0
            for part in _sliced(seqs, SQL_VARIABLES):
                where = f"WHERE seq IN ({','.join('?' * len(part))})"
                # Counted first (RETURNING needs SQLite 3.35; Ubuntu 20.04 has 3.31).
                found, payload = db.execute(
                    f"SELECT count(*), coalesce(sum(length(payload)), 0) FROM spool {where}", part
                ).fetchone()
                db.execute(f"DELETE FROM spool {where}", part)
                records, size = records + found, size + payload
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return records, size

    def _shrink(self) -> None:
        """Empty, give the file's free pages back to the file system once
        they are many: a file that held an outage kept its size for good
        (7.9 MB for 50,000 records, 0 in it), room an SD card's other users
        (the broker's store, the journal) needed."""
        db = self._db
        assert db is not None
        try:
            if self._space()[1] < SHRINK_ABOVE:
                return
            before = self.path.stat().st_size
            db.execute("VACUUM")  # of an empty table: a moment, and little room
            self._checkpoint()
            after = self.path.stat().st_size
        except (sqlite3.Error, OSError) as exc:  # no room for it, say: it stays as large
            log.info("spool %s: empty, but not shrunk (%s)", self.path, exc)
            return
        log.info("spool %s: empty, shrunk from %d to %d bytes", self.path, before, after)

    def _oldest(self) -> int | None:
        db = self._db
        assert db is not None
        # The first in spool order (min(received_ms) scanned the whole table,
        # after every delete: 117 ms at a million records).
        row = db.execute("SELECT received_ms FROM spool ORDER BY seq LIMIT 1").fetchone()
        return None if row is None else row[0]


class _Deleted:
    """A spooled message is done once Cassandra has it: queue its delete."""

    __slots__ = ("_seq", "_source")

    def __init__(self, source: SpoolSource, seq: int) -> None:
        self._source, self._seq = source, seq

    @property
    def comes_back(self) -> bool:
        """Its record stays spooled until done(), and a restart replays it."""
        return True

    def done(self) -> None:
        self._source.written(self._seq)


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
        queue_size: int,
        commit_delay: float = 0.0,
        receive_maximum: int = 65535,
    ) -> None:
        """``commit_delay``: how long a delivery may wait for others to share
        its commit (spool.commit_delay); ``receive_maximum``: how many the
        broker sends unacknowledged (mqtt.receive_maximum), so that many
        commit at once, as nothing more comes until they are."""
        self.spool = spool
        self._pipeline = pipeline
        self._flow = flow
        self._stats = stats
        self._inbox: list[Delivery] = []
        self._inbox_limit = queue_size
        self._inbox_ready = asyncio.Event()
        # Group commits: set when the inbox holds a commit's worth, or the
        # source closes, or the gateway stops (nothing more comes: _gather).
        self._commit_delay = commit_delay
        self._group = min(GROUP_ENOUGH, queue_size, receive_maximum)
        self._grouped = asyncio.Event()
        self._spooled = asyncio.Event()
        self._to_delete: list[int] = []
        self._delete_ready = asyncio.Event()
        self._delete_now = asyncio.Event()
        self._closing = False
        self._closed = asyncio.Event()
        self._writes_stopped = asyncio.Event()
        # Monotonic times: the last log line about the bound and about the full
        # disk, and since when each was reported (None: not now).
        self._full_logged = -math.inf
        self._full_reported: float | None = None
        self._disk_logged = -math.inf
        self._disk_reported: float | None = None
        # Carried over from spool-only mode: said already, and since then.
        now, wall = time.monotonic(), time.time()
        if spool.carried_full is not None:
            self._full_logged = now
            self._full_reported = now - (wall - spool.carried_full)
        if spool.carried_disk is not None:
            self._disk_logged = now
            self._disk_reported = now - (wall - spool.carried_disk)

    def accept(self, delivery: Delivery) -> None:
        """The receiver's handler: append first, acknowledge once committed."""
        inbox = self._inbox
        inbox.append(delivery)
        self._inbox_ready.set()
        if len(inbox) >= self._group:
            self._grouped.set()
            if len(inbox) >= self._inbox_limit:
                self._flow.pause_reading()

    def close(self) -> None:
        """No more deliveries: append what the inbox holds, stop feeding.
        What is spooled stays spooled until the next start."""
        self._closing = True
        self._closed.set()
        self._inbox_ready.set()
        self._grouped.set()
        self._spooled.set()

    def writes_stopped(self) -> None:
        """The writers are done: delete what they finished, then stop."""
        self._writes_stopped.set()
        self._delete_ready.set()
        self._delete_now.set()

    def written(self, seq: int) -> None:
        to_delete = self._to_delete
        to_delete.append(seq)
        self._delete_ready.set()
        if len(to_delete) >= DELETE_ENOUGH:
            self._delete_now.set()

    async def append(self, stopping: asyncio.Event | None = None) -> None:
        """Commit and acknowledge deliveries until closed; once ``stopping``
        is set (the receiver takes no more and waits for its acknowledgements)
        nothing waits out spool.commit_delay."""
        if stopping is not None:
            stopped = asyncio.ensure_future(stopping.wait())
            stopped.add_done_callback(lambda _: self._grouped.set())
        try:
            await self._append(stopping)
        finally:
            if stopping is not None:
                stopped.cancel()

    async def _append(self, stopping: asyncio.Event | None) -> None:
        while True:
            await self._inbox_ready.wait()
            self._inbox_ready.clear()
            if not self._inbox:
                if self._closing:
                    return
                continue
            if not (stopping is not None and stopping.is_set()):
                await self._gather()
            if not await self._room():
                return  # stopping while full: the inbox is unacknowledged, redelivered later
            # No more than the bound allows (at least one: there is room).
            taken = self.spool.fits(len(d.payload) for d in self._inbox)
            taken = await self._commit(self._inbox[:taken])
            if not taken:
                return  # stopping while the disk is full: as above
            batch = self._inbox[:taken]
            del self._inbox[:taken]  # deliveries that arrived meanwhile stay behind
            if len(self._inbox) < self._group:
                self._grouped.clear()
            for delivery in batch:
                delivery.ack.done()
            self._spooled.set()
            # Full now: nothing more can arrive while reads are paused, so wait
            # for room here, then read again.
            if not await self._room():
                return
            self._flow.resume_reading()
            if self._inbox or self._closing:
                # Go round again: close()'s wake-up may have been used up by
                # this commit, and nothing else would end the wait.
                self._inbox_ready.set()

    async def _gather(self) -> None:
        """Wait until the inbox's oldest delivery has waited ``commit_delay``
        since it was received, unless the inbox holds a commit's worth
        (GROUP_ENOUGH, or mqtt.receive_maximum) or the source closes: commits
        of one message each wrote 14 KB per message, and of ten 3.3 KB
        (bench/spool_commit_bytes.py). The wait is clamped to the delay, so a
        step of the wall clock costs at most one delay."""
        waited = time.time() - self._inbox[0].received_ms / 1000
        wait = min(self._commit_delay, self._commit_delay - waited)
        if wait > 0 and not (self._grouped.is_set() or self._closing):
            await _sleep_unless(self._grouped, wait)

    async def _commit(self, batch: list[Delivery]) -> int:
        """Commit the first of ``batch`` to the spool; how many (at least one),
        or 0 if the source is closed first (nothing of it committed). A
        commit refused for room is tried again at once with half as many
        messages, down to one: a little room left (deletes freed pages) takes
        a small commit, never a large one. Only a single message refused is
        the disk full (said, counted, and retried after a wait): each halving
        of a backlog's 2,000-message commit said "disk full", then "room
        again after 0 s", and waited half a second."""
        records: list[Appended] = [
            (
                d.received_ms,
                d.topic,
                d.content_type,
                d.payload,
                (REDELIVERED if d.redelivered else 0) | (RETAINED if d.retained else 0),
                d.received_us,
            )
            for d in batch
        ]
        delay = RETRY_MIN
        while True:
            try:
                await self.spool.append(records)
            except SpoolDiskFull as exc:
                self._delete_now.set()  # what deletes free is room
                if len(records) > 1:
                    records = records[: len(records) // 2]
                    continue
                self._flow.pause_reading()  # the broker keeps the rest meanwhile
                self._disk_full(exc, "not acknowledged, the broker keeps them in our session")
                if not await _sleep_unless(self._closed, delay):
                    return 0
                delay = min(RETRY_MAX, 2 * delay)
                continue
            self._disk_room()
            return len(records)

    async def _room(self) -> bool:
        """Wait until the spool has room (True), or the source is closed (False)."""
        spool = self.spool
        if not spool.full:
            return True
        self._flow.pause_reading()  # the broker keeps the rest until there is room
        self._delete_now.set()  # what deletes free is room
        self._stats.spool_full_waits += 1
        now = time.monotonic()
        if now - self._full_logged >= LOG_EVERY:
            self._full_logged = now
            if self._full_reported is None:
                self._full_reported = now
            log.warning(
                "spool full at %s (%d messages, %d bytes; spool.max_records %d, "
                "spool.max_bytes %d): not acknowledging until Cassandra drains it; "
                "the broker holds the rest in our session (times full so far: %d)",
                spool.path,
                spool.depth,
                spool.bytes,
                spool.max_records,
                spool.max_bytes,
                self._stats.spool_full_waits,
            )
        room = asyncio.ensure_future(spool.wait_for_room())
        closed = asyncio.ensure_future(self._closed.wait())
        await asyncio.wait((room, closed), return_when=asyncio.FIRST_COMPLETED)
        room.cancel()
        closed.cancel()
        if spool.full:
            return False
        if self._full_reported is not None:
            log.warning(
                "spool has room again at %s after %.0f s (%d messages): acknowledging again",
                spool.path,
                time.monotonic() - self._full_reported,
                spool.depth,
            )
            self._full_reported = None
        return True

    def _disk_full(self, exc: SpoolDiskFull, what: str) -> None:
        self._stats.spool_disk_full += 1
        now = time.monotonic()
        if now - self._disk_logged >= LOG_EVERY:
            self._disk_logged = now
            if self._disk_reported is None:
                self._disk_reported = now
            log.warning(
                "%s: %s; retrying until there is room (spool writes refused so far: %d)",
                exc,
                what,
                self._stats.spool_disk_full,
            )

    def _disk_room(self) -> None:
        if self._disk_reported is not None:
            log.warning(
                "spool disk has room again at %s after %.0f s: acknowledging again",
                self.spool.path,
                time.monotonic() - self._disk_reported,
            )
            self._disk_reported = None
            self._disk_logged = -math.inf  # the next time is logged at once

    async def feed(self) -> None:
        last = 0
        while not self._closing:
            # Cleared before reading, so an append during the read is not missed.
            self._spooled.clear()
            # A queue's worth at a time, so that a spooled backlog keeps the
            # queue full whatever the chunk size (a chunk leaves a device's
            # latest rows to its newer event queued behind it:
            # Pipeline._note_queued).
            records = await self.spool.read(last, self._inbox_limit)
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
                        _Deleted(self, record.seq),
                        record.redelivered,
                        record.retained,
                        record.received_us,
                    )
                )
                last = record.seq

    async def delete(self) -> None:
        delay = RETRY_MIN
        spool = self.spool
        while True:
            await self._delete_ready.wait()
            # Grouped (DELETE_DELAY), but at once when the spool or its disk
            # is full: appends wait for the room deletes make.
            if not (spool.full or spool.disk_full_since is not None):
                await _sleep_unless(self._delete_now, DELETE_DELAY)
            self._delete_now.clear()
            self._delete_ready.clear()
            batch, self._to_delete = self._to_delete, []
            if batch:
                try:
                    await self.spool.delete(batch)
                except SpoolDiskFull as exc:
                    # Written, still spooled: deleted later, or written again
                    # (idempotently) after a restart.
                    self._to_delete[:0] = batch
                    self._disk_full(exc, "they stay spooled until deleted")
                    if not await _sleep_unless(self._writes_stopped, delay):
                        return
                    delay = min(RETRY_MAX, 2 * delay)
                    self._delete_ready.set()
                    self._delete_now.set()
                    continue
                delay = RETRY_MIN
                if self.spool.disk_full_since is None:
                    self._disk_room()
            if self._writes_stopped.is_set() and not self._to_delete:
                return


def _sliced(seqs: list[int], size: int = RESERVE_SLICE) -> list[list[int]]:
    return [seqs[at : at + size] for at in range(0, len(seqs), size)]


async def _sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``, unless ``event`` is set first (False)."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return True
    return False
