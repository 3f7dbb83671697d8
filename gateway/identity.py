"""Event identity and row keys: the content hash and the write timestamp of
an event, and a device's state bucket and device hash.

Kept apart from decode.py and the store (no pydantic, no msgpack) so that
anything writing the gateway's rows, the bench's reference writers included,
computes exactly the same keys and timestamps.
"""

from __future__ import annotations

import hashlib
import uuid
import zlib

import orjson

__all__ = ["FIRST_HASH", "device_hash", "event_identity", "rejection_id", "state_bucket"]

# The least device_hash: every row's (device_hash, device_id) is above
# (FIRST_HASH, ""), as no device id is empty, so a clustering slice
# "> (FIRST_HASH, '')" starts at a partition's first row.
FIRST_HASH = -(2**31)
# 100-ns intervals from the UUID epoch (1582-10-15) to the Unix one.
_UUID_EPOCH = 0x01B21DD213814000


def state_bucket(device_id: str, buckets: int) -> int:
    """The device's latest_events_by_state bucket, of ``buckets``: stable
    across processes and versions (unlike hash())."""
    return zlib.crc32(device_id.encode()) % buckets if buckets > 1 else 0


def device_hash(device_id: str) -> int:
    """The first clustering column of latest_events_by_state: the same stable
    hash as the bucket's, as a signed 32-bit int. It spreads devices that
    leave a state in id order among the rows that stay (schema/002)."""
    return zlib.crc32(device_id.encode()) + FIRST_HASH


def rejection_id(received_ms: int, topic: str, payload: bytes) -> uuid.UUID:
    """The time UUID of a rejected message's row: its receive time, with the
    node and clock sequence taken from a hash of its topic and payload, so a
    message written again (a spool replayed after a restart) lands on the
    same row, where a random one made a second row each time."""
    digest = hashlib.blake2b(topic.encode() + b"\0" + payload, digest_size=8).digest()
    bits = int.from_bytes(digest, "big")
    node, clock_seq = bits >> 16, bits & 0x3FFF
    ticks = received_ms * 10_000 + _UUID_EPOCH  # 100 ns since 1582-10-15 (RFC 4122)
    return uuid.UUID(
        fields=(
            ticks & 0xFFFFFFFF,
            (ticks >> 32) & 0xFFFF,
            (ticks >> 48) & 0x0FFF | 0x1000,
            (clock_seq >> 8) & 0x3F | 0x80,
            clock_seq & 0xFF,
            node,
        )
    )


def event_identity(
    tenant: str,
    device_id: str,
    ts_ms: int,
    state: str | None,
    value: str | float | None,
    metrics: dict[str, float],
    tags: dict[str, str],
    *,
    micros: int | None = None,
) -> tuple[int, int]:
    """(event_id, write timestamp in µs) for an event's content.

    event_id is a signed 64-bit hash of everything the event says, so a
    redelivered copy maps to the same raw-telemetry row. The write timestamp is
    the event time in microseconds: exact when the time says its microseconds
    (``micros``, 0..999 below the millisecond), else the millisecond plus a
    deterministic tie-break (0..999 from the hash), so two different events of
    one device in the same millisecond still resolve the same way in every table.
    """
    fields: list[object] = [tenant, device_id, ts_ms, state, value, metrics, tags]
    if micros is not None:
        fields.append(micros)  # two events a few µs apart are two rows
    canonical = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    digest = hashlib.blake2b(canonical, digest_size=8).digest()
    event_id = int.from_bytes(digest, "big", signed=True)
    below_ms = event_id % 1000 if micros is None else micros
    return event_id, ts_ms * 1000 + below_ms
