"""A lease in Cassandra: one holder at a time for a named job.

With several gateway instances, each may run the roll-up worker
(``rollups.worker``), and one at a time does: the one that holds the job's
row in ``worker_leases``. The others stand by and take the row over once it
is released (a stop) or has expired (a crash, a lost link), so roll-ups go on
when the instance that ran them goes away, without a person moving
``rollups.worker`` to another one.

How:

* **Taken** by ``INSERT ... IF NOT EXISTS USING TTL`` (a lightweight
  transaction), **renewed** every third of ``ttl`` by ``UPDATE ... USING TTL
  ... IF holder = me``, **released** by ``DELETE ... IF holder = me``. The row
  expires by its TTL when its holder stops renewing it.
* **The holder is the instance's MQTT client id**, unique per instance by
  necessity (two sessions with one id end each other). A restarted instance
  finds its own row and holds it at once, rather than waiting out the TTL of
  the lease its previous process left; a transaction retried after a timeout
  that had in fact applied finds its own row too, and is held.
* **Given up before it can have expired.** A holder counts the lease as
  its own until ``ttl`` less a second (MARGIN: a TTL is counted in whole
  seconds) after its last renewal was sent; a renewal still unanswered then
  counts as failed, and a holder that could not renew (Cassandra
  unreachable from it) stops working. The job must still be one that two
  holders may do at once (the roll-up worker's writes are idempotent, the
  later read wins: a holder that stalls, a pause of its process, may go on
  for a moment after a standby took over), so the lease saves repeated work
  and never carries correctness.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..aio import gather_all
from .write_session import Prepared, WriteSession

log = logging.getLogger(__name__)

# Seconds a lease is counted as ours for less than its TTL (Lease._valid).
MARGIN = 1.0


class LeaseLost(Exception):
    """The lease is another holder's now, or could not be renewed in time."""


