"""Roll-ups against the real broker and Cassandra: whatever order, copies and
lateness the events come in, once the worker has caught up the 1-minute and
1-hour aggregates equal a recomputation from the raw rows read back; the
dirty marks survive a SIGKILL after the ack; the CLI and the API serve them."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import QueryError
from gateway.stats import Stats
from gateway.store import queries, rollups
from gateway.store.database import Database
from gateway.store.rollups import MINUTE_MS, RollupWorker
from gateway.store.write_session import WriteSession, open_write_session
from gateway.tools.cli import rollup_progress
from gateway.web.tokens import TokenStore

from .helpers import (
    RunningGateway,
    as_ms,
    base_env,
    make_config,
    proxy,
    publish,
    run_cli,
    running_gateway,
    wait_until_blocking,
)
from .test_read_api import client

HOUR_MS = 3_600_000
# Where `make up` has the single node log (cassandra/cassandra.sh).
CASSANDRA_LOG = Path(__file__).resolve().parents[1] / ".state/logs/cassandra/system.log"
# A topic tree of their own: other gateways' traffic on the shared broker
# would only add windows for the workers here to recompute.
TOPICS = '[{template = "rollup-test/{tenant}/devices/{device_id}/events"}]'


def topic(tenant: str, device: str) -> str:
    return f"rollup-test/{tenant}/devices/{device}/events"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gateway(db: Database) -> AsyncIterator[RunningGateway]:
    """One gateway for the module (it writes the marks; the tests drive the worker)."""
    async with running_gateway(make_config(GATEWAY_TOPICS=TOPICS)) as gw:
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def session() -> AsyncIterator[WriteSession]:
    """A write session as `gateway run` opens one for its worker (the driver
    `auto` picks: acsylla here)."""
    async with open_write_session(make_config().cassandra) as opened:
        await opened.plan_packing()
        yield opened


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(session: WriteSession) -> RollupWorker:
    w = RollupWorker(session, make_config(), Stats(), name=f"test-{uuid.uuid4().hex[:8]}")
    await w.start()
    return w


async def publish_and_wait(gateway: RunningGateway, messages: list[tuple[str, bytes]]) -> None:
    """Publish, then wait until the gateway has stored and acknowledged them."""
    want = gateway.stats.written + gateway.stats.sampled_out + len(messages)
    await publish(messages)
    await gateway.wait_for(lambda s: s.written + s.sampled_out >= want and s.acked >= s.received)


def minute_now() -> int:
    now = int(time.time() * 1000)
    return now - now % MINUTE_MS


async def settle(worker: RollupWorker, first_minute: int) -> None:
    """Recompute every window marked from ``first_minute`` to this minute."""
    for minute in range(first_minute, minute_now() + 1, MINUTE_MS):
        await worker.process_minute(minute)


@dataclass(frozen=True)
class Ev:
    ts_ms: int
    value: float | str | None
    metrics: dict[str, float]

    def payload(self) -> bytes:
        body: dict[str, Any] = {"ts": self.ts_ms, "metrics": self.metrics}
        if self.value is not None:
            body["value"] = self.value
        return orjson.dumps(body)


# Two minutes before an hour ends, three hours ago: windows on both sides of
# an hour boundary, and every event is back-fill (never sampled out).
BASE = (int(time.time() * 1000) - 3 * HOUR_MS) // HOUR_MS * HOUR_MS + 58 * MINUTE_MS

numbers = st.one_of(
    st.integers(-3, 3).map(float),
    st.integers(-1000, 1000).map(float),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)
events = st.builds(
    Ev,
    # Whole seconds over four minutes: several events share a millisecond.
    ts_ms=st.integers(0, 4 * 60 - 1).map(lambda s: BASE + s * 1000),
    value=st.one_of(st.none(), numbers, st.just("text")),
    metrics=st.dictionaries(st.sampled_from(["a", "b"]), numbers, max_size=2),
)


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[Ev], list[Ev]]:
    """Distinct events, published shuffled with copies, in two rounds: the
    second (late events and more copies) after the first was rolled up."""
    evs = draw(st.lists(events, min_size=1, max_size=30, unique_by=Ev.payload))
    copies = draw(st.lists(st.sampled_from(evs), max_size=10))
    order = draw(st.permutations(evs + copies))
    cut = draw(st.integers(0, len(order)))
    return order[:cut], order[cut:]


async def raw_samples(
    db: Database, tenant: str, device: str
) -> dict[str, list[tuple[int, int, float]]]:
    """(ts, event id, value) per metric, from every raw row read back, each row once."""
    parts = await db.execute(
        f"SELECT bucket_start, shard FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s",
        (tenant, device),
    )
    rows: dict[tuple[int, int], Any] = {}
    for p in parts:
        for r in await db.execute(
            f"SELECT ts, event_id, value_num, metrics FROM {db.keyspace}.telemetry "
            "WHERE tenant = %s AND device_id = %s AND bucket_start = %s AND shard = %s",
            (tenant, device, p.bucket_start, p.shard),
        ):
            rows[(as_ms(r.ts), r.event_id)] = r
    out: dict[str, list[tuple[int, int, float]]] = {}
    for (ts, event_id), r in rows.items():
        metrics = dict(r.metrics or {})
        if r.value_num is not None:  # the top-level value is metric "value"
            metrics["value"] = r.value_num
        pairs = list(metrics.items())
        for metric, v in pairs:
            out.setdefault(metric, []).append((ts, event_id, v))
    return out


def expected(samples: list[tuple[int, int, float]], step_ms: int) -> dict[int, tuple[Any, ...]]:
    windows: dict[int, list[tuple[int, int, float]]] = {}
    for s in samples:
        windows.setdefault(s[0] - s[0] % step_ms, []).append(s)
    return {
        start: (
            len(w),
            min(v for *_, v in w),
            max(v for *_, v in w),
            sum(v for *_, v in w),
            max(w)[2],
        )
        for start, w in windows.items()
    }


async def assert_rollups_match_raw(db: Database, tenant: str, device: str) -> None:
    samples = await raw_samples(db, tenant, device)
    since = datetime.fromtimestamp((BASE - HOUR_MS) / 1000, UTC)
    until = since + timedelta(hours=3)
    for metric in ("value", "a", "b"):
        for step, step_ms in ((60, MINUTE_MS), (3600, HOUR_MS)):
            got = {
                as_ms(r.start): (r.count, r.min, r.max, r.sum, r.last)
                for r in await queries.rollups(db, tenant, device, metric, step, since, until)
            }
            want = expected(samples.get(metric, []), step_ms)
            assert got.keys() == want.keys(), (metric, step)
            for start, (count, low, high, total, last) in want.items():
                g = got[start]
                assert (g[0], g[1], g[2], g[4]) == (count, low, high, last), (metric, step, start)
                # Sums agree to rounding: the worker adds exactly (fsum), in its own order.
                assert g[3] is not None, (metric, step, start)  # None: beyond a double's range
                assert math.isclose(g[3], total, rel_tol=1e-9, abs_tol=1e-6), (metric, step)


def test_sums_near_the_range_of_a_double_neither_raise_nor_lie() -> None:
    """math.fsum raised OverflowError when a partial sum passed the largest
    double, even for a sum that fits; the worker's pass failed on that minute
    again and again, and no roll-up of any device was written after it."""
    big = 1.7e308
    fits = rollups.aggregate([(1, 1, big), (2, 2, big), (3, 3, -big)])
    assert (fits.count, fits.sum, fits.last) == (3, big, -big)
    beyond = rollups.aggregate([(1, 1, 1e308), (2, 2, 1e308)])
    assert (beyond.count, beyond.min, beyond.max, beyond.sum) == (2, 1e308, 1e308, None)
    assert rollups.merge([beyond, rollups.aggregate([(60_001, 3, 1.0)])]).sum is None
    hour = rollups.merge([rollups.aggregate([(1, 1, 1e308)]), rollups.aggregate([(2, 2, 1e308)])])
    assert (hour.count, hour.sum) == (2, None)
    # Rows another program wrote may hold infinities (the decoder refuses them):
    # inf with -inf raised ValueError, which stopped the worker at that minute.
    odd = rollups.aggregate([(1, 1, math.inf), (2, 2, -math.inf), (3, 3, 1.0)])
    assert (odd.count, odd.sum, odd.last) == (3, None, 1.0)


async def test_a_device_sending_values_near_1e308_stops_no_roll_up(
    db: Database, gateway: RunningGateway, worker: RollupWorker, tenant: str
) -> None:
    """Against the real services: two values of 1e308 in one minute of one
    device, one ordinary value of another device in the same minute. Both
    minutes are written; the huge one's sum is null, shown as out of range."""
    minute = BASE - 10 * MINUTE_MS
    first_minute = minute_now()
    await publish_and_wait(
        gateway,
        [
            (topic(tenant, "huge"), orjson.dumps({"ts": minute + 1000, "value": 1e308})),
            (topic(tenant, "huge"), orjson.dumps({"ts": minute + 2000, "value": 1e308})),
            (topic(tenant, "plain"), orjson.dumps({"ts": minute + 3000, "value": 2.5})),
        ],
    )
    await settle(worker, first_minute)  # no exception: it used to raise OverflowError
    since = datetime.fromtimestamp(minute / 1000, UTC)
    until = since + timedelta(minutes=1)
    (huge,) = await queries.rollups(db, tenant, "huge", "value", 60, since, until)
    assert (huge.count, huge.max, huge.sum) == (2, 1e308, None)
    assert huge.as_json()["sum"] is None
    (plain,) = await queries.rollups(db, tenant, "plain", "value", 60, since, until)
    assert (plain.count, plain.sum) == (1, 2.5)


