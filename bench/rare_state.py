"""Case 1 of the state-view issue, measured with the real gateway: a rare state
left by 110,000 devices, read back (`bench/rare_state.py`).

The issue's reproduction, through Mosquitto and `gateway run` (a subprocess):

1. N devices (default 110,000) of one tenant publish ``{"ts": T, "state": "alarm"}``;
2. then each publishes ``{"ts": T+1000, "state": "ok"}``;
3. then one device publishes ``{"ts": T+2000, "state": "alarm"}``.

QoS 1, one message per device per phase, each phase in a shuffled device order
split over --publishers MQTT 3.1.1 connections (separate processes writing
prebuilt PUBLISH packets: paho's per-message cost starves the gateway on two
cores). Each phase is published while the gateway runs, at most --lead messages
ahead of it (a small broker backlog keeps Mosquitto's persistence saves cheap);
the next starts once the gateway has acknowledged every message of the one
before (``gateway_acks_sent_total`` on its /metrics). Sampling is off
(``GATEWAY_SAMPLING__ENABLED=false``).

Runs, each on a fresh tenant, a fresh gateway process and MQTT session, in the
``bench_rare`` keyspace (``gateway schema apply``):

* ``on``: rotation on (``pipeline.rotate_after_deletes`` 500, the default) with
  ``GATEWAY_PIPELINE__ROTATION_WAIT=0`` (a single instance may);
* ``off``: rotation off (``GATEWAY_PIPELINE__ROTATE_AFTER_DELETES=0``);
* ``on-wait``: rotation on with the default wait (``states_refresh`` + 2 s);
  skipped when the time budget (--budget) would be exceeded.

After the last message, the run waits until the gateway has settled: no row
of the tenant in ``state_partitions`` with ``next_gen`` or ``retired_gen``
set, and no rotation line in the gateway's log for --settle-quiet seconds.
Then, with the gateway still running (idle):

* exactness: ``devices_in_state`` (gateway/store/queries.py) of "alarm" must be
  exactly the device of step 3 and of "ok" the other N-1;
  ``latest_events_by_device`` of every device must hold its newest event;
  the runs must agree;
* one traced execution of the first-page query of each state (the CQL
  ``devices_page`` sends, at the generation ``state_generations`` gives):
  "Read N live rows and M tombstone cells" summed over the trace's events;
* --clients concurrent clients calling
  ``devices_page(db, config, tenant, state, limit=100)`` for --read-seconds,
  "alarm" then "ok": p50 / p99 / max, errors; server warnings the driver logs
  ("Server warning: ..."), and tombstone lines of the tenant in Cassandra's
  system.log.

Rotations are taken from the gateway's log lines ("rotating into",
"now live (N rows copied)"), timed by this process as they appear
(0.2 s polling). "1,000,000 on paper" replays the gateway's rotation rule
(latest.py / rotate.py) on N and on 1,000,000 departures, with the departure
rate and copy rate measured here, and is checked against the measured run at N.

Writes bench/results/rare_state.json and rare_state.md; logs in bench/.logs/rare_state/.
On this shared 2-core box a run takes 4 to 6 minutes, so the default wait run
is skipped when --budget (15 min) would be passed; ``--runs on-wait --add-to``
measures it afterwards into the same results, and the report names both commands.
``--render`` writes the report again from the JSON.

Usage: .venv/bin/python bench/rare_state.py [--devices 110000] [--runs on,off,on-wait]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
LOGS = BENCH / ".logs" / "rare_state"
RESULTS = BENCH / "results"
GATEWAY = ROOT / ".venv" / "bin" / "gateway"
CASSANDRA_LOG = ROOT / ".state" / "logs" / "cassandra" / "system.log"

KEYSPACE = "bench_rare"
TOPIC_TEMPLATE = "gwrare/{tenant}/devices/{device_id}/events"
MQTT_HOST, MQTT_PORT = "127.0.0.1", 1883
RARE, COMMON = "alarm", "ok"
PAGE = 100
TARGET_P99_MS = 50.0
TRACE_READ = re.compile(r"Read (\d+) live rows and (\d+) tombstone cells")
ANNOUNCE = re.compile(
    r"state partition (\S+): (\d+) deletes in generation (\d+), rotating into (\d+)"
)
SWITCHED = re.compile(r"state partition (\S+): generation (\d+) now live \((\d+) rows copied\)")
ROT_FAILED = re.compile(r"state partition (\S+): rotation (\S+) failed")

RUNS: dict[str, dict[str, str]] = {
    "on": {"GATEWAY_PIPELINE__ROTATION_WAIT": "0"},
    "off": {"GATEWAY_PIPELINE__ROTATE_AFTER_DELETES": "0"},
    "on-wait": {},
}
LABELS = {
    "on": "rotation on (rotate_after_deletes 500, rotation_wait 0)",
    "off": "rotation off (rotate_after_deletes 0)",
    "on-wait": "rotation on (rotate_after_deletes 500, default rotation_wait)",
}


def device_id(i: int) -> str:
    return f"d{i:06d}"


# -- publishing (one process per connection) ---------------------------------------


def _varint(n: int) -> bytes:
    """MQTT's Remaining Length encoding."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _publish_worker(
    client_id: str,
    tenant: str,
    ids: list[str],
    ts: int,
    state: str,
    acked: Any,
    failed: Any,
    allowed: Any,
    share: float,
) -> None:
    """One MQTT 3.1.1 connection publishing one QoS 1 message per device.

    Packets are built here and written straight to the socket (paho's
    per-message Python costs about 0.4 ms, too much beside a gateway on two
    cores); at most WINDOW await their PUBACK, which a reader thread counts.
    Paced: this connection publishes at most ``share`` of ``allowed`` (set by
    the harness to what the gateway has handled plus --lead), so the broker's
    backlog, and what each of its persistence saves rewrites, stays small.
    """
    window = 10_000
    total = len(ids)
    sock = socket.create_connection((MQTT_HOST, MQTT_PORT), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x01\x2c" + len(cid).to_bytes(2, "big") + cid
    sock.sendall(b"\x10" + _varint(len(body)) + body)
    connack = b""
    while len(connack) < 4:
        chunk = sock.recv(4 - len(connack))
        if not chunk:
            raise SystemExit(f"{client_id}: connection closed before CONNACK")
        connack += chunk
    if connack[0] != 0x20 or connack[3] != 0:
        raise SystemExit(f"{client_id}: CONNACK refused: {connack!r}")
    sock.settimeout(None)
    count = {"acked": 0}
    room = threading.Condition()
    closed: list[str] = []

    def reader() -> None:
        buf = b""
        reported = 0
        while count["acked"] < total:
            chunk = sock.recv(65536)
            if not chunk:
                closed.append("connection closed by the broker")
                break
            buf += chunk
            whole = len(buf) // 4 * 4
            packets, buf = buf[:whole], buf[whole:]
            for i in range(0, whole, 4):
                if packets[i] != 0x40 or packets[i + 1] != 2:
                    closed.append(f"unexpected packet {packets[i : i + 4]!r}")
                    break
            if closed:
                break
            with room:
                count["acked"] += whole // 4
                room.notify_all()
            if count["acked"] - reported >= 500 or count["acked"] >= total:
                with acked.get_lock():
                    acked.value += count["acked"] - reported
                reported = count["acked"]
        with room:
            room.notify_all()
        if closed:
            with failed.get_lock():
                failed.value += total - count["acked"]

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    prefix = f"gwrare/{tenant}/devices/"
    message = payload(ts, state)
    batch: list[bytes] = []
    for k, dev in enumerate(ids):
        topic = (prefix + dev + "/events").encode()
        rest = len(topic).to_bytes(2, "big") + topic + (k % 65535 + 1).to_bytes(2, "big") + message
        batch.append(b"\x32" + _varint(len(rest)) + rest)
        if len(batch) == 500 or k == total - 1:
            while k + 1 > allowed.value * share + 500:
                time.sleep(0.05)
            with room:
                while k + 1 - len(batch) - count["acked"] > window - len(batch) and not closed:
                    room.wait(1)
            if closed:
                break
            sock.sendall(b"".join(batch))
            batch = []
    thread.join(1800)
    if closed or count["acked"] < total:
        raise SystemExit(f"{client_id}: {count['acked']}/{total} PUBACKs; {closed}")
    sock.sendall(b"\xe0\x00")
    sock.close()


def payload(ts: int, state: str) -> bytes:
    return json.dumps({"ts": ts, "state": state}).encode()


# -- the gateway under test -------------------------------------------------------------


class LogTail(threading.Thread):
    """Follows the gateway's log: rotation lines (timed on arrival), warnings, errors."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stopped = threading.Event()
        self.announced: list[dict[str, Any]] = []
        self.switched: list[dict[str, Any]] = []
        self.failed: list[str] = []
        self.warnings: list[str] = []  # WARNING/ERROR lines but "hot partition" notices
        self.hot = 0  # "hot partition" notices (expected: one tenant changes state at once)
        self.metrics_url: str | None = None
        self.subscribed = False
        self.last_rotation_line = time.monotonic()
        self._offset = 0
        self._partial = ""

    def run(self) -> None:
        while not self.stopped.is_set():
            self.poll()
            self.stopped.wait(0.2)
        self.poll()

    def poll(self) -> None:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except OSError:
            return
        if not chunk:
            return
        now = time.monotonic()
        *lines, self._partial = (self._partial + chunk).split("\n")
        for line in lines:
            if m := ANNOUNCE.search(line):
                self.last_rotation_line = now
                self.announced.append(
                    {
                        "at": now,
                        "partition": m.group(1),
                        "logged_deletes": int(m.group(2)),
                        "gen": int(m.group(3)),
                        "next_gen": int(m.group(4)),
                    }
                )
            elif m := SWITCHED.search(line):
                self.last_rotation_line = now
                self.switched.append(
                    {
                        "at": now,
                        "partition": m.group(1),
                        "gen": int(m.group(2)),
                        "copied": int(m.group(3)),
                    }
                )
            elif ROT_FAILED.search(line):
                self.last_rotation_line = now
                self.failed.append(line)
            if " WARNING " in line or " ERROR " in line or "Traceback" in line:
                if "hot partition" in line:
                    self.hot += 1
                else:
                    self.warnings.append(line)
            if "subscribed to" in line:
                self.subscribed = True
            if (m := re.search(r"metrics on (http://\S+)/metrics", line)) and not self.metrics_url:
                self.metrics_url = m.group(1) + "/metrics"


def scrape(url: str) -> dict[str, float]:
    """The gateway's /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def rejected_total(metrics: dict[str, float]) -> int:
    return int(
        sum(v for k, v in metrics.items() if k.startswith("gateway_messages_rejected_total"))
    )


def gateway_env(client_id: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_MQTT__CLIENT_ID": client_id,
        "GATEWAY_MQTT__SESSION_EXPIRY": "600",
        "GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE,
        "GATEWAY_TOPICS": f'[{{template = "{TOPIC_TEMPLATE}"}}]',
        "GATEWAY_SAMPLING__ENABLED": "false",
        "GATEWAY_PIPELINE__STATUS_INTERVAL": "1",
        "GATEWAY_API__PORT": "0",
    }
    return env | extra


class BenchFailure(RuntimeError):
    pass


# -- measuring reads ------------------------------------------------------------------


class DriverWarnings(logging.Handler):
    """Counts the cassandra-driver's "Server warning: ..." log lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Server warning" in message:
            self.texts.append(message)

    def take(self) -> list[str]:
        out, self.texts = self.texts, []
        return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p * (len(ordered) - 1))))]

    return {"p50": round(q(0.5), 2), "p99": round(q(0.99), 2), "max": round(ordered[-1], 2)}


def cassandra_log_offset() -> int:
    try:
        return CASSANDRA_LOG.stat().st_size
    except OSError:
        return -1


def cassandra_tombstone_lines(offset: int, tenant: str) -> dict[str, Any]:
    """Tombstone warnings and failures Cassandra logged for the tenant since offset."""
    if offset < 0:
        return {"error": f"cannot read {CASSANDRA_LOG}"}
    with open(CASSANDRA_LOG, errors="replace") as f:
        f.seek(offset)
        text = f.read()
    warn = fail = 0
    sample: dict[str, str] = {}
    for line in text.splitlines():
        if f"'{tenant}'" not in line or "tombstone" not in line.lower():
            continue
        if "tombstone_warn_threshold" in line:
            warn += 1
            sample.setdefault("warn", line[:400])
        else:
            fail += 1
            sample.setdefault("failure", line[:400])
    return {"warn_lines": warn, "failure_lines": fail, "samples": sample}


# -- one run --------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    tenant: str
    client_id: str
    devices: int
    publishers: int
    base_ts: int
    out: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = f"{int(time.time()) % 100000:05d}"
        self.started = time.monotonic()
        self.driver_warnings = DriverWarnings()
        logging.getLogger("cassandra").addHandler(self.driver_warnings)
        logging.getLogger("cassandra").setLevel(logging.WARNING)
        logging.getLogger("cassandra").propagate = False
        self.ctx = mp.get_context("spawn")

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        minutes, seconds = divmod(int(elapsed), 60)
        print(f"[rare {minutes:02d}:{seconds:02d}] {message}", flush=True)

    # -- setup

    def schema(self) -> None:
        env = gateway_env("unused", {})
        done = subprocess.run(
            [str(GATEWAY), "schema", "apply"], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise BenchFailure(f"gateway schema apply failed:\n{done.stdout}\n{done.stderr}")
        self.say(f"schema applied to keyspace {KEYSPACE}")

    # -- the run

    def run(self, name: str) -> dict[str, Any]:
        n = self.args.devices
        run = Run(
            name=name,
            tenant=f"rare{self.run_id}{name.replace('-', '')}",
            client_id=f"bench-rare-{self.run_id}-{name}",
            devices=n,
            publishers=self.args.publishers,
            base_ts=int(time.time() * 1000) - 120_000,
        )
        env = gateway_env(run.client_id, RUNS[name])
        out = run.out
        out |= {
            "run": name,
            "label": LABELS[name],
            "tenant": run.tenant,
            "devices": n,
            "gateway_env": {k: v for k, v in env.items() if k.startswith("GATEWAY_")},
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        # The gateway's code as this run's process loads it (others may commit meanwhile).
        out["gateway_source"] = _source_digest()
        LOGS.mkdir(parents=True, exist_ok=True)
        log_path = LOGS / f"gateway-{name}.log"
        cass_offset = cassandra_log_offset()
        t_run = time.monotonic()
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                [str(GATEWAY), "run"],
                env=env,
                cwd=ROOT,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        tail = LogTail(log_path)
        tail.start()
        try:
            self._wait_started(proc, tail)
            assert tail.metrics_url is not None
            self.say(f"{name}: gateway pid {proc.pid} subscribed, metrics at {tail.metrics_url}")
            self._ingest(run, proc, tail)
            self._settle(run, proc, tail)
            out["metrics_after_ingest"] = {
                k: v
                for k, v in scrape(tail.metrics_url).items()
                if k.startswith("gateway_") and "_bucket" not in k
            }
            cass_reads_offset = cassandra_log_offset()
            out["cassandra_log_ingest"] = cassandra_tombstone_lines(cass_offset, run.tenant)
            asyncio.run(self._reads(run))
            out["cassandra_log_reads"] = cassandra_tombstone_lines(cass_reads_offset, run.tenant)
        finally:
            code = self._stop(proc)
            tail.stopped.set()
            tail.join(5)
            out["gateway_exit"] = code
            summary = [
                ln for ln in log_path.read_text(errors="replace").splitlines() if "stopped:" in ln
            ]
            out["gateway_summary"] = summary[-1].split("stopped: ", 1)[1] if summary else None
            out["gateway_log_warnings"] = tail.warnings[:50]
            out["gateway_log_warning_count"] = len(tail.warnings) + tail.hot
            out["gateway_log_hot_partition_notices"] = tail.hot
            out["rotation_failures_logged"] = tail.failed[:20]
            out["rotations"] = self._rotations(tail, t_run)
            self._forget(env)
            out["seconds"] = round(time.monotonic() - t_run, 1)
        return out

    def _wait_started(self, proc: subprocess.Popen[bytes], tail: LogTail) -> None:
        deadline = time.monotonic() + 90
        while not (tail.subscribed and tail.metrics_url):
            if proc.poll() is not None:
                raise BenchFailure(f"gateway exited at start-up (code {proc.returncode})")
            if time.monotonic() > deadline:
                raise BenchFailure("gateway not subscribed after 90 s")
            time.sleep(0.1)

    def _ingest(self, run: Run, proc: subprocess.Popen[bytes], tail: LogTail) -> None:
        n = run.devices
        rng = random.Random(1)
        all_ids = [device_id(i) for i in range(n)]
        rare_device = all_ids[rng.randrange(n)]
        run.out["rare_device"] = rare_device
        phases = [
            ("alarm", RARE, run.base_ts, all_ids),
            ("ok", COMMON, run.base_ts + 1000, all_ids),
            ("alarm again (one device)", RARE, run.base_ts + 2000, [rare_device]),
        ]
        handled_before = 0
        out_phases = []
        assert tail.metrics_url is not None
        for i, (label, state, ts, ids) in enumerate(phases):
            order = list(ids)
            random.Random(100 + i).shuffle(order)
            workers = max(1, min(run.publishers, len(order)))
            size = -(-len(order) // workers)
            acked = self.ctx.Value("q", 0)
            failed = self.ctx.Value("q", 0)
            allowed = self.ctx.Value("q", self.args.lead)
            procs = [
                self.ctx.Process(
                    target=_publish_worker,
                    args=(
                        f"{run.client_id}-pub{i}-{w}",
                        run.tenant,
                        order[w * size : (w + 1) * size],
                        ts,
                        state,
                        acked,
                        failed,
                        allowed,
                        len(order[w * size : (w + 1) * size]) / len(order),
                    ),
                    daemon=True,
                )
                for w in range(workers)
            ]
            target = handled_before + len(order)
            t0 = time.monotonic()
            for p in procs:
                p.start()
            published_at: float | None = None
            first_handled: float | None = None
            last_change, last_handled = t0, handled_before
            next_say = t0 + self.args.progress_every
            while True:
                time.sleep(0.25)
                now = time.monotonic()
                if proc.poll() is not None:
                    raise BenchFailure(
                        f"the gateway exited (code {proc.returncode}) during {label}"
                    )
                metrics = scrape(tail.metrics_url)
                handled = int(metrics.get("gateway_acks_sent_total", 0))
                allowed.value = handled - handled_before + self.args.lead
                if handled > handled_before and first_handled is None:
                    first_handled = now
                if published_at is None and all(not p.is_alive() for p in procs):
                    published_at = now
                    bad = [p.exitcode for p in procs if p.exitcode != 0]
                    if bad:
                        raise BenchFailure(f"a publisher failed ({bad}) during {label}")
                if handled != last_handled:
                    last_change, last_handled = now, handled
                if handled >= target and published_at is not None:
                    break
                if now - last_change > self.args.stall:
                    raise BenchFailure(
                        f"{label}: the gateway handled nothing for {self.args.stall:.0f} s "
                        f"({handled - handled_before}/{len(order)}; published {acked.value})"
                    )
                if now >= next_say:
                    next_say = now + self.args.progress_every
                    rate = (handled - handled_before) / max(now - t0, 1e-9)
                    self.say(
                        f"{run.name}: phase {label!r}: published {acked.value:,}/{len(order):,}, "
                        f"handled {handled - handled_before:,} ({rate:,.0f}/s), "
                        f"rotations {len(tail.switched)} done / {len(tail.announced)} announced"
                    )
            done_at = time.monotonic()
            seconds = done_at - t0
            rejected = rejected_total(metrics)
            phase = {
                "phase": label,
                "state": state,
                "ts": ts,
                "messages": len(order),
                "publish_failures": failed.value,
                "published_s": round((published_at or done_at) - t0, 2),
                "handled_s": round(seconds, 2),
                "handled_per_s": round(len(order) / seconds, 1),
                "rejected_total": rejected,
            }
            out_phases.append(phase)
            self.say(
                f"{run.name}: phase {label!r}: {len(order):,} messages handled in {seconds:.1f} s "
                f"({phase['handled_per_s']:,.0f}/s; published in {phase['published_s']:.1f} s); "
                f"rotations {len(tail.switched)}"
            )
            if failed.value:
                raise BenchFailure(f"{label}: {failed.value} PUBACKs with a failure reason")
            if rejected:
                raise BenchFailure(f"{label}: the gateway rejected {rejected} messages")
            handled_before = target
        run.out["phases"] = out_phases
        run.out["ingest_s"] = round(sum(p["handled_s"] for p in out_phases), 2)

    def _partitions(self, session: Any, tenant: str) -> list[dict[str, Any]]:
        rows = session.execute(
            "SELECT state, bucket, gen, next_gen, live, retired_gen "
            f"FROM {KEYSPACE}.state_partitions WHERE tenant = %s",
            (tenant,),
        )
        return [
            {
                "state": r.state,
                "bucket": r.bucket,
                "gen": r.gen,
                "next_gen": r.next_gen,
                "live": r.live,
                "retired_gen": r.retired_gen,
            }
            for r in rows
        ]

    def _settle(self, run: Run, proc: subprocess.Popen[bytes], tail: LogTail) -> None:
        from cassandra.cluster import Cluster  # noqa: PLC0415

        cluster = Cluster(["127.0.0.1"], protocol_version=4)
        session = cluster.connect()
        t0 = time.monotonic()
        try:
            while True:
                parts = self._partitions(session, run.tenant)
                busy = [
                    p for p in parts if p["next_gen"] is not None or p["retired_gen"] is not None
                ]
                quiet = time.monotonic() - tail.last_rotation_line
                if not busy and quiet >= self.args.settle_quiet:
                    break
                if proc.poll() is not None:
                    raise BenchFailure(
                        f"the gateway exited (code {proc.returncode}) while settling"
                    )
                if time.monotonic() - t0 > self.args.settle_timeout:
                    raise BenchFailure(
                        f"not settled after {self.args.settle_timeout:.0f} s: {busy}"
                    )
                time.sleep(0.5)
        finally:
            cluster.shutdown()
        run.out["settle_s"] = round(time.monotonic() - t0, 1)
        run.out["state_partitions"] = parts
        self.say(
            f"{run.name}: settled in {run.out['settle_s']:.1f} s; state_partitions: "
            + (", ".join(f"{p['state']} gen {p['gen']} live {p['live']}" for p in parts) or "none")
        )

    def _rotations(self, tail: LogTail, t_run: float) -> dict[str, Any]:
        switched = list(tail.switched)
        per: list[dict[str, Any]] = []
        for s in switched:
            start = next(
                (
                    a
                    for a in tail.announced
                    if a["partition"] == s["partition"] and a["next_gen"] == s["gen"]
                ),
                None,
            )
            per.append(
                {
                    "partition": s["partition"],
                    "gen": s["gen"],
                    "copied": s["copied"],
                    "announced_at_s": round(start["at"] - t_run, 1) if start else None,
                    "live_at_s": round(s["at"] - t_run, 1),
                    "announce_to_live_s": round(s["at"] - start["at"], 2) if start else None,
                }
            )
        return {
            "announced": len(tail.announced),
            "switched": len(switched),
            "failures_logged": len(tail.failed),
            "rows_copied": sum(s["copied"] for s in switched),
            "by_partition": dict(Counter(s["partition"] for s in switched)),
            "each": per,
            "logged_deletes_at_announce": sorted({a["logged_deletes"] for a in tail.announced}),
        }

    def _stop(self, proc: subprocess.Popen[bytes]) -> int | None:
        # Imported here, as run_tool at the bottom: the spawned publishers
        # import this module's top level, and not benchlib's.
        from benchlib import stop_process  # noqa: PLC0415

        return stop_process(proc, 60)

    def _forget(self, env: dict[str, str]) -> None:
        subprocess.run(
            [str(GATEWAY), "forget-session"], env=env, capture_output=True, check=False, timeout=60
        )

    # -- reads

    async def _reads(self, run: Run) -> None:
        from gateway.config import load_config  # noqa: PLC0415
        from gateway.store.database import connect  # noqa: PLC0415
        from gateway.store.queries import (  # noqa: PLC0415
            devices_in_state,
            devices_page,
            state_generations,
        )

        env = gateway_env(run.client_id, RUNS[run.name])
        config = load_config(None, {k: v for k, v in env.items() if k.startswith("GATEWAY_")})
        out = run.out
        async with connect(config.cassandra) as db:
            # Exactness first (also warms the prepared statements).
            self.driver_warnings.take()
            out["check"] = await self._check(db, config, run, devices_in_state)
            out["check_driver_warnings"] = len(self.driver_warnings.take())
            self.say(f"{run.name}: check: {out['check']['text']}")
            reads: dict[str, Any] = {}
            for state in (RARE, COMMON):
                gens = await state_generations(db, run.tenant, state)
                entry: dict[str, Any] = {"generation": gens.get(0, 0)}
                entry["trace"] = await asyncio.get_running_loop().run_in_executor(
                    None, self._traced, db, run.tenant, state, gens.get(0, 0)
                )
                self.driver_warnings.take()
                entry |= await self._load(
                    db,
                    config,
                    run.tenant,
                    state,
                    devices_page,
                    self.args.clients,
                    self.args.read_seconds,
                )
                warnings = self.driver_warnings.take()
                if self.args.single_seconds > 0:
                    single = await self._load(
                        db, config, run.tenant, state, devices_page, 1, self.args.single_seconds
                    )
                    entry["one_client"] = single
                    warnings += self.driver_warnings.take()
                entry["driver_server_warnings"] = len(warnings)
                if warnings:
                    entry["driver_server_warning_sample"] = warnings[0][:400]
                reads[state] = entry
                t = entry["trace"]
                self.say(
                    f"{run.name}: first page of {state!r}: p50 {entry['p50']} / "
                    f"p99 {entry['p99']} / max {entry['max']} ms over {entry['reads']} reads, "
                    f"{entry['errors']} errors; "
                    f"trace: {t.get('live_rows')} live rows, {t.get('tombstones')} tombstones"
                    f"{', ' + t['error'] if 'error' in t else ''}; "
                    f"server warnings {len(warnings)}"
                )
            out["reads"] = reads

    async def _check(self, db: Any, config: Any, run: Run, devices_in_state: Any) -> dict[str, Any]:
        n, rare = run.devices, run.out["rare_device"]
        out: dict[str, Any] = {}
        members: dict[str, list[str]] = {}
        for state in (RARE, COMMON):
            try:
                rows = await devices_in_state(db, config, run.tenant, state)
            except Exception as exc:
                out[f"{state}_error"] = f"{type(exc).__name__}: {exc}"[:600]
                continue
            out[f"{state}_count"] = len(rows)
            for r in rows:
                members.setdefault(r.device_id, []).append(state)
            if state == RARE:
                out["alarm_devices"] = [r.device_id for r in rows][:10]
        # latest_events_by_device: every device's newest event (state and ts).
        stmt = await db.prepared(
            f"SELECT device_id, state, toUnixTimestamp(ts) AS ts_ms FROM {KEYSPACE}."
            "latest_events_by_device WHERE tenant = ? AND device_id IN ?"
        )
        ids = [device_id(i) for i in range(n)]
        wrong = found = 0
        chunks = [ids[i : i + 100] for i in range(0, n, 100)]
        for start in range(0, len(chunks), 32):
            results = await asyncio.gather(
                *(db.execute(stmt, (run.tenant, c)) for c in chunks[start : start + 32])
            )
            for rows in results:
                for r in rows:
                    found += 1
                    want = (
                        (RARE, run.base_ts + 2000)
                        if r.device_id == rare
                        else (COMMON, run.base_ts + 1000)
                    )
                    if (r.state, r.ts_ms) != want:
                        wrong += 1
        out["by_device_found"] = found
        out["by_device_wrong"] = wrong
        readable = RARE + "_error" not in out and COMMON + "_error" not in out
        if readable:
            several = sum(1 for v in members.values() if len(v) > 1)
            missing = n - len(members)
            out["in_several_states"] = several
            out["missing_from_state_view"] = missing
        ok_state = (
            out.get("ok_count") == n - 1
            and COMMON + "_error" not in out
            and all(s == [COMMON] for d, s in members.items() if d != rare)
        )
        alarm_state = out.get("alarm_devices") == [rare] and out.get("alarm_count") == 1
        out["ok"] = bool(
            ok_state
            and found == n
            and wrong == 0
            and (alarm_state or run.name == "off")
            and (
                not readable
                or (out["in_several_states"] == 0 and out["missing_from_state_view"] == 0)
            )
        )
        out["ok_set_digest"] = hashlib.sha256(
            ",".join(sorted(d for d, s in members.items() if COMMON in s)).encode()
        ).hexdigest()[:16]

        def count(state: str) -> str:
            if f"{state}_error" in out:
                error: str = out[f"{state}_error"]
                return "unreadable (" + error.split(":", maxsplit=1)[0] + ", see below)"
            return f"{out.get(f'{state}_count'):,} devices"

        text = [
            f"'alarm': {count(RARE)}"
            + (f" {out['alarm_devices']}" if "alarm_devices" in out else ""),
            f"'ok': {count(COMMON)}",
            f"latest_events_by_device: {found:,} devices found, {wrong} not at their newest event",
        ]
        if run.name == "off" and RARE + "_error" in out:
            text.append("'alarm' unreadable is case 1 itself, expected with rotation off")
        out["text"] = ("OK " if out["ok"] else "FAILED ") + "; ".join(str(t) for t in text)
        return out

    def _traced(self, db: Any, tenant: str, state: str, gen: int) -> dict[str, Any]:
        """The first-page query devices_page sends, once, with tracing."""
        from gateway.identity import FIRST_HASH  # noqa: PLC0415

        cql = (
            f"SELECT device_id, ts, value, tags FROM {KEYSPACE}.latest_events_by_state "
            "WHERE tenant = %s AND state = %s AND bucket = %s AND gen = %s "
            "AND (device_hash, device_id) > (%s, %s) LIMIT %s"
        )
        try:
            result = db.session.execute(
                cql, (tenant, state, 0, gen, FIRST_HASH, "", PAGE), trace=True, timeout=60
            )
            trace = result.get_query_trace(max_wait_sec=30)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:400]}
        live = tomb = 0
        for event in trace.events:
            if m := TRACE_READ.search(event.description):
                live += int(m.group(1))
                tomb += int(m.group(2))
        return {
            "live_rows": live,
            "tombstones": tomb,
            "rows_returned": len(result.current_rows),
            "server_warnings": list(result.response_future.warnings or [])[:3],
            "server_ms": round(trace.duration.total_seconds() * 1000, 2)
            if trace.duration
            else None,
        }

    async def _load(
        self,
        db: Any,
        config: Any,
        tenant: str,
        state: str,
        devices_page: Any,
        clients: int,
        seconds: float,
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        errors: Counter[str] = Counter()
        sizes: Counter[int] = Counter()
        deadline = loop.time() + seconds

        async def client() -> None:
            while loop.time() < deadline:
                t0 = time.perf_counter()
                try:
                    page = await devices_page(db, config, tenant, state, limit=PAGE)
                except Exception as exc:
                    errors[f"{type(exc).__name__}: {exc}"[:300]] += 1
                    times.append((time.perf_counter() - t0) * 1000)
                    continue
                times.append((time.perf_counter() - t0) * 1000)
                sizes[len(page.devices)] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.monotonic() - t0
        return {
            "clients": clients,
            "seconds": round(wall, 2),
            "reads": len(times),
            "reads_per_s": round(len(times) / wall, 1),
            "errors": sum(errors.values()),
            "error_kinds": dict(errors),
            "page_sizes": {str(k): v for k, v in sizes.items()},
            **percentiles(times),
        }


# -- 1,000,000 on paper ------------------------------------------------------------------


class _Replay:
    """State of one partition in :func:`replay`."""

    def __init__(self, n: int, rotate_after: int, wait_s: float, rate: float, overhead: float):
        self.rotate_after, self.wait_s, self.rate, self.overhead = (
            rotate_after,
            wait_s,
            rate,
            overhead,
        )
        self.live_true = n  # devices still in the state (live rows of the generation read)
        self.live_est = n  # the gateway's estimate (Part.live)
        self.deletes = 0  # Part.deletes
        self.gen_tomb = 0  # tombstones in the generation readers read
        self.next_tomb = 0  # tombstones in the next one, while a rotation runs
        self.rotating = False
        self.copy_at: float | None = None
        self.switch_at: float | None = None
        self.copied_now = 0
        self.rotations = self.copied = self.dual = 0
        self.busy_s = 0.0

    def due(self) -> bool:
        return bool(self.rotate_after) and self.deletes >= max(
            self.rotate_after, self.live_est // 2
        )

    def announce(self, t: float) -> None:
        self.rotating, self.deletes, self.next_tomb = True, 0, 0
        self.copy_at, self.switch_at = t + self.wait_s, None

    def advance(self, t: float) -> None:
        """Copy and switch what comes due by ``t``; a switch re-checks (rotate.py)."""
        while self.rotating:
            assert self.copy_at is not None
            if self.switch_at is None and t >= self.copy_at:
                self.copied_now = self.live_true
                duration = self.overhead + self.copied_now / self.rate
                self.switch_at = self.copy_at + duration
                self.busy_s += duration
            if self.switch_at is None or t < self.switch_at:
                return
            self.rotating = False
            self.gen_tomb = self.next_tomb
            self.live_est = max(0, self.copied_now - self.deletes)
            self.rotations += 1
            self.copied += self.copied_now
            if self.due():
                self.announce(self.switch_at)  # started by the next chunk or the idle tick

    def depart(self, t: float) -> None:
        self.advance(t)
        self.live_true -= 1
        self.live_est -= 1
        self.gen_tomb += 1
        self.deletes += 1
        if self.rotating:
            self.next_tomb += 1
            self.dual += 1
        if not self.rotating and self.due():
            self.announce(t)


def replay(
    n: int,
    *,
    rotate_after: int,
    wait_s: float,
    depart_per_s: float,
    copy_rows_per_s: float,
    overhead_s: float,
) -> dict[str, Any]:
    """The gateway's rotation rule (latest.py, rotate.py) replayed on n devices that
    all leave one state at depart_per_s, in a random order:

    * each departure sends a delete into the partition's generation (and into
      the next one while a rotation runs), ``deletes`` + 1, ``live`` - 1;
    * due when ``deletes >= max(rotate_after, live // 2)``, started at once when
      no rotation runs (by the chunk, or by the idle tick); announcing sets
      ``deletes = 0``;
    * ``wait_s`` later the live rows are copied (overhead_s + rows / copy_rows_per_s);
      what was deleted since the announcement is the new generation's
      tombstones; the switch sets ``live = copied - deletes`` and re-checks due.
    """
    p = _Replay(n, rotate_after, wait_s, copy_rows_per_s, overhead_s)
    max_tomb = max_first_page = 0
    for i in range(n):
        p.depart(i / depart_per_s)
        max_tomb = max(max_tomb, p.gen_tomb)
        # What a first page of PAGE rows steps over, departures spread at random.
        first_page = p.gen_tomb if p.live_true <= PAGE else p.gen_tomb * PAGE // p.live_true
        max_first_page = max(max_first_page, first_page)
    p.advance(float("inf"))
    max_tomb = max(max_tomb, p.gen_tomb)
    max_first_page = max(max_first_page, p.gen_tomb)
    extra = p.copied + p.dual + 4 * p.rotations  # copies, deletes twice, 2 LWTs + drop + mark
    return {
        "devices": n,
        "rotations": p.rotations,
        "rows_copied": p.copied,
        "dual_written_deletes": p.dual,
        "extra_writes": extra,
        "extra_writes_per_departure": round(extra / n, 3),
        "copies_per_departure": round(p.copied / n, 3),
        "max_tombstones_in_read_generation": max_tomb,
        "final_tombstones_in_read_generation": p.gen_tomb,
        "max_first_page_tombstones": max_first_page,
        "departure_s": round(n / depart_per_s, 1),
        "rotation_busy_s": round(p.busy_s, 1),
    }


def statements(run: dict[str, Any]) -> float | None:
    """Statements the gateway sent to Cassandra in a run (``gateway_cassandra_rows_total``)."""
    rows: float | None = run.get("metrics_after_ingest", {}).get("gateway_cassandra_rows_total")
    return rows


def on_paper(results: dict[str, Any], rotate_after: int) -> dict[str, Any]:
    runs = results["runs"]
    base = runs.get("on")
    if not base or "rotations" not in base or not base.get("phases"):
        return {"status": "not computed: no completed 'on' run"}
    each = [r for r in base["rotations"]["each"] if r["announce_to_live_s"] is not None]
    copied = sum(r["copied"] for r in each)
    seconds = sum(r["announce_to_live_s"] for r in each)
    if not each or seconds <= 0:
        return {"status": "not computed: no timed rotation in the 'on' run"}
    # The run's average: every row copied over every second from announce to switch
    # (with rotation_wait 0 that is the copy itself, beside the ingest it competes with).
    overhead, rate = 0.0, copied / seconds
    depart = base["phases"][1]["handled_per_s"]
    params = {
        "rotate_after_deletes": rotate_after,
        "departures_per_s": depart,
        "copy_rows_per_s": round(rate, 1),
        "overhead_s_per_rotation": round(overhead, 3),
        "from_run": "on",
    }
    out: dict[str, Any] = {"params": params}
    for key, wait in (("wait_0", 0.0), ("default_wait", results["default_rotation_wait_s"])):
        out[key] = {
            str(n): replay(
                n,
                rotate_after=rotate_after,
                wait_s=wait,
                depart_per_s=depart,
                copy_rows_per_s=rate,
                overhead_s=overhead,
            )
            for n in (base["devices"], 1_000_000)
        }
    # How much the 1,000,000 figures hang on the copy speed.
    out["copy_speed_sensitivity"] = {
        f"x{factor:g}": replay(
            1_000_000,
            rotate_after=rotate_after,
            wait_s=0.0,
            depart_per_s=depart,
            copy_rows_per_s=rate * factor,
            overhead_s=overhead,
        )
        for factor in (0.5, 2.0)
    }
    off_rows = statements(runs.get("off", {}))
    measured = {
        name: {
            "departures_per_s": r["phases"][1]["handled_per_s"] if r.get("phases") else None,
            "extra_statements_per_departure": (
                round((rows - off_rows) / r["devices"], 3)
                if (rows := statements(r)) is not None and off_rows is not None
                else None
            ),
            "rotations": r["rotations"]["switched"],
            "rows_copied": r["rotations"]["rows_copied"],
            "final_tombstones_read": r.get("reads", {})
            .get(RARE, {})
            .get("trace", {})
            .get("tombstones"),
        }
        for name, r in runs.items()
        if name != "off" and "rotations" in r
    }
    out["measured_at_n"] = measured
    return out


# -- report ---------------------------------------------------------------------------------


def _f(value: Any, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _trace_text(entry: dict[str, Any]) -> str:
    t = entry.get("trace", {})
    if "error" in t:
        error: str = t["error"]
        return "read failed (" + error.split(":", maxsplit=1)[0] + ")"
    return _f(t.get("tombstones"))


def _lat(entry: dict[str, Any]) -> str:
    if not entry:
        return "n/a"
    text = f"{_f(entry.get('p50'), 1)} / {_f(entry.get('p99'), 1)} / {_f(entry.get('max'), 1)}"
    if entry.get("errors"):
        text += f" ({'all' if entry['errors'] == entry.get('reads') else entry['errors']} failed)"
    return text


def done_when(results: dict[str, Any]) -> list[str]:
    """Case 1's "Done when", per run, from the figures (after the gateway settled)."""
    out = []
    for name, r in results["runs"].items():
        a, o = r.get("reads", {}).get(RARE), r.get("reads", {}).get(COMMON)
        if not a or not o:
            continue
        t = a.get("trace", {})
        warned = a.get("driver_server_warnings", 0) + len(t.get("server_warnings", []))
        answers = "error" not in t and not a.get("errors") and r.get("check", {}).get("ok")
        quiet = answers and warned == 0

        def p99(entry: dict[str, Any]) -> str:
            ok = entry.get("p99") is not None and entry["p99"] <= TARGET_P99_MS
            return f"{'yes' if ok else 'no'} ({_f(entry.get('p99'), 1)} ms)"

        out.append(
            f'- {LABELS.get(name, name)}: "alarm" answers exactly: '
            f"{'yes' if answers else 'no'}; without a tombstone warning: "
            f"{'yes' if quiet else 'no'} ("
            + (
                "the read failed"
                + (": READ_TOO_MANY_TOMBSTONES" if "TOO_MANY_TOMBSTONES" in t["error"] else "")
                if "error" in t
                else f"{_f(t.get('tombstones'))} tombstones read"
            )
            + "); first "
            f'page p99 <= {TARGET_P99_MS:.0f} ms with {a.get("clients")} clients: "alarm" '
            f'{p99(a)}, "ok" {p99(o)}; one client alone: "alarm" '
            f'{p99(a.get("one_client", {}))}, "ok" {p99(o.get("one_client", {}))}'
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = [
        "# Case 1: a rare state left by many devices, through the real gateway",
        "",
        f"`bench/rare_state.py`, run {results['started']} ({results['minutes']:.1f} min):",
        "",
        f"    {results['command']}",
        "",
        *(
            line
            for sup in results.get("supplements", [])
            for line in (
                f"and afterwards, for run(s) {', '.join(sup['runs'])} (started {sup['started']}, "
                f"{sup['minutes']:.1f} min, load average {sup['load_start']} at start, "
                f"{sup['load_end']} at end; gateway source {sup['gateway_source']}):",
                "",
                f"    {sup['command']}",
                "",
            )
        ),
        f"Machine: {results['machine']}. Gateway source: {results['gateway_source']}. "
        f"Load average at start {results['load_start']}, at end {results['load_end']}: "
        "test suites of other sessions ran beside it on this 2-core box, so every time "
        "below includes waiting for the CPU.",
        "",
        f"Workload per run, on a fresh tenant, gateway process (`gateway run`) and MQTT "
        f"session: {results['devices']:,} devices publish "
        '`{"ts": T, "state": "alarm"}`, then each `{"ts": T+1000, "state": "ok"}`, then one '
        'device `{"ts": T+2000, "state": "alarm"}`. QoS 1 through Mosquitto, '
        f"{results['publishers']} MQTT connections, each phase in a shuffled device order, "
        f"published while the gateway runs and at most {results['lead']:,} messages ahead of "
        "it; the next phase starts when the gateway has acknowledged every message of the "
        "last (`gateway_acks_sent_total` on its /metrics). `GATEWAY_SAMPLING__ENABLED=false`, "
        "`state_buckets` 1. Reads once the gateway has settled (no `state_partitions` row "
        f"mid-rotation or with a generation to drop): {results['clients']} concurrent clients "
        "calling `devices_page(db, config, tenant, state, limit=100)` for "
        f"{results['read_seconds']:.0f} s per state (then one client alone for "
        f"{results['single_seconds']:.0f} s); tombstones from one traced execution of the "
        "first-page query `devices_page` sends.",
        "",
        '## Against the issue\'s "Done when"',
        "",
        *done_when(results),
        "",
        "## Results",
        "",
        "| run | ingest s: alarm / ok / one | ok phase msg/s | rotations | rows copied | "
        'first page "alarm" p50 / p99 / max ms | reads (errors) | tombstones read | '
        'tombstone warnings | first page "ok" p50 / p99 / max ms | reads (errors) | '
        "tombstones read | exact |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---|---|---:|---|",
    ]
    for name, r in runs.items():
        label = LABELS.get(name, name)
        if "reads" not in r:
            lines.append(f"| {label} | FAILED: {r.get('error', '?')[:300]} |" + " |" * 11)
            continue
        ph = r.get("phases", [])
        rot = r.get("rotations", {})
        a, o = r["reads"].get(RARE, {}), r["reads"].get(COMMON, {})
        warned = a.get("driver_server_warnings", 0) + len(
            a.get("trace", {}).get("server_warnings", [])
        )
        lines.append(
            f"| {label} | {' / '.join(_f(p['handled_s'], 1) for p in ph)} "
            f"(total {_f(r.get('ingest_s'), 1)}) | "
            f"{_f(ph[1]['handled_per_s'] if len(ph) > 1 else None)} | "
            f"{rot.get('switched', 0)} | {_f(rot.get('rows_copied'))} | {_lat(a)} | "
            f"{_f(a.get('reads'))} ({_f(a.get('errors'))}) | {_trace_text(a)} | {_f(warned)} | "
            f"{_lat(o)} | {_f(o.get('reads'))} ({_f(o.get('errors'))}) | {_trace_text(o)} | "
            f"{'yes' if r.get('check', {}).get('ok') else 'NO'} |"
        )
    sources = {
        m.group(1)
        for r in runs.values()
        if (m := re.search(r"cql ([0-9a-f]{12})", r.get("gateway_source") or ""))
    }
    if len(sources) > 1:
        lines += ["", "The gateway's code differed between runs:", ""] + [
            f"- {name}: {r.get('gateway_source')}" for name, r in runs.items()
        ]
    lines += [
        "",
        "The same first page with one client alone, and the server's own time for it (trace):",
        "",
        '| run | "alarm" one client p50 / p99 / max ms | "alarm" server ms (trace) | '
        '"ok" one client p50 / p99 / max ms | "ok" server ms (trace) | Cassandra statements '
        "per event |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name, r in runs.items():
        if "reads" not in r:
            continue
        a, o = r["reads"].get(RARE, {}), r["reads"].get(COMMON, {})
        sent = statements(r)
        events = sum(p["messages"] for p in r.get("phases", []))
        lines.append(
            f"| {name} | {_lat(a.get('one_client', {}))} | "
            f"{_f(a.get('trace', {}).get('server_ms'), 1)} | {_lat(o.get('one_client', {}))} | "
            f"{_f(o.get('trace', {}).get('server_ms'), 1)} | "
            f"{_f(sent / events if sent and events else None, 2)} |"
        )
    lines += [
        "",
        "Checks (`devices_in_state` of gateway/store/queries.py for both states, and "
        "`latest_events_by_device` of every device):",
        "",
    ]
    for name, r in runs.items():
        c = r.get("check", {})
        lines.append(f"- {name}: {c.get('text', r.get('error', 'n/a'))}")
        for key in ("alarm_error", "ok_error"):
            if key in c:
                lines.append(f"  - reading {key.split('_')[0]!r}: {c[key][:400]}")
    lines.append(f"- runs agree: {results.get('runs_agree')}")
    lines += ["", "Errors and warnings:", ""]
    for name, r in runs.items():
        for state in (RARE, COMMON):
            e = r.get("reads", {}).get(state, {})
            for text, count in (e.get("error_kinds") or {}).items():
                lines.append(f"- {name}, readers of {state!r}: {count:,} x {text[:400]}")
            t = e.get("trace", {})
            if "error" in t:
                lines.append(f"- {name}, traced read of {state!r}: {t['error'][:400]}")
            if e.get("driver_server_warning_sample"):
                lines.append(
                    f"- {name}, readers of {state!r}: {e['driver_server_warnings']:,} server "
                    f"warnings logged by the driver, e.g. {e['driver_server_warning_sample'][:400]}"
                )
        for stage in ("ingest", "reads"):
            c = r.get(f"cassandra_log_{stage}") or {}
            if c.get("warn_lines") or c.get("failure_lines"):
                sample = next(iter(c.get("samples", {}).values()), "")
                lines.append(
                    f"- {name}, Cassandra system.log lines for the tenant during {stage}: "
                    f"{c['warn_lines']:,} tombstone warnings, {c['failure_lines']:,} tombstone "
                    f"failures; e.g. {sample[:400]}"
                )
        other = [w for w in r.get("gateway_log_warnings", []) if "hot partition" not in w]
        total = r.get("gateway_log_warning_count", 0)
        hot = r.get("gateway_log_hot_partition_notices", total - len(other))
        if total:
            lines.append(
                f"- {name}, gateway log: {total} WARNING/ERROR lines, {hot} of them "
                '"hot partition" notices (the tenant\'s state partitions take every write)'
                + (f"; the others: {'; '.join(w[:300] for w in other[:5])}" if other else "")
            )
        if r.get("rotation_failures_logged"):
            lines.append(f"- {name}: rotation failures: {r['rotation_failures_logged'][:3]}")
    rot_rows = [(n, x) for n, r in runs.items() for x in r.get("rotations", {}).get("each", [])]
    if rot_rows:
        lines += [
            "",
            "## Rotations",
            "",
            "From the gateway's log lines, timed by the harness as they appeared (0.2 s polling; "
            "seconds from the gateway's start):",
            "",
            "| run | partition | into gen | rows copied | announced at s | live at s | "
            "announce to live s |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for name, x in rot_rows:
            lines.append(
                f"| {name} | {x['partition'].split('/', 1)[1]} | {x['gen']} | {_f(x['copied'])} | "
                f"{_f(x['announced_at_s'], 1)} | {_f(x['live_at_s'], 1)} | "
                f"{_f(x['announce_to_live_s'], 2)} |"
            )
        for name, r in runs.items():
            parts = r.get("state_partitions")
            if parts:
                lines.append(
                    f"\n{name}, `state_partitions` after settling: "
                    + "; ".join(f"{p['state']}: gen {p['gen']}, live {p['live']}" for p in parts)
                )
    paper = results.get("on_paper", {})
    if "params" in paper:
        p = paper["params"]
        wait_label = f"{results['default_rotation_wait_s']:.0f} s"
        lines += [
            "",
            "## 1,000,000 on paper",
            "",
            "The gateway's rotation rule replayed (`replay()` in the script): a partition is due "
            "at `deletes >= max(rotate_after_deletes, live // 2)` and starts at once (the next "
            "chunk, or the idle tick); announcing zeroes `deletes`; `rotation_wait` later the "
            "live rows are copied, and every delete until the switch is written to both "
            "generations (the new one starts with those tombstones); the switch sets `live` to "
            "the rows copied less the deletes since the announcement and checks again. "
            "Inputs measured in the 'on' run: "
            f"{_f(p['departures_per_s'])} departures/s (its ok phase), copies at "
            f"{_f(p['copy_rows_per_s'])} rows/s (all its rows copied over all its seconds from "
            "announce to switch). Extra writes = rows copied + deletes written "
            "twice + 4 statements per rotation (two LWTs, the drop, its mark). First-page "
            "tombstones = what a `LIMIT 100` read of the rare state steps over, departures "
            "spread at random: all of them once fewer than 100 devices are left; in device-id "
            "order (a site leaving together, ids in order) every tombstone of the generation "
            "read lies before its first live row. The measured runs read only after settling; "
            "reads during the departure are not measured.",
            "",
            "| rotation_wait | devices | rotations | rows copied | copies per departure | "
            "deletes written twice | extra writes per departure | first-page tombstones: "
            "worst in random order / worst in device-id order / at the end | departures take s "
            "| rotations busy s |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        ]
        rows = [
            (label, n, x)
            for key, label in (("wait_0", "0"), ("default_wait", wait_label))
            for n, x in paper[key].items()
        ]
        rows += [
            (f"0, copies {factor[1:]}x as fast", "1000000", x)
            for factor, x in paper.get("copy_speed_sensitivity", {}).items()
        ]
        for label, n, x in rows:
            lines.append(
                f"| {label} | {int(n):,} | {x['rotations']} | {_f(x['rows_copied'])} | "
                f"{x['copies_per_departure']:.2f} | {_f(x['dual_written_deletes'])} | "
                f"{x['extra_writes_per_departure']:.2f} | "
                f"{_f(x['max_first_page_tombstones'])} / "
                f"{_f(x['max_tombstones_in_read_generation'])} / "
                f"{_f(x['final_tombstones_in_read_generation'])} | "
                f"{_f(x['departure_s'])} | {_f(x['rotation_busy_s'])} |"
            )
        lines += ["", "Measured at N, against the replay's rows for N:", ""]
        for name, m in paper.get("measured_at_n", {}).items():
            lines.append(
                f"- {name}: {m['rotations']} rotations, {_f(m['rows_copied'])} rows copied, "
                f'{_f(m["final_tombstones_read"])} tombstones read by the first page of "alarm"'
                + (
                    f", {m['extra_statements_per_departure']:.2f} more Cassandra statements per "
                    "departure than the 'off' run"
                    if m.get("extra_statements_per_departure") is not None
                    else ""
                )
            )
    if results.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


def _source_digest() -> str:
    """The commit, and a digest of gateway/ and schema/ as run (the tree may be dirty)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "gateway", "schema"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("gateway/**/*.py"), *ROOT.glob("schema/*.cql")]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    state = "with uncommitted changes in gateway/ or schema/" if dirty else "clean"
    return f"{commit} ({state}; sha256 of gateway/**/*.py + schema/*.cql {h.hexdigest()[:12]})"


def _machine() -> str:
    cpus = os.cpu_count()
    try:
        from cassandra.cluster import Cluster  # noqa: PLC0415

        cluster = Cluster(["127.0.0.1"], protocol_version=4)
        session = cluster.connect()
        version = session.execute("SELECT release_version FROM system.local").one()[0]
        settings = {
            r.name: r.value
            for r in session.execute("SELECT name, value FROM system_views.settings")
            if r.name in ("tombstone_warn_threshold", "tombstone_failure_threshold")
        }
        cluster.shutdown()
    except Exception as exc:  # pragma: no cover
        version, settings = f"? ({exc})", {}
    return (
        f"{cpus} cores, Cassandra {version} (one node, same host; tombstone_warn_threshold "
        f"{settings.get('tombstone_warn_threshold')}, tombstone_failure_threshold "
        f"{settings.get('tombstone_failure_threshold')}), Mosquitto on the same host, "
        f"Python {sys.version.split()[0]}"
    )


def merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s runs added to ``base`` (--add-to), each run naming its invocation."""
    merged = dict(base)
    merged["runs"] = dict(base["runs"])
    invocation = {
        k: new[k]
        for k in ("command", "started", "minutes", "load_start", "load_end", "gateway_source")
    }
    for name, run in new["runs"].items():
        merged["runs"][name] = run | {"invocation": invocation}
    merged["notes"] = [
        n for n in base.get("notes", []) if not any(n.startswith(f"run {r} ") for r in new["runs"])
    ] + new.get("notes", [])
    merged["supplements"] = [*base.get("supplements", []), invocation | {"runs": list(new["runs"])}]
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=110_000)
    parser.add_argument("--runs", default="on,off,on-wait", help="of: " + ", ".join(RUNS))
    parser.add_argument("--publishers", type=int, default=2, help="MQTT connections (processes)")
    parser.add_argument(
        "--lead",
        type=int,
        default=5000,
        help="messages the publishers may be ahead of the gateway (the broker's backlog)",
    )
    parser.add_argument("--clients", type=int, default=20, help="concurrent readers")
    parser.add_argument("--read-seconds", type=float, default=10.0)
    parser.add_argument(
        "--single-seconds",
        type=float,
        default=3.0,
        help="then one client alone for this long (0: not), to tell queueing from cost",
    )
    parser.add_argument("--stall", type=float, default=120.0, help="s without progress = failure")
    parser.add_argument("--settle-quiet", type=float, default=3.0)
    parser.add_argument("--settle-timeout", type=float, default=180.0)
    parser.add_argument("--progress-every", type=float, default=5.0)
    parser.add_argument(
        "--budget",
        type=float,
        default=900.0,
        help="s; a run is skipped when the runs so far say it would end past this",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "rare_state.json")
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: write the report (.md) again from the results in --out",
    )
    parser.add_argument(
        "--add-to",
        action="store_true",
        help="add this invocation's runs to the results already in --out (e.g. a run "
        "skipped for time, measured afterwards); both commands are reported",
    )
    args = parser.parse_args()
    if args.render:
        finish(json.loads(args.out.read_text()), args.out)
        print(f"rendered {args.out.with_suffix('.md')} from {args.out}")
        return 0
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            parser.error(f"unknown run {r!r}")

    from gateway.config import load_config  # noqa: PLC0415

    defaults = load_config(None, {})
    bench = Bench(args)
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(
            shlex.quote(a) for a in [".venv/bin/python", "bench/rare_state.py", *sys.argv[1:]]
        ),
        "devices": args.devices,
        "publishers": args.publishers,
        "lead": args.lead,
        "clients": args.clients,
        "single_seconds": args.single_seconds,
        "read_seconds": args.read_seconds,
        "keyspace": KEYSPACE,
        "default_rotation_wait_s": (
            defaults.pipeline.rotation_wait
            if defaults.pipeline.rotation_wait is not None
            else defaults.pipeline.states_refresh + 2.0
        ),
        "rotate_after_deletes_default": defaults.pipeline.rotate_after_deletes,
        "machine": _machine(),
        "gateway_source": _source_digest(),
        "load_start": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "runs": {},
        "notes": [],
    }
    base: dict[str, Any] | None = None
    if args.add_to:
        base = json.loads(args.out.read_text())
        if base["devices"] != args.devices:
            parser.error(f"--add-to: {args.out} has {base['devices']} devices, not {args.devices}")
    failed = False
    out = args.out
    try:
        bench.schema()
        durations: list[float] = []
        for name in runs:
            elapsed = time.monotonic() - bench.started
            if durations and name == "on-wait":
                estimate = max(durations)
                if elapsed + estimate > args.budget:
                    note = (
                        f"run {name} skipped: {elapsed:.0f} s used, a run takes about "
                        f"{estimate:.0f} s, budget {args.budget:.0f} s"
                    )
                    bench.say(note)
                    results["notes"].append(note)
                    continue
            bench.say(f"run {name}: {LABELS[name]}")
            t0 = time.monotonic()
            results["runs"][name] = {"run": name, "error": "interrupted"}  # until it returns
            try:
                results["runs"][name] = bench.run(name)
            except BenchFailure as exc:
                failed = True
                bench.say(f"run {name} FAILED: {exc}")
                results["runs"][name] = {"run": name, "error": str(exc)}
                break
            durations.append(time.monotonic() - t0)
            if not results["runs"][name].get("check", {}).get("ok"):
                failed = True
                bench.say(f"run {name}: the check FAILED; stopping")
                break
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM (benchlib.run_tool): what was measured goes beside
        # --out, which keeps the last complete results.
        failed = True
        out = args.out.with_name(f"{args.out.stem}.interrupted.json")
        raise
    finally:
        results["load_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        results["minutes"] = round((time.monotonic() - bench.started) / 60, 1)
        if base is not None:
            results = merge(base, results)
        if not finish(results, out):
            failed = True
        bench.say(f"wrote {out} and {out.with_suffix('.md')}")
    return 1 if failed else 0


def finish(results: dict[str, Any], out: Path) -> bool:
    """Cross-run checks and the on-paper figures; writes the JSON and the report.
    False when the runs disagree."""
    done = [r for r in results["runs"].values() if "check" in r]
    digests = {r["check"].get("ok_set_digest") for r in done}
    alarms = {tuple(r["check"].get("alarm_devices", ())) for r in done if r["run"] != "off"}
    results["runs_agree"] = (
        f"yes: the same {done[0]['check'].get('ok_count'):,} devices in 'ok' in every run"
        + (f", 'alarm' = {list(next(iter(alarms)))}" if len(alarms) == 1 else "")
        if len(done) > 1 and len(digests) == 1 and len(alarms) <= 1
        else ("NO" if len(done) > 1 else "n/a (one run)")
    )
    results["on_paper"] = on_paper(results, results["rotate_after_deletes_default"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    return len(done) < 2 or results["runs_agree"].startswith("yes")


if __name__ == "__main__":
    # Imported here, not at the top: the publishers are spawned processes,
    # which import this module's top level, and benchlib's imports (the
    # drivers, aiomqtt, the gateway) cost each of them a second and 40 MB.
    from benchlib import run_tool

    # SIGTERM runs the finally blocks too: the gateway is stopped, its MQTT
    # session forgotten and the runs so far written beside --out (the
    # publishers use clean sessions and are daemonic).
    run_tool(lambda: sys.exit(main()))
