"""Receive-only micro-benchmark: broker bytes in, deliveries out, µs of CPU per message.

No database: each receiver acknowledges every message as soon as it is
delivered (in order), so what is measured is the MQTT layer alone, the part
issue #13 found at ~44% of the gateway's CPU under paho.

For each receiver, on the real Mosquitto started by ``make up``:

1. a persistent session subscribed to the bench tree is created;
2. N QoS 1 messages (gateway-like JSON, ~150 bytes, MQTT v5 with a content
   type) are published into it by ``mosquitto_pub -l`` while nobody listens;
3. the receiver connects in a fresh process, drains the N messages and
   acknowledges each; it reports the wall time and its own CPU time
   (``time.process_time``, all threads) from CONNACK to the last PUBACK.

Receivers:

* ``connection``: the gateway's receive path (gateway/ingest/receive.py on
  connection.py, the mqtt5 codec), under uvloop as ``gateway run`` runs it;
* ``paho``: paho-mqtt 2.2 with manual acks on its own network thread, the
  library (and parser) under the previous receive path;
* ``aiomqtt3``: aiomqtt 3.0.0a1 (also on mqtt5), ``await client.puback()`` per
  message. It breaks aiomqtt 2's API, which the tools use, so it runs from a
  virtualenv of its own in .state/bench-aiomqtt3 (made on first use).

Run: ``make bench-receive`` (or ``.venv/bin/python bench/receive.py -n 100000``).
Results: bench/results/receive.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("STATE_DIR", ROOT / ".state"))
AIOMQTT3_VENV = STATE / "bench-aiomqtt3"
HOST, PORT = "127.0.0.1", 1883
TOPIC = "gwbench/rx/devices/{device}/events"
FILTER = "gwbench/rx/devices/+/events"
PAYLOAD = (
    '{{"ts": {ts}, "state": "on", "value": 21.5, '
    '"metrics": {{"temperature": 21.5, "humidity": 40.2, "battery": 97.1}}, '
    '"tags": {{"floor": "3", "room": "3.14"}}}}'
)

# ------------------------------------------------------------------ children
# Each child prints one JSON line: {"messages", "wall_s", "cpu_s"}.

CONNECTION_CHILD = """
import asyncio, json, sys, time
import uvloop
from gateway.config import MqttConfig
from gateway.ingest.receive import Receiver
from gateway.stats import Stats

client_id, n = sys.argv[1], int(sys.argv[2])

async def main():
    stats = Stats()
    receiver = Receiver(MqttConfig(client_id=client_id, receive_maximum=1000),
                        [sys.argv[3]], stats)
    stop = asyncio.Event()
    marks = {}
    def handler(d):
        if stats.received == 1:
            marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
        d.ack.done()
        # The PUBACKs go out in one write once the loop has run what is
        # ready (receive.py: flush_soon), so stats.acked counts them after
        # this call: stop after that flush, not when acked reaches n here.
        if stats.received >= n:
            asyncio.get_running_loop().call_soon(stop.set)
    await receiver.run(handler, stop)
    print(json.dumps({"messages": stats.acked, "wall_s": time.perf_counter() - marks["t0"],
                      "cpu_s": time.process_time() - marks["c0"]}))

uvloop.run(main())
"""

PAHO_CHILD = """
import json, sys, threading, time
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

client_id, n = sys.argv[1], int(sys.argv[2])
done = threading.Event()
count = 0
marks = {}
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                     protocol=mqtt.MQTTv5)
client.manual_ack_set(True)

def on_message(c, userdata, msg):
    global count
    count += 1
    if count == 1:
        marks["t0"], marks["c0"] = time.perf_counter(), time.process_time()
    c.ack(msg.mid, msg.qos)
    if count >= n:
        done.set()

client.on_message = on_message
props = Properties(PacketTypes.CONNECT)
props.SessionExpiryInterval = 600
props.ReceiveMaximum = 1000
client.connect("127.0.0.1", 1883, clean_start=False, properties=props)
client.loop_start()
done.wait(600)
wall, cpu = time.perf_counter() - marks["t0"], time.process_time() - marks["c0"]
client.disconnect()
client.loop_stop()
print(json.dumps({"messages": count, "wall_s": wall, "cpu_s": cpu}))
"""

AIOMQTT3_CHILD = """
import asyncio, json, sys, time
import aiomqtt
from mqtt5 import PublishPacket

client_id, n = sys.argv[1], int(sys.argv[2])