async def test_a_raw_row_with_a_null_metric_stops_no_roll_up(
    db: Database, gateway: RunningGateway, worker: RollupWorker, tenant: str
) -> None:
    """A raw row whose metric is NaN (another writer's, or an older
    version's: the decoder refuses NaN) reads back through toJson as null.
    The worker raised TypeError on that minute again and again, so its cursor
    never moved on and no later minute of any device was rolled up. The null
    is left out; the row's other metrics count."""
    minute = BASE - 20 * MINUTE_MS
    first_minute = minute_now()
    await publish_and_wait(
        gateway,
        [
            (topic(tenant, "nan"), orjson.dumps({"ts": minute + 1000, "metrics": {"a": 1.0}})),
            (topic(tenant, "nan"), orjson.dumps({"ts": minute + 2000, "metrics": {"a": 2.0}})),
        ],
    )
    (part,) = await db.execute(
        f"SELECT bucket_start, shard FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s",
        (tenant, "nan"),
    )
    rows = await db.execute(
        f"SELECT ts, event_id FROM {db.keyspace}.telemetry WHERE tenant = %s "
        "AND device_id = %s AND bucket_start = %s AND shard = %s",
        (tenant, "nan", part.bucket_start, part.shard),
    )
    newest = max(rows, key=lambda r: r.ts)
    # Newer than the gateway's write (its timestamp is the event time).
    await db.execute(
        f"UPDATE {db.keyspace}.telemetry USING TIMESTAMP %s SET metrics = {{'a': NaN, 'b': 3.0}} "
        "WHERE tenant = %s AND device_id = %s AND bucket_start = %s AND shard = %s "
        "AND ts = %s AND event_id = %s",
        (
            int(time.time() * 1_000_000),
            tenant,
            "nan",
            part.bucket_start,
            part.shard,
            newest.ts,
            newest.event_id,
        ),
    )
    await settle(worker, first_minute)
    since = datetime.fromtimestamp(minute / 1000, UTC)
    until = since + timedelta(minutes=1)
    (a,) = await queries.rollups(db, tenant, "nan", "a", 60, since, until)
    assert (a.count, a.sum) == (1, 1.0)
    (b,) = await queries.rollups(db, tenant, "nan", "b", 60, since, until)
    assert (b.count, b.sum) == (1, 3.0)


async def test_a_top_level_value_and_a_metric_named_value_count_once(
    db: Database, gateway: RunningGateway, worker: RollupWorker, tenant: str
) -> None:
    """The top-level ``value`` is rolled up as metric ``value``; an event that
    also carries ``metrics.value`` gave that metric two samples, so each such
    event counted twice and its sum held both numbers. The top-level value is
    the event's ``value``; ``metrics.value`` stays in the raw row."""
    minute = BASE - 12 * MINUTE_MS
    first_minute = minute_now()
    both = {"value": 5.0, "metrics": {"value": 7.0, "a": 1.0}}
    await publish_and_wait(
        gateway,
        [
            (topic(tenant, "both"), orjson.dumps({"ts": minute + 1000, **both})),
            (topic(tenant, "both"), orjson.dumps({"ts": minute + 2000, **both})),
            (topic(tenant, "inner"), orjson.dumps({"ts": minute + 3000, "metrics": {"value": 7}})),
        ],
    )
    await settle(worker, first_minute)
    since = datetime.fromtimestamp(minute / 1000, UTC)
    until = since + timedelta(minutes=1)
    (value,) = await queries.rollups(db, tenant, "both", "value", 60, since, until)
    assert (value.count, value.sum, value.last) == (2, 10.0, 5.0)
    (a,) = await queries.rollups(db, tenant, "both", "a", 60, since, until)
    assert (a.count, a.sum) == (2, 2.0)
    # Without a top-level value, metrics.value is the event's value metric.
    (inner,) = await queries.rollups(db, tenant, "inner", "value", 60, since, until)
    assert (inner.count, inner.sum) == (1, 7.0)
    (raw,) = await queries.history(db, tenant, "both", since, until, 1)
    assert raw.metrics == {"value": 7.0, "a": 1.0}  # kept as sent


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rounds=deliveries())
async def test_rollups_equal_a_recomputation_from_the_raw_rows(
    db: Database,
    gateway: RunningGateway,
    worker: RollupWorker,
    rounds: tuple[list[Ev], list[Ev]],
) -> None:
    tenant = f"rup{uuid.uuid4().hex[:10]}"
    device = "meter"
    for batch in rounds:
        first_minute = minute_now()
        await publish_and_wait(gateway, [(topic(tenant, device), e.payload()) for e in batch])
        await settle(worker, first_minute)
    await assert_rollups_match_raw(db, tenant, device)


