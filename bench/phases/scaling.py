"""Gateway throughput by fleet size: the same drain at each of
``--scale-devices`` (the 1k-device row comes from the gateway's own phase)."""

from __future__ import annotations

import functools

from harness import Bench
from systems import gateway

from phases.sustained import drain, scaling_row


def run(bench: Bench) -> None:
    rows_out = bench.results.setdefault("scaling", [])
    for devices in bench.args.scale_devices:
        bench.say(f"gateway with {devices} devices")
        result, _ = drain(
            bench,
            "gateway",
            functools.partial(gateway.proc, bench, name=f"gateway-{devices}"),
            count=bench.args.scale_count,
            devices=devices,
            latency=False,
            latest=False,
        )
        rows_out.append(scaling_row(devices, result))
