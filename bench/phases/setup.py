"""Setup: the schema in the ``gateway_bench`` keyspace, its tables truncated,
the harness's Cassandra session, an empty log folder, and what the report
says about the machine (including one write's round trip)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import rows
from benchlib import (
    BENCH,
    WARM_UP_EVENTS,
    BenchDb,
    apply_schema,
    broker_store_mb,
    percentiles,
    warm_up_cassandra,
)
from harness import LOGS, Bench

from cassandra import __version__ as cassandra_driver_version


def run(bench: Bench) -> None:
    apply_schema()
    bench.db = BenchDb()
    bench.say(f"schema applied to keyspace {rows.KEYSPACE}; truncating its tables")
    bench.cdb.truncate()
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    bench.results["machine"] = machine(bench.cdb)
    bench.results["cassandra_warm_up"] = warm_up(bench)
    bench.results["cassandra_write_rtt_ms"] = write_rtt(bench.cdb)


def warm_up(bench: Bench) -> dict[str, float]:
    """Warm Cassandra up (benchlib.warm_up_cassandra) before anything is
    measured, always: `make bench` starts Cassandra if it is not running."""
    bench.say(f"warming Cassandra up: {WARM_UP_EVENTS:,} events' rows, not measured")
    seconds = warm_up_cassandra(
        bench.tenant("warm"), bench.args.devices, LOGS / "warm_up.json", bench.log("warm-up")
    )
    return {"events": WARM_UP_EVENTS, "seconds": round(seconds, 1)}


def write_rtt(db: BenchDb, n: int = 300) -> dict[str, float | None]:
    """One write's round trip (sequential, idle): what the latency figures leave out."""
    insert = db.session.prepare(rows.cql(rows.CQL_INSERT_PARTITION))
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        db.session.execute(insert, ("rtt-probe", f"dev-{i:06d}", 0, 0, 3600, 600))
        times.append((time.perf_counter() - t0) * 1000)
    return percentiles(times)


def _first_line(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def machine(db: BenchDb) -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text()
    mem_kb = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1))  # type: ignore[union-attr]
    model = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    mosquitto = _first_line(["mosquitto", "-h"]) or _first_line(["/usr/sbin/mosquitto", "-h"])
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "cpu_model": model.group(1).strip() if model else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cassandra": db.session.execute("SELECT release_version FROM system.local").one()[0],
        "python_driver": cassandra_driver_version,
        "write_driver": _write_driver(),
        "mosquitto": mosquitto,
        "node": _first_line(["node", "--version"]),
        "gateway_commit": (
            _first_line(["git", "-C", str(BENCH.parent), "describe", "--always"]) or "?"
        )
        + (" (working tree with uncommitted changes)" if _dirty() else ""),
        "loadavg_start": os.getloadavg(),
        "broker_store_mb": broker_store_mb(),
    }


def _write_driver() -> str:
    """The driver the gateway writes through with its defaults, and its version."""
    from gateway.config import CassandraConfig  # noqa: PLC0415
    from gateway.store.write_session import choose_driver  # noqa: PLC0415

    name = choose_driver(CassandraConfig())
    if name == "acsylla":
        return f"acsylla {importlib.metadata.version('acsylla')} (DataStax C++ driver)"
    return f"cassandra-driver {cassandra_driver_version}"


def _dirty() -> bool:
    out = subprocess.run(
        ["git", "-C", str(BENCH.parent), "status", "--porcelain", "--", "gateway"],
        capture_output=True,
        text=True,
        check=False,
    )
    return bool(out.stdout.strip())