async def test_marks_survive_a_sigkill_after_the_ack_and_the_cursor_resumes(
    db: Database, session: WriteSession, tenant: str, gateway_process: Any
) -> None:
    first = minute_now()
    name = f"test-{uuid.uuid4().hex[:8]}"
    proc = gateway_process(GATEWAY_TOPICS=TOPICS)
    proc.start()
    base = BASE + 10 * MINUTE_MS
    sent = [Ev(base + i * 1000, float(i), {"t": 20.0 + i}) for i in range(5)]
    await publish([(topic(tenant, "pump"), e.payload()) for e in sent])

    def acked() -> bool:
        found = re.findall(r"acked=(\d+)", proc.output())
        return bool(found) and int(found[-1]) >= len(sent)

    wait_until_blocking(acked, 30, "the gateway acknowledged every event")
    proc.kill()  # SIGKILL: nothing held in memory survives, only what is in Cassandra
    # A worker that had started before the events, and never ran: the marks
    # wait in Cassandra until a worker of the same name starts again.
    await RollupWorker(session, make_config(), Stats(), name=name).start(first)
    later = RollupWorker(
        session, make_config(), Stats(), name=name, clock=lambda: time.time() + 120
    )
    await later.start()
    assert later.cursor_ms == first
    assert await later.catch_up() >= 1
    assert later.cursor_ms > minute_now()
    since = datetime.fromtimestamp(base / 1000, UTC)
    rows = await queries.rollups(db, tenant, "pump", "t", 60, since, since + timedelta(minutes=1))
    assert [r.as_json() for r in rows] == [
        {
            "start": queries.iso(since),
            "count": 5,
            "min": 20.0,
            "max": 24.0,
            "sum": 110.0,
            "last": 24.0,
        }
    ]
    hour = await queries.rollups(
        db, tenant, "pump", "value", 3600, since, since + timedelta(hours=1)
    )
    assert [(r.count, r.sum, r.last) for r in hour] == [(5, 10.0, 4.0)]
    # A restart resumes where the worker stopped.
    again = RollupWorker(session, make_config(), Stats(), name=name)
    await again.start()
    assert again.cursor_ms == later.cursor_ms


async def test_cli_and_api_serve_the_rollups(
    db: Database, tenant: str, gateway: RunningGateway, worker: RollupWorker, tmp_path: Path
) -> None:
    first = minute_now()
    start = BASE + 20 * MINUTE_MS
    events = [Ev(start + i * 7000, None, {"kwh": float(i)}) for i in range(4)]
    tenths = [Ev(start + i * 7000, None, {"kwh": v}) for i, v in enumerate((0.1, 0.2))]
    await publish_and_wait(
        gateway,
        [(topic(tenant, "m1"), e.payload()) for e in events]
        + [(topic(tenant, "m2"), e.payload()) for e in tenths],
    )
    await settle(worker, first)
    iso = queries.iso(datetime.fromtimestamp(start / 1000, UTC))
    until = queries.iso(datetime.fromtimestamp((start + HOUR_MS) / 1000, UTC))
    want = [{"start": iso, "count": 4, "min": 0.0, "max": 3.0, "sum": 6.0, "last": 3.0}]
    args = ("rollup", "--tenant", tenant, "m1", "--metric", "kwh", "--step", "1m")
    result = run_cli(*args, "--since", iso, "--until", until, "--json")
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout) == want
    # The text form rounds away a double's noise: 0.1 + 0.2 reads 0.3.
    text = run_cli("rollup", "--tenant", tenant, "m2", "--metric", "kwh", "--step", "1m",
                   "--since", iso, "--until", until)  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert text.stdout == f"{iso}\tcount=2\tmin=0.1\tmax=0.2\tsum=0.3\tlast=0.2\n"
    # A misspelt metric finds nothing, and says which metrics the tenant has.
    typo = run_cli("rollup", "--tenant", tenant, "m1", "--metric", "kwhh", "--step", "1m",
                   "--since", iso, "--until", until)  # fmt: skip
    assert typo.returncode == 0, typo.stderr
    assert typo.stdout == ""
    # (After it, what the worker's progress says, which depends on the shared keyspace.)
    assert typo.stderr.startswith(
        f"(0 windows of 1m for 'kwhh': tenant {tenant!r} has no such metric; its metrics: kwh"
    )
    # A misspelt tenant has no metrics at all: it said nothing of it. Nor
    # has it the device: exit 1, as history says it (it was 0).
    other = run_cli("rollup", "--tenant", f"{tenant}x", "m1", "--metric", "kwh",
                    "--since", iso, "--until", until, "--json")  # fmt: skip
    assert other.returncode == 1, other.stderr
    assert other.stderr.startswith(
        f"(0 windows of 1m for 'kwh': tenant '{tenant}x' has no metrics recorded; "
        "a misspelt --tenant?"
    )
    # Up to now, the answer says how far the worker has got: windows after
    # its cursor are not there yet (an answer without them said nothing).
    done = await queries.rollups_done_until(db)
    recent = run_cli(*args, "--since", "10m")
    assert recent.returncode == 0, recent.stderr
    assert re.search(r"; (done up to|the roll-up worker is \d+ min behind)", recent.stderr), (
        recent.stderr
    )
    bad = run_cli(*args[:-1], "5m", "--since", iso, "--json")
    assert bad.returncode == 2
    assert "--step" in bad.stderr
    bad = run_cli(*args, "--since", until, "--until", iso, env=base_env())
    assert bad.returncode == 2
    assert "--since" in bad.stderr

    tokens = TokenStore(tmp_path / "tokens.jsonl")
    async with client(db, make_config(), tokens, tenant) as api:
        path = f"/api/v1/tenants/{tenant}/devices/m1/rollups?metric=kwh&step=1m"
        status, body, _ = await api.get(f"{path}&since={iso}&until={until}")
        assert status == 200, body
        assert body["rollups"] == want
        assert done is not None  # this module's gateway wrote marks, so started the cursor
        assert body["done_until"] >= queries.iso(done)  # it only moves on
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/devices/m1/rollups?step=2m")
        assert status == 400
        assert body["detail"].startswith("step:")
        # A range of too many windows names the end the user gave: until
        # alone was blamed on since, 24 h ago by default.
        for query, blamed in (
            ("until=2099-01-01T00:00:00Z", "until"),
            ("since=2000-01-01", "since"),
        ):
            status, body, _ = await api.get(f"{path}&{query}")
            assert status == 400, body
            assert body["detail"].startswith(f"{blamed}: the range holds more than"), body
        status, body, _ = await api.get("/api/v1/tenants/other/devices/m1/rollups")
        assert status == 403
        # As the CLI says it: a misspelt metric, or device, is a 404 naming
        # it (both were a 200 with no windows).
        window = f"since={iso}&until={until}"
        base = f"/api/v1/tenants/{tenant}/devices"
        status, body, _ = await api.get(f"{base}/m1/rollups?metric=kwhh&{window}")
        assert (status, body["error"]) == (404, "not_found"), body
        assert body["detail"] == (
            f"metric: no device of tenant {tenant!r} has sent a metric 'kwhh'; its metrics: 'kwh'"
        )
        status, body, _ = await api.get(f"{base}/m9/rollups?metric=kwh&{window}")
        assert (status, body["detail"]) == (404, f"no device 'm9' in tenant {tenant!r}"), body
        status, body, _ = await api.get(f"{base}/m9/history")
        assert (status, body["detail"]) == (404, f"no device 'm9' in tenant {tenant!r}"), body
        # A known device and metric with nothing in the range: no windows, no error.
        status, body, _ = await api.get(f"{path}&since=2000-01-01T00:00:00Z&until=2000-01-02")
        assert (status, body["rollups"]) == (200, []), body
        status, body, _ = await api.get(f"{base}/m1/history?since=2000-01-01&until=2000-01-02")
        assert (status, body["events"]) == (200, []), body
    # Without metadata no metric is known not to be sent: no windows, no 404.
    async with client(db, make_config(GATEWAY_METADATA__ENABLED="false"), tokens, tenant) as api:
        status, body, _ = await api.get(f"{base}/m1/rollups?metric=kwhh&{window}")
        assert (status, body["rollups"]) == (200, []), body


