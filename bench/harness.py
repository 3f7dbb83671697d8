"""What every phase of bench/run.py shares: one :class:`Bench` per run.

It holds the run's id (tenants and MQTT client ids carry it), the processes
and sessions to clean up, the harness's Cassandra session (:class:`BenchDb`,
opened by phases/setup.py), the results being collected and the progress
line. The phases (bench/systems/, bench/phases/) are functions of a Bench.
"""

from __future__ import annotations

import argparse
import signal
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchlib import (
    BENCH,
    BenchDb,
    Check,
    Proc,
    Sent,
    clear_session,
    fleet_spec,
    publish_recorded,
    settle_cassandra,
)

RESULTS = BENCH / "results"
LOGS = BENCH / ".logs"
SYSTEMS = ("broker", "cassandra", "naive", "nodered", "gateway")


class Stopped(Exception):
    """SIGTERM/SIGINT: clean up and leave."""


# -- progress ---------------------------------------------------------------------


class Progress:
    """One line per step: phase, elapsed, ETA (phase estimates scaled by how
    the finished phases compared with theirs)."""

    def __init__(self, phases: Sequence[str], estimates: Mapping[str, float]) -> None:
        self.phases = list(phases)
        self.estimates = estimates
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
                est = self.estimates[name] * scale
                left += max(est - (time.monotonic() - self.phase_start), 0.0)
            elif seen or self.current is None:
                left += self.estimates[name] * scale
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
        self.done_est += self.estimates[self.current]
        self.done_real += real
        self.say(f"done in {real:.0f} s")
        self.phases.remove(self.current)
        self.current = None


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
    """One run: its id, its processes and sessions, its results."""

    def __init__(self, args: argparse.Namespace, estimates: Mapping[str, float]) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:6]
        self.progress = Progress([p for p in estimates if p not in args.skip], estimates)
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

    def settle(self, key: str) -> None:
        """Let Cassandra finish what earlier phases left it (compactions)
        before ``key``'s drain, so that no system pays for another's rows;
        what it waited is in the report (``settled``)."""
        waited, cores = settle_cassandra()
        self.results.setdefault("settled", {})[key] = {"waited_s": waited, "cores": cores}
        if cores is not None:
            self.say(f"Cassandra settled in {waited:.0f} s (last {cores:.2f} cores)")

    def publish_backlog(self, tenant: str, devices: int, count: int) -> list[Sent]:
        self.cdb.register_states([tenant])
        stats, sent = publish_recorded(fleet_spec(tenant, devices), count=count)
        self.say(f"published a backlog of {stats.sent} messages at {stats.rate:.0f} msg/s")
        return sent

    def stop(self, proc: Proc) -> None:
        code = proc.stop()
        if code not in (0, None, -signal.SIGTERM):
            self.say(f"{proc.name} exited with {code}")

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
