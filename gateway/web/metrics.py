"""The gateway's Prometheus metrics: every family built from ``gateway/stats.py`` at each scrape.

:class:`GatewayCollector` is a prometheus_client *custom collector* (the
library's documented way to expose values kept elsewhere): at each scrape its
``collect()`` reads :class:`Stats` (and the sampler's noisy devices and the
spool, when given) and yields fresh metric families. Nothing is updated
between scrapes, so the write path never touches prometheus_client.
:func:`gateway_registry` registers it in a private ``CollectorRegistry`` (not
the library's global one); ``generate_latest(registry)`` renders it.

Cardinality cap: a labelled family keeps at most ``max_series`` label sets per
scrape, in the order Stats first met them. The rest are folded into one series
whose label values are ``_other`` (counters: the sum of their totals, which
stays monotonic because Stats never forgets a label; the noisy-device gauge
keeps its ``rate`` label, so ``_other`` holds the summed observed and the
summed kept rates), and every label set folded at a scrape is counted in
``gateway_metric_series_dropped_total{metric=...}``: memory stays bounded and
the loss is visible. A label value that already is ``_other`` (Stats' own fold,
see ``LabelledCounts``) joins that series without counting as dropped.

The families run on the event loop thread at scrape time, so reading Stats
needs no lock; each scrape costs one pass over Stats.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..histogram import Histogram as StatsHistogram
from ..stats import WRITE_LATENCY_BUCKETS, Cache, Stats

# What ``generate_latest`` writes. Not prometheus_client's CONTENT_TYPE_LATEST:
# in recent releases (0.26 here; 0.20-0.22 still said 0.0.4) that names text
# format 1.0.0, which the library itself sends only with a negotiated escaping
# scheme; bare ``generate_latest`` output is format 0.0.4.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_MAX_SERIES = 10_000
OTHER = "_other"
SERIES_DROPPED = "gateway_metric_series_dropped_total"

Labels = tuple[str, ...]

# (metric name, Stats attribute, help)
_STATS_TOTALS: tuple[tuple[str, str, str], ...] = (
    ("gateway_messages_received_total", "received", "MQTT messages the broker handed over."),
    (
        "gateway_events_written_total",
        "written",
        "Events stored as raw rows, every Cassandra write of theirs acknowledged (not "
        "those sampling left out).",
    ),
    ("gateway_acks_sent_total", "acked", "PUBACKs sent to the broker."),
    (
        "gateway_hot_partitions_untracked_writes_total",
        "untracked_writes",
        "Writes to partitions beyond hot_partitions.max_tracked in their window: not "
        "counted per partition, so never found hot.",
    ),
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
    (
        "gateway_cassandra_sessions_renewed_total",
        "cassandra_sessions_renewed",
        "C++ driver sessions replaced after Cassandra requests found no host for a while.",
    ),
    (
        "gateway_cassandra_in_flight_waits_total",
        "in_flight_waits",
        "Cassandra requests that waited because the in-flight limit was reached.",
    ),
    ("gateway_mqtt_connects_total", "connects", "Successful MQTT connections."),
    ("gateway_mqtt_disconnects_total", "disconnects", "MQTT connections lost or closed."),
    (
        "gateway_mqtt_malformed_packets_total",
        "malformed_packets",
        "Connections closed because the broker sent a malformed packet.",
    ),
    (
        "gateway_mqtt_sessions_lost_total",
        "sessions_lost",
        "Reconnects where the broker no longer had our persistent session.",
    ),
    (
        "gateway_mqtt_subscriptions_refused_total",
        "subscriptions_refused",
        "Topic filters the broker refused to subscribe us to.",
    ),
    (
        "gateway_mqtt_subscriptions_qos0_total",
        "subscriptions_qos0",
        "Topic filters the broker granted at QoS 0 only: no acknowledgement, "
        "so messages on them can be lost.",
    ),
    (
        "gateway_mqtt_stale_subscription_messages_total",
        "stale_subscription",
        "Messages that match none of this config's topic filters: a subscription "
        "of an earlier config left in the broker session (gateway forget-session).",
    ),
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
        "Events that wrote nothing to the latest tables: a newer event made their writes "
        "moot (in the same chunk, or queued behind it and sure to write them), they were "
        "older than the device's newest write, or sampling kept the state view from them.",
    ),
    ("gateway_chunks_total", "chunks", "Groups of messages the writer took off the queue."),
    (
        "gateway_lingers_total",
        "lingers",
        "Chunks the writer waited pipeline.linger for, to gather more messages.",
    ),
    ("gateway_states_registered_total", "states_registered", "States newly registered."),
    (
        "gateway_newest_reads_total",
        "newest_reads",
        "Reads of a device's newest write (once per device per start-up or eviction; "
        "in a share group, at every chunk).",
    ),
    (
        "gateway_newest_read_ahead_total",
        "newest_read_ahead",
        "Of those, read as the event was queued, ahead of its chunk.",
    ),
    (
        "gateway_newest_read_ahead_skipped_total",
        "newest_read_ahead_skipped",
        "Devices not read ahead: pipeline.queue_size devices were waiting "
        "(their chunk reads them).",
    ),
    (
        "gateway_latest_deletes_saved_total",
        "deletes_saved",
        "Events in their device's last written state: no deletes written for them.",
    ),
    (
        "gateway_latest_missed_deletes_total",
        "missed_deletes",
        "Deletes sent late into a state another instance registered: its rows older than "
        "this one's writes of their devices into another state (pipeline.states_refresh).",
    ),
    (
        "gateway_write_ts_ties_total",
        "tie_breaks",
        "Two events of one device with the same write timestamp, settled by event id.",
    ),
    (
        "gateway_state_rotations_total",
        "rotations",
        "State partitions copied into a fresh generation (tombstones left behind).",
    ),
    ("gateway_state_rotation_rows_total", "rotation_rows", "Live rows those rotations copied."),
    (
        "gateway_state_rotation_failures_total",
        "rotation_failures",
        "Rotation steps that failed and are retried.",
    ),
    (
        "gateway_state_generations_dropped_total",
        "generations_dropped",
        "Old state-partition generations deleted after a rotation.",
    ),
    (
        "gateway_stale_latest_total",
        "stale_latest",
        "Events older than their device's newest write: latest-table writes skipped.",
    ),
    (
        "gateway_rollup_marks_total",
        "rollup_marks",
        "Dirty-window marks written with raw rows (roll-ups).",
    ),
    (
        "gateway_rollup_mark_evictions_total",
        "rollup_mark_evictions",
        "Written marks forgotten at rollups.mark_cache_size (written again when seen again).",
    ),
    (
        "gateway_metadata_cache_evictions_total",
        "metadata_cache_evictions",
        "Metadata entries, device shapes and tenant counts forgotten at their caches' bounds "
        "(metadata.cache_size; looked up, and written if missing, when seen again).",
    ),
    (
        "gateway_rollup_windows_total",
        "rollup_windows",
        "1-minute windows recomputed from their raw rows.",
    ),
    (
        "gateway_rollup_windows_kept_total",
        "rollup_windows_kept",
        "Roll-up aggregates kept as stored because a recompute found fewer rows "
        "(the rows it would read had expired).",
    ),
    (
        "gateway_rollup_paced_seconds_total",
        "rollup_paced_s",
        "Time the roll-up worker waited to spread a minute's work over rollups.spread.",
    ),
    (
        "gateway_rollup_failures_total",
        "rollup_failures",
        "Roll-up worker passes that failed (retried; the marks stay in Cassandra).",
    ),
    (
        "gateway_rollup_retries_total",
        "rollup_retries",
        "Roll-up worker reads and writes tried again after a timeout or an unavailable "
        "node (each is idempotent; a minute's work is not started over for one).",
    ),
    (
        "gateway_rollup_lease_taken_total",
        "rollup_lease_taken",
        "Times this instance took the roll-up worker's lease and began to work "
        "(rollups.worker; the other instances with it stand by).",
    ),
    (
        "gateway_rollup_lease_lost_total",
        "rollup_lease_lost",
        "Times this instance stopped working because its roll-up lease was another "
        "instance's or could not be renewed within rollups.lease.",
    ),
    (
        "gateway_clock_steps_total",
        "clock_steps",
        "Times this host's clock stepped by over a second (NTP setting a stale clock "
        "right, or someone setting it); each is followed by a new measurement against "
        "Cassandra's.",
    ),
    (
        "gateway_spool_full_total",
        "spool_full_waits",
        "Times the spool reached spool.max_records or spool.max_bytes: acknowledgements "
        "and reads paused until Cassandra drained it.",
    ),
    (
        "gateway_spool_disk_full_total",
        "spool_disk_full",
        "Spool writes refused because the disk was full: a single message's append, or a "
        "delete (a larger append is first halved, not counted; nothing acknowledged; retried).",
    ),
    (
        "gateway_metadata_writes_total",
        "metadata_writes",
        "New metadata entries written (metric names, tag keys and values, devices by tag).",
    ),
    (
        "gateway_metadata_reads_total",
        "metadata_reads",
        "Metadata entries not in the LRU (metadata.cache_size), looked up in Cassandra.",
    ),
    (
        "gateway_metadata_reservations_total",
        "metadata_reservations",
        "Compare-and-sets of a tenant's metadata entry count, lost races included.",
    ),
    (
        "gateway_quota_reads_total",
        "quota_reads",
        "Devices looked up in quota_devices: new to this process, of a tenant with "
        "max_devices_per_tenant.",
    ),
    (
        "gateway_quota_reservations_total",
        "quota_reservations",
        "Compare-and-sets of a tenant's admitted-device count, lost races included.",
    ),
    (
        "gateway_metadata_held_total",
        "metadata_held",
        "Events held for the metadata worker (an entry not in the LRU): acknowledged once "
        "their entries are decided and written.",
    ),
    (
        "gateway_metadata_backlog_waits_total",
        "metadata_backlog_waits",
        "Times the write loop waited because the metadata worker had its bound of chunks held.",
    ),
)

# (metric name, help, label name, Stats attribute holding a LabelledCounts)
_STATS_BY_LABEL: tuple[tuple[str, str, str, str], ...] = (
    (
        "gateway_hot_partitions_total",
        "Partitions that went over hot_partitions.threshold writes in a window (once "
        "per partition per window), by table.",
        "table",
        "hot_by_table",
    ),
    (
        "gateway_quota_rejections_total",
        "Messages rejected for exceeding the tenant's quota, by tenant.",
        "tenant",
        "quota_by_tenant",
    ),
    (
        "gateway_sampled_out_total",
        "Events not written because of sampling, by tenant.",
        "tenant",
        "sampled_out_by_tenant",
    ),
    (
        "gateway_metadata_capped_total",
        "New metadata entries not written: the tenant reached metadata.max_per_tenant.",
        "tenant",
        "metadata_capped_by_tenant",
    ),
)

_REJECTED = (
    "gateway_messages_rejected_total",
    "Messages recorded in rejected_messages, by reason.",
)
_NOISY = (
    "gateway_noisy_device_rate",
    "Messages per second of each noisy device: observed, and kept after sampling.",
)
_SERIES_DROPPED_HELP = (
    "Label sets beyond their metric's series cap, folded into the series whose label "
    'values are "_other" (each such label set counted at every scrape).'
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
    disk_full_since: float | None

    @property
    def full(self) -> bool: ...

    def oldest_age(self) -> float: ...


def bucket_bound(bound: float) -> str:
    """An ``le`` value as the gateway has always written it: ``0.005``, ``60``, ``+Inf``."""
    if math.isinf(bound):
        return "+Inf" if bound > 0 else "-Inf"
    if bound.is_integer() and abs(bound) < 1e15:
        return str(int(bound))
    return repr(bound)


def _buckets(source: StatsHistogram) -> list[tuple[str, float]]:
    """The cumulative buckets of ``source``, as prometheus_client takes them."""
    buckets: list[tuple[str, float]] = []
    cumulative = 0
    for bound, count in zip(source.bounds, source.counts, strict=True):
        cumulative += count
        buckets.append((bucket_bound(bound), cumulative))
    return buckets


def _histogram(name: str, help: str, source: StatsHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, help, buckets=_buckets(source), sum_value=source.sum)


class GatewayCollector(Collector):
    """The gateway's families, built from :class:`Stats` at every ``collect()``."""

    def __init__(
        self,
        stats: Stats,
        *,
        noisy: Callable[[], list[NoisyRate]] | None = None,
        spool: SpoolGauges | None = None,
        max_series: int = DEFAULT_MAX_SERIES,
    ) -> None:
        if max_series < 1:
            raise ValueError(f"max_series must be at least 1, got {max_series}")
        self.stats = stats
        self.noisy = noisy
        self.spool = spool
        self.max_series = max_series
        # Label sets folded so far, by metric: the only state kept between scrapes.
        self._dropped: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        families = list(self._families())
        dropped = CounterMetricFamily(SERIES_DROPPED, _SERIES_DROPPED_HELP, labels=("metric",))
        for metric, count in sorted(self._dropped.items()):
            dropped.add_metric((metric,), count)
        families.append(dropped)
        # Name order (as exposed: counters with _total), as the exposition always was.
        yield from sorted(families, key=_exposed_name)

    def _families(self) -> Iterator[Metric]:
        stats = self.stats
        for name, attr, help in _STATS_TOTALS:
            yield CounterMetricFamily(name, help, value=getattr(stats, attr))
        yield self._capped_counter(*_REJECTED, ("reason",), stats.rejected_by_reason)
        for name, help, label, attr in _STATS_BY_LABEL:
            yield self._capped_counter(name, help, (label,), getattr(stats, attr).counts)
        yield _histogram(
            "gateway_write_latency_seconds",
            "Seconds from an event's sent_at (the publisher's clock) to the acknowledgement "
            "of its last Cassandra write; only events that carry sent_at and are stored raw.",
            stats.write_latency,
        )
        yield _histogram(
            "gateway_batch_rows", "Statements per Cassandra request.", stats.batch_rows
        )
        yield _histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop woke from a 0.1 s sleep: its stalls, which every "
            "message in flight waits out.",
            stats.loop_lag,
        )
        yield GaugeMetricFamily(
            "gateway_cassandra_in_flight",
            "Cassandra requests not yet answered.",
            value=stats.in_flight,
        )
        yield GaugeMetricFamily(
            "gateway_cassandra_in_flight_limit",
            "Cassandra requests allowed in flight (adapted to the measured latency).",
            value=stats.in_flight_limit,
        )
        yield GaugeMetricFamily(
            "gateway_cassandra_latency_floor_seconds",
            "Lowest recent Cassandra request latency, the in-flight limit's reference.",
            value=stats.latency_floor,
        )
        yield GaugeMetricFamily(
            "gateway_queue_depth",
            "Messages in the pipeline queue (as last sampled).",
            value=stats.queue_depth,
        )
        yield GaugeMetricFamily(
            "gateway_rollup_lag_seconds",
            "How far the roll-up worker is behind the minutes that are due "
            "(on a standby: read from the cursor at each try).",
            value=stats.rollup_lag_s,
        )
        yield GaugeMetricFamily(
            "gateway_rollup_lease_held",
            "1 while this instance holds the roll-up worker's lease and works, else 0.",
            value=stats.rollup_lease_held,
        )
        offset = stats.clock_offset_s
        yield GaugeMetricFamily(
            "gateway_clock_offset_seconds",
            "Cassandra's clock minus this host's, as last measured (at start, every 10 "
            "min, and after a step): positive when this host's clock is behind; NaN until "
            "measured.",
            value=math.nan if offset is None else offset,
        )
        yield from _cache_families(stats.caches)
        yield GaugeMetricFamily(
            "gateway_uptime_seconds",
            "Seconds since the gateway started.",
            value=time.monotonic() - stats.started,
        )
        if self.noisy is not None:
            yield self._noisy_gauge(self.noisy())
        if self.spool is not None:
            yield from _spool_families(self.spool)

    def _capped_counter(
        self, name: str, help: str, labelnames: Labels, counts: Mapping[str, float]
    ) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help, labels=labelnames)
        series = (((str(value),), float(count)) for value, count in counts.items())
        for labels, total in self._cap(name, series, lambda _: (OTHER,) * len(labelnames)):
            family.add_metric(labels, total)
        return family

    def _noisy_gauge(self, devices: list[NoisyRate]) -> GaugeMetricFamily:
        name, help = _NOISY
        family = GaugeMetricFamily(name, help, labels=("tenant", "device_id", "rate"))

        def series() -> Iterator[tuple[Labels, float]]:
            for d in devices:
                yield (d.tenant, d.device_id, "observed"), d.observed
                yield (d.tenant, d.device_id, "kept"), d.kept

        for labels, value in self._cap(name, series(), lambda key: (OTHER, OTHER, key[2])):
            family.add_metric(labels, value)
        return family

    def _cap(
        self,
        metric: str,
        series: Iterable[tuple[Labels, float]],
        fold: Callable[[Labels], Labels],
    ) -> list[tuple[Labels, float]]:
        """The first ``max_series`` label sets as they are; the rest summed into their
        ``fold`` key (all ``_other``), and counted."""
        kept: dict[Labels, float] = {}
        folded: dict[Labels, float] = {}
        dropped = 0
        for labels, value in series:
            other = fold(labels)
            if labels == other:  # already folded upstream (Stats' own cap)
                folded[other] = folded.get(other, 0.0) + value
            elif labels in kept or len(kept) < self.max_series:
                kept[labels] = kept.get(labels, 0.0) + value
            else:
                folded[other] = folded.get(other, 0.0) + value
                dropped += 1
        if dropped:
            self._dropped[metric] = self._dropped.get(metric, 0) + dropped
        return [*sorted(kept.items()), *folded.items()]


