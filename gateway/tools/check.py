"""``gateway check``: is everything the gateway needs reachable and ready?

Connects to the broker (with a throw-away client id, so the gateway's own
persistent session is untouched) and to Cassandra, and checks the schema.
When something is wrong its first line says what, in one sentence ("cannot
connect to Cassandra at 127.0.0.1:9043: connection refused"); then one line
per check. Exits non-zero if any fails. Never prints
secrets: only hosts, ports, keyspace and table names.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import time
from datetime import UTC, datetime

import aiomqtt

from ..aio import gather_all
from ..config import Config
from ..errors import ConfigError, SinkError
from ..ingest.spool import (
    damaged,
    disk_needed,
    nearest_existing,
    peek,
    room_needed,
    stranded,
    takes,
    unwritable,
    what_to_do_with_damaged,
)
from ..store.clock import check_line, measure
from ..store.database import unanswered
from ..store.queries import (
    ROLLUP_BEHIND_S,
    ROLLUP_CURSOR_CQL,
    ROLLUP_HOLDER_CQL,
    ROLLUP_PROGRESS,
    iso,
    rollup_behind_s,
)
from ..store.schema import missing_from
from ..store.write_session import WriteSession, open_write_session, unavailable_errors
from .mqtt_client import mqtt_client

# (ok, the check's line, and when it failed the one sentence that says what is wrong)
Result = tuple[bool, str, str]


async def _broker(config: Config) -> Result:
    cfg = config.mqtt
    where = f"{'mqtts' if cfg.tls.enabled else 'mqtt'}://{cfg.host}:{cfg.port}"
    try:
        async with mqtt_client(
            cfg, identifier=f"{cfg.client_id}-check-{os.getpid()}", clean_start=True, timeout=5
        ):
            return True, f"broker: ok ({where})", ""
    except aiomqtt.MqttError as exc:
        # "[Errno -2] Name or service not known": the resolver's are negative.
        reason = re.sub(r"^\[Errno -?\d+\] ", "", str(exc))
        reason = reason[:1].lower() + reason[1:]
        return (
            False,
            f"broker: unreachable at {where}: {reason}",
            f"cannot connect to the broker at {where}: {reason}",
        )


async def _cassandra(config: Config) -> list[Result]:
    """Cassandra's check, then (schema complete, roll-ups on) where the
    roll-up worker runs and how far it has got: said, never a failure (before
    the first `gateway run` none has run); then this host's clock against
    Cassandra's (store/clock.py)."""
    hosts = ",".join(f"{h}:{config.cassandra.port}" for h in config.cassandra.contact_points)
    rollups: list[Result] = []
    clock: list[Result] = []
    failing: str | None = None
    try:
        # Through the driver `gateway run` will write with (cassandra.driver).
        async with open_write_session(config.cassandra) as session:
            missing = missing_from(session.keyspace, await session.tables())
            driver = session.name
            if not missing:
                failing = await _unanswered(session)
            if not missing and failing is None and config.rollups.enabled:
                try:
                    said = await _rollup_worker(session, config.rollups.grace)
                except Exception as exc:  # a read at quorum with replicas down
                    said = f"roll-ups: not known ({exc or type(exc).__name__})"
                rollups.append((True, said, ""))
            try:
                offset = await measure(session)
            except Exception as exc:
                clock.append((True, f"clock: not known ({exc or type(exc).__name__})", ""))
            else:
                right, line = check_line(offset, config.limits.max_future_skew)
                problem = "" if right else f"this host's clock is {line.removeprefix('clock: ')}"
                clock.append((right, line, problem))
    except (SinkError, ConfigError) as exc:
        return [(False, f"cassandra: {exc}", str(exc))]
    if missing:
        return [
            (
                False,
                f"cassandra: reachable ({hosts}) but the schema is missing "
                f"{', '.join(missing)}: run `gateway schema apply`",
                f"Cassandra at {hosts} answers but the schema is incomplete "
                f"(missing {', '.join(missing)}): run `gateway schema apply`",
            ),
            *clock,
        ]
    if failing is not None:
        level = config.cassandra.consistency
        return [
            (
                False,
                f"cassandra: reachable ({hosts}), but a read at {level} fails: {failing}; "
                "replicas down? writes need them too",
                f"Cassandra at {hosts} answers, but not a read at {level}: {failing}",
            ),
            *clock,
        ]
    ok = (
        f"cassandra: ok ({hosts}, keyspace {config.cassandra.keyspace}, schema complete, "
        f"writes through {driver})"
    )
    return [(True, ok, ""), *rollups, *clock]


async def _unanswered(session: WriteSession) -> str | None:
    """Why a read at the configured consistency fails, or None. Reachable
    and with its schema, the cluster was "ok" with two of three nodes down,
    while /healthz said the writes were failing (probe)."""
    try:
        await session.read(await session.prepare(ROLLUP_CURSOR_CQL), (ROLLUP_PROGRESS,))
    except unavailable_errors() as exc:
        return unanswered(exc)
    return None


