"""Plain helpers shared by the tests: no fixtures here (those are in conftest.py).

The local services' addresses, the write drivers this platform has, the
gateway in this process and as a subprocess, MQTT publishing, read-backs of
what the gateway stored, a Cassandra link that can be cut, and waits on a
condition under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import aiomqtt
import orjson
from cassandra.cluster import NoHostAvailable
from packaging.requirements import Requirement
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway import app
from gateway.config import Config, load_config
from gateway.ingest.receive import Delivery
from gateway.stats import Stats
from gateway.store import queries
from gateway.store.database import Database

ROOT = Path(__file__).resolve().parent.parent
MQTT_HOST = "127.0.0.1"
# `make test` runs the suite in pytest-xdist workers gw0, gw1, ...: worker N
# talks to its own Mosquitto on MQTT_PORT + N (the Makefile starts them), so
# one worker's gateways never receive another's messages. Cassandra is shared:
# tests isolate themselves there with fresh tenant names.
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
MQTT_PORT = int(os.environ.get("MQTT_PORT", "1883")) + WORKER
CQL_PORT = 9042
TEST_KEYSPACE = "gateway_test"


# ---------------------------------------------------------------- write drivers


def _acsylla_platform() -> bool:
    """Whether pyproject.toml installs acsylla here: its dependency's own marker, evaluated."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    (acsylla,) = (r for r in map(Requirement, dependencies) if r.name == "acsylla")
    return acsylla.marker is None or acsylla.marker.evaluate()


# True on Linux x86_64 and macOS. There acsylla must be installed, and the
# tests parametrized over DRIVERS fail (never skip) if it is not; elsewhere
# (e.g. Linux aarch64) the gateway writes through cassandra-driver only.
ACSYLLA_PLATFORM = _acsylla_platform()
# The values of cassandra.driver (gateway.config.CassandraConfig.driver).
Driver = Literal["auto", "acsylla", "python"]
DRIVERS: tuple[Driver, ...] = ("acsylla", "python") if ACSYLLA_PLATFORM else ("python",)


# ---------------------------------------------------------------- waits


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    deadline: float,
    what: str = "",
    interval: float = 0.1,
) -> None:
    """Poll `predicate` (plain or async) until it is true; AssertionError after
    `deadline` seconds. For "until it happened", instead of a fixed sleep."""
    try:
        async with asyncio.timeout(deadline):
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"not within {deadline} s: {what or predicate}") from None


def wait_until_blocking(
    predicate: Callable[[], bool], deadline: float, what: str = "", interval: float = 0.1
) -> None:
    """`wait_until` for code outside an event loop (sync fixtures, threads)."""
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() >= end:
            raise AssertionError(f"not within {deadline} s: {what or predicate}")
        time.sleep(interval)


# ---------------------------------------------------------------- configuration, CLI


