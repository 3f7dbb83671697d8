"""The on-disk spool: on its own, across a SIGKILL, and in the gateway while
Cassandra is away (through the cuttable proxy of helpers.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson
import pytest

from gateway.errors import SpoolError
from gateway.ingest import spool as spool_module
from gateway.ingest.receive import Delivery
from gateway.ingest.spool import (
    DELETE_ENOUGH,
    GROUP_ENOUGH,
    Appended,
    Record,
    Spool,
    SpoolSource,
    peek,
)
from gateway.stats import Stats
from gateway.store.database import Database

from .helpers import (
    Acks,
    Unfed,
    Unpaused,
    device_row,
    make_config,
    proxy,
    publish,
    running_gateway,
    telemetry_keys,
    topic,
)


async def test_append_read_delete_in_order_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite"
    async with Spool(path, 1000, 10**6) as spool:
        seqs = await spool.append([(i, f"t/{i}", None, b"x" * i) for i in range(1, 11)])
        assert seqs == sorted(seqs)
        assert (spool.depth, spool.bytes) == (10, 55)
        first = await spool.read(0, 4)
        assert [r.topic for r in first] == ["t/1", "t/2", "t/3", "t/4"]
        await spool.delete([r.seq for r in first])
    async with Spool(path, 1000, 10**6) as spool:  # what was not deleted survives
        assert (spool.depth, spool.bytes) == (6, 45)
        rest = await spool.read(0, 100)
        assert [r.topic for r in rest] == [f"t/{i}" for i in range(5, 11)]


class _SlowSpool(Spool):
    """A disk whose fsync takes 0.3 s (an SD card)."""

    async def append(self, records: Sequence[Appended]) -> list[int]:
        await asyncio.sleep(0.3)
        return await super().append(records)


async def test_an_emptied_spool_gives_its_room_back(tmp_path: Path) -> None:
    """A spool file kept the size of its largest outage for good: 7.9 MB for
    50,000 records, 0 left in it (edge review). Emptied with more than
    SHRINK_ABOVE free in it, it shrinks; a small one is left as it is."""
    path = tmp_path / "spool.sqlite"
    async with Spool(path, 1000, 1 << 30) as spool:
        seqs = await spool.append([(1, "t/a", None, os.urandom(1 << 20))] * 12)
        assert path.stat().st_size > 12 << 20
        await spool.delete(seqs[:6])
        assert path.stat().st_size > 12 << 20  # not empty: kept
        await spool.delete(seqs[6:])
        assert path.stat().st_size < 1 << 20
        assert (await spool.append([(2, "t/a", None, b"{}")])) == [seqs[-1] + 1]
    async with Spool(path, 1000, 1 << 30) as spool:
        assert spool.depth == 1
        seqs = await spool.append([(3, "t/a", None, os.urandom(1 << 20))] * 2)
        size = path.stat().st_size
        await spool.delete([seqs[0] - 1, *seqs])
        assert path.stat().st_size == size  # 2 MB free in it: under SHRINK_ABOVE


async def test_a_delete_counts_only_what_it_removed(tmp_path: Path) -> None:
    """Deletes are retried whole after a full disk stopped them part-way
    (their slices commit one by one): the depth and bytes went down by the
    whole batch again, and drifted below what the file held. They now go down
    by what each delete removed."""
    async with Spool(tmp_path / "spool.sqlite", 1000, 10**6) as spool:
        seqs = await spool.append([(i, "t/a", None, b"x" * i) for i in range(1, 11)])
        await spool.delete(seqs[:4])
        assert (spool.depth, spool.bytes, spool.deleted) == (6, 45, 4)
        await spool.delete(seqs[:6])  # the first four again
        assert (spool.depth, spool.bytes, spool.deleted) == (4, 34, 6)
        assert [r.seq for r in await spool.read(0, 100)] == seqs[6:]


async def test_closing_during_a_commit_with_a_delivery_behind_it_does_not_hang(
    tmp_path: Path,
) -> None:
    """close() while a slow commit was under way and another delivery had come
    in: append() committed that one too, then waited for ever, close()'s
    wake-up used up; the gateway never left spool mode, nor stopped."""
    acks = Acks()
    async with _SlowSpool(tmp_path / "s.sqlite", 1000, 10**6) as spool:
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 100)
        task = asyncio.create_task(source.append())
        source.accept(Delivery("t/0", b"0", None, 1000, acks.of("t/0")))
        await asyncio.sleep(0.1)  # its commit is under way
        source.accept(Delivery("t/1", b"1", None, 1001, acks.of("t/1")))
        source.close()
        async with asyncio.timeout(5):
            await task
        assert acks.done == ["t/0", "t/1"]
        assert spool.depth == 2


class _CountingSpool(Spool):
    """The spool, its commits counted: appends' sizes and when each began and
    ended, and deletes' sizes and when each began."""

    def __init__(self, path: Path, max_records: int, max_bytes: int) -> None:
        super().__init__(path, max_records, max_bytes)
        self.appends: list[tuple[float, int]] = []
        self.ended: list[float] = []
        self.deletes: list[tuple[float, int]] = []

    async def append(self, records: Sequence[Appended]) -> list[int]:
        self.appends.append((time.monotonic(), len(records)))
        try:
            return await super().append(records)
        finally:
            self.ended.append(time.monotonic())

    async def delete(self, seqs: Sequence[int]) -> None:
        self.deletes.append((time.monotonic(), len(seqs)))
        await super().delete(seqs)


