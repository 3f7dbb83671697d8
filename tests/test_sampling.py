"""Adaptive sampling and tenant quotas: pure unit tests with a fake clock. No services."""

from __future__ import annotations

import itertools
import math
import random
import tracemalloc
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config import SamplingConfig
from gateway.ingest.sampling import (
    QUOTA_PENDING,
    QUOTA_RECHECK,
    QUOTA_REFUSED,
    QUOTA_REMEMBER,
    REASONS,
    Sampler,
    Verdict,
)
from gateway.topic_filters import filter_levels, topic_matches

TENANT = "acme"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def _topic(tenant: str, device: str) -> str:
    return f"tenants/{tenant}/devices/{device}/events"


def _sampler(clock: FakeClock, **settings: Any) -> Sampler:
    return Sampler(SamplingConfig.model_validate(settings), clock)


def _ticks(start: float, rate: float, seconds: float) -> Iterator[float]:
    """Evenly spaced arrival times; integer steps so no float drift."""
    for i in range(round(rate * seconds)):
        yield start + i / rate


def _feed(
    sampler: Sampler,
    clock: FakeClock,
    rate: float,
    seconds: float,
    *,
    tenant: str = TENANT,
    device: str = "d1",
    state: str | None = "on",
    metrics: Mapping[str, float] | None = None,
) -> list[tuple[float, Verdict]]:
    """One device at a steady rate from the clock's current time; returns (time, verdict)."""
    out = []
    start = clock.now
    for t in _ticks(start, rate, seconds):
        clock.now = t
        out.append(
            (t, sampler.decide(tenant, device, _topic(tenant, device), state, metrics or {}))
        )
    clock.now = start + seconds
    return out


def _make_noisy(
    sampler: Sampler,
    clock: FakeClock,
    rate: float = 250.0,
    *,
    metrics: Mapping[str, float] | None = None,
    limit: float = 60.0,
) -> float:
    """Feed device d1 at ``rate`` until the sampler calls it noisy (after
    ``noisy_for`` like any device), and stop there, for the tests about what
    happens next; returns how long that took. The clock is left one message
    interval after the transition, as :func:`_feed` leaves it."""
    start = clock.now
    for t in _ticks(start, rate, limit):
        clock.now = t
        verdict = sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", metrics or {})
        if verdict.reason == "transition":
            clock.now = t + 1 / rate
            return t - start
    raise AssertionError(f"d1 was not noisy after {limit} s at {rate} msg/s")


def _kept(verdicts: list[tuple[float, Verdict]], reason: str | None = None) -> list[float]:
    return [t for t, v in verdicts if v.keep_raw and (reason is None or v.reason == reason)]


def _reasons(verdicts: list[tuple[float, Verdict]]) -> Counter[str]:
    return Counter(v.reason for _, v in verdicts)


# --- rate estimate and noisy detection ------------------------------------


@pytest.mark.parametrize("rate", [100.0, 3.0, 0.5])
def test_rate_estimate_converges(rate: float) -> None:
    clock = FakeClock()
    sampler = _sampler(clock)
    _feed(sampler, clock, rate, 60)  # 12 half-lives
    # Sampled at every event over the last ten seconds, the estimate stays within 10 %.
    for t in _ticks(clock.now, rate, 10):
        clock.now = t
        sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {})
        assert sampler.rate(TENANT, "d1") == pytest.approx(rate, rel=0.1, abs=0.15)


def test_rate_decays_while_silent_and_unknown_is_zero() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, half_life=5.0)
    _feed(sampler, clock, 100, 30)
    clock.now += 10  # two half-lives
    assert sampler.rate(TENANT, "d1") == pytest.approx(25, rel=0.1)
    assert sampler.rate(TENANT, "nobody") == 0.0


def test_device_over_noisy_above_becomes_noisy_once() -> None:
    clock = FakeClock()
    sampler = _sampler(clock)
    slow = _feed(sampler, clock, 4, 120, device="slow")
    assert _reasons(slow) == {"state_change": 1, "normal": len(slow) - 1}
    assert sampler.noisy(TENANT) == []

    fast = _feed(sampler, clock, 6, 120, device="fast")
    reasons = _reasons(fast)
    assert reasons["transition"] == 1
    assert reasons["sampled"] > 0
    (noisy,) = sampler.noisy(TENANT)
    assert noisy.device_id == "fast"
    assert noisy.tenant == TENANT
    became = next(t for t, v in fast if v.reason == "transition")
    assert noisy.since == became
    assert noisy.observed_rate == pytest.approx(6, rel=0.1)
    # A 6 msg/s device sampled to 1 msg/s.
    assert noisy.kept_rate == pytest.approx(1, rel=0.2)
    assert noisy.sampled_out == sum(1 for t, v in fast if t > became and not v.keep_raw)


def test_noisy_device_kept_about_target_spread_over_time() -> None:
    clock = FakeClock(1000.37)
    sampler = _sampler(clock)  # target_rate 1
    verdicts = _feed(sampler, clock, 250, 60)
    reasons = _reasons(verdicts)
    became = next(t for t, v in verdicts if v.reason == "transition")
    # The estimate passes noisy_above within half a second; noisy_for (10 s) later it is noisy.
    assert 10.0 <= became - 1000.37 < 10.5
    normal = reasons["normal"]  # before it was noisy
    sampled = _kept(verdicts, "sampled")
    assert 48 <= len(sampled) <= 50
    assert len(_kept(verdicts)) == len(sampled) + normal + 2  # + first event + transition
    # Evenly spread: one per second, never two together, never a long gap.
    gaps = [b - a for a, b in itertools.pairwise([became, *sampled])]
    assert all(0.95 <= gap <= 1.05 for gap in gaps), gaps
    assert 60 - sampled[-1] + 1000.37 < 1.5


