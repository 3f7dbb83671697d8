"""Naive bridge: what small public MQTT→Cassandra bridges do.

A paho-mqtt ``on_message`` callback (MQTT v5, QoS 1, persistent session)
decodes the JSON payload and calls the synchronous ``session.execute`` once
per row, for the same rows as the gateway (bench/rows.py). paho sends the
PUBACK after ``on_message`` returns, so a message is acknowledged once its rows
are written. No validation, no batching, one request in flight.

Prints ``READY`` once connected and ``written=N`` as it goes; stops on SIGTERM.
Usage (from bench/run.py): python bench/naive_bridge.py CLIENT_ID
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

import orjson
import paho.mqtt.client as mqtt
from cassandra.cluster import Cluster
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from rows import KEYSPACE, SESSION_EXPIRY, SUBSCRIPTION, Statements, event_identity


def main() -> None:
    client_id = sys.argv[1]
    cluster = Cluster(["127.0.0.1"], protocol_version=4)
    session = cluster.connect(KEYSPACE)
    statements = Statements.prepare_with(session.prepare)
    stop = threading.Event()
    written = 0
    failed = 0

    def on_connect(client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            print(f"connect failed: {reason}", flush=True)
            stop.set()
            return
        client.subscribe(SUBSCRIPTION, qos=1)
        print("READY", flush=True)

    def on_message(_c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        nonlocal written, failed
        received_ms = int(time.time() * 1000)
        _, tenant, _, device, _ = message.topic.split("/")
        try:
            event = orjson.loads(message.payload)
            value = event.get("value")
            value_text = value if isinstance(value, str) else None
            value_num = float(value) if isinstance(value, int | float) else None
            metrics = {k: float(v) for k, v in event.get("metrics", {}).items()}
            tags = dict(event.get("tags", {}))
            ts, state = int(event["ts"]), event.get("state")
            event_id, write_ts = event_identity(
                tenant,
                device,
                ts,
                state,
                value_text if value_text is not None else value_num,
                metrics,
                tags,
            )
            for statement, params in statements.rows(
                tenant,
                device,
                ts,
                state,
                value_text,
                value_num,
                metrics,
                tags,
                received_ms,
                event_id,
                write_ts,
            ):
                session.execute(statement, params)
        except Exception as exc:  # a bridge like this logs and moves on
            failed += 1
            if failed <= 5:
                print(f"write failed: {exc!r}", flush=True)
            return
        written += 1

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
        if written != shown:
            shown = written
            print(f"written={written} failed={failed}", flush=True)
    client.disconnect()
    client.loop_stop()
    cluster.shutdown()
    print(f"written={written} failed={failed}", flush=True)


if __name__ == "__main__":
    main()
