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
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import rows
from benchlib import (
    BENCH,
    BenchDb,
    Check,
    Proc,
    ProcError,
    Sent,
    cassandra_config,
    clear_session,
    cpu_seconds,
    create_session,
    fleet_spec,
    peak_rss_mb,
    percentiles,
    publish_recorded,
    rss_mb,
)
from cassandra.concurrent import execute_concurrent
from cassandra.query import UNSET_VALUE, BatchStatement, BatchType

from cassandra import __version__ as cassandra_driver_version
from gateway.config import Config, TenantConfig
from gateway.store.database import connect
from gateway.store.latest import state_bucket
from gateway.store.queries import devices_in_state

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # pip install matplotlib (the bench extra)
    plt = None  # type: ignore[assignment]

RESULTS = BENCH / "results"
LOGS = BENCH / ".logs"
NODE_DIR = BENCH / ".node-red"
NODE_RED_VERSION = "4.1.8"
CASSANDRA_DRIVER_JS_VERSION = "4.10.0"
PHASES: dict[str, float] = {  # name -> estimated seconds on the 2-core reference box
    "setup": 5,
    "broker": 20,
    "ceiling": 55,
    "naive": 75,
    "nodered": 35,
    "gateway": 80,
    "scaling": 50,
    "overload": 220,
    "states": 30,
    "report": 5,
}
SYSTEMS = ("broker", "cassandra", "naive", "nodered", "gateway")
LABELS = {
    "broker": "Broker ceiling (paho QoS 1 subscriber, no database)",
    "cassandra": "Cassandra ceiling (direct writer, same rows and driver as the gateway)",
    "naive": "Naive bridge (paho on_message + cassandra-driver session.execute per row)",
    "nodered": "Node-RED (mqtt in → function node + cassandra-driver)",
    "gateway": "Gateway (defaults)",
}


PLOT_LABELS = {
    "broker": "broker only (publish → received)",
    "cassandra": "Cassandra ceiling",
    "naive": "naive bridge",
    "nodered": "Node-RED",
    "gateway": "gateway",
}


class Stopped(Exception):
    """SIGTERM/SIGINT: clean up and leave."""


# -- progress ---------------------------------------------------------------------


class Progress:
    """One line per step: phase, elapsed, ETA (phase estimates scaled by how
    the finished phases compared with theirs)."""

    def __init__(self, phases: Sequence[str]) -> None:
        self.phases = list(phases)
        self.start = time.monotonic()
        self.current: str | None = None
        self.phase_start = self.start
        self.done_est = 0.0
        self.done_real = 0.0

    def _eta(self) -> float:
        scale = self.done_real / self.done_est if self.done_est > 30 else 1.0
        left = 0.0
        seen = False
        for name in self.phases:
            if name == self.current:
                seen = True
                est = PHASES[name] * scale
                left += max(est - (time.monotonic() - self.phase_start), 0.0)
            elif seen or self.current is None:
                left += PHASES[name] * scale
        return left

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.start
        print(
            f"[bench {_mmss(elapsed)} elapsed, ETA ~{_mmss(self._eta())}] "
            f"{self.current or '-'}: {message}",
            flush=True,
        )

    def begin(self, name: str) -> None:
        self.current = name
        self.phase_start = time.monotonic()
        self.say("start")

    def end(self) -> None:
        assert self.current is not None
        real = time.monotonic() - self.phase_start
        self.done_est += PHASES[self.current]
        self.done_real += real
        self.say(f"done in {real:.0f} s")
        self.phases.remove(self.current)
        self.current = None


def _scaling_row(devices: int, result: Drain) -> dict[str, Any]:
    return {
        "devices": devices,
        "backlog": result.count,
        "msg_per_s": result.rate,
        "cpu_s_per_1k_msgs": result.cpu_per_1k,
        "peak_rss_mb": result.peak_rss_mb,
        "check": result.check.text() if result.check else None,
        "ok": result.check.ok if result.check else False,
    }


def _mmss(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60:02d}:{s % 60:02d}"


# -- the run --------------------------------------------------------------------


