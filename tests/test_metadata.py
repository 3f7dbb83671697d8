"""Metadata against the real broker and Cassandra: metric names, tag keys and
values, and devices by tag value, maintained on ingest, written once per new
entry, capped per tenant (counted), and served by the CLI and the API."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import orjson
import pytest

from gateway.config import Config, TopicTemplate
from gateway.store import queries
from gateway.store.database import Database
from gateway.web.tokens import TokenStore

from .helpers import DRIVERS, base_env, make_config, publish, run_cli, running_gateway
from .test_read_api import client

# A topic tree of their own: other tenants' traffic on the shared broker would
# add metadata writes to the counts checked here.
TOPICS = '[{template = "meta-test/{tenant}/devices/{device_id}/events"}]'


def topic(tenant: str, device: str) -> str:
    return f"meta-test/{tenant}/devices/{device}/events"


def event(tags: dict[str, str], **metrics: float) -> bytes:
    return orjson.dumps(
        {"ts": int(time.time() * 1000), "value": 1.5, "metrics": metrics, "tags": tags}
    )


async def test_metadata_is_kept_on_ingest_and_served(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    messages = [
        (topic(tenant, "d1"), event({"floor": "3", "room": "a"}, temp=20.0)),
        (topic(tenant, "d2"), event({"floor": "3"}, temp=21.0, hum=40.0)),
        (topic(tenant, "d3"), event({"floor": "4"})),
        (topic(tenant, "d1"), event({"floor": "3", "room": "a"}, temp=20.5)),  # nothing new
    ]
    async with running_gateway(make_config(GATEWAY_TOPICS=TOPICS)) as gw:
        await publish(messages)
        await gw.wait_handled(len(messages))
        # d1's second event added nothing: one write per new entry.
        # metrics value/temp/hum, keys floor/room, values 3/4/a, devices 4 pairs.
        assert gw.stats.metadata_writes == 3 + 2 + 3 + 4
        assert gw.stats.metadata_capped == 0
    assert sorted(await queries.meta_metrics(db, tenant)) == ["hum", "temp", "value"]
    assert sorted(await queries.meta_tag_keys(db, tenant)) == ["floor", "room"]
    assert sorted(await queries.meta_tag_values(db, tenant, "floor")) == ["3", "4"]
    assert sorted(await queries.meta_tag_devices(db, tenant, "floor", "3")) == ["d1", "d2"]

    result = run_cli("meta", "devices", "floor=3", "--tenant", tenant, "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(orjson.loads(result.stdout)) == ["d1", "d2"]
    result = run_cli("meta", "devices", "floor", "--tenant", tenant)
    assert result.returncode == 2
    assert "KEY=VALUE" in result.stderr
    # Empty answers say why: a tag the tenant does not have, a tenant with
    # nothing recorded, a device it does not have, or nothing in the range.
    result = run_cli("meta", "values", "flor", "--tenant", tenant)
    assert result.returncode == 0, result.stderr
    assert "the tenant has no tag 'flor'; its tags: floor, room" in result.stderr
    # A value the tag never had (it said nothing: CLI probe).
    result = run_cli("meta", "devices", "floor=9", "--tenant", tenant)
    assert result.returncode == 0, result.stderr
    assert "tag 'floor' has no value '9'; its values: 3, 4" in result.stderr
    result = run_cli("meta", "tags", "--tenant", f"{tenant}x", "--json")
    assert (result.returncode, orjson.loads(result.stdout)) == (0, [])
    assert "nothing recorded for the tenant; a misspelt --tenant?" in result.stderr
    result = run_cli("history", "--tenant", tenant, "d9")
    assert f"tenant {tenant!r} has no device 'd9'; a misspelt id or --tenant?" in result.stderr
    # Not found is 1, as `gateway device` says it (history and rollup said 0).
    assert result.returncode == 1, result.stderr
    result = run_cli("rollup", "--tenant", tenant, "d9", "--metric", "temp")
    assert f"tenant {tenant!r} has no device 'd9'" in result.stderr
    assert result.returncode == 1, result.stderr
    # With a misspelt metric too: the metric's hint, and still 1 (it was 0).
    result = run_cli("rollup", "--tenant", tenant, "d9", "--metric", "tmp")
    assert "has no such metric" in result.stderr, result.stderr
    assert result.returncode == 1, result.stderr
    result = run_cli(
        "history",
        "--tenant",
        tenant,
        "d1",
        "--until",
        "2020-01-01T00:00:00Z",
        "--since",
        "2019-12-31T00:00:00Z",
    )
    assert result.returncode == 0, result.stderr
    assert "(0 events: none in the range; its newest event is at 20" in result.stderr
    result = run_cli("rejected", "--tenant", tenant, "--since", "9d")
    assert result.returncode == 0, result.stderr
    assert "as far back as they are kept (7 days)" in result.stderr, result.stderr

    tokens = TokenStore(tmp_path / "tokens.jsonl")
    async with client(db, make_config(), tokens, tenant) as api:
        base = f"/api/v1/tenants/{tenant}/meta"
        status, body, _ = await api.get(f"{base}/tags")
        assert (status, sorted(body["tags"])) == (200, ["floor", "room"])
        status, body, _ = await api.get(f"{base}/tags/floor/values")
        assert (status, sorted(body["values"])) == (200, ["3", "4"])
        status, body, _ = await api.get(f"{base}/metrics")
        assert (status, sorted(body["metrics"])) == (200, ["hum", "temp", "value"])
        status, body, _ = await api.get(f"{base}/devices?tag=floor=4")
        assert (status, body["devices"]) == (200, ["d3"])
        status, body, _ = await api.get(f"{base}/devices")
        assert status == 400
        assert body["detail"].startswith("tag:")


async def test_a_tenant_over_its_metadata_cap_is_counted_and_its_events_still_stored(
    db: Database, tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cap was silent: never logged, and the lists' answers said nothing,
    so `meta devices` of a tenant past it was incomplete without a word. And
    each later event of a device with a refused entry counted it again, for
    the life of the process."""
    caplog.set_level(logging.WARNING, "gateway.store.metadata")
    # A tag whose value never repeats (a serial number, say).
    messages = [(topic(tenant, f"d{i}"), event({"serial": f"s{i}"})) for i in range(8)]
    config = make_config(GATEWAY_METADATA__MAX_PER_TENANT="5", GATEWAY_TOPICS=TOPICS)
    async with running_gateway(config) as gw:
        await publish(messages)
        await gw.wait_handled(len(messages))
        assert gw.stats.written == len(messages)
        assert gw.stats.metadata_writes == 5
        capped = gw.stats.metadata_capped
        assert capped > 0
        assert gw.stats.metadata_capped_by_tenant.counts[tenant] == capped
        # The same devices again, the same tags: nothing new to refuse.
        await publish([(t, event({"serial": f"s{i}"})) for i, (t, _) in enumerate(messages)])
        await gw.wait_handled(2 * len(messages))
        assert gw.stats.metadata_capped == capped
    said = [r.getMessage() for r in caplog.records if "metadata.max_per_tenant" in r.getMessage()]
    assert len(said) == 1, said
    assert repr(tenant) in said[0]
    assert "(5 entries)" in said[0]
    result = run_cli(
        "meta", "tags", "--tenant", tenant, env=base_env(GATEWAY_METADATA__MAX_PER_TENANT="5")
    )
    assert result.returncode == 0, result.stderr
    assert "the tenant is at metadata.max_per_tenant (5 entries)" in result.stderr
    tokens = TokenStore(tmp_path / "tokens.jsonl")
    async with client(db, config, tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/tags/serial/values")
        assert (status, body["capped"]) == (200, True), body
    async with client(db, make_config(), tokens, tenant) as api:  # the default cap: 10,000
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/tags")
        assert (status, body["capped"]) == (200, False), body
    stored = (
        len(await queries.meta_metrics(db, tenant))
        + len(await queries.meta_tag_keys(db, tenant))
        + len(await queries.meta_tag_values(db, tenant, "serial"))
    )
    for i in range(8):
        stored += len(await queries.meta_tag_devices(db, tenant, "serial", f"s{i}"))
    assert stored == 5


# -- the cap holds across restarts and instances (meta_entry_counts) ----------


async def _stored(db: Database, tenant: str, serials: int) -> int:
    """The tenant's metadata rows, for events tagged serial=s0.. s{serials-1}."""
    stored = (
        len(await queries.meta_metrics(db, tenant))
        + len(await queries.meta_tag_keys(db, tenant))
        + len(await queries.meta_tag_values(db, tenant, "serial"))
    )
    for i in range(serials):
        stored += len(await queries.meta_tag_devices(db, tenant, "serial", f"s{i}"))
    return stored


async def test_a_tenant_at_its_cap_stays_there_after_a_restart(db: Database, tenant: str) -> None:
    # The cap was once counted per process: each start let the tenant add
    # up to the cap again.
    def config() -> Config:
        return make_config(GATEWAY_METADATA__MAX_PER_TENANT="5", GATEWAY_TOPICS=TOPICS)

    serials = [(topic(tenant, f"d{i}"), event({"serial": f"s{i}"})) for i in range(8)]
    async with running_gateway(config()) as gw:
        await publish(serials[:4])
        await gw.wait_handled(4)
        assert gw.stats.metadata_writes == 5
    result = run_cli("meta", "count", "--tenant", tenant, "--json")
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout) == {"tenant": tenant, "entries": 5, "cap": 10_000}
    async with running_gateway(config()) as gw:
        await publish(serials[4:])
        await gw.wait_handled(4)
        assert gw.stats.written == 4
        assert gw.stats.metadata_writes == 0
        # Each event's new tag value and (value, device) entry.
        assert gw.stats.metadata_capped_by_tenant.counts[tenant] == 8
    assert await _stored(db, tenant, 8) == 5


