"""Several gateway instances on one broker (README, "Scaling out").

The default recipe: each instance has its own MQTT client id (its own
persistent session) and its own topic filters, here a ``tenants`` list per
instance. Two instances as real subprocesses, one tenant each; one is
SIGKILLed under a steady publish on both shards, the other keeps writing its
own shard, the broker holds the killed one's messages in its session, and
after a restart its backlog drains. Nothing is lost in either shard, and
neither instance ever receives the other's messages.

Then the option: MQTT shared subscriptions (``mqtt.share_group``), each
message handed to one member of the group.
"""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from collections.abc import Callable

import orjson

from gateway.store.database import Database

from .helpers import (
    GatewayProcess,
    Publisher,
    assert_all_stored,
    make_config,
    publish,
    running_gateway,
    telemetry_keys,
    topic,
    wait_until,
)

DEVICES = 10
RATE = 80.0  # messages per second and shard
COUNT = 800  # per shard: 10 s of publishing


def _shard(tenant: str) -> str:
    """GATEWAY_TOPICS for an instance that takes one tenant (a TOML array)."""
    return (
        '[{template = "tenants/{tenant}/devices/{device_id}/events", '
        f'tenants = ["{tenant}"]}}]'
    )


async def _stored(db: Database, tenant: str) -> int:
    return sum([len(await telemetry_keys(db, tenant, f"d{i}")) for i in range(DEVICES)])


def _received(gw: GatewayProcess) -> int:
    """Messages the instance's last run received, from its summary line on SIGTERM."""
    runs = re.findall(r"stopped: received=(\d+)", gw.output())
    assert runs, f"no summary line:\n{gw.output()[-2000:]}"
    return int(runs[-1])


async def test_two_shards_one_killed_the_other_unaffected_nothing_lost(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    a_tenant, b_tenant = tenant, f"t{uuid.uuid4().hex[:12]}"
    a = gateway_process(GATEWAY_TOPICS=_shard(a_tenant))
    b = gateway_process(GATEWAY_TOPICS=_shard(b_tenant))
    await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
    a_pub = Publisher(a_tenant, DEVICES, RATE, COUNT)
    b_pub = Publisher(b_tenant, DEVICES, RATE, COUNT)
    a_pub.start()
    b_pub.start()

    async def writing(tenant: str, at_least: int) -> None:
        async def enough() -> bool:
            return await _stored(db, tenant) >= at_least

        await wait_until(enough, 30, f"{at_least} rows of {tenant}", interval=0.2)

    await writing(b_tenant, 80)
    b.kill()
    # Instance A goes on writing its shard while B is down...
    await writing(a_tenant, await _stored(db, a_tenant) + 50)
    b_rows = await _stored(db, b_tenant)  # B's last writes have landed by now
    await writing(a_tenant, await _stored(db, a_tenant) + 100)
    # ...and nobody writes B's: A never sees B's messages, which the broker
    # holds in B's persistent session meanwhile.
    assert await _stored(db, b_tenant) == b_rows
    assert b_pub.is_alive(), "B's shard should still be publishing during the outage"
    await asyncio.to_thread(b.start)
    await asyncio.to_thread(a_pub.join, 60)
    await asyncio.to_thread(b_pub.join, 60)
    await assert_all_stored(db, a_tenant, a_pub, deadline=60)
    await assert_all_stored(db, b_tenant, b_pub, deadline=60)
    for gw in (a, b):
        gw.signal(signal.SIGTERM)
        assert gw.wait() == 0
    # Each instance received its own shard only: A, never restarted, exactly
    # its shard; B's second run the backlog it had not acknowledged, at most
    # its whole shard. (A filter that took both tenants would give A twice as many.)
    assert _received(a) == COUNT
    assert 0 < _received(b) <= COUNT
    assert "sessions_lost=0" in b.output()


async def test_a_share_group_splits_the_messages_between_members(db: Database, tenant: str) -> None:
    """mqtt.share_group: each message reaches one member; together they get all."""
    shard = {
        "GATEWAY_TOPICS": _shard(tenant),
        "GATEWAY_MQTT__SHARE_GROUP": f"g{tenant}",
        "GATEWAY_SAMPLING__ENABLED": "false",
    }
    count = 60
    messages = [
        (topic(tenant, f"d{i % DEVICES}"), orjson.dumps({"ts": 1_790_000_000_000 + i, "value": i}))
        for i in range(count)
    ]
    async with (
        running_gateway(make_config(**shard)) as one,
        running_gateway(make_config(**shard)) as two,
    ):
        await publish(messages)

        def all_handled() -> bool:
            return one.stats.written + two.stats.written >= count

        await wait_until(all_handled, 30, "every message written by one member")
        # Room for a duplicate to show up, if the broker sent one to both.
        await asyncio.sleep(0.5)
        assert one.stats.received + two.stats.received == count
        assert one.stats.received > 0
        assert two.stats.received > 0
    keys = {k for i in range(DEVICES) for k in await telemetry_keys(db, tenant, f"d{i}")}
    assert {ts for ts, _ in keys} == {1_790_000_000_000 + i for i in range(count)}
