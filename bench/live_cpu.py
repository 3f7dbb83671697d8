"""The gateway's CPU per message on a live stream, at fixed rates.

A drain (drain.py) fills every chunk and request; a live stream at a modest
rate does not, and costs several times more CPU per message. For each rate
this starts `gateway run` on the bench keyspace (benchlib.gateway_env),
publishes the simulated fleet at that rate for --duration seconds (the
publisher runs in this process, not the gateway's), waits until every message
is handled (written, rejected or sampled out), and prints the gateway's CPU
per message by thread, with its chunks and requests per message, and the CPU
per message of the local Cassandra and Mosquitto (`make up`'s) over the same
time: the two cores are shared, so what the gateway asks of them counts too.
The roll-up worker reads each minute back ``rollups.grace`` after it ends
(30 s): a --duration of 120 s or more holds some of that work.

Usage: .venv/bin/python bench/live_cpu.py --rates 500,1000,2000 [--duration 20]
       [--gateway-env GATEWAY_PIPELINE__LINGER=0s]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

from benchlib import (
    HANDLED,
    add_gateway_env,
    add_warm_up,
    apply_schema,
    clear_session,
    fleet_spec,
    gateway_env,
    gateway_settings,
    maybe_warm_up,
    run_tool,
    services_cpu,
    services_cpu_since,
)
from drain import follow, gateway, thread_cpu, thread_cpu_since, wait_line

from gateway.tools.simulate import publish

ROOT = "gwlive"
COUNTERS = re.compile(r"\b(chunks|lingers|requests)=(\d+)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="500,1000,2000", help="msg/s, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    parser.add_argument("--devices", type=int, default=1000)
    add_gateway_env(parser, "a setting for the gateway (repeatable)")
    add_warm_up(parser)
    args = parser.parse_args()
    maybe_warm_up(args.warm_up, args.devices)
    extra = gateway_settings(args.gateway_env)
    apply_schema()
    print(
        "rate msg/s | achieved | CPU us/msg | event loop | other threads | msgs/chunk"
        " | chunks lingered | requests/msg | Cassandra us/msg | Mosquitto us/msg"
    )
    for rate in (float(r) for r in args.rates.split(",")):
        run(rate, args.duration, args.devices, extra)


def run(rate: float, duration: float, devices: int, extra: dict[str, str]) -> None:
    client_id = f"bench-live-{uuid.uuid4().hex[:8]}"
    # The bench keyspace, and a topic tree of its own (benchlib.gateway_env).
    env = gateway_env(client_id, ROOT) | extra
    log = f"/tmp/{client_id}.log"
    proc = gateway(env, log)
    try:
        wait_line(proc, log, "subscribed to")
        before = thread_cpu(proc.pid)
        services_before = services_cpu()
        spec = fleet_spec(f"live{uuid.uuid4().hex[:6]}", devices, rate, root=ROOT)
        stats = asyncio.run(publish(spec, duration=duration, status_every=3600))
        wait_written(proc, log, stats.sent)
        cpu = thread_cpu_since(proc.pid, before)
        used = services_cpu_since(services_before, stats.sent)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        counters = final_counters(log)
    finally:
        if proc.poll() is None:
            proc.kill()
        clear_session(client_id)
    report(rate, stats.rate, stats.sent, cpu, counters, used)


def wait_written(proc: subprocess.Popen[bytes], log: str, count: int) -> None:
    deadline = time.monotonic() + 120
    for line in follow(proc, log):
        m = HANDLED.search(line)  # written, rejected, sampled out
        if m and sum(int(n) for n in m.groups()) >= count:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not handle {count} messages within 120 s")


def final_counters(log: str) -> dict[str, int]:
    """chunks, lingers and requests from the gateway's last line (``stopped: ...``)."""
    for line in reversed(Path(log).read_text().splitlines()):
        if "stopped:" in line:
            return {k: int(v) for k, v in COUNTERS.findall(line)}
    raise SystemExit(f"no 'stopped:' line in {log}")


def report(
    rate: float,
    achieved: float,
    sent: int,
    cpu: dict[str, float],
    counters: dict[str, int],
    services: dict[str, float | None],
) -> None:
    per = 1e6 / sent
    chunks = counters.get("chunks", 0)
    print(
        f"{rate:.0f} | {achieved:.0f} | {sum(cpu.values()) * per:.0f}"
        f" | {cpu['event loop'] * per:.0f} | {cpu['other threads'] * per:.0f}"
        f" | {sent / max(chunks, 1):.1f} | {counters.get('lingers', 0)} of {chunks}"
        f" | {counters.get('requests', 0) / sent:.2f}"
        + "".join(f" | {'-' if us is None else f'{us:.0f}'}" for us in services.values())
    )


if __name__ == "__main__":
    run_tool(main)
