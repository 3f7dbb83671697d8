"""Receive from Mosquitto: QoS 1, persistent session, acks only once durable.

Why aiomqtt with paho's manual acks: aiomqtt 2.x acknowledges a QoS 1 message
as soon as it arrives, so a crash would lose what was acked but not yet
written. paho 2.x, which aiomqtt wraps, can leave acknowledgements to the
application (``manual_ack_set(True)`` then ``ack(mid, qos)``). We keep
aiomqtt's asyncio integration (socket callbacks, connect in an executor) and
switch its paho client to manual acks. This touches aiomqtt's private
``_client`` attribute, so the dependency is pinned to aiomqtt 2.x and the tests
exercise it against a real broker; aiomqtt 3 has a public ``puback()`` to move
to when it is released.

Promises:

* MQTT v5, fixed client id, ``clean_start`` false with a session expiry: the
  broker keeps our subscriptions and backlog while we are away.
* Flow control, in two layers. The v5 Receive Maximum
  (``mqtt.receive_maximum``) caps the messages the broker sends before we
  acknowledge, so a slow Cassandra throttles the broker instead of filling
  RAM. Brokers don't always honour it (Mosquitto 2.0.11 over-sends when it
  resumes a session with a backlog: 2,422 unacknowledged with a limit of
  1,000, measured here), so the pipeline can also pause reading the socket
  (``pause_reading``/``resume_reading``): TCP then holds the broker back.
* Messages are taken straight from paho's ``on_message`` callback; aiomqtt's
  own queue, which discards messages when full, is bypassed, and so is its
  socket reader, replaced by one that can be paused.
* Each delivery carries an :class:`Ack`; PUBACKs go out in receive order
  (MQTT requires it), each once the message and all messages before it are done.
* Connection lost: reconnect with exponential backoff and full jitter, and
  subscribe again. Acks of the old connection are dropped (counted): the
  broker redelivers those messages, and the writes are idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiomqtt
from paho.mqtt.client import MQTTMessage
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..config import MqttConfig
from ..stats import Stats

log = logging.getLogger(__name__)


class Ack:
    """Marks one received message done; the tracker sends PUBACKs in order."""

    __slots__ = ("_done", "_tracker", "mid", "qos")

    def __init__(self, tracker: AckTracker, mid: int, qos: int) -> None:
        self._tracker = tracker
        self.mid = mid
        self.qos = qos
        self._done = False

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._tracker.flush()


class AckTracker:
    """Receive-ordered acknowledgements for one connection.

    Also measures backpressure: while ``limit`` (the receive maximum) messages
    are unacknowledged the broker should send nothing more, and that time is
    added to ``Stats.throttled_s``.
    """

    def __init__(self, paho: object, stats: Stats, limit: int) -> None:
        self._paho = paho
        self._stats = stats
        self._limit = limit
        self._queue: deque[Ack] = deque()
        self._open = True
        self.taking = True
        self._throttled_since: float | None = None
        self._empty = asyncio.Event()
        self._empty.set()

    def track(self, mid: int, qos: int) -> Ack:
        ack = Ack(self, mid, qos)
        self._queue.append(ack)
        self._empty.clear()
        if len(self._queue) >= self._limit and self._throttled_since is None:
            self._throttled_since = time.monotonic()
            self._stats.throttle_events += 1
        return ack

    def flush(self) -> None:
        queue = self._queue
        while queue and queue[0]._done:
            ack = queue.popleft()
            if not self._open:
                self._stats.acks_dropped += 1
            elif ack.qos > 0:
                self._paho.ack(ack.mid, ack.qos)  # type: ignore[attr-defined]
                self._stats.acked += 1
        if self._throttled_since is not None and len(queue) < self._limit:
            self._stats.throttled_s += time.monotonic() - self._throttled_since
            self._throttled_since = None
        if not queue:
            self._empty.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def wait_empty(self) -> None:
        await self._empty.wait()

    def close(self) -> None:
        """The connection is gone: later completions cannot be acknowledged."""
        self._open = False
        self.flush()


class Done(Protocol):
    """What a delivery calls once it is durable (an MQTT ack, or a spool delete)."""

    def done(self) -> None: ...


@dataclass(slots=True)
class Delivery:
    topic: str
    payload: bytes
    content_type: str | None
    received_ms: int
    ack: Done
    redelivered: bool = False  # the MQTT DUP flag: the broker may have sent it before


# Called on the event loop for every message, in receive order. It must not
# block: it classifies the message and hands it to the pipeline queue.
Handler = Callable[[Delivery], None]


def mqtt_client(
    cfg: MqttConfig,
    *,
    identifier: str | None = None,
    clean_start: bool = False,
    session_expiry: int | None = None,
    receive_maximum: int | None = None,
    max_inflight: int | None = None,
    timeout: float = 10,
) -> aiomqtt.Client:
    """An MQTT v5 client for the configured broker: address, credentials, TLS.

    One place for what every connection of the gateway shares (the receiver,
    `gateway check`, `gateway forget-session`, `gateway simulate`); the
    password is only read here. ``max_inflight`` bounds our own unacknowledged
    QoS 1 publishes (the simulator's).
    """
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    if session_expiry is not None:
        props.SessionExpiryInterval = session_expiry
    if receive_maximum is not None:
        props.ReceiveMaximum = receive_maximum
    return aiomqtt.Client(
        cfg.host,
        cfg.port,
        identifier=identifier or cfg.client_id,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=clean_start,
        properties=props,
        keepalive=cfg.keepalive,
        username=cfg.username,
        password=cfg.password.get_secret_value() if cfg.password else None,
        tls_context=cfg.tls.context(),
        timeout=timeout,
        logger=logging.getLogger(f"{__name__}.paho"),
        max_inflight_messages=max_inflight,
    )


class Receiver:
    """Connects, subscribes and hands every message to ``handler``, until stopped."""

    def __init__(
        self,
        config: MqttConfig,
        subscriptions: list[str],
        stats: Stats,
        *,
        shutdown_deadline: float = 10.0,
    ) -> None:
        self._config = config
        self._subscriptions = subscriptions
        self._stats = stats
        self._shutdown_deadline = shutdown_deadline
        self._loop = asyncio.get_running_loop()
        self._client: aiomqtt.Client | None = None
        self._paused = False
        self.connected = asyncio.Event()

    def _make_client(self) -> aiomqtt.Client:
        cfg = self._config
        return mqtt_client(
            cfg, session_expiry=int(cfg.session_expiry), receive_maximum=cfg.receive_maximum
        )

    # -- socket reading, pausable ------------------------------------------

    def pause_reading(self) -> None:
        """Stop reading the broker's socket (the pipeline queue is full)."""
        client = self._client
        if self._paused or client is None:
            return
        sock = client._client.socket()
        if sock is not None:
            self._loop.remove_reader(sock.fileno())
            self._paused = True
            self._stats.read_pauses += 1

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        client = self._client
        if client is not None:
            self._add_reader(client)

    def _add_reader(self, client: aiomqtt.Client) -> None:
        paho = client._client
        sock = paho.socket()
        if sock is None:
            return

        def read() -> None:
            # Same as aiomqtt's reader: a failed read means the connection broke.
            try:
                paho.loop_read()
            except Exception as exc:
                disconnected = client._disconnected
                if not disconnected.done():
                    disconnected.set_exception(exc)

        self._loop.add_reader(sock.fileno(), read)

    # -- the session --------------------------------------------------------

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            client = self._make_client()
            paho = client._client
            tracker = AckTracker(paho, self._stats, self._config.receive_maximum)
            # Acknowledge only once the writes are durable (module docstring).
            paho.manual_ack_set(True)
            paho.on_message = self._on_message(tracker, handler)
            try:
                async with client:
                    self._client = client
                    self._paused = False
                    # Replace aiomqtt's socket reader with ours, which can pause.
                    sock = paho.socket()
                    if sock is not None:
                        self._loop.remove_reader(sock.fileno())
                        self._add_reader(client)
                    self._stats.connects += 1
                    attempt = 0
                    for topic in self._subscriptions:
                        await client.subscribe(topic, qos=1)
                    log.info(
                        "connected to mqtt://%s:%d as %r, subscribed to %s",
                        self._config.host,
                        self._config.port,
                        self._config.client_id,
                        ", ".join(self._subscriptions),
                    )
                    self.connected.set()
                    await _until_stopped_or_disconnected(client, stop)
                    # Stopping: take no more messages; let what we hold be
                    # written and acknowledged before disconnecting.
                    tracker.taking = False
                    try:
                        async with asyncio.timeout(self._shutdown_deadline):
                            await tracker.wait_empty()
                    except TimeoutError:
                        log.warning(
                            "stopping with %d messages not yet durable; the broker will "
                            "redeliver them",
                            tracker.pending,
                        )
            except aiomqtt.MqttError as exc:
                self.connected.clear()
                self._stats.disconnects += 1
                attempt += 1
                cap = min(self._config.reconnect_max, self._config.reconnect_min * 2**attempt)
                delay = random.uniform(self._config.reconnect_min, cap)
                log.warning(
                    "MQTT connection to %s:%d lost or refused (%s); retrying in %.1f s",
                    self._config.host,
                    self._config.port,
                    exc,
                    delay,
                )
                try:
                    async with asyncio.timeout(delay):
                        await stop.wait()
                except TimeoutError:
                    pass
            finally:
                self._client = None
                self.connected.clear()
                tracker.close()

    def _on_message(
        self, tracker: AckTracker, handler: Handler
    ) -> Callable[[object, object, MQTTMessage], None]:
        stats = self._stats

        def on_message(_client: object, _userdata: object, message: MQTTMessage) -> None:
            if not tracker.taking:
                # Stopping: leave it unacknowledged; the broker redelivers it.
                return
            props = message.properties
            content_type = getattr(props, "ContentType", None) if props is not None else None
            stats.received += 1
            handler(
                Delivery(
                    # Brokers only pass valid UTF-8 topics; never raise here regardless.
                    topic=message._topic.decode("utf-8", "replace"),
                    payload=bytes(message.payload),
                    content_type=content_type,
                    received_ms=int(time.time() * 1000),
                    ack=tracker.track(message.mid, message.qos),
                    redelivered=bool(message.dup),
                )
            )

        return on_message


async def _until_stopped_or_disconnected(client: aiomqtt.Client, stop: asyncio.Event) -> None:
    """Return when ``stop`` is set; raise MqttError when the connection drops."""

    async def disconnected() -> None:
        # Nothing reaches aiomqtt's queue (we took over on_message), so this
        # only ends by raising MqttError when the connection is lost.
        async for _ in client.messages:
            pass

    watch = asyncio.ensure_future(disconnected())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((watch, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        watch.cancel()
    if watch.done() and not watch.cancelled() and (exc := watch.exception()) is not None:
        raise exc
