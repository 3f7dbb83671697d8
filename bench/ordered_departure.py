"""Devices leaving a large state in device-id order: the first page's cost with
rows clustered by device id (the layout before) and by device hash, then id
(schema/002, the layout now), on the real Cassandra (`make bench-ordered`).

A floor's lights switched off together leave a state in id order. Fewer than
half of the state's devices leave, so the gateway's rotation rule (deletes at
least half the live rows, gateway/store/latest.py) does not copy the
partition into a fresh generation: what is measured is what a reader meets
between two rotations, and the worst of it.

Workload, on one tenant per layout and the ``bench_ordered`` keyspace:

1. N devices (``--devices``, default 110,000) are in "ok": one row each,
   written as the gateway writes it (``USING TIMESTAMP`` = event time in µs);
2. the first D of them in device-id order (``--leave``, default 49 % of N)
   move to "alarm": an insert into "alarm" and a delete from "ok", each with
   the newer event's timestamp, exactly the writes of latest.py;
3. ``nodetool flush``, so reads meet SSTables as they would after a while.

The two layouts are two tables with the same columns. The "before" table is
``PRIMARY KEY ((tenant, state, bucket, gen), device_id)``; the "now" table is
the gateway's own ``latest_events_by_state``, with ``latest_events_by_device``
filled too, so the gateway's own page read (``devices_page``: generations, the
state read and the page check) runs on it as the read API runs it.

Measured for the first page of "ok" (the state the devices left):

* tombstones read, from one traced execution of the first-page CQL;
* one client, then ``--clients`` concurrent clients, for ``--read-seconds``
  each: p50 / p99 / max latency of the CQL first page, and for the "now"
  layout of ``devices_page(limit=100)`` too;
* server warnings the driver logged ("Server warning: ... tombstone").

Writes bench/results/ordered_departure.json and .md.

Usage: .venv/bin/python bench/ordered_departure.py [--devices 110000] [--leave 53900]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cassandra.concurrent import execute_concurrent_with_args

from gateway.config import CassandraConfig, Config
from gateway.identity import FIRST_HASH, device_hash
from gateway.store import queries
from gateway.store.database import Database, connect

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
KEYSPACE = "bench_ordered"
PAGE = 100
TRACE_READ = re.compile(r"Read (\d+) live rows and (\d+) tombstone cells")
BEFORE_TABLE = """
CREATE TABLE IF NOT EXISTS {ks}.by_device_id (
    tenant text, state text, bucket int, gen int, device_id text,
    ts timestamp, value text, tags frozen<map<text, text>>,
    PRIMARY KEY ((tenant, state, bucket, gen), device_id))
"""
LAYOUTS = {
    "before": {
        "table": "by_device_id",
        "clustering": "device_id",
        "first_page": "SELECT device_id, ts, value, tags, WRITETIME(ts) AS wt "
        "FROM {ks}.by_device_id WHERE tenant = ? AND state = ? AND bucket = 0 AND gen = 0 "
        "AND device_id > ? LIMIT ?",
    },
    "now": {
        "table": "latest_events_by_state",
        "clustering": "device_hash, device_id",
        "first_page": "SELECT device_hash, device_id, ts, value, tags, WRITETIME(ts) AS wt "
        "FROM {ks}.latest_events_by_state WHERE tenant = ? AND state = ? AND bucket = 0 "
        "AND gen = 0 AND (device_hash, device_id) > (?, ?) LIMIT ?",
    },
}


class Warnings(logging.Handler):
    """Counts the driver's "Server warning" log lines about tombstones."""

    def __init__(self) -> None:
        super().__init__()
        self.tombstone = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "Server warning" in text and "tombstone" in text:
            self.tombstone += 1


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {"p50": round(q(0.50), 2), "p99": round(q(0.99), 2), "max": round(ordered[-1], 2)}


def schema() -> None:
    env = {"GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE}
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "gateway"), "schema", "apply"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"gateway schema apply failed: {result.stderr.strip()}")