class _TimedAck:
    comes_back = True

    def __init__(self, at: list[float]) -> None:
        self._at = at

    def done(self) -> None:
        self._at.append(time.monotonic())


def _now(topic: str, acked: list[float]) -> Delivery:
    """A delivery received now (spool.commit_delay counts from then)."""
    return Delivery(topic, b"x" * 100, None, int(time.time() * 1000), _TimedAck(acked))


async def test_deliveries_a_little_apart_share_a_commit_within_the_delay(tmp_path: Path) -> None:
    """A commit rewrites a few 4 KiB pages however little it holds: at 100
    msg/s one message a commit wrote 20.8 KB per message. With
    spool.commit_delay a delivery waits that long for others, no longer.
    (Without it each of these 20 deliveries, 10 ms apart, had a commit of
    its own.)"""
    delay = 0.15
    acked: list[float] = []
    accepted: list[float] = []
    spool = _CountingSpool(tmp_path / "s.sqlite", 1000, 10**6)
    async with spool:
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 1000, delay)
        task = asyncio.create_task(source.append())
        for n in range(20):
            accepted.append(time.monotonic())
            source.accept(_now(f"t/{n}", acked))
            await asyncio.sleep(0.01)
        async with asyncio.timeout(5):
            while len(acked) < 20:  # noqa: ASYNC110 - waiting for the commits
                await asyncio.sleep(0.01)
        source.close()
        await task
    sizes = [n for _, n in spool.appends]
    assert sum(sizes) == 20
    # 0.15 s of the 0.2 s each (more on a loaded box, whose sleeps run long).
    spread = accepted[-1] - accepted[0]
    assert len(sizes) <= math.ceil(spread / delay) + 1, (sizes, spread)
    # Each commit began once its first delivery had waited the delay (less
    # the millisecond received_ms drops), or once the commit before it ended,
    # and not much later (a loaded box's slack).
    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    ready = [accepted[first] + delay for first in firsts]
    ready = [max(at, end) for at, end in zip(ready, [0.0, *spool.ended], strict=False)]
    began = [at for at, _ in spool.appends]
    assert began[0] >= ready[0] - 0.002, (began, ready)
    late = [b - r for b, r in zip(began, ready, strict=True)]
    assert max(late) < 0.1, late


async def test_a_commits_worth_does_not_wait_out_the_delay(tmp_path: Path) -> None:
    """GROUP_ENOUGH deliveries commit at once, and so do as many as the
    broker sends unacknowledged, and whatever waits once the source closes
    or the gateway stops. (At once: well within the 3 s delay, with room
    for a loaded box's fsyncs.)"""
    acked: list[float] = []
    spool = _CountingSpool(tmp_path / "s.sqlite", 10_000, 10**7)

    async def committed(count: int, began: float) -> float:
        async with asyncio.timeout(5):
            while len(acked) < count:  # noqa: ASYNC110 - waiting for the commit
                await asyncio.sleep(0.01)
        return acked[-1] - began

    async with spool:
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 1000, commit_delay=3.0)
        task = asyncio.create_task(source.append())
        began = time.monotonic()
        for n in range(GROUP_ENOUGH):
            source.accept(_now(f"t/{n}", acked))
        assert await committed(GROUP_ENOUGH, began) < 1.5
        assert [n for _, n in spool.appends] == [GROUP_ENOUGH]
        source.close()
        await task
        # mqtt.receive_maximum (10): the broker sends no more until they are
        # acknowledged, so waiting would stall every commit.
        acked.clear()
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 1000, 3.0, receive_maximum=10)
        task = asyncio.create_task(source.append())
        began = time.monotonic()
        for n in range(10):
            source.accept(_now(f"u/{n}", acked))
        assert await committed(10, began) < 1.5
        # Closed while one waits out the delay.
        source.accept(_now("u/10", acked))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        source.close()
        async with asyncio.timeout(1.5):
            await task
        assert await committed(11, began) < 1.5
        # The gateway stopping: the receiver waits for its acknowledgements.
        acked.clear()
        stopping = asyncio.Event()
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 1000, commit_delay=3.0)
        task = asyncio.create_task(source.append(stopping))
        source.accept(_now("v/0", acked))
        await asyncio.sleep(0.05)
        began = time.monotonic()
        stopping.set()
        assert await committed(1, began) < 1.5
        source.accept(_now("v/1", acked))  # under way as it stopped: not held either
        assert await committed(2, began) < 1.5
        source.close()
        await task


