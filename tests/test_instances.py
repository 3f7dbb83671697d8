"""Several gateway instances writing one tenant (issue: past one machine).

Two in-process gateways, each with its own MQTT client id and its own topic
template, both mapping to the same tenant: ``tenants/{tenant}/devices/...``
on one, ``sites/{device_id}/events`` (fixed tenant) on the other. A device
may publish through either. Whatever the order, "which devices are in state
X" must list each device once, in the state of its newest event.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import orjson
import pytest

from gateway.config import Config, TopicTemplate
from gateway.identity import device_hash
from gateway.stats import Stats
from gateway.store import queries
from gateway.store.database import Database

from .helpers import (
    GatewayProcess,
    RunningGateway,
    device_row,
    make_config,
    publish,
    running_gateway,
    state_rows,
    telemetry_keys,
    wait_until,
)


def _instances(tenant: str) -> tuple[Config, Config]:
    a = make_config()
    b = make_config()
    b = b.model_copy(
        update={"topics": [TopicTemplate(template="sites/{device_id}/events", tenant=tenant)]}
    )
    return a, b


async def _listed(db: Database, config: Config, tenant: str, state: str) -> set[str]:
    page = await queries.devices_page(db, config, tenant, state, limit=1000)
    return {row.device_id for row in page.devices}


async def test_a_state_new_to_one_instance_leaves_no_phantom(db: Database, tenant: str) -> None:
    """Instance B knows the tenant's states ({ok}); A registers "alarm" for d1;
    B then writes d1's newer "ok" before its next states refresh (10 s), so
    its deletes do not cover "alarm"."""
    a_cfg, b_cfg = _instances(tenant)
    t0 = 1_790_000_000_000
    via_a = f"tenants/{tenant}/devices/d1/events"
    via_b = "sites/d1/events"
    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        await publish([("sites/d0/events", orjson.dumps({"ts": t0, "state": "ok"}))])
        await b.wait_handled(1)
        await publish([(via_a, orjson.dumps({"ts": t0 + 1000, "state": "alarm"}))])
        await a.wait_handled(1)
        await publish([(via_b, orjson.dumps({"ts": t0 + 2000, "state": "ok"}))])
        await b.wait_handled(2)
    assert (await device_row(db, tenant, "d1")).state == "ok"
    assert "d1" in await _listed(db, a_cfg, tenant, "ok")
    assert "d1" not in await _listed(db, a_cfg, tenant, "alarm")


async def test_an_instance_that_learns_a_new_state_sends_the_deletes_it_missed(
    db: Database, tenant: str
) -> None:
    """As above, but without a page read: /states counted d1 in "alarm" as
    well as in "ok" (COUNT(*) per partition) until someone opened "alarm".
    B, learning "alarm" at its next states refresh, reads it and deletes the
    rows older than its own writes of their devices, as of those writes."""
    a_cfg, _ = _instances(tenant)
    b_cfg = make_config(GATEWAY_PIPELINE__STATES_REFRESH="3s").model_copy(
        update={"topics": [TopicTemplate(template="sites/{device_id}/events", tenant=tenant)]}
    )
    t0 = 1_790_000_000_000
    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        await publish([("sites/d0/events", orjson.dumps({"ts": t0, "state": "ok"}))])
        await b.wait_handled(1)
        loaded = time.monotonic()  # B read the tenant's states: {ok}
        await publish(
            [
                (
                    f"tenants/{tenant}/devices/d1/events",
                    orjson.dumps({"ts": t0 + 1000, "state": "alarm"}),
                )
            ]
        )
        await a.wait_handled(1)
        await publish([("sites/d1/events", orjson.dumps({"ts": t0 + 2000, "state": "ok"}))])
        await b.wait_handled(2)
        assert time.monotonic() - loaded < 3, "too slow: B refreshed its states before d1"
        assert dict(await queries.state_counts(db, b_cfg, tenant)) == {"ok": 2, "alarm": 1}
        # B's next chunk after its refresh, of another device.
        await asyncio.sleep(3.5 - (time.monotonic() - loaded))
        await publish([("sites/d2/events", orjson.dumps({"ts": t0 + 3000, "state": "ok"}))])
        await b.wait_handled(3)
        await b.wait_for(lambda s: s.written >= 3 and s.acked >= 3)
        missed = b.stats.missed_deletes
    assert dict(await queries.state_counts(db, b_cfg, tenant)) == {"ok": 3, "alarm": 0}
    assert missed == 1  # d1's alarm row, older than B's ok; d0 and d2 were never in alarm
    assert (await device_row(db, tenant, "d1")).state == "ok"


async def test_a_device_on_two_instances_ends_in_its_newest_state(
    db: Database, tenant: str
) -> None:
    """A writes ok, B writes a newer alarm, A writes a newer ok: A's last write
    is in the same state as its previous one, so it sends no deletes, and
    B's alarm row would stay."""
    a_cfg, b_cfg = _instances(tenant)
    t0 = 1_790_000_000_000
    via_a = f"tenants/{tenant}/devices/d1/events"
    via_b = "sites/d1/events"
    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        # Every state known to both first: only the second gap is exercised.
        await publish([(via_a, orjson.dumps({"ts": t0, "state": "alarm"}))])
        await a.wait_handled(1)
        await publish([(via_a, orjson.dumps({"ts": t0 + 1, "state": "ok"}))])
        await a.wait_handled(2)
        await publish([(via_b, orjson.dumps({"ts": t0 + 1000, "state": "alarm"}))])
        await b.wait_handled(1)
        await publish([(via_a, orjson.dumps({"ts": t0 + 2000, "state": "ok"}))])
        await a.wait_handled(3)
    assert (await device_row(db, tenant, "d1")).state == "ok"
    assert "d1" in await _listed(db, a_cfg, tenant, "ok")
    assert "d1" not in await _listed(db, a_cfg, tenant, "alarm")


