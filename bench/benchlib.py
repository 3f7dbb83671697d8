"""Shared pieces of the benchmark harness (bench/run.py) and its systems under test.

* Processes under test run as subprocesses with their output in a log file
  (never a pipe nobody drains); :class:`Proc` follows the log for a ready line
  and a progress counter, and reads CPU time and peak RSS from /proc.
* MQTT: every system gets its own persistent session (client id), created by
  the harness before a backlog is published and cleared afterwards
  (clean start, session expiry 0). The benchmark uses its own topic tree
  (``gwbench/...``), so gateways run by anyone else on the same broker don't
  receive its load.
* Cassandra: everything goes to the ``gateway_bench`` keyspace, one tenant per
  system and run, so stored rows can be counted exactly. Raw telemetry is read
  back as ``gateway history`` reads it (gateway/store/queries.py): each
  partition once, however many bucket sizes list it, one copy per event.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiomqtt
import uvloop
from cassandra.cluster import Cluster, Session
from cassandra.concurrent import execute_concurrent_with_args
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from rows import KEYSPACE, SESSION_EXPIRY, STATES, SUBSCRIPTION

from gateway.config import CassandraConfig, Config
from gateway.store.database import Database, build_cluster
from gateway.store.queries import devices_in_state, history_partitions, unique_events
from gateway.tools.simulate import FleetSpec, PublishStats, publish
from gateway.units import epoch_ms

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MQTT_HOST = "127.0.0.1"
MQTT_PORT = 1883
TOPIC_TEMPLATE = "gwbench/{tenant}/devices/{device_id}/events"
T = TypeVar("T")


# -- processes ----------------------------------------------------------------


def broker_store_mb() -> float | None:
    """The size of the local Mosquitto's persistence file (None if absent).
    Mosquitto rewrites the whole file every 5,000 changes and serves nobody
    meanwhile, so a large one (sessions left behind) adds stalls to every
    latency figure (bench/publish_acks.py)."""
    store = Path(os.environ.get("STATE_DIR", ROOT / ".state")) / "mosquitto" / "mosquitto.db"
    return round(store.stat().st_size / 1e6, 1) if store.exists() else None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_bytes(pid: int) -> int:
    """Bytes the process (all its threads) caused to be written to storage
    (/proc/<pid>/io ``write_bytes``: page cache writes it dirtied; not the file
    system's own journal and metadata writes)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def _status_kb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return float(line.split()[1])
    return 0.0


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident set size."""
    return _status_kb(pid, "VmHWM:") / 1024


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS:") / 1024


class ProcError(RuntimeError):
    pass


@dataclass
class Proc:
    """A process under test, followed through its log file."""

    name: str
    cmd: Sequence[str]
    env: dict[str, str]
    log: Path
    ready: Sequence[re.Pattern[str]]  # all of them, in any order; ready at the last
    progress: re.Pattern[str] | None = None
    cwd: Path = ROOT
    popen: subprocess.Popen[bytes] | None = None
    count: int = 0
    ready_at: float | None = None
    ready_cpu: float = 0.0
    _offset: int = 0
    _partial: str = ""
    _ready_seen: bool = False
    _pending: list[re.Pattern[str]] = field(default_factory=list)
    last_progress_line: str = ""
    # The gateway's own count of events it left out of the raw table (its
    # status line's sampled_out; 0 for a system without one): what a read-back
    # check of this process's tenants must not call missing.
    sampled_out: int = 0

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.popen = subprocess.Popen(
                list(self.cmd),
                env=self.env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._offset, self._partial, self._ready_seen = 0, "", False
        self._pending = list(self.ready)
        self.count, self.ready_at, self.sampled_out = 0, None, 0
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def poll(self) -> None:
        """Read new log lines: note the ready line and the latest progress count."""
        with open(self.log, errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        if not chunk:
            return
        text = self._partial + chunk
        *complete, self._partial = text.split("\n")
        for line in complete:
            if not self._ready_seen:
                self._pending = [p for p in self._pending if not p.search(line)]
                if not self._pending:
                    self._ready_seen = True
                    self.ready_at = time.monotonic()
                    self.ready_cpu = cpu_seconds(self.pid) if self.alive() else 0.0
            if self.progress is not None and (m := self.progress.search(line)):
                # Several groups (written, rejected, sampled out...) add up.
                count = sum(int(g) for g in m.groups() if g is not None)
                if count >= self.count:
                    self.count = count
                    self.last_progress_line = line
                    sampled = SAMPLED_OUT.search(line)
                    self.sampled_out = int(sampled.group(1)) if sampled else 0

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if self._ready_seen:
                return
            if not self.alive():
                raise ProcError(f"{self.name} exited before it was ready:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise ProcError(f"{self.name} not ready after {timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.02)

    def wait_count(
        self,
        target: int,
        timeout: float,
        tick: Callable[[], None] | None = None,
        stall: float = 60.0,
    ) -> bool:
        """Wait until the progress counter reaches ``target``; False on timeout/stall."""
        deadline = time.monotonic() + timeout
        last_change, last = time.monotonic(), self.count
        next_tick = time.monotonic() + 5.0
        while True:
            self.poll()
            now = time.monotonic()
            if self.count >= target:
                return True
            if self.count != last:
                last_change, last = now, self.count
            if not self.alive():
                raise ProcError(f"{self.name} exited:\n{self._tail()}")
            if now > deadline or now - last_change > stall:
                return False
            if tick is not None and now >= next_tick:
                tick()
                next_tick = now + 5.0
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> int | None:
        """:func:`stop_process`; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)  # one frozen (instances.py) can't act
        return stop_process(self.popen, timeout)


