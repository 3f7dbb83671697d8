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

import pytest
import pytest_asyncio

from gateway.stats import Stats
from gateway.store.database import Database
from gateway.store.rollups import MINUTE_MS, RollupWorker
from gateway.store.write_session import WriteSession, open_write_session

from .helpers import make_config, proxy, wait_until

# Renewed every 2 s and counted as held for 5 s after each renewal: one slow
# transaction on a busy CI box does not lose it.
LEASE_S = 6


class Recording(RollupWorker):
    """A worker that notes the minutes it processes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.minutes: list[int] = []

    async def process_minute(self, minute_ms: int, spread: float = 0.0) -> None:
        self.minutes.append(minute_ms)
        await super().process_minute(minute_ms, spread)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def session() -> AsyncIterator[WriteSession]:
    async with open_write_session(make_config().cassandra) as opened:
        yield opened


async def started(
    session: WriteSession, name: str, holder: str, first: int, stats: Stats | None = None
) -> Recording:
    # No spread: the marks table is the suite's, so a minute just due may
    # hold other tests' windows, and spread over 20 s it kept "A caught up"
    # past its deadline (a clean-clone CI). Pacing is tested in test_rollups.py
    # (test_a_minute_is_spread_over_what_is_left_before_the_next_is_due).
    config = make_config(
        GATEWAY_ROLLUPS__LEASE=f"{LEASE_S}s",
        GATEWAY_ROLLUPS__INTERVAL="0.2s",
        GATEWAY_ROLLUPS__SPREAD="0s",
    )
    worker = Recording(session, config, stats or Stats(), name=name, holder=holder)
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


def role(worker: RollupWorker, expected: str) -> Callable[[], bool]:
    return lambda: worker.role == expected


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
    """A works (its lease in Cassandra), B stands by naming A, does no
    minute; A stops, releasing the lease, and B takes over
    at its next try from the cursor A left, not from the one B read when it
    started 5 minutes back: B processes no minute A had finished."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a = await started(session, name, "gw-a", minutes_ago(5))
    b_stats = Stats()
    b = await started(session, name, "gw-b", minutes_ago(5), b_stats)
    async with running(a) as a_task:
        await wait_until(role(a, "working"), 10, "A holds the lease")
        # A catches up on the five due minutes (no marks in them).
        await wait_until(lambda: a.cursor_ms >= minutes_ago(1), 20, "A caught up")
        async with running(b):
            await wait_until(role(b, "standing by for 'gw-a'"), 10, "B stands by")
            await asyncio.sleep(LEASE_S / 3 * 2)  # two more of B's tries
            assert b.minutes == [], "a standby did minutes too"
            assert await lease_holder(db, name) == "gw-a"
            a_task.cancel()  # a stop: A releases the lease
            await asyncio.gather(a_task, return_exceptions=True)
            assert a.role == "standing by"
            # Released: gone, or B's try came in between and took it (not A's
            # row left to expire).
            assert await lease_holder(db, name) != "gw-a", "a stopped worker keeps no lease"
            done_by_a = a.cursor_ms
            await wait_until(role(b, "working"), LEASE_S, "B takes over at its next try")
            await wait_until(lambda: b_stats.rollup_lease_held == 1, 5, "B works")
            assert await lease_holder(db, name) == "gw-b"
            await asyncio.sleep(1)  # B's first pass
            assert all(m >= done_by_a for m in b.minutes), (b.minutes, done_by_a)
            assert b.cursor_ms >= done_by_a
            assert b_stats.rollup_lease_taken == 1
    assert await lease_holder(db, name) is None


async def test_a_lease_left_by_a_dead_instance_is_taken_once_it_expires(
    session: WriteSession, db: Database
) -> None:
    """A row a killed instance left (no release): another instance waits for
    its TTL, showing meanwhile how far behind the dead worker left the cursor
    (5 minutes: 3.5 minutes past due); the same instance restarted (its
    client id) takes it at once."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    b_stats = Stats()
    b = await started(session, name, "gw-b", minutes_ago(5), b_stats)
    left = time.monotonic()
    await db.execute(
        f"INSERT INTO {db.keyspace}.worker_leases (name, holder) VALUES (%s, %s) "
        f"USING TTL {LEASE_S}",
        (name, "gw-dead"),
    )
    async with running(b):
        await wait_until(role(b, "standing by for 'gw-dead'"), 5, "B stands by")
        await wait_until(lambda: b_stats.rollup_lag_s > 180, 5, "a standby shows the lag")
        await wait_until(role(b, "working"), LEASE_S + LEASE_S / 3 + 2, "B takes it over")
    assert time.monotonic() - left >= LEASE_S - 1

    name = f"lease-{uuid.uuid4().hex[:8]}"
    await db.execute(
        f"INSERT INTO {db.keyspace}.worker_leases (name, holder) VALUES (%s, %s) USING TTL 60",
        (name, "gw-a"),
    )
    again = await started(session, name, "gw-a", minutes_ago(0))
    async with running(again):
        await wait_until(role(again, "working"), 2, "a restarted instance takes its own at once")


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
        await wait_until(role(a, "working"), 10, "A holds the lease")
        await db.execute(
            f"UPDATE {db.keyspace}.worker_leases USING TTL 60 SET holder = %s WHERE name = %s",
            ("gw-b", name),
        )
        await wait_until(
            lambda: a_stats.rollup_lease_lost == 1 and a_stats.rollup_lease_held == 0,
            LEASE_S,
            "A stops at its next renewal",
        )
        assert a.role == "standing by for 'gw-b'"
        passes = len(a.minutes)
        await asyncio.sleep(LEASE_S / 3 * 2)
        assert a.role == "standing by for 'gw-b'", "A took a lease that is not free"
        assert len(a.minutes) == passes


@pytest.mark.asyncio(loop_scope="session")
async def test_a_worker_whose_link_crawls_stops_before_its_lease_can_have_expired(
    session: WriteSession,
) -> None:
    """A's link to Cassandra crawls: its renewal gets no answer, and the
    driver's request timeout (30 s here) is longer than the lease. A stops
    working within the lease (it used to wait for the request to time out,
    working on while B had taken over), B takes over, and once the link is
    well again A stands by for B."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    async with proxy() as link:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(link.port), GATEWAY_CASSANDRA__REQUEST_TIMEOUT="30s"
        )
        async with open_write_session(config.cassandra) as crawling:
            a_stats = Stats()
            a = await started(crawling, name, "gw-a", minutes_ago(0), a_stats)
            b = await started(session, name, "gw-b", minutes_ago(0))
            async with running(a):
                await wait_until(role(a, "working"), 10, "A holds the lease")
                async with running(b):
                    await wait_until(role(b, "standing by for 'gw-a'"), 10, "B stands by")
                    link.limit = 1  # bytes per second towards Cassandra: no answer comes
                    await wait_until(
                        lambda: a_stats.rollup_lease_lost == 1 and a_stats.rollup_lease_held == 0,
                        LEASE_S,
                        "A stops within its lease",
                    )
                    await wait_until(role(b, "working"), LEASE_S + LEASE_S / 3 + 2, "B takes over")
                    link.limit = None
                    link.drop()  # the crawling connections; the driver opens new ones
                    await wait_until(role(a, "standing by for 'gw-b'"), 20, "A stands by for B")
