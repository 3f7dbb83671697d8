"""Read side for the CLI: devices by state, a device's latest event, history.

* ``devices_in_state`` reads every bucket partition of (tenant, state): with
  the default single bucket it is one partition read (Solution 3).
* ``history`` lists the device's raw-telemetry partitions for the range from
  ``telemetry_partitions`` (whatever bucket sizes and shards were used), reads
  them newest first, at most HISTORY_READS at once and only as many as the
  page needs, and merges them newest first, one copy per event
  (``history_partitions``, ``unique_events``; the bench's read-back check,
  bench/benchlib.py, goes through the same two).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import heapq
import itertools
import logging
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import orjson

from cassandra import OperationTimedOut, ReadFailure, ReadTimeout

from ..config import MAX_BUCKET_SECONDS, Config
from ..errors import QueryError
from ..identity import FIRST_HASH
from ..units import epoch_ms, parse_duration
from .database import Database

log = logging.getLogger(__name__)

# The failure code a replica gives for a read that met more deleted rows than
# its tombstone_failure_threshold (native protocol v5, READ_FAILURE reasons).
READ_TOO_MANY_TOMBSTONES = 0x0001


@dataclass(frozen=True, slots=True)
class LatestRow:
    device_id: str
    ts: datetime
    value: str | float | None
    state: str | None = None
    metrics: dict[str, float] | None = None
    tags: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device_id": self.device_id, "ts": iso(self.ts), "value": self.value}
        if self.state is not None or self.metrics is not None:
            out |= {"state": self.state, "metrics": self.metrics or {}, "tags": self.tags or {}}
        return out


@dataclass(frozen=True, slots=True)
class HistoryRow:
    ts: datetime
    state: str | None
    value: str | float | None
    metrics: dict[str, float]
    tags: dict[str, str]
    event_id: int = 0  # the content hash that tells two events of one millisecond apart

    def as_json(self) -> dict[str, Any]:
        return {
            "ts": iso(self.ts),
            "state": self.state,
            "value": self.value,
            "metrics": self.metrics,
            "tags": self.tags,
        }


def iso(ts: datetime) -> str:
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return aware.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _value(text: str | None, num: float | None) -> str | float | None:
    return text if text is not None else num


@dataclass(frozen=True, slots=True)
class StateRow:
    """A device in a state: its latest event's time and value, and its tags."""

    device_id: str
    ts: datetime
    value: Any
    tags: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "ts": iso(self.ts),
            "value": self.value,
            "tags": self.tags,
        }


@dataclass(frozen=True, slots=True)
class DevicePage:
    devices: list[StateRow]
    next_cursor: str | None  # opaque; None: no more


MAX_PAGE = 1000
# Rows one page request may read while a filter skips rows; when it runs
# out, the page comes back short with a cursor to go on from.
SCAN_BUDGET = 10_000


def bad_parameter(parameter: str, detail: str) -> QueryError:
    """The error for a bad request parameter (the API answers it with a 400)."""
    return QueryError(f"{parameter}: {detail}", parameter=parameter)


def asked_state(text: str) -> str:
    """A state as asked for (``--state``, the API's ``/states/{state}``),
    trimmed as the decoder trims a device's: ``"on "`` is ``"on"``, which is
    what was stored. Only whitespace names no state."""
    state = text.strip()
    if not state:
        raise bad_parameter("state", f"{text!r} is only whitespace, and no state is")
    return state


def _pack(value: Any) -> str:
    """An opaque cursor: the JSON of ``value``, base64url without padding."""
    return base64.urlsafe_b64encode(orjson.dumps(value)).decode().rstrip("=")


def _unpack(cursor: str) -> Any:
    try:
        return orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error):
        raise bad_parameter("cursor", "not a cursor this server gave out") from None


# A position in a state partition: (device_hash, device_id) of a row.
Position = tuple[int, str]
START: Position = (FIRST_HASH, "")  # before every row


def query_of(*identity: Any) -> int:
    """What a cursor carries of the query it was given out for (tenant, state
    or device, filters): a position alone was taken by any other query, and a
    page of state "off" began where a page of "on" ended, with no error."""
    return zlib.crc32(orjson.dumps(identity))


OTHER_QUERY = "given out for another query (tenant, state, device or filter): start without it"


def encode_cursor(bucket: int, after: Position, query: int) -> str:
    return _pack([bucket, *after, query])


def decode_cursor(cursor: str, buckets: int, query: int) -> tuple[int, Position]:
    found = _unpack(cursor)
    match found:
        case [int(bucket), int(hashed), str(after), int(given_for)] if 0 <= bucket < buckets and (
            FIRST_HASH <= hashed < 2**31
        ):
            if given_for != query:
                raise bad_parameter("cursor", OTHER_QUERY)
            return bucket, (hashed, after)
    raise bad_parameter("cursor", "not a cursor this server gave out (or state_buckets changed)")


def parse_tag(tag: str) -> tuple[str, str]:
    """``KEY:VALUE`` or ``KEY=VALUE``, split at the first ``:`` or ``=`` of the
    key: the value may hold either (``site:v=1``, ``at=12:30``). A key that
    holds ``:``, ``=`` or ``\\`` writes them ``\\:``, ``\\=`` and ``\\\\``
    (``a\\:b:1`` is key ``a:b``, value ``1``); the value is taken as written.
    One parser for every ``tag`` parameter and the CLI's KEY=VALUE (the
    metadata endpoint split at '=' first, the states one at ':' first)."""
    if not tag:
        # /meta/devices without ?tag= said "expected KEY:VALUE ... (got '')".
        raise bad_parameter("tag", "required: KEY:VALUE or KEY=VALUE, e.g. floor:3 or floor=3")
    key: list[str] = []
    i = 0
    while i < len(tag):
        ch = tag[i]
        if ch == "\\" and i + 1 < len(tag):
            key.append(tag[i + 1])
            i += 2
            continue
        if ch in ":=":
            if key:
                return "".join(key), tag[i + 1 :]
            break
        key.append(ch)
        i += 1
    raise bad_parameter(
        "tag",
        "expected KEY:VALUE or KEY=VALUE, e.g. floor:3 or floor=3; a key that holds : = "
        f"or \\ writes them \\: \\= \\\\ (got {tag!r})",
    )