def stop_process(popen: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM (so a gateway's log ends with its "stopped:" counts), then
    SIGKILL if it is still there ``timeout`` seconds later; the exit code."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)
    return popen.returncode


# -- MQTT -----------------------------------------------------------------------


async def _connect(client_id: str, *, clean: bool, expiry: int) -> aiomqtt.Client:
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = expiry
    return aiomqtt.Client(
        MQTT_HOST,
        MQTT_PORT,
        identifier=client_id,
        clean_start=clean,
        protocol=aiomqtt.ProtocolVersion.V5,
        properties=props,
    )


async def _create_session(client_id: str, subscription: str) -> None:
    async with await _connect(client_id, clean=True, expiry=SESSION_EXPIRY) as client:
        await client.subscribe(subscription, qos=1)


async def _clear_session(client_id: str) -> None:
    async with await _connect(client_id, clean=True, expiry=0):
        pass


# Sessions create_session made and clear_session has not cleared yet: what
# run_tool clears when a tool ends, whichever way it ends.
_OPEN_SESSIONS: set[str] = set()


def create_session(client_id: str, root: str = "gwbench") -> None:
    """A fresh persistent session subscribed to the bench tree (the broker queues for it);
    ``root``: its first level (a tree of one's own: see :func:`gateway_env`)."""
    _OPEN_SESSIONS.add(client_id)
    asyncio.run(_create_session(client_id, SUBSCRIPTION.replace("gwbench", root, 1)))


def clear_session(client_id: str) -> None:
    """Drop a persistent session and whatever the broker still queues for it."""
    asyncio.run(_clear_session(client_id))
    _OPEN_SESSIONS.discard(client_id)


def run_tool(main: Callable[[], None]) -> None:
    """Run a bench tool's ``main``. SIGTERM (``kill``, ``timeout``) ends it as
    Ctrl-C does, with a KeyboardInterrupt (raised, not passed on as SIGINT: a
    tool started in the background by a script ignores SIGINT), so its
    ``finally`` blocks run and stop the processes it started; then every session that
    :func:`create_session` made and nothing cleared is cleared, and a
    stopped tool exits 130 with one line instead of a traceback. Killed
    outright, a tool left its session behind, subscribed to the bench tree;
    the broker queued every later bench publish for it until it expired,
    and its store grew to hundreds of MB, whose autosaves stall every client
    (bench/PERFORMANCE.md)."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        main()
    except KeyboardInterrupt:
        print(f"{Path(sys.argv[0]).name}: stopped", file=sys.stderr)
        sys.exit(130)
    finally:
        for client_id in sorted(_OPEN_SESSIONS):
            try:
                clear_session(client_id)
            except Exception as exc:
                print(f"could not clear MQTT session {client_id}: {exc}", file=sys.stderr)


@dataclass(frozen=True, slots=True)
class Sent:
    device_id: str
    ts: int
    state: str
    sent_at: float | None  # epoch ms, publisher's clock just before the PUBLISH


def apply_schema() -> None:
    """`gateway schema apply` on the bench keyspace (idempotent), before a run."""
    subprocess.run(
        [sys.executable, "-m", "gateway", "schema", "apply"],
        env=gateway_env("gwbench-schema"),
        check=True,
        capture_output=True,
    )


def ceiling_command(prefix: str, devices: int, count: int, levels: str, out: Path) -> list[str]:
    """bench/ceiling.py's command line: ``count`` events' rows of ``devices``
    devices at each concurrency level of ``levels``, into tenants named from
    ``prefix``, its report to ``out``."""
    return [
        *(sys.executable, str(BENCH / "ceiling.py"), "--prefix", prefix),
        *("--devices", str(devices), "--count", str(count)),
        *("--levels", levels, "--out", str(out)),
    ]


# Events whose rows warm_up_cassandra writes: right after a restart, 40,000
# left the ceiling at 10,767 msg/s, 120,000 brought it to 16,485, the warm
# level (bench/PERFORMANCE.md).
WARM_UP_EVENTS = 120_000
# A local Cassandra younger than this is taken to be cold (--warm-up auto).
COLD_FOR_S = 600.0


def warm_up_cassandra(prefix: str, devices: int, out: Path, log: Path) -> float:
    """Write WARM_UP_EVENTS events' rows through ceiling.py, unmeasured, so
    that a JVM started a minute ago is compiled before anything is measured
    (a run that began a minute after a restart gave the ceiling 8,181 msg/s
    against about 15,000 warm). Its output goes to ``log``; returns seconds."""
    apply_schema()  # ceiling.py writes into the bench keyspace
    began = time.monotonic()
    cmd = ceiling_command(prefix, devices, WARM_UP_EVENTS, "128", out)
    with log.open("w") as output:
        subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - began


def local_pid(*names: str, marker: bytes) -> int | None:
    """The pid in the first of ``names`` (pidfiles in `make up`'s run
    directory) whose process is alive and has ``marker`` in its command line,
    or None when there is none of ours."""
    run = Path(os.environ.get("STATE_DIR", ROOT / ".state")) / "run"
    for name in names:
        try:
            pid = int((run / name).read_text().split()[0])
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except (OSError, ValueError, IndexError):
            continue
    return None


def cassandra_pid() -> int | None:
    """The local Cassandra's pid (`make up`'s, one node or node 1 of three)."""
    return local_pid("cassandra.pid", "cassandra-node1.pid", marker=b"CassandraDaemon")


def mosquitto_pid() -> int | None:
    """The local Mosquitto's pid (`make up`'s)."""
    return local_pid("mosquitto.pid", marker=b"mosquitto")


SERVICES = {"Cassandra": cassandra_pid, "Mosquitto": mosquitto_pid}


def services_cpu() -> dict[str, float]:
    """CPU seconds so far of the local Cassandra and Mosquitto (`make up`'s),
    by name; NaN for one that is not ours (not started by `make up`)."""
    cpu: dict[str, float] = {}
    for name, find in SERVICES.items():
        pid = find()
        cpu[name] = float("nan") if pid is None else cpu_seconds(pid)
    return cpu


def services_cpu_since(before: dict[str, float], messages: int) -> dict[str, float | None]:
    """µs of CPU per message each service used since ``before``
    (:func:`services_cpu`); None for one that is not ours."""
    after = services_cpu()
    return {
        name: None
        if math.isnan(used := after[name] - before[name])
        else used / max(messages, 1) * 1e6
        for name in before
    }


# Cassandra at rest here uses 0.015 to 0.025 of a core; after a phase that
# wrote 100,000 events it went on compacting into the next system's drain.
QUIET_CORES = 0.1
QUIET_WINDOW_S = 2.0


def nodetool_flush(*keyspaces: str) -> str | None:
    """``nodetool flush`` (of ``keyspaces``, or all) on the local Cassandra,
    through cassandra/cassandra.sh; the error, if it could not be done."""
    script = ROOT / "cassandra" / "cassandra.sh"
    try:
        subprocess.run(
            ["bash", str(script), "nodetool", "flush", *keyspaces],
            check=True,
            capture_output=True,
            text=True,
            timeout=180,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return f"nodetool flush unavailable: {exc} {detail}"[:500]
    return None


def settle_cassandra(limit_s: float = 120.0) -> tuple[float, float | None]:
    """Flush the local Cassandra's memtables, then wait until it uses under
    QUIET_CORES over QUIET_WINDOW_S (the flush and its compactions of what
    earlier phases wrote are done), at most ``limit_s``. Returns the seconds
    waited and the cores it used in the last window (None when there is no
    Cassandra of ours to watch). Without the flush, whichever system's
    writes filled a memtable paid for flushing every earlier phase's rows in
    it: in one `make bench` run with it, Node-RED's drain cost Cassandra 185
    µs per message, against 302 to 332 in three runs without."""
    pid = cassandra_pid()
    if pid is None:
        return 0.0, None
    started = time.monotonic()
    if (error := nodetool_flush()) is not None:
        print(f"{error} (settling without it)", flush=True)
    while True:
        before = cpu_seconds(pid)
        time.sleep(QUIET_WINDOW_S)
        cores = (cpu_seconds(pid) - before) / QUIET_WINDOW_S
        waited = time.monotonic() - started
        if cores < QUIET_CORES or waited >= limit_s:
            return waited, cores


def cassandra_age_s() -> float | None:
    """Seconds since the local Cassandra started (`make up`'s, one node or
    node 1 of three), or None when there is none of ours to look at."""
    pid = cassandra_pid()
    if pid is None:
        return None
    try:
        # Field 22 of /proc/<pid>/stat: start time, in ticks after boot.
        started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")


def add_warm_up(parser: argparse.ArgumentParser) -> None:
    """A tool's ``--warm-up {auto,yes,no}``; act on it with :func:`maybe_warm_up`."""
    parser.add_argument(
        "--warm-up",
        choices=("auto", "yes", "no"),
        default="auto",
        help=f"write {WARM_UP_EVENTS:,} events' rows to Cassandra first, unmeasured "
        f"(about 20 s); auto: when the local Cassandra started under "
        f"{COLD_FOR_S / 60:.0f} minutes ago (a cold JIT)",
    )


def maybe_warm_up(choice: str, devices: int) -> None:
    """Warm Cassandra up as ``--warm-up`` says, and say what was decided."""
    age = cassandra_age_s()
    if choice == "no":
        skip = "--warm-up no"
    elif choice == "auto" and age is None:
        skip = "no local Cassandra of ours to judge"
    elif choice == "auto" and age is not None and age >= COLD_FOR_S:
        skip = f"up for {age / 60:.0f} min"
    else:
        skip = ""
    if skip:
        print(f"Cassandra warm-up skipped ({skip})", flush=True)
        return
    why = "--warm-up yes" if choice == "yes" else f"started {age:.0f} s ago"
    print(
        f"warming Cassandra up ({why}): {WARM_UP_EVENTS:,} events' rows, not measured", flush=True
    )
    tag = uuid.uuid4().hex[:6]
    out = Path(f"/tmp/bench-warm-{tag}.json")
    seconds = warm_up_cassandra(f"warm{tag}", devices, out, out.with_suffix(".log"))
    print(f"warmed up in {seconds:.0f} s", flush=True)


def add_gateway_env(parser: argparse.ArgumentParser, help: str) -> None:
    """The bench tools' ``--gateway-env GATEWAY_X__Y=V`` (repeatable); read
    it with :func:`gateway_settings`."""
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        type=_setting,
        metavar="GATEWAY_X__Y=V",
        help=help,
    )


