"""The Python driver's CPU per message against acsylla's, before and after a change.

ARM hosts write through cassandra-driver (acsylla has no aarch64 wheels). Each
case drains the same backlog (``--count`` messages from ``--devices`` devices,
published while the gateway is away, as bench/drain.py does) through one
`gateway run` and reports msg/s and the gateway's CPU (all threads) per message,
from its ready line until every message is written (or rejected, or sampled out).

Variants, run in rounds (one of each per round, in this order) so that a noisy
neighbour hurts all alike:

* ``acsylla``: this checkout, ``cassandra.driver = "acsylla"``;
* ``python``: this checkout, ``cassandra.driver = "python"``;
* ``python before``: the same, with the gateway's code of ``--before`` (a git
  ref, default ``BEFORE_PACKING``: main just before the Python path packed
  partitions into shared requests, what bench/results/python_driver.md
  compares with), extracted into a temp dir and put first on PYTHONPATH.
  Omitted with ``--before ""``. ``--before-driver acsylla`` makes it
  ``acsylla before`` (bench/results/acsylla_packing.md: acsylla before and
  after it packed partitions too).

Reported: per variant the median and min-max over the rounds, and the ratios
python / acsylla of the medians and of each round.

Usage: .venv/bin/python bench/python_driver.py [--rounds 3] [--count 30000] [--before REF]
       [--before-driver python|acsylla]; --render RESULTS.json rewrites its .md
Writes bench/results/python_driver.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
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
    ROOT,
    BenchDb,
    Proc,
    apply_schema,
    clear_session,
    cpu_seconds,
    create_session,
    fleet_spec,
    gateway_env,
    publish_recorded,
    run_tool,
)

RESULTS = BENCH / "results"
# main before the packing was merged: "main" itself has it now, and would
# compare the Python path with itself.
BEFORE_PACKING = "9cb0ef7"
LOGS = Path("/tmp/python_driver_logs")


@dataclass
class Case:
    variant: str
    round: int
    driver: str
    msgs: int = 0
    seconds: float = 0.0
    msg_per_s: float = 0.0
    cpu_us: float = 0.0
    requests_per_msg: float | None = None
    note: str = ""


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def extract(ref: str) -> tuple[Path, str]:
    """The gateway package of ``ref`` in a temp dir (its links resolved): the dir
    and the commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="gateway-before-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "gateway", "gateway.example.toml", "schema"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder, commit


def run_case(case: Case, db: BenchDb, args: argparse.Namespace, code: Path | None) -> None:
    key = uuid.uuid4().hex[:6]
    root = f"gwb{key}"  # a tree of its own: other benches' load stays out
    cid, tenant = f"gwbench-pydrv-{key}", f"pyd{key}"
    create_session(cid, root)
    db.register_states([tenant])
    published, _ = publish_recorded(fleet_spec(tenant, args.devices, root=root), count=args.count)
    env = gateway_env(cid, root, CASSANDRA__DRIVER=case.driver)
    if code is not None:
        # First on sys.path: `python -m` puts the working directory there (ahead
        # of PYTHONPATH and of the editable install of this checkout).
        env["PYTHONPATH"] = str(code)
    proc = Proc(
        case.variant,
        [sys.executable, "-m", "gateway", "run"],
        env,
        LOGS / f"{case.variant.replace(' ', '_')}_{case.round}.log",
        [READY],
        HANDLED,
        cwd=code or ROOT,
    ).start()
    try:
        proc.wait_ready(120)
        assert proc.ready_at is not None
        if not proc.wait_count(published.sent, timeout=args.timeout):
            case.note = f"stopped at {proc.count}/{published.sent}"
        case.seconds = time.monotonic() - proc.ready_at
        cpu = cpu_seconds(proc.pid) - proc.ready_cpu
        case.msgs = proc.count
        case.msg_per_s = proc.count / case.seconds
        case.cpu_us = cpu / max(proc.count, 1) * 1e6
    finally:
        proc.stop()
        clear_session(cid)
    # The summary line at exit counts the requests sent.
    for line in proc.log.read_text(errors="replace").splitlines():
        if "stopped: received=" in line and "requests=" in line and case.msgs:
            requests = int(line.split("requests=")[1].split()[0])
            case.requests_per_msg = requests / case.msgs
    say(
        f"{case.variant} (round {case.round}): {case.msg_per_s:.0f} msg/s, "
        f"{case.cpu_us:.0f} us CPU/msg, {case.requests_per_msg or 0:.2f} requests/msg {case.note}"
    )