def test_kept_events_are_spread_not_first_n_per_second() -> None:
    clock = FakeClock(500.0)
    sampler = _sampler(clock, target_rate=4.0)
    verdicts = _feed(sampler, clock, 250, 40)  # noisy after about 10 s
    sampled = _kept(verdicts, "sampled")
    assert 115 <= len(sampled) <= 120
    # "First 4 per second" would keep four back-to-back messages and then
    # nothing for almost a second; these are a quarter second apart.
    gaps = [b - a for a, b in itertools.pairwise(sampled)]
    assert min(gaps) >= 0.24
    assert max(gaps) <= 0.26


def test_target_just_under_rate_keeps_target_not_less() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, tenants={TENANT: {"target_rate": 5.0}})
    verdicts = _feed(sampler, clock, 6.25, 120)
    became = next(t for t, v in verdicts if v.reason == "transition")
    after = [(t, v) for t, v in verdicts if t > became + 1]
    kept_rate = len(_kept(after)) / (after[-1][0] - after[0][0])
    assert kept_rate == pytest.approx(5.0, rel=0.05)


# --- never sampled out ----------------------------------------------------


def test_first_event_of_a_device_is_a_state_change() -> None:
    sampler = _sampler(FakeClock())
    assert sampler.decide(TENANT, "a", "t", None, {}) == Verdict(True, True, "state_change")
    assert sampler.decide(TENANT, "a", "t", None, {}) == Verdict(True, True, "normal")
    assert sampler.decide(TENANT, "b", "t", "on", {}).reason == "state_change"


def test_state_changes_of_a_noisy_device_always_kept() -> None:
    clock = FakeClock()
    sampler = _sampler(clock)
    _make_noisy(sampler, clock)
    changes = 0
    state = "on"
    for i, t in enumerate(_ticks(clock.now, 250, 20)):
        clock.now = t
        if i % 37 == 0:
            state = "off" if state == "on" else "on"
            changes += 1
            expect_change = True
        else:
            expect_change = False
        verdict = sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), state, {})
        if expect_change:
            assert verdict == Verdict(True, True, "state_change")
        else:
            assert verdict.reason == "sampled"
    # A state-less event is not a change, and does not forget the state.
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), None, {}).reason == "sampled"
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), state, {}).reason == "sampled"
    assert changes > 100


def test_a_late_event_within_bounds_does_not_hide_the_return_from_beyond() -> None:
    """The rule's memory of "beyond" was overwritten by every event, a late
    one too: a late value within bounds cleared it, and the newer, real
    return within bounds was then sampled out as ordinary."""
    clock = FakeClock()
    sampler = _sampler(clock, important=[{"metric": "temperature", "above": 80.0}])
    _make_noisy(sampler, clock, metrics={"temperature": 20.0})
    base = 10**12

    def send(ts: int, temperature: float) -> str:
        clock.now += 0.004
        topic = _topic(TENANT, "d1")
        return sampler.decide(TENANT, "d1", topic, "on", {"temperature": temperature}, ts).reason

    assert send(base + 100, 90.0) == "important"
    assert send(base + 110, 91.0) == "important"
    send(base + 50, 20.0)  # late: from before the crossing
    assert send(base + 120, 20.0) == "important"  # the return within bounds
    assert send(base + 130, 20.0) == "sampled"


def test_an_important_rule_on_value_reads_the_events_value() -> None:
    """A payload's numeric ``value`` is not among its metrics: a rule on
    metric "value" was accepted and never matched."""
    clock = FakeClock()
    sampler = _sampler(clock, important=[{"metric": "value", "above": 80.0}])
    _make_noisy(sampler, clock)

    def send(top: float, metrics: dict[str, float] | None = None) -> str:
        clock.now += 0.004
        topic = _topic(TENANT, "d1")
        return sampler.decide(TENANT, "d1", topic, "on", metrics or {}, None, None, top).reason

    assert send(20.0) == "sampled"
    assert send(99.0) == "important"
    assert send(20.0) == "important"  # back within bounds
    assert send(99.0, {"value": 10.0}) == "sampled"  # a metric of that name comes first


def test_important_rules_keep_beyond_and_back() -> None:
    clock = FakeClock()
    rules = [{"metric": "temperature", "above": 80.0}, {"metric": "pressure", "below": 1.5}]
    sampler = _sampler(clock, important=rules)
    _make_noisy(sampler, clock, metrics={"temperature": 20.0, "pressure": 2.0})

    def send(**metrics: float) -> Verdict:
        clock.now += 0.004
        return sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", metrics)

    assert send(temperature=79.0).reason == "sampled"
    assert send(temperature=80.5) == Verdict(True, True, "important")
    assert send(temperature=90.0).reason == "important"  # still beyond
    assert send(pressure=2.0).reason == "sampled"  # temperature not reported: no crossing
    assert send(temperature=70.0).reason == "important"  # back within bounds
    assert send(temperature=70.0).reason == "sampled"
    assert send(pressure=1.2).reason == "important"
    assert send(pressure=1.7).reason == "important"
    assert send(pressure=1.7, temperature=80.0).reason == "sampled"  # "above" is strict


