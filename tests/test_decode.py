"""Payload decoding and validation. Pure unit tests, no services needed."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import msgpack
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import LimitsConfig
from gateway.errors import DecodeError
from gateway.event import Event
from gateway.identity import event_identity
from gateway.ingest.decode import REASONS, Decoder, _finite

LIMITS = LimitsConfig()
DECODER = Decoder(LIMITS)
NOW_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
SKEW_MS = int(LIMITS.max_future_skew * 1000)

EVENT: dict[str, Any] = {
    "ts": NOW_MS - 5_000,
    "state": "running",
    "value": 21.5,
    "metrics": {"temp": 21.5, "rpm": 1200, "neg": -3},
    "tags": {"site": "north", "fw": "1.2.3"},
    "sent_at": NOW_MS - 4_000,
}


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _mp(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def decode(
    payload: bytes,
    content_type: str | None = None,
    *,
    received_ms: int = NOW_MS,
    decoder: Decoder = DECODER,
    tenant: str = "acme",
    device_id: str = "dev-1",
) -> Event:
    return decoder.decode(tenant, device_id, payload, content_type, received_ms)


def reject(
    payload: bytes,
    reason: str,
    content_type: str | None = None,
    *,
    decoder: Decoder = DECODER,
    received_ms: int = NOW_MS,
) -> str:
    assert reason in REASONS
    with pytest.raises(DecodeError) as info:
        decode(payload, content_type, decoder=decoder, received_ms=received_ms)
    assert info.value.reason == reason, info.value.detail
    assert info.value.detail.strip()
    return info.value.detail


# --- formats --------------------------------------------------------------------


def test_full_event_decodes() -> None:
    event = decode(_json(EVENT))
    assert event.tenant == "acme"
    assert event.device_id == "dev-1"
    assert event.ts_ms == NOW_MS - 5_000
    assert not event.ts_from_receive
    assert event.received_ms == NOW_MS
    assert event.state == "running"
    assert event.value_num == 21.5
    assert event.value_text is None
    assert event.metrics == {"temp": 21.5, "rpm": 1200.0, "neg": -3.0}
    assert all(type(v) is float for v in event.metrics.values())
    assert event.tags == {"site": "north", "fw": "1.2.3"}
    assert event.sent_at_ms == float(NOW_MS - 4_000)
    assert type(event.sent_at_ms) is float


def test_json_and_msgpack_decode_identically() -> None:
    from_json = decode(_json(EVENT))
    from_msgpack = decode(_mp(EVENT))
    assert from_json == from_msgpack
    assert dataclasses.asdict(from_json) == dataclasses.asdict(from_msgpack)
    # Also with a text value and an RFC 3339 ts.
    other = EVENT | {"value": "open", "ts": "2023-11-14T22:13:15.250Z"}
    assert decode(_json(other)) == decode(_mp(other))
    assert decode(_json(other)).value_text == "open"


def test_int_value_becomes_float() -> None:
    event = decode(_json({"value": 7}))
    assert event.value_num == 7.0
    assert type(event.value_num) is float
    assert event.value_text is None


def test_numeric_looking_text_value_stays_text() -> None:
    event = decode(_json({"value": "21"}))
    assert (event.value_text, event.value_num) == ("21", None)


def test_minimal_events() -> None:
    event = decode(b"{}")
    assert event.state is None
    assert event.value_text is None
    assert event.value_num is None
    assert event.metrics == {}
    assert event.tags == {}
    assert event.sent_at_ms is None
    # A null is as if left out, for every field (metrics and tags were refused).
    nulls = {"ts": None, "state": None, "value": None, "sent_at": None}
    nulls |= {"metrics": None, "tags": None}
    assert decode(_json(nulls)) == event
    assert decode(_mp(nulls)) == event
    assert decode(_json({"metrics": None, "state": "on"})).state == "on"


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "text/json", "APPLICATION/JSON", "application/json; charset=utf-8"],
)
def test_json_content_type_forces_json(content_type: str) -> None:
    assert decode(_json(EVENT), content_type) == decode(_json(EVENT))
    reject(_mp(EVENT), "invalid_json", content_type)


@pytest.mark.parametrize(
    "content_type",
    [
        "application/msgpack",
        "application/x-msgpack",
        "application/vnd.msgpack",
        " Application/MsgPack ",
    ],
)
def test_msgpack_content_type_forces_msgpack(content_type: str) -> None:
    assert decode(_mp(EVENT), content_type) == decode(_mp(EVENT))
    reject(_json(EVENT), "invalid_msgpack", content_type)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/cbor", "json", "application/xml"]
)
def test_unknown_content_type_rejected(content_type: str) -> None:
    detail = reject(_json(EVENT), "unsupported_content_type", content_type)
    assert repr(content_type) in detail


def test_empty_content_type_means_detection() -> None:
    assert decode(_json(EVENT), "") == decode(_json(EVENT))


@pytest.mark.parametrize("prefix", [b"", b" ", b"\n", b"\r\n\t "])
def test_detection_by_first_byte_json(prefix: bytes) -> None:
    assert decode(prefix + _json(EVENT)).value_num == 21.5


def test_detection_by_first_byte_msgpack() -> None:
    assert decode(_mp(EVENT)).value_num == 21.5
    # map16 header (0xde): more than 15 keys would be unknown fields, so check the
    # header byte is understood by asking for the unknown-field rejection.
    big = {f"k{i}": i for i in range(16)}
    payload = _mp(big)
    assert payload[0] == 0xDE
    reject(payload, "unknown_field")


def test_detection_json_array_and_string() -> None:
    assert "got list" in reject(b"[1, 2]", "not_an_object")
    assert "got str" in reject(b'"x"', "not_an_object")
    # Anything else is tried as MessagePack.
    assert "got int" in reject(_mp(5), "not_an_object")
    assert "got list" in reject(_mp([1]), "not_an_object")
    detail = reject(b"not json", "invalid_msgpack")
    assert detail.endswith("; it is text, but no JSON event either: that starts with '{'")
    # Binary that is no MessagePack is not called text.
    assert "text" not in reject(b"\xc1\xff", "invalid_msgpack")


def test_json_with_a_byte_order_mark_is_told_so_without_a_content_type() -> None:
    """It was tried as MessagePack ("received extra data")."""
    detail = reject(b'\xef\xbb\xbf{"value": 1}', "invalid_json")
    assert "byte order mark" in detail


def test_a_ts_text_too_long_is_told_so() -> None:
    """The reason said it expected epoch milliseconds or an RFC 3339 string,
    "got text", for a string that was one, only too long."""
    detail = reject(_json({"ts": "2023-11-14T22:13:20." + "0" * 50 + "Z"}), "invalid_ts")
    assert "at most 64 characters" in detail
    assert "got text" not in detail


def test_an_integer_beyond_64_bits_is_not_called_a_float() -> None:
    detail = reject(b'{"ts": 18446744073709551616}', "invalid_ts")
    assert "a number beyond 64-bit integers" in detail
    assert "a float" not in detail


# --- timestamps ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ts", "expected"),
    [
        (NOW_MS, NOW_MS),
        ("2023-11-14T22:13:20Z", NOW_MS),
        ("2023-11-14T22:13:20.123Z", NOW_MS + 123),
        ("2023-11-14T22:13:20.123999Z", NOW_MS + 123),
        ("2023-11-15T00:13:20+02:00", NOW_MS),
        ("2023-11-15T00:13:20.5+02:00", NOW_MS + 500),
        ("2023-11-14T19:43:20-02:30", NOW_MS),
        ("2023-11-14T22:13:20+00:00", NOW_MS),
        ("2021-05-03T00:00:00.001Z", 1_620_000_000_001),
    ],
)
def test_ts_forms(ts: int | str, expected: int) -> None:
    event = decode(_json({"ts": ts}))
    assert event.ts_ms == expected
    assert not event.ts_from_receive
    assert decode(_mp({"ts": ts})).ts_ms == expected


@pytest.mark.parametrize("ts", ["2023-11-14T22:13:20", "2023-11-14T22:13:20.123"])
def test_rfc3339_without_offset_rejected(ts: str) -> None:
    detail = reject(_json({"ts": ts}), "invalid_ts")
    assert "no UTC offset" in detail


@pytest.mark.parametrize("ts", ["2023-11-14", "20231114T221320Z", "2023-W46-2T22:13:20Z"])
def test_other_iso8601_forms_are_not_rfc3339(ts: str) -> None:
    detail = reject(_json({"ts": ts}), "invalid_ts")
    assert "RFC 3339" in detail


@pytest.mark.parametrize("ts", ["yesterday", "2023-13-01T00:00:00Z", "", "1700000000000"])
def test_unparseable_ts_string_rejected(ts: str) -> None:
    detail = reject(_json({"ts": ts}), "invalid_ts")
    assert "neither epoch milliseconds nor an RFC 3339 time" in detail


def test_ts_in_epoch_seconds_rejected_with_hint() -> None:
    detail = reject(_json({"ts": 1_620_000_000}), "invalid_ts")
    assert "limits.min_timestamp" in detail
    assert "epoch seconds instead of milliseconds?" in detail


@pytest.mark.parametrize("ts", [0, -1, -1_620_000_000_000])
def test_ts_not_positive_rejected_without_seconds_hint(ts: int) -> None:
    detail = reject(_json({"ts": ts}), "invalid_ts")
    assert "limits.min_timestamp" in detail
    assert "epoch seconds" not in detail


def test_min_timestamp_boundary() -> None:
    min_ms = 946_684_800_000  # 2000-01-01T00:00:00Z
    assert decode(_json({"ts": min_ms})).ts_ms == min_ms
    reject(_json({"ts": min_ms - 1}), "invalid_ts")
    reject(_json({"ts": "1999-12-31T23:59:59.999Z"}), "invalid_ts")


def test_ts_too_far_in_future_rejected() -> None:
    detail = reject(_json({"ts": NOW_MS + SKEW_MS + 1_000}), "invalid_ts")
    assert "max_future_skew" in detail
    assert "in the future" in detail
    reject(_json({"ts": "2023-11-14T22:18:21Z"}), "invalid_ts")


def test_ts_within_skew_accepted() -> None:
    assert decode(_json({"ts": NOW_MS + 60_000})).ts_ms == NOW_MS + 60_000
    assert decode(_json({"ts": NOW_MS + SKEW_MS})).ts_ms == NOW_MS + SKEW_MS  # boundary
    reject(_json({"ts": NOW_MS + SKEW_MS + 1}), "invalid_ts")


def test_skew_is_configurable() -> None:
    strict = Decoder(LimitsConfig(max_future_skew=1.0))
    reject(_json({"ts": NOW_MS + 1_001}), "invalid_ts", decoder=strict)
    assert decode(_json({"ts": NOW_MS + 1_000}), decoder=strict).ts_ms == NOW_MS + 1_000


def test_old_timestamp_is_accepted_for_backfill() -> None:
    event = decode(_json({"ts": 1_620_000_000_000, "value": 1}))  # 2021-05-03
    assert event.ts_ms == 1_620_000_000_000
    assert decode(_json({"ts": "2021-05-03T00:00:00Z"})).ts_ms == 1_620_000_000_000


def test_missing_ts_uses_received_time() -> None:
    event = decode(_json({"value": 1}), received_ms=NOW_MS + 42)
    assert event.ts_ms == NOW_MS + 42
    assert event.received_ms == NOW_MS + 42
    assert event.ts_from_receive
    assert event.write_ts // 1000 == NOW_MS + 42


def test_an_event_without_ts_is_written_at_its_receive_microsecond() -> None:
    """Its write timestamp is the receive time to the µs (strictly increasing
    in the order of arrival: Delivery.received_us), not the hash tie-break,
    so of several in one millisecond the last to arrive is the newest; its
    event id stays the content's and the millisecond's (a replayed spool
    record is the same raw row)."""
    received = NOW_MS + 42
    payloads = [_json({"state": s, "value": i}) for i, s in enumerate(["on", "off", "on", "off"])]
    events = [
        DECODER.decode("acme", "dev-1", p, None, received, received * 1000 + 5 + i)
        for i, p in enumerate(payloads)
    ]
    assert [e.write_ts for e in events] == [received * 1000 + 5 + i for i in range(4)]
    assert [e.event_id for e in events] == [
        decode(p, received_ms=received).event_id for p in payloads
    ]
    # Without the µs (an older spool's record): the hash tie-break, as before.
    hashed = decode(payloads[0], received_ms=received)
    assert hashed.write_ts == event_identity("acme", "dev-1", received, "on", 0.0, {}, {})[1]
    # A time the event gives is not touched.
    timed = DECODER.decode("acme", "dev-1", _json({"ts": received - 10}), None, received, 7)
    assert timed.write_ts // 1000 == received - 10


# --- strict types ------------------------------------------------------------------


def test_string_metric_rejected() -> None:
    detail = reject(_json({"metrics": {"temp": "21"}}), "invalid_field")
    assert detail.startswith("metrics.temp:")
    assert "finite number" in detail
    assert "text" in detail


@pytest.mark.parametrize("value", [True, False])
def test_bool_value_rejected(value: bool) -> None:
    detail = reject(_json({"value": value}), "invalid_field")
    assert detail.startswith("value:")
    assert "boolean" in detail


def test_bool_metric_and_sent_at_rejected() -> None:
    assert "boolean" in reject(_json({"metrics": {"on": True}}), "invalid_field")
    assert "boolean" in reject(_json({"sent_at": True}), "invalid_field")


@pytest.mark.parametrize("ts", [1.5, 1_700_000_000_000.0, True, [1], {"a": 1}])
def test_non_integer_ts_rejected(ts: Any) -> None:
    detail = reject(_json({"ts": ts}), "invalid_ts")
    assert detail.startswith("ts:")
    assert "epoch milliseconds (an integer) or an RFC 3339 string" in detail


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"state": 5}, "state"),
        ({"state": True}, "state"),
        ({"tags": {"a": 1}}, "tags.a"),
        ({"tags": ["a"]}, "tags"),
        ({"metrics": [1]}, "metrics"),
        ({"value": [1]}, "value"),
        ({"value": {"a": 1}}, "value"),
    ],
)
def test_wrong_types_rejected(payload: dict[str, Any], field: str) -> None:
    detail = reject(_json(payload), "invalid_field")
    assert detail.startswith(f"{field}:")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["value", "metric", "sent_at"])
def test_non_finite_numbers_in_msgpack_rejected(bad: float, where: str) -> None:
    obj: dict[str, Any] = (
        {"metrics": {"ok": 1.0, "temp": bad}} if where == "metric" else {where: bad}
    )
    detail = reject(_mp(obj), "invalid_field")
    assert "finite" in detail
    assert detail.startswith("metrics.temp:" if where == "metric" else f"{where}:")


def test_a_number_is_an_exact_int_or_a_finite_float() -> None:
    """The fast path's number check (``_finite``), as compiled (it tests
    finiteness by arithmetic there): not a bool, an infinity, NaN or a float
    subclass. What it refuses goes to the pydantic model, which decides."""

    class Sub(float):
        pass

    assert _finite(1)
    assert _finite(-1.5)
    assert _finite(0.0)
    assert _finite(1.7976931348623157e308)
    bad = (True, Sub(1.0), float("inf"), float("-inf"), float("nan"), "1", None)
    assert [x for x in bad if _finite(x)] == []


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
@pytest.mark.parametrize("where", ["value", "metric", "sent_at"])
def test_non_finite_numbers_in_json_are_named_by_their_field(bad: str, where: str) -> None:
    """orjson refuses them with a place ("line 1 column 32 (char 31)"), not a
    field (CLI probe); the field is named as for MessagePack."""
    body = (
        f'{{"metrics": {{"ok": 1.0, "temp": {bad}}}}}'
        if where == "metric"
        else f'{{"{where}": {bad}}}'
    )
    detail = reject(body.encode(), "invalid_field")
    assert detail.startswith("metrics.temp:" if where == "metric" else f"{where}:"), detail
    assert "finite" in detail


def test_what_orjson_refuses_stays_refused_when_python_s_json_takes_it() -> None:
    """Nothing orjson refused is accepted because Python's json read it: a
    lone surrogate, which Python's json reads, the model refuses by its
    field; a NaN beside an unknown field is refused for one or the other."""
    assert reject(b'{"value": "\\ud800"}', "invalid_field").startswith("value:")
    with pytest.raises(DecodeError):
        decode(b'{"value": NaN, "colour": "red"}')


def test_a_key_only_python_s_json_reads_is_a_rejection_not_an_error() -> None:
    """A lone surrogate in a key: orjson refuses it, Python's json reads it,
    and the model's error has no field to name (an empty location), which
    raised IndexError out of the decoder, a message the receiver could not
    take (review)."""
    detail = reject(b'{"\\ud800": 1}', "invalid_field")
    assert detail.startswith("payload: Input should be a valid string"), detail


def test_json_that_is_not_utf8_says_so_and_where() -> None:
    """orjson read such bytes as "surrogates not allowed" at char 0 (CLI
    probe), MessagePack sent as JSON too."""
    detail = reject(b'{"value": "\xff"}', "invalid_json")
    assert "not UTF-8 text (byte 0xff at offset 11)" in detail
    detail = reject(_mp({"value": 1}), "invalid_json", "application/json")
    assert "MessagePack? Its content type is application/msgpack" in detail


def test_non_utf8_text_in_msgpack_rejected() -> None:
    # fixmap(1) "value" -> fixstr(2) with invalid UTF-8 bytes.
    detail = reject(b"\x81\xa5value\xa2\xff\xfe", "invalid_msgpack")
    assert "UTF-8" in detail
    reject(b"\x81\xa2\xff\xfe\x01", "invalid_msgpack")  # ... in a key
    state = _mp({"state": "ok"}).replace(b"ok", b"\xc3\x28")
    reject(state, "invalid_msgpack")


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"value": b"text"}, "value"),
        ({"state": b"running"}, "state"),
        ({"tags": {"site": b"north"}}, "tags.site"),
    ],
)
def test_binary_as_text_rejected(obj: dict[str, Any], field: str) -> None:
    detail = reject(_mp(obj), "invalid_field")
    assert detail.startswith(f"{field}:")


def test_binary_value_detail_says_binary() -> None:
    assert "binary data" in reject(_mp({"value": b"x"}), "invalid_field")


def test_msgpack_ext_types_rejected() -> None:
    reject(_mp({"value": msgpack.ExtType(5, b"ab")}), "invalid_field")
    reject(_mp({"ts": msgpack.Timestamp(1_700_000_000)}), "invalid_ts")


def test_msgpack_non_string_keys_rejected() -> None:
    reject(_mp({"metrics": {1: 1.0}}), "invalid_msgpack")
    reject(_mp({b"value": 1}), "invalid_field")


# --- limits -------------------------------------------------------------------------


def test_too_many_metrics() -> None:
    ok = {f"m{i}": i for i in range(LIMITS.max_metrics)}
    assert len(decode(_json({"metrics": ok})).metrics) == LIMITS.max_metrics
    too_many = ok | {"one_more": 1}
    detail = reject(_json({"metrics": too_many}), "invalid_field")
    assert detail.startswith("metrics:")
    assert str(LIMITS.max_metrics) in detail


def test_too_many_tags() -> None:
    ok = {f"t{i}": "v" for i in range(LIMITS.max_tags)}
    assert len(decode(_json({"tags": ok})).tags) == LIMITS.max_tags
    detail = reject(_json({"tags": ok | {"x": "y"}}), "invalid_field")
    assert detail.startswith("tags:")
    assert str(LIMITS.max_tags) in detail


def test_small_configured_limits() -> None:
    small = Decoder(LimitsConfig(max_metrics=2, max_tags=1, max_key_length=3))
    assert decode(_json({"metrics": {"a": 1, "b": 2}}), decoder=small).metrics == {
        "a": 1.0,
        "b": 2.0,
    }
    assert "2" in reject(
        _json({"metrics": {"a": 1, "b": 2, "c": 3}}), "invalid_field", decoder=small
    )
    assert "1" in reject(_json({"tags": {"a": "1", "b": "2"}}), "invalid_field", decoder=small)
    assert "3" in reject(_json({"metrics": {"abcd": 1}}), "invalid_field", decoder=small)


@pytest.mark.parametrize("where", ["metrics", "tags"])
def test_key_length(where: str) -> None:
    limit = LIMITS.max_key_length
    value: Any = 1 if where == "metrics" else "v"
    ok = "k" * limit
    assert ok in getattr(decode(_json({where: {ok: value}})), where)
    detail = reject(_json({where: {"k" * (limit + 1): value}}), "invalid_field")
    assert f"at most {limit} characters" in detail
    assert "empty" not in detail
    assert "at least 1" in reject(_json({where: {"": value}}), "invalid_field")


def test_state_length() -> None:
    limit = LIMITS.max_state_length
    assert decode(_json({"state": "s" * limit})).state == "s" * limit
    detail = reject(_json({"state": "s" * (limit + 1)}), "invalid_field")
    assert detail.startswith("state:")
    assert f"at most {limit} characters" in detail
    assert "at least 1" in reject(_json({"state": ""}), "invalid_field")


@pytest.mark.parametrize("state", [".", ".."])
def test_a_state_no_url_can_name_is_refused(state: str) -> None:
    """A state "." or ".." was stored and counted, but the page could not
    open it: browsers drop such a path segment, even %2e%2e, so /states/../
    devices asked for another route (read-side probe). "..." is fine."""
    detail = reject(_json({"state": state}), "invalid_field")
    assert detail.startswith("state:")
    assert "URL" in detail
    assert decode(_json({"state": "..."})).state == "..."


@pytest.mark.parametrize(
    ("state", "said"),
    [
        (" ", "only whitespace"),
        ("\t", "only whitespace"),
        ("a\u200bb", "U+200B"),
        ("a\u061cb", "U+061C"),
        ("a\u00adb", "U+00AD"),
        ("a\nb", "U+000A"),
        ("a\x7fb", "U+007F"),
        ("\u202eno", "U+202E"),
        ("ok\ufeff", "U+FEFF"),
    ],
)
@pytest.mark.parametrize("packed", [_json, _mp])
def test_a_state_people_could_not_tell_apart_is_refused(
    state: str, said: str, packed: Callable[[Any], bytes]
) -> None:
    """The page showed a tile with no name for " ", and "a\u200bb" as "ab",
    another state that looked the same (read-side probe). Each is rejected,
    naming why."""
    detail = reject(packed({"state": state}), "invalid_field")
    assert detail.startswith(f"state: {state!r}:"), detail
    assert said in detail, detail


@pytest.mark.parametrize(
    "state", ["door open", "état", "開", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "a-b_c.d"]
)
def test_states_with_spaces_inside_and_any_script_are_kept(state: str) -> None:
    assert decode(_json({"state": state})).state == state


@pytest.mark.parametrize(
    ("sent", "kept"), [("on ", "on"), ("on\r\n", "on"), ("\u00a0open", "open")]
)
def test_whitespace_at_a_states_ends_is_dropped(sent: str, kept: str) -> None:
    """A state "on " beside "on" made two tiles called on; rejecting a device's every
    message over its firmware's line end would lose its values."""
    assert decode(_json({"state": sent})).state == kept


