"""The device quota (max_devices_per_tenant), held in Cassandra
(gateway/store/quota.py): the same devices across restarts, one quota across
instances, and slots given back with `gateway quota --release`. On the real
services."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest

from gateway import app
from gateway.config import DEFAULT_TEMPLATE, CassandraConfig, Config, TopicTemplate
from gateway.ingest import sampling
from gateway.ingest.sampling import QUOTA_RECHECK
from gateway.stats import Stats
from gateway.store import queries
from gateway.store.database import Database
from gateway.store.limit import InFlightLimit
from gateway.store.quota import DeviceQuota, release, taken_by_another
from gateway.store.requests import Requests
from gateway.store.write_session import open_write_session
from gateway.tools.delay_proxy import DelayProxy

from .helpers import (
    CQL_PORT,
    DRIVERS,
    Driver,
    base_env,
    make_config,
    publish,
    rejected_since,
    run_cli,
    running_gateway,
    telemetry_keys,
    topic,
    wait_until,
)


def _config(tenant: str, quota: int) -> Config:
    return make_config(
        **{f"GATEWAY_SAMPLING__TENANTS__{tenant.upper()}__MAX_DEVICES_PER_TENANT": str(quota)},
        # This tenant only: other tests' traffic on the shared broker would
        # count in wait_handled.
        GATEWAY_TOPICS=f'[{{template = "{DEFAULT_TEMPLATE}", tenants = ["{tenant}"]}}]',
    )


async def _send(messages: list[tuple[str, str]], ts: int) -> None:
    """One event each, (topic, state), a millisecond apart."""
    await publish(
        [(t, orjson.dumps({"ts": ts + i, "state": state})) for i, (t, state) in enumerate(messages)]
    )


async def _stored(db: Database, tenant: str, devices: list[str]) -> dict[str, int]:
    return {d: len(await telemetry_keys(db, tenant, d)) for d in devices}


async def _refused(db: Database, tenant: str, now: int) -> list[str]:
    rows = await rejected_since(db, tenant, now)
    assert {r.reason for r in rows} <= {"quota"}
    return sorted(str(r.device_id) for r in rows)


async def test_a_restart_admits_the_devices_admitted_before(db: Database, tenant: str) -> None:
    """The quota was held in memory: after a restart it admitted whichever
    devices sent first, and refused devices it had admitted before."""
    now = int(time.time() * 1000)
    async with running_gateway(_config(tenant, 3)) as gw:
        await _send([(topic(tenant, f"d{i}"), "on") for i in range(4)], now)
        await gw.wait_handled(4)
    async with running_gateway(_config(tenant, 3)) as gw:
        # The refused d3 and a new d4 send first this time.
        await _send([(topic(tenant, d), "off") for d in ("d4", "d3", "d0", "d1", "d2")], now + 10)
        await gw.wait_handled(5)
    devices = [f"d{i}" for i in range(5)]
    assert await _stored(db, tenant, devices) == {"d0": 2, "d1": 2, "d2": 2, "d3": 0, "d4": 0}
    assert await _refused(db, tenant, now) == ["d3", "d3", "d4"]


async def test_two_instances_share_one_quota(db: Database, tenant: str) -> None:
    """Each instance counted its own devices: a tenant split over two got
    twice its quota."""
    a_cfg = _config(tenant, 4)
    b_cfg = _config(tenant, 4).model_copy(
        update={"topics": [TopicTemplate(template=f"q/{tenant}/{{device_id}}", tenant=tenant)]}
    )
    now = int(time.time() * 1000)
    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        await _send([(topic(tenant, f"a{i}"), "on") for i in range(3)], now)
        await a.wait_handled(3)
        await _send([(f"q/{tenant}/b{i}", "on") for i in range(3)], now + 10)
        await b.wait_handled(3)
        # A device B admitted is admitted for A too.
        await _send([(topic(tenant, "b0"), "off")], now + 20)
        await a.wait_handled(4)
    stored = await _stored(db, tenant, ["a0", "a1", "a2", "b0", "b1", "b2"])
    assert stored == {"a0": 1, "a1": 1, "a2": 1, "b0": 2, "b1": 0, "b2": 0}
    assert await _refused(db, tenant, now) == ["b1", "b2"]


async def test_release_gives_a_slot_back(db: Database, tenant: str) -> None:
    """`gateway quota --release` takes devices out of the quota: after a
    restart a new device is admitted at once (here). A running gateway
    admits one within QUOTA_RECHECK (60 s): the test below checks that with
    the quota object itself, without waiting the minute."""
    now = int(time.time() * 1000)
    cfg = _config(tenant, 2)
    env = base_env(**{f"GATEWAY_SAMPLING__TENANTS__{tenant.upper()}__MAX_DEVICES_PER_TENANT": "2"})
    async with running_gateway(cfg) as gw:
        await _send([(topic(tenant, d), "on") for d in ("d0", "d1", "d2")], now)
        await gw.wait_handled(3)
    shown = run_cli("quota", "--tenant", tenant, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "2 of 2 devices admitted" in shown.stdout
    released = run_cli("quota", "--tenant", tenant, "--release", "d0", "nope", env=env)
    assert released.returncode == 0, released.stderr
    assert "released 1 device (d0)" in released.stdout
    assert "not admitted: nope" in released.stdout
    assert "1 of 2 devices admitted" in released.stdout
    # Under its quota the devices listed are not counted, so not shown as null.
    shown = run_cli("quota", "--tenant", tenant, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert orjson.loads(shown.stdout) == {"tenant": tenant, "admitted": 1, "quota": 2}
    async with running_gateway(cfg) as gw:
        await _send([(topic(tenant, d), "off") for d in ("d2", "d0")], now + 10)
        await gw.wait_handled(2)
    assert await _stored(db, tenant, ["d0", "d1", "d2"]) == {"d0": 1, "d1": 1, "d2": 1}
    assert await _refused(db, tenant, now) == ["d0", "d2"]


async def test_one_device_admitted_by_two_instances_at_once_takes_one_slot(
    keyspace: str, db: Database, tenant: str
) -> None:
    """Two instances that both find a new device absent both take a slot and
    write its row: the count ran one above the devices for good, and a tenant
    behind a share group could end far under its quota. The row is written
    IF NOT EXISTS, and the instance that finds it there gives its slot back."""
    async with _quota_on(keyspace) as (_, one), _quota_on(keyspace) as (_, two):
        # Both read before either writes: each finds d0 absent.
        refused = await asyncio.gather(
            one.settle({(tenant, "d0"): 2}), two.settle({(tenant, "d0"): 2})
        )
        assert list(refused) == [set(), set()]  # a list, typed as a tuple by typeshed
        assert await queries.quota_admitted(db, tenant) == 1
        assert await one.settle({(tenant, "d1"): 2}) == set()
        assert await two.settle({(tenant, "d2"): 2}) == {(tenant, "d2")}


async def test_an_instance_that_filled_the_quota_itself_reads_the_count_before_refusing(
    keyspace: str, db: Database, tenant: str
) -> None:
    """An instance whose own compare-and-set took a tenant's last slot
    remembered the tenant as full, and refused every new device for
    QUOTA_RECHECK without a look, though a slot had been given back since:
    by another instance that lost a race for the same device (what made the
    test above fail now and then), or by `gateway quota --release` (here,
    which is deterministic). Now it reads the count before it refuses, and
    only a tenant found full is refused from memory."""
    async with _quota_on(keyspace) as (_, one):
        assert await one.settle({(tenant, "d0"): 2, (tenant, "d1"): 2}) == set()
        assert (await release(db, tenant, ["d1"])).admitted == 1
        assert await one.settle({(tenant, "d2"): 2}) == set()
        assert await one.settle({(tenant, "d3"): 2}) == {(tenant, "d3")}
        # Found full now: refused from memory, even with a slot given back.
        assert (await release(db, tenant, ["d2"])).admitted == 1
        assert await one.settle({(tenant, "d4"): 2}) == {(tenant, "d4")}
    assert await queries.quota_admitted(db, tenant) == 1


@asynccontextmanager
async def _quota_on(
    keyspace: str, driver: Driver = "auto", port: int = CQL_PORT
) -> AsyncIterator[tuple[Any, DeviceQuota]]:
    """A write session and a DeviceQuota on it, as a gateway instance has."""
    stats = Stats()
    config = CassandraConfig(keyspace=keyspace, driver=driver, port=port)
    async with open_write_session(config) as session:
        limit = InFlightLimit(stats, initial=8, minimum=1, maximum=8)
        quota = DeviceQuota(Requests(session, config, stats, limit), stats, recheck=QUOTA_RECHECK)
        await quota.prepare(session)
        yield session, quota


async def test_an_instance_that_loses_the_last_slots_waits_for_the_winners_rows(
    keyspace: str, db: Database, tenant: str
) -> None:
    """Two instances meet the same new devices; the one behind a slow link
    takes the last slots, and writes their rows one round trip after its
    compare-and-set. The other lost its compare-and-set, read the devices
    again at once, found no rows yet and refused devices that were admitted
    (3 of 5 probe runs, up to 35 of 50 devices). Now, having lost a race, it
    reads them again a few times, from 0.1 s apart, each wait doubled."""
    wanted = {(tenant, f"d{i}"): 3 for i in range(3)}
    async with (
        DelayProxy("127.0.0.1", CQL_PORT, delay=0.15) as link,
        _quota_on(keyspace, port=link.port) as (_, slow),
        _quota_on(keyspace) as (_, fast),
    ):
        winner = asyncio.create_task(slow.settle(wanted))

        # Once the slow one's count is in, its rows are 0.3 s away.
        async def counted() -> bool:
            return await queries.quota_admitted(db, tenant) == 3

        await wait_until(counted, 10, "the slow instance's count", interval=0.01)
        refused = await fast.settle(wanted)
        assert await winner == set()
    assert refused == set()
    assert await queries.quota_admitted(db, tenant) == 3


@pytest.mark.parametrize("driver", DRIVERS)
async def test_an_insert_retried_after_it_applied_keeps_its_slot(
    keyspace: str, tenant: str, driver: Driver
) -> None:
    """An IF NOT EXISTS retried after a timeout that had applied answers "not
    applied" with our own row. acsylla answers its uuid as text, which never
    equalled the UUID sent, so the gateway gave the slot back and the quota
    was exceeded (68 devices of 50 in a probe over a flapping link)."""
    async with _quota_on(keyspace, driver) as (session, _):
        insert = await session.prepare(
            "INSERT INTO {keyspace}.quota_devices (tenant, bucket, device_id, admission) "
            "VALUES (?, ?, ?, ?) IF NOT EXISTS"
        )
        mine, theirs = uuid.uuid4(), uuid.uuid4()
        first = await session.execute(session.bind(insert, (tenant, 0, "d0", mine)))
        again = await session.execute(session.bind(insert, (tenant, 0, "d0", mine)))
        other = await session.execute(session.bind(insert, (tenant, 0, "d0", theirs)))
    assert not taken_by_another(first[0], mine)
    assert not taken_by_another(again[0], mine)
    assert taken_by_another(other[0], theirs)


async def test_a_refused_device_is_refused_from_memory(tenant: str) -> None:
    """A refused device stayed pending: every message of it cost a read of
    quota_devices in the write loop, so a tenant flooding new ids slowed
    every tenant. Now it is refused in memory for QUOTA_RECHECK."""
    now = int(time.time() * 1000)
    async with running_gateway(_config(tenant, 1)) as gw:
        await _send([(topic(tenant, "d0"), "on")], now)
        await gw.wait_handled(1)
        await _send([(topic(tenant, "x"), "on")], now + 1)
        await gw.wait_handled(2)
        reads = gw.stats.quota_reads
        await _send([(topic(tenant, "x"), str(i)) for i in range(200)], now + 2)
        await gw.wait_handled(202)
        assert gw.stats.quota_rejected == 201
        assert gw.stats.quota_reads == reads


async def test_a_released_device_still_sending_takes_a_slot_again(
    db: Database, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running gateway admitted a device it remembered, after `gateway
    quota --release` had given its slot back: with the slot taken by
    another device, the tenant had more devices than its quota until the
    gateway restarted. Now a remembered admission is asked again after
    QUOTA_REMEMBER (10 min; 1 s here, and the at-quota memory
    QUOTA_RECHECK 1 s too, so that the freed slot is seen at once)."""
    monkeypatch.setattr(sampling, "QUOTA_REMEMBER", 1.0)
    monkeypatch.setattr(sampling, "QUOTA_RECHECK", 1.0)
    monkeypatch.setattr(app, "QUOTA_RECHECK", 1.0)
    now = int(time.time() * 1000)
    env = base_env(**{f"GATEWAY_SAMPLING__TENANTS__{tenant.upper()}__MAX_DEVICES_PER_TENANT": "2"})
    async with running_gateway(_config(tenant, 2)) as gw:
        await _send([(topic(tenant, d), "on") for d in ("d0", "d1")], now)
        await gw.wait_handled(2)
        released = await asyncio.to_thread(
            run_cli, "quota", "--tenant", tenant, "--release", "d0", env=env
        )
        assert released.returncode == 0, released.stderr
        await asyncio.sleep(1.5)
        # d0 still sends: it takes the slot back; d2, new, finds none.
        await _send([(topic(tenant, "d0"), "off")], now + 10)
        await gw.wait_handled(3)
        await _send([(topic(tenant, "d2"), "on")], now + 20)
        await gw.wait_handled(4)
    assert await queries.quota_admitted(db, tenant) == 2
    assert await _stored(db, tenant, ["d0", "d1", "d2"]) == {"d0": 2, "d1": 1, "d2": 0}
    assert await _refused(db, tenant, now) == ["d2"]


