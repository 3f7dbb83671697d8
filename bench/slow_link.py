"""Gateway throughput with Cassandra 0, 20, 50 and 100 ms round trip away.

Each case drains a backlog held by the broker (as bench/run.py does: publish
while the gateway is away, then start it and count acknowledged messages),
with the gateway writing through gateway/tools/delay_proxy.py, which delays
every byte by half the round trip in each direction without costing bandwidth.
The proxy runs on its own event loop in a thread of this process, which sleeps
while the gateway drains. Cases:

* ``local``: straight to Cassandra, no proxy (the reference figure);
* each round trip with the adaptive in-flight limit (the default) and with
  the old fixed cap (``adaptive_in_flight = false``, ``max_in_flight = 64``);
* at 50 ms, the Python driver without and with lz4 protocol compression
  (bytes through the proxy per message, and throughput);
* ``local`` with the Python driver: CPU per message against acsylla's.

A drain stops at ``--count`` messages or after ``--seconds``, whichever comes
first; msg/s is acknowledged messages / seconds since the gateway was ready,
so start-up (the limit starts at 64 and has to grow) is included. CPU is the
gateway process's (all threads) over the same span.

Usage: .venv/bin/python bench/slow_link.py [--count 20000] [--seconds 30]
       [--rtts 0 20 50 100] [--quick] [--only CASE ...]
       [--gateway-env GATEWAY_PIPELINE__BATCH_MAX_EVENTS=500]
Writes bench/results/slow_link.{json,md}. The box has 2 shared cores and
Cassandra, Mosquitto, the publisher and the gateway share them: expect ±30%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import rows
from benchlib import (
    BENCH,
    Proc,
    add_gateway_env,
    apply_schema,
    clear_session,
    connect_cluster,
    cpu_seconds,
    create_session,
    fleet_spec,
    gateway_settings,
    publish_recorded,
    run_tool,
)
from cassandra.cluster import Session

from gateway.tools.delay_proxy import DelayProxy

RESULTS = BENCH / "results"
LOGS = Path("/tmp/slow_link_logs")
CQL = ("127.0.0.1", 9042)
ACKED = re.compile(r"status: .*acked=(\d+)")
LIMIT = re.compile(r"status: .*in_flight=\d+/(\d+)")


@dataclass
class Case:
    name: str
    rtt_ms: float | None  # None: no proxy
    adaptive: bool = True
    driver: str = "acsylla"
    compression: str = "none"
    # Filled in by the run.
    msg_per_s: float = 0.0
    acked: int = 0
    seconds: float = 0.0
    cpu_us_per_msg: float = 0.0
    limit_last: int | None = None
    limit_max: int | None = None
    bytes_per_msg: float | None = None
    ratio_to_local: float | None = None
    ratio_to_proxy0: float | None = None  # to the 0 ms proxy case: same proxy CPU
    note: str = ""
    settings: dict[str, str] = field(default_factory=dict)  # --gateway-env, applied last

    def env(self, cid: str, port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {
            "GATEWAY_MQTT__CLIENT_ID": cid,
            "GATEWAY_MQTT__SESSION_EXPIRY": "600",
            "GATEWAY_CASSANDRA__KEYSPACE": rows.KEYSPACE,
            "GATEWAY_CASSANDRA__PORT": str(port),
            "GATEWAY_CASSANDRA__DRIVER": self.driver,
            "GATEWAY_CASSANDRA__COMPRESSION": self.compression,
            "GATEWAY_TOPICS": '[{template = "gwbench/{tenant}/devices/{device_id}/events"}]',
            "GATEWAY_PIPELINE__STATUS_INTERVAL": "200ms",
            "GATEWAY_API__PORT": "0",
        }
        if not self.adaptive:
            env["GATEWAY_CASSANDRA__ADAPTIVE_IN_FLIGHT"] = "false"
            env["GATEWAY_CASSANDRA__MAX_IN_FLIGHT"] = "64"
        return env | self.settings


@dataclass
class Run:
    args: dict[str, Any]
    cases: list[Case] = field(default_factory=list)


class ProxyThread:
    """A DelayProxy on its own event loop in a daemon thread."""

    def __init__(self, rtt_ms: float) -> None:
        self.proxy = DelayProxy(*CQL, delay=rtt_ms / 2000)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.__aenter__(), self._loop).result(10)
        return self.proxy

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextmanager
def link(rtt_ms: float | None) -> Iterator[DelayProxy | None]:
    if rtt_ms is None:
        yield None
        return
    with ProxyThread(rtt_ms) as proxy:
        yield proxy


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def register_states(session: Session, tenant: str) -> None:
    """The tenant's states known for a day: a steady state, as bench/run.py sets up
    (BenchDb.register_states; its read-back queries are not needed here)."""
    since = int((time.time() - 86400) * 1000)
    insert = session.prepare(
        f"INSERT INTO {rows.KEYSPACE}.tenant_states (tenant, state, registered_at) VALUES (?, ?, ?)"
    )
    for state in rows.STATES:
        session.execute(insert, (tenant, state, since))


def spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy (from the venv) sampling the gateway, as bench/drain.py --profile does."""
    py_spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(py_spy), "record", "--pid", str(pid), "--format", "raw", "--output", str(out)]
    return subprocess.Popen([*cmd, "--rate", "250", "--threads"], stdout=subprocess.DEVNULL)


