"""`gateway schema migrate`: a keyspace with an older latest_events_by_state
(from before state generations, or before the device_hash clustering column)
is refused by `schema apply`, with the way out named, and rebuilt by
`migrate` from latest_events_by_device, write timestamps kept; a
latest_events_by_device from before state_event_id gains the column, and
tenant_states the tenant's recorded state_buckets; `gateway run` on such a
keyspace stops with one line naming `gateway schema apply`."""

from __future__ import annotations

import uuid

import pytest
from cassandra.cluster import Cluster

from gateway.identity import device_hash

from .helpers import base_env, make_config, run_cli

# latest_events_by_state as round 1 created it, and as state generations left it.
ROUND_1 = """
CREATE TABLE {ks}.latest_events_by_state (
    tenant text, state text, bucket int, device_id text,
    ts timestamp, value text, value_num double,
    PRIMARY KEY ((tenant, state, bucket), device_id))
"""
GENERATIONS = """
CREATE TABLE {ks}.latest_events_by_state (
    tenant text, state text, bucket int, gen int, device_id text,
    ts timestamp, value text, tags frozen<map<text, text>>,
    PRIMARY KEY ((tenant, state, bucket, gen), device_id))
"""


@pytest.mark.parametrize("old_table", [ROUND_1, GENERATIONS], ids=["round-1", "generations"])
def test_an_old_state_table_is_refused_then_migrated(old_table: str) -> None:
    keyspace = f"gateway_migrate_{uuid.uuid4().hex[:8]}"
    env = base_env(GATEWAY_CASSANDRA__KEYSPACE=keyspace)
    config = make_config(GATEWAY_CASSANDRA__KEYSPACE=keyspace)
    cluster = Cluster(config.cassandra.contact_points, port=config.cassandra.port)
    session = cluster.connect()
    try:
        assert run_cli("schema", "apply", env=env).returncode == 0
        session.execute(f"DROP TABLE {keyspace}.latest_events_by_state")
        session.execute(old_table.format(ks=keyspace))
        # Older still: latest_events_by_device before state_event_id.
        session.execute(f"ALTER TABLE {keyspace}.latest_events_by_device DROP state_event_id")
        # And tenant_states before state_buckets.
        session.execute(f"ALTER TABLE {keyspace}.tenant_states DROP state_buckets")
        insert = (
            f"INSERT INTO {keyspace}.latest_events_by_device "
            "(tenant, device_id, state, ts, value, value_num, tags) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) USING TIMESTAMP %s"
        )
        session.execute(
            insert, ("acme", "door-1", "open", 1_000, None, 3.5, {"floor": "3"}, 1_000_000)
        )
        session.execute(insert, ("acme", "door-2", "shut", 2_000, "x", None, None, 2_000_000))
        session.execute(insert, ("acme", "meter", None, 3_000, None, 1.0, None, 3_000_000))

        # The gateway itself names the way out too (it was a traceback).
        no_api = {"GATEWAY_API__ENABLED": "false", "GATEWAY_MQTT__CLIENT_ID": f"gw-{keyspace}"}
        run = run_cli("run", env=env | no_api, timeout=60)
        assert run.returncode != 0
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith(f"gateway: keyspace {keyspace!r} lacks"), run.stderr
        assert last.endswith("run `gateway schema apply`"), run.stderr
        assert "Traceback" not in run.stderr

        refused = run_cli("schema", "apply", env=env)
        assert refused.returncode != 0
        assert "gateway schema migrate" in refused.stderr
        assert "Traceback" not in refused.stderr

        migrated = run_cli("schema", "migrate", env=env)
        assert migrated.returncode == 0, migrated.stderr
        assert "2 rows" in migrated.stdout

        rows = {
            r.device_id: r
            for r in session.execute(
                f"SELECT device_hash, device_id, state, value, tags, WRITETIME(ts) AS wt "
                f"FROM {keyspace}.latest_events_by_state"
            )
        }
        assert set(rows) == {"door-1", "door-2"}
        assert (rows["door-1"].state, rows["door-1"].value, rows["door-1"].wt) == (
            "open",
            "3.5",
            1_000_000,
        )
        assert dict(rows["door-1"].tags) == {"floor": "3"}
        assert rows["door-1"].device_hash == device_hash("door-1")
        assert (rows["door-2"].value, rows["door-2"].wt) == ('"x"', 2_000_000)

        assert run_cli("schema", "apply", env=env).returncode == 0  # now the new layout
        columns = session.execute(
            "SELECT column_name FROM system_schema.columns "
            "WHERE keyspace_name = %s AND table_name = 'latest_events_by_device'",
            (keyspace,),
        )
        assert "state_event_id" in {c.column_name for c in columns}
        # migrate recorded the state_buckets it rebuilt the tenant with.
        (recorded,) = session.execute(
            f"SELECT state_buckets FROM {keyspace}.tenant_states WHERE tenant = 'acme'"
        )
        assert recorded.state_buckets == 1
        # Once current, migrate does nothing unless forced: it rewrote every
        # state row of whatever keyspace the config named (the default one,
        # when --config was missing).
        again = run_cli("schema", "migrate", env=env)
        assert again.returncode == 0, again.stderr
        assert "already has the current layout; nothing to migrate" in again.stderr
        assert "rebuilt" not in again.stdout + again.stderr
        forced = run_cli("schema", "migrate", "--force", env=env)
        assert forced.returncode == 0, forced.stderr
        assert "2 rows" in forced.stdout
        listed = run_cli("devices", "--tenant", "acme", "--state", "open", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert '"door-1"' in listed.stdout
    finally:
        session.execute(f"DROP KEYSPACE IF EXISTS {keyspace}")
        cluster.shutdown()
