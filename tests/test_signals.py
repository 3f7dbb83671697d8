"""The gateway killed with SIGKILL mid-stream, several times, and restarted:
nothing is lost, and the duplicates that at-least-once delivery causes change
nothing (event-time write timestamps, content-hash row keys). SIGTERM under
load: it finishes what it holds, and the rest waits in the broker.

They stop only the gateway's own subprocess, so they run beside the other
tests (tests/faults/ is for those that restart the shared services)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC

from gateway.store.database import Database
from gateway.tools.delay_proxy import DelayProxy
from gateway.tools.simulate import Fleet, FleetSpec

from .helpers import (
    CQL_PORT,
    GatewayProcess,
    Publisher,
    assert_all_stored,
    device_row,
    publish,
    stored_at_least,
    telemetry_keys,
    wait_until,
)


def _publish_in_thread(messages: list[tuple[str, bytes]], done: list[int]) -> threading.Thread:
    """Publish in a thread, 100 at a time with 0.1 s between: at most about
    1,000 msg/s, so that the stream outlasts the first kill (at full speed a
    fast gateway could write all of it before the kill lands)."""

    async def paced() -> int:
        sent = 0
        for start in range(0, len(messages), 100):
            sent += await publish(messages[start : start + 100])
            await asyncio.sleep(0.1)
        return sent

    def work() -> None:
        done.append(asyncio.run(paced()))

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
    total = sum(len(stamps) for stamps in expected.values())

    async def stored(devices: list[str]) -> int:
        return sum([len(await telemetry_keys(db, tenant, d)) for d in devices])

    # Let it get going, then kill it hard while messages are in flight.
    async def going() -> bool:
        return await stored(list(expected)[:5]) >= 100

    await wait_until(going, 60, "100 events stored", interval=0.2)
    gw.kill()
    stored_at_kill = await stored(list(expected))
    assert stored_at_kill < total, "the kill should land mid-stream"
    # Several more kills while the rest is redelivered and written, each once
    # the restarted gateway has written more (or everything is there).
    for _ in range(3):
        before = await stored(list(expected))
        gw.start()

        async def progressed(before: int = before) -> bool:
            now = await stored(list(expected))
            return now > before or now == total

        await wait_until(progressed, 60, "the restarted gateway writing", interval=0.5)
        gw.signal(signal.SIGKILL)
        gw.wait()
    gw.start()
    await asyncio.to_thread(publisher.join, 120)
    assert done == [len(messages)]

    async def all_stored() -> bool:
        # Sorted lists, not sets: a redelivered copy with an id of its own
        # would be a second row of the same time.
        stamps = {d: sorted(k[0] for k in await telemetry_keys(db, tenant, d)) for d in expected}
        return stamps == {d: sorted(s) for d, s in expected.items()}

    await wait_until(all_stored, 120, "every event stored once", interval=1)
    # Latest tables: each device's newest event, whatever was redelivered.
    for device, stamps in expected.items():
        row = await device_row(db, tenant, device)
        assert int(row.ts.replace(tzinfo=UTC).timestamp() * 1000) == max(stamps)
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0
    assert "stopped: received=" in gw.output()


async def test_sigterm_under_load_finishes_what_it_holds(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    gw = gateway_process(GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    assert gw.proc is not None
    publisher = Publisher(tenant, devices=30, rate=1000, count=6000)
    publisher.start()
    # Under load: the gateway is storing the stream (6000 events over 6 s).
    await wait_until(stored_at_least(db, tenant, publisher, 1000), 60, "1000 events stored")
    gw.signal(signal.SIGTERM)
    # It stops by itself within its shutdown deadline (10 s): exit code 0, and
    # the CLI's backstop (deadline + 5 s, then cancel and exit 1) never fired.
    assert gw.wait(timeout=30) == 0
    assert "shutdown took over" not in gw.output()
    # Said at once, before the stop's summary (a Ctrl-C met silence).
    output = gw.output()
    said = output.find("stopping: finishing the writes under way (up to 10 s")
    assert 0 <= said < output.find("stopped: received="), output[-2000:]
    # The rest waits in the broker for the next run.
    gw.start()
    await asyncio.to_thread(publisher.join, 120)
    await assert_all_stored(db, tenant, publisher)
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0


async def test_a_second_signal_exits_at_once_and_loses_nothing(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    """A Ctrl-C while Cassandra hangs waits for the writes under way, up to
    pipeline.shutdown_deadline (10 s) and the backstop; a second Ctrl-C
    changed nothing (field probe). Now it exits at once, as SIGKILL would,
    and the next start takes from the broker what was not acknowledged."""
    async with DelayProxy("127.0.0.1", CQL_PORT) as proxy:
        gw = gateway_process(
            GATEWAY_SAMPLING__ENABLED="false", GATEWAY_CASSANDRA__PORT=str(proxy.port)
        )
        await asyncio.to_thread(gw.start)
        publisher = Publisher(tenant, devices=10, rate=500, count=3000)
        publisher.start()
        await wait_until(stored_at_least(db, tenant, publisher, 300), 60, "300 events stored")
        proxy.delay = 60.0  # Cassandra's answers stop coming back
        await asyncio.sleep(1.0)
        gw.signal(signal.SIGTERM)
        await wait_until(lambda: "stopping: finishing" in gw.output(), 10, "the stop said")
        started = time.monotonic()
        gw.signal(signal.SIGINT)
        assert await asyncio.to_thread(gw.wait, 10) == 130
        took = time.monotonic() - started
    assert took < 3, took
    output = gw.output()
    assert "second signal: exiting now, without waiting for the writes under way" in output
    assert "stopped: received=" not in output  # not the graceful stop's end
    gw.env["GATEWAY_CASSANDRA__PORT"] = str(CQL_PORT)
    await asyncio.to_thread(gw.start)
    await asyncio.to_thread(publisher.join, 120)
    await assert_all_stored(db, tenant, publisher)
    gw.signal(signal.SIGTERM)
    assert await asyncio.to_thread(gw.wait) == 0
