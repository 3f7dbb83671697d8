"""Adaptive sampling and tenant quotas: which events are written in full.

For every decoded event :meth:`Sampler.decide` returns a :class:`Verdict`:
whether to write its raw-telemetry row (``keep_raw``), whether to update the
device's latest-event tables (``update_latest``), and why (``reason``). It is
pure logic: no I/O. Time is the message's receive time (wall clock, seconds)
when the caller gives it, so a backlog drained from the spool is judged at
the rate it arrived, not the rate it is drained; else the injected clock.

How it decides:

* Each device's message rate is estimated continuously with an exponentially
  decayed counter (``half_life``). A device whose estimate goes above
  ``noisy_above`` and stays above it for ``noisy_for`` (both per tenant, or
  per topic pattern) becomes *noisy*; its raw
  telemetry is then thinned to ``target_rate``: an event is kept when it is the
  first one in a new slot of ``1/target_rate`` seconds counted from the moment
  the device became noisy. Kept events are therefore spread evenly over time,
  at most ``target_rate`` per second, and never bunched at the start of a second.
* A noisy device returns to full resolution only after its estimate has stayed
  under ``quiet_below`` for ``quiet_for`` seconds (hysteresis).
* A tenant with ``max_rate`` has a token bucket (``max_rate``, ``burst``); when
  it is empty the tenant's ordinary events are dropped (reason ``tenant_rate``).
  With ``max_devices_per_tenant`` the device quota is held in Cassandra
  (store/quota.py): the events of a device this process has not seen
  settled are left ``QUOTA_PENDING`` (not tracked) and the write loop
  settles them there (:meth:`Sampler.settled`), then decides those admitted;
  a device seen refused is refused from memory (``QUOTA_REFUSED``) for
  QUOTA_RECHECK, one seen admitted admitted from memory for QUOTA_REMEMBER.
  Devices already admitted keep working, across restarts and instances.
* With ``latest_interval`` above 0 (it is 0 by default: off), latest-table
  updates of noisy devices, and of events dropped by the tenant rate, are
  coalesced to one per ``latest_interval`` seconds per device; always-kept
  events (below) update them at once.

Promises:

* Never sampled out (neither by device sampling nor by the tenant rate): the
  first event of a device the sampler does not know, an event newer (by event
  time) than the device's newest state-bearing event whose state differs from
  that event's, the first event
  after a device becomes noisy or quiet again, and an event that an
  ``important`` rule marks (a metric beyond a threshold, or back from beyond
  it). These always have ``update_latest=True``. Only the device quota can
  refuse them. Events the caller keeps without asking (back-fill) pass the
  device quota alone (:meth:`Sampler.admission`, settled like the pending
  ones) and are shown to :meth:`Sampler.observe`, so a state they bring is
  what the next event is compared with.
* With ``enabled = false`` device sampling is off and every event is kept;
  tenant quotas (rate and device count) still apply.
* Bounded memory: at most ``max_devices`` devices are tracked (LRU; evictions
  are counted). A forgotten device is simply new again: the cost of
  forgetting is more kept events, never fewer (a noisy one is stored whole
  until it is noisy again, ``noisy_for`` later). Tenants without a section
  of their own are tracked in an LRU of ``max_tenants``; tenants with a section are always
  tracked. The per-tenant set of admitted devices exists only for tenants with
  a device quota and never holds more than twice the quota; refused devices are
  remembered in an LRU of MAX_REFUSED (one forgotten is asked of Cassandra
  again).
* Receive times that go back (a clock stepped back; a backlog received
  before a restart) are taken as no time passing: neither a noisy device's
  slots nor a tenant's token bucket wait for the clock to catch up.
* ``decide`` is O(1) amortized (O(number of important rules) per event, and a
  topic-pattern lookup only when a device first appears or changes topic).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..config import SamplingConfig, TenantSampling
from ..lru import LRU
from ..stats import Cache
from ..topic_filters import filter_levels, topic_matches

REASONS = (
    "normal",  # full resolution: the device is not noisy and its tenant within its rate
    "state_change",  # the state differs from the previous one (or the device is new)
    "transition",  # first event after the device became noisy, or quiet again
    "important",  # an important rule matched
    "sampled",  # the device is noisy; keep_raw says whether this is one of the kept samples
    "tenant_rate",  # the tenant is over max_rate: dropped
    "quota_pending",  # a device this process has not seen settled: kept whole
    # until its tenant's quota, held in Cassandra, settles it (store/quota.py)
    "quota",  # a device the quota refused within QUOTA_RECHECK: rejected
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to write for one event. ``reason`` is one of REASONS."""

    keep_raw: bool
    update_latest: bool
    reason: str


