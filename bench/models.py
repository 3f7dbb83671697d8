"""The state-view data models, measured on the real Cassandra: `make bench-models`.

"Which devices are in state X right now?" answered by the five data models of
"Five Data Models for IoT: Managing the Latest IoT Events Based on a State in
Apache Cassandra" (multi-tenant forms, tenant in the partition key), plus SAI
and a variant of Solution 3:

1   materialized view: latest_events_by_device ((tenant, device_id)) with a view
    PRIMARY KEY ((tenant, state), device_id);
2   legacy secondary index (``USING 'legacy_local_table'``) on the state of a
    ((tenant), device_id) table;
3   state-partitioned table ((tenant, state), device_id): each event inserts
    into its state and deletes from every other state;
4   one table per state, ((tenant, device_id)); a state is read by scanning its
    table for the tenant (ALLOW FILTERING, as the article's full-table reads);
5   Solution 3 with artificial buckets ((tenant, state, bucket), device_id),
    bucket = crc32(device_id) % B, B = ceil(N / --bucket-devices); a state is
    read from all its buckets (``bucket IN ?``, paged, so the first page stops
    at the first 100 rows);
SAI Storage-Attached Index on the state of a ((tenant), device_id) table;
3c  Solution 3 where the writer deletes only from the device's previous state:
    it keeps each device's newest (timestamp, state) in memory and writes
    nothing for an event older than that (a single writer that never restarts,
    the best case for this shortcut).

Every write carries ``USING TIMESTAMP`` = event time in µs, in every model, so
duplicated and reordered deliveries converge on the newest event per device.

Workload (the same for every model; fixed seed; one tenant of N devices; states
"ok" (common), "alarm" and "fault" (rare)):
(a) every device publishes "alarm", then the table is flushed to an SSTable
    (``nodetool flush``, not timed) so later history lies over it as in a live
    node; (b) every device publishes "ok", so every device leaves the rare
    state (the case that leaves tombstones in Solution 3's "alarm" partition);
(c) churn rounds: a random 10% of devices publish 1-2 events each (mostly
    "ok", some "fault"), some delivered twice, the round's deliveries
    shuffled, so a device's events arrive out of order; (d) one device
    publishes "alarm" last: the rare state ends with exactly that device.
The truth (newest event per device) is kept here, in Python.

Measured per model and fleet size, all from this run:
* correctness: every state read back in full (per state: the view, the index,
  the partition(s), or the state's table); every device must be in exactly one
  state, that of its newest event, with its timestamp; checked before and after
  the final flush;
* writes_per_s and cpu_us_per_event: deliveries per wall second of phases
  (a)-(d) and this process's CPU time (time.process_time: all threads, the
  driver's IO thread included) per delivery; prepared statements through
  cassandra-driver's execute_concurrent (--concurrency in flight), the
  gateway's cluster settings (LOCAL_QUORUM, one node);
* first-page latency: "the first 100 devices in state X" (LIMIT 100,
  fetch_size 100) for "ok" and "alarm", up to --reads times (fewer when a
  series passes --read-budget seconds: "n" in the JSON), p50/p99, plus the
  first read on its own (legacy indexes repair stale entries on it); before
  and after ``nodetool flush``;
* live rows and tombstones read by that query: one more execution with
  tracing, summing the trace's "Read N live rows and M tombstone cells" lines
  (partition deletions, as Solution 4's deletes are, and entries inside a
  legacy index are not counted there), and for SAI the rows its index matched
  that the read then discarded ("post-filtered N rows": stale entries);
* warnings the server returns (DDL and every response), and read or write
  failures, kept as text instead of stopping the run.

Writes bench/results/models.json and models.md.
Usage: .venv/bin/python bench/models.py [--sizes 1000,10000,100000 | --quick] [--only 3,SAI]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shlex
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from benchlib import ROOT, nodetool_flush, percentiles
from cassandra.cluster import Session
from cassandra.concurrent import execute_concurrent
from cassandra.query import BoundStatement, PreparedStatement

from cassandra import __version__ as cassandra_driver_version
from gateway.config import CassandraConfig
from gateway.store.database import build_cluster

KEYSPACE = "bench_models"
TENANT = "tenant-1"
COMMON, RARE, OTHER = "ok", "alarm", "fault"
STATES = (COMMON, RARE, OTHER)
PAGE = 100
TARGET_P99_MS = 50.0
BASE_MS = 1_700_000_000_000  # event time of the first event (fixed: same rows every run)
TRACE_READ = re.compile(r"Read (\d+) live rows and (\d+) tombstone cells")
# SAI's summary line: rows its index matched that the read then discarded (stale entries).
TRACE_SAI = re.compile(r"post-filtered (\d+) rows")
SETTINGS = (
    "tombstone_warn_threshold",
    "tombstone_failure_threshold",
    "read_request_timeout",
    "range_request_timeout",
    "memtable_heap_space",
    "default_secondary_index",
    "materialized_views_enabled",
)
RESULTS = ROOT / "bench" / "results"

Write = tuple[PreparedStatement, tuple[Any, ...]]


# -- the workload -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    device_id: str
    ts_ms: int
    state: str

    @property
    def write_ts(self) -> int:
        return self.ts_ms * 1000  # USING TIMESTAMP is in µs

    @property
    def value(self) -> str:
        return f"{self.state}@{self.ts_ms}"


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    deliveries: list[Event]
    flush_after: bool = False


@dataclass
class Workload:
    size: int
    phases: list[Phase]
    truth: dict[str, Event]
    events: int  # distinct events; deliveries count duplicates too

    @property
    def deliveries(self) -> int:
        return sum(len(p.deliveries) for p in self.phases)

    def summary(self) -> dict[str, Any]:
        return {
            "devices": self.size,
            "events": self.events,
            "deliveries": self.deliveries,
            "phases": {p.name: len(p.deliveries) for p in self.phases},
            "final_states": {s: sum(e.state == s for e in self.truth.values()) for s in STATES},
        }


def make_workload(
    size: int, seed: int, rounds: int, churn: float, fault_share: float, dup_share: float
) -> Workload:
    rng = random.Random(f"{seed}:{size}")
    devices = [f"dev-{i:06d}" for i in range(size)]
    truth: dict[str, Event] = {}
    clock = BASE_MS
    events = 0

    def emit(device: str, state: str) -> Event:
        # One global clock, +1 ms per event: a device's events strictly increase,
        # so "its newest event" is always well defined.
        nonlocal clock, events
        clock += 1
        events += 1
        truth[device] = Event(device, clock, state)
        return truth[device]

    def in_random_order(state: str) -> list[Event]:
        order = devices[:]
        rng.shuffle(order)
        return [emit(d, state) for d in order]

    phases = [
        Phase("a: all alarm", in_random_order(RARE), flush_after=True),
        Phase("b: all ok", in_random_order(COMMON)),
    ]
    for r in range(rounds):
        batch = [
            emit(d, OTHER if rng.random() < fault_share else COMMON)
            for d in rng.sample(devices, max(1, round(size * churn)))
            for _ in range(rng.randint(1, 2))
        ]
        batch += [e for e in batch if rng.random() < dup_share]  # redelivered copies
        rng.shuffle(batch)  # a device's events now arrive in any order
        phases.append(Phase(f"c{r + 1}: churn", batch))
    phases.append(Phase("d: one alarm", [emit(rng.choice(devices), RARE)]))
    return Workload(size, phases, dict(truth), events)


# -- the data models ----------------------------------------------------------------


def _bound(prepared: PreparedStatement, params: Sequence[Any], fetch_size: int) -> BoundStatement:
    bound = prepared.bind(params)
    bound.fetch_size = fetch_size
    return bound


class Model:
    """One data model: its schema, the writes of an event, and its two reads."""

    key: ClassVar[int | str]
    name: ClassVar[str]
    schema_text: ClassVar[str]

    def __init__(self, session: Session, size: int, bucket_devices: int) -> None:
        self.session = session
        self.size = size
        self.bucket_devices = bucket_devices

    def create(self) -> list[str]:
        raise NotImplementedError

    def drop(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        raise NotImplementedError

    def writes(self, event: Event) -> list[Write]:
        raise NotImplementedError

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        """The devices in ``state``: the first page (limit) or all of them (paged)."""
        raise NotImplementedError

    def _select(self, cql: str, params: Sequence[Any], limit: int | None) -> BoundStatement:
        text = cql + (f" LIMIT {limit}" if limit else "")
        return _bound(self.session.prepare(text), params, limit or 5000)


class DeviceTable(Model):
    """Solutions 1, 2 and SAI: one upserted row per device; the server indexes state."""

    table: ClassVar[str]
    partition_key: ClassVar[str] = "(tenant), device_id"

    def create(self) -> list[str]:
        return [
            f"CREATE TABLE {self.table} (tenant text, device_id text, state text, "
            f"ts timestamp, value text, PRIMARY KEY ({self.partition_key}))"
        ]

    def drop(self) -> list[str]:
        return [f"DROP TABLE IF EXISTS {self.table}"]

    def prepare(self) -> None:
        self._upsert = self.session.prepare(
            f"INSERT INTO {self.table} (tenant, device_id, state, ts, value) "
            "VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ?"
        )

    def writes(self, event: Event) -> list[Write]:
        e = event
        return [(self._upsert, (TENANT, e.device_id, e.state, e.ts_ms, e.value, e.write_ts))]

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        return self._select(
            "SELECT device_id, toUnixTimestamp(ts) AS ts_ms, value "
            f"FROM {self.table} WHERE tenant = ? AND state = ?",
            (TENANT, state),
            limit,
        )


class MaterializedView(DeviceTable):
    key = 1
    name = "materialized view"
    table = "s1_latest_by_device"
    view = "s1_latest_by_state"
    # One-row partitions per device, as the gateway's latest_events_by_device.
    partition_key = "(tenant, device_id)"
    schema_text = "base ((tenant, device_id)); view ((tenant, state), device_id)"

    def create(self) -> list[str]:
        return [
            *super().create(),
            f"CREATE MATERIALIZED VIEW {self.view} AS SELECT * FROM {self.table} "
            "WHERE tenant IS NOT NULL AND device_id IS NOT NULL AND state IS NOT NULL "
            "PRIMARY KEY ((tenant, state), device_id)",
        ]

    def drop(self) -> list[str]:
        return [f"DROP MATERIALIZED VIEW IF EXISTS {self.view}", *super().drop()]

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        return self._select(
            "SELECT device_id, toUnixTimestamp(ts) AS ts_ms, value "
            f"FROM {self.view} WHERE tenant = ? AND state = ?",
            (TENANT, state),
            limit,
        )


class LegacyIndex(DeviceTable):
    key = 2
    name = "secondary index (legacy 2i)"
    table = "s2_latest_by_device"
    schema_text = "((tenant), device_id) + CREATE INDEX ... USING 'legacy_local_table'"

    def create(self) -> list[str]:
        # This node's default_secondary_index is sai: name the legacy one explicitly.
        return [
            *super().create(),
            f"CREATE INDEX s2_state_2i ON {self.table} (state) USING 'legacy_local_table'",
        ]


class Sai(DeviceTable):
    key = "SAI"
    name = "storage-attached index (SAI)"
    table = "sai_latest_by_device"
    schema_text = "((tenant), device_id) + CREATE INDEX ... USING 'sai'"

    def create(self) -> list[str]:
        return [*super().create(), f"CREATE INDEX sai_state ON {self.table} (state) USING 'sai'"]


class StatePartitioned(Model):
    """Solution 3: insert into the event's state, delete from every other state."""

    key: ClassVar[int | str] = 3
    name = "state-partitioned table"
    table = "s3_latest_by_state"
    schema_text = "((tenant, state), device_id); insert + delete from every other state"

    def create(self) -> list[str]:
        return [
            f"CREATE TABLE {self.table} (tenant text, state text, device_id text, "
            "ts timestamp, value text, PRIMARY KEY ((tenant, state), device_id))"
        ]

    def drop(self) -> list[str]:
        return [f"DROP TABLE IF EXISTS {self.table}"]

    def prepare(self) -> None:
        self._insert = self.session.prepare(
            f"INSERT INTO {self.table} (tenant, state, device_id, ts, value) "
            "VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ?"
        )
        self._delete = self.session.prepare(
            f"DELETE FROM {self.table} USING TIMESTAMP ? "
            "WHERE tenant = ? AND state = ? AND device_id = ?"
        )

    def _insert_row(self, e: Event) -> Write:
        return (self._insert, (TENANT, e.state, e.device_id, e.ts_ms, e.value, e.write_ts))

    def _delete_row(self, e: Event, state: str) -> Write:
        # Same timestamp as the insert: it removes anything older in that state,
        # and a late older event can never bring the device back there.
        return (self._delete, (e.write_ts, TENANT, state, e.device_id))

    def writes(self, event: Event) -> list[Write]:
        others = [self._delete_row(event, s) for s in STATES if s != event.state]
        return [self._insert_row(event), *others]

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        return self._select(
            "SELECT device_id, toUnixTimestamp(ts) AS ts_ms, value "
            f"FROM {self.table} WHERE tenant = ? AND state = ?",
            (TENANT, state),
            limit,
        )


