"""The receive path (gateway/ingest/receive.py on connection.py).

Two kinds of test:

* Against a scripted broker on 127.0.0.1: faults the real Mosquitto never
  produces (a malformed packet, a topic alias we did not allow, a broker that
  stops answering pings, a forgotten session, packets cut at every byte).
  This is the "inject a fault that can't be produced for real" exception.
* Against the real Mosquitto, with publishers nobody here wrote
  (``mosquitto_pub``, MQTT 3.1.1 and 5, with and without a content type), and
  with a packet over the Maximum Packet Size we advertise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import mqtt5
import orjson
import pytest

from gateway.config import MqttConfig
from gateway.ingest.connection import Connection, ConnectOptions, connect
from gateway.ingest.receive import Delivery, Receiver, max_packet_size
from gateway.stats import Stats
from gateway.store.database import Database

from .helpers import (
    MQTT_HOST,
    MQTT_PORT,
    device_row,
    free_port,
    http_get,
    make_config,
    mosquitto_on,
    running_gateway,
    self_signed,
    wait_until,
)
from .scripted_broker import ScriptedBroker, Session


def publish_packet(pid: int, payload: bytes = b"{}", **kw: object) -> bytes:
    return mqtt5.PublishPacket(
        f"tenants/t/devices/d{pid}/events",
        payload,
        qos=mqtt5.QoS.AT_LEAST_ONCE,
        packet_id=pid,
        **kw,  # type: ignore[arg-type]
    ).write()


def scripted_config(broker: ScriptedBroker, reconnect_max: float = 0.1) -> MqttConfig:
    """A receiver's config for the scripted broker, reconnecting fast."""
    return MqttConfig(
        host="127.0.0.1",
        port=broker.port,
        client_id=f"rx-{uuid.uuid4().hex[:8]}",
        reconnect_min=0.05,
        reconnect_max=reconnect_max,
    )


@asynccontextmanager
async def receiving(
    broker: ScriptedBroker, *, filters: list[str] | None = None
) -> AsyncIterator[tuple[list[Delivery], Stats, Receiver]]:
    """A Receiver on the scripted broker that acknowledges every message at once."""
    config = scripted_config(broker)
    stats = Stats()
    got: list[Delivery] = []

    def handler(delivery: Delivery) -> None:
        got.append(delivery)
        delivery.ack.done()

    receiver = Receiver(config, filters or ["tenants/+/devices/+/events"], stats)
    stop = asyncio.Event()
    task = asyncio.create_task(receiver.run(handler, stop))
    try:
        yield got, stats, receiver
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task


# ------------------------------------------------------------ codec-level faults


async def test_packets_cut_at_every_byte_and_coalesced_arrive_whole_and_in_order() -> None:
    packets = [publish_packet(pid, orjson.dumps({"n": pid})) for pid in range(1, 41)]
    stream = b"".join(packets)

    def script(writer: asyncio.StreamWriter, _s: Session, _n: int) -> None:
        # Chunks of 1, 2, 3, ... bytes: every split point inside a header,
        # a topic and a payload; the later chunks hold several packets each.
        pos, size = 0, 1
        while pos < len(stream):
            writer.write(stream[pos : pos + size])
            pos += size
            size += 1

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(
            lambda: bool(broker.sessions) and len(broker.sessions[0].pubacks) == 40,
            10,
            "all PUBACKs",
        )
    assert [orjson.loads(d.payload)["n"] for d in got] == list(range(1, 41))
    # PUBACKs in receive order (MQTT 5 section 4.6).
    assert broker.sessions[0].pubacks == list(range(1, 41))
    assert stats.received == stats.acked == 40
    assert stats.connects == 1


