"""The gateway's HTTP side: Prometheus metrics and a health check, no dependencies.

Serves, over plain HTTP/1.1 with ``Connection: close`` (one request per
connection):

    GET /metrics   Prometheus text exposition format 0.0.4, from ``render_metrics()``
    GET /healthz   {"status": "ok"|"degraded", "checks": {...}}; 200 if healthy, else 503

Anything else: 404 for an unknown path, 405 (``Allow: GET``) for another
method on a known path, 400 for a malformed request line.

Bounds, so a scraper (or anything else that finds the port) cannot hurt the
gateway's event loop:

* The request line plus headers may be at most 8 KiB; more gets 431. Request
  bodies are never read.
* The whole request head must arrive within 5 s of the connection being
  accepted (slowloris); otherwise 408 and the connection is closed. Writing the
  response has the same deadline.
* At most 32 connections are served at once (a semaphore). A connection beyond
  that is answered 503 (``Retry-After: 1``) at once and closed: refused, not
  queued, so a flood cannot pile up waiting handlers.
* After an error response the server reads and discards what the client still
  sends (at most 64 KiB, at most 1 s) before closing, so the client sees the
  response rather than a TCP reset.

``render_metrics`` and ``health`` run on the event loop and must be cheap and
non-blocking. If one raises, the request gets a 500 with a short text body and
one warning is logged; the server keeps serving.

The metrics model (:class:`MetricsRegistry`) is a small subset of Prometheus:
counters, gauges (set or callback) and histograms, with label escaping per the
exposition spec and a cap on label sets per metric. Updates and rendering
happen on the event loop thread, so there are no locks. Label sets beyond the
cap are folded into one series whose every label value is ``_other`` and the
fold is counted in ``gateway_metric_series_dropped_total{metric=...}``: memory
stays bounded and the loss is visible.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
import math
import re
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from .errors import ConfigError
from .metrics import Stats

log = logging.getLogger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"

MAX_HEADER_BYTES = 8 * 1024
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 32
LINGER_BYTES = 64 * 1024
LINGER_SECONDS = 1.0

DEFAULT_MAX_SERIES = 10_000
OTHER = "_other"
SERIES_DROPPED = "gateway_metric_series_dropped_total"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

Key = tuple[str, ...]
_F = TypeVar("_F", bound="_Family")


# --------------------------------------------------------------------------
# Metrics model


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the exposition format (Go's ParseFloat) reads it."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Family:
    """One metric family: a name, a type, label names, and its series."""

    kind: ClassVar[str]
    reserved_labels: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        registry: MetricsRegistry,
        name: str,
        help: str,
        labelnames: tuple[str, ...],
        max_series: int,
    ) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for {name}")
            if label in self.reserved_labels:
                raise ValueError(f"label name {label!r} is reserved in a {self.kind}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names for {name}: {labelnames}")
        if max_series < 1:
            raise ValueError(f"max_series must be at least 1, got {max_series}")
        self._registry = registry
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self.max_series = max_series
        self._labelset = frozenset(labelnames)
        self._other: Key = (OTHER,) * len(labelnames)
        # Rendered label pairs per series, without braces; also the set of series.
        self._label_text: dict[Key, str] = {}
        if not labelnames:
            self._label_text[()] = ""

    def _key(self, labels: Mapping[str, object]) -> tuple[Key, bool, bool]:
        """The series key for ``labels``, whether it is new (the caller creates
        it) and whether ``labels`` were folded into ``_other`` (cap reached)."""
        if not self.labelnames and not labels:
            return (), False, False
        if labels.keys() != self._labelset:
            raise ValueError(
                f"{self.name} takes labels {sorted(self._labelset)}, got {sorted(labels)}"
            )
        key = tuple(str(labels[n]) for n in self.labelnames)
        if key in self._label_text:
            return key, False, False
        folded = False
        if key != self._other:
            real = len(self._label_text) - (self._other in self._label_text)
            if real >= self.max_series:
                self._registry._series_dropped(self.name)
                key, folded = self._other, True
                if key in self._label_text:
                    return key, False, True
        self._label_text[key] = ",".join(
            f'{n}="{_escape_label(v)}"' for n, v in zip(self.labelnames, key, strict=True)
        )
        return key, True, folded

    @property
    def series_count(self) -> int:
        """Series held, including the ``_other`` one if the cap was hit."""
        return len(self._label_text)

    def sample_names(self) -> tuple[str, ...]:
        return (self.name,)

    def render_into(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {_escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        self._render_samples(out)

    def _render_samples(self, out: list[str]) -> None:
        raise NotImplementedError

    def _sample(self, out: list[str], name: str, key: Key, value: float) -> None:
        text = self._label_text[key]
        if text:
            out.append(f"{name}{{{text}}} {format_value(value)}")
        else:
            out.append(f"{name} {format_value(value)}")


class Counter(_Family):
    """A monotonically increasing total (name it ``*_total``)."""

    kind = "counter"

    def __init__(
        self,
        registry: MetricsRegistry,
        name: str,
        help: str,
        labelnames: tuple[str, ...],
        max_series: int,
    ) -> None:
        super().__init__(registry, name, help, labelnames, max_series)
        self._values: dict[Key, float] = dict.fromkeys(self._label_text, 0.0)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        key, new, _ = self._key(labels)
        if new:
            self._values[key] = amount
        else:
            self._values[key] += amount

    def set_total(self, value: float, **labels: str) -> None:
        """Mirror a total kept elsewhere (e.g. an int in :class:`Stats`).

        A label set beyond the cap cannot be folded into ``_other`` (a total
        cannot be summed without remembering it): it is not recorded, and the
        drop is counted like any other.
        """
        key, new, folded = self._key(labels)
        if folded:
            if new:
                self._values[key] = 0
            return
        self._values[key] = value

    def value(self, **labels: str) -> float:
        """The current value (0 for a series never touched); for tests and callers."""
        key = tuple(str(labels[n]) for n in self.labelnames)
        return self._values.get(key, 0)

    def _render_samples(self, out: list[str]) -> None:
        values = self._values
        for key in sorted(values):
            self._sample(out, self.name, key, values[key])


class Gauge(_Family):
    """A value that goes up and down; ``set`` it or give it a callback."""

    kind = "gauge"

    def __init__(
        self,
        registry: MetricsRegistry,
        name: str,
        help: str,
        labelnames: tuple[str, ...],
        max_series: int,
    ) -> None:
        super().__init__(registry, name, help, labelnames, max_series)
        self._values: dict[Key, float] = dict.fromkeys(self._label_text, 0.0)
        self._fn: Callable[[], float] | None = None

    def set(self, value: float, **labels: str) -> None:
        key, _, _ = self._key(labels)
        self._values[key] = value

    def clear(self) -> None:
        """Forget every labelled series (for gauges rebuilt at each render)."""
        if self.labelnames:
            self._values.clear()
            self._label_text.clear()

    def set_function(self, fn: Callable[[], float]) -> None:
        """Read the value from ``fn()`` at render time (gauges without labels only)."""
        if self.labelnames:
            raise ValueError(f"{self.name}: set_function needs a gauge without labels")
        self._fn = fn

    def value(self, **labels: str) -> float:
        if self._fn is not None:
            return self._fn()
        key = tuple(str(labels[n]) for n in self.labelnames)
        return self._values.get(key, 0)

    def _render_samples(self, out: list[str]) -> None:
        if self._fn is not None:
            self._sample(out, self.name, (), self._fn())
            return
        values = self._values
        for key in sorted(values):
            self._sample(out, self.name, key, values[key])


@dataclass(slots=True)
class _HistogramSeries:
    counts: list[int]  # per bucket, not cumulative; the last bucket is +Inf
    sum: float = 0.0


class Histogram(_Family):
    """Observations counted into buckets (rendered cumulative, with +Inf), sum, count."""

    kind = "histogram"
    reserved_labels = frozenset({"le"})

    def __init__(
        self,
        registry: MetricsRegistry,
        name: str,
        help: str,
        buckets: tuple[float, ...],
        labelnames: tuple[str, ...],
        max_series: int,
    ) -> None:
        super().__init__(registry, name, help, labelnames, max_series)
        bounds = [float(b) for b in buckets]
        if any(math.isnan(b) for b in bounds):
            raise ValueError(f"{name}: NaN bucket bound")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing, got {buckets}")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds: tuple[float, ...] = tuple(bounds)
        self._le = tuple(format_value(b) for b in bounds)
        self._series: dict[Key, _HistogramSeries] = {
            k: _HistogramSeries([0] * len(bounds)) for k in self._label_text
        }

    def observe(self, value: float, **labels: str) -> None:
        key, new, _ = self._key(labels)
        if new:
            series = self._series[key] = _HistogramSeries([0] * len(self.bounds))
        else:
            series = self._series[key]
        # Bucket i counts value <= bounds[i]; NaN only in +Inf, as Prometheus does.
        index = (
            len(self.bounds) - 1 if math.isnan(value) else bisect.bisect_left(self.bounds, value)
        )
        series.counts[index] += 1
        series.sum += value

    def sample_names(self) -> tuple[str, ...]:
        return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def _render_samples(self, out: list[str]) -> None:
        bucket, total, count = self.sample_names()
        for key in sorted(self._series):
            series = self._series[key]
            text = self._label_text[key]
            sep = "," if text else ""
            cumulative = 0
            for le, n in zip(self._le, series.counts, strict=True):
                cumulative += n
                out.append(f'{bucket}{{{text}{sep}le="{le}"}} {cumulative}')
            self._sample(out, total, key, series.sum)
            self._sample(out, count, key, cumulative)


class MetricsRegistry:
    """Metric families by name, rendered in name order as exposition format 0.0.4."""

    def __init__(self, max_series: int = DEFAULT_MAX_SERIES) -> None:
        self.max_series = max_series
        self._families: dict[str, _Family] = {}
        self._sample_names: set[str] = set()
        self._hooks: list[Callable[[], None]] = []
        # Label values are names of this registry's families: bounded by construction.
        self.series_dropped = self._add(
            Counter(
                self,
                SERIES_DROPPED,
                "Metric updates whose label set exceeded the metric's series cap, "
                'folded into the series with label values "_other".',
                ("metric",),
                sys.maxsize,
            )
        )

    def counter(
        self,
        name: str,
        help: str,
        labelnames: tuple[str, ...] = (),
        *,
        max_series: int | None = None,
    ) -> Counter:
        return self._add(Counter(self, name, help, labelnames, self._cap(max_series)))

    def gauge(
        self,
        name: str,
        help: str,
        labelnames: tuple[str, ...] = (),
        *,
        max_series: int | None = None,
    ) -> Gauge:
        return self._add(Gauge(self, name, help, labelnames, self._cap(max_series)))

    def histogram(
        self,
        name: str,
        help: str,
        buckets: tuple[float, ...],
        labelnames: tuple[str, ...] = (),
        *,
        max_series: int | None = None,
    ) -> Histogram:
        return self._add(Histogram(self, name, help, buckets, labelnames, self._cap(max_series)))

    def on_render(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` at the start of every render (to mirror values kept elsewhere)."""
        self._hooks.append(hook)

    def get(self, name: str) -> _Family:
        return self._families[name]

    def render(self) -> str:
        for hook in self._hooks:
            hook()
        out: list[str] = []
        for name in sorted(self._families):
            self._families[name].render_into(out)
        out.append("")
        return "\n".join(out)

    def _add(self, family: _F) -> _F:
        names = family.sample_names()
        if family.name in self._families or self._sample_names.intersection(names):
            raise ValueError(f"metric {family.name} collides with one already registered")
        self._families[family.name] = family
        self._sample_names.update(names)
        return family

    def _cap(self, max_series: int | None) -> int:
        return self.max_series if max_series is None else max_series

    def _series_dropped(self, metric: str) -> None:
        self.series_dropped.inc(metric=metric)


