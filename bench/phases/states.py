"""``gateway devices --state S`` (gateway.queries.devices_in_state): its
latency for ``--state-devices`` devices in the state over ``--state-buckets``
bucket partitions, on rows written straight into latest_events_by_state."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import rows
from benchlib import cassandra_config
from cassandra.concurrent import execute_concurrent
from cassandra.query import UNSET_VALUE, BatchStatement, BatchType
from harness import Bench

from gateway.config import Config, TenantConfig
from gateway.identity import device_hash, state_bucket
from gateway.store.database import connect
from gateway.store.queries import devices_in_state


def run(bench: Bench) -> None:
    db = bench.cdb
    insert = db.session.prepare(rows.cql(rows.CQL_INSERT_STATE))
    now = int(time.time() * 1000)
    combos = [(n, b) for n in bench.args.state_devices for b in bench.args.state_buckets]
    total = sum(n for n, _ in combos)
    bench.say(f"inserting {total} rows into latest_events_by_state")
    batches: list[tuple[BatchStatement, None]] = []
    for n, b in combos:
        tenant = bench.tenant(f"q{n}b{b}")
        groups: dict[int, list[str]] = {}
        for i in range(n):
            device = f"dev-{i:06d}"
            groups.setdefault(state_bucket(device, b), []).append(device)
        for bucket, devices in groups.items():
            for start in range(0, len(devices), 20):
                batch = BatchStatement(batch_type=BatchType.UNLOGGED)
                for device in devices[start : start + 20]:
                    batch.add(
                        insert,
                        (
                            tenant,
                            "on",
                            bucket,
                            0,
                            device_hash(device),
                            device,
                            now,
                            "1.0",
                            UNSET_VALUE,
                            now * 1000,
                        ),
                    )
                batches.append((batch, None))
    t0 = time.monotonic()
    for ok, res in execute_concurrent(db.session, batches, concurrency=64):
        if not ok:
            raise res
    bench.say(f"inserted in {time.monotonic() - t0:.1f} s; timing devices_in_state")
    bench.results["devices_in_state"] = asyncio.run(_time_queries(bench, combos))


async def _time_queries(bench: Bench, combos: list[tuple[int, int]]) -> list[dict[str, Any]]:
    tenants = {bench.tenant(f"q{n}b{b}"): TenantConfig(state_buckets=b) for n, b in combos}
    config = Config(cassandra=cassandra_config(), tenants=tenants)
    out = []
    async with connect(config.cassandra) as db:
        for n, b in combos:
            tenant = bench.tenant(f"q{n}b{b}")
            await devices_in_state(db, config, tenant, "on")  # warm-up
            times = []
            returned = 0
            for _ in range(bench.args.state_runs):
                t0 = time.perf_counter()
                found = await devices_in_state(db, config, tenant, "on")
                times.append((time.perf_counter() - t0) * 1000)
                returned = len(found)
            median = statistics.median(times)
            out.append(
                {
                    "devices": n,
                    "buckets": b,
                    "median_ms": median,
                    "runs_ms": times,
                    "returned": returned,
                    "ok": returned == n,
                }
            )
            bench.say(f"{n} devices, {b} bucket(s): median {median:.1f} ms ({returned} rows)")
    return out