async def state_generations(db: Database, tenant: str, state: str) -> dict[int, int]:
    """bucket -> the generation readers read (absent: 0); store/rotate.py."""
    stmt = await db.prepared(
        f"SELECT bucket, gen FROM {db.keyspace}.state_partitions WHERE tenant = ? AND state = ?"
    )
    return {r.bucket: r.gen or 0 for r in await db.execute(stmt, (tenant, state))}


async def devices_page(
    db: Database,
    config: Config,
    tenant: str,
    state: str,
    *,
    limit: int = 100,
    cursor: str | None = None,
    prefix: str = "",
    tag: tuple[str, str] | None = None,
    budget: int | None = None,
    buckets: int | None = None,
) -> DevicePage:
    """One page of the devices in ``state``, sorted by device id.

    Pages follow the table's clustering order: by bucket, then by device
    hash (schema/002), so one page holds devices from across the id range,
    sorted by id within the page. A cursor names the bucket and the position
    of the last row read, so paging goes on across buckets and across a
    rotation (generations keep positions). ``prefix`` and ``tag`` are
    filters: rows are read, then kept when the device id starts with
    ``prefix`` (whatever the case) and the tags hold KEY with VALUE, at most
    ``budget`` rows per page (default SCAN_BUDGET); a page that runs out
    comes back short, with a cursor. ``buckets``: the tenant's state_buckets,
    when the caller has read them (else read here). Each read
    asks for one row more than it needs, so that a page that ends the list
    exactly says so (no cursor onto an empty page).
    """
    if not 1 <= limit <= MAX_PAGE:
        raise bad_parameter("limit", f"must be between 1 and {MAX_PAGE} (got {limit})")
    if buckets is None:
        buckets = await state_buckets(db, config, tenant)
    query = query_of(tenant, state, prefix, tag)
    bucket, after = decode_cursor(cursor, buckets, query) if cursor else (0, START)
    gens = await state_generations(db, tenant, state)
    stmt = await db.prepared(
        "SELECT device_hash, device_id, ts, value, tags, WRITETIME(ts) AS wt "
        f"FROM {db.keyspace}.latest_events_by_state "
        "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? "
        "AND (device_hash, device_id) > (?, ?) LIMIT ?"
    )
    filtered = bool(prefix) or tag is not None
    most = SCAN_BUDGET if budget is None else budget
    # Not case-sensitive: "lobby" finds "Lobby-3" (page probe); an exact
    # match is among what it finds.
    folded = prefix.casefold()

    def keep(r: Any) -> bool:
        if folded and not r.device_id.casefold().startswith(folded):
            return False
        return tag is None or (r.tags or {}).get(tag[0]) == tag[1]

    out: list[StateRow] = []
    scanned = 0
    while bucket < buckets:
        want = min(MAX_PAGE, most - scanned) if filtered else limit - len(out)
        gen = gens.get(bucket, 0)
        params = (tenant, state, bucket, gen, *after, want + 1)  # one to look ahead
        rows = await _read_state(db, stmt, params, tenant, state, buckets)
        scanned += len(rows)
        matching = [r for r in rows if keep(r)]
        seen, checked, stale = 0, 0, set[str]()
        for r in rows:
            if keep(r):
                if seen == checked:
                    # Check only rows that may be given out, as many as the page still needs.
                    batch = matching[checked : checked + limit - len(out)]
                    stale |= await _stale(db, tenant, state, bucket, gen, batch)
                    checked += len(batch)
                seen += 1
                if r.device_id not in stale:
                    out.append(StateRow(r.device_id, r.ts, _json(r.value), dict(r.tags or {})))
            after = (r.device_hash, r.device_id)
            if len(out) == limit:
                break
        if len(out) == limit:
            last = (rows[-1].device_hash, rows[-1].device_id)
            if after != last or len(rows) > want:
                return _page(out, encode_cursor(bucket, after, query))
            return _page(out, await _next(db, stmt, tenant, state, gens, bucket, buckets, query))
        if len(rows) > want:
            if filtered and scanned >= most:
                return _page(out, encode_cursor(bucket, after, query))
            continue  # more in this bucket
        bucket, after = bucket + 1, START
    return _page(out, None)


def _page(rows: list[StateRow], cursor: str | None) -> DevicePage:
    return DevicePage(sorted(rows, key=lambda r: r.device_id), cursor)


# Devices per read of latest_events_by_device when a page is checked (a
# page is at most MAX_PAGE rows); the reads of a page run concurrently.
# Cassandra serves a 100-key IN in about 18 ms here and four 25-key INs side
# by side in about 10 to 13 ms, for 1 to 2 ms more of the client's CPU; ten
# 10-key INs gain no more time and cost more CPU (one client, a page of 100,
# 110,000 devices, settled; measured with the rare-state bench's tenant).
VERIFY_IN = 25