async def test_receive_times_increase_in_order_but_follow_a_step_back_of_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delivery.received_us orders a device's untimed events: messages read
    in the same µs are a µs apart, in order. A clock stepped back by more
    than a millisecond is followed: pinned to the old time instead, every
    message a µs apart looked a flood to the sampler and to max_rate for as
    long as the step (review)."""
    base = time.time_ns() // 1000 * 1000
    calls = 0

    def clock() -> int:  # the same µs for the first 20 reads, then 5 s back
        nonlocal calls
        calls += 1
        return base if calls <= 20 else base - 5_000_000_000

    packets = b"".join(publish_packet(pid) for pid in range(1, 41))

    def script(writer: asyncio.StreamWriter, _s: Session, _n: int) -> None:
        monkeypatch.setattr(time, "time_ns", clock)
        writer.write(packets)

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, _, _):
        await wait_until(lambda: len(got) == 40, 10, "40 messages")
    monkeypatch.undo()
    stamps = [d.received_us for d in got]
    base_us = base // 1000
    assert stamps[:20] == [base_us + i for i in range(20)]
    assert all(d.received_ms == d.received_us // 1000 for d in got)
    assert stamps[-1] < base_us - 4_000_000, stamps  # the step back, taken
    assert stamps[20:] == sorted(stamps[20:])


async def test_the_connect_packet_says_what_we_promise() -> None:
    broker = ScriptedBroker(lambda w, s, n: None)
    async with broker.running(), receiving(broker) as (_, _stats, receiver):
        await wait_until(receiver.connected.is_set, 10, "connected")
    connect = broker.sessions[0].connect
    assert connect.clean_start is False
    assert connect.session_expiry_interval == 7 * 86400
    assert connect.receive_max == 1000
    assert connect.topic_alias_max == 0
    assert connect.max_packet_size == max_packet_size(64 * 1024)
    assert broker.sessions[0].subscribed == ["tenants/+/devices/+/events"]


async def test_a_malformed_packet_closes_the_connection_is_counted_and_we_reconnect() -> None:
    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.write(publish_packet(1))
            # A PUBLISH whose remaining length field never ends: malformed.
            writer.write(b"\x32\xff\xff\xff\xff\x01")
            writer.write(publish_packet(2))  # behind the bad bytes: never parsed
        else:
            writer.write(publish_packet(3))

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(lambda: len(got) == 2, 10, "the message after the reconnect")
    assert [d.topic.split("/")[3] for d in got] == ["d1", "d3"]
    assert stats.malformed_packets == 1
    assert stats.connects == 2
    assert stats.disconnects == 1


async def test_a_topic_alias_we_did_not_allow_is_a_protocol_error() -> None:
    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.write(publish_packet(1, topic_alias=1))
        else:
            writer.write(publish_packet(2))

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(lambda: len(got) == 1, 10, "the message after the reconnect")
    assert got[0].topic.endswith("d2/events")
    assert stats.connects == 2
    assert stats.malformed_packets == 1  # counted like a malformed packet (it was not)


async def test_a_puback_to_a_receiver_that_never_publishes_is_a_protocol_error() -> None:
    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        # In one write with the PUBACK, a PUBLISH behind it: on a connection
        # we are closing, so not ours to take (it was delivered, and counted
        # acknowledged, though its PUBACK could never go).
        stream = mqtt5.PubAckPacket(7).write() + publish_packet(3)
        writer.write(stream if n == 0 else publish_packet(2))

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(lambda: len(got) >= 1, 10, "the message after the reconnect")
    assert [d.topic.split("/")[3] for d in got] == ["d2"]
    assert stats.connects == 2
    assert stats.malformed_packets == 1


async def refused_then_reconnected(first: bytes) -> ScriptedBroker:
    """The first connection gets ``first``, which must close it, counted as
    malformed; the next one a message, which must arrive."""

    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        writer.write(first if n == 0 else publish_packet(2))

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(lambda: len(got) == 1, 10, "the message after the reconnect")
    assert got[0].topic.endswith("d2/events")
    assert (stats.malformed_packets, stats.connects) == (1, 2)
    return broker


# The codec panics in Rust on it, with a UnicodeDecodeError pending that
# Python reports as unraisable: the codec's noise, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_topic_that_is_not_utf8_is_a_malformed_packet() -> None:
    """The codec raises a Rust panic for it (pyo3's PanicException, a
    BaseException), which escaped data_received: no DISCONNECT, not counted,
    a traceback in the log."""
    topic = b"tenants/t/devices/\xff\xfe/events"
    body = len(topic).to_bytes(2, "big") + topic + (1).to_bytes(2, "big") + b"\x00{}"
    await refused_then_reconnected(b"\x32" + bytes([len(body)]) + body)


async def test_a_whole_packet_over_our_maximum_is_refused_and_counted() -> None:
    """Only a partial packet was checked against the Maximum Packet Size we
    advertise: a whole one in one read was taken and acknowledged."""
    broker = await refused_then_reconnected(
        publish_packet(1, b"x" * (max_packet_size(64 * 1024) + 100))
    )
    assert broker.sessions[0].pubacks == []


async def test_reads_paused_across_a_reconnect_keep_the_pings_going() -> None:
    """Paused (a full queue) when the connection dropped, the next one was
    paused at its CONNACK: the SUBACK stayed unread, and the keepalive, which
    started after it, never did; the broker drops a client silent that long."""

    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.close()  # the broker drops us; our next ping finds it out

    broker = ScriptedBroker(script, server_keep_alive=1)
    async with broker.running(), receiving(broker) as (_, _stats, receiver):
        receiver.pause_reading()
        await wait_until(lambda: len(broker.sessions) == 2, 10, "the reconnect")
        await asyncio.sleep(2.5)
        pings = broker.sessions[1].pings
        receiver.resume_reading()
    assert pings >= 3  # one every half keepalive: about 5 in 2.5 s


async def test_an_outage_of_a_thousand_attempts_does_not_stop_the_receiver() -> None:
    """The backoff's cap was reconnect_min * 2**attempt: a float overflow on
    the 1,024th failed attempt (about 4 hours with the defaults) stopped the
    receiver, and with it the gateway."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again: nothing listens there
    config = MqttConfig(
        host="127.0.0.1", port=port, client_id="rx-outage", reconnect_min=0.001, reconnect_max=0.002
    )
    stats = Stats()
    stop = asyncio.Event()
    task = asyncio.create_task(Receiver(config, ["a/#"], stats).run(lambda d: None, stop))
    logger = logging.getLogger("gateway.ingest.receive")
    level = logger.level
    logger.setLevel(logging.ERROR)  # 1,000 warnings otherwise
    try:
        await wait_until(lambda: stats.disconnects > 1030 or task.done(), 60, "1,030 attempts")
    finally:
        logger.setLevel(level)
        stop.set()
        async with asyncio.timeout(10):
            await task  # raised OverflowError before
    assert stats.disconnects > 1030