async def test_recount_gives_back_the_slots_a_stopped_gateway_never_used(
    db: Database, tenant: str
) -> None:
    """A gateway stopped between its compare-and-set and its devices' rows
    leaves the count above the devices listed (a probe: count 50, no rows,
    every device refused for good), and nothing said so or gave them back."""
    now = int(time.time() * 1000)
    env = base_env(**{f"GATEWAY_SAMPLING__TENANTS__{tenant.upper()}__MAX_DEVICES_PER_TENANT": "2"})
    async with running_gateway(_config(tenant, 2)) as gw:
        await _send([(topic(tenant, "d0"), "on")], now)
        await gw.wait_handled(1)
    # What the stop leaves: one more slot counted, its row never written.
    await db.execute(
        f"UPDATE {db.keyspace}.quota_counts SET admitted = 2 WHERE tenant = %s", (tenant,)
    )
    shown = run_cli("quota", "--tenant", tenant, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "2 of 2 devices admitted" in shown.stdout
    assert "1 listed: 1 slots were taken for devices never written" in shown.stdout
    fixed = run_cli("quota", "--tenant", tenant, "--recount", env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert "recounted: 2 -> 1" in fixed.stdout
    assert "1 of 2 devices admitted" in fixed.stdout
    assert "listed:" not in fixed.stdout
    async with running_gateway(_config(tenant, 2)) as gw:
        await _send([(topic(tenant, d), "on") for d in ("d1", "d2")], now + 10)
        await gw.wait_handled(2)
    assert await _stored(db, tenant, ["d1", "d2"]) == {"d1": 1, "d2": 0}
    # A count below the rows (its row deleted by hand) is raised to them.
    await db.execute(f"DELETE FROM {db.keyspace}.quota_counts WHERE tenant = %s", (tenant,))
    raised = run_cli("quota", "--tenant", tenant, "--recount", "--json", env=env)
    assert raised.returncode == 0, raised.stderr
    assert orjson.loads(raised.stdout) == {
        "tenant": tenant,
        "admitted": 2,
        "listed": 2,
        "quota": 2,
        "recounted": {"before": 0, "after": 2},
    }
