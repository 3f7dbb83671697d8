"""The device quota (``sampling.tenants.<t>.max_devices_per_tenant``), held in
Cassandra (schema/008_device_quota.cql): ``quota_devices`` lists the devices
each tenant's quota admitted, ``quota_counts`` says how many
(reservations.py: a compare-and-set, so instances never together pass it).

The sampler admits, from memory, the devices this process has seen admitted
(ingest/sampling.py); the first events of any other device of a tenant with
a quota reach the write loop pending, and :meth:`DeviceQuota.settle` decides
their devices, a chunk at a time, before anything of theirs is written
(ingest/pipeline.py):

* a device in ``quota_devices`` is admitted (one read per tenant, bucket and
  up to 100 devices, ``device_id IN (...)``), whichever instance or run
  admitted it: a restart admits the same devices as before, where a quota in
  memory started empty and admitted whichever devices sent first;
* the others of a tenant take the count up by as many as fit, in arrival
  order; each is admitted and its row written with its first event's rows
  (:meth:`DeviceQuota.writes`), so it is durable before that event is
  acknowledged;
* the rest are refused: their events are rejected with reason ``quota``.

A tenant found at its quota is remembered with its count for RECHECK
seconds; its devices not found in ``quota_devices`` are refused without a
compare-and-set meanwhile, and then the count is read again, so that slots
given back (``gateway quota --release``) are taken within a minute. The
count may run above what ``quota_devices`` holds (a retried transaction, two
instances admitting one device at once, a crash between the count and the
row): fewer devices, never more.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ..errors import GatewayError
from ..event import Event
from ..identity import state_bucket
from ..stats import Stats
from . import queries
from .database import DICT_ROWS, Database
from .requests import Requests
from .reservations import MAX_ATTEMPTS, Reservations
from .sink import Pending, Write
from .write_session import Prepared, WriteSession

# quota_devices partitions per tenant: crc32(device_id) % QUOTA_BUCKETS.
QUOTA_BUCKETS = 16
# Seconds a tenant found at its quota is taken to stay there.
RECHECK = 60.0

Device = tuple[str, str]  # (tenant, device_id)


def quota_bucket(device_id: str) -> int:
    return state_bucket(device_id, QUOTA_BUCKETS)


class DeviceQuota:
    _insert: Prepared
    _exists: Prepared

    def __init__(self, requests: Requests, stats: Stats) -> None:
        self._requests = requests
        self._stats = stats
        self._counts = Reservations(requests, "quota_counts", "admitted", self._count_attempt)
        # Devices this chunk admitted whose rows are still to be written.
        self._new: set[Device] = set()

    def _count_attempt(self) -> None:
        self._stats.quota_reservations += 1

    async def prepare(self, session: WriteSession) -> None:
        self._insert, self._exists, _ = await asyncio.gather(
            session.prepare(
                "INSERT INTO {keyspace}.quota_devices (tenant, bucket, device_id) VALUES (?, ?, ?)"
            ),
            session.prepare(
                "SELECT device_id FROM {keyspace}.quota_devices "
                "WHERE tenant = ? AND bucket = ? AND device_id IN ?"
            ),
            self._counts.prepare(session),
        )

    async def settle(self, wanted: dict[Device, int]) -> set[Device]:
        """Admit or refuse devices none of this process's chunks admitted
        yet, each with its tenant's quota; the devices refused."""
        if not wanted:
            return set()
        self._stats.quota_reads += len(wanted)
        # Keys are text: the bucket as a string, an int again when bound.
        found = await self._requests.read_keys(
            [(t, str(quota_bucket(d)), d) for t, d in wanted],
            lambda prefix: (self._exists, (prefix[0], int(prefix[1]))),
            "device_id",
            in_slot=True,
        )
        absent: dict[str, list[str]] = {}
        caps: dict[str, int] = {}
        for (tenant, device), cap in wanted.items():
            if (tenant, str(quota_bucket(device)), device) not in found:
                absent.setdefault(tenant, []).append(device)
                caps[tenant] = cap
        granted = await asyncio.gather(
            *(self._take(tenant, len(devices), caps[tenant]) for tenant, devices in absent.items())
        )
        refused: set[Device] = set()
        for (tenant, devices), count in zip(absent.items(), granted, strict=True):
            self._new.update((tenant, d) for d in devices[:count])
            refused.update((tenant, d) for d in devices[count:])
        return refused

    async def _take(self, tenant: str, count: int, cap: int) -> int:
        """Slots for ``count`` new devices of the tenant: how many it got."""
        seen = self._counts.known(tenant)
        if seen is not None and seen[0] >= cap:
            if time.monotonic() - seen[1] < RECHECK:
                return 0
            if await self._counts.refresh(tenant) >= cap:
                return 0
        return await self._counts.reserve(tenant, count, cap)

    def writes(self, event: Event, pending: Pending) -> list[Write]:
        """The ``quota_devices`` row of a device :meth:`settle` admitted just
        now, with its first event's rows; nothing for any other event."""
        key = (event.tenant, event.device_id)
        if key not in self._new:
            return []
        self._new.discard(key)
        values = (event.tenant, quota_bucket(event.device_id), event.device_id)
        return [Write(("quota", *values[:2]), self._insert, values, pending)]

    def chunk_done(self) -> None:
        """Forget admissions whose event wrote nothing (none should): the
        count keeps them, fewer devices, never more."""
        self._new.clear()


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
    A running gateway that found the tenant at its quota takes the slots
    within RECHECK seconds; a device released while a gateway remembers it
    as admitted stays admitted by that gateway until it restarts."""
    ks = db.keyspace
    by_bucket: dict[int, list[str]] = {}
    for device in dict.fromkeys(devices):
        by_bucket.setdefault(quota_bucket(device), []).append(device)
    find = await db.prepared(
        f"SELECT device_id FROM {ks}.quota_devices "
        "WHERE tenant = ? AND bucket = ? AND device_id IN ?"
    )
    forget = await db.prepared(
        f"DELETE FROM {ks}.quota_devices WHERE tenant = ? AND bucket = ? AND device_id IN ?"
    )
    present: set[str] = set()
    for bucket, group in by_bucket.items():
        found = [r.device_id for r in await db.execute(find, (tenant, bucket, group))]
        if found:
            await db.execute(forget, (tenant, bucket, found))
            present.update(found)
    move = await db.prepared(
        f"UPDATE {ks}.quota_counts SET admitted = ? WHERE tenant = ? IF admitted = ?"
    )
    after = await queries.quota_admitted(db, tenant)
    for _ in range(MAX_ATTEMPTS):
        before = after
        after = max(0, before - len(present))
        if after == before:
            break
        rows = await db.execute(move, (after, tenant, before), profile=DICT_ROWS)
        if rows[0]["[applied]"]:
            break
        after = await queries.quota_admitted(db, tenant)  # a gateway moved it meanwhile
    else:
        raise GatewayError(f"the device count of tenant {tenant!r} kept moving; try again")
    listed = list(dict.fromkeys(devices))
    return Released(
        [d for d in listed if d in present], [d for d in listed if d not in present], after
    )
