"""Faults on a real three-node Cassandra 5.0 cluster (replication factor 3,
LOCAL_QUORUM), and token-aware routing of both write drivers.

Nodes are SIGKILLed and restarted with cassandra.sh kill-node/start-node; the
gateway runs as a real subprocess against all three contact points. Each fault
test counts the events the broker PUBACKed to the publisher against the rows
read back at LOCAL_QUORUM.
"""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from collections.abc import Callable, Iterator

import pytest
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
from cassandra.policies import RoundRobinPolicy, WhiteListRoundRobinPolicy

from gateway.store.database import Database
from gateway.store.write_session import open_write_session

from ..helpers import (
    DRIVERS,
    GatewayProcess,
    Publisher,
    assert_all_stored,
    make_config,
    wait_until,
)
from .conftest import CLUSTER_ENV, NODES, node_script

WRITTEN = re.compile(r"written=(\d+)")
ACKED = re.compile(r"\backed=(\d+)")


def written(gw: GatewayProcess) -> int:
    """The gateway's count of durable writes, from its latest status line."""
    found = WRITTEN.findall(gw.output())
    return int(found[-1]) if found else 0


def acked(gw: GatewayProcess) -> int:
    """The gateway's count of PUBACKs sent, from its latest status line."""
    found = ACKED.findall(gw.output())
    return int(found[-1]) if found else 0


def driver_cluster(hosts: list[str], policy: object) -> Cluster:
    profile = ExecutionProfile(load_balancing_policy=policy)
    return Cluster(hosts, protocol_version=5, execution_profiles={EXEC_PROFILE_DEFAULT: profile})


def node_sessions() -> Iterator[tuple[str, Cluster]]:
    """A driver connection pinned to each node (virtual tables are node-local)."""
    for host in NODES:
        yield host, driver_cluster([host], WhiteListRoundRobinPolicy([host]))


def pending_hints_for(target: str) -> int:
    """Hint files the other live nodes hold for ``target`` (system_views.pending_hints)."""
    files = 0
    for host, cluster in node_sessions():
        if host == target:
            continue
        try:
            session = cluster.connect()
            for row in session.execute("SELECT address, files FROM system_views.pending_hints"):
                if str(row.address) == target:
                    files += row.files
        finally:
            cluster.shutdown()
    return files


async def _steady_gateway(
    gateway_process: Callable[..., GatewayProcess], tenant: str, rate: float, seconds: float
) -> tuple[GatewayProcess, Publisher]:
    gw = gateway_process(**CLUSTER_ENV, GATEWAY_SAMPLING__ENABLED="false")
    gw.start()
    publisher = Publisher(tenant, devices=20, rate=rate, count=int(rate * seconds))
    publisher.start()
    await wait_until(lambda: written(gw) >= 200, 60, "200 events written")
    return gw, publisher


