"""Property-based fuzzing of TopicMatcher.match + Decoder.decode together.

Properties:
  * the only exception that escapes is DecodeError, whose reason is one of
    gateway.decode.REASONS and whose detail is a non-empty sentence;
  * every accepted event respects the configured limits;
  * valid generated events round-trip field for field.

Small limits make the boundaries reachable. The example budgets below add up to
over 5,000 generated (topic, payload) cases per run (see ``--hypothesis-show-statistics``).
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgpack
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from gateway.config import LimitsConfig, TopicTemplate
from gateway.errors import DecodeError
from gateway.event import Event
from gateway.identity import event_identity
from gateway.ingest.decode import JSON_TYPES, MSGPACK_TYPES, REASONS, Decoder, state_problem
from gateway.ingest.topics import TopicMatcher
from gateway.topic_filters import NO_URL_NAMES, unseen_char

LIMITS = LimitsConfig(
    max_payload_bytes=4096,
    max_metrics=4,
    max_tags=3,
    max_key_length=8,
    max_state_length=8,
    max_text_length=16,
    max_topic_level_length=16,
    max_future_skew=300.0,
)
TEMPLATES = [
    TopicTemplate(),
    TopicTemplate(template="site/{device_id}/events", tenant="site-a"),
    TopicTemplate(template="{_}/x/{tenant}/{device_id}"),
]
MATCHER = TopicMatcher(TEMPLATES, LIMITS)
DECODER = Decoder(LIMITS)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MIN_MS = (LIMITS.min_timestamp - EPOCH) // timedelta(milliseconds=1)
SKEW_MS = int(LIMITS.max_future_skew * 1000)
NOW_MS = 1_700_000_000_000
FIELDS = ("ts", "state", "value", "metrics", "tags", "sent_at")
NULLABLE = ("ts", "state", "value", "sent_at")  # metrics and tags may be absent, not null


def _fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# --- the property ------------------------------------------------------------------


def _is_control(text: str) -> bool:
    return any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in text)


def _assert_within_limits(event: Event, topic: str, payload: bytes, received_ms: int) -> None:
    assert len(payload) <= LIMITS.max_payload_bytes
    for level in (event.tenant, event.device_id):
        assert 0 < len(level) <= LIMITS.max_topic_level_length
        assert not _is_control(level)
        assert unseen_char(level) is None
        assert level == level.strip()
    assert event.device_id in topic.split("/")

    assert len(event.metrics) <= LIMITS.max_metrics
    for name, number in event.metrics.items():
        assert 1 <= len(name) <= LIMITS.max_key_length
        assert type(number) is float
        assert math.isfinite(number)
    assert len(event.tags) <= LIMITS.max_tags
    for key, text in event.tags.items():
        assert 1 <= len(key) <= LIMITS.max_key_length
        assert isinstance(text, str)
        assert len(text) <= LIMITS.max_text_length
    if event.state is not None:
        assert 1 <= len(event.state) <= LIMITS.max_state_length
    assert event.value_text is None or event.value_num is None
    if event.value_text is not None:
        assert len(event.value_text) <= LIMITS.max_text_length
    if event.value_num is not None:
        assert type(event.value_num) is float
        assert math.isfinite(event.value_num)
    if event.sent_at_ms is not None:
        assert math.isfinite(event.sent_at_ms)

    assert event.received_ms == received_ms
    if event.ts_from_receive:
        assert event.ts_ms == received_ms
    else:
        assert MIN_MS <= event.ts_ms <= received_ms + SKEW_MS
    assert -(2**63) <= event.event_id < 2**63
    assert event.write_ts // 1000 == event.ts_ms
    assert 0 <= event.write_ts % 1000 < 1000


def _run(
    topic: str, payload: bytes, content_type: str | None, received_ms: int
) -> Event | DecodeError:
    # Anything but DecodeError propagates and fails the test.
    try:
        tenant, device_id = MATCHER.match(topic)
        return DECODER.decode(tenant, device_id, payload, content_type, received_ms)
    except DecodeError as exc:
        return exc


def check(topic: str, payload: bytes, content_type: str | None, received_ms: int) -> Event | None:
    """Run both stages; only DecodeError may escape them. Returns the event if accepted."""
    outcome = _run(topic, payload, content_type, received_ms)
    if isinstance(outcome, DecodeError):
        note(
            f"rejected: {outcome.reason}"
        )  # the distribution shows in --hypothesis-show-statistics
        assert outcome.reason in REASONS, outcome
        assert outcome.reason != "too_many_states", outcome  # only the writer sets it
        assert isinstance(outcome.detail, str)
        assert outcome.detail.strip(), outcome
        return None
    note("accepted")
    _assert_within_limits(outcome, topic, payload, received_ms)
    return outcome


# --- generators ------------------------------------------------------------------------

CONTROL = st.sampled_from("\x00\x01\x07\t\n\r\x1b\x1f\x7f\x85\x9f")
CHARS = st.one_of(st.characters(codec="utf-8"), CONTROL)  # utf-8 codec: no surrogates
TEXT = st.text(CHARS, max_size=16)
SHORT_TEXT = st.text(CHARS, min_size=1, max_size=LIMITS.max_key_length)
HUGE_INTS = st.integers(min_value=-(10**40), max_value=10**40)
EDGE_INTS = st.sampled_from(
    [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, MIN_MS, NOW_MS]
)
ANY_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
MSGPACK_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)

RECEIVED = st.one_of(st.just(NOW_MS), st.integers(min_value=MIN_MS, max_value=4_102_444_800_000))
CONTENT_TYPES = st.one_of(
    st.none(),
    st.sampled_from(sorted(JSON_TYPES | MSGPACK_TYPES)),
    st.sampled_from(["", "application/json; charset=utf-8", "APPLICATION/MSGPACK", "text/plain"]),
    st.text(max_size=30),
)


def _json_tree(ints: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), ints, ANY_FLOATS, TEXT)
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(TEXT, children, max_size=4)
        ),
        max_leaves=8,
    )


JSON_VALUES = _json_tree(st.one_of(st.integers(), HUGE_INTS, EDGE_INTS))

_MP_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    MSGPACK_INTS,
    EDGE_INTS.filter(lambda i: -(2**63) <= i < 2**64),
    ANY_FLOATS,
    TEXT,
    st.binary(max_size=16),
    st.builds(msgpack.ExtType, st.integers(min_value=0, max_value=127), st.binary(max_size=12)),
    st.builds(
        msgpack.Timestamp,
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.integers(min_value=0, max_value=999_999_999),
    ),
)
_MP_KEYS = st.one_of(TEXT, st.binary(max_size=6), st.integers(min_value=-3, max_value=3))
MSGPACK_VALUES = st.recursive(
    _MP_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_MP_KEYS, children, max_size=4)
    ),
    max_leaves=8,
)


def _shaped(values: st.SearchStrategy[Any], keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Objects that look like events: known field names (and some others) with any values."""
    key_names = st.one_of(st.sampled_from(FIELDS), keys)
    maps = st.dictionaries(st.one_of(SHORT_TEXT, keys), values, max_size=6)
    field_value = st.one_of(values, maps)
    return st.dictionaries(key_names, field_value, max_size=7)


