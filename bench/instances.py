"""One gateway instance or two: the same backlog, split over two tenant shards.

Each run publishes ``--count`` events (half to each of two fresh tenants,
``--devices`` simulated devices per tenant) while the gateways are frozen (their
persistent sessions hold the backlog), then resumes them and times the drain:

* ``one``: one instance subscribed to both shards (``tenants = [a, b]``);
* ``two``: two instances, one shard each (``tenants = [a]`` and ``[b]``),
  each with its own client id.

Runs alternate one, two, one, two, ... (``--pairs``), so a change of load on
the shared box hits both alike. Per run: msg/s = events over the span from
the first to the last WRITETIME of the run's telemetry rows (as bench/run.py
measures the sustained rate), and the gateways' CPU per message (utime+stime
from the end of start-up, over the messages: each gateway starts on an empty
session and is frozen with SIGSTOP while the backlog is published, then
resumed). Every event is read back.
Results in bench/results/instances.{json,md}.

Usage: .venv/bin/python bench/instances.py [--count 20000] [--devices 500] [--pairs 3]
(`make bench-instances`)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import uuid
from statistics import median
from typing import Any

import rows
from benchlib import (
    BENCH,
    TOPIC_TEMPLATE,
    BenchDb,
    Check,
    Proc,
    apply_schema,
    clear_session,
    cpu_seconds,
    fleet_spec,
    peak_rss_mb,
    publish_recorded,
    run_tool,
)

RESULTS = BENCH / "results"
LOGS = BENCH / ".logs" / "instances"


def _topics(tenants: list[str]) -> str:
    names = ", ".join(f'"{t}"' for t in tenants)
    return f'[{{template = "{TOPIC_TEMPLATE}", tenants = [{names}]}}]'


def _gateway(name: str, client_id: str, tenants: list[str]) -> Proc:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_MQTT__CLIENT_ID": client_id,
        "GATEWAY_MQTT__SESSION_EXPIRY": str(rows.SESSION_EXPIRY),
        "GATEWAY_CASSANDRA__KEYSPACE": rows.KEYSPACE,
        "GATEWAY_TOPICS": _topics(tenants),
        "GATEWAY_PIPELINE__STATUS_INTERVAL": "200ms",
        "GATEWAY_API__PORT": "0",
        "GATEWAY_ROLLUPS__WORKER": "false",
        # Frozen while the backlog is published: the broker must not drop it
        # for a missed keepalive (1.5 x this) meanwhile.
        "GATEWAY_MQTT__KEEPALIVE": "300",
    }
    return Proc(
        name,
        [sys.executable, "-m", "gateway", "run"],
        env,
        LOGS / f"{name}.log",
        [re.compile(r"connected to mqtt://")],
        re.compile(r"status: .*acked=(\d+)"),
    )


def _wait_ready(gws: list[Proc], timeout: float) -> None:
    """Poll every log in turn, so each start-up CPU figure is read at its own ready line."""
    deadline = time.monotonic() + timeout
    while not all(gw.ready_at is not None for gw in gws):
        for gw in gws:
            gw.poll()
            if not gw.alive():
                gw.wait_ready(0)  # raises with the log's tail
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready after {timeout:.0f} s: {[gw.name for gw in gws]}")
        time.sleep(0.01)


def run_once(db: BenchDb, mode: str, count: int, devices: int, tag: str) -> dict[str, Any]:
    tenants = [f"inst{tag}a", f"inst{tag}b"]
    shards = [tenants] if mode == "one" else [[t] for t in tenants]
    gws = [
        _gateway(f"{mode}-{tag}-{i}", f"bench-inst-{tag}-{i}", shard)
        for i, shard in enumerate(shards)
    ]
    # The gateways start on empty sessions (creating them) and are then frozen
    # (SIGSTOP) while the backlog is published: the broker queues it for their
    # sessions. Their CPU is read once they are ready and frozen, so start-up
    # is left out; SIGCONT starts the drain. (Stopping and restarting them
    # instead would leave the start-up CPU unknown: the broker sends the queued
    # messages ahead of the SUBACK that the ready line waits for.)
    for gw in gws:
        gw.start()
    try:
        _wait_ready(gws, 120)
        time.sleep(1.0)  # let start-up finish (states refresh, first status line)
        for gw in gws:
            os.kill(gw.pid, signal.SIGSTOP)
        base_cpu = [cpu_seconds(gw.pid) for gw in gws]
        db.register_states(tenants)
        sent = {}
        for i, tenant in enumerate(tenants):
            spec = fleet_spec(tenant, devices, seed=i + 1)
            _, sent[tenant] = publish_recorded(spec, count=count // 2)
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        for gw in gws:
            os.kill(gw.pid, signal.SIGCONT)
        for gw, shard in zip(gws, shards, strict=True):
            target = sum(len(sent[t]) for t in shard)
            if not gw.wait_count(target, timeout=600):
                raise SystemExit(f"{gw.name}: drained only {gw.count}/{target}")
        wall = time.monotonic() - t0
        cpu = [cpu_seconds(gw.pid) - c for gw, c in zip(gws, base_cpu, strict=True)]
        rss = [peak_rss_mb(gw.pid) for gw in gws]
    finally:
        for gw in gws:
            gw.stop()
            clear_session(gw.env["GATEWAY_MQTT__CLIENT_ID"])
    by_tenant = {t: db.check(t, sent[t]) for t in tenants}
    # Per instance: its status line counts what its sampler left out of the
    # raw table, over all of its tenants.
    checks = {
        "+".join(shard): Check.together([by_tenant[t] for t in shard], gw.sampled_out)
        for gw, shard in zip(gws, shards, strict=True)
    }
    writes = [w for c in checks.values() for w in c.write_us]
    total = sum(len(s) for s in sent.values())
    span = (max(writes) - min(writes)) / 1e6
    per_instance = []
    for check, gw_cpu in zip(checks.values(), cpu, strict=True):
        # Handled: stored, or sampled out (benchlib.Check.span_rate).
        per_instance.append(
            {
                "messages": check.stored + check.sampled_out,
                "msg_s": round(check.span_rate() or 0),
                "cpu_s": round(gw_cpu, 2),
            }
        )
    return {
        "mode": mode,
        "instances": len(gws),
        "messages": total,
        "msg_s": round((total - 1) / span),
        "wall_s": round(wall, 1),
        "cpu_us_per_msg": round(sum(cpu) / total * 1e6),
        "peak_rss_mb": [round(r) for r in rss],
        "per_instance": per_instance,
        "stored_ok": all(c.ok for c in checks.values()),
        "stored": {t: c.text() for t, c in checks.items()},
        "load_avg_1m_at_start": round(load0, 2),
    }


def _report(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = [
        "# One gateway instance or two, on this box",
        "",
        f"Run {results['started']}: `bench/instances.py --count {results['count']} "
        f"--devices {results['devices']} --pairs {results['pairs']}`, gateway at "
        f"{results['commit']}. Machine: {results['machine']}.",
        "",
        f"A backlog of {results['count']:,} events, half in each of two tenants "
        f"({results['devices']:,} devices each), drained by one instance subscribed to both "
        "or by two instances with one tenant each. Runs interleaved.",
        "",
        "| # | Instances | msg/s (all) | msg/s per instance | CPU µs / msg | wall s | "
        "load 1m at start | stored |",
        "|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for i, r in enumerate(runs, 1):
        each = " + ".join(f"{p['msg_s']:,}" for p in r["per_instance"])
        lines.append(
            f"| {i} | {r['instances']} | {r['msg_s']:,} | {each} | {r['cpu_us_per_msg']} | "
            f"{r['wall_s']} | {r['load_avg_1m_at_start']} | "
            f"{'ok' if r['stored_ok'] else 'MISMATCH'} |"
        )
    lines += ["", "Medians:", ""]
    for mode, n in (("one", 1), ("two", 2)):
        mine = [r for r in runs if r["mode"] == mode]
        lines.append(
            f"- {n} instance{'s' if n > 1 else ''}: "
            f"{median(r['msg_s'] for r in mine):,.0f} msg/s, "
            f"{median(r['cpu_us_per_msg'] for r in mine):,.0f} µs CPU per message "
            f"({len(mine)} runs)"
        )
    ratio = [
        b["msg_s"] / a["msg_s"]
        for a, b in zip(runs[0::2], runs[1::2], strict=False)
        if a["mode"] == "one" and b["mode"] == "two"
    ]
    if ratio:
        lines.append("- two/one per pair: " + ", ".join(f"{x:.2f}x" for x in ratio))
    lines += [
        "",
        "msg/s: events handled (stored, or sampled out by the gateway) over the span from "
        "the first to the last WRITETIME of the run's telemetry rows (both tenants; per "
        "instance, its own tenants' rows). CPU: utime+stime "
        "of the gateway processes from the end of start-up (each is frozen with SIGSTOP "
        "while the backlog is published, then resumed), summed, over the events. Mosquitto, "
        "Cassandra (one node) and the gateways share the box's cores.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20000, help="events per run (both shards)")
    parser.add_argument("--devices", type=int, default=500, help="devices per tenant")
    parser.add_argument("--pairs", type=int, default=3, help="(one, two) pairs of runs")
    args = parser.parse_args()
    apply_schema()
    LOGS.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "count": args.count,
        "devices": args.devices,
        "pairs": args.pairs,
        "commit": commit,
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        "Cassandra and Mosquitto on the same host",
        "runs": [],
    }
    db = BenchDb()
    try:
        for pair in range(args.pairs):
            for mode in ("one", "two"):
                tag = f"{uuid.uuid4().hex[:6]}"
                r = run_once(db, mode, args.count, args.devices, tag)
                print(
                    f"pair {pair + 1} {mode}: {r['msg_s']:,} msg/s, "
                    f"{r['cpu_us_per_msg']} µs CPU/msg, per instance "
                    f"{[p['msg_s'] for p in r['per_instance']]}, stored ok={r['stored_ok']}",
                    flush=True,
                )
                results["runs"].append(r)
    finally:
        db.close()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "instances.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "instances.md").write_text(_report(results))
    print(_report(results))


if __name__ == "__main__":
    run_tool(main)
