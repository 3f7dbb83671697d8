"""The broker alone: publish → PUBACK latency of the simulated fleet, and its stalls.

Publishes with ``gateway.tools.simulate.publish`` (the publisher every latency
figure in bench/ uses) at RATE msg/s for DURATION seconds, with nothing else
running, and times each QoS 1 publish from its ``sent_at`` stamp to the
broker's PUBACK. Prints the percentiles, the publisher's own CPU per message
(it shares the cores with whatever it measures), the publishes slower than
``--slow`` ms, and when those happened (seconds into the run), with the size
of the broker's persistence file before and after.

Why: Mosquitto (``autosave_on_changes true``, ``autosave_interval 5000`` in
mosquitto/) rewrites its whole store every 5,000 changes, and does nothing
else meanwhile. Every publish in flight then waits, and so does every
message's delivery; an end-to-end latency figure carries that wait whatever
the subscriber does. Run this before trusting a latency tail.

Usage: .venv/bin/python bench/publish_acks.py [--rate 500] [--duration 30] [--slow 400]
(the store is $STATE_DIR/mosquitto/mosquitto.db, .state/ by default, as make up starts it)
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import uvloop
from benchlib import broker_store_mb, fleet_spec, percentiles

from gateway.tools.simulate import publish


def store_size() -> str:
    mb = broker_store_mb()
    return "absent" if mb is None else f"{mb:,.1f} MB"


def clusters(times_s: list[float], gap_s: float = 0.5) -> list[tuple[float, int]]:
    """(start, count) of the runs of slow publishes less than gap_s apart."""
    out: list[tuple[float, int]] = []
    last = -gap_s
    for t in sorted(times_s):
        if out and t - last < gap_s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((t, 1))
        last = t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--slow", type=float, default=400, help="ms; default 400")
    args = parser.parse_args()
    acks: list[tuple[float, float]] = []  # (sent_at ms, publish → PUBACK ms)

    def on_sent(_topic: str, event: dict[str, Any]) -> None:
        acks.append((event["sent_at"], time.time() * 1000 - event["sent_at"]))

    spec = fleet_spec(f"acks{uuid.uuid4().hex[:6]}", args.devices, rate=args.rate)
    before = store_size()
    start_ms = time.time() * 1000
    cpu = time.process_time()
    stats = uvloop.run(publish(spec, duration=args.duration, on_sent=on_sent, status_every=3600))
    cpu = time.process_time() - cpu
    if not acks:
        raise SystemExit("no publish was acknowledged")
    p = percentiles([latency for _, latency in acks])
    slow = [(sent - start_ms) / 1000 for sent, latency in acks if latency > args.slow]
    print(
        f"published {stats.sent} at {stats.rate:.0f} msg/s; publish → PUBACK ms: "
        f"p50 {p['p50']:.1f}, p99 {p['p99']:.1f}, max {p['max']:.1f}"
    )
    print(f"publisher CPU: {cpu * 1e6 / max(stats.sent, 1):.0f} us per message")
    print(f"slower than {args.slow:g} ms: {len(slow)}")
    for at, count in clusters(slow):
        print(f"  {count} publishes from {at:.1f} s into the run")
    print(f"broker store: {before} before, {store_size()} after")


if __name__ == "__main__":
    main()