async def test_an_error_raised_while_the_receiver_waits_to_reconnect_is_not_chained_to_it() -> None:
    """Compiled code (mypyc) waiting inside an ``except`` clause left the
    broker's error as the thread's current exception: every exception raised
    meanwhile, in any task, was chained to it. The wait is outside now."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again: nothing listens there
    config = MqttConfig(host="127.0.0.1", port=port, client_id="rx-chain", reconnect_min=5)
    stats = Stats()
    stop = asyncio.Event()
    task = asyncio.create_task(Receiver(config, ["a/#"], stats).run(lambda d: None, stop))
    try:
        await wait_until(lambda: stats.disconnects >= 1, 10, "a refused connect")
        await asyncio.sleep(0.1)  # in its wait to reconnect
        try:
            raise ValueError("raised by the test, after nothing")
        except ValueError as exc:
            context = exc.__context__
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
    assert context is None, f"chained to {context!r}"


async def test_the_receiver_is_behind_while_half_its_window_waits_for_acknowledgement() -> None:
    """Receiver.behind: half of mqtt.receive_maximum messages or more not yet
    acknowledged (the roll-up worker spreads its minutes meanwhile: app.py).
    Acknowledging them in order ends it; a receiver with no connection is not
    behind."""
    held: list[Delivery] = []

    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.write(b"".join(publish_packet(pid) for pid in (1, 2, 3, 4)))

    broker = ScriptedBroker(script)
    stats = Stats()
    stop = asyncio.Event()
    async with broker.running():
        config = scripted_config(broker).model_copy(update={"receive_maximum": 4})
        receiver = Receiver(config, ["tenants/+/devices/+/events"], stats)
        assert not receiver.behind()
        task = asyncio.create_task(receiver.run(held.append, stop))
        try:
            await wait_until(lambda: len(held) == 4, 10, "four messages")
            assert receiver.behind()  # 4 of 4 wait
            for delivery in held[:2]:
                delivery.ack.done()
            await wait_until(lambda: stats.acked == 2, 5, "two PUBACKs")
            assert receiver.behind()  # 2 of 4: half
            held[2].ack.done()
            await wait_until(lambda: stats.acked == 3, 5, "the third PUBACK")
            assert not receiver.behind()  # 1 of 4
            held[3].ack.done()
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await task
    assert not receiver.behind()


async def test_acks_finished_during_the_reconnect_wait_are_dropped_not_counted() -> None:
    """The tracker was closed only after the wait: what finished meanwhile was
    counted acknowledged, though no connection could carry its PUBACK."""
    held: list[Delivery] = []

    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.write(b"".join(publish_packet(pid) for pid in (1, 2, 3)))
            writer.write(b"\x32\xff\xff\xff\xff\x01")  # then a reconnect

    broker = ScriptedBroker(script)
    config = MqttConfig(
        host="127.0.0.1", port=1, client_id="rx-wait", reconnect_min=2.0, reconnect_max=2.0
    )
    stats = Stats()
    stop = asyncio.Event()
    async with broker.running():
        config = config.model_copy(update={"port": broker.port})
        receiver = Receiver(config, ["tenants/+/devices/+/events"], stats)
        task = asyncio.create_task(receiver.run(held.append, stop))
        try:
            await wait_until(lambda: stats.disconnects == 1 and len(held) == 3, 10, "the drop")
            for delivery in held:  # durable now, during the 2 s wait
                delivery.ack.done()
            await wait_until(lambda: stats.acks_dropped + stats.acked == 3, 1, "the acks")
            assert (stats.acked, stats.acks_dropped) == (0, 3)
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await task


async def test_a_broker_that_stops_answering_pings_is_dropped() -> None:
    # The broker's Server Keep Alive (1 s) overrides ours (MQTT 5 section 3.2.2.3.14).
    broker = ScriptedBroker(lambda w, s, n: None, server_keep_alive=1)
    broker.answer_pings = False
    async with broker.running(), receiving(broker) as (_, stats, _r):
        await wait_until(lambda: stats.connects >= 2, 15, "a reconnect after the keepalive")
    assert broker.sessions[0].pings >= 1
    assert stats.disconnects >= 1


async def test_a_lost_session_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        if n == 0:
            writer.write(b"\x32\xff\xff\xff\xff\x01")  # force a reconnect

    # First connection: a session existed; second: the broker forgot it.
    broker = ScriptedBroker(script, session_present=lambda n: n == 0)
    async with broker.running(), receiving(broker) as (_, stats, _r):
        await wait_until(lambda: stats.connects == 2, 10, "the reconnect")
    assert stats.sessions_lost == 1
    assert "no longer had our session" in caplog.text


async def test_a_session_the_real_broker_dropped_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same, from the real Mosquitto: a client that takes our id over
    with clean_start (and no expiry) ends our connection and our session, so
    the reconnect finds none: what was queued for us meanwhile is gone."""
    config = mosquitto_config("lost").model_copy(update={"reconnect_min": 0.5})
    stats = Stats()
    stop = asyncio.Event()
    receiver = Receiver(config, ["tenants/+/devices/+/events"], stats)
    task = asyncio.create_task(receiver.run(lambda d: d.ack.done(), stop))
    try:
        await wait_until(lambda: stats.connects == 1, 10, "connected")
        other = Connection(lambda p: None, None)
        options = ConnectOptions(
            client_id=config.client_id, clean_start=True, session_expiry=0, keepalive=30
        )
        await connect(other, MQTT_HOST, MQTT_PORT, options)
        other.close()  # before our reconnect (0.5 s on): the session ends with it
        await wait_until(lambda: stats.connects == 2, 10, "the reconnect")
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
    assert stats.sessions_lost == 1
    assert "no longer had our session" in caplog.text


