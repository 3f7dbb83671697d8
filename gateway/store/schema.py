"""Apply the ordered ``schema/*.cql`` files, idempotently.

Every statement is ``CREATE ... IF NOT EXISTS`` or, for a column added
later, ``ALTER TABLE ... ADD IF NOT EXISTS``; ``{keyspace}`` and
``{replication}`` are filled in from the config. Running ``gateway schema apply``
twice changes nothing. ``missing_from`` tells ``gateway check`` and ``run`` what is absent.

Two changes cannot be made by ``IF NOT EXISTS``: ``latest_events_by_state``
gained a ``gen`` column in its partition key (state generations,
gateway/store/rotate.py), then a ``device_hash`` clustering column before
``device_id`` (schema/002). ``apply`` refuses a keyspace with an old layout
and names the way out, ``gateway schema migrate``: it drops the old table,
creates the new one and refills it from ``latest_events_by_device`` (the truth
it was derived from), keeping each row's write timestamp.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path

from ..config import CassandraConfig
from ..errors import SchemaError
from ..identity import device_hash, state_bucket
from .database import Database
from .latest import RECORD_STATE_BUCKETS, state_value

log = logging.getLogger(__name__)

REQUIRED_TABLES = (
    "tenant_states",
    "state_partitions",
    "latest_events_by_state",
    "latest_events_by_device",
    "telemetry",
    "telemetry_partitions",
    "rejected_messages",
    "rollups",
    "rollup_marks",
    "rollup_progress",
    "worker_leases",
    "meta_metrics",
    "meta_tag_keys",
    "meta_tag_values",
    "meta_tag_devices",
    "meta_entry_counts",
    "quota_devices",
    "quota_counts",
)


def schema_dir() -> Path:
    """The schema/ folder: inside the package (package data; in a checkout a
    symlink to the top-level schema/), else next to it, else in the cwd."""
    here = Path(__file__).resolve()
    for candidate in (
        here.parents[1] / "schema",
        here.parents[2] / "schema",
        Path.cwd() / "schema",
    ):
        if candidate.is_dir() and any(candidate.glob("*.cql")):
            return candidate
    raise SchemaError("no schema/ folder with .cql files next to the package or in the cwd")


def replication_clause(config: CassandraConfig) -> str:
    if config.replication == "SimpleStrategy":
        return f"{{'class': 'SimpleStrategy', 'replication_factor': {config.replication_factor}}}"
    dcs = ", ".join(f"'{dc}': {rf}" for dc, rf in sorted(config.datacenters.items()))
    return f"{{'class': 'NetworkTopologyStrategy', {dcs}}}"


def _replication_of(found: dict[str, str]) -> dict[str, str | int]:
    """A keyspace's replication map as system_schema holds it, in the form
    the config's is compared in: the class's short name, factors as numbers."""
    out: dict[str, str | int] = {}
    for key, value in found.items():
        if key == "class":
            out[key] = value.rsplit(".", 1)[-1]
        else:
            out[key] = int(value) if value.isdigit() else value
    return out


def _wanted_replication(config: CassandraConfig) -> dict[str, str | int]:
    if config.replication == "SimpleStrategy":
        return {"class": "SimpleStrategy", "replication_factor": config.replication_factor}
    return {"class": "NetworkTopologyStrategy", **config.datacenters}


def _clause(replication: dict[str, str | int]) -> str:
    rest = sorted((k, v) for k, v in replication.items() if k != "class")
    parts = [f"'class': '{replication.get('class')}'"] + [f"'{k}': {v}" for k, v in rest]
    return "{" + ", ".join(parts) + "}"


def _config_for(have: dict[str, str | int], config: CassandraConfig) -> str:
    """The config keys that would name the keyspace's replication ``have``."""
    if have.get("class") == "SimpleStrategy":
        factor = f"cassandra.replication_factor = {have.get('replication_factor')}"
        if config.replication == "SimpleStrategy":
            return factor
        return f'cassandra.replication = "SimpleStrategy", {factor} and no datacenters'
    dcs = ", ".join(f"{k} = {v}" for k, v in sorted(have.items()) if k != "class")
    return f'cassandra.replication = "NetworkTopologyStrategy" and datacenters = {{ {dcs} }}'


async def replication_mismatch(db: Database) -> str | None:
    """Why the keyspace's replication is not the config's, with the
    statements that would change it; None when it is (or there is no
    keyspace). ``schema apply`` creates a keyspace, never alters one: a
    keyspace made with one replica stayed at one when the config said three,
    and one node of three down then failed a third of the writes."""
    rows = await db.execute(
        "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name = %s",
        (db.keyspace,),
    )
    if not rows:
        return None
    have = _replication_of(dict(rows[0].replication))
    want = _wanted_replication(db.config)
    if have == want:
        return None
    ks = db.keyspace
    # The keyspace may be the right one (made for a cluster, the command run
    # without the cluster's settings): advice to lower it alone was a trap.
    config_fix = _config_for(have, db.config)
    return (
        f"keyspace {ks!r} has replication {_clause(have)}, not the config's {_clause(want)} "
        "(cassandra.replication, replication_factor, datacenters): `schema apply` creates a "
        f"keyspace, it never changes one. If the keyspace is right, set {config_fix}. "
        f"If the config is right, run in cqlsh: ALTER KEYSPACE {ks} WITH replication = "
        f"{_clause(want)}; then `nodetool repair -full {ks}` on every node for more "
        f"replicas, or `nodetool cleanup {ks}` for fewer"
    )


