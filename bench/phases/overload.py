"""Gateway under overload: one gateway, fed by publisher processes
(bench/publisher.py) at each of ``--overload-factors`` times its sustained
rate for ``--overload-seconds``, then drained. Every published message must
be stored or counted as sampled out."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from benchlib import BENCH, Proc, ProcError, clear_session, create_session, peak_rss_mb, rss_mb
from harness import Bench
from systems import gateway


def run(bench: Bench) -> None:
    sustained = bench.results["systems"].get("gateway", {}).get("msg_per_s")
    if not sustained:
        bench.results["overload"] = {"status": "not measured: no sustained gateway rate"}
        return
    cid = bench.client_id("overload")
    create_session(cid)
    gw = bench.proc(gateway.proc(bench, cid, "gateway-overload"))
    segments = []
    try:
        gw.wait_ready(90)
        for factor in bench.args.overload_factors:
            segments.append(segment(bench, gw, factor, sustained))
    finally:
        bench.stop(gw)
        clear_session(cid)
    bench.results["overload"] = {"sustained_msg_per_s": sustained, "segments": segments}


def segment(bench: Bench, gw: Proc, factor: float, sustained: float) -> dict[str, Any]:
    target = factor * sustained
    duration = bench.args.overload_seconds
    k = max(1, min(bench.args.max_publishers, math.ceil(target / 8000)))
    devices = max(1, bench.args.devices // k)
    tenants = [bench.tenant(f"ov{factor:g}p{i}") for i in range(k)]
    bench.cdb.register_states(tenants)
    base = gw.count
    counters0 = gateway.status_counters(gw)
    bench.say(
        f"{factor:g}x: offering {target:.0f} msg/s for {duration:.0f} s "
        f"from {k} publisher process(es)"
    )
    pubs = [
        bench.proc(
            Proc(
                f"publisher-{factor:g}-{i}",
                [
                    sys.executable,
                    str(BENCH / "publisher.py"),
                    tenant,
                    str(devices),
                    str(target / k),
                    str(duration),
                    str(i + 1),
                ],
                dict(os.environ),
                bench.log(f"publisher-{factor:g}-{i}"),
                [],
                None,
            )
        )
        for i, tenant in enumerate(tenants)
    ]
    rss_max = 0.0
    t0 = time.monotonic()
    next_say = t0 + 5
    while any(p.alive() for p in pubs):
        gw.poll()
        rss_max = max(rss_max, rss_mb(gw.pid))
        if time.monotonic() > next_say:
            bench.say(f"{factor:g}x: gateway written {gw.count - base}, RSS {rss_max:.0f} MB")
            next_say = time.monotonic() + 5
        if not gw.alive():
            raise ProcError("the gateway exited during the overload run")
        time.sleep(0.25)
    published_at = time.monotonic()
    stats = []
    for p in pubs:
        lines = p.log.read_text().strip().splitlines()
        try:
            stats.append(json.loads(lines[-1]))
        except (IndexError, json.JSONDecodeError):
            raise ProcError(f"{p.name} failed:\n{p.log.read_text()[-2000:]}") from None
    published = sum(s["sent"] for s in stats)
    offered = published / max(s["elapsed_s"] for s in stats)
    bench.say(f"{factor:g}x: {published} published ({offered:.0f} msg/s); draining")

    def tick() -> None:
        nonlocal rss_max
        rss_max = max(rss_max, rss_mb(gw.pid))
        bench.say(f"{factor:g}x: drained {gw.count - base}/{published}")

    done = gw.wait_count(base + published, timeout=120 + published / 200, tick=tick)
    drained_at = time.monotonic()
    rss_max = max(rss_max, rss_mb(gw.pid))
    stored = sum(bench.cdb.count(t, [f"dev-{i:06d}" for i in range(devices)]) for t in tenants)
    # At these rates per device the adaptive sampler may decide some raw rows
    # are not kept (by design, counted, latest state still written): every
    # published message must be either stored or counted as sampled out.
    counters = gateway.status_counters(gw)
    sampled_out = counters.get("sampled_out", 0) - counters0.get("sampled_out", 0)
    written = counters.get("written", 0) - counters0.get("written", 0)
    result = {
        "factor": factor,
        "target_msg_per_s": target,
        "offered_msg_per_s": offered,
        "publishers": k,
        "seconds": duration,
        "published": published,
        "stored": stored,
        "sampled_out": sampled_out,
        "gateway_written": written,
        "ok": done and stored == written and stored + sampled_out == published,
        "drain_after_publish_s": drained_at - published_at,
        "whole_segment_msg_per_s": published / (drained_at - t0),
        "rss_max_sampled_mb": rss_max,
        "peak_rss_mb": peak_rss_mb(gw.pid),
    }
    bench.say(
        f"{factor:g}x: stored {stored} + sampled out {sampled_out} of {published} published, "
        f"peak RSS {result['peak_rss_mb']:.0f} MB, "
        f"drained {result['drain_after_publish_s']:.0f} s after publishing ended"
    )
    return result
