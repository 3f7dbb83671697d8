"""Metadata on ingest: the metric names, tag keys and tag values a tenant's
devices use, and which devices carry a tag value (schema/006_metadata.cql;
the tsdb-cassandra README's metadata tables).

Promises:

* Written once per new entry: every entry written is remembered in an LRU of
  ``metadata.cache_size``; an entry seen again costs nothing. A forgotten one
  costs one idempotent write (key-only rows: an INSERT of an existing row
  changes nothing).
* Capped per tenant: a tenant adds at most ``metadata.max_per_tenant`` new
  entries per gateway process (a tag whose values never repeat, a timestamp
  say, cannot grow the tables without bound). Beyond, entries are not
  written, and each is counted (``metadata_capped``, per tenant too); the
  event itself is stored as usual. The count is per process: a restart
  starts it again, so a tenant's tables grow by at most the cap per start.
* Written with the event's other rows, before its acknowledgement; the
  values are those of stored events (decode validated them), sampled-out
  events included, since they say what devices use.
"""

from __future__ import annotations

from ..config import Config
from ..event import Event
from ..lru import LRU
from ..stats import Stats
from .rollups import VALUE_METRIC
from .sink import Pending, Write
from .write_session import Prepared, WriteSession

# Tenants whose counts of new entries are kept (LRU): a forgotten tenant
# starts counting again, as after a restart.
MAX_TENANTS = 10_000


class Metadata:
    _metric: Prepared
    _tag_key: Prepared
    _tag_value: Prepared
    _tag_device: Prepared

    def __init__(self, config: Config, stats: Stats) -> None:
        self._stats = stats
        self._seen: LRU[tuple[str, ...], bool] = LRU(config.metadata.cache_size)
        self._added: LRU[str, int] = LRU(MAX_TENANTS)
        self._cap = config.metadata.max_per_tenant

    async def prepare(self, session: WriteSession) -> None:
        self._metric = await session.prepare(
            "INSERT INTO {keyspace}.meta_metrics (tenant, metric) VALUES (?, ?)"
        )
        self._tag_key = await session.prepare(
            "INSERT INTO {keyspace}.meta_tag_keys (tenant, tag_key) VALUES (?, ?)"
        )
        self._tag_value = await session.prepare(
            "INSERT INTO {keyspace}.meta_tag_values (tenant, tag_key, tag_value) VALUES (?, ?, ?)"
        )
        self._tag_device = await session.prepare(
            "INSERT INTO {keyspace}.meta_tag_devices (tenant, tag_key, tag_value, device_id) "
            "VALUES (?, ?, ?, ?)"
        )

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        tenant = event.tenant
        out: list[Write] = []
        if event.value_num is not None:
            self._add(out, pending, ("m", tenant, VALUE_METRIC), self._metric, (tenant,))
        for metric in event.metrics:
            self._add(out, pending, ("m", tenant, metric), self._metric, (tenant,))
        for key, value in event.tags.items():
            self._add(out, pending, ("k", tenant, key), self._tag_key, (tenant,))
            self._add(out, pending, ("v", tenant, key, value), self._tag_value, (tenant, key))
            self._add(
                out,
                pending,
                ("d", tenant, key, value, event.device_id),
                self._tag_device,
                (tenant, key, value),
            )
        return out

    def _add(
        self,
        out: list[Write],
        pending: Pending,
        entry: tuple[str, ...],
        prepared: Prepared,
        partition: tuple[str, ...],
    ) -> None:
        seen = self._seen
        if seen.touch(entry):
            return
        tenant = entry[1]
        added = self._added.get(tenant) or 0
        if added >= self._cap:
            self._stats.metadata_capped += 1
            self._stats.metadata_capped_by_tenant.add(tenant)
            return
        self._added.put(tenant, added + 1)
        seen.put(entry, True)
        self._stats.metadata_writes += 1
        # The row's values: the partition key, then the entry's last part.
        out.append(
            Write(("meta", entry[0], *partition), prepared, (*partition, entry[-1]), pending)
        )
