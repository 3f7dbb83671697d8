"""The write loop over a slow link to the real Cassandra (gateway/tools/delay_proxy.py):
what used to cost it round trips per chunk of devices met for the first time.

* The newest write of a device is read when its event is queued
  (store/latest.py, read-ahead), so chunks do not wait for it; the number
  waiting to be read ahead is bounded by pipeline.queue_size and the excess
  is counted.
* Metadata's existence reads and entry counts are the metadata worker's
  (store/metadata.py): events with entries to decide are held, not
  acknowledged, until their rows are written; at most BACKLOG_CHUNKS chunks
  wait for it, beyond which the write loop waits (counted).
"""

from __future__ import annotations

import time

import orjson

from gateway.config import Config
from gateway.event import Event
from gateway.stats import Stats
from gateway.store import queries
from gateway.store.database import Database
from gateway.store.latest import LatestState
from gateway.store.limit import InFlightLimit
from gateway.store.requests import Requests
from gateway.store.write_session import open_write_session
from gateway.tools.delay_proxy import DelayProxy

from .helpers import CQL_PORT, make_config, publish, running_gateway

TOPICS = '[{template = "slow-link/{tenant}/devices/{device_id}/events"}]'


def topic(tenant: str, device: str) -> str:
    return f"slow-link/{tenant}/devices/{device}/events"


async def drain_over_100ms(messages: list[tuple[str, bytes]], batch: int) -> tuple[Config, Stats]:
    """Publish to an in-process gateway whose Cassandra is 100 ms away and
    which takes chunks of ``batch`` events; its config and counters once
    every message is handled."""
    async with DelayProxy("127.0.0.1", CQL_PORT, delay=0.05) as proxy:
        config = make_config(
            GATEWAY_TOPICS=TOPICS,
            GATEWAY_CASSANDRA__PORT=str(proxy.port),
            GATEWAY_PIPELINE__BATCH_MAX_EVENTS=str(batch),
        )
        async with running_gateway(config) as gw:
            await publish(messages)
            await gw.wait_handled(len(messages), deadline=120)
            return config, gw.stats


async def test_new_devices_are_read_ahead_and_their_states_are_right(
    db: Database, tenant: str
) -> None:
    """300 devices met for the first time over a 100 ms link, in chunks of 50:
    each newest write is read once, ahead of its chunk, and the state view
    and latest table come out right (the reads still decide: a device whose
    stored newest event is newer keeps it)."""
    now = int(time.time() * 1000)
    # d0..d9 already hold a newer event than the one about to arrive.
    newer = [
        (topic(tenant, f"d{i}"), orjson.dumps({"ts": now + 60_000, "state": "newer"}))
        for i in range(10)
    ]
    async with running_gateway(make_config(GATEWAY_TOPICS=TOPICS)) as gw:
        await publish(newer)
        await gw.wait_handled(len(newer))
    messages = [
        (topic(tenant, f"d{i}"), orjson.dumps({"ts": now, "state": "on" if i % 2 else "off"}))
        for i in range(300)
    ]
    config, stats = await drain_over_100ms(messages, batch=50)
    assert stats.newest_reads == 300  # once per device, ahead or by its chunk
    # Ahead of its chunk, but for the few whose chunk came while the reader
    # was still sending the read before.
    assert stats.newest_read_ahead >= 250, stats.newest_read_ahead
    assert stats.newest_read_ahead_skipped == 0
    assert stats.stale_latest == 10  # d0..d9: their stored event is newer
    on = {row.device_id for row in await queries.devices_in_state(db, config, tenant, "on")}
    off = {row.device_id for row in await queries.devices_in_state(db, config, tenant, "off")}
    kept = {row.device_id for row in await queries.devices_in_state(db, config, tenant, "newer")}
    assert kept == {f"d{i}" for i in range(10)}
    assert on == {f"d{i}" for i in range(11, 300, 2)}
    assert off == {f"d{i}" for i in range(10, 300, 2)}


def state_event(device: str, event_id: int) -> Event:
    return Event(
        tenant="t",
        device_id=device,
        ts_ms=1,
        state="on",
        value_text=None,
        value_num=None,
        metrics={},
        tags={},
        received_ms=1,
        ts_from_receive=False,
        sent_at_ms=None,
        event_id=event_id,
        write_ts=1000,
    )


async def test_read_ahead_is_bounded_by_the_queue_size(keyspace: str) -> None:
    """At most pipeline.queue_size devices wait to be read ahead; the next is
    counted and left to its chunk (nothing is read until the reader runs)."""
    config = make_config(GATEWAY_PIPELINE__QUEUE_SIZE="1000", GATEWAY_MQTT__RECEIVE_MAXIMUM="100")
    stats = Stats()
    async with open_write_session(config.cassandra) as session:
        limit = InFlightLimit(stats, initial=64, minimum=64, maximum=64)
        latest = LatestState(Requests(session, config.cassandra, stats, limit), config, stats)
        for i in range(1003):
            latest.read_ahead(state_event(f"d{i % 1002}", i + 1))
    # 1,000 waiting; d1000 and d1001 counted; d0 again is waiting already.
    assert stats.newest_read_ahead_skipped == 2


async def test_metadata_waits_for_its_worker_not_the_write_loop(db: Database, tenant: str) -> None:
    """400 events with a new tag value each, over a 100 ms link, in chunks of
    10: the write loop outruns the metadata worker (two round trips a
    decision) until BACKLOG_CHUNKS chunks are held, then waits, counted.
    Every event is held, every event and every entry is stored, and the
    tenant's entry count matches what was written."""
    messages = [
        (
            topic(tenant, f"d{i}"),
            orjson.dumps({"ts": int(time.time() * 1000), "value": 1, "tags": {"serial": f"s{i}"}}),
        )
        for i in range(400)
    ]
    _, stats = await drain_over_100ms(messages, batch=10)
    assert stats.metadata_held == 400
    assert stats.metadata_backlog_waits > 0
    # metric value, tag key serial, 400 values, 400 device pairs.
    assert stats.metadata_writes == 2 + 400 + 400
    assert stats.written == 400
    values = await queries.meta_tag_values(db, tenant, "serial")
    assert sorted(values) == sorted(f"s{i}" for i in range(400))
    assert await queries.meta_entry_count(db, tenant) == 2 + 400 + 400


async def test_a_held_event_is_acknowledged_once_and_only_after_its_metadata(
    db: Database, tenant: str
) -> None:
    """With one request in flight at a time, the sink's submit waits for a
    slot between requests, so a held event's other writes complete while the
    rest of its chunk is still being sent. Its extra count must already be
    there: otherwise it is acknowledged (and counted written) before its
    metadata rows, and a second time when the worker lets it go."""
    messages = [
        (
            topic(tenant, f"d{i}"),
            orjson.dumps({"ts": 1_700_000_000_000 + i, "tags": {"n": f"v{i}"}}),
        )
        for i in range(200)
    ]
    config = make_config(
        GATEWAY_TOPICS=TOPICS,
        GATEWAY_CASSANDRA__ADAPTIVE_IN_FLIGHT="false",
        GATEWAY_CASSANDRA__MAX_IN_FLIGHT="1",
        GATEWAY_PIPELINE__BATCH_MAX_EVENTS="50",
    )
    async with running_gateway(config) as gw:
        await publish(messages)
        await gw.wait_handled(len(messages), deadline=120)
        stats = gw.stats
    assert stats.metadata_held == 200
    assert stats.written == 200  # each event done exactly once
    assert stats.acked == 200
    assert sorted(await queries.meta_tag_values(db, tenant, "n")) == sorted(
        f"v{i}" for i in range(200)
    )
