"""How many Cassandra requests may be in flight: a limit that follows the link.

A fixed cap of N requests in flight caps throughput at N per round trip: 64
over a 50 ms link is about 1,300 requests/s, a fifth of what one local
Cassandra takes. :class:`InFlightLimit` adapts the cap to the latency it
measures, in the spirit of TCP Vegas and Netflix's gradient limiter:

* The *floor* is the lowest latency of an answered request over the last 20 to
  40 s (two rolling periods): the link's round trip plus Cassandra's unloaded
  service time. A link that becomes slower for good raises it within 40 s.
* Every *window* of about ``limit`` outcomes (at least ``MIN_WINDOW``), the
  window's median latency is compared with the floor. Near it (at most
  ``GROW_BELOW`` x floor + ``SLACK``) nothing is queueing, so the limit grows
  by ``GROWTH``, but only if the window's busiest moment used at least half
  of it (a limit nobody reaches proves nothing). Until the first window that
  is not near the floor (or the first timeout) it doubles instead, like
  TCP's slow start: a link found 100 ms away wants several times the
  starting limit, and growing 10% a window took seconds to get there. Well
  above it (over ``SHRINK_ABOVE`` x floor + ``SLACK``) requests queue
  somewhere, and the limit shrinks in proportion, by at most a quarter per
  window. In between it holds. ``SLACK`` absorbs the event loop's own
  scheduling jitter, which on a local Cassandra is larger than the round trip
  itself.
* A latency runs from sending a request to its answer: for the Python
  driver, to when the driver's own thread got it (``execute_timed``), so
  that the event loop's busy spells (binding a chunk's statements takes tens
  of milliseconds) do not read as Cassandra queueing.
* A timeout, an overloaded coordinator or a lost connection halves it, once
  per window.
* It never leaves ``[minimum, maximum]``; with ``adaptive=False`` it stays at
  ``maximum`` (the old fixed cap).

Promises: a request is admitted only while fewer than ``limit`` are in flight
(a lowered limit lets the excess finish, it never cancels one); waiters are
admitted in arrival order; the limit, the floor and every wait are counted in
:class:`~gateway.stats.Stats`. The limiter only decides *when* a request is
sent: ordering and acknowledgement (after Cassandra's answer) are the sink's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

from ..stats import Stats

log = logging.getLogger(__name__)

INITIAL_IN_FLIGHT = 64  # the old fixed cap: right for a local Cassandra
MIN_WINDOW = 32  # outcomes per decision at least: a median of fewer is noise
GROWTH = 0.10  # relative growth per window near the floor
SLOW_START = 2.0  # growth per window near the floor until the first one that is not
GROW_BELOW = 1.5  # near the floor: median <= GROW_BELOW * floor + SLACK
SHRINK_ABOVE = 3.0  # queueing: median > SHRINK_ABOVE * floor + SLACK
SLACK = 0.003  # seconds of event-loop jitter tolerated on top of the floor
MAX_SHRINK = 0.75  # a latency rise cuts at most a quarter per window
OVERLOAD_CUT = 0.5  # a timeout or overload error halves the limit
FLOOR_PERIOD = 20.0  # seconds; the floor is the minimum over the last two periods


class InFlightLimit:
    """An adaptive counting semaphore over Cassandra requests."""

    def __init__(
        self,
        stats: Stats,
        *,
        initial: int,
        minimum: int,
        maximum: int,
        adaptive: bool = True,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum ({minimum}) <= maximum ({maximum})")
        self._stats = stats
        self.minimum = minimum
        self.maximum = maximum
        self.adaptive = adaptive
        self._limit = float(min(max(initial, minimum), maximum) if adaptive else maximum)
        self._slots = int(self._limit)  # what is admitted (the limit moves in fractions)
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        # The current window.
        self._latencies: list[float] = []
        self._outcomes = 0
        self._busiest = 0
        self._cut = False  # halved in this window already
        self._slow_start = adaptive  # until a window finds latency above the floor
        # The floor: minimum latency of this period and of the one before.
        self._period_start = time.monotonic()
        self._floor_now = math.inf
        self._floor_before = math.inf
        self._publish()

    @property
    def limit(self) -> int:
        return self._slots

    @property
    def floor(self) -> float | None:
        """Lowest recent latency in seconds (None before the first answer)."""
        floor = min(self._floor_now, self._floor_before)
        return None if floor == math.inf else floor

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- the semaphore -----------------------------------------------------------

    async def acquire(self) -> None:
        """Wait until fewer than ``limit`` requests are in flight; take a slot."""
        if self._in_flight < self._slots and not self._waiters:
            self._take()
            return
        self._stats.in_flight_waits += 1
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted as we were cancelled: hand the slot on
            elif waiter in self._waiters:  # _admit drops cancelled waiters it meets
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self._in_flight -= 1
        self._admit()

    def _take(self) -> None:
        self._in_flight += 1
        self._busiest = max(self._busiest, self._in_flight)

    def _admit(self) -> None:
        waiters = self._waiters
        while waiters and self._in_flight < self._slots:
            waiter = waiters.popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)

    # -- what requests report ----------------------------------------------------

    def answered(self, latency: float) -> None:
        """A request attempt was answered after ``latency`` seconds."""
        self._floor_now = min(self._floor_now, latency)
        self._latencies.append(latency)
        self._outcome()

    def overloaded(self) -> None:
        """A request attempt timed out, found Cassandra overloaded, or lost its connection."""
        if self.adaptive and not self._cut:
            self._cut = True
            self._slow_start = False
            self._set(self._limit * OVERLOAD_CUT, "timeout or overload")
        self._outcome()

    def _outcome(self) -> None:
        self._outcomes += 1
        if self._outcomes >= max(MIN_WINDOW, self._limit):
            self._decide()

    def _decide(self) -> None:
        now = time.monotonic()
        if now - self._period_start > FLOOR_PERIOD:
            self._period_start = now
            self._floor_before, self._floor_now = self._floor_now, math.inf
        latencies, busiest, cut = self._latencies, self._busiest, self._cut
        self._latencies, self._outcomes, self._busiest, self._cut = [], 0, self._in_flight, False
        self._publish()
        floor = self.floor
        if not self.adaptive or cut or floor is None or not latencies:
            return
        latencies.sort()
        median = latencies[len(latencies) // 2]
        if median <= floor * GROW_BELOW + SLACK:
            if busiest >= self._limit / 2:
                growth = SLOW_START if self._slow_start else 1 + GROWTH
                self._set(max(self._limit * growth, self._limit + 1), "")
            return
        self._slow_start = False
        if median > (queueing := floor * SHRINK_ABOVE + SLACK):
            self._set(self._limit * max(MAX_SHRINK, queueing / median), "")

    def _set(self, limit: float, why: str) -> None:
        before = self.limit
        self._limit = min(max(limit, self.minimum), self.maximum)
        self._slots = int(self._limit)
        if why and self.limit < before:
            log.info("Cassandra in-flight limit %d -> %d (%s)", before, self.limit, why)
        self._publish()
        self._admit()

    def _publish(self) -> None:
        stats = self._stats
        stats.in_flight_limit = self.limit
        floor = self.floor
        stats.latency_floor = 0.0 if floor is None else floor
