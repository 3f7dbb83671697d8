"""The production Mosquitto example (mosquitto/production.conf + acl.example),
run for real on a spare port: TLS with hostname verification, passwords, and
an ACL that keeps a device out of other devices' topics. Then the gateway
itself over TLS with a password from a file."""

from __future__ import annotations

import asyncio
import getpass
import re
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import orjson
import pytest

from gateway.store.database import Database

from .helpers import (
    ROOT,
    free_port,
    make_config,
    running_gateway,
    telemetry_keys,
    wait_until_blocking,
)


@dataclass
class SecureBroker:
    port: int
    ca: Path
    passwords: dict[str, str]
    tmp: Path


def _run(*cmd: str, cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(tmp: Path) -> None:
    _run(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=gateway test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=tmp,
    )
    _run(
        "openssl",
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=tmp,
    )
    (tmp / "san.ext").write_text("subjectAltName=DNS:localhost\n")
    _run(
        "openssl",
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
        cwd=tmp,
    )


def _render(tmp: Path, port: int) -> Path:
    """production.conf with its paths and port pointed into tmp."""
    text = (ROOT / "mosquitto" / "production.conf").read_text()
    swaps = {
        "password_file": tmp / "passwd",
        "acl_file": ROOT / "mosquitto" / "acl.example",
        "certfile": tmp / "server.crt",
        "keyfile": tmp / "server.key",
        "cafile": tmp / "ca.crt",
        "persistence_location": f"{tmp}/",
    }
    for key, value in swaps.items():
        text, n = re.subn(rf"^{key} .*$", f"{key} {value}", text, flags=re.M)
        assert n == 1, key
    text = re.sub(r"^listener 8883$", f"listener {port} 127.0.0.1", text, flags=re.M)
    text = re.sub(r"^log_dest .*$", f"log_dest file {tmp}/mosquitto.log", text, flags=re.M)
    conf = tmp / "mosquitto.conf"
    conf.write_text(text + f"\nuser {getpass.getuser()}\n")
    return conf


@pytest.fixture
def secure_broker(services: None, tmp_path: Path) -> Iterator[SecureBroker]:
    _certificates(tmp_path)
    passwords = {"gateway": uuid.uuid4().hex, "dev-a": uuid.uuid4().hex, "dev-b": uuid.uuid4().hex}
    for i, (user, password) in enumerate(passwords.items()):
        flags = ["-c"] if i == 0 else []
        _run(
            "mosquitto_passwd", *flags, "-b", str(tmp_path / "passwd"), user, password, cwd=tmp_path
        )
    (tmp_path / "passwd").chmod(0o600)
    port = free_port()
    proc = subprocess.Popen(
        ["mosquitto", "-c", str(_render(tmp_path, port))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            log = tmp_path / "mosquitto.log"
            assert proc.poll() is None, log.read_text() if log.exists() else "exited"
            return False
        return True

    try:
        wait_until_blocking(listening, 10, "the secure broker listening")
        yield SecureBroker(port, tmp_path / "ca.crt", passwords, tmp_path)
    finally:
        proc.terminate()
        proc.wait(10)


def _tls(broker: SecureBroker) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(broker.ca))  # hostname checked


@asynccontextmanager
async def _client(broker: SecureBroker, user: str | None) -> AsyncIterator[aiomqtt.Client]:
    async with aiomqtt.Client(
        "localhost",
        broker.port,
        identifier=f"{user}-{uuid.uuid4().hex[:6]}",
        username=user,
        password=broker.passwords.get(user or ""),
        tls_context=_tls(broker),
        protocol=aiomqtt.ProtocolVersion.V5,
    ) as client:
        yield client


async def test_anonymous_and_wrong_password_are_refused(secure_broker: SecureBroker) -> None:
    with pytest.raises(aiomqtt.MqttError):
        async with _client(secure_broker, None):
            pass
    secure_broker.passwords["dev-a"], real = "wrong", secure_broker.passwords["dev-a"]
    try:
        with pytest.raises(aiomqtt.MqttError):
            async with _client(secure_broker, "dev-a"):
                pass
    finally:
        secure_broker.passwords["dev-a"] = real


# paho leaves the socket of a failed TLS handshake for the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_hostname_verification_is_on(secure_broker: SecureBroker) -> None:
    # The certificate names localhost, not 127.0.0.1.
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client(
            "127.0.0.1",
            secure_broker.port,
            username="gateway",
            password=secure_broker.passwords["gateway"],
            tls_context=_tls(secure_broker),
        ):
            pass


async def test_device_cannot_publish_into_another_devices_topic(
    secure_broker: SecureBroker,
) -> None:
    async with _client(secure_broker, "gateway") as gateway:
        await gateway.subscribe("tenants/+/devices/+/events", qos=1)
        async with _client(secure_broker, "dev-a") as device:
            await device.publish("tenants/acme/devices/dev-b/events", b"forged", qos=1)
            await device.publish("tenants/acme/devices/dev-a/events", b"own", qos=1)
        # Per-client order is kept: had the forged message been let through,
        # it would arrive before the device's own one.
        async with asyncio.timeout(10):
            message = await anext(aiomqtt_messages(gateway))
        assert str(message.topic) == "tenants/acme/devices/dev-a/events"
        assert message.payload == b"own"


def aiomqtt_messages(client: aiomqtt.Client) -> AsyncIterator[aiomqtt.Message]:
    return client.messages.__aiter__()


async def test_gateway_over_tls_with_password_file(
    secure_broker: SecureBroker, db: Database, tenant: str
) -> None:
    secret = secure_broker.tmp / "gateway-password"
    secret.write_text(secure_broker.passwords["gateway"] + "\n")
    secret.chmod(0o600)
    config = make_config(
        GATEWAY_MQTT__HOST="localhost",
        GATEWAY_MQTT__PORT=str(secure_broker.port),
        GATEWAY_MQTT__USERNAME="gateway",
        GATEWAY_MQTT__PASSWORD_FILE=str(secret),
        GATEWAY_MQTT__TLS__ENABLED="true",
        GATEWAY_MQTT__TLS__CA_FILE=str(secure_broker.ca),
    )
    assert secure_broker.passwords["gateway"] not in repr(config)
    now = int(time.time() * 1000)
    async with running_gateway(config) as gw:
        async with _client(secure_broker, "dev-a") as device:
            for i in range(5):
                payload = orjson.dumps({"ts": now + i, "state": "on"})
                await device.publish(f"tenants/{tenant}/devices/dev-a/events", payload, qos=1)
        await gw.wait_handled(5)
    assert len(await telemetry_keys(db, tenant, "dev-a")) == 5
