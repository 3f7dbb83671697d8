"""Apply the ordered ``schema/*.cql`` files, idempotently.

Every statement is ``CREATE ... IF NOT EXISTS``; ``{keyspace}`` and
``{replication}`` are filled in from the config. Running ``gateway schema apply``
twice changes nothing. ``missing_from`` tells ``gateway check`` and ``run`` what is absent.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..config import CassandraConfig
from ..errors import SchemaError
from .database import Database

log = logging.getLogger(__name__)

REQUIRED_TABLES = (
    "tenant_states",
    "latest_events_by_state",
    "latest_events_by_device",
    "telemetry",
    "telemetry_partitions",
    "rejected_messages",
)


def schema_dir() -> Path:
    """The schema/ folder: next to the package in a checkout, else in the cwd (Docker)."""
    for candidate in (Path(__file__).resolve().parents[2] / "schema", Path.cwd() / "schema"):
        if candidate.is_dir() and any(candidate.glob("*.cql")):
            return candidate
    raise SchemaError("no schema/ folder with .cql files next to the package or in the cwd")


def replication_clause(config: CassandraConfig) -> str:
    if config.replication == "SimpleStrategy":
        return f"{{'class': 'SimpleStrategy', 'replication_factor': {config.replication_factor}}}"
    dcs = ", ".join(f"'{dc}': {rf}" for dc, rf in sorted(config.datacenters.items()))
    return f"{{'class': 'NetworkTopologyStrategy', {dcs}}}"


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
    done = 0
    for name, stmt in statements(db.config, directory):
        try:
            await db.execute(stmt)
        except Exception as exc:
            raise SchemaError(f"{name}: {exc}") from None
        done += 1
    return done


def missing_from(keyspace: str, tables: set[str] | None) -> list[str]:
    """What the gateway needs that ``tables`` (None: no such keyspace) lacks."""
    if tables is None:
        return [f"keyspace {keyspace}"]
    return [t for t in REQUIRED_TABLES if t not in tables]