@pytest.mark.parametrize("driver", DRIVERS)
async def test_writes_go_to_the_partitions_replica(driver: str) -> None:
    """Token-aware routing: with replication factor 1 each partition has one
    replica, and the gateway's write session sends every write straight to it.
    The proof is on the server side: each node's own coordinator write count
    for the table (system_views.coordinator_write_latency) grows by exactly the
    writes whose replica it is. Round-robin would send two thirds elsewhere."""
    keyspace = f"route_{uuid.uuid4().hex[:8]}"
    table = "t"
    admin = driver_cluster(list(NODES), RoundRobinPolicy())
    session = admin.connect()
    session.execute(
        f"CREATE KEYSPACE {keyspace} WITH replication = "
        "{'class': 'SimpleStrategy', 'replication_factor': 1}"
    )
    session.execute(f"CREATE TABLE {keyspace}.{table} (k text PRIMARY KEY, v int)")
    admin.refresh_schema_metadata()
    keys = [f"device-{i}" for i in range(60)]
    expected = dict.fromkeys(NODES, 0)
    for key in keys:
        (replica,) = admin.metadata.get_replicas(keyspace, key.encode())
        expected[replica.address] += 1
    assert all(expected.values()), expected  # every node owns some of them

    def coordinated() -> dict[str, int]:
        counts = {}
        for host, cluster in node_sessions():
            try:
                rows = cluster.connect().execute(
                    "SELECT count FROM system_views.coordinator_write_latency "
                    "WHERE keyspace_name = %s AND table_name = %s",
                    (keyspace, table),
                )
                counts[host] = sum(r.count for r in rows)
            finally:
                cluster.shutdown()
        return counts

    env = CLUSTER_ENV | {
        "GATEWAY_CASSANDRA__KEYSPACE": keyspace,
        "GATEWAY_CASSANDRA__DRIVER": driver,
        "GATEWAY_CASSANDRA__CONSISTENCY": "ONE",
    }
    config = make_config(**env).cassandra
    try:
        async with open_write_session(config) as write:
            insert = await write.prepare(f"INSERT INTO {{keyspace}}.{table} (k, v) VALUES (?, ?)")
            await asyncio.sleep(2)  # the driver has learnt the ring
            before = await asyncio.to_thread(coordinated)
            for i, key in enumerate(keys):
                await write.execute(write.bind(insert, (key, i)))
            after = await asyncio.to_thread(coordinated)
        got = {host: after[host] - before[host] for host in NODES}
        assert got == expected, f"{driver}: coordinated per node {got}, replicas {expected}"
    finally:
        session.execute(f"DROP KEYSPACE {keyspace}")
        admin.shutdown()


async def test_one_node_then_two_down_then_back_loses_nothing_and_catches_up(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess]
) -> None:
    """One scenario under a steady publish (one gateway start, one publisher):
    node 3 SIGKILLed, writes go on; node 2 too, writes stop with nothing
    acknowledged; node 2 back, the backlog drains; node 3 back, the hints
    catch it up."""
    gw, publisher = await _steady_gateway(gateway_process, tenant, rate=100, seconds=40)
    await asyncio.to_thread(node_script, "kill-node", 3)
    # Writes go on with 2 of 3 replicas: LOCAL_QUORUM is 2.
    before = written(gw)
    await wait_until(
        lambda: written(gw) >= before + 500, 30, "500 more events written with a node down"
    )
    # The live nodes keep hints for the dead one. They are buffered in memory
    # and reach a file (what system_views.pending_hints lists) when the buffer
    # is flushed, every hints_flush_period (10 s): wait for one flush.

    async def hints_held() -> bool:
        return await asyncio.to_thread(pending_hints_for, NODES[2]) > 0

    await wait_until(hints_held, 30, "hints for 127.0.0.3 held by the live nodes", interval=2)

    await asyncio.to_thread(node_script, "kill-node", 2)
    try:
        # No quorum: writes fail and are retried, nothing more is written or
        # acknowledged; the broker keeps the backlog in our session.
        await asyncio.sleep(3)  # writes in flight at the kill end one way or the other
        stuck, stuck_acked = written(gw), acked(gw)
        await asyncio.sleep(6)
        assert publisher.is_alive(), "the publish ended before the quorum was lost"
        assert written(gw) == stuck
        assert acked(gw) == stuck_acked  # nothing acknowledged without its write
        assert gw.proc is not None
        assert gw.proc.poll() is None
    finally:
        await asyncio.to_thread(node_script, "start-node", 2)
    # One node back: quorum again, the backlog drains.
    await asyncio.to_thread(publisher.join, 180)
    await assert_all_stored(db, tenant, publisher, deadline=180)
    assert written(gw) > stuck

    # Node 3 back: it catches up from the hints, and quorum reads stay right.
    await asyncio.to_thread(node_script, "start-node", 3)

    async def caught_up() -> bool:
        return await asyncio.to_thread(pending_hints_for, NODES[2]) == 0

    await wait_until(caught_up, 120, "hints for 127.0.0.3 delivered", interval=2)
    await assert_all_stored(db, tenant, publisher, deadline=60)
    gw.signal(signal.SIGTERM)
    assert gw.wait() == 0
