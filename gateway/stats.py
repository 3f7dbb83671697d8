"""Counters shared by the pipeline stages, and the one-line status.

Plain numbers updated on the event loop (no locks needed). Everything that is
dropped, retried, rejected or throttled has a counter here, so no decision of
the gateway is invisible. This is a leaf: the stages write here, and the HTTP
side (``gateway/web/metrics.py``) reads it at every scrape; the write path
never imports the HTTP side.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .histogram import Histogram

# Distinct label values kept per labelled count (tenants, say); later ones are
# added under OTHER, and how many were folded is counted.
MAX_LABELS = 10_000
OTHER = "_other"

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


class Cache(Protocol):
    """What the metrics read of a bounded cache: ``lru.LRU``, or a view of
    several bounded collections counted as one."""

    @property
    def evictions(self) -> int: ...  # entries forgotten at the bound, ever

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...


class LabelledCounts:
    """Counts by one label value, with at most ``cap`` distinct values."""

    __slots__ = ("cap", "counts", "folded")

    def __init__(self, cap: int = MAX_LABELS) -> None:
        self.cap = cap
        self.counts: dict[str, int] = {}
        self.folded = 0  # additions whose label went to OTHER at the cap

    def add(self, label: str, amount: int = 1) -> None:
        counts = self.counts
        if label not in counts and len(counts) >= self.cap:
            self.folded += amount
            label = OTHER
        counts[label] = counts.get(label, 0) + amount


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    # The caches of the stages, by name (gateway_cache_* metrics), registered
    # as the gateway opens (app.py). Opened again (after spooling through an
    # outage at start), its new caches replace the old: a counter reset.
    caches: dict[str, Cache] = field(default_factory=dict)
    received: int = 0  # messages the broker handed us
    written: int = 0  # events stored (raw row and latest tables), every write acknowledged
    rejected: int = 0  # messages recorded in rejected_messages
    rejected_by_reason: Counter[str] = field(default_factory=Counter)
    acked: int = 0  # PUBACKs sent to the broker
    acks_dropped: int = 0  # finished after their connection closed: the broker redelivers
    no_ts: int = 0  # events that took the receive time as ts
    chunks: int = 0  # groups of messages the writer took off the queue at once
    lingers: int = 0  # chunks the writer waited pipeline.linger for, to gather more
    requests: int = 0  # Cassandra requests sent (a batch is one)
    rows: int = 0  # statements in those requests
    retries: int = 0  # Cassandra requests retried after a transient error
    in_flight: int = 0  # Cassandra requests not yet answered
    in_flight_limit: int = 0  # how many may be (store/limit.py adapts it to the latency)
    in_flight_waits: int = 0  # requests that waited for the in-flight limit
    # C++ driver sessions replaced after requests found no host for a while
    # (cassandra.renew_after, store/write_session.py)
    cassandra_sessions_renewed: int = 0
    latency_floor: float = 0.0  # seconds: lowest recent Cassandra request latency (0: none yet)
    queue_depth: int = 0
    connects: int = 0  # successful MQTT connections
    disconnects: int = 0
    malformed_packets: int = 0  # connections we closed on a malformed packet from the broker
    sessions_lost: int = 0  # reconnects where the broker no longer had our session
    subscriptions_refused: int = 0  # topic filters the broker refused in a SUBACK
    subscriptions_qos0: int = 0  # topic filters granted QoS 0 only (at most once)
    # messages that match none of our filters: an earlier config's subscription
    # left in the broker session (pipeline.Classifier)
    stale_subscription: int = 0
    states_registered: int = 0
    sampled_out: int = 0  # events whose raw row sampling left out (acknowledged, counted)
    quota_rejected: int = 0  # messages of new devices over a tenant's device quota
    quota_reads: int = 0  # devices looked up in quota_devices (store/quota.py)
    quota_reservations: int = 0  # compare-and-sets of a tenant's admitted-device count
    # events whose latest-table writes a newer event made moot: in the chunk, or
    # queued behind it and sure to write them (ingest/pipeline.py)
    coalesced: int = 0
    hot_partitions: int = 0  # partitions over the hot threshold, once per window
    untracked_writes: int = 0  # writes to partitions beyond hot_partitions.max_tracked
    newest_reads: int = 0  # reads of a device's newest write (once per device per start-up)
    newest_read_ahead: int = 0  # of those, read when the event was queued (read-ahead)
    newest_read_ahead_skipped: int = 0  # not read ahead: pipeline.queue_size devices waiting
    deletes_saved: int = 0  # same-state events that needed no deletes (their last write's cover)
    missed_deletes: int = 0  # deletes a state learnt from another instance missed, sent late
    tie_breaks: int = 0  # two events of a device with one write timestamp: the larger id won
    rotations: int = 0  # state partitions copied into a fresh generation (store/rotate.py)
    rotation_rows: int = 0  # live rows those rotations copied
    rotation_failures: int = 0  # rotation steps that failed and will be retried
    generations_dropped: int = 0  # old generations deleted after a rotation
    stale_latest: int = 0  # events older than the device's newest write: latest writes skipped
    spool: Any = None  # the Spool in spool mode (depth, bytes, oldest_age())
    spool_full_waits: int = 0  # times the spool was full: acks and reads paused
    spool_disk_full: int = 0  # one-message appends and deletes refused for a full disk (retried)
    throttled_s: float = 0.0  # time with mqtt.receive_maximum messages unacknowledged
    throttle_events: int = 0  # times that limit was reached
    read_pauses: int = 0  # times the pipeline queue filled and socket reads paused
    overflow: int = 0  # messages read after a pause took effect (held, never dropped)
    rollup_marks: int = 0  # dirty-window marks written (store/rollups.py)
    rollup_mark_evictions: int = 0  # marks forgotten at rollups.mark_cache_size (rewritten if seen)
    metadata_cache_evictions: int = 0  # metadata entries forgotten at metadata.cache_size
    rollup_windows: int = 0  # 1-minute windows recomputed from their raw rows
    rollup_windows_kept: int = 0  # aggregates kept over a recompute from expired rows
    rollup_failures: int = 0  # roll-up worker passes that failed (retried; marks stay)
    rollup_retries: int = 0  # roll-up reads and writes tried again after a transient error
    rollup_lag_s: float = 0.0  # how far the roll-up worker is behind its due minutes
    rollup_paced_s: float = 0.0  # time the worker waited to spread a minute (rollups.spread)
    rollup_lease_held: int = 0  # 1 while this instance holds the roll-up worker's lease
    rollup_lease_taken: int = 0  # times this instance took the roll-up worker's lease
    rollup_lease_lost: int = 0  # times it lost it while working (another holder, no renewal)
    # Cassandra's clock minus this host's, as last measured (store/clock.py).
    clock_offset_s: float | None = None
    clock_steps: int = 0  # times this host's clock stepped (wall less monotonic moved)
    metadata_writes: int = 0  # new metadata entries written (store/metadata.py)
    metadata_capped: int = 0  # new entries not written: tenant at metadata.max_per_tenant
    metadata_reads: int = 0  # metadata entries not in the LRU, looked up in Cassandra
    metadata_reservations: int = 0  # compare-and-sets of a tenant's entry count (lost ones too)
    metadata_held: int = 0  # events held for the metadata worker (an entry not in the LRU)
    metadata_backlog_waits: int = 0  # times the write loop waited for the metadata worker
    # Seconds from the device's publish time to the Cassandra ack of its event.
    write_latency: Histogram = field(default_factory=lambda: Histogram(WRITE_LATENCY_BUCKETS))
    # How late the event loop woke from a LAG_PROBE sleep (app.py): its stalls,
    # which every message in flight waits out.
    loop_lag: Histogram = field(default_factory=lambda: Histogram(WRITE_LATENCY_BUCKETS))
    batch_rows: Histogram = field(default_factory=lambda: Histogram(BATCH_ROWS_BUCKETS))
    hot_by_table: LabelledCounts = field(default_factory=LabelledCounts)
    quota_by_tenant: LabelledCounts = field(default_factory=LabelledCounts)
    sampled_out_by_tenant: LabelledCounts = field(default_factory=LabelledCounts)
    metadata_capped_by_tenant: LabelledCounts = field(default_factory=LabelledCounts)
    _last: tuple[float, int, int] | None = None  # (time, received, written) at the last line

    def track_caches(self, caches: Mapping[str, Cache]) -> None:
        """Register a stage's caches (its ``caches()``) for the metrics."""
        self.caches.update(caches)

    def status_line(self) -> str:
        now = time.monotonic()
        t0, rx0, wr0 = self._last or (self.started, 0, 0)
        span = max(now - t0, 1e-9)
        self._last = (now, self.received, self.written)
        return (
            f"in={self.received} ({(self.received - rx0) / span:.0f}/s) "
            f"written={self.written} ({(self.written - wr0) / span:.0f}/s) "
            f"rejected={self.rejected} sampled_out={self.sampled_out} "
            f"queue={self.queue_depth} in_flight={self.in_flight}/{self.in_flight_limit} "
            f"retries={self.retries} acked={self.acked}"
            + (self._spool_status() if self.spool is not None else "")
        )

    def _spool_status(self) -> str:
        spool = self.spool
        paused = ""
        if spool.disk_full_since is not None:
            paused = "; DISK FULL, acks paused"
        elif spool.full:
            paused = "; FULL, acks paused"
        return f" spool={spool.depth} (oldest {spool.oldest_age():.0f}s{paused})"

    def summary(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.rejected_by_reason.items()))
        return (
            f"received={self.received} written={self.written} rejected={self.rejected}"
            f"{f' ({reasons})' if reasons else ''} acked={self.acked} "
            f"unacked_redelivered_later={self.acks_dropped} no_ts={self.no_ts} "
            f"chunks={self.chunks} lingers={self.lingers} requests={self.requests} "
            f"retries={self.retries} "
            f"connects={self.connects} sessions_lost={self.sessions_lost} "
            f"malformed_packets={self.malformed_packets} "
            f"sampled_out={self.sampled_out} quota_rejected={self.quota_rejected} "
            f"coalesced={self.coalesced} throttled={self.throttled_s:.1f}s "
            f"read_pauses={self.read_pauses} overflow={self.overflow} "
            + (
                f"spool_full={self.spool_full_waits} spool_disk_full={self.spool_disk_full} "
                # What stays for the next start (field-engineer probe: the
                # summary said received=531 written=0, and not where they were).
                f"spooled={self.spool.depth} "
                if self.spool is not None
                else ""
            )
            + f"uptime={time.monotonic() - self.started:.0f}s"
        )
