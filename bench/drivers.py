"""Is the Python cassandra-driver the bottleneck? The same writes through it and
through acsylla (asyncio over the DataStax C++ driver), side by side.

Both write the gateway's two per-event rows that cannot be batched across
devices (the raw telemetry row and the latest_events_by_device upsert with
USING TIMESTAMP) for the same pre-decoded events, at the same concurrency, into
the bench keyspace. Reported: rows/s and this process's CPU per row (both
drivers' IO threads included).

Usage: .venv/bin/python bench/drivers.py [--events 20000] [--concurrency 64 256]
(This measurement is why the gateway writes through acsylla where it is
installed: gateway/write_session.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import uvloop

from gateway.config import load_config
from gateway.database import connect
from gateway.decode import Decoder, Event
from gateway.simulate import Fleet, FleetSpec

KEYSPACE = "gateway_bench"
TELEMETRY = (
    f"INSERT INTO {KEYSPACE}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
    "state, value_num, metrics, tags, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "USING TTL 86400"
)
DEVICE = (
    f"INSERT INTO {KEYSPACE}.latest_events_by_device (tenant, device_id, state, ts, value_num, "
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


def rows(e: Event, as_datetime: bool) -> tuple[list[Any], list[Any]]:
    def t(ms: int) -> Any:
        return datetime.fromtimestamp(ms / 1000, UTC) if as_datetime else ms

    bucket = e.ts_ms - e.ts_ms % 3_600_000
    tele = [
        e.tenant,
        e.device_id,
        t(bucket),
        0,
        t(e.ts_ms),
        e.event_id,
        e.state,
        e.value_num,
        e.metrics,
        e.tags,
        t(e.received_ms),
    ]
    dev = [e.tenant, e.device_id, e.state, t(e.ts_ms), e.value_num, e.metrics, e.tags, e.write_ts]
    return tele, dev


async def run_bounded(calls: list[Callable[[], Awaitable[Any]]], concurrency: int) -> float:
    slots = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[Any]]) -> None:
        async with slots:
            await call()

    started = time.monotonic()
    await asyncio.gather(*(one(c) for c in calls))
    return time.monotonic() - started


async def python_driver(evs: list[Event], concurrency: int) -> tuple[float, float]:
    config = load_config(None, {"GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE})
    async with connect(config.cassandra) as db:
        loop = asyncio.get_running_loop()
        tele = await loop.run_in_executor(None, db.session.prepare, TELEMETRY)
        dev = await loop.run_in_executor(None, db.session.prepare, DEVICE)
        calls: list[Callable[[], Awaitable[Any]]] = []
        for e in evs:
            t, d = rows(e, as_datetime=False)
            calls.append(lambda t=t: db.execute(tele.bind(t)))
            calls.append(lambda d=d: db.execute(dev.bind(d)))
        c0 = cpu()
        elapsed = await run_bounded(calls, concurrency)
        return len(calls) / elapsed, (cpu() - c0) / len(calls) * 1e6


async def acsylla_driver(evs: list[Event], concurrency: int) -> tuple[float, float]:
    import acsylla  # noqa: PLC0415 - not on every platform

    cluster = acsylla.create_cluster(
        ["127.0.0.1"], port=9042, protocol_version=4, consistency="LOCAL_QUORUM"
    )
    session = await cluster.create_session(keyspace=KEYSPACE)
    try:
        tele = await session.create_prepared(TELEMETRY)
        dev = await session.create_prepared(DEVICE)
        calls: list[Callable[[], Awaitable[Any]]] = []
        for e in evs:
            t, d = rows(e, as_datetime=True)
            calls.append(lambda t=t: session.execute(tele.bind(t)))
            calls.append(lambda d=d: session.execute(dev.bind(d)))
        c0 = cpu()
        elapsed = await run_bounded(calls, concurrency)
        return len(calls) / elapsed, (cpu() - c0) / len(calls) * 1e6
    finally:
        await session.close()
        cluster.destroy()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    print(f"{'driver':<18}{'in flight':>10}{'rows/s':>10}{'CPU us/row':>12}")
    for concurrency in args.concurrency:
        for name, fn in (("cassandra-driver", python_driver), ("acsylla", acsylla_driver)):
            evs = events(args.events, f"drv{uuid.uuid4().hex[:6]}")
            rate, cpu_per_row = await fn(evs, concurrency)
            print(f"{name:<18}{concurrency:>10}{rate:>10.0f}{cpu_per_row:>12.0f}", flush=True)


if __name__ == "__main__":
    uvloop.run(main())
