"""The simulated fleet: deterministic generation, and delivery through the real broker."""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiomqtt
import mqtt5
import msgpack
import orjson
import pytest

from gateway.config import MqttConfig
from gateway.errors import BrokerError
from gateway.tools import simulate
from gateway.tools.simulate import Fleet, FleetSpec, PublishStats, noisy_device_ids, publish

from .helpers import (
    MQTT_HOST,
    MQTT_PORT,
    base_env,
    free_port,
    mosquitto_on,
    run_cli,
)
from .scripted_broker import ScriptedBroker

NOW_MS = 1_700_000_000_000


def _draw(fleet: Fleet, n: int, *, step_every: int = 7) -> list[tuple[str, bytes, dict[str, Any]]]:
    # A clock that often repeats the same millisecond, to exercise the per-device bump.
    return [fleet.next_message(NOW_MS + i // step_every) for i in range(n)]


def _device_of(topic: str) -> str:
    parts = topic.split("/")
    assert parts[0] == "tenants"
    assert parts[2] == "devices"
    assert parts[4] == "events"
    return parts[3]


def test_same_spec_same_messages() -> None:
    spec = FleetSpec(devices=50, rate=100.0, noisy=0.1, seed=42)
    assert _draw(Fleet(spec), 2_000) == _draw(Fleet(spec), 2_000)
    other = _draw(Fleet(FleetSpec(devices=50, rate=100.0, noisy=0.1, seed=43)), 2_000)
    assert other != _draw(Fleet(spec), 2_000)


def test_device_ids_and_noisy_ids() -> None:
    spec = FleetSpec(devices=20, rate=10.0, noisy=0.1)
    assert Fleet(spec).device_ids == [f"dev-{i:06d}" for i in range(20)]
    assert noisy_device_ids(spec) == ["dev-000000", "dev-000001"]
    assert noisy_device_ids(FleetSpec(devices=20, rate=10.0)) == []


def test_noisy_devices_send_about_50x() -> None:
    spec = FleetSpec(devices=100, rate=1000.0, noisy=0.1, seed=7)
    counts = Counter(_device_of(topic) for topic, _, _ in _draw(Fleet(spec), 20_000))
    noisy = set(noisy_device_ids(spec))
    assert len(noisy) == 10
    noisy_mean = sum(counts[d] for d in noisy) / len(noisy)
    normal_ids = [d for d in Fleet(spec).device_ids if d not in noisy]
    normal_mean = sum(counts[d] for d in normal_ids) / len(normal_ids)
    assert 35 < noisy_mean / normal_mean < 70
    # Every device gets picked eventually (~34 expected each for normal ones).
    assert all(counts[d] > 0 for d in normal_ids)


def test_ts_strictly_increasing_per_device() -> None:
    fleet = Fleet(FleetSpec(devices=5, rate=100.0, noisy=0.2))
    last: dict[str, int] = {}
    # Same millisecond for every event: all bumps.
    for _ in range(1_000):
        topic, _, event = fleet.next_message(NOW_MS)
        dev = _device_of(topic)
        assert event["ts"] > last.get(dev, -1)
        assert event["ts"] >= NOW_MS
        last[dev] = event["ts"]
    # A clock running ahead is taken as is.
    topic, _, event = fleet.next_message(NOW_MS + 10_000_000)
    assert event["ts"] == NOW_MS + 10_000_000


def test_json_payload_decodes_to_event() -> None:
    fleet = Fleet(FleetSpec(devices=10, rate=10.0, fmt="json", tenant="t1"))
    assert fleet.content_type == "application/json"
    for topic, payload, event in _draw(fleet, 500):
        assert orjson.loads(payload) == event
        assert topic == f"tenants/t1/devices/{_device_of(topic)}/events"
        assert set(event) == {"ts", "state", "value", "metrics", "tags", "sent_at"}
        assert isinstance(event["ts"], int)
        assert isinstance(event["sent_at"], float)
        assert event["value"] == event["metrics"]["temperature"]
        assert set(event["metrics"]) == {"temperature", "humidity", "battery"}
        assert event["tags"]["kind"] == "sensor"
        assert event["tags"]["site"].startswith("site-")


def test_msgpack_payload_decodes_to_event() -> None:
    fleet = Fleet(FleetSpec(devices=10, rate=10.0, fmt="msgpack", device_kind="switch"))
    assert fleet.content_type == "application/msgpack"
    for _, payload, event in _draw(fleet, 500):
        assert msgpack.unpackb(payload, raw=False) == event
        # Non-sensor kinds report their state as a text value.
        assert event["value"] == event["state"]
        assert event["tags"]["kind"] == "switch"


def test_sent_at_override() -> None:
    _, payload, event = Fleet(FleetSpec(devices=1, rate=1.0)).next_message(
        NOW_MS, sent_at=NOW_MS + 0.5
    )
    assert event["sent_at"] == NOW_MS + 0.5
    assert orjson.loads(payload)["sent_at"] == NOW_MS + 0.5


def test_some_but_not_all_events_change_state() -> None:
    spec = FleetSpec(devices=20, rate=10.0, states=("on", "off", "idle"), seed=3)
    previous: dict[str, str] = {}
    changes = repeats = 0
    for topic, _, event in _draw(Fleet(spec), 10_000):
        dev = _device_of(topic)
        assert event["state"] in spec.states
        if dev in previous:
            if previous[dev] == event["state"]:
                repeats += 1
            else:
                changes += 1
        previous[dev] = event["state"]
    assert changes > 0
    assert repeats > 0
    # p = 0.05: about 500 changes out of ~10,000; loose bounds.
    assert 200 < changes < 1_000


@pytest.mark.parametrize(
    "kwargs",
    [
        {"devices": 0, "rate": 1.0},
        {"devices": 1, "rate": 0.0},
        {"devices": 1, "rate": float("inf")},
        {"devices": 1, "rate": 1.0, "noisy": 1.5},
        {"devices": 1, "rate": 1.0, "fmt": "xml"},
        {"devices": 1, "rate": 1.0, "states": ()},
        {"devices": 1, "rate": 1.0, "state_change_probability": -0.1},
        {"devices": 1, "rate": 1.0, "topic_template": "tenants/{tenant}/events"},
        {"devices": 1, "rate": 1.0, "topic_template": "{tenant}/{device_id}/{oops}"},
    ],
)
def test_spec_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        FleetSpec(**kwargs)


def _broker() -> MqttConfig:
    """This xdist worker's own Mosquitto (the simulator defaults to port 1883)."""
    return MqttConfig(host=MQTT_HOST, port=MQTT_PORT)


async def _collect(
    spec: FleetSpec, count: int
) -> tuple[PublishStats, list[tuple[str, dict[str, Any]]], dict[tuple[str, int], Any]]:
    """Subscribe to the spec's tenant, publish ``count`` messages, gather what arrives."""
    sent: list[tuple[str, dict[str, Any]]] = []
    received: dict[tuple[str, int], Any] = {}
    content_types: set[str | None] = set()
    decode = orjson.loads if spec.fmt == "json" else lambda b: msgpack.unpackb(b, raw=False)
    async with aiomqtt.Client(
        MQTT_HOST,
        MQTT_PORT,
        identifier=f"test-sim-sub-{uuid.uuid4().hex}",
        protocol=aiomqtt.ProtocolVersion.V5,
    ) as sub:
        async with asyncio.timeout(10):
            await sub.subscribe(f"tenants/{spec.tenant}/devices/+/events", qos=1)
        pub = asyncio.create_task(
            publish(
                spec,
                _broker(),
                count=count,
                on_sent=lambda topic, event: sent.append((topic, event)),
            )
        )
        try:
            async with asyncio.timeout(30):
                async for message in sub.messages:
                    assert isinstance(message.payload, bytes)
                    event = decode(message.payload)
                    dev = _device_of(str(message.topic))
                    received[(dev, event["ts"])] = (str(message.topic), event)
                    props = message.properties
                    content_types.add(getattr(props, "ContentType", None))
                    if len(received) >= count:
                        break
                stats = await pub
        finally:
            if not pub.done():
                pub.cancel()
                await asyncio.gather(pub, return_exceptions=True)
    assert content_types == {"application/json" if spec.fmt == "json" else "application/msgpack"}
    return stats, sent, received


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
async def test_publish_end_to_end(fmt: str) -> None:
    spec = FleetSpec(
        devices=30,
        rate=2000.0,
        fmt="json" if fmt == "json" else "msgpack",
        noisy=0.1,
        tenant=f"sim-{uuid.uuid4().hex}",
    )
    stats, sent, received = await _collect(spec, 500)
    assert stats.sent == 500
    assert len(sent) == 500
    sent_by_key = {(_device_of(topic), event["ts"]): (topic, event) for topic, event in sent}
    assert len(sent_by_key) == 500, "(device_id, ts) must be unique"
    assert received == sent_by_key
    # sent_at is the real publish time, not the deterministic default.
    assert all(isinstance(event["sent_at"], float) for _, event in sent)


async def test_publish_duration_stops() -> None:
    spec = FleetSpec(devices=5, rate=200.0, tenant=f"sim-{uuid.uuid4().hex}")
    async with asyncio.timeout(30):
        stats = await publish(spec, _broker(), duration=0.3)
    # The schedule never goes past rate * duration messages.
    assert 0 < stats.sent <= 60


async def test_publish_duration_sends_every_message_due_before_the_end() -> None:
    """The last message falls due a fraction of a millisecond before the end:
    `simulate --rate 1500 --duration 40` sent 59,999 of 60,000 (probe),
    when the loop woke for it just after the end."""
    for rate, duration in ((1000.0, 0.2995), (3000.0, 0.2999), (1500.0, 0.4)):
        spec = FleetSpec(devices=5, rate=rate, tenant=f"sim-{uuid.uuid4().hex}")
        async with asyncio.timeout(30):
            stats = await publish(spec, _broker(), duration=duration)
        assert stats.sent == math.ceil(rate * duration), (rate, duration, stats.sent)


async def test_publish_duration_stops_a_sender_the_broker_cannot_keep_up_with(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One publish in flight at 1,000,000 msg/s: far behind at the end, it
    stops LATE_S after it, and says so, instead of running on."""
    monkeypatch.setattr(simulate, "LATE_S", 0.2)
    spec = FleetSpec(devices=5, rate=1_000_000.0, tenant=f"sim-{uuid.uuid4().hex}")
    async with asyncio.timeout(30):
        stats = await publish(spec, _broker(), duration=0.1, concurrency=1)
    assert 0 < stats.sent < 100_000
    assert stats.elapsed_s < 1.0
    assert "stopped 0.2 s after the end, with" in caplog.text
    assert "the broker did not keep up with --rate 1e+06" in caplog.text


def test_the_cli_says_in_one_line_when_the_broker_is_missing_or_goes_away(
    tmp_path: Path,
) -> None:
    """Refused at start, and lost mid-run (a real Mosquitto of the test's own,
    stopped under the simulator): exit 1 with one line, never a traceback."""
    port = free_port()
    env = base_env(GATEWAY_MQTT__PORT=str(port))
    args = ("simulate", "--devices", "5", "--rate", "50", "--tenant", f"sim-{uuid.uuid4().hex}")
    refused = run_cli(*args, "--count", "3", env=env, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert f"gateway: simulate: lost or no broker at 127.0.0.1:{port}" in refused.stderr
    assert "Traceback" not in refused.stderr

    with mosquitto_on(port, tmp_path):
        sim = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args, "--duration", "60"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(2)  # publishing by now
        assert sim.poll() is None, sim.communicate()
    _, err = sim.communicate(timeout=60)
    assert sim.returncode == 1, err
    assert f"gateway: simulate: lost or no broker at 127.0.0.1:{port}" in err
    assert "Traceback" not in err


def _no_script(_writer: asyncio.StreamWriter, _session: object, _n: int) -> None:
    pass


async def test_at_most_concurrency_publishes_await_their_puback() -> None:
    """The scripted broker holds every PUBACK until the publisher has had time to
    overrun its window; then answers all, and the rest go out."""
    held: list[int] = []
    release = asyncio.Event()

    def on_publish(writer: asyncio.StreamWriter, packet: Any) -> None:
        held.append(packet.packet_id)
        if release.is_set():
            writer.write(mqtt5.PubAckPacket(packet.packet_id).write())

    broker = ScriptedBroker(_no_script, on_publish=on_publish)
    spec = FleetSpec(devices=5, rate=5000.0, tenant="window")
    async with broker.running():
        task = asyncio.create_task(
            publish(spec, MqttConfig(host="127.0.0.1", port=broker.port), count=20, concurrency=4)
        )
        await asyncio.sleep(0.5)  # 2,500 messages would be due by now
        assert len(held) == 4, held
        release.set()
        broker.writers[0].write(b"".join(mqtt5.PubAckPacket(pid).write() for pid in held))
        async with asyncio.timeout(10):
            stats = await task
    assert stats.sent == 20
    assert len(held) == 20
    assert len(set(held[:4])) == 4


async def test_a_puback_for_no_publish_of_ours_is_a_broker_error() -> None:
    def on_publish(writer: asyncio.StreamWriter, packet: Any) -> None:
        writer.write(mqtt5.PubAckPacket(packet.packet_id + 1000).write())

    broker = ScriptedBroker(_no_script, on_publish=on_publish)
    spec = FleetSpec(devices=5, rate=100.0, tenant="stray")
    async with broker.running():
        with pytest.raises(BrokerError, match="PUBACK for no publish of ours"):
            async with asyncio.timeout(10):
                await publish(spec, MqttConfig(host="127.0.0.1", port=broker.port), count=3)


async def test_publishes_never_acknowledged_end_the_run_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the last message is sent, its PUBACK is awaited ACK_WAIT_S, not forever."""
    monkeypatch.setattr(simulate, "ACK_WAIT_S", 0.5)
    broker = ScriptedBroker(_no_script)  # swallows every PUBLISH
    spec = FleetSpec(devices=5, rate=1000.0, tenant="silent")
    started = time.monotonic()
    async with broker.running():
        with pytest.raises(BrokerError, match=r"3 publishes got no PUBACK within 0\.5 s"):
            async with asyncio.timeout(10):
                await publish(spec, MqttConfig(host="127.0.0.1", port=broker.port), count=3)
    assert time.monotonic() - started < 5


async def test_publishes_the_broker_refuses_are_counted_not_sent(tmp_path: Path) -> None:
    """A real Mosquitto whose ACL lets clients write only under allowed/: each
    refused publish gets a PUBACK of NOT_AUTHORIZED, is counted as refused and
    is not handed to on_sent."""
    port = free_port()
    acl = tmp_path / "acl"
    acl.write_text("topic write allowed/#\n")
    sent: list[str] = []
    with mosquitto_on(port, tmp_path, f"acl_file {acl}\n"):
        cfg = MqttConfig(host="127.0.0.1", port=port)
        denied = FleetSpec(devices=3, rate=500.0, tenant="denied")
        async with asyncio.timeout(30):
            stats = await publish(denied, cfg, count=10, on_sent=lambda t, _e: sent.append(t))
        assert (stats.sent, stats.refused, sent) == (0, 10, [])
        allowed = FleetSpec(
            devices=3, rate=500.0, tenant="t", topic_template="allowed/{tenant}/{device_id}"
        )
        async with asyncio.timeout(30):
            stats = await publish(allowed, cfg, count=10, on_sent=lambda t, _e: sent.append(t))
        assert (stats.sent, stats.refused, len(sent)) == (10, 0, 10)


def test_an_interrupted_simulate_says_how_much_it_sent() -> None:
    """Ctrl-C ended `gateway simulate` with exit 0 and not a word: how many
    messages went out was lost. It says so now, and exits 130, as an
    interrupted command does (it was 0: `simulate ... && next` went on)."""
    tenant = f"simint{uuid.uuid4().hex[:8]}"
    # Interrupted once it has sent (a fixed 3 s sent SIGINT during its
    # imports once, on a loaded box, and it died of KeyboardInterrupt).
    sub = ["mosquitto_sub", "-h", MQTT_HOST, "-p", str(MQTT_PORT), "-t", f"tenants/{tenant}/#"]
    first = subprocess.Popen([*sub, "-C", "1", "-W", "60"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # subscribed
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "simulate", "--rate", "50", "--tenant", tenant],
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.wait(timeout=70) == 0, "no message from simulate within 60 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        for started in (proc, first):
            if started.poll() is None:
                started.kill()
                started.wait()
    assert proc.returncode == 130, err
    line = out.strip().splitlines()[-1]
    assert line.startswith("simulate: interrupted; sent "), out
    assert int(line.split("sent ")[1].split()[0]) > 0, line
