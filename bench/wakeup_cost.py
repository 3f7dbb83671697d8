"""What one event-loop wake-up costs on this machine, doing nothing else.

A uvloop loop sleeps ``1/rate`` seconds at a time for --seconds and reports
the CPU it spent per wake-up (``time.process_time``). On a VM this is the
floor under every message a live, sparse stream makes the gateway handle
(bench/PERFORMANCE.md, "Live streams"). Rates above 1,000 are not meaningful:
uvloop rounds sleeps below a millisecond down to none, and the loop spins.

Usage: .venv/bin/python bench/wakeup_cost.py [--rates 100,500,1000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop


async def wakeups(rate: float, seconds: float) -> tuple[int, float]:
    """(wake-ups, CPU seconds) of sleeping 1/rate at a time for ``seconds``."""
    count = 0
    cpu0, end = time.process_time(), time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(1 / rate)
        count += 1
    return count, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--rates", default="100,500,1000", help="wake-ups per second, comma-separated"
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    for rate in (float(r) for r in args.rates.split(",")):
        count, cpu = uvloop.run(wakeups(rate, args.seconds))
        each = cpu / count * 1e6
        print(f"{rate:.0f}/s asked: {count} wake-ups, {cpu:.2f} CPU s, {each:.1f} us each")


if __name__ == "__main__":
    main()