@pytest.mark.asyncio(loop_scope="session")  # the module's session lives on that loop
async def test_the_worker_waits_while_writes_are_being_retried(session: WriteSession) -> None:
    """A raw row being retried could land after its mark was read: while this
    process retries writes (and a grace period after), no minute is finished."""
    stats = Stats()
    config = make_config(GATEWAY_ROLLUPS__GRACE="1s")
    w = RollupWorker(
        session, config, stats, name=f"test-{uuid.uuid4().hex[:8]}", clock=lambda: time.time() + 120
    )
    first = minute_now()
    await w.start(first)
    stats.retries += 1  # what Requests counts when a write is retried
    assert await w.catch_up() == 0
    assert w.cursor_ms == first
    await asyncio.sleep(1.1)  # the grace period with no further retry
    assert await w.catch_up() >= 1


@pytest.mark.asyncio(loop_scope="session")  # the module's session lives on that loop
async def test_a_grace_within_the_request_timeout_is_warned_of(
    session: WriteSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A mark answered after the grace lands behind the worker's cursor and its
    window is never recomputed: nothing said so when the grace was set below
    the request timeout."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    for grace, warned in (("10s", True), ("11s", False)):
        caplog.clear()
        config = make_config(GATEWAY_ROLLUPS__GRACE=grace, GATEWAY_CASSANDRA__REQUEST_TIMEOUT="10s")
        with caplog.at_level(logging.WARNING, logger="gateway.store.rollups"):
            await RollupWorker(session, config, Stats(), name=name).start()
        said = [r.getMessage() for r in caplog.records if "request_timeout" in r.getMessage()]
        if warned:
            assert len(said) == 1, said
            assert "rollups.grace (10s) is not above cassandra.request_timeout (10s)" in said[0]
        else:
            assert not said, said


@pytest.mark.asyncio(loop_scope="session")  # the module's session lives on that loop
async def test_a_retry_during_a_long_catch_up_stops_it_at_the_next_minute(
    session: WriteSession,
) -> None:
    """A pass that catches up on many due minutes (after a restart or an
    outage) looked at the retries once, before its first minute: a retry
    that began meanwhile did not stop it, so it finished the newest minutes
    while a raw row of theirs could still land after their marks were read."""
    stats = Stats()
    first = minute_now()

    def clock() -> float:
        if w.cursor_ms == first + MINUTE_MS and not stats.retries:
            stats.retries += 1  # the first minute is done: a write is retried now
        return time.time() + 600

    w = RollupWorker(
        session,
        make_config(GATEWAY_ROLLUPS__GRACE="1s"),
        stats,
        name=f"test-{uuid.uuid4().hex[:8]}",
        clock=clock,
    )
    await w.start(first)
    await asyncio.sleep(1.1)  # a worker up for longer than the grace, no retry so far
    assert await w.catch_up() == 1  # ten minutes due; it stops after the first
    assert w.cursor_ms == first + MINUTE_MS


async def test_a_crawling_link_mid_minute_costs_retries_not_the_minute() -> None:
    """Each read and write of the worker is retried on a transient error. A
    minute was all or nothing: one timeout among its requests failed the
    pass, which started the minute over; over a flaky link a minute longer
    than the gaps between timeouts never finished. Here the link crawls
    (its first requests time out), then blinks and is well again."""
    async with proxy() as link:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(link.port), GATEWAY_CASSANDRA__REQUEST_TIMEOUT="1s"
        )
        async with open_write_session(config.cassandra) as session:
            await session.plan_packing()
            stats = Stats()
            w = RollupWorker(session, config, stats, name=f"test-{uuid.uuid4().hex[:8]}")
            await w.start()
            tenant = f"t-{uuid.uuid4().hex[:8]}"
            windows = {(tenant, f"d{i}", minute_now() - MINUTE_MS) for i in range(300)}
            link.limit = 100  # bytes per second towards Cassandra: each request times out
            task = asyncio.create_task(w.recompute(windows))
            await asyncio.sleep(1.5)
            link.limit = None
            link.drop()  # the crawling connections; the driver opens new ones
            async with asyncio.timeout(60):
                await task  # raised the driver's timeout before
            assert stats.rollup_retries > 0
            assert stats.rollup_windows == 300


@pytest.mark.asyncio(loop_scope="session")
async def test_a_minute_is_spread_over_what_is_left_before_the_next_is_due(
    session: WriteSession,
) -> None:
    """recompute() spaces its groups of GROUP windows evenly over ``spread``;
    catch_up() spreads a minute that came due on time over ``rollups.spread``,
    one found late (a restart) over what is left before the next minute comes
    due if that is less, and goes at full speed through a minute once the next
    one is due too (an outage)."""
    stats = Stats()
    w = RollupWorker(session, make_config(), stats, name=f"test-{uuid.uuid4().hex[:8]}")
    await w.start()
    tenant = f"spread-{uuid.uuid4().hex[:8]}"
    start = minute_now() - 10 * MINUTE_MS
    windows = {(tenant, f"d{i:04d}", start) for i in range(2 * rollups.GROUP + 1)}  # 3 groups

    began = time.monotonic()
    await w.recompute(windows, spread=3.0)
    took = time.monotonic() - began
    # Six groups are counted: three of windows, and at most three of hours
    # (one hour per device). These windows have no raw rows, so no hour is
    # merged. Group k starts no sooner than k/6 of 3 s: the third at 1 s.
    assert took >= 0.99, took
    assert stats.rollup_paced_s > 0.5
    paced = stats.rollup_paced_s
    await w.recompute(windows)  # spread 0: no waiting
    assert stats.rollup_paced_s == paced

    seen: list[float] = []

    class Recording(RollupWorker):
        async def process_minute(self, minute_ms: int, spread: float = 0.0) -> None:
            seen.append(spread)

    config = make_config(GATEWAY_ROLLUPS__GRACE="1s", GATEWAY_ROLLUPS__SPREAD="20s")
    now = [0.0]
    clocked = Recording(
        session, config, Stats(), name=f"test-{uuid.uuid4().hex[:8]}", clock=lambda: now[0]
    )
    first = minute_now() - 5 * MINUTE_MS
    now[0] = (first + MINUTE_MS + 1000 + 5000) / 1000  # the first minute, due 5 s ago
    await clocked.start(first)
    assert await clocked.catch_up() == 1
    # Three minutes later: the next two are 125 s and 65 s late (the minute
    # after each is due too), the third 5 s (55 s left: the whole 20 s).
    now[0] += 3 * 60
    assert await clocked.catch_up() == 3
    assert seen == [20.0, 0.0, 0.0, 20.0]
    # 108 s later the next is 53 s late (a restart): 7 s left before the one
    # after it comes due, so 7 s, not 20 and not full speed.
    now[0] += 108
    assert await clocked.catch_up() == 1
    assert seen[-1] == pytest.approx(7.0)