async def _stale(
    db: Database, tenant: str, state: str, bucket: int, gen: int, rows: list[Any]
) -> set[str]:
    """The devices of ``rows`` whose newest state-bearing write is elsewhere.

    latest_events_by_device, with the write timestamp of its ``state``, is the
    truth. A state row older than the device's newest write into another
    state is a leftover that a delete never reached: with several gateway
    instances, one can write a device's newer event before it knows a state
    another instance just registered, or skip the deletes because its own
    previous write for the device was in the same state. Such a row is left
    out of the answer and deleted as of that newest write (``USING
    TIMESTAMP``), so a later write that really puts the device back in this
    state, being newer, is untouched. Cost: concurrent reads of up to
    VERIFY_IN devices each (``device_id IN (...)``), four for a page of 100:
    as point reads, one request per row, the checks cost the read side most
    of its CPU per page.
    """
    if not rows:
        return set()
    newest = await db.prepared(
        "SELECT device_id, state, WRITETIME(state) AS wt "
        f"FROM {db.keyspace}.latest_events_by_device WHERE tenant = ? AND device_id IN ?"
    )
    found = await asyncio.gather(
        *(
            db.execute(newest, (tenant, [r.device_id for r in rows[start : start + VERIFY_IN]]))
            for start in range(0, len(rows), VERIFY_IN)
        )
    )
    truth = {t.device_id: t for part in found for t in part}
    leftovers: list[tuple[int, str, int]] = []
    for row in rows:
        t = truth.get(row.device_id)
        if t is not None and t.state != state and t.wt is not None and t.wt > (row.wt or 0):
            leftovers.append((row.device_hash, row.device_id, int(t.wt)))
    if leftovers:
        repair = await db.prepared(
            f"DELETE FROM {db.keyspace}.latest_events_by_state USING TIMESTAMP ? "
            "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? "
            "AND device_hash = ? AND device_id = ?"
        )
        await asyncio.gather(
            *(
                db.execute(repair, (wt, tenant, state, bucket, gen, hashed, dev))
                for hashed, dev, wt in leftovers
            )
        )
        log.info(
            "tenant %r state %r: %d leftover rows of devices whose newest event is in "
            "another state left out and deleted",
            tenant,
            state,
            len(leftovers),
        )
    return {device for _, device, _ in leftovers}


async def _next(
    db: Database,
    stmt: Any,
    tenant: str,
    state: str,
    gens: dict[int, int],
    bucket: int,
    buckets: int,
    query: int,
) -> str | None:
    """The cursor of the start of the next bucket that holds a row (None:
    none does), for a page that ended exactly with its bucket."""
    for later in range(bucket + 1, buckets):
        params = (tenant, state, later, gens.get(later, 0), *START, 1)
        if await _read_state(db, stmt, params, tenant, state, buckets):
            return encode_cursor(later, START, query)
    return None


def _json(value: str | None) -> Any:
    if value is None:
        return None
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return value


async def _read_state(
    db: Database, stmt: Any, params: tuple[Any, ...], tenant: str, state: str, buckets: int
) -> list[Any]:
    try:
        return list(await db.execute(stmt, params))
    except ReadFailure as exc:
        codes = set((exc.error_code_map or {}).values())
        # Protocol v4 (what the CLI speaks) gives no reason code; v5 does.
        if codes and READ_TOO_MANY_TOMBSTONES not in codes:
            raise
        cause = (
            "a partition holds more deleted rows (devices that left the state) than "
            "the tombstone_failure_threshold"
        )
        raise QueryError(
            f"Cassandra failed to read state {state!r} of tenant {tenant!r}"
            + (f": {cause}" if codes else f", most likely because {cause}")
            + ". The gateway rotates state partitions to keep them few "
            "(pipeline.rotate_after_deletes; is it 0?); spreading the state over more "
            f"partitions with tenants.{tenant}.state_buckets (now {buckets}) helps too "
            '(README, "The state view: which model, by measurement")'
        ) from None


@dataclass(frozen=True, slots=True)
class FoundDevices:
    """Devices whose id starts with a prefix, across a tenant's states."""

    devices: list[LatestRow]  # an exact id first, then by id
    complete: bool  # False: more match, or a state's search stopped at its share of FIND_ROWS
    cut_short: list[str]  # the states whose search stopped at its share of FIND_ROWS

    def as_json(self) -> list[dict[str, Any]]:
        return [
            {
                "device_id": d.device_id,
                "state": d.state,
                "ts": iso(d.ts),
                "value": d.value,
                "tags": d.tags or {},
            }
            for d in self.devices
        ]


# States searched at once by find_devices (a tenant has at most
# pipeline.max_states_per_tenant, 32 by default, up to 1,024), and the rows
# one search reads in all: shared among the states, at least FIND_STATE_ROWS
# each (so 102,400 at most, with 1,024 states).
FIND_PARALLEL = 8
FIND_ROWS = 40_000
FIND_STATE_ROWS = 100


