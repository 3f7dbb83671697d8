"""Hot partitions: writes per partition per window, counted in bounded memory.

The sink counts every write here. A partition over the threshold in a window
is logged once, counted (``Stats.hot_partitions``, by table), and reported to
``on_hot``; at each window's end ``on_window`` gets the partitions that were
warm in it, over half the threshold (the raw-telemetry writer uses both to
shard hot devices: a device split in two whose halves are warm would be hot
again in one, so it stays split; told only the hot ones, it was halved and
split again every other window). Both callbacks are given at construction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable

from ..stats import Stats

log = logging.getLogger(__name__)


# What each table's hot partition means, and what can be done, for its warning
# (a tenant's state partition warned every 10 s with no word of either: probe).
_WHAT_TO_DO = {
    "telemetry": "; the device's raw telemetry is split over more shards, up to "
    "hot_partitions.max_shards (at it, only raising it spreads the device further)",
    "state": "; the tenant's devices in this state share it: tenants.<tenant>.state_buckets "
    "spreads them, set before the tenant's first write (the first writer records it)",
    "device": "; one device sends this fast: its newest event is rewritten with each",
}


class HotPartitions:
    """Writes per partition over a window, in bounded memory.

    A partition over ``threshold`` writes in a window is logged once for that
    window, counted, and reported to ``on_hot``; at the end of each window
    ``on_window`` gets the set of partitions over half the threshold in it. At most
    ``max_tracked`` partitions are counted per window; writes to others are
    counted in ``Stats.untracked_writes`` only.
    """

    def __init__(
        self,
        window: float,
        threshold: int,
        max_tracked: int,
        stats: Stats,
        *,
        on_hot: Callable[[Hashable], None] = lambda key: None,
        on_window: Callable[[set[Hashable]], None] = lambda hot: None,
    ) -> None:
        self._window = window
        self._threshold = threshold
        self._max = max_tracked
        self._stats = stats
        self._counts: dict[Hashable, int] = {}
        self._started = time.monotonic()
        self._on_hot = on_hot
        self._on_window = on_window

    def count(self, keys: Iterable[Hashable]) -> None:
        """One write to each of ``keys`` (a key may repeat), all at one time:
        the sink counts a chunk's writes in one call."""
        now = time.monotonic()
        if now - self._started >= self._window:
            half = self._threshold / 2
            warm = {key for key, n in self._counts.items() if n > half}
            self._counts.clear()
            self._started = now
            self._on_window(warm)
        counts = self._counts
        threshold, most = self._threshold, self._max
        for key in keys:
            current = counts.get(key)
            if current is None:
                if len(counts) >= most:
                    self._stats.untracked_writes += 1
                    continue
                current = 0
            current += 1
            counts[key] = current
            if current == threshold + 1:
                self._went_hot(key)

    def _went_hot(self, key: Hashable) -> None:
        self._stats.hot_partitions += 1
        table = str(key[0]) if isinstance(key, tuple) else "?"
        self._stats.hot_by_table.add(table)
        log.warning(
            "hot partition %s: over %d writes in %.0f s%s",
            key,
            self._threshold,
            self._window,
            _WHAT_TO_DO.get(table, ""),
        )
        self._on_hot(key)
