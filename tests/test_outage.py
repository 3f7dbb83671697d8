"""Cassandra going away mid-stream, through a TCP proxy we can cut
(helpers.CuttableProxy).

The proxy forwards to the real Cassandra; cutting it closes every connection
and refuses new ones, which is what the driver sees when the link to a remote
cluster drops. (Stopping the shared local node would take every other test
down with it.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest

from gateway.app import _leaves
from gateway.errors import WritesFailing
from gateway.store import requests, write_session
from gateway.store.database import Database

from .helpers import (
    CuttableProxy,
    RunningGateway,
    device_row,
    make_config,
    proxy,
    publish,
    running_gateway,
    telemetry_keys,
    topic,
    wait_until,
)


async def test_outage_mid_stream_is_retried_and_nothing_lost(db: Database, tenant: str) -> None:
    now = int(time.time() * 1000)
    messages = [
        (
            topic(tenant, f"d{i % 10}"),
            orjson.dumps({"ts": now - 10_000 + i, "state": "on", "value": i}),
        )
        for i in range(400)
    ]
    async with proxy() as p:
        # Ten devices at 40 events each in a second would be sampled as noisy.
        config = make_config(GATEWAY_CASSANDRA__PORT=str(p.port), GATEWAY_SAMPLING__ENABLED="false")
        async with running_gateway(config) as gw:
            await publish(messages[:200])
            await gw.wait_handled(200)
            await p.cut()
            publisher = asyncio.create_task(publish(messages[200:]))
            await gw.wait_for(lambda s: s.retries > 0, deadline=60)
            await asyncio.sleep(2)
            await p.start()  # same port: the link is back
            await publisher
            await gw.wait_handled(400, deadline=90)
            assert gw.stats.retries > 0
    for i in range(10):
        assert len(await telemetry_keys(db, tenant, f"d{i}")) == 40
    assert (await device_row(db, tenant, "d9")).value_num == 399


async def test_giving_up_stops_the_gateway_and_the_broker_keeps_the_rest(
    db: Database, tenant: str
) -> None:
    now = int(time.time() * 1000)
    messages = [
        (topic(tenant, "g"), orjson.dumps({"ts": now - 1000 + i, "value": i})) for i in range(50)
    ]
    client_id = f"giveup-{tenant}"
    async with proxy() as p:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(p.port),
            GATEWAY_CASSANDRA__GIVE_UP_AFTER="3",
            GATEWAY_MQTT__CLIENT_ID=client_id,
            GATEWAY_SAMPLING__ENABLED="false",
        )
        gave_up: BaseExceptionGroup[BaseException] | None = None
        try:
            async with running_gateway(config) as gw:
                cut = time.time()
                await p.cut()
                await publish(messages)
                async with asyncio.timeout(60):
                    await gw.task
        except BaseExceptionGroup as group:
            gave_up = group
        assert gave_up is not None, "the gateway should stop after give_up_after"
        assert "give_up_after" in repr(gave_up.exceptions)
        # It says when the writes began to fail (/healthz's "unreachable
        # since" in spool mode): at least give_up_after before it gave up.
        failing, _ = gave_up.split(WritesFailing)
        assert failing is not None
        first = _leaves(failing)[0]
        assert isinstance(first, WritesFailing)
        assert cut <= first.since <= time.time() - 3, (cut, first.since)
    # The same session, Cassandra reachable again: everything arrives.
    config = make_config(GATEWAY_MQTT__CLIENT_ID=client_id, GATEWAY_SAMPLING__ENABLED="false")
    async with running_gateway(config) as gw:
        await gw.wait_for(lambda s: s.written >= 50, deadline=60)
    assert len(await telemetry_keys(db, tenant, "g")) == 50


@asynccontextmanager
async def _a_host_given_up(
    tenant: str, count: int, rollup_worker: bool = False
) -> AsyncIterator[tuple[RunningGateway, list[tuple[str, bytes]], CuttableProxy]]:
    """A gateway (acsylla, through a proxy) has written the first of
    ``count`` events of device "lamp" and sent the second; meanwhile the
    proxy answered the driver's reconnects with "bad credentials" for 2 s, so
    the C++ driver gave the host up for good. Then the node takes connections
    again. Yields the gateway, the events and the proxy."""
    now = int(time.time() * 1000)
    events = [
        (topic(tenant, "lamp"), orjson.dumps({"ts": now + i, "value": i})) for i in range(count)
    ]
    async with proxy() as link:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(link.port),
            GATEWAY_CASSANDRA__DRIVER="acsylla",
            GATEWAY_CASSANDRA__RENEW_AFTER="3s",
            GATEWAY_SAMPLING__ENABLED="false",
            GATEWAY_ROLLUPS__WORKER=str(rollup_worker).lower(),
        )
        async with running_gateway(config) as gw:
            await publish(events[:1])
            await gw.wait_handled(1)
            link.refuse_with = (0x0100, "Provided username gw and/or password are incorrect")
            link.drop()
            await publish(events[1:2])
            await gw.wait_for(lambda s: s.retries > 0)
            await asyncio.sleep(2)  # the driver's reconnection meets the refusal
            link.refuse_with = None  # the node takes connections again
            yield gw, events, link


async def test_a_driver_session_that_gave_its_host_up_is_replaced(
    db: Database, tenant: str
) -> None:
    """The C++ driver gives a host's connections up for good after one
    authentication error while reconnecting, as a password-protected node
    restarting answers until it can read system_auth: its requests then found
    no host until the gateway gave up (cassandra.give_up_after, 10 min), though
    the node took connections again 2 s later (probe: still stuck after 25 s;
    the Python driver reconnected in 4 s). Now a new driver session is opened
    after cassandra.renew_after of that, and what was held back is written."""
    async with _a_host_given_up(tenant, 3) as (gw, events, _):
        await publish(events[2:])
        await gw.wait_handled(3, deadline=60)
        assert gw.stats.cassandra_sessions_renewed == 1
    assert len(await telemetry_keys(db, tenant, "lamp")) == 3


async def test_requests_waiting_to_retry_go_through_a_new_driver_session_at_once(
    tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a new driver session replaced one that gave its host up, the
    requests that had failed meanwhile slept out their backoff first (up to
    cassandra's 10 s between retries), though the new session worked. Now the
    replacement wakes them. Every retry here waits 2.5 to 10 s."""
    monkeypatch.setattr(requests, "BACKOFF_MIN", 5.0)
    async with _a_host_given_up(tenant, 2) as (gw, _, _):
        await gw.wait_for(lambda s: s.cassandra_sessions_renewed == 1, deadline=60)
        renewed = time.monotonic()
        await gw.wait_handled(2, deadline=30)
        waited = time.monotonic() - renewed
    assert waited < 1.5, f"written {waited:.1f} s after the new session"


