"""gateway.web: the Prometheus families mirrored from Stats, and the aiohttp server's bounds.

No external services: each test serves on 127.0.0.1 port 0, on the test's own
event loop, and talks to it with aiohttp's client or, for malformed and slow
requests, raw bytes over asyncio streams. Every wait is under WAIT.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import aiohttp
import prometheus_client
import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import ConfigError
from gateway.stats import LabelledCounts, Stats
from gateway.web import server
from gateway.web.metrics import (
    METRICS_CONTENT_TYPE,
    SERIES_DROPPED,
    HttpCollector,
    HttpStats,
    NoisyRate,
    gateway_registry,
)
from gateway.web.server import AddRoutes, Limits, Listening, build_app, http_log, serve

from .helpers import ROOT

HOST = "127.0.0.1"
WAIT = 5.0  # upper bound for any single wait in these tests

Labels = frozenset[tuple[str, str]]


# --------------------------------------------------------------------------
# Reading an exposition with prometheus_client's own parser


@dataclass
class Scrape:
    types: dict[str, str]  # by sample-family name as exposed (counters with _total)
    helps: dict[str, str]
    samples: dict[tuple[str, Labels], float]
    order: list[str]  # family names as exposed, in the order written

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def series(self, name: str) -> dict[Labels, float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def parse(text: str) -> Scrape:
    scrape = Scrape({}, {}, {}, [])
    for family in text_string_to_metric_families(text):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert name not in scrape.types, f"{name} twice"
        scrape.types[name] = family.type
        scrape.helps[name] = family.documentation
        scrape.order.append(name)
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in scrape.samples, f"duplicate sample {key}"
            scrape.samples[key] = s.value
    return scrape


def scrape_of(registry: prometheus_client.CollectorRegistry) -> Scrape:
    return parse(prometheus_client.generate_latest(registry).decode())


def check_histogram(scrape: Scrape, name: str) -> list[tuple[str, float]]:
    """The (le, cumulative count) pairs of an unlabelled histogram, checked for shape."""
    buckets = [(dict(labels)["le"], v) for labels, v in scrape.series(f"{name}_bucket").items()]
    bounds = [float(le) for le, _ in buckets]
    counts = [n for _, n in buckets]
    assert bounds == sorted(bounds)
    assert bounds[-1] == math.inf
    assert counts == sorted(counts), f"{name} not cumulative: {counts}"
    assert scrape.value(f"{name}_count") == counts[-1]
    return buckets


# --------------------------------------------------------------------------
# The families mirrored from Stats


def test_every_stats_total_is_mirrored_under_its_name() -> None:
    expected = {
        "gateway_messages_received_total": "received",
        "gateway_events_written_total": "written",
        "gateway_acks_sent_total": "acked",
        "gateway_acks_dropped_total": "acks_dropped",
        # It was counted and never exported, though the config said "counted".
        "gateway_hot_partitions_untracked_writes_total": "untracked_writes",
        "gateway_events_without_ts_total": "no_ts",
        "gateway_cassandra_requests_total": "requests",
        "gateway_cassandra_rows_total": "rows",
        "gateway_cassandra_retries_total": "retries",
        "gateway_mqtt_connects_total": "connects",
        "gateway_mqtt_disconnects_total": "disconnects",
        "gateway_backpressure_seconds_total": "throttled_s",
        "gateway_backpressure_events_total": "throttle_events",
        "gateway_read_pauses_total": "read_pauses",
        "gateway_read_overflow_total": "overflow",
        "gateway_coalesced_events_total": "coalesced",
        "gateway_chunks_total": "chunks",
        "gateway_lingers_total": "lingers",
        "gateway_states_registered_total": "states_registered",
        "gateway_newest_reads_total": "newest_reads",
        "gateway_latest_deletes_saved_total": "deletes_saved",
        "gateway_write_ts_ties_total": "tie_breaks",
        "gateway_stale_latest_total": "stale_latest",
        "gateway_rollup_marks_total": "rollup_marks",
        "gateway_rollup_mark_evictions_total": "rollup_mark_evictions",
        "gateway_rollup_windows_total": "rollup_windows",
        "gateway_rollup_failures_total": "rollup_failures",
        "gateway_metadata_writes_total": "metadata_writes",
        "gateway_metadata_reads_total": "metadata_reads",
        "gateway_metadata_reservations_total": "metadata_reservations",
        "gateway_spool_full_total": "spool_full_waits",
        "gateway_spool_disk_full_total": "spool_disk_full",
    }
    stats = Stats()
    for i, attr in enumerate(expected.values()):
        setattr(stats, attr, i + 1)
    stats.throttled_s = 1.25
    stats.in_flight = 3
    stats.queue_depth = 17
    registry = gateway_registry(stats)
    scrape = scrape_of(registry)
    for i, (name, attr) in enumerate(expected.items()):
        assert scrape.types[name] == "counter", name
        assert scrape.helps[name], name
        want = 1.25 if attr == "throttled_s" else i + 1
        assert scrape.value(name) == want, name
    assert scrape.types["gateway_cassandra_in_flight"] == "gauge"
    assert scrape.value("gateway_cassandra_in_flight") == 3
    assert scrape.value("gateway_queue_depth") == 17
    stats.rollup_lag_s = 42.5
    assert scrape_of(registry).value("gateway_rollup_lag_seconds") == 42.5
    assert 0 <= scrape.value("gateway_uptime_seconds") < 60
    # The gateway's families come first and in name order, as they always did.
    ours = [name for name in scrape.order if name.startswith("gateway_")]
    assert ours == sorted(ours) == scrape.order[: len(ours)]

    # Values are read at scrape time.
    stats.received += 5
    stats.in_flight = 0
    stats.rejected_by_reason["bad_json"] += 2
    scrape = scrape_of(registry)
    assert scrape.value("gateway_messages_received_total") == 1 + 5
    assert scrape.value("gateway_cassandra_in_flight") == 0
    assert scrape.value("gateway_messages_rejected_total", reason="bad_json") == 2


@dataclass
class FakeSpool:
    depth: int = 4
    bytes: int = 1000
    deleted: int = 9
    full: bool = True
    disk_full_since: float | None = None

    def oldest_age(self) -> float:
        return 2.5


def test_histograms_labelled_counters_noisy_and_spool() -> None:
    stats = Stats()
    stats.write_latency.observe(0.004)
    stats.write_latency.observe(120)
    stats.batch_rows.observe(3)
    stats.loop_lag.observe(0.3)
    stats.rejected_by_reason.update({"invalid_json": 2, "topic": 1})
    stats.hot_by_table.add("telemetry")
    stats.quota_by_tenant.add("acme")
    stats.sampled_out_by_tenant.add("acme", 4)
    noisy = [NoisyRate("acme", "d1", 12.5, 1.0)]
    scrape = scrape_of(gateway_registry(stats, noisy=lambda: noisy, spool=FakeSpool()))

    assert scrape.types["gateway_write_latency_seconds"] == "histogram"
    latency = dict(check_histogram(scrape, "gateway_write_latency_seconds"))
    # The le values are written as they always were ("60", not "60.0").
    assert list(latency) == [
        "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
        "1", "2.5", "5", "10", "30", "60", "+Inf",
    ]  # fmt: skip
    assert (latency["0.001"], latency["0.005"], latency["60"], latency["+Inf"]) == (0, 1, 1, 2)
    assert scrape.value("gateway_write_latency_seconds_sum") == pytest.approx(120.004)
    rows = dict(check_histogram(scrape, "gateway_batch_rows"))
    assert list(rows) == [str(2**i) for i in range(11)] + ["+Inf"]
    assert (rows["2"], rows["4"], rows["+Inf"]) == (0, 1, 1)
    lag = dict(check_histogram(scrape, "gateway_event_loop_lag_seconds"))
    assert (lag["0.25"], lag["0.5"], lag["+Inf"]) == (0, 1, 1)

    assert scrape.value("gateway_messages_rejected_total", reason="invalid_json") == 2
    assert scrape.value("gateway_messages_rejected_total", reason="topic") == 1
    assert scrape.value("gateway_hot_partitions_total", table="telemetry") == 1
    assert scrape.value("gateway_quota_rejections_total", tenant="acme") == 1
    assert scrape.value("gateway_sampled_out_total", tenant="acme") == 4
    for name in ("gateway_messages_rejected_total", "gateway_sampled_out_total"):
        assert scrape.types[name] == "counter"

    assert scrape.types["gateway_noisy_device_rate"] == "gauge"
    rate = "gateway_noisy_device_rate"
    assert scrape.value(rate, tenant="acme", device_id="d1", rate="observed") == 12.5
    assert scrape.value(rate, tenant="acme", device_id="d1", rate="kept") == 1.0

    assert scrape.value("gateway_spool_depth") == 4
    assert scrape.value("gateway_spool_bytes") == 1000
    assert scrape.value("gateway_spool_oldest_age_seconds") == 2.5
    assert scrape.types["gateway_spool_drained_total"] == "counter"
    assert scrape.value("gateway_spool_drained_total") == 9
    assert scrape.value("gateway_spool_full") == 1
    assert scrape.value("gateway_spool_disk_full") == 0
    assert scrape.types["gateway_spool_full_total"] == "counter"
    assert scrape.types["gateway_spool_disk_full_total"] == "counter"
    # Nothing folded: the dropped-series family is there, with no series.
    assert scrape.types[SERIES_DROPPED] == "counter"
    assert scrape.series(SERIES_DROPPED) == {}


def test_exposition_text_and_label_escaping() -> None:
    stats = Stats(received=2)
    nasty = 'a"b\\c\nd'
    stats.quota_by_tenant.add(nasty)
    text = prometheus_client.generate_latest(gateway_registry(stats)).decode()
    assert METRICS_CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    # The names a scraper sees, HELP and TYPE included, are the ones it always saw.
    assert "# TYPE gateway_messages_received_total counter\n" in text
    assert "# HELP gateway_messages_received_total MQTT messages the broker handed over.\n" in (
        text
    )
    assert "\ngateway_messages_received_total 2.0\n" in text
    assert 'gateway_quota_rejections_total{tenant="a\\"b\\\\c\\nd"} 1.0\n' in text
    assert not any(line.endswith("_created") for line in text.splitlines())
    assert parse(text).value("gateway_quota_rejections_total", tenant=nasty) == 1


def test_process_and_collector_families_are_read_at_each_scrape() -> None:
    registry = gateway_registry(Stats())
    before = scrape_of(registry)
    assert before.types["process_cpu_seconds_total"] == "counter"
    assert before.value("process_resident_memory_bytes") > 10e6
    assert before.value("process_open_fds") > 0
    young = before.value("python_gc_collections_total", generation="0")
    gc.collect(0)
    gc.collect(0)
    after = scrape_of(registry)
    assert after.value("python_gc_collections_total", generation="0") == young + 2


def test_the_registry_is_private() -> None:
    stats = Stats(received=7)
    gateway_registry(stats)
    gateway_registry(stats)  # a second one does not collide with the first
    assert b"gateway_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_cardinality_cap_folds_into_other_and_counts() -> None:
    stats = Stats()
    for i in range(5):
        stats.quota_by_tenant.add(f"t{i}", i + 1)  # t0=1 ... t4=5
    devices = [NoisyRate("acme", f"d{i}", 10.0 + i, 1.0) for i in range(3)]
    registry = gateway_registry(stats, noisy=lambda: devices, max_series=4)
    for i in range(3):  # five label sets for a cap of four
        stats.rejected_by_reason[f"r{i}"] += 1
    stats.rejected_by_reason.update({"r3": 1, "r4": 1})

    scrape = scrape_of(registry)
    quota = scrape.series("gateway_quota_rejections_total")
    assert len(quota) == 5  # four real series and _other: bounded
    for i in range(4):  # kept in the order Stats met them
        assert scrape.value("gateway_quota_rejections_total", tenant=f"t{i}") == i + 1
    assert scrape.value("gateway_quota_rejections_total", tenant="_other") == 5
    # Noisy devices: two devices (four series) kept; the third folded, its rate
    # label kept so that _other is the sum of observed and of kept rates.
    rate = "gateway_noisy_device_rate"
    assert len(scrape.series(rate)) == 6
    assert scrape.value(rate, tenant="acme", device_id="d1", rate="observed") == 11.0
    assert scrape.value(rate, tenant="_other", device_id="_other", rate="observed") == 12.0
    assert scrape.value(rate, tenant="_other", device_id="_other", rate="kept") == 1.0
    # Folds are counted: one label set per metric per scrape.
    assert scrape.value(SERIES_DROPPED, metric="gateway_quota_rejections_total") == 1
    assert scrape.value(SERIES_DROPPED, metric="gateway_messages_rejected_total") == 1
    assert scrape.value(SERIES_DROPPED, metric=rate) == 2
    assert ("gateway_sampled_out_total",) not in {
        tuple(dict(labels).values()) for labels in scrape.series(SERIES_DROPPED)
    }

    # Another scrape: the same series, _other still monotonic, folds counted again.
    stats.quota_by_tenant.add("t4", 10)
    stats.quota_by_tenant.add("t5", 2)
    scrape = scrape_of(registry)
    assert scrape.value("gateway_quota_rejections_total", tenant="t0") == 1
    assert scrape.value("gateway_quota_rejections_total", tenant="_other") == 17
    assert scrape.value(SERIES_DROPPED, metric="gateway_quota_rejections_total") == 3


def test_stats_own_other_joins_the_folded_series_without_counting() -> None:
    stats = Stats()
    stats.sampled_out_by_tenant = LabelledCounts(cap=2)
    for tenant in ("a", "b", "c", "d"):
        stats.sampled_out_by_tenant.add(tenant)  # c and d go to Stats' own _other
    scrape = scrape_of(gateway_registry(stats, max_series=2))
    assert scrape.series("gateway_sampled_out_total") == {
        frozenset({("tenant", "a")}): 1,
        frozenset({("tenant", "b")}): 1,
        frozenset({("tenant", "_other")}): 2,
    }
    assert scrape.series(SERIES_DROPPED) == {}


def test_max_series_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_series"):
        gateway_registry(Stats(), max_series=0)


# --------------------------------------------------------------------------
# Serving


def healthy() -> tuple[bool, dict[str, object]]:
    return True, {"cassandra": "up"}


def no_noisy(tenant: str) -> list[dict[str, object]]:
    return []


@asynccontextmanager
async def running(
    *,
    stats: Stats | None = None,
    health: Callable[[], tuple[bool, dict[str, object]]] = healthy,
    noisy: Callable[[str], list[dict[str, object]]] = no_noisy,
    extra: Iterable[AddRoutes] = (),
    limits: Limits | None = None,
    shutdown_timeout: float = 2.0,
) -> AsyncIterator[Listening]:
    app = build_app(
        metrics=gateway_registry(stats or Stats()),
        health=health,
        noisy=noisy,
        extra=extra,
        limits=limits or Limits(),
    )
    async with asyncio.timeout(WAIT * 4):
        async with serve(app, HOST, 0, shutdown_timeout=shutdown_timeout) as listening:
            yield listening


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


async def request(
    at: Listening,
    path: str,
    method: str = "GET",
    data: bytes | None = None,
    token: str | None = None,
) -> Reply:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        asyncio.timeout(WAIT),
        aiohttp.ClientSession() as session,
        session.request(method, f"{at.url}{path}", data=data, headers=headers) as response,
    ):
        return Reply(
            response.status,
            {k.lower(): v for k, v in response.headers.items()},
            await response.read(),
        )


@asynccontextmanager
async def connection(
    port: int,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, read until the server closes."""
    async with asyncio.timeout(WAIT), connection(port) as (reader, writer):
        writer.write(raw)
        await writer.drain()
        return await until_closed(reader)