async def test_deletes_are_grouped_unless_the_spool_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deletes wait DELETE_DELAY (1 s; 3 s here, so that "at once" has room
    for a loaded box's fsyncs), or DELETE_ENOUGH due, whatever
    spool.commit_delay says: but at once when the spool is full, since
    appends wait for the room they make, and when the writers stop."""
    monkeypatch.setattr(spool_module, "DELETE_DELAY", 3.0)
    spool = _CountingSpool(tmp_path / "s.sqlite", 40, 10**6)
    async with spool:
        seqs = await spool.append([(n, f"t/{n}", None, b"x") for n in range(30)])
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 100)
        deletes = asyncio.create_task(source.delete())
        for seq in seqs[:20]:
            source.written(seq)
            await asyncio.sleep(0.01)
        async with asyncio.timeout(5):
            while spool.depth > 10:  # noqa: ASYNC110 - waiting for the delete
                await asyncio.sleep(0.01)
        assert [n for _, n in spool.deletes] == [20], spool.deletes  # 0.2 s of 3 s
        # Full already: at once.
        seqs += await spool.append([(n, f"t/{n}", None, b"x") for n in range(30)])
        assert spool.full
        full = time.monotonic()
        source.written(seqs[20])
        async with asyncio.timeout(5):
            while spool.full:  # noqa: ASYNC110 - waiting for the delete
                await asyncio.sleep(0.01)
        assert spool.deletes[-1][0] - full < 1.5, spool.deletes[-1][0] - full
        # Asleep when the spool fills: an append waiting for room wakes it.
        source.written(seqs[21])
        await asyncio.sleep(0.05)
        assert len(spool.deletes) == 2
        await spool.append([(1, "t/1", None, b"x")])
        assert spool.full
        acked: list[float] = []
        appends = asyncio.create_task(source.append())
        waiting = time.monotonic()
        source.accept(_now("t/new", acked))
        async with asyncio.timeout(5):
            while not acked:  # noqa: ASYNC110 - waiting for the room and the commit
                await asyncio.sleep(0.01)
        assert acked[0] - waiting < 1.5, acked[0] - waiting
        # Full again: one more at once makes room, then one that sleeps.
        source.written(seqs[22])
        async with asyncio.timeout(5):
            while spool.full:  # noqa: ASYNC110 - waiting for the delete
                await asyncio.sleep(0.01)
        source.written(seqs[23])
        await asyncio.sleep(0.05)
        assert len(spool.deletes) == 4, spool.deletes
        # Asleep when the writers stop: at once, and the task ends.
        stopped = time.monotonic()
        source.writes_stopped()
        async with asyncio.timeout(5):
            await deletes
        assert time.monotonic() - stopped < 1.5
        assert len(spool.deletes) == 5, spool.deletes
        assert spool.depth == 62 - 24  # 30 + 30 + 1 + 1 appended; 20 + 1 + 1 + 1 + 1 deleted
        source.close()
        await appends
    # DELETE_ENOUGH due: at once.
    async with Spool(tmp_path / "t.sqlite", 10_000, 10**7) as spool:
        seqs = await spool.append([(n, f"t/{n}", None, b"x") for n in range(DELETE_ENOUGH)])
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 100)
        deletes = asyncio.create_task(source.delete())
        due = time.monotonic()
        for seq in seqs:
            source.written(seq)
        async with asyncio.timeout(5):
            while spool.depth:  # noqa: ASYNC110 - waiting for the delete
                await asyncio.sleep(0.01)
        assert time.monotonic() - due < 1.5
        source.writes_stopped()
        await deletes


async def spooled_through(path: Path, deliveries: Callable[[Acks], list[Delivery]]) -> list[Record]:
    """The records a SpoolSource committed for ``deliveries`` (made with the
    Acks they are acknowledged to), read back once all were acknowledged."""
    acks = Acks()
    batch = deliveries(acks)
    async with Spool(path, 1000, 10**6) as spool:
        source = SpoolSource(spool, Unfed(), Unpaused(), Stats(), 100)
        task = asyncio.create_task(source.append())
        for delivery in batch:
            source.accept(delivery)
        async with asyncio.timeout(5):
            while len(acks.done) < len(batch):  # noqa: ASYNC110 - waiting for the commits
                await asyncio.sleep(0.01)
        source.close()
        await task
        return await spool.read(0, 10)


async def test_a_retained_copy_stays_one_through_the_spool(tmp_path: Path) -> None:
    """A retained copy and a redelivery are placed differently in the state
    view (the first may be older than anything, the second is newer than what
    was acknowledged before it): the spool keeps both flags apart."""
    records = await spooled_through(
        tmp_path / "s.sqlite",
        lambda acks: [
            Delivery("t/0", b"0", None, 1000, acks.of("t/0")),
            Delivery("t/1", b"1", None, 1001, acks.of("t/1"), redelivered=True),
            Delivery("t/2", b"2", None, 1002, acks.of("t/2"), retained=True),
            Delivery("t/3", b"3", None, 1003, acks.of("t/3"), redelivered=True, retained=True),
        ],
    )
    assert [(r.topic, r.redelivered, r.retained) for r in records] == [
        ("t/0", False, False),
        ("t/1", True, False),
        ("t/2", False, True),
        ("t/3", True, True),
    ]


async def test_the_receive_microsecond_goes_through_the_spool(tmp_path: Path) -> None:
    """An event without ts is written at its receive µs (Delivery.received_us),
    which orders a device's untimed events of one millisecond: the spool
    keeps it, so a replay after a restart orders them as the first run did.
    A spool written before it was kept gets the column, null (0: not known)
    for its records, and takes new ones with it."""
    path = tmp_path / "s.sqlite"
    with sqlite3.connect(path) as old:  # a spool of before the column
        old.execute(
            "CREATE TABLE spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, received_ms INTEGER "
            "NOT NULL, topic TEXT NOT NULL, content_type TEXT, payload BLOB NOT NULL, "
            "redelivered INTEGER NOT NULL DEFAULT 0)"
        )
        old.execute("INSERT INTO spool (received_ms, topic, payload) VALUES (999, 't/old', x'30')")
    records = await spooled_through(
        path,
        lambda acks: [
            Delivery(f"t/{i}", b"0", None, 1000, acks.of(f"t/{i}"), received_us=1_000_007 + i)
            for i in range(3)
        ],
    )
    assert [(r.topic, r.received_ms, r.received_us) for r in records] == [
        ("t/old", 999, 0),
        ("t/0", 1000, 1_000_007),
        ("t/1", 1000, 1_000_008),
        ("t/2", 1000, 1_000_009),
    ]


async def test_a_damaged_spool_is_reported_on_one_line(tmp_path: Path) -> None:
    """SQLite's quick_check reports over several lines ("*** in database
    main ***", then the page), and `gateway check`'s DAMAGED line carried
    them so (field probe)."""
    path = tmp_path / "spool.sqlite"
    async with Spool(path, 1000, 1 << 24) as spool:
        await spool.append([(int(time.time() * 1000), "t/a", None, b"x" * 3000)] * 50)
    with path.open("r+b") as file:
        file.seek(4096 * 10 + 8)  # a cell's offset on a leaf page: out of range
        file.write(b"\x00\x07\x13")
    with pytest.raises(sqlite3.DatabaseError) as raised:
        peek(path, verify=True)
    said = str(raised.value)
    assert "\n" not in said, said
    assert "out of range" in said, said
    assert "malformed" in said, said


async def test_a_spool_folder_that_cannot_be_made_is_a_spool_error(tmp_path: Path) -> None:
    """It was a PermissionError traceback (or NotADirectoryError, as here)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SpoolError, match="opening it failed"):
        async with Spool(tmp_path / "file" / "sub" / "s.sqlite", 10, 10**6):
            pass


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ("CREATE TABLE users (id INTEGER, name TEXT)", "it holds the tables users"),
        ("CREATE TABLE spool (seq INTEGER, data BLOB)", "its spool table has no"),
    ],
)
async def test_a_file_that_is_not_a_spool_is_refused_untouched(
    tmp_path: Path, schema: str, says: str
) -> None:
    """A SQLite file of another program's (spool.path pointed at the wrong
    file) was adopted: a spool table added beside its own, or a column added
    to its own spool table before the open failed."""
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(schema)
    before = path.read_bytes()
    with pytest.raises(SpoolError, match=says):
        async with Spool(path, 10, 10**6):
            pass
    assert path.read_bytes() == before


