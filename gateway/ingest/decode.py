"""Decode and validate one MQTT payload into an :class:`Event`.

Format: JSON (orjson) or MessagePack, chosen by the MQTT v5 content type when
present, otherwise by the first byte (``{`` or whitespace means JSON, a
MessagePack map header means MessagePack). One event per message::

    {"ts": <epoch ms int | RFC 3339 string>, "state": str, "value": str | number,
     "metrics": {name: number}, "tags": {key: str}, "sent_at": <epoch ms, optional>}

Every field but ``ts`` is optional; without ``ts`` the gateway's receive time is
used (and counted). ``sent_at`` is the publisher's clock at publish time, used
only to measure latency. Unknown fields are rejected rather than silently
dropped, so what is stored is exactly what was sent.

Promises: ``decode`` never raises anything but :class:`DecodeError`, whose
``reason`` is one of REASONS and whose detail names the field and the limit.
Validation is pydantic in strict mode (no coercion: ``"21"`` is not a number,
``true`` is not a number), with bounded sizes from ``[limits]``. A
well-formed event takes a hand-written fast path (:meth:`Decoder._fields`)
that accepts only what that model accepts; anything it is unsure of goes
through the model, so every rejection and its message come from pydantic.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import msgpack
import orjson
from pydantic import ValidationError

from ..config import LimitsConfig
from ..errors import DecodeError
from ..event import Event
from ..identity import event_identity
from ..topic_filters import NO_URL_NAMES, NO_URL_REASON, unseen_char
from .payload_model import MAX_TS_TEXT, payload_model

REASONS = (
    "topic",  # the topic matches no template or has a bad level
    "too_large",  # payload over limits.max_payload_bytes
    "empty",  # zero-length payload
    "invalid_json",
    "invalid_msgpack",
    "unsupported_content_type",
    "not_an_object",  # the payload is valid but not a map/object
    "invalid_field",  # a field has the wrong type, size or value
    "unknown_field",
    "invalid_ts",  # unparseable, or outside the plausible range
    "too_many_states",  # set by the writer: the tenant's state budget is spent
    "quota",  # set by the pipeline: a new device over the tenant's device quota
)

_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})?$"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)
JSON_TYPES = frozenset({"application/json", "text/json"})
MSGPACK_TYPES = frozenset(
    {"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"}
)


def state_problem(state: str) -> str | None:
    """Why ``state`` (its whitespace at the ends dropped, as Decoder does)
    cannot be one, or None: a label people must tell apart."""
    if not state:
        return "only whitespace, so the page and the CLI would show no name"
    if state in NO_URL_NAMES:
        return NO_URL_REASON
    unseen = unseen_char(state)
    if unseen is not None:
        return (
            f"holds U+{ord(unseen):04X}, a control or invisible character, so the "
            "page and the CLI could not show it"
        )
    return None


_FIELDS = frozenset({"ts", "state", "value", "metrics", "tags", "sent_at"})
_EMPTY: dict[str, Any] = {}
# ts, state, value, metrics, tags, sent_at
_Fields = tuple[
    int | str | None,
    str | None,
    str | float | None,
    dict[str, int | float],
    dict[str, str],
    float | None,
]


def _finite(number: object) -> bool:
    """A JSON/MessagePack number the model takes: int or finite float, never bool."""
    if type(number) is int:
        return True
    # x - x is 0.0 for a finite float and NaN for an infinity or NaN: native
    # arithmetic when compiled, where math.isfinite is a module lookup and a
    # call, several times per message.
    return type(number) is float and number - number == 0.0


class Decoder:
    """Validates payloads against the configured limits. One per gateway."""

    def __init__(self, limits: LimitsConfig) -> None:
        self._limits = limits
        self._payload = payload_model(limits)
        self._min_ms = int(limits.min_timestamp.timestamp() * 1000)
        self._skew_ms = int(limits.max_future_skew * 1000)
        # Read once: a pydantic model's fields are a getattr hook's lookups,
        # six of them per message here.
        self._max_payload = limits.max_payload_bytes
        self._max_state = limits.max_state_length
        self._max_text = limits.max_text_length
        self._max_metrics = limits.max_metrics
        self._max_key = limits.max_key_length
        self._max_tags = limits.max_tags

    def decode(
        self,
        tenant: str,
        device_id: str,
        payload: bytes,
        content_type: str | None,
        received_ms: int,
        received_us: int = 0,
    ) -> Event:
        """The event of a payload, or :class:`DecodeError`. An event without
        ``ts`` takes ``received_ms`` as its time, and is written at
        ``received_us`` (increasing in the order of arrival:
        Delivery.received_us) when given, else by the hash tie-break."""
        size = len(payload)
        if size == 0:
            raise DecodeError("empty", "the payload is empty")
        if size > self._max_payload:
            raise DecodeError(
                "too_large",
                f"payload of {size} bytes is over the limit of "
                f"{self._limits.max_payload_bytes} (limits.max_payload_bytes)",
            )
        raw = self._parse(payload, content_type)
        if not isinstance(raw, dict):
            raise DecodeError(
                "not_an_object", f"expected one event as an object, got {type(raw).__name__}"
            )
        fields = self._fields(raw)
        if fields is None:
            try:
                data = self._payload.model_validate(raw)
            except ValidationError as exc:
                raise _reason(exc) from None
            metrics, tags = data.metrics or {}, data.tags or {}
            fields = (data.ts, data.state, data.value, metrics, tags, data.sent_at)
        return self._event(tenant, device_id, received_ms, received_us, *fields)

    def _fields(self, raw: dict[Any, Any]) -> _Fields | None:
        """The fields of a well-formed event without building a model, or None.

        Must accept nothing the pydantic model rejects (tests/test_decode.py
        checks both agree); returning None is always safe.
        """
        if not raw.keys() <= _FIELDS:
            return None
        ts = raw.get("ts")
        if ts is not None and not (
            (type(ts) is int) or (type(ts) is str and len(ts) <= MAX_TS_TEXT)
        ):
            return None
        state = raw.get("state")
        if state is not None and not (type(state) is str and 0 < len(state) <= self._max_state):
            return None
        value = raw.get("value")
        if value is not None and not (
            _finite(value) or (type(value) is str and len(value) <= self._max_text)
        ):
            return None
        sent_at = raw.get("sent_at")
        if sent_at is not None and not _finite(sent_at):
            return None
        metrics = raw.get("metrics")
        if metrics is None:  # left out, or null: as every field
            metrics = _EMPTY
        elif type(metrics) is not dict or len(metrics) > self._max_metrics:
            return None
        max_key = self._max_key
        for name, number in metrics.items():
            if not (type(name) is str and 0 < len(name) <= max_key and _finite(number)):
                return None
        tags = raw.get("tags")
        if tags is None:
            tags = _EMPTY
        elif type(tags) is not dict or len(tags) > self._max_tags:
            return None
        max_text = self._max_text
        for key, text in tags.items():
            if not (
                type(key) is str
                and 0 < len(key) <= max_key
                and type(text) is str
                and len(text) <= max_text
            ):
                return None
        return ts, state, value, metrics, tags, sent_at

    def _event(
        self,
        tenant: str,
        device_id: str,
        received_ms: int,
        received_us: int,
        ts: int | str | None,
        state: str | None,
        value: str | float | None,
        raw_metrics: dict[str, int | float],
        raw_tags: dict[str, str],
        sent_at: float | None,
    ) -> Event:
        if state is not None:
            # Whitespace at the ends dropped ("on\r\n", "on " are "on"): a
            # second tile called on, and rejecting a device's every message
            # over its firmware's line end, were both worse.
            sent, state = state, state.strip()
            problem = state_problem(state)
            if problem is not None:
                raise DecodeError("invalid_field", f"state: {sent!r}: {problem}")
        micros: int | None = None  # below the millisecond, when the ts says
        if ts is None:
            ts_ms, from_receive = received_ms, True
        else:
            (ts_ms, micros), from_receive = self._timestamp(ts), False
            if ts_ms < self._min_ms:
                hint = " (epoch seconds instead of milliseconds?)" if ts_ms > 0 else ""
                raise DecodeError(
                    "invalid_ts",
                    f"ts {ts!r} is before limits.min_timestamp "
                    f"{self._limits.min_timestamp.isoformat()}{hint}",
                )
            if ts_ms > received_ms + self._skew_ms:
                raise DecodeError(
                    "invalid_ts",
                    f"ts {ts!r} is {(ts_ms - received_ms) / 1000:.0f} s in the future, "
                    f"over limits.max_future_skew ({self._limits.max_future_skew:.0f} s)",
                )
        value_text = value if isinstance(value, str) else None
        value_num = float(value) if value is not None and not isinstance(value, str) else None
        metrics = {name: float(v) for name, v in raw_metrics.items()}
        tags = dict(raw_tags)
        # Numbers are hashed as floats (as stored): 1 and 1.0 are one event.
        event_id, write_ts = event_identity(
            tenant,
            device_id,
            ts_ms,
            state,
            value_text if value_text is not None else value_num,
            metrics,
            tags,
            micros=micros,
        )
        if from_receive and received_us:
            # Written at its receive time to the µs (Delivery.received_us):
            # of a device's untimed events in one millisecond (a burst, a
            # drained backlog) the last to arrive is the newest, where the
            # hash tie-break picked one at random (CLI probe: the latest of
            # ten was the sixth). Its event id stays the content's and the
            # millisecond's.
            write_ts = received_us
        return Event(
            tenant=tenant,
            device_id=device_id,
            ts_ms=ts_ms,
            state=state,
            value_text=value_text,
            value_num=value_num,
            metrics=metrics,
            tags=tags,
            received_ms=received_ms,
            ts_from_receive=from_receive,
            sent_at_ms=float(sent_at) if sent_at is not None else None,
            event_id=event_id,
            write_ts=write_ts,
        )

    def _parse(self, payload: bytes, content_type: str | None) -> Any:
        kind = _kind(payload, content_type)
        if kind == "json":
            try:
                return orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise self._json_error(payload, exc) from None
        try:
            # strict_map_key: keys must be str/bytes; raw=False: str must be UTF-8.
            return msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except UnicodeDecodeError:
            raise DecodeError("invalid_msgpack", "a text field is not valid UTF-8") from None
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            why = str(exc) or type(exc).__name__  # FormatError/StackError carry no text
            text = ""
            if not content_type and _text_like(payload):
                # Text, without a content type: its sender likely meant JSON,
                # and "not valid MessagePack" alone puzzled (CLI probe).
                text = "; it is text, but no JSON event either: that starts with '{'"
            raise DecodeError("invalid_msgpack", f"not valid MessagePack: {why}{text}") from None

    def _json_error(self, payload: bytes, exc: orjson.JSONDecodeError) -> DecodeError:
        """Why orjson refused ``payload``, said for its sender. orjson's own
        message places the error by character but names no field, and reads
        bytes that are not UTF-8 as "surrogates not allowed" at the start
        (CLI probe). Python's json takes NaN, infinities and numbers past a
        double's range, and lone surrogates, which orjson refuses: when it
        reads the payload, the model names the field (as for MessagePack).
        Should the model take what orjson refused, orjson's reason stands:
        nothing is accepted for being read by Python's json."""
        try:
            text = payload.decode()
        except UnicodeDecodeError as bad:
            first = payload[0]
            hint = (
                "; MessagePack? Its content type is application/msgpack"
                if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)  # a msgpack map
                else ""
            )
            return DecodeError(
                "invalid_json",
                f"not valid JSON: not UTF-8 text (byte 0x{payload[bad.start]:02x} at offset "
                f"{bad.start}){hint}",
            )
        try:
            loose = json.loads(text)
        except (ValueError, RecursionError):
            loose = None
        if isinstance(loose, dict):
            try:
                self._payload.model_validate(loose)
            except ValidationError as refused:
                return _reason(refused)
        return DecodeError("invalid_json", f"not valid JSON: {exc}")

    @staticmethod
    def _timestamp(ts: int | str) -> tuple[int, int | None]:
        """Epoch ms, and the microseconds below the millisecond when the time
        has more than three fractional digits (else None)."""
        if isinstance(ts, int):
            return ts, None
        match = _RFC3339.match(ts)
        if not match:
            raise DecodeError(
                "invalid_ts", f"ts {ts!r} is neither epoch milliseconds nor an RFC 3339 time"
            )
        try:
            parsed = datetime.fromisoformat(ts.upper())  # 3.11 wants 'T' and 'Z'

        except ValueError:
            raise DecodeError(
                "invalid_ts", f"ts {ts!r} is neither epoch milliseconds nor an RFC 3339 time"
            ) from None
        if parsed.tzinfo is None:
            raise DecodeError("invalid_ts", f"ts {ts!r} has no UTC offset (RFC 3339 needs one)")
        # Exact integer arithmetic: float timestamps can land 1 ms short.
        since = parsed - _EPOCH
        fraction = match.group(1) or ""
        micros = since.microseconds % 1000 if len(fraction) > 4 else None
        return since // _ONE_MS, micros