def _rfc3339(dt: datetime, offset_minutes: int, style: int) -> str:
    zone = timezone(timedelta(minutes=offset_minutes))
    text = dt.astimezone(zone).isoformat()
    if offset_minutes == 0 and style == 1:
        text = text.removesuffix("+00:00") + "Z"
    return text


@st.composite
def ts_values(draw: st.DrawFn, received_ms: int) -> tuple[int | str, int]:
    """A valid ts (int ms or RFC 3339 text) and the ms it denotes."""
    ms = draw(st.integers(min_value=MIN_MS, max_value=received_ms + SKEW_MS))
    if draw(st.booleans()):
        return ms, ms
    micro = draw(st.integers(min_value=0, max_value=999))
    dt = EPOCH + timedelta(milliseconds=ms, microseconds=micro)
    if dt > EPOCH + timedelta(milliseconds=received_ms + SKEW_MS):
        dt = EPOCH + timedelta(milliseconds=ms)
    offset = draw(
        st.one_of(st.just(0), st.integers(min_value=-23 * 60 - 59, max_value=23 * 60 + 59))
    )
    return _rfc3339(dt, offset, draw(st.integers(0, 1))), ms


NUMBERS = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), FINITE_FLOATS)


@st.composite
def valid_events(draw: st.DrawFn, received_ms: int) -> tuple[dict[str, Any], int | None]:
    """An event within LIMITS, and the ts_ms it denotes (None: no ts given)."""
    event: dict[str, Any] = {}
    ts_ms: int | None = None
    if draw(st.booleans()):
        event["ts"], ts_ms = draw(ts_values(received_ms))
    if draw(st.booleans()):
        event["state"] = draw(
            st.text(CHARS, min_size=1, max_size=LIMITS.max_state_length).filter(
                lambda s: s == s.strip() and state_problem(s) is None
            )
        )
    if draw(st.booleans()):
        event["value"] = draw(st.one_of(st.text(CHARS, max_size=LIMITS.max_text_length), NUMBERS))
    if draw(st.booleans()):
        event["metrics"] = draw(st.dictionaries(SHORT_TEXT, NUMBERS, max_size=LIMITS.max_metrics))
    if draw(st.booleans()):
        event["tags"] = draw(
            st.dictionaries(
                SHORT_TEXT,
                st.text(CHARS, max_size=LIMITS.max_text_length),
                max_size=LIMITS.max_tags,
            )
        )
    if draw(st.booleans()):
        event["sent_at"] = draw(NUMBERS)
    for name in draw(st.sets(st.sampled_from(NULLABLE))):
        event.setdefault(name, None)  # explicit nulls mean "absent"
    return event, ts_ms