def test_transition_to_noisy_and_back_each_kept_once() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, half_life=1.0, quiet_for=10.0)
    noisy = _feed(sampler, clock, 250, 12)  # noisy after noisy_for (10 s)
    quiet = _feed(sampler, clock, 0.5, 60)
    transitions = [(t, v) for t, v in noisy + quiet if v.reason == "transition"]
    assert len(transitions) == 2
    assert transitions[0][0] < quiet[0][0] <= transitions[1][0]
    assert all(v.keep_raw and v.update_latest for _, v in transitions)
    back = transitions[1][0]
    assert all(v.reason == "normal" for t, v in quiet if t > back)
    assert sampler.noisy(TENANT) == []


# --- hysteresis -------------------------------------------------------------
# A short half-life makes the estimate follow a change within a few seconds,
def _random_arrivals(sampler: Sampler, clock: FakeClock, rate: float, seconds: float) -> None:
    """One device whose messages arrive at random (Poisson) at a steady ``rate``."""
    rng = random.Random(7)
    end = clock.now + seconds
    while True:
        clock.now += rng.expovariate(rate)
        if clock.now > end:
            return
        sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {}, int(clock.now * 1000))


def test_noisy_for_keeps_an_irregular_device_under_noisy_above_whole() -> None:
    """At a steady 4 msg/s with random spacing, the estimate crosses noisy_above
    (5) now and then; at noisy_for 0 one crossing makes the device noisy for
    good (quiet_below 2 is never reached). With noisy_for "10s" it must stay
    above for 10 s, which this device never does in ten minutes."""
    at_once, patient = FakeClock(), FakeClock()
    eager = _sampler(at_once, noisy_for="0s")
    _random_arrivals(eager, at_once, 4.0, 600)
    assert [d.device_id for d in eager.noisy(TENANT)] == ["d1"]

    waiting = _sampler(patient, noisy_for="10s")
    _random_arrivals(waiting, patient, 4.0, 600)
    assert waiting.noisy(TENANT) == []


def test_noisy_for_delays_a_noisy_device_by_that_long() -> None:
    """A device at 20 msg/s: noisy as soon as its estimate passes 5 msg/s at
    noisy_for 0, and 10 s after that (to the event) at "10s"."""
    firsts = []
    for noisy_for in ("0s", "10s"):
        clock = FakeClock()
        verdicts = _feed(_sampler(clock, noisy_for=noisy_for), clock, 20, 30)
        firsts.append(next(t for t, v in verdicts if v.reason == "transition"))
    crossed, after = firsts
    assert crossed < 1002.5  # 20 (1 - 2^(-t/5)) passes 5 msg/s at t = 2.08 s
    assert 10.0 <= after - crossed <= 10.0 + 1 / 20


# so the quiet_for period dominates and can be checked to the second.


def test_rate_between_quiet_below_and_noisy_above_stays_noisy() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, half_life=0.5)
    _make_noisy(sampler, clock)
    verdicts = _feed(sampler, clock, 4.5, 300)  # under noisy_above 5, over quiet_below 2
    assert _reasons(verdicts).keys() == {"sampled"}
    assert [d.device_id for d in sampler.noisy(TENANT)] == ["d1"]


def test_quiet_for_less_than_quiet_for_stays_noisy() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, half_life=0.5, quiet_for=30.0)
    _make_noisy(sampler, clock)
    dip = _feed(sampler, clock, 1, 25)  # under quiet_below, but not for 30 s
    back = _feed(sampler, clock, 20, 60)
    assert "transition" not in _reasons(dip + back)
    assert sampler.noisy(TENANT)


def test_quiet_after_quiet_for() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, half_life=0.5, quiet_for=30.0)
    _make_noisy(sampler, clock)
    drop = clock.now
    verdicts = _feed(sampler, clock, 1, 60)
    (back,) = [t for t, v in verdicts if v.reason == "transition"]
    # The estimate needs about log2(250/2) half-lives (3.5 s) to fall under 2.
    assert drop + 30 <= back <= drop + 30 + 5
    assert all(v.reason == "sampled" for t, v in verdicts if t < back)
    assert all(v.reason == "normal" for t, v in verdicts if t > back)


def test_silent_noisy_device_is_quiet_on_its_next_event() -> None:
    clock = FakeClock()
    sampler = _sampler(clock)
    _make_noisy(sampler, clock)
    clock.now += 20  # the estimate is under 2 msg/s after ~35 s; plus quiet_for
    assert sampler.noisy(TENANT)
    clock.now += 60
    assert sampler.noisy(TENANT) == []  # reported quiet before its next event
    verdict = sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {})
    assert verdict == Verdict(True, True, "transition")
    clock.now += 0.1
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {}).reason == "normal"


@pytest.mark.parametrize("quiet_for", [0.05, 0.2, 1.0])
def test_the_noisy_list_says_what_the_next_event_finds(quiet_for: float) -> None:
    """noisy() reports a silent device as its next event would find it. An
    event counts half its own jump in the estimate (about 0.07 msg/s at the
    default half-life), so for the 0.25 s after the estimate decays under
    quiet_below an event still reads as loud: with quiet_for under that, the
    list called the device quiet while its next event kept it noisy."""
    crossing: float | None = None
    mismatches = []
    for step in range(80):
        clock = FakeClock()
        sampler = _sampler(clock, quiet_for=f"{quiet_for}s")
        _make_noisy(sampler, clock)
        silent_from = clock.now
        if crossing is None:  # when the estimate falls under quiet_below
            while sampler.rate(TENANT, "d1") >= 2.0:
                clock.now += 0.001
            crossing = clock.now - silent_from
        clock.now = silent_from + crossing + step * 0.01
        listed = [d.device_id for d in sampler.noisy(TENANT)] == ["d1"]
        verdict = sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {})
        still_noisy = verdict.reason != "transition"
        if listed != still_noisy:
            mismatches.append((round(clock.now - silent_from - crossing, 2), listed))
    assert mismatches == []


