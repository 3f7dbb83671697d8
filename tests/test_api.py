"""gateway.web: the metrics model, the exposition text, and the HTTP server's bounds.

No external services: each test serves on 127.0.0.1 port 0 and talks raw
HTTP/1.1 over asyncio streams.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import pytest

from gateway.stats import Stats
from gateway.web.metrics import (
    METRICS_CONTENT_TYPE,
    SERIES_DROPPED,
    MetricsRegistry,
    gateway_metrics,
)
from gateway.web.server import serve

HOST = "127.0.0.1"
WAIT = 5.0  # upper bound for any single wait in these tests

Labels = frozenset[tuple[str, str]]


# --------------------------------------------------------------------------
# A strict line-by-line reader of exposition format 0.0.4


@dataclass
class Exposition:
    types: dict[str, str] = field(default_factory=dict)
    helps: dict[str, str] = field(default_factory=dict)
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    order: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"({_NAME})(\{{.*\}})? (\S+)\Z")
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def _parse_labels(text: str) -> dict[str, str]:
    """``{a="x",b="y"}`` with the spec's escapes (\\\\, \\", \\n)."""
    assert text.startswith("{"), text
    assert text.endswith("}"), text
    labels: dict[str, str] = {}
    i, body = 0, text[1:-1]
    while i < len(body):
        m = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="').match(body, i)
        assert m, f"bad label at {body[i:]!r}"
        name, i = m.group(1), m.end()
        value: list[str] = []
        while body[i] != '"':
            if body[i] == "\\":
                escaped = body[i + 1]
                assert escaped in '\\"n', f"bad escape \\{escaped}"
                value.append("\n" if escaped == "n" else escaped)
                i += 2
            else:
                assert body[i] != "\n"
                value.append(body[i])
                i += 1
        i += 1
        assert name not in labels, f"duplicate label {name}"
        labels[name] = "".join(value)
        if i < len(body):
            assert body[i] == ",", body[i:]
            i += 1
    return labels


def _family_of(name: str, types: dict[str, str]) -> str:
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and types.get(base) == "histogram":
            return base
    raise AssertionError(f"sample {name} has no preceding TYPE line")


def parse_exposition(text: str) -> Exposition:
    assert text.endswith("\n"), "exposition must end with a newline"
    out = Exposition()
    current: str | None = None  # the family whose lines we are in
    done: set[str] = set()  # families already left: their lines must be contiguous
    for line in text.splitlines():
        assert line, "no empty lines"
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, *rest = line.split(" ", 3)
            assert re.fullmatch(_NAME, name), name
            if name != current:
                assert name not in done, f"{name} not contiguous"
                if current is not None:
                    done.add(current)
                current = name
            if kind == "TYPE":
                assert name not in out.types, f"second TYPE for {name}"
                assert rest, line
                assert rest[0] in _TYPES, line
                assert not any(k[0] == name for k in out.samples), "TYPE after samples"
                out.types[name] = rest[0]
            else:
                out.helps[name] = rest[0] if rest else ""
            continue
        assert not line.startswith("#"), line
        m = _SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name, label_text, raw = m.groups()
        family = _family_of(name, out.types)
        assert family == current, f"{name} outside its family's block"
        labels = _parse_labels(label_text) if label_text else {}
        value = float(raw)  # accepts +Inf, -Inf, NaN as Go does
        key = (name, frozenset(labels.items()))
        assert key not in out.samples, f"duplicate sample {line}"
        out.samples[key] = value
        out.order.append((name, labels, value))
    check_histograms(out)
    return out


def check_histograms(exp: Exposition) -> None:
    for family, kind in exp.types.items():
        if kind != "histogram":
            continue
        series: dict[Labels, list[tuple[float, float]]] = {}
        for name, labels, value in exp.order:
            if name == f"{family}_bucket":
                rest = frozenset((k, v) for k, v in labels.items() if k != "le")
                series.setdefault(rest, []).append((float(labels["le"]), value))
        for rest, buckets in series.items():
            les = [le for le, _ in buckets]
            counts = [n for _, n in buckets]
            assert les == sorted(les), les
            assert len(set(les)) == len(les), les
            assert les[-1] == math.inf, "last bucket must be +Inf"
            assert counts == sorted(counts), f"{family} buckets not cumulative: {counts}"
            assert exp.samples[(f"{family}_count", rest)] == counts[-1]
            assert (f"{family}_sum", rest) in exp.samples