def status_of(data: bytes) -> int:
    assert data.startswith(b"HTTP/1."), data[:200]
    return int(data.split(b" ", 2)[1])


async def test_metrics_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    stats = Stats(received=3, written=2)
    stats.write_latency.observe(0.2)
    with caplog.at_level(logging.INFO, logger="gateway.web.server"):
        async with running(stats=stats) as at:
            assert f"metrics on http://{HOST}:{at.port}/metrics" in caplog.messages
            reply = await request(at, "/metrics")
            stats.received = 4
            reply2 = await request(at, "/metrics?name[]=x")  # query strings are ignored
            head = await request(at, "/metrics", method="HEAD")
    assert reply.status == 200
    assert reply.headers["content-type"] == METRICS_CONTENT_TYPE
    assert reply.headers["cache-control"] == "no-store"
    scrape = parse(reply.body.decode())
    assert scrape.value("gateway_messages_received_total") == 3
    assert scrape.value("gateway_events_written_total") == 2
    assert scrape.value("gateway_write_latency_seconds_count") == 1
    assert reply2.status == 200
    assert parse(reply2.body.decode()).value("gateway_messages_received_total") == 4
    assert head.status == 200
    assert head.body == b""


async def test_healthz() -> None:
    checks: dict[str, object] = {"cassandra": "up", "mqtt": "connected"}
    ok = [True]
    async with running(health=lambda: (ok[0], checks)) as at:
        reply = await request(at, "/healthz")
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        assert reply.json() == {"status": "ok", "checks": checks}
        ok[0] = False
        checks["cassandra"] = "writes failing for 12 s"
        reply = await request(at, "/healthz")
        assert reply.status == 503
        assert reply.json() == {"status": "degraded", "checks": checks}