def _setting(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return text


def gateway_settings(items: Iterable[str]) -> dict[str, str]:
    """``--gateway-env``'s NAME=VALUE items as environment variables."""
    return dict(item.split("=", 1) for item in items)


def gateway_env(client_id: str, root: str = "gwbench", **settings: str) -> dict[str, str]:
    """The environment of a `gateway run` under test: this process's without
    any GATEWAY_ setting, the bench keyspace, the bench tree under ``root`` (a
    root of its own keeps other benches' load on the shared broker out of its
    counts), a persistent session for ``client_id``, no HTTP port, a status
    line every second; then ``settings`` (``CASSANDRA__DRIVER="python"`` sets
    GATEWAY_CASSANDRA__DRIVER)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_MQTT__CLIENT_ID": client_id,
        "GATEWAY_MQTT__SESSION_EXPIRY": "600",
        "GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE,
        "GATEWAY_TOPICS": f'[{{template = "{template(root)}"}}]',
        "GATEWAY_PIPELINE__STATUS_INTERVAL": "1s",
        "GATEWAY_API__PORT": "0",
    }
    return env | {f"GATEWAY_{k}": v for k, v in settings.items()}


# Messages a gateway has finished with: written, rejected or sampled out. In
# spool mode "acked" counts spool commits, so it is no measure of writes.
HANDLED = re.compile(r"status: .*written=(\d+) .*rejected=(\d+) sampled_out=(\d+)")
# Read from whichever progress line a Proc accepts (Proc.sampled_out): the
# gateway's status lines carry it, other systems' lines don't (0).
SAMPLED_OUT = re.compile(r"\bsampled_out=(\d+)")
READY = re.compile(r"connected to mqtt://")


def template(root: str) -> str:
    return TOPIC_TEMPLATE.replace("gwbench", root, 1)


def fleet_spec(
    tenant: str, devices: int, rate: float = 1e9, seed: int = 1, root: str = "gwbench"
) -> FleetSpec:
    return FleetSpec(
        devices=devices, rate=rate, tenant=tenant, topic_template=template(root), seed=seed
    )


def publish_recorded(
    spec: FleetSpec, *, count: int | None = None, duration: float | None = None
) -> tuple[PublishStats, list[Sent]]:
    """Publish with gateway.simulate.publish and record every acknowledged message."""
    sent: list[Sent] = []

    def on_sent(topic: str, event: dict[str, Any]) -> None:
        sent.append(Sent(topic.split("/")[3], event["ts"], event["state"], event["sent_at"]))

    # uvloop, as `gateway simulate` runs it: the publisher's CPU is taken from
    # the cores the system under test runs on.
    stats = uvloop.run(
        publish(spec, count=count, duration=duration, on_sent=on_sent, status_every=3600)
    )
    return stats, sent


# -- Cassandra ------------------------------------------------------------------


def cassandra_config(keyspace: str = KEYSPACE) -> CassandraConfig:
    return CassandraConfig(keyspace=keyspace)


def connect_cluster(keyspace: str = KEYSPACE) -> tuple[Cluster, Session]:
    """Same driver settings as the gateway (gateway.database.build_cluster)."""
    cluster = build_cluster(cassandra_config(keyspace))
    return cluster, cluster.connect(keyspace)


# Every event a bench run can have written, for gateway.store.queries' time range.
ALL_TIME = (datetime(1970, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))


@dataclass(frozen=True, slots=True)
class Stored:
    """One raw telemetry row as read back."""

    device_id: str
    ts: int  # epoch ms
    event_id: int
    write_us: int  # WRITETIME(received_at): when the writer's driver sent it
    received_ms: int  # received_at: when the system under test got the message


async def read_back(
    db: Database, tenant: str, devices: Iterable[str], in_flight: int = 128
) -> list[Stored]:
    """The devices' raw telemetry, as ``gateway history`` reads it: the
    partitions of queries.history_partitions (a partition that two bucket
    sizes share is read once) and one copy per (ts, event_id)
    (queries.unique_events), plus each row's receive and write times, which
    history leaves out."""
    rows_of = await db.prepared(
        "SELECT ts, event_id, toUnixTimestamp(received_at) AS received_ms, "
        "WRITETIME(received_at) AS wt FROM {keyspace}.telemetry "
        "WHERE tenant = ? AND device_id = ? AND bucket_start = ? AND shard = ?"
    )
    limit = asyncio.Semaphore(in_flight)

    async def one(device: str) -> list[Stored]:
        async with limit:
            wanted = await history_partitions(db, tenant, device, *ALL_TIME)
            parts = [await db.execute(rows_of, (tenant, device, p.start, p.shard)) for p in wanted]
        return [
            Stored(device, epoch_ms(r.ts), r.event_id, r.wt, r.received_ms)
            for r in unique_events(parts)
        ]

    found = await asyncio.gather(*(one(d) for d in devices))
    return [row for rows in found for row in rows]


@dataclass
class Check:
    """Stored rows of one tenant compared with what was published."""

    published: int
    stored: int
    matched: int
    devices: int
    # Events the system reports it left out of the raw table on purpose (the
    # gateway's sampler, for a device over sampling.noisy_above): published,
    # decided, not stored. Counted, not identified: a run passes when every
    # stored row is a published event and stored + sampled_out = published.
    sampled_out: int = 0
    latest_ok: int | None = None
    state_ok: int | None = None
    write_us: list[int] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.stored == self.matched
            and self.stored + self.sampled_out == self.published
            and self.latest_ok in (None, self.devices)
            and self.state_ok in (None, self.devices)
        )

    @classmethod
    def together(cls, checks: Sequence[Check], sampled_out: int) -> Check:
        """The checks of several tenants as one, with ``sampled_out`` for all
        of them: a gateway subscribed to several tenants reports one count in
        its status line. A latest-table count is None only when no tenant's
        was checked; an unchecked tenant's devices count as found, so that a
        checked tenant's misses still show."""

        def total(counts: list[tuple[int | None, int]]) -> int | None:
            if all(found is None for found, _ in counts):
                return None
            return sum(devices if found is None else found for found, devices in counts)

        return cls(
            published=sum(c.published for c in checks),
            stored=sum(c.stored for c in checks),
            matched=sum(c.matched for c in checks),
            devices=sum(c.devices for c in checks),
            sampled_out=sampled_out,
            latest_ok=total([(c.latest_ok, c.devices) for c in checks]),
            state_ok=total([(c.state_ok, c.devices) for c in checks]),
            write_us=[w for c in checks for w in c.write_us],
            latency_ms=[x for c in checks for x in c.latency_ms],
        )

    def span_rate(self) -> float | None:
        """Messages handled per second between the first and the last write
        (WRITETIME of telemetry rows): the stored rows, and the events the
        system sampled out, which it received, decided and acknowledged as
        well. Approximate: they arrive among the stored ones (a device's first
        event, and its first as a noisy device, are always stored), but those
        decided after the last stored row's write count without their time."""
        if len(self.write_us) < 2:
            return None
        span = (max(self.write_us) - min(self.write_us)) / 1e6
        handled = len(self.write_us) + self.sampled_out
        return (handled - 1) / span if span > 0 else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "published": self.published,
            "stored_telemetry_rows": self.stored,
            "matched": self.matched,
            "sampled_out": self.sampled_out,
            "ok": self.ok,
        }
        if self.latest_ok is not None:
            out["devices"] = self.devices
            out["latest_by_device_ok"] = self.latest_ok
            out["latest_by_state_ok"] = self.state_ok
        return out

    def text(self) -> str:
        sampled = f" + {self.sampled_out} sampled out" if self.sampled_out else ""
        if self.ok:
            extra = " (latest tables match)" if self.latest_ok is not None else ""
            return f"{self.stored}{sampled}/{self.published} ok{extra}"
        parts = [f"{self.stored}{sampled}/{self.published} stored, {self.matched} matched"]
        if self.latest_ok is not None:
            parts.append(f"latest {self.latest_ok}/{self.devices}, by-state {self.state_ok}")
        return "MISMATCH: " + ", ".join(parts)


