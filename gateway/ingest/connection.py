"""One MQTT v5 connection to the broker, on the compiled ``mqtt5`` packet codec.

Why our own small asyncio Protocol rather than a client library: the gateway
needs four things no released asyncio client offers through public APIs
together (see bench/PERFORMANCE.md, "The receive path"): PUBACKs sent by the application,
in receive order, only once a message is durable; socket reads that can be
paused when the pipeline is full (Mosquitto 2.0.11 over-sends past Receive
Maximum on session resume); no queue of its own that could grow or drop; and
packet parsing that costs well under a microsecond. ``mqtt5`` (Rust) encodes
and decodes the packets; this module is only the session logic around it:
CONNECT/CONNACK, SUBSCRIBE/SUBACK, keepalive, PUBACK, DISCONNECT.

The same connection publishes at QoS 1 for ``gateway simulate``
(gateway/tools/simulate.py), whose load has to cost little next to the
gateway it drives on the same cores: :meth:`Connection.publish` sends a batch
of PUBLISH packets in one write, and each PUBACK is handed to ``on_puback``.
The gateway itself never publishes; a PUBACK it did not ask for is a protocol
error.

Promises:

* Every PUBLISH is handed to ``on_publish`` synchronously, in the order the
  bytes arrived, with partial and coalesced TCP reads reassembled.
* A malformed packet, a protocol violation (a topic alias we did not allow, a
  packet over our Maximum Packet Size) or a missed keepalive (counted only
  while we read) closes the connection with the matching DISCONNECT reason; ``closed`` then raises
  :class:`ConnectionLost` and the caller reconnects.
* Nothing is buffered beyond one partial packet, which is bounded by the
  Maximum Packet Size we advertise.
* A packet id is never reused while its PUBLISH awaits its PUBACK; how many
  await one is the caller's bound (:attr:`Connection.unacked`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from mqtt5 import (
    ConnAckPacket,
    ConnAckReasonCode,
    ConnectPacket,
    DisconnectPacket,
    DisconnectReasonCode,
    PingReqPacket,
    PingRespPacket,
    PubAckPacket,
    PublishPacket,
    QoS,
    RetainHandling,
    SubAckPacket,
    SubAckReasonCode,
    SubscribePacket,
    TopicFilter,
    read,
)

from ..errors import BrokerError

if TYPE_CHECKING:
    from ..config import MqttConfig

log = logging.getLogger(__name__)

PublishHandler = Callable[[PublishPacket], None]
PubAckHandler = Callable[[PubAckPacket], None]
T = TypeVar("T")


class ConnectionLost(BrokerError):
    """The connection closed: by the broker, the network, or us on a protocol error."""


@dataclass(frozen=True, slots=True)
class Granted:
    """A SUBACK's bad news: filters refused (with the reason code's name), and
    filters granted QoS 0 only (no PUBACK, so no redelivery: at most once)."""

    refused: list[str]
    at_most_once: list[str]


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """What a CONNECT says; the password is only ever held here and in the packet."""

    client_id: str
    clean_start: bool
    session_expiry: int
    keepalive: int
    receive_maximum: int = 65535
    max_packet_size: int | None = None
    username: str | None = None
    password: bytes | None = None

    @classmethod
    def for_broker(
        cls,
        cfg: MqttConfig,
        *,
        client_id: str,
        clean_start: bool,
        session_expiry: int,
        receive_maximum: int = 65535,
        max_packet_size: int | None = None,
    ) -> ConnectOptions:
        """The CONNECT for the configured broker: its keepalive and credentials
        (the receiver's session and ``gateway simulate``'s alike)."""
        return cls(
            client_id=client_id,
            clean_start=clean_start,
            session_expiry=session_expiry,
            keepalive=cfg.keepalive,
            receive_maximum=receive_maximum,
            max_packet_size=max_packet_size,
            username=cfg.username,
            password=cfg.password.get_secret_value().encode() if cfg.password else None,
        )


class Connection(asyncio.Protocol):
    """The protocol object for one TCP (or TLS) connection; see the module docstring."""

    def __init__(
        self,
        on_publish: PublishHandler,
        max_packet_size: int | None,
        *,
        on_puback: PubAckHandler | None = None,
    ) -> None:
        self._on_publish = on_publish
        self._on_puback = on_puback
        self._unacked: set[int] = set()  # our QoS 1 publishes awaiting their PUBACK
        self._max_packet_size = max_packet_size
        self._transport: asyncio.Transport | None = None
        self._partial = bytearray()
        self._loop = asyncio.get_running_loop()
        self._connack: asyncio.Future[ConnAckPacket] = self._loop.create_future()
        self._subacks: dict[int, asyncio.Future[SubAckPacket]] = {}
        self.closed: asyncio.Future[None] = self._loop.create_future()
        # Closed because the broker sent a malformed packet, or one that MQTT
        # or our CONNECT forbids (a topic alias, one over our maximum size).
        self.malformed = False
        self.last_received = time.monotonic()
        self.last_sent = time.monotonic()
        self._next_id = 0

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        reason = f"connection lost: {exc}" if exc else "connection closed by the broker"
        self._fail(ConnectionLost(reason))

    def data_received(self, data: bytes) -> None:
        self.last_received = time.monotonic()
        if self._partial:
            # Only a packet split across reads is copied; whole packets are
            # parsed straight from the bytes the transport handed us.
            self._partial += data
            data = bytes(self._partial)
            self._partial.clear()
        view = memoryview(data)
        end = len(data)
        pos = 0
        while pos < end:
            try:
                packet, used = read(view[pos:])
            except IndexError:  # an incomplete packet: wait for more bytes
                break
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                # ValueError, and what the codec raises from Rust on some bytes
                # (invalid UTF-8 in a topic: a PanicException, a BaseException).
                self._abort(DisconnectReasonCode.MALFORMED_PACKET, f"malformed packet: {exc}")
                return
            if self._max_packet_size is not None and used > self._max_packet_size:
                self._abort(DisconnectReasonCode.PACKET_TOO_LARGE, "packet over our maximum")
                return
            pos += used
            if isinstance(packet, PublishPacket):
                if packet.topic_alias is not None:
                    # We advertise Topic Alias Maximum 0: an alias is a protocol error.
                    self._abort(DisconnectReasonCode.TOPIC_ALIAS_INVALID, "topic alias received")
                    return
                if packet.qos == QoS.EXACTLY_ONCE:
                    # We subscribe at QoS 1 at most (and a publisher gets no
                    # PUBLISH): QoS 2 would need PUBREC, not our PUBACK.
                    self._abort(DisconnectReasonCode.PROTOCOL_ERROR, "QoS 2 PUBLISH received")
                    return
                self._on_publish(packet)
            else:
                self._control(packet)
            if self._transport is None or self.closed.done():
                return  # closed by that packet: what follows it is not ours to take
        if pos < end:
            rest = view[pos:]
            if self._max_packet_size is not None and len(rest) > self._max_packet_size + 5:
                # Longer than any packet we allowed, header included.
                self._abort(DisconnectReasonCode.PACKET_TOO_LARGE, "packet over our maximum")
                return
            self._partial += rest

    def _control(self, packet: object) -> None:
        if isinstance(packet, ConnAckPacket):
            if not self._connack.done():
                self._connack.set_result(packet)
        elif isinstance(packet, SubAckPacket):
            waiter = self._subacks.pop(packet.packet_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(packet)
        elif isinstance(packet, PubAckPacket) and self._on_puback is not None:
            if packet.packet_id not in self._unacked:
                self._abort(DisconnectReasonCode.PROTOCOL_ERROR, "PUBACK for no publish of ours")
                return
            self._unacked.discard(packet.packet_id)
            self._on_puback(packet)
        elif isinstance(packet, PingRespPacket):
            pass  # last_received is already updated
        elif isinstance(packet, DisconnectPacket):
            detail = f" ({packet.reason_str})" if packet.reason_str else ""
            self._fail(ConnectionLost(f"broker disconnected us: {packet.reason_code.name}{detail}"))
            self.close()
        else:
            # A receiver never publishes, so no PUBACK/PUBREC/...; a publisher
            # publishes at QoS 1 only; QoS 2 is not subscribed.
            self._abort(DisconnectReasonCode.PROTOCOL_ERROR, f"unexpected {type(packet).__name__}")

    # -- sending --------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)
            self.last_sent = time.monotonic()

    def puback(self, packet_ids: Iterable[int]) -> None:
        """Acknowledge QoS 1 messages (already in receive order), in one write."""
        self.send(b"".join(PubAckPacket(pid).write() for pid in packet_ids))

    @property
    def unacked(self) -> int:
        """How many of our QoS 1 publishes await their PUBACK."""
        return len(self._unacked)

    def publish(self, messages: Iterable[tuple[str, bytes]], content_type: str | None) -> list[int]:
        """Publish ``(topic, payload)`` pairs at QoS 1 in one write; return their
        packet ids in order. Each PUBACK goes to ``on_puback``."""
        if self._on_puback is None:
            raise RuntimeError("this connection was opened without on_puback")
        ids: list[int] = []
        packets: list[bytes] = []
        for topic, payload in messages:
            if len(self._unacked) >= 65535:
                raise BrokerError("65,535 publishes await their PUBACK: no packet id is free")
            pid = self._next_id = self._next_id % 65535 + 1
            while pid in self._unacked:
                pid = self._next_id = pid % 65535 + 1
            self._unacked.add(pid)
            ids.append(pid)
            packets.append(
                PublishPacket(
                    topic, payload, qos=QoS.AT_LEAST_ONCE, packet_id=pid, content_type=content_type
                ).write()
            )
        if packets:
            self.send(b"".join(packets))
        return ids

    def pause_reading(self) -> None:
        if self._transport is not None and self._transport.is_reading():
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_reading():
            # The broker's silence while we did not read says nothing about it.
            self.last_received = time.monotonic()
            self._transport.resume_reading()

    # -- the session ----------------------------------------------------------

    async def handshake(self, options: ConnectOptions) -> ConnAckPacket:
        self.send(
            ConnectPacket(
                options.client_id,
                username=options.username,
                password=options.password,
                clean_start=options.clean_start,
                keep_alive=options.keepalive,
                session_expiry_interval=options.session_expiry,
                receive_max=options.receive_maximum,
                topic_alias_max=0,
                max_packet_size=options.max_packet_size,
            ).write()
        )
        connack = await self._until_closed(self._connack)
        if connack.reason_code != ConnAckReasonCode.SUCCESS:
            self.close()
            raise BrokerError(f"broker refused the connection: {connack.reason_code.name}")
        return connack

    async def subscribe(self, filters: list[str]) -> Granted:
        """Subscribe at QoS 1; return what the broker refused or granted at QoS 0 only.

        A retained message is sent only when the subscription is new (Retain
        Handling 1), so reconnecting to our session does not hand us the
        tenant's retained messages again; live messages come with the retain
        flag cleared (Retain As Published off), so a PUBLISH flagged retain is
        always such a stored copy, sent because we subscribed.
        """
        self._next_id = self._next_id % 65535 + 1
        pid = self._next_id
        waiter: asyncio.Future[SubAckPacket] = self._loop.create_future()
        self._subacks[pid] = waiter
        topic_filters = [
            TopicFilter(
                f,
                max_qos=QoS.AT_LEAST_ONCE,
                retain_as_published=False,
                retain_handling=RetainHandling.SEND_IF_SUBSCRIPTION_NOT_EXISTS,
            )
            for f in filters
        ]
        self.send(SubscribePacket(pid, topic_filters).write())
        suback = await self._until_closed(waiter)
        pairs = list(zip(filters, suback.reason_codes, strict=False))
        return Granted(
            refused=[f"{topic}: {code.name}" for topic, code in pairs if int(code) >= 0x80],
            at_most_once=[
                topic for topic, code in pairs if code == SubAckReasonCode.GRANTED_QOS_AT_MOST_ONCE
            ],
        )

    async def keepalive(self, interval: float) -> None:
        """Ping when we have been quiet; close when the broker has been silent too long.

        MQTT 5 §3.1.2.10: the broker drops us after 1.5 x keepalive without a
        packet from us; we give the broker the same 1.5x of reading before
        giving up on it. While reads are paused (a full pipeline queue or spool,
        for as long as Cassandra or the disk takes) its answers wait unread in
        the socket, so only our pings go on; a broker that has gone meanwhile
        shows as a failed write.
        """
        while self._transport is not None:
            now = time.monotonic()
            reading = self._transport.is_reading()
            if reading and now - self.last_received > 1.5 * interval:
                self._abort(DisconnectReasonCode.KEEP_ALIVE_TIMEOUT, "keepalive timeout")
                return
            if now - self.last_sent >= interval / 2:
                self.send(PingReqPacket().write())
            await asyncio.sleep(interval / 4)

    def close(
        self, reason: DisconnectReasonCode = DisconnectReasonCode.NORMAL_DISCONNECTION
    ) -> None:
        transport = self._transport
        if transport is not None:
            if not transport.is_closing():
                transport.write(DisconnectPacket(reason_code=reason).write())
            transport.close()

    async def _until_closed(self, waiter: asyncio.Future[T]) -> T:
        await asyncio.wait((waiter, self.closed), return_when=asyncio.FIRST_COMPLETED)
        if waiter.done():
            return waiter.result()
        waiter.cancel()
        self.closed.result()  # raises ConnectionLost
        raise ConnectionLost("connection closed")

    def _abort(self, reason: DisconnectReasonCode, detail: str) -> None:
        if reason != DisconnectReasonCode.KEEP_ALIVE_TIMEOUT:
            self.malformed = True  # the broker sent what MQTT or our CONNECT forbids
        log.warning("closing the MQTT connection: %s", detail)
        self._fail(ConnectionLost(detail))
        self.close(reason)

    def _fail(self, exc: ConnectionLost) -> None:
        if not self.closed.done():
            self.closed.set_exception(exc)
            # Retrieved by whoever awaits it; don't warn if nobody does.
            self.closed.exception()


async def connect(
    conn: Connection,
    host: str,
    port: int,
    options: ConnectOptions,
    *,
    tls: ssl.SSLContext | None = None,
    within: float = 10.0,
) -> ConnAckPacket:
    """Open ``conn``'s TCP/TLS connection and complete CONNECT/CONNACK ``within`` seconds.

    ``conn`` is built by the caller first: the broker may send queued messages
    right behind the CONNACK, in the same read, so the PUBLISH handler has to
    be in place before the first byte arrives.
    """
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(within):
            await loop.create_connection(
                lambda: conn, host, port, ssl=tls, server_hostname=host if tls else None
            )
            return await conn.handshake(options)
    except TimeoutError:
        conn.close()
        raise BrokerError(f"no CONNACK from {host}:{port} within {within:g} s") from None
    except (OSError, ssl.SSLError) as exc:
        conn.close()
        raise BrokerError(f"cannot connect to {host}:{port}: {exc}") from exc