def base_env(**extra: str) -> dict[str, str]:
    """Environment for a gateway subprocess: the test keyspace and the local services."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env |= {
        "GATEWAY_CASSANDRA__KEYSPACE": TEST_KEYSPACE,
        "GATEWAY_MQTT__PORT": str(MQTT_PORT),
        "GATEWAY_MQTT__SESSION_EXPIRY": "600",
        "GATEWAY_PIPELINE__STATUS_INTERVAL": "1",
        # Several test gateways may run at once: metrics on any free port.
        "GATEWAY_API__PORT": "0",
        # They share one keyspace, so one roll-up progress cursor: the roll-up
        # tests drive workers of their own (tests/test_rollups.py).
        "GATEWAY_ROLLUPS__WORKER": "false",
    }
    return env | extra


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env=env or base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def make_config(**env: str) -> Config:
    """A validated Config for an in-process gateway, from GATEWAY_* style overrides."""
    values = base_env(GATEWAY_MQTT__CLIENT_ID=f"gw-test-{uuid.uuid4().hex[:12]}")
    values |= env
    return load_config(None, {k: v for k, v in values.items() if k.startswith("GATEWAY_")})


# ---------------------------------------------------------------- the gateway in this process


def _figures(stats: Stats) -> str:
    figures = {
        name: getattr(stats, name)
        for name in (
            "received",
            "acked",
            "written",
            "rejected",
            "sampled_out",
            "queue_depth",
            "in_flight",
            "in_flight_limit",
            "retries",
            "spool_full_waits",
            "spool_disk_full",
            "read_pauses",
        )
    }
    spool = stats.spool
    if spool is not None:
        figures |= {
            "spool.depth": spool.depth,
            "spool.bytes": spool.bytes,
            "spool.appended": spool.appended,
            "spool.deleted": spool.deleted,
            "spool.full_since": spool.full_since,
            "spool.disk_full_since": spool.disk_full_since,
        }
        with contextlib.suppress(OSError):
            figures["spool disk free"] = shutil.disk_usage(spool.path.parent).free
            figures["spool files"] = {
                p.name: p.stat().st_size for p in spool.path.parent.glob(f"{spool.path.name}*")
            }
    return ", ".join(f"{k} {v}" for k, v in figures.items())


@dataclass
class RunningGateway:
    config: Config
    stats: Stats
    stop: asyncio.Event
    task: asyncio.Task[Stats]

    async def wait_for(self, predicate: Callable[[Stats], bool], deadline: float = 60) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        while not predicate(self.stats):
            if self.task.done():
                self.task.result()  # raise the gateway's error, if any
                raise AssertionError("gateway stopped early")
            if loop.time() >= end:
                # What the gateway was doing: a bare TimeoutError left a rare
                # failure (the spool that filled its own disk, once in CI)
                # with nothing to go on.
                raise TimeoutError(
                    f"not within {deadline} s; the gateway's figures: {_figures(self.stats)}"
                )
            await asyncio.sleep(0.05)

    async def wait_handled(self, count: int, deadline: float = 60) -> None:
        """Until `count` messages were written, rejected or sampled out, and acknowledged."""
        await self.wait_for(
            lambda s: s.written + s.rejected + s.sampled_out >= count and s.acked >= count,
            deadline,
        )


@asynccontextmanager
async def running_gateway(config: Config | None = None) -> AsyncIterator[RunningGateway]:
    """The real pipeline in this process, connected and subscribed on entry."""
    config = config or make_config()
    stats = Stats()
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        # As `gateway run` does (gateway/tools/cli.py).
        app.run(
            config,
            stop,
            stats=stats,
            shutdown_deadline=config.pipeline.shutdown_deadline,
            ready=ready,
        )
    )
    try:
        async with asyncio.timeout(60):
            ready_wait = asyncio.ensure_future(ready.wait())
            await asyncio.wait((task, ready_wait), return_when=asyncio.FIRST_COMPLETED)
            ready_wait.cancel()
            if task.done():
                task.result()
        yield RunningGateway(config, stats, stop, task)
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await task
        await clear_session(config.mqtt.client_id)


# ---------------------------------------------------------------- MQTT


def _session_client(client_id: str, *, expiry: int, clean_start: bool) -> aiomqtt.Client:
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho: untyped
    props.SessionExpiryInterval = expiry
    return aiomqtt.Client(
        MQTT_HOST,
        MQTT_PORT,
        identifier=client_id,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=clean_start,
        properties=props,
    )


async def clear_session(client_id: str) -> None:
    """End a test gateway's persistent session, so the broker stops queueing for it."""
    async with _session_client(client_id, expiry=0, clean_start=True):
        pass


async def subscribe_session(client_id: str, topic_filter: str) -> None:
    """A persistent session holding a subscription, as a gateway of an
    earlier config leaves it (end it with :func:`clear_session`)."""
    async with _session_client(client_id, expiry=600, clean_start=False) as client:
        await client.subscribe(topic_filter, qos=1)