def _encode(event: Any, fmt: str) -> bytes:
    if fmt == "json":
        return orjson.dumps(event)
    return msgpack.packb(event, use_bin_type=True)  # type: ignore[no-any-return]


# Topics: random levels, and template-shaped topics with random levels in them.
SAFE_LEVEL = st.text(
    st.characters(codec="utf-8", exclude_characters="/", exclude_categories=["Cc"]),
    min_size=1,
    max_size=LIMITS.max_topic_level_length,
).filter(
    lambda s: (
        not _is_control(s) and s not in NO_URL_NAMES and unseen_char(s) is None and s == s.strip()
    )
)
LEVEL = st.one_of(
    st.sampled_from(
        ["", "+", "#", ".", "..", "tenants", "devices", "events", "site", "x", "acme", "d1"]
    ),
    st.text(st.one_of(CHARS.filter(lambda c: c != "/"), CONTROL), max_size=20),
    st.text(st.characters(codec="ascii", exclude_characters="/"), min_size=17, max_size=400),
    SAFE_LEVEL,
)
SHAPED_TOPICS = st.one_of(
    st.builds("tenants/{}/devices/{}/events".format, LEVEL, LEVEL),
    st.builds("site/{}/events".format, LEVEL),
    st.builds("{}/x/{}/{}".format, LEVEL, LEVEL, LEVEL),
)
RANDOM_TOPICS = st.one_of(st.lists(LEVEL, max_size=7).map("/".join), TEXT)
GOOD_TOPICS = st.one_of(
    st.builds("tenants/{}/devices/{}/events".format, SAFE_LEVEL, SAFE_LEVEL),
    st.builds("site/{}/events".format, SAFE_LEVEL),
    st.builds("{}/x/{}/{}".format, LEVEL, SAFE_LEVEL, SAFE_LEVEL),
)


@st.composite
def payload_topics(draw: st.DrawFn) -> str:
    """For payload-focused tests: 4 in 5 topics match, so the payload gets decoded."""
    if draw(st.integers(min_value=0, max_value=4)) < 4:
        return draw(GOOD_TOPICS)
    return draw(st.one_of(SHAPED_TOPICS, RANDOM_TOPICS))


PAYLOAD_TOPICS = payload_topics()
ALL_TOPICS = st.one_of(SHAPED_TOPICS, RANDOM_TOPICS, GOOD_TOPICS)


# --- fuzz tests ---------------------------------------------------------------------------


@pytest.mark.slow
@_fuzz(400)
@given(
    topic=PAYLOAD_TOPICS,
    payload=st.one_of(
        st.binary(max_size=64),
        st.binary(min_size=LIMITS.max_payload_bytes - 2, max_size=LIMITS.max_payload_bytes + 2),
        st.binary(max_size=16).map(lambda b: b"{" + b),
        st.binary(max_size=16).map(lambda b: bytes([0x80 | (len(b) % 16)]) + b),
        # {"value": <timestamp extension (type -1) with any length and data>}
        st.builds(
            b"\x81\xa5value".__add__,
            st.builds(
                bytes.__add__,
                st.sampled_from(
                    [b"\xd4\xff", b"\xd6\xff", b"\xd7\xff", b"\xc7\x0c\xff", b"\xc7\x05\xff"]
                ),
                st.binary(max_size=14),
            ),
        ),
    ),
    content_type=CONTENT_TYPES,
    received_ms=RECEIVED,
)
def test_fuzz_arbitrary_bytes(
    topic: str, payload: bytes, content_type: str | None, received_ms: int
) -> None:
    check(topic, payload, content_type, received_ms)


