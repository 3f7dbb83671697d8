"""How long the roll-up worker holds the event loop: the gaps a 1 ms ticker sees
while the worker recomputes a busy minute.

1. Start `gateway run` on the bench keyspace under a topic tree of its own
   (benchlib.gateway_env) with its roll-up worker off, so marks and raw rows
   are written but nothing recomputes them yet.
2. Publish COUNT events of the simulated fleet (DEVICES devices) as fast as
   the broker takes them; wait until the gateway has written them; stop it.
3. In this process, on a write session as `gateway run` opens for its worker,
   recompute every 1-minute window those events fell in (``RollupWorker.
   recompute``, no spreading), RUNS times, while a task sleeps 1 ms in a loop
   and records how late each wake-up came. The event loop is the one the
   gateway's MQTT reads, writes and acknowledgements would share; the
   garbage collector is set as `gateway run` sets it (tools/cli.py), and its
   passes meanwhile are timed.

Prints, per run: windows, raw rows, wall and CPU seconds (this process: the
worker and the ticker), and the ticker's gaps: p99, max, and how many were
over 20 and over 50 ms; and the collector's passes and the longest. A gap
is time nothing else could run on the loop.

Usage: .venv/bin/python bench/rollup_stalls.py [--devices 1000] [--count 264000] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import uuid

import uvloop
from benchlib import (
    add_warm_up,
    apply_schema,
    fleet_spec,
    gateway_env,
    maybe_warm_up,
    publish_recorded,
    quantile,
    run_tool,
)
from drain import gateway_session, wait_line
from live_cpu import wait_written
from rows import KEYSPACE

from gateway.config import Config, load_config
from gateway.stats import Stats
from gateway.store.rollups import MINUTE_MS, RollupWorker
from gateway.store.write_session import open_write_session
from gateway.tools.cli import GC_PER_EVENT, GC_YOUNG

ROOT = "gwstalls"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument(
        "--count", type=int, default=264_000, help="events; default a minute at 4,400 msg/s"
    )
    parser.add_argument("--runs", type=int, default=2)
    add_warm_up(parser)
    args = parser.parse_args()
    maybe_warm_up(args.warm_up, args.devices)
    apply_schema()
    client_id = f"bench-stalls-{uuid.uuid4().hex[:8]}"
    env = gateway_env(client_id, ROOT, ROLLUPS__WORKER="false")
    log = f"/tmp/{client_id}.log"
    tenant = f"stalls{uuid.uuid4().hex[:6]}"
    with gateway_session(env, log) as proc:
        wait_line(proc, log, "subscribed to")
        spec = fleet_spec(tenant, args.devices, root=ROOT)
        stats, sent = publish_recorded(spec, count=args.count)
        wait_written(proc, log, stats.sent)
    windows = {(tenant, s.device_id, s.ts - s.ts % MINUTE_MS) for s in sent}
    print(f"{len(sent)} events of {args.devices} devices written: {len(windows)} windows")
    del sent  # as `gateway run`: what is loaded stays out of every collection
    config = load_config(None, {"GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE})
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(GC_YOUNG, GC_PER_EVENT * config.pipeline.batch_max_events), 10, 10)
    for run in range(1, args.runs + 1):
        uvloop.run(recompute(config, windows, run))


async def recompute(config: Config, windows: set[tuple[str, str, int]], run: int) -> None:
    passes: list[float] = []  # ms of each collector pass
    started: list[float] = []

    def timed(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            passes.append((time.perf_counter() - started.pop()) * 1000)

    async with open_write_session(config.cassandra) as session:
        await session.plan_packing("the roll-up worker")
        stats = Stats()
        worker = RollupWorker(session, config, stats, name=f"stalls-{uuid.uuid4().hex[:8]}")
        await worker.start()
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append((now - last) * 1000)
                last = now

        ticking = asyncio.create_task(ticker())
        gc.callbacks.append(timed)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            await worker.recompute(windows)
        finally:
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            gc.callbacks.remove(timed)
            done.set()
            await ticking
    gaps.sort()
    print(
        f"run {run}: {stats.rollup_windows} windows in {wall:.2f} s, {cpu:.2f} CPU s; "
        f"event-loop gaps (ms): p99 {quantile(gaps, 0.99):.1f}, max {gaps[-1]:.1f}, "
        f"over 20 ms {sum(g > 20 for g in gaps)}, over 50 ms {sum(g > 50 for g in gaps)}; "
        f"{len(passes)} collector passes, longest {max(passes, default=0):.1f} ms"
    )


if __name__ == "__main__":
    run_tool(main)