@dataclass(frozen=True, slots=True)
class NoisyDevice:
    tenant: str
    device_id: str
    observed_rate: float  # msg/s, the estimate now
    kept_rate: float  # msg/s of kept raw events, same estimator
    since: float  # clock time (wall clock by default) it became noisy
    sampled_out: int  # events not kept since it became noisy


# Verdicts are immutable and few: build each once instead of once per event.
_NORMAL = Verdict(True, True, "normal")
_STATE_CHANGE = Verdict(True, True, "state_change")
_TRANSITION = Verdict(True, True, "transition")
# A payload's top-level numeric value, as a metric's name (store/rollups.py's
# VALUE_METRIC; the roll-ups and metadata call it so too).
VALUE = "value"
_IMPORTANT = Verdict(True, True, "important")
QUOTA_PENDING = Verdict(True, True, "quota_pending")
QUOTA_REFUSED = Verdict(False, False, "quota")
# Seconds a device the quota refused stays refused from memory (and a tenant
# found at its quota is taken to stay there: store/quota.py); then its quota
# is asked again, so that slots given back are taken.
QUOTA_RECHECK = 60.0
# Seconds a device seen admitted is admitted from memory; then its quota is
# asked again, so that a device released (`gateway quota --release`) while
# it still sends takes a slot again, or is refused when there is none.
QUOTA_REMEMBER = 600.0
# Devices remembered as refused (LRU): a forgotten one costs one read again.
MAX_REFUSED = 10_000
# Indexed by keep_raw * 2 + update_latest.
_SAMPLED = (
    Verdict(False, False, "sampled"),
    Verdict(False, True, "sampled"),
    Verdict(True, False, "sampled"),
    Verdict(True, True, "sampled"),
)
# Indexed by update_latest.
_TENANT_RATE = (Verdict(False, False, "tenant_rate"), Verdict(False, True, "tenant_rate"))


@dataclass(frozen=True, slots=True)
class _TenantParams:
    noisy_above: float
    noisy_for: float
    target_rate: float
    max_rate: float | None
    burst: float
    max_devices: int | None


class _Tenant:
    __slots__ = (
        "burst",
        "kept",
        "known",
        "max_devices",
        "max_rate",
        "noisy",
        "params",
        "quota_rejected",
        "refilled",
        "sampled_out",
        "tenant_rate_sampled",
        "tokens",
    )

    def __init__(self, params: _TenantParams, now: float) -> None:
        self.params = params
        self.max_rate = params.max_rate
        self.burst = params.burst
        self.tokens = params.burst
        self.refilled = now
        self.max_devices = params.max_devices
        # Devices this process has seen admitted, only with a device quota,
        # each with when (the sampler's clock), in that order: at most twice
        # the quota (releases and a lowered quota can leave more admitted
        # than it), the one seen longest ago going first, asked of Cassandra
        # again when it sends. The quota itself is in Cassandra (store/quota.py).
        self.known: dict[str, float] | None = {} if params.max_devices is not None else None
        # This tenant's noisy devices, so noisy() needn't scan every device.
        self.noisy: dict[str, _Device] = {}
        self.kept = 0
        self.sampled_out = 0
        self.quota_rejected = 0
        self.tenant_rate_sampled = 0