async def main():
    count = 0
    async with aiomqtt.Client(hostname="127.0.0.1", port=1883, identifier=client_id,
                              clean_start=False,
                              session_expiry_interval=600, receive_max=1000) as client:
        async for packet in client.messages():
            if not isinstance(packet, PublishPacket):
                continue
            count += 1
            if count == 1:
                t0, c0 = time.perf_counter(), time.process_time()
            await client.puback(packet.packet_id)
            if count >= n:
                break
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"messages": count, "wall_s": wall, "cpu_s": cpu}))

asyncio.run(main())
"""


def aiomqtt3_python() -> str:
    python = AIOMQTT3_VENV / "bin" / "python"
    if not python.exists():
        print(f"making {AIOMQTT3_VENV} (aiomqtt 3.0.0a1) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIOMQTT3_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "aiomqtt==3.0.0a1"], check=True)
    return str(python)


# name -> (a function returning the python that runs the child, the child's code)
RECEIVERS: dict[str, tuple[Callable[[], str], str]] = {
    "connection": (lambda: sys.executable, CONNECTION_CHILD),
    "paho": (lambda: sys.executable, PAHO_CHILD),
    "aiomqtt3": (aiomqtt3_python, AIOMQTT3_CHILD),
}


# ------------------------------------------------------------------ harness


def session(client_id: str, *, keep: bool) -> None:
    """Create (subscribed, persistent) or clear the broker session of ``client_id``."""
    args = ["mosquitto_sub", "-h", HOST, "-p", str(PORT), "-V", "mqttv5", "-i", client_id]
    if keep:
        args += ["-c", "-x", "600", "-q", "1", "-t", FILTER, "-E"]
    else:
        args += ["-x", "0", "-t", FILTER, "-E"]
    subprocess.run(args, check=True, timeout=30)


def fill(n: int) -> float:
    """Publish ``n`` messages over 10 devices; return the seconds it took."""
    start = time.perf_counter()
    procs = []
    per = n // 10
    for d in range(10):
        lines = "".join(PAYLOAD.format(ts=1_700_000_000_000 + i) + "\n" for i in range(per))
        proc = subprocess.Popen(
            [
                "mosquitto_pub",
                "-h",
                HOST,
                "-p",
                str(PORT),
                "-V",
                "mqttv5",
                "-q",
                "1",
                "-D",
                "publish",
                "content-type",
                "application/json",
                "-t",
                TOPIC.format(device=f"d{d}"),
                "-l",
            ],
            stdin=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(lines)
        proc.stdin.close()
        procs.append(proc)
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise SystemExit("mosquitto_pub failed")
    return time.perf_counter() - start


def measure(name: str, n: int) -> dict[str, float]:
    python, code = RECEIVERS[name]
    client_id = f"bench-rx-{name}-{uuid.uuid4().hex[:6]}"
    exe = python()
    session(client_id, keep=True)
    try:
        fill_s = fill(n)
        out = subprocess.run(
            [exe, "-c", code, client_id, str(n), FILTER],
            check=False,
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    finally:
        session(client_id, keep=False)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["messages"] != n:
        raise SystemExit(f"{name}: received {result['messages']} of {n}")
    result["fill_s"] = fill_s
    result["us_per_msg"] = result["cpu_s"] / n * 1e6
    result["msg_per_s"] = n / result["wall_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--messages", type=int, default=100_000)
    parser.add_argument("--receivers", default=",".join(RECEIVERS), help="comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "receive")
    args = parser.parse_args()
    n = args.messages - args.messages % 10
    results: dict[str, dict[str, float]] = {}
    for name in args.receivers.split(","):
        print(f"{name}: {n} messages ...", flush=True)
        results[name] = measure(name, n)
        r = results[name]
        print(
            f"  {r['us_per_msg']:.1f} µs CPU/msg, {r['msg_per_s']:,.0f} msg/s "
            f"({r['cpu_s']:.2f} s CPU in {r['wall_s']:.2f} s)",
            flush=True,
        )
    command = "bench/receive.py " + " ".join(sys.argv[1:])
    meta = {
        "command": command.strip(),
        "messages": n,
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.with_suffix(".json").write_text(json.dumps(meta | {"results": results}, indent=2))
    base = results.get("paho")
    lines = [
        "# Receive-only micro-benchmark",
        "",
        f"`{meta['command']}` on {meta['host']}, {meta['when']}, {n:,} QoS 1 messages "
        "(MQTT v5 with a content type, ~190 bytes) drained from a persistent session "
        "on the local Mosquitto, each acknowledged on delivery. One run; the box is shared.",
        "",
        "| receiver | µs CPU per message | msg/s | vs paho CPU |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        ratio = f"{r['us_per_msg'] / base['us_per_msg']:.2f}x" if base else "n/a"
        lines.append(f"| {name} | {r['us_per_msg']:.1f} | {r['msg_per_s']:,.0f} | {ratio} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