class BenchDb:
    """The harness's own Cassandra session, for setup and for checking results."""

    def __init__(self, keyspace: str = KEYSPACE) -> None:
        self.keyspace = keyspace
        self.cluster, self.session = connect_cluster(keyspace)
        s = self.session
        self._latest = s.prepare(
            f"SELECT state, toUnixTimestamp(ts) AS ts_ms FROM {keyspace}.latest_events_by_device "
            "WHERE tenant = ? AND device_id = ?"
        )
        self._register = s.prepare(
            f"INSERT INTO {keyspace}.tenant_states (tenant, state, registered_at) VALUES (?, ?, ?)"
        )

    def close(self) -> None:
        self.cluster.shutdown()

    def concurrent(
        self, statement: Any, params: Iterable[Sequence[Any]], concurrency: int = 64
    ) -> list[list[Any]]:
        results = execute_concurrent_with_args(
            self.session, statement, list(params), concurrency=concurrency
        )
        out = []
        for ok, result in results:
            if not ok:
                raise result
            out.append(list(result))
        return out

    def truncate(self) -> None:
        tables = self.session.execute(
            "SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s",
            (self.keyspace,),
        )
        for row in tables:
            self.session.execute(f"TRUNCATE {self.keyspace}.{row.table_name}", timeout=120)

    def register_states(self, tenants: Iterable[str]) -> None:
        """Record the tenants' states as known for a day: a steady state, so the
        gateway's first-seen-state check (gateway/store/latest.py) doesn't apply."""
        since = int((time.time() - 86400) * 1000)
        self.concurrent(self._register, [(t, s, since) for t in tenants for s in STATES])

    def _run(self, read: Callable[[Database], Awaitable[T]]) -> T:
        """``read`` on this session, through the gateway's Database (which wraps it)."""

        async def run() -> T:
            return await read(Database(self.cluster, self.session, cassandra_config(self.keyspace)))

        return asyncio.run(run())

    def read_back(self, tenant: str, devices: Iterable[str]) -> list[Stored]:
        return self._run(lambda db: read_back(db, tenant, devices))

    def in_state(self, tenant: str, state: str) -> list[str]:
        """The devices in ``state``, as ``gateway devices --state`` reads them
        (whichever generation the state partition is in)."""
        config = Config(cassandra=cassandra_config(self.keyspace))

        async def read(db: Database) -> list[str]:
            return [r.device_id for r in await devices_in_state(db, config, tenant, state)]

        return self._run(read)

    def check(
        self, tenant: str, sent: Sequence[Sent], *, latest: bool = True, sampled_out: int = 0
    ) -> Check:
        """Read back the tenant's telemetry (:func:`read_back`) and latest
        tables; ``sampled_out``: how many of ``sent`` the system says it left
        out of the raw table (:attr:`Check.sampled_out`)."""
        newest: dict[str, Sent] = {}
        by_key: dict[tuple[str, int], Sent] = {}
        for s in sent:
            by_key[(s.device_id, s.ts)] = s
            cur = newest.get(s.device_id)
            if cur is None or s.ts > cur.ts:
                newest[s.device_id] = s
        devices = sorted(newest)
        result = Check(
            published=len(sent), stored=0, matched=0, devices=len(devices), sampled_out=sampled_out
        )
        for r in self.read_back(tenant, devices):
            result.stored += 1
            hit = by_key.get((r.device_id, r.ts))
            if hit is None:
                continue
            result.matched += 1
            result.write_us.append(r.write_us)
            if hit.sent_at is not None:
                result.latency_ms.append(r.write_us / 1000 - hit.sent_at)
        if latest:
            found = self.concurrent(self._latest, [(tenant, d) for d in devices], 128)
            result.latest_ok = sum(
                1
                for d, rs in zip(devices, found, strict=True)
                if rs and rs[0].state == newest[d].state and rs[0].ts_ms == newest[d].ts
            )
            members: dict[str, list[str]] = {}
            for state in STATES:
                for device in self.in_state(tenant, state):
                    members.setdefault(device, []).append(state)
            result.state_ok = sum(1 for d in devices if members.get(d) == [newest[d].state])
        return result

    def count(self, tenant: str, devices: Iterable[str]) -> int:
        """Raw telemetry rows (events) of a tenant's devices (:func:`read_back`)."""
        return len(self.read_back(tenant, devices))


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)
    q = quantile
    return {"p50": q(ordered, 0.5), "p99": q(ordered, 0.99), "max": ordered[-1], "n": len(ordered)}


def quantile(ordered: Sequence[float], p: float) -> float:
    """The ``p`` quantile (0 to 1) of values sorted ascending, nearest rank."""
    return ordered[min(len(ordered) - 1, max(0, round(p * (len(ordered) - 1))))]
