"""Retry delays never overflow, however many attempts a long outage makes,
and a rotation's failing step waits its backoff.

``0.5 * 2**attempt`` is an int until it meets a float, and ``2.0**1024``
raises OverflowError: the spool-only mode's reconnect loop, a request's
retries and a state partition's rotation steps all counted attempts
without a bound on the exponent, so an outage long enough (about 1.5 h
for the spool-only loop) stopped the gateway instead of waiting on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.aio import all_or_none, backoff
from gateway.errors import GatewayError
from gateway.stats import Stats
from gateway.store import rotate
from gateway.store.latest import Part, PartKey
from gateway.store.rotate import StateRotation

from .helpers import make_config


def test_backoff_doubles_up_to_its_bound_and_never_overflows() -> None:
    assert [backoff(n, 0.5, 10.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    for attempt in (1_023, 1_024, 10**6):
        assert backoff(attempt, 0.5, 10.0) == 10.0


async def test_a_rotation_step_failing_1100_times_is_still_retried() -> None:
    """A partition whose rotation step keeps failing (17 h of failures at
    the 60 s bound) is retried at the bound, not dropped with OverflowError."""
    # A failing step touches neither the requests nor the state view.
    rotation = StateRotation(None, None, make_config(), Stats())  # type: ignore[arg-type]
    key = ("tenant", "on", 0)
    queue: dict[Any, float] = {}

    async def failing(key: Any) -> None:
        raise GatewayError("Cassandra is unreachable")

    for _ in range(1_100):
        await rotation._step(key, queue, failing)
    assert queue[key] == pytest.approx(time.monotonic() + rotate.MAX_BACKOFF, abs=1.0)


class _Latest:
    """The little of LatestState that announcing a rotation reads: the due
    partitions and their generations."""

    def __init__(self, key: PartKey) -> None:
        self.due: dict[PartKey, None] = {key: None}
        self.parts = {key: Part(gen=3, deletes=500)}

    def part(self, key: PartKey) -> Part | None:
        return self.parts.get(key)


async def test_a_failing_rotation_announcement_backs_off_off_the_write_path() -> None:
    """The announcement (a lightweight transaction, which can fail while
    plain writes succeed: a serial quorum short across data centres) runs
    in the write loop, between chunks. Failing, it is retried after a
    backoff, not at every chunk; a request that hangs holds the write loop
    for at most cassandra.request_timeout; and once it goes through, the
    rotation goes on."""
    key: PartKey = ("tenant", "alarm", 0)
    latest = _Latest(key)
    config = make_config(
        GATEWAY_CASSANDRA__REQUEST_TIMEOUT="0.2", GATEWAY_PIPELINE__ROTATION_WAIT="30"
    )
    stats = Stats()
    rotation = StateRotation(None, latest, config, stats)  # type: ignore[arg-type]
    calls: list[float] = []
    outcome = "hang"

    async def announce(key: PartKey, part: Part) -> bool:
        calls.append(time.monotonic())
        if outcome == "hang":  # Requests retrying a transient error, for up to give_up_after
            await asyncio.sleep(3600)
        if outcome == "fail":
            raise GatewayError("Unavailable: SERIAL needs 3 replicas, 2 alive")
        return True

    rotation._announce = announce  # type: ignore[method-assign]
    runner = asyncio.create_task(rotation.run())
    try:
        # The write loop: a chunk every 10 ms, each calling begin_due when a
        # partition is due (pipeline._start_rotations).
        started = time.monotonic()
        async with asyncio.timeout(5):  # else: held for give_up_after (600 s)
            await rotation.begin_due()
        assert time.monotonic() - started < 1.0
        outcome = "fail"
        while time.monotonic() - started < 2.5:
            if latest.due:
                await rotation.begin_due()
            await asyncio.sleep(0.01)
        # Backoff after the hang (1 s), then after the first failure (2 s):
        # 2 attempts in 2.5 s, where every chunk made one.
        assert len(calls) == 2, calls
        assert calls[1] - calls[0] >= 0.9
        assert stats.rotation_failures == 2
        outcome = "ok"
        while latest.parts[key].next_gen is None and time.monotonic() - started < 6:
            if latest.due:
                await rotation.begin_due()
            await asyncio.sleep(0.01)
        assert latest.parts[key].next_gen == 4  # announced: the copy comes next
        assert len(calls) == 3, calls
    finally:
        runner.cancel()


async def test_all_or_none_cancels_the_others_at_the_first_failure() -> None:
    """The roll-up worker's requests, each retried with backoff: with gather,
    when one gave up the others went on retrying after the pass had failed,
    overlapping the next pass. The first failure is raised as itself."""
    cancelled: list[int] = []

    async def request(n: int) -> int:
        try:
            await asyncio.sleep(0.01 if n == 0 else 10)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise
        raise TimeoutError(f"request {n} timed out")

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="request 0 timed out"):
        await all_or_none([request(n) for n in range(3)])
    assert sorted(cancelled) == [1, 2]
    assert time.monotonic() - started < 5

    async def value(n: int) -> int:
        await asyncio.sleep(0.01 * (3 - n))
        return n

    assert await all_or_none([value(n) for n in range(3)]) == [0, 1, 2]
