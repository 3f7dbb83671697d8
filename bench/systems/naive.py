"""Naive bridge: bench/naive_bridge.py, paho on_message + session.execute per
row, acknowledging after the write."""

from __future__ import annotations

import os
import re
import sys

from benchlib import BENCH, Proc
from harness import Bench
from phases.sustained import drain


def run(bench: Bench) -> None:
    def make(cid: str) -> Proc:
        return Proc(
            "naive_bridge",
            [sys.executable, str(BENCH / "naive_bridge.py"), cid],
            dict(os.environ),
            bench.log("naive_bridge"),
            [re.compile("READY")],
            re.compile(r"written=(\d+)"),
        )

    result, _ = drain(
        bench, "naive", make, count=bench.args.naive_count, devices=bench.args.devices
    )
    bench.results["systems"]["naive"] = result.as_json()