def test_text_length() -> None:
    limit = LIMITS.max_text_length
    assert decode(_json({"value": "v" * limit})).value_text == "v" * limit
    detail = reject(_json({"value": "v" * (limit + 1)}), "invalid_field")
    assert detail.startswith("value:")
    assert f"at most {limit} characters" in detail
    detail = reject(_json({"tags": {"note": "v" * (limit + 1)}}), "invalid_field")
    assert detail.startswith("tags.note:")
    assert f"at most {limit} characters" in detail


def test_lengths_count_characters_not_bytes() -> None:
    limit = LIMITS.max_state_length
    assert decode(_json({"state": "é" * limit})).state == "é" * limit


def test_oversized_payload() -> None:
    limit = LIMITS.max_payload_bytes
    base = _json({"value": 1})
    exact = base + b" " * (limit - len(base))
    assert len(exact) == limit
    assert decode(exact).value_num == 1.0
    detail = reject(exact + b" ", "too_large")
    assert f"{limit + 1} bytes" in detail
    assert f"limit of {limit}" in detail
    assert "limits.max_payload_bytes" in detail
    # Checked before parsing: garbage over the limit is "too_large", not "invalid".
    reject(b"\xff" * (limit + 1), "too_large")


def test_empty_payload() -> None:
    assert reject(b"", "empty") == "the payload is empty"
    reject(b"", "empty", "text/plain")  # before the content type is looked at