@pytest.mark.asyncio(loop_scope="session")
async def test_while_the_write_path_is_behind_every_minute_is_spread(
    session: WriteSession,
) -> None:
    """A minute found after the next one came due (an outage) goes at full
    speed, except while the write path is behind (the application object
    sets RollupWorker.backlogged to Gateway._behind): then its groups are
    spaced over rollups.spread as a minute on time is, so a draining backlog
    keeps the CPU and Cassandra. The backlog is looked at again while the
    worker waits: once it has drained, the rest goes at once."""

    def worker(spread: str) -> tuple[RollupWorker, Stats]:
        stats = Stats()
        config = make_config(GATEWAY_ROLLUPS__SPREAD=spread)
        return RollupWorker(session, config, stats, name=f"test-{uuid.uuid4().hex[:8]}"), stats

    tenant = f"behind-{uuid.uuid4().hex[:8]}"
    start = minute_now() - 10 * MINUTE_MS
    windows = {(tenant, f"d{i:04d}", start) for i in range(2 * rollups.GROUP + 1)}  # 3 groups

    w, stats = worker("6s")
    await w.start()
    began = time.monotonic()
    await w.recompute(windows)  # nothing behind: full speed, no waiting
    assert stats.rollup_paced_s == 0
    full_speed = time.monotonic() - began

    behind = [True]
    w.backlogged = lambda: behind[0]
    began = time.monotonic()
    await w.recompute(windows)
    took = time.monotonic() - began
    # Six groups counted (three of windows, at most three of hours): the
    # third starts no sooner than 2/6 of 6 s.
    assert took >= 1.99, (took, full_speed)
    assert stats.rollup_paced_s > 1.0

    # Behind at first, then drained 0.5 s in: with a 24 s spread the second
    # group would wait until 4 s; it goes once the drain is seen.
    w, stats = worker("24s")
    await w.start()
    behind = [True]
    w.backlogged = lambda: behind[0]

    async def drained() -> None:
        await asyncio.sleep(0.5)
        behind[0] = False

    began = time.monotonic()
    await asyncio.gather(w.recompute(windows), drained())
    took = time.monotonic() - began
    assert 0.5 <= took < 2.5 + full_speed, (took, full_speed)
    assert stats.rollup_paced_s < 1.0


async def test_rollup_ttls_are_the_tenants_own(
    db: Database, session: WriteSession, tenant: str, gateway: RunningGateway
) -> None:
    """rollup_ttl_1m / rollup_ttl_1h set for one tenant apply to its aggregates
    only; every other tenant keeps the defaults (90 days and 2 years)."""
    other = f"{tenant}x"
    first = minute_now()
    start = BASE + 30 * MINUTE_MS
    sent = [Ev(start + i * 1000, float(i), {}) for i in range(3)]
    await publish_and_wait(
        gateway,
        [(topic(t, "meter"), e.payload()) for t in (tenant, other) for e in sent],
    )
    config = make_config(
        **{
            f"GATEWAY_TENANTS__{tenant.upper()}__ROLLUP_TTL_1M": "2h",
            f"GATEWAY_TENANTS__{tenant.upper()}__ROLLUP_TTL_1H": "3d",
        }
    )
    assert config.tenant(tenant).rollup_ttl_1m == 7200
    w = RollupWorker(session, config, Stats(), name=f"test-{uuid.uuid4().hex[:8]}")
    await w.start(first)
    await settle(w, first)

    async def ttls(t: str, step: int, start_ms: int) -> list[int]:
        rows = await db.execute(
            f"SELECT TTL(count) AS ttl FROM {db.keyspace}.rollups WHERE tenant = %s "
            "AND device_id = 'meter' AND step = %s AND bucket = %s AND metric = 'value'",
            (t, step, datetime.fromtimestamp(queries.rollup_bucket(start_ms, step) / 1000, UTC)),
        )
        return [r.ttl for r in rows]

    hour = start - start % HOUR_MS
    day = 86400
    for t, (ttl_1m, ttl_1h) in ((tenant, (7200, 3 * day)), (other, (90 * day, 730 * day))):
        # Each row's TTL as set, less the seconds since it was written.
        for got, want in ((await ttls(t, 60, start), ttl_1m), (await ttls(t, 3600, hour), ttl_1h)):
            assert got, (t, want)
            assert all(want - 120 < ttl <= want for ttl in got), (t, got, want)


async def test_at_the_mark_cache_bound_a_forgotten_mark_is_written_again_and_counted(
    db: Database, tenant: str, worker: RollupWorker
) -> None:
    """rollups.mark_cache_size bounds what the writer remembers; past it a
    mark is forgotten (counted), written again when its window is touched
    again, and no window goes without its roll-up."""
    topics = '[{template = "rollup-bound/{tenant}/devices/{device_id}/events"}]'
    config = make_config(GATEWAY_TOPICS=topics, GATEWAY_ROLLUPS__MARK_CACHE_SIZE="100")
    first = minute_now()
    start = BASE + 40 * MINUTE_MS

    def message(device: str, i: int) -> tuple[str, bytes]:
        return f"rollup-bound/{tenant}/devices/{device}/events", Ev(start + i, 1.0, {}).payload()

    async with running_gateway(config) as gw:
        # One window each for 150 devices: the first 50 marks are forgotten.
        await publish_and_wait(gw, [message(f"d{i:03}", 0) for i in range(150)])
        assert (gw.stats.rollup_marks, gw.stats.rollup_mark_evictions) == (150, 50)
        # d000's mark was forgotten: touching its window writes it again.
        await publish_and_wait(gw, [message("d000", 1)])
        assert (gw.stats.rollup_marks, gw.stats.rollup_mark_evictions) == (151, 51)
    await settle(worker, first)
    since = datetime.fromtimestamp(start / 1000, UTC)
    for i in range(150):
        got = await queries.rollups(
            db, tenant, f"d{i:03}", "value", 60, since, since + timedelta(minutes=1)
        )
        assert [r.count for r in got] == [2 if i == 0 else 1], i


async def test_many_devices_in_one_pass_each_equal_their_raw_rows(
    db: Database, gateway: RunningGateway, worker: RollupWorker, monkeypatch: Any
) -> None:
    """The worker reads a minute's windows together (device_id IN ...), in
    groups: 150 devices with events on both sides of an hour boundary, some
    late (a second round into windows already rolled up) and some copies.
    With groups of 100 windows (of about 275) and reads of 7 devices (of
    about 25 per window start in a group), both boundaries are crossed,
    and each device's roll-ups must still equal its own raw rows; the
    written batches pack up to 10 windows."""
    monkeypatch.setattr(rollups, "GROUP", 100)
    monkeypatch.setattr(rollups, "READ_IN", 7)
    tenant = f"rupmany{uuid.uuid4().hex[:8]}"
    devices = [f"m{i:03d}" for i in range(150)]

    def event(i: int, second: int) -> tuple[str, bytes]:
        ev = Ev(BASE + second * 1000, float(i % 7) + second / 10, {"a": float(second)})
        return topic(tenant, devices[i]), ev.payload()

    first = [event(i, (i * 37) % 240) for i in range(150)]
    first += [event(i, (i * 11) % 240) for i in range(0, 150, 3)]
    first += first[:20]  # copies
    late = [event(i, (i * 53) % 240) for i in range(0, 150, 2)]
    for batch in (first, late):
        minute = minute_now()
        await publish_and_wait(gateway, batch)
        await settle(worker, minute)
    for device in devices:
        await assert_rollups_match_raw(db, tenant, device)