class DeleteOnChange(StatePartitioned):
    """3c: delete only from the previous state the writer remembers."""

    key = "3c"
    name = "state-partitioned, delete only on change"
    table = "s3c_latest_by_state"
    schema_text = "as 3; delete only from the known previous state, skip older events"

    def __init__(self, session: Session, size: int, bucket_devices: int) -> None:
        super().__init__(session, size, bucket_devices)
        self.known: dict[str, Event] = {}

    def writes(self, event: Event) -> list[Write]:
        last = self.known.get(event.device_id)
        if last is not None and event.ts_ms <= last.ts_ms:
            return []  # a late or duplicated event: the state table already has newer
        self.known[event.device_id] = event
        out = [self._insert_row(event)]
        if last is not None and last.state != event.state:
            out.append(self._delete_row(event, last.state))
        return out


class Bucketed(StatePartitioned):
    """Solution 5: Solution 3 with (tenant, state, bucket) partitions."""

    key = 5
    name = "state-partitioned with buckets"
    table = "s5_latest_by_state"
    schema_text = "((tenant, state, bucket), device_id), bucket = crc32(device_id) % B"

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.size / self.bucket_devices))

    def bucket(self, device_id: str) -> int:
        return zlib.crc32(device_id.encode()) % self.buckets

    def create(self) -> list[str]:
        return [
            f"CREATE TABLE {self.table} (tenant text, state text, bucket int, device_id text, "
            "ts timestamp, value text, PRIMARY KEY ((tenant, state, bucket), device_id))"
        ]

    def prepare(self) -> None:
        self._insert = self.session.prepare(
            f"INSERT INTO {self.table} (tenant, state, bucket, device_id, ts, value) "
            "VALUES (?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
        )
        self._delete = self.session.prepare(
            f"DELETE FROM {self.table} USING TIMESTAMP ? "
            "WHERE tenant = ? AND state = ? AND bucket = ? AND device_id = ?"
        )

    def _insert_row(self, e: Event) -> Write:
        b = self.bucket(e.device_id)
        return (self._insert, (TENANT, e.state, b, e.device_id, e.ts_ms, e.value, e.write_ts))

    def _delete_row(self, e: Event, state: str) -> Write:
        return (self._delete, (e.write_ts, TENANT, state, self.bucket(e.device_id), e.device_id))

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        # Paged IN over partition keys: the coordinator reads the buckets one after
        # the other and stops once the page has its rows.
        return self._select(
            "SELECT device_id, toUnixTimestamp(ts) AS ts_ms, value "
            f"FROM {self.table} WHERE tenant = ? AND state = ? AND bucket IN ?",
            (TENANT, state, list(range(self.buckets))),
            limit,
        )


