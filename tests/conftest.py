"""Shared fixtures: the real Mosquitto and Cassandra started by `make up`.

A missing service fails the test run (never skips): in CI a skipped
integration test would hide exactly the breakage it exists to catch.
Tests isolate themselves with a fresh tenant name and MQTT client id each;
they share one test keyspace, created once per session through the CLI.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gateway import app
from gateway.config import Config, load_config
from gateway.stats import Stats
from gateway.store.database import Database, connect

ROOT = Path(__file__).resolve().parent.parent
MQTT_HOST = "127.0.0.1"
MQTT_PORT = int(os.environ.get("MQTT_PORT", "1883"))
CQL_PORT = 9042
TEST_KEYSPACE = "gateway_test"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tests/faults/ restarts the shared broker and Cassandra: run those last.
    items.sort(key=lambda item: "/faults/" in str(item.path))


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def services() -> None:
    missing = [
        f"{name} on 127.0.0.1:{port}"
        for name, port in (("Mosquitto", MQTT_PORT), ("Cassandra", CQL_PORT))
        if not _reachable(port)
    ]
    if missing:
        pytest.fail(
            f"required services not reachable: {', '.join(missing)}. "
            "Start them with `make up` (`make test` does this).",
            pytrace=False,
        )


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


@pytest.fixture(scope="session")
def keyspace(services: None) -> str:
    result = run_cli("schema", "apply")
    assert result.returncode == 0, result.stderr
    return TEST_KEYSPACE


def make_config(**env: str) -> Config:
    """A validated Config for an in-process gateway, from GATEWAY_* style overrides."""
    values = base_env(GATEWAY_MQTT__CLIENT_ID=f"gw-test-{uuid.uuid4().hex[:12]}")
    values |= env
    return load_config(None, {k: v for k, v in values.items() if k.startswith("GATEWAY_")})


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def db(keyspace: str) -> AsyncIterator[Database]:
    async with connect(make_config().cassandra) as database:
        yield database


@dataclass
class RunningGateway:
    config: Config
    stats: Stats
    stop: asyncio.Event
    task: asyncio.Task[Stats]

    async def wait_for(self, predicate: Callable[[Stats], bool], deadline: float = 60) -> None:
        async with asyncio.timeout(deadline):
            while not predicate(self.stats):
                if self.task.done():
                    self.task.result()  # raise the gateway's error, if any
                    raise AssertionError("gateway stopped early")
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
    task = asyncio.create_task(app.run(config, stop, stats=stats, ready=ready))
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


async def clear_session(client_id: str) -> None:
    """End a test gateway's persistent session, so the broker stops queueing for it."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0
    async with aiomqtt.Client(
        MQTT_HOST,
        MQTT_PORT,
        identifier=client_id,
        protocol=aiomqtt.ProtocolVersion.V5,
        clean_start=True,
        properties=props,
    ):
        pass


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
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = content_type
        batch: list[Any] = []
        for topic, payload in messages:
            batch.append(client.publish(topic, payload, qos=1, properties=props))
            count += 1
            if len(batch) >= 100:
                await asyncio.gather(*batch)
                batch = []
        await asyncio.gather(*batch)
    return count


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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if "subscribed to" in text:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited during start-up:\n{text}")
            time.sleep(0.1)
        raise AssertionError("gateway did not connect within the deadline")

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


@pytest.fixture
def gateway_process(keyspace: str, tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    made: list[GatewayProcess] = []

    def factory(**env: str) -> GatewayProcess:
        proc = GatewayProcess(
            base_env(GATEWAY_MQTT__CLIENT_ID=f"gw-proc-{uuid.uuid4().hex[:12]}", **env),
            tmp_path / f"gateway-{len(made)}.log",
        )
        made.append(proc)
        return proc

    yield factory
    for proc in made:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()
        asyncio.run(clear_session(proc.env["GATEWAY_MQTT__CLIENT_ID"]))