async def test_a_refused_subscription_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = ScriptedBroker(lambda w, s, n: None)
    filters = ["tenants/+/devices/+/events", "denied/#"]
    async with broker.running(), receiving(broker, filters=filters) as (_, stats, receiver):
        await wait_until(receiver.connected.is_set, 10, "connected")
    assert stats.subscriptions_refused == 1
    assert "denied/#: NOT_AUTHORIZED" in caplog.text
    assert receiver.refused == ["denied/#: NOT_AUTHORIZED"]


async def test_a_refused_subscription_makes_the_gateway_unhealthy() -> None:
    """Connected but deaf to a filter's messages (an ACL, a broker without
    shared subscriptions), the gateway answered /healthz 200 "ok". (A real
    Mosquitto grants a subscription its ACL denies and drops the messages,
    so the scripted broker refuses it.)"""
    broker = ScriptedBroker(lambda w, s, n: None)
    api_port = free_port()
    async with broker.running():
        config = make_config(
            GATEWAY_MQTT__PORT=str(broker.port),
            GATEWAY_API__PORT=str(api_port),
            GATEWAY_TOPICS='[{template = "tenants/{tenant}/devices/{device_id}/events"}, '
            '{template = "denied/{tenant}/{device_id}"}]',
        )
        async with running_gateway(config):
            code, body = await asyncio.to_thread(http_get, api_port, "/healthz")
    assert code == 503, body
    assert orjson.loads(body)["checks"]["mqtt_refused"] == ["denied/+/+: NOT_AUTHORIZED"]