async def test_leftovers_anywhere_in_a_long_page_are_left_out_and_deleted(
    db: Database, tenant: str
) -> None:
    """The page check reads the devices' newest writes VERIFY_IN at a time:
    leftovers in the first and in a later read are both found, and only they."""
    ks, t0 = db.keyspace, 1_790_000_000_000
    by_state = await db.prepared(
        f"INSERT INTO {ks}.latest_events_by_state "
        "(tenant, state, bucket, gen, device_hash, device_id, ts) "
        "VALUES (?, ?, 0, 0, ?, ?, ?) USING TIMESTAMP ?"
    )
    by_device = await db.prepared(
        f"INSERT INTO {ks}.latest_events_by_device (tenant, device_id, state, ts) "
        "VALUES (?, ?, ?, ?) USING TIMESTAMP ?"
    )
    devices = [f"d{i:03d}" for i in range(250)]
    leftovers = {"d007", "d180"}  # the page takes several reads of VERIFY_IN
    for i, device in enumerate(devices):
        ts = t0 + i
        await db.execute(by_state, (tenant, "alarm", device_hash(device), device, ts, ts * 1000))
        newest, state = (ts + 1000, "ok") if device in leftovers else (ts, "alarm")
        await db.execute(by_device, (tenant, device, state, newest, newest * 1000))
    config = make_config()
    assert await _listed(db, config, tenant, "alarm") == set(devices) - leftovers
    # Deleted as of the newest write, so a second look does not meet them.
    rows = await db.execute(
        f"SELECT device_id FROM {ks}.latest_events_by_state "
        "WHERE tenant = %s AND state = 'alarm' AND bucket = 0 AND gen = 0",
        (tenant,),
    )
    assert {r.device_id for r in rows} == set(devices) - leftovers


async def test_every_instance_gives_a_state_the_same_verdict_within_the_budget(
    db: Database, tenant: str
) -> None:
    """max_states_per_tenant = 2; both instances know "s1". A registers "s2";
    B, not yet refreshed (states_refresh, 10 s), was handed "s3" and
    registered it past the budget, and A then refused "s3" (too_many_states)
    while B stored it: one state, two verdicts. A state new to an instance is
    now looked for in a fresh read first."""
    env = {"GATEWAY_PIPELINE__MAX_STATES_PER_TENANT": "2"}
    a_cfg = make_config(**env)
    b_cfg = make_config(**env).model_copy(
        update={"topics": [TopicTemplate(template="sites/{device_id}/events", tenant=tenant)]}
    )
    t0 = 1_790_000_000_000

    def via_a(device: str, state: str) -> tuple[str, bytes]:
        return f"tenants/{tenant}/devices/{device}/events", orjson.dumps({"ts": t0, "state": state})

    def via_b(device: str, state: str) -> tuple[str, bytes]:
        return f"sites/{device}/events", orjson.dumps({"ts": t0, "state": state})

    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        await publish([via_a("d0", "s1"), via_b("d1", "s1")])
        await a.wait_handled(1)
        await b.wait_handled(1)
        await publish([via_a("d2", "s2")])
        await a.wait_handled(2)
        await publish([via_b("d3", "s3")])  # B's cache still says one state
        await b.wait_handled(2)
        await publish([via_a("d4", "s3")])
        await a.wait_handled(3)
        verdicts = (a.stats.rejected, b.stats.rejected)
    assert sorted(await queries.known_states(db, tenant)) == ["s1", "s2"]
    assert verdicts == (1, 1)  # "s3" refused by both