# --- per-tenant and per-topic settings --------------------------------------


def test_per_tenant_settings_and_default_section() -> None:
    clock = FakeClock()
    sampler = _sampler(
        clock,
        tenants={
            "big": {"noisy_above": 50.0, "target_rate": 5.0},
            "default": {"target_rate": 2.0},
        },
    )
    at_20 = _feed(sampler, clock, 20, 30, tenant="big")
    assert "transition" not in _reasons(at_20)
    at_100 = _feed(sampler, clock, 100, 30, tenant="big", device="d2")
    became = next(t for t, v in at_100 if v.reason == "transition")
    assert len(_kept(at_100, "sampled")) == pytest.approx(5 * (clock.now - became), abs=2)
    # Any other tenant: the default section (target 2) and global noisy_above 5.
    other = _feed(sampler, clock, 20, 30, tenant="other")
    became = next(t for t, v in other if v.reason == "transition")
    assert len(_kept(other, "sampled")) == pytest.approx(2 * (clock.now - became), abs=2)


def test_topic_overrides_first_match_wins() -> None:
    clock = FakeClock()
    sampler = _sampler(
        clock,
        overrides=[
            {"topic_filter": "tenants/acme/devices/pump7/#", "target_rate": 10.0},
            {"topic_filter": "tenants/+/devices/+/events", "noisy_above": 100.0},
            {"topic_filter": "#", "noisy_above": 6.0},
        ],
    )
    # pump7: first override (target 10), noisy_above from the tenant (5).
    pump = _feed(sampler, clock, 250, 40, device="pump7")  # noisy after about 10 s
    assert len(_kept(pump, "sampled")) == pytest.approx(10 * 30, abs=12)
    # Other devices on an .../events topic: the second override, not the third.
    other = _feed(sampler, clock, 50, 30, device="valve")
    assert "transition" not in _reasons(other)
    # A device on another topic shape: the catch-all.
    clock.now += 1
    for t in _ticks(clock.now, 50, 30):
        clock.now = t
        sampler.decide(TENANT, "cam", "tenants/acme/cams/cam/frames", None, {})
    assert {d.device_id for d in sampler.noisy(TENANT)} == {"pump7", "cam"}


def test_noisy_for_per_tenant_and_per_topic() -> None:
    """noisy_for follows noisy_above's precedence: a topic override, then the
    tenant's section, then [sampling]. Each device at 250 msg/s: noisy once
    its estimate has passed 5 msg/s (after 0.14 s) and stayed over for that long."""
    clock = FakeClock()
    sampler = _sampler(
        clock,
        noisy_for="10s",
        tenants={"patient": {"noisy_for": "30s"}, "eager": {"noisy_for": "0s"}},
        overrides=[
            {"topic_filter": "tenants/patient/devices/pump-1/#", "noisy_for": "2s"},
            {"topic_filter": "tenants/patient/devices/valve-1/#", "target_rate": 3.0},
        ],
    )

    def noisy_after(tenant: str, device: str) -> float:
        start = clock.now
        for t in _ticks(start, 250, 60):
            clock.now = t
            if sampler.decide(tenant, device, _topic(tenant, device), "on", {}).reason == (
                "transition"
            ):
                return t - start
        raise AssertionError(f"{tenant}/{device} not noisy in 60 s")

    assert noisy_after("eager", "d1") < 0.2
    assert 2.0 <= noisy_after("patient", "pump-1") < 2.2  # the override
    assert 30.0 <= noisy_after("patient", "d1") < 30.2  # the tenant's section
    # An override that does not set it: the tenant's section's.
    assert 30.0 <= noisy_after("patient", "valve-1") < 30.2
    assert 10.0 <= noisy_after("other", "d1") < 10.2  # [sampling]


def test_a_noisy_device_that_changes_topic_is_kept_at_its_new_target() -> None:
    """The slot counter of a noisy device was left at the old target's count:
    noisy for 100 s at a target of 10 msg/s, then moved to a topic with target
    1, it kept nothing until 1,000 s after it became noisy."""
    clock = FakeClock()
    sampler = _sampler(clock, overrides=[{"topic_filter": "fast/#", "target_rate": 10.0}])

    def feed(topic: str, seconds: float) -> list[float]:
        kept = []
        for t in _ticks(clock.now, 250, seconds):
            clock.now = t
            if sampler.decide(TENANT, "d1", topic, "on", {}).keep_raw:
                kept.append(t)
        clock.now += 1 / 250
        return kept

    fast = feed("fast/d1", 110)  # whole until noisy (2,500 in 10 s), then 10 a second
    assert 2500 + 990 <= len(fast) <= 2500 + 1040
    slow = feed(_topic(TENANT, "d1"), 60)  # [sampling]'s target: 1 a second
    assert 59 <= len(slow) <= 61, len(slow)
    gaps = [b - a for a, b in itertools.pairwise(slow)]
    assert max(gaps) <= 1.01


def test_topic_filter_matching() -> None:
    def match(topic_filter: str, topic: str) -> bool:
        return topic_matches(filter_levels(topic_filter), topic)

    assert match("a/+/c", "a/b/c")
    assert not match("a/+/c", "a/b/c/d")
    assert not match("a/+/c", "a/c")
    assert match("a/#", "a")
    assert match("a/#", "a/b/c")
    assert match("#", "anything/at/all")
    assert match("+/+", "/x")  # an empty level is a level
    assert not match("+/x", "$SYS/x")
    assert match("$SYS/#", "$SYS/x")
    assert not match("a/b", "a/b/c")


# --- latest-table coalescing --------------------------------------------------


