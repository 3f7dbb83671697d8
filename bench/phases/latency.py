"""Latency: a live run at a fixed rate into a system that is up (after its
drain); latency = WRITETIME of each stored telemetry row - the sent_at in its
payload (the broker ceiling: publish → received, from its own log)."""

from __future__ import annotations

import json
from typing import Any

from benchlib import Proc, fleet_spec, percentiles, publish_recorded
from harness import LOGS, Bench, Drain


def run(
    bench: Bench,
    key: str,
    proc: Proc,
    result: Drain,
    devices: int,
    has_db: bool,
    rate: float | None = None,
) -> dict[str, Any]:
    """A live run at ``rate`` (default: half the sustained rate, which is
    the system's reported latency); returns what it measured."""
    assert result.rate is not None
    fixed = rate is not None
    rate = rate if rate is not None else result.rate / 2
    tenant = bench.tenant(f"{key}lat{int(rate) if fixed else ''}")
    bench.cdb.register_states([tenant])
    base, base_sampled = proc.count, proc.sampled_out
    seconds = bench.args.fixed_latency_seconds if fixed else bench.args.latency_seconds
    bench.say(f"latency run: {rate:.0f} msg/s for {seconds:.0f} s")
    stats, sent = publish_recorded(fleet_spec(tenant, devices, rate=rate), duration=seconds)
    done = bench.wait(proc, base + stats.sent, timeout=120, what="latency run written")
    p: dict[str, Any] = {
        "offered_msg_per_s": rate,
        "achieved_msg_per_s": stats.rate,
        "published": stats.sent,
        "complete": done,
    }
    if has_db:
        check = bench.cdb.check(tenant, sent, sampled_out=proc.sampled_out - base_sampled)
        p["check"] = check.summary() | {"text": check.text()}
        values = check.latency_ms
    else:
        bench.stop(proc)
        path = LOGS / f"{key}-latency.json"
        values = json.loads(path.read_text()) if path.exists() else []
    p |= percentiles(values)
    if values:
        bench.say(f"latency p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms, max {p['max']:.1f} ms")
    if fixed:
        return p
    ordered = sorted(values)
    p["cdf_ms"] = [ordered[round(q / 100 * (len(ordered) - 1))] for q in range(101) if ordered]
    result.latency = p
    result.latency_values = values
    bench.latencies[key] = values
    return p