async def test_the_event_loop_runs_other_tasks_while_a_group_is_decoded_and_aggregated(
    db: Database, gateway: RunningGateway, session: WriteSession
) -> None:
    """The worker decodes and aggregates a group's raw rows on the event loop,
    where the gateway also reads MQTT and writes. It yields every YIELD_ROWS
    rows: for 30 windows of 200 rows each (devices sending 3.3 msg/s, one
    group), 6,000 rows, a task that does nothing but yield runs at least 4
    times between the raw rows' arrival and the end of their decoding, and
    again between that and the end of their aggregation (it ran 0 times in
    each when a group was handled in one go). Each window still counts its
    200 rows."""
    tenant = f"rupslice{uuid.uuid4().hex[:8]}"
    devices = [f"s{i:02d}" for i in range(30)]
    start = BASE - 20 * MINUTE_MS
    await publish_and_wait(
        gateway,
        [
            (topic(tenant, device), Ev(start + k * 250, float(k), {}).payload())
            for device in devices
            for k in range(200)
        ],
    )
    ticks = 0
    seen: list[tuple[str, int]] = []  # (step, the other task's ticks when it ended)

    class Recording(RollupWorker):
        async def _read_in(self, groups: Any, read: Any) -> list[Any]:
            rows = await super()._read_in(groups, read)
            seen.append(("read", ticks))
            return rows

        async def _raw(self, windows: list[tuple[str, str, int]]) -> Any:
            raw = await super()._raw(windows)
            seen.append(("decoded", ticks))
            return raw

        async def _keep_larger(self, computed: Any, step: int, source_ttl: Any) -> None:
            seen.append(("aggregated", ticks))
            await super()._keep_larger(computed, step, source_ttl)

    async def other_task() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    w = Recording(session, make_config(), Stats(), name=f"test-{uuid.uuid4().hex[:8]}")
    await w.start()
    other = asyncio.create_task(other_task())
    try:
        await w.recompute({(tenant, device, start) for device in devices})
    finally:
        other.cancel()
    # The group's index read, its raw read, then the hours' read of minutes.
    steps = [step for step, _ in seen]
    assert steps[:4] == ["read", "read", "decoded", "aggregated"], seen
    (_, arrived), (_, decoded), (_, aggregated) = seen[1:4]
    assert decoded - arrived >= 4, seen
    assert aggregated - decoded >= 4, seen
    since = datetime.fromtimestamp(start / 1000, UTC)
    until = since + timedelta(minutes=1)
    for device in devices:
        got = await queries.rollups(db, tenant, device, "value", 60, since, until)
        assert [(r.count, r.min, r.max) for r in got] == [(200, 0.0, 199.0)], device


async def test_written_batches_stay_under_cassandras_batch_size_warning(
    db: Database, gateway: RunningGateway, worker: RollupWorker, caplog: Any
) -> None:
    """`make run`'s fleet (a value and three metrics per event, ids like
    dev-000001): a minute of 60 devices is rolled up in batches that Cassandra
    does not warn about (batch_size_warn_threshold, 5 KiB of mutations). With
    30 rows to a batch it warned: "Batch for [gateway.rollups] is of size
    7056, exceeding specified threshold of 5120"."""
    tenant = f"rupsize{uuid.uuid4().hex[:8]}"
    metrics = {"temperature": 21.37, "humidity": 45.1, "battery": 97.25}
    batch = [
        (topic(tenant, f"dev-{i:06d}"), Ev(BASE + i * 500, 20.0 + i / 10, metrics).payload())
        for i in range(60)
    ]
    minute = minute_now()
    await publish_and_wait(gateway, batch)
    caplog.set_level("WARNING", logger="cassandra")
    # The C++ driver does not pass the server's warnings on: Cassandra's own
    # log says it, whichever driver the worker uses.
    warned = f"Batch for [{db.keyspace}.rollups]"
    before = CASSANDRA_LOG.read_text(errors="replace").count(warned)
    await settle(worker, minute)
    warnings = [r.getMessage() for r in caplog.records if "Batch for" in r.getMessage()]
    assert warnings == []
    assert CASSANDRA_LOG.read_text(errors="replace").count(warned) == before
    since = datetime.fromtimestamp(BASE / 1000, UTC)
    got = await queries.rollups(
        db, tenant, "dev-000059", "humidity", 60, since, since + timedelta(minutes=1)
    )
    assert [(r.count, r.last) for r in got] == [(1, 45.1)]


async def test_a_worker_on_the_python_driver_equals_the_raw_rows(
    db: Database, gateway: RunningGateway
) -> None:
    """Where acsylla is not installed, or with Cassandra TLS or compression,
    the worker's session is the Python driver's: the same roll-ups, from
    rows that come back as that driver decodes them (timestamps, JSON, pages)."""
    tenant = f"ruppy{uuid.uuid4().hex[:8]}"
    sent = [Ev(BASE + i * 7_000, float(i % 5), {"a": float(i), "b": 0.5}) for i in range(30)]
    minute = minute_now()
    await publish_and_wait(gateway, [(topic(tenant, "meter"), e.payload()) for e in sent])
    config = make_config(GATEWAY_CASSANDRA__DRIVER="python")
    async with open_write_session(config.cassandra) as python_session:
        assert python_session.name.startswith("python")
        w = RollupWorker(python_session, config, Stats(), name=f"test-{uuid.uuid4().hex[:8]}")
        await w.start(minute)
        await settle(w, minute)
    await assert_rollups_match_raw(db, tenant, "meter")