async def test_a_subscription_granted_only_qos_0_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker that grants QoS 0 (Mosquitto's max_qos 0, an ACL, a proxy)
    turns at-least-once off for that filter: no PUBACK, so a message in
    flight when the gateway stops is lost. It said "subscribed to" only."""
    broker = ScriptedBroker(lambda w, s, n: None)
    filters = ["tenants/+/devices/+/events", "qos0/#"]
    async with broker.running(), receiving(broker, filters=filters) as (_, stats, receiver):
        await wait_until(receiver.connected.is_set, 10, "connected")
    assert (stats.subscriptions_qos0, stats.subscriptions_refused) == (1, 0)
    assert "granted qos0/# at QoS 0 only" in caplog.text


async def test_a_real_broker_granting_qos_0_only_is_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same, from a real Mosquitto with ``max_qos 0``."""
    port = free_port()
    with mosquitto_on(port, tmp_path, "max_qos 0\n"):
        config = make_config(GATEWAY_MQTT__PORT=str(port))
        async with running_gateway(config) as gw:
            assert (gw.stats.subscriptions_qos0, gw.stats.subscriptions_refused) == (1, 0)
    assert "at QoS 0 only" in caplog.text, caplog.text


async def test_a_qos_2_publish_is_a_protocol_error_not_a_puback() -> None:
    """We subscribe at QoS 1 at most: a QoS 2 PUBLISH breaks the protocol, and
    a PUBACK is no answer to it (QoS 2 needs PUBREC). It was taken as QoS 1."""

    def script(writer: asyncio.StreamWriter, _s: Session, n: int) -> None:
        qos = mqtt5.QoS.EXACTLY_ONCE if n == 0 else mqtt5.QoS.AT_LEAST_ONCE
        writer.write(
            mqtt5.PublishPacket("tenants/t/devices/d/events", b"{}", qos=qos, packet_id=1).write()
        )

    broker = ScriptedBroker(script)
    async with broker.running(), receiving(broker) as (got, stats, _):
        await wait_until(lambda: len(got) == 1, 10, "the QoS 1 message after the reconnect")
    assert broker.sessions[0].pubacks == []
    assert (stats.malformed_packets, stats.connects) == (1, 2)


async def _reconnecting_for(broker: ScriptedBroker, seconds: float) -> None:
    """A receiver against ``broker`` for ``seconds``, backing off up to 5 s."""
    async with broker.running():
        config = scripted_config(broker, reconnect_max=5.0)
        stop = asyncio.Event()
        task = asyncio.create_task(
            Receiver(config, ["tenants/+/devices/+/events"], Stats()).run(lambda d: None, stop)
        )
        await asyncio.sleep(seconds)
        stop.set()
        async with asyncio.timeout(10):
            await task


async def test_a_broker_that_drops_us_at_once_is_retried_ever_more_slowly() -> None:
    """Each CONNACK used to reset the backoff, so a broker that accepts and
    closes at once (a twin with our client id, a proxy) was reconnected to at
    reconnect_min to 2 x reconnect_min for ever: 51 connections in 4 s here.
    Only a connection that lasted SHORT_LIVED resets it now."""
    broker = ScriptedBroker(lambda writer, _s, _n: writer.close())
    await _reconnecting_for(broker, 4)
    # Caps doubling from 0.1 s towards 5 s: 4 s hold about 8 attempts.
    assert 3 <= len(broker.sessions) <= 12, f"{len(broker.sessions)} connections in 4 s"


async def test_a_flapping_link_is_retried_soon_after_each_connection_that_held() -> None:
    """A link to the broker up 3 s, down 2 s (field probe): each connection
    was subscribed and lasted seconds, but under SHORT_LIVED, so the backoff
    never reset and grew to its cap: 16 s, then 21.6 s without a connection
    while the link was up 60% of the time (Mosquitto's queue for us may
    overflow meanwhile). A connection that was subscribed and lasted
    UP_A_WHILE keeps the next wait short; one dropped at once still backs
    off (the test above)."""
    starts: list[float] = []

    def script(writer: asyncio.StreamWriter, _session: object, _n: int) -> None:
        starts.append(time.monotonic())  # subscribed: the link holds 1.2 s
        asyncio.get_running_loop().call_later(1.2, writer.close)

    await _reconnecting_for(ScriptedBroker(script), 15)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 1.2 s up, then at most 8 x reconnect_min (0.4 s) down; it grew to 5 s.
    assert max(gaps) < 2.2, [round(g, 2) for g in gaps]


async def test_stop_is_heard_while_the_suback_is_awaited() -> None:
    """A broker that answers the CONNECT and pings but never the SUBSCRIBE
    kept Receiver.run waiting for ever, and `gateway run` with it: SIGTERM
    never completed."""
    broker = ScriptedBroker(lambda w, s, n: None)
    broker.answer_subscribe = False
    async with broker.running():
        config = scripted_config(broker)
        stats = Stats()
        stop = asyncio.Event()
        receiver = Receiver(config, ["tenants/+/devices/+/events"], stats)
        task = asyncio.create_task(receiver.run(lambda d: None, stop))
        await wait_until(lambda: len(broker.sessions) == 1 and stats.connects == 1, 10, "CONNACK")
        await asyncio.sleep(0.5)
        assert not receiver.connected.is_set()  # waiting for the SUBACK
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:
            task.cancel()
    assert done, "Receiver.run still running 5 s after stop"


async def test_stop_is_heard_when_reads_were_paused_across_a_reconnect() -> None:
    """The usual way to that wait: the pipeline queue is full (Cassandra slow),
    reads are paused, the broker drops us, and the receiver reconnects paused,
    so the SUBACK stays unread. SIGTERM then waited until the queue drained."""
    broker = ScriptedBroker(lambda w, s, n: None, server_keep_alive=1)
    async with broker.running():
        config = scripted_config(broker)
        stop = asyncio.Event()
        receiver = Receiver(config, ["tenants/+/devices/+/events"], Stats())
        task = asyncio.create_task(receiver.run(lambda d: d.ack.done(), stop))
        await wait_until(receiver.connected.is_set, 10, "connected")
        receiver.pause_reading()  # the pipeline's queue is full
        broker.writers[0].close()  # the broker drops us; a failed ping write tells
        await wait_until(lambda: len(broker.sessions) == 2, 10, "the reconnect")
        await asyncio.sleep(0.5)
        assert not receiver.connected.is_set()  # its SUBACK is unread
        stop.set()  # SIGTERM
        done, _ = await asyncio.wait({task}, timeout=5)
        receiver.resume_reading()
        async with asyncio.timeout(10):
            await task
    assert done, "Receiver.run still running 5 s after stop"


async def test_a_tls_file_unreadable_at_a_reconnect_is_retried_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The TLS files are read at each connect (renewed ones are used). One
    missing mid-rotation raised FileNotFoundError out of Receiver.run, and
    `gateway run` exited with a traceback. Now that connect fails and is
    retried like any other; a file that is not PEM is a config error at load."""
    ca, _ = self_signed(tmp_path)
    config = MqttConfig(
        host="127.0.0.1",
        port=free_port(),  # nothing listens: each attempt fails and is retried
        client_id=f"rx-{uuid.uuid4().hex[:8]}",
        reconnect_min=0.05,
        reconnect_max=0.1,
        tls={"enabled": True, "ca_file": ca},  # type: ignore[arg-type]
    )
    ca.unlink()  # mid-rotation
    stats = Stats()
    stop = asyncio.Event()
    task = asyncio.create_task(
        Receiver(config, ["tenants/+/devices/+/events"], stats).run(lambda d: None, stop)
    )
    await wait_until(lambda: stats.disconnects >= 3 or task.done(), 10, "retries")
    stop.set()
    async with asyncio.timeout(10):
        await task  # raises what Receiver.run raised
    assert "mqtt.tls.ca_file: cannot load" in caplog.text
    (tmp_path / "not.pem").write_text("a CA bundle, half written\n")
    with pytest.raises(ValueError, match=r"ca_file: cannot load .*not\.pem"):
        MqttConfig(tls={"enabled": True, "ca_file": tmp_path / "not.pem"})  # type: ignore[arg-type]


# ------------------------------------------------------------ the real Mosquitto


def mosquitto_config(prefix: str, reconnect_max: float = 0.1) -> MqttConfig:
    """A receiver's config for the real Mosquitto: a session of 5 s, fast reconnects."""
    return MqttConfig(
        host=MQTT_HOST,
        port=MQTT_PORT,
        client_id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        session_expiry=5,
        reconnect_min=0.05,
        reconnect_max=reconnect_max,
    )


def mosquitto_pub(topic: str, payload: bytes, *args: str) -> None:
    subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            MQTT_HOST,
            "-p",
            str(MQTT_PORT),
            "-q",
            "1",
            "-t",
            topic,
            "-s",
            *args,
        ],
        input=payload,
        check=True,
        timeout=10,
    )