def summary(cases: list[Case]) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}, "ratios": {}}
    variants = list(dict.fromkeys(c.variant for c in cases))
    for v in variants:
        mine = [c for c in cases if c.variant == v]
        out["variants"][v] = {
            name: {
                "median": statistics.median(vals),
                "min": min(vals),
                "max": max(vals),
            }
            for name in ("cpu_us", "msg_per_s", "requests_per_msg")
            if (vals := [float(x) for c in mine if (x := getattr(c, name)) is not None])
        }
    acsylla = {c.round: c.cpu_us for c in cases if c.variant == "acsylla"}
    for v in variants:
        if v == "acsylla" or "acsylla" not in out["variants"]:
            continue
        per_round = [
            c.cpu_us / acsylla[c.round] for c in cases if c.variant == v and c.round in acsylla
        ]
        out["ratios"][v] = {
            "of_medians": out["variants"][v]["cpu_us"]["median"]
            / out["variants"]["acsylla"]["cpu_us"]["median"],
            "per_round": per_round,
        }
    return out


def markdown(data: dict[str, Any]) -> str:
    args, s = data["args"], data["summary"]
    cases = [Case(**c) for c in data["cases"]]
    before = f"{args.get('before_driver', 'python')} before"
    lines = [
        "# The gateway's CPU per message through each driver, now and before",
        "",
        f"Command: `{data['command']}` ({data['when']}; this checkout at {data['commit']}"
        + (
            f", `{before}` = {args['before']} at {data['before_commit']}"
            if data.get("before_commit")
            else ""
        )
        + ").",
        f"Each case drains a backlog of {args['count']:,} messages from {args['devices']:,} "
        "devices through one `gateway run`; CPU is the gateway process's (all threads) per "
        "message from its ready line to the last write. Variants run in rounds, one of each "
        f"per round; medians and [min-max] over {args['rounds']} rounds. "
        "2 shared cores, other work running.",
        "",
        "| variant | CPU µs/msg | msg/s | requests/msg | CPU / acsylla (of medians) | per round |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for v, figs in s["variants"].items():

        def cell(name: str, fmt: str, figs: dict[str, Any] = figs) -> str:
            f = figs.get(name)
            if f is None:
                return ""
            return f"{fmt.format(f['median'])} [{fmt.format(f['min'])}-{fmt.format(f['max'])}]"

        ratio = s["ratios"].get(v)
        of_medians = "" if ratio is None else "{:.2f}x".format(ratio["of_medians"])
        per_round = "" if ratio is None else ", ".join(f"{r:.2f}" for r in ratio["per_round"])
        lines.append(
            f"| {v} | {cell('cpu_us', '{:,.0f}')} | {cell('msg_per_s', '{:,.0f}')} "
            f"| {cell('requests_per_msg', '{:.2f}')} | {of_medians} | {per_round} |"
        )
    lines += [
        "",
        "Every case:",
        "",
        "| variant | round | CPU µs/msg | msg/s | requests/msg | note |",
    ]
    lines.append("|---|---:|---:|---:|---:|---|")
    for c in cases:
        lines.append(
            f"| {c.variant} | {c.round} | {c.cpu_us:,.0f} | {c.msg_per_s:,.0f} "
            f"| {c.requests_per_msg or 0:.2f} | {c.note} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=30_000, help="backlog per drain")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument(
        "--before", default=BEFORE_PACKING, help='git ref of "DRIVER before" ("": none)'
    )
    parser.add_argument(
        "--before-driver",
        choices=("python", "acsylla"),
        default="python",
        help="the driver the --before code writes through",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="cap per drain, s")
    parser.add_argument("--out", default=str(RESULTS / "python_driver"), help="results path stem")
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    apply_schema()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    before, before_commit = extract(args.before) if args.before else (None, "")
    variants: list[tuple[str, str, Path | None]] = [
        ("acsylla", "acsylla", None),
        ("python", "python", None),
    ]
    if before is not None:
        variants.append((f"{args.before_driver} before", args.before_driver, before))
    db = BenchDb(rows.KEYSPACE)
    cases: list[Case] = []
    data: dict[str, Any] = {}
    try:
        for r in range(1, args.rounds + 1):
            for variant, driver, code in variants:
                case = Case(variant, r, driver)
                say(f"{variant}, round {r}")
                run_case(case, db, args, code)
                cases.append(case)
                data = {
                    "command": " ".join([".venv/bin/python", *sys.argv]),
                    "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "commit": head,
                    "before_commit": before_commit,
                    "args": vars(args),
                    "cases": [asdict(c) for c in cases],
                    "summary": summary(cases),
                }
                Path(args.out + ".json").write_text(json.dumps(data, indent=1) + "\n")
                Path(args.out + ".md").write_text(markdown(data))
    finally:
        db.close()
        if before is not None:
            shutil.rmtree(before, ignore_errors=True)
    print(markdown(data))


def render(path: Path) -> None:
    """Rewrite the .md of a results .json (after a change to the report)."""
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        render(Path(sys.argv[2]))
        sys.exit(0)
    run_tool(main)