@pytest.mark.parametrize("interval", [1.0, 0.25])
def test_update_latest_coalesced_for_noisy_devices(interval: float) -> None:
    clock = FakeClock()
    sampler = _sampler(clock, latest_interval=interval)
    _make_noisy(sampler, clock)
    verdicts = _feed(sampler, clock, 250, 30)
    updates = [t for t, v in verdicts if v.update_latest]
    gaps = [b - a for a, b in itertools.pairwise(updates)]
    assert min(gaps) >= interval - 1e-9
    assert max(gaps) <= interval + 0.01
    # A state change updates at once and restarts the interval.
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "off", {}).update_latest
    clock.now += 0.004
    assert not sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "off", {}).update_latest


def test_update_latest_always_for_quiet_devices() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, latest_interval=10.0)
    verdicts = _feed(sampler, clock, 4, 60)
    assert all(v.update_latest and v.keep_raw for _, v in verdicts)


# --- tenant quotas --------------------------------------------------------------


def _fleet(
    sampler: Sampler,
    clock: FakeClock,
    tenants: list[str],
    devices: int,
    rate: float,
    seconds: float,
) -> dict[str, list[Verdict]]:
    """Each tenant's devices, each at ``rate``, interleaved in time."""
    out: dict[str, list[Verdict]] = {t: [] for t in tenants}
    start = clock.now
    for step, t in enumerate(_ticks(start, rate * devices, seconds)):
        clock.now = t
        device = f"dev{step % devices}"
        for tenant in tenants:
            out[tenant].append(sampler.decide(tenant, device, _topic(tenant, device), "on", {}))
    clock.now = start + seconds
    return out


def test_tenant_over_max_rate_sampled_to_max_rate_other_untouched() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, tenants={"capped": {"max_rate": 10.0, "burst": 20.0}})
    # 50 devices at 2 msg/s each (under noisy_above, so device sampling stays
    # out of it): 100 msg/s per tenant, 10x the cap.
    out = _fleet(sampler, clock, ["capped", "free"], devices=50, rate=2.0, seconds=60)
    capped = Counter((v.keep_raw, v.reason) for v in out["capped"])
    kept = sum(n for (keep, _), n in capped.items() if keep)
    # 60 s at 10 msg/s, plus the full bucket at the start, plus each device's
    # first event (always kept, though it takes a token while there is one).
    assert 600 <= kept <= 600 + 20 + 50
    assert capped[(True, "state_change")] == 50
    assert capped[(False, "tenant_rate")] == 6000 - kept
    assert all(v.keep_raw for v in out["free"])
    counters = sampler.tenant_counters()
    assert counters["capped"]["tenant_rate_sampled"] == 6000 - kept
    assert counters["free"] == {
        "kept": 6000,
        "sampled_out": 0,
        "quota_rejected": 0,
        "tenant_rate_sampled": 0,
    }
    # Spread over time, not bunched: the bucket's 10/s holds in every 10 s window.
    per_window = Counter(int(i / 1000) for i, v in enumerate(out["capped"]) if v.keep_raw)
    assert all(per_window[w] == 100 for w in range(1, 6)), per_window


def test_tenant_rate_keeps_state_changes() -> None:
    clock = FakeClock()
    sampler = _sampler(
        clock, tenants={TENANT: {"max_rate": 1.0, "burst": 1.0, "noisy_above": 1000.0}}
    )
    _feed(sampler, clock, 100, 5.5)  # one token a second; the last went at +5 s
    clock.now += 0.01
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {}).reason == "tenant_rate"
    clock.now += 0.01
    assert sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "off", {}).keep_raw
    clock.now += 0.01
    assert sampler.decide(TENANT, "new", _topic(TENANT, "new"), "on", {}).keep_raw


def test_device_quota_leaves_new_devices_pending_until_settled() -> None:
    """The quota is in Cassandra (store/quota.py): the sampler admits from
    memory only the devices it saw settled as admitted, refuses for
    QUOTA_RECHECK those it saw refused, and leaves the others pending (kept
    whole, not tracked) for the write loop to settle."""
    clock = FakeClock()
    sampler = _sampler(clock, max_devices=2, tenants={TENANT: {"max_devices_per_tenant": 3}})
    for device, admitted in (("d0", True), ("d1", True), ("d2", True), ("d3", False)):
        assert sampler.decide(TENANT, device, "t", "on", {}) is QUOTA_PENDING
        sampler.settled(TENANT, device, admitted)
    assert sampler.tracked_devices == 0  # pending devices cost no sampler state
    for device in ("d0", "d1", "d2"):
        verdict = sampler.decide(TENANT, device, "t", "on", {})
        assert verdict.keep_raw
        assert verdict is not QUOTA_PENDING
    # d0 fell out of the sampler's LRU (max_devices=2) but is still admitted.
    assert sampler.tracked_devices == 2
    assert sampler.decide(TENANT, "d0", "t", "on", {}) is not QUOTA_PENDING
    assert sampler.admission(TENANT, "d0") is None
    # A refused device is refused from memory for QUOTA_RECHECK, then asked again.
    assert sampler.decide(TENANT, "d3", "t", "on", {}) is QUOTA_REFUSED
    assert sampler.admission(TENANT, "d3") is QUOTA_REFUSED
    clock.now += QUOTA_RECHECK
    assert sampler.decide(TENANT, "d3", "t", "on", {}) is QUOTA_PENDING
    # It remembers every device admitted (a release or a lowered quota can
    # leave more than the quota), up to twice the quota: the one seen
    # longest ago goes first, and is asked of Cassandra again.
    for device in ("d4", "d5", "d6", "d7"):
        sampler.settled(TENANT, device, True)
        assert sampler.admission(TENANT, device) is None
    assert sampler.admission(TENANT, "d0") is QUOTA_PENDING
    assert sampler.admission(TENANT, "d1") is None
    # Other tenants have no quota.
    assert sampler.quota("other") is None
    for i in range(10):
        assert sampler.decide("other", f"x{i}", "t", "on", {}) is not QUOTA_PENDING
    assert sampler.admission("other", "x99") is None
    assert sampler.quota(TENANT) == 3
    # Counted: the refusal decide gave; the write loop counts the ones it settles.
    sampler.count_refused(TENANT)
    assert sampler.tenant_counters()[TENANT]["quota_rejected"] == 2


