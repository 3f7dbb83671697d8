"""Cassandra ceiling: write already-decoded events as fast as the driver allows.

The same fleet as the other systems (gateway.simulate.Fleet) is generated and
decoded by the gateway's own Decoder before the clock starts; then the rows the
gateway writes for each event (bench/rows.py: same prepared statements, same
USING TIMESTAMP) go out through the gateway's own write session
(gateway/store/write_session.py: the same driver, chosen the same way, with the same
settings), ``concurrency`` statements in flight, each completion sending the
next. One run per concurrency level, each into its own tenant; no MQTT.
Statements go ``--pack`` to a request (an UNLOGGED batch of that many rows,
of different partitions; default 10), as the gateway packs up to 10
partitions per request where their replicas agree (one node here); ``--pack
1`` sends one statement per request, the ceiling before the gateway packed.

Writes a JSON report (per level: events, statements, seconds, CPU seconds of
this process, failures, and the events written so the harness can check them).
Usage (from bench/run.py):
    python bench/ceiling.py --prefix T --devices 1000 --count 20000 --levels 32,64 --out F \
        [--driver auto|acsylla|python] [--pack 10]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvloop
from benchlib import services_cpu, services_cpu_since, settle_cassandra
from rows import ALL_CQL, KEYSPACE, Statements, cql

from gateway.config import CassandraConfig, LimitsConfig
from gateway.event import Event
from gateway.ingest.decode import Decoder
from gateway.store.write_session import WriteSession, open_write_session
from gateway.tools.simulate import Fleet, FleetSpec

TOPIC_TEMPLATE = "gwbench/{tenant}/devices/{device_id}/events"


def cpu_seconds() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def decoded_events(tenant: str, devices: int, count: int) -> list[Event]:
    fleet = Fleet(
        FleetSpec(devices=devices, rate=1e9, tenant=tenant, topic_template=TOPIC_TEMPLATE)
    )
    decoder = Decoder(LimitsConfig())
    events = []
    for _ in range(count):
        now = time.time() * 1000
        topic, payload, _event = fleet.next_message(int(now), sent_at=now)
        device = topic.split("/")[3]
        events.append(decoder.decode(tenant, device, payload, fleet.content_type, int(now)))
    return events


def statements_of(statements: Statements, events: list[Event]) -> Iterator[tuple[Any, Any]]:
    for e in events:
        yield from statements.rows(
            e.tenant,
            e.device_id,
            e.ts_ms,
            e.state,
            e.value_text,
            e.value_num,
            e.metrics,
            e.tags,
            e.received_ms,
            e.event_id,
            e.write_ts,
        )


async def write_all(
    session: WriteSession, rows: Iterator[tuple[Any, Any]], concurrency: int, pack: int
) -> tuple[int, list[str]]:
    """``concurrency`` writers, each sending its next ``pack`` rows when the
    last request is done."""
    sent = 0
    failures: list[str] = []

    async def writer() -> None:
        nonlocal sent
        # One shared iterator: each row goes once.
        while group := list(itertools.islice(rows, pack)):
            sent += len(group)
            bound = [session.bind(prepared, values) for prepared, values in group]
            try:
                await session.execute(bound[0] if len(bound) == 1 else session.batch(bound))
            except Exception as exc:
                failures.append(repr(exc))

    await asyncio.gather(*(writer() for _ in range(concurrency)))
    return sent, failures


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = CassandraConfig(keyspace=KEYSPACE, driver=args.driver)
    report: dict[str, Any] = {"levels": []}
    async with open_write_session(config) as session:
        report["driver"] = session.name
        prepared = {
            name: await session.prepare(cql(text), timestamps=ts)
            for name, (text, ts) in ALL_CQL.items()
        }
        for n, level in enumerate(int(x) for x in args.levels.split(",")):
            tenant = f"{args.prefix}c{level}"
            events = decoded_events(tenant, args.devices, args.count)
            statements = Statements(prepared)
            if n:
                # Each level from flushed memtables, as each system's drain
                # (harness.Bench.settle, which `make bench` runs before the
                # first): none pays for an earlier level's rows.
                settle_cassandra()
            services, cpu0, t0 = services_cpu(), cpu_seconds(), time.monotonic()
            sent, failures = await write_all(
                session, statements_of(statements, events), level, args.pack
            )
            elapsed, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
            services_used = services_cpu_since(services, len(events))
            print(
                f"level {level}: {len(events)} events, {sent} statements in {elapsed:.2f} s "
                f"({len(events) / elapsed:.0f} events/s), {len(failures)} failed "
                f"({session.name})",
                flush=True,
            )
            report["levels"].append(
                {
                    "concurrency": level,
                    "tenant": tenant,
                    "events": len(events),
                    "statements": sent,
                    "seconds": elapsed,
                    "cpu_s": cpu,
                    "services_cpu_us_per_msg": services_used,
                    "failures": len(failures),
                    "first_failures": failures[:3],
                    "sent": [[e.device_id, e.ts_ms, e.state] for e in events],
                }
            )
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--levels", default="32,64,128,256")
    parser.add_argument("--driver", default="auto", choices=["auto", "acsylla", "python"])
    parser.add_argument("--pack", type=int, default=10, help="statements per request")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = uvloop.run(run(args))
    report["peak_rss_mb"] = peak_rss_mb()
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