async def test_an_entry_stored_before_a_restart_is_not_counted_again(
    db: Database, tenant: str
) -> None:
    first = [(topic(tenant, "d1"), event({"floor": "3"}))]  # value, floor, 3, (3, d1)
    config = make_config(
        GATEWAY_METADATA__MAX_PER_TENANT="5",
        GATEWAY_TOPICS=TOPICS,
        GATEWAY_CASSANDRA__DRIVER=DRIVERS[0],
    )
    async with running_gateway(config) as gw:
        await publish(first)
        await gw.wait_handled(1)
        assert gw.stats.metadata_writes == 4
    assert await queries.meta_entry_count(db, tenant) == 4
    # After the restart the LRU is empty: the four are read, found and not
    # counted, so the fifth entry (metric temp) still fits under the cap. The
    # other driver, if this platform has two: both bind the counter update.
    config = make_config(
        GATEWAY_METADATA__MAX_PER_TENANT="5",
        GATEWAY_TOPICS=TOPICS,
        GATEWAY_CASSANDRA__DRIVER=DRIVERS[-1],
    )
    async with running_gateway(config) as gw:
        await publish([*first, (topic(tenant, "d1"), event({"floor": "3"}, temp=20.0))])
        await gw.wait_handled(2)
        assert gw.stats.metadata_reads == 5
        assert gw.stats.metadata_writes == 1
        assert gw.stats.metadata_capped == 0
    assert await queries.meta_entry_count(db, tenant) == 5
    assert sorted(await queries.meta_metrics(db, tenant)) == ["temp", "value"]


