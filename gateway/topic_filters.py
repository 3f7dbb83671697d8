"""MQTT topic filters: validation and matching (MQTT 5.0, 4.7).

A leaf module: config validates filters with it, sampling matches topics.
"""

from __future__ import annotations


def filter_levels(topic_filter: str) -> tuple[str, ...]:
    levels = tuple(topic_filter.split("/"))
    for i, level in enumerate(levels):
        if level == "#" and i != len(levels) - 1:
            raise ValueError(f"topic_filter {topic_filter!r}: '#' must be the last level")
        if level not in ("#", "+") and ("#" in level or "+" in level):
            raise ValueError(
                f"topic_filter {topic_filter!r}: '+' and '#' must stand alone in a level"
            )
    return levels


def topic_matches(levels: tuple[str, ...], topic: str) -> bool:
    """MQTT filter matching: ``+`` is one level, a final ``#`` the rest (or nothing)."""
    parts = topic.split("/")
    # Wildcards at the first level don't match $SYS-style topics (MQTT 4.7.2).
    if topic.startswith("$") and levels and levels[0] in ("+", "#"):
        return False
    for i, level in enumerate(levels):
        if level == "#":
            return True
        if i >= len(parts) or (level != "+" and level != parts[i]):
            return False
    return len(levels) == len(parts)
