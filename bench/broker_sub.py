"""Broker ceiling: a minimal QoS 1 subscriber, no decoding, no database.

paho-mqtt (MQTT v5, persistent session) receives and acknowledges as fast as
it can: paho sends the PUBACK as soon as ``on_message`` returns, and
``on_message`` only counts. Prints ``READY`` once connected and
``received=N first=T last=T`` (epoch seconds) as it goes; stops on SIGTERM.

With ``LATENCY_AFTER LATENCY_OUT``, every message after the first
LATENCY_AFTER also has its ``sent_at`` read, and the publish→receive latencies
(ms) are written to LATENCY_OUT (JSON) on exit: the broker's share of the
end-to-end latency, for the latency run only.

Usage (from bench/run.py): python bench/broker_sub.py CLIENT_ID [LATENCY_AFTER LATENCY_OUT]
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

import orjson
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

SUBSCRIPTION = "gwbench/+/devices/+/events"
SESSION_EXPIRY = 600


def main() -> None:
    client_id = sys.argv[1]
    latency_after = int(sys.argv[2]) if len(sys.argv) > 2 else None
    latencies: list[float] = []
    stop = threading.Event()
    received = 0
    first = last = 0.0

    def on_connect(client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            print(f"connect failed: {reason}", flush=True)
            stop.set()
            return
        client.subscribe(SUBSCRIPTION, qos=1)
        print("READY", flush=True)

    def on_message(_c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        nonlocal received, first, last
        last = time.time()
        if received == 0:
            first = last
        received += 1
        if latency_after is not None and received > latency_after:
            latencies.append(last * 1000 - orjson.loads(message.payload)["sent_at"])

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.on_connect = on_connect
    client.on_message = on_message
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = SESSION_EXPIRY
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client.connect("127.0.0.1", 1883, clean_start=False, properties=props)
    client.loop_start()
    shown = -1
    while not stop.wait(0.05):
        if received != shown:
            shown = received
            print(f"received={received} first={first:.6f} last={last:.6f}", flush=True)
    client.disconnect()
    client.loop_stop()
    print(f"received={received} first={first:.6f} last={last:.6f}", flush=True)
    if latency_after is not None:
        with open(sys.argv[3], "w") as out:
            json.dump(latencies, out)


if __name__ == "__main__":
    main()