# --------------------------------------------------------------------------
# The gateway's metric families

# (metric name, Stats attribute, help)
_STATS_TOTALS: tuple[tuple[str, str, str], ...] = (
    ("gateway_messages_received_total", "received", "MQTT messages the broker handed over."),
    (
        "gateway_events_written_total",
        "written",
        "Events whose every Cassandra write was acknowledged.",
    ),
    ("gateway_acks_sent_total", "acked", "PUBACKs sent to the broker."),
    (
        "gateway_acks_dropped_total",
        "acks_dropped",
        "Messages finished after their MQTT connection closed; the broker redelivers them.",
    ),
    (
        "gateway_events_without_ts_total",
        "no_ts",
        "Events without a timestamp, stamped with the receive time.",
    ),
    (
        "gateway_cassandra_requests_total",
        "requests",
        "Cassandra requests sent, retries included (a batch is one).",
    ),
    ("gateway_cassandra_rows_total", "rows", "Statements in the Cassandra requests sent."),
    (
        "gateway_cassandra_retries_total",
        "retries",
        "Cassandra requests retried after a transient error.",
    ),
    ("gateway_mqtt_connects_total", "connects", "Successful MQTT connections."),
    ("gateway_mqtt_disconnects_total", "disconnects", "MQTT connections lost or closed."),
    (
        "gateway_backpressure_seconds_total",
        "throttled_s",
        "Seconds with mqtt.receive_maximum messages unacknowledged "
        "(added when each such period ends).",
    ),
    (
        "gateway_backpressure_events_total",
        "throttle_events",
        "Times mqtt.receive_maximum unacknowledged messages was reached.",
    ),
    (
        "gateway_read_pauses_total",
        "read_pauses",
        "Times the pipeline queue filled and MQTT socket reads paused.",
    ),
    (
        "gateway_read_overflow_total",
        "overflow",
        "Messages read after a read pause took effect (held, never dropped).",
    ),
    (
        "gateway_coalesced_events_total",
        "coalesced",
        "Events whose latest-state writes a newer event in the same chunk made moot.",
    ),
    ("gateway_chunks_total", "chunks", "Groups of messages the writer took off the queue."),
    ("gateway_states_registered_total", "states_registered", "States newly registered."),
    (
        "gateway_late_state_checks_total",
        "late_state_checks",
        "Reads done for old events into recently known states.",
    ),
)