@pytest.mark.asyncio(loop_scope="session")  # the module's session lives on that loop
async def test_a_worker_started_after_another_instance_finds_its_first_marks(
    session: WriteSession,
) -> None:
    """Instance B (rollups.worker = false) started and wrote marks; the only
    worker, on instance A, started a minute later on a keyspace without a
    cursor, and began its cursor at its own start: B's first marks were
    behind it and their windows never rolled up. Every instance that writes
    marks now starts the cursor, whoever comes first."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    start_b = time.time()
    await rollups.RollupMarks(make_config(), Stats(), lambda: start_b, name=name).prepare(session)
    worker_a = RollupWorker(session, make_config(), Stats(), name=name, clock=lambda: start_b + 120)
    await worker_a.start()
    b_minute = int(start_b * 1000) - int(start_b * 1000) % MINUTE_MS
    assert worker_a.cursor_ms == b_minute


@pytest.mark.asyncio(loop_scope="session")  # the module's session lives on that loop
async def test_rollup_lag_grows_while_the_worker_waits_out_write_retries(
    session: WriteSession, caplog: pytest.LogCaptureFixture
) -> None:
    """While this process's writes are retried the worker finishes no minute,
    and it returned before measuring the lag: the gauge stayed 0 with the
    cursor ten minutes behind, for as long as retries kept coming."""
    stats = Stats()
    worker = RollupWorker(
        session,
        make_config(GATEWAY_ROLLUPS__GRACE="30s"),
        stats,
        name=f"test-{uuid.uuid4().hex[:8]}",
        clock=lambda: time.time() + 900,
    )
    caplog.set_level(logging.WARNING, "gateway.store.rollups")
    await worker.start(minute_now())  # the cursor: this minute; the worker's clock: 15 min on
    stats.retries += 1  # the write path retried a request just now
    assert await worker.catch_up() == 0  # it waits
    assert stats.rollup_lag_s > 780, stats.rollup_lag_s
    # Past ten minutes it says so in the log, once (only the gauge showed it).
    assert await worker.catch_up() == 0
    said = [r.getMessage() for r in caplog.records if "min behind, done up to" in r.getMessage()]
    assert len(said) == 1, said
    assert re.match(r"roll-ups: 1[34] min behind", said[0]), said  # 810 s + into this minute


def test_a_rollup_answer_says_how_far_the_worker_has_got_and_where_it_runs() -> None:
    now = datetime(2026, 11, 28, 12, 0, 30, tzinfo=UTC)
    done = datetime(2026, 11, 28, 11, 59, tzinfo=UTC)
    assert rollup_progress(None, now, now, 30, None) == (
        "; no roll-up worker has run in this keyspace (rollups.worker on a gateway)",
        True,
    )
    assert rollup_progress(done, now, now, 30, "gw-a") == (
        "; done up to 2026-11-28T11:59:00.000Z, each minute about 2 min after it began",
        False,
    )
    assert rollup_progress(done, done - timedelta(hours=1), now, 30, "gw-a") == ("", False)
    text, stalled = rollup_progress(done - timedelta(minutes=30), now, now, 30, "gw-a")
    assert stalled
    assert text == (
        "; the roll-up worker is 30 min behind, done up to 2026-11-28T11:29:00.000Z; "
        "it runs on 'gw-a': gateway_rollup_lag_seconds and the log there"
    )
    text, stalled = rollup_progress(done - timedelta(minutes=30), now, now, 30, None)
    assert stalled
    assert text.endswith("; no gateway runs it: is one with rollups.worker = true running?")


async def test_one_tag_parser_for_states_and_metadata(
    db: Database, tenant: str, gateway: RunningGateway, tmp_path: Path
) -> None:
    """A value holding '=' (site = "v=1"): the state list read
    ``tag=site:v=1`` as site, "v=1" (':' first), /meta/devices as "site:v",
    "1" ('=' first), and found nothing. Both split at the first ':' or '='."""
    payload = {"state": "on", "value": 1, "tags": {"site": "v=1", "at": "12:30"}}
    await publish_and_wait(gateway, [(topic(tenant, "colon"), orjson.dumps(payload))])
    tokens = TokenStore(tmp_path / "tokens.jsonl")
    async with client(db, make_config(), tokens, tenant) as api:
        for spelling in ("site:v%3D1", "site=v%3D1", "at=12:30", "at:12:30"):
            status, meta, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/devices?tag={spelling}")
            assert status == 200, meta
            assert meta["devices"] == ["colon"], (spelling, meta)
            status, listed, _ = await api.get(
                f"/api/v1/tenants/{tenant}/states/on/devices?tag={spelling}"
            )
            assert [d["device_id"] for d in listed["devices"]] == ["colon"], (spelling, listed)
    assert queries.parse_tag("site:v=1") == ("site", "v=1")
    assert queries.parse_tag("at=12:30") == ("at", "12:30")
    for bad in ("=x", ":x", "x"):
        with pytest.raises(QueryError, match="expected KEY:VALUE or KEY=VALUE"):
            queries.parse_tag(bad)


async def test_a_tag_key_with_a_separator_and_a_long_value_can_be_filtered_on(
    db: Database, tenant: str, gateway: RunningGateway, tmp_path: Path
) -> None:
    """A key that holds ':' or '=' could not be filtered on (the parameter
    split at the first of them); a value of 513 to 1,024 characters was over
    the parameter's 512; and 1,024 characters of '€' percent-encode to 9,216
    bytes, over aiohttp's 8,190-byte request line: a plain-text 400."""
    long = "€" * 1024
    tags = {"a:b": "1", "k=v": "2", "back\\slash": "3", "long": long}
    await publish_and_wait(
        gateway,
        [(topic(tenant, "odd"), orjson.dumps({"state": "on", "value": 1, "tags": tags}))],
    )
    tokens = TokenStore(tmp_path / "tokens.jsonl")
    spellings = [
        ("a\\:b:1", "a:b"),
        ("a\\:b=1", "a:b"),
        ("k\\=v:2", "k=v"),
        ("back\\\\slash=3", "back\\slash"),
        (f"long:{long}", "long"),
    ]
    async with client(db, make_config(), tokens, tenant) as api:
        for spelling, key in spellings:
            assert queries.parse_tag(spelling) == (key, tags[key])
            tag = quote(spelling, safe="")
            status, meta, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/devices?tag={tag}")
            assert status == 200, meta
            assert meta["devices"] == ["odd"], (spelling, meta)
            status, listed, _ = await api.get(
                f"/api/v1/tenants/{tenant}/states/on/devices?tag={tag}"
            )
            assert status == 200, listed
            assert [d["device_id"] for d in listed["devices"]] == ["odd"], (spelling, listed)
        # The unescaped key splits where it always did: key "a", value "b:1".
        status, meta, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/devices?tag=a:b:1")
        assert (status, meta["devices"]) == (200, []), meta
        status, body, _ = await api.get(f"/api/v1/tenants/{tenant}/meta/devices?tag=k:{'x' * 4095}")
        assert status == 400, body
        assert body["detail"] == "tag: longer than 4096 characters", body
    cli = run_cli("meta", "devices", "--tenant", tenant, "a\\:b=1")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.split() == ["odd"], cli.stdout