async def test_two_instances_on_one_tenant_stay_within_its_cap(db: Database, tenant: str) -> None:
    """Each instance moves the tenant's count by a compare-and-set before it
    writes: together they never pass the cap, however they race, and the
    loser of a race tries again, so neither starves the other."""
    # Each instance brings 62 new entries (metric value, tag key serial, and
    # per event a value and a device): either alone fits, both do not.
    cap = 100
    a = make_config(GATEWAY_METADATA__MAX_PER_TENANT=str(cap), GATEWAY_TOPICS=TOPICS)
    b = make_config(GATEWAY_METADATA__MAX_PER_TENANT=str(cap))
    b = b.model_copy(
        update={"topics": [TopicTemplate(template="meta-test-b/{device_id}/events", tenant=tenant)]}
    )
    n = 30
    via_a = [(topic(tenant, f"d{i}"), event({"serial": f"s{i}"})) for i in range(n)]
    via_b = [(f"meta-test-b/d{i}/events", event({"serial": f"s{i}"})) for i in range(n, 2 * n)]
    async with running_gateway(a) as gw_a, running_gateway(b) as gw_b:
        await asyncio.gather(publish(via_a), publish(via_b))
        await gw_a.wait_handled(n)
        await gw_b.wait_handled(n)
        written = gw_a.stats.metadata_writes + gw_b.stats.metadata_writes
        # Neither starved the other: each wrote what the other left.
        assert gw_a.stats.metadata_writes > 0
        assert gw_b.stats.metadata_writes > 0
        capped = gw_a.stats.metadata_capped + gw_b.stats.metadata_capped
        assert capped > 0
    # A compare-and-set never moves the count past the cap; every entry
    # written was counted first.
    assert await queries.meta_entry_count(db, tenant) == cap
    assert written <= cap
    # The two entries both instances carry (metric value, tag key serial) may
    # be found absent by both and written by both: counted twice, stored once.
    assert written - 2 <= await _stored(db, tenant, 2 * n) <= written


