"""Rotate state partitions into fresh generations, so tombstones never pile up.

Every device that leaves a state leaves a row tombstone in that state's
partition of ``latest_events_by_state``, and a read of the partition must step
over every one of them until compaction purges it, ``gc_grace_seconds`` (ten
days) later. In a 110,000-device tenant a rare state's partition then holds
110,000 tombstones around its few live rows: slow to read at best, and past
``tombstone_failure_threshold`` not readable at all. Rotation keeps each
partition's tombstones in the hundreds, whatever the tenant's history:

1. **Announce.** When latest.py finds a partition *due* (enough deletes sent
   into its generation ``g``; see ``pipeline.rotate_after_deletes``), the
   pipeline lets the writes in flight land and calls :meth:`begin_due`. A
   lightweight transaction on ``state_partitions`` sets ``next_gen = g + 1``;
   from then on writers send every insert and delete of the partition to both
   generations. Other instances learn it within ``pipeline.states_refresh``.
2. **Copy**, ``pipeline.rotation_wait`` later (when every writer dual-writes):
   page through ``g`` and insert its live rows into ``g + 1`` *with their own
   write timestamps* (``USING TIMESTAMP WRITETIME``). Cassandra then resolves
   the copies against the dual writes exactly as it resolved the originals: a
   delete sent during the copy wins over an older copied row, a newer insert
   wins over it. Copying twice writes the same cells, so any instance may
   finish an interrupted rotation.
3. **Switch**: a second transaction sets ``gen = g + 1`` (``IF gen = g AND
   next_gen = g + 1``). Readers read ``g + 1`` from now on, writers write only
   it.
4. **Drop** ``g`` with one partition tombstone, ``retire_after`` later (time
   for readers that looked up ``g`` just before the switch to finish). Its
   timestamp is a year ahead, so a late write from an instance that has not yet
   re-read the generations cannot bring a row back into it. The partition
   tombstone is never read again: nothing reads ``g`` any more.

Bounds and failures: one rotation runs at a time; what waits is at most one
entry per known partition. A step that fails (Cassandra away, a timeout) is
logged, counted (``rotation_failures``) and retried after a backoff of up to a
minute; the gateway's writes go on meanwhile, in both generations. The
announcement runs in the write loop, between chunks, so it has
``cassandra.request_timeout`` in all (not the ``give_up_after`` of a write):
a lightweight transaction can fail while plain writes succeed (a serial
quorum short across data centres), and a failed one waits out its backoff
before the partition is due again, instead of being tried at every chunk. A rotation
that a restart interrupted is found when the tenant's generations are next
read, and finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from ..aio import backoff
from ..config import Config
from ..errors import GatewayError
from ..identity import FIRST_HASH
from ..stats import Stats
from ..units import epoch_ms
from .latest import INSERT_STATE, LatestState, Part, PartKey
from .requests import Requests
from .write_session import Prepared, WriteSession

log = logging.getLogger(__name__)

PAGE = 500  # rows per copy read: far under any tombstone or page-size limit
# A dropped generation's partition tombstone is this far ahead of now.
DROP_AHEAD_US = 366 * 86400 * 1_000_000
MIN_RETIRE_AFTER = 5.0
MAX_BACKOFF = 60.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class StateRotation:
    _begin: Prepared
    _begin_first: Prepared
    _page: Prepared
    _copy: Prepared
    _switch: Prepared
    _drop: Prepared
    _dropped: Prepared

    def __init__(
        self, requests: Requests, latest: LatestState, config: Config, stats: Stats
    ) -> None:
        self._requests = requests
        self._latest = latest
        self._stats = stats
        pipeline = config.pipeline
        wait = pipeline.rotation_wait
        self.wait = pipeline.states_refresh + 2.0 if wait is None else wait
        self.retire_after = max(MIN_RETIRE_AFTER, self.wait)
        self._batch_rows = pipeline.batch_max_rows
        # key -> monotonic time of its next step (copy, or drop); one entry per partition.
        self._copy_at: dict[PartKey, float] = {}
        self._drop_at: dict[PartKey, float] = {}
        # key -> when its failed announcement is due again (then back in latest.due).
        self._announce_at: dict[PartKey, float] = {}
        self._announce_timeout = config.cassandra.request_timeout
        self._failures: dict[PartKey, int] = {}
        self._wake = asyncio.Event()

    async def prepare(self, session: WriteSession) -> None:
        # Together: each is a round trip, a second or more over a slow link.
        (
            self._begin,
            self._begin_first,
            self._page,
            self._copy,
            self._switch,
            self._drop,
            self._dropped,
        ) = await asyncio.gather(
            session.prepare(
                "UPDATE {keyspace}.state_partitions SET next_gen = ?, rotating_since = ? "
                "WHERE tenant = ? AND state = ? AND bucket = ? IF gen = ? AND next_gen = null",
                timestamps=(1,),
            ),
            session.prepare(
                "INSERT INTO {keyspace}.state_partitions "
                "(tenant, state, bucket, gen, next_gen, rotating_since) "
                "VALUES (?, ?, ?, 0, 1, ?) IF NOT EXISTS",
                timestamps=(3,),
            ),
            session.prepare(
                "SELECT device_hash, device_id, ts, value, tags, WRITETIME(ts) AS wt "
                "FROM {keyspace}.latest_events_by_state "
                "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ? "
                f"AND (device_hash, device_id) > (?, ?) LIMIT {PAGE}"
            ),
            session.prepare(INSERT_STATE, timestamps=(6,)),
            session.prepare(
                "UPDATE {keyspace}.state_partitions SET gen = ?, next_gen = null, "
                "rotating_since = null, live = ?, retired_gen = ?, retired_at = ? "
                "WHERE tenant = ? AND state = ? AND bucket = ? IF gen = ? AND next_gen = ?",
                timestamps=(3,),
            ),
            session.prepare(
                "DELETE FROM {keyspace}.latest_events_by_state USING TIMESTAMP ? "
                "WHERE tenant = ? AND state = ? AND bucket = ? AND gen = ?"
            ),
            session.prepare(
                "UPDATE {keyspace}.state_partitions SET retired_gen = null, retired_at = null "
                "WHERE tenant = ? AND state = ? AND bucket = ? IF retired_gen = ?"
            ),
        )

    async def begin_due(self) -> None:
        """Announce the next generation of every due partition. The caller (the
        pipeline) has let the writes in flight land: every write sent before
        this is in generation ``g``, every write built after it goes to both."""
        due, self._latest.due = self._latest.due, {}
        now = time.monotonic()
        for key in due:
            part = self._latest.part(key)
            if part is None:
                continue  # its tenant left the cache; its counts went with it
            if part.retired_gen is not None and key not in self._drop_at:
                self._drop_at[key] = now  # left by an earlier run: drop it now
            if key in self._copy_at or key in self._announce_at:
                continue
            if part.next_gen is not None:
                # Found mid-rotation (another instance, or before a restart):
                # copy once every writer has surely seen it.
                since = part.rotating_since
                age = 0.0 if since is None else time.time() - epoch_ms(since) / 1000
                self._copy_at[key] = now + max(0.0, self.wait - age)
                continue
            if part.deletes < 1:
                continue  # only a retired generation to drop
            try:
                async with asyncio.timeout(self._announce_timeout):
                    applied = await self._announce(key, part)
            except (GatewayError, TimeoutError) as exc:
                # Applied or not, the next read of the tenant's generations
                # says: a rotation found under way is finished like any other.
                # Between chunks: 1 s, 2 s, ... (the other steps start at 2 s).
                why = (
                    str(exc)
                    or f"no answer in {self._announce_timeout:g} s (cassandra.request_timeout)"
                )
                self._retry_later(key, self._announce_at, "announce", why, first=1.0)
                continue
            self._failures.pop(key, None)
            if applied:
                log.info(
                    "state partition %s: %d deletes in generation %d, rotating into %d",
                    _name(key),
                    part.deletes,
                    part.gen,
                    part.gen + 1,
                )
                part.next_gen, part.rotating_since = part.gen + 1, datetime.now(UTC)
                # What is counted from now on goes into the new generation too.
                part.deletes = 0
                self._copy_at[key] = now + self.wait
        self._wake.set()

    async def _announce(self, key: PartKey, part: Part) -> bool:
        tenant, state, bucket = key
        now_ms = _now_ms()
        if part.gen == 0:
            rows = await self._requests.execute(self._begin_first, (tenant, state, bucket, now_ms))
            if rows[0]["[applied]"]:
                return True
        rows = await self._requests.execute(
            self._begin, (part.gen + 1, now_ms, tenant, state, bucket, part.gen)
        )
        # Not applied: another instance rotated it first; the next refresh of
        # the tenant's generations (states_refresh) tells this one.
        return bool(rows[0]["[applied]"])

    async def run(self) -> None:
        """Copy, switch and drop as each comes due, until cancelled."""
        while True:
            now = time.monotonic()
            for key, at in list(self._announce_at.items()):
                if at <= now:
                    del self._announce_at[key]
                    self._latest.due[key] = None  # announced at the next chunk (or tick)
            deadlines = [
                *self._copy_at.values(),
                *self._drop_at.values(),
                *self._announce_at.values(),
            ]
            timeout = None if not deadlines else max(0.0, min(deadlines) - now)
            self._wake.clear()
            if timeout is None or timeout > 0:
                try:
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                continue
            for key, at in list(self._drop_at.items()):
                if at <= now:
                    await self._step(key, self._drop_at, self._drop_old)
            for key, at in list(self._copy_at.items()):
                if at <= now:
                    await self._step(key, self._copy_at, self._rotate)

    async def _step(
        self,
        key: PartKey,
        queue: dict[PartKey, float],
        step: Callable[[PartKey], Awaitable[None]],
    ) -> None:
        try:
            await step(key)
        except GatewayError as exc:
            self._retry_later(key, queue, getattr(step, "__name__", "step"), exc)
            return
        queue.pop(key, None)
        self._failures.pop(key, None)

    def _retry_later(
        self,
        key: PartKey,
        queue: dict[PartKey, float],
        what: str,
        why: BaseException | str,
        first: float = 2.0,
    ) -> None:
        """A step of ``key``'s rotation failed: counted, logged, and due again
        in ``queue`` after a backoff from ``first`` s, doubling per failure of
        the partition in a row, up to MAX_BACKOFF."""
        tries = self._failures.get(key, 0) + 1
        self._failures[key] = tries
        queue[key] = time.monotonic() + backoff(tries, first / 2, MAX_BACKOFF)
        self._stats.rotation_failures += 1
        log.warning("state partition %s: rotation %s failed, will retry: %s", _name(key), what, why)

    async def _rotate(self, key: PartKey) -> None:
        part = self._latest.part(key)
        if part is None or part.next_gen is None:
            return  # switched meanwhile (by another instance), or forgotten
        gen, next_gen = part.gen, part.next_gen
        if part.retired_gen is not None:
            await self._drop_old(key)  # one retired generation at a time
        copied = await self._copy_rows(key, gen, next_gen)
        # Rows copied, less the deletes sent since the announcement: a device
        # that left while the copy ran was copied and then deleted. An
        # underestimate only makes the next rotation come sooner; an
        # overestimate could let tombstones grow past rotate_after_deletes.
        live = max(0, copied - part.deletes)
        tenant, state, bucket = key
        rows = await self._requests.execute(
            self._switch,
            (next_gen, live, gen, _now_ms(), tenant, state, bucket, gen, next_gen),
        )
        if not rows[0]["[applied]"]:
            return  # another instance switched it; the next refresh says so
        # Deletes sent since the announcement went to both generations; those
        # into the new one are what it starts with.
        part.gen, part.next_gen, part.rotating_since = next_gen, None, None
        part.live, part.retired_gen = live, gen
        self._latest.check_due(key, part)  # departures during the copy may call for the next
        self._drop_at[key] = time.monotonic() + self.retire_after
        self._stats.rotations += 1
        self._stats.rotation_rows += copied
        log.info(
            "state partition %s: generation %d now live (%d rows copied)",
            _name(key),
            next_gen,
            copied,
        )

    async def _copy_rows(self, key: PartKey, gen: int, next_gen: int) -> int:
        tenant, state, bucket = key
        session = self._requests.session
        copied = 0
        after: tuple[int, str] = (FIRST_HASH, "")
        while True:
            rows = await self._requests.execute(self._page, (tenant, state, bucket, gen, *after))
            inserts = [
                session.bind(
                    self._copy,
                    (
                        tenant,
                        state,
                        bucket,
                        next_gen,
                        r["device_hash"],
                        r["device_id"],
                        epoch_ms(r["ts"]),
                        r["value"],
                        r["tags"] or {},
                        r["wt"],
                    ),
                )
                for r in rows
                if r["wt"] is not None
            ]
            for start in range(0, len(inserts), self._batch_rows):
                chunk = inserts[start : start + self._batch_rows]
                await self._requests.send(session.batch(chunk), len(chunk))
            copied += len(inserts)
            if len(rows) < PAGE:
                return copied
            after = (rows[-1]["device_hash"], rows[-1]["device_id"])

    async def _drop_old(self, key: PartKey) -> None:
        part = self._latest.part(key)
        if part is None or part.retired_gen is None:
            return
        retired = part.retired_gen
        tenant, state, bucket = key
        ahead = int(time.time() * 1_000_000) + DROP_AHEAD_US
        await self._requests.execute(self._drop, (ahead, tenant, state, bucket, retired))
        await self._requests.execute(self._dropped, (tenant, state, bucket, retired))
        if part.retired_gen == retired:
            part.retired_gen = None
        self._stats.generations_dropped += 1


def _name(key: PartKey) -> str:
    tenant, state, bucket = key
    return f"{tenant}/{state}/{bucket}"