async def test_share_group_members_leave_exact_state_counts(db: Database, tenant: str) -> None:
    """Two members of a share group, 21 devices going alarm, ok, alarm, ok,
    each device's events dealt to both. A member whose last write for a device
    was in the same state skipped its deletes, not knowing the other had
    moved the device: /states counted all 21 in "alarm" as well as in "ok".
    In a share group every event writes its deletes."""
    env = {"GATEWAY_MQTT__SHARE_GROUP": f"g{tenant}", "GATEWAY_SAMPLING__ENABLED": "false"}
    devices = [f"d{i:02d}" for i in range(21)]
    t0 = 1_790_000_000_000
    async with (
        running_gateway(make_config(**env)) as one,
        running_gateway(make_config(**env)) as two,
    ):
        for r, state in enumerate(("alarm", "ok", "alarm", "ok")):
            await publish(
                (
                    f"tenants/{tenant}/devices/{d}/events",
                    orjson.dumps({"ts": t0 + r, "state": state}),
                )
                for d in devices
            )
            total = (r + 1) * len(devices)

            def both_done(s: Stats, t: int = total) -> bool:
                return s.written + two.stats.written >= t and s.acked + two.stats.acked >= t

            await one.wait_for(both_done)
        split = (one.stats.received, two.stats.received)
    assert min(split) > 0, split  # both members took part
    counts = dict(await queries.state_counts(db, make_config(), tenant))
    assert counts == {"ok": 21, "alarm": 0}, (counts, split)


def _own_topics(tenant: str) -> str:
    """GATEWAY_TOPICS for the default template, subscribed for this tenant only:
    a gateway in a share group of its own still gets every message its filter
    matches, other tests' too (the per-worker brokers of `make test` aside)."""
    template = "tenants/{tenant}/devices/{device_id}/events"
    return f'[{{template = "{template}", tenants = ["{tenant}"]}}]'


async def test_a_late_event_in_a_share_group_loses_to_another_members_newer_write(
    db: Database, tenant: str
) -> None:
    """Share group, rotate_after_deletes = 5. Member A writes d in s0 (t+100)
    and so knows d's newest write "for sure"; member B writes d's newer s1
    (t+300), whose delete of d from s0 lands in s0's generation 0. 30 other
    devices leave s0 through A, which rotates s0 into generation 1 (live rows
    only: the tombstone stays behind). A late s0 event of d (t+200) then
    reached A, which still trusted what it knew and wrote d into generation 1
    with no tombstone to lose to: d counted in s0 and s1 (probe: 3 of 3). In
    a share group a member reads its devices' newest writes again for every
    chunk. The broker's dealing is played by the topics: A takes the
    ``tenants/...`` template, B the ``sites/...`` one, both share-group
    members, so each message goes to the member the test means."""
    env = {
        "GATEWAY_MQTT__SHARE_GROUP": f"g{tenant}",
        "GATEWAY_SAMPLING__ENABLED": "false",
        "GATEWAY_PIPELINE__ROTATE_AFTER_DELETES": "5",
        "GATEWAY_PIPELINE__ROTATION_WAIT": "0.5",
    }
    a_cfg = make_config(**env, GATEWAY_TOPICS=_own_topics(tenant))
    via_b = f"sites/{tenant}/d/events"
    b_cfg = make_config(**env).model_copy(
        update={
            "topics": [
                TopicTemplate(template=f"sites/{tenant}/{{device_id}}/events", tenant=tenant)
            ]
        }
    )
    t0 = 1_790_000_000_000

    def via_a(device: str, ts: int, state: str) -> tuple[str, bytes]:
        return f"tenants/{tenant}/devices/{device}/events", orjson.dumps({"ts": ts, "state": state})

    others = [f"f{i:02d}" for i in range(30)]
    async with running_gateway(a_cfg) as a, running_gateway(b_cfg) as b:
        await publish([via_a("w0", t0, "s0"), via_a("w1", t0, "s1")])
        await a.wait_handled(2)
        await publish([via_a("d", t0 + 100, "s0")])
        await a.wait_handled(3)
        await publish([(via_b, orjson.dumps({"ts": t0 + 300, "state": "s1"}))])
        await b.wait_handled(1)
        await publish(via_a(f, t0 + 10, "s0") for f in others)
        await a.wait_handled(33)
        await publish(via_a(f, t0 + 20, "s1") for f in others)
        await a.wait_handled(63)

        async def rotated() -> bool:
            return (await queries.state_generations(db, tenant, "s0")).get(0, 0) >= 1

        await wait_until(rotated, 30, "s0 rotated into generation 1")
        await publish([via_a("d", t0 + 200, "s0")])  # late
        await a.wait_handled(64)
    assert (await device_row(db, tenant, "d")).state == "s1"
    assert "d" not in await state_rows(db, tenant, "s0")
    assert "d" in await state_rows(db, tenant, "s1")
    counts = dict(await queries.state_counts(db, make_config(), tenant))
    assert counts == {"s0": 1, "s1": 32}, counts


