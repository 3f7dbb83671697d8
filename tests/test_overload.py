"""Overload: publishing at about 10x what Cassandra absorbs, through a slow
link to it (the cuttable proxy with a bandwidth limit), then the link is
restored. Memory stays bounded, nothing is dropped, the backlog drains."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from gateway.store.database import Database

from .helpers import Publisher, assert_all_stored, make_config, proxy, rss_mb, running_gateway


async def test_ten_times_overload_is_absorbed_and_drained(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    async with proxy() as p:
        p.limit = 40_000  # bytes/s towards Cassandra: roughly 100 events/s
        config = make_config(GATEWAY_CASSANDRA__PORT=str(p.port), GATEWAY_SAMPLING__ENABLED="false")
        async with running_gateway(config) as gw:
            # Measure what the slow link absorbs, then offer ten times that.
            start, before = time.monotonic(), gw.stats.written
            warmup = Publisher(tenant, devices=100, rate=300, count=1500)
            warmup.start()
            await asyncio.to_thread(warmup.join, 60)
            await asyncio.sleep(5)  # part of the measuring window, not a wait for something
            absorbed = (gw.stats.written - before) / (time.monotonic() - start)
            baseline = rss_mb(os.getpid())
            overload = Publisher(tenant, devices=100, rate=min(10 * absorbed, 3000), count=0)
            overload.count = int(overload.rate * 8)  # 8 s at 10x
            overload.published = warmup.published  # one ledger for both runs
            overload.start()
            peak = baseline
            while overload.is_alive():  # RSS sampled while the overload lasts
                await asyncio.sleep(0.5)
                peak = max(peak, rss_mb(os.getpid()))
            print(
                f"slow link absorbed {absorbed:.0f} events/s; offered {overload.rate:.0f}/s; "
                f"RSS {baseline:.0f} -> peak {peak:.0f} MB; throttled {gw.stats.throttled_s:.0f} s"
            )
            assert gw.stats.throttle_events > 0  # the broker was held back...
            assert peak - baseline < 60  # ...instead of memory growing
            p.limit = None  # the link recovers
            await assert_all_stored(db, tenant, overload, deadline=240)
