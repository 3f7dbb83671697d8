"""The roll-up worker's lease against the real Cassandra (gateway/store/lease.py):
of several instances with ``rollups.worker`` on, one works and the others
stand by; a standby takes over when the worker stops, when its instance died
and left the lease to expire, and a worker whose lease went to another
instance stops working. Before the lease, several workers each did all the
work, and one worker that went away stopped roll-ups until a person moved
``rollups.worker`` to another instance."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest_asyncio

from gateway.stats import Stats
from gateway.store.database import Database
from gateway.store.rollups import MINUTE_MS, RollupWorker
from gateway.store.write_session import WriteSession, open_write_session

from .helpers import make_config, wait_until

LEASE_S = 3  # the least rollups.lease allows: renewed every second


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def session() -> AsyncIterator[WriteSession]:
    async with open_write_session(make_config().cassandra) as opened:
        yield opened


async def started(
    session: WriteSession, name: str, holder: str, first: int, stats: Stats | None = None
) -> RollupWorker:
    config = make_config(GATEWAY_ROLLUPS__LEASE=f"{LEASE_S}s", GATEWAY_ROLLUPS__INTERVAL="0.2s")
    worker = RollupWorker(session, config, stats or Stats(), name=name, holder=holder)
    await worker.start(first)
    return worker


@contextlib.asynccontextmanager
async def running(worker: RollupWorker) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def holds(worker: RollupWorker) -> Callable[[], bool]:
    return lambda: worker.role == "working"


async def lease_holder(db: Database, name: str) -> str | None:
    rows = await db.execute(
        f"SELECT holder FROM {db.keyspace}.worker_leases WHERE name = %s", (name,)
    )
    return rows[0].holder if rows else None


def minutes_ago(n: int) -> int:
    now = int(time.time() * 1000)
    return now - now % MINUTE_MS - n * MINUTE_MS


async def test_one_of_two_workers_works_and_the_other_takes_over_where_it_stopped(
    session: WriteSession, db: Database
) -> None:
    """A works (its lease in Cassandra), B stands by naming A and does no
    minute; A stops and B takes over within a renewal period, from the cursor
    A left (B read it when it started, 5 minutes back), not from its own."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a = await started(session, name, "gw-a", minutes_ago(5))
    b_stats = Stats()
    b = await started(session, name, "gw-b", minutes_ago(5), b_stats)
    first = b.cursor_ms
    async with running(a) as a_task:
        await wait_until(holds(a), 10, "A holds the lease")
        # A catches up on the five due minutes (no marks in them).
        await wait_until(lambda: a.cursor_ms >= minutes_ago(1), 20, "A caught up")
        async with running(b):
            await asyncio.sleep(LEASE_S)  # three of B's tries
            assert b.role == "standing by for 'gw-a'"
            assert b.cursor_ms == first, "a standby did minutes too"
            assert await lease_holder(db, name) == "gw-a"
            a_task.cancel()  # a stop: A releases the lease
            await asyncio.gather(a_task, return_exceptions=True)
            assert a.role == "standing by"
            await wait_until(holds(b), LEASE_S, "B takes over within a renewal period")
            assert b.cursor_ms >= a.cursor_ms > first
            assert await lease_holder(db, name) == "gw-b"
            assert (b_stats.rollup_lease_taken, b_stats.rollup_lease_held) == (1, 1)
    assert await lease_holder(db, name) is None, "a stopped worker keeps no lease"


async def test_a_lease_left_by_a_dead_instance_is_taken_once_it_expires(
    session: WriteSession, db: Database
) -> None:
    """A row a killed instance left (no release): another instance waits for
    its TTL, the same instance restarted (its client id) takes it at once."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    await db.execute(
        f"INSERT INTO {db.keyspace}.worker_leases (name, holder) VALUES (%s, %s) "
        f"USING TTL {LEASE_S}",
        (name, "gw-dead"),
    )
    b = await started(session, name, "gw-b", minutes_ago(0))
    began = time.monotonic()
    async with running(b):
        await asyncio.sleep(0.5)
        assert b.role == "standing by for 'gw-dead'"
        await wait_until(holds(b), LEASE_S + 3, "B takes the expired lease")
    assert time.monotonic() - began >= LEASE_S - 1

    name = f"lease-{uuid.uuid4().hex[:8]}"
    await db.execute(
        f"INSERT INTO {db.keyspace}.worker_leases (name, holder) VALUES (%s, %s) USING TTL 60",
        (name, "gw-a"),
    )
    again = await started(session, name, "gw-a", minutes_ago(0))
    async with running(again):
        await wait_until(holds(again), 2, "a restarted instance holds its own lease at once")


async def test_a_worker_whose_lease_another_instance_took_stops_working(
    session: WriteSession, db: Database
) -> None:
    """The row turns another holder's (as after A's link was down past the
    TTL and B took it): A's next renewal fails, A stops working, counts it,
    and stands by; its minutes stop."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a_stats = Stats()
    a = await started(session, name, "gw-a", minutes_ago(0), a_stats)
    async with running(a):
        await wait_until(holds(a), 10, "A holds the lease")
        await db.execute(
            f"UPDATE {db.keyspace}.worker_leases USING TTL 60 SET holder = %s WHERE name = %s",
            ("gw-b", name),
        )
        await wait_until(lambda: a.role != "working", LEASE_S, "A stops at its next renewal")
        assert a.role == "standing by for 'gw-b'"
        assert (a_stats.rollup_lease_lost, a_stats.rollup_lease_held) == (1, 0)
        await asyncio.sleep(LEASE_S / 3 * 2)
        assert a.role == "standing by for 'gw-b'", "A took a lease that is not free"