def test_unknown_field() -> None:
    detail = reject(_json({"value": 1, "colour": "red"}), "unknown_field")
    assert "'colour'" in detail
    reject(_mp({"Value": 1}), "unknown_field")


@pytest.mark.parametrize(
    "payload", [b"{", b'{"value": }', b'{"value": 1,}', b"{'value': 1}", b'{"a":1} x', b"   "]
)
def test_invalid_json(payload: bytes) -> None:
    assert reject(payload, "invalid_json").startswith("not valid JSON")


def test_invalid_utf8_in_json() -> None:
    reject(b'{"value": "\xff"}', "invalid_json")
    # A lone surrogate escape: Python's json reads it, the model names the field.
    reject(b'{"value": "\\ud800"}', "invalid_field")


def test_truncated_msgpack() -> None:
    payload = _mp(EVENT)
    for cut in (1, 5, len(payload) // 2, len(payload) - 1):
        reject(payload[:cut], "invalid_msgpack")


def test_msgpack_trailing_data() -> None:
    reject(_mp(EVENT) + b"\x00", "invalid_msgpack")


def test_msgpack_too_deep() -> None:
    reject(b"\x81\xa5value" + b"\x91" * 5000 + b"\xc0", "invalid_msgpack")
    reject(b'{"value": ' + b"[" * 5000 + b"]" * 5000 + b"}", "invalid_json")


@pytest.mark.parametrize("payload", [b"\xc1", b"\x81\xa5value" + b"\x91" * 5000 + b"\xc0"])
def test_msgpack_error_detail_says_what_is_wrong(payload: bytes) -> None:
    detail = reject(payload, "invalid_msgpack")
    assert detail.removeprefix("not valid MessagePack:").strip()


@pytest.mark.parametrize("name", ["int", "str", "float", "none", "a[1]"])
def test_detail_names_a_metric_whatever_its_name(name: str) -> None:
    detail = reject(_json({"metrics": {name: "21"}}), "invalid_field")
    assert detail.startswith(f"metrics.{name}:")


# --- identity -------------------------------------------------------------------------


def test_event_identity_is_the_same_in_every_process_and_version() -> None:
    """Pinned: a redelivered copy must map to the row its first delivery made,
    whichever process (or release) wrote that. An id built on hash(), or any
    change to the canonical form, would give an event a second raw row when
    it is redelivered after a restart or an upgrade."""
    args: tuple[Any, ...] = ("acme", "d1", 1_700_000_000_123, "on", 1.5, {"a": 1.0}, {"k": "v"})
    assert event_identity(*args) == (7854067878555332281, 1700000000123281)
    assert event_identity(*args, micros=456) == (3426008325960982782, 1700000000123456)


def test_event_identity_is_deterministic() -> None:
    args: tuple[Any, ...] = ("acme", "d1", NOW_MS, "on", 1.5, {"a": 1.0}, {"k": "v"})
    assert event_identity(*args) == event_identity(*args)
    event_id, write_ts = event_identity(*args)
    assert -(2**63) <= event_id < 2**63
    assert write_ts // 1000 == NOW_MS
    assert 0 <= write_ts % 1000 < 1000


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "acme2"},
        {"device_id": "d2"},
        {"ts_ms": NOW_MS + 1},
        {"state": "off"},
        {"state": None},
        {"value": 1.6},
        {"value": "1.5"},
        {"value": None},
        {"metrics": {"a": 2.0}},
        {"metrics": {"b": 1.0}},
        {"metrics": {}},
        {"tags": {"k": "w"}},
        {"tags": {"j": "v"}},
        {"tags": {}},
    ],
)
def test_event_identity_differs_when_any_field_differs(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "tenant": "acme",
        "device_id": "d1",
        "ts_ms": NOW_MS,
        "state": "on",
        "value": 1.5,
        "metrics": {"a": 1.0},
        "tags": {"k": "v"},
    }
    assert event_identity(**base)[0] != event_identity(**(base | change))[0]