def test_an_admitted_device_is_asked_again_after_quota_remember() -> None:
    """A device released from the quota while it still sends kept being
    admitted from memory by a running gateway, without a slot."""
    clock = FakeClock()
    sampler = _sampler(clock, tenants={TENANT: {"max_devices_per_tenant": 3}})
    assert sampler.decide(TENANT, "d0", "t", "on", {}) is QUOTA_PENDING
    sampler.settled(TENANT, "d0", True)
    clock.now += QUOTA_REMEMBER - 1
    assert sampler.decide(TENANT, "d0", "t", "on", {}) is not QUOTA_PENDING
    clock.now += 1  # tracked by the sampler, and still asked again
    assert sampler.decide(TENANT, "d0", "t", "on", {}) is QUOTA_PENDING
    assert sampler.admission(TENANT, "d0") is QUOTA_PENDING
    sampler.settled(TENANT, "d0", True)
    assert sampler.decide(TENANT, "d0", "t", "on", {}) is not QUOTA_PENDING


def test_default_section_quota_applies_to_every_tenant() -> None:
    sampler = _sampler(FakeClock(), tenants={"default": {"max_devices_per_tenant": 1}})
    assert sampler.decide("a", "x", "t", "on", {}) is QUOTA_PENDING
    assert sampler.quota("a") == sampler.quota("b") == 1
    assert _sampler(FakeClock()).quota("a") is None


def test_disabled_keeps_everything_but_quotas_apply() -> None:
    clock = FakeClock()
    sampler = _sampler(
        clock,
        enabled=False,
        tenants={TENANT: {"max_devices_per_tenant": 1, "max_rate": 50.0, "burst": 50.0}},
    )
    verdicts = _feed(sampler, clock, 40, 30, tenant="free")
    assert all(v.keep_raw and v.update_latest for _, v in verdicts)
    assert sampler.noisy("free") == []
    sampler.settled(TENANT, "d1", True)
    capped = _feed(sampler, clock, 100, 10)
    assert 500 <= len(_kept(capped)) <= 551
    assert sampler.decide(TENANT, "d2", "t", "on", {}) is QUOTA_PENDING


# --- bounds and counters ------------------------------------------------------


@pytest.mark.slow
def test_memory_bounded_with_a_million_device_ids() -> None:
    # A million ids: the sampler tracks at most max_devices at every step.
    # (Not the process's peak RSS, which this test used to compare: a
    # high-water mark that an earlier test already raised shows no growth
    # here whatever the sampler does. The bytes are measured just below.)
    clock = FakeClock()
    sampler = _sampler(clock, max_devices=10_000)
    for i in range(1_000_000):
        clock.now += 0.0001
        sampler.decide(TENANT, f"device-{i}", "t", "on", {})
        assert sampler.tracked_devices == min(i + 1, 10_000)
    assert sampler.evicted_devices == 990_000


def test_memory_stops_growing_at_max_devices() -> None:
    # The bytes of the sampler itself, traced from its creation: full at
    # 10,000 devices, and 30,000 more new ids do not grow it.
    clock = FakeClock()
    tracemalloc.start()
    try:
        sampler = _sampler(clock, max_devices=10_000)
        for i in range(30_000):
            clock.now += 0.0001
            sampler.decide(TENANT, f"device-{i}", "t", "on", {})
        full, _ = tracemalloc.get_traced_memory()
        for i in range(30_000, 60_000):
            clock.now += 0.0001
            sampler.decide(TENANT, f"device-{i}", "t", "on", {})
        end, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sampler.tracked_devices == 10_000
    assert full < 10_000_000  # about 400 bytes a device (ids included)
    assert end - full < 1_000_000
    assert peak < 15_000_000


def test_unconfigured_tenants_bounded() -> None:
    sampler = _sampler(FakeClock(), max_tenants=100, tenants={"vip": {"max_rate": 5.0}})
    sampler.decide("vip", "d", "t", "on", {})
    for i in range(1000):
        sampler.decide(f"t{i}", "d", "t", "on", {})
    counters = sampler.tenant_counters()
    assert len(counters) == 101
    assert "vip" in counters  # a configured tenant is never forgotten
    assert sampler.evicted_tenants == 900


def test_evicted_noisy_device_leaves_the_noisy_list() -> None:
    clock = FakeClock()
    sampler = _sampler(clock, max_devices=3)
    _make_noisy(sampler, clock)
    assert sampler.noisy(TENANT)
    for device in ("a", "b", "c"):
        sampler.decide(TENANT, device, "t", "on", {})
    assert sampler.noisy(TENANT) == []