async def test_noisy_passes_the_tenant() -> None:
    asked: list[str] = []

    def noisy(tenant: str) -> list[dict[str, object]]:
        asked.append(tenant)
        return [{"device_id": "d1", "observed_rate": 12.5}]

    async with running(noisy=noisy) as at:
        reply = await request(at, "/noisy?tenant=acme")
        assert (await request(at, "/noisy")).status == 200
    assert reply.status == 200
    assert reply.json() == [{"device_id": "d1", "observed_rate": 12.5}]
    assert asked == ["acme", ""]


def add_api(app: web.Application) -> None:
    """What a module adding routes does: here a sub-application under /api/v1."""

    async def thing(request: web.Request) -> web.Response:
        return web.json_response({"thing": request.match_info["name"]})

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def teapot(request: web.Request) -> web.Response:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": "bad_token", "detail": "mine"}),
            content_type="application/json",
        )

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("boom")

    api = web.Application()
    api.router.add_get("/things/{name}", thing)
    api.router.add_post("/echo", echo)
    api.router.add_get("/own-error", teapot)
    api.router.add_get("/broken", broken)
    app.add_subapp("/api/v1", api)


def add_page(app: web.Application) -> None:
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html></html>", content_type="text/html")

    app.router.add_get("/", page)


async def test_routes_added_by_extra() -> None:
    async with running(extra=[add_api, add_page]) as at:
        reply = await request(at, "/api/v1/things/x1")
        assert (reply.status, reply.json()) == (200, {"thing": "x1"})
        page = await request(at, "/")
        assert (page.status, page.body) == (200, b"<html></html>")
        # The bounds cover what was added (echo reads its body).
        assert (await request(at, "/api/v1/echo", "POST", b"hello")).body == b"hello"
        # The built-in routes are still there.
        assert (await request(at, "/healthz")).status == 200


