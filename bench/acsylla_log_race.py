"""Does closing acsylla clusters crash a process whose other sessions log?

acsylla gives the C++ driver one logging callback for the whole process: each
cluster object it creates sets it, and each one closed clears it and frees
what the callback writes to, with no lock against the driver's threads. This
runs, in a child process each time, one session sending requests while the
C++ driver logs at ``trace`` (every request logs), and beside it, for
``--seconds``:

* ``clusters``: clusters created and closed as fast as the loop allows, as
  `gateway run` did with a cluster per session (each replacement of a
  session that gave its host up made one and closed one);
* ``sessions``: sessions opened and closed on the one shared cluster, as it
  does now (``SharedClusters`` in gateway/store/write_session.py).

``--level disabled`` is the control: the same work with the driver silent.

and prints how each child ended: killed by a signal (SIGSEGV, SIGABRT) with
the first line it wrote, hung (killed at ``--seconds`` + 30), or normally. Needs the local Cassandra
(``make up``). Usage:
    .venv/bin/python bench/acsylla_log_race.py [--runs 5] [--seconds 20]
        [--modes clusters,sessions] [--level trace|disabled|warn]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import signal
import subprocess
import sys
import time
from typing import Any

STATEMENT = "SELECT release_version FROM system.local"


async def _child(mode: str, seconds: float, level: str) -> None:
    import acsylla  # noqa: PLC0415 - only the child needs it

    logged = 0

    def count(_message: Any) -> None:
        nonlocal logged
        logged += 1

    def cluster() -> Any:
        return acsylla.create_cluster(["127.0.0.1"], log_level=level, logging_callback=count)

    kept = cluster()
    session = await kept.create_session()
    stop = asyncio.Event()

    async def load() -> int:
        statement = acsylla.create_statement(STATEMENT)
        sent = 0
        while not stop.is_set():
            await asyncio.gather(*(session.execute(statement) for _ in range(20)))
            sent += 20
        return sent

    task = asyncio.create_task(load())
    rounds = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mode == "clusters":
            other = cluster()
            await asyncio.sleep(0)
            other.destroy()
        else:
            opened = await kept.create_session()
            await opened.close()
        rounds += 1
    stop.set()
    sent = await task
    await session.close()
    kept.destroy()
    print(f"{rounds} {sent} {logged}", flush=True)


def _run(mode: str, seconds: float, level: str) -> str:
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode, f"--seconds={seconds}", f"--level={level}"],
            check=False,
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
    except subprocess.TimeoutExpired:
        return f"hung (killed after {time.monotonic() - started:.0f} s)"
    if done.returncode == 0:
        rounds, sent, logged = done.stdout.split()
        return f"ended normally: {rounds} rounds, {sent} requests, {logged} driver lines"
    said = [line for line in done.stderr.splitlines() if line and not line.startswith(" ")]
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return f"killed by {name} after {time.monotonic() - started:.1f} s: {said[:1]}"
    return f"exit {done.returncode}: {said[-1:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--modes", default="clusters,sessions")
    parser.add_argument(
        "--level", default="trace", help="the C++ driver's log level (disabled: a control)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        faulthandler.enable()
        asyncio.run(_child(args.child, args.seconds, args.level))
        return
    for run in range(1, args.runs + 1):
        for mode in args.modes.split(","):
            outcome = _run(mode, args.seconds, args.level)
            print(f"run {run}, {mode}, log level {args.level}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
