"""Broker ceiling: bench/broker_sub.py, a paho QoS 1 subscriber, no database.
Its rate is first to last message received (from its own progress line)."""

from __future__ import annotations

import os
import re
import sys

from benchlib import BENCH, Proc
from harness import LOGS, Bench
from phases.sustained import drain


def run(bench: Bench) -> None:
    n = bench.args.count

    def make(cid: str) -> Proc:
        return Proc(
            "broker_sub",
            [
                sys.executable,
                str(BENCH / "broker_sub.py"),
                cid,
                str(n),
                str(LOGS / "broker-latency.json"),
            ],
            dict(os.environ),
            bench.log("broker_sub"),
            [re.compile("READY")],
            re.compile(r"received=(\d+)"),
        )

    result, _ = drain(bench, "broker", make, count=n, devices=bench.args.devices, has_db=False)
    result.extra["latency_meaning"] = "publish → received by the subscriber (no database)"
    bench.results["systems"]["broker"] = result.as_json()
