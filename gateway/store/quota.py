"""The device quota (``sampling.tenants.<t>.max_devices_per_tenant``), held in
Cassandra (schema/008_device_quota.cql): ``quota_devices`` lists the devices
each tenant's quota admitted, ``quota_counts`` says how many
(reservations.py: a compare-and-set, so instances never together pass it).

The sampler admits, from memory, the devices this process has seen admitted
(for QUOTA_REMEMBER), and refuses for ``recheck`` seconds those it has seen
refused
(ingest/sampling.py); the first events of any other device of a tenant with
a quota reach the write loop pending, and :meth:`DeviceQuota.settle` decides
their devices, a chunk at a time, before anything of theirs is written
(ingest/pipeline.py):

* a device in ``quota_devices`` is admitted (one read per tenant, bucket and
  up to 100 devices, ``device_id IN (...)``), whichever instance or run
  admitted it: a restart admits the same devices as before, where a quota in
  memory started empty and admitted whichever devices sent first;
* the others of a tenant take the count up by as many as fit, in arrival
  order, and each of those is written (``IF NOT EXISTS``) before settle
  returns, so a device is admitted only once its row is durable: every
  event of it, acknowledged in any order (the spool's), finds it after a
  crash. A row another instance wrote meanwhile (both found the device
  absent) gives the slot just taken back;
* the rest are read again (another instance may have admitted them since
  the first read; when this one lost a compare-and-set, up to RACE_REREADS
  more times, as the winner writes its rows after its compare-and-set) and,
  if still absent, refused: their events are rejected with reason
  ``quota``.

A tenant found at its quota (a compare-and-set, or a read of the count, left
no room for a device) is remembered for ``recheck`` seconds; its devices not
found in ``quota_devices`` are refused without a compare-and-set meanwhile,
and then the count is read again, so that slots given back (``gateway quota
--release``) are taken within ``recheck``. A tenant this instance filled
itself, its last compare-and-set granting every slot it asked for, is not
found full: its count is read again before the next device is refused, as
another instance may have given a slot back since (two instances that
admitted the same device, the loser giving its slot back, left the winner
refusing devices for ``recheck`` with a slot free). The
count may still run above what ``quota_devices`` holds (a compare-and-set
retried after a timeout it had applied, a crash between the count and the
rows, a write loop stopped between them): fewer devices, never more, until
:func:`recount` (``gateway quota --recount``) sets it to the rows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import GatewayError
from ..identity import state_bucket
from ..lru import LRU
from ..stats import Cache, Stats
from . import queries, reservations
from .database import Database
from .requests import Requests
from .reservations import MAX_ATTEMPTS, MAX_TENANTS, Reservations, Reserved
from .write_session import Prepared, WriteSession

# quota_devices partitions per tenant: crc32(device_id) % QUOTA_BUCKETS.
QUOTA_BUCKETS = 16
# After a compare-and-set lost to another instance, the devices about to be
# refused are read again up to RACE_REREADS times: first twice our own round
# trip later, within RACE_WAIT_MIN..RACE_WAIT_MAX s, then each wait twice the
# last, up to RACE_WAIT_MAX (0.1 + 0.2 + 0.4 + 0.8 s on a local link): the
# winner writes its devices' rows after its compare-and-set, over a link that
# may be slower, and a busy box delays it further. Three reads 0.1 s apart
# left a margin of a few hundred ms, which a loaded CI box ate once.
RACE_REREADS = 4
RACE_WAIT_MIN = 0.1
RACE_WAIT_MAX = 1.0
NONE_TAKEN = Reserved(0, False, 0.0)
Device = tuple[str, str]  # (tenant, device_id)


def quota_bucket(device_id: str) -> int:
    return state_bucket(device_id, QUOTA_BUCKETS)


class DeviceQuota:
    _insert: Prepared
    _exists: Prepared

    def __init__(self, requests: Requests, stats: Stats, *, recheck: float) -> None:
        self._requests = requests
        self._stats = stats
        self._recheck = recheck
        self._counts = Reservations(requests, "quota_counts", "admitted", self._count_attempt)
        # Tenant -> when (time.monotonic()) it was found at its quota (an LRU
        # of MAX_TENANTS: one forgotten costs one read of its count).
        self._full: LRU[str, float] = LRU(MAX_TENANTS)

    def _count_attempt(self) -> None:
        self._stats.quota_reservations += 1

    def caches(self) -> dict[str, Cache]:
        """Its bounded caches, by name, for the metrics (gateway_cache_*)."""
        return {"quota_counts": self._counts.cache, "quota_full_tenants": self._full}

    async def prepare(self, session: WriteSession) -> None:
        self._insert, self._exists, _ = await asyncio.gather(
            session.prepare(
                "INSERT INTO {keyspace}.quota_devices (tenant, bucket, device_id, admission) "
                "VALUES (?, ?, ?, ?) IF NOT EXISTS"
            ),
            session.prepare(
                "SELECT device_id FROM {keyspace}.quota_devices "
                "WHERE tenant = ? AND bucket = ? AND device_id IN ?"
            ),
            self._counts.prepare(session),
        )

    async def settle(self, wanted: dict[Device, int]) -> set[Device]:
        """Admit or refuse devices this process has not seen settled, each
        with its tenant's quota; the devices refused."""
        if not wanted:
            return set()
        found = await self._listed(list(wanted))
        absent: dict[str, list[str]] = {}
        caps: dict[str, int] = {}
        for (tenant, device), cap in wanted.items():
            if (tenant, device) not in found:
                absent.setdefault(tenant, []).append(device)
                caps[tenant] = cap
        if not absent:
            return set()
        taken = await asyncio.gather(
            *(self._admit(tenant, devices, caps[tenant]) for tenant, devices in absent.items())
        )
        admitted = {key for devices, _ in taken for key in devices}
        left = [(tenant, d) for tenant, devices in absent.items() for d in devices]
        refused = [key for key in left if key not in admitted]
        if not refused:
            return set()
        # Read again: another instance may have admitted them since.
        listed = await self._listed(refused)
        refused = [key for key in refused if key not in listed]
        # A tenant whose count another instance moved while this one was
        # refusing devices may have lost the last slots to it, and that
        # instance writes its rows after its compare-and-set: wait for them,
        # a few times, from about two of our round trips, each wait doubled.
        raced = {
            tenant: reserved.took
            for tenant, (_, reserved) in zip(absent, taken, strict=True)
            if reserved.raced
        }
        racing = [key for key in refused if key[0] in raced]
        pause = min(RACE_WAIT_MAX, max(RACE_WAIT_MIN, 2 * max(raced.values(), default=0.0)))
        for _ in range(RACE_REREADS if racing else 0):
            await asyncio.sleep(pause)
            pause = min(RACE_WAIT_MAX, 2 * pause)
            listed = await self._listed(racing)
            racing = [key for key in racing if key not in listed]
            if not racing:
                break
        refused = [key for key in refused if key[0] not in raced or key in racing]
        return set(refused)

    async def _listed(self, devices: list[Device]) -> set[Device]:
        """Those of ``devices`` that quota_devices lists."""
        self._stats.quota_reads += len(devices)
        # Keys are text: the bucket as a string, an int again when bound.
        found = await self._requests.read_keys(
            [(t, str(quota_bucket(d)), d) for t, d in devices],
            lambda prefix: (self._exists, (prefix[0], int(prefix[1]))),
            "device_id",
            in_slot=True,
        )
        return {(t, d) for t, _, d in found}

    async def _admit(
        self, tenant: str, devices: list[str], cap: int
    ) -> tuple[list[Device], Reserved]:
        """Take slots for the first of ``devices`` that fit and write their
        rows; the devices admitted, and how the slots were taken."""
        reserved = await self._take(tenant, len(devices), cap)
        admitted = devices[: reserved.granted]
        if not admitted:
            return [], reserved
        ids = [uuid.uuid4() for _ in admitted]
        rows = await asyncio.gather(
            *(
                self._requests.execute_in_slot(
                    self._insert, (tenant, quota_bucket(d), d, admission)
                )
                for d, admission in zip(admitted, ids, strict=True)
            )
        )
        twice = sum(
            1
            for (row, *_), admission in zip(rows, ids, strict=True)
            if taken_by_another(row, admission)
        )
        if twice:
            await self._counts.give_back(tenant, twice)
        return [(tenant, d) for d in admitted], reserved

    async def _take(self, tenant: str, count: int, cap: int) -> Reserved:
        """Slots for ``count`` new devices of the tenant (module docstring:
        a tenant found at its quota)."""
        found_full = self._full.peek(tenant)
        if found_full is not None and time.monotonic() - found_full < self._recheck:
            return NONE_TAKEN
        seen = self._counts.known(tenant)
        if seen is not None and seen >= cap and await self._counts.refresh(tenant) >= cap:
            self._full.put(tenant, time.monotonic())
            return NONE_TAKEN
        reserved = await self._counts.reserve(tenant, count, cap)
        if reserved.granted < count:
            self._full.put(tenant, time.monotonic())
        return reserved


