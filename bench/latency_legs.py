"""Where a live message's latency goes: publish → received, and received → write sent.

Starts `gateway run` on the bench keyspace under a topic tree of its own
(benchlib.gateway_env), publishes the simulated fleet at RATE msg/s for
DURATION seconds (benchlib.publish_recorded, in this process), waits until the
gateway has handled every message, and reads each telemetry row back with
``received_at`` (the gateway's clock when the message arrived) and
``WRITETIME`` (the driver's clock when the write was sent). Prints the
percentiles of both legs and of their sum (publish → write sent, what
bench/run.py's latency runs measure), the share of messages acknowledged within each
bound of ``gateway_write_latency_seconds`` (publish → durable PUBACK, from the
gateway's /metrics just before it stops), and the quarter-seconds whose
slowest message took over --slow ms (a periodic stall shows as a pattern there).

Usage: .venv/bin/python bench/latency_legs.py [--rate 3000] [--duration 20] [--api-port 9199]
       [--gateway-env GATEWAY_PIPELINE__LINGER=0s]
"""

from __future__ import annotations

import argparse
import urllib.request
import uuid
from datetime import UTC, datetime

from benchlib import (
    BenchDb,
    add_gateway_env,
    add_warm_up,
    apply_schema,
    fleet_spec,
    gateway_env,
    gateway_settings,
    maybe_warm_up,
    publish_recorded,
    quantile,
    run_tool,
)
from drain import gateway_session, wait_line
from live_cpu import wait_written
from prometheus_client.parser import text_string_to_metric_families

ROOT = "gwlegs"
BIN_S = 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=3000)
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--slow", type=float, default=100, help="ms; default 100")
    parser.add_argument("--api-port", type=int, default=9199, help="the gateway's /metrics")
    add_gateway_env(parser, "a setting for the gateway (repeatable)")
    add_warm_up(parser)
    args = parser.parse_args()
    maybe_warm_up(args.warm_up, args.devices)
    apply_schema()
    client_id = f"bench-legs-{uuid.uuid4().hex[:8]}"
    env = gateway_env(client_id, ROOT, API__PORT=str(args.api_port))
    env |= gateway_settings(args.gateway_env)
    log = f"/tmp/{client_id}.log"
    tenant = f"legs{uuid.uuid4().hex[:6]}"
    db = BenchDb()
    with gateway_session(env, log) as proc:
        wait_line(proc, log, "subscribed to")
        db.register_states([tenant])
        spec = fleet_spec(tenant, args.devices, args.rate, root=ROOT)
        stats, sent = publish_recorded(spec, duration=args.duration)
        wait_written(proc, log, stats.sent)
        acked = ack_shares(args.api_port)
    sent_at = {(s.device_id, s.ts): s.sent_at for s in sent}
    t0 = min(s.sent_at for s in sent if s.sent_at is not None)
    arrive: list[float] = []
    write: list[float] = []
    total: list[float] = []  # publish → write sent: what bench/run.py's latency runs measure
    bins: dict[int, list[float]] = {}
    # Read back as gateway history reads them (benchlib.read_back).
    for row in db.read_back(tenant, sorted({s.device_id for s in sent})):
        at = sent_at.get((row.device_id, row.ts))
        if at is None:
            continue
        written = row.write_us / 1000
        arrive.append(row.received_ms - at)
        write.append(written - row.received_ms)
        total.append(written - at)
        bins.setdefault(int((at - t0) / 1000 / BIN_S), []).append(written - at)
    db.close()
    print(f"{len(write)} of {stats.sent} messages at {stats.rate:.0f} msg/s; ms:")
    legs = (
        ("publish → received", arrive),
        ("received → write sent", write),
        ("publish → write sent", total),
    )
    for leg, values in legs:
        ordered = sorted(values)
        q = [quantile(ordered, p) for p in (0.5, 0.9, 0.99)]
        print(f"  {leg}: p50 {q[0]:.1f}, p90 {q[1]:.1f}, p99 {q[2]:.1f}, max {ordered[-1]:.1f}")
    print(f"  publish → durable ack: {acked}")
    for b in sorted(bins):
        worst = max(bins[b])
        if worst > args.slow:
            clock = datetime.fromtimestamp(t0 / 1000 + b * BIN_S, UTC).strftime("%H:%M:%S.%f")
            print(f"  {b * BIN_S:6.2f} s ({clock[:-4]}): slowest {worst:.0f} ms of {len(bins[b])}")


def ack_shares(port: int) -> str:
    """The cumulative shares of gateway_write_latency_seconds, up to where it reaches 100%."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    buckets = [
        (sample.labels["le"], sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "gateway_write_latency_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    ]
    total = buckets[-1][1] or 1.0
    shares: list[str] = []
    for le, count in buckets:
        shares.append(f"≤ {le} s {count / total:.1%}")
        if count >= total:
            break
    return ", ".join(shares)


if __name__ == "__main__":
    run_tool(main)
