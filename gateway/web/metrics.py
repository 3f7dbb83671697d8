"""The gateway's Prometheus metrics: a small exposition-format registry, and
the families that mirror ``gateway/stats.py`` at every scrape.

The metrics model (:class:`MetricsRegistry`) is a small subset of Prometheus:
counters, gauges (set or callback) and histograms, with label escaping per the
exposition spec and a cap on label sets per metric. Updates and rendering
happen on the event loop thread, so there are no locks. Label sets beyond the
cap are folded into one series whose every label value is ``_other`` and the
fold is counted in ``gateway_metric_series_dropped_total{metric=...}``: memory
stays bounded and the loss is visible.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from ..stats import Histogram as StatsHistogram
from ..stats import Stats

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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

    def mirror(self, source: StatsHistogram) -> None:
        """Take the counts of a histogram kept in Stats (same bounds, no labels)."""
        if source.bounds != self.bounds or self.labelnames:
            raise ValueError(f"{self.name}: cannot mirror a histogram with other bounds")
        series = self._series[()]
        series.counts[:] = source.counts
        series.sum = source.sum

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
        "gateway_newest_reads_total",
        "newest_reads",
        "Reads of a device's newest write (once per device per start-up or eviction).",
    ),
    (
        "gateway_latest_deletes_saved_total",
        "deletes_saved",
        "Events in their device's last written state: no deletes written for them.",
    ),
    (
        "gateway_write_ts_ties_total",
        "tie_breaks",
        "Two events of one device with the same write timestamp, settled by event id.",
    ),
    (
        "gateway_stale_latest_total",
        "stale_latest",
        "Events older than their device's newest write: latest-table writes skipped.",
    ),
)


@dataclass(frozen=True, slots=True)
class NoisyRate:
    """One noisy device's rates, as the sampler reports them."""

    tenant: str
    device_id: str
    observed: float
    kept: float


class SpoolGauges(Protocol):
    depth: int
    bytes: int
    deleted: int

    def oldest_age(self) -> float: ...


@dataclass(frozen=True, slots=True)
class GatewayMetrics:
    """The registry of the gateway's families; ``render`` mirrors Stats first."""

    registry: MetricsRegistry

    def render(self) -> str:
        return self.registry.render()


def gateway_metrics(
    stats: Stats,
    *,
    noisy: Callable[[], list[NoisyRate]] | None = None,
    spool: SpoolGauges | None = None,
    max_series: int = DEFAULT_MAX_SERIES,
) -> GatewayMetrics:
    """The gateway's metric families; :class:`Stats` is mirrored at every render."""
    registry = MetricsRegistry(max_series)
    totals = [(registry.counter(name, help), attr) for name, attr, help in _STATS_TOTALS]
    rejected = registry.counter(
        "gateway_messages_rejected_total",
        "Messages recorded in rejected_messages, by reason.",
        ("reason",),
    )
    by_label = [
        (
            registry.counter(
                "gateway_hot_partitions_total",
                "Writes to partitions detected as hot, by table.",
                ("table",),
            ),
            "table",
            stats.hot_by_table,
        ),
        (
            registry.counter(
                "gateway_quota_rejections_total",
                "Messages rejected for exceeding the tenant's quota, by tenant.",
                ("tenant",),
            ),
            "tenant",
            stats.quota_by_tenant,
        ),
        (
            registry.counter(
                "gateway_sampled_out_total",
                "Events not written because of sampling, by tenant.",
                ("tenant",),
            ),
            "tenant",
            stats.sampled_out_by_tenant,
        ),
    ]
    histograms = [
        (
            registry.histogram(
                "gateway_write_latency_seconds",
                "Seconds from MQTT publish time to the Cassandra acknowledgement of the event.",
                stats.write_latency.bounds,
            ),
            stats.write_latency,
        ),
        (
            registry.histogram(
                "gateway_batch_rows", "Statements per Cassandra request.", stats.batch_rows.bounds
            ),
            stats.batch_rows,
        ),
    ]

    def mirror() -> None:
        for counter, attr in totals:
            counter.set_total(getattr(stats, attr))
        for reason, count in stats.rejected_by_reason.items():
            rejected.set_total(count, reason=reason)
        for family, label, counts in by_label:
            for value, count in counts.counts.items():
                family.set_total(count, **{label: value})
        for histogram, source in histograms:
            histogram.mirror(source)

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
    if noisy is not None:
        gauge = registry.gauge(
            "gateway_noisy_device_rate",
            "Messages per second of each noisy device: observed, and kept after sampling.",
            ("tenant", "device_id", "rate"),
        )

        def mirror_noisy() -> None:
            gauge.clear()  # rebuilt at each render: devices stop being noisy
            for d in noisy():
                gauge.set(d.observed, tenant=d.tenant, device_id=d.device_id, rate="observed")
                gauge.set(d.kept, tenant=d.tenant, device_id=d.device_id, rate="kept")

        registry.on_render(mirror_noisy)
    if spool is not None:
        _spool_families(registry, spool)
    return GatewayMetrics(registry)


def _spool_families(registry: MetricsRegistry, spool: SpoolGauges) -> None:
    """The spool's depth, size, oldest age and drained total (its rate is the drain rate)."""
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
