"""Read side for the CLI: devices by state, a device's latest event, history.

* ``devices_in_state`` reads every bucket partition of (tenant, state): with
  the default single bucket it is one partition read (Solution 3).
* ``history`` lists the device's raw-telemetry partitions for the range from
  ``telemetry_partitions`` (whatever bucket sizes and shards were used), reads
  each, and merges them newest first.
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cassandra import ReadFailure

from ..config import MAX_BUCKET_SECONDS, Config
from ..errors import QueryError
from .database import Database

# The failure code a replica gives for a read that met more deleted rows than
# its tombstone_failure_threshold (native protocol v5, READ_FAILURE reasons).
READ_TOO_MANY_TOMBSTONES = 0x0001


@dataclass(frozen=True, slots=True)
class LatestRow:
    device_id: str
    ts: datetime
    value: str | float | None
    state: str | None = None
    metrics: dict[str, float] | None = None
    tags: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device_id": self.device_id, "ts": iso(self.ts), "value": self.value}
        if self.state is not None or self.metrics is not None:
            out |= {"state": self.state, "metrics": self.metrics or {}, "tags": self.tags or {}}
        return out


@dataclass(frozen=True, slots=True)
class HistoryRow:
    ts: datetime
    state: str | None
    value: str | float | None
    metrics: dict[str, float]
    tags: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        return {
            "ts": iso(self.ts),
            "state": self.state,
            "value": self.value,
            "metrics": self.metrics,
            "tags": self.tags,
        }


def iso(ts: datetime) -> str:
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return aware.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _value(text: str | None, num: float | None) -> str | float | None:
    return text if text is not None else num


async def devices_in_state(
    db: Database, config: Config, tenant: str, state: str
) -> list[LatestRow]:
    buckets = config.tenant(tenant).state_buckets
    query = (
        f"SELECT device_id, ts, value, value_num FROM {db.keyspace}.latest_events_by_state "
        "WHERE tenant = %s AND state = %s AND bucket = %s"
    )
    try:
        parts = await asyncio.gather(
            *(db.execute(query, (tenant, state, b)) for b in range(buckets))
        )
    except ReadFailure as exc:
        codes = set((exc.error_code_map or {}).values())
        # Protocol v4 (what the CLI speaks) gives no reason code; v5 does.
        if codes and READ_TOO_MANY_TOMBSTONES not in codes:
            raise
        cause = (
            "a partition holds more deleted rows (devices that left the state within "
            "gc_grace_seconds) than the tombstone_failure_threshold"
        )
        raise QueryError(
            f"Cassandra failed to read state {state!r} of tenant {tenant!r}"
            + (f": {cause}" if codes else f", most likely because {cause}")
            + f". Spread the state over more partitions with tenants.{tenant}.state_buckets "
            f'(now {buckets}; README, "The state view: which model, by measurement")'
        ) from None
    rows = [
        LatestRow(r.device_id, r.ts, _value(r.value, r.value_num)) for part in parts for r in part
    ]
    return sorted(rows, key=lambda r: r.device_id)


async def latest_event(db: Database, tenant: str, device_id: str) -> LatestRow | None:
    rows = await db.execute(
        f"SELECT device_id, state, ts, value, value_num, metrics, tags "
        f"FROM {db.keyspace}.latest_events_by_device WHERE tenant = %s AND device_id = %s",
        (tenant, device_id),
    )
    if not rows:
        return None
    r = rows[0]
    return LatestRow(
        r.device_id,
        r.ts,
        _value(r.value, r.value_num),
        r.state,
        dict(r.metrics or {}),
        dict(r.tags or {}),
    )


async def history(
    db: Database,
    tenant: str,
    device_id: str,
    since: datetime,
    until: datetime,
    limit: int,
) -> list[HistoryRow]:
    since_ms = int(since.timestamp() * 1000)
    until_ms = int(until.timestamp() * 1000)
    partitions = await db.execute(
        f"SELECT bucket_start, shard, bucket_seconds FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s AND bucket_start <= %s AND bucket_start > %s",
        (tenant, device_id, until_ms, since_ms - MAX_BUCKET_SECONDS * 1000),
    )
    # A partition may be listed once per bucket size it was written with: the
    # longest decides whether it overlaps the range.
    longest: dict[tuple[datetime, int], int] = {}
    for p in partitions:
        key = (p.bucket_start, p.shard)
        longest[key] = max(longest.get(key, 0), p.bucket_seconds)
    wanted = [
        (start, shard)
        for (start, shard), seconds in longest.items()
        if _ms(start) + seconds * 1000 > since_ms
    ]
    query = (
        f"SELECT ts, event_id, state, value, value_num, metrics, tags FROM {db.keyspace}.telemetry "
        "WHERE tenant = %s AND device_id = %s AND bucket_start = %s AND shard = %s "
        "AND ts >= %s AND ts <= %s LIMIT %s"
    )
    parts = await asyncio.gather(
        *(
            db.execute(query, (tenant, device_id, start, shard, since_ms, until_ms, limit))
            for start, shard in wanted
        )
    )
    # Each partition is already newest first; merge them. A redelivered event
    # can sit in two partitions (its device changed bucket size or shard count
    # in between): keep one copy per (ts, event_id).
    merged = heapq.merge(*parts, key=lambda r: _ms(r.ts), reverse=True)
    out = []
    last_ts: datetime | None = None
    seen: set[int] = set()
    for r in merged:
        if r.ts != last_ts:
            last_ts, seen = r.ts, set()
        if r.event_id in seen:
            continue
        seen.add(r.event_id)
        out.append(
            HistoryRow(
                r.ts,
                r.state,
                _value(r.value, r.value_num),
                dict(r.metrics or {}),
                dict(r.tags or {}),
            )
        )
        if len(out) >= limit:
            break
    return out


def _ms(ts: datetime) -> int:
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return int(aware.timestamp() * 1000)
