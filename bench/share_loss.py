"""What the local broker does with a shared subscription when a member leaves.

Two members of one share group (MQTT v5 ``$share/<group>/...``), receive
maximum 5 each. Member B acknowledges nothing (a gateway whose writes are
still in flight); 20 messages are published, B disconnects, 20 more are
published, B comes back (acknowledging now). Run once with persistent
sessions (as the gateway connects: clean start off, session expiry 600 s)
and once with clean sessions (expiry 0). Prints what A got while B was away
and which messages nobody acknowledged.

Usage: .venv/bin/python bench/share_loss.py   (needs the broker on 127.0.0.1:1883)
"""

from __future__ import annotations

import asyncio
import uuid

import aiomqtt
from mqtt5 import PublishPacket

from gateway.ingest.connection import Connection, ConnectOptions, connect


async def _member(
    client_id: str, topic_filter: str, got: list[str], *, ack: bool, persistent: bool
) -> Connection:
    def on_publish(packet: PublishPacket) -> None:
        got.append(packet.payload.decode())
        if ack:
            conn.puback([packet.packet_id or 0])

    conn = Connection(on_publish, None)
    options = ConnectOptions(client_id, not persistent, 600 if persistent else 0, 60, 5)
    await connect(conn, "127.0.0.1", 1883, options)
    await conn.subscribe([topic_filter])
    return conn


async def _publish(topic: str, prefix: str, n: int) -> None:
    async with aiomqtt.Client("127.0.0.1", 1883, identifier=f"p-{uuid.uuid4().hex[:8]}") as c:
        for i in range(n):
            await c.publish(topic, f"{prefix}{i}", qos=1)


async def _forget(client_id: str) -> None:
    conn = Connection(lambda _p: None, None)
    await connect(conn, "127.0.0.1", 1883, ConnectOptions(client_id, True, 0, 60))
    conn.close()


async def run(persistent: bool) -> dict[str, int]:
    group = f"g{uuid.uuid4().hex[:8]}"
    topic = f"sharebench/{group}/d"
    topic_filter = f"$share/{group}/sharebench/{group}/+"
    a_got: list[str] = []
    b_first: list[str] = []
    b_back: list[str] = []
    a = await _member(f"A-{group}", topic_filter, a_got, ack=True, persistent=True)
    b = await _member(f"B-{group}", topic_filter, b_first, ack=False, persistent=persistent)
    await _publish(topic, "x", 20)
    await asyncio.sleep(1)
    b.close()
    await asyncio.sleep(1)
    await _publish(topic, "y", 20)
    await asyncio.sleep(1)
    a_while_away = sum(1 for m in a_got if m.startswith("y"))
    b2 = await _member(f"B-{group}", topic_filter, b_back, ack=True, persistent=persistent)
    await asyncio.sleep(2)
    every = {f"x{i}" for i in range(20)} | {f"y{i}" for i in range(20)}
    result = {
        "b_in_flight_unacked": len(b_first),
        "a_got_of_20_sent_while_b_away": a_while_away,
        "b_in_flight_given_to_a": len(set(b_first) & set(a_got)),
        "b_got_on_return": len(b_back),
        "never_acknowledged_with_b_back": len(every - set(a_got) - set(b_back)),
        "never_acknowledged_if_b_never_returns": len(every - set(a_got)),
    }
    a.close()
    b2.close()
    await _forget(f"A-{group}")
    await _forget(f"B-{group}")
    return result


def main() -> None:
    for persistent in (True, False):
        result = asyncio.run(run(persistent))
        print("persistent sessions" if persistent else "clean sessions", result)


if __name__ == "__main__":
    main()