async def test_a_drifted_entry_count_is_recounted_from_the_tables(
    db: Database, tenant: str
) -> None:
    """The count only ever errs high (a compare-and-set retried after a
    timeout it had applied, a crash between the count and the rows), and a
    tenant then reached its cap with fewer entries than it: there was no way
    back but CQL by hand. `gateway meta count --recount` sets it to what the
    tables hold."""
    messages = [(topic(tenant, f"d{i}"), event({"floor": str(i)})) for i in range(3)]
    async with running_gateway(make_config(GATEWAY_TOPICS=TOPICS)) as gw:
        await publish(messages)
        await gw.wait_handled(len(messages))
    # value, floor, 3 values of floor, 3 (value, device) pairs
    assert await queries.meta_entry_count(db, tenant) == 8
    await db.execute(
        f"UPDATE {db.keyspace}.meta_entry_counts SET reserved = 20 WHERE tenant = %s", (tenant,)
    )
    result = run_cli("meta", "count", "--tenant", tenant, "--recount", "--json")
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout) == {
        "tenant": tenant,
        "recounted": {"before": 20, "after": 8},
        "entries": 8,
        "cap": 10_000,
    }
    assert "meta count: 3 of 3 tag values counted" in result.stderr
    assert await queries.meta_entry_count(db, tenant) == 8
    # Its row deleted by hand: raised to the entries again.
    await db.execute(f"DELETE FROM {db.keyspace}.meta_entry_counts WHERE tenant = %s", (tenant,))
    result = run_cli("meta", "count", "--tenant", tenant, "--recount")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("recounted: 0 -> 8\n8 of 10000"), result.stdout


async def test_past_the_cache_bound_an_entry_is_read_again_not_written_or_counted(
    db: Database, tenant: str
) -> None:
    """metadata.cache_size bounds what the writer remembers: an entry it
    forgot costs one read when seen again (counted), never a second write
    or a second place against the tenant's cap."""
    config = make_config(GATEWAY_METADATA__CACHE_SIZE="100", GATEWAY_TOPICS=TOPICS)
    # 120 devices with a tag value each: value, serial, 120 values, 120 device pairs.
    first = [(topic(tenant, f"d{i}"), event({"serial": f"s{i}"})) for i in range(120)]
    async with running_gateway(config) as gw:
        await publish(first)
        await gw.wait_handled(len(first))
        assert gw.stats.metadata_writes == 2 + 120 + 120
        # 242 entries remembered in a cache of 100, and 120 devices' shapes in
        # another: 142 and 20 forgotten, and counted
        # (gateway_metadata_cache_evictions_total; it was not anywhere).
        assert gw.stats.metadata_cache_evictions == 142 + 20
        reads = gw.stats.metadata_reads
        # d0's shape, value and device pair were among the oldest, so forgotten.
        await publish(first[:1])
        await gw.wait_handled(len(first) + 1)
        assert gw.stats.metadata_reads == reads + 2
        assert gw.stats.metadata_writes == 2 + 120 + 120
    assert await queries.meta_entry_count(db, tenant) == 2 + 120 + 120


async def test_a_metadata_list_cut_at_its_bound_says_so(
    db: Database, tenant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lists stop at queries.MAX_META (10,000) entries, while
    metadata.max_per_tenant may be set to 10,000,000: 10,050 devices of a
    tag value listed 10,000, with nothing to say the rest were left out
    (probe of the metadata). The answer now says "truncated", the CLI says
    the list is longer. MAX_META is lowered here to 3, for 5 devices."""
    config = make_config(GATEWAY_TOPICS=TOPICS)
    async with running_gateway(config) as gw:
        await publish([(topic(tenant, f"d{i}"), event({"floor": "4"})) for i in range(5)])
        await gw.wait_handled(5)
    monkeypatch.setattr(queries, "MAX_META", 3)
    tokens = TokenStore(tmp_path / "tokens.jsonl")
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/devices?tag=floor=4")
        assert (status, len(body["devices"]), body["truncated"]) == (200, 3, True)
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/tags")
        assert (body["tags"], body["truncated"]) == (["floor"], False)