def _text_like(payload: bytes) -> bool:
    """Whether ``payload`` reads as printable UTF-8 text (lines and tabs allowed)."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return False
    return text.replace("\n", "").replace("\r", "").replace("\t", "").isprintable()


def _kind(payload: bytes, content_type: str | None) -> str:
    if content_type:
        base = content_type.split(";", 1)[0].strip().lower()
        if base in JSON_TYPES:
            return "json"
        if base in MSGPACK_TYPES:
            return "msgpack"
        raise DecodeError(
            "unsupported_content_type",
            f"content type {content_type!r} is neither JSON nor MessagePack",
        )
    first = payload[0]
    # A JSON object starts with '{' (maybe after whitespace); anything else is
    # tried as MessagePack, whose maps start with 0x80-0x8f, 0xde or 0xdf. A
    # UTF-8 byte order mark is JSON too, so that the reason names it.
    if first in b'{ \t\r\n["' or payload.startswith(b"\xef\xbb\xbf"):
        return "json"
    return "msgpack"


_MAPS = frozenset({"metrics", "tags"})
_EXPECTED = {
    "ts": "epoch milliseconds (an integer) or an RFC 3339 string",
    "value": "text or a finite number",
    "metrics": "a finite number",
    "sent_at": "a finite number",
}


def _reason(exc: ValidationError) -> DecodeError:
    errors = exc.errors(include_url=False)
    err = errors[0]
    parts = _clean_loc(err["loc"])
    # The payload itself ("()": a key Python's json read that no field can
    # be, a lone surrogate): named as the payload, not an IndexError below.
    head = parts[0] if parts else ""
    field = ".".join(part if len(part) <= 40 else part[:37] + "..." for part in parts) or "payload"
    if err["type"] == "extra_forbidden":
        return DecodeError("unknown_field", f"unknown field {field!r}")
    same_field = [e for e in errors if _clean_loc(e["loc"]) == parts]
    # A union member of the right type that failed on a limit (text too long)
    # says more than the members of other types.
    fitting = [e for e in same_field if not e["type"].endswith("_type")]
    if len(same_field) > 1 and fitting:
        err = fitting[0]
    value = err.get("input")
    if any(e["type"] == "finite_number" for e in same_field):
        value = next(e["input"] for e in same_field if e["type"] == "finite_number")
        message = f"must be a finite number, got {value!r}"
    elif len(same_field) > 1 and head in _EXPECTED and err["type"].endswith("_type"):
        # A union member failed on type: say what the field accepts.
        message = f"expected {_EXPECTED[head]}, got {_type_name(value)}"
    else:
        message = str(err["msg"])
        if isinstance(value, str | int | float | bool) and len(repr(value)) <= 40:
            message += f" (got {value!r})"
        elif isinstance(value, str):
            message += f" (got {len(value)} characters)"
    reason = "invalid_ts" if head == "ts" else "invalid_field"
    return DecodeError(reason, f"{field}: {message}")


def _clean_loc(loc: tuple[int | str, ...]) -> list[str]:
    # pydantic appends union members to the location ("str", "union[int,float]"),
    # which could collide with a metric named "int": keep the field, and for the
    # two maps the key, and drop the rest.
    parts = [str(p) for p in loc]
    return parts[:2] if parts and parts[0] in _MAPS else parts[:1]


def _type_name(value: object) -> str:
    names = {
        bool: "a boolean",
        str: "text",
        int: "an integer",
        float: "a float",
        bytes: "binary data",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    if type(value) is float and value.is_integer() and abs(value) >= 2**63:
        # JSON parsers hand an integer beyond 64 bits over as a float.
        return "a number beyond 64-bit integers"
    return names.get(type(value), type(value).__name__)