def load(db: Database, tenants: dict[str, str], n: int, leave: int) -> float:
    """Write the workload into both layouts; returns the seconds it took."""
    session = db.session
    session.execute(BEFORE_TABLE.format(ks=KEYSPACE), timeout=60)
    ks = KEYSPACE
    insert = {
        "before": session.prepare(
            f"INSERT INTO {ks}.by_device_id (tenant, state, bucket, gen, device_id, ts, value, "
            "tags) VALUES (?, ?, 0, 0, ?, ?, '1.0', {}) USING TIMESTAMP ?"
        ),
        "now": session.prepare(
            f"INSERT INTO {ks}.latest_events_by_state (tenant, state, bucket, gen, device_hash, "
            "device_id, ts, value, tags) VALUES (?, ?, 0, 0, ?, ?, ?, '1.0', {}) USING TIMESTAMP ?"
        ),
    }
    delete = {
        "before": session.prepare(
            f"DELETE FROM {ks}.by_device_id USING TIMESTAMP ? WHERE tenant = ? AND state = ? "
            "AND bucket = 0 AND gen = 0 AND device_id = ?"
        ),
        "now": session.prepare(
            f"DELETE FROM {ks}.latest_events_by_state USING TIMESTAMP ? WHERE tenant = ? "
            "AND state = ? AND bucket = 0 AND gen = 0 AND device_hash = ? AND device_id = ?"
        ),
    }
    by_device = session.prepare(
        f"INSERT INTO {ks}.latest_events_by_device (tenant, device_id, state, ts, value_num) "
        "VALUES (?, ?, ?, ?, 1.0) USING TIMESTAMP ?"
    )
    states = session.prepare(
        f"INSERT INTO {ks}.tenant_states (tenant, state, registered_at) VALUES (?, ?, ?)"
    )
    t0_ms = int(time.time() * 1000) - 3_600_000
    t1_ms = t0_ms + 60_000
    devices = [f"floor{i // 1000:03d}-light-{i % 1000:03d}" for i in range(n)]
    leaving = devices[:leave]  # in device-id order: the ids sort as generated
    started = time.monotonic()

    def run(stmt: Any, params: list[tuple[Any, ...]]) -> None:
        for ok, result in execute_concurrent_with_args(session, stmt, params, concurrency=96):
            if not ok:
                raise result

    for layout, tenant in tenants.items():
        now = layout == "now"
        key = (lambda d: (device_hash(d), d)) if now else (lambda d: (d,))
        run(states, [(tenant, s, t0_ms) for s in ("ok", "alarm")])
        run(insert[layout], [(tenant, "ok", *key(d), t0_ms, t0_ms * 1000) for d in devices])
        say(f"{layout}: {n:,} devices in 'ok'")
        run(insert[layout], [(tenant, "alarm", *key(d), t1_ms, t1_ms * 1000) for d in leaving])
        run(delete[layout], [(t1_ms * 1000, tenant, "ok", *key(d)) for d in leaving])
        say(f"{layout}: {leave:,} left 'ok' for 'alarm', in device-id order")
        if now:
            run(by_device, [(tenant, d, "ok", t0_ms, t0_ms * 1000) for d in devices[leave:]])
            run(by_device, [(tenant, d, "alarm", t1_ms, t1_ms * 1000) for d in leaving])
    took = time.monotonic() - started
    subprocess.run(
        ["bash", str(ROOT / "cassandra" / "cassandra.sh"), "nodetool", "flush", KEYSPACE],
        check=True,
        capture_output=True,
    )
    return took


def traced(db: Database, layout: str, tenant: str) -> dict[str, Any]:
    stmt = db.session.prepare(LAYOUTS[layout]["first_page"].format(ks=KEYSPACE))
    start = (FIRST_HASH, "") if layout == "now" else ("",)
    try:
        result = db.session.execute(stmt, (tenant, "ok", *start, PAGE), trace=True, timeout=60)
        trace = result.get_query_trace(max_wait_sec=30)
    except Exception as exc:  # reported, as the read's outcome
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    live = tombstones = 0
    for event in trace.events:
        if found := TRACE_READ.search(event.description):
            live += int(found[1])
            tombstones += int(found[2])
    return {"live_rows": live, "tombstones": tombstones, "rows_returned": len(list(result))}