@dataclass
class Drain:
    """What one drain (and optional latency run) of one system measured."""

    count: int
    reached: int = 0
    rate: float | None = None
    wall_s: float | None = None
    cpu_per_1k: float | None = None
    peak_rss_mb: float | None = None
    check: Check | None = None
    latency: dict[str, Any] = field(default_factory=dict)
    latency_values: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backlog": self.count,
            "drained": self.reached,
            "msg_per_s": self.rate,
            "wall_s_start_to_drained": self.wall_s,
            "cpu_s_per_1k_msgs": self.cpu_per_1k,
            "peak_rss_mb": self.peak_rss_mb,
        }
        if self.check is not None:
            out["check"] = self.check.summary() | {"text": self.check.text()}
        if self.latency:
            out["latency"] = self.latency
        return out | self.extra


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:6]
        self.progress = Progress([p for p in PHASES if p not in args.skip])
        self.procs: list[Proc] = []
        self.sessions: set[str] = set()
        self.db: BenchDb | None = None
        self.started = datetime.now(UTC)
        self.results: dict[str, Any] = {
            "started": self.started.isoformat(timespec="seconds"),
            "run_id": self.run_id,
            "command": args.command,
            "params": {k: v for k, v in vars(args).items() if k not in ("command", "skip", "out")},
            "skipped": sorted(args.skip),
            "systems": {},
            "notes": [],
        }
        self.latencies: dict[str, list[float]] = {}
        self.startup: dict[str, float] = {}

    # -- helpers ------------------------------------------------------------------

    def say(self, message: str) -> None:
        self.progress.say(message)

    def tenant(self, name: str) -> str:
        return f"r{self.run_id}{name}"

    def client_id(self, name: str) -> str:
        cid = f"gwbench-{self.run_id}-{name}"
        self.sessions.add(cid)
        return cid

    def log(self, name: str) -> Path:
        return LOGS / f"{name}.log"

    def proc(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc.start()

    @property
    def cdb(self) -> BenchDb:
        assert self.db is not None
        return self.db

    def wait(self, proc: Proc, target: int, timeout: float, what: str) -> bool:
        def tick() -> None:
            self.say(f"{what}: {proc.count}/{target}")

        return proc.wait_count(target, timeout, tick)

    def publish_backlog(self, tenant: str, devices: int, count: int) -> list[Sent]:
        self.cdb.register_states([tenant])
        stats, sent = publish_recorded(fleet_spec(tenant, devices), count=count)
        self.say(f"published a backlog of {stats.sent} messages at {stats.rate:.0f} msg/s")
        return sent

    def drain(
        self,
        key: str,
        make: Callable[[str], Proc],
        *,
        count: int,
        devices: int,
        has_db: bool = True,
        latency: bool = True,
        latest: bool = True,
        latency_rates: Sequence[float] = (),
    ) -> tuple[Drain, Proc]:
        """Backlog → start → drain → (latency run at half the rate, then at each
        of ``latency_rates``) → stop."""
        cid = self.client_id(key)
        tenant = self.tenant(f"{key}{devices}")
        startup_cpu = self.startup_cpu(key, make, cid)
        create_session(cid)  # fresh and empty: only the backlog below is queued
        sent = self.publish_backlog(tenant, devices, count)
        proc = self.proc(make(cid))
        started = time.monotonic()
        result = Drain(count=count)
        try:
            proc.wait_ready(90)
            self.say(f"{proc.name} ready, draining {count} messages")
            done = self.wait(proc, count, timeout=60 + count / 50, what="drained")
            cpu = cpu_seconds(proc.pid) - startup_cpu
            result.wall_s = time.monotonic() - started
            result.reached = proc.count
            result.peak_rss_mb = peak_rss_mb(proc.pid)
            result.cpu_per_1k = cpu / max(proc.count, 1) * 1000
            if not done:
                result.extra["status"] = f"stalled at {proc.count}/{count}"
            if has_db:
                result.check = self.cdb.check(tenant, sent, latest=latest)
                result.rate = result.check.span_rate()
                self.say(f"stored: {result.check.text()}")
            else:
                m = re.search(r"first=([\d.]+) last=([\d.]+)", proc.last_progress_line)
                if m and done and float(m.group(2)) > float(m.group(1)):
                    result.rate = (count - 1) / (float(m.group(2)) - float(m.group(1)))
            rate_text = f"{result.rate:.0f}" if result.rate else "?"
            self.say(
                f"{rate_text} msg/s sustained, {result.cpu_per_1k:.2f} CPU s per 1k msgs, "
                f"peak RSS {result.peak_rss_mb:.0f} MB"
            )
            if latency and result.rate:
                self.latency_run(key, proc, result, devices, has_db)
                result.extra["latency_by_rate"] = [
                    self.latency_run(key, proc, result, devices, has_db, rate=rate)
                    for rate in latency_rates
                ]
        finally:
            self.stop(proc)
            clear_session(cid)
        return result, proc

    def startup_cpu(self, key: str, make: Callable[[str], Proc], cid: str) -> float:
        """CPU seconds a system spends starting up (to connected and subscribed),
        measured once per system on an empty session. A backlog floods in as soon
        as the system connects, before it can report being ready, so the drain's
        CPU is its total minus this."""
        if key not in self.startup:
            create_session(cid)
            proc = self.proc(make(cid))
            try:
                proc.wait_ready(90)
                time.sleep(0.2)
                self.startup[key] = cpu_seconds(proc.pid)
            finally:
                self.stop(proc)
            self.say(f"{proc.name} start-up: {self.startup[key]:.2f} CPU s")
        return self.startup[key]

    def latency_run(
        self,
        key: str,
        proc: Proc,
        result: Drain,
        devices: int,
        has_db: bool,
        rate: float | None = None,
    ) -> dict[str, Any]:
        """A live run at ``rate`` (default: half the sustained rate, which is
        the system's reported latency); returns what it measured."""
        assert result.rate is not None
        fixed = rate is not None
        rate = rate if rate is not None else result.rate / 2
        tenant = self.tenant(f"{key}lat{int(rate) if fixed else ''}")
        self.cdb.register_states([tenant])
        base = proc.count
        self.say(f"latency run: {rate:.0f} msg/s for {self.args.latency_seconds:.0f} s")
        stats, sent = publish_recorded(
            fleet_spec(tenant, devices, rate=rate), duration=self.args.latency_seconds
        )
        done = self.wait(proc, base + stats.sent, timeout=120, what="latency run written")
        p: dict[str, Any] = {
            "offered_msg_per_s": rate,
            "achieved_msg_per_s": stats.rate,
            "published": stats.sent,
            "complete": done,
        }
        if has_db:
            check = self.cdb.check(tenant, sent)
            p["check"] = check.summary() | {"text": check.text()}
            values = check.latency_ms
        else:
            self.stop(proc)
            path = LOGS / f"{key}-latency.json"
            values = json.loads(path.read_text()) if path.exists() else []
        p |= percentiles(values)
        if values:
            self.say(f"latency p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms, max {p['max']:.1f} ms")
        if fixed:
            return p
        ordered = sorted(values)
        p["cdf_ms"] = [ordered[round(q / 100 * (len(ordered) - 1))] for q in range(101) if ordered]
        result.latency = p
        result.latency_values = values
        self.latencies[key] = values
        return p

    def stop(self, proc: Proc) -> None:
        code = proc.stop()
        if code not in (0, None, -signal.SIGTERM):
            self.say(f"{proc.name} exited with {code}")

    # -- the systems ----------------------------------------------------------------

    def gateway_proc(self, cid: str, name: str = "gateway") -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {
            "GATEWAY_MQTT__CLIENT_ID": cid,
            "GATEWAY_MQTT__SESSION_EXPIRY": "600",
            "GATEWAY_CASSANDRA__KEYSPACE": rows.KEYSPACE,
            "GATEWAY_TOPICS": '[{template = "gwbench/{tenant}/devices/{device_id}/events"}]',
            "GATEWAY_PIPELINE__STATUS_INTERVAL": "200ms",
        }
        if "api" in Config.model_fields:
            # Its metrics endpoint on any free port: several gateways may run at once.
            env["GATEWAY_API__PORT"] = "0"
        env |= dict(item.split("=", 1) for item in self.args.gateway_env)
        return Proc(
            name,
            [sys.executable, "-m", "gateway", "run"],
            env,
            self.log(name),
            [re.compile(r"connected to mqtt://")],
            # acked: messages finished (written, rejected or sampled out) and PUBACKed
            re.compile(r"status: .*acked=(\d+)"),
        )

    def phase_setup(self) -> None:
        env = dict(os.environ, GATEWAY_CASSANDRA__KEYSPACE=rows.KEYSPACE)
        subprocess.run(
            [sys.executable, "-m", "gateway", "schema", "apply"],
            env=env,
            check=True,
            capture_output=True,
        )
        self.db = BenchDb()
        self.say(f"schema applied to keyspace {rows.KEYSPACE}; truncating its tables")
        self.cdb.truncate()
        shutil.rmtree(LOGS, ignore_errors=True)
        LOGS.mkdir(parents=True, exist_ok=True)
        self.results["machine"] = machine(self.cdb)
        self.results["cassandra_write_rtt_ms"] = write_rtt(self.cdb)

    def phase_broker(self) -> None:
        n = self.args.count

        def make(cid: str) -> Proc:
            return Proc(
                "broker_sub",
                [
                    sys.executable,
                    str(BENCH / "broker_sub.py"),
                    cid,
                    str(n),
                    str(LOGS / "broker-latency.json"),
                ],
                dict(os.environ),
                self.log("broker_sub"),
                [re.compile("READY")],
                re.compile(r"received=(\d+)"),
            )

        result, _ = self.drain("broker", make, count=n, devices=self.args.devices, has_db=False)
        result.extra["latency_meaning"] = "publish → received by the subscriber (no database)"
        self.results["systems"]["broker"] = result.as_json()

    def phase_ceiling(self) -> None:
        out = LOGS / "ceiling.json"
        cmd = [sys.executable, str(BENCH / "ceiling.py"), "--prefix", self.tenant("")]
        cmd += ["--devices", str(self.args.devices), "--count", str(self.args.ceiling_count)]
        cmd += ["--levels", self.args.levels, "--out", str(out)]
        proc = self.proc(
            Proc("ceiling", cmd, dict(os.environ), self.log("ceiling"), [], re.compile(r"^$"))
        )
        levels = [int(x) for x in self.args.levels.split(",")]
        tenants = [self.tenant(f"c{level}") for level in levels]
        self.cdb.register_states(tenants)
        next_say = time.monotonic() + 5
        while proc.alive():
            time.sleep(0.1)
            if time.monotonic() > next_say:
                done = proc.log.read_text().count("level ")
                self.say(f"{done}/{len(levels)} concurrency levels done")
                next_say = time.monotonic() + 5
        if proc.popen is None or proc.popen.returncode != 0 or not out.exists():
            raise ProcError(f"ceiling writer failed:\n{proc.log.read_text()[-2000:]}")
        report = json.loads(out.read_text())
        per_level = []
        best: dict[str, Any] | None = None
        for level in report["levels"]:
            sent = [Sent(d, ts, s, None) for d, ts, s in level.pop("sent")]
            check = self.cdb.check(level["tenant"], sent)
            level["msg_per_s"] = level["events"] / level["seconds"]
            level["cpu_s_per_1k_msgs"] = level["cpu_s"] / level["events"] * 1000
            level["check"] = check.summary() | {"text": check.text()}
            level["statements_per_s"] = level["statements"] / level["seconds"]
            self.say(
                f"{level['concurrency']} in flight: {level['msg_per_s']:.0f} msg/s "
                f"({level['statements_per_s']:.0f} statements/s), stored {check.text()}"
            )
            per_level.append(level)
            if (
                check.ok
                and level["failures"] == 0
                and (best is None or level["msg_per_s"] > best["msg_per_s"])
            ):
                best = level
        result: dict[str, Any] = {
            "levels": per_level,
            "process_peak_rss_mb": report["peak_rss_mb"],
            "driver": report["driver"],
        }
        if best is not None:
            result |= {
                "backlog": best["events"],
                "drained": best["events"],
                "msg_per_s": best["msg_per_s"],
                "cpu_s_per_1k_msgs": best["cpu_s_per_1k_msgs"],
                "peak_rss_mb": report["peak_rss_mb"],
                "check": best["check"],
                "best_concurrency": best["concurrency"],
            }
        else:
            result["status"] = "failed: no concurrency level wrote every row without errors"
        self.results["systems"]["cassandra"] = result

    def phase_naive(self) -> None:
        def make(cid: str) -> Proc:
            return Proc(
                "naive_bridge",
                [sys.executable, str(BENCH / "naive_bridge.py"), cid],
                dict(os.environ),
                self.log("naive_bridge"),
                [re.compile("READY")],
                re.compile(r"written=(\d+)"),
            )

        result, _ = self.drain(
            "naive", make, count=self.args.naive_count, devices=self.args.devices
        )
        self.results["systems"]["naive"] = result.as_json()

    def phase_nodered(self) -> None:
        reason = install_node_red(self.say)
        if reason is not None:
            self.results["systems"]["nodered"] = {"status": f"not measured: {reason}"}
            self.say(f"Node-RED not measured: {reason}")
            return
        user = NODE_DIR / "user"
        modules = NODE_DIR / "node_modules"

        def make(cid: str) -> Proc:
            write_flows(user, cid)
            env = dict(os.environ, BENCH_NODE_MODULES=str(modules), BENCH_KEYSPACE=rows.KEYSPACE)
            return Proc(
                "nodered",
                [
                    "node",
                    str(modules / "node-red" / "red.js"),
                    "--userDir",
                    str(user),
                    "--settings",
                    str(BENCH / "nodered" / "settings.js"),
                ],
                env,
                self.log("nodered"),
                [re.compile("Connected to broker"), re.compile("cassandra connected")],
                re.compile(r"written=(\d+)"),
            )

        result, _ = self.drain(
            "nodered", make, count=self.args.nodered_count, devices=self.args.devices
        )
        result.extra["version"] = NODE_RED_VERSION
        failed = re.findall(r"failed=(\d+)", self.log("nodered").read_text())
        result.extra["write_failures"] = int(failed[-1]) if failed else None
        self.results["systems"]["nodered"] = result.as_json()

    def phase_gateway(self) -> None:
        result, proc = self.drain(
            "gateway",
            self.gateway_proc,
            count=self.args.count,
            devices=self.args.devices,
            latency_rates=self.args.latency_rates,
        )
        summary = [line for line in proc.log.read_text().splitlines() if "stopped:" in line]
        if summary:
            result.extra["gateway_summary"] = summary[-1].split("stopped: ", 1)[1]
            dropped = re.findall(r"\b(sampled_out|quota_rejected|rejected)=(\d+)", summary[-1])
            result.extra["gateway_dropped"] = {k: int(v) for k, v in dropped if int(v)}
        self.results["systems"]["gateway"] = result.as_json()
        self.results["scaling"] = [_scaling_row(self.args.devices, result)]

    def phase_scaling(self) -> None:
        rows_out = self.results.setdefault("scaling", [])
        for devices in self.args.scale_devices:
            self.say(f"gateway with {devices} devices")
            result, _ = self.drain(
                "gateway",
                functools.partial(self.gateway_proc, name=f"gateway-{devices}"),
                count=self.args.scale_count,
                devices=devices,
                latency=False,
                latest=False,
            )
            rows_out.append(_scaling_row(devices, result))

    def phase_overload(self) -> None:
        sustained = self.results["systems"].get("gateway", {}).get("msg_per_s")
        if not sustained:
            self.results["overload"] = {"status": "not measured: no sustained gateway rate"}
            return
        cid = self.client_id("overload")
        create_session(cid)
        gw = self.proc(self.gateway_proc(cid, "gateway-overload"))
        segments = []
        try:
            gw.wait_ready(90)
            for factor in self.args.overload_factors:
                segments.append(self.overload_segment(gw, factor, sustained))
        finally:
            self.stop(gw)
            clear_session(cid)
        self.results["overload"] = {"sustained_msg_per_s": sustained, "segments": segments}

    def overload_segment(self, gw: Proc, factor: float, sustained: float) -> dict[str, Any]:
        target = factor * sustained
        duration = self.args.overload_seconds
        k = max(1, min(self.args.max_publishers, math.ceil(target / 8000)))
        devices = max(1, self.args.devices // k)
        tenants = [self.tenant(f"ov{factor:g}p{i}") for i in range(k)]
        self.cdb.register_states(tenants)
        base = gw.count
        counters0 = _status_counters(gw)
        self.say(
            f"{factor:g}x: offering {target:.0f} msg/s for {duration:.0f} s "
            f"from {k} publisher process(es)"
        )
        pubs = [
            self.proc(
                Proc(
                    f"publisher-{factor:g}-{i}",
                    [
                        sys.executable,
                        str(BENCH / "publisher.py"),
                        tenant,
                        str(devices),
                        str(target / k),
                        str(duration),
                        str(i + 1),
                    ],
                    dict(os.environ),
                    self.log(f"publisher-{factor:g}-{i}"),
                    [],
                    None,
                )
            )
            for i, tenant in enumerate(tenants)
        ]
        rss_max = 0.0
        t0 = time.monotonic()
        next_say = t0 + 5
        while any(p.alive() for p in pubs):
            gw.poll()
            rss_max = max(rss_max, rss_mb(gw.pid))
            if time.monotonic() > next_say:
                self.say(f"{factor:g}x: gateway written {gw.count - base}, RSS {rss_max:.0f} MB")
                next_say = time.monotonic() + 5
            if not gw.alive():
                raise ProcError("the gateway exited during the overload run")
            time.sleep(0.25)
        published_at = time.monotonic()
        stats = []
        for p in pubs:
            lines = p.log.read_text().strip().splitlines()
            try:
                stats.append(json.loads(lines[-1]))
            except (IndexError, json.JSONDecodeError):
                raise ProcError(f"{p.name} failed:\n{p.log.read_text()[-2000:]}") from None
        published = sum(s["sent"] for s in stats)
        offered = published / max(s["elapsed_s"] for s in stats)
        self.say(f"{factor:g}x: {published} published ({offered:.0f} msg/s); draining")

        def tick() -> None:
            nonlocal rss_max
            rss_max = max(rss_max, rss_mb(gw.pid))
            self.say(f"{factor:g}x: drained {gw.count - base}/{published}")

        done = gw.wait_count(base + published, timeout=120 + published / 200, tick=tick)
        drained_at = time.monotonic()
        rss_max = max(rss_max, rss_mb(gw.pid))
        stored = sum(self.cdb.count(t, [f"dev-{i:06d}" for i in range(devices)]) for t in tenants)
        # At these rates per device the adaptive sampler may decide some raw rows
        # are not kept (by design, counted, latest state still written): every
        # published message must be either stored or counted as sampled out.
        counters = _status_counters(gw)
        sampled_out = counters.get("sampled_out", 0) - counters0.get("sampled_out", 0)
        written = counters.get("written", 0) - counters0.get("written", 0)
        result = {
            "factor": factor,
            "target_msg_per_s": target,
            "offered_msg_per_s": offered,
            "publishers": k,
            "seconds": duration,
            "published": published,
            "stored": stored,
            "sampled_out": sampled_out,
            "gateway_written": written,
            "ok": done and stored == written and stored + sampled_out == published,
            "drain_after_publish_s": drained_at - published_at,
            "whole_segment_msg_per_s": published / (drained_at - t0),
            "rss_max_sampled_mb": rss_max,
            "peak_rss_mb": peak_rss_mb(gw.pid),
        }
        self.say(
            f"{factor:g}x: stored {stored} + sampled out {sampled_out} of {published} published, "
            f"peak RSS {result['peak_rss_mb']:.0f} MB, "
            f"drained {result['drain_after_publish_s']:.0f} s after publishing ended"
        )
        return result

    def phase_states(self) -> None:
        db = self.cdb
        insert = db.session.prepare(rows.cql(rows.CQL_INSERT_STATE))
        now = int(time.time() * 1000)
        combos = [(n, b) for n in self.args.state_devices for b in self.args.state_buckets]
        total = sum(n for n, _ in combos)
        self.say(f"inserting {total} rows into latest_events_by_state")
        batches: list[tuple[BatchStatement, None]] = []
        for n, b in combos:
            tenant = self.tenant(f"q{n}b{b}")
            groups: dict[int, list[str]] = {}
            for i in range(n):
                device = f"dev-{i:06d}"
                groups.setdefault(state_bucket(device, b), []).append(device)
            for bucket, devices in groups.items():
                for start in range(0, len(devices), 20):
                    batch = BatchStatement(batch_type=BatchType.UNLOGGED)
                    for device in devices[start : start + 20]:
                        batch.add(
                            insert,
                            (tenant, "on", bucket, 0, device, now, "1.0", UNSET_VALUE, now * 1000),
                        )
                    batches.append((batch, None))
        t0 = time.monotonic()
        for ok, res in execute_concurrent(db.session, batches, concurrency=64):
            if not ok:
                raise res
        self.say(f"inserted in {time.monotonic() - t0:.1f} s; timing devices_in_state")
        self.results["devices_in_state"] = asyncio.run(self._time_queries(combos))

    async def _time_queries(self, combos: list[tuple[int, int]]) -> list[dict[str, Any]]:
        tenants = {self.tenant(f"q{n}b{b}"): TenantConfig(state_buckets=b) for n, b in combos}
        config = Config(cassandra=cassandra_config(), tenants=tenants)
        out = []
        async with connect(config.cassandra) as db:
            for n, b in combos:
                tenant = self.tenant(f"q{n}b{b}")
                await devices_in_state(db, config, tenant, "on")  # warm-up
                times = []
                returned = 0
                for _ in range(self.args.state_runs):
                    t0 = time.perf_counter()
                    found = await devices_in_state(db, config, tenant, "on")
                    times.append((time.perf_counter() - t0) * 1000)
                    returned = len(found)
                median = statistics.median(times)
                out.append(
                    {
                        "devices": n,
                        "buckets": b,
                        "median_ms": median,
                        "runs_ms": times,
                        "returned": returned,
                        "ok": returned == n,
                    }
                )
                self.say(f"{n} devices, {b} bucket(s): median {median:.1f} ms ({returned} rows)")
        return out

    # -- driver -------------------------------------------------------------------

    def run(self) -> None:
        phases: dict[str, Callable[[], None]] = {
            "setup": self.phase_setup,
            "broker": self.phase_broker,
            "ceiling": self.phase_ceiling,
            "naive": self.phase_naive,
            "nodered": self.phase_nodered,
            "gateway": self.phase_gateway,
            "scaling": self.phase_scaling,
            "overload": self.phase_overload,
            "states": self.phase_states,
        }
        failures: dict[str, str] = {}
        try:
            for name, fn in phases.items():
                if name in self.args.skip:
                    continue
                self.progress.begin(name)
                try:
                    fn()
                except (Stopped, KeyboardInterrupt):
                    raise
                except Exception as exc:
                    if name == "setup":
                        raise
                    failures[name] = f"{type(exc).__name__}: {exc}"
                    self.say(f"FAILED: {failures[name][:500]}")
                    key = {"ceiling": "cassandra"}.get(name, name)
                    if key in SYSTEMS:
                        self.results["systems"].setdefault(key, {})["status"] = (
                            f"failed: {failures[name][:300]}"
                        )
                finally:
                    self.cleanup()
                self.progress.end()
        finally:
            self.cleanup()
            if self.db is not None:
                self.db.close()
        self.results["phase_failures"] = failures
        self.progress.begin("report")
        self.results["duration_s"] = time.monotonic() - self.progress.start
        self.results["machine"] = self.results.get("machine", {}) | {"loadavg_end": os.getloadavg()}
        write_report(self.results, self.latencies, self.args.out)
        self.progress.end()
        print(f"results: {self.args.out / 'latest.md'}", flush=True)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.stop(15)
        self.procs = [p for p in self.procs if p.alive()]
        for cid in sorted(self.sessions):
            try:
                clear_session(cid)
            except Exception as exc:
                print(f"could not clear MQTT session {cid}: {exc}", flush=True)
        self.sessions.clear()


# -- Node-RED -----------------------------------------------------------------------


def install_node_red(say: Callable[[str], None]) -> str | None:
    """Install Node-RED and cassandra-driver into bench/.node-red; the reason if not."""
    node = shutil.which("node")
    npm = shutil.which("npm")
    if node is None or npm is None:
        return "node/npm not installed (apt-get install nodejs npm)"
    wanted = {"node-red": NODE_RED_VERSION, "cassandra-driver": CASSANDRA_DRIVER_JS_VERSION}
    have = {}
    for name in wanted:
        pkg = NODE_DIR / "node_modules" / name / "package.json"
        if pkg.exists():
            have[name] = json.loads(pkg.read_text()).get("version")
    if have == wanted:
        return None
    say(f"npm install node-red@{NODE_RED_VERSION} cassandra-driver@{CASSANDRA_DRIVER_JS_VERSION}")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--save-exact", "--loglevel=error"]
        + [f"{k}@{v}" for k, v in wanted.items()],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        return f"npm install failed: {(done.stderr or done.stdout).strip()[-400:]}"
    return None


def write_flows(user: Path, client_id: str) -> None:
    code = BENCH / "nodered"
    user.mkdir(parents=True, exist_ok=True)
    flows = [
        {"id": "b0a1", "type": "tab", "label": "bench"},
        {
            "id": "b0b1",
            "type": "mqtt-broker",
            "name": "local",
            "broker": "127.0.0.1",
            "port": "1883",
            "clientid": client_id,
            "autoConnect": True,
            "usetls": False,
            "protocolVersion": "5",
            "keepalive": "60",
            "cleansession": False,
            "autoUnsubscribe": False,
            "sessionExpiry": "600",
            "birthTopic": "",
            "closeTopic": "",
            "willTopic": "",
        },
        {
            "id": "b0c1",
            "type": "mqtt in",
            "z": "b0a1",
            "name": "events",
            "topic": rows.SUBSCRIPTION,
            "qos": "1",
            "datatype": "json",
            "broker": "b0b1",
            "nl": False,
            "rap": True,
            "rh": 0,
            "inputs": 0,
            "wires": [["b0d1"]],
        },
        {
            "id": "b0d1",
            "type": "function",
            "z": "b0a1",
            "name": "writer",
            "func": (code / "on_message.js").read_text(),
            "outputs": 0,
            "timeout": 0,
            "noerr": 0,
            "initialize": (code / "on_start.js").read_text(),
            "finalize": (code / "on_stop.js").read_text(),
            "libs": [],
            "wires": [],
        },
    ]
    (user / "flows.json").write_text(json.dumps(flows, indent=1))


# -- machine and report ---------------------------------------------------------------


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
    }


def _status_counters(proc: Proc) -> dict[str, int]:
    """The counters of the gateway's last status line (written=, sampled_out= ...)."""
    for line in reversed(proc.log.read_text().splitlines()):
        if "status:" in line:
            return {k: int(v) for k, v in re.findall(r"\b(\w+)=(\d+)", line)}
    return {}


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


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ratios: dict[str, float | None], key: str) -> str:
    value = ratios.get(f"gateway/{key}")
    return "-" if value is None else f"{value:.2f}x"


