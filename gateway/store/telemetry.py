"""Raw telemetry: every accepted event into its time-bucketed partition
(schema/003_telemetry.cql), and each new partition into ``telemetry_partitions``
so readers find every bucket of a time range without scanning.

Promises: partitions are (tenant, device, bucket_start, shard), so a
partition stays bounded whatever the device's rate:

* the bucket size follows the device's rate class (tenant config, the
  reference's classes): 15 min above 1 msg/s, 6 h below 1 msg/min, 1 h between.
  The rate is measured in event time (smoothed gap between a device's events,
  an LRU like the others), so a slow device reads as slow and back-fill keeps
  its real rate;
* a device whose partition stays hot (``sink.HotPartitions``) is split over K
  shards, K doubling per hot window up to ``hot_partitions.max_shards`` and
  halving per cool one; a row's shard is its event_id modulo K.

Every (bucket, shard) partition is recorded in ``telemetry_partitions``, so
readers find all of them. Rows carry the tenant's TTL. The raw row's key
includes the event's content hash, so a redelivered copy overwrites itself
(if the device changed rate class or K in between, the copy lands in another
partition and readers drop it: they de-duplicate by (ts, event_id)).
The memory of already-indexed partitions is an LRU of
``pipeline.partition_cache_size`` entries (forgetting one costs one idempotent
index write), each with the time its entry was written: an entry is written
again for a row that comes a bucket or more after it (or half the TTL, if
that is less), so it never expires under rows written later; the shard
counts are an LRU of the same size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

from ..config import Config, TenantConfig
from ..event import Event
from ..lru import LRU
from ..stats import Cache
from .sink import Pending, Write
from .write_session import UNSET, Prepared, WriteSession

log = logging.getLogger(__name__)


# Weight of the newest gap in the smoothed gap: about the last 10 events count.
GAP_ALPHA = 0.2


def bucket_start_ms(ts_ms: int, bucket_seconds: int) -> int:
    size = bucket_seconds * 1000
    return ts_ms - ts_ms % size


class _Gap:
    """A device's last event time and smoothed gap between its events (ms)."""

    def __init__(self, last_ts: int) -> None:
        self.last_ts = last_ts
        self.gap: float | None = None  # until a second event


class _Buckets:
    """A tenant's TTL and bucket sizes, read once from its TenantConfig (a
    pydantic model: config.tenant() and its fields cost interpreted calls and
    lookups per message)."""

    def __init__(self, cfg: TenantConfig) -> None:
        self.ttl = int(cfg.ttl)
        self.adaptive = cfg.adaptive_buckets
        self.bucket = int(cfg.telemetry_bucket)
        self.fast_above = cfg.fast_above
        self.fast_bucket = int(cfg.fast_bucket)
        self.slow_below = cfg.slow_below
        self.slow_bucket = int(cfg.slow_bucket)


