"""How long `gateway run` takes to start with Cassandra a slow link away.

Each case starts `gateway run` against gateway/tools/delay_proxy.py (every
byte delayed by half the round trip each way) and times from the process's
start to the line that says it subscribed (the last step before READY), and
to each log line before it, so the slow steps show. The keyspace is `make
up`'s; the gateway's client id is fresh each time (a broker session of its
own, cleared after).

Usage: .venv/bin/python bench/start_time.py [--rtts 0 100 1000] [--runs 1]
Prints a table; over 1 s round trips the start took 75 s (before the
statements were prepared together), 48 s (before the sessions opened
together), and 19 s since.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import clear_session

from gateway.tools.delay_proxy import DelayProxy

READY_LINE = "subscribed to"
CQL = ("127.0.0.1", 9042)


async def one_start(rtt_ms: float, client_id: str) -> tuple[float, list[tuple[float, str]]]:
    """Seconds to the subscribed line, and (seconds, message) of each log line."""
    async with DelayProxy(*CQL, delay=rtt_ms / 2000) as proxy:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {
            "GATEWAY_CASSANDRA__PORT": str(proxy.port),
            "GATEWAY_MQTT__CLIENT_ID": client_id,
            "GATEWAY_API__PORT": "0",
        }
        with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "run", env=env, stdout=log, stderr=log
            )
            lines: list[tuple[float, str]] = []
            try:
                while True:
                    await asyncio.sleep(0.05)
                    text = await asyncio.to_thread(Path(log.name).read_text)
                    for line in text.splitlines()[len(lines) :]:
                        lines.append((time.monotonic() - started, line.split(" ", 2)[-1]))
                    if READY_LINE in text:
                        return time.monotonic() - started, lines
                    if proc.returncode is not None:
                        raise SystemExit(f"gateway exited:\n{text[-2000:]}")
            finally:
                if proc.returncode is None:
                    proc.terminate()
                    await proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", type=float, nargs="+", default=[0, 100, 1000], metavar="MS")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", action="store_true", help="print each run's log lines, timed")
    args = parser.parse_args()
    print("| round trip | start to subscribed (s) |")
    print("|---:|---|")
    for rtt in args.rtts:
        took = []
        for _ in range(args.runs):
            client_id = f"bench-start-{uuid.uuid4().hex[:8]}"
            try:
                seconds, lines = asyncio.run(one_start(rtt, client_id))
            finally:
                clear_session(client_id)
            took.append(seconds)
            if args.steps:
                for at, message in lines:
                    print(f"  {at:6.1f} s  {message[:110]}", file=sys.stderr)
        print(f"| {rtt:.0f} ms | {', '.join(f'{t:.1f}' for t in took)} |", flush=True)


if __name__ == "__main__":
    main()