async def publish(
    messages: Iterable[tuple[str, bytes | str]],
    *,
    content_type: str | None = None,
    client_id: str | None = None,
) -> int:
    """Publish at QoS 1 (each PUBACKed by the broker). Returns how many."""
    count = 0
    async with aiomqtt.Client(
        MQTT_HOST,
        MQTT_PORT,
        identifier=client_id or f"pub-{uuid.uuid4().hex[:10]}",
        protocol=aiomqtt.ProtocolVersion.V5,
        max_inflight_messages=100,
    ) as client:
        client.pending_calls_threshold = 10_000
        props = None
        if content_type is not None:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]  # paho: untyped
            props.ContentType = content_type
        batch: list[Any] = []
        for topic_, payload in messages:
            batch.append(client.publish(topic_, payload, qos=1, properties=props))
            count += 1
            if len(batch) >= 100:
                await asyncio.gather(*batch)
                batch = []
        await asyncio.gather(*batch)
    return count


def topic(tenant: str, device: str) -> str:
    return f"tenants/{tenant}/devices/{device}/events"


# ---------------------------------------------------------------- local ports, HTTP


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a server a test
    starts, or as an address where nothing answers)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def reachable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections at HOST:PORT (within 2 s)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@contextmanager
def mosquitto_on(port: int, tmp_path: Path, extra: str = "") -> Iterator[None]:
    """A Mosquitto of the test's own on ``port``, with ``extra`` configuration lines.
    It runs as this user (as mosquitto/mosquitto.sh starts ours): as root it would
    otherwise drop to ``mosquitto``, which can't read files under ``tmp_path``."""
    conf = tmp_path / "mosquitto.conf"
    user = pwd.getpwuid(os.getuid()).pw_name
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nuser {user}\n{extra}")
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        wait_until_blocking(
            lambda: reachable(port), 10, f"a test Mosquitto listening on {port}", interval=0.05
        )
        yield
    finally:
        broker.terminate()
        broker.wait(10)


def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET http://127.0.0.1:PORT/PATH: (status, body), error statuses included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


# ---------------------------------------------------------------- the gateway as a subprocess


@dataclass
class GatewayProcess:
    """`gateway run` as a real subprocess, for signal and crash tests."""

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _log: Any = field(default=None, repr=False)

    def start(self, timeout: float = 60) -> None:
        self._log = self.log_path.open("ab")
        offset = self.log_path.stat().st_size
        proc = self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1

        def subscribed() -> bool:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if "subscribed to" in text:
                return True
            if proc.poll() is not None:
                raise AssertionError(f"gateway exited during start-up:\n{text}")
            return False

        wait_until_blocking(subscribed, timeout, "the gateway subscribed")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        self._log.close()
        return code

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


# ---------------------------------------------------------------- reading back what was stored


def as_ms(ts: datetime) -> int:
    return int(ts.replace(tzinfo=UTC).timestamp() * 1000)


async def state_rows(db: Database, tenant: str, state: str, buckets: int = 1) -> dict[str, Any]:
    """The rows of every bucket of (tenant, state), in the generation readers read."""
    rows: dict[str, Any] = {}
    for found in (await state_rows_by_bucket(db, tenant, state, buckets)).values():
        rows |= found
    return rows


async def state_rows_by_bucket(
    db: Database, tenant: str, state: str, buckets: int
) -> dict[int, dict[str, Any]]:
    """The rows of (tenant, state), bucket by bucket, in the generation readers read."""
    by_bucket: dict[int, dict[str, Any]] = {}
    gens = await queries.state_generations(db, tenant, state)
    for bucket in range(buckets):
        found = await db.execute(
            f"SELECT device_id, ts, value, tags FROM {db.keyspace}.latest_events_by_state "
            "WHERE tenant = %s AND state = %s AND bucket = %s AND gen = %s",
            (tenant, state, bucket, gens.get(bucket, 0)),
        )
        by_bucket[bucket] = {
            r.device_id: queries.StateRow(r.device_id, r.ts, orjson.loads(r.value), dict(r.tags))
            for r in found
        }
    return by_bucket


