"""Lines that repeat while a link flaps, said once a minute per kind.

The drivers report every failed reconnect: the C++ driver's came 66 times in
90 s of a flapping link (ERROR lines that filled `journalctl -p err`), and
cassandra-driver's (the read API's session) every 1 to 10 s of an outage,
360 an hour. :class:`Repeats` lets each kind of line through at most once
per ``every`` seconds, and the next one it lets through says how many it held
back meanwhile. A kind is the text without its numbers (addresses, ports,
delays). At most ``kinds`` kinds are remembered: at the bound the one seen
longest ago is forgotten, and its next line is said at once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

EVERY = 60.0
KINDS = 32

_NUMBERS = re.compile(r"\d+")


class Repeats:
    def __init__(
        self, every: float = EVERY, kinds: int = KINDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._every = every
        self._kinds = kinds
        self._clock = clock
        self.last: dict[str, tuple[float, int]] = {}  # kind: (said at, held back since)

    def say(self, text: str) -> str | None:
        """``text`` to log now (with how many like it were held back), or
        None: one of its kind was said less than ``every`` seconds ago."""
        kind, now = _NUMBERS.sub("#", text), self._clock()
        said, held = self.last.pop(kind, (None, 0))
        if said is not None and now - said < self._every:
            self.last[kind] = (said, held + 1)
            return None
        while len(self.last) >= self._kinds:
            del self.last[next(iter(self.last))]  # the kind seen longest ago
        self.last[kind] = (now, 0)
        if held and said is not None:
            return f"{text} ({held} more like it held back over the last {now - said:.0f} s)"
        return text
