"""Units: durations (and the sizes they bound), and instants as epoch ms or UTC text.

A leaf module: it imports nothing of the gateway's, so config, the CLI and
any stage can use it without an import cycle.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


_EXPECTED = "expected a duration such as 30, '15m' or '1h' (units ms, s, m, h, d; none is s)"


def parse_duration(value: object) -> float:
    """``"15m"``, ``"1h"``, ``"250ms"``, ``30`` (seconds) -> seconds."""
    if isinstance(value, bool):
        raise ValueError(_EXPECTED)
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond a float's range
            raise ValueError(f"expected a finite duration, got {value}") from None
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise ValueError(f"{_EXPECTED}, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    return seconds


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1}
for _power, _letter in enumerate("KMGT", start=1):
    _SIZE_UNITS[f"{_letter}B"] = 1000**_power
    _SIZE_UNITS[f"{_letter}IB"] = 1024**_power


def parse_size(value: object) -> object:
    """``"64KiB"``, ``"1GiB"``, ``"500MB"``, ``65536`` (bytes) -> whole bytes;
    KB, MB, GB, TB are powers of 1000, KiB ... TiB of 1024. A value that is
    not a size is left to the field's own type check (an int)."""
    if isinstance(value, bool) or not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    if match is None:
        if value.strip().lstrip("-").isdigit():
            return value  # a bare (negative) number: the field's own bound says why
        raise ValueError(
            f"expected a size such as 65536, '64KiB' or '1GiB' (B, KB, MB, GB, TB; KiB, MiB, "
            f"GiB, TiB), got {value!r}"
        )
    # Exact: in floats "4.1GB" was not whole bytes, and long numbers lost digits.
    size = Decimal(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()]
    if size != size.to_integral_value():
        raise ValueError(f"expected whole bytes, got {value!r}")
    return int(size)


def size_text(size: int) -> str:
    """``size`` bytes in the largest binary unit that gives a whole number."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        count = _SIZE_UNITS[unit.upper()]
        if size >= count and size % count == 0:
            return f"{size // count}{unit}"
    return f"{size}B"


def duration_text(seconds: float) -> str:
    """``seconds`` in the largest unit that gives a whole number (2678400 ->
    "31d", 1 -> "1s", 0.005 -> "5ms"), for messages."""
    for unit in ("d", "h", "m", "s", "ms"):
        count = seconds / _UNITS[unit]
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{unit}"
    return f"{seconds:g}s"


def parse_whole_seconds(value: object) -> object:
    """A duration in whole seconds as an int (``"1m"`` -> 60); a value that
    is not a duration is left to the field's own type check."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    seconds = parse_duration(value)
    if not seconds.is_integer():
        raise ValueError(f"expected whole seconds, got {value!r}")
    return int(seconds)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_ms(ts: datetime) -> int:
    """A timestamp (naive means UTC, as one Cassandra driver returns them) as
    epoch ms, exactly (float seconds * 1000 could truncate one short)."""
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return (aware - _EPOCH) // timedelta(milliseconds=1)


def utc_text(wall: float) -> str:
    """Epoch seconds as the logs and /healthz say an instant: ``2026-11-23T14:30:05Z``."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