def test_counters_add_up() -> None:
    clock = FakeClock()
    sampler = _sampler(
        clock,
        important=[{"metric": "t", "above": 50.0}],
        tenants={
            "a": {"max_rate": 30.0, "max_devices_per_tenant": 8},
            "b": {"target_rate": 2.0},
        },
    )
    decided: Counter[str] = Counter()
    by_verdict: Counter[tuple[str, bool, str]] = Counter()
    admitted: dict[str, set[str]] = {"a": set(), "b": set()}
    # A deterministic mix: noisy and quiet devices, state flips, important values.
    for step in range(60_000):
        clock.now += 0.001
        tenant = "ab"[step % 2]
        device = f"d{(step * 7919) % 11 if step % 3 else step % 2}"
        state = "on" if step % 97 else "off"
        metrics = {"t": 60.0 if step % 501 == 0 else 20.0}
        verdict = sampler.decide(tenant, device, _topic(tenant, device), state, metrics)
        assert verdict.reason in REASONS
        decided[tenant] += 1
        if verdict is QUOTA_PENDING:  # settled as the write loop would
            if len(admitted[tenant]) < 8:
                admitted[tenant].add(device)
            ok = device in admitted[tenant]
            sampler.settled(tenant, device, ok)
            if ok:
                verdict = sampler.decide(tenant, device, _topic(tenant, device), state, metrics)
            else:
                sampler.count_refused(tenant)
                verdict = QUOTA_REFUSED
        by_verdict[tenant, verdict.keep_raw, verdict.reason] += 1
    counters = sampler.tenant_counters()
    for tenant in "ab":
        c = counters[tenant]
        assert c["kept"] + c["sampled_out"] + c["quota_rejected"] == decided[tenant]
        assert c["kept"] == sum(n for (t, keep, _), n in by_verdict.items() if t == tenant and keep)
        assert c["quota_rejected"] == by_verdict[tenant, False, "quota"]
        assert c["tenant_rate_sampled"] == by_verdict[tenant, False, "tenant_rate"]
        assert c["tenant_rate_sampled"] <= c["sampled_out"]
    assert counters["a"]["quota_rejected"] > 0
    assert counters["a"]["tenant_rate_sampled"] > 0
    assert counters["b"]["sampled_out"] > 0
    assert by_verdict["b", True, "important"] > 0
    # Per device: the noisy list's sampled_out never exceeds the tenant's.
    assert sum(d.sampled_out for d in sampler.noisy("b")) <= counters["b"]["sampled_out"]


# --- configuration ----------------------------------------------------------------


def test_defaults() -> None:
    config = SamplingConfig()
    assert config.enabled
    assert (config.noisy_above, config.target_rate, config.quiet_below) == (5.0, 1.0, 2.0)
    assert (config.half_life, config.quiet_for, config.latest_interval) == (5.0, 30.0, 0.0)
    assert config.noisy_for == 10.0
    assert config.max_devices == 100_000
    assert config.important == []
    assert config.overrides == []
    assert config.tenants == {}


def test_durations_accept_units() -> None:
    config = SamplingConfig.model_validate(
        {"half_life": "10s", "quiet_for": "2m", "latest_interval": "250ms"}
    )
    assert (config.half_life, config.quiet_for, config.latest_interval) == (10.0, 120.0, 0.25)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quiet_below": 5.0}, "quiet_below (5.0) must be below noisy_above (5.0)"),
        ({"noisy_above": 0}, "noisy_above"),
        ({"target_rate": -1}, "target_rate"),
        ({"half_life": 0.1}, "half_life (0.1 s) is too short for quiet_below"),
        ({"tenants": {"x": {"noisy_above": 1.0}}}, "tenants.x.noisy_above (1.0)"),
        ({"tenants": {"x": {"burst": 5}}}, "tenants.x.burst is set but max_rate is not"),
        ({"tenants": {"x": {"max_devices_per_tenant": -1}}}, "max_devices_per_tenant"),
        ({"overrides": [{"topic_filter": "a/#", "noisy_above": 2.0}]}, "overrides[0].noisy_above"),
        ({"overrides": [{"topic_filter": "a/#/b", "target_rate": 2}]}, "must be the last level"),
        ({"overrides": [{"topic_filter": "a/b+", "target_rate": 2}]}, "must stand alone"),
        (
            {"overrides": [{"topic_filter": "a"}]},
            "sets none of noisy_above, noisy_for and target_rate",
        ),
        ({"important": [{"metric": "t"}]}, "needs above or below"),
        ({"important": [{"metric": "t", "above": 1, "below": 2}]}, "must be less than above"),
        ({"important": [{"metric": "t", "above": math.inf}]}, "finite"),
        ({"bogus": 1}, "bogus"),
        ({"max_devices": 0}, "max_devices"),
    ],
)
def test_invalid_config_names_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingConfig.model_validate(settings)
    assert message in str(info.value)


def test_config_is_frozen() -> None:
    config = SamplingConfig()
    with pytest.raises(ValidationError):
        config.noisy_above = 10.0


def test_state_changes_are_judged_by_event_time_not_arrival() -> None:
    sampler = _sampler(FakeClock())
    topic = _topic(TENANT, "d1")
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=100).reason == "state_change"
    assert sampler.decide(TENANT, "d1", topic, "off", {}, ts=300).reason == "state_change"
    # A late event in another state is a real transition seen out of order:
    # its raw row is kept; it does not become "the device's state".
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=200).keep_raw
    assert sampler.decide(TENANT, "d1", topic, "off", {}, ts=250).reason != "state_change"
    # Judged against the newest event (off), not the last to arrive (on).
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=400).reason == "state_change"