def _cache_families(caches: Mapping[str, Cache]) -> Iterator[Metric]:
    """Each cache's entries, bound, and entries forgotten at the bound (what
    forgetting one costs is in its module: usually a read, or an idempotent
    write, again)."""
    evictions = CounterMetricFamily(
        "gateway_cache_evictions_total",
        "Entries a bounded cache forgot at its bound, by cache.",
        labels=("cache",),
    )
    entries = GaugeMetricFamily(
        "gateway_cache_entries", "Entries in a bounded cache, by cache.", labels=("cache",)
    )
    capacity = GaugeMetricFamily(
        "gateway_cache_capacity", "The bound of a cache, in entries, by cache.", labels=("cache",)
    )
    for name, cache in sorted(caches.items()):
        evictions.add_metric((name,), cache.evictions)
        entries.add_metric((name,), len(cache))
        capacity.add_metric((name,), cache.capacity)
    yield from (evictions, entries, capacity)


def _exposed_name(family: Metric) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


def _spool_families(spool: SpoolGauges) -> Iterator[Metric]:
    """The spool's depth, size, oldest age, whether it is full or its disk is, and
    the drained total (its rate is the drain rate)."""
    yield GaugeMetricFamily("gateway_spool_depth", "Messages in the on-disk spool.", spool.depth)
    yield GaugeMetricFamily(
        "gateway_spool_bytes", "Payload bytes in the on-disk spool.", spool.bytes
    )
    yield GaugeMetricFamily(
        "gateway_spool_oldest_age_seconds", "Age of the oldest spooled message.", spool.oldest_age()
    )
    yield GaugeMetricFamily(
        "gateway_spool_full",
        "1 while the spool is at spool.max_records or spool.max_bytes: nothing more is "
        "acknowledged, the broker holds the rest.",
        1 if spool.full else 0,
    )
    yield GaugeMetricFamily(
        "gateway_spool_disk_full",
        "1 while spool writes fail because the disk is full: nothing more is acknowledged "
        "until there is room.",
        0 if spool.disk_full_since is None else 1,
    )
    yield CounterMetricFamily(
        "gateway_spool_drained_total",
        "Spooled messages written to Cassandra and removed (its rate is the drain rate).",
        spool.deleted,
    )