async def test_a_spool_this_user_cannot_write_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It opened (SQLite falls back to reading), the gateway said READY, and
    the first message's commit stopped it. The tests run as root, for whom
    every file is writable, and the interpreter is not reachable by another
    user: os.access is made to say what it says to a user without write
    permission (the fault injected)."""
    path = tmp_path / "s.sqlite"
    async with Spool(path, 10, 10**6):
        pass
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != path and real(p, mode))
    with pytest.raises(SpoolError, match="is not writable by this user"):
        async with Spool(path, 10, 10**6):
            pass


def _remove(path: Path, *, replace: bool) -> None:
    """What a cleanup job or a hand would do to the spool's files."""
    for file in path.parent.glob(path.name + "*"):
        file.unlink()
    if replace:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["removed", "replaced"])
async def test_a_spool_removed_or_replaced_while_open_fails_the_next_commit(
    tmp_path: Path, how: str
) -> None:
    """SQLite went on committing into the removed file: acknowledged messages
    were gone at the next start. Now the commit fails, before any ack."""
    path = tmp_path / "s.sqlite"
    async with Spool(path, 100, 10**6) as spool:
        await spool.append([(1, "t/1", None, b"1")])
        _remove(path, replace=how == "replaced")
        with pytest.raises(SpoolError, match="removed or replaced while open"):
            await spool.append([(2, "t/2", None, b"2")])
        assert spool.depth == 1