async def test_mosquitto_pub_in_every_protocol_version_and_content_type_is_stored(
    db: Database, tenant: str
) -> None:
    def topic(device: str) -> str:
        return f"tenants/{tenant}/devices/{device}/events"

    async with running_gateway(make_config()) as gw:
        cases = {
            "v311-json": ("-V", "mqttv311"),
            "v5-json": ("-V", "mqttv5"),
            "v5-json-ct": ("-V", "mqttv5", "-D", "publish", "content-type", "application/json"),
        }
        for device, args in cases.items():
            payload = orjson.dumps({"ts": 1_700_000_000_000, "state": "on", "value": 1})
            await asyncio.to_thread(mosquitto_pub, topic(device), payload, *args)
        # MessagePack only reaches us tagged: MQTT 3.1.1 has no content type.
        packed = bytes.fromhex("82a27473cf0000018bcfe56800a57374617465a26f6e")
        await asyncio.to_thread(
            mosquitto_pub,
            topic("v5-msgpack-ct"),
            packed,
            "-V",
            "mqttv5",
            "-D",
            "publish",
            "content-type",
            "application/msgpack",
        )
        await gw.wait_handled(4)
        assert gw.stats.rejected == 0
    for device in [*cases, "v5-msgpack-ct"]:
        row = await device_row(db, tenant, device)
        assert row.state == "on", device