async def _taken_by(gw: RunningGateway, before: int, within: float) -> bool:
    """Whether the in-process member received more than ``before`` messages within ``within`` s."""
    try:
        await gw.wait_for(lambda s: s.received > before, within)
    except TimeoutError:
        return False
    return True


async def test_an_untimed_redelivery_in_a_share_group_does_not_beat_another_members_write(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    """Share group of A (a subprocess) and B; a lamp that never sends ts. Its
    "on" (m1) is dealt to A, stopped before acknowledging it; its later "off"
    (m2) is dealt to B and written, stamped with B's receive time. A is
    killed and restarted, and the broker resends m1 (DUP). The rule that puts
    a redelivered untimed event just after the device's untimed write (the
    broker resends in order what one session had not acknowledged) put m1
    after B's write: the lamp ended "on" (probe: 6 of 6). That write came
    from another member; the rule holds for a sole writer only.

    Mosquitto deals a group's messages to its members in turn: a filler
    message tells whose turn it is, and a setup dealt otherwise is retried
    with another lamp."""
    group = {
        "GATEWAY_MQTT__SHARE_GROUP": f"g{tenant}",
        "GATEWAY_SAMPLING__ENABLED": "false",
        "GATEWAY_TOPICS": _own_topics(tenant),
    }
    a = gateway_process(**group)
    await asyncio.to_thread(a.start)
    t0 = int(time.time() * 1000) - 60_000
    lamp = ""
    async with running_gateway(make_config(**group)) as b:
        a.signal(signal.SIGSTOP)
        try:
            for attempt in range(4):
                filler = (
                    f"tenants/{tenant}/devices/filler{attempt}/events",
                    orjson.dumps({"ts": t0, "state": "on"}),
                )
                received = b.stats.received
                await publish([filler])
                if not await _taken_by(b, received, 1.5):  # A's turn was this one
                    received = b.stats.received
                    await publish([filler])
                    assert await _taken_by(b, received, 10), "B never took its turn"
                # B took the last one: A's turn.
                lamp = f"lamp{attempt}"
                on, off = orjson.dumps({"state": "on"}), orjson.dumps({"state": "off"})
                received = b.stats.received
                await publish([(f"tenants/{tenant}/devices/{lamp}/events", on)])
                if await _taken_by(b, received, 1.5):
                    continue  # m1 went to B: not this setup
                await publish([(f"tenants/{tenant}/devices/{lamp}/events", off)])
                if not await _taken_by(b, received, 5):
                    continue  # m2 went to A too
                await b.wait_for(lambda s: s.written >= s.received and s.acked >= s.received)
                break
            else:
                pytest.fail("the broker never dealt m1 to A and m2 to B")
            assert (await device_row(db, tenant, lamp)).state == "off"
            # Killed while stopped, m1 unread: resumed first (SIGCONT, then
            # SIGKILL), A could read it in between and stamp it after B's write,
            # a fresh delivery rightly put last: the lamp ended "on" in CI
            # (2 of about 10 clean-clone runs; 3 of 3 with 1 s between them).
            await asyncio.to_thread(a.kill)
        finally:
            a.signal(signal.SIGCONT)  # nothing once killed
        await asyncio.to_thread(a.start)  # the broker resends m1, DUP set

        async def both_stored() -> bool:
            return len(await telemetry_keys(db, tenant, lamp)) == 2

        await wait_until(both_stored, 30, "m1 written after the restart")
        a.signal(signal.SIGTERM)  # what A read is written before it exits
        assert await asyncio.to_thread(a.wait) == 0
    assert (await device_row(db, tenant, lamp)).state == "off"
    assert lamp in await state_rows(db, tenant, "off")
    assert lamp not in await state_rows(db, tenant, "on")


async def test_a_share_group_member_reads_its_devices_for_every_chunk_a_sole_writer_once(
    tenant: str,
) -> None:
    """The cost of the share-group rule above, and none outside a share group:
    three chunks of the same 5 devices cost a sole writer one read of each
    device, a share-group member one per chunk."""
    devices = [f"d{i}" for i in range(5)]
    reads: list[int] = []
    for env in (
        {},
        {"GATEWAY_MQTT__SHARE_GROUP": f"g{tenant}", "GATEWAY_SAMPLING__ENABLED": "false"},
    ):
        mine = f"{tenant}{len(reads)}"
        config = make_config(**env, GATEWAY_TOPICS=_own_topics(mine))
        async with running_gateway(config) as gw:
            for r in range(3):
                await publish(
                    (
                        f"tenants/{mine}/devices/{d}/events",
                        orjson.dumps({"ts": 1_790_000_000_000 + r, "state": f"s{r % 2}"}),
                    )
                    for d in devices
                )
                await gw.wait_handled((r + 1) * len(devices))
            reads.append(gw.stats.newest_reads)
    assert reads == [5, 15], reads