def taken_by_another(row: dict[str, Any], admission: uuid.UUID) -> bool:
    """Whether an ``IF NOT EXISTS`` insert of a device's row with this
    admission id found the row written by another instance, which counted
    the device too: not applied, and the row there has another id (or none,
    written before the column). The same id is our own insert, retried after
    a timeout that had applied it. acsylla answers a uuid as text, the
    Python driver as a UUID."""
    if row["[applied]"]:
        return False
    found = row.get("admission")
    return found is None or str(found) != str(admission)


# -- `gateway quota`: the count, and slots given back --------------------------


@dataclass(frozen=True, slots=True)
class Released:
    released: list[str]  # taken out of the quota
    not_admitted: list[str]  # not in it: nothing to give back
    admitted: int  # the tenant's count after


async def release(db: Database, tenant: str, devices: list[str]) -> Released:
    """Take ``devices`` out of the tenant's quota: their rows first, then the
    count down by as many (a compare-and-set against the gateways' own). A
    crash between the two leaves the count high: fewer devices, never more.
    When the count keeps moving (gateways admitting devices meanwhile) the
    rows are put back and nothing is released. A running gateway that found
    the tenant at its quota takes the slots within ``QUOTA_RECHECK`` seconds,
    and asks again about a device it remembers admitted after
    ``QUOTA_REMEMBER`` (ingest/sampling.py): a released device that still
    sends takes a slot again, or is refused."""
    ks = db.keyspace
    listed = list(dict.fromkeys(devices))
    by_bucket: dict[int, list[str]] = {}
    for device in listed:
        by_bucket.setdefault(quota_bucket(device), []).append(device)
    find = await db.prepared(
        f"SELECT device_id, admission FROM {ks}.quota_devices "
        "WHERE tenant = ? AND bucket = ? AND device_id IN ?"
    )
    forget = await db.prepared(
        f"DELETE FROM {ks}.quota_devices WHERE tenant = ? AND bucket = ? AND device_id IN ?"
    )
    present: dict[str, Any] = {}  # device -> its admission id
    for bucket, group in by_bucket.items():
        found = {r.device_id: r.admission for r in await db.execute(find, (tenant, bucket, group))}
        if found:
            await db.execute(forget, (tenant, bucket, list(found)))
            present |= found
    after = await queries.quota_admitted(db, tenant)
    for _ in range(MAX_ATTEMPTS):
        before = after
        after = max(0, before - len(present))
        if after == before or await reservations.move_count(
            db, "quota_counts", "admitted", tenant, before, after
        ):
            break
        after = await queries.quota_admitted(db, tenant)  # a gateway moved it meanwhile
    else:
        restore = await db.prepared(
            f"INSERT INTO {ks}.quota_devices (tenant, bucket, device_id, admission) "
            "VALUES (?, ?, ?, ?)"
        )
        for device, admission in present.items():
            await db.execute(restore, (tenant, quota_bucket(device), device, admission))
        raise GatewayError(
            f"the device count of tenant {tenant!r} kept moving (gateways admitting devices): "
            "nothing was released; try again"
        )
    return Released(
        [d for d in listed if d in present], [d for d in listed if d not in present], after
    )


async def recount(db: Database, tenant: str) -> tuple[int, int]:
    """Set the tenant's count to the devices quota_devices lists: the slots
    taken for devices whose rows were never written (a gateway stopped
    between its compare-and-set and its rows) are given back, and a count
    below the rows (its row deleted by hand) is raised to them. (count
    before, count after.) Run it while no gateway admits new devices of the
    tenant: one between its compare-and-set and its rows at that moment
    would put the tenant that many devices over its quota."""
    return await reservations.recount(
        db,
        "quota_counts",
        "admitted",
        tenant,
        lambda: queries.quota_admitted(db, tenant),
        lambda: queries.quota_listed(db, tenant, QUOTA_BUCKETS),
        "devices listed",
    )
