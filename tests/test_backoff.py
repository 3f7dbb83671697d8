"""Retry delays never overflow, however many attempts a long outage makes.

``0.5 * 2**attempt`` is an int until it meets a float, and ``2.0**1024``
raises OverflowError: the spool-only mode's reconnect loop, a request's
retries and a state partition's rotation steps all counted attempts
without a bound on the exponent, so an outage long enough (about 1.5 h
for the spool-only loop) stopped the gateway instead of waiting on.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.aio import backoff
from gateway.errors import GatewayError
from gateway.stats import Stats
from gateway.store import rotate
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