async def device_row(db: Database, tenant: str, device: str) -> Any:
    found = await db.execute(
        f"SELECT state, ts, value, value_num, metrics FROM {db.keyspace}.latest_events_by_device "
        "WHERE tenant = %s AND device_id = %s",
        (tenant, device),
    )
    return found[0] if found else None


async def rejected_since(db: Database, tenant: str, since_ms: int) -> list[queries.RejectedRow]:
    """The tenant's rejected messages from a minute before ``since_ms`` on,
    in every hour's partition: a test that reads only the hour it began in
    misses what it refused after the hour turned (CI, at 06:00)."""
    return await queries.rejected(db, tenant, datetime.fromtimestamp(since_ms / 1000 - 60, UTC))


async def telemetry_keys(db: Database, tenant: str, device: str) -> set[tuple[int, int]]:
    """(ts ms, event_id) of every raw row of a device, found through the partition index."""
    parts = await db.execute(
        f"SELECT bucket_start, shard FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s",
        (tenant, device),
    )
    keys: set[tuple[int, int]] = set()
    for p in parts:
        rows = await db.execute(
            f"SELECT ts, event_id FROM {db.keyspace}.telemetry WHERE tenant = %s "
            "AND device_id = %s AND bucket_start = %s AND shard = %s",
            (tenant, device, p.bucket_start, p.shard),
        )
        keys |= {(as_ms(r.ts), r.event_id) for r in rows}
    return keys


# ---------------------------------------------------------------- a Cassandra link that can be cut


class CuttableProxy:
    """Forwards to the real Cassandra; cutting it closes every connection and
    refuses new ones, which is what the driver sees when the link to a remote
    cluster drops. (Stopping the shared local node would take every other test
    down with it.)"""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        # Bytes per second towards Cassandra (None: no limit): a slow link.
        self.limit: float | None = None
        # (code, message): new connections are not forwarded; every request
        # on them is answered with that CQL error, as a node refusing them
        # answers (bad credentials: 0x0100). None: forwarded.
        self.refuse_with: tuple[int, str] | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        self.drop()

    def drop(self) -> None:
        """Close every connection; new ones are taken (a link that blinked)."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse_with is not None:
            await self._refuse(reader, writer, *self.refuse_with)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", CQL_PORT)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, limited: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(4096 if limited else 65536):
                    if limited and self.limit is not None:
                        await asyncio.sleep(len(data) / self.limit)
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: int, message: str
    ) -> None:
        """Answer each request frame (9-byte header: version, flags, stream,
        opcode, body length) with an ERROR frame (opcode 0) on its stream."""
        self._writers.add(writer)
        text = message.encode()
        body = struct.pack(">iH", code, len(text)) + text
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            while True:
                version, _, stream, _, length = struct.unpack(">BBhBI", await reader.readexactly(9))
                await reader.readexactly(length)
                writer.write(struct.pack(">BBhBI", 0x80 | version, 0, stream, 0, len(body)) + body)
                await writer.drain()
        writer.transport.abort()


@asynccontextmanager
async def proxy() -> AsyncIterator[CuttableProxy]:
    p = CuttableProxy()
    await p.start()
    try:
        yield p
    finally:
        with contextlib.suppress(Exception):
            await p.cut()


# ---------------------------------------------------------------- fault tests (tests/faults/)


class Publisher:
    """Publishes events at a steady rate in its own thread, reconnecting (with
    the same id) whenever the broker goes away; an event counts as published
    once the broker PUBACKed it."""

    def __init__(self, tenant: str, devices: int, rate: float, count: int) -> None:
        self.tenant, self.devices, self.rate, self.count = tenant, devices, rate, count
        self.published: dict[str, list[dict[str, object]]] = {}
        self.reconnects = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "publisher did not finish"

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def _run(self) -> None:
        start = time.monotonic()
        base = int(time.time() * 1000)
        states = ("on", "off", "alarm")
        i = 0
        while i < self.count:
            try:
                async with aiomqtt.Client(
                    MQTT_HOST, MQTT_PORT, identifier=f"pub-{uuid.uuid4().hex[:8]}", timeout=5
                ) as client:
                    while i < self.count:
                        device = f"d{i % self.devices}"
                        event = {"ts": base + i, "state": states[(i // 7) % 3], "value": i}
                        await client.publish(topic(self.tenant, device), orjson.dumps(event), qos=1)
                        self.published.setdefault(device, []).append(event)
                        i += 1
                        ahead = start + i / self.rate - time.monotonic()
                        if ahead > 0:
                            await asyncio.sleep(ahead)
            except aiomqtt.MqttError:
                self.reconnects += 1
                await asyncio.sleep(0.5)


def stored_at_least(
    db: Database, tenant: str, publisher: Publisher, at_least: int
) -> Callable[[], Awaitable[bool]]:
    """A wait_until predicate: the gateway has stored `at_least` of the publisher's events."""

    async def predicate() -> bool:
        stored = 0
        for i in range(publisher.devices):
            stored += len(await telemetry_keys(db, tenant, f"d{i}"))
        return stored >= at_least

    return predicate