def test_event_identity_ignores_key_order() -> None:
    one = event_identity("t", "d", NOW_MS, None, None, {"a": 1.0, "b": 2.0}, {"x": "1", "y": "2"})
    two = event_identity("t", "d", NOW_MS, None, None, {"b": 2.0, "a": 1.0}, {"y": "2", "x": "1"})
    assert one == two


def test_write_ts_range_over_many_events() -> None:
    for i in range(2_000):
        ts = NOW_MS + i * 7
        _, write_ts = event_identity("t", f"d{i}", ts, None, float(i), {}, {})
        assert write_ts // 1000 == ts
        assert 0 <= write_ts % 1000 < 1000


def test_decoded_identity_matches_event_identity() -> None:
    event = decode(_json(EVENT))
    expected = event_identity(
        "acme", "dev-1", event.ts_ms, "running", 21.5, event.metrics, event.tags
    )
    assert (event.event_id, event.write_ts) == expected
    assert event.write_ts // 1000 == event.ts_ms
    assert 0 <= event.write_ts % 1000 < 1000


def test_duplicate_payloads_share_event_id() -> None:
    payload = _json(EVENT)
    first = decode(payload, received_ms=NOW_MS)
    redelivered = decode(payload, received_ms=NOW_MS + 30_000)
    assert (first.event_id, first.write_ts) == (redelivered.event_id, redelivered.write_ts)
    assert decode(_mp(EVENT)).event_id == first.event_id
    # Same content, different key order and whitespace.
    reordered = json.dumps(dict(reversed(list(EVENT.items()))), indent=2).encode()
    assert decode(reordered).event_id == first.event_id
    # sent_at is not part of the identity: a re-publish with a new send time is a duplicate.
    assert decode(_json(EVENT | {"sent_at": NOW_MS})).event_id == first.event_id