class TablePerState(Model):
    """Solution 4: latest_<state> tables, insert into one, delete from the others."""

    key = 4
    name = "one table per state"
    schema_text = "latest_<state> ((tenant, device_id)); read = scan with ALLOW FILTERING"

    @staticmethod
    def table(state: str) -> str:
        return f"s4_latest_{state}"

    def create(self) -> list[str]:
        return [
            f"CREATE TABLE {self.table(s)} (tenant text, device_id text, ts timestamp, "
            "value text, PRIMARY KEY ((tenant, device_id)))"
            for s in STATES
        ]

    def drop(self) -> list[str]:
        return [f"DROP TABLE IF EXISTS {self.table(s)}" for s in STATES]

    def prepare(self) -> None:
        self._insert = {
            s: self.session.prepare(
                f"INSERT INTO {self.table(s)} (tenant, device_id, ts, value) "
                "VALUES (?, ?, ?, ?) USING TIMESTAMP ?"
            )
            for s in STATES
        }
        self._delete = {
            s: self.session.prepare(
                f"DELETE FROM {self.table(s)} USING TIMESTAMP ? WHERE tenant = ? AND device_id = ?"
            )
            for s in STATES
        }

    def writes(self, event: Event) -> list[Write]:
        e = event
        out: list[Write] = [
            (self._insert[e.state], (TENANT, e.device_id, e.ts_ms, e.value, e.write_ts))
        ]
        out += [
            (self._delete[s], (e.write_ts, TENANT, e.device_id)) for s in STATES if s != e.state
        ]
        return out

    def read(self, state: str, *, limit: int | None) -> BoundStatement:
        # tenant is only part of the partition key: a scan of the whole table.
        text = (
            "SELECT device_id, toUnixTimestamp(ts) AS ts_ms, value "
            f"FROM {self.table(state)} WHERE tenant = ?"
        )
        if limit:
            text += f" LIMIT {limit}"
        return _bound(self.session.prepare(text + " ALLOW FILTERING"), (TENANT,), limit or 5000)


