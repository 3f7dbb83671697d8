"""The three-node cluster's tests: `make test-cluster` (the last part of `make
test`) starts Cassandra as three nodes on 127.0.0.1..3 (CASSANDRA_NODES=3),
runs tests/cluster/ (marked `cluster` by tests/conftest.py) and stops the
cluster. They run apart from the rest: the cluster replaces the single node.

They write to a keyspace of their own with replication factor 3, at the
gateway's default consistency, LOCAL_QUORUM.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gateway.store.database import Database, connect

from ..helpers import CQL_PORT, ROOT, base_env, make_config, reachable, run_cli

NODES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
CLUSTER_KEYSPACE = "gateway_cluster_test"
# GATEWAY_* settings of every gateway and CLI call in these tests.
CLUSTER_ENV = {
    "GATEWAY_CASSANDRA__KEYSPACE": CLUSTER_KEYSPACE,
    "GATEWAY_CASSANDRA__CONTACT_POINTS": ",".join(NODES),
    "GATEWAY_CASSANDRA__REPLICATION_FACTOR": "3",
}


def node_script(action: str, node: int) -> None:
    """cassandra.sh start-node/stop-node/kill-node I, for the cluster."""
    result = subprocess.run(
        ["bash", str(ROOT / "cassandra" / "cassandra.sh"), action, str(node)],
        env=base_env(CASSANDRA_NODES="3"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, f"cassandra.sh {action} {node}: {result.stdout}{result.stderr}"


@pytest.fixture(autouse=True)
def all_nodes_up(keyspace: str) -> None:
    """Each test starts on the whole cluster: a node an earlier test left down
    is started (and waited for) here, not at the end of that test, so the last
    test does not wait for a node nobody needs any more."""
    for i, host in enumerate(NODES, 1):
        if not reachable(CQL_PORT, host):
            node_script("start-node", i)


@pytest.fixture(scope="session")
def keyspace(services: None) -> str:
    down = [h for h in NODES if not reachable(CQL_PORT, h)]
    if down:
        pytest.fail(
            f"the three-node cluster is not up ({', '.join(down)} not answering on "
            f"port {CQL_PORT}); `make test-cluster` starts it",
            pytrace=False,
        )
    result = run_cli("schema", "apply", env=base_env(**CLUSTER_ENV))
    assert result.returncode == 0, result.stderr
    return CLUSTER_KEYSPACE


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def db(keyspace: str) -> AsyncIterator[Database]:
    async with connect(make_config(**CLUSTER_ENV).cassandra) as database:
        yield database