async def test_rebuild_rollups_recomputes_what_no_mark_asked_for(
    db: Database, tenant: str, gateway: RunningGateway
) -> None:
    """A window whose marks were missed (another instance's, retried after
    the grace: README, Known limits) stayed as it was until a later event of
    the device touched it, and nothing could recompute it. `gateway
    rebuild-rollups` recomputes every window of the devices that holds raw
    rows in the range, and their hours."""
    w = (int(time.time() * 1000) - 2 * HOUR_MS) // HOUR_MS * HOUR_MS + 10 * MINUTE_MS
    sent = [
        (topic(tenant, "r1"), orjson.dumps({"ts": w + 1_000, "value": 1})),
        (topic(tenant, "r1"), orjson.dumps({"ts": w + 2_000, "value": 2})),
        (topic(tenant, "r1"), orjson.dumps({"ts": w + MINUTE_MS + 5, "value": 5})),
        (topic(tenant, "r2"), orjson.dumps({"ts": w + 30_000, "value": 10})),
        (topic(tenant, "r3"), orjson.dumps({"ts": w - 3 * HOUR_MS, "value": 7})),  # before
    ]
    await publish_and_wait(gateway, sent)
    since = datetime.fromtimestamp((w - HOUR_MS) / 1000, UTC)
    until = datetime.fromtimestamp((w + HOUR_MS) / 1000, UTC)

    async def rollups_of(device: str, step: int) -> list[tuple[int, int, float | None]]:
        rows = await queries.rollups(db, tenant, device, "value", step, since, until)
        return [(as_ms(r.start), r.count, r.sum) for r in rows]

    async def forget() -> None:
        """No roll-up of the tenant's: none was ever computed, or it is wrong."""
        for device in ("r1", "r2", "r3"):
            for step in (60, 3600):
                for bucket in {queries.rollup_bucket(t, step) for t in (w - HOUR_MS, w)}:
                    await db.execute(
                        f"DELETE FROM {db.keyspace}.rollups WHERE tenant = %s AND device_id = %s "
                        "AND step = %s AND bucket = %s",
                        (tenant, device, step, bucket),
                    )

    await forget()
    assert await rollups_of("r1", 60) == []
    span = ["--since", queries.iso(since), "--until", queries.iso(until)]
    raw = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "rebuild-rollups", "--tenant", tenant, *span],
        env=base_env(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    result = subprocess.CompletedProcess(
        raw.args, raw.returncode, raw.stdout.decode(), raw.stderr.decode()
    )
    assert result.returncode == 0, result.stderr
    # Progress into a pipe or a log file is whole lines, not carriage returns
    # (read as bytes: text mode takes a carriage return for a line's end).
    assert b"\r" not in raw.stderr, raw.stderr
    assert "rebuild-rollups: 3 of 3 devices, 3 windows recomputed" in result.stderr.splitlines()
    assert result.stdout.startswith(
        f"recomputed 3 1-minute windows and their hours, of 2 devices of tenant {tenant!r}"
    ), result.stdout
    hour = w - w % HOUR_MS
    assert await rollups_of("r1", 60) == [(w, 2, 3.0), (w + MINUTE_MS, 1, 5.0)]
    assert await rollups_of("r1", 3600) == [(hour, 3, 8.0)]
    assert await rollups_of("r2", 60) == [(w, 1, 10.0)]
    assert await rollups_of("r3", 60) == []  # its row is before the range

    # One device: only its windows.
    await forget()
    result = run_cli("rebuild-rollups", "--tenant", tenant, "r2", *span)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("recomputed 1 1-minute window and its hour, of 1 device")
    assert await rollups_of("r2", 60) == [(w, 1, 10.0)]
    assert await rollups_of("r1", 60) == []

    # A misspelt device beside a real one: the real one is done, the other
    # said, exit 1 (it was ignored without a word, exit 0: CLI probe).
    await forget()
    result = run_cli("rebuild-rollups", "--tenant", tenant, "r2", "r9", *span)
    assert result.returncode == 1
    assert result.stdout.startswith("recomputed 1 1-minute window and its hour, of 1 device")
    assert f"(tenant {tenant!r} has no device 'r9'; a misspelt id or --tenant?)" in result.stderr
    assert await rollups_of("r2", 60) == [(w, 1, 10.0)]
    # A device that has rows, none in the range: said, exit 1 (nothing done).
    result = run_cli("rebuild-rollups", "--tenant", tenant, "r3", *span)
    assert result.returncode == 1
    assert f"(r3: no raw rows from {span[1]} to {span[3]})" in result.stderr
    # A range back to the year 1 reads only the days that hold partitions:
    # it read one empty day after another, for hours (CLI probe).
    await forget()
    result = run_cli(  # it ran for hours: the timeout fails it
        "rebuild-rollups", "--tenant", tenant, "--since", "0001-01-01T00:00:00Z", timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("recomputed 4 1-minute windows and their hours, of 3 devices")
    assert await rollups_of("r1", 60) == [(w, 2, 3.0), (w + MINUTE_MS, 1, 5.0)]
    # A tenant with no raw rows: a misspelt --tenant, said, exit 1.
    result = run_cli("rebuild-rollups", "--tenant", f"{tenant}x", *span)
    assert result.returncode == 1
    assert f"tenant '{tenant}x' has no raw rows; a misspelt --tenant?" in result.stderr


async def _expire_raw(db: Database, tenant: str, device: str) -> None:
    """Delete a device's raw rows, as their TTL would (not waited for here)."""
    for part in await db.execute(
        f"SELECT bucket_start, shard FROM {db.keyspace}.telemetry_partitions "
        "WHERE tenant = %s AND device_id = %s",
        (tenant, device),
    ):
        await db.execute(
            f"DELETE FROM {db.keyspace}.telemetry WHERE tenant = %s AND device_id = %s "
            "AND bucket_start = %s AND shard = %s",
            (tenant, device, part.bucket_start, part.shard),
        )


def _ago(days: int) -> int:
    """An hour start ``days`` days ago (epoch ms)."""
    return (int(time.time() * 1000) - days * 86_400_000) // HOUR_MS * HOUR_MS


async def test_a_copy_after_the_raw_rows_expired_does_not_shrink_the_rollup(
    db: Database, tenant: str, gateway: RunningGateway, session: WriteSession
) -> None:
    """Five events rolled up (count 5, sum 15); their raw rows then expire
    (30 days; deleted here, as the TTL would, rather than waited for) while
    the 1-minute roll-up is kept 90 days. A copy of one of them arrives: the
    window was recomputed from the one raw row left, count 1, sum 1, and its
    hour with it (probe of the roll-ups). Now the stored aggregate, which
    counted the expired rows, is kept."""
    stats = Stats()
    worker = RollupWorker(session, make_config(), stats, name=f"test-{uuid.uuid4().hex[:8]}")
    await worker.start()
    window = _ago(31) + 5 * MINUTE_MS
    sent = [
        (topic(tenant, "d1"), orjson.dumps({"ts": window + i, "value": i + 1})) for i in range(5)
    ]
    since, until = (
        datetime.fromtimestamp(window / 1000, UTC),
        datetime.fromtimestamp((window + MINUTE_MS) / 1000, UTC),
    )
    first = minute_now()
    await publish_and_wait(gateway, sent)
    await settle(worker, first)
    (before,) = await queries.rollups(db, tenant, "d1", "value", 60, since, until)
    assert (before.count, before.sum) == (5, 15.0)
    await _expire_raw(db, tenant, "d1")
    first = minute_now()
    await publish_and_wait(gateway, sent[:1])  # a copy of the first event
    await settle(worker, first)
    (after,) = await queries.rollups(db, tenant, "d1", "value", 60, since, until)
    hour_start = window - window % HOUR_MS
    hour = await queries.rollups(
        db,
        tenant,
        "d1",
        "value",
        3600,
        datetime.fromtimestamp(hour_start / 1000, UTC),
        datetime.fromtimestamp((hour_start + HOUR_MS) / 1000, UTC),
    )
    assert [(after.count, after.sum)] + [(h.count, h.sum) for h in hour] == [(5, 15.0), (5, 15.0)]
    assert stats.rollup_windows_kept >= 1  # (this worker also recomputes other tests' marks)


async def test_an_hour_keeps_what_its_expired_minutes_counted(
    db: Database, tenant: str, gateway: RunningGateway, session: WriteSession
) -> None:
    """An hour is re-merged from its 1-minute rows. A late event into an hour
    whose minutes have expired (90 days after they were written; deleted
    here rather than waited for) re-wrote it from the one minute left: count 1 where it was 5 (probe
    of the roll-ups, with rollup_ttl_1m under an hour, now refused). The
    stored hour is kept; the late event's own minute is rolled up."""
    stats = Stats()
    worker = RollupWorker(session, make_config(), stats, name=f"test-{uuid.uuid4().hex[:8]}")
    await worker.start()
    hour_ms = _ago(91)
    sent = [
        (topic(tenant, "d1"), orjson.dumps({"ts": hour_ms + m * MINUTE_MS, "value": m + 1}))
        for m in range(5)
    ]
    hour = (
        datetime.fromtimestamp(hour_ms / 1000, UTC),
        datetime.fromtimestamp((hour_ms + HOUR_MS) / 1000, UTC),
    )
    first = minute_now()
    await publish_and_wait(gateway, sent)
    await settle(worker, first)
    (before,) = await queries.rollups(db, tenant, "d1", "value", 3600, *hour)
    assert (before.count, before.sum) == (5, 15.0)
    # Raw rows go after 30 days, the minutes after 90: both gone by now.
    await _expire_raw(db, tenant, "d1")
    await db.execute(
        f"DELETE FROM {db.keyspace}.rollups WHERE tenant = %s AND device_id = %s "
        "AND step = 60 AND bucket = %s",
        (tenant, "d1", queries.rollup_bucket(hour_ms, 60)),
    )
    first = minute_now()
    late = orjson.dumps({"ts": hour_ms + 10 * MINUTE_MS, "value": 100})
    await publish_and_wait(gateway, [(topic(tenant, "d1"), late)])
    await settle(worker, first)
    (after,) = await queries.rollups(db, tenant, "d1", "value", 3600, *hour)
    minutes = await queries.rollups(db, tenant, "d1", "value", 60, *hour)
    assert (after.count, after.sum) == (5, 15.0)
    assert [(m.count, m.sum) for m in minutes] == [(1, 100.0)]
    assert stats.rollup_windows_kept >= 1  # (this worker also recomputes other tests' marks)