MODELS: tuple[type[Model], ...] = (
    MaterializedView,
    LegacyIndex,
    StatePartitioned,
    TablePerState,
    Bucketed,
    Sai,
    DeleteOnChange,
)


# -- measuring ----------------------------------------------------------------------


@dataclass
class Warnings:
    """Server warnings, grouped by their text with the numbers taken out."""

    seen: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, where: str, texts: Sequence[str] | None) -> None:
        for text in texts or ():
            key = re.sub(r"\d+", "N", re.sub(r"token -?\d+", "token", text))
            entry = self.seen.setdefault(key, {"text": text[:400], "count": 0, "where": []})
            entry["count"] += 1
            if where not in entry["where"]:
                entry["where"].append(where)

    def listed(self) -> list[dict[str, Any]]:
        return list(self.seen.values())


@dataclass
class Ingest:
    deliveries: int = 0
    statements: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    failures: int = 0
    unrecovered: int = 0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "deliveries": self.deliveries,
            "statements": self.statements,
            "seconds": round(self.seconds, 3),
            "cpu_s": round(self.cpu_s, 3),
            "write_failures_retried": self.failures,
            "write_failures_unrecovered": self.unrecovered,
            "phases": self.phases,
        }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster = build_cluster(CassandraConfig(keyspace=KEYSPACE))
        self.session: Session = self.cluster.connect()
        self.session.execute(
            f"CREATE KEYSPACE IF NOT EXISTS {KEYSPACE} WITH replication = "
            "{'class': 'SimpleStrategy', 'replication_factor': 1}"
        )
        self.session.set_keyspace(KEYSPACE)
        self.flush_error: str | None = None
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[models {elapsed // 60:02.0f}:{elapsed % 60:02.0f}] {message}", flush=True)

    def close(self) -> None:
        self.cluster.shutdown()

    def node(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cassandra": self.session.execute("SELECT release_version FROM system.local").one()[0]
        }
        try:
            rows = self.session.execute("SELECT name, value FROM system_views.settings")
            out.update({r.name: r.value for r in rows if r.name in SETTINGS})
        except Exception as exc:  # an older node without the virtual table
            out["settings_error"] = repr(exc)
        return out

    def drop_leftovers(self) -> None:
        """Tables of an interrupted earlier run (views first: they pin their base)."""
        for kind, column in (("views", "view_name"), ("tables", "table_name")):
            rows = self.session.execute(
                f"SELECT {column} FROM system_schema.{kind} WHERE keyspace_name = %s", (KEYSPACE,)
            )
            what = "MATERIALIZED VIEW" if kind == "views" else "TABLE"
            for row in rows:
                self.session.execute(f"DROP {what} IF EXISTS {row[0]}", timeout=120)

    def flush(self) -> None:
        """nodetool flush of the keyspace; without nodetool, say so once and go on."""
        if self.flush_error is not None or self.args.no_flush:
            return
        if (error := nodetool_flush(KEYSPACE)) is not None:
            self.flush_error = f"{error}; flushes skipped"
            self.say(self.flush_error)

    # -- writes --

    def write(self, model: Model, events: Sequence[Event], ingest: Ingest, warn: Warnings) -> None:
        statements = [w for e in events for w in model.writes(e)]
        results = execute_concurrent(
            self.session,
            statements,
            concurrency=self.args.concurrency,
            raise_on_first_error=False,
            results_generator=True,
        )
        failed: list[Write] = []
        for statement, (ok, result) in zip(statements, results, strict=True):
            if not ok:
                failed.append(statement)
            elif result.response_future.warnings:
                warn.add(f"{model.size} write", result.response_future.warnings)
        ingest.statements += len(statements)
        ingest.failures += len(failed)
        # Timestamps make any order right, so a failed write is simply sent again.
        for prepared, params in failed:
            for attempt in range(3):
                try:
                    self.session.execute(prepared, params, timeout=60)
                    break
                except Exception:
                    if attempt == 2:
                        ingest.unrecovered += 1
                    time.sleep(0.5)

    def ingest(self, model: Model, workload: Workload, warn: Warnings) -> Ingest:
        ingest = Ingest()
        for phase in workload.phases:
            t0, cpu0 = time.perf_counter(), time.process_time()
            self.write(model, phase.deliveries, ingest, warn)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            ingest.deliveries += len(phase.deliveries)
            ingest.seconds += seconds
            ingest.cpu_s += cpu
            ingest.phases[phase.name] = {
                "deliveries": len(phase.deliveries),
                "seconds": round(seconds, 3),
            }
            if phase.flush_after:
                self.flush()  # not timed: history now spans an SSTable and the memtable
        return ingest

    # -- reads --

    def first_page(
        self, model: Model, state: str, where: str, warn: Warnings, errors: list[str]
    ) -> dict[str, Any]:
        """Latency of the first page (LIMIT 100), then one traced execution."""
        statement = model.read(state, limit=PAGE)
        times: list[float] = []
        out: dict[str, Any] = {}
        deadline = time.monotonic() + self.args.read_budget
        try:
            for i in range(self.args.reads + 1):
                t0 = time.perf_counter()
                result = self.session.execute(statement, timeout=120)
                ms = (time.perf_counter() - t0) * 1000
                warn.add(where, result.response_future.warnings)
                if i == 0:  # on its own: legacy indexes repair stale entries on first read
                    out["first_ms"] = round(ms, 2)
                    out["rows"] = len(result.current_rows)
                else:
                    times.append(ms)
                if time.monotonic() > deadline:
                    break
        except Exception as exc:
            errors.append(f"{where} first page of {state!r}: {type(exc).__name__}: {exc}"[:600])
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.update({k: _ms(v) for k, v in percentiles(times).items()})
        if "error" not in out:
            out.update(self.traced(statement, state, where, warn, errors))
        return out

    def traced(
        self, statement: BoundStatement, state: str, where: str, warn: Warnings, errors: list[str]
    ) -> dict[str, Any]:
        try:
            result = self.session.execute(statement, trace=True, timeout=120)
            warn.add(where, result.response_future.warnings)
            trace = result.get_query_trace(max_wait_sec=30)
        except Exception as exc:
            errors.append(f"{where} traced read of {state!r}: {type(exc).__name__}: {exc}"[:600])
            return {"trace_error": f"{type(exc).__name__}: {exc}"[:300]}
        live = tombstones = 0
        filtered: int | None = None
        for event in trace.events:
            if m := TRACE_READ.search(event.description):
                live += int(m.group(1))
                tombstones += int(m.group(2))
            elif m := TRACE_SAI.search(event.description):
                filtered = (filtered or 0) + int(m.group(1))
        server_ms = trace.duration.total_seconds() * 1000 if trace.duration else None
        out: dict[str, Any] = {"live_rows": live, "tombstones": tombstones}
        if filtered is not None:
            out["sai_post_filtered"] = filtered
        return out | {"traced_server_ms": _ms(server_ms)}

    def check(
        self, model: Model, workload: Workload, where: str, errors: list[str]
    ) -> dict[str, Any]:
        """Read every state in full; each device in exactly its newest event's state."""
        found: dict[str, list[tuple[str, int]]] = {}
        counts = {"missing": 0, "in_several_states": 0, "wrong_state": 0, "wrong_ts": 0}
        counts["unknown_device"] = counts["read_errors"] = 0
        rows_per_state: dict[str, int] = {}
        for state in STATES:
            try:
                rows = list(self.session.execute(model.read(state, limit=None), timeout=120))
            except Exception as exc:
                counts["read_errors"] += 1
                errors.append(f"{where} full read of {state!r}: {type(exc).__name__}: {exc}"[:600])
                continue
            rows_per_state[state] = len(rows)
            for row in rows:
                found.setdefault(row.device_id, []).append((state, row.ts_ms))
        for device, newest in workload.truth.items():
            places = found.get(device, [])
            if not places:
                counts["missing"] += 1
            elif len(places) > 1:
                counts["in_several_states"] += 1
            elif places[0][0] != newest.state:
                counts["wrong_state"] += 1
            elif places[0][1] != newest.ts_ms:
                counts["wrong_ts"] += 1
        counts["unknown_device"] = len(set(found) - set(workload.truth))
        return {"ok": not any(counts.values()), **counts, "rows_per_state": rows_per_state}

    def reads(
        self, model: Model, workload: Workload, stage: str, warn: Warnings, errors: list[str]
    ) -> dict[str, Any]:
        where = f"{model.size} {stage}"
        return {
            "common": self.first_page(model, COMMON, where, warn, errors),
            "rare": self.first_page(model, RARE, where, warn, errors),
            "correctness": self.check(model, workload, where, errors),
        }

    # -- one model at one size --

    def measure(self, cls: type[Model], workload: Workload) -> dict[str, Any]:
        model = cls(self.session, workload.size, self.args.bucket_devices)
        started = time.monotonic()
        warn, errors = Warnings(), []
        for cql in model.drop():
            self.session.execute(cql, timeout=120)
        for cql in model.create():
            result = self.session.execute(cql, timeout=120)
            warn.add(f"{workload.size} schema", result.response_future.warnings)
        model.prepare()
        ingest = self.ingest(model, workload, warn)
        if ingest.unrecovered:
            errors.append(f"{workload.size}: {ingest.unrecovered} writes failed 3 retries")
        before = self.reads(model, workload, "before flush", warn, errors)
        self.flush()
        after = self.reads(model, workload, "after flush", warn, errors)
        if not self.args.keep:
            for cql in model.drop():
                self.session.execute(cql, timeout=120)
        return {
            "ingest": ingest,
            "before": before,
            "after": after if self.flush_error is None and not self.args.no_flush else None,
            "warnings": warn,
            "errors": errors,
            "extra": {"buckets": model.buckets} if isinstance(model, Bucketed) else {},
            "seconds": round(time.monotonic() - started, 1),
        }


def _ms(value: float | int | None) -> float | None:
    return None if value is None else round(float(value), 2)


# -- the report ---------------------------------------------------------------------


def assemble(
    selected: Sequence[type[Model]], runs: dict[tuple[str, int], dict[str, Any]], sizes: list[int]
) -> list[dict[str, Any]]:
    """One entry per model, every figure keyed by fleet size."""
    out = []
    for cls in selected:
        entry: dict[str, Any] = {"solution": cls.key, "name": cls.name, "schema": cls.schema_text}
        per: dict[str, dict[str, Any]] = {
            k: {}
            for k in (
                "correctness",
                "writes_per_s",
                "cpu_us_per_event",
                "statements_per_event",
                "ingest",
                "read_ms",
                "tombstones",
                "live_rows",
                "read_ms_after_flush",
                "tombstones_after_flush",
                "live_rows_after_flush",
                "sai_post_filtered",
                "sai_post_filtered_after_flush",
                "run_seconds",
                "extra",
            )
        }
        warnings: dict[str, dict[str, Any]] = {}
        errors: list[str] = []
        correct = True
        for size in sizes:
            run = runs.get((str(cls.key), size))
            if run is None:
                correct = False
                continue
            n = str(size)
            ingest: Ingest = run["ingest"]
            per["ingest"][n] = ingest.summary()
            per["writes_per_s"][n] = round(ingest.deliveries / ingest.seconds, 1)
            per["cpu_us_per_event"][n] = round(ingest.cpu_s / ingest.deliveries * 1e6, 1)
            per["statements_per_event"][n] = round(ingest.statements / ingest.deliveries, 3)
            stages = {"before flush": run["before"], "after flush": run["after"]}
            per["correctness"][n] = {
                stage: reads["correctness"] for stage, reads in stages.items() if reads
            }
            correct = correct and all(c["ok"] for c in per["correctness"][n].values())
            correct = correct and not ingest.unrecovered
            for suffix, reads in (("", run["before"]), ("_after_flush", run["after"])):
                if not reads:
                    continue
                per["read_ms" + suffix][n] = {
                    kind: {
                        k: reads[kind].get(k)
                        for k in ("p50", "p99", "max", "n", "first_ms", "rows", "error")
                        if k in reads[kind]
                    }
                    for kind in ("common", "rare")
                }
                for metric in ("tombstones", "live_rows", "sai_post_filtered"):
                    values = {kind: reads[kind].get(metric) for kind in ("common", "rare")}
                    if any(v is not None for v in values.values()):
                        per[metric + suffix][n] = values
            per["run_seconds"][n] = run["seconds"]
            if run["extra"]:
                per["extra"][n] = run["extra"]
            for key, w in run["warnings"].seen.items():
                merged = warnings.setdefault(key, {"text": w["text"], "count": 0, "where": []})
                merged["count"] += w["count"]
                merged["where"] += [x for x in w["where"] if x not in merged["where"]]
            errors += run["errors"]
        entry["correct"] = correct
        optional = ("extra", "sai_post_filtered", "sai_post_filtered_after_flush")
        entry.update({k: v for k, v in per.items() if v or k not in optional})
        entry["warnings"] = list(warnings.values())
        entry["errors"] = errors
        entry["meets_target"] = meets_target(entry)
        out.append(entry)
    return out


def meets_target(entry: dict[str, Any]) -> bool:
    """Correct everywhere, and first-page p99 <= 50 ms for both states, every size, every stage."""
    if not entry["correct"]:
        return False
    for key in ("read_ms", "read_ms_after_flush"):
        for by_kind in entry.get(key, {}).values():
            for r in by_kind.values():
                if r.get("error") or r.get("p99") is None or r["p99"] > TARGET_P99_MS:
                    return False
    return True


def _pair(read: dict[str, Any] | None) -> str:
    if not read:
        return "-"
    if read.get("error"):
        return "**fails**"
    return f"{read['p50']:.1f} / {read['p99']:.1f}"


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(report: dict[str, Any]) -> Iterator[str]:
    w = report["workload"]
    yield "# State-view data models on Cassandra (`make bench-models`)"
    yield ""
    yield (
        f"Run {report['when']} on Cassandra {report['node'].get('cassandra')} (one node, this "
        f"2-core box), cassandra-driver {report['driver']}: `{report['command']}` "
        f"({report['seconds'] / 60:.1f} min)."
    )
    yield ""
    yield (
        f"Workload per fleet size N (one tenant, seed {w['seed']}): (a) every device publishes "
        f'"{RARE}" (then `nodetool flush`), (b) every device publishes "{COMMON}", '
        f"(c) {w['churn_rounds']} churn rounds of {w['churn_share']:.0%} of the devices, 1-2 "
        f'events each ({w["fault_share"]:.0%} "{OTHER}", the rest "{COMMON}"), '
        f"{w['duplicate_share']:.0%} delivered twice, shuffled per round, (d) one device "
        f'publishes "{RARE}". Every write USING TIMESTAMP = event time. '
        f"{w['concurrency']} statements in flight. Reads: the first page of {PAGE} devices "
        f'in the common state "{COMMON}" and in the rare state "{RARE}" (which ends with one '
        f"device), up to {w['reads']} times; tombstones from the query's trace."
    )
    yield ""
    if report.get("flush_error"):
        yield f"**{report['flush_error']}**"
        yield ""
    yield "## Summary"
    yield ""
    yield (
        f"| Solution | Correct at every size | Worst first-page p99 (ms) | Most tombstones "
        f"per first page | p99 ≤ {TARGET_P99_MS:.0f} ms everywhere and correct |"
    )
    yield "|---|---|---:|---:|---|"
    for s in report["solutions"]:
        p99s = [
            r.get("p99")
            for key in ("read_ms", "read_ms_after_flush")
            for by_kind in s.get(key, {}).values()
            for r in by_kind.values()
        ]
        failed = any(
            r.get("error")
            for key in ("read_ms", "read_ms_after_flush")
            for by_kind in s.get(key, {}).values()
            for r in by_kind.values()
        )
        tombs = [
            t
            for key in ("tombstones", "tombstones_after_flush")
            for by_kind in s.get(key, {}).values()
            for t in by_kind.values()
            if t is not None
        ]
        worst = max((p for p in p99s if p is not None), default=None)
        worst_text = ("read fails; " if failed else "") + _num(worst, ",.1f")
        yield (
            f"| {s['solution']} {s['name']} | {'yes' if s['correct'] else '**no**'} | "
            f"{worst_text} | {_num(max(tombs, default=None))} | "
            f"{'yes' if s['meets_target'] else 'no'} |"
        )
    yield ""
    yield "## Per size"
    yield ""
    yield (
        f'| Solution | N | Correct | Writes/s | CPU µs/event | Stmts/event | "{COMMON}" p50 / p99 '
        f'ms | "{RARE}" p50 / p99 ms | after final flush "{COMMON}" | after final flush "{RARE}" | '
        f'Tombstones "{COMMON}" / "{RARE}" (after final flush) |'
    )
    yield "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    for s in report["solutions"]:
        for n in (str(x) for x in report["sizes"]):
            if n not in s["writes_per_s"]:
                continue
            ok = all(c["ok"] for c in s["correctness"][n].values())
            before = s["read_ms"].get(n, {})
            after = s["read_ms_after_flush"].get(n, {})
            t = s["tombstones"].get(n, {})
            ta = s["tombstones_after_flush"].get(n, {})
            stale = ""  # SAI: index matches the read discarded
            if sf := s.get("sai_post_filtered_after_flush", {}).get(n):
                sb = s.get("sai_post_filtered", {}).get(n, {})
                stale = (
                    f"; SAI post-filtered {_num(sb.get('common'))} / {_num(sb.get('rare'))} "
                    f"({_num(sf.get('common'))} / {_num(sf.get('rare'))})"
                )
            yield (
                f"| {s['solution']} | {int(n):,} | {'yes' if ok else '**no**'} | "
                f"{s['writes_per_s'][n]:,.0f} | {s['cpu_us_per_event'][n]:,.0f} | "
                f"{s['statements_per_event'][n]:.2f} | {_pair(before.get('common'))} | "
                f"{_pair(before.get('rare'))} | {_pair(after.get('common'))} | "
                f"{_pair(after.get('rare'))} | {_num(t.get('common'))} / {_num(t.get('rare'))} "
                f"({_num(ta.get('common'))} / {_num(ta.get('rare'))}){stale} |"
            )
    yield ""
    yield "## Warnings and errors"
    yield ""
    for s in report["solutions"]:
        if not s["warnings"] and not s["errors"]:
            continue
        yield f"**{s['solution']} {s['name']}**"
        yield ""
        for warning in s["warnings"]:
            where = ", ".join(warning["where"][:6])
            yield f"- warning x{warning['count']} ({where}): {warning['text']}"
        for error in s["errors"]:
            yield f"- error: {error}"
        yield ""
    yield "## How it is measured"
    yield ""
    doc = (__doc__ or "").split("Measured per model and fleet size, all from this run:")[1]
    yield "Measured per model and fleet size:" + doc.split("Writes bench/results")[0].rstrip()
    yield ""
    yield "Node settings: " + ", ".join(f"{k} = {v}" for k, v in report["node"].items())


# -- main ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1000,10000,100000", help="fleet sizes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="smoke test: sizes 1000,5000")
    parser.add_argument("--only", default="", help="models to run, e.g. 1,3,SAI,3c (default all)")
    parser.add_argument("--concurrency", type=int, default=64, help="statements in flight")
    parser.add_argument("--reads", type=int, default=40, help="first-page reads per state")
    parser.add_argument("--read-budget", type=float, default=15.0, help="seconds per read series")
    parser.add_argument("--rounds", type=int, default=3, help="churn rounds")
    parser.add_argument("--bucket-devices", type=int, default=10_000, help="devices per bucket (5)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-flush", action="store_true", help="never run nodetool flush")
    parser.add_argument("--keep", action="store_true", help="keep each model's tables")
    parser.add_argument("--out", type=Path, default=RESULTS / "models.json")
    args = parser.parse_args()
    sizes = [1000, 5000] if args.quick else [int(x) for x in args.sizes.split(",")]
    wanted = {x.strip() for x in args.only.split(",") if x.strip()}
    selected = [m for m in MODELS if not wanted or str(m.key) in wanted]
    # Server warnings are collected from each response; the driver would also
    # log every one of them (thousands of tombstone warnings) to stderr.
    logging.getLogger("cassandra.protocol").setLevel(logging.ERROR)

    shares = {"churn_share": 0.10, "fault_share": 0.10, "duplicate_share": 0.25}
    bench = Bench(args)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    workloads: dict[str, Any] = {}
    try:
        node = bench.node()
        bench.drop_leftovers()
        for size in sizes:
            workload = make_workload(
                size,
                args.seed,
                args.rounds,
                shares["churn_share"],
                shares["fault_share"],
                shares["duplicate_share"],
            )
            workloads[str(size)] = workload.summary()
            for cls in selected:
                bench.say(f"N={size:,} solution {cls.key} ({cls.name}): writing")
                run = bench.measure(cls, workload)
                runs[(str(cls.key), size)] = run
                ingest: Ingest = run["ingest"]
                rare = run["before"]["rare"]
                bench.say(
                    f"N={size:,} solution {cls.key}: {ingest.deliveries / ingest.seconds:,.0f} "
                    f"events/s, correct {run['before']['correctness']['ok']}, "
                    f"alarm p99 {rare.get('p99')} ms, tombstones {rare.get('tombstones')}"
                    + (f", {len(run['errors'])} errors" if run["errors"] else "")
                )
    finally:
        bench.close()
    report: dict[str, Any] = {
        "solutions": assemble(selected, runs, sizes),
        "workload": {
            "seed": args.seed,
            "tenant": TENANT,
            "states": list(STATES),
            "common": COMMON,
            "rare": RARE,
            "churn_rounds": args.rounds,
            **shares,
            "concurrency": args.concurrency,
            "consistency": "LOCAL_QUORUM (one node, RF 1)",
            "page": PAGE,
            "reads": args.reads,
            "read_budget_s": args.read_budget,
            "bucket_devices": args.bucket_devices,
            "per_size": workloads,
        },
        "sizes": sizes,
        "node": node,
        "driver": cassandra_driver_version,
        "flush_error": bench.flush_error,
        "command": shlex.join(["bench/models.py", *sys.argv[1:]]),
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round(time.monotonic() - bench.started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(markdown(report)) + "\n")
    print(f"results: {args.out} and {args.out.with_suffix('.md')}", flush=True)


if __name__ == "__main__":
    main()