class Lease:
    """The lease on ``name`` for ``holder`` (module docstring)."""

    def __init__(
        self,
        session: WriteSession,
        name: str,
        holder: str,
        ttl: float,
        *,
        what: str,
    ) -> None:
        self._session = session
        self.name = name
        self.holder = holder
        self.ttl = ttl
        self.what = what  # for the log: "roll-ups: standing by; ..."
        self._valid_until = 0.0  # by time.monotonic(): held until then at the latest
        self._since_ms = 0  # when this holder took it (the row's since)
        self.other: str | None = None  # the holder found last time it was not ours
        self._failing = False  # taking it failed, and has not worked since
        self._asked = False  # a take was sent and not yet answered

    async def prepare(self) -> None:
        prepare = self._session.prepare
        self._take, self._renew, self._release = await gather_all(
            prepare(
                "INSERT INTO {keyspace}.worker_leases (name, holder, since) VALUES (?, ?, ?) "
                "IF NOT EXISTS USING TTL ?",
                timestamps=(2,),
            ),
            prepare(
                "UPDATE {keyspace}.worker_leases USING TTL ? SET holder = ?, since = ? "
                "WHERE name = ? IF holder = ?",
                timestamps=(2,),
            ),
            prepare("DELETE FROM {keyspace}.worker_leases WHERE name = ? IF holder = ?"),
        )

    async def hold(
        self,
        work: Callable[[], Coroutine[Any, Any, None]],
        lost: Callable[[LeaseLost], None],
        standing_by: Callable[[], Awaitable[None]],
    ) -> None:
        """Until cancelled: take the lease when it is free and run ``work()``
        while it is renewed; stand by while another holder has it, awaiting
        ``standing_by()`` after each try. A lost lease cancels ``work()``
        (``lost`` is told why) and it stands by again. Cancelled, or once
        ``work()`` has returned, it releases the lease, so that a standby takes
        it at its next try. Here, not in the compiled worker: an ``await`` in a
        ``finally`` of a mypyc-compiled coroutine loses its cancellation
        (tests/test_compiled.py)."""
        try:
            while True:
                if await self._try_take():
                    working = asyncio.create_task(work())
                    keeping = asyncio.create_task(self._keep())
                    try:
                        await asyncio.wait({working, keeping}, return_when=FIRST_COMPLETED)
                    finally:
                        for task in (working, keeping):
                            task.cancel()
                        await asyncio.gather(working, keeping, return_exceptions=True)
                    failed = None if keeping.cancelled() else keeping.exception()
                    if isinstance(failed, LeaseLost):
                        lost(failed)  # whatever work() did when cancelled
                    elif failed is not None:
                        raise failed
                    elif not working.cancelled():
                        working.result()  # raises what work() raised
                        return  # work() is done: released below
                else:
                    await standing_by()
                await asyncio.sleep(self.renew_every)
        finally:
            if self.held or self._asked:
                await self.release()

    async def _try_take(self) -> bool:
        """:meth:`take` once; an error is logged (once while it lasts) and
        means not taken."""
        other = self.other
        try:
            taken = await self.take()
        except Exception as exc:
            if not self._failing:
                log.warning("%s: its lease could not be taken, trying again: %s", self.what, exc)
            self._failing = True
            self.other = None  # not known any more
            return False
        self._failing = False
        if not taken and self.other != other:
            log.info("%s: standing by; %r holds the lease", self.what, self.other)
        return taken

    async def _keep(self) -> None:
        """Renew every third of the TTL until the lease is lost: another
        holder has it, or it went unrenewed for its TTL (LeaseLost)."""
        while True:
            # Not past the lease, when renewals fail fast (an unavailable
            # replica) and the next try would come after it.
            await asyncio.sleep(min(self.renew_every, self._valid_until - time.monotonic()))
            if not self.held:
                raise LeaseLost("not renewed within rollups.lease")
            try:
                # A renewal still unanswered when the lease may have expired
                # is a failed one: the request could take longer than the TTL.
                async with asyncio.timeout(max(0.0, self._valid_until - time.monotonic())):
                    await self.renew()
            except LeaseLost:
                raise
            except Exception as exc:
                why = str(exc) or type(exc).__name__
                if not self.held:
                    raise LeaseLost(f"not renewed within rollups.lease: {why}") from exc
                log.info("%s: lease not renewed, trying again: %s", self.what, why)

    @property
    def held(self) -> bool:
        return time.monotonic() < self._valid_until

    @property
    def renew_every(self) -> float:
        return self.ttl / 3

    async def _lwt(self, prepared: Prepared, values: tuple[object, ...]) -> dict[str, object]:
        session = self._session
        rows = await session.execute(session.bind(prepared, values))
        return rows[0]

    async def take(self) -> bool:
        """Try once to hold the lease (a transient error propagates); whether
        it is ours now."""
        sent = time.monotonic()
        now_ms = int(time.time() * 1000)
        self._asked = True  # cancelled before the answer, it may be ours: released
        row = await self._lwt(self._take, (self.name, self.holder, now_ms, self._ttl_s))
        self._since_ms = now_ms
        if not row["[applied]"]:
            if row.get("holder") != self.holder:
                self._asked = False
                self.other = str(row.get("holder"))
                return False
            # Ours already: a previous process of this instance, or this
            # insert retried after a timeout that had applied it.
            if not await self._renewed(sent):  # held until a TTL from now if so
                self._asked = False
                return False
        else:
            self._valid(sent)
        self._asked = False
        self.other = None
        return True

    async def renew(self) -> None:
        """Renew the lease; LeaseLost when it is another holder's now. A
        transient error propagates (the caller goes on trying until
        :attr:`held` turns false)."""
        if not await self._renewed(time.monotonic()):
            raise LeaseLost(
                "the lease expired before it was renewed"
                if self.other is None
                else f"{self.other!r} holds the lease now"
            )

    async def _renewed(self, sent: float) -> bool:
        row = await self._lwt(
            self._renew, (self._ttl_s, self.holder, self._since_ms, self.name, self.holder)
        )
        if not row["[applied]"]:
            self._valid_until = 0.0
            self.other = None if row.get("holder") is None else str(row.get("holder"))
            return False
        self._valid(sent)
        return True

    def _valid(self, sent: float) -> None:
        """Held until ``ttl`` after the request was sent, less MARGIN:
        Cassandra counts a TTL in whole seconds, so the row may expire up to
        a second early."""
        self._valid_until = sent + self.ttl - MARGIN

    async def release(self) -> None:
        """Give the lease up, so that a standby takes it at its next try
        rather than after the TTL (a stop); no error escapes. Only our own
        row is deleted (``IF holder = me``)."""
        self._valid_until = 0.0
        self._asked = False
        try:
            await self._lwt(self._release, (self.name, self.holder))
        except Exception as exc:  # the TTL ends it anyway
            log.info("%s: lease not released (it expires in %.0f s): %s", self.what, self.ttl, exc)

    @property
    def _ttl_s(self) -> int:
        return math.ceil(self.ttl)