def statements(config: CassandraConfig, directory: Path | None = None) -> list[tuple[str, str]]:
    """(file name, statement) pairs in file order, placeholders filled in."""
    directory = directory or schema_dir()
    out: list[tuple[str, str]] = []
    for path in sorted(directory.glob("*.cql")):
        text = re.sub(r"--[^\n]*", "", path.read_text())
        text = text.replace("{keyspace}", config.keyspace).replace(
            "{replication}", replication_clause(config)
        )
        # A statement ends with ';' at the end of a line.
        out.extend(
            (path.name, stmt.strip()) for stmt in re.split(r";[ \t]*(?:\n|$)", text) if stmt.strip()
        )
    return out


async def apply(db: Database, directory: Path | None = None) -> int:
    """Run every statement; returns how many ran. Waits for schema agreement."""
    if await old_state_layout(db):
        raise SchemaError(
            f"{db.keyspace}.latest_events_by_state has an older layout (without the "
            "gen or device_hash column). Run `gateway schema migrate` once: it rebuilds "
            "the table from latest_events_by_device (stop the gateways first)"
        )
    done = 0
    for name, stmt in statements(db.config, directory):
        try:
            await db.execute(stmt)
        except Exception as exc:
            raise SchemaError(f"{name}: {exc}") from None
        done += 1
    return done


def incomplete(keyspace: str, tables: set[str] | None) -> str | None:
    """Why the gateway cannot write to ``keyspace`` with ``tables`` (None:
    no such keyspace), or None if nothing is missing."""
    missing = missing_from(keyspace, tables)
    if not missing:
        return None
    return (
        f"schema incomplete in keyspace {keyspace!r} (missing: {', '.join(missing)}): "
        "run `gateway schema apply`"
    )


def missing_from(keyspace: str, tables: set[str] | None) -> list[str]:
    """What the gateway needs that ``tables`` (None: no such keyspace) lacks."""
    if tables is None:
        return [f"keyspace {keyspace}"]
    return [t for t in REQUIRED_TABLES if t not in tables]


async def old_state_layout(db: Database) -> bool:
    """Whether latest_events_by_state exists without its ``gen`` or
    ``device_hash`` column."""
    rows = await db.execute(
        "SELECT column_name FROM system_schema.columns "
        "WHERE keyspace_name = %s AND table_name = 'latest_events_by_state'",
        (db.keyspace,),
    )
    columns = {r.column_name for r in rows}
    return bool(columns) and not {"gen", "device_hash"} <= columns


async def migrate(
    db: Database, state_buckets: Callable[[str], int], progress: Callable[[int], None]
) -> int:
    """Rebuild latest_events_by_state in the current layout from
    latest_events_by_device; returns the rows written. Idempotent: a second
    run (or one after an interruption) writes the same rows again.
    ``state_buckets`` gives a tenant's ``state_buckets`` setting, used where
    Cassandra has none recorded (store/latest.py), and then recorded."""
    if await old_state_layout(db):
        await db.execute(f"DROP TABLE {db.keyspace}.latest_events_by_state")
    await apply(db)
    insert = await db.prepared(
        f"INSERT INTO {db.keyspace}.latest_events_by_state "
        "(tenant, state, bucket, gen, device_hash, device_id, ts, value, tags) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?"
    )
    gens = {
        (r.tenant, r.state, r.bucket): r.gen or 0
        for r in await db.execute(
            f"SELECT tenant, state, bucket, gen FROM {db.keyspace}.state_partitions"
        )
    }
    buckets: dict[str, int] = {
        r.tenant: r.state_buckets
        for r in await db.execute(
            f"SELECT DISTINCT tenant, state_buckets FROM {db.keyspace}.tenant_states"
        )
        if r.state_buckets is not None
    }
    record = await db.prepared(RECORD_STATE_BUCKETS.format(keyspace=db.keyspace))
    written = 0
    after = -(2**63)
    page = (
        f"SELECT token(tenant, device_id) AS t, tenant, device_id, state, ts, value, "
        f"value_num, tags, WRITETIME(state) AS wt FROM {db.keyspace}.latest_events_by_device "
        "WHERE token(tenant, device_id) > %s LIMIT 2000"
    )
    while True:
        rows = await db.execute(page, (after,))
        if not rows:
            return written
        after = rows[-1].t
        writes: list[tuple[object, ...]] = []
        for r in rows:
            if r.state is None or r.wt is None:
                continue
            if r.tenant not in buckets:
                mine = state_buckets(r.tenant)
                applied = (await db.execute(record, (mine, r.tenant)))[0]
                buckets[r.tenant] = mine if applied[0] else applied.state_buckets
            bucket = state_bucket(r.device_id, buckets[r.tenant])
            gen = gens.get((r.tenant, r.state, bucket), 0)
            value = state_value(r.value, r.value_num)
            key = (r.tenant, r.state, bucket, gen, device_hash(r.device_id), r.device_id)
            writes.append((*key, r.ts, value, r.tags or {}, r.wt))
        for start in range(0, len(writes), 64):
            await asyncio.gather(*(db.execute(insert, w) for w in writes[start : start + 64]))
        written += len(writes)
        progress(written)
