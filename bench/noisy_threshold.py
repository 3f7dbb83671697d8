"""Which steady rates the sampler calls noisy when messages arrive at random.

Feeds ``gateway.ingest.sampling.Sampler`` (its defaults: noisy_above 5 msg/s,
half-life 5 s, quiet_below 2 msg/s for 30 s) DEVICES devices per rate whose
messages arrive as a Poisson process at that steady rate, for 60 s and for
600 s, and prints the share of devices noisy at the end and the share of
events thinned. No broker or database: the sampler's own decisions, at the
receive times given. Seeded, so a run repeats exactly.

Why: the estimate fluctuates with the spacing of the messages, and once it
has stayed over noisy_above for noisy_for (at 0 s, once it has crossed it)
a device stays noisy until it has been under quiet_below for quiet_for
(README, Known limits).

Usage: .venv/bin/python bench/noisy_threshold.py [--noisy-for 0s]
(sampling.noisy_for, default 10s: how long the estimate must stay over
noisy_above first; 0s was the default before)
"""

from __future__ import annotations

import argparse
import random

from gateway.config import SamplingConfig
from gateway.ingest.sampling import Sampler
from gateway.units import parse_duration

DEVICES = 300
RATES = (2.5, 3.0, 3.5, 4.0, 4.4, 5.2)
START = 1_700_000_000.0


def run(rate: float, seconds: float, rng: random.Random, noisy_for: float) -> tuple[float, float]:
    """(share of devices noisy at the end, share of events thinned)."""
    sampler = Sampler(SamplingConfig(noisy_for=noisy_for))
    kept = total = noisy = 0
    for d in range(DEVICES):
        device, t, last = f"d{d}", START, None
        while True:
            t += rng.expovariate(rate)
            if t > START + seconds:
                break
            topic = f"tenants/t/devices/{device}/events"
            last = sampler.decide("t", device, topic, "on", {"x": 1.0}, int(t * 1000), t)
            total += 1
            kept += last.keep_raw
        noisy += last is not None and last.reason != "normal"
    return noisy / DEVICES, 1 - kept / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--noisy-for", default="10s", help="sampling.noisy_for (default 10s)")
    args = parser.parse_args()
    noisy_for = parse_duration(args.noisy_for)  # seconds, as the config reads it
    rng = random.Random(1)
    print(
        f"{DEVICES} devices per rate, Poisson arrivals, sampler defaults "
        f"but noisy_for {args.noisy_for}"
    )
    for rate in RATES:
        cells = []
        for seconds in (60.0, 600.0):
            noisy, thinned = run(rate, seconds, rng, noisy_for)
            cells.append(f"{seconds:3.0f} s: {noisy:6.1%} noisy, {thinned:5.1%} thinned")
        print(f"{rate:3.1f} msg/s   " + ";  ".join(cells))


if __name__ == "__main__":
    main()