def _driver_lines(forward: write_session.DriverLog) -> int:
    """How many lines the C++ driver has given ``forward`` (logged or held back)."""
    return sum(1 + held for _, held in forward.last.values())


async def test_the_c_driver_still_reports_after_its_session_was_replaced(
    tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acsylla gives the C++ driver one logging callback for the whole
    process, and closing a cluster clears it. Replacing a driver session
    closed the old session's cluster: from then on the driver's warnings and
    errors reached no log, for the new session and the roll-up worker's
    too. (write_session.SharedClusters; tests/test_write_session.py has the
    same with two sessions and no gateway.)"""
    forward = write_session.DriverLog()  # its own: lines counted from this test only
    monkeypatch.setattr(write_session, "_forward_log", forward)
    clusters = len(write_session._clusters)
    async with _a_host_given_up(tenant, 2, rollup_worker=True) as (gw, _, link):
        # The roll-up worker's session may be replaced too (its lease is
        # renewed through the same cut link): one renewal or two.
        await gw.wait_for(lambda s: s.cassandra_sessions_renewed >= 1, deadline=60)
        await gw.wait_handled(2, deadline=30)
        # The write path, the roll-up worker and the replacement: one cluster.
        assert len(write_session._clusters) == clusters + 1
        before = _driver_lines(forward)
        link.drop()
        await wait_until(
            lambda: _driver_lines(forward) > before,
            15,
            "the link dropped, and the C++ driver said something",
        )


async def test_an_error_raised_while_a_request_waits_to_retry_is_not_chained_to_it(
    tenant: str,
) -> None:
    """CI's report of a failed assertion in a test came with a chain of 60
    "No hosts available" errors above it, from a gateway of an earlier test
    retrying through a cut link, and read as a Cassandra outage. Compiled
    code (mypyc) that waits inside an ``except`` clause leaves the error set
    as the thread's current exception: every exception raised meanwhile, in
    any task, was chained to it. The retry now waits outside the clause."""
    async with proxy() as link:
        config = make_config(GATEWAY_CASSANDRA__PORT=str(link.port))
        async with running_gateway(config) as gw:
            await link.cut()
            await publish([(topic(tenant, "d"), orjson.dumps({"value": 1}))])
            await gw.wait_for(lambda s: s.retries >= 2)
            try:
                raise ValueError("raised by the test, after nothing")
            except ValueError as exc:
                context = exc.__context__
            await link.start()
            await gw.wait_handled(1)
    assert context is None, f"chained to {context!r}"