def test_arrival_time_given_by_the_caller_is_what_the_rate_is_measured_in() -> None:
    """A backlog handed over in a burst (the spool draining) keeps the rate it
    arrived at: one message a second is not noisy, however fast it is decided."""
    clock = FakeClock()  # never moves
    # Noisy at once: with noisy_for, a clock that never moves could never make
    # it noisy, and this test could not fail.
    sampler = _sampler(clock, noisy_for="0s")
    topic = _topic(TENANT, "d1")
    verdicts = [
        sampler.decide(TENANT, "d1", topic, "on", {}, ts=i, now=1000.0 + i) for i in range(120)
    ]
    assert all(v.keep_raw for v in verdicts)
    assert not sampler.noisy(TENANT)


# --- receive times that go back ----------------------------------------------


def test_a_configured_tenants_rate_holds_for_a_backlog_received_before_the_start() -> None:
    """After a restart the spool hands over messages received before the
    sampler existed. A tenant with a section of its own had its token bucket
    stamped with the start time, and every older arrival found it empty: 4,995
    of 5,000 events at half the tenant's max_rate were dropped."""
    clock = FakeClock(10_000.0)
    sampler = _sampler(clock, tenants={TENANT: {"max_rate": 10.0, "noisy_above": 1000.0}})
    verdicts = []
    for i in range(5000):  # received at 5 msg/s over the 1,000 s before the start
        now = 9000 + i * 0.2
        verdicts.append(
            sampler.decide(TENANT, "d1", _topic(TENANT, "d1"), "on", {}, int(now * 1000), now)
        )
    assert all(v.keep_raw for v in verdicts), _reasons([(0.0, v) for v in verdicts])


def test_a_clock_that_steps_back_starves_neither_a_noisy_device_nor_a_tenant() -> None:
    """A wall clock stepped back 120 s (the receive times are wall-clock
    times): a noisy device still keeps its target rate and, with latest_interval
    0, still updates the latest tables with every event; a tenant under its
    max_rate keeps everything."""
    clock = FakeClock()
    sampler = _sampler(clock, tenants={"capped": {"max_rate": 100.0, "noisy_above": 1000.0}})
    _make_noisy(sampler, clock)
    for t in _ticks(clock.now, 10, 5):
        clock.now = t
        assert sampler.decide("capped", "c1", _topic("capped", "c1"), "on", {}).keep_raw
    clock.now -= 120
    noisy = _feed(sampler, clock, 250, 30)
    assert 28 <= len(_kept(noisy, "sampled")) <= 31
    assert all(v.update_latest for _, v in noisy)
    clock.now -= 30  # back to the step's start, for the tenant
    capped = _feed(sampler, clock, 10, 30, tenant="capped", device="c1")
    assert all(v.keep_raw for _, v in capped), _reasons(capped)


def test_a_noisy_device_alternating_between_two_targets_is_not_starved() -> None:
    """One device, two topics (two topic templates can name the same device)
    with different targets, alternating message by message: each change of
    target used to mark the current slot as taken, and nothing was kept."""
    clock = FakeClock()
    sampler = _sampler(
        clock,
        overrides=[{"topic_filter": "tenants/+/devices/+/status", "target_rate": 2.0}],
    )
    _make_noisy(sampler, clock)
    kept = []
    for i, t in enumerate(_ticks(clock.now, 250, 60)):
        clock.now = t
        topic = _topic(TENANT, "d1") if i % 2 else f"tenants/{TENANT}/devices/d1/status"
        if sampler.decide(TENANT, "d1", topic, "on", {}).keep_raw:
            kept.append(t)
    # At least the lower target (1 msg/s), at most the higher (2 msg/s).
    assert 59 <= len(kept) <= 121, len(kept)
    assert max(b - a for a, b in itertools.pairwise(kept)) <= 1.01


def test_two_states_at_the_same_timestamp_are_both_kept() -> None:
    """Events in two states with the same timestamp: the second arrival used to
    be taken for no change, though it became the device's state."""
    clock = FakeClock()
    sampler = _sampler(clock)
    _make_noisy(sampler, clock)
    clock.now += 0.004
    topic = _topic(TENANT, "d1")
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=5_000_000).reason == "sampled"
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", topic, "off", {}, ts=5_000_000).keep_raw


def test_back_fill_shown_to_observe_is_what_the_next_event_is_compared_with() -> None:
    """Back-fill is kept without decide and used to be invisible to the sampler:
    a change back from its state was taken for no change and sampled out. An
    untracked device (after a restart, the first view may be an old event)
    stays untracked, and nothing is counted."""
    clock = FakeClock()
    sampler = _sampler(clock)
    _make_noisy(sampler, clock)  # d1 is "on", timestamps 0, 1, 2, ...
    topic = _topic(TENANT, "d1")
    counters, rate = sampler.tenant_counters(), sampler.rate(TENANT, "d1")
    sampler.observe(TENANT, "d1", "off", 1_000_000)
    assert sampler.tenant_counters() == counters
    assert sampler.rate(TENANT, "d1") == rate
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=1_000_001).reason == "state_change"
    # Back-fill older than the newest state does not replace it.
    sampler.observe(TENANT, "d1", "off", 500_000)
    clock.now += 0.004
    assert sampler.decide(TENANT, "d1", topic, "on", {}, ts=1_000_002).reason == "sampled"
    # Untracked: no entry; the device's next event is still its first.
    sampler.observe(TENANT, "d2", "off", 1)
    assert sampler.tracked_devices == 1
    assert sampler.decide(TENANT, "d2", "t", "off", {}, ts=2).reason == "state_change"
    # Tracked but with no state known: an old state is not adopted, since
    # states before the device was tracked are unknown.
    assert sampler.decide(TENANT, "d3", "t", None, {}, ts=100).reason == "state_change"
    sampler.observe(TENANT, "d3", "off", 50)
    assert sampler.decide(TENANT, "d3", "t", "off", {}, ts=101).reason == "state_change"
