"""End-to-end benchmark: `make bench` (about 10 minutes on a 2-core box).

One run, one generated load (gateway.simulate: 1,000 devices, JSON, seed 1),
five systems side by side, each draining the same backlog from its own
persistent MQTT session into its own tenant of the ``gateway_bench`` keyspace:

1. broker ceiling: bench/broker_sub.py, a paho QoS 1 subscriber, no database;
2. Cassandra ceiling: bench/ceiling.py, the gateway's rows for already-decoded
   events through the gateway's own write session (same driver: acsylla where
   installed), 32/64/128/256 statements in flight (best);
3. naive bridge: bench/naive_bridge.py, paho on_message + session.execute per row;
4. Node-RED: mqtt-in (QoS 1) → function node with cassandra-driver (bench/nodered/);
5. the gateway with its defaults (``python -m gateway run``).

For each: sustained msg/s while draining a pre-published backlog (from the
WRITETIME of the stored telemetry rows: first to last write), stored rows
checked against what was published (telemetry_partitions → telemetry, plus
the latest tables), CPU seconds per 1,000 messages and peak RSS of the process
under test (/proc), and publish→stored latency in a second, live run at half
the sustained rate (the gateway also at 250, 500 and 1,000 msg/s). Then, for
the gateway: throughput at 10k and 100k devices,
2x and 10x overload, and the latency of ``gateway devices --state S``
(gateway.queries.devices_in_state) for 1k/10k/100k devices and 1/8/32 buckets.

Writes bench/results/latest.json, latest.md, throughput_vs_devices.png and
latency_cdf.png. Logs of the processes under test go to bench/.logs/ (ignored).
Usage: .venv/bin/python bench/run.py [--count 20000] [--skip overload,states] ...

This file is the driver: the command line, the phases in order, and what to
do when one fails. Each phase is a function of one run (harness.Bench):

* systems/: one module per system compared (broker, cassandra, naive,
  nodered, gateway), each drained through phases/sustained.py, which runs
  phases/latency.py after the drain;
* phases/: setup, sustained, latency, then the gateway-only scaling,
  overload and states, and report (latest.md, latest.json, the plots);
* benchlib.py: processes under test, MQTT sessions, publishing, and the
  read-back check (stored rows read as ``gateway history`` reads them).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import add_gateway_env
from harness import RESULTS, SYSTEMS, Bench, Stopped
from phases import overload, report, scaling, setup, states
from systems import broker, cassandra, gateway, naive, nodered

# name -> (estimated seconds on the 2-core reference box, the phase), in the
# order they run; the report comes last, whatever failed.
PHASES: dict[str, tuple[float, Callable[[Bench], None]]] = {
    "setup": (25, setup.run),
    "broker": (70, broker.run),
    "ceiling": (55, cassandra.run),
    "naive": (125, naive.run),
    "nodered": (85, nodered.run),
    "gateway": (130, gateway.run),
    "scaling": (50, scaling.run),
    "overload": (220, overload.run),
    "states": (30, states.run),
    "report": (5, report.run),
}


def run(bench: Bench) -> None:
    """Every phase not skipped; a failed phase is recorded and the next one
    runs (except setup: without it nothing can)."""
    failures: dict[str, str] = {}
    try:
        for name, (_, phase) in PHASES.items():
            if name == "report" or name in bench.args.skip:
                continue
            bench.progress.begin(name)
            try:
                phase(bench)
            except (Stopped, KeyboardInterrupt):
                raise
            except Exception as exc:
                if name == "setup":
                    raise
                failures[name] = f"{type(exc).__name__}: {exc}"
                bench.say(f"FAILED: {failures[name][:500]}")
                key = {"ceiling": "cassandra"}.get(name, name)
                if key in SYSTEMS:
                    bench.results["systems"].setdefault(key, {})["status"] = (
                        f"failed: {failures[name][:300]}"
                    )
            finally:
                bench.cleanup()
            bench.progress.end()
    finally:
        bench.cleanup()
        if bench.db is not None:
            bench.db.close()
    bench.results["phase_failures"] = failures
    bench.progress.begin("report")
    report.run(bench)
    bench.progress.end()
    print(f"results: {bench.args.out / 'latest.md'}", flush=True)


# -- entry point ------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20000, help="backlog per system")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--naive-count", type=int, help="backlog for the naive bridge")
    parser.add_argument("--nodered-count", type=int, help="backlog for Node-RED")
    parser.add_argument("--ceiling-count", type=int, help="events per concurrency level")
    parser.add_argument("--levels", default="32,64,128,256", help="ceiling concurrency levels")
    parser.add_argument(
        "--latency-seconds",
        type=float,
        default=60.0,
        help="the latency run at half the sustained rate (60 s: a whole minute, so it "
        "holds one minute's roll-up work whatever second it starts at)",
    )
    parser.add_argument(
        "--fixed-latency-seconds",
        type=float,
        default=10.0,
        help="each of the gateway's latency runs at --latency-rates",
    )
    parser.add_argument(
        "--latency-rates",
        type=_ints,
        default=[250, 500, 1000],
        help="fixed rates (msg/s) of the gateway's extra latency runs",
    )
    parser.add_argument("--scale-devices", type=_ints, default=[10_000, 100_000])
    parser.add_argument("--scale-count", type=int, help="backlog per scaling run")
    parser.add_argument("--overload-factors", type=lambda t: [float(x) for x in t.split(",")])
    parser.add_argument("--overload-seconds", type=float, default=30.0)
    parser.add_argument("--max-publishers", type=int, default=4)
    parser.add_argument("--state-devices", type=_ints, default=[1_000, 10_000, 100_000])
    parser.add_argument("--state-buckets", type=_ints, default=[1, 8, 32])
    parser.add_argument("--state-runs", type=int, default=5)
    add_gateway_env(parser, "extra gateway setting (repeatable); the default run uses none")
    parser.add_argument("--skip", type=lambda t: set(t.split(",")), default=set())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.naive_count = args.naive_count or args.count
    args.nodered_count = args.nodered_count or args.count
    args.ceiling_count = args.ceiling_count or args.count
    args.scale_count = args.scale_count or args.count
    args.overload_factors = args.overload_factors or [2.0, 10.0]
    unknown = args.skip - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) in --skip: {', '.join(sorted(unknown))}")
    args.command = " ".join(["bench/run.py", *sys.argv[1:]])
    if os.environ.get("MAKELEVEL"):
        args.command = f"make bench (= .venv/bin/python {args.command})"

    def stop(_signum: int, _frame: Any) -> None:
        raise Stopped

    signal.signal(signal.SIGTERM, stop)
    bench = Bench(args, {name: estimate for name, (estimate, _) in PHASES.items()})
    try:
        run(bench)
    except (Stopped, KeyboardInterrupt):
        print("bench: stopped; processes and MQTT sessions cleaned up", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
