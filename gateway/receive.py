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
* Flow control: the v5 Receive Maximum (``mqtt.receive_maximum``) caps the
  messages the broker sends before we acknowledge, so memory is bounded by it
  and a slow Cassandra throttles the broker instead of filling RAM. (aiomqtt's
  own queue is unbounded on purpose: it never holds more than that cap, and a
  bounded one would discard messages.)
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .config import MqttConfig
from .metrics import Stats

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
    """Receive-ordered acknowledgements for one connection."""

    def __init__(self, paho: object, stats: Stats) -> None:
        self._paho = paho
        self._stats = stats
        self._queue: deque[Ack] = deque()
        self._open = True
        self._empty = asyncio.Event()
        self._empty.set()

    def track(self, mid: int, qos: int) -> Ack:
        ack = Ack(self, mid, qos)
        self._queue.append(ack)
        self._empty.clear()
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


@dataclass(slots=True)
class Delivery:
    topic: str
    payload: bytes
    content_type: str | None
    received_ms: int
    ack: Ack


Handler = Callable[[Delivery], Awaitable[None]]


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
        self.connected = asyncio.Event()

    def _client(self) -> aiomqtt.Client:
        cfg = self._config
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = int(cfg.session_expiry)
        props.ReceiveMaximum = cfg.receive_maximum
        client = aiomqtt.Client(
            cfg.host,
            cfg.port,
            identifier=cfg.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            clean_start=False,
            properties=props,
            keepalive=cfg.keepalive,
            username=cfg.username,
            password=cfg.password.get_secret_value() if cfg.password else None,
            timeout=10,
            logger=logging.getLogger(f"{__name__}.paho"),
        )
        # See the module docstring: acknowledge only once the writes are durable.
        client._client.manual_ack_set(True)
        return client

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            client = self._client()
            tracker = AckTracker(client._client, self._stats)
            try:
                async with client:
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
                    await self._pump(client, tracker, handler, stop)
                    # Stopping: let what we hold be written and acknowledged.
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
                self.connected.clear()
                tracker.close()

    async def _pump(
        self,
        client: aiomqtt.Client,
        tracker: AckTracker,
        handler: Handler,
        stop: asyncio.Event,
    ) -> None:
        messages = client.messages
        while not stop.is_set():
            if len(messages) == 0:
                # Idle: wait for a message or for the stop signal, whichever is first.
                # A message is never cancelled half-way through the handler.
                next_message = asyncio.ensure_future(anext(messages))
                stop_wait = asyncio.ensure_future(stop.wait())
                done, _ = await asyncio.wait(
                    (next_message, stop_wait), return_when=asyncio.FIRST_COMPLETED
                )
                stop_wait.cancel()
                if next_message not in done:
                    next_message.cancel()
                    return
                message = next_message.result()
            else:
                message = await anext(messages)
            props = message.properties
            content_type = getattr(props, "ContentType", None) if props else None
            payload = message.payload
            if not isinstance(payload, bytes | bytearray):
                payload = str(payload).encode()
            self._stats.received += 1
            await handler(
                Delivery(
                    topic=message.topic.value,
                    payload=bytes(payload),
                    content_type=content_type,
                    received_ms=int(time.time() * 1000),
                    ack=tracker.track(message.mid, message.qos),
                )
            )
