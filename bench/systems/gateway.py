"""The gateway with its defaults (``python -m gateway run``), plus whatever
``--gateway-env`` sets; the scaling and overload phases start it from here too."""

from __future__ import annotations

import os
import re
import sys

import rows
from benchlib import Proc, gateway_settings
from harness import Bench
from phases.sustained import drain, scaling_row

from gateway.config import Config


def proc(bench: Bench, cid: str, name: str = "gateway") -> Proc:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_MQTT__CLIENT_ID": cid,
        "GATEWAY_MQTT__SESSION_EXPIRY": "600",
        "GATEWAY_CASSANDRA__KEYSPACE": rows.KEYSPACE,
        "GATEWAY_TOPICS": '[{template = "gwbench/{tenant}/devices/{device_id}/events"}]',
        "GATEWAY_PIPELINE__STATUS_INTERVAL": "200ms",
    }
    if "api" in Config.model_fields:
        # Its metrics endpoint on any free port: several gateways may run at once.
        env["GATEWAY_API__PORT"] = "0"
    env |= gateway_settings(bench.args.gateway_env)
    return Proc(
        name,
        [sys.executable, "-m", "gateway", "run"],
        env,
        bench.log(name),
        [re.compile(r"connected to mqtt://")],
        # acked: messages finished (written, rejected or sampled out) and PUBACKed
        re.compile(r"status: .*acked=(\d+)"),
    )


def run(bench: Bench) -> None:
    result, gw = drain(
        bench,
        "gateway",
        lambda cid: proc(bench, cid),
        count=bench.args.count,
        devices=bench.args.devices,
        latency_rates=bench.args.latency_rates,
    )
    summary = [line for line in gw.log.read_text().splitlines() if "stopped:" in line]
    if summary:
        result.extra["gateway_summary"] = summary[-1].split("stopped: ", 1)[1]
        dropped = re.findall(r"\b(sampled_out|quota_rejected|rejected)=(\d+)", summary[-1])
        result.extra["gateway_dropped"] = {k: int(v) for k, v in dropped if int(v)}
    bench.results["systems"]["gateway"] = result.as_json()
    bench.results["scaling"] = [scaling_row(bench.args.devices, result)]


def status_counters(gw: Proc) -> dict[str, int]:
    """The counters of the gateway's last status line (written=, sampled_out= ...)."""
    for line in reversed(gw.log.read_text().splitlines()):
        if "status:" in line:
            return {k: int(v) for k, v in re.findall(r"\b(\w+)=(\d+)", line)}
    return {}