# --------------------------------------------------------------------------
# A raw HTTP client


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_reply(data: bytes) -> Reply:
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response head in {data[:200]!r}"
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, status, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return Reply(int(status), headers, body)


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


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, read until the server closes."""
    async with asyncio.timeout(WAIT), connection(port) as (reader, writer):
        writer.write(raw)
        await writer.drain()
        return await reader.read()


async def get(port: int, path: str, method: str = "GET") -> Reply:
    raw = f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nUser-Agent: test\r\n\r\n"
    return parse_reply(await exchange(port, raw.encode()))


def port_of(server: asyncio.Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


def healthy() -> tuple[bool, dict[str, object]]:
    return True, {"cassandra": "up"}


@asynccontextmanager
async def running(
    render: Callable[[], str] = lambda: "",
    health: Callable[[], tuple[bool, dict[str, object]]] = healthy,
    **kwargs: float,
) -> AsyncIterator[int]:
    async with serve(HOST, 0, render, health, **kwargs) as server:  # type: ignore[arg-type]
        yield port_of(server)


# --------------------------------------------------------------------------
# Metrics model


def test_values_match_what_was_recorded() -> None:
    reg = MetricsRegistry()
    hits = reg.counter("app_hits_total", "Hits.", ("path",))
    reg.counter("app_plain_total", "No labels.")
    temp = reg.gauge("app_temperature", "Temperature.", ("room",))
    depth = reg.gauge("app_depth", "Callback gauge.")
    latency = reg.histogram("app_latency_seconds", "Latency.", (0.1, 1.0, 10.0), ("op",))
    hits.inc(path="/a")
    hits.inc(2.5, path="/a")
    hits.inc(path="/b")
    hits.set_total(42, path="/mirrored")
    temp.set(21.5, room="kitchen")
    temp.set(-3, room="cellar")
    box = [7]
    depth.set_function(lambda: box[0])
    for v in (0.05, 0.1, 0.5, 5.0, 50.0):
        latency.observe(v, op="read")
    latency.observe(math.nan, op="nan")

    exp = parse_exposition(reg.render())
    assert exp.types["app_hits_total"] == "counter"
    assert exp.types["app_temperature"] == "gauge"
    assert exp.types["app_latency_seconds"] == "histogram"
    assert exp.value("app_hits_total", path="/a") == 3.5
    assert exp.value("app_hits_total", path="/b") == 1
    assert exp.value("app_hits_total", path="/mirrored") == 42
    assert exp.value("app_plain_total") == 0  # label-less metrics exist from the start
    assert exp.value("app_temperature", room="kitchen") == 21.5
    assert exp.value("app_temperature", room="cellar") == -3
    assert exp.value("app_depth") == 7
    box[0] = 9
    assert parse_exposition(reg.render()).value("app_depth") == 9

    # le is inclusive: 0.1 falls in le="0.1"
    buckets = {"0.1": 2, "1": 3, "10": 4, "+Inf": 5}
    for le, n in buckets.items():
        assert exp.value("app_latency_seconds_bucket", op="read", le=le) == n
    assert exp.value("app_latency_seconds_count", op="read") == 5
    assert exp.value("app_latency_seconds_sum", op="read") == pytest.approx(55.65)
    # NaN lands in +Inf only, and makes the sum NaN (as Prometheus clients do).
    assert exp.value("app_latency_seconds_bucket", op="nan", le="10") == 0
    assert exp.value("app_latency_seconds_count", op="nan") == 1
    assert math.isnan(exp.value("app_latency_seconds_sum", op="nan"))


def test_label_escaping() -> None:
    reg = MetricsRegistry()
    nasty = 'a"b\\c\nd'
    reg.counter("app_total", "Help with \\ and\nnewline.", ("v",)).inc(v=nasty)
    reg.histogram("app_h", "H.", (1.0,), ("v",)).observe(0.5, v=nasty)
    text = reg.render()
    assert 'app_total{v="a\\"b\\\\c\\nd"} 1\n' in text
    assert 'app_h_bucket{v="a\\"b\\\\c\\nd",le="1"} 1\n' in text
    assert "# HELP app_total Help with \\\\ and\\nnewline.\n" in text
    exp = parse_exposition(text)
    assert exp.value("app_total", v=nasty) == 1
    assert exp.value("app_h_count", v=nasty) == 1
    assert exp.helps["app_total"] == "Help with \\\\ and\\nnewline."


def test_render_order_is_stable() -> None:
    reg = MetricsRegistry()
    b = reg.counter("b_total", "B.", ("k",))
    a = reg.gauge("a", "A.", ("k",))
    for k in ("z", "m", "a"):
        b.inc(k=k)
        a.set(1, k=k)
    text = reg.render()
    assert text == reg.render()
    names = [line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert names == sorted(names)
    assert [labels["k"] for name, labels, _ in parse_exposition(text).order if name == "a"] == [
        "a",
        "m",
        "z",
    ]


def test_cardinality_cap_folds_into_other_and_counts() -> None:
    reg = MetricsRegistry(max_series=3)
    per_tenant = reg.counter("app_per_tenant_total", "Per tenant.", ("tenant", "kind"))
    hist = reg.histogram("app_h", "H.", (1.0,), ("tenant",), max_series=1)
    for i in range(5):
        per_tenant.inc(tenant=f"t{i}", kind="x")
    per_tenant.inc(10, tenant="t0", kind="x")  # an existing series still counts on its own
    per_tenant.inc(tenant="t9", kind="x")  # folded again
    hist.observe(0.5, tenant="a")
    hist.observe(2.0, tenant="b")

    exp = parse_exposition(reg.render())
    assert exp.value("app_per_tenant_total", tenant="t0", kind="x") == 11
    assert exp.value("app_per_tenant_total", tenant="t2", kind="x") == 1
    assert ("app_per_tenant_total", frozenset({("tenant", "t3"), ("kind", "x")})) not in (
        exp.samples
    )
    assert exp.value("app_per_tenant_total", tenant="_other", kind="_other") == 3
    assert per_tenant.series_count == 4  # 3 real + _other: bounded
    assert exp.value("app_h_count", tenant="_other") == 1
    assert exp.value("app_h_bucket", tenant="_other", le="1") == 0
    assert exp.value(SERIES_DROPPED, metric="app_per_tenant_total") == 3
    assert exp.value(SERIES_DROPPED, metric="app_h") == 1

    # A mirrored total beyond the cap cannot be summed into _other: not recorded, counted.
    mirrored = reg.counter("app_mirror_total", "M.", ("k",), max_series=1)
    mirrored.set_total(5, k="a")
    mirrored.set_total(7, k="b")
    exp = parse_exposition(reg.render())
    assert exp.value("app_mirror_total", k="a") == 5
    assert exp.value("app_mirror_total", k="_other") == 0
    assert exp.value(SERIES_DROPPED, metric="app_mirror_total") == 1


def test_misuse_is_rejected() -> None:
    reg = MetricsRegistry()
    c = reg.counter("app_total", "C.", ("a",))
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(b="x")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc()
    with pytest.raises(ValueError, match="cannot decrease"):
        c.inc(-1, a="x")
    with pytest.raises(ValueError, match="collides"):
        reg.gauge("app_total", "Again.")
    reg.histogram("app_h", "H.", (1.0,))
    with pytest.raises(ValueError, match="collides"):
        reg.counter("app_h_count", "Clashes with the histogram's samples.")
    with pytest.raises(ValueError, match="invalid metric name"):
        reg.counter("app-total", "Bad.")
    with pytest.raises(ValueError, match="invalid label name"):
        reg.counter("app2_total", "Bad.", ("__reserved",))
    with pytest.raises(ValueError, match="reserved"):
        reg.histogram("app_h2", "H.", (1.0,), ("le",))
    with pytest.raises(ValueError, match="strictly increasing"):
        reg.histogram("app_h3", "H.", (2.0, 1.0))
    with pytest.raises(ValueError, match="without labels"):
        reg.gauge("app_g", "G.", ("a",)).set_function(lambda: 1.0)


def test_stats_are_mirrored() -> None:
    stats = Stats(
        received=10,
        written=7,
        rejected=3,
        acked=6,
        acks_dropped=1,
        no_ts=2,
        chunks=4,
        requests=12,
        rows=30,
        retries=5,
        in_flight=3,
        queue_depth=17,
        connects=2,
        disconnects=1,
        coalesced=8,
        throttled_s=1.25,
        throttle_events=2,
        read_pauses=9,
    )
    stats.rejected_by_reason.update({"bad_json": 2, "bad_topic": 1})
    reg = gateway_metrics(stats).registry
    exp = parse_exposition(reg.render())
    expected = {
        "gateway_messages_received_total": 10,
        "gateway_events_written_total": 7,
        "gateway_acks_sent_total": 6,
        "gateway_acks_dropped_total": 1,
        "gateway_events_without_ts_total": 2,
        "gateway_cassandra_requests_total": 12,
        "gateway_cassandra_rows_total": 30,
        "gateway_cassandra_retries_total": 5,
        "gateway_cassandra_in_flight": 3,
        "gateway_queue_depth": 17,
        "gateway_mqtt_connects_total": 2,
        "gateway_mqtt_disconnects_total": 1,
        "gateway_backpressure_seconds_total": 1.25,
        "gateway_backpressure_events_total": 2,
        "gateway_read_pauses_total": 9,
        "gateway_coalesced_events_total": 8,
        "gateway_chunks_total": 4,
    }
    for name, value in expected.items():
        assert exp.value(name) == value, name
    assert exp.value("gateway_messages_rejected_total", reason="bad_json") == 2
    assert exp.value("gateway_messages_rejected_total", reason="bad_topic") == 1
    assert 0 <= exp.value("gateway_uptime_seconds") < 60
    assert exp.types["gateway_cassandra_in_flight"] == "gauge"
    assert exp.types["gateway_chunks_total"] == "counter"

    # Values are read at render time.
    stats.received += 5
    stats.in_flight = 0
    stats.rejected_by_reason["bad_json"] += 1
    exp = parse_exposition(reg.render())
    assert exp.value("gateway_messages_received_total") == 15
    assert exp.value("gateway_cassandra_in_flight") == 0
    assert exp.value("gateway_messages_rejected_total", reason="bad_json") == 3


def test_direct_families() -> None:
    stats = Stats()
    metrics = gateway_metrics(stats)
    stats.write_latency.observe(0.004)
    stats.write_latency.observe(120)
    stats.batch_rows.observe(3)
    stats.hot_by_table.add("telemetry")
    stats.quota_by_tenant.add("acme")
    stats.sampled_out_by_tenant.add("acme", 4)
    exp = parse_exposition(metrics.render())
    assert exp.types["gateway_write_latency_seconds"] == "histogram"
    assert exp.value("gateway_write_latency_seconds_bucket", le="0.001") == 0
    assert exp.value("gateway_write_latency_seconds_bucket", le="0.005") == 1
    assert exp.value("gateway_write_latency_seconds_bucket", le="60") == 1
    assert exp.value("gateway_write_latency_seconds_bucket", le="+Inf") == 2
    les = [
        float(labels["le"]) for name, labels, _ in exp.order if name == "gateway_batch_rows_bucket"
    ]
    assert les == [2.0**i for i in range(11)] + [math.inf]
    assert exp.value("gateway_batch_rows_bucket", le="2") == 0
    assert exp.value("gateway_batch_rows_bucket", le="4") == 1
    assert exp.value("gateway_hot_partitions_total", table="telemetry") == 1
    assert exp.value("gateway_quota_rejections_total", tenant="acme") == 1
    assert exp.value("gateway_sampled_out_total", tenant="acme") == 4


# --------------------------------------------------------------------------
# HTTP


async def test_metrics_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    stats = Stats(received=3, written=2)
    metrics = gateway_metrics(stats)
    stats.write_latency.observe(0.2)
    stats.quota_by_tenant.add('a"b\\c\nd')
    with caplog.at_level(logging.INFO, logger="gateway.web.server"):
        async with running(metrics.render) as port:
            assert f"metrics on http://{HOST}:{port}/metrics" in caplog.messages
            reply = await get(port, "/metrics")
            stats.received = 4
            reply2 = await get(port, "/metrics?name[]=x")  # query strings are ignored
    assert reply.status == 200
    assert reply.headers["content-type"] == METRICS_CONTENT_TYPE
    exp = parse_exposition(reply.body.decode("utf-8"))
    assert exp.value("gateway_messages_received_total") == 3
    assert exp.value("gateway_events_written_total") == 2
    assert exp.value("gateway_write_latency_seconds_count") == 1
    assert exp.value("gateway_quota_rejections_total", tenant='a"b\\c\nd') == 1
    assert reply2.status == 200
    assert parse_exposition(reply2.body.decode()).value("gateway_messages_received_total") == 4


async def test_healthz() -> None:
    state: dict[str, object] = {"cassandra": "up", "mqtt": "connected"}
    ok = [True]
    async with running(health=lambda: (ok[0], state)) as port:
        reply = await get(port, "/healthz")
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        assert json.loads(reply.body) == {"status": "ok", "checks": state}
        ok[0] = False
        state["cassandra"] = "down"
        reply = await get(port, "/healthz")
        assert reply.status == 503
        assert json.loads(reply.body) == {"status": "degraded", "checks": state}


async def test_unknown_path_wrong_method_bad_request() -> None:
    async with running() as port:
        assert (await get(port, "/")).status == 404
        assert (await get(port, "/metrics/extra")).status == 404
        reply = await get(port, "/metrics", method="POST")
        assert reply.status == 405
        assert reply.headers["allow"] == "GET"
        assert (await get(port, "/healthz", method="DELETE")).status == 405
        assert (await get(port, "/nope", method="POST")).status == 404
        assert parse_reply(await exchange(port, b"garbage\r\n\r\n")).status == 400
        assert parse_reply(await exchange(port, b"GET /metrics SPDY/3\r\n\r\n")).status == 400
        # Still serving.
        assert (await get(port, "/healthz")).status == 200


async def test_oversized_head_gets_431() -> None:
    async with running() as port:
        big = b"GET /metrics HTTP/1.1\r\n" + b"".join(
            b"X-Filler-%d: %s\r\n" % (i, b"x" * 100) for i in range(90)
        )
        assert len(big) > 8 * 1024
        reply = parse_reply(await exchange(port, big + b"\r\n"))
        assert reply.status == 431
        one_long_line = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n"
        assert parse_reply(await exchange(port, one_long_line)).status == 431
        # Just under the bound is fine.
        head = b"GET /metrics HTTP/1.1\r\nX: "
        fits = head + b"y" * (8 * 1024 - len(head) - 4) + b"\r\n\r\n"
        assert len(fits) == 8 * 1024
        assert parse_reply(await exchange(port, fits)).status == 200


def test_documented_defaults() -> None:
    params = inspect.signature(serve).parameters
    assert params["read_timeout"].default == 5.0
    assert params["max_connections"].default == 32
    assert params["max_header_bytes"].default == 8 * 1024


async def test_slowloris_is_cut_off() -> None:
    async with running(read_timeout=0.3) as port:
        # A head that stops half way is answered 408 and closed (the WAIT
        # deadline fails the test if the server holds it instead).
        async with asyncio.timeout(WAIT), connection(port) as (reader, writer):
            writer.write(b"GET /metr")  # ... and never the rest
            await writer.drain()
            data = await reader.read()  # EOF: the server closed the connection
        assert parse_reply(data).status == 408
        # Dribbling bytes does not extend the deadline: it covers the whole head.
        # A byte every 50 ms, forever, never lets a per-read timeout of 0.3 s
        # expire; only a deadline on the whole head ends this connection.
        async with asyncio.timeout(WAIT), connection(port) as (reader, writer):

            async def dribble() -> None:
                head = b"GET /metrics HTTP/1.1\r\nX-Slow: "
                for ch in itertools.chain(head, itertools.repeat(ord("y"))):
                    writer.write(bytes([ch]))
                    await writer.drain()
                    await asyncio.sleep(0.05)

            dribbler = asyncio.create_task(dribble())
            data = await reader.read()  # returns at the server's FIN, after its 408
            dribbler.cancel()
            await asyncio.gather(dribbler, return_exceptions=True)
        assert parse_reply(data).status == 408
        assert (await get(port, "/healthz")).status == 200


async def test_a_head_in_pieces_within_the_deadline_is_served() -> None:
    # The other side of the deadline: a client that pauses mid-head but
    # completes it in time is answered, not cut off.
    async with running(read_timeout=WAIT) as port:
        async with asyncio.timeout(WAIT * 2), connection(port) as (reader, writer):
            for piece in (b"GET /hea", b"lthz HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
            data = await reader.read()
        assert parse_reply(data).status == 200


async def test_connections_beyond_the_limit_get_503() -> None:
    """Behaviour chosen: the 33rd concurrent connection is refused with 503, not queued."""
    async with running(read_timeout=30) as port, asyncio.timeout(WAIT * 2):
        idle = [await asyncio.open_connection(HOST, port) for _ in range(32)]
        try:
            # The server accepts in order, so these 32 hold every slot.
            extra = await exchange(port, b"")
            reply = parse_reply(extra)
            assert reply.status == 503
            assert reply.headers["retry-after"] == "1"
            # A request sent on an extra connection also gets the 503 (no reset).
            assert (await get(port, "/healthz")).status == 503
            # Freeing one slot lets the next connection in.
            _, writer = idle.pop()
            writer.close()
            await writer.wait_closed()
            for _ in range(500):  # until the server has seen that close
                if (status := (await get(port, "/healthz")).status) != 503:
                    break
                await asyncio.sleep(0.01)
            assert status == 200
            # An idle connection holding a slot is answered once it sends its request.
            reader, writer = idle.pop()
            writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
            assert parse_reply(await reader.read()).status == 200
            writer.close()
            await writer.wait_closed()
        finally:
            for _, writer in idle:
                writer.close()
                await writer.wait_closed()


async def test_render_error_is_a_500_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = [0]

    def render() -> str:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom")
        return "# TYPE x gauge\nx 1\n"

    def health() -> tuple[bool, dict[str, object]]:
        raise KeyError("nope")

    async with running(render, health) as port:
        with caplog.at_level(logging.WARNING, logger="gateway.web.server"):
            reply = await get(port, "/metrics")
        assert reply.status == 500
        assert reply.body == b"internal server error\n"
        assert b"boom" not in reply.body
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert warnings[0].exc_info is not None
        reply = await get(port, "/metrics")
        assert reply.status == 200
        assert parse_exposition(reply.body.decode()).value("x") == 1
        assert (await get(port, "/healthz")).status == 500
        assert (await get(port, "/metrics")).status == 200


async def test_exit_closes_listener_and_open_connections() -> None:
    async with asyncio.timeout(WAIT):
        async with serve(HOST, 0, lambda: "", healthy) as server:
            port = port_of(server)
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"GET /metr")  # a handler is in flight, waiting for the rest
            await writer.drain()
            await asyncio.sleep(0.05)
        try:
            assert await reader.read() == b""  # closed (reset) by the server on exit
        except ConnectionResetError:
            pass
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()
        with pytest.raises(OSError, match=r"refused|Connect call failed"):
            await asyncio.open_connection(HOST, port)
