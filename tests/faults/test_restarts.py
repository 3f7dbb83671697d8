"""Faults on the real services: Mosquitto restarted mid-stream, Cassandra
stopped while a fleet publishes (the gateway's own SIGKILL and SIGTERM are in
tests/test_signals.py: they restart nothing shared).

Each test counts published events (PUBACKed by the broker) against stored
ones and asserts they are equal. The gateway runs as a real subprocess.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable

from gateway.store.database import Database

from ..helpers import (
    ROOT,
    GatewayProcess,
    Publisher,
    assert_all_stored,
    rss_mb,
    stored_at_least,
    wait_until,
)


def _service(script: str, *actions: str) -> None:
    for action in actions:
        subprocess.run(
            ["bash", str(ROOT / script), action], check=True, timeout=180, capture_output=True
        )


async def test_mosquitto_restart_mid_stream(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    gw = gateway_process(GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    publisher = Publisher(tenant, devices=20, rate=300, count=3000)
    publisher.start()
    # Mid-stream (3000 events over 10 s): the gateway is storing them.
    await wait_until(stored_at_least(db, tenant, publisher, 300), 60, "300 events stored")
    await asyncio.to_thread(_service, "mosquitto/mosquitto.sh", "stop")
    await asyncio.sleep(2)  # the scenario: the broker is away for 2 s
    await asyncio.to_thread(_service, "mosquitto/mosquitto.sh", "start")
    await asyncio.to_thread(publisher.join, 120)
    assert publisher.reconnects > 0  # the broker did go away mid-stream
    await assert_all_stored(db, tenant, publisher)
    log = gw.output()
    assert "lost or refused" in log  # it noticed, backed off...
    assert log.count("subscribed to") >= 2  # ...and came back
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0


async def test_cassandra_stopped_while_the_fleet_publishes(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    gw = gateway_process(GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    assert gw.proc is not None
    publisher = Publisher(tenant, devices=50, rate=200, count=200 * 35)
    publisher.start()
    # Warmed up (about 5 s of the fleet stored) before the baseline is taken.
    await wait_until(stored_at_least(db, tenant, publisher, 1000), 60, "1000 events stored")
    baseline = rss_mb(gw.proc.pid)
    await asyncio.to_thread(_service, "cassandra/cassandra.sh", "stop")
    peak = baseline
    outage_end = time.monotonic() + 20  # the scenario: Cassandra is down for 20 s
    while time.monotonic() < outage_end:
        await asyncio.sleep(1)
        peak = max(peak, rss_mb(gw.proc.pid))
    await asyncio.to_thread(_service, "cassandra/cassandra.sh", "start", "wait")
    await asyncio.to_thread(publisher.join, 180)
    # The database fixture's session reconnects by itself.
    await assert_all_stored(db, tenant, publisher, deadline=180)
    # Memory stays flat: the backlog waits in the broker, not in the gateway.
    assert peak - baseline < 60, (baseline, peak)
    print(f"RSS baseline {baseline:.0f} MB, peak during the outage {peak:.0f} MB")
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0