@pytest.mark.slow
@_fuzz(280)
@given(
    topic=PAYLOAD_TOPICS,
    obj=st.one_of(JSON_VALUES, _shaped(JSON_VALUES, TEXT)),
    indent=st.booleans(),
    content_type=st.one_of(st.none(), st.sampled_from(sorted(JSON_TYPES)), CONTENT_TYPES),
    received_ms=RECEIVED,
)
def test_fuzz_json_objects(
    topic: str, obj: Any, indent: bool, content_type: str | None, received_ms: int
) -> None:
    # The standard library writes huge ints, NaN and Infinity; orjson must cope.
    payload = json.dumps(obj, indent=1 if indent else None, ensure_ascii=indent).encode()
    event = check(topic, payload, content_type, received_ms)
    if event is not None:
        assert isinstance(obj, dict)
        assert set(obj) <= set(FIELDS)


@pytest.mark.slow
@_fuzz(280)
@given(
    topic=PAYLOAD_TOPICS,
    obj=st.one_of(MSGPACK_VALUES, _shaped(MSGPACK_VALUES, _MP_KEYS)),
    content_type=st.one_of(st.none(), st.sampled_from(sorted(MSGPACK_TYPES)), CONTENT_TYPES),
    received_ms=RECEIVED,
)
def test_fuzz_msgpack_objects(
    topic: str, obj: Any, content_type: str | None, received_ms: int
) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    event = check(topic, payload, content_type, received_ms)
    if event is not None:
        assert isinstance(obj, dict)
        assert set(obj) <= set(FIELDS)


_TS_EDGES = st.one_of(
    st.sampled_from(
        [
            MIN_MS - 1,
            MIN_MS,
            NOW_MS + SKEW_MS,
            NOW_MS + SKEW_MS + 1,
            1_620_000_000,
            0,
            -1,
            2**63 - 1,
            "2021-05-03T00:00:00Z",
            "2021-05-03T00:00:00",
            "2023-11-14T22:18:21Z",
            "0001-01-01T00:00:00+01:00",
            "9999-12-31T23:59:59-23:59",
            "20231114T221320Z",
            "not a time",
            1.5,
            True,
        ]
    ),
    st.text(max_size=70),
)


@st.composite
def mutated_events(draw: st.DrawFn) -> tuple[bytes, str]:
    """A valid event with field-level and then maybe byte-level mutations."""
    event, _ = draw(valid_events(NOW_MS))
    fmt = draw(st.sampled_from(["json", "msgpack"]))
    anything = JSON_VALUES if fmt == "json" else MSGPACK_VALUES
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        op = draw(st.sampled_from(["drop", "replace", "unknown", "metric", "tag", "long", "ts"]))
        if op == "drop" and event:
            event.pop(draw(st.sampled_from(sorted(event))))
        elif op == "replace":
            event[draw(st.sampled_from(FIELDS))] = draw(anything)
        elif op == "unknown":
            event[draw(TEXT)] = draw(anything)
        elif op == "metric":
            metrics = event.get("metrics")
            metrics = dict(metrics) if isinstance(metrics, dict) else {}
            metrics[draw(st.one_of(SHORT_TEXT, TEXT))] = draw(
                st.one_of(anything, NUMBERS, ANY_FLOATS)
            )
            event["metrics"] = metrics
        elif op == "tag":
            tags = event.get("tags")
            tags = dict(tags) if isinstance(tags, dict) else {}
            tags[draw(st.one_of(SHORT_TEXT, TEXT))] = draw(st.one_of(anything, TEXT))
            event["tags"] = tags
        elif op == "long":
            field = draw(st.sampled_from(["state", "value", "ts"]))
            size = draw(st.integers(min_value=LIMITS.max_state_length, max_value=80))
            event[field] = draw(st.text(CHARS, min_size=size, max_size=size))
        else:
            event["ts"] = draw(_TS_EDGES)
    # The standard library writes huge ints, NaN and Infinity, which orjson refuses to.
    payload = json.dumps(event).encode() if fmt == "json" else _encode(event, fmt)
    if payload and draw(st.booleans()):
        pos = draw(st.integers(min_value=0, max_value=len(payload) - 1))
        byte_op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        if byte_op == "flip":
            mask = draw(st.integers(min_value=1, max_value=255))
            payload = payload[:pos] + bytes([payload[pos] ^ mask]) + payload[pos + 1 :]
        elif byte_op == "truncate":
            payload = payload[:pos]
        elif byte_op == "insert":
            payload = payload[:pos] + draw(st.binary(min_size=1, max_size=4)) + payload[pos:]
        else:
            payload = payload[:pos] + payload[pos + 1 :]
    return payload, fmt


