"""The read API under load, as integrators and the page use it (`bench/read_api.py`).

Issue 12, "Performance": API latency with 20 concurrent clients at 1k, 10k and
100k devices in one state; goals: the first page (100 devices) p99 <= 50 ms at
100k, the per-state counts <= 1 s at 100k.

Data (written directly, not through MQTT: the ingest path is measured by
``make bench``). In the ``bench_api`` keyspace (``gateway schema apply`` with
``GATEWAY_CASSANDRA__KEYSPACE=bench_api``), one tenant per size N
(``api-1k``, ``api-10k``, ``api-100k``): N devices in state "on"
(``dev-000000`` ...), then 300 in "off" and 200 in "alarm", each with tags
``{"floor": "0".."9", "room": "0".."39"}`` (seeded, uniform). Rows go to
``latest_events_by_state`` (generation 0, bucket 0: the default
``state_buckets`` 1, value as JSON text, tags a map, ``USING TIMESTAMP`` = event
time in µs, as gateway/store/latest.py writes them), ``latest_events_by_device``
and ``tenant_states``, with prepared statements through cassandra-driver's
``execute_concurrent_with_args``. The tables are truncated first; then
``nodetool flush`` and a wait for compactions, so reads come from SSTables.

Server: the real read side, ``gateway serve`` as a subprocess (its log in a
temporary directory), with one ``gateway token add --tenant T`` token per tenant
and one ``--admin`` token.

Load: --clients (20) aiohttp clients in one process (uvloop), closed loop (each
sends its next request when the last answer is read), --seconds (15) per case
after a 1 s warm-up that is not counted; a fresh connection pool per case.
Latency is from sending the request to having read the whole body, per request:
p50 / p99 / max, requests/s, errors by kind. Every answer is checked against the
data written (status 200, the exact page: number of devices, first and last
device id); a wrong answer or an error stops the run (--keep-going to go on).

Cases per size:

* ``first page, cached``: every client asks the same URL
  ``/states/on/devices?limit=100``; the server answers from its 0.5 s cache,
  recomputing about twice a second (concurrent misses share one read);
* ``first page, uncached``: the same URL plus ``&nocache=<n>``, n unique per
  request. The server ignores unknown parameters and keys its cache by path
  and query, so every request reads Cassandra with exactly the first page's
  CQL (``devices_page``): the cost of the first page when nothing is cached,
  as distinct integrators' queries would see it. Also with 1 client, for
  the unloaded service time;
* ``prefix search, uncached``: ``prefix=dev-NNNN`` (100 devices each), a
  different prefix per request (and ``nocache``): the page's id search, a
  clustering range that starts inside the partition;
* ``deep page, uncached``: cursors followed from the first page to the
  middle of the state (the walk timed, every page checked), then the middle
  page's URL with ``nocache``;
* ``tag filter, uncached``: ``tag=floor:3`` (10% of the devices: the server
  reads about 1,000 rows to fill a page of 100) with ``nocache``;
* ``state counts, under load``: ``/states`` by every client (cached 1 s, 10 s
  when counting took over 200 ms: requests that find it expired wait for one
  shared recount);
* ``state counts, cold``: one client, idle server, --cold-samples requests,
  each after waiting ``cached_for_s`` + 0.3 s so the count is recomputed
  (checked: ``as_of`` changes).

Noise: before starting, waits (polling every 30 s, at most --wait-max s) until
no process matches --wait-for (default ``bench/rare_state.py``); records the
busiest other processes and the load average at start and end, and per case the
CPU time of the server, of Cassandra, of this process and of everything else
(from /proc/stat).

Writes bench/results/read_api.json and read_api.md.
Usage: .venv/bin/python bench/read_api.py [--sizes 1000,10000,100000] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from cassandra.concurrent import execute_concurrent_with_args
from cassandra.query import UNSET_VALUE

import cassandra
from gateway.config import CassandraConfig
from gateway.identity import device_hash
from gateway.store.database import build_cluster
from gateway.store.latest import state_value

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GATEWAY = Path(sys.executable).parent / "gateway"
KEYSPACE = "bench_api"
OFF, ALARM = 300, 200
FLOORS, ROOMS = 10, 40
PAGE = 100
TAG = ("floor", "3")
SEED = 12
WARMUP = 1.0
BUSY_OTHER = 0.2  # cores used by other processes that mark a case as noisy
COUNTER = itertools.count()


def say(text: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {text}", flush=True)


def label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


# -- the data -------------------------------------------------------------------


@dataclass
class Fleet:
    size: int
    tenant: str
    on: list[str]
    off: list[str]
    alarm: list[str]
    tags: dict[str, dict[str, str]]

    @property
    def tagged(self) -> list[str]:
        return [d for d in self.on if self.tags[d][TAG[0]] == TAG[1]]


def make_fleet(size: int) -> Fleet:
    rng = random.Random(SEED * 1_000_003 + size)
    ids = [f"dev-{i:06d}" for i in range(size + OFF + ALARM)]
    tags = {
        d: {"floor": str(rng.randrange(FLOORS)), "room": str(rng.randrange(ROOMS))} for d in ids
    }
    return Fleet(
        size, f"api-{label(size)}", ids[:size], ids[size : size + OFF], ids[size + OFF :], tags
    )


def load(fleets: list[Fleet], concurrency: int) -> dict[str, Any]:
    """Truncate the tables and write every fleet's rows; flush; wait for compactions."""
    cluster = build_cluster(CassandraConfig(keyspace=KEYSPACE))
    session = cluster.connect(KEYSPACE)
    out: dict[str, Any] = {}
    try:
        for table in ("latest_events_by_state", "latest_events_by_device", "tenant_states"):
            session.execute(f"TRUNCATE {table}", timeout=120)
        session.execute("TRUNCATE state_partitions", timeout=120)
        by_state = session.prepare(
            "INSERT INTO latest_events_by_state "
            "(tenant, state, bucket, gen, device_hash, device_id, ts, value, tags) "
            "VALUES (?, ?, 0, 0, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
        )
        by_device = session.prepare(
            "INSERT INTO latest_events_by_device "
            "(tenant, device_id, state, ts, value, value_num, metrics, tags) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
        )
        states = session.prepare(
            "INSERT INTO tenant_states (tenant, state, registered_at) VALUES (?, ?, ?)"
        )
        now_ms = int(time.time() * 1000)
        for fleet in fleets:
            rng = random.Random(SEED + fleet.size)
            state_rows: list[tuple[Any, ...]] = []
            device_rows: list[tuple[Any, ...]] = []
            for state, devices in (("on", fleet.on), ("off", fleet.off), ("alarm", fleet.alarm)):
                for d in devices:
                    ts = now_ms - rng.randrange(86_400_000)
                    temp = round(rng.uniform(18.0, 26.0), 1)
                    tags = fleet.tags[d]
                    state_rows.append(
                        (
                            fleet.tenant,
                            state,
                            device_hash(d),
                            d,
                            ts,
                            state_value(None, temp),
                            tags,
                            ts * 1000,
                        )
                    )
                    device_rows.append(
                        (fleet.tenant, d, state, ts, UNSET_VALUE, temp, {}, tags, ts * 1000)
                    )
            started = time.monotonic()
            _write(session, states, [(fleet.tenant, s, now_ms) for s in ("on", "off", "alarm")], 8)
            _write(session, by_state, state_rows, concurrency)
            _write(session, by_device, device_rows, concurrency)
            took = time.monotonic() - started
            rows = len(state_rows) + len(device_rows) + 3
            out[fleet.tenant] = {"rows": rows, "seconds": round(took, 1), "rows_per_s": rows / took}
            say(f"  {fleet.tenant}: {rows:,} rows in {took:.1f} s ({rows / took:,.0f}/s)")
    finally:
        cluster.shutdown()
    started = time.monotonic()
    out["flush"] = nodetool("flush", KEYSPACE)
    out["compactions_wait_s"] = wait_compactions()
    out["flush_and_compaction_s"] = round(time.monotonic() - started, 1)
    return out


