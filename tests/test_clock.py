"""This host's clock against Cassandra's (gateway/store/clock.py), against the
real Cassandra. A host clock that is off is injected (the one fault here that
cannot be produced for real without changing the box's clock): the clock
function the measurement reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gateway.stats import Stats
from gateway.store.clock import ClockWatch, Offset, check_line, measure
from gateway.store.write_session import WriteSession, open_write_session

from .helpers import make_config, wait_until

DAY = 86_400.0


@pytest_asyncio.fixture
async def session(keyspace: str) -> AsyncIterator[WriteSession]:
    async with open_write_session(make_config().cassandra) as opened:
        yield opened


async def test_the_offset_against_cassandra_is_measured(session: WriteSession) -> None:
    right = await measure(session)
    # The same host: one clock, so only the round trip and the millisecond.
    assert abs(right.seconds) < 0.5, right
    assert 0.001 <= right.within < 0.5, right
    assert right.describe().startswith("within 0.")
    assert check_line(right, 300.0) == (True, f"clock: {right.describe()}")

    behind = await measure(session, clock=lambda: time.time() - DAY)
    assert behind.seconds == pytest.approx(DAY, abs=1.0), behind
    ok, line = check_line(behind, 300.0)
    assert not ok
    assert line.startswith("clock: 86,400 s behind Cassandra's (±0.")
    assert "over limits.max_future_skew (300 s)" in line
    assert "synchronise this host's clock (NTP)" in line

    ahead = await measure(session, clock=lambda: time.time() + 30)
    ok, line = check_line(ahead, 300.0)
    assert ok, line  # under the skew that refuses ts: said, not failed
    assert "s ahead of Cassandra's" in line
    assert "events without ts are stamped by this host's clock" in line


def test_an_offset_within_its_uncertainty_is_not_called_off() -> None:
    assert Offset(0.004, 0.005).describe() == "within 0.005 s of Cassandra's"
    assert Offset(-2.5, 0.01).describe() == "2.500 s ahead of Cassandra's (±0.010 s)"
    assert Offset(-2.5, 0.01).beyond == pytest.approx(2.49)


async def test_a_step_of_the_clock_is_logged_and_measured_again(
    session: WriteSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A stale clock set right by NTP steps: the offset measured at start is
    then wrong until the next measurement, ten minutes later; the step is
    seen within a look (here 50 ms) and measured again at once."""
    shift = [-DAY]  # the host booted a day behind

    def clock() -> float:
        return time.time() + shift[0]

    stats = Stats()
    watch = ClockWatch(session, stats, clock=clock, measure_every=3600, look_every=0.05)
    await watch.prepare()

    with caplog.at_level(logging.INFO, logger="gateway.store.clock"):
        running = asyncio.create_task(watch.run())
        try:
            await wait_until(lambda: stats.clock_offset_s is not None, 10, "measured", 0.02)
            assert stats.clock_offset_s == pytest.approx(DAY, abs=1.0)
            said = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(said) == 1, said
            assert "this host's clock is 86,400 s behind Cassandra's" in said[0].getMessage()
            assert "synchronise it (NTP)" in said[0].getMessage()
            caplog.clear()
            shift[0] = 0.0  # NTP sets it right
            await wait_until(lambda: stats.clock_steps == 1, 10, "the step seen", 0.02)
            await wait_until(
                lambda: stats.clock_offset_s is not None and abs(stats.clock_offset_s) < 0.5,
                10,
                "measured again",
                0.02,
            )
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any("clock stepped forward by 86,400 s" in m for m in messages), messages
    assert any(m.startswith("clock: within 0.") for m in messages), messages