async def find_devices(
    db: Database, config: Config, tenant: str, prefix: str, *, limit: int = 100
) -> FoundDevices:
    """The tenant's devices in a state whose id starts with ``prefix``
    (whatever the case): each state's first page of its prefix search
    (devices_page, the states sharing FIND_ROWS rows read), merged and
    sorted by id and cut to ``limit``; and first the device named exactly by
    ``prefix``, read by its key, so found however large the states, and also
    when it has no state (no state's list holds such a device, so only its
    exact id finds it). Not complete when more match or a state's search
    stopped short: a state's own list (``prefix`` on its pages) goes on from
    there. A state's pages come in the table's order (by device hash), so
    what an incomplete answer holds is some of the matches, not the first
    ids."""
    if not prefix:
        raise bad_parameter("prefix", "required: the start of a device id")
    if not 1 <= limit <= MAX_PAGE:
        raise bad_parameter("limit", f"must be between 1 and {MAX_PAGE} (got {limit})")
    # Read once for every state's search (devices_page would read them each).
    states, recorded = await _tenant_states(db, tenant)
    buckets = _buckets(config, tenant, recorded)
    budget = max(FIND_STATE_ROWS, FIND_ROWS // max(len(states), 1))
    running = asyncio.Semaphore(FIND_PARALLEL)

    async def search(state: str) -> DevicePage:
        async with running:
            return await devices_page(
                db,
                config,
                tenant,
                state,
                limit=limit,
                prefix=prefix,
                budget=budget,
                buckets=buckets,
            )

    exact_read = asyncio.ensure_future(latest_event(db, tenant, prefix))
    reads = [asyncio.ensure_future(search(state)) for state in states]
    try:
        exact, pages = await asyncio.gather(exact_read, asyncio.gather(*reads))
    except BaseException:
        # A failed read fails the search with its own error (the API's 400 or
        # 503), and the other reads stop.
        for read in [exact_read, *reads]:
            read.cancel()
        raise
    found: dict[str, LatestRow] = {}
    for state, page in zip(states, pages, strict=True):
        for d in page.devices:
            seen = found.get(d.device_id)
            # A device met in two states (a move under way): its newer row.
            if seen is None or d.ts > seen.ts:
                found[d.device_id] = LatestRow(d.device_id, d.ts, d.value, state, None, d.tags)
    first: list[LatestRow] = []
    if exact is not None:
        found.pop(exact.device_id, None)
        first = [exact]
    rows = first + sorted(found.values(), key=lambda r: r.device_id)
    more = any(p.next_cursor is not None for p in pages) or len(rows) > limit
    short = [
        state
        for state, page in zip(states, pages, strict=True)
        if page.next_cursor is not None and len(page.devices) < limit
    ]
    return FoundDevices(rows[:limit], not more, short)


async def devices_in_state(
    db: Database, config: Config, tenant: str, state: str, *, prefix: str = ""
) -> list[StateRow]:
    """Every device in ``state`` (whose id starts with ``prefix``, whatever
    the case), by device id (the CLI's full list)."""
    rows: list[StateRow] = []
    cursor: str | None = None
    while True:
        page = await devices_page(
            db, config, tenant, state, limit=MAX_PAGE, cursor=cursor, prefix=prefix
        )
        rows += page.devices
        if page.next_cursor is None:
            return sorted(rows, key=lambda r: r.device_id)
        cursor = page.next_cursor


async def known_states(db: Database, tenant: str) -> list[str]:
    """Every state the tenant has used (``tenant_states``), by name."""
    return (await _tenant_states(db, tenant))[0]


async def state_buckets(db: Database, config: Config, tenant: str) -> int:
    """The tenant's state_buckets: as the gateway that first wrote the tenant
    recorded it (store/latest.py), else (nothing written yet) the config's."""
    return _buckets(config, tenant, (await _tenant_states(db, tenant))[1])


def _buckets(config: Config, tenant: str, recorded: int | None) -> int:
    """state_buckets as recorded (tenant_states), else the config's."""
    return recorded or config.tenant(tenant).state_buckets


async def _tenant_states(db: Database, tenant: str) -> tuple[list[str], int | None]:
    """The tenant's states by name, and its recorded state_buckets (or None)."""
    rows = await db.execute(
        await db.prepared(
            f"SELECT state, state_buckets FROM {db.keyspace}.tenant_states WHERE tenant = ?"
        ),
        (tenant,),
    )
    recorded = rows[0].state_buckets if rows else None
    return sorted(r.state for r in rows if r.state is not None), recorded


async def state_counts(db: Database, config: Config, tenant: str) -> list[tuple[str, int]]:
    """(state, devices) for every state the tenant has used, most devices first."""
    states, recorded = await _tenant_states(db, tenant)
    buckets = _buckets(config, tenant, recorded)
    count = await db.prepared(
        f"SELECT COUNT(*) AS n FROM {db.keyspace}.latest_events_by_state "
        "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ?"
    )

    # COUNT_READS workers, each reading one partition at a time: a tenant's
    # states times its buckets (up to 1024 each) were all started together.
    gens: dict[str, dict[int, int]] = {}
    totals = dict.fromkeys(states, 0)

    async def generations(todo: Iterator[str]) -> None:
        for state in todo:
            gens[state] = await state_generations(db, tenant, state)

    async def counts(todo: Iterator[tuple[str, int]]) -> None:
        for state, bucket in todo:
            params = (tenant, state, bucket, gens[state].get(bucket, 0))
            rows = await _read_state(db, count, params, tenant, state, buckets)
            totals[state] += int(rows[0].n)

    state_todo = iter(states)
    await asyncio.gather(*(generations(state_todo) for _ in range(COUNT_READS)))
    part_todo = ((state, bucket) for state in states for bucket in range(buckets))
    await asyncio.gather(*(counts(part_todo) for _ in range(COUNT_READS)))
    found = list(totals.items())
    return sorted(found, key=lambda sc: (-sc[1], sc[0]))


async def tenants(db: Database, limit: int = 1000) -> list[str]:
    """Tenants that have used a state (for admin tokens), at most ``limit``."""
    rows = await db.execute(
        f"SELECT DISTINCT tenant FROM {db.keyspace}.tenant_states LIMIT {int(limit)}"
    )
    return sorted(r.tenant for r in rows)


async def devices_with_rows(db: Database, tenant: str) -> list[str]:
    """Every device of ``tenant`` that has raw rows (a partition in
    ``telemetry_partitions``), by id: a scan of that table's partition keys,
    filtered by Cassandra (``gateway rebuild-rollups`` over a whole tenant)."""
    rows = await db.execute(
        f"SELECT DISTINCT tenant, device_id FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s ALLOW FILTERING",
        (tenant,),
    )
    return sorted(r.device_id for r in rows)


async def device_has_rows(db: Database, tenant: str, device_id: str) -> bool:
    """Whether ``device_id`` has raw rows at any time (a partition in
    ``telemetry_partitions``): a device a tenant has, even one whose rows were
    written around the gateway (no latest row)."""
    rows = await db.execute(
        f"SELECT bucket_start FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s LIMIT 1",
        (tenant, device_id),
    )
    return bool(rows)


async def latest_event(db: Database, tenant: str, device_id: str) -> LatestRow | None:
    rows = await db.execute(
        f"SELECT device_id, state, ts, value, value_num, metrics, tags "
        f"FROM {db.keyspace}.latest_events_by_device WHERE tenant = %s AND device_id = %s",
        (tenant, device_id),
    )
    if not rows:
        return None
    r = rows[0]
    return LatestRow(
        r.device_id,
        r.ts,
        _value(r.value, r.value_num),
        r.state,
        dict(r.metrics or {}),
        dict(r.tags or {}),
    )


class Partition(NamedTuple):
    """One raw-telemetry partition of a device: its key's last two parts,
    and when the newest event it may hold ends (epoch ms, exclusive)."""

    start: datetime
    shard: int
    end_ms: int


async def history_partitions(
    db: Database, tenant: str, device_id: str, since: datetime, until: datetime
) -> list[Partition]:
    """The device's raw-telemetry partitions that may hold events in
    [since, until], once each, newest end first."""
    since_ms = epoch_ms(since)
    partitions = await db.execute(
        f"SELECT bucket_start, shard, bucket_seconds FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s AND bucket_start <= %s AND bucket_start > %s",
        (tenant, device_id, epoch_ms(until), since_ms - MAX_BUCKET_SECONDS * 1000),
    )
    # A partition may be listed once per bucket size it was written with: the
    # longest decides whether it overlaps the range.
    longest: dict[tuple[datetime, int], int] = {}
    for p in partitions:
        key = (p.bucket_start, p.shard)
        longest[key] = max(longest.get(key, 0), p.bucket_seconds)
    found = [
        Partition(start, shard, epoch_ms(start) + seconds * 1000)
        for (start, shard), seconds in longest.items()
    ]
    # Ties in a fixed order: events of one millisecond in two partitions then
    # come out in the same order on every read (history_page's cursor).
    found.sort(key=lambda p: (-p.end_ms, -epoch_ms(p.start), p.shard))
    return [p for p in found if p.end_ms > since_ms]


def unique_events(parts: Iterable[Iterable[Any]]) -> Iterator[Any]:
    """Rows of several partitions, each newest first, merged newest first.

    A redelivered event can sit in two partitions (its device changed bucket
    size or shard count in between): this keeps one copy per (ts, event_id).
    """
    merged = heapq.merge(*parts, key=lambda r: epoch_ms(r.ts), reverse=True)
    last_ts: datetime | None = None
    seen: set[int] = set()
    for r in merged:
        if r.ts != last_ts:
            last_ts, seen = r.ts, set()
        if r.event_id in seen:
            continue
        seen.add(r.event_id)
        yield r


async def history(
    db: Database,
    tenant: str,
    device_id: str,
    since: datetime,
    until: datetime,
    limit: int,
) -> list[HistoryRow]:
    """The device's newest ``limit`` events in [since, until], newest first.
    Its partitions are read newest first, HISTORY_READS at a time, until the
    events found fill the page with none older than a partition not read
    yet; so a page of a long range reads a few partitions, not all of them."""
    wanted = await history_partitions(db, tenant, device_id, since, until)
    query = (
        f"SELECT ts, event_id, state, value, value_num, metrics, tags FROM {db.keyspace}.telemetry "
        "WHERE tenant = %s AND device_id = %s AND bucket_start = %s AND shard = %s "
        "AND ts >= %s AND ts <= %s LIMIT %s"
    )
    since_ms, until_ms = epoch_ms(since), epoch_ms(until)
    parts: list[list[Any]] = []
    merged: list[Any] = []
    for first in range(0, len(wanted), HISTORY_READS):
        parts += await asyncio.gather(
            *(
                db.execute(query, (tenant, device_id, p.start, p.shard, since_ms, until_ms, limit))
                for p in wanted[first : first + HISTORY_READS]
            )
        )
        merged = list(itertools.islice(unique_events(parts), limit))
        rest = wanted[first + HISTORY_READS : first + HISTORY_READS + 1]
        # Every partition not read yet ends at or before rest[0]'s end.
        if len(merged) == limit and (not rest or epoch_ms(merged[-1].ts) >= rest[0].end_ms):
            break
    return [
        HistoryRow(
            r.ts,
            r.state,
            _value(r.value, r.value_num),
            dict(r.metrics or {}),
            dict(r.tags or {}),
            r.event_id,
        )
        for r in merged
    ]


@dataclass(frozen=True, slots=True)
class HistoryPage:
    events: list[HistoryRow]
    next_cursor: str | None


async def history_page(
    db: Database,
    tenant: str,
    device_id: str,
    since: datetime,
    until: datetime,
    limit: int,
    cursor: str | None = None,
) -> HistoryPage:
    """One page of :func:`history`, newest first. The cursor holds the time
    of the page's last event and which events at that millisecond were given
    out already, so the next page neither skips nor repeats one: their ids,
    or past CURSOR_IDS of them (a flood in one millisecond) their count.
    Events of one millisecond come in the same order on every read, so the
    count is exact too, unless another event lands in that millisecond
    between two pages."""
    if not 1 <= limit <= MAX_PAGE:
        raise bad_parameter("limit", f"must be between 1 and {MAX_PAGE} (got {limit})")
    seen: set[int] = set()
    skip = 0
    query = query_of(tenant, device_id)
    if cursor:
        try:
            last_ms, given, given_for = _unpack(cursor)
            if isinstance(given, list):
                seen = {int(i) for i in given}
            else:
                skip = int(given)
            until = datetime.fromtimestamp(0, UTC) + timedelta(milliseconds=int(last_ms))
            if skip < 0:
                raise ValueError(skip)
        except (ValueError, TypeError, OverflowError):
            raise bad_parameter("cursor", "not a cursor this server gave out") from None
        if given_for != query:
            raise bad_parameter("cursor", OTHER_QUERY)
        if skip > HISTORY_MAX_SKIP:
            # Each partition read would fetch that many rows more (and past a
            # 32-bit int, Cassandra refuses the LIMIT).
            raise bad_parameter(
                "cursor",
                f"more than {HISTORY_MAX_SKIP} events at {iso(until)} paged through; "
                "to go on, set until before that time",
            )
    rows = await history(db, tenant, device_id, since, until, limit + len(seen) + skip)
    last = epoch_ms(until)
    at_last = [r for r in rows if epoch_ms(r.ts) == last]
    given_out = {id(r) for r in at_last[:skip]} | {id(r) for r in at_last if r.event_id in seen}
    page = [r for r in rows if id(r) not in given_out][:limit]
    if len(page) < limit:
        return HistoryPage(page, None)
    end = epoch_ms(page[-1].ts)
    here = [r for r in page if epoch_ms(r.ts) == end]
    if end == last:
        ids = {r.event_id for r in here} | seen
        count = len(here) + len(seen) + skip
    else:
        ids, count = {r.event_id for r in here}, len(here)
    if not skip and len(ids) <= CURSOR_IDS:
        return HistoryPage(page, _pack([end, sorted(ids), query]))
    return HistoryPage(page, _pack([end, count, query]))


# Event ids a history cursor carries at most (about 20 characters each); past
# that it carries their count.
CURSOR_IDS = 16
# Partition reads one history query has in flight (history: newest first, as
# many as its page needs).
HISTORY_READS = 16
# Partition counts one state count has in flight (queries.state_counts).
COUNT_READS = 32
# Events of one millisecond a history cursor may count as given out: the
# page after reads that many rows more from each partition.
HISTORY_MAX_SKIP = 10_000


_SPACED_OFFSET = re.compile(r"\d \d\d(:?\d\d)?$")


def parse_time(parameter: str, text: str, now: datetime | None = None) -> datetime:
    """An RFC 3339 time (without an offset: UTC), or a duration ago with its
    unit, such as ``2h`` or ``30m`` (or ``-2h``: the same). A bare number is
    refused: a date typed as ``20261126`` or an epoch time read as seconds
    ago went back months, or decades, without a word."""
    now = now or datetime.now(UTC)
    ago = text[1:] if text.startswith("-") else text  # no RFC 3339 time starts so
    if ago.strip().replace(".", "", 1).isdigit():
        raise bad_parameter(
            parameter,
            f"{text!r} has no unit: give a duration ago such as 30m, 2h or 7d, "
            "or an RFC 3339 time such as 2026-11-26T13:00:00Z",
        )
    try:
        seconds = parse_duration(ago)
    except ValueError:
        pass
    else:
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:  # ago beyond year 1
            raise bad_parameter(parameter, f"{text!r} reaches back before year 1") from None
    try:
        # RFC 3339 allows a lower-case z (and t), which fromisoformat refuses.
        parsed = datetime.fromisoformat(text[:-1] + "Z" if text.endswith("z") else text)
    except ValueError:
        # "...T23:00:00 05:30": a "+" in a URL's query arrives as a space.
        plus = (
            " (its offset lost the +, as a + in a URL query does: send it as %2B)"
            if _SPACED_OFFSET.search(text)
            else ""
        )
        raise bad_parameter(
            parameter,
            f"{text!r} is neither an RFC 3339 time (2026-01-31T09:00:00Z, or with an "
            f"offset such as +01:00) nor a duration like 2h (one number and a unit: ms, "
            f"s, m, h or d){plus}",
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class RejectedRow:
    received_at: datetime
    topic: str
    device_id: str | None
    reason: str
    detail: str
    payload_size: int | None
    # As kept: its first limits.rejected_payload_bytes (None: none kept).
    payload: bytes | None = None

    def payload_truncated(self) -> bool:
        """More was sent than kept."""
        return (
            self.payload is not None
            and self.payload_size is not None
            and self.payload_size > len(self.payload)
        )

    def payload_text(self) -> str | None:
        """The kept payload as text when it is UTF-8 (cut inside a character
        by the limit: up to that character), else None."""
        if self.payload is None:
            return None
        try:
            return self.payload.decode()
        except UnicodeDecodeError as exc:
            if self.payload_truncated() and exc.reason == "unexpected end of data":
                return self.payload[: exc.start].decode()
            return None

    def as_json(self) -> dict[str, Any]:
        text = self.payload_text()
        encoded: str | None = None
        encoding: str | None = None
        if text is not None:
            encoded, encoding = text, "utf-8"
        elif self.payload is not None:
            encoded, encoding = base64.b64encode(self.payload).decode(), "base64"
        return {
            "received_at": iso(self.received_at),
            "topic": self.topic,
            "device_id": self.device_id,
            "reason": self.reason,
            "detail": self.detail,
            "payload_size": self.payload_size,
            "payload": encoded,
            "payload_encoding": encoding,
            "payload_truncated": self.payload_truncated(),
        }


MAX_REJECTED_HOURS = 7 * 24  # the table's TTL: nothing older is kept


async def rejected(
    db: Database, tenant: str, since: datetime, limit: int = 1000
) -> list[RejectedRow]:
    """The tenant's rejected messages since ``since`` (at most 7 days back),
    newest first, at most ``limit``: one partition per hour, newest hour first."""
    hour = 3_600_000
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    since_ms = max(epoch_ms(since), now_ms - MAX_REJECTED_HOURS * hour)
    stmt = await db.prepared(
        f"SELECT received_at, topic, device_id, reason, detail, payload_size, payload "
        f"FROM {db.keyspace}.rejected_messages "
        "WHERE tenant = ? AND hour_start = ? AND received_at >= ? LIMIT ?"
    )
    out: list[RejectedRow] = []
    start = now_ms - now_ms % hour
    while start + hour > since_ms and len(out) < limit:
        rows = await db.execute(stmt, (tenant, start, since_ms, limit - len(out)))
        out += [
            RejectedRow(
                r.received_at, r.topic, r.device_id, r.reason, r.detail, r.payload_size, r.payload
            )
            for r in rows
        ]
        start -= hour
    return out


# -- roll-ups (written by store/rollups.py) ----------------------------------

ROLLUP_STEPS = {"1m": 60, "1h": 3600}
# Rows of one step share a partition per bucket of this span (schema/005_rollups.cql).
ROLLUP_BUCKET_MS = {60: 86_400_000, 3600: 64 * 86_400_000}
# How long a range one roll-up read may cover, in windows: a week of minutes,
# over a year of hours. The window holding `since` is read too, so a range of
# exactly this length that starts inside a window returns one more.
MAX_ROLLUP_WINDOWS = 10_080


def rollup_bucket(start_ms: int, step: int) -> int:
    span = ROLLUP_BUCKET_MS[step]
    return start_ms - start_ms % span


@dataclass(frozen=True, slots=True)
class RollupRow:
    start: datetime
    count: int
    min: float
    max: float
    sum: float | None  # None: beyond the range of a double
    last: float

    def as_json(self) -> dict[str, Any]:
        return {
            "start": iso(self.start),
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "sum": self.sum,
            "last": self.last,
        }


def parse_step(text: str) -> int:
    try:
        return ROLLUP_STEPS[text]
    except KeyError:
        raise bad_parameter("step", f"expected 1m or 1h (got {text!r})") from None


def check_order(
    since: datetime,
    until: datetime,
    *,
    since_given: bool,
    flag: str = "",
    until_given: bool = True,
    ahead: float = 0.0,
) -> None:
    """``since`` before ``until``, or the QueryError naming the one given:
    ``until`` alone before the default ``since`` (24 h ago) blamed ``since``,
    which the user never gave. ``flag``: ``--`` for the CLI's option names;
    ``ahead``: how far past now the default ``until`` is (history's:
    ``limits.max_future_skew``), as said when it was not given."""
    if since < until:
        return
    if since_given:
        # "before until" of a range with no until given read as a mistake of ours.
        default = "now plus limits.max_future_skew" if ahead else "now"
        now = "" if until_given else f" ({default}, unless {flag}until is given)"
        raise bad_parameter(f"{flag}since", f"must be before {flag}until{now}")
    raise bad_parameter(f"{flag}until", f"must be after {flag}since, 24 h ago unless given")


def check_rejected_since(since: datetime, now: datetime, *, flag: str = "") -> None:
    """``since`` of a rejected-messages read, refused in the future: nothing
    was rejected then, and an empty answer said nothing of why. The CLI's and
    the API's rule (``flag``: ``--`` for the CLI's option names)."""
    if since > now:
        raise bad_parameter(f"{flag}since", f"{iso(since)} is in the future")


def check_rollup_range(
    step: int, since: datetime, until: datetime, *, since_given: bool = True
) -> tuple[int, int]:
    """The epoch ms of the first window of [since, until) and of its end, or
    the QueryError that names the bad parameter (checked before any read):
    ``since`` when it was given, else ``until`` (``since`` is then the
    default, 24 h ago, which the user never gave)."""
    since_ms, until_ms = epoch_ms(since), epoch_ms(until)
    if since_ms >= until_ms:
        raise bad_parameter("since", "must be before until")
    step_ms = step * 1000
    first = since_ms - since_ms % step_ms
    if (until_ms - first) // step_ms > MAX_ROLLUP_WINDOWS:
        span = f"the range holds more than {MAX_ROLLUP_WINDOWS} windows of {step} s "
        span += f"(from {iso(since)} to {iso(until)})"
        # An hour is the longest step: no longer one to suggest.
        longer = ", or take a longer step" if step < 3600 else ""
        if since_given:
            # Either end may be the one to move: say both.
            move = "move since later or until earlier"
            raise bad_parameter("since", f"{span}: {move}{longer}")
        move = "move until earlier (since is 24 h ago unless given)"
        raise bad_parameter("until", f"{span}: {move}{longer}")
    return first, until_ms


# The roll-up worker's cursor's name in rollup_progress (store/rollups.py).
ROLLUP_PROGRESS = "default"
# A worker this far behind is said to be, by itself in the log and by the
# roll-up answers.
ROLLUP_BEHIND_S = 600.0
# The cursor and the lease's holder, as the worker, the answers and `gateway
# check` read them ({keyspace} filled in by the caller).
ROLLUP_CURSOR_CQL = (
    "SELECT toUnixTimestamp(minute) AS minute_ms FROM {keyspace}.rollup_progress WHERE name = ?"
)
ROLLUP_HOLDER_CQL = "SELECT holder FROM {keyspace}.worker_leases WHERE name = ?"


def rollup_behind_s(cursor_ms: float, now_ms: float, grace_s: float) -> float:
    """How long ago the worker's next minute (``cursor_ms``) came due: a
    minute after it began, plus the grace (negative: not due yet)."""
    return (now_ms - cursor_ms) / 1000 - 60 - grace_s


async def rollups_done_until(db: Database) -> datetime | None:
    """The roll-up worker's cursor: the first minute of writes it has not
    finished, so windows before it are done (a late event marks its window
    again); None when no gateway has started one in this keyspace."""
    stmt = await db.prepared(ROLLUP_CURSOR_CQL.format(keyspace=db.keyspace))
    rows = await db.execute(stmt, (ROLLUP_PROGRESS,))
    return datetime.fromtimestamp(rows[0].minute_ms / 1000, UTC) if rows else None


async def rollup_worker(db: Database) -> str | None:
    """Which instance runs the roll-up worker (the MQTT client id holding its
    lease, store/lease.py); None when none does."""
    stmt = await db.prepared(ROLLUP_HOLDER_CQL.format(keyspace=db.keyspace))
    rows = await db.execute(stmt, (ROLLUP_PROGRESS,))
    return rows[0].holder if rows else None


async def rollups(
    db: Database,
    tenant: str,
    device_id: str,
    metric: str,
    step: int,
    since: datetime,
    until: datetime,
) -> list[RollupRow]:
    """The ``step`` windows of ``metric`` from the one holding ``since`` to
    the last that starts before ``until``, oldest first; windows without
    stored raw rows are absent."""
    first, until_ms = check_rollup_range(step, since, until)
    stmt = await db.prepared(
        f"SELECT start, count, min, max, sum, last FROM {db.keyspace}.rollups "
        "WHERE tenant = ? AND device_id = ? AND step = ? AND bucket = ? AND metric = ? "
        "AND start >= ? AND start < ?"
    )
    buckets = range(rollup_bucket(first, step), until_ms, ROLLUP_BUCKET_MS[step])
    parts = await asyncio.gather(
        *(db.execute(stmt, (tenant, device_id, step, b, metric, first, until_ms)) for b in buckets)
    )
    return [
        RollupRow(r.start, r.count, r.min, r.max, r.sum, r.last) for rows in parts for r in rows
    ]


# -- metadata (written by store/metadata.py) ---------------------------------

# Entries one metadata answer lists at most: each query reads one more, so
# that a list cut there says so (meta_cut). metadata.max_per_tenant may be
# set far above it (10,000,000).
MAX_META = 10_000


def first_names(names: list[str], most: int = 20, show: Callable[[str], str] = repr) -> str:
    """The first ``most`` of ``names`` in order, each as ``show`` gives it:
    the hint after a misspelt name (the CLI's and the API's)."""
    ordered = sorted(names)
    shown = ", ".join(show(name) for name in ordered[:most])
    return shown + (", ..." if len(ordered) > most else "")


def meta_cut(found: list[str]) -> tuple[list[str], bool]:
    """A metadata list as answered (at most MAX_META), and whether it was cut."""
    return found[:MAX_META], len(found) > MAX_META


async def meta_metrics(db: Database, tenant: str) -> list[str]:
    stmt = await db.prepared(
        f"SELECT metric FROM {db.keyspace}.meta_metrics WHERE tenant = ? LIMIT {MAX_META + 1}"
    )
    return [r.metric for r in await db.execute(stmt, (tenant,))]


async def meta_tag_keys(db: Database, tenant: str) -> list[str]:
    stmt = await db.prepared(
        f"SELECT tag_key FROM {db.keyspace}.meta_tag_keys WHERE tenant = ? LIMIT {MAX_META + 1}"
    )
    return [r.tag_key for r in await db.execute(stmt, (tenant,))]


async def meta_tag_values(db: Database, tenant: str, key: str) -> list[str]:
    stmt = await db.prepared(
        f"SELECT tag_value FROM {db.keyspace}.meta_tag_values WHERE tenant = ? AND tag_key = ? "
        f"LIMIT {MAX_META + 1}"
    )
    return [r.tag_value for r in await db.execute(stmt, (tenant, key))]


async def meta_tag_devices(db: Database, tenant: str, key: str, value: str) -> list[str]:
    """Devices that have carried tag ``key`` = ``value`` (ever: entries are never removed)."""
    stmt = await db.prepared(
        f"SELECT device_id FROM {db.keyspace}.meta_tag_devices "
        f"WHERE tenant = ? AND tag_key = ? AND tag_value = ? LIMIT {MAX_META + 1}"
    )
    return [r.device_id for r in await db.execute(stmt, (tenant, key, value))]


async def quota_admitted(db: Database, tenant: str) -> int:
    """The devices the tenant's device quota has admitted (at least those
    listed in quota_devices; see store/quota.py)."""
    stmt = await db.prepared(f"SELECT admitted FROM {db.keyspace}.quota_counts WHERE tenant = ?")
    rows = await db.execute(stmt, (tenant,))
    return int(rows[0].admitted or 0) if rows else 0


async def quota_listed(db: Database, tenant: str, buckets: int) -> int | None:
    """The devices quota_devices lists for the tenant (``buckets`` partitions:
    store/quota.py's QUOTA_BUCKETS), which the count may run above; None when
    Cassandra could not count them in time (a quota of millions)."""
    stmt = await db.prepared(
        f"SELECT COUNT(*) AS n FROM {db.keyspace}.quota_devices WHERE tenant = ? AND bucket = ?"
    )
    try:
        answers = await asyncio.gather(*(db.execute(stmt, (tenant, b)) for b in range(buckets)))
    except (OperationTimedOut, ReadTimeout):
        return None
    return sum(int(rows[0].n) for rows in answers)


async def meta_entries(db: Database, tenant: str, progress: Callable[[int, int], None]) -> int:
    """The tenant's metadata entries as the four tables hold them: metric
    names, tag keys, tag values, and (tag value, device) pairs. One read per
    table and tag key, one per tag value (COUNT_READS at once);
    ``progress(done, of)`` is told as tag values are counted."""
    ks = db.keyspace
    metrics = await db.prepared(f"SELECT COUNT(*) AS n FROM {ks}.meta_metrics WHERE tenant = ?")
    keys = await db.prepared(f"SELECT tag_key FROM {ks}.meta_tag_keys WHERE tenant = ?")
    values = await db.prepared(
        f"SELECT tag_value FROM {ks}.meta_tag_values WHERE tenant = ? AND tag_key = ?"
    )
    devices = await db.prepared(
        f"SELECT COUNT(*) AS n FROM {ks}.meta_tag_devices "
        "WHERE tenant = ? AND tag_key = ? AND tag_value = ?"
    )
    total = int((await db.execute(metrics, (tenant,)))[0].n)
    tag_keys = [r.tag_key for r in await db.execute(keys, (tenant,))]
    pairs = [
        (key, r.tag_value) for key in tag_keys for r in await db.execute(values, (tenant, key))
    ]
    total += len(tag_keys) + len(pairs)
    done = 0
    progress(done, len(pairs))
    for first in range(0, len(pairs), COUNT_READS):
        group = pairs[first : first + COUNT_READS]
        counts = await asyncio.gather(*(db.execute(devices, (tenant, k, v)) for k, v in group))
        total += sum(int(rows[0].n) for rows in counts)
        done += len(group)
        progress(done, len(pairs))
    return total


async def meta_capped(db: Database, tenant: str, config: Config) -> bool:
    """Whether the tenant has reached ``metadata.max_per_tenant``: entries
    since are not recorded, so its metadata lists may be incomplete."""
    return await meta_entry_count(db, tenant) >= config.metadata.max_per_tenant


async def meta_entry_count(db: Database, tenant: str) -> int:
    """The entries the tenant has taken against ``metadata.max_per_tenant``
    (at least those stored; see store/metadata.py)."""
    stmt = await db.prepared(
        f"SELECT reserved FROM {db.keyspace}.meta_entry_counts WHERE tenant = ?"
    )
    rows = await db.execute(stmt, (tenant,))
    return int(rows[0].reserved or 0) if rows else 0