async def test_a_packet_over_our_maximum_is_dropped_by_the_broker_not_buffered(
    db: Database, tenant: str
) -> None:
    config = make_config(GATEWAY_LIMITS__MAX_PAYLOAD_BYTES="1024")
    limit = max_packet_size(1024)
    topic = f"tenants/{tenant}/devices/big/events"
    async with running_gateway(config) as gw:
        # Over the payload limit, under the packet limit: reaches us, rejected with a reason.
        over = orjson.dumps({"ts": 1_700_000_000_000, "state": "on", "pad": "x" * 2000})
        await asyncio.to_thread(mosquitto_pub, topic, over, "-V", "mqttv5")
        await gw.wait_handled(1)
        assert gw.stats.rejected_by_reason["too_large"] == 1
        # Over the packet limit: the broker drops it (MQTT 5 section 3.1.2.11.4).
        huge = orjson.dumps({"ts": 1_700_000_000_001, "state": "on", "pad": "x" * limit})
        await asyncio.to_thread(mosquitto_pub, topic, huge, "-V", "mqttv5")
        fine = orjson.dumps({"ts": 1_700_000_000_002, "state": "off"})
        await asyncio.to_thread(mosquitto_pub, topic, fine, "-V", "mqttv5")
        await gw.wait_handled(2)
        assert gw.stats.received == 2
        assert gw.stats.connects == 1
    assert (await device_row(db, tenant, "big")).state == "off"