# Seconds to answer an HTTP request: a cached answer takes under a
# millisecond, a read of Cassandra milliseconds, one that waits for a hung
# Cassandra up to its 10 s request timeout. The write latency's buckets
# (1 ms to 60 s) cover them.
HTTP_SECONDS_BUCKETS = WRITE_LATENCY_BUCKETS


class HttpStats:
    """The HTTP side's counts, kept by ``build_app``'s middleware on the event
    loop and read by :class:`HttpCollector` at each scrape. Labelled by route
    (the path template a request matched, ``unmatched`` for none: as many as
    the application has routes) and status (an HTTP code, or ``cancelled``
    for a request cut short), so the series are bounded by the routes."""

    __slots__ = ("answered", "busy", "seconds", "under_way")

    def __init__(self) -> None:
        self.answered: dict[tuple[str, str], int] = {}  # (route, status) -> requests
        self.seconds: dict[str, StatsHistogram] = {}  # route -> time to answer
        self.under_way = 0
        self.busy = 0  # API requests refused at the cap of requests handled at once

    def observe(self, route: str, status: str, seconds: float) -> None:
        key = (route, status)
        self.answered[key] = self.answered.get(key, 0) + 1
        histogram = self.seconds.get(route)
        if histogram is None:
            histogram = self.seconds[route] = StatsHistogram(HTTP_SECONDS_BUCKETS)
        histogram.observe(seconds)


