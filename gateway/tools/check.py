"""``gateway check``: is everything the gateway needs reachable and ready?

Connects to the broker (with a throw-away client id, so the gateway's own
persistent session is untouched) and to Cassandra, and checks the schema.
Prints one line per check and exits non-zero if any fails. Never prints
secrets: only hosts, ports, keyspace and table names.
"""

from __future__ import annotations

import os
import sqlite3
import time

import aiomqtt

from ..config import Config
from ..errors import ConfigError, SinkError
from ..store.schema import missing_from
from ..store.write_session import open_write_session
from .mqtt_client import mqtt_client


async def _broker(config: Config) -> tuple[bool, str]:
    cfg = config.mqtt
    where = f"{'mqtts' if cfg.tls.enabled else 'mqtt'}://{cfg.host}:{cfg.port}"
    try:
        async with mqtt_client(
            cfg, identifier=f"{cfg.client_id}-check-{os.getpid()}", clean_start=True, timeout=5
        ):
            return True, f"broker: ok ({where})"
    except aiomqtt.MqttError as exc:
        return False, f"broker: unreachable at {where}: {exc}"


async def _cassandra(config: Config) -> tuple[bool, str]:
    hosts = ",".join(f"{h}:{config.cassandra.port}" for h in config.cassandra.contact_points)
    try:
        # Through the driver `gateway run` will write with (cassandra.driver).
        async with open_write_session(config.cassandra) as session:
            missing = missing_from(session.keyspace, await session.tables())
            driver = session.name
    except (SinkError, ConfigError) as exc:
        return False, f"cassandra: {exc}"
    if missing:
        return False, (
            f"cassandra: reachable ({hosts}) but the schema is missing "
            f"{', '.join(missing)}: run `gateway schema apply`"
        )
    return True, (
        f"cassandra: ok ({hosts}, keyspace {config.cassandra.keyspace}, schema complete, "
        f"writes through {driver})"
    )


def _spool(config: Config) -> tuple[bool, str]:
    path = config.spool.path
    if not path.exists():
        return True, f"spool: empty ({path} not created yet)"
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            depth, oldest = db.execute("SELECT count(*), min(received_ms) FROM spool").fetchone()
    except sqlite3.Error as exc:
        return False, f"spool: cannot read {path}: {exc}"
    age = 0.0 if oldest is None else max(0.0, time.time() - oldest / 1000)
    full = depth >= config.spool.max_records
    state = "FULL (acknowledgements paused)" if full else "ok"
    return not full, (
        f"spool: {state}, {depth} messages waiting, oldest {age:.0f} s "
        f"({path}; drain rate: gateway_spool_drained_total in /metrics)"
    )


async def run(config: Config) -> int:
    results = [await _broker(config), await _cassandra(config)]
    if config.spool.enabled:
        results.append(_spool(config))
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1
