"""The adaptive in-flight limit (gateway/store/limit.py) against the real Cassandra,
through gateway/tools/delay_proxy.py: a link tens of milliseconds long.

The writes go through the gateway's own Sink and Requests (one request per
partition: rejected_messages rows of distinct hours of a fresh tenant, each
too large to share a batch on the Python driver's path), so the limit sees
what it sees in production. Nothing here asserts a timing: only
what the limiter did after a given number of writes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import CassandraConfig, PipelineConfig
from gateway.stats import Stats
from gateway.store.hot import HotPartitions
from gateway.store.limit import InFlightLimit
from gateway.store.requests import Requests
from gateway.store.sink import Pending, Sink, Write
from gateway.store.write_session import PACK_BYTES, Prepared, open_write_session
from gateway.tools.delay_proxy import DelayProxy
from gateway.web.metrics import gateway_registry

from .helpers import CQL_PORT, Driver, wait_until

HOUR_MS = 3_600_000
INSERT = (
    "INSERT INTO {keyspace}.rejected_messages "
    "(tenant, hour_start, received_at, id, topic, device_id, reason, detail, payload, "
    "payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
START = 16  # the limit's starting value in these tests
# Over the Python driver's pack size: one partition per request with either driver.
PAYLOAD = bytes(PACK_BYTES + 1)


@dataclass
class Link:
    proxy: DelayProxy
    limit: InFlightLimit
    stats: Stats
    sink: Sink
    insert: Prepared
    tenant: str
    written: int = 0

    async def write(self, count: int, deadline: float = 120) -> None:
        """``count`` rows, one partition each, all acknowledged before it returns."""
        done = asyncio.Event()
        left = count

        def one_done() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                done.set()

        now = int(time.time() * 1000)
        writes = []
        for i in range(self.written, self.written + count):
            hour = now - now % HOUR_MS - i * HOUR_MS  # a partition per row
            pending = Pending(one_done)
            values = (self.tenant, hour, hour, uuid.uuid1(), "t", "d", "test", "", PAYLOAD, 0)
            writes.append(Write(("rejected", self.tenant, hour), self.insert, values, pending))
        self.written += count
        async with asyncio.timeout(deadline):
            await self.sink.submit(writes)
            await done.wait()
        assert self.stats.in_flight == 0  # every request answered, none left behind


@asynccontextmanager
async def slow_link(
    keyspace: str, one_way: float, driver: Driver = "auto", request_timeout: float = 10.0
) -> AsyncIterator[Link]:
    async with DelayProxy("127.0.0.1", CQL_PORT, delay=one_way) as proxy:
        config = CassandraConfig(
            keyspace=keyspace, port=proxy.port, driver=driver, request_timeout=request_timeout
        )
        stats = Stats()
        limit = InFlightLimit(stats, initial=START, minimum=4, maximum=1024)
        async with open_write_session(config) as session:
            insert = await session.prepare(INSERT, timestamps=(1, 2))
            requests = Requests(session, config, stats, limit)
            hot = HotPartitions(10.0, 1_000_000, 10_000, stats)
            async with Sink(requests, PipelineConfig(), hot, stats) as sink:
                yield Link(proxy, limit, stats, sink, insert, f"lim{uuid.uuid4().hex[:10]}")


@pytest.mark.parametrize("driver", ["acsylla", "python"])
async def test_the_limit_grows_on_a_50ms_link(keyspace: str, driver: Driver) -> None:
    async with slow_link(keyspace, one_way=0.025, driver=driver) as link:
        await link.write(3000)
        # 16 in flight over 50 ms is 320 requests/s: the limit must have left it
        # far behind, and the floor is the link's round trip. (Three times, not
        # four: on a busy 2-core box the Python driver's IO thread waits for the
        # GIL, which reads as latency above the floor, and it reached 61 once.)
        assert link.limit.limit >= 3 * START, link.limit.limit
        assert link.stats.in_flight_limit == link.limit.limit
        assert link.limit.floor is not None
        assert link.limit.floor >= 0.05
        assert link.stats.in_flight_waits > 0  # the limit was the bound at times


async def test_the_limit_shrinks_when_latency_rises_well_above_its_floor(keyspace: str) -> None:
    async with slow_link(keyspace, one_way=0.025) as link:
        await link.write(3000)
        grown = link.limit.limit
        assert grown >= 4 * START
        # The link becomes ten times slower: requests queue somewhere.
        link.proxy.delay = 0.25
        await link.write(grown * 3)
        assert link.limit.limit < grown * 0.75, (grown, link.limit.limit)


async def test_timeouts_halve_the_limit_and_nothing_is_lost(keyspace: str) -> None:
    async with slow_link(keyspace, one_way=0.025, request_timeout=1.0) as link:
        await link.write(3000)
        grown = link.limit.limit
        # How far it grew is test_the_limit_grows_on_a_50ms_link's subject; on
        # a loaded box it may grow little (20 once in a clean-clone CI run),
        # and a quarter of START is still the minimum, so halving must reach it.
        assert grown >= START
        # The link stalls past the request timeout: every request times out.
        link.proxy.delay = 3.0
        writing = asyncio.create_task(link.write(grown))
        try:
            await wait_until(lambda: link.limit.limit <= grown // 4, 60, "the limit quartered")
            assert link.stats.retries > 0
        finally:
            # The link recovers: every write still completes (retried, not lost).
            link.proxy.delay = 0.025
            await writing
        assert link.limit.limit >= 4  # never below the minimum


def test_the_floor_defaults_to_the_old_cap_and_never_exceeds_the_cap() -> None:
    assert CassandraConfig().in_flight_floor() == 64
    assert CassandraConfig().in_flight_floor(256) == 256  # the Python driver's
    assert CassandraConfig(max_in_flight=32).in_flight_floor(256) == 32
    assert CassandraConfig(min_in_flight=8).in_flight_floor(256) == 8
    with pytest.raises(ValueError, match=r"cassandra\.min_in_flight \(100\).*max_in_flight"):
        CassandraConfig(min_in_flight=100, max_in_flight=50)


async def test_the_limit_is_in_the_metrics_and_the_status_line(keyspace: str) -> None:
    async with slow_link(keyspace, one_way=0.01) as link:
        await link.write(500)
        text = prometheus_client.generate_latest(gateway_registry(link.stats)).decode()
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert values["gateway_cassandra_in_flight_limit"] == link.limit.limit
        assert values["gateway_cassandra_latency_floor_seconds"] >= 0.02
        assert values["gateway_cassandra_in_flight_waits_total"] == link.stats.in_flight_waits
        assert f"in_flight=0/{link.limit.limit} " in link.stats.status_line()


async def test_admission_is_bounded_fifo_and_a_cancelled_waiter_hands_its_slot_on() -> None:
    stats = Stats()
    limit = InFlightLimit(stats, initial=2, minimum=2, maximum=2)
    await limit.acquire()
    await limit.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await limit.acquire()
        order.append(name)

    first = asyncio.create_task(wait("first"))
    second = asyncio.create_task(wait("second"))
    third = asyncio.create_task(wait("third"))
    await asyncio.sleep(0)
    assert (limit.in_flight, stats.in_flight_waits) == (2, 3)
    limit.release()  # granted to "first", which is cancelled before it runs
    first.cancel()
    async with asyncio.timeout(5):
        await second  # the slot went on to the next in line
    assert order == ["second"]
    assert not third.done()
    limit.release()
    async with asyncio.timeout(5):
        await third
    assert order == ["second", "third"]
    assert limit.in_flight == 2


async def test_a_waiter_cancelled_as_a_slot_frees_leaves_the_limit_consistent() -> None:
    """Cancel a waiting acquire, then release a slot before the cancelled task
    runs again: the release passes over the cancelled waiter and drops it, and
    the task's own clean-up must cope (it raised ValueError out of the sink and
    ended the gateway's stop with a traceback, seen in tests/test_spool.py)."""
    limit = InFlightLimit(Stats(), initial=1, minimum=1, maximum=1, adaptive=False)
    await limit.acquire()
    waiting = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0)  # it is queued behind the one slot
    waiting.cancel()
    limit.release()  # in the same step: the waiter is cancelled but its task has not run
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert limit.in_flight == 0
    await asyncio.wait_for(limit.acquire(), 1)  # the freed slot is still there
    assert limit.in_flight == 1


async def test_the_limit_doubles_until_a_window_leaves_the_floor_then_grows_a_tenth() -> None:
    """Slow start: a link found 100 ms away wants several times the starting
    limit; doubling per window gets there in a few round trips, and the first
    window with latency above the floor ends it for good."""
    limit = InFlightLimit(Stats(), initial=64, minimum=4, maximum=4096)

    async def window(latency: float) -> None:
        """A full window with every slot in use, each answered after ``latency``."""
        held = limit.limit
        for _ in range(held):
            await limit.acquire()
        for _ in range(held):
            limit.answered(latency)
            limit.release()

    await window(0.100)
    assert limit.limit == 128
    await window(0.100)
    assert limit.limit == 256
    await window(0.200)  # above 1.5x the floor, below 3x: hold, slow start over
    assert limit.limit == 256
    await window(0.100)
    assert limit.limit == 281  # a tenth from now on
