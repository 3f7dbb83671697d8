"""A scripted MQTT v5 broker on 127.0.0.1, for the faults the real Mosquitto
never produces (a malformed packet, a topic alias nobody allowed, a PUBACK for
no publish, silence). The "inject a fault that can't be produced for real"
exception: everything else runs against the real Mosquitto.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import mqtt5


@dataclass
class Session:
    """One client connection to the scripted broker, as the broker saw it."""

    connect: mqtt5.ConnectPacket
    subscribed: list[str] = field(default_factory=list)
    pubacks: list[int] = field(default_factory=list)
    published: list[mqtt5.PublishPacket] = field(default_factory=list)
    pings: int = 0


Script = Callable[[asyncio.StreamWriter, Session, int], None]
OnPublish = Callable[[asyncio.StreamWriter, mqtt5.PublishPacket], None]


class ScriptedBroker:
    """Accepts connections; answers CONNECT and SUBSCRIBE; then runs ``script``.

    ``script(writer, session, n)`` gets the n-th connection (0-based) and
    writes whatever bytes the test wants the client to see. A client's
    PUBLISH goes to ``on_publish(writer, packet)``, which answers it or not.
    """

    def __init__(
        self,
        script: Script,
        *,
        session_present: Callable[[int], bool] = bool,
        server_keep_alive: int | None = None,
        on_publish: OnPublish | None = None,
    ) -> None:
        self.script = script
        self.on_publish = on_publish
        self.session_present = session_present
        self.server_keep_alive = server_keep_alive
        self.sessions: list[Session] = []
        self.writers: list[asyncio.StreamWriter] = []  # one per connection, in order
        self.answer_pings = True
        self.answer_subscribe = True  # False: no SUBACK, ever (nor the script)
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = bytearray()
        session: Session | None = None
        n = len(self.sessions)
        try:
            while data := await reader.read(65536):
                buf += data
                while True:
                    try:
                        packet, used = mqtt5.read(memoryview(bytes(buf)))
                    except IndexError:
                        break
                    del buf[:used]
                    if isinstance(packet, mqtt5.ConnectPacket):
                        session = Session(packet)
                        self.sessions.append(session)
                        self.writers.append(writer)
                        present = self.session_present(n)
                        writer.write(
                            mqtt5.ConnAckPacket(
                                session_present=present, server_keep_alive=self.server_keep_alive
                            ).write()
                        )
                    elif isinstance(packet, mqtt5.SubscribePacket):
                        assert session is not None
                        session.subscribed += [f.pattern for f in packet.topic_filters]
                        if not self.answer_subscribe:
                            continue
                        codes = [_granted(f.pattern) for f in packet.topic_filters]
                        writer.write(mqtt5.SubAckPacket(packet.packet_id, codes).write())
                        self.script(writer, session, n)
                    elif isinstance(packet, mqtt5.PublishPacket):
                        assert session is not None
                        session.published.append(packet)
                        if self.on_publish is not None:
                            self.on_publish(writer, packet)
                    elif isinstance(packet, mqtt5.PubAckPacket):
                        assert session is not None
                        session.pubacks.append(packet.packet_id)
                    elif isinstance(packet, mqtt5.PingReqPacket):
                        assert session is not None
                        session.pings += 1
                        if self.answer_pings:
                            writer.write(mqtt5.PingRespPacket().write())
                    elif isinstance(packet, mqtt5.DisconnectPacket):
                        writer.close()
                        return
        except ConnectionError:
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedBroker]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self


def _granted(pattern: str) -> mqtt5.SubAckReasonCode:
    """Filters under denied/ are refused, under qos0/ granted QoS 0 only."""
    if pattern.startswith("denied/"):
        return mqtt5.SubAckReasonCode.NOT_AUTHORIZED
    if pattern.startswith("qos0/"):
        return mqtt5.SubAckReasonCode.GRANTED_QOS_AT_MOST_ONCE
    return mqtt5.SubAckReasonCode.GRANTED_QOS_AT_LEAST_ONCE