class HttpCollector(Collector):
    """The families of :class:`HttpStats`, for ``gateway run`` and ``gateway serve``."""

    def __init__(self, http: HttpStats) -> None:
        self.http = http

    def collect(self) -> Iterator[Metric]:
        http = self.http
        answered = CounterMetricFamily(
            "gateway_http_requests_total",
            "HTTP requests answered, by route (the path template matched; unmatched for "
            "none) and status (cancelled: cut short, by the client or a stop).",
            labels=("route", "status"),
        )
        for (route, status), count in sorted(http.answered.items()):
            answered.add_metric((route, status), count)
        yield answered
        seconds = HistogramMetricFamily(
            "gateway_http_request_duration_seconds",
            "Time to answer an HTTP request, by route.",
            labels=("route",),
        )
        for route, histogram in sorted(http.seconds.items()):
            seconds.add_metric((route,), _buckets(histogram), histogram.sum)
        yield seconds
        yield GaugeMetricFamily(
            "gateway_http_requests_in_progress",
            "HTTP requests being handled now.",
            value=http.under_way,
        )
        yield CounterMetricFamily(
            "gateway_http_busy_refusals_total",
            "Read API requests refused with 503 busy: the cap of requests handled at once "
            "(32 by default, half of it for one token) was reached; refused, not queued.",
            value=http.busy,
        )


class CachesCollector(Collector):
    """``gateway_cache_*`` for a process with no :class:`Stats` (``gateway
    serve``: the read API's answers)."""

    def __init__(self, caches: Mapping[str, Cache]) -> None:
        self.caches = caches

    def collect(self) -> Iterator[Metric]:
        yield from _cache_families(self.caches)


def gateway_registry(
    stats: Stats,
    *,
    noisy: Callable[[], list[NoisyRate]] | None = None,
    spool: SpoolGauges | None = None,
    max_series: int = DEFAULT_MAX_SERIES,
) -> CollectorRegistry:
    """A private registry holding the gateway's collector (not prometheus_client's
    global one), and prometheus_client's standard ``process_*`` (CPU, memory,
    file descriptors) and ``python_gc_*`` (the cyclic collector's passes by
    generation, and what they found) families, read at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(stats, noisy=noisy, spool=spool, max_series=max_series))
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