@pytest.mark.slow
@_fuzz(400)
@given(
    topic=PAYLOAD_TOPICS,
    mutated=mutated_events(),
    use_content_type=st.booleans(),
    received_ms=st.one_of(st.just(NOW_MS), RECEIVED),
)
def test_fuzz_mutated_events(
    topic: str, mutated: tuple[bytes, str], use_content_type: bool, received_ms: int
) -> None:
    payload, fmt = mutated
    content_type = None
    if use_content_type:
        content_type = "application/json" if fmt == "json" else "application/msgpack"
    check(topic, payload, content_type, received_ms)


@_fuzz(400)
@given(topic=ALL_TOPICS, received_ms=RECEIVED)
def test_fuzz_topics(topic: str, received_ms: int) -> None:
    payload = b'{"value": 1}'
    event = check(topic, payload, None, received_ms)
    levels = topic.split("/")
    if event is None:
        return
    if len(levels) == 5 and levels[0] == "tenants" and levels[2] == "devices":
        assert (event.tenant, event.device_id) == (levels[1], levels[3])
    elif len(levels) == 3 and levels[0] == "site" and levels[2] == "events":
        assert (event.tenant, event.device_id) == ("site-a", levels[1])
    else:
        assert len(levels) == 4
        assert levels[1] == "x"
        assert (event.tenant, event.device_id) == (levels[2], levels[3])
    # tenant_of agrees with a full match.
    assert MATCHER.tenant_of(topic) == event.tenant


@st.composite
def round_trip_cases(draw: st.DrawFn) -> tuple[dict[str, Any], int | None, int]:
    received_ms = draw(RECEIVED)
    event, ts_ms = draw(valid_events(received_ms))
    return event, ts_ms, received_ms


@pytest.mark.slow
@_fuzz(280)
@given(
    topic=GOOD_TOPICS,
    case=round_trip_cases(),
    fmt=st.sampled_from(["json", "msgpack"]),
    use_content_type=st.booleans(),
)
def test_valid_events_round_trip(
    topic: str,
    case: tuple[dict[str, Any], int | None, int],
    fmt: str,
    use_content_type: bool,
) -> None:
    generated, ts_ms, received_ms = case
    payload = _encode(generated, fmt)
    content_type = None
    if use_content_type:
        content_type = "application/json" if fmt == "json" else "application/msgpack"
    event = check(topic, payload, content_type, received_ms)
    assert event is not None, "a valid event was rejected"

    tenant, device_id = MATCHER.match(topic)
    assert (event.tenant, event.device_id) == (tenant, device_id)
    if ts_ms is None:
        assert event.ts_from_receive
        assert event.ts_ms == received_ms
    else:
        assert not event.ts_from_receive
        assert event.ts_ms == ts_ms
    assert event.state == generated.get("state")
    value = generated.get("value")
    if isinstance(value, str):
        assert (event.value_text, event.value_num) == (value, None)
    elif value is None:
        assert (event.value_text, event.value_num) == (None, None)
    else:
        assert event.value_text is None
        assert event.value_num == float(value)
        assert type(event.value_num) is float
    metrics = generated.get("metrics") or {}
    assert event.metrics == {name: float(number) for name, number in metrics.items()}
    assert event.tags == (generated.get("tags") or {})
    sent_at = generated.get("sent_at")
    assert event.sent_at_ms == (None if sent_at is None else float(sent_at))
    # Numbers are identified as stored (floats), so 1 and 1.0 are one event.
    canonical = value if isinstance(value, str) or value is None else float(value)
    # An RFC 3339 time with more than three fractional digits keeps its µs.
    ts = generated.get("ts")
    micros = None
    if isinstance(ts, str) and re.search(r"\.\d{4}", ts):
        micros = datetime.fromisoformat(ts.upper()).microsecond % 1000
    assert (event.event_id, event.write_ts) == event_identity(
        tenant,
        device_id,
        event.ts_ms,
        event.state,
        canonical,
        event.metrics,
        event.tags,
        micros=micros,
    )
    # The other encoding of the same event decodes to the same thing.
    other = _encode(generated, "msgpack" if fmt == "json" else "json")
    assert DECODER.decode(tenant, device_id, other, None, received_ms) == event
