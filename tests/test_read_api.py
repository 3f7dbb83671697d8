"""The read API (/api/v1) against the real broker and Cassandra: what goes in
through MQTT comes out through HTTP, paged, filtered, per tenant, and bad
requests get a 4xx that names the problem, never a 500."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import Config
from gateway.lru import LRU
from gateway.store import queries
from gateway.store.database import Database
from gateway.units import epoch_ms
from gateway.web import api as api_module
from gateway.web import server as server_module
from gateway.web.api import read_api
from gateway.web.server import build_app, once_per, serve
from gateway.web.tokens import TokenStore

from .helpers import (
    base_env,
    free_port,
    make_config,
    publish,
    run_cli,
    running_gateway,
    topic,
    wait_until,
)
from .test_ingest import D1, D2, D3, reference_messages


@asynccontextmanager
async def api_server(db: Database, config: Config, tokens: TokenStore) -> AsyncIterator[str]:
    app = build_app(
        metrics=CollectorRegistry(),
        health=lambda: (True, {}),
        noisy=lambda tenant: [],
        extra=[read_api(db, config, tokens)],
    )
    async with serve(app, "127.0.0.1", 0) as listening:
        yield listening.url


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str | None) -> None:
        self.session, self.url, self.token = session, url, token

    async def get(
        self, path: str, *, token: str | None = None, **headers: str
    ) -> tuple[int, Any, aiohttp.ClientResponse]:
        auth = token if token is not None else self.token
        if auth:
            headers["Authorization"] = f"Bearer {auth}"
        async with self.session.get(self.url + path, headers=headers) as response:
            body = await response.read()
            return response.status, orjson.loads(body) if body else None, response


async def load_reference(*tenants: str) -> None:
    """The reference example's five events for each tenant, through MQTT, stored."""
    async with running_gateway(make_config()) as gw:
        await publish([m for t in tenants for m in reference_messages(t)])
        await gw.wait_handled(5 * len(tenants))


@pytest.fixture
def tokens(tmp_path: Path) -> TokenStore:
    return TokenStore(tmp_path / "tokens.jsonl")


@asynccontextmanager
async def client(
    db: Database, config: Config, tokens: TokenStore, tenant: str | None
) -> AsyncIterator[Client]:
    token = tokens.add(tenant=tenant) if tenant else tokens.add(admin=True)
    async with api_server(db, config, tokens) as url, aiohttp.ClientSession() as session:
        yield Client(session, url, token.token)


