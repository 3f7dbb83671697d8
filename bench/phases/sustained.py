"""Sustained rate: a system drains a backlog that was published while it was
away (its persistent MQTT session holds it); then its stored rows are read
back, and its CPU and peak RSS read from /proc."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchlib import (
    Proc,
    clear_session,
    cpu_seconds,
    create_session,
    peak_rss_mb,
    services_cpu,
    services_cpu_since,
)
from harness import Bench, Drain

from phases.latency import run as latency_run


def drain(
    bench: Bench,
    key: str,
    make: Callable[[str], Proc],
    *,
    count: int,
    devices: int,
    has_db: bool = True,
    latency: bool = True,
    latest: bool = True,
    latency_rates: Sequence[float] = (),
) -> tuple[Drain, Proc]:
    """Backlog → start → drain → (latency run at half the rate, then at each
    of ``latency_rates``) → stop."""
    cid = bench.client_id(key)
    tenant = bench.tenant(f"{key}{devices}")
    startup = startup_cpu(bench, key, make, cid)
    create_session(cid)  # fresh and empty: only the backlog below is queued
    bench.settle(key)
    sent = bench.publish_backlog(tenant, devices, count)
    services = services_cpu()  # Cassandra's and Mosquitto's, over the same drain
    proc = bench.proc(make(cid))
    started = time.monotonic()
    result = Drain(count=count)
    try:
        proc.wait_ready(90)
        bench.say(f"{proc.name} ready, draining {count} messages")
        done = bench.wait(proc, count, timeout=60 + count / 50, what="drained")
        cpu = cpu_seconds(proc.pid) - startup
        result.extra["services_cpu_us_per_msg"] = services_cpu_since(services, proc.count)
        result.wall_s = time.monotonic() - started
        result.reached = proc.count
        result.peak_rss_mb = peak_rss_mb(proc.pid)
        result.cpu_per_1k = cpu / max(proc.count, 1) * 1000
        if not done:
            result.extra["status"] = f"stalled at {proc.count}/{count}"
        if has_db:
            # This process has handled the backlog's tenant alone so far.
            result.check = bench.cdb.check(
                tenant, sent, latest=latest, sampled_out=proc.sampled_out
            )
            result.rate = result.check.span_rate()
            bench.say(f"stored: {result.check.text()}")
        else:
            m = re.search(r"first=([\d.]+) last=([\d.]+)", proc.last_progress_line)
            if m and done and float(m.group(2)) > float(m.group(1)):
                result.rate = (count - 1) / (float(m.group(2)) - float(m.group(1)))
        rate_text = f"{result.rate:.0f}" if result.rate else "?"
        bench.say(
            f"{rate_text} msg/s sustained, {result.cpu_per_1k:.2f} CPU s per 1k msgs, "
            f"peak RSS {result.peak_rss_mb:.0f} MB"
        )
        if latency and result.rate:
            latency_run(bench, key, proc, result, devices, has_db)
            result.extra["latency_by_rate"] = [
                latency_run(bench, key, proc, result, devices, has_db, rate=rate)
                for rate in latency_rates
            ]
    finally:
        bench.stop(proc)
        clear_session(cid)
    return result, proc


def startup_cpu(bench: Bench, key: str, make: Callable[[str], Proc], cid: str) -> float:
    """CPU seconds a system spends starting up (to connected and subscribed),
    measured once per system on an empty session. A backlog floods in as soon
    as the system connects, before it can report being ready, so the drain's
    CPU is its total minus this."""
    if key not in bench.startup:
        create_session(cid)
        proc = bench.proc(make(cid))
        try:
            proc.wait_ready(90)
            time.sleep(0.2)
            bench.startup[key] = cpu_seconds(proc.pid)
        finally:
            bench.stop(proc)
        bench.say(f"{proc.name} start-up: {bench.startup[key]:.2f} CPU s")
    return bench.startup[key]


def scaling_row(devices: int, result: Drain) -> dict[str, Any]:
    """One row of the report's throughput-by-fleet-size table."""
    return {
        "devices": devices,
        "backlog": result.count,
        "msg_per_s": result.rate,
        "cpu_s_per_1k_msgs": result.cpu_per_1k,
        "peak_rss_mb": result.peak_rss_mb,
        "check": result.check.text() if result.check else None,
        "ok": result.check.ok if result.check else False,
    }