class Telemetry:
    _insert_row: Prepared
    _insert_partition: Prepared

    def __init__(self, config: Config) -> None:
        # Each tenant the config names, and the one every other tenant gets.
        self._buckets = {name: _Buckets(config.tenant(name)) for name in config.tenants}
        self._other_buckets = _Buckets(config.tenant("default"))
        size = config.pipeline.partition_cache_size
        self._shards: LRU[tuple[str, str], int] = LRU(size)
        # Per device: its last event time and smoothed gap between events.
        self._gaps: LRU[tuple[str, str], _Gap] = LRU(size)
        self._max_shards = config.hot_partitions.max_shards
        # When each partition's index entry was last written (monotonic s).
        self._indexed: LRU[tuple[str, str, int, int, int], float] = LRU(size)

    def caches(self) -> dict[str, Cache]:
        """Its bounded caches, by name, for the metrics (gateway_cache_*)."""
        return {
            "telemetry_shards": self._shards,
            "telemetry_gaps": self._gaps,
            "telemetry_partitions_indexed": self._indexed,
        }

    async def prepare(self, session: WriteSession) -> None:
        self._insert_row = await session.prepare(
            "INSERT INTO {keyspace}.telemetry "
            "(tenant, device_id, bucket_start, shard, ts, event_id, state, value, value_num, "
            "metrics, tags, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?",
            timestamps=(2, 4, 11),
        )
        self._insert_partition = await session.prepare(
            "INSERT INTO {keyspace}.telemetry_partitions "
            "(tenant, device_id, bucket_start, shard, bucket_seconds) VALUES (?, ?, ?, ?, ?) "
            "USING TTL ?",
            timestamps=(2,),
        )

    def _rate(self, event: Event) -> float | None:
        """The device's rate by event time: an EWMA of the gap between its
        events (so back-fill arriving in a burst keeps its real rate, and a
        device sending once an hour reads as slow). None until two events."""
        key = (event.tenant, event.device_id)
        known = self._gaps.get(key)
        if known is None:
            self._gaps.put(key, _Gap(event.ts_ms))
            return None
        gap = known.gap
        step = event.ts_ms - known.last_ts
        if step <= 0:  # out of order or duplicate: no new information
            return None if gap is None else 1000.0 / max(gap, 1.0)
        gap = step if gap is None else gap + GAP_ALPHA * (step - gap)
        known.last_ts = event.ts_ms  # in place: get() marked it used
        known.gap = gap
        return 1000.0 / max(gap, 1.0)

    def _tenant(self, tenant: str) -> _Buckets:
        found = self._buckets.get(tenant)
        return found if found is not None else self._other_buckets

    def mark_hot(self, partition: Hashable) -> None:
        """Sink callback: a partition went over the hot threshold."""
        if isinstance(partition, tuple) and partition[0] == "telemetry":
            device = (partition[1], partition[2])
            shards = min(self._max_shards, (self._shards.get(device) or 1) * 2)
            if shards > 1:
                self._shards.put(device, shards)
                log.info("device %s/%s: raw telemetry split over %d shards", *device, shards)

    def window_ended(self, warm: set[Hashable]) -> None:
        """Sink callback: devices none of whose partitions was warm (over half
        the hot threshold) in the last window cool down: halving their shards
        keeps each under it."""
        warm_devices = {(p[1], p[2]) for p in warm if isinstance(p, tuple) and p[0] == "telemetry"}
        for device, shards in [(d, k) for d, k in self._shards.items() if d not in warm_devices]:
            if shards > 2:
                self._shards.put(device, shards // 2)
            else:
                self._shards.pop(device)

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        buckets = self._tenant(event.tenant)
        bucket_seconds = _bucket_seconds(buckets, self._rate(event))
        ttl = buckets.ttl
        start = bucket_start_ms(event.ts_ms, bucket_seconds)
        shards = self._shards.peek((event.tenant, event.device_id)) or 1
        shard = event.event_id % shards
        key = (event.tenant, event.device_id, start, shard)
        # Unset, not null, for absent fields: a null would write a tombstone.
        out = [
            Write(
                ("telemetry", *key),
                self._insert_row,
                (
                    event.tenant,
                    event.device_id,
                    start,
                    shard,
                    event.ts_ms,
                    event.event_id,
                    _or_unset(event.state),
                    _or_unset(event.value_text),
                    _or_unset(event.value_num),
                    event.metrics or UNSET,
                    event.tags or UNSET,
                    event.received_ms,
                    ttl,
                ),
                pending,
            )
        ]
        indexed = (*key, bucket_seconds)
        written_at = self._indexed.get(indexed)
        now = time.monotonic()
        if written_at is None or now - written_at >= min(bucket_seconds, ttl / 2):
            # The index entry outlives the data it points to by one bucket,
            # counted from its own write. A live partition's rows all come
            # within that bucket; a row written later (back-fill, a late
            # delivery) lives its TTL from its own write, so the entry is
            # written again for it (without, that row outlived its entry by
            # up to half the TTL, unfindable: history and the roll-ups read
            # partitions through the index). Written once per run, it had
            # expired under a gateway up longer than the TTL.
            out.append(
                Write(
                    ("partitions", event.tenant, event.device_id),
                    self._insert_partition,
                    (
                        event.tenant,
                        event.device_id,
                        start,
                        shard,
                        bucket_seconds,
                        ttl + bucket_seconds,
                    ),
                    pending,
                )
            )
            self._indexed.put(indexed, now)
        return out


def _bucket_seconds(cfg: _Buckets, rate: float | None) -> int:
    if not cfg.adaptive or rate is None:
        return cfg.bucket
    if rate > cfg.fast_above:
        return cfg.fast_bucket
    if rate < cfg.slow_below:
        return cfg.slow_bucket
    return cfg.bucket


def _or_unset(value: object) -> object:
    return UNSET if value is None else value