async def _rollup_worker(session: WriteSession, grace: float) -> str:
    """Which instance holds the roll-up worker's lease (store/lease.py), and
    its cursor."""
    cursor, lease = await gather_all(
        session.prepare(ROLLUP_CURSOR_CQL), session.prepare(ROLLUP_HOLDER_CQL)
    )
    done, holder = await gather_all(
        session.read(cursor, (ROLLUP_PROGRESS,)), session.read(lease, (ROLLUP_PROGRESS,))
    )
    if not done:
        return "roll-ups: no worker has run in this keyspace yet"
    done_ms = done[0]["minute_ms"]
    behind = rollup_behind_s(done_ms, time.time() * 1000, grace)
    where = (
        f"the worker runs on {holder[0]['holder']!r}"
        if holder
        else "no gateway runs the worker now (one with rollups.worker = true will)"
    )
    late = f", {behind // 60:.0f} min behind" if behind >= ROLLUP_BEHIND_S else ""
    return f"roll-ups: {where}, done up to {iso(datetime.fromtimestamp(done_ms / 1000, UTC))}{late}"


def _spool(config: Config) -> Result:
    path = config.spool.path
    # Where the file is, or will be: the gateway makes its missing directories.
    where = nearest_existing(path.parent)
    free = shutil.disk_usage(where).free if where is not None else 0
    # The gateway's own rule (ingest/spool.py, takes): a message of the
    # largest size allowed would not be spooled, and acknowledgements pause.
    largest = config.limits.max_payload_bytes
    need = room_needed(largest)

    # Not "acknowledgements paused": a smaller message may still fit, and the
    # gateway on a disk this check failed took and acknowledged 100 of 100
    # (field-engineer probe); one of the largest size would wait for room.
    def full_disk(room: int) -> str:
        return (
            f"the spool's disk is full ({room} bytes of room for {path}; a message of "
            f"limits.max_payload_bytes needs {need}, kept for it and for deletes, and "
            f"{disk_needed(largest)} of it free on disk): such a message is not "
            "acknowledged until there is room, smaller ones while they fit"
        )

    too_full = "DISK FULL (no room for a message of limits.max_payload_bytes)"

    # The gateway's own refusal at start (ingest/spool.py, Spool._open), asked
    # whether or not the file is there yet: the first check on a new host too.
    why = unwritable(path)
    if why is not None:
        return False, f"spool: cannot write {path}: {why}", f"cannot write the spool {path}: {why}"
    try:
        found = peek(path, verify=True)
    except sqlite3.Error as exc:
        if damaged(exc):
            said = f"cannot read the spool {path} ({exc}); {what_to_do_with_damaged(path)}"
            return False, f"spool: DAMAGED, cannot read {path}: {exc}", said
        if not takes(free, 0, largest):  # reading needs room too (its -shm file)
            return False, f"spool: DISK FULL, cannot read {path}: {exc}", full_disk(free)
        return False, f"spool: cannot read {path}: {exc}", f"cannot read the spool {path}: {exc}"
    if found is None:
        # The first check on a new host: the gateway could not spool there either.
        if not takes(free, 0, largest):
            said = f"spool: {too_full}, {path} not created yet"
            return False, said, full_disk(free)
        return True, f"spool: empty ({path} not created yet)", ""
    age = 0.0 if found.oldest_ms is None else max(0.0, time.time() - found.oldest_ms / 1000)
    # The bounds as the gateway applies them (ingest/spool.py, Spool.full).
    bound = (
        f"{found.depth} messages, spool.max_records"
        if found.depth >= config.spool.max_records
        else f"{found.size} bytes, spool.max_bytes"
        if found.size >= config.spool.max_bytes
        else None
    )
    room = free - found.owed + found.freed
    disk_full = not takes(free - found.owed, found.freed, largest)
    problem = (
        full_disk(room) if disk_full else f"the spool is full ({bound}): acknowledgements paused"
    )
    state = too_full if disk_full else "FULL (acknowledgements paused)" if bound else "ok"
    # An empty spool has no oldest message ("0 messages ..., oldest 0 s").
    waiting = (
        f"{found.depth} message{'' if found.depth == 1 else 's'} ({found.size} bytes) waiting, "
        f"oldest {age:.0f} s"
        if found.depth
        else "empty"
    )
    return (
        state == "ok",
        f"spool: {state}, {waiting} ({path}; drain rate: gateway_spool_drained_total in /metrics)",
        problem,
    )


def _spool_off(config: Config) -> Result | None:
    """With the spool off: a spool file left holding messages is a problem."""
    said = stranded(config.spool.path)
    return None if said is None else (False, f"spool: off; {said}", said)


async def run(config: Config) -> int:
    """Print what is wrong first, in one line, then one line per check."""
    results = [await _broker(config), *await _cassandra(config)]
    if config.spool.enabled:
        results.append(_spool(config))
    elif (left := _spool_off(config)) is not None:
        results.append(left)
    problems = [problem for ok, _, problem in results if not ok]
    if problems:
        more = len(problems) - 1
        print(problems[0] + (f" (and {more} more problem{'s' * (more > 1)} below)" if more else ""))
    for _, line, _ in results:
        print(line)
    return 1 if problems else 0
