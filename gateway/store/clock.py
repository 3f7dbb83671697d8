"""This host's clock against Cassandra's, and the clock's steps.

The gateway stamps ``received_at``, and the ``ts`` of every event that comes
without one, from this host's clock, and rejects a ``ts`` more than
``limits.max_future_skew`` ahead of it. An edge host without a real-time
clock that boots with no link (no NTP) starts from a stale time: its events
land at the wrong time, and every device's own timestamps are refused as
"in the future". Nothing said so.

* **The offset.** :func:`measure` asks the coordinator for its time
  (``toUnixTimestamp(now())``) three times and keeps the answer with the
  shortest round trip: Cassandra's clock minus ours, give or take half that
  round trip (and the millisecond the answer is rounded to). Cassandra's
  nodes keep NTP time (their last-write-wins needs it), so they are the
  reference.
* **The watch** (:class:`ClockWatch`, a task of ``gateway run``) measures at
  start and every :data:`MEASURE_EVERY`, and at once when this host's clock
  steps (NTP setting a stale clock right is the usual step): the wall clock
  less the monotonic one changing by more than :data:`STEP` between two
  looks, :data:`LOOK_EVERY` apart. It logs an offset beyond :data:`WARN_OVER`
  (and when it is back within), and each step; ``gateway_clock_offset_seconds``
  and ``/healthz`` show the last offset, ``gateway_clock_steps_total`` the
  steps. A failed measurement is skipped (the link's own probe reports an
  unreachable Cassandra).
* ``gateway check`` prints the offset, and fails beyond
  ``limits.max_future_skew``.

What it cannot do: see the clock while Cassandra is unreachable (spool mode
stamps what it takes by this host's clock, as it is), or restamp events
already taken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..stats import Stats
from .write_session import Prepared, WriteSession

log = logging.getLogger(__name__)

CLOCK_CQL = "SELECT toUnixTimestamp(now()) AS now_ms FROM system.local"
SAMPLES = 3
# An offset beyond this (past its uncertainty) is logged: 1 s already
# reorders a device's events against another instance's, and against ts.
WARN_OVER = 1.0
MEASURE_EVERY = 600.0
LOOK_EVERY = 10.0
STEP = 1.0


@dataclass(frozen=True, slots=True)
class Offset:
    """Cassandra's clock minus this host's, in seconds, give or take ``within``."""

    seconds: float
    within: float

    @property
    def beyond(self) -> float:
        """How far off this host's clock is at least (0 when it may be right)."""
        return max(0.0, abs(self.seconds) - self.within)

    def describe(self) -> str:
        if self.beyond <= 0.001:
            return f"within {self.within:.3f} s of Cassandra's"
        side = "behind" if self.seconds > 0 else "ahead of"
        return f"{_amount(self.seconds)} s {side} Cassandra's (±{self.within:.3f} s)"


def _amount(seconds: float) -> str:
    """How many seconds, for the log: "86,400" for a day, "2.500" under ten."""
    off = abs(seconds)
    return f"{off:,.0f}" if off >= 10 else f"{off:.3f}"


async def measure(
    session: WriteSession,
    prepared: Prepared | None = None,
    clock: Callable[[], float] = time.time,
) -> Offset:
    """This host's clock against the coordinator's (module docstring)."""
    if prepared is None:
        prepared = await session.prepare(CLOCK_CQL)
    best: Offset | None = None
    for _ in range(SAMPLES):
        wall = clock()
        sent = time.monotonic()
        rows = await session.read(prepared, ())
        half = (time.monotonic() - sent) / 2
        theirs = rows[0]["now_ms"] / 1000
        # Half the round trip each way, and the answer's millisecond.
        offset = Offset(theirs - (wall + half), half + 0.001)
        if best is None or offset.within < best.within:
            best = offset
    assert best is not None
    return best


def check_line(offset: Offset, max_future_skew: float) -> tuple[bool, str]:
    """``gateway check``'s line: fails when this host's clock is so far off
    that devices' own timestamps would be refused (or accepted wrongly)."""
    said = f"clock: {offset.describe()}"
    if offset.beyond > max_future_skew:
        return False, (
            f"{said}: over limits.max_future_skew ({max_future_skew:g} s), so devices' own "
            "ts are refused as in the future (or late ones taken for new), and events "
            "without ts are stamped wrong; synchronise this host's clock (NTP)"
        )
    if offset.beyond > WARN_OVER:
        return True, f"{said}: events without ts are stamped by this host's clock (NTP?)"
    return True, said


class ClockWatch:
    """``gateway run``'s watch on this host's clock (module docstring)."""

    def __init__(
        self,
        session: WriteSession,
        stats: Stats,
        *,
        clock: Callable[[], float] = time.time,
        measure_every: float = MEASURE_EVERY,
        look_every: float = LOOK_EVERY,
    ) -> None:
        self._session = session
        self._stats = stats
        self._clock = clock
        self._measure_every = measure_every
        self._look_every = look_every
        self._off = False  # the last offset was beyond WARN_OVER, and said so

    async def prepare(self) -> None:
        self._prepared = await self._session.prepare(CLOCK_CQL)

    async def run(self) -> None:
        """Measure now, then every ``measure_every`` and after each step."""
        base = self._clock() - time.monotonic()
        due = 0.0  # monotonic time of the next measurement
        while True:
            now = time.monotonic()
            if now >= due:
                await self._measure()
                due = now + self._measure_every
            await asyncio.sleep(min(self._look_every, max(0.0, due - time.monotonic())))
            moved = self._clock() - time.monotonic() - base
            if abs(moved) > STEP:
                base += moved
                self._stats.clock_steps += 1
                log.warning(
                    "clock: this host's clock stepped %s by %s s; measuring it against "
                    "Cassandra's again",
                    "forward" if moved > 0 else "back",
                    _amount(moved),
                )
                due = 0.0

    async def _measure(self) -> None:
        try:
            offset = await measure(self._session, self._prepared, self._clock)
        except Exception as exc:  # the link's probe says the link is down
            log.debug("clock: not measured: %s", exc)
            return
        first = self._stats.clock_offset_s is None
        self._stats.clock_offset_s = offset.seconds
        off = offset.beyond > WARN_OVER
        if off:
            log.warning(
                "clock: this host's clock is %s: received_at, and the ts of events "
                "without one, come from it, and a device's ts more than "
                "limits.max_future_skew ahead of it is refused; synchronise it (NTP)",
                offset.describe(),
            )
        elif self._off or first:
            log.info("clock: %s", offset.describe())
        self._off = off
