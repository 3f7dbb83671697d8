"""One Cassandra request at a time, retried until it succeeds or cannot.

Every statement the gateway sends goes through :class:`Requests`: the sink's
batches, the latest-state reads and state registrations, and metadata's
existence reads and entry counts. Promises:

* Timeouts, unavailable replicas and lost connections (the write session's
  ``transient`` errors) are retried with capped exponential backoff and full
  jitter, which is safe because every write is idempotent (fixed keys,
  event-time write timestamps) and every read is a read. The one exception,
  metadata's compare-and-set of a tenant's entry count, errs on the safe
  side when a retry counts twice (``metadata.py``).
* After ``cassandra.give_up_after`` seconds of failing, counted for each
  request from its own first failure, :class:`WritesFailing` is raised, and
  on an error retrying cannot fix :class:`SinkError`: the gateway stops (in
  spool mode, on the first, it spools until Cassandra answers: app.py). The
  messages concerned were never acknowledged (or are in the spool), so
  nothing is lost. Other requests'
  answers do not reset that clock: with one token range short of replicas
  (two of three down at RF 3), its writes fail while the rest succeed.
* When a request that had failed succeeds on a retry (Cassandra is back), or
  a new driver session replaced one that gave its host up
  (``cassandra.renew_after``), every request sleeping in backoff retries at
  once instead of finishing its sleep. An answer to a request that never
  failed wakes nobody: it says nothing of the failing ones' partitions, and
  woken by each one, a failing request retried once per other answer.
* :attr:`Requests.failing_for` is the time since the oldest request still
  failing first failed; the first failure of a run is logged, and the run's
  end when no request is failing any more, once each.
* Every attempt's outcome is reported to the in-flight limit (``limit.py``):
  its latency when answered, an overload when it failed transiently.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..aio import backoff
from ..config import CassandraConfig
from ..errors import SinkError, WritesFailing
from ..stats import Stats
from .limit import InFlightLimit
from .write_session import Prepared, Rows, WriteSession

log = logging.getLogger(__name__)

BACKOFF_MIN = 0.05
BACKOFF_MAX = 10.0
# Last values per read of :meth:`Requests.read_keys` (one ``IN`` list): a chunk
# of 500 devices met for the first time costs 5 requests, not 500.
IN_MAX = 100
# What :meth:`Requests.probe` asks: small, and answered by any node.
PROBE = "SELECT release_version FROM system.local"
# A key read by :meth:`Requests.read_keys`: partition (or prefix), last value.
Key = tuple[str, ...]


class Requests:
    def __init__(
        self, session: WriteSession, config: CassandraConfig, stats: Stats, limit: InFlightLimit
    ) -> None:
        self.session = session
        self.limit = limit
        self._transient = session.transient
        self._give_up_after = config.give_up_after
        self._stats = stats
        # When each request still failing first failed (at most one entry per
        # request under way, which the in-flight limit and the readers bound),
        # and when the current run of failures began.
        self._failing: dict[int, float] = {}
        self._next_id = 0
        self._failing_since: float | None = None
        # Since when the idle link's probe (:meth:`probe`) fails, if it does.
        self._probe_failing_since: float | None = None
        self.answered_at = time.monotonic()  # the last answer Cassandra gave
        # Set (and replaced) when requests succeed again after failures, or
        # when a new driver session replaced one that gave its host up.
        self._recovered = asyncio.Event()
        session.renewed = self._wake

    @property
    def failing_for(self) -> float | None:
        """Seconds the oldest request still failing (or, while none are sent,
        the link's probe) has been failing, or None when none is."""
        failing = self._failing
        since = min(failing.values()) if failing else self._probe_failing_since
        return None if since is None else time.monotonic() - since

    async def prepare_probe(self) -> None:
        """Prepare :meth:`probe`'s statement (at start, with the others: once
        the link is down it cannot be prepared)."""
        self._probe = await self.session.prepare(PROBE)

    async def probe(self) -> None:
        """Ask Cassandra something small, once, not retried: while nothing is
        written, :attr:`failing_for` would otherwise say nothing of a link
        that went down (/healthz said "ok" for as long as a quiet site sent
        nothing). The driver's request timeout bounds it."""
        try:
            await self.session.execute(self.session.bind(self._probe, ()))
        except Exception:  # whatever the driver says of a dead link: it is down
            if self._probe_failing_since is None:
                self._probe_failing_since = time.monotonic()
                log.warning("Cassandra does not answer (no writes meanwhile)")
            return
        self.answered_at = time.monotonic()
        if self._probe_failing_since is not None:
            log.warning("Cassandra answers again")
            self._probe_failing_since = None

    def _wake(self) -> None:
        """Every request sleeping in backoff retries now."""
        self._recovered.set()
        self._recovered = asyncio.Event()

    def bind(self, prepared: Prepared, values: tuple[Any, ...]) -> Any:
        try:
            return self.session.bind(prepared, values)
        except Exception as exc:
            # A value the driver cannot encode: a bug, not a bad message (decode
            # validated it). Stop with the statement named; nothing was acked.
            raise SinkError(f"cannot bind a value for {prepared.cql!r}: {short(exc)}") from None

    async def execute(self, prepared: Prepared, values: tuple[Any, ...]) -> Rows:
        """One statement (a read, or a write outside the sink's batches)."""
        return await self.send(self.bind(prepared, values), 1)

    async def execute_in_slot(self, prepared: Prepared, values: tuple[Any, ...]) -> Rows:
        """:meth:`execute` holding an in-flight slot (``limit.py``) as the sink's
        writes do: for reads that come many at once (metadata's existence
        reads), which then queue behind the limit instead of all going out."""
        limit = self.limit
        await limit.acquire()
        try:
            return await self.execute(prepared, values)
        finally:
            limit.release()

    async def read_keys(
        self,
        keys: Iterable[Key],
        statement: Callable[[Key], tuple[Prepared, tuple[Any, ...]]],
        column: str,
        *,
        in_slot: bool = False,
    ) -> dict[Key, dict[str, Any]]:
        """The rows of many keys, each a partition (or its prefix) plus one last
        value: one read per prefix and up to IN_MAX last values, at once.
        ``statement(prefix)`` gives the prepared statement, which ends in
        ``... IN ?``, and the values before that list; ``column`` is the one
        that holds a row's last value. Keys without a row are left out."""
        by_prefix: dict[Key, list[str]] = {}
        for key in keys:
            by_prefix.setdefault(key[:-1], []).append(key[-1])
        reads = [
            (prefix, values[start : start + IN_MAX])
            for prefix, values in by_prefix.items()
            for start in range(0, len(values), IN_MAX)
        ]
        execute = self.execute_in_slot if in_slot else self.execute

        async def read(prefix: Key, values: list[str]) -> Rows:
            prepared, before = statement(prefix)
            return await execute(prepared, (*before, values))

        answers = await asyncio.gather(*(read(prefix, values) for prefix, values in reads))
        return {
            (*prefix, row[column]): row
            for (prefix, _), rows in zip(reads, answers, strict=True)
            for row in rows
        }

    async def send(self, request: Any, rows: int) -> Rows:
        """A bound statement or batch of ``rows`` statements, with retries."""
        stats = self._stats
        limit = self.limit
        attempt = 0
        first_failed: float | None = None
        me = self._next_id
        self._next_id += 1
        try:
            while True:
                stats.requests += 1
                stats.rows += rows
                sent = time.monotonic()
                try:
                    result, answered = await self.session.execute_timed(request)
                except self._transient as exc:
                    limit.overloaded()
                    now = time.monotonic()
                    if first_failed is None:
                        first_failed = now
                        self._failed(me, now, exc)
                    if now - first_failed >= self._give_up_after:
                        raise WritesFailing(
                            f"Cassandra writes failing for over {self._give_up_after:.0f} s "
                            f"(cassandra.give_up_after); last error: {short(exc)}",
                            time.time() - (now - first_failed),
                        ) from None
                    attempt += 1
                    stats.retries += 1
                except Exception as exc:
                    raise SinkError(f"Cassandra refused a write: {short(exc)}") from None
                else:
                    limit.answered(answered - sent)
                    self.answered_at = answered
                    self._probe_failing_since = None
                    if first_failed is not None:
                        self._recovered_one(me)
                    return result
                # A transient failure. Waited here, not in the except clause:
                # compiled (mypyc) code suspended in one leaves the error as the
                # thread's current exception, and every exception raised meanwhile,
                # in any task, was chained to it (tests/test_outage.py).
                # The last sleep ends at give_up_after, where one more attempt
                # decides: a full one could end 2.6 times past it (a 3.2 s
                # sleep begun at 1.9 s of 2), and a CI run's give-up took 5.2 s.
                delay = min(
                    backoff(attempt, BACKOFF_MIN, BACKOFF_MAX) * (0.5 + random.random() / 2),
                    first_failed + self._give_up_after - time.monotonic(),
                )
                recovered = self._recovered
                try:
                    async with asyncio.timeout(delay):
                        await recovered.wait()
                except TimeoutError:
                    pass
        finally:
            if first_failed is not None:  # given up, or cancelled, while failing
                self._failing.pop(me, None)

    def _failed(self, me: int, now: float, exc: BaseException) -> None:
        """Request ``me`` failed for the first time."""
        if not self._failing:
            self._failing_since = now
            log.warning("Cassandra request failed, retrying: %s", short(exc))
        self._failing[me] = now

    def _recovered_one(self, me: int) -> None:
        """Request ``me``, which had failed, was answered: Cassandra answers
        again, so the others retry now; the run ends with the last one."""
        self._failing.pop(me, None)
        since = self._failing_since
        if not self._failing and since is not None:
            log.warning("Cassandra writes succeed again after %.1f s", time.monotonic() - since)
            self._failing_since = None
        self._wake()


def short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:297] + "..."