async def timed(clients: int, seconds: float, read: Any) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds

    async def client() -> None:
        nonlocal errors
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                await read()
            except Exception:  # counted
                errors += 1
                continue
            latencies.append((time.perf_counter() - t0) * 1000)

    await asyncio.gather(*(client() for _ in range(clients)))
    return {"clients": clients, "reads": len(latencies), "errors": errors, **percentiles(latencies)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    warnings = Warnings()
    logging.getLogger("cassandra").addHandler(warnings)
    stamp = int(time.time())
    tenants = {layout: f"{layout}{stamp}" for layout in LAYOUTS}
    config = Config(cassandra=CassandraConfig(keyspace=KEYSPACE))
    out: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "bench/ordered_departure.py", *sys.argv[1:]]),
        "devices": args.devices,
        "leave": args.leave,
        "clients": args.clients,
        "read_seconds": args.read_seconds,
        "layouts": {},
    }
    async with connect(config.cassandra) as db:
        out["load_s"] = round(
            await asyncio.to_thread(load, db, tenants, args.devices, args.leave), 1
        )
        for layout, tenant in tenants.items():
            spec = LAYOUTS[layout]
            stmt = await db.prepared(spec["first_page"].format(ks=KEYSPACE))
            start = (FIRST_HASH, "") if layout == "now" else ("",)
            params = (tenant, "ok", *start, PAGE)
            entry: dict[str, Any] = {"table": spec["table"], "clustering": spec["clustering"]}
            before = warnings.tombstone
            entry["trace"] = await asyncio.to_thread(traced, db, layout, tenant)

            async def cql_page(stmt: Any = stmt, params: Any = params) -> None:
                await db.execute(stmt, params)

            entry["cql_1"] = await timed(1, args.read_seconds, cql_page)
            entry["cql_n"] = await timed(args.clients, args.read_seconds, cql_page)
            if layout == "now":

                async def api_page(tenant: str = tenant) -> None:
                    page = await queries.devices_page(db, config, tenant, "ok", limit=PAGE)
                    if len(page.devices) != PAGE:
                        raise AssertionError(f"{len(page.devices)} devices on the first page")

                entry["page_1"] = await timed(1, args.read_seconds, api_page)
                entry["page_n"] = await timed(args.clients, args.read_seconds, api_page)
            entry["tombstone_warnings"] = warnings.tombstone - before
            out["layouts"][layout] = entry
            say(f"{layout}: {json.dumps(entry)}")
    return out


def on_paper(devices: int, leave: int) -> dict[str, float]:
    """Tombstones the first page meets, by the layouts' rules: clustered by id,
    every departure in id order lies in front of it; by hash, departures are
    spread evenly, so a page of PAGE live rows meets PAGE x leave / stay."""
    stay = devices - leave
    return {"before": leave, "now": round(PAGE * leave / stay, 1)}


def markdown(r: dict[str, Any]) -> str:
    def lat(e: dict[str, Any] | None) -> str:
        if not e:
            return "-"
        if not e["reads"]:
            return f"all {e['errors']} failed"
        err = f", {e['errors']} errors" if e["errors"] else ""
        return f"{e['p50']} / {e['p99']} / {e['max']} ({e['reads']:,} reads{err})"

    lines = [
        "# Devices leaving a large state in device-id order",
        "",
        f"`bench/ordered_departure.py`, run {r['started']}:",
        "",
        f"    {r['command']}",
        "",
        f'{r["devices"]:,} devices in "ok"; the first {r["leave"]:,} in device-id order move '
        f'to "alarm" (an insert and a delete each, as the gateway writes them; loaded in '
        f"{r['load_s']} s, then flushed). Fewer than half leave, so the gateway's rotation "
        'would not copy the partition. First page (100 devices) of "ok"; latencies '
        f"p50 / p99 / max in ms over {r['read_seconds']} s per row; {r['clients']} clients "
        "run concurrently in one Python process.",
        "",
        "| layout | clustering | tombstones read (trace) | warnings | CQL first page, 1 client "
        f"| CQL, {r['clients']} clients | `devices_page`, 1 client "
        f"| `devices_page`, {r['clients']} clients |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for layout, e in r["layouts"].items():
        t = e["trace"]
        tomb = t.get("tombstones", t.get("error", "?"))
        lines.append(
            f"| {layout} | `{e['clustering']}` | {tomb} | {e['tombstone_warnings']} "
            f"| {lat(e['cql_1'])} | {lat(e['cql_n'])} | {lat(e.get('page_1'))} "
            f"| {lat(e.get('page_n'))} |"
        )
    paper = r["paper"]
    lines += [
        "",
        "On paper (tombstones in front of the first page, by each layout's rule): "
        + "; ".join(
            f"{n:,} devices, {leave:,} leaving: before {p['before']:,}, now {p['now']}"
            for n, leave, p in paper
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=110_000)
    parser.add_argument("--leave", type=int, help="devices that leave (default 49 %% of them)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--read-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "ordered_departure.json")
    args = parser.parse_args()
    if args.leave is None:
        args.leave = args.devices * 49 // 100
    if not 0 < args.leave < args.devices / 2:
        parser.error("--leave: must be between 1 and under half of --devices")
    schema()
    results = asyncio.run(measure(args))
    results["paper"] = [
        (n, leave, on_paper(n, leave))
        for n, leave in ((args.devices, args.leave), (1_000_000, 490_000))
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
