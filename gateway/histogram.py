"""Observations counted into buckets, as a Prometheus histogram exposes them.

A leaf, compiled (setup.py): the write path observes into one for every
message (``gateway_write_latency_seconds``) and every request, and an
interpreted call per observation was measurable (bench/PERFORMANCE.md).
``gateway/stats.py`` holds the instances; the HTTP side reads them.
"""

from __future__ import annotations

import bisect
import math


class Histogram:
    """Observations counted into buckets (``value <= bound``; the last is +Inf)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf) if not bounds or bounds[-1] != math.inf else bounds
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = (
            len(self.bounds) - 1 if math.isnan(value) else bisect.bisect_left(self.bounds, value)
        )
        self.counts[index] += 1
        self.sum += value