def write_report(results: dict[str, Any], latencies: dict[str, list[float]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    systems = results["systems"]
    gw = systems.get("gateway", {}).get("msg_per_s")
    results["ratios"] = {
        f"gateway/{key}": (gw / systems[key]["msg_per_s"])
        if gw and systems.get(key, {}).get("msg_per_s")
        else None
        for key in ("cassandra", "broker", "naive", "nodered")
    }
    plots = plot(results, latencies, out)
    (out / "latest.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "latest.md").write_text("\n".join(markdown(results, plots)) + "\n")


def markdown(results: dict[str, Any], plots: list[str]) -> Iterator[str]:
    m = results.get("machine", {})
    p = results["params"]
    systems = results["systems"]
    yield "# Benchmark results"
    yield ""
    yield (
        f"Run {results['run_id']} started {results['started']}, took "
        f"{results.get('duration_s', 0) / 60:.1f} min: `{results['command']}`"
    )
    yield ""
    yield (
        f"Machine: {m.get('cores')} cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB RAM, "
        f"Linux {m.get('kernel')}; Cassandra {m.get('cassandra')} (1 node, same host), "
        f"{m.get('mosquitto')}, Python {m.get('python')} (gateway and ceiling write through "
        f"{m.get('write_driver')}; the naive bridge uses cassandra-driver "
        f"{m.get('python_driver')}), Node.js {m.get('node')}; gateway at "
        f"{m.get('gateway_commit')}. Load average at start "
        f"{_load(m.get('loadavg_start'))}, at end {_load(m.get('loadavg_end'))} "
        "(other work on the box shows up here)."
    )
    yield ""
    yield (
        f"Load: gateway.simulate fleet, {p['devices']:,} devices, JSON, QoS 1, one backlog of "
        f"{p['count']:,} messages per system (naive bridge: {p['naive_count']:,}; "
        f"Node-RED: {p['nodered_count']:,}), each system in its own tenant and MQTT session."
    )
    yield ""
    yield (
        "| System | Backlog | Sustained msg/s | Stored = published | Latency p50 / p99 / max (ms) "
        "| CPU s / 1k msgs | Peak RSS (MB) |"
    )
    yield "|---|---:|---:|---|---:|---:|---:|"
    for key in SYSTEMS:
        s = systems.get(key)
        label = LABELS[key]
        if s is None:
            yield f"| {label} | skipped | | | | | |"
            continue
        if "msg_per_s" not in s or s.get("msg_per_s") is None:
            yield f"| {label} | {s.get('status', 'not measured')} | | | | | |"
            continue
        if key == "cassandra":
            label += f", best at {s['best_concurrency']} in flight"
        lat = s.get("latency") or {}
        latency = (
            f"{_f(lat.get('p50'), 1)} / {_f(lat.get('p99'), 1)} / {_f(lat.get('max'), 1)}"
            if lat.get("n")
            else "n/a"
        )
        check = s.get("check", {}).get("text", "n/a (no database)")
        if lat.get("check"):
            check += f"; latency run {lat['check']['text']}"
        if s.get("gateway_dropped"):
            check += (
                " (gateway counted "
                + ", ".join(f"{k}={v}" for k, v in s["gateway_dropped"].items())
                + ")"
            )
        status = f" ({s['status']})" if s.get("status") else ""
        yield (
            f"| {label}{status} | {s.get('backlog', 0):,} | {_f(s.get('msg_per_s'))} | {check} "
            f"| {latency} | {_f(s.get('cpu_s_per_1k_msgs'), 2)} | {_f(s.get('peak_rss_mb'))} |"
        )
    yield ""
    r = results.get("ratios", {})
    yield (
        f"Gateway throughput ratios: gateway/Cassandra ceiling {_ratio(r, 'cassandra')}, "
        f"gateway/broker ceiling {_ratio(r, 'broker')}, gateway/naive {_ratio(r, 'naive')}, "
        f"gateway/Node-RED {_ratio(r, 'nodered')}."
    )
    by_rate = systems.get("gateway", {}).get("latency_by_rate") or []
    if by_rate:
        yield ""
        yield (
            "Gateway latency by offered rate (live runs after the drain, same fleet; "
            "publish → write sent, as above):"
        )
        yield ""
        yield "| Offered msg/s | Achieved msg/s | p50 / p99 / max (ms) | Stored |"
        yield "|---:|---:|---:|---|"
        for lat in by_rate:
            yield (
                f"| {lat['offered_msg_per_s']:,.0f} | {lat['achieved_msg_per_s']:,.0f} | "
                f"{lat.get('p50', 0):.1f} / {lat.get('p99', 0):.1f} / {lat.get('max', 0):.1f} | "
                f"{lat.get('check', {}).get('text', '?')} |"
            )
    yield ""
    cas = systems.get("cassandra", {})
    if cas.get("levels"):
        yield "Cassandra ceiling by concurrency (statements in flight):"
        yield ""
        yield "| In flight | msg/s | statements/s | CPU s / 1k msgs | failures | stored |"
        yield "|---:|---:|---:|---:|---:|---|"
        for lv in cas["levels"]:
            yield (
                f"| {lv['concurrency']} | {_f(lv['msg_per_s'])} | {_f(lv['statements_per_s'])} "
                f"| {_f(lv['cpu_s_per_1k_msgs'], 2)} | {lv['failures']} | {lv['check']['text']} |"
            )
        yield ""
    scaling = results.get("scaling")
    if scaling:
        yield "Gateway throughput by fleet size:"
        yield ""
        yield "| Devices | Backlog | msg/s | CPU s / 1k msgs | Peak RSS (MB) | Stored |"
        yield "|---:|---:|---:|---:|---:|---|"
        for row in scaling:
            yield (
                f"| {row['devices']:,} | {row['backlog']:,} | {_f(row['msg_per_s'])} "
                f"| {_f(row['cpu_s_per_1k_msgs'], 2)} | {_f(row['peak_rss_mb'])} | {row['check']} |"
            )
        yield ""
    overload = results.get("overload")
    if overload and overload.get("segments"):
        yield (
            "Gateway under overload (offered load a multiple of its sustained "
            f"{overload['sustained_msg_per_s']:,.0f} msg/s, then drained):"
        )
        yield ""
        yield (
            "| Target | Offered msg/s (achieved) | Publishers | Published | Stored raw "
            "| Sampled out (counted) | Drain after publishing (s) | Peak RSS (MB) |"
        )
        yield "|---|---:|---:|---:|---:|---:|---:|---:|"
        for seg in overload["segments"]:
            yield (
                f"| {seg['factor']:g}x for {seg['seconds']:.0f} s ({_f(seg['target_msg_per_s'])}"
                f" msg/s) | {_f(seg['offered_msg_per_s'])} | {seg['publishers']} "
                f"| {seg['published']:,} | {seg['stored']:,} "
                f"| {seg.get('sampled_out', 0):,}{' ok' if seg['ok'] else ' MISMATCH'} "
                f"| {_f(seg['drain_after_publish_s'], 1)} | {_f(seg['peak_rss_mb'])} |"
            )
        yield ""
        yield (
            "ok: every published message is a stored raw row or was sampled out by the "
            "adaptive sampler (noisy devices, gateway/ingest/sampling.py; their latest state is "
            "still written), and the stored rows equal the gateway's own written count."
        )
        yield ""
    elif overload:
        yield f"Overload: {overload.get('status')}"
        yield ""
    states = results.get("devices_in_state")
    if states:
        buckets = sorted({row["buckets"] for row in states})
        yield (
            "`gateway devices --state S` (gateway.queries.devices_in_state), median of "
            f"{p['state_runs']} runs, ms:"
        )
        yield ""
        yield "| Devices in the state | " + " | ".join(f"{b} bucket(s)" for b in buckets) + " |"
        yield "|---:|" + "---:|" * len(buckets)
        for n in sorted({row["devices"] for row in states}):
            cells = []
            for b in buckets:
                row = next((x for x in states if x["devices"] == n and x["buckets"] == b), None)
                cells.append(
                    "-" if row is None else f"{row['median_ms']:.1f}{'' if row['ok'] else ' (!)'}"
                )
            yield f"| {n:,} | " + " | ".join(cells) + " |"
        yield ""
    for name in plots:
        yield f"![{name}]({name})"
    if plots:
        yield ""
    yield "How it is measured:"
    yield ""
    for note in NOTES:
        yield f"- {note}"
    rtt = results.get("cassandra_write_rtt_ms") or {}
    if rtt.get("p50") is not None:
        yield (
            f"- One Cassandra write's round trip from Python, sequential on the idle cluster "
            f"at setup: p50 {rtt['p50']:.2f} ms, p99 {rtt['p99']:.2f} ms ({rtt['n']} writes)."
        )
    failures = results.get("phase_failures") or {}
    for name, reason in failures.items():
        yield f"- Phase {name} failed: {reason}"
    if results.get("skipped"):
        yield f"- Skipped phases: {', '.join(results['skipped'])}"


def _load(value: Any) -> str:
    return "/".join(f"{x:.2f}" for x in value) if value else "?"


NOTES = [
    "Sustained msg/s: a backlog is published while the system is away (its persistent "
    "session holds it), then the system starts and drains it; the rate is stored rows "
    "over the span between the first and the last WRITETIME of the telemetry rows (the "
    "broker ceiling: first to last message received; the Cassandra ceiling: its own clock "
    "around the writes).",
    "Stored = published: the run's telemetry rows are read back through "
    "telemetry_partitions and matched to the published (device, ts); the latest tables "
    "must hold each device's newest event, in exactly one state partition.",
    "Latency: a second, live run at half the sustained rate; latency = WRITETIME of the "
    "telemetry row - sent_at in the payload. The drivers stamp writes client-side when "
    "they send them, so this is publish → write sent to Cassandra; the write's round trip "
    "is not included (see the measured round trip below). Broker ceiling: publish → "
    "received by the subscriber.",
    "CPU and RSS: utime+stime and VmHWM of the process under test from /proc. CPU per "
    "1k messages is its CPU at the end of the drain minus its start-up CPU (measured on a "
    "separate start with an empty session), over the messages drained. The Cassandra "
    "ceiling measures its own write loop; its RSS includes the pre-decoded events it holds.",
    "Node-RED's MQTT client acknowledges QoS 1 messages on receipt, before the function "
    "node writes them (a crash loses them); the naive bridge and the gateway acknowledge "
    "after the write. The naive bridge and Node-RED write the same rows (same tables, "
    "keys and write timestamps) but without the gateway's validation, batching and "
    "coalescing; Node-RED's function node caps itself at 128 messages in flight.",
    "The Cassandra ceiling sends one statement per row; the gateway batches rows of one "
    "partition and skips latest-table writes that a newer event of the same device in the "
    "same chunk supersedes, so it can come out above this 'ceiling'.",
    "Every system, the broker, Cassandra and the publisher share the same cores, so "
    "figures are lower than on a dedicated box and vary with other load.",
]


def plot(results: dict[str, Any], latencies: dict[str, list[float]], out: Path) -> list[str]:
    if plt is None:
        results["notes"].append("matplotlib not installed: no plots")
        return []
    made = []
    scaling = [r for r in results.get("scaling", []) if r.get("msg_per_s")]
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["devices"] for r in scaling]
        ax.plot(xs, [r["msg_per_s"] for r in scaling], "o-", label="gateway")
        ceiling = results["systems"].get("cassandra", {}).get("msg_per_s")
        if ceiling:
            ax.axhline(ceiling, ls="--", color="grey", label="Cassandra ceiling (1k devices)")
        ax.set_xscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel("sustained messages/s")
        top = max([r["msg_per_s"] for r in scaling] + [ceiling or 0])
        ax.set_ylim(0, top * 1.2)
        ax.set_title("Gateway throughput vs fleet size")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_devices.png", dpi=100)
        plt.close(fig)
        made.append("throughput_vs_devices.png")
    if latencies:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in SYSTEMS:
            values = sorted(v for v in latencies.get(key, []) if v > 0)
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, ys, label=PLOT_LABELS[key])
        ax.set_xscale("log")
        ax.set_xlabel("publish → stored latency (ms)")
        ax.set_ylabel("fraction of messages")
        ax.set_title("Latency CDF at half the sustained rate")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "latency_cdf.png", dpi=100)
        plt.close(fig)
        made.append("latency_cdf.png")
    return made


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
    parser.add_argument("--latency-seconds", type=float, default=10.0)
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
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="GATEWAY_X__Y=V",
        help="extra gateway setting (repeatable); the default run uses none",
    )
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
    bench = Bench(args)
    try:
        bench.run()
    except (Stopped, KeyboardInterrupt):
        print("bench: stopped; processes and MQTT sessions cleaned up", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
