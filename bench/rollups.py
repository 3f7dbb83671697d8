"""What roll-ups and metadata cost: the gateway's CPU per message with them on
and off, on the same load.

Each run drains a backlog as bench/drain.py does (the broker holds N events of
a simulated fleet for the gateway's session; the gateway starts and writes
them all), once with ``rollups.enabled`` and ``metadata.enabled`` false and
once with both true, alternating, ``--runs`` times each:

* ingest: the gateway's CPU from "subscribed" until every event is written,
  per event (the marks and metadata entries are written on this path);
* worker: after the drain, the gateway runs until the roll-up worker has
  recomputed every window the drain marked (grace and interval 1 s here,
  so it needs no minutes of waiting); its CPU over that time, less what the
  same wait costs with roll-ups off (idle), per event.

Writes into its own keyspace (``gateway_bench_rollups``, created with
``gateway schema apply``) and resets the worker's position there before each
run, so no old marks are caught up on.

Usage: .venv/bin/python bench/rollups.py [--devices 200] [--count 20000] [--runs 2]
       [--out bench/results/rollups.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from benchlib import clear_session, run_tool
from drain import STATUS, follow, gateway, wait_line

from gateway.tools.simulate import FleetSpec, publish

KEYSPACE = "gateway_bench_rollups"
# A topic tree of its own: other gateways and benchmarks share the broker.
TOPIC = "gwbench-rollups/{tenant}/devices/{device_id}/events"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    mode: str
    events: int
    ingest_s: float
    ingest_cpu: float
    settle_s: float
    settle_cpu: float
    rows: float  # Cassandra statements sent by the write path
    marks: float
    metadata: float
    windows: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cql(statement: str) -> None:
    from cassandra.cluster import Cluster  # noqa: PLC0415 - only here

    cluster = Cluster(["127.0.0.1"], protocol_version=4)
    try:
        cluster.connect().execute(statement)
    finally:
        cluster.shutdown()


def one_run(mode: str, args: argparse.Namespace) -> Run:
    on = "true" if mode == "on" else "false"
    client_id = f"bench-rollups-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = dict(
        os.environ,
        GATEWAY_CASSANDRA__KEYSPACE=KEYSPACE,
        GATEWAY_MQTT__CLIENT_ID=client_id,
        GATEWAY_MQTT__SESSION_EXPIRY="600",
        GATEWAY_PIPELINE__STATUS_INTERVAL="1",
        GATEWAY_API__PORT=str(port),
        GATEWAY_ROLLUPS__ENABLED=on,
        GATEWAY_METADATA__ENABLED=on,
        GATEWAY_ROLLUPS__GRACE="1s",
        GATEWAY_ROLLUPS__INTERVAL="1s",
        GATEWAY_TOPICS=f'[{{template = "{TOPIC}"}}]',
    )
    cql(f"DELETE FROM {KEYSPACE}.rollup_progress WHERE name = 'default'")
    log = f"/tmp/{client_id}.log"
    proc = gateway(env, log)
    try:
        wait_line(proc, log, "subscribed to")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        tenant = f"b{uuid.uuid4().hex[:8]}"
        spec = FleetSpec(devices=args.devices, rate=1e9, tenant=tenant, topic_template=TOPIC)
        asyncio.run(publish(spec, count=args.count, status_every=3600))
        proc = gateway(env, log)
        start = time.monotonic()
        cpu0 = 0.0
        for line in follow(proc, log):
            if "subscribed to" in line:
                start, cpu0 = time.monotonic(), cpu(proc.pid)
            m = STATUS.search(line)
            if m and "status:" in line and int(m.group(1)) + int(m.group(2)) >= args.count:
                break
        ingest_s, ingest_cpu = time.monotonic() - start, cpu(proc.pid) - cpu0
        # Every mark is in a minute that is over, plus the grace, plus a pass.
        settle_start, cpu1 = time.monotonic(), cpu(proc.pid)
        due = (time.time() // 60 + 1) * 60 + 1 + 2
        time.sleep(max(0.0, due - time.time()))
        last = -1.0
        while True:
            metrics = scrape(port)
            windows = metrics.get("gateway_rollup_windows_total", 0.0)
            if windows == last and metrics.get("gateway_rollup_lag_seconds", 0.0) == 0:
                break
            last = windows
            time.sleep(2)
        settle_s, settle_cpu = time.monotonic() - settle_start, cpu(proc.pid) - cpu1
    finally:
        # Also on an error or a SIGTERM (benchlib.run_tool): no
        # gateway or session is left behind.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        clear_session(client_id)
    return Run(
        mode,
        args.count,
        ingest_s,
        ingest_cpu,
        settle_s,
        settle_cpu,
        metrics.get("gateway_cassandra_rows_total", 0.0),
        metrics.get("gateway_rollup_marks_total", 0.0),
        metrics.get("gateway_metadata_writes_total", 0.0),
        windows,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/rollups.md")
    args = parser.parse_args()
    env = dict(os.environ, GATEWAY_CASSANDRA__KEYSPACE=KEYSPACE)
    subprocess.run(
        [sys.executable, "-m", "gateway", "schema", "apply"], env=env, check=True, cwd=ROOT
    )
    runs: list[Run] = []
    for i in range(args.runs):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            run = one_run(mode, args)
            runs.append(run)
            print(
                f"{mode}: ingest {run.ingest_cpu / run.events * 1e6:.0f} us/event "
                f"({run.events / run.ingest_s:.0f} events/s), settle {run.settle_cpu:.2f} s CPU "
                f"in {run.settle_s:.0f} s, {run.rows / run.events:.2f} statements/event, "
                f"{run.windows:.0f} windows",
                flush=True,
            )
    report(runs, args)


def report(runs: list[Run], args: argparse.Namespace) -> None:
    def med(mode: str, value: str) -> float:
        per_event: list[float] = [getattr(r, value) / r.events for r in runs if r.mode == mode]
        return statistics.median(per_event)

    def idle(mode: str) -> float:
        return statistics.median(r.settle_cpu / r.settle_s for r in runs if r.mode == mode)

    off, on = med("off", "ingest_cpu") * 1e6, med("on", "ingest_cpu") * 1e6
    on_runs = [r for r in runs if r.mode == "on"]
    worker = statistics.median(
        (r.settle_cpu - idle("off") * r.settle_s) / r.events * 1e6 for r in on_runs
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.strip()
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Roll-ups and metadata: CPU per message (`bench/rollups.py`)",
        "",
        f"Run {when}: `.venv/bin/python bench/rollups.py --devices {args.devices} "
        f"--count {args.count} --runs {args.runs}`, gateway at {commit}. Shared 2-core box; "
        "Cassandra, Mosquitto and other test suites ran beside it, so single runs are noisy: "
        "medians of the runs below.",
        "",
        f"Load: a backlog of {args.count:,} events from {args.devices} simulated devices "
        "(value + 3 metrics + 2 tags each), drained by `gateway run` (bench/drain.py's method). "
        "Off: `rollups.enabled = false`, `metadata.enabled = false`. On: both true, the worker "
        "in the gateway with `grace` and `interval` 1 s.",
        "",
        "| | off | on | cost |",
        "|---|---:|---:|---:|",
        f"| gateway CPU per event while ingesting, µs | {off:.0f} | {on:.0f} | "
        f"{on - off:+.0f} ({(on - off) / off * 100:+.0f}%) |",
        f"| worker CPU per event after the drain (less idle), µs | | {worker:.0f} | "
        f"{worker:+.0f} |",
        f"| Cassandra statements per event (write path) | {med('off', 'rows'):.2f} | "
        f"{med('on', 'rows'):.2f} | {med('on', 'rows') - med('off', 'rows'):+.2f} |",
        f"| roll-up marks per event | | {med('on', 'marks'):.3f} | |",
        f"| metadata entries written per event | | {med('on', 'metadata'):.4f} | |",
        f"| 1-minute windows recomputed per event | | {med('on', 'windows'):.4f} | |",
        "",
        "Every run:",
        "",
        "| mode | events/s | ingest CPU µs/event | settle s | settle CPU s | windows |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.mode} | {r.events / r.ingest_s:,.0f} | {r.ingest_cpu / r.events * 1e6:.0f} | "
        f"{r.settle_s:.0f} | {r.settle_cpu:.2f} | {r.windows:.0f} |"
        for r in runs
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_tool(main)
