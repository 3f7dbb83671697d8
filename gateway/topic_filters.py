"""MQTT topic filters: validation and matching (MQTT 5.0, 4.7), and what a
topic level may not hold.

A leaf module: config validates filters and tenant names with it, sampling
matches topics, the topic matcher and the token store check levels.
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls, as a regular expression's class.
CONTROLS = "\\x00-\\x1f\\x7f-\\x9f"
_CONTROL = re.compile(f"[{CONTROLS}]")


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


def covers(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether every topic filter ``b`` matches, ``a`` matches too (levels of
    two filters without '#')."""
    return len(a) == len(b) and all(x in ("+", y) for x, y in zip(a, b, strict=True))


def overlap(a: tuple[str, ...], b: tuple[str, ...]) -> str | None:
    """A topic both filters (without '#') match, or None if there is none."""
    if len(a) != len(b) or any(x != y and "+" not in (x, y) for x, y in zip(a, b, strict=True)):
        return None
    return "/".join(y if x == "+" else x for x, y in zip(a, b, strict=True)).replace("+", "x")


def meets(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether some topic matches both the filter ``a`` (which may end in
    '#') and ``b`` (which has no '#')."""
    if a and a[0] in ("+", "#") and b and b[0].startswith("$"):
        return False  # a wildcard first level never matches a $ topic (MQTT 4.7.2)
    if a and a[-1] == "#":
        head = a[:-1]  # '#' also matches its parent level: a/# matches a
        return len(b) >= len(head) and overlap(head, b[: len(head)]) is not None
    return overlap(a, b) is not None


def is_topic_level(name: str) -> bool:
    """Whether ``name`` can be one level of a topic, as a tenant named in
    config or a token must: not empty, no '/', '+' or '#', no control character."""
    return bool(name) and not any(ch in name for ch in "/+#") and not has_control(name)


# Names no URL can carry as a path segment: browsers (and most HTTP
# clients) resolve "." and ".." away, even percent-encoded, so a device or
# state so named could not be opened in the page or the API.
NO_URL_NAMES = frozenset({".", ".."})
NO_URL_REASON = "a URL drops a . or .. path segment, so the page and API could not open it"


# What a state, a device id or a tenant taken from a topic may not hold:
# controls (C0, C1, DEL), and the characters that show as nothing or as a
# break: soft hyphen, Arabic letter mark, Hangul fillers, Mongolian vowel
# separator, zero-width space, direction marks, line and paragraph
# separators, bidirectional embeddings and isolates, word joiner, invisible
# operators and deprecated format characters, byte-order mark. They are the
# labels the page's tiles and lists and the CLI show: "a\u200bb" looked
# exactly like "ab" and was another one. Zero-width joiners stay allowed:
# emoji sequences and scripts use them.
INVISIBLE_RANGES = (
    (0x00AD, 0x00AD),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x180E, 0x180E),
    (0x200B, 0x200B),
    (0x200E, 0x200F),
    (0x2028, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0x3164, 0x3164),
    (0xFEFF, 0xFEFF),
)
# Every one of them, for those that show them escaped (the CLI, the page's
# copy in gateway/web/static/app.js).
INVISIBLE = tuple(c for first, last in INVISIBLE_RANGES for c in range(first, last + 1))
_UNSEEN = re.compile(
    f"[{CONTROLS}" + "".join(f"\\u{a:04x}-\\u{b:04x}" for a, b in INVISIBLE_RANGES) + "]"
)


def unseen_char(text: str) -> str | None:
    """The first control or invisible character of ``text`` (_UNSEEN), or None.
    The ASCII ones are all unprintable, so printable ASCII (nearly every id; a
    C-level scan) needs no regular expression. Not every other one is: the
    Hangul fillers are letters."""
    if text.isascii() and text.isprintable():
        return None
    found = _UNSEEN.search(text)
    return None if found is None else found.group()


def has_control(text: str) -> bool:
    """Whether ``text`` holds a C0 or C1 control character (or DEL), which no
    tenant, device id or label may: they would break log lines and listings.
    Every such character is unprintable, so a printable text (nearly all of
    them; a C-level scan) needs no regular expression."""
    return not text.isprintable() and _CONTROL.search(text) is not None
