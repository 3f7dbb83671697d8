"""Sustained gateway throughput: drain a backlog held by the broker.

1. Start `gateway run` once so its persistent session exists, then stop it.
2. Publish N events from a simulated fleet while the gateway is away
   (the broker queues them for the session).
3. Start the gateway again and time how long it takes to write all N.

This measures the gateway alone (no publisher competing for the 2 cores).
Usage: .venv/bin/python bench/drain.py --devices 1000 --count 30000 [--profile stacks.txt]
(--profile: py-spy's collapsed stacks of the gateway during the drain; summarise
them with bench/profile_top.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchlib import (
    add_warm_up,
    clear_session,
    maybe_warm_up,
    run_tool,
    services_cpu,
    services_cpu_since,
    stop_process,
)

from gateway.tools.simulate import FleetSpec, publish

# Handled = written + sampled out (a noisy device's sampled events are decided too).
STATUS = re.compile(r"written=(\d+).*sampled_out=(\d+)")


def gateway(env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    # Output to a file, never a pipe nobody drains (a full pipe blocks the gateway).
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "run"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


@contextmanager
def gateway_session(env: dict[str, str], log: str) -> Iterator[subprocess.Popen[bytes]]:
    """`gateway run` (:func:`gateway`) for the block; then stopped with
    SIGTERM (so its log ends with its "stopped:" counts; killed if still there
    30 s later), and its MQTT session cleared (a session left behind queues
    every later bench publish: bench/PERFORMANCE.md)."""
    proc = gateway(env, log)
    try:
        yield proc
    finally:
        stop_process(proc, 30)
        clear_session(env["GATEWAY_MQTT__CLIENT_ID"])


def follow(proc: subprocess.Popen[bytes], log: str) -> Iterator[str]:
    with open(log) as lines:
        while True:
            line = lines.readline()
            if line:
                yield line
            elif proc.poll() is not None:
                raise SystemExit(f"gateway exited:\n{Path(log).read_text()[-2000:]}")
            else:
                time.sleep(0.05)


def wait_line(proc: subprocess.Popen[bytes], log: str, pattern: str) -> None:
    for line in follow(proc, log):
        if pattern in line:
            return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--count", type=int, default=30000)
    parser.add_argument("--format", default="json")
    parser.add_argument("--noisy", type=float, default=0.0)
    parser.add_argument(
        "--profile", metavar="FILE", help="py-spy the gateway during the drain (collapsed stacks)"
    )
    add_warm_up(parser)
    args = parser.parse_args()
    maybe_warm_up(args.warm_up, args.devices)
    client_id = f"bench-{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        GATEWAY_MQTT__CLIENT_ID=client_id,
        # Its status lines end the measurement: every 0.1 s, so that a drain of
        # a few seconds is not rounded to whole seconds.
        GATEWAY_PIPELINE__STATUS_INTERVAL="0.1",
        GATEWAY_API__PORT="0",
        GATEWAY_MQTT__SESSION_EXPIRY="600",
    )
    log = f"/tmp/{client_id}.log"
    try:
        drain(args, env, log)
    finally:
        # Also when the gateway died mid-drain: a session left behind stays
        # subscribed to the whole fleet's tree and queues every later bench
        # publish until it expires, growing the broker's store (whose
        # autosaves then stall every client: publish_acks.py).
        clear_session(client_id)


def drain(args: argparse.Namespace, env: dict[str, str], log: str) -> None:
    proc = gateway(env, log)
    try:
        wait_line(proc, log, "subscribed to")  # its session exists
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    tenant = f"bench{uuid.uuid4().hex[:6]}"
    spec = FleetSpec(
        devices=args.devices, rate=1e9, fmt=args.format, noisy=args.noisy, tenant=tenant
    )
    t0 = time.monotonic()
    stats = asyncio.run(publish(spec, count=args.count, status_every=3600))
    print(f"published {stats.sent} in {time.monotonic() - t0:.1f} s while the gateway was away")
    proc = gateway(env, log)
    try:
        measure(args, proc, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def measure(args: argparse.Namespace, proc: subprocess.Popen[bytes], log: str) -> None:
    start = time.monotonic()
    cpu0 = None
    written = 0
    threads0 = dict.fromkeys(THREAD_GROUPS, 0.0)
    services0 = services_cpu()
    profiler: subprocess.Popen[bytes] | None = None
    for line in follow(proc, log):
        if cpu0 is None and "subscribed to" in line:
            start = time.monotonic()
            cpu0 = _cpu(proc.pid)
            threads0 = thread_cpu(proc.pid)
            services0 = services_cpu()
            if args.profile:
                profiler = spy(proc.pid, args.profile)
        if (m := STATUS.search(line)) and "status:" in line:
            written = int(m.group(1)) + int(m.group(2))
            if written >= args.count:
                break
    elapsed = time.monotonic() - start
    cpu = _cpu(proc.pid) - (cpu0 or 0.0)
    services = services_cpu_since(services0, written)
    threads = thread_cpu_since(proc.pid, threads0)
    rss = _rss_mb(proc.pid)
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        profiler.wait(60)
    # Status lines come every 0.1 s, so the rate is a slight underestimate.
    print(
        f"drained {written} events in {elapsed:.1f} s: {written / elapsed:.0f} events/s, "
        f"gateway CPU {cpu / written * 1e6:.0f} us/event, RSS {rss:.0f} MB "
        f"(devices={args.devices}, format={args.format})"
    )
    split = ", ".join(
        f"{name} {seconds / written * 1e6:.0f}"
        for name, seconds in sorted(threads.items(), key=lambda item: item[1], reverse=True)
        if seconds > 0
    )
    print(f"  by thread, us/event: {split}")
    print(
        "  the local services over the same drain, us/event: "
        + ", ".join(f"{name} {'-' if us is None else f'{us:.0f}'}" for name, us in services.items())
    )
    # Roll-ups earlier runs left due in this keyspace are done during the
    # drain, and cost it (bench/PERFORMANCE.md, "Two runs from fresh clones"): say from when.
    for line in Path(log).read_text().splitlines():
        if "still to do" in line:
            print("  " + line.split(": ", 1)[-1])


def spy(pid: int, out: str) -> subprocess.Popen[bytes]:
    """py-spy (from the venv) sampling the gateway, idle time excluded."""
    py_spy = Path(sys.executable).with_name("py-spy")
    if not py_spy.exists():
        sys.exit(f"--profile needs py-spy at {py_spy}: .venv/bin/pip install -e '.[bench]'")
    cmd = [str(py_spy), "record", "--pid", str(pid), "--format", "raw", "--output", out]
    if os.environ.get("DRAIN_PROFILE_NATIVE") == "1":  # C frames too (mypyc, the driver)
        cmd.append("--native")
    return subprocess.Popen([*cmd, "--rate", "250", "--threads"], stdout=subprocess.DEVNULL)


def _cpu(pid: int) -> float:
    return _cpu_of(Path(f"/proc/{pid}/stat"))


THREAD_GROUPS = ("event loop", "other threads")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the event loop's thread ("event loop") and of all the
    others together ("other threads": the C++ driver's IO threads, or the
    Python driver's; they share the process's name, so they are told apart
    by thread id). Both keys are always there (0.0 for none)."""
    by_thread = dict.fromkeys(THREAD_GROUPS, 0.0)
    for task in Path(f"/proc/{pid}/task").iterdir():
        name = "event loop" if task.name == str(pid) else "other threads"
        try:
            by_thread[name] += _cpu_of(task / "stat")
        except OSError:
            continue  # the thread ended meanwhile
    return by_thread


def thread_cpu_since(pid: int, before: dict[str, float]) -> dict[str, float]:
    """:func:`thread_cpu` less ``before`` (an earlier :func:`thread_cpu`)."""
    return {name: seconds - before[name] for name, seconds in thread_cpu(pid).items()}


def _cpu_of(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    run_tool(main)
