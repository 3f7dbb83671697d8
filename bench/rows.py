"""The rows the gateway writes for one event, for the bench's own writers
(bench/ceiling.py and bench/naive_bridge.py). Kept light (no aiomqtt, no
pydantic) so the naive bridge loads only what such a bridge needs.

Same statements, parameters and write timestamps as gateway/store/latest.py and
gateway/store/telemetry.py, without the gateway's batching and coalescing: per event

* INSERT into telemetry (client-stamped by the driver, with the tenant's TTL),
* INSERT into telemetry_partitions the first time a (device, bucket) is seen,
* INSERT into latest_events_by_device USING TIMESTAMP write_ts,
* INSERT into latest_events_by_state and DELETE from every other state's
  partition, USING TIMESTAMP write_ts (generation 0: these writers never
  rotate a state partition, gateway/store/rotate.py).

Event ids and write timestamps come from gateway/identity.py, the gateway's own
(a module without pydantic, so the naive bridge stays light).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from cassandra.query import UNSET_VALUE

from gateway.identity import device_hash, event_identity

__all__ = ["event_identity"]

KEYSPACE = "gateway_bench"
STATES = ("on", "off")
SUBSCRIPTION = "gwbench/+/devices/+/events"
# Defaults of [tenants.default]: 1 h telemetry buckets, 30 d TTL, 1 state bucket.
TELEMETRY_BUCKET_S = 3600
TTL_S = 30 * 86400
SESSION_EXPIRY = 600

CQL_INSERT_STATE = (
    "INSERT INTO {ks}.latest_events_by_state "
    "(tenant, state, bucket, gen, device_hash, device_id, ts, value, tags) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
)
CQL_DELETE_STATE = (
    "DELETE FROM {ks}.latest_events_by_state USING TIMESTAMP ? "
    "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? "
    "AND device_hash = ? AND device_id = ?"
)
CQL_INSERT_DEVICE = (
    "INSERT INTO {ks}.latest_events_by_device "
    "(tenant, device_id, state, state_event_id, ts, value, value_num, metrics, tags) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
)
CQL_INSERT_TELEMETRY = (
    "INSERT INTO {ks}.telemetry "
    "(tenant, device_id, bucket_start, shard, ts, event_id, state, value, value_num, "
    "metrics, tags, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
)
CQL_INSERT_PARTITION = (
    "INSERT INTO {ks}.telemetry_partitions "
    "(tenant, device_id, bucket_start, shard, bucket_seconds) VALUES (?, ?, ?, ?, ?) "
    "USING TTL ?"
)


def cql(template: str) -> str:
    return template.replace("{ks}", KEYSPACE)


def _or_unset(value: object) -> object:
    return UNSET_VALUE if value is None else value


def state_value(text: str | None, num: float | None) -> str:
    """The value as latest_events_by_state stores it: JSON, never null (as
    gateway/store/latest.py's state_value, which would bring pydantic along)."""
    return orjson.dumps(text if text is not None else num).decode()


# Each statement's CQL and which of its parameters are timestamps (epoch ms),
# as gateway/store/write_session.py wants them.
ALL_CQL = {
    "insert_state": (CQL_INSERT_STATE, (6,)),
    "delete_state": (CQL_DELETE_STATE, ()),
    "insert_device": (CQL_INSERT_DEVICE, (4,)),
    "insert_telemetry": (CQL_INSERT_TELEMETRY, (2, 4, 11)),
    "insert_partition": (CQL_INSERT_PARTITION, (2,)),
}


class Statements:
    """The five prepared statements, and the rows of one event.

    ``prepared`` maps each name of ALL_CQL to its prepared statement, from
    whichever driver the writer uses (UNSET_VALUE marks an unset parameter
    for both of the gateway's).
    """

    def __init__(self, prepared: dict[str, Any]) -> None:
        self.insert_state = prepared["insert_state"]
        self.delete_state = prepared["delete_state"]
        self.insert_device = prepared["insert_device"]
        self.insert_telemetry = prepared["insert_telemetry"]
        self.insert_partition = prepared["insert_partition"]
        self._indexed: set[tuple[str, str, int]] = set()

    @classmethod
    def prepare_with(cls, prepare: Callable[[str], Any]) -> Statements:
        return cls({name: prepare(cql(text)) for name, (text, _) in ALL_CQL.items()})

    def rows(
        self,
        tenant: str,
        device: str,
        ts_ms: int,
        state: str | None,
        value_text: str | None,
        value_num: float | None,
        metrics: dict[str, float],
        tags: dict[str, str],
        received_ms: int,
        event_id: int,
        write_ts: int,
    ) -> list[tuple[Any, tuple[Any, ...]]]:
        start = ts_ms - ts_ms % (TELEMETRY_BUCKET_S * 1000)
        out: list[tuple[Any, tuple[Any, ...]]] = [
            (
                self.insert_telemetry,
                (
                    tenant,
                    device,
                    start,
                    0,
                    ts_ms,
                    event_id,
                    _or_unset(state),
                    _or_unset(value_text),
                    _or_unset(value_num),
                    metrics or UNSET_VALUE,
                    tags or UNSET_VALUE,
                    received_ms,
                    TTL_S,
                ),
            )
        ]
        key = (tenant, device, start)
        if key not in self._indexed:
            self._indexed.add(key)
            out.append(
                (
                    self.insert_partition,
                    (tenant, device, start, 0, TELEMETRY_BUCKET_S, TTL_S + TELEMETRY_BUCKET_S),
                )
            )
        out.append(
            (
                self.insert_device,
                (
                    tenant,
                    device,
                    state if state is not None else UNSET_VALUE,
                    event_id if state is not None else UNSET_VALUE,
                    ts_ms,
                    value_text,
                    value_num,
                    metrics,
                    tags,
                    write_ts,
                ),
            )
        )
        if state is None:
            return out
        bucket, gen = 0, 0  # state_buckets = 1 (the default), never rotated
        value = state_value(value_text, value_num)
        hashed = device_hash(device)
        out.append(
            (
                self.insert_state,
                (tenant, state, bucket, gen, hashed, device, ts_ms, value, tags, write_ts),
            )
        )
        for other in STATES:
            if other != state:
                out.append(
                    (self.delete_state, (write_ts, tenant, other, bucket, gen, hashed, device))
                )
        return out
