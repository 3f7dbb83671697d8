"""The gateway killed with SIGKILL mid-stream, several times, and restarted:
nothing is lost, and the duplicates that at-least-once delivery causes change
nothing (event-time write timestamps, content-hash row keys)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC

from gateway.store.database import Database
from gateway.tools.simulate import Fleet, FleetSpec

from ..conftest import GatewayProcess, publish
from ..test_ingest import device_row, telemetry_keys


def _publish_in_thread(messages: list[tuple[str, bytes]], done: list[int]) -> threading.Thread:
    def work() -> None:
        done.append(asyncio.run(publish(messages)))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


async def test_sigkill_mid_stream_loses_nothing(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    fleet = Fleet(FleetSpec(devices=50, rate=1000, tenant=tenant, seed=7))
    now = int(time.time() * 1000) - 60_000
    messages: list[tuple[str, bytes]] = []
    expected: dict[str, set[int]] = {}
    for i in range(4000):
        t, payload, event = fleet.next_message(now + i)
        messages.append((t, payload))
        expected.setdefault(t.split("/")[3], set()).add(event["ts"])
    gw = gateway_process()
    gw.start()
    done: list[int] = []
    publisher = _publish_in_thread(messages, done)
    # Let it get going, then kill it hard while messages are in flight.
    written = 0
    async with asyncio.timeout(60):
        while written < 100:
            await asyncio.sleep(0.2)
            written = 0
            for device in list(expected)[:5]:
                written += len(await telemetry_keys(db, tenant, device))
    gw.kill()
    stored_at_kill = 0
    for device in expected:
        stored_at_kill += len(await telemetry_keys(db, tenant, device))
    assert stored_at_kill < len(messages), "the kill should land mid-stream"
    # Several more kills while the rest is redelivered and written.
    for _ in range(3):
        gw.start()
        await asyncio.sleep(1.0)
        gw.signal(signal.SIGKILL)
        gw.wait()
    gw.start()
    await asyncio.to_thread(publisher.join, 120)
    assert done == [len(messages)]
    async with asyncio.timeout(120):
        while True:
            stored = {d: {k[0] for k in await telemetry_keys(db, tenant, d)} for d in expected}
            if stored == expected:
                break
            await asyncio.sleep(1)
    # Latest tables: each device's newest event, whatever was redelivered.
    for device, stamps in expected.items():
        row = await device_row(db, tenant, device)
        assert int(row.ts.replace(tzinfo=UTC).timestamp() * 1000) == max(stamps)
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0
    assert "stopped: received=" in gw.output()