def drain(
    case: Case, db: Session, count: int, devices: int, seconds: float, profile: Path | None
) -> None:
    key = uuid.uuid4().hex[:6]
    cid, tenant = f"gwbench-link-{key}", f"link{key}"
    create_session(cid)  # fresh and empty: only the backlog below is queued
    register_states(db, tenant)
    stats, _ = publish_recorded(fleet_spec(tenant, devices), count=count)
    with link(case.rtt_ms) as proxy:
        port = CQL[1] if proxy is None else proxy.port
        proc = Proc(
            case.name,
            [sys.executable, "-m", "gateway", "run"],
            case.env(cid, port),
            LOGS / f"{case.name.replace(' ', '_')}.log",
            [re.compile(r"connected to mqtt://")],
            ACKED,
        ).start()
        try:
            proc.wait_ready(120)
            assert proc.ready_at is not None
            profiler = None
            if profile is not None:
                profiler = spy(proc.pid, profile / f"{case.name.replace(' ', '_')}.txt")
            bytes0 = (proxy.bytes_in + proxy.bytes_out) if proxy else 0
            limits: list[int] = []
            offset = 0
            deadline = proc.ready_at + seconds
            while proc.count < stats.sent and time.monotonic() < deadline:
                proc.wait_count(stats.sent, timeout=0.5)
                text = proc.log.read_text(errors="replace")
                limits += [int(m.group(1)) for m in LIMIT.finditer(text, offset)]
                offset = len(text)
            case.seconds = time.monotonic() - proc.ready_at
            cpu = cpu_seconds(proc.pid) - proc.ready_cpu
            case.acked = proc.count
            case.msg_per_s = proc.count / case.seconds
            case.cpu_us_per_msg = cpu / max(proc.count, 1) * 1e6
            if limits:
                case.limit_last, case.limit_max = limits[-1], max(limits)
            if proxy is not None and proc.count:
                moved = proxy.bytes_in + proxy.bytes_out - bytes0
                case.bytes_per_msg = moved / proc.count
            if proc.count < stats.sent:
                case.note = f"stopped at {seconds:.0f} s: {proc.count}/{stats.sent}"
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                profiler.wait(60)
        finally:
            proc.stop()
            clear_session(cid)
    say(
        f"{case.name}: {case.msg_per_s:.0f} msg/s, {case.cpu_us_per_msg:.0f} us CPU/msg, "
        f"limit {case.limit_last} (max {case.limit_max}), "
        f"{case.bytes_per_msg or 0:.0f} B/msg {case.note}"
    )


def cases(rtts: list[float], quick: bool) -> list[Case]:
    out = [Case("local", None), Case("local fixed64", None, adaptive=False)]
    for rtt in rtts:
        out.append(Case(f"{rtt:g}ms adaptive", rtt))
        out.append(Case(f"{rtt:g}ms fixed64", rtt, adaptive=False))
    if not quick:
        # The Python driver (ARM hosts) over the same round trips, and lz4 at 50 ms.
        out.append(Case("local python", None, driver="python"))
        for rtt in dict.fromkeys((0.0, *rtts)):
            out.append(Case(f"{rtt:g}ms python", rtt, driver="python"))
        out.append(Case("50ms python lz4", 50, driver="python", compression="lz4"))
    return out