async def test_unknown_path_and_wrong_method() -> None:
    async with running(extra=[add_api]) as at:
        assert (await request(at, "/")).status == 404
        assert (await request(at, "/metrics/extra")).status == 404
        reply = await request(at, "/metrics", "POST")
        assert reply.status == 405
        assert set(reply.headers["allow"].split(",")) == {"GET", "HEAD"}
        assert (await request(at, "/healthz", "DELETE")).status == 405
        assert (await request(at, "/nope", "POST")).status == 404
        # Under /api, errors are JSON.
        for path in ("/api", "/api/v2/x", "/api/v1/nothing/here"):
            reply = await request(at, path)
            assert reply.status == 404, path
            assert reply.headers["content-type"] == "application/json"
            assert reply.json() == {"error": "not_found", "detail": f"no such path: {path}"}
        reply = await request(at, "/api/v1/things/x", "DELETE")
        assert reply.status == 405
        assert reply.json() == {
            "error": "method_not_allowed",
            "detail": "DELETE is not allowed on /api/v1/things/x",
        }
        assert "GET" in reply.headers["allow"]
        # A JSON error the API raises itself passes through unchanged.
        reply = await request(at, "/api/v1/own-error")
        assert (reply.status, reply.json()) == (400, {"error": "bad_token", "detail": "mine"})
        # Malformed requests: 400, and serving goes on.
        assert status_of(await exchange(at.port, b"garbage\r\n\r\n")) == 400
        assert status_of(await exchange(at.port, b"GET /metrics SPDY/3\r\n\r\n")) == 400
        assert (await request(at, "/healthz")).status == 200