class Published(Protocol):
    """What :func:`assert_all_stored` reads of a :class:`Publisher`: the events
    the broker acknowledged, by device."""

    published: dict[str, list[dict[str, object]]]


async def assert_all_stored(
    db: Database, tenant: str, publisher: Published, deadline: float = 120
) -> None:
    """Every published event reaches the raw table once (a redelivered copy
    is the same row: published events have distinct times, so two rows of one
    time are a duplicate), and the latest tables hold exactly the newest event
    of each device."""
    expected = {
        d: sorted({int(str(e["ts"])) for e in events}) for d, events in publisher.published.items()
    }

    async def all_stored() -> bool:
        try:
            stored = {
                d: sorted(k[0] for k in await telemetry_keys(db, tenant, d)) for d in expected
            }
        except NoHostAvailable:  # this test's own session is still reconnecting
            return False
        return stored == expected

    await wait_until(all_stored, deadline, "every published event stored once", interval=1)
    for device, events in publisher.published.items():
        newest = max(events, key=lambda e: int(str(e["ts"])))
        row = await device_row(db, tenant, device)
        assert (row.state, row.value_num) == (newest["state"], float(str(newest["value"])))
        assert device in await state_rows(db, tenant, str(newest["state"]))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate and its key (PEM files in ``folder``): a CA
    file, or a client certificate, that the TLS settings load."""
    cert, key = folder / "self.crt", folder / "self.key"
    request = ("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2")
    names = ("-subj", "/CN=gateway test", "-keyout", str(key), "-out", str(cert))
    subprocess.run(["openssl", *request, *names], check=True, capture_output=True, timeout=60)
    return cert, key


# ---------------------------------------------------------------- spool source doubles


class Acks:
    """Deliveries' acknowledgements (``Delivery.ack``), in the order they came."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def of(self, name: str) -> Ack:
        return Ack(self.done, name)


class Ack:
    comes_back = True  # the broker's QoS 1 resend

    def __init__(self, done: list[str], name: str) -> None:
        self._done, self._name = done, name

    def done(self) -> None:
        self._done.append(self._name)


class Unfed:
    """A pipeline a SpoolSource must not feed (only its appends are tested)."""

    async def put(self, delivery: Delivery) -> None:
        raise AssertionError("not fed in this test")


class Unpaused:
    """The receiver's flow control, for a SpoolSource on its own."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass
