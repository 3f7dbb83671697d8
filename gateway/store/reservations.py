"""Per-tenant counts held under a cap by compare-and-set, shared by every
gateway instance: the metadata entries a tenant has taken
(``meta_entry_counts``, metadata.py) and the devices its quota has admitted
(``quota_counts``, quota.py).

A count moves from N to N + (what fits under the cap) in one lightweight
transaction (``IF <column> = N``; the first one ``IF NOT EXISTS``), awaited
before what it grants is written: racing instances never together pass the
cap, and one of them always wins. An instance that loses learns the count
from the answer and tries again, up to MAX_ATTEMPTS times. Not a counter
column: a counter update cannot be made conditional, and add-then-check with
counters lets racing instances deny each other for good.

The count errs on the side of fewer, never more: a transaction retried after
a timeout it had in fact applied counts twice, and two instances that both
find an item absent both count it. Each tenant's count as last seen is
remembered (an LRU of MAX_TENANTS): the expected value of the next
compare-and-set, and whether the tenant is at its cap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import GatewayError
from ..lru import LRU
from .database import DICT_ROWS, Database
from .requests import Requests
from .write_session import Prepared, WriteSession

# Tenants whose counts are remembered (LRU): a forgotten one costs one more
# compare-and-set, or one read.
MAX_TENANTS = 10_000
# Compare-and-sets per tenant per call: each one lost means another instance
# won, so this many instances may race before one call is capped.
MAX_ATTEMPTS = 8


class Reserved(NamedTuple):
    granted: int  # how many were taken
    raced: bool  # a compare-and-set lost: another instance moved the count since last seen
    took: float  # seconds the compare-and-sets took


class Reservations:
    """One table's counts: ``table (tenant text PRIMARY KEY, <column> bigint)``."""

    _first: Prepared
    _move: Prepared
    _read: Prepared

    def __init__(
        self,
        requests: Requests,
        table: str,
        column: str,
        on_attempt: Callable[[], None],
        on_evict: Callable[[], None] = lambda: None,
    ) -> None:
        self._requests = requests
        self._table = table
        self._column = column
        self._on_attempt = on_attempt  # each compare-and-set sent
        self._on_evict = on_evict  # a tenant's count forgotten at the LRU's bound
        # Tenant -> its count as last seen.
        self._counts: LRU[str, int] = LRU(MAX_TENANTS)

    @property
    def cache(self) -> LRU[str, int]:
        """The tenants' counts as last seen (for the metrics)."""
        return self._counts

    async def prepare(self, session: WriteSession) -> None:
        table, column = self._table, self._column
        # Together: each is a round trip, a second or more over a slow link.
        self._first, self._move, self._read = await asyncio.gather(
            session.prepare(
                f"INSERT INTO {{keyspace}}.{table} (tenant, {column}) VALUES (?, ?) IF NOT EXISTS"
            ),
            session.prepare(
                f"UPDATE {{keyspace}}.{table} SET {column} = ? WHERE tenant = ? IF {column} = ?"
            ),
            session.prepare(f"SELECT {column} FROM {{keyspace}}.{table} WHERE tenant = ?"),
        )

    def _remember(self, tenant: str, count: int) -> None:
        if self._counts.put(tenant, count) is not None:
            self._on_evict()

    def known(self, tenant: str) -> int | None:
        """The tenant's count as last seen; None if not seen."""
        return self._counts.peek(tenant)

    async def refresh(self, tenant: str) -> int:
        """Read the tenant's count again (0 without a row): an operator may have
        lowered it (``gateway quota --release``)."""
        rows = await self._requests.execute(self._read, (tenant,))
        count = int(rows[0][self._column]) if rows and rows[0][self._column] is not None else 0
        self._remember(tenant, count)
        return count

    async def reserve(self, tenant: str, count: int, cap: int) -> Reserved:
        """Take up to ``count`` more under ``cap``: how many were granted, and
        whether another instance moved the count meanwhile."""
        known = self._counts.get(tenant)  # None: no row seen yet
        granted = 0
        raced = False
        started = time.monotonic()
        for _ in range(MAX_ATTEMPTS):
            before = known or 0
            allowed = min(count, cap - before)
            if allowed <= 0:
                break
            self._on_attempt()
            if known is None:
                rows = await self._requests.execute(self._first, (tenant, allowed))
            else:
                rows = await self._requests.execute(self._move, (before + allowed, tenant, known))
            row = rows[0]
            if row["[applied]"]:
                granted, known = allowed, before + allowed
                break
            # Another instance moved it first (or our own attempt, retried
            # after a timeout, did: then it counts twice, fewer, never more),
            # or, a first insert after a restart, the count is only now
            # learnt: either way items may have been taken just now. The
            # answer carries the count: try again from there. No count in
            # the answer: the row is gone (an operator reset the tenant), so
            # start it again.
            raced = True
            value = row.get(self._column)
            known = None if value is None else int(value)
        if known is not None:
            self._remember(tenant, known)
        return Reserved(granted, raced, time.monotonic() - started)

    async def give_back(self, tenant: str, count: int) -> None:
        """Take ``count`` off the tenant's count (never below 0): slots taken
        for items that turned out to be there already."""
        for _ in range(MAX_ATTEMPTS):
            before = await self.refresh(tenant)
            after = max(0, before - count)
            if after == before:
                return
            self._on_attempt()
            rows = await self._requests.execute(self._move, (after, tenant, before))
            if rows[0]["[applied]"]:
                self._remember(tenant, after)
                return
        # Others kept moving it: the count stays high, fewer items, never more.


async def recount(
    db: Database,
    table: str,
    column: str,
    tenant: str,
    read: Callable[[], Awaitable[int]],
    counted: Callable[[], Awaitable[int | None]],
    what: str,
) -> tuple[int, int]:
    """Set a tenant's count (``table``.``column``, as ``read()`` gives it) to
    what ``counted()`` finds the tables hold, by compare-and-set: counted
    slots never written are given back, and a count below the rows (its row
    deleted by hand) is raised to them. (count before, count after.) Tried
    again while gateways move the count meanwhile, up to MAX_ATTEMPTS times;
    ``what`` names the count in the errors."""
    for _ in range(MAX_ATTEMPTS):
        before = await read()
        found = await counted()
        if found is None:
            raise GatewayError(
                f"could not count the {what} of tenant {tenant!r} in time; try again"
            )
        if before == found or await move_count(db, table, column, tenant, before, found):
            return before, found
    raise GatewayError(
        f"the {what} count of tenant {tenant!r} kept moving (gateways adding to it): "
        "nothing was recounted; try again when they are quiet"
    )


async def move_count(
    db: Database, table: str, column: str, tenant: str, before: int, after: int
) -> bool:
    """The tenant's count from ``before`` to ``after`` by compare-and-set (a
    count of 0 may be no row yet: then it is made); whether it applied."""
    ks = db.keyspace
    move = await db.prepared(
        f"UPDATE {ks}.{table} SET {column} = ? WHERE tenant = ? IF {column} = ?"
    )
    rows = await db.execute(move, (after, tenant, before), profile=DICT_ROWS)
    if rows[0]["[applied]"] or before or column in rows[0]:
        return bool(rows[0]["[applied]"])
    first = await db.prepared(
        f"INSERT INTO {ks}.{table} (tenant, {column}) VALUES (?, ?) IF NOT EXISTS"
    )
    rows = await db.execute(first, (tenant, after), profile=DICT_ROWS)
    return bool(rows[0]["[applied]"])