async def test_oversized_requests_are_rejected(caplog: pytest.LogCaptureFixture) -> None:
    limits = Limits(client_max_size=1024)
    async with running(extra=[add_api], limits=limits) as at:
        long_line = b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
        with caplog.at_level(logging.INFO, logger="gateway.web.http"):
            assert status_of(await exchange(at.port, long_line)) == 400
        # A client's bad request is no error of ours: no ERROR, no traceback
        # (aiohttp logs one, which any client could fill the log with).
        assert not [r for r in caplog.records if r.levelno > logging.WARNING or r.exc_info]
        # aiohttp's own bound (8190) was less than the longest valid API request.
        line = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        assert status_of(await exchange(at.port, line)) == 404
        long_header = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 9000 + b"\r\n\r\n"
        assert status_of(await exchange(at.port, long_header)) == 400
        many = b"".join(b"X-%d: y\r\n" % i for i in range(70))
        too_many = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"
        assert status_of(await exchange(at.port, too_many)) == 400
        # Within the bounds is fine.
        fits = (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + b"".join(b"X-%d: %s\r\n" % (i, b"y" * 8000) for i in range(8))
            + b"\r\n"
        )
        assert status_of(await exchange(at.port, fits)) == 200
        # A body over client_max_size, on a route that reads it: 413, JSON under /api.
        reply = await request(at, "/api/v1/echo", "POST", b"z" * 2000)
        assert reply.status == 413
        body = reply.json()
        assert isinstance(body, dict)
        assert body["error"] == "too_large"
        assert "1024" in body["detail"]
        assert (await request(at, "/api/v1/echo", "POST", b"z" * 1000)).status == 200
        assert (await request(at, "/healthz")).status == 200