async def test_two_receivers_with_one_client_id_are_told_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two gateways given the same mqtt.client_id (a copied config) take the
    session from each other, each reconnect closing the other's connection,
    for ever; the log said only "connection closed by the broker"."""
    caplog.set_level(logging.WARNING, logger="gateway.ingest.receive")
    config = mosquitto_config("twin", reconnect_max=0.2)
    stop = asyncio.Event()
    twins = [Receiver(config, ["twins/never/#"], Stats()) for _ in range(2)]
    tasks = [asyncio.create_task(r.run(lambda d: d.ack.done(), stop)) for r in twins]
    try:
        await wait_until(
            lambda: "another client uses mqtt.client_id" in caplog.text,
            20,
            "the hint that two clients share the client id",
        )
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await asyncio.gather(*tasks)
    assert f"mqtt.client_id {config.client_id!r}" in caplog.text


def clear_retained(topic: str) -> None:
    subprocess.run(
        ["mosquitto_pub", "-h", MQTT_HOST, "-p", str(MQTT_PORT), "-t", topic, "-r", "-n"],
        check=True,
        timeout=10,
    )


async def test_a_retained_message_never_beats_a_newer_event(db: Database, tenant: str) -> None:
    """The broker sends a retained message to each new subscription. Without
    a ``ts`` it used to be stamped with its receive time, so at every restart
    (and every reconnect: it subscribed with Retain Handling 0) an old
    retained "alarm" became the device's newest event again, over the "ok"
    it sent since. A retained copy is now taken as a redelivery: behind
    every timed write of the device."""
    topic = f"tenants/{tenant}/devices/d1/events"
    await asyncio.to_thread(mosquitto_pub, topic, b'{"state": "alarm"}', "-r")
    try:
        async with running_gateway() as gw:  # a new session: the retained copy comes
            await gw.wait_handled(1)
            await asyncio.to_thread(mosquitto_pub, topic, b'{"state": "ok"}')
            await gw.wait_handled(2)
        assert (await device_row(db, tenant, "d1")).state == "ok"
        async with running_gateway() as gw:  # a new session again: the copy again
            await gw.wait_handled(1)
            assert gw.stats.no_ts == 1
        assert (await device_row(db, tenant, "d1")).state == "ok"
    finally:
        await asyncio.to_thread(clear_retained, topic)


async def test_a_retained_message_is_not_sent_again_to_our_session(tenant: str) -> None:
    """Reconnecting to our session (a blip; here another connection with our
    client id takes it over for a moment) subscribes again; with Retain
    Handling 0 the broker sent the retained message again each time."""
    topic = f"tenants/{tenant}/devices/d/events"
    await asyncio.to_thread(mosquitto_pub, topic, b'{"state": "alarm"}', "-r")
    config = mosquitto_config("rx")
    stats = Stats()
    got: list[Delivery] = []
    stop = asyncio.Event()
    receiver = Receiver(config, [f"tenants/{tenant}/devices/+/events"], stats)

    def take(delivery: Delivery) -> None:
        got.append(delivery)
        delivery.ack.done()

    task = asyncio.create_task(receiver.run(take, stop))
    try:
        for connects in (1, 2, 3):

            def up(c: int = connects) -> bool:
                return stats.connects == c and len(got) >= 1

            await wait_until(up, 10, "up")
            await asyncio.sleep(0.3)
            # The takeover ends our connection; the session stays.
            other = Connection(lambda p: None, None)
            options = ConnectOptions(
                client_id=config.client_id, clean_start=False, session_expiry=5, keepalive=30
            )
            await connect(other, MQTT_HOST, MQTT_PORT, options)
            other.close()
        await wait_until(lambda: stats.connects == 4, 10, "the last reconnect")
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        async with asyncio.timeout(10):
            await task
        await asyncio.to_thread(clear_retained, topic)
    assert [(d.payload, d.retained) for d in got] == [(b'{"state": "alarm"}', True)]


async def test_templates_one_covering_the_other_take_a_message_once(tenant: str) -> None:
    """A shard's template beside a wider one (README, "Scaling out") was two
    subscriptions matching the same topics, and Mosquitto delivers a message
    once per matching subscription: each was taken and written twice."""
    shard = (
        f'{{template = "tenants/{{tenant}}/devices/{{device_id}}/events", tenants = ["{tenant}"]}}'
    )
    wider = '{template = "tenants/{tenant}/{_}/{device_id}/events"}'
    config = make_config(GATEWAY_TOPICS=f"[{shard}, {wider}]")
    async with running_gateway(config) as gw:
        payload = orjson.dumps({"ts": 1_700_000_000_000, "state": "on"})
        await asyncio.to_thread(mosquitto_pub, f"tenants/{tenant}/devices/d1/events", payload)
        await gw.wait_handled(1)
        await asyncio.sleep(1)
        assert (gw.stats.received, gw.stats.written) == (1, 1)