def _write(session: Any, stmt: Any, rows: list[tuple[Any, ...]], concurrency: int) -> None:
    for ok, result in execute_concurrent_with_args(
        session, stmt, rows, concurrency=concurrency, raise_on_first_error=False
    ):
        if not ok:
            raise RuntimeError(f"write failed: {result!r}")


def nodetool(*args: str) -> str:
    script = ROOT / "cassandra" / "cassandra.sh"
    try:
        done = subprocess.run(
            ["bash", str(script), "nodetool", *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        return f"failed: {exc} {detail}"[:300]
    return done.stdout


def wait_compactions(limit: float = 120.0) -> float | None:
    """Seconds until `nodetool compactionstats` shows nothing pending (None: gave up)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        text = nodetool("compactionstats")
        if text.startswith("failed"):
            return None
        pending = [ln for ln in text.splitlines() if ln.lower().startswith("pending tasks")]
        idle = pending and pending[0].replace(":", " ").split()[2] == "0"
        if idle and KEYSPACE not in text:  # active compactions list their keyspace
            return round(time.monotonic() - started, 1)
        time.sleep(3)
    return None


# -- processes and noise ----------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat)."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def busy_processes(interval: float = 3.0, above: float = 3.0) -> list[dict[str, Any]]:
    """Processes using more than ``above`` % of a core over ``interval`` s (not this one)."""

    def snap() -> dict[int, float]:
        out = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                out[int(entry.name)] = cpu_seconds(int(entry.name))
        return out

    first = snap()
    time.sleep(interval)
    second = snap()
    found = []
    for pid, cpu in second.items():
        pct = 100 * (cpu - first.get(pid, cpu)) / interval
        cmd = _cmdline(pid)
        if pct >= above and pid != os.getpid() and cmd:
            if "CassandraDaemon" in cmd:
                cmd = "java ... CassandraDaemon (Cassandra)"
            found.append({"pid": pid, "cpu_pct": round(pct), "cmd": cmd[:140]})
    return sorted(found, key=lambda p: -p["cpu_pct"])


def pgrep(pattern: str) -> list[str]:
    done = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, check=False)
    return [ln for ln in done.stdout.splitlines() if ln and int(ln.split()[0]) != os.getpid()]


def wait_for_quiet(patterns: list[str], every: float, limit: float) -> dict[str, Any]:
    started = time.monotonic()
    seen: list[str] = []
    while True:
        running = [ln for p in patterns for ln in pgrep(p)]
        if not running:
            waited = time.monotonic() - started
            if seen:
                say(f"no other benchmark running any more (waited {waited:.0f} s)")
            return {"patterns": patterns, "waited_s": round(waited), "was_running": seen}
        if time.monotonic() - started >= limit:
            say(f"still running after {limit:.0f} s, measuring anyway: {running}")
            return {
                "patterns": patterns,
                "waited_s": round(time.monotonic() - started),
                "was_running": seen,
                "still_running": running,
            }
        for ln in running:
            if ln not in seen:
                seen.append(ln)
        say(f"waiting for another benchmark to finish: {'; '.join(running)}")
        time.sleep(every)


def cassandra_pid() -> int | None:
    found = pgrep("CassandraDaemon")
    return int(found[0].split()[0]) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway_env(port: int, tokens: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE,
        "GATEWAY_API__PORT": str(port),
        "GATEWAY_API__TOKENS_FILE": str(tokens),
    }
    return env


def add_token(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(GATEWAY), "token", "add", *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return done.stdout.strip().splitlines()[-1]


# -- the load ---------------------------------------------------------------------


@dataclass
class Expect:
    count: int  # devices on the page
    first: str | None
    last: str | None


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wrong: int = 0
    samples: list[str] = field(default_factory=list)  # first few errors, verbatim
    sizes: Counter[int] = field(default_factory=Counter)
    answered: int = 0  # answers during the warm-up too (the CPU figures cover it)

    def note(self, text: str) -> None:
        if len(self.samples) < 5:
            self.samples.append(text[:400])


URLFn = Callable[[int], tuple[str, Expect | None]]
Check = Callable[[dict[str, Any]], str | None]


def check_page(expect: Expect, body: dict[str, Any]) -> str | None:
    devices = body.get("devices")
    if not isinstance(devices, list):
        return f"no devices list: {str(body)[:200]}"
    ids = [d.get("device_id") for d in devices]
    got = Expect(len(ids), ids[0] if ids else None, ids[-1] if ids else None)
    if got != expect:
        return f"page {got} != expected {expect}"
    return None


async def hammer(
    base: str,
    token: str,
    url_for: URLFn,
    clients: int,
    seconds: float,
    check: Check | None = None,
) -> Tally:
    """``clients`` closed-loop clients for ``seconds`` (after WARMUP s not counted).
    ``url_for(n)`` gets a number unique across the whole run."""
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(
        base, connector=connector, timeout=timeout, headers=headers
    ) as http:
        loop = asyncio.get_running_loop()
        start = loop.time() + WARMUP
        end = start + seconds

        async def client() -> None:
            while True:
                now = loop.time()
                if now >= end:
                    return
                counted = now >= start
                url, expect = url_for(next(COUNTER))
                t0 = time.perf_counter()
                try:
                    async with http.get(url) as response:
                        data = await response.read()
                        status = response.status
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    if counted:
                        tally.errors[type(exc).__name__] += 1
                        tally.note(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                took = time.perf_counter() - t0
                tally.answered += 1
                if not counted:
                    continue
                tally.latencies.append(took)
                if status != 200:
                    tally.errors[f"HTTP {status}"] += 1
                    tally.note(f"{url}: HTTP {status}: {data[:300]!r}")
                    continue
                body = orjson.loads(data)
                problem = None
                if expect is not None:
                    tally.sizes[len(body.get("devices", []))] += 1
                    problem = check_page(expect, body)
                elif check is not None:
                    problem = check(body)
                if problem:
                    tally.wrong += 1
                    tally.note(f"{url}: {problem}")

        await asyncio.gather(*(client() for _ in range(clients)))
    return tally


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    rank = max(1, int(-(-q * len(sorted_values) // 1)))  # nearest rank
    return sorted_values[min(rank, len(sorted_values)) - 1]


def summarize(tally: Tally, seconds: float) -> dict[str, Any]:
    ms = sorted(x * 1000 for x in tally.latencies)
    return {
        "requests": len(ms),
        "requests_per_s": round(len(ms) / seconds, 1),
        "p50_ms": round(pct(ms, 0.50), 2),
        "p99_ms": round(pct(ms, 0.99), 2),
        "max_ms": round(ms[-1], 2) if ms else None,
        "mean_ms": round(sum(ms) / len(ms), 2) if ms else None,
        "errors": dict(tally.errors),
        "wrong_answers": tally.wrong,
        "devices_per_page": {str(k): v for k, v in sorted(tally.sizes.items())},
        "error_samples": tally.samples,
    }


class Stop(Exception):
    pass


@dataclass
class Bench:
    args: argparse.Namespace
    base: str
    tokens: dict[str, str]
    server_pid: int
    cassandra: int | None
    cases: list[dict[str, Any]] = field(default_factory=list)
    walks: dict[str, Any] = field(default_factory=dict)
    cold: dict[str, Any] = field(default_factory=dict)

    deadline: float = 0.0  # time.monotonic(): no more waiting for other benchmarks after
    waits: list[dict[str, Any]] = field(default_factory=list)

    def others(self) -> list[str]:
        """Processes matching --wait-for now (another benchmark)."""
        return [ln for p in self.args.wait_for for ln in pgrep(p)]

    def quiet(self) -> None:
        """Wait (within the --wait-max budget) until no other benchmark runs."""
        left = self.deadline - time.monotonic()
        if left > 0 and self.others():
            self.waits.append(wait_for_quiet(self.args.wait_for, 30.0, left))

    async def case(
        self,
        fleet: Fleet,
        name: str,
        cache: str,
        shown: str,
        url_for: URLFn,
        *,
        clients: int | None = None,
        seconds: float | None = None,
        check: Check | None = None,
    ) -> dict[str, Any]:
        clients = clients or self.args.clients
        seconds = seconds or self.args.seconds
        for attempt in (1, 2):
            self.quiet()
            say(f"{fleet.tenant}: {name} ({cache}), {clients} clients, {seconds:.0f} s ...")
            others = self.others()
            cpu0 = self._cpu()
            tally = await hammer(
                self.base, self.tokens[fleet.tenant], url_for, clients, seconds, check
            )
            cpu1 = self._cpu()
            others += [p for p in self.others() if p not in others]
            if not others:
                break
            say(f"  ! another benchmark ran during this case: {others}")
            if attempt == 1 and time.monotonic() < self.deadline:
                say("  measuring this case again once it is gone")
                continue
        result = summarize(tally, seconds)
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
        wall = seconds + WARMUP
        other = cpu["machine"] - cpu["server"] - cpu["cassandra"] - cpu["client"]
        row = {
            "devices": fleet.size,
            "tenant": fleet.tenant,
            "case": name,
            "cache": cache,
            "url": shown,
            "clients": clients,
            "seconds": seconds,
            **result,
            "cpu_cores": {
                "server": round(cpu["server"] / wall, 2),
                "cassandra": round(cpu["cassandra"] / wall, 2),
                "client": round(cpu["client"] / wall, 2),
                "other": round(max(0.0, other) / wall, 2),
            },
            # server CPU over every answer of the case, warm-up included
            "server_cpu_ms_per_request": round(1000 * cpu["server"] / tally.answered, 3)
            if tally.answered
            else None,
            "other_benchmarks": others,
        }
        self.cases.append(row)
        c = row["cpu_cores"]
        say(
            f"  {result['requests_per_s']:,.0f} req/s, p50 {result['p50_ms']} ms, "
            f"p99 {result['p99_ms']} ms, max {result['max_ms']} ms, errors "
            f"{result['errors'] or 0}, wrong {result['wrong_answers']}, pages "
            f"{result['devices_per_page']}; cores: server {c['server']}, cassandra "
            f"{c['cassandra']}, client {c['client']}, other {c['other']}"
        )
        if (result["errors"] or result["wrong_answers"]) and not self.args.keep_going:
            for sample in result["error_samples"]:
                say(f"  ! {sample}")
            raise Stop(
                f"{fleet.tenant} {name}: errors {result['errors']}, wrong answers "
                f"{result['wrong_answers']}: {result['error_samples']}"
            )
        return row

    def _cpu(self) -> dict[str, float]:
        return {
            "server": cpu_seconds(self.server_pid),
            "cassandra": cpu_seconds(self.cassandra) if self.cassandra else 0.0,
            "client": cpu_seconds(os.getpid()),
            "machine": machine_busy(),
        }

    def session(self, fleet: Fleet | None) -> aiohttp.ClientSession:
        token = self.tokens[fleet.tenant] if fleet else self.tokens["admin"]
        return aiohttp.ClientSession(self.base, headers={"Authorization": f"Bearer {token}"})

    async def get(
        self, fleet: Fleet | None, path: str, http: aiohttp.ClientSession | None = None
    ) -> tuple[int, Any, float]:
        """One request; on a new connection unless ``http`` is given."""
        if http is None:
            async with self.session(fleet) as fresh:
                return await self.get(fleet, path, fresh)
        t0 = time.perf_counter()
        async with http.get(path) as response:
            data = await response.read()
        took = time.perf_counter() - t0
        return response.status, orjson.loads(data) if data else None, took

    # -- per size --------------------------------------------------------------

    async def run_size(self, fleet: Fleet) -> None:
        t = fleet.tenant
        on = fleet.on
        first = Expect(PAGE, on[0], on[PAGE - 1])
        devices = f"/api/v1/tenants/{t}/states/on/devices?limit={PAGE}"

        status, body, _ = await self.get(fleet, devices)
        if status != 200 or check_page(first, body):
            raise Stop(f"{t}: first page wrong before load: HTTP {status} {str(body)[:300]}")

        await self.case(fleet, "first page", "cached", devices, lambda n: (devices, first))
        await self.case(
            fleet,
            "first page",
            "uncached",
            devices + "&nocache=<n>",
            lambda n: (f"{devices}&nocache={n}", first),
        )
        await self.case(
            fleet,
            "first page",
            "uncached",
            devices + "&nocache=<n>",
            lambda n: (f"{devices}&nocache={n}", first),
            clients=1,
            seconds=self.args.single_seconds,
        )

        prefixes = [f"dev-{i:04d}" for i in range(fleet.size // PAGE)]
        rng = random.Random(SEED)
        rng.shuffle(prefixes)

        def by_prefix(n: int) -> tuple[str, Expect]:
            p = prefixes[n % len(prefixes)]
            return f"{devices}&prefix={p}&nocache={n}", Expect(PAGE, f"{p}00", f"{p}99")

        await self.case(
            fleet,
            "prefix search",
            "uncached",
            devices + f"&prefix=dev-NNNN&nocache=<n> ({len(prefixes)} prefixes, 100 devices each)",
            by_prefix,
        )

        cursor, offset = await self.walk(fleet, devices)
        deep = Expect(PAGE, on[offset], on[offset + PAGE - 1])
        await self.case(
            fleet,
            "deep page",
            "uncached",
            devices + f"&cursor=<page {offset // PAGE + 1}>&nocache=<n>",
            lambda n: (f"{devices}&cursor={cursor}&nocache={n}", deep),
        )

        tagged = fleet.tagged[:PAGE]
        tag_expect = Expect(len(tagged), tagged[0], tagged[-1])
        tag_url = f"{devices}&tag={TAG[0]}:{TAG[1]}"
        await self.case(
            fleet,
            "tag filter",
            "uncached",
            tag_url + f"&nocache=<n> ({len(fleet.tagged):,} of {fleet.size:,} match)",
            lambda n: (f"{tag_url}&nocache={n}", tag_expect),
        )

        states = f"/api/v1/tenants/{t}/states"
        want = [
            {"state": "on", "devices": fleet.size},
            {"state": "off", "devices": OFF},
            {"state": "alarm", "devices": ALARM},
        ]

        def check_counts(body: dict[str, Any]) -> str | None:
            if body.get("states") != want:
                return f"counts {body.get('states')} != {want}"
            return None

        await self.case(
            fleet,
            "state counts",
            "cached (1 s, or 10 s when counting took > 200 ms)",
            states,
            lambda n: (states, None),
            check=check_counts,
        )
        await self.cold_counts(fleet, states, check_counts)

    async def walk(self, fleet: Fleet, devices: str) -> tuple[str, int]:
        """Follow cursors to the middle; every page checked. Returns the middle
        page's cursor and the offset of its first device."""
        pages = max(1, fleet.size // 2 // PAGE)
        self.quiet()
        say(f"{fleet.tenant}: following cursors through {pages} pages to the middle ...")
        cursor = ""  # none yet: the first page
        t0 = time.perf_counter()
        times = []
        http = self.session(fleet)
        for page in range(pages):
            url = devices + (f"&cursor={cursor}" if cursor else "")
            status, body, took = await self.get(fleet, url, http)
            times.append(took * 1000)
            at = page * PAGE
            expect = Expect(PAGE, fleet.on[at], fleet.on[at + PAGE - 1])
            problem = check_page(expect, body) if status == 200 else f"HTTP {status} {body}"
            if problem:
                raise Stop(f"{fleet.tenant}: page {page + 1} while following cursors: {problem}")
            cursor = body["next_cursor"]
            if not cursor:
                raise Stop(f"{fleet.tenant}: no next_cursor after page {page + 1}")
        took = time.perf_counter() - t0
        await http.close()
        times.sort()
        self.walks[fleet.tenant] = {
            "devices": fleet.size,
            "pages": pages,
            "seconds": round(took, 2),
            "ms_per_page_p50": round(pct(times, 0.5), 2),
            "ms_per_page_max": round(times[-1], 2),
        }
        say(f"  {pages} pages in {took:.2f} s, all as expected")
        return cursor, pages * PAGE

    async def cold_counts(self, fleet: Fleet, path: str, check: Check) -> None:
        self.quiet()
        others = self.others()
        say(f"{fleet.tenant}: state counts, cold ({self.args.cold_samples} samples) ...")
        samples: list[float] = []
        cached: list[float] = []
        kept: list[float] = []
        status, body, _ = await self.get(fleet, path)
        as_of = body.get("as_of") if status == 200 else None
        while len(samples) < self.args.cold_samples:
            keep = float(body.get("cached_for_s", 1.0)) if status == 200 else 1.0
            await asyncio.sleep(keep + 0.3)
            status, body, took = await self.get(fleet, path)
            if status != 200 or check(body):
                raise Stop(f"{fleet.tenant}: counts: HTTP {status} {str(body)[:300]}")
            if body["as_of"] == as_of:
                continue  # not recomputed (should not happen after cached_for_s)
            as_of = body["as_of"]
            samples.append(took * 1000)
            kept.append(float(body["cached_for_s"]))
            _, again, took2 = await self.get(fleet, path)  # right after: from the cache
            if again.get("as_of") == as_of:
                cached.append(took2 * 1000)
        self.cold[fleet.tenant] = {
            "devices": fleet.size,
            "cold_ms": [round(x, 1) for x in samples],
            "cold_p50_ms": round(sorted(samples)[len(samples) // 2], 1),
            "cold_max_ms": round(max(samples), 1),
            "cached_ms": [round(x, 2) for x in cached],
            "cached_for_s": sorted(set(kept)),
            "states": body["states"],
            "other_benchmarks": others + [p for p in self.others() if p not in others],
        }
        say(
            f"  cold: {', '.join(f'{x:.0f}' for x in samples)} ms; right after, cached: "
            f"{', '.join(f'{x:.1f}' for x in cached)} ms; cached_for_s {sorted(set(kept))}"
        )


# -- reporting ------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = 0.0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal"):
            mem = int(line.split()[1]) / 1024 / 1024
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "ram_gib": round(mem, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "cassandra_driver": cassandra.__version__,
    }


def git_head() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "gateway"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    return done.stdout.strip() + (" (gateway/ modified)" if dirty.stdout.strip() else "")


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    run = report["run"]
    m = run["machine"]
    noise_ = run["noise"]
    waited = noise_["wait"]["waited_s"] + sum(w["waited_s"] for w in noise_["waits_during_run"])
    lines = [
        "# Read API under load (`bench/read_api.py`)",
        "",
        f"Run {run['started']} UTC, {run['minutes']} min ({waited / 60:.1f} of them waiting "
        f"for other benchmarks to finish): `{run['command']}`, gateway at {run['git']}.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['ram_gib']} GiB RAM, Linux "
        f"{m['kernel']}; Cassandra {run['cassandra_version']} (1 node, same host); Python "
        f"{m['python']}, aiohttp {m['aiohttp']}, cassandra-driver {m['cassandra_driver']}. "
        "Server (`gateway serve`), Cassandra and the load generator share the 2 cores.",
        "",
        "**Data written directly** into `latest_events_by_state` (gen 0, as the gateway "
        "writes it), `latest_events_by_device` and `tenant_states` with concurrent prepared "
        "inserts, then flushed: the ingest path is measured elsewhere (`make bench`). "
        f'One tenant per size: N devices in "on", {OFF} in "off", {ALARM} in "alarm"; '
        f'tags `{{"floor": "0".."{FLOORS - 1}", "room": "0".."{ROOMS - 1}"}}`; '
        "`state_buckets` 1 (the default): the 100k state is one partition.",
        "",
        f"Load: {run['clients']} concurrent aiohttp clients, closed loop (each sends its next "
        f"request when the last answer is read), {run['seconds']:.0f} s per case after a 1 s "
        "warm-up; latency from sending the request to the last byte of the answer; every "
        "answer checked against the data (status, number of devices, first and last id).",
        "",
        "## Goals (issue 12)",
        "",
    ]
    for goal in report["goals"]:
        lines.append(f"- {goal}")
    lines += ["", "## Reading the numbers", "", *findings(report["cases"]), "", "## Latency"]
    lines += [
        "",
        "| devices | case | cache | clients | req/s | p50 ms | p99 ms | max ms | errors | "
        "devices/page | server CPU ms/req | cores: server / Cassandra / client / other |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for c in report["cases"]:
        errors = sum(c["errors"].values()) + c["wrong_answers"]
        pages = ", ".join(f"{k} ({v:,})" for k, v in c["devices_per_page"].items()) or "-"
        cores = c["cpu_cores"]
        mark = " †" if c.get("other_benchmarks") else ""
        mark += " ‡" if c["cpu_cores"]["other"] >= BUSY_OTHER else ""
        lines.append(
            f"| {c['devices']:,} | {c['case']}{mark} | {c['cache'].split(' (')[0]} | "
            f"{c['clients']} | "
            f"{c['requests_per_s']:,.0f} | {fmt(c['p50_ms'])} | {fmt(c['p99_ms'])} | "
            f"{fmt(c['max_ms'])} | {errors} | {pages} | {fmt(c['server_cpu_ms_per_request'], 2)} "
            f"| {cores['server']} / {cores['cassandra']} / {cores['client']} / {cores['other']} |"
        )
    if any(c.get("other_benchmarks") for c in report["cases"]):
        lines += ["", "† another benchmark (--wait-for) was running during this case."]
    if any(c["cpu_cores"]["other"] >= BUSY_OTHER for c in report["cases"]):
        lines += [
            "",
            f"‡ other processes used ≥ {BUSY_OTHER} of a core during this case (`other`).",
        ]
    lines += ["", "URLs (under `/api/v1/tenants/<tenant>/states/on/devices`):", ""]
    seen = set()
    for c in report["cases"]:
        key = (c["case"], c["cache"])
        if key in seen or c["devices"] != report["cases"][-1]["devices"]:
            continue
        seen.add(key)
        url, _, note = c["url"].partition(" (")
        lines.append(f"- {c['case']}, {c['cache']}: `{url}`" + (f" ({note}" if note else ""))
    lines += [
        "",
        "## State counts, uncached (one request, idle server)",
        "",
        "| devices | cold ms (each sample) | cold p50 / max ms | right after, cached ms | "
        "cached_for_s |",
        "|---:|---|---:|---|---|",
    ]
    for c in report["counts_cold"].values():
        lines.append(
            f"| {c['devices']:,} | {', '.join(f'{x:,.0f}' for x in c['cold_ms'])} | "
            f"{c['cold_p50_ms']:,.0f} / {c['cold_max_ms']:,.0f} | "
            f"{', '.join(f'{x:.1f}' for x in c['cached_ms'])} | "
            f"{', '.join(str(x) for x in c['cached_for_s'])} |"
        )
    lines += [
        "",
        "## Following cursors to the middle (one client, sequential, every page checked)",
        "",
        "| devices | pages | seconds | ms per page p50 / max |",
        "|---:|---:|---:|---:|",
    ]
    for w in report["deep_walk"].values():
        lines.append(
            f"| {w['devices']:,} | {w['pages']:,} | {w['seconds']} | "
            f"{w['ms_per_page_p50']} / {w['ms_per_page_max']} |"
        )
    load_rows = {k: v for k, v in report["load"].items() if isinstance(v, dict)}
    lines += ["", "## Data load (not the ingest path)", ""]
    for tenant, v in load_rows.items():
        lines.append(
            f"- {tenant}: {v['rows']:,} rows in {v['seconds']} s ({v['rows_per_s']:,.0f}/s)"
        )
    if "flush_and_compaction_s" in report["load"]:
        lines.append(
            "- `nodetool flush` and compactions settled: "
            f"{report['load']['flush_and_compaction_s']} s"
        )
    noise = run["noise"]
    lines += [
        "",
        "## Noise",
        "",
        f"- Other benchmarks: waited {noise['wait']['waited_s']} s for "
        f"`{', '.join(noise['wait']['patterns'])}`"
        + (
            f" (was running: {'; '.join(noise['wait']['was_running'])})"
            if noise["wait"]["was_running"]
            else " (none was running)"
        )
        + (
            f"; still running: {noise['wait']['still_running']}"
            if noise["wait"].get("still_running")
            else ""
        ),
        "- Waits between cases for another benchmark: "
        + (
            "; ".join(
                f"{w['waited_s']} s for {', '.join(w['was_running'])}"
                for w in noise["waits_during_run"]
            )
            or "none"
        )
        + ".",
        f"- Load average at start {noise['loadavg_start']}, at end {noise['loadavg_end']}.",
        "- Busy processes (≥ 3 % of a core over 3 s) at start, besides this one: "
        + _procs(noise["busy_start"]),
        "- At end: " + _procs(noise["busy_end"]),
        "- Per case, the `other` column is CPU used by everything but the server, "
        "Cassandra and the load generator (from /proc/stat), in cores.",
        "",
        "## How it is measured",
        "",
        *[
            ln.rstrip()
            for ln in (__doc__ or "")
            .split("Cases per size:")[1]
            .split("Noise:")[0]
            .strip()
            .splitlines()
        ],
        "",
        f"Command: `{run['command']}`",
        "",
    ]
    return "\n".join(lines)


def _span(rows: list[dict[str, Any]], key: str, digits: int = 0) -> str:
    """min-max of ``key`` (``a.b`` for nested) over ``rows``, e.g. ``5.1-5.3``."""

    def get(row: dict[str, Any]) -> float:
        for part in key.split("."):
            row = row[part]
        return float(row)  # type: ignore[arg-type]

    values = [get(r) for r in rows]
    low, high = min(values), max(values)
    if round(low, digits) == round(high, digits):
        return f"{low:,.{digits}f}"
    return f"{low:,.{digits}f} to {high:,.{digits}f}"


def findings(cases: list[dict[str, Any]]) -> list[str]:
    """What the table says, in numbers taken from it."""

    def pick(case: str, cache: str, many: bool = True) -> list[dict[str, Any]]:
        return [
            c
            for c in cases
            if c["case"] == case and c["cache"].startswith(cache) and (c["clients"] > 1) == many
        ]

    out = []
    uncached, single = pick("first page", "uncached"), pick("first page", "uncached", False)
    cached, tag = pick("first page", "cached"), pick("tag filter", "uncached")
    inside = pick("prefix search", "uncached") + pick("deep page", "uncached")
    if uncached:
        n = uncached[0]["clients"]
        out.append(
            "- **Uncached pages are bound by the server's CPU, not by the state's size.** "
            "Every uncached first page cost the server "
            f"{_span(uncached, 'server_cpu_ms_per_request', 1)} ms of CPU; the server process "
            f"ran at {_span(uncached, 'cpu_cores.server', 2)} cores (one Python process: its "
            "event loop and the Cassandra driver's IO thread share one interpreter lock) and "
            f"answered {_span(uncached, 'requests_per_s')} requests/s at every size, Cassandra "
            f"using {_span(uncached, 'cpu_cores.cassandra', 2)} cores. {n} closed-loop clients "
            f"then wait in line: p50 {_span(uncached, 'p50_ms')} ms, about {n} / throughput."
        )
    if single:
        out.append(
            f"- Alone (1 client) the same uncached page takes p50 {_span(single, 'p50_ms', 1)} "
            f"ms, p99 {_span(single, 'p99_ms', 1)} ms at every size: the service time."
        )
    if inside:
        out.append(
            "- Pages that start inside the partition (prefix search, a cursor in the middle) "
            f"answer {_span(inside, 'requests_per_s')} requests/s at "
            f"{_span(inside, 'server_cpu_ms_per_request', 1)} ms of server CPU: the same cost "
            "as the first page."
        )
    if cached:
        out.append(
            "- Cached (all clients on one URL, as many open pages are): p99 "
            f"{_span(cached, 'p99_ms', 1)} ms at {_span(cached, 'requests_per_s')} requests/s; "
            f"the load generator (client {_span(cached, 'cpu_cores.client', 2)} cores) is the "
            "limit there, not the server."
        )
    if tag:
        out.append(
            "- A tag filter reads about ten rows per match (10% of the devices match): "
            f"{_span(tag, 'server_cpu_ms_per_request')} ms of server CPU per page, "
            f"{_span(tag, 'requests_per_s')} requests/s."
        )
    return out


def _procs(procs: list[dict[str, Any]]) -> str:
    if not procs:
        return "none."
    return "; ".join(f"`{p['cmd'][:90]}` {p['cpu_pct']} %" for p in procs) + "."


def goals(cases: list[dict[str, Any]], cold: dict[str, Any]) -> list[str]:
    out = []
    for c in cases:
        if c["devices"] == 100_000 and c["case"] == "first page" and c["clients"] > 1:
            ok = c["p99_ms"] <= 50
            out.append(
                f"First page at 100k, {c['cache']}, {c['clients']} clients: p99 "
                f"{c['p99_ms']:.1f} ms: {'met' if ok else 'NOT met'} (goal ≤ 50 ms)."
            )
    for c in cold.values():
        if c["devices"] == 100_000:
            ok = c["cold_max_ms"] <= 1000
            out.append(
                f"State counts at 100k, uncached: {c['cold_p50_ms']:,.0f} ms p50, "
                f"{c['cold_max_ms']:,.0f} ms max: {'met' if ok else 'NOT met'} (goal ≤ 1 s)."
            )
    return out


# -- main ---------------------------------------------------------------------


def loadavg() -> str:
    return "/".join(Path("/proc/loadavg").read_text().split()[:3])


async def measure(args: argparse.Namespace, fleets: list[Fleet], bench: Bench) -> None:
    status, body, _ = await bench.get(None, "/api/v1/me")
    if status != 200 or not body.get("admin"):
        raise Stop(f"admin token: /api/v1/me answered {status} {body}")
    for fleet in fleets:
        await bench.run_size(fleet)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--single-seconds", type=float, default=5.0, help="the 1-client case")
    parser.add_argument("--cold-samples", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=128, help="inserts in flight")
    parser.add_argument("--no-load", action="store_true", help="reuse the rows of a last run")
    parser.add_argument("--keep-going", action="store_true", help="do not stop on errors")
    parser.add_argument("--wait-for", action="append", default=None)
    parser.add_argument("--wait-max", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "read_api")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md from the .json (no run)"
    )
    args = parser.parse_args()
    if args.render:
        saved = orjson.loads(args.out.with_suffix(".json").read_bytes())
        args.out.with_suffix(".md").write_text(markdown(saved))
        return 0
    # A TERM stops the run like Ctrl-C: the finally below stops `gateway serve`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(s) for s in args.sizes.split(",")]
    command = " ".join([".venv/bin/python bench/read_api.py", *map(shlex.quote, sys.argv[1:])])
    started_wall = datetime.now(UTC)
    t_start = time.monotonic()

    args.wait_for = args.wait_for or ["bench/rare_state.py"]
    wait = wait_for_quiet(args.wait_for, 30.0, args.wait_max)
    noise: dict[str, Any] = {"wait": wait, "loadavg_start": loadavg()}
    say("busy processes now (3 s sample) ...")
    noise["busy_start"] = busy_processes()
    for p in noise["busy_start"]:
        say(f"  {p['cpu_pct']:>4} %  {p['cmd'][:100]}")

    env0 = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    say(f"schema: gateway schema apply (keyspace {KEYSPACE}) ...")
    subprocess.run(
        [str(GATEWAY), "--log-level", "WARNING", "schema", "apply"],
        env=env0 | {"GATEWAY_CASSANDRA__KEYSPACE": KEYSPACE},
        check=True,
        cwd=ROOT,
    )
    fleets = [make_fleet(n) for n in sizes]
    load_info: dict[str, Any] = {"skipped": True}
    if not args.no_load:
        say(f"writing rows for {', '.join(f.tenant for f in fleets)} ...")
        load_info = load(fleets, args.concurrency)

    tmp = Path(tempfile.mkdtemp(prefix="read_api-"))
    port = free_port()
    env = gateway_env(port, tmp / "tokens.jsonl")
    tokens = {f.tenant: add_token(env, "--tenant", f.tenant) for f in fleets}
    tokens["admin"] = add_token(env, "--admin")
    log_path = tmp / "serve.log"
    say(f"starting gateway serve on 127.0.0.1:{port} (log {log_path}) ...")
    with log_path.open("wb") as log_file:
        server = subprocess.Popen(
            [str(GATEWAY), "serve"], env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT
        )
    report: dict[str, Any] = {}
    outcome = "complete"
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, server, log_path)
        bench = Bench(args, base, tokens, server.pid, cassandra_pid())
        bench.deadline = t_start + args.wait_max
        try:
            uvloop.run(measure(args, fleets, bench))
        except Stop as exc:
            outcome = f"stopped: {exc}"
            say(f"STOPPED: {exc}")
        if server.poll() is not None:
            outcome += f"; gateway serve exited with {server.returncode}"
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    server_log = log_path.read_text(errors="replace").splitlines()
    noise["waits_during_run"] = bench.waits
    noise["loadavg_end"] = loadavg()
    noise["busy_end"] = busy_processes()
    report = {
        "run": {
            "started": started_wall.strftime("%Y-%m-%d %H:%M"),
            "minutes": round((time.monotonic() - t_start) / 60, 1),
            "command": command,
            "outcome": outcome,
            "git": git_head(),
            "machine": machine(),
            "cassandra_version": _cassandra_version(),
            "clients": args.clients,
            "seconds": args.seconds,
            "keyspace": KEYSPACE,
            "noise": noise,
            "server_log_tail": server_log[-20:],
        },
        "data": {
            "written_directly": True,
            "tenants": {
                f.tenant: {
                    "on": f.size,
                    "off": OFF,
                    "alarm": ALARM,
                    "tagged_floor_3": len(f.tagged),
                }
                for f in fleets
            },
            "tags": f'{{"floor": 0..{FLOORS - 1}, "room": 0..{ROOMS - 1}}} seeded uniform',
            "state_buckets": 1,
        },
        "load": load_info,
        "cases": bench.cases,
        "deep_walk": bench.walks,
        "counts_cold": bench.cold,
    }
    report["goals"] = goals(bench.cases, bench.cold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path = args.out.with_suffix(".json")
    json_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    md = markdown(report)
    if outcome != "complete":
        md = md.replace("## Goals", f"**Run {outcome}**\n\n## Goals", 1)
    args.out.with_suffix(".md").write_text(md)
    say(f"wrote {json_path} and {args.out.with_suffix('.md')} ({report['run']['minutes']} min)")
    for g in report["goals"]:
        say(g)
    return 0 if outcome == "complete" else 1


def _wait_healthy(base: str, server: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"gateway serve exited: {log_path.read_text()[-2000:]}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(base + "/healthz", timeout=2) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"gateway serve not healthy within 60 s: {log_path.read_text()[-2000:]}")


def _cassandra_version() -> str:
    cluster = build_cluster(CassandraConfig(keyspace=KEYSPACE))
    try:
        row = cluster.connect().execute("SELECT release_version FROM system.local").one()
        return str(row.release_version)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