class _Device:
    __slots__ = (
        "acc",
        "beyond",
        "kept_acc",
        "kept_at",
        "last",
        "latest_at",
        "loud_since",
        "newest_ts",
        "noisy",
        "noisy_above",
        "noisy_for",
        "quiet_since",
        "sampled_out",
        "since",
        "state",
        "state_ts",
        "target",
        "topic",
    )

    def __init__(
        self, topic: str, noisy_above: float, noisy_for: float, target: float, now: float
    ) -> None:
        self.topic = topic
        self.noisy_above = noisy_above
        self.noisy_for = noisy_for
        self.target = target
        # Decayed event counter scaled to msg/s: acc(t) = λ Σ exp(-λ (t - t_i)).
        # Its time average is exactly the rate; it only decays between events.
        self.acc = 0.0
        self.kept_acc = 0.0
        self.last = now
        self.latest_at = -math.inf
        self.loud_since: float | None = None  # estimate over noisy_above since (not yet noisy)
        self.state: str | None = None  # that of the newest state-bearing event
        self.state_ts = -1  # its write timestamp
        self.newest_ts = -1  # the newest event's write timestamp
        self.noisy = False
        self.since = 0.0
        self.quiet_since: float | None = None
        self.kept_at = 0.0  # when its last slot was kept (or it became noisy)
        self.sampled_out = 0
        self.beyond = 0  # bit i: rule i's metric was beyond its threshold last time


class _AdmittedSets:
    """Every tenant's admitted-device set (``_Tenant.known``), as one cache
    for the metrics: its entries, its bound (twice each quota) and the
    devices forgotten at that bound (each asked of Cassandra again when it
    next sends)."""

    def __init__(self, tenants: Callable[[], list[_Tenant]]) -> None:
        self._tenants = tenants
        self.evictions = 0

    @property
    def capacity(self) -> int:
        return sum(2 * t.max_devices for t in self._tenants() if t.max_devices is not None)

    def __len__(self) -> int:
        return sum(len(t.known) for t in self._tenants() if t.known is not None)


