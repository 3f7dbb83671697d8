"""The bench's read-back check (bench/benchlib.py) counts each stored event once.

A device that changes rate class writes telemetry partitions of two bucket
sizes; at 07:00 a 15-minute and a 1-hour bucket start together, so both sizes
write into the same (bucket_start, shard) partition and ``telemetry_partitions``
lists it twice. The check once read it twice and reported
"MISMATCH: 40000/20000 stored" (and a doubled sustained rate).
"""

from __future__ import annotations

import importlib
import re
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from .helpers import ROOT, TEST_KEYSPACE

BUCKET = 1_767_250_800_000  # 2026-01-01T07:00:00Z: a 15-minute and a 1-hour bucket start here
MINUTE = 60_000


@pytest.fixture
def benchlib(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # bench/ is a folder of scripts that import each other flat, as bench/run.py
    # runs them with bench/ first on sys.path.
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    # By name: bench/ is on no path mypy searches.
    return importlib.import_module("benchlib")


@pytest.fixture
def bench_db(benchlib: ModuleType, keyspace: str) -> Iterator[Any]:
    db = benchlib.BenchDb(keyspace)
    try:
        yield db
    finally:
        db.close()


def test_a_partition_listed_for_two_bucket_sizes_is_read_once(
    benchlib: ModuleType, bench_db: Any
) -> None:
    db, session = bench_db, bench_db.session
    tenant = f"t{uuid.uuid4().hex[:10]}"
    device = "dev-000001"
    ks = TEST_KEYSPACE
    insert_row = session.prepare(
        f"INSERT INTO {ks}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
        "state, received_at) VALUES (?, ?, ?, ?, ?, ?, 'on', ?)"
    )
    insert_partition = session.prepare(
        f"INSERT INTO {ks}.telemetry_partitions (tenant, device_id, bucket_start, shard, "
        "bucket_seconds) VALUES (?, ?, ?, ?, ?)"
    )
    # Three events while the device was fast (15-minute buckets), two after it
    # slowed down (1-hour buckets): all five in partition (07:00, shard 0).
    events = [(BUCKET + m * MINUTE, 1000 + m) for m in (1, 5, 10, 20, 40)]
    for ts, event_id in events:
        session.execute(insert_row, (tenant, device, BUCKET, 0, ts, event_id, ts))
    for seconds in (900, 3600):
        session.execute(insert_partition, (tenant, device, BUCKET, 0, seconds))
    # A redelivered copy of the 07:05 event that landed in shard 1 (the device
    # was split over two shards in between): the same event, counted once.
    ts, event_id = events[1]
    session.execute(insert_row, (tenant, device, BUCKET, 1, ts, event_id, ts))
    session.execute(insert_partition, (tenant, device, BUCKET, 1, 3600))

    sent = [benchlib.Sent(device, ts, "on", None) for ts, _ in events]
    check = db.check(tenant, sent, latest=False)

    assert (check.published, check.stored, check.matched) == (5, 5, 5), check.text()
    assert check.ok
    assert check.text() == "5/5 ok"
    assert len(check.write_us) == 5  # the sustained rate's rows, each once
    assert db.count(tenant, [device]) == 5


def test_events_the_gateway_sampled_out_are_not_missing_but_others_are(
    benchlib: ModuleType, bench_db: Any
) -> None:
    """The check once printed MISMATCH whenever the sampler left events out of
    the raw table (a noisy device in a fast drain), though the gateway had
    counted each one. It now takes that count: stored + sampled out must add
    up to what was published, and every stored row must be a published one."""
    db, session = bench_db, bench_db.session
    tenant = f"t{uuid.uuid4().hex[:10]}"
    device = "dev-000001"
    ks = TEST_KEYSPACE
    session.execute(
        f"INSERT INTO {ks}.telemetry_partitions (tenant, device_id, bucket_start, shard, "
        "bucket_seconds) VALUES (%s, %s, %s, 0, 3600)",
        (tenant, device, BUCKET),
    )
    published = [BUCKET + m * MINUTE for m in range(5)]
    for ts in published[:3]:  # two of the five were not stored
        session.execute(
            f"INSERT INTO {ks}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
            "state, received_at) VALUES (%s, %s, %s, 0, %s, 1, 'on', %s)",
            (tenant, device, BUCKET, ts, ts),
        )
    sent = [benchlib.Sent(device, ts, "on", None) for ts in published]

    sampled = db.check(tenant, sent, latest=False, sampled_out=2)
    assert sampled.ok, sampled.text()
    assert sampled.text() == "3 + 2 sampled out/5 ok"
    assert sampled.summary()["sampled_out"] == 2

    for count in (0, 1, 3):  # lost, or a count that does not add up
        check = db.check(tenant, sent, latest=False, sampled_out=count)
        assert not check.ok
        assert check.text().startswith("MISMATCH: ")


def test_the_gateway_status_line_gives_handled_and_sampled_out(
    benchlib: ModuleType, tmp_path: Any
) -> None:
    log = tmp_path / "gateway.log"
    log.write_text(
        "INFO gateway.app: status: in=100 (50/s) written=90 (45/s) rejected=3 "
        "sampled_out=7 queue=0 in_flight=0/64 retries=0 acked=100\n"
    )
    proc = benchlib.Proc("gateway", ["true"], {}, log, [], progress=benchlib.HANDLED)
    proc.poll()
    assert (proc.count, proc.sampled_out) == (100, 7)
    # make bench follows the gateway by its acked count (bench/systems/gateway.py).
    acked = benchlib.Proc("gateway", ["true"], {}, log, [], progress=re.compile(r"acked=(\d+)"))
    acked.poll()
    assert (acked.count, acked.sampled_out) == (100, 7)


def test_one_instance_with_two_tenants_is_checked_with_its_one_sampled_out_count(
    benchlib: ModuleType,
) -> None:
    """bench/instances.py: a gateway subscribed to two tenants reports one
    sampled_out count; each tenant alone cannot be checked against it, the two
    together must add up."""
    a = benchlib.Check(published=10, stored=7, matched=7, devices=2, latest_ok=2, state_ok=2)
    b = benchlib.Check(published=10, stored=9, matched=9, devices=3, latest_ok=3, state_ok=3)
    # Each alone: 3 and 1 events unaccounted for.
    assert not a.ok
    assert not b.ok
    both = benchlib.Check.together([a, b], sampled_out=4)
    assert both.ok, both.text()
    assert both.text() == "16 + 4 sampled out/20 ok (latest tables match)"
    assert not benchlib.Check.together([a, b], sampled_out=3).ok
    wrong_latest = benchlib.Check(published=10, stored=10, matched=10, devices=3, latest_ok=2)
    assert not benchlib.Check.together([a, wrong_latest], sampled_out=3).ok
    assert benchlib.Check.together([a, b], 4).latest_ok == 5
    # A tenant whose latest tables were not read does not hide one whose were wrong.
    unread = benchlib.Check(published=10, stored=10, matched=10, devices=3)
    assert not benchlib.Check.together([unread, wrong_latest], sampled_out=0).ok
    assert benchlib.Check.together([unread, b], sampled_out=1).ok
    assert benchlib.Check.together([unread, unread], sampled_out=0).latest_ok is None


def test_the_sustained_rate_counts_the_messages_sampled_out_too(benchlib: ModuleType) -> None:
    """A drain the sampler thinned handled every message it acknowledged; the
    rate used to count stored rows only and read low."""
    writes = [0, 250_000, 500_000, 750_000, 1_000_000]  # five rows over one second
    stored = benchlib.Check(published=5, stored=5, matched=5, devices=1, write_us=writes)
    assert stored.span_rate() == 4.0
    thinned = benchlib.Check(
        published=10, stored=5, matched=5, devices=1, sampled_out=5, write_us=writes
    )
    assert thinned.span_rate() == 9.0
