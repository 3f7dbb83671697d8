"""What the spool costs: the same gateway with ``spool.enabled`` true and false.

Each case runs one gateway (`gateway run`, spool file in a fresh temp dir) through
two phases:

1. *drain*: a backlog of ``--count`` messages from ``--devices`` devices,
   published while the gateway is away (as bench/drain.py does), drained from
   the gateway's ready line until every message is written (or rejected, or
   sampled out): msg/s and the gateway's CPU (all threads) per message;
2. *live*: at a fixed moderate rate (``--rate`` msg/s from ``--live-devices``
   devices, for ``--live-seconds``) into the running gateway: latency from the
   ``sent_at`` in each payload to the WRITETIME of its stored telemetry row (as
   bench/phases/latency.py measures it: when the driver sent the row, so with
   the spool it includes the commit, the read back and the delete's queueing),
   CPU per message, and bytes written.

Bytes written are the gateway process's ``write_bytes`` (/proc/PID/io: what it
dirtied in the page cache, so what reaches the disk, before the file system's
own journal and metadata), per message; without the spool that is only its
log. The spool file (SQLite database plus its WAL) is measured at the end of
each phase.

Cases alternate (off, on, off, on, ...) so a noisy neighbour hurts both alike;
medians and min-max over ``--pairs`` pairs are reported.

Usage: .venv/bin/python bench/spool_cost.py [--pairs 3] [--count 10000] [--rate 100]
Writes bench/results/spool_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import rows
from benchlib import (
    BENCH,
    HANDLED,
    READY,
    BenchDb,
    Proc,
    apply_schema,
    clear_session,
    cpu_seconds,
    create_session,
    fleet_spec,
    gateway_env,
    percentiles,
    publish_recorded,
    run_tool,
    write_bytes,
)

RESULTS = BENCH / "results"
LOGS = Path("/tmp/spool_cost_logs")
DAY = 86_400


@dataclass
class Case:
    spool: bool
    pair: int
    drain_msgs: int = 0
    drain_msg_per_s: float = 0.0
    drain_cpu_us: float = 0.0
    drain_write_bytes_per_msg: float = 0.0
    live_offered: float = 0.0
    live_msgs: int = 0
    live_msg_per_s: float = 0.0
    live_cpu_us: float = 0.0
    live_write_bytes_per_msg: float = 0.0
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    latency_max_ms: float | None = None
    stored_ok: bool = False
    spool_file_bytes: int = 0  # database + WAL, largest seen at a phase's end
    note: str = ""

    @property
    def name(self) -> str:
        return "spool on" if self.spool else "spool off"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def spool_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("spool.sqlite*"))


def run_case(case: Case, db: BenchDb, args: argparse.Namespace) -> None:
    key = uuid.uuid4().hex[:6]
    root = f"gwb{key}"  # a tree of its own: other benches' load stays out
    cid, backlog, live = f"gwbench-spool-{key}", f"spb{key}", f"spl{key}"
    folder = Path(tempfile.mkdtemp(prefix="spool-cost-"))
    create_session(cid, root)  # fresh and empty: only what is published below is queued
    db.register_states([backlog, live])
    published, _ = publish_recorded(fleet_spec(backlog, args.devices, root=root), count=args.count)
    env = gateway_env(
        cid,
        root,
        SPOOL__ENABLED=str(case.spool).lower(),
        SPOOL__PATH=str(folder / "spool.sqlite"),
        SPOOL__COMMIT_DELAY=args.commit_delay,
        CASSANDRA__DRIVER=args.driver,
    )
    proc = Proc(
        case.name,
        [sys.executable, "-m", "gateway", "run"],
        env,
        LOGS / f"{case.name.replace(' ', '_')}_{case.pair}.log",
        [READY],
        HANDLED,
    ).start()
    try:
        proc.wait_ready(120)
        assert proc.ready_at is not None
        t0, cpu0, io0 = proc.ready_at, proc.ready_cpu, write_bytes(proc.pid)
        if not proc.wait_count(published.sent, timeout=args.timeout):
            case.note = f"drain stopped at {proc.count}/{published.sent}"
        t1, cpu1, io1 = time.monotonic(), cpu_seconds(proc.pid), write_bytes(proc.pid)
        n = max(proc.count, 1)
        case.drain_msgs = proc.count
        case.drain_msg_per_s = proc.count / (t1 - t0)
        case.drain_cpu_us = (cpu1 - cpu0) / n * 1e6
        case.drain_write_bytes_per_msg = (io1 - io0) / n
        case.spool_file_bytes = spool_bytes(folder)

        base = proc.count
        spec = fleet_spec(live, args.live_devices, rate=args.rate, root=root)
        stats, sent = publish_recorded(spec, duration=args.live_seconds)
        if not proc.wait_count(base + stats.sent, timeout=120):
            case.note += f" live run stopped at {proc.count - base}/{stats.sent}"
        cpu2, io2 = cpu_seconds(proc.pid), write_bytes(proc.pid)
        n = max(proc.count - base, 1)
        case.live_offered = args.rate
        case.live_msgs = proc.count - base
        case.live_msg_per_s = stats.rate
        case.live_cpu_us = (cpu2 - cpu1) / n * 1e6
        case.live_write_bytes_per_msg = (io2 - io1) / n
        case.spool_file_bytes = max(case.spool_file_bytes, spool_bytes(folder))
    finally:
        proc.stop()
        clear_session(cid)
        shutil.rmtree(folder, ignore_errors=True)
    check = db.check(live, sent, latest=False)
    case.stored_ok = check.ok
    p = percentiles(check.latency_ms)
    case.latency_p50_ms, case.latency_p99_ms, case.latency_max_ms = p["p50"], p["p99"], p["max"]
    say(
        f"{case.name} (pair {case.pair}): drain {case.drain_msg_per_s:.0f} msg/s, "
        f"{case.drain_cpu_us:.0f} us CPU/msg, {case.drain_write_bytes_per_msg:.0f} B/msg written; "
        f"live {case.live_msg_per_s:.0f} msg/s: p50 {case.latency_p50_ms or 0:.1f} ms, "
        f"p99 {case.latency_p99_ms or 0:.1f} ms, {case.live_cpu_us:.0f} us CPU/msg, "
        f"{case.live_write_bytes_per_msg:.0f} B/msg written; stored {check.text()} {case.note}"
    )


# (field, heading, format)
FIGURES = [
    ("drain_msg_per_s", "drain msg/s", "{:,.0f}"),
    ("drain_cpu_us", "drain CPU µs/msg", "{:,.0f}"),
    ("drain_write_bytes_per_msg", "drain bytes written/msg", "{:,.0f}"),
    ("live_cpu_us", "live CPU µs/msg", "{:,.0f}"),
    ("latency_p50_ms", "live latency p50 ms", "{:,.1f}"),
    ("latency_p99_ms", "live latency p99 ms", "{:,.1f}"),
    ("live_write_bytes_per_msg", "live bytes written/msg", "{:,.0f}"),
    ("spool_file_bytes", "spool file bytes (db + WAL)", "{:,.0f}"),
]


def summary(cases: list[Case]) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode and figure: median, min and max over the pairs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode in ("spool off", "spool on"):
        mine = [c for c in cases if c.name == mode]
        out[mode] = {}
        for name, _, _ in FIGURES:
            values = [float(v) for c in mine if (v := getattr(c, name)) is not None]
            if values:
                out[mode][name] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
    return out


def markdown(data: dict[str, Any]) -> str:
    args, cases = data["args"], [Case(**c) for c in data["cases"]]
    s = data["summary"]
    lines = [
        "# What the spool costs",
        "",
        f"Command: `{data['command']}` ({data['when']}).",
        f"Per case: a backlog of {args['count']:,} messages from {args['devices']:,} devices "
        f"drained, then {args['rate']:g} msg/s from {args['live_devices']} devices for "
        f"{args['live_seconds']:g} s into the running gateway (driver {args['driver']}, "
        f"spool.commit_delay {args.get('commit_delay', '0 (before it existed)')}). "
        "Off and on alternate; medians and [min-max] over "
        f"{len(cases) // 2} pairs. Bytes written: the gateway's /proc/PID/io "
        "`write_bytes` per message (without the spool, only its log). "
        "2 shared cores, other work running.",
        "",
        "| | spool off | spool on | on / off |",
        "|---|---:|---:|---:|",
    ]
    for name, heading, fmt in FIGURES:
        off, on = s["spool off"].get(name), s["spool on"].get(name)

        def cell(v: dict[str, float] | None, fmt: str = fmt) -> str:
            if v is None:
                return ""
            return f"{fmt.format(v['median'])} [{fmt.format(v['min'])}-{fmt.format(v['max'])}]"

        ratio = f"{on['median'] / off['median']:.2f}" if on and off and off["median"] else ""
        lines.append(f"| {heading} | {cell(off)} | {cell(on)} | {ratio} |")
    wear = data["wear"]
    lines += [
        "",
        f"SD-card wear with the spool: {wear['bytes_per_msg']:,.0f} bytes written per message "
        f"at {args['rate']:g} msg/s (live median, minus the log's "
        f"{wear['log_bytes_per_msg']:,.0f}), so {wear['gb_per_day']:,.2f} GB a day and "
        f"{wear['gb_per_day'] * 365 / 1000:,.2f} TB a year at that rate. Not at others: "
        "the more messages share a commit, the fewer bytes each (spool.commit_delay), so "
        "measure another rate with --rate.",
    ]
    lines += ["", "Every case:", ""]
    lines.append(
        "| case | pair | drain msg/s | drain µs/msg | drain B/msg | live msg/s | live µs/msg "
        "| p50 / p99 ms | live B/msg | spool file B | stored | note |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|")
    for c in cases:
        lines.append(
            f"| {c.name} | {c.pair} | {c.drain_msg_per_s:,.0f} | {c.drain_cpu_us:,.0f} "
            f"| {c.drain_write_bytes_per_msg:,.0f} | {c.live_msg_per_s:,.0f} "
            f"| {c.live_cpu_us:,.0f} | {c.latency_p50_ms or 0:.1f} / {c.latency_p99_ms or 0:.1f} "
            f"| {c.live_write_bytes_per_msg:,.0f} | {c.spool_file_bytes:,} "
            f"| {'ok' if c.stored_ok else 'MISMATCH'} | {c.note} |"
        )
    return "\n".join(lines) + "\n"


def wear(summary: dict[str, dict[str, dict[str, float]]], rate: float) -> dict[str, Any]:
    """Bytes the spool writes per message at the live rate, and per day at it."""
    on = summary["spool on"]["live_write_bytes_per_msg"]["median"]
    log = summary["spool off"]["live_write_bytes_per_msg"]["median"]
    per_msg = max(on - log, 0.0)
    return {
        "bytes_per_msg": per_msg,
        "log_bytes_per_msg": log,
        "gb_per_day": per_msg * rate * DAY / 1e9,
    }


def save(cases: list[Case], args: argparse.Namespace, out: str) -> str:
    data: dict[str, Any] = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(args),
        "cases": [asdict(c) for c in cases],
    }
    data["summary"] = summary(cases)
    text = ""
    if all(data["summary"][m] for m in ("spool off", "spool on")):
        data["wear"] = wear(data["summary"], args.rate)
        text = markdown(data)
        Path(out + ".md").write_text(text)
    Path(out + ".json").write_text(json.dumps(data, indent=1) + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--count", type=int, default=10_000, help="backlog per drain")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="live msg/s")
    parser.add_argument("--live-devices", type=int, default=100)
    parser.add_argument("--live-seconds", type=float, default=20.0)
    parser.add_argument("--driver", default="auto", help="cassandra.driver")
    parser.add_argument(
        "--commit-delay", default="100ms", help="spool.commit_delay (the gateway's default)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="cap per drain, s")
    parser.add_argument("--out", default=str(RESULTS / "spool_cost"), help="results path stem")
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    apply_schema()
    db = BenchDb(rows.KEYSPACE)
    cases: list[Case] = []
    try:
        for pair in range(1, args.pairs + 1):
            for spool in (False, True):
                case = Case(spool=spool, pair=pair)
                say(f"{case.name}, pair {pair}")
                run_case(case, db, args)
                cases.append(case)
                save(cases, args, args.out)  # a run cut short keeps what it measured
    finally:
        db.close()
    print(save(cases, args, args.out))


if __name__ == "__main__":
    run_tool(main)
