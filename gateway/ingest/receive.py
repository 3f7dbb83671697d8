"""Receive from Mosquitto: QoS 1, persistent session, acks only once durable.

The connection itself (CONNECT, SUBSCRIBE, keepalive, PUBACK, pausable reads)
is :mod:`.connection`, our own asyncio Protocol on the compiled ``mqtt5``
codec; this module is the session around it: reconnecting, tracking which
messages are done, and acknowledging them in order.

Promises:

* MQTT v5, fixed client id, ``clean_start`` false with a session expiry: the
  broker keeps our subscriptions and backlog while we are away. A CONNACK
  without ``session_present`` after we had a session is logged and counted
  (``sessions_lost``): the broker forgot what it held for us.
* Flow control, in two layers. The v5 Receive Maximum
  (``mqtt.receive_maximum``) caps the messages the broker sends before we
  acknowledge, so a slow Cassandra throttles the broker instead of filling
  RAM. Brokers don't always honour it (Mosquitto 2.0.11 over-sends when it
  resumes a session with a backlog: 2,422 unacknowledged with a limit of
  1,000, measured here), so the pipeline can also pause reading the socket
  (``pause_reading``/``resume_reading``): TCP then holds the broker back.
* We advertise a Maximum Packet Size derived from ``limits.max_payload_bytes``
  (see :func:`max_packet_size`): the broker drops what is far too large
  instead of us buffering it.
* Each delivery carries an :class:`Ack`; PUBACKs go out in receive order
  (MQTT requires it), each once the message and all messages before it are done.
* Connection lost, malformed packet or keepalive timeout: reconnect with
  exponential backoff and full jitter, and subscribe again. Acks of the old
  connection are dropped (counted): the broker redelivers those messages, and
  the writes are idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

from mqtt5 import PublishPacket

from ..aio import backoff
from ..config import MqttConfig
from ..errors import BrokerError, ConfigError
from ..stats import Stats
from .connection import Connection, ConnectOptions, Granted, connect

log = logging.getLogger(__name__)

# A connection closed under SHORT_LIVED s after it opened does not reset the
# reconnect backoff: a broker that accepts and drops us at once (a twin with
# our client id, an overloaded broker, a proxy) is retried ever more slowly.
SHORT_LIVED = 10.0
# A connection that was subscribed and lasted this long (s), though under
# SHORT_LIVED, keeps the next wait within reconnect_min x 2**(FLAPPING + 1):
# a link up 3 s and down 2 s waited 16 s and more, the backoff never reset.
UP_A_WHILE = 1.0
FLAPPING = 2
# Another client with our client id (Receiver._closed_after): this many
# connections in a row, each short-lived, within TWIN_WINDOW s.
TWIN_CLOSES = 3
TWIN_WINDOW = 60.0

# Room for the fixed header, topic and properties on top of the payload limit.
PACKET_OVERHEAD = 16 * 1024


def max_packet_size(max_payload_bytes: int) -> int:
    """The Maximum Packet Size we advertise.

    Twice the payload limit plus headroom: a payload somewhat over the limit
    still reaches us and is recorded in ``rejected_messages`` with its reason
    (``too_large``); one far over it is dropped by the broker (MQTT 5
    §3.1.2.11.4), which Mosquitto logs, rather than buffered by us.
    """
    return 2 * max_payload_bytes + PACKET_OVERHEAD


class Ack:
    """Marks one received message done; the tracker sends PUBACKs in order."""

    __slots__ = ("_done", "_tracker", "mid", "qos")

    def __init__(self, tracker: AckTracker, mid: int, qos: int) -> None:
        self._tracker = tracker
        self.mid = mid
        self.qos = qos
        self._done = False

    @property
    def comes_back(self) -> bool:
        """QoS 1: the broker sends it again if the gateway stops before done()."""
        return self.qos > 0

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._tracker.flush_soon()


class AckTracker:
    """Receive-ordered acknowledgements for one connection.

    Also measures backpressure: while ``limit`` (the receive maximum) messages
    are unacknowledged the broker should send nothing more, and that time is
    added to ``Stats.throttled_s``.
    """

    def __init__(self, puback: Callable[[list[int]], None], stats: Stats, limit: int) -> None:
        self._puback = puback
        self._stats = stats
        self._limit = limit
        self._queue: deque[Ack] = deque()
        self._open = True
        self.taking = True
        self._throttled_since: float | None = None
        self._flush_due = False
        self._empty = asyncio.Event()
        self._empty.set()

    def track(self, mid: int, qos: int) -> Ack:
        ack = Ack(self, mid, qos)
        self._queue.append(ack)
        if len(self._queue) == 1:
            self._empty.clear()  # set while the queue was empty, and only then
        if len(self._queue) >= self._limit and self._throttled_since is None:
            self._throttled_since = time.monotonic()
            self._stats.throttle_events += 1
        return ack

    def flush_soon(self) -> None:
        """Flush once the event loop has run what is ready now: the requests
        that completed together have their PUBACKs sent in one write."""
        queue = self._queue
        if not self._flush_due and queue and queue[0]._done:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._due_flush)

    def _due_flush(self) -> None:
        self._flush_due = False
        self.flush()

    def flush(self) -> None:
        queue = self._queue
        if not queue or not queue[0]._done:
            return
        ready: list[int] = []
        while queue and queue[0]._done:
            ack = queue.popleft()
            if not self._open:
                self._stats.acks_dropped += 1
            elif ack.qos > 0:
                ready.append(ack.mid)
        if ready:
            self._puback(ready)
            self._stats.acked += len(ready)
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

    @property
    def comes_back(self) -> bool:
        """Whether the message is delivered again, should the gateway stop
        before :meth:`done`: the broker's QoS 1 resend, or the spool's replay."""

    def done(self) -> None: ...


@dataclass(slots=True, init=False)
class Delivery:
    topic: str
    payload: bytes
    content_type: str | None
    received_ms: int
    ack: Done
    redelivered: bool = False  # the MQTT DUP flag: the broker may have sent it before
    # A retained copy, sent because we subscribed (live messages come with
    # retain cleared): as old as the message the broker kept, of any age.
    retained: bool = False
    # The receive time in µs, increasing in the order of arrival (Receiver;
    # but after a step back of the clock past a millisecond), kept in the
    # spool; 0 when not known (a spool record written before it was kept).
    # An event without ts is written at it (decode.py).
    received_us: int = 0

    # Written out: a dataclass's generated __init__ is interpreted (event.py).
    def __init__(
        self,
        topic: str,
        payload: bytes,
        content_type: str | None,
        received_ms: int,
        ack: Done,
        redelivered: bool = False,
        retained: bool = False,
        received_us: int = 0,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.content_type = content_type
        self.received_ms = received_ms
        self.ack = ack
        self.redelivered = redelivered
        self.retained = retained
        self.received_us = received_us


# Called on the event loop for every message, in receive order. It must not
# block: it classifies the message and hands it to the pipeline queue.
Handler = Callable[[Delivery], None]


class Receiver:
    """Connects, subscribes and hands every message to ``handler``, until stopped."""

    def __init__(
        self,
        config: MqttConfig,
        subscriptions: list[str],
        stats: Stats,
        *,
        max_payload_bytes: int = 64 * 1024,
        shutdown_deadline: float = 10.0,
    ) -> None:
        self._config = config
        # Inside the share group, if mqtt.share_group is set.
        self._subscriptions = [config.subscription(f) for f in subscriptions]
        self._stats = stats
        self._max_packet_size = max_packet_size(max_payload_bytes)
        self._shutdown_deadline = shutdown_deadline
        self._connection: Connection | None = None
        self._tracker: AckTracker | None = None  # the connection's (behind())
        self._tls: ssl.SSLContext | None = None
        self._paused = False
        self._had_session = False
        self._last_us = 0  # the last message's receive time, µs (Delivery.received_us)
        # When recent connections were closed by the broker soon after they
        # opened (bounded: the last TWIN_CLOSES), and when that was last said.
        self._short_lived: deque[float] = deque(maxlen=TWIN_CLOSES)
        self._twin_said = -TWIN_WINDOW
        self.connected = asyncio.Event()
        # The filters the broker refused in the last SUBACK, with the reason
        # ("denied/#: NOT_AUTHORIZED"): what the gateway is deaf to (/healthz).
        self.refused: list[str] = []

    def _options(self) -> ConnectOptions:
        cfg = self._config
        return ConnectOptions.for_broker(
            cfg,
            client_id=cfg.client_id,
            clean_start=False,
            session_expiry=int(cfg.session_expiry),
            receive_maximum=cfg.receive_maximum,
            max_packet_size=self._max_packet_size,
        )

    # -- socket reading, pausable ------------------------------------------

    def pause_reading(self) -> None:
        """Stop reading the broker's socket (the pipeline queue is full)."""
        if self._paused:
            return
        self._paused = True
        self._stats.read_pauses += 1
        if self._connection is not None:
            self._connection.pause_reading()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._connection is not None:
            self._connection.resume_reading()

    def _closed_after(self, seconds: float) -> None:
        """A connection ended after ``seconds``. Mosquitto closes a client id's
        connection (without a word to an MQTT 5 client, in 2.0.11) when
        another connects with that id: two instances given one client id take
        the session from each other, each reconnect ending the other's, for
        ever. Say so once TWIN_CLOSES connections in a row lasted under
        SHORT_LIVED seconds within TWIN_WINDOW, at most once per TWIN_WINDOW."""
        now = time.monotonic()
        if seconds >= SHORT_LIVED:
            self._short_lived.clear()
            return
        self._short_lived.append(now)
        recent = self._short_lived
        if len(recent) < TWIN_CLOSES or now - recent[0] > TWIN_WINDOW:
            return
        if now - self._twin_said < TWIN_WINDOW:
            return
        self._twin_said = now
        log.warning(
            "our last %d connections to the broker ended within seconds of opening: "
            "either another client uses mqtt.client_id %r (a second gateway with a "
            "copied config? each connect ends the other's: give each instance its own), "
            "or the link to the broker keeps dropping",
            len(recent),
            self._config.client_id,
        )

    def behind(self) -> bool:
        """Half of ``mqtt.receive_maximum`` messages or more are held, not yet
        written and acknowledged: the write path is behind what the broker
        sends (a backlog drains, or Cassandra is slower than the stream)."""
        tracker = self._tracker
        return tracker is not None and 2 * tracker.pending >= self._config.receive_maximum

    # -- the session --------------------------------------------------------

    async def run(self, handler: Handler, stop: asyncio.Event) -> None:
        attempt = 0
        cfg = self._config
        while not stop.is_set():
            tracker: AckTracker | None = None
            pinger: asyncio.Future[None] | None = None
            connected_at: float | None = None
            retry_in: float | None = None
            try:
                tracker = self._tracker = AckTracker(self._puback, self._stats, cfg.receive_maximum)
                conn = Connection(self._on_publish(tracker, handler), self._max_packet_size)
                self._connection = conn
                connack = await connect(
                    conn, cfg.host, cfg.port, self._options(), tls=self._tls_context()
                )
                # Pings from the CONNACK on: paused reads (a full queue) hold
                # the SUBACK back too, and the broker must not drop us meanwhile.
                keepalive = connack.server_keep_alive or cfg.keepalive
                pinger = asyncio.ensure_future(conn.keepalive(keepalive))
                if self._paused:
                    conn.pause_reading()
                self._stats.connects += 1
                connected_at = time.monotonic()
                self._session(connack.session_present)
                # Stop is heard while the SUBACK is awaited too: a broker that
                # never answers, or reads paused since before this connect.
                granted = await _unless_stopped(conn.subscribe(self._subscriptions), stop)
                if granted is not None:
                    self._granted(granted)
                    self.connected.set()
                    await _until_stopped_or_closed(conn, stop)
                # Stopping: take no more messages; let what we hold be
                # written and acknowledged before disconnecting.
                tracker.taking = False
                try:
                    async with asyncio.timeout(self._shutdown_deadline):
                        await tracker.wait_empty()
                except TimeoutError:
                    log.warning(
                        "stopping with %d messages not yet durable; the broker will redeliver them",
                        tracker.pending,
                    )
                conn.close()
            except BrokerError as exc:
                subscribed = self.connected.is_set()
                self.connected.clear()
                self._stats.disconnects += 1
                if connected_at is not None:
                    lasted = time.monotonic() - connected_at
                    if lasted >= SHORT_LIVED:
                        attempt = 0  # it was up a while: the first retry comes soon
                    elif lasted >= UP_A_WHILE and subscribed:
                        attempt = min(attempt, FLAPPING)  # a flapping link: soon too
                    self._closed_after(lasted)
                if self._connection is not None and self._connection.malformed:
                    self._stats.malformed_packets += 1
                # The connection is gone: acks that complete during the wait
                # below are dropped (and counted so), not counted as sent.
                if tracker is not None:
                    tracker.close()
                attempt += 1
                cap = backoff(attempt, cfg.reconnect_min, cfg.reconnect_max)
                delay = random.uniform(cfg.reconnect_min, cap)
                log.warning(
                    "MQTT connection to %s:%d lost or refused (%s); retrying in %.1f s",
                    cfg.host,
                    cfg.port,
                    exc,
                    delay,
                )
                retry_in = delay
            finally:
                if pinger is not None:
                    pinger.cancel()
                if self._connection is not None:
                    self._connection.close()
                self._connection = None
                self._tracker = None
                self.connected.clear()
                if tracker is not None:
                    tracker.close()
            if retry_in is not None:
                # Waited here, not in the except clause: compiled (mypyc) code
                # suspended in one leaves the error as the thread's current
                # exception, chained to every exception raised meanwhile.
                try:
                    async with asyncio.timeout(retry_in):
                        await stop.wait()
                except TimeoutError:
                    pass

    def _puback(self, packet_ids: list[int]) -> None:
        if self._connection is not None:
            self._connection.puback(packet_ids)

    def _tls_context(self) -> ssl.SSLContext | None:
        """The TLS files read anew at each connect (renewed certificates are
        used); while they cannot be read (mid-rotation), the last good ones."""
        try:
            self._tls = self._config.tls.context()
        except ConfigError as exc:
            if self._tls is None:
                raise BrokerError(f"mqtt.tls.{exc}") from None  # retried as a failed connect
            log.warning("mqtt.tls.%s; connecting with the files read before", exc)
        return self._tls

    def _granted(self, granted: Granted) -> None:
        cfg = self._config
        self.refused = list(granted.refused)
        for reason in granted.refused:
            self._stats.subscriptions_refused += 1
            log.error("the broker refused the subscription %s", reason)
        for topic_filter in granted.at_most_once:
            self._stats.subscriptions_qos0 += 1
            log.error(
                "the broker granted %s at QoS 0 only (its max_qos or an ACL?): messages on "
                "it are not acknowledged, so one in flight when the gateway stops is lost",
                topic_filter,
            )
        log.info(
            "connected to %s://%s:%d as %r, subscribed to %s",
            "mqtts" if cfg.tls.enabled else "mqtt",
            cfg.host,
            cfg.port,
            cfg.client_id,
            ", ".join(self._subscriptions),
        )

    def _session(self, present: bool) -> None:
        if present:
            self._had_session = True
        elif self._had_session:
            self._stats.sessions_lost += 1
            log.warning(
                "the broker no longer had our session (client id %r): messages it held "
                "for us while we were away are lost; subscribing again",
                self._config.client_id,
            )
        else:
            self._had_session = True
            log.info("the broker had no session for %r: starting one", self._config.client_id)

    def _on_publish(self, tracker: AckTracker, handler: Handler) -> Callable[[PublishPacket], None]:
        stats = self._stats

        def on_publish(packet: PublishPacket) -> None:
            if not tracker.taking:
                # Stopping: leave it unacknowledged; the broker redelivers it.
                return
            stats.received += 1
            now_us = time.time_ns() // 1000
            if self._last_us - 1000 < now_us <= self._last_us:
                # The same µs (or a step back within a millisecond): after the
                # last. A larger step back is taken as it is: pinned to the
                # old time, every message a µs apart looked a flood to the
                # sampler and to max_rate for as long as the step (review).
                now_us = self._last_us + 1
            self._last_us = now_us
            handler(
                Delivery(
                    topic=packet.topic,
                    payload=packet.payload,
                    content_type=packet.content_type,
                    received_ms=now_us // 1000,
                    ack=tracker.track(packet.packet_id or 0, int(packet.qos)),
                    redelivered=packet.duplicate,
                    retained=packet.retain,
                    received_us=now_us,
                )
            )

        return on_publish


async def _unless_stopped(
    coro: Coroutine[object, object, Granted], stop: asyncio.Event
) -> Granted | None:
    """``coro``'s result, or None if ``stop`` is set first (``coro`` is then cancelled)."""
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _until_stopped_or_closed(conn: Connection, stop: asyncio.Event) -> None:
    """Return when ``stop`` is set; raise ConnectionLost when the connection drops."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((conn.closed, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if conn.closed.done():
        conn.closed.result()  # raises ConnectionLost
