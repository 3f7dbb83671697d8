"""Cassandra ceiling: bench/ceiling.py writes the gateway's rows for
already-decoded events through the gateway's own write session, at each
concurrency level of ``--levels``; the best level that stored every row
without failures is the ceiling."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from benchlib import Proc, ProcError, Sent, ceiling_command
from harness import LOGS, Bench


def run(bench: Bench) -> None:
    out = LOGS / "ceiling.json"
    args = bench.args
    cmd = ceiling_command(bench.tenant(""), args.devices, args.ceiling_count, args.levels, out)
    bench.settle("cassandra")  # after the warm-up's writes
    proc = bench.proc(
        Proc("ceiling", cmd, dict(os.environ), bench.log("ceiling"), [], re.compile(r"^$"))
    )
    levels = [int(x) for x in bench.args.levels.split(",")]
    tenants = [bench.tenant(f"c{level}") for level in levels]
    bench.cdb.register_states(tenants)
    next_say = time.monotonic() + 5
    while proc.alive():
        time.sleep(0.1)
        if time.monotonic() > next_say:
            done = proc.log.read_text().count("level ")
            bench.say(f"{done}/{len(levels)} concurrency levels done")
            next_say = time.monotonic() + 5
    if proc.popen is None or proc.popen.returncode != 0 or not out.exists():
        raise ProcError(f"ceiling writer failed:\n{proc.log.read_text()[-2000:]}")
    report = json.loads(out.read_text())
    per_level = []
    best: dict[str, Any] | None = None
    for level in report["levels"]:
        sent = [Sent(d, ts, s, None) for d, ts, s in level.pop("sent")]
        check = bench.cdb.check(level["tenant"], sent)
        level["msg_per_s"] = level["events"] / level["seconds"]
        level["cpu_s_per_1k_msgs"] = level["cpu_s"] / level["events"] * 1000
        level["check"] = check.summary() | {"text": check.text()}
        level["statements_per_s"] = level["statements"] / level["seconds"]
        bench.say(
            f"{level['concurrency']} in flight: {level['msg_per_s']:.0f} msg/s "
            f"({level['statements_per_s']:.0f} statements/s), stored {check.text()}"
        )
        per_level.append(level)
        if (
            check.ok
            and level["failures"] == 0
            and (best is None or level["msg_per_s"] > best["msg_per_s"])
        ):
            best = level
    result: dict[str, Any] = {
        "levels": per_level,
        "process_peak_rss_mb": report["peak_rss_mb"],
        "driver": report["driver"],
    }
    if best is not None:
        result |= {
            "backlog": best["events"],
            "drained": best["events"],
            "msg_per_s": best["msg_per_s"],
            "cpu_s_per_1k_msgs": best["cpu_s_per_1k_msgs"],
            "peak_rss_mb": report["peak_rss_mb"],
            "check": best["check"],
            "best_concurrency": best["concurrency"],
            "services_cpu_us_per_msg": best.get("services_cpu_us_per_msg", {}),
        }
    else:
        result["status"] = "failed: no concurrency level wrote every row without errors"
    bench.results["systems"]["cassandra"] = result