WRITE_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BATCH_ROWS_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(11))  # 1 .. 1024


@dataclass(frozen=True, slots=True)
class GatewayMetrics:
    """The registry plus the families the pipeline observes directly."""

    registry: MetricsRegistry
    write_latency: Histogram  # seconds, MQTT publish time -> Cassandra ack
    batch_rows: Histogram  # statements per Cassandra request
    hot_partitions: Counter  # labels: table
    quota_rejections: Counter  # labels: tenant
    sampled_out: Counter  # labels: tenant
    noisy_rate: Gauge  # labels: tenant, device_id, rate (observed|kept); rebuilt per render

    def render(self) -> str:
        return self.registry.render()


def gateway_metrics(stats: Stats, *, max_series: int = DEFAULT_MAX_SERIES) -> GatewayMetrics:
    """The gateway's metric families; :class:`Stats` is mirrored at every render."""
    registry = MetricsRegistry(max_series)
    totals = [(registry.counter(name, help), attr) for name, attr, help in _STATS_TOTALS]
    rejected = registry.counter(
        "gateway_messages_rejected_total",
        "Messages recorded in rejected_messages, by reason.",
        ("reason",),
    )

    def mirror() -> None:
        for counter, attr in totals:
            counter.set_total(getattr(stats, attr))
        for reason, count in stats.rejected_by_reason.items():
            rejected.set_total(count, reason=reason)

    registry.on_render(mirror)
    registry.gauge(
        "gateway_cassandra_in_flight", "Cassandra requests not yet answered."
    ).set_function(lambda: stats.in_flight)
    registry.gauge(
        "gateway_queue_depth", "Messages in the pipeline queue (as last sampled)."
    ).set_function(lambda: stats.queue_depth)
    registry.gauge("gateway_uptime_seconds", "Seconds since the gateway started.").set_function(
        lambda: time.monotonic() - stats.started
    )
    return GatewayMetrics(
        registry=registry,
        write_latency=registry.histogram(
            "gateway_write_latency_seconds",
            "Seconds from MQTT publish time to the Cassandra acknowledgement of the event.",
            WRITE_LATENCY_BUCKETS,
        ),
        batch_rows=registry.histogram(
            "gateway_batch_rows", "Statements per Cassandra request.", BATCH_ROWS_BUCKETS
        ),
        hot_partitions=registry.counter(
            "gateway_hot_partitions_total",
            "Writes to partitions detected as hot, by table.",
            ("table",),
        ),
        quota_rejections=registry.counter(
            "gateway_quota_rejections_total",
            "Messages rejected for exceeding the tenant's quota, by tenant.",
            ("tenant",),
        ),
        sampled_out=registry.counter(
            "gateway_sampled_out_total",
            "Events not written because of sampling, by tenant.",
            ("tenant",),
        ),
        noisy_rate=registry.gauge(
            "gateway_noisy_device_rate",
            "Messages per second of each noisy device: observed, and kept after sampling.",
            ("tenant", "device_id", "rate"),
        ),
    )


