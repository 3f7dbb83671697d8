"""Raw telemetry: every accepted event into its time-bucketed partition
(schema/003_telemetry.cql), and each new partition into ``telemetry_partitions``
so readers find every bucket of a time range without scanning.

Promises: partitions are (tenant, device, bucket_start, shard) with the
tenant's bucket size (default 1 h), so a partition stays bounded whatever the
device's rate. Rows carry the tenant's TTL. The raw row's key includes the
event's content hash, so a redelivered copy overwrites itself. The memory of
already-indexed partitions is an LRU of ``pipeline.partition_cache_size``
entries; forgetting one only costs one idempotent index write.
"""

from __future__ import annotations

from collections import OrderedDict

from cassandra.query import UNSET_VALUE

from .config import Config
from .database import Database
from .decode import Event
from .sink import Pending, Write


def bucket_start_ms(ts_ms: int, bucket_seconds: int) -> int:
    size = bucket_seconds * 1000
    return ts_ms - ts_ms % size


class Telemetry:
    def __init__(self, db: Database, config: Config) -> None:
        self._config = config
        self._indexed: OrderedDict[tuple[str, str, int, int], None] = OrderedDict()
        self._cache_size = config.pipeline.partition_cache_size
        self._insert_row = db.prepare(
            "INSERT INTO {keyspace}.telemetry "
            "(tenant, device_id, bucket_start, shard, ts, event_id, state, value, value_num, "
            "metrics, tags, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
        )
        self._insert_partition = db.prepare(
            "INSERT INTO {keyspace}.telemetry_partitions "
            "(tenant, device_id, bucket_start, shard, bucket_seconds) VALUES (?, ?, ?, ?, ?) "
            "USING TTL ?"
        )

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        tenant_cfg = self._config.tenant(event.tenant)
        bucket_seconds = int(tenant_cfg.telemetry_bucket)
        ttl = int(tenant_cfg.ttl)
        start = bucket_start_ms(event.ts_ms, bucket_seconds)
        shard = 0
        key = (event.tenant, event.device_id, start, shard)
        # Unset, not null, for absent fields: a null would write a tombstone.
        out = [
            Write(
                ("telemetry", *key),
                self._insert_row.bind(
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
                        event.metrics or UNSET_VALUE,
                        event.tags or UNSET_VALUE,
                        event.received_ms,
                        ttl,
                    )
                ),
                pending,
            )
        ]
        if key in self._indexed:
            self._indexed.move_to_end(key)
        else:
            # The index entry outlives the data it points to by one bucket.
            out.append(
                Write(
                    ("partitions", event.tenant, event.device_id),
                    self._insert_partition.bind(
                        (
                            event.tenant,
                            event.device_id,
                            start,
                            shard,
                            bucket_seconds,
                            ttl + bucket_seconds,
                        )
                    ),
                    pending,
                )
            )
            self._indexed[key] = None
            if len(self._indexed) > self._cache_size:
                self._indexed.popitem(last=False)
        return out


def _or_unset(value: object) -> object:
    return UNSET_VALUE if value is None else value
