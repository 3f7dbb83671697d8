"""Is the Python cassandra-driver the bottleneck? The same writes through it and
through acsylla (asyncio over the DataStax C++ driver), side by side.

Both go through the gateway's own write session (gateway/store/write_session.py:
the same binding, timestamps and UNSET handling as the gateway) and write the
gateway's two per-event rows that cannot be batched across
devices (the raw telemetry row and the latest_events_by_device upsert with
USING TIMESTAMP) for the same pre-decoded events, at the same concurrency, into
the bench keyspace. Reported: rows/s and this process's CPU per row (both
drivers' IO threads included).

Usage: .venv/bin/python bench/drivers.py [--events 20000] [--concurrency 64 256] [--pack 1]
(This measurement is why the gateway writes through acsylla where it is
installed: gateway/store/write_session.py.)
"""

from __future__ import annotations

import argparse
import resource
import time
import uuid
from typing import Any, Literal

import uvloop
from ceiling import write_all

from gateway.config import CassandraConfig, load_config
from gateway.event import Event
from gateway.ingest.decode import Decoder
from gateway.store.write_session import open_write_session
from gateway.tools.simulate import Fleet, FleetSpec

KEYSPACE = "gateway_bench"
DRIVERS: tuple[Literal["python", "acsylla"], ...] = ("python", "acsylla")
TELEMETRY = (
    "INSERT INTO {keyspace}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
    "state, value_num, metrics, tags, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "USING TTL 86400"
)
DEVICE = (
    "INSERT INTO {keyspace}.latest_events_by_device (tenant, device_id, state, ts, value_num, "
    "metrics, tags) VALUES (?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def events(count: int, tenant: str) -> list[Event]:
    decoder = Decoder(load_config(None, {}).limits)
    fleet = Fleet(FleetSpec(devices=1000, rate=1000, tenant=tenant))
    now = int(time.time() * 1000)
    out = []
    for i in range(count):
        topic, payload, _ = fleet.next_message(now - 60_000 + i)
        out.append(decoder.decode(tenant, topic.split("/")[3], payload, None, now))
    return out


async def measure(
    driver: Literal["python", "acsylla"], evs: list[Event], concurrency: int, pack: int
) -> tuple[str, float, float]:
    """Both rows of every event through the gateway's write session with ``driver``,
    ``pack`` rows to a request."""
    async with open_write_session(CassandraConfig(keyspace=KEYSPACE, driver=driver)) as session:
        tele = await session.prepare(TELEMETRY, timestamps=(2, 4, 10))
        dev = await session.prepare(DEVICE, timestamps=(3,))
        rows: list[tuple[Any, Any]] = []
        for e in evs:
            bucket = e.ts_ms - e.ts_ms % 3_600_000
            telemetry = (e.tenant, e.device_id, bucket, 0, e.ts_ms, e.event_id, e.state)
            rows.append((tele, (*telemetry, e.value_num, e.metrics, e.tags, e.received_ms)))
            device = (e.tenant, e.device_id, e.state, e.ts_ms, e.value_num, e.metrics, e.tags)
            rows.append((dev, (*device, e.write_ts)))
        c0, t0 = cpu(), time.monotonic()
        sent, failures = await write_all(session, iter(rows), concurrency, pack)
        elapsed = time.monotonic() - t0
        if failures:
            raise SystemExit(f"{session.name}: {len(failures)} writes failed: {failures[:3]}")
        return session.name, sent / elapsed, (cpu() - c0) / sent * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--pack",
        type=int,
        default=1,
        help="rows per request (default 1: one statement per request; "
        "10 packs them as bench/ceiling.py does)",
    )
    args = parser.parse_args()
    print(f"{'driver':<32}{'in flight':>10}{'rows/s':>10}{'CPU us/row':>12}")
    for concurrency in args.concurrency:
        for driver in DRIVERS:
            evs = events(args.events, f"drv{uuid.uuid4().hex[:6]}")
            name, rate, cpu_per_row = await measure(driver, evs, concurrency, args.pack)
            print(f"{name:<32}{concurrency:>10}{rate:>10.0f}{cpu_per_row:>12.0f}", flush=True)


if __name__ == "__main__":
    uvloop.run(main())