def add_spool_metrics(metrics: GatewayMetrics, spool: SpoolGauges) -> None:
    """The spool's depth, size, oldest age and drained total (its rate is the drain rate)."""
    registry = metrics.registry
    registry.gauge("gateway_spool_depth", "Messages in the on-disk spool.").set_function(
        lambda: spool.depth
    )
    registry.gauge("gateway_spool_bytes", "Payload bytes in the on-disk spool.").set_function(
        lambda: spool.bytes
    )
    registry.gauge(
        "gateway_spool_oldest_age_seconds", "Age of the oldest spooled message."
    ).set_function(spool.oldest_age)
    drained = registry.counter(
        "gateway_spool_drained_total",
        "Spooled messages written to Cassandra and removed (its rate is the drain rate).",
    )
    registry.on_render(lambda: drained.set_total(spool.deleted))


class SpoolGauges(Protocol):
    depth: int
    bytes: int
    deleted: int

    def oldest_age(self) -> float: ...


# --------------------------------------------------------------------------
# HTTP server

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

_PATHS = ("/metrics", "/healthz")


@dataclass(slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = TEXT_CONTENT_TYPE
    headers: tuple[tuple[str, str], ...] = ()


def _text(status: int, text: str, *headers: tuple[str, str]) -> _Response:
    return _Response(status, text.encode(), TEXT_CONTENT_TYPE, headers)


class _HeadTooLarge(Exception):
    pass


class _Server:
    def __init__(
        self,
        render_metrics: Callable[[], str],
        health: Callable[[], tuple[bool, dict[str, object]]],
        read_timeout: float,
        max_connections: int,
        max_header_bytes: int,
        routes: Mapping[str, Callable[[Mapping[str, str]], object]],
    ) -> None:
        self.render_metrics = render_metrics
        self.routes = dict(routes)
        self.health = health
        self.read_timeout = read_timeout
        self.max_header_bytes = max_header_bytes
        self.slots = asyncio.Semaphore(max_connections)
        self.handlers: set[asyncio.Task[None]] = set()
        self.closing = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        answered = False  # otherwise (error, timeout, cancelled): reset the connection
        try:
            if self.closing:
                return
            if self.slots.locked():  # no await between this check and the acquire below
                await self._send(reader, writer, _text(503, "busy\n", ("Retry-After", "1")))
            else:
                async with self.slots:
                    response = await self._respond(reader)
                    await self._send(reader, writer, response)
            answered = True
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("HTTP connection ended: %r", exc)
        except Exception:
            log.warning("HTTP handler failed", exc_info=True)
        finally:
            self.handlers.discard(task)
            if answered:
                writer.close()
                try:
                    async with asyncio.timeout(self.read_timeout):
                        await writer.wait_closed()
                except TimeoutError:
                    writer.transport.abort()
                except Exception as exc:  # the peer reset; nothing to do
                    log.debug("HTTP close: %r", exc)
            else:
                writer.transport.abort()

    async def _respond(self, reader: asyncio.StreamReader) -> _Response:
        try:
            async with asyncio.timeout(self.read_timeout):
                request_line = await self._read_head(reader)
        except TimeoutError:
            return _text(408, "request timeout\n")
        except _HeadTooLarge:
            return _text(431, f"request head over {self.max_header_bytes} bytes\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
            return _text(400, "bad request\n")
        method, target, _ = parts
        path, _, query = target.partition("?")
        if path not in _PATHS and path not in self.routes:
            return _text(404, "not found\n")
        if method != "GET":
            return _text(405, "method not allowed\n", ("Allow", "GET"))
        try:
            if path == "/metrics":
                return _Response(200, self.render_metrics().encode(), METRICS_CONTENT_TYPE)
            if path in self.routes:
                params = dict(urllib.parse.parse_qsl(query))
                result = self.routes[path](params)
                return _Response(
                    200, json.dumps(result, default=str, sort_keys=True).encode(), JSON_CONTENT_TYPE
                )
            ok, checks = self.health()
            body = {"status": "ok" if ok else "degraded", "checks": checks}
            return _Response(
                200 if ok else 503,
                json.dumps(body, default=str, sort_keys=True).encode(),
                JSON_CONTENT_TYPE,
            )
        except Exception:
            log.warning("GET %s failed", path, exc_info=True)
            return _text(500, "internal server error\n")

    async def _read_head(self, reader: asyncio.StreamReader) -> str:
        """The request line, once the whole head (up to the empty line) is read."""
        total = 0
        request_line: bytes | None = None
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _HeadTooLarge from None
            total += len(line)
            if total > self.max_header_bytes:
                raise _HeadTooLarge
            if line in (b"\r\n", b"\n"):
                if request_line is not None:
                    return request_line.decode("latin-1").rstrip("\r\n")
                continue  # RFC 9112 2.2: ignore empty lines before the request line
            if request_line is None:
                request_line = line

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: _Response
    ) -> None:
        head = [
            f"HTTP/1.1 {response.status} {_REASONS[response.status]}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: close",
            "Cache-Control: no-store",
        ]
        head.extend(f"{name}: {value}" for name, value in response.headers)
        async with asyncio.timeout(self.read_timeout):
            writer.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + response.body)
            await writer.drain()
        if response.status >= 400 and writer.can_write_eof():
            # Lingering close: discard what the client still sends so that
            # closing does not reset the connection before it reads the answer.
            writer.write_eof()
            discarded = 0
            with suppress(TimeoutError):
                async with asyncio.timeout(min(LINGER_SECONDS, self.read_timeout)):
                    while discarded < LINGER_BYTES:
                        chunk = await reader.read(LINGER_BYTES)
                        if not chunk:
                            break
                        discarded += len(chunk)

    async def close(self) -> None:
        self.closing = True
        handlers = list(self.handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


def _url(sockname: tuple[object, ...]) -> str:
    host, port = str(sockname[0]), sockname[1]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


@asynccontextmanager
async def serve(
    host: str,
    port: int,
    render_metrics: Callable[[], str],
    health: Callable[[], tuple[bool, dict[str, object]]],
    *,
    read_timeout: float = READ_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    max_header_bytes: int = MAX_HEADER_BYTES,
    routes: Mapping[str, Callable[[Mapping[str, str]], object]] | None = None,
) -> AsyncIterator[asyncio.Server]:
    """Serve /metrics and /healthz on ``host:port`` (0: any free port) while inside.

    The bound address is in ``server.sockets``. On exit the listening socket is
    closed and connections still being served are cancelled and closed.
    """
    state = _Server(
        render_metrics, health, read_timeout, max_connections, max_header_bytes, routes or {}
    )
    try:
        server = await asyncio.start_server(state.handle, host, port, limit=max_header_bytes)
    except OSError as exc:
        raise ConfigError(
            f"api: cannot listen on {host}:{port} ({exc.strerror}); set api.port, "
            "or api.enabled = false"
        ) from None
    try:
        log.info("metrics on %s", _url(server.sockets[0].getsockname()))
        yield server
    finally:
        server.close()
        await state.close()
        await server.wait_closed()
