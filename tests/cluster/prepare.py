"""The cluster tests' keyspace, applied through nodes 2 and 3 before node 1
joins: `make test` runs this while the fault tests run on the single node
(which holds 127.0.0.1 until then). Node 1 learns the schema as it joins, so
the tests' own `schema apply` (the ``keyspace`` fixture) then changes nothing.
On three nodes every statement waits for schema agreement: about 20 s of the
run, now off its critical path. A failure here is only said: the fixture
applies the schema anyway.

Usage: .venv/bin/python -m tests.cluster.prepare
"""

from __future__ import annotations

import sys

from ..helpers import base_env, run_cli
from .conftest import CLUSTER_ENV, NODES


def main() -> int:
    env = base_env(**{**CLUSTER_ENV, "GATEWAY_CASSANDRA__CONTACT_POINTS": ",".join(NODES[1:])})
    result = run_cli("schema", "apply", env=env)
    if result.returncode != 0:
        print(f"cluster: schema not applied ahead (the tests will):\n{result.stderr}", end="")
    else:
        print(f"cluster: {result.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