async def test_full_spool_waits_for_room(tmp_path: Path) -> None:
    async with Spool(tmp_path / "s.sqlite", 3, 10**6) as spool:
        await spool.append([(1, "a", None, b"1"), (2, "b", None, b"2"), (3, "c", None, b"3")])
        assert spool.full
        waiter = asyncio.create_task(spool.wait_for_room())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        (oldest,) = await spool.read(0, 1)
        await spool.delete([oldest.seq])
        async with asyncio.timeout(5):
            await waiter


WRITER = """
import asyncio, sys
from pathlib import Path
from gateway.ingest.spool import Spool
async def main():
    async with Spool(Path(sys.argv[1]), 10**9, 10**12) as spool:
        i = 0
        while True:
            await spool.append([(i + k, f"t/{i + k}", None, b"p" * 100) for k in range(50)])
            i += 50
            print(i, flush=True)
asyncio.run(main())
"""


def _write_then_kill(path: Path, at_least: int) -> int:
    """Run the writer in a subprocess and SIGKILL it mid-stream; committed count."""
    committed = 0
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            committed = int(line)
            if committed >= at_least:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    return committed


async def test_sigkill_mid_append_loses_no_committed_record(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite"
    committed = await asyncio.to_thread(_write_then_kill, path, 5000)
    async with Spool(path, 10**9, 10**12) as spool:
        records = await spool.read(0, 10**6)
    # Everything reported committed is there, whole and in order; a torn last
    # transaction (if any) is simply absent, never half-read.
    assert len(records) >= committed
    assert len(records) % 50 == 0
    assert [r.topic for r in records] == [f"t/{i}" for i in range(len(records))]
    assert all(r.payload == b"p" * 100 for r in records)


HOLDER = """
import asyncio, sys
from pathlib import Path
from gateway.ingest.spool import Spool
async def main():
    async with Spool(Path(sys.argv[1]), 1000, 10**6) as spool:
        await spool.append([(1, "t/1", None, b"1")])
        print("open", flush=True)
        sys.stdin.read()  # held until the test closes our stdin
asyncio.run(main())
"""


async def _depth(path: Path) -> int:
    async with Spool(path, 1000, 10**6) as spool:
        return spool.depth


@pytest.mark.parametrize("ends", ["exits", "is killed"])
def test_a_spool_open_in_another_process_is_refused_until_it_ends(
    tmp_path: Path, ends: str
) -> None:
    """Two gateways with one spool.path (two instances in one working
    directory) shared the file without a word: each fed Cassandra from and
    deleted the other's records, one's depth went negative (no bound any
    more) and the other's grew until it called itself full and stopped
    acknowledging. The second now refuses at once, naming spool.path, the
    holder's pid and what to do; once the holder is gone (SIGKILL too) the
    file opens, as it was."""
    path = tmp_path / "spool.sqlite"
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline() == "open\n"
            with pytest.raises(SpoolError) as refused:
                asyncio.run(_depth(path))
        finally:
            if ends == "exits":
                holder.stdin.close()
            else:
                holder.send_signal(signal.SIGKILL)
            holder.wait(10)
    said = str(refused.value)
    assert said.startswith(f"spool {path}: "), said
    assert f"another gateway process (pid {holder.pid}) has it open" in said, said
    assert "give each gateway instance its own spool.path" in said, said
    assert holder.returncode == (0 if ends == "exits" else -signal.SIGKILL)
    assert asyncio.run(_depth(path)) == 1  # the holder's record, untouched


async def test_gateway_keeps_acknowledging_while_cassandra_is_away(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    now = int(time.time() * 1000)
    messages = [
        (topic(tenant, f"d{i % 5}"), orjson.dumps({"ts": now + i, "state": "on", "value": i}))
        for i in range(300)
    ]
    spool_path = tmp_path / "spool.sqlite"
    async with proxy() as p:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(p.port),
            GATEWAY_SAMPLING__ENABLED="false",
            GATEWAY_SPOOL__ENABLED="true",
            GATEWAY_SPOOL__PATH=str(spool_path),
            # Stopping while Cassandra is away waits out this deadline for the
            # writes under way (then leaves them in the spool): not 10 s here.
            GATEWAY_PIPELINE__SHUTDOWN_DEADLINE="1",
        )
        async with running_gateway(config) as gw:
            await p.cut()
            await publish(messages)
            # All acknowledged although nothing can reach Cassandra: spooled.
            await gw.wait_for(lambda s: s.acked >= 300, deadline=60)
            assert gw.stats.written < 300
            assert gw.stats.spool is not None
            assert gw.stats.spool.depth > 0
            # Stop with Cassandra still away: the spool keeps what is not written.
    async with Spool(spool_path, 10**6, 10**9) as spool:
        left = spool.depth
    assert left > 0
    # Next start, Cassandra reachable: the spool drains in arrival order.
    config = make_config(
        GATEWAY_SAMPLING__ENABLED="false",
        GATEWAY_SPOOL__ENABLED="true",
        GATEWAY_SPOOL__PATH=str(spool_path),
    )
    async with running_gateway(config) as gw:
        assert gw.stats.spool is not None
        await gw.wait_for(lambda s: s.spool.depth == 0 and s.in_flight == 0, deadline=60)
    for i in range(5):
        assert len(await telemetry_keys(db, tenant, f"d{i}")) == 60
    assert (await device_row(db, tenant, "d4")).value_num == 299


async def test_stopping_with_a_full_queue_and_cassandra_away_does_not_hang(
    tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The spool's feeder can be waiting for room in a full queue while the
    writers wait for Cassandra: stopping must still end, within the deadline.
    Its summary says how many stay spooled (it said received and written)."""
    caplog.set_level(logging.INFO, logger="gateway")
    spool_path = tmp_path / "spool.sqlite"
    now = int(time.time() * 1000)
    messages = [
        (topic(tenant, f"d{i % 5}"), orjson.dumps({"ts": now + i, "value": i})) for i in range(200)
    ]
    async with proxy() as p:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(p.port),
            GATEWAY_SPOOL__ENABLED="true",
            GATEWAY_SPOOL__PATH=str(spool_path),
            GATEWAY_MQTT__RECEIVE_MAXIMUM="10",
            GATEWAY_PIPELINE__QUEUE_SIZE="10",
            GATEWAY_PIPELINE__SHUTDOWN_DEADLINE="1",
            GATEWAY_SAMPLING__ENABLED="false",
        )
        async with running_gateway(config) as gw:
            await p.cut()
            await publish(messages)
            await gw.wait_for(lambda s: s.acked >= 200 and s.queue_depth >= 10, deadline=30)
            # Leaving waits at most 30 s for the gateway to end, then fails.
    async with Spool(spool_path, 10_000, 10**8) as spool:
        assert spool.depth > 0  # what was not written stays spooled
    stopped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped: ")]
    assert stopped, [r.getMessage() for r in caplog.records][-5:]
    assert f" spooled={spool.depth} " in stopped[-1], stopped[-1]
