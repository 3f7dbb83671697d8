"""Faults on the real services: Mosquitto restarted mid-stream, Cassandra
stopped while a fleet publishes, SIGTERM under load.

Each test counts published events (PUBACKed by the broker) against stored
ones and asserts they are equal. The gateway runs as a real subprocess.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import orjson
from cassandra.cluster import NoHostAvailable

from gateway.store.database import Database

from ..conftest import MQTT_HOST, MQTT_PORT, ROOT, GatewayProcess
from ..test_ingest import device_row, state_rows, telemetry_keys, topic


def _service(script: str, *actions: str) -> None:
    for action in actions:
        subprocess.run(
            ["bash", str(ROOT / script), action], check=True, timeout=180, capture_output=True
        )


class Publisher:
    """Publishes events at a steady rate in its own thread, reconnecting (with
    the same id) whenever the broker goes away; an event counts as published
    once the broker PUBACKed it."""

    def __init__(self, tenant: str, devices: int, rate: float, count: int) -> None:
        self.tenant, self.devices, self.rate, self.count = tenant, devices, rate, count
        self.published: dict[str, list[dict[str, object]]] = {}
        self.reconnects = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "publisher did not finish"

    async def _run(self) -> None:
        start = time.monotonic()
        base = int(time.time() * 1000)
        states = ("on", "off", "alarm")
        i = 0
        while i < self.count:
            try:
                async with aiomqtt.Client(
                    MQTT_HOST, MQTT_PORT, identifier=f"pub-{uuid.uuid4().hex[:8]}", timeout=5
                ) as client:
                    while i < self.count:
                        device = f"d{i % self.devices}"
                        event = {"ts": base + i, "state": states[(i // 7) % 3], "value": i}
                        await client.publish(topic(self.tenant, device), orjson.dumps(event), qos=1)
                        self.published.setdefault(device, []).append(event)
                        i += 1
                        ahead = start + i / self.rate - time.monotonic()
                        if ahead > 0:
                            await asyncio.sleep(ahead)
            except aiomqtt.MqttError:
                self.reconnects += 1
                await asyncio.sleep(0.5)


async def _assert_all_stored(
    db: Database, tenant: str, publisher: Publisher, deadline: float = 120
) -> None:
    expected = {d: {e["ts"] for e in events} for d, events in publisher.published.items()}
    async with asyncio.timeout(deadline):
        while True:
            try:
                stored = {d: {k[0] for k in await telemetry_keys(db, tenant, d)} for d in expected}
            except NoHostAvailable:  # this test's own session is still reconnecting
                stored = {}
            if stored == expected:
                break
            await asyncio.sleep(1)
    # The latest tables are exactly the newest event of each device.
    for device, events in publisher.published.items():
        newest = max(events, key=lambda e: int(str(e["ts"])))
        row = await device_row(db, tenant, device)
        assert (row.state, row.value_num) == (newest["state"], float(str(newest["value"])))
        assert device in await state_rows(db, tenant, str(newest["state"]))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def test_mosquitto_restart_mid_stream(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    gw = gateway_process(GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    publisher = Publisher(tenant, devices=20, rate=300, count=3000)
    publisher.start()
    await asyncio.sleep(3)
    await asyncio.to_thread(_service, "mosquitto/mosquitto.sh", "stop")
    await asyncio.sleep(2)
    await asyncio.to_thread(_service, "mosquitto/mosquitto.sh", "start")
    await asyncio.to_thread(publisher.join, 120)
    assert publisher.reconnects > 0
    await _assert_all_stored(db, tenant, publisher)
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
    publisher = Publisher(tenant, devices=50, rate=200, count=200 * 60)
    publisher.start()
    await asyncio.sleep(5)
    baseline = _rss_mb(gw.proc.pid)
    await asyncio.to_thread(_service, "cassandra/cassandra.sh", "stop")
    peak = baseline
    outage_end = time.monotonic() + 60
    while time.monotonic() < outage_end:
        await asyncio.sleep(1)
        peak = max(peak, _rss_mb(gw.proc.pid))
    await asyncio.to_thread(_service, "cassandra/cassandra.sh", "start", "wait")
    await asyncio.to_thread(publisher.join, 180)
    # The database fixture's session reconnects by itself.
    await _assert_all_stored(db, tenant, publisher, deadline=180)
    # Memory stays flat: the backlog waits in the broker, not in the gateway.
    assert peak - baseline < 60, (baseline, peak)
    print(f"RSS baseline {baseline:.0f} MB, peak during the outage {peak:.0f} MB")
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0


async def test_sigterm_under_load_finishes_what_it_holds(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    gw = gateway_process(GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    assert gw.proc is not None
    publisher = Publisher(tenant, devices=30, rate=1000, count=6000)
    publisher.start()
    await asyncio.sleep(2)
    stopped = time.monotonic()
    gw.signal(signal.SIGTERM)
    assert gw.wait(timeout=30) == 0
    took = time.monotonic() - stopped
    assert took < 15, took  # the configured deadline is 10 s
    assert "stopped: received=" in gw.output()
    # The rest waits in the broker for the next run.
    gw.start()
    await asyncio.to_thread(publisher.join, 120)
    await _assert_all_stored(db, tenant, publisher)
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0
