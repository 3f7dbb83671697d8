"""The edge host after an outage: drain a spool that filled while Cassandra was away.

1. Write COUNT events of the simulated fleet (DEVICES devices, timestamps
   spread evenly over the last OUTAGE seconds, so all of them are back-fill)
   straight into a fresh spool file (``gateway.ingest.spool.Spool``), as
   `gateway run` with ``spool.enabled`` had acknowledged them to the broker.
2. Start `gateway run` on that spool, in the bench keyspace, and time it from
   its "subscribed" line until every event is written.

Prints events/s, the gateway's CPU per event (from "subscribed" on), the
local Cassandra's and Mosquitto's CPU per event over the same span, and the
gateway's own counts at its stop (chunks, requests, coalesced: events that
left their latest-table rows to a newer event of their device).

Usage: .venv/bin/python bench/spool_drain.py [--devices 1000] [--count 60000] [--outage 600]
       [--gateway-env GATEWAY_PIPELINE__BATCH_MAX_EVENTS=500]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import (
    add_gateway_env,
    add_warm_up,
    apply_schema,
    cpu_seconds,
    gateway_env,
    gateway_settings,
    maybe_warm_up,
    run_tool,
    services_cpu,
    services_cpu_since,
    template,
)
from drain import STATUS, follow, gateway_session

from gateway.ingest.spool import Spool
from gateway.tools.simulate import Fleet, FleetSpec

ROOT = "gwspool"
COUNTS = re.compile(r"\b(chunks|requests|coalesced|sampled_out)=(\d+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--count", type=int, default=60_000)
    parser.add_argument("--outage", type=float, default=600, help="seconds; default 600")
    add_gateway_env(parser, "a setting for the gateway (repeatable)")
    add_warm_up(parser)
    args = parser.parse_args()
    maybe_warm_up(args.warm_up, args.devices)
    apply_schema()
    with tempfile.TemporaryDirectory(prefix="bench-spool-") as tmp:
        path = Path(tmp) / "spool.sqlite"
        tenant = f"spool{uuid.uuid4().hex[:6]}"
        asyncio.run(fill(path, tenant, args.devices, args.count, args.outage))
        print(f"spooled {args.count} events of {args.devices} devices over {args.outage:.0f} s")
        client_id = f"bench-spool-{uuid.uuid4().hex[:8]}"
        env = gateway_env(client_id, ROOT, SPOOL__ENABLED="true", SPOOL__PATH=str(path))
        env |= gateway_settings(args.gateway_env)
        drain(env, f"/tmp/{client_id}.log", args.count)


async def fill(path: Path, tenant: str, devices: int, count: int, outage_s: float) -> None:
    fleet = Fleet(
        FleetSpec(devices=devices, rate=1e9, tenant=tenant, topic_template=template(ROOT))
    )
    received = int(time.time() * 1000)
    first = received - int(outage_s * 1000)
    step = outage_s * 1000 / count
    records = []
    for i in range(count):
        topic, payload, _ = fleet.next_message(int(first + i * step))
        records.append((received, topic, fleet.content_type, payload))
    async with Spool(path, max(count, 1), 1024**4) as spool:
        await spool.append(records)


def drain(env: dict[str, str], log: str, count: int) -> None:
    start = cpu0 = 0.0
    services0 = services_cpu()
    written = 0
    with gateway_session(env, log) as proc:
        for line in follow(proc, log):
            if not start and "subscribed to" in line:
                start, cpu0, services0 = time.monotonic(), cpu_seconds(proc.pid), services_cpu()
            if (m := STATUS.search(line)) and "status:" in line:
                written = int(m.group(1)) + int(m.group(2))
                if written >= count:
                    break
        elapsed = time.monotonic() - start
        cpu = cpu_seconds(proc.pid) - cpu0
        services = services_cpu_since(services0, written)
    stopped = next(
        line for line in reversed(Path(log).read_text().splitlines()) if "stopped:" in line
    )
    counts = ", ".join(f"{k} {v}" for k, v in COUNTS.findall(stopped))
    print(
        f"drained {written} events from the spool in {elapsed:.1f} s: {written / elapsed:.0f} "
        f"events/s, gateway CPU {cpu / written * 1e6:.0f} us/event; Cassandra "
        f"{services['Cassandra'] or 0:.0f} us/event, Mosquitto {services['Mosquitto'] or 0:.0f}; "
        f"{counts}"
    )


if __name__ == "__main__":
    run_tool(main)
