"""cassandra.compression: lz4 through the Python driver really shrinks what
crosses the link (counted by gateway/tools/delay_proxy.py), "none" really sends
plain frames (the driver would otherwise compress whenever lz4 is installed),
and a driver or install that cannot compress is a config error naming the key."""

from __future__ import annotations

import importlib.util
import time
import uuid
from typing import Literal

import pytest

from gateway.config import CassandraConfig
from gateway.errors import ConfigError
from gateway.store import database
from gateway.store.write_session import choose_driver, open_write_session
from gateway.tools.delay_proxy import DelayProxy

from .helpers import CQL_PORT

INSERT = (
    "INSERT INTO {keyspace}.rejected_messages "
    "(tenant, hour_start, received_at, id, topic, device_id, reason, detail, payload, "
    "payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
PAYLOAD = b"temperature=21.5;" * 6000  # 102 kB, very compressible
WRITES = 20


async def bytes_sent(keyspace: str, compression: Literal["none", "lz4"]) -> int:
    """Bytes towards Cassandra for WRITES inserts of PAYLOAD (connection set-up excluded)."""
    async with DelayProxy("127.0.0.1", CQL_PORT) as proxy:
        config = CassandraConfig(
            keyspace=keyspace, port=proxy.port, driver="python", compression=compression
        )
        async with open_write_session(config) as session:
            insert = await session.prepare(INSERT, timestamps=(1, 2))
            before = proxy.bytes_out
            now = int(time.time() * 1000)
            tenant = f"lz{uuid.uuid4().hex[:10]}"
            for _ in range(WRITES):
                values = (tenant, now, now, uuid.uuid1(), "t", "d", "test", "", PAYLOAD, 1)
                await session.execute(session.bind(insert, values))
            return proxy.bytes_out - before


async def test_lz4_shrinks_what_crosses_the_link_and_none_does_not(keyspace: str) -> None:
    plain = await bytes_sent(keyspace, "none")
    lz4 = await bytes_sent(keyspace, "lz4")
    assert plain >= WRITES * len(PAYLOAD)
    assert lz4 < plain / 10, (lz4, plain)


def test_compression_needs_the_python_driver() -> None:
    with pytest.raises(ValueError, match=r"cassandra\.compression.*driver = \"python\""):
        CassandraConfig(driver="acsylla", compression="lz4")
    # "auto" picks the driver that can.
    assert choose_driver(CassandraConfig(compression="lz4")) == "python"


def test_lz4_without_the_package_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # Uninstalling a package is not something a test can do to the shared venv:
    # the one fault injected here is "the lz4 package is not found".
    # importlib.util is the module gateway/store/database.py looks find_spec up on.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"cassandra\.compression.*pip install lz4"):
        database.build_cluster(CassandraConfig(driver="python", compression="lz4"))
