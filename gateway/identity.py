"""Event identity: the content hash and the write timestamp of an event.

Kept apart from decode.py (no pydantic, no msgpack) so that anything writing
the gateway's rows, the bench's reference writers included, computes exactly
the same keys and timestamps.
"""

from __future__ import annotations

import hashlib

import orjson

__all__ = ["event_identity"]


def event_identity(
    tenant: str,
    device_id: str,
    ts_ms: int,
    state: str | None,
    value: str | float | None,
    metrics: dict[str, float],
    tags: dict[str, str],
) -> tuple[int, int]:
    """(event_id, write timestamp in µs) for an event's content.

    event_id is a signed 64-bit hash of everything the event says, so a
    redelivered copy maps to the same raw-telemetry row. The write timestamp is
    the event time in microseconds plus a deterministic tie-break below the
    millisecond (0..999 from the hash), so two different events of one device in
    the same millisecond still resolve the same way in every table.
    """
    canonical = orjson.dumps(
        [tenant, device_id, ts_ms, state, value, metrics, tags], option=orjson.OPT_SORT_KEYS
    )
    digest = hashlib.blake2b(canonical, digest_size=8).digest()
    event_id = int.from_bytes(digest, "big", signed=True)
    return event_id, ts_ms * 1000 + (event_id % 1000)