def test_identity_depends_on_topic() -> None:
    payload = _json(EVENT)
    assert decode(payload).event_id != decode(payload, device_id="dev-2").event_id
    assert decode(payload).event_id != decode(payload, tenant="beta").event_id


# -- the fast path and the model agree ---------------------------------------------

_SMALL = LimitsConfig(max_metrics=2, max_tags=2, max_key_length=3, max_state_length=3,
                      max_text_length=4)  # fmt: skip
_SMALL_DECODER = Decoder(_SMALL)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=3),
)
_maps = st.dictionaries(st.one_of(st.text(max_size=4), st.binary(max_size=2)), _scalars, max_size=3)
_events = st.dictionaries(
    st.sampled_from(["ts", "state", "value", "metrics", "tags", "sent_at", "other"]),
    st.one_of(_scalars, _maps, st.lists(_scalars, max_size=2)),
)


# Near-valid events, at and just over every bound of _SMALL.
_numbers = st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True),
                     st.booleans())  # fmt: skip
_texts = st.text(max_size=5)
_near_valid = st.fixed_dictionaries(
    {},
    optional={
        "ts": st.one_of(st.integers(0, 2**40), st.text(max_size=66), st.booleans()),
        "state": _texts,
        "value": st.one_of(_numbers, _texts),
        "metrics": st.dictionaries(_texts, _numbers, max_size=3),
        "tags": st.dictionaries(_texts, st.one_of(_texts, _numbers), max_size=3),
        "sent_at": _numbers,
    },
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_events, _near_valid))
def test_the_fast_path_accepts_only_what_the_model_accepts(raw: dict[str, Any]) -> None:
    fast = _SMALL_DECODER._fields(raw)
    if fast is None:
        return  # the model decides, as before
    model = _SMALL_DECODER._payload.model_validate(raw)  # raises if the fast path was wrong
    # None (left out, or null) is no metrics and no tags, as Decoder.decode takes it.
    metrics, tags = model.metrics or {}, model.tags or {}
    assert fast == (model.ts, model.state, model.value, metrics, tags, model.sent_at)


def test_the_fast_path_takes_a_typical_event() -> None:
    raw = {"ts": 1, "state": "on", "value": 1.5, "metrics": {"t": 1}, "tags": {"f": "3"}}
    assert DECODER._fields(raw) is not None