def markdown(run: Run, command: str) -> str:
    local = {c.driver: c.msg_per_s for c in run.cases if c.rtt_ms is None and c.adaptive}
    proxy0 = {c.driver: c.msg_per_s for c in run.cases if c.rtt_ms == 0 and c.adaptive}
    lines = [
        "# A slow link to Cassandra",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
        f"Backlog of {run.args['count']} messages from {run.args['devices']} devices per "
        f"case, each drain stopped after {run.args['seconds']:.0f} s at most; msg/s counts "
        "from the gateway's ready line (start-up of the limit included). The proxy runs "
        "in Python on the same 2 cores, so `x 0 ms` (against the adaptive case through the "
        "proxy at 0 ms) compares like with like; `x local` is against the direct adaptive "
        "case. One run on the 2-core shared box: figures move by ±30% between runs.",
        "",
        "| Case | RTT ms | Limit | Driver | msg/s | x local | x 0 ms | CPU µs/msg "
        "| limit last (max) | bytes/msg via proxy | Note |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for c in run.cases:
        ref, ref0 = local.get(c.driver), proxy0.get(c.driver)
        c.ratio_to_local = c.msg_per_s / ref if ref else None
        c.ratio_to_proxy0 = c.msg_per_s / ref0 if ref0 and c.rtt_ms is not None else None
        x0 = "" if c.ratio_to_proxy0 is None else f"{c.ratio_to_proxy0:.2f}"
        lines.append(
            f"| {c.name} | {'direct' if c.rtt_ms is None else f'{c.rtt_ms:g}'} "
            f"| {'adaptive' if c.adaptive else 'fixed 64'} | {c.driver}"
            f"{' + ' + c.compression if c.compression != 'none' else ''} "
            f"| {c.msg_per_s:,.0f} | {c.ratio_to_local or 0:.2f} | {x0} | {c.cpu_us_per_msg:.0f} "
            f"| {c.limit_last} ({c.limit_max}) "
            f"| {'' if c.bytes_per_msg is None else f'{c.bytes_per_msg:,.0f}'} | {c.note} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0, help="cap per drain")
    parser.add_argument("--rtts", type=float, nargs="+", default=[0, 20, 50, 100])
    parser.add_argument("--quick", action="store_true", help="no python-driver cases")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    add_gateway_env(parser, "a setting for every case's gateway (repeatable), applied last")
    parser.add_argument("--out", default=str(RESULTS / "slow_link"), help="results path stem")
    parser.add_argument(
        "--profile", type=Path, help="py-spy each gateway into this folder (bench/profile_top.py)"
    )
    parser.add_argument("--render", type=Path, help="only rewrite the .md of this results .json")
    args = parser.parse_args()
    if args.render is not None:
        data = json.loads(args.render.read_text())
        known = set(Case.__dataclass_fields__)
        loaded = [Case(**{k: v for k, v in c.items() if k in known}) for c in data["cases"]]
        old = Run(args=data["args"], cases=loaded)
        args.render.with_suffix(".md").write_text(markdown(old, data["command"]))
        return
    LOGS.mkdir(parents=True, exist_ok=True)
    apply_schema()
    cluster, db = connect_cluster()
    run = Run(args=vars(args))
    try:
        for case in cases(args.rtts, args.quick):
            if args.only and case.name not in args.only:
                continue
            case.settings = gateway_settings(args.gateway_env)
            say(f"case {case.name}")
            drain(case, db, args.count, args.devices, args.seconds, args.profile)
            run.cases.append(case)
            save(run, args.out)  # after every case: a long run cut short keeps what it measured
    finally:
        cluster.shutdown()
    print(save(run, args.out))


def save(run: Run, out: str) -> str:
    command = " ".join([".venv/bin/python", *sys.argv])
    text = markdown(run, command)
    Path(out + ".md").write_text(text)
    data = {"command": command, **asdict(run)}
    Path(out + ".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return text


if __name__ == "__main__":
    run_tool(main)