async def test_slow_and_idle_connections_are_closed() -> None:
    async with running(limits=Limits(keepalive_timeout=0.3)) as at:
        # A head that stops half way: closed (the WAIT deadline fails the test
        # if the server holds it instead). aiohttp closes without a response.
        async with asyncio.timeout(WAIT), connection(at.port) as (reader, writer):
            writer.write(b"GET /metr")
            await writer.drain()
            assert await until_closed(reader) == b""
        # Dribbling bytes does not extend the deadline: it runs from the accept.
        async with asyncio.timeout(WAIT), connection(at.port) as (reader, writer):

            async def dribble() -> None:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                while True:
                    writer.write(b"y")
                    await writer.drain()
                    await asyncio.sleep(0.05)

            dribbler = asyncio.create_task(dribble())
            try:
                assert await until_closed(reader) == b""
            finally:
                dribbler.cancel()
                await asyncio.gather(dribbler, return_exceptions=True)
        # A connection that never sends anything is closed too.
        async with asyncio.timeout(WAIT), connection(at.port) as (reader, _):
            assert await until_closed(reader) == b""
        # A head in pieces, completed in time, is served; the idle keep-alive
        # connection after the response is then closed.
        async with asyncio.timeout(WAIT), connection(at.port) as (reader, writer):
            for piece in (b"GET /hea", b"lthz HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)
            data = await until_closed(reader)
            assert status_of(data) == 200
        assert (await request(at, "/healthz")).status == 200


class _Slow:
    """/api/v1/slow: each request waits inside until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.inside = 0

    def add(self, app: web.Application) -> None:
        async def slow(request: web.Request) -> web.Response:
            self.inside += 1
            await self.release.wait()
            return web.Response(text="done")

        app.router.add_get("/api/v1/slow", slow)

    async def until_inside(self, count: int) -> None:
        async with asyncio.timeout(WAIT):
            while self.inside < count:  # noqa: ASYNC110 - a test waiting for its own handlers
                await asyncio.sleep(0.01)


async def test_requests_beyond_the_cap_get_503() -> None:
    """Behaviour chosen: a read API request beyond the cap is refused at once
    with 503, not queued. /healthz and /metrics never are: with Cassandra
    hanging, 32 waiting API requests made them answer "busy", and monitoring
    went blind in the outage (read-side probe)."""
    slow = _Slow()
    async with running(extra=[slow.add, add_api], limits=Limits(max_requests=4)) as at:
        # Half the cap each for two tokens.
        held = [asyncio.create_task(request(at, "/api/v1/slow", token=t)) for t in "aabb"]
        try:
            await slow.until_inside(4)
            assert (await request(at, "/healthz")).status == 200
            assert (await request(at, "/metrics")).status == 200
            reply = await request(at, "/api/v1/things/x", token="c")
            assert reply.status == 503
            assert reply.headers["retry-after"] == "1"
            assert reply.headers["connection"] == "close"
            body = reply.json()
            assert isinstance(body, dict)
            assert (body["error"], body["detail"]) == (
                "busy",
                "busy: 4 requests under way, retry shortly",
            )
            assert slow.inside == 4  # refused requests never reached a handler
            # The refusal is counted; it was silent (read-side review).
            scrape = parse((await request(at, "/metrics")).body.decode())
            assert scrape.value("gateway_http_busy_refusals_total") == 1
            assert scrape.value("gateway_http_requests_in_progress") == 5  # 4 held, /metrics
        finally:
            slow.release.set()
            replies = await asyncio.gather(*held)
        assert [r.status for r in replies] == [200] * 4
        assert (await request(at, "/healthz")).status == 200
        scrape = parse((await request(at, "/metrics")).body.decode())
        assert scrape.value("gateway_http_busy_refusals_total") == 1
        assert scrape.series("gateway_http_requests_total") == {
            frozenset({("route", "/api/v1/slow"), ("status", "200")}): 4,
            frozenset({("route", "/api/v1/things/{name}"), ("status", "503")}): 1,
            frozenset({("route", "/healthz"), ("status", "200")}): 2,
            frozenset({("route", "/metrics"), ("status", "200")}): 2,
        }
        assert scrape.value("gateway_http_requests_in_progress") == 1  # this scrape


async def test_one_token_takes_at_most_half_the_requests_at_once() -> None:
    """One token's slow queries took all 32 places, and every other tenant's
    page answered "busy" (read-API review)."""
    slow = _Slow()
    async with running(extra=[slow.add], limits=Limits(max_requests=4)) as at:
        held = [asyncio.create_task(request(at, "/api/v1/slow", token="a")) for _ in range(2)]
        try:
            await slow.until_inside(2)
            refused = await request(at, "/api/v1/slow", token="a")
            assert refused.status == 503
            assert refused.json() == {
                "error": "busy",
                "detail": "busy: 2 requests under way for this token, retry shortly",
            }
            other = asyncio.create_task(request(at, "/api/v1/slow", token="b"))
            await slow.until_inside(3)  # another token still gets in
        finally:
            slow.release.set()
            replies = await asyncio.gather(*held)
        assert [r.status for r in replies] == [200, 200]
        assert (await other).status == 200
        # Its places are given back: the token gets in again.
        assert (await request(at, "/api/v1/slow", token="a")).status == 200


async def test_requests_are_counted_and_timed_by_route_and_status() -> None:
    """By the route's template, not the path: a tenant or device in a label
    would be a series per tenant; an unknown path is "unmatched"."""

    def add_paths(app: web.Application) -> None:
        async def thing(request: web.Request) -> web.Response:
            await asyncio.sleep(0.03)
            return web.Response(text=request.match_info["name"])

        app.router.add_get("/api/v1/things/{name}", thing)

    async with running(extra=[add_paths]) as at:
        for path in ("/api/v1/things/a", "/api/v1/things/b", "/nowhere", "/healthz"):
            await request(at, path)
        assert (await request(at, "/healthz", method="POST")).status == 405
        scrape = parse((await request(at, "/metrics")).body.decode())
    assert scrape.series("gateway_http_requests_total") == {
        frozenset({("route", "/api/v1/things/{name}"), ("status", "200")}): 2,
        frozenset({("route", "unmatched"), ("status", "404")}): 1,
        frozenset({("route", "unmatched"), ("status", "405")}): 1,
        frozenset({("route", "/healthz"), ("status", "200")}): 1,
    }
    things = frozenset({("route", "/api/v1/things/{name}")})
    assert scrape.samples[("gateway_http_request_duration_seconds_count", things)] == 2
    assert scrape.samples[("gateway_http_request_duration_seconds_sum", things)] >= 0.06
    fast = things | {("le", "0.025")}
    assert scrape.samples[("gateway_http_request_duration_seconds_bucket", fast)] == 0


async def test_a_failing_handler_is_a_500_and_serving_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = [0]

    def health() -> tuple[bool, dict[str, object]]:
        calls[0] += 1
        if calls[0] <= 2:
            raise KeyError("nope")
        return True, {}

    async with running(health=health, extra=[add_api]) as at:
        with caplog.at_level(logging.WARNING, logger="gateway.web.http"):
            reply = await request(at, "/healthz")
            again = await request(at, "/healthz")
            api = await request(at, "/api/v1/broken")
        assert (reply.status, reply.body) == (500, b"internal server error\n")
        assert b"nope" not in reply.body
        assert again.status == 500
        assert (api.status, api.json()) == (
            500,
            {"error": "internal_error", "detail": "internal server error"},
        )
        # One warning with the traceback; the same message again within 10 s is
        # not logged (a client can provoke it at will).
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert warnings[0].exc_info is not None
        assert (await request(at, "/healthz")).status == 200
        assert (await request(at, "/metrics")).status == 200


async def test_exit_closes_the_listener_and_open_connections() -> None:
    started = asyncio.Event()

    def add_stuck(app: web.Application) -> None:
        async def stuck(request: web.Request) -> web.Response:
            started.set()
            await asyncio.Event().wait()  # until cancelled at shutdown
            raise AssertionError("not reached")

        app.router.add_get("/stuck", stuck)

    # A long keep-alive: only the shutdown can close these connections in time.
    limits = Limits(keepalive_timeout=60)
    async with asyncio.timeout(WAIT):
        async with running(extra=[add_stuck], limits=limits, shutdown_timeout=0.2) as at:
            port = at.port
            half, half_writer = await asyncio.open_connection(HOST, port)
            half_writer.write(b"GET /metr")  # waiting for the rest of its head
            stuck, stuck_writer = await asyncio.open_connection(HOST, port)
            stuck_writer.write(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
            await started.wait()
        try:
            assert await until_closed(half) == b""
            assert await until_closed(stuck) == b""  # cancelled after shutdown_timeout
        finally:
            for writer in (half_writer, stuck_writer):
                writer.close()
                with suppress(ConnectionError):
                    await writer.wait_closed()
        with pytest.raises(OSError, match=r"refused|Connect call failed"):
            await asyncio.open_connection(HOST, port)


async def test_a_port_in_use_is_a_config_error() -> None:
    async with running() as at:
        app = build_app(metrics=gateway_registry(Stats()), health=healthy, noisy=no_noisy)
        with pytest.raises(ConfigError, match=r"api: cannot listen on .*api\.port"):
            async with serve(app, HOST, at.port):
                pass


def test_documented_defaults() -> None:
    # The numbers the module docstring and the README promise.
    limits = Limits()
    assert (limits.max_line_size, limits.max_field_size, limits.max_headers) == (65536, 8190, 64)
    assert limits.client_max_size == 64 * 1024
    assert limits.keepalive_timeout == 5.0
    assert limits.lingering_time == 1.0
    assert limits.max_requests == 32


async def test_a_token_in_a_bad_header_line_never_reaches_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A token read from a file with CRLF line ends carries a stray CR: aiohttp
    refuses the header line, and its parser error quoted the line, token and
    all, at ERROR. The request is still refused; the secret is masked."""
    token = "gwt_c93019ae_" + "S3cr3tS3cr3t" * 3
    line = f"Authorization: Bearer {token}\r"
    raw = f"GET /healthz HTTP/1.1\r\nHost: x\r\n{line}\r\n\r\n"
    with caplog.at_level(logging.DEBUG, logger="gateway.web.http"):
        async with running() as at:
            assert status_of(await exchange(at.port, raw.encode())) == 400
        # The same message within 10 s is left out, so the parser's error is
        # also logged afresh here, as aiohttp words it.
        error = aiohttp.http_exceptions.BadHttpMessage(
            f"Missing expected LF after header value:\n    {line.encode()!r}"
        )
        http_log.error("Error handling request %s", id(error), exc_info=error)
    assert "gwt_c93019ae_..." in caplog.text  # logged, naming the token's public id
    assert "S3cr3t" not in caplog.text


def test_the_readmes_metrics_reference_lists_every_family() -> None:
    """The README's table of /metrics against what the gateway registers (a
    name gone or added without the table following fails here)."""
    registry = gateway_registry(Stats(), noisy=list, spool=FakeSpool())
    families = [*registry.collect(), *HttpCollector(HttpStats()).collect()]
    served = {
        f.name + ("_total" if f.type == "counter" else "")
        for f in families
        if not f.name.startswith(("process_", "python_"))
    }
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(gateway_[a-z0-9_]+)` \|", table, re.MULTILINE))
    assert served - listed == set(), "registered, not in the README's table"
    assert listed - served == set(), "in the README's table, not registered"


class _Keep(logging.Handler):
    def __init__(self, seen: list[logging.LogRecord]) -> None:
        super().__init__()
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)


def test_a_bad_request_is_logged_as_one_masked_warning_line() -> None:
    """What aiohttp logs for a request it cannot parse: an ERROR with its
    traceback, quoting the request (a token among it)."""
    seen: list[logging.LogRecord] = []
    logger = logging.getLogger("gateway.web.http.test-brief")
    logger.propagate = False
    for kept in (server._BadRequestsBrief(), server._MaskTokens()):
        logger.addFilter(kept)
    logger.addHandler(_Keep(seen))
    secret = "gwt_0123abcd_" + "s" * 43
    try:
        raise HttpProcessingError(
            code=400, message=f"Got more than 8190 bytes when reading: b'Bearer {secret}'"
        )
    except HttpProcessingError:
        logger.exception("Error handling request from %s", "127.0.0.1")
    (record,) = seen
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    text = logging.Formatter().format(record)
    assert text.startswith("Error handling request from 127.0.0.1: a bad request, answered 400: ")
    assert "Traceback" not in text
    assert "s" * 43 not in text
    assert "gwt_0123abcd_..." in text  # the token's public id, as elsewhere