async def test_the_reference_example_through_mqtt_then_http(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    await load_reference(tenant)
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states")
        assert status == 200, body
        assert body["tenant"] == tenant
        assert body["states"] == [{"state": "off", "devices": 2}, {"state": "on", "devices": 1}]
        assert body["cached_for_s"] > 0

        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states/on/devices")
        assert status == 200, body
        assert body["devices"] == [
            {"device_id": D1, "ts": "2021-01-01T03:33:33.000Z", "value": "event 1-3", "tags": {}}
        ]
        assert body["next_cursor"] is None
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states/off/devices")
        assert [d["device_id"] for d in body["devices"]] == [D2, D3]
        # Trimmed as the decoder trims a device's "off ": it found nothing.
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states/off%20/devices")
        assert (status, body["state"]) == (200, "off"), body
        assert [d["device_id"] for d in body["devices"]] == [D2, D3]

        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/{D1}")
        assert status == 200
        assert (body["state"], body["value"]) == ("on", "event 1-3")

        since = "since=2021-01-01T00:00:00Z&until=2021-01-02T00:00:00Z"
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/{D1}/history?{since}")
        assert status == 200, body
        assert [e["value"] for e in body["events"]] == ["event 1-3", "event 1-2", "event 1-1"]
        # Paged one at a time: the same three, in the same order, then no cursor.
        seen, cursor = [], ""
        for _ in range(4):
            status, body, _ = await api.get(
                f"/api/v1/tenants/{tenant}/devices/{D1}/history?{since}&limit=1{cursor}"
            )
            seen += [e["value"] for e in body["events"]]
            if body["next_cursor"] is None:
                break
            cursor = f"&cursor={body['next_cursor']}"
        assert seen == ["event 1-3", "event 1-2", "event 1-1"]
        # A cursor is for the query it came from: on another it gave a 200
        # that began mid-list (a page of "on" from where "off" ended, or a
        # device's history from another device's time).
        _, off, _ = await api.get(f"/api/v1/tenants/{tenant}/states/off/devices?limit=1")
        _, d1, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/{D1}/history?{since}&limit=1")
        for path in (
            f"states/on/devices?cursor={off['next_cursor']}",
            f"states/off/devices?prefix=x&cursor={off['next_cursor']}",
            f"devices/{D2}/history?{since}&cursor={d1['next_cursor']}",
        ):
            status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/{path}")
            assert status == 400, (path, body)
            assert body["detail"].startswith("cursor: given out for another query"), body
        status, body, _ = await api.get(
            f"/api/v1/tenants/{tenant}/states/off/devices?cursor={off['next_cursor']}"
        )
        pages = [d["device_id"] for d in off["devices"] + body["devices"]]
        assert sorted(pages) == [D2, D3]  # its own query takes it

        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/nobody")
        assert status == 404
        assert body["error"] == "not_found"
        assert "nobody" in body["detail"]


async def test_a_device_is_found_by_its_id_whatever_its_state(
    db: Database, tenant: str, tokens: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager looking for "lobby" had to know its state first: the prefix
    filter searched one state's list. The exact id comes first, in any
    state or none; the rest by id, each with its state."""
    config = make_config(GATEWAY_SAMPLING__ENABLED="false")
    sent: dict[str, dict[str, Any]] = {
        "hall-1": {"state": "on"},
        "Lobby-1": {"state": "on", "tags": {"floor": "0"}},
        "lobby-2": {"state": "off", "value": 2.5},
        "lobby": {"value": 1.0},  # no state: no state's list holds it
        "lobby-3": {"state": "alarm"},
    }
    messages = [
        (topic(tenant, device), orjson.dumps({"ts": 1_700_000_000_000 + i} | event))
        for i, (device, event) in enumerate(sent.items())
    ]
    async with running_gateway(config) as gw:
        await publish(messages)
        await gw.wait_handled(len(messages))
    async with client(db, config, tokens, tenant) as api:
        base = f"/api/v1/tenants/{tenant}/devices"
        status, body, _ = await api.get(f"{base}?prefix=LOBBY")
        assert status == 200, body
        # Not the exact id in any case: "LOBBY" names no device.
        assert [(d["device_id"], d["state"]) for d in body["devices"]] == [
            ("Lobby-1", "on"),
            ("lobby-2", "off"),
            ("lobby-3", "alarm"),
        ]
        assert (body["complete"], body["cut_short"]) == (True, [])
        assert body["devices"][0]["tags"] == {"floor": "0"}
        assert body["devices"][1]["value"] == 2.5
        status, body, _ = await api.get(f"{base}?prefix=lobby")
        assert [(d["device_id"], d["state"]) for d in body["devices"]] == [
            ("lobby", None),
            ("Lobby-1", "on"),
            ("lobby-2", "off"),
            ("lobby-3", "alarm"),
        ]
        assert body["devices"][0]["value"] == 1.0
        # An exact id that a state lists too comes once, first.
        status, body, _ = await api.get(f"{base}?prefix=Lobby-1")
        assert [(d["device_id"], d["state"]) for d in body["devices"]] == [("Lobby-1", "on")]
        status, body, _ = await api.get(f"{base}?prefix=lobby&limit=2")
        assert [d["device_id"] for d in body["devices"]] == ["lobby", "Lobby-1"]
        assert body["complete"] is False
        status, body, _ = await api.get(f"{base}?prefix=nobody")
        assert (status, body["devices"], body["complete"]) == (200, [], True)
        status, body, _ = await api.get(base)
        assert (status, body["error"]) == (400, "bad_parameter"), body
        assert body["detail"].startswith("prefix:"), body
    # The CLI finds them as the API does, with their state ("—": none); and
    # with --state, among that state's devices only.
    found = run_cli("devices", "--tenant", tenant, "--prefix", "lobby")
    assert found.returncode == 0, found.stderr
    assert [line.split("\t")[:2] for line in found.stdout.splitlines()] == [
        ["lobby", "—"],
        ["Lobby-1", "on"],
        ["lobby-2", "off"],
        ["lobby-3", "alarm"],
    ]
    assert found.stderr == (
        f"(4 devices whose id starts with 'lobby' for tenant {tenant!r}, in any state)\n"
    )
    found = run_cli("devices", "--tenant", tenant, "--prefix", "LOBBY", "--state", "on")
    assert (found.returncode, found.stdout.split("\t")[0]) == (0, "Lobby-1"), found.stderr
    assert "1 device whose id starts with 'LOBBY' in state 'on'" in found.stderr
    found = run_cli("devices", "--tenant", tenant)
    assert found.returncode == 2
    # One line naming what to give (it said "devices:" twice).
    assert found.stderr.endswith(
        "gateway devices: error: give --state, or --prefix to find devices in any state\n"
    ), found.stderr

    async with client(db, config, tokens, tenant) as api:
        # A state's search that reads its share of FIND_ROWS without filling
        # its page stops there, and the answer names that state.
        monkeypatch.setattr(queries, "FIND_ROWS", 1)
        monkeypatch.setattr(queries, "FIND_STATE_ROWS", 1)
        status, body, _ = await api.get(f"{base}?prefix=lobby-&limit=5")
        assert status == 200, body
        assert body["complete"] is False
        assert "on" in body["cut_short"], body


async def test_a_device_with_raw_rows_but_no_latest_row_is_no_404(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """Rows written around the gateway (no latest row): the device is one the
    tenant has, so an empty range of its history or roll-ups is an answer,
    in the API and the CLI alike, not "no such device"."""
    config = make_config(GATEWAY_SAMPLING__ENABLED="false")
    async with running_gateway(config) as gw:
        await publish([(topic(tenant, "raw-1"), orjson.dumps({"ts": 1_700_000_000_000}))])
        await gw.wait_handled(1)
    await db.execute(
        f"DELETE FROM {db.keyspace}.latest_events_by_device WHERE tenant = %s AND device_id = %s",
        (tenant, "raw-1"),
    )
    empty = "since=2000-01-01T00:00:00Z&until=2000-01-02T00:00:00Z"
    async with client(db, config, tokens, tenant) as api:
        base = f"/api/v1/tenants/{tenant}/devices/raw-1"
        status, body, _ = await api.get(f"{base}/history?{empty}")
        assert (status, body["events"]) == (200, []), body
        status, body, _ = await api.get(f"{base}/rollups?{empty}")
        assert (status, body["rollups"]) == (200, []), body
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/raw-2/history?{empty}")
        assert status == 404, body
    since, until = "2000-01-01T00:00:00Z", "2000-01-02T00:00:00Z"
    for command in ("history", "rollup"):
        result = run_cli(command, "--tenant", tenant, "raw-1", "--since", since, "--until", until)
        assert result.returncode == 0, (command, result.stderr)
        assert "has no device" not in result.stderr, (command, result.stderr)
        result = run_cli(command, "--tenant", tenant, "raw-2", "--since", since, "--until", until)
        assert result.returncode == 1, (command, result.stderr)


async def test_paging_crosses_buckets_and_filters_by_prefix_and_tag(
    db: Database, tokens: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = f"p{uuid.uuid4().hex[:12]}"
    env = {f"GATEWAY_TENANTS__{tenant.upper()}__STATE_BUCKETS": "4"}
    config = make_config(GATEWAY_SAMPLING__ENABLED="false", **env)
    count = 5_000
    messages = [
        (
            topic(tenant, f"dev-{i:05d}"),
            orjson.dumps(
                {"ts": 1_700_000_000_000 + i, "state": "on", "tags": {"floor": str(i % 7)}}
            ),
        )
        for i in range(count)
    ]
    async with running_gateway(config) as gw:
        await publish(messages)
        await gw.wait_handled(count, deadline=180)
    async with client(db, config, tokens, tenant) as api:
        base = f"/api/v1/tenants/{tenant}/states/on/devices"
        got: list[str] = []
        cursor, pages = "", 0
        while True:
            status, body, _ = await api.get(f"{base}?limit=250{cursor}")
            assert status == 200, body
            assert len(body["devices"]) <= 250
            ids = [d["device_id"] for d in body["devices"]]
            assert ids == sorted(ids)  # by id within a page (pages go by device hash)
            got += ids
            pages += 1
            if body["next_cursor"] is None:
                break
            cursor = f"&cursor={body['next_cursor']}"
        assert len(got) == count
        assert set(got) == {f"dev-{i:05d}" for i in range(count)}
        assert pages >= count // 250

        status, body, _ = await api.get(f"{base}?prefix=dev-0012&limit=500")
        assert [d["device_id"] for d in body["devices"]] == [
            f"dev-{i:05d}" for i in range(120, 130)
        ]
        # Whatever the case ("lobby" finds "Lobby-3").
        status, upper, _ = await api.get(f"{base}?prefix=DEV-0012&limit=500")
        assert upper["devices"] == body["devices"]
        # The prefix is a filter within the scan budget: with a small budget
        # the answer comes in short pages, each with a cursor, and is complete
        # (limit 400: not the view just answered, which the answer cache holds).
        monkeypatch.setattr(queries, "SCAN_BUDGET", 700)
        found: list[str] = []
        cursor, requests = "", 0
        while True:
            status, body, _ = await api.get(f"{base}?prefix=dev-0012&limit=400{cursor}")
            assert status == 200, body
            found += [d["device_id"] for d in body["devices"]]
            requests += 1
            if body["next_cursor"] is None:
                break
            cursor = f"&cursor={body['next_cursor']}"
        assert sorted(found) == [f"dev-{i:05d}" for i in range(120, 130)]
        assert requests >= count // 700
        monkeypatch.undo()

        floor3: list[dict[str, Any]] = []
        cursor = ""
        while True:
            status, body, _ = await api.get(f"{base}?tag=floor:3&limit=100{cursor}")
            assert status == 200, body
            floor3 += body["devices"]
            if body["next_cursor"] is None:
                break
            cursor = f"&cursor={body['next_cursor']}"
        assert {d["device_id"] for d in floor3} == {
            f"dev-{i:05d}" for i in range(count) if i % 7 == 3
        }
        assert all(d["tags"] == {"floor": "3"} for d in floor3)
        # KEY=VALUE (the form of /meta/devices and the CLI) filters the same;
        # it was a 400 "expected KEY:VALUE".
        status, colon, _ = await api.get(f"{base}?tag=floor:3&limit=50")
        status, equals, _ = await api.get(f"{base}?tag=floor=3&limit=50")
        assert status == 200, equals
        assert equals["devices"] == colon["devices"]

        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states")
        assert body["states"] == [{"state": "on", "devices": count}]


async def test_tenants_are_isolated(db: Database, tenant: str, tokens: TokenStore) -> None:
    other = f"o{uuid.uuid4().hex[:12]}"
    await load_reference(tenant, other)
    config = make_config(GATEWAY_TENANTS__DEFAULT__TTL="30d")  # a section, not a tenant
    mine = tokens.add(tenant=tenant).token
    admin = tokens.add(admin=True).token
    async with api_server(db, config, tokens) as url, aiohttp.ClientSession() as session:
        api = Client(session, url, mine)
        path = f"/api/v1/tenants/{other}/states/on/devices"
        status, body, _ = await api.get(path)
        assert status == 403
        assert other in body["detail"]
        status, body, response = await api.get(path, token="")
        assert status == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        status, body, _ = await api.get(path, token="gwt_00000000_" + "x" * 43)
        assert status == 401
        status, body, _ = await api.get(path, token=admin)
        assert status == 200
        assert [d["device_id"] for d in body["devices"]] == [D1]
        status, body, _ = await api.get("/api/v1/me")
        assert body == {"admin": False, "tenants": [tenant]}
        status, body, _ = await api.get("/api/v1/me", token=admin)
        assert body["admin"] is True
        # All tenants up to queries.tenants' cap of 1,000 (a clean clone's test
        # keyspace is far below it; a long-used one may not be).
        listed = body["tenants"]
        assert {tenant, other} <= set(listed) or len(listed) == 1000
        assert "default" not in listed  # it was listed: an admin's picker offered it
        # Revoked by another process (`gateway token revoke` writes the file):
        # the running API refuses it within about a second (its store re-reads
        # the file), cached answers included.
        status, _, _ = await api.get(f"/api/v1/tenants/{tenant}/states")
        assert status == 200
        TokenStore(tokens.path).revoke(mine.split("_")[1])

        async def refused() -> bool:
            status, _, _ = await api.get(f"/api/v1/tenants/{tenant}/states")
            return status == 401

        await wait_until(refused, 5, "the revoked token refused by the running API", interval=0.1)


async def every_page(api: Client, path: str, key: str, pages: int) -> list[Any]:
    """The ``key`` items of every page of ``path`` (a query without a cursor),
    following next_cursor at most ``pages`` times: each must be taken back."""
    items: list[Any] = []
    cursor = ""
    for _ in range(pages):
        status, body, _ = await api.get(f"{path}{cursor}")
        assert status == 200, body
        items += body[key]
        if body["next_cursor"] is None:
            return items
        cursor = f"&cursor={body['next_cursor']}"
    raise AssertionError(f"{path}: more than {pages} pages")


async def test_history_pages_through_many_events_of_one_millisecond(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """30 events in one millisecond, 8 to a page: the cursor carried the ids of
    every event of that millisecond given out so far, outgrew the 512
    characters the API takes for a parameter, and page 4 was a 400."""
    ts = 1_700_000_000_000
    messages = [topic(tenant, "burst")] * 30
    async with running_gateway(make_config()) as gw:
        await publish(
            [
                (t, orjson.dumps({"ts": ts, "state": "on", "value": i}))
                for i, t in enumerate(messages)
            ]
        )
        await gw.wait_handled(30)
    since = "since=2023-11-14T00:00:00Z&until=2023-11-15T00:00:00Z"
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/devices/burst/history?{since}&limit=8"
        events = await every_page(api, path, "events", pages=6)
    assert sorted(e["value"] for e in events) == list(range(30))  # each once


async def test_the_answer_cache_is_bounded_in_bytes(
    db: Database, tenant: str, tokens: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded by 2048 answers only: history pages of long values, each a
    query of its own (since=7d, 7.0d, 168h ... are all different keys), could
    hold gigabytes on an edge host (read-API review)."""
    await load_reference(tenant)
    monkeypatch.setattr(api_module, "CACHE_BYTES", 16 * 1024)
    api = api_module.ReadApi(db, make_config(), tokens)
    app = build_app(metrics=CollectorRegistry(), health=lambda: (True, {}), extra=[api.add_routes])
    token = tokens.add(tenant=tenant).token
    cache = api.caches()["api_answers"]
    async with serve(app, "127.0.0.1", 0) as listening, aiohttp.ClientSession() as session:
        client = Client(session, listening.url, token)
        for second in range(100):
            status, body, _ = await client.get(
                f"/api/v1/tenants/{tenant}/devices/{D1}/history"
                f"?since=2020-12-31T00:00:{second // 60:02d}.{second % 60:02d}Z"
                "&until=2021-01-02T00:00:00Z"
            )
            assert (status, len(body["events"])) == (200, 3), body
    assert isinstance(cache, LRU)
    kept = sum(len(answer.body) for _, answer in cache.items())
    assert 0 < kept <= 16 * 1024
    assert len(cache) < 100
    assert cache.evictions == 100 - len(cache)


async def test_state_counts_read_a_bounded_number_of_partitions_at_once(
    db: Database, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every state's every bucket was counted at once: states times
    state_buckets (up to 1024 each) reads started together (read-API review).
    Counted here by the reads the session has under way."""
    config = make_config(**{f"GATEWAY_TENANTS__{tenant.upper()}__STATE_BUCKETS": "64"})
    async with running_gateway(config) as gw:
        await publish(
            [(topic(tenant, f"d{i}"), f'{{"state": "s{i % 3}"}}'.encode()) for i in range(30)]
        )
        await gw.wait_handled(30)
    under_way = most = 0
    execute = db.execute

    def counting(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        nonlocal under_way, most
        under_way += 1
        most = max(most, under_way)
        future = execute(*args, **kwargs)

        def done(_: asyncio.Future[Any]) -> None:
            nonlocal under_way
            under_way -= 1

        future.add_done_callback(done)
        return future

    monkeypatch.setattr(db, "execute", counting)
    counts = await queries.state_counts(db, config, tenant)
    assert counts == [("s0", 10), ("s1", 10), ("s2", 10)]
    assert 1 < most <= queries.COUNT_READS, most  # 3 x 64 = 192 at once before


async def test_rejected_says_when_its_limit_left_some_out(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """The answer had no way to say it was cut at its limit: the page guessed
    from the count, and said older ones were left out when exactly that many
    were there."""
    async with running_gateway(make_config()) as gw:
        await publish([(topic(tenant, f"b{i}"), b"{oops") for i in range(3)])
        await gw.wait_handled(3)
    async with client(db, make_config(), tokens, tenant) as api:
        for limit, shown, truncated in ((2, 2, True), (3, 3, False), (4, 3, False)):
            status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/rejected?limit={limit}")
            assert status == 200, body
            assert (len(body["rejected"]), body["truncated"]) == (shown, truncated), body
        # With what was kept of each payload.
        kept = {
            (r["payload"], r["payload_encoding"], r["payload_truncated"]) for r in body["rejected"]
        }
        assert kept == {("{oops", "utf-8", False)}
        # A since in the future is refused by name, as the CLI refuses it (it
        # answered an empty list, and said nothing of why).
        status, body, _ = await api.get(
            f"/api/v1/tenants/{tenant}/rejected?since=2099-01-01T00:00:00Z"
        )
        assert status == 400, body
        assert body["error"] == "bad_parameter", body
        assert body["detail"].startswith("since: 2099-01-01T00:00:00"), body
        assert body["detail"].endswith("is in the future"), body


async def test_an_event_a_fast_clock_dated_ahead_is_in_the_default_history(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """Stored (within limits.max_future_skew) and shown as the device's
    latest, but history and roll-ups ended at now by default: a device whose
    clock ran 2 minutes fast had its newest value left out of them."""
    ahead = int(time.time() * 1000) + 120_000
    async with running_gateway(make_config()) as gw:
        await publish([(topic(tenant, "fast"), orjson.dumps({"ts": ahead, "value": 7.5}))])
        await gw.wait_handled(1)
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/fast/history")
        assert status == 200, body
        assert [e["value"] for e in body["events"]] == [7.5]
        # Roll-ups keep ending at now: past it, since=7d of minutes (the
        # largest range they take, README) was over the windows' cap, a 400.
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/fast/rollups?since=7d")
        assert status == 200, body
    shown = run_cli("history", "--tenant", tenant, "fast", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [e["value"] for e in orjson.loads(shown.stdout)] == [7.5]
    rolled = run_cli("rollup", "--tenant", tenant, "fast", "--since", "7d", "--step", "1m")
    assert rolled.returncode == 0, rolled.stderr


@pytest.mark.parametrize("buckets", [1, 4])
async def test_a_page_that_ends_the_list_exactly_has_no_next_cursor(
    db: Database, tenant: str, tokens: TokenStore, buckets: int
) -> None:
    """Exactly 100 devices in a state: a page of 100 (or the second of 50)
    came with a next_cursor, and the page showed "Next" onto an empty page
    ("No devices are in state standby right now")."""
    config = make_config(**{f"GATEWAY_TENANTS__{tenant.upper()}__STATE_BUCKETS": str(buckets)})
    async with running_gateway(config) as gw:
        await publish([(topic(tenant, f"s{i:03d}"), b'{"state":"standby"}') for i in range(100)])
        await gw.wait_handled(100)
    async with client(db, config, tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/states/standby/devices"
        status, body, _ = await api.get(f"{path}?limit=100")
        assert status == 200, body
        assert (len(body["devices"]), body["next_cursor"]) == (100, None)
        status, first, _ = await api.get(f"{path}?limit=50")
        assert first["next_cursor"] is not None
        status, second, _ = await api.get(f"{path}?limit=50&cursor={first['next_cursor']}")
        assert (len(second["devices"]), second["next_cursor"]) == (50, None)
        both = {d["device_id"] for d in first["devices"] + second["devices"]}
        assert both == {f"s{i:03d}" for i in range(100)}


async def test_history_reads_newest_partitions_first_and_only_as_many_as_a_page_needs(
    db: Database, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long range listed every partition in it and read them all at once:
    20,000 partitions (a busy device over months) took 9 s for a page of 10,
    with 20,000 reads in flight. A page now reads the newest partitions
    first, queries.HISTORY_READS at a time, until no older one can change
    it, and is the same page as merging them all."""
    hour_ms, quarter_ms = 3_600_000, 900_000
    newest = epoch_ms(datetime.now(UTC)) // hour_ms * hour_ms - hour_ms
    ks = db.keyspace
    index = (
        f"INSERT INTO {ks}.telemetry_partitions (tenant, device_id, bucket_start, shard, "
        "bucket_seconds) VALUES (%s, 'd', %s, %s, %s)"
    )
    row = (
        f"INSERT INTO {ks}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
        "value_num) VALUES (%s, 'd', %s, %s, %s, %s, %s)"
    )
    writes: list[tuple[str, tuple[object, ...]]] = []
    # 300 quarter-hour partitions, an event in every third, two shards in some;
    # a 6-hour partition overlapping the newest ones, holding a copy of one
    # of their events (a device that changed bucket size) and one of its own.
    for k in range(300):
        start = newest - k * quarter_ms
        for shard in (0, 1) if k % 10 == 0 else (0,):
            writes.append((index, (tenant, start, shard, 900)))
            if k % 3 == 0:
                ts = start + 100 + shard
                writes.append((row, (tenant, start, shard, ts, k * 2 + shard, float(k))))
    six = newest - newest % (6 * hour_ms)
    writes.append((index, (tenant, six, 0, 6 * 3600)))
    writes.append((row, (tenant, six, 0, newest - 3 * quarter_ms + 100, 6, 3.0)))  # a copy
    writes.append((row, (tenant, six, 0, newest - 7 * quarter_ms + 5, 999, 99.0)))
    for first in range(0, len(writes), 100):
        await asyncio.gather(*(db.execute(q, v) for q, v in writes[first : first + 100]))
    since = datetime.fromtimestamp((newest - 400 * quarter_ms) / 1000, UTC)
    until = datetime.fromtimestamp((newest + hour_ms) / 1000, UTC)
    everything = await queries.history(db, tenant, "d", since, until, 1000)
    assert len(everything) == 100 + 10 + 1  # the copy once
    assert [e.ts for e in everything] == sorted((e.ts for e in everything), reverse=True)

    real = db.execute
    reads = in_flight = most = 0

    async def counting(query: Any, params: Any = None, **kw: Any) -> Any:
        nonlocal reads, in_flight, most
        if isinstance(query, str) and f"FROM {ks}.telemetry " in query:
            reads += 1
            in_flight += 1
            most = max(most, in_flight)
            try:
                return await real(query, params, **kw)
            finally:
                in_flight -= 1
        return await real(query, params, **kw)

    monkeypatch.setattr(db, "execute", counting)
    page = await queries.history_page(db, tenant, "d", since, until, 10)
    assert [e.event_id for e in page.events] == [e.event_id for e in everything[:10]]
    assert most <= queries.HISTORY_READS
    assert reads <= 3 * queries.HISTORY_READS  # of 331 partitions
    got, cursor = list(page.events), page.next_cursor
    while cursor is not None:
        page = await queries.history_page(db, tenant, "d", since, until, 10, cursor)
        got += page.events
        cursor = page.next_cursor
    assert [(e.ts, e.event_id) for e in got] == [(e.ts, e.event_id) for e in everything]
    assert most <= queries.HISTORY_READS


@pytest.mark.parametrize("given", ["3000000000", "100000000000000000000", "1e300", "10001"])
async def test_a_history_cursor_counting_too_many_events_is_a_400(
    db: Database, tenant: str, tokens: TokenStore, given: str
) -> None:
    """A cursor's count of events already given out at its millisecond went
    into each partition read's LIMIT: past a 32-bit int, Cassandra refused
    the read and the API answered 503 "Cassandra did not answer"; under it, a
    forged count made every partition read up to that many rows."""
    now_ms = epoch_ms(datetime.now(UTC))
    start = now_ms - now_ms % 900_000
    await db.execute(
        f"INSERT INTO {db.keyspace}.telemetry_partitions (tenant, device_id, bucket_start, "
        "shard, bucket_seconds) VALUES (%s, 'd', %s, 0, 900)",
        (tenant, start),
    )
    await db.execute(
        f"INSERT INTO {db.keyspace}.telemetry (tenant, device_id, bucket_start, shard, ts, "
        "event_id, state) VALUES (%s, 'd', %s, 0, %s, 1, 'on')",
        (tenant, start, start + 5),
    )
    query = queries.query_of(tenant, "d")
    packed = base64.urlsafe_b64encode(f"[{now_ms},{given},{query}]".encode())
    cursor = packed.decode().rstrip("=")
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(
            f"/api/v1/tenants/{tenant}/devices/d/history?since=1h&cursor={cursor}"
        )
    assert status == 400, body
    assert body["detail"].startswith("cursor:"), body


async def test_a_device_cursor_with_the_longest_device_id_is_taken_back(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """A device id of 128 characters (limits.max_topic_level_length), 3 bytes
    each in UTF-8: the cursor naming it was 530 characters, and the API
    refused its own cursor as longer than 512."""
    long_ids = ["設" * 127 + "1", "設" * 127 + "2"]
    async with running_gateway(make_config()) as gw:
        await publish([(topic(tenant, d), orjson.dumps({"state": "on"})) for d in long_ids])
        await gw.wait_handled(2)
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/states/on/devices?limit=1"
        devices = await every_page(api, path, "devices", pages=4)
    assert sorted(d["device_id"] for d in devices) == long_ids


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("states/on/devices?limit=0", "limit"),
        ("states/on/devices?limit=abc", "limit"),
        ("states/on/devices?limit=501", "limit"),
        ("states/on/devices?cursor=garbage", "cursor"),
        ("states/on/devices?cursor=Wzk5LCIiXQ", "cursor"),  # [99,""]: no bucket 99
        ("states/on/devices?tag=nocolon", "tag"),
        ("states/on/devices?prefix=" + "x" * 600, "prefix"),
        (f"devices/{D1}/history?since=yesterday", "since"),
        (f"devices/{D1}/history?since=1h&until=2h", "since"),
        (f"devices/{D1}/history?cursor=%%%", "cursor"),
        ("rejected?since=soon", "since"),
        # Before year 1: the date arithmetic overflowed, a 500.
        (f"devices/{D1}/history?since=1000000d", "since"),
        (f"devices/{D1}/history?since=99999999999d", "since"),
        ("rejected?since=1000000d", "since"),
        # A bare number was taken as seconds ago (an epoch time: 56 years).
        (f"devices/{D1}/history?since=1764161000", "since"),
        # Unknown or repeated: ignored, they gave unfiltered data (probe).
        ("states/on/devices?tags=floor:1", "tags"),
        ("states/on/devices?Limit=2", "Limit"),
        ("states/on/devices?tag=floor:1&tag=floor:2", "tag"),
        ("states?limit=2", "limit"),
        (f"devices/{D1}/history?step=1h", "step"),
        ("states/%20/devices", "state"),
        ("meta/devices", "tag"),  # said "expected KEY:VALUE ... (got '')"
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(
    db: Database, tenant: str, tokens: TokenStore, query: str, parameter: str
) -> None:
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/{query}")
    assert status == 400, body
    assert body["error"] == "bad_parameter"
    assert body["detail"].startswith(f"{parameter}:"), body


@pytest.mark.parametrize(
    "query",
    [
        "states/on/devices?limit=abc",
        "states/on/devices?prefix=" + "x" * 600,
        "states/on/devices?cursor=" + "c" * 7000,
        f"devices/{D1}/history?since=yesterday",
        "rejected?since=soon",
    ],
)
async def test_the_token_is_checked_before_the_parameters(
    db: Database, tenant: str, tokens: TokenStore, query: str
) -> None:
    """Without a token, a bad parameter was a 400 naming it, and a too-long
    one a 400 before any token was looked at: who may not read a tenant
    learns nothing about its API but 401, or 403 for another tenant's token."""
    other = tokens.add(tenant=f"o{uuid.uuid4().hex[:12]}").token
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/{query}"
        status, body, response = await api.get(path, token="")
        assert (status, body["error"]) == (401, "unauthorized"), body
        assert response.headers["WWW-Authenticate"] == "Bearer"
        status, body, _ = await api.get(path, token="gwt_00000000_" + "x" * 43)
        assert (status, body["error"]) == (401, "unauthorized"), body
        status, body, _ = await api.get(path, token=other)
        assert (status, body["error"]) == (403, "forbidden"), body
        status, body, _ = await api.get(path)
        assert (status, body["error"]) == (400, "bad_parameter"), body


async def test_unknown_paths_and_methods_are_json_errors(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get("/api/v1/nothing/here")
        assert status == 404
        assert set(body) == {"error", "detail"}
        async with api.session.post(api.url + f"/api/v1/tenants/{tenant}/states") as response:
            assert response.status == 405
            assert (await response.json())["error"] == "method_not_allowed"
        status, body, _ = await api.get("/api/v1/openapi.json", token="")
        assert status == 200
        assert "/api/v1/tenants/{tenant}/states" in body["paths"]


async def test_an_unchanged_answer_is_a_304_and_a_change_shows(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    async with running_gateway(make_config()) as gw:
        await publish(reference_messages(tenant))
        await gw.wait_handled(5)
        async with client(db, make_config(), tokens, tenant) as api:
            path = f"/api/v1/tenants/{tenant}/states/on/devices"
            status, body, response = await api.get(path)
            etag = response.headers["ETag"]
            status, body, _ = await api.get(path, **{"If-None-Match": etag})
            assert status == 304
            assert body is None
            # "*" matches any current answer (RFC 9110 13.1.2); it was a 200.
            status, body, _ = await api.get(path, **{"If-None-Match": "*"})
            assert (status, body) == (304, None)
            # ... but not an error: a device that is not there is still its 404.
            status, body, _ = await api.get(
                f"/api/v1/tenants/{tenant}/devices/nobody", **{"If-None-Match": "*"}
            )
            assert status == 404, body
            # D2 turns on: the next poll after the cache's half second shows it.
            await publish(
                [(topic(tenant, D2), orjson.dumps({"ts": "2022-01-01T00:00:00Z", "state": "on"}))]
            )
            await gw.wait_handled(6)
            for _ in range(40):
                status, body, _ = await api.get(path, **{"If-None-Match": etag})
                if status == 200:
                    break
                await asyncio.sleep(0.1)
            assert status == 200
            assert [d["device_id"] for d in body["devices"]] == [D1, D2]


async def test_gateway_serve_runs_the_read_side_alone(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """`gateway serve`: no MQTT, only Cassandra; the page, the API and
    /healthz, with the tokens `gateway token add` wrote."""
    await load_reference(tenant)
    port = free_port()
    env = base_env(
        GATEWAY_API__PORT=str(port),
        GATEWAY_API__TOKENS_FILE=str(tmp_path / "tokens.jsonl"),
        GATEWAY_MQTT__PORT="1",  # nothing listens there: serve must not need a broker
    )
    added = run_cli("token", "add", "--tenant", tenant, env=env)
    assert added.returncode == 0, added.stderr
    token = added.stdout.strip().splitlines()[-1]
    log = (tmp_path / "serve.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"{url}/healthz") as response:
                        health = await response.json()
                        break
                except aiohttp.ClientConnectionError:
                    assert proc.returncode is None, (tmp_path / "serve.log").read_text()
                    await asyncio.sleep(0.2)
            assert health["status"] == "ok", health
            async with session.get(f"{url}/") as response:
                assert response.status == 200
                assert "<html" in (await response.text()).lower()
            async with session.get(f"{url}/app.js") as response:
                assert response.status == 200
            headers = {"Authorization": f"Bearer {token}"}
            async with session.get(
                f"{url}/api/v1/tenants/{tenant}/states/off/devices", headers=headers
            ) as response:
                body = await response.json()
                assert [d["device_id"] for d in body["devices"]] == [D2, D3]
            async with session.get(f"{url}/noisy") as response:
                assert response.status == 404  # no ingest to ask in serve mode
            # Its own /metrics: the requests above by route and status, and
            # the API's answer cache (it had only process_* before).
            async with session.get(f"{url}/metrics") as response:
                scraped = {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(await response.text())
                    for s in family.samples
                }
        devices_route = "/api/v1/tenants/{tenant}/states/{state}/devices"
        assert (
            scraped[("gateway_http_requests_total", (("route", devices_route), ("status", "200")))]
            == 1
        )
        assert (
            scraped[("gateway_http_requests_total", (("route", "unmatched"), ("status", "404")))]
            == 1
        )
        assert scraped[("gateway_cache_entries", (("cache", "api_answers"),))] >= 1
        assert scraped[("gateway_cache_capacity", (("cache", "api_answers"),))] == 2048
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
    assert token not in (tmp_path / "serve.log").read_text()  # tokens are never logged


async def test_a_tokens_file_unreadable_for_a_moment_is_a_503_not_a_logout(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """A half-written tokens file: every request got 401 "unknown or revoked
    token", and the page logged its reader out and forgot the token, which
    stayed forgotten once the file was whole again (read-side probe). The
    store still accepts no token meanwhile (a revoke may have gone wrong),
    but the answer is a 503 to retry."""
    path = tmp_path / "tokens.jsonl"
    tokens = TokenStore(path, recheck_interval=0)
    async with client(db, make_config(), tokens, tenant) as api:
        good = path.read_bytes()
        states = f"/api/v1/tenants/{tenant}/states"
        assert (await api.get(states))[0] == 200
        path.write_bytes(good + b'{"id": "half')
        status, body, response = await api.get(states)
        assert (status, body["error"]) == (503, "unavailable"), body
        assert "tokens file" in body["detail"]
        assert response.headers["Retry-After"] == "2"
        status, body, _ = await api.get(states, token="")
        assert status == 401  # no token at all is still a 401
        path.write_bytes(good)
        assert (await api.get(states))[0] == 200


async def test_history_and_rejections_are_cached_like_every_list(
    db: Database, tenant: str, tokens: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device page polls its history every second or two: each poll of
    each viewer was a Cassandra read (34 answers/s for 10 clients against
    7,056 for the cached device route; read-side probe). Concurrent and
    repeated asks within LIST_TTL now share one read, as the README says."""
    await load_reference(tenant)
    reads = {"history": 0, "rejected": 0}
    for name in reads:
        real = getattr(queries, f"{name}_page" if name == "history" else name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            reads[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(queries, real.__name__, counting)
    async with client(db, make_config(), tokens, tenant) as api:
        for path in (f"devices/{D1}/history?since=7d", "rejected?since=24h"):
            answers = await asyncio.gather(
                *(api.get(f"/api/v1/tenants/{tenant}/{path}") for _ in range(10))
            )
            assert {status for status, _, _ in answers} == {200}
            assert len({orjson.dumps(body) for _, body, _ in answers}) == 1
    assert reads == {"history": 1, "rejected": 1}


async def test_unchanged_state_counts_are_a_304(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """/states put its "as_of" time in the body and the ETag covered it, so
    it never answered 304 and the page redrew its tiles every second."""
    await load_reference(tenant)
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/states"
        status, _, response = await api.get(path)
        assert status == 200
        await asyncio.sleep(api_module.COUNTS_TTL + 0.2)  # a count of its own
        status, body, _ = await api.get(path, **{"If-None-Match": response.headers["ETag"]})
        assert status == 304, body


async def test_names_with_braces_are_reachable(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """A state or device id holding "{" or "}" is stored and counted, but its
    paths were a 404 "no such path" (aiohttp's default segment pattern)."""
    async with running_gateway(make_config()) as gw:
        payload = orjson.dumps({"ts": "2026-01-01T00:00:00Z", "state": "{x}"})
        await publish([(topic(tenant, "dev{1}"), payload)])
        await gw.wait_handled(1)
    async with client(db, make_config(), tokens, tenant) as api:
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/states/%7Bx%7D/devices")
        assert status == 200, body
        assert [d["device_id"] for d in body["devices"]] == ["dev{1}"]
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/dev%7B1%7D")
        assert status == 200, body
        assert body["state"] == "{x}"


def test_read_failures_are_logged_at_most_once_per_10_s(caplog: pytest.LogCaptureFixture) -> None:
    """Every failed Cassandra read was logged: 66 lines in about 1 s from
    pages left open through an outage (read-side probe), on an edge host's
    small disk. The read API's failure line now comes at most every 10 s."""
    limits = [f for f in api_module.failures.filters if isinstance(f, server_module._OncePer)]
    assert [f.interval for f in limits] == [10.0]
    # The same filter on a logger of its own, at 0.3 s: one line of 50, then
    # one more once the interval has passed.
    caplog.set_level(logging.WARNING, logger="gateway")
    logger = once_per(0.3, logging.getLogger(f"gateway.test.{uuid.uuid4().hex}"))
    for _ in range(50):
        logger.warning("read API: Cassandra failed: %s", "NoHostAvailable")
    assert sum("Cassandra failed" in r.getMessage() for r in caplog.records) == 1
    time.sleep(0.35)
    logger.warning("read API: Cassandra failed: %s", "NoHostAvailable")
    assert sum("Cassandra failed" in r.getMessage() for r in caplog.records) == 2


# -- the OpenAPI document, checked against what the server does ---------------

_OPENAPI_FIELDS = {
    "openapi", "info", "jsonSchemaDialect", "servers", "paths", "webhooks",
    "components", "security", "tags", "externalDocs",
}  # fmt: skip
_OPERATION_FIELDS = {
    "tags", "summary", "description", "externalDocs", "operationId", "parameters",
    "requestBody", "responses", "callbacks", "deprecated", "security", "servers",
}  # fmt: skip


def _resolve(doc: dict[str, Any], node: Any) -> Any:
    """``node`` with its local ``$ref`` followed (a dangling one fails)."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = doc
        for part in ref[2:].split("/"):
            assert isinstance(target, dict), f"dangling $ref {ref}"
            assert part in target, f"dangling $ref {ref}"
            target = target[part]
        node = target
    return node


def _every_ref(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _every_ref(v)]
    if isinstance(node, list):
        return [r for v in node for r in _every_ref(v)]
    return []


def _is(kind: str, value: Any) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "integer": isinstance(value, int),
        "number": isinstance(value, int | float),
    }[kind]


def _conforms(doc: dict[str, Any], schema: Any, value: Any, where: str = "$") -> None:
    """``value`` fits ``schema`` (the JSON Schema keywords the document uses).
    An object schema with properties and no additionalProperties is taken as
    closed: every field of an answer must be documented."""
    schema = _resolve(doc, schema)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        assert any(_is(k, value) for k in kinds), f"{where}: {value!r} is not {kinds}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for name in schema.get("required", []):
            assert name in value, f"{where}: no {name!r} in {sorted(value)}"
        properties = schema.get("properties", {})
        others = schema.get("additionalProperties", not properties)
        for name, item in value.items():
            if name in properties:
                _conforms(doc, properties[name], item, f"{where}.{name}")
            else:
                assert others is not False, f"{where}: {name!r} is not documented"
                if isinstance(others, dict):
                    _conforms(doc, others, item, f"{where}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _conforms(doc, schema["items"], item, f"{where}[{i}]")


def _check_openapi_structure(doc: dict[str, Any]) -> None:
    """OpenAPI 3.1 in structure (openapi-spec-validator is not a dependency)."""
    assert str(doc["openapi"]).startswith("3.1.")
    assert set(doc) <= _OPENAPI_FIELDS, set(doc) - _OPENAPI_FIELDS
    assert isinstance(doc["info"]["title"], str)
    assert isinstance(doc["info"]["version"], str)
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearer"] == {"type": "http", "scheme": "bearer"}
    for ref in _every_ref(doc):
        _resolve(doc, {"$ref": ref})
    ids = [op.get("operationId") for item in doc["paths"].values() for op in item.values()]
    ids = [i for i in ids if i is not None]
    assert len(ids) == len(set(ids)), ids
    for template, item in doc["paths"].items():
        assert template.startswith("/api/v1/"), template
        assert set(item) == {"get"}, template
        op = item["get"]
        assert set(op) <= _OPERATION_FIELDS, (template, set(op) - _OPERATION_FIELDS)
        for requirement in op.get("security", []):
            assert set(requirement) <= set(schemes), template
        params = [_resolve(doc, p) for p in op.get("parameters", [])]
        for p in params:
            assert isinstance(p["name"], str), (template, p)
            assert p["in"] in ("query", "header", "path", "cookie"), (template, p)
            assert isinstance(p["required"], bool), (template, p)
            assert isinstance(p["schema"], dict), (template, p)
            if p["in"] == "path":
                assert p["required"] is True, (template, p)
        keys = [(p["name"], p["in"]) for p in params]
        assert len(keys) == len(set(keys)), (template, keys)
        in_path = {p["name"] for p in params if p["in"] == "path"}
        assert in_path == set(re.findall(r"\{(\w+)\}", template)), template
        assert op["responses"], template
        for code, given in op["responses"].items():
            assert re.fullmatch(r"[1-5]\d\d|[1-5]XX|default", code), (template, code)
            response = _resolve(doc, given)
            assert isinstance(response["description"], str), (template, code)
            for media in response.get("content", {}).values():
                assert isinstance(_resolve(doc, media["schema"]), dict), (template, code)
            for name, given_header in response.get("headers", {}).items():
                header = _resolve(doc, given_header)
                assert "name" not in header, (template, code, name)
                assert "in" not in header, (template, code, name)
                assert isinstance(header["schema"], dict), (template, code, name)


async def test_the_openapi_document_declares_what_each_route_takes_and_answers(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """The document declared only path parameters: the query parameters, the
    304, the 404 of an unknown device and the 503's Retry-After were prose,
    and no answer had a schema, so a generated client could send no filter.
    Here every route is asked with each declared query parameter (taken),
    each bound (kept), every undeclared name (refused, and the server's own
    list of what the route takes is the declared one), and every answer is
    checked against the status, headers and schema the document gives."""
    now = datetime.now(UTC).isoformat(timespec="milliseconds")
    event = {"ts": now, "state": "on", "value": 21.5}
    event |= {"metrics": {"temperature": 21.5}, "tags": {"floor": "3"}}
    async with running_gateway(make_config()) as gw:
        await publish(
            [
                *reference_messages(tenant),
                (topic(tenant, D1), orjson.dumps(event)),
                (topic(tenant, D2), b"{"),
            ]
        )
        await gw.wait_handled(7)
    tokens = TokenStore(tmp_path / "tokens.jsonl", recheck_interval=0)
    other = tokens.add(tenant=f"o{uuid.uuid4().hex[:12]}").token
    async with client(db, make_config(), tokens, tenant) as api:
        status, doc, _ = await api.get("/api/v1/openapi.json", token="")
        assert status == 200
        _check_openapi_structure(doc)
        app = web.Application()
        read_api(db, make_config(), tokens)(app)
        served = {r.canonical for r in app.router.resources()} - {"/api/v1/openapi.json"}
        assert set(doc["paths"]) == served

        declared: dict[str, dict[str, Any]] = {}
        for template, item in doc["paths"].items():
            params = [_resolve(doc, p) for p in item["get"].get("parameters", [])]
            declared[template] = {p["name"]: p for p in params if p["in"] == "query"}
        anywhere = {name for query in declared.values() for name in query}
        assert {"limit", "cursor", "prefix", "tag", "since", "until", "step", "metric"} <= anywhere

        def url(template: str, **names: str) -> str:
            values = {"tenant": tenant, "state": "on", "device_id": D1, "key": "floor"} | names
            return re.sub(r"\{(\w+)\}", lambda m: values[m[1]], template)

        async def get(
            template: str,
            path: str,
            query: dict[str, str],
            token: str | None = None,
            **headers: str,
        ) -> tuple[int, Any]:
            """Ask, and check the answer is one the document gives."""
            text = "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
            status, body, response = await api.get(
                path + ("?" + text if text else ""), token=token, **headers
            )
            responses = doc["paths"][template]["get"]["responses"]
            assert str(status) in responses, (template, query, status, body)
            documented = _resolve(doc, responses[str(status)])
            for name in documented.get("headers", {}):
                assert name in response.headers, (template, status, name)
            if "content" in documented:
                _conforms(doc, documented["content"]["application/json"]["schema"], body)
            else:
                assert body is None, (template, status, body)
            return status, (body, response)

        for template, query in declared.items():
            path = url(template)
            required = {n: str(p["example"]) for n, p in query.items() if p["required"]}
            status, (body, response) = await get(template, path, required)
            assert status == 200, (template, body)
            etag = response.headers["ETag"]
            status, _ = await get(template, path, required, **{"If-None-Match": etag})
            assert status == 304, template
            for name in required:
                status, (body, _) = await get(
                    template, path, {n: v for n, v in required.items() if n != name}
                )
                assert status == 400, (template, name, body)
                assert body["detail"].startswith(f"{name}:"), (template, body)
            for name, p in query.items():
                value = str(p["example"]) if "example" in p else ""
                status, (body, _) = await get(template, path, required | {name: value})
                assert status == 200, (template, name, value, body)
                schema = p["schema"]
                for good in schema.get("enum", []):
                    status, (body, _) = await get(template, path, required | {name: good})
                    assert status == 200, (template, name, good, body)
                if "maxLength" in schema:
                    most = schema["maxLength"]
                    status, (body, _) = await get(template, path, required | {name: "x" * most})
                    assert status == 200 or "longer than" not in body["detail"], (template, name)
                    status, (body, _) = await get(
                        template, path, required | {name: "x" * (most + 1)}
                    )
                    assert body["detail"] == f"{name}: longer than {most} characters", template
                if schema.get("type") == "integer":
                    low, high = schema["minimum"], schema["maximum"]
                    assert low <= schema["default"] <= high
                    for good in (low, high):
                        status, (body, _) = await get(template, path, required | {name: str(good)})
                        assert status == 200, (template, name, good, body)
                    for bad in (low - 1, high + 1):
                        status, (body, _) = await get(template, path, required | {name: str(bad)})
                        assert status == 400, (template, name, bad)
                        assert body["detail"].startswith(
                            f"{name}: must be between {low} and {high}"
                        )
            takes = ", ".join(sorted(query)) or "none"
            for name in [*sorted(anywhere - set(query)), "Limit", "undeclared"]:
                status, (body, _) = await get(template, path, required | {name: "1"})
                assert status == 400, (template, name, body)
                assert body["detail"] == f"{name}: not a parameter of this path (it takes: {takes})"
            status, _ = await get(template, path, required, token="")
            assert status == 401, template
            status, _ = await get(template, path, required, token=other)
            assert status == (403 if "{tenant}" in template else 200), template
            unknown = url(template, state="none", device_id="no-such-device", key="none")
            status, _ = await get(template, unknown, required)
            assert status == (404 if "{device_id}" in template else 200), template

        # The tokens file half-written: every route is a 503 with Retry-After.
        good = (tmp_path / "tokens.jsonl").read_bytes()
        (tmp_path / "tokens.jsonl").write_bytes(good + b'{"id": "half')
        for template, query in declared.items():
            required = {n: str(p["example"]) for n, p in query.items() if p["required"]}
            status, (body, _) = await get(template, url(template), required)
            assert status == 503, (template, body)
        (tmp_path / "tokens.jsonl").write_bytes(good)


async def test_an_offset_whose_plus_became_a_space_is_told_so(
    db: Database, tenant: str, tokens: TokenStore
) -> None:
    """ "?since=2026-11-26T23:00:00+05:30" unencoded: the "+" arrives as a
    space, and the 400 quoted a time that was not the one typed."""
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/devices/{D1}/history?since=2026-11-26T23:00:00+05:30"
        status, body, _ = await api.get(path)
        assert status == 400, body
        assert body["detail"].startswith("since:")
        assert "%2B" in body["detail"]
        path = path.replace("+", "%2B")
        # Taken: what is left to say is that the tenant has no such device.
        status, body, _ = await api.get(path)
        assert (status, body["detail"]) == (404, f"no device {D1!r} in tenant {tenant!r}")
