"""A/B of the read side's page check: 100 point reads against one IN read.

A state page checks each row it lists against latest_events_by_device
(gateway/store/queries.py, ``_stale``). This times that check for 100 devices
of bench/read_api.py's data, two ways, one and 20 concurrent clients for 6 s
each, twice in alternation:

* ``point``: one read per device, 64 at once (the check until 7933319);
* ``IN``: one read of the 100 (``device_id IN ?``, what the check does now).

Usage: .venv/bin/python bench/page_check.py [--keyspace bench_api] [--tenant api-100k]
(run bench/read_api.py first: it leaves the data behind). Prints one line per case.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.config import load_config
from gateway.store.database import connect


async def main(keyspace: str, tenant: str, seconds: float) -> None:
    config = load_config(None, {"GATEWAY_CASSANDRA__KEYSPACE": keyspace})
    async with connect(config.cassandra) as db:
        ks = db.keyspace
        rows = await db.execute(
            f"SELECT device_id FROM {ks}.latest_events_by_device "
            "WHERE tenant = %s LIMIT 100 ALLOW FILTERING",
            (tenant,),
        )
        ids = [r.device_id for r in rows]
        if len(ids) < 100:
            raise SystemExit(f"{tenant!r} in {keyspace!r} has {len(ids)} devices: run read_api.py")
        point = await db.prepared(
            f"SELECT state, WRITETIME(state) AS wt FROM {ks}.latest_events_by_device "
            "WHERE tenant = ? AND device_id = ?"
        )
        many = await db.prepared(
            f"SELECT device_id, state, WRITETIME(state) AS wt FROM {ks}.latest_events_by_device "
            "WHERE tenant = ? AND device_id IN ?"
        )
        gate = asyncio.Semaphore(64)

        async def one(device: str) -> None:
            async with gate:
                await db.execute(point, (tenant, device))

        async def points() -> None:
            await asyncio.gather(*(one(d) for d in ids))

        async def in_read() -> None:
            await db.execute(many, (tenant, ids))

        cases: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("point", points),
            ("IN", in_read),
        ] * 2
        for name, check in cases:
            for clients in (1, 20):
                times = await load(check, clients, seconds)
                p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
                print(
                    f"{name:5} {clients:2} clients: {len(times) / seconds:5.0f} checks/s, "
                    f"p50 {p50:7.1f} ms, p99 {p99:7.1f} ms",
                    flush=True,
                )


async def load(check: Callable[[], Awaitable[None]], clients: int, seconds: float) -> list[float]:
    """Run ``check`` back to back in ``clients`` tasks; each one's ms, sorted."""
    times: list[float] = []
    deadline = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            await check()
            times.append((time.perf_counter() - t0) * 1000)

    await asyncio.gather(*(client() for _ in range(clients)))
    return sorted(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--keyspace", default="bench_api")
    parser.add_argument("--tenant", default="api-100k")
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    asyncio.run(main(args.keyspace, args.tenant, args.seconds))