class Sampler:
    """Decides, per event, what is written. Not thread-safe; one per pipeline."""

    def __init__(self, config: SamplingConfig, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._enabled = config.enabled
        self._lam = math.log(2) / config.half_life
        self._half_lam = self._lam / 2
        self._quiet_below = config.quiet_below
        self._quiet_for = config.quiet_for
        self._latest_interval = config.latest_interval
        self._rules = tuple(
            (
                rule.metric,
                math.inf if rule.above is None else rule.above,
                -math.inf if rule.below is None else rule.below,
                1 << i,
            )
            for i, rule in enumerate(config.important)
        )
        self._overrides = tuple(
            (filter_levels(o.topic_filter), o.noisy_above, o.noisy_for, o.target_rate)
            for o in config.overrides
        )
        sections = {
            name: self._params(section)
            for name, section in config.tenants.items()
            if name != "default"
        }
        default = config.tenants.get("default")
        self._default_params = self._params(default or TenantSampling())
        now = clock()
        # Tenants with a section of their own are few and configured: never evicted.
        self._pinned = {name: _Tenant(params, now) for name, params in sections.items()}
        self._tenants: LRU[str, _Tenant] = LRU(config.max_tenants)
        self._devices: LRU[tuple[str, str], _Device] = LRU(config.max_devices)
        # Devices the quota refused, and when (settled): rejected from memory
        # for QUOTA_RECHECK, not asked of Cassandra again meanwhile.
        self._refused: LRU[tuple[str, str], float] = LRU(MAX_REFUSED)
        self._admitted = _AdmittedSets(self._all_tenants)

    def _all_tenants(self) -> list[_Tenant]:
        return [*self._pinned.values(), *(ten for _, ten in self._tenants.items())]

    def caches(self) -> dict[str, Cache]:
        """Its bounded caches, by name, for the metrics (gateway_cache_*)."""
        return {
            "sampler_devices": self._devices,
            "sampler_tenants": self._tenants,
            "sampler_quota_refused": self._refused,
            "sampler_quota_admitted": self._admitted,
        }

    def _params(self, section: TenantSampling) -> _TenantParams:
        c = self._config
        max_rate = section.max_rate
        burst = section.burst
        if burst is None:
            burst = max(1.0, max_rate) if max_rate is not None else 1.0
        return _TenantParams(
            noisy_above=section.noisy_above if section.noisy_above is not None else c.noisy_above,
            noisy_for=section.noisy_for if section.noisy_for is not None else c.noisy_for,
            target_rate=section.target_rate if section.target_rate is not None else c.target_rate,
            max_rate=max_rate,
            burst=burst,
            max_devices=section.max_devices_per_tenant,
        )

    @property
    def tracked_devices(self) -> int:
        return len(self._devices)

    def _tenant(self, name: str, now: float) -> _Tenant:
        ten = self._pinned.get(name)
        if ten is not None:
            return ten
        ten = self._tenants.get(name)
        if ten is not None:
            return ten
        ten = _Tenant(self._default_params, now)
        # At the bound (more than max_tenants unconfigured tenants active) the
        # least recent one goes, with its counters and admitted-device set: if
        # it comes back, its devices' quota is settled in Cassandra again.
        self._tenants.put(name, ten)
        return ten

    def _resolve(self, dev: _Device, params: _TenantParams, topic: str) -> None:
        noisy_above, noisy_for = params.noisy_above, params.noisy_for
        target = params.target_rate
        for levels, o_noisy, o_for, o_target in self._overrides:
            if topic_matches(levels, topic):
                if o_noisy is not None:
                    noisy_above = o_noisy
                if o_for is not None:
                    noisy_for = o_for
                if o_target is not None:
                    target = o_target
                break
        dev.topic, dev.target = topic, target
        dev.noisy_above, dev.noisy_for = noisy_above, noisy_for

    def decide(
        self,
        tenant: str,
        device_id: str,
        topic: str,
        state: str | None,
        metrics: Mapping[str, float],
        ts: int | None = None,
        now: float | None = None,
        value: float | None = None,
    ) -> Verdict:
        """The verdict for one event of ``device_id``, published on ``topic``.

        ``ts`` orders the device's events (the event's write timestamp): an
        event older than the device's newest is late, cannot change the latest
        tables, and is never taken for a state change (None: events in arrival
        order). ``now`` is when the
        message arrived (seconds); the clock's time when None. ``value`` is
        the event's numeric ``value``: a rule on metric "value" reads it when
        ``metrics`` has none of that name, as roll-ups do (a rule on it was
        accepted, and never matched a device that sends only ``value``).
        """
        if now is None:
            now = self._clock()
        ten = self._tenant(tenant, now)
        key = (tenant, device_id)
        if ten.known is not None and not self._remembered(ten.known, device_id):
            # Not tracked until the quota admits it: a flood of new ids
            # costs neither memory nor other devices' state.
            verdict = self._unknown(key)
            if verdict is QUOTA_REFUSED:
                ten.quota_rejected += 1
            return verdict
        devices = self._devices
        dev = devices.get(key)
        if dev is None:
            dev = _Device(topic, 0.0, 0.0, 0.0, now)
            self._resolve(dev, ten.params, topic)
            evicted = devices.put(key, dev)
            if evicted is not None:
                self._forget(*evicted)
            changed = True
            late = False
            dt = 0.0
            if ts is None:
                ts = 0
        else:
            if topic != dev.topic:
                self._resolve(dev, ten.params, topic)
            if ts is None:
                ts = dev.newest_ts + 1
            late = ts < dev.newest_ts
            # Against the newest state-bearing event, by event time. A late event
            # in another state is a real transition seen out of order: its raw
            # row is kept (its latest-table writes are skipped as stale).
            # The same timestamp in another state is a change too (which of the
            # two the latest tables show is their tie-break's business).
            changed = state is not None and state != dev.state
            if now < dev.last:
                # A clock stepped back (receive times are wall-clock times): the
                # device's own times step back with it, as if no time had passed.
                _shift(dev, now - dev.last)
            dt = now - dev.last

        lam = self._lam
        prev_acc = dev.acc
        decay = math.exp(-lam * dt)
        before = prev_acc * decay
        dev.acc = before + lam
        # The estimate at an event instant: midway through the jump the event
        # causes, so a steady rate r reads as r, not r + λ/2.
        est = before + self._half_lam
        last = dev.last
        dev.last = now
        if not late:
            dev.newest_ts = ts
        if state is not None and ts >= dev.state_ts:
            dev.state = state
            dev.state_ts = ts

        transition = False
        if self._enabled:
            if dev.noisy:
                q = self._quiet_below
                if est < q:
                    quiet_since = dev.quiet_since
                    if quiet_since is None:
                        # Between events the estimate only decays, so the moment
                        # it fell under quiet_below is known exactly: a device
                        # that simply went silent has been quiet since then.
                        quiet_since = last
                        if prev_acc > q:
                            quiet_since = min(now, last + math.log(prev_acc / q) / lam)
                        dev.quiet_since = quiet_since
                    if now - quiet_since >= self._quiet_for:
                        dev.noisy = False
                        dev.quiet_since = None
                        transition = True
                        ten.noisy.pop(device_id, None)
                else:
                    dev.quiet_since = None
                if dev.noisy:
                    # Re-registered each time: the tenant's entry may have been
                    # evicted and recreated since the device became noisy.
                    ten.noisy[device_id] = dev
            elif est > dev.noisy_above:
                if dev.loud_since is None:
                    dev.loud_since = now
                if now - dev.loud_since >= dev.noisy_for:
                    dev.loud_since = None
                    dev.noisy = True
                    dev.since = dev.kept_at = now
                    dev.sampled_out = 0
                    dev.quiet_since = None
                    transition = True
                    ten.noisy[device_id] = dev
            else:
                dev.loud_since = None

        important = False
        rules = self._rules
        if rules:
            old = dev.beyond
            new = 0
            for metric, above, below, bit in rules:
                reading = metrics.get(metric)
                if reading is None and metric == VALUE:
                    reading = value
                if reading is None:
                    new |= old & bit  # not reported: nothing crossed
                elif reading > above or reading < below:
                    new |= bit
                    important = True
                elif old & bit:
                    important = True  # back within bounds: the crossing is kept too
            if not late:
                # Only the newest event says where the device is now: a late
                # one within bounds cleared the mark, and the real return,
                # newer, was then sampled out as ordinary.
                dev.beyond = new

        if transition:
            verdict = _TRANSITION
        elif changed:
            verdict = _STATE_CHANGE
        elif important:
            verdict = _IMPORTANT
        else:
            verdict = self._ordinary(ten, dev, now)
            keep = verdict.keep_raw
            if verdict.update_latest and not late:
                # A late event's latest-table writes change nothing (they are
                # older): they don't count as the device's latest update.
                dev.latest_at = now
            if keep:
                ten.kept += 1
                dev.kept_acc = dev.kept_acc * decay + lam
            else:
                ten.sampled_out += 1
                dev.kept_acc *= decay
                if dev.noisy:
                    dev.sampled_out += 1
            return verdict

        # Always kept. It still takes a token when one is left, so that ordinary
        # telemetry yields to it under the tenant's rate.
        if ten.max_rate is not None:
            self._take_token(ten, now)
        if not late:
            dev.latest_at = now
        ten.kept += 1
        dev.kept_acc = dev.kept_acc * decay + lam
        return verdict

    def admission(self, tenant: str, device_id: str, now: float | None = None) -> Verdict | None:
        """The device quota alone (for back-fill, which skips :meth:`decide`):
        None when the device may be written (its tenant has no quota, or
        this process saw it admitted), ``QUOTA_REFUSED`` when this process
        saw it refused within QUOTA_RECHECK, else ``QUOTA_PENDING``."""
        now = self._clock() if now is None else now
        known = self._tenant(tenant, now).known
        if known is None or self._remembered(known, device_id):
            return None
        return self._unknown((tenant, device_id))

    def _remembered(self, known: dict[str, float], device_id: str) -> bool:
        """Seen admitted within QUOTA_REMEMBER (by the sampler's clock)."""
        at = known.get(device_id)
        return at is not None and self._clock() - at < QUOTA_REMEMBER

    def _unknown(self, key: tuple[str, str]) -> Verdict:
        # By the sampler's clock, as settled() stamps it, not a receive time:
        # a backlog drained from the spool is judged on when it is written.
        refused_at = self._refused.peek(key)
        if refused_at is not None and self._clock() - refused_at < QUOTA_RECHECK:
            return QUOTA_REFUSED
        return QUOTA_PENDING

    def count_refused(self, tenant: str) -> None:
        """An event rejected for the quota without :meth:`decide` saying so
        (settled in the write loop, or back-fill)."""
        self._tenant(tenant, self._clock()).quota_rejected += 1

    def quota(self, tenant: str) -> int | None:
        """The tenant's ``max_devices_per_tenant``, or None."""
        return self._tenant(tenant, self._clock()).max_devices

    def settled(self, tenant: str, device_id: str, admitted: bool) -> None:
        """The quota's verdict on a device left ``QUOTA_PENDING``: an admitted
        device is remembered for QUOTA_REMEMBER (its events then go through
        :meth:`decide`), a refused one for QUOTA_RECHECK."""
        now = self._clock()
        ten = self._tenant(tenant, now)
        if not admitted:
            self._refused.put((tenant, device_id), now)
            return
        self._refused.pop((tenant, device_id))
        known, cap = ten.known, ten.max_devices
        if known is None or cap is None:
            return
        known.pop(device_id, None)  # to the end: the one seen longest ago goes first
        known[device_id] = now
        if len(known) > 2 * cap:
            del known[next(iter(known))]
            self._admitted.evictions += 1

    def observe(self, tenant: str, device_id: str, state: str | None, ts: int) -> None:
        """Note an event that is kept without :meth:`decide` (back-fill).

        It can still be the device's newest state-bearing event, and the next
        event must be compared with it, or the change back from it is taken
        for no change and sampled out. It is not an arrival the rate should
        count, nor a decision the counters should, so nothing else changes.
        A device the sampler does not track stays untracked: its next event is
        kept as new anyway, and after a restart or an eviction an old event
        may predate states the sampler never saw.
        """
        dev = self._devices.peek((tenant, device_id))
        if dev is None:
            return
        dev.newest_ts = max(dev.newest_ts, ts)
        # Only over a state the sampler knows: with none, the next state-bearing
        # event is a change anyway, and this one may be older than a state
        # received before the device was tracked (a restart, an eviction).
        if state is not None and dev.state is not None and ts >= dev.state_ts:
            dev.state = state
            dev.state_ts = ts

    def _take_token(self, ten: _Tenant, now: float) -> bool:
        """Refill, then take a token if there is one; False if the bucket is empty."""
        assert ten.max_rate is not None
        # Never a negative refill: receive times older than the last (a backlog
        # from before a restart, a clock stepped back) start the count afresh.
        tokens = ten.tokens + max(now - ten.refilled, 0.0) * ten.max_rate
        ten.refilled = now
        tokens = min(tokens, ten.burst)
        if tokens >= 1.0:
            ten.tokens = tokens - 1.0
            return True
        ten.tokens = tokens
        return False

    def _ordinary(self, ten: _Tenant, dev: _Device, now: float) -> Verdict:
        # An event with no reason of its own to be kept.
        if dev.noisy:
            # Keep the first event of each 1/target slot since the device became
            # noisy: evenly spread, at most target per second, whatever the rate.
            # The last kept event's slot is counted at the device's target now,
            # not remembered: a topic whose target differs (one device, two
            # topic templates) neither starves it nor lets it burst.
            since, target = dev.since, dev.target
            keep = int((now - since) * target) > int((dev.kept_at - since) * target)
            if keep:
                dev.kept_at = now
            if keep and ten.max_rate is not None and not self._take_token(ten, now):
                ten.tenant_rate_sampled += 1
                return _TENANT_RATE[self._latest_due(dev, now)]
            return _SAMPLED[keep * 2 + self._latest_due(dev, now)]
        if ten.max_rate is not None and not self._take_token(ten, now):
            ten.tenant_rate_sampled += 1
            return _TENANT_RATE[self._latest_due(dev, now)]
        return _NORMAL

    def _latest_due(self, dev: _Device, now: float) -> bool:
        return now - dev.latest_at >= self._latest_interval

    @property
    def evicted_devices(self) -> int:
        return self._devices.evictions

    @property
    def evicted_tenants(self) -> int:
        return self._tenants.evictions

    def _forget(self, key: tuple[str, str], dev: _Device) -> None:
        # An evicted device leaves its tenant's noisy list too.
        tenant, device_id = key
        if dev.noisy:
            ten = self._pinned.get(tenant) or self._tenants.peek(tenant)
            if ten is not None:
                ten.noisy.pop(device_id, None)

    def _still_noisy(self, dev: _Device, now: float) -> bool:
        # A noisy device that went silent is not re-evaluated until its next
        # event; report what that event would find. The event reads the
        # estimate with half its own jump (decide's ``est``), so it is still
        # loud until the decayed estimate is that much under quiet_below.
        q = self._quiet_below
        acc = dev.acc * math.exp(-self._lam * max(0.0, now - dev.last))
        if acc + self._half_lam >= q:
            return True
        quiet_since = dev.quiet_since
        if quiet_since is None:
            quiet_since = dev.last
            if dev.acc > q:
                quiet_since += math.log(dev.acc / q) / self._lam
        return now - quiet_since < self._quiet_for

    def rate(self, tenant: str, device_id: str) -> float:
        """The device's estimated message rate now (0.0 if not tracked)."""
        dev = self._devices.peek((tenant, device_id))
        if dev is None:
            return 0.0
        return dev.acc * math.exp(-self._lam * max(0.0, self._clock() - dev.last))

    def noisy(self, tenant: str) -> list[NoisyDevice]:
        """The tenant's noisy devices, noisiest first."""
        ten = self._pinned.get(tenant) or self._tenants.peek(tenant)
        if ten is None:
            return []
        now = self._clock()
        lam = self._lam
        found = []
        for device_id, dev in ten.noisy.items():
            if not self._still_noisy(dev, now):
                continue
            decay = math.exp(-lam * max(0.0, now - dev.last))
            found.append(
                NoisyDevice(
                    tenant=tenant,
                    device_id=device_id,
                    observed_rate=dev.acc * decay,
                    kept_rate=dev.kept_acc * decay,
                    since=dev.since,
                    sampled_out=dev.sampled_out,
                )
            )
        found.sort(key=lambda d: d.observed_rate, reverse=True)
        return found

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        """Per tracked tenant. Every decided event is counted exactly once:
        decided = kept + sampled_out + quota_rejected; tenant_rate_sampled is
        the part of sampled_out dropped by the tenant's rate. An event left
        ``QUOTA_PENDING`` counts once settled: refused, as a quota rejection;
        admitted, by its :meth:`decide` then. quota_rejected also counts
        back-filled events refused, which :meth:`decide` never sees."""
        out: dict[str, dict[str, int]] = {}
        for name, ten in (*self._pinned.items(), *self._tenants.items()):
            out[name] = {
                "kept": ten.kept,
                "sampled_out": ten.sampled_out,
                "quota_rejected": ten.quota_rejected,
                "tenant_rate_sampled": ten.tenant_rate_sampled,
            }
        return out


def _shift(dev: _Device, delta: float) -> None:
    """Move a device's remembered times by ``delta`` seconds (a clock step)."""
    dev.last += delta
    dev.since += delta
    dev.kept_at += delta
    dev.latest_at += delta  # -inf stays -inf
    if dev.loud_since is not None:
        dev.loud_since += delta
    if dev.quiet_since is not None:
        dev.quiet_since += delta
