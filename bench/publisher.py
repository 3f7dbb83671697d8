"""One publisher process for the overload runs: gateway.simulate.publish into
the bench topic tree, paced to RATE for DURATION seconds; prints its
PublishStats as JSON. Several run in parallel when one process can't offer
the load alone.

Usage (from bench/run.py): python bench/publisher.py TENANT DEVICES RATE DURATION SEED
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict

from gateway.tools.simulate import FleetSpec, publish

TOPIC_TEMPLATE = "gwbench/{tenant}/devices/{device_id}/events"


def main() -> None:
    tenant, devices, rate, duration, seed = sys.argv[1:6]
    spec = FleetSpec(
        devices=int(devices),
        rate=float(rate),
        tenant=tenant,
        topic_template=TOPIC_TEMPLATE,
        seed=int(seed),
    )
    stats = asyncio.run(publish(spec, duration=float(duration), status_every=3600))
    print(json.dumps(asdict(stats)), flush=True)


if __name__ == "__main__":
    main()
