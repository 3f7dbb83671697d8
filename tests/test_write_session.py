"""The write session's promises, for both drivers, against the real Cassandra:
exact millisecond timestamps, unset versus null, unlogged batches, USING
TIMESTAMP, lightweight-transaction results, which driver a config picks, and
how many partitions the sink puts in one request."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio

from gateway import repeats
from gateway.config import CassandraConfig, PipelineConfig, TlsConfig
from gateway.errors import ConfigError, SinkError
from gateway.stats import Stats
from gateway.store import write_session
from gateway.store.database import Database
from gateway.store.hot import HotPartitions
from gateway.store.limit import InFlightLimit
from gateway.store.requests import Requests
from gateway.store.sink import Pending, Sink, Write
from gateway.store.write_session import (
    PACK_BYTES,
    UNSET,
    Prepared,
    WriteSession,
    acsylla_installed,
    choose_driver,
    every_node_holds_everything,
    open_write_session,
    value_bytes,
)

from .helpers import ACSYLLA_PLATFORM, DRIVERS, make_config, proxy, self_signed, wait_until

# Some write sessions are read back through `db`, which lives on the session
# loop (conftest.py): every session is opened, and its tests run, on that loop.
on_session_loop = pytest.mark.asyncio(loop_scope="session")

INSERT = (
    "INSERT INTO {keyspace}.telemetry (tenant, device_id, bucket_start, shard, ts, event_id, "
    "state, value, value_num, metrics, tags, received_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) USING TTL ?"
)
TIMESTAMPS = (2, 4, 11)


@pytest.mark.skipif(not ACSYLLA_PLATFORM, reason="pyproject.toml installs no acsylla here")
def test_acsylla_is_installed_where_pyproject_installs_it() -> None:
    # On Linux x86_64 and macOS acsylla is the driver the gateway picks, and
    # the tests below run on it too (DRIVERS): missing there, they fail, never skip.
    assert acsylla_installed()


@pytest_asyncio.fixture(params=DRIVERS, loop_scope="session")
async def session(request: pytest.FixtureRequest, keyspace: str) -> AsyncIterator[WriteSession]:
    config = make_config(GATEWAY_CASSANDRA__DRIVER=request.param).cassandra
    async with open_write_session(config) as opened:
        assert opened.name.startswith(request.param)
        yield opened


@on_session_loop
async def test_millisecond_timestamps_round_trip_exactly(
    session: WriteSession, db: Database, tenant: str
) -> None:
    insert = await session.prepare(INSERT, timestamps=TIMESTAMPS)
    rng = random.Random(7)
    # 1970 to 2100, plus values where ms / 1000 * 1000 truncates one short.
    stamps = [0, 1, 999, 1_000, 4_102_444_799_999, 2_184_396_185_549, 2_175_509_153_569] + [
        rng.randrange(0, 4_102_444_800_000) for _ in range(300)
    ]
    statements = [
        session.bind(insert, (tenant, "d", 0, 0, ts, i, "on", UNSET, UNSET, UNSET, UNSET, ts, 600))
        for i, ts in enumerate(stamps)
    ]
    for start in range(0, len(statements), 50):
        await session.execute(session.batch(statements[start : start + 50]))
    rows = await db.execute(
        f"SELECT event_id, toUnixTimestamp(ts) AS ts, toUnixTimestamp(received_at) AS rcv "
        f"FROM {db.keyspace}.telemetry WHERE tenant = %s AND device_id = 'd' "
        "AND bucket_start = 0 AND shard = 0",
        (tenant,),
    )
    got = {r.event_id: (r.ts, r.rcv) for r in rows}
    assert got == {i: (ts, ts) for i, ts in enumerate(stamps)}


@on_session_loop
async def test_unset_keeps_a_column_and_none_clears_it(
    session: WriteSession, db: Database, tenant: str
) -> None:
    insert = await session.prepare(
        "INSERT INTO {keyspace}.latest_events_by_device (tenant, device_id, state, ts, value, "
        "value_num, metrics, tags) VALUES (?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?",
        timestamps=(3,),
    )
    first = (tenant, "d", "on", 1_000, "first", 1.5, {"t": 2.0}, {"k": "v"}, 10)
    await session.execute(session.bind(insert, first))
    # state unset (kept), value null (cleared), the rest replaced.
    second = (tenant, "d", UNSET, 2_000, None, 2.5, {"t": 3.0}, {"k": "w"}, 20)
    await session.execute(session.bind(insert, second))
    rows = await db.execute(
        f"SELECT state, value, value_num, metrics, tags, WRITETIME(value_num) AS wt, "
        f"WRITETIME(state) AS state_wt FROM {db.keyspace}.latest_events_by_device "
        "WHERE tenant = %s AND device_id = 'd'",
        (tenant,),
    )
    row = rows[0]
    assert (row.state, row.value, row.value_num) == ("on", None, 2.5)
    assert (dict(row.metrics), dict(row.tags)) == ({"t": 3.0}, {"k": "w"})
    assert (row.wt, row.state_wt) == (20, 10)  # USING TIMESTAMP bound as given


@on_session_loop
async def test_reads_and_lightweight_transactions_give_dicts(
    session: WriteSession, tenant: str
) -> None:
    register = await session.prepare(
        "INSERT INTO {keyspace}.tenant_states (tenant, state, registered_at) "
        "VALUES (?, ?, ?) IF NOT EXISTS",
        timestamps=(2,),
    )
    first = await session.execute(session.bind(register, (tenant, "on", 1_234)))
    assert first[0]["[applied]"] is True
    again = await session.execute(session.bind(register, (tenant, "on", 5_678)))
    assert again[0]["[applied]"] is False
    registered = again[0]["registered_at"]
    assert registered.replace(tzinfo=UTC) == datetime(1970, 1, 1, 0, 0, 1, 234_000, tzinfo=UTC)
    select = await session.prepare("SELECT state FROM {keyspace}.tenant_states WHERE tenant = ?")
    assert await session.execute(session.bind(select, (tenant,))) == [{"state": "on"}]
    assert await session.execute(session.bind(select, ("nobody-" + uuid.uuid4().hex,))) == []


async def _one_partition_of(session: WriteSession, tenant: str, count: int) -> Prepared:
    """``count`` telemetry rows of device "d" in one partition (event ids 0 to
    count - 1), written 50 to a batch; and the SELECT of their event ids."""
    insert = await session.prepare(INSERT, timestamps=TIMESTAMPS)
    statements = [
        session.bind(
            insert,
            (tenant, "d", 0, 0, 1_000 + i, i, UNSET, UNSET, float(i), UNSET, UNSET, 1_000, 600),
        )
        for i in range(count)
    ]
    await asyncio.gather(
        *(
            session.execute(session.batch(statements[start : start + 50]))
            for start in range(0, count, 50)
        )
    )
    return await session.prepare(
        "SELECT event_id FROM {keyspace}.telemetry WHERE tenant = ? AND device_id = 'd' "
        "AND bucket_start = ? AND shard = 0",
        timestamps=(1,),
    )


@on_session_loop
async def test_a_read_of_more_than_a_page_returns_every_row(
    session: WriteSession, tenant: str
) -> None:
    """read() fetches 5,000 rows a page with either driver and returns them
    all: the roll-up worker's reads of a busy minute can run past a page,
    and a row left out would be an aggregate wrong."""
    count = 5_050
    select = await _one_partition_of(session, tenant, count)
    rows = await session.read(select, (tenant, 0))
    assert sorted(r["event_id"] for r in rows) == list(range(count))


@pytest.mark.skipif(not ACSYLLA_PLATFORM, reason="pyproject.toml installs no acsylla here")
@on_session_loop
async def test_a_read_lets_other_tasks_run_while_it_decodes_a_page(
    keyspace: str, tenant: str
) -> None:
    """The C++ driver hands the event loop a whole page (up to 5,000 rows),
    and decoding it in one go held the loop for up to 50 ms: the roll-up
    worker's reads, on the loop that also reads MQTT and acknowledges
    (bench/rollup_stalls.py). read() yields every YIELD_ROWS rows: for a page
    of 3,000 rows, a task that does nothing but yield runs at least twice
    between the page's arrival and read()'s return (it ran 0 times before).
    Every row is still returned."""
    config = make_config(GATEWAY_CASSANDRA__DRIVER="acsylla").cassandra
    count = 3 * write_session.YIELD_ROWS
    async with open_write_session(config) as session:
        assert isinstance(session, write_session.AcsyllaSession)
        select = await _one_partition_of(session, tenant, count)
        ticks = 0
        arrived: list[int] = []  # the other task's ticks when each page came
        driver = session._session

        class Recording:
            """The driver's session, noting when each answer comes (the
            compiled AcsyllaSession calls its own methods natively, so only
            the object it calls out to can be wrapped)."""

            def execute(self, statement: Any) -> Any:
                async def answered() -> Any:
                    result = await driver.execute(statement)
                    arrived.append(ticks)
                    return result

                return answered()

        async def other_task() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0)
                ticks += 1

        session._session = Recording()
        other = asyncio.create_task(other_task())
        try:
            rows = await session.read(select, (tenant, 0))
            returned = ticks
        finally:
            other.cancel()
            session._session = driver
    assert len(arrived) == 1, arrived  # one page
    assert returned - arrived[0] >= 2, (arrived, returned)
    assert sorted(r["event_id"] for r in rows) == list(range(count))


@on_session_loop
async def test_both_drivers_pack_partitions_into_shared_batches_on_one_node(
    session: WriteSession, db: Database, tenant: str
) -> None:
    """Up to 10 partitions with the same replicas per request (the Python
    driver asks its token map; acsylla packs because the one node holds every
    partition), never over PACK_BYTES of values, and every row lands."""
    await session.plan_packing()
    assert session.batch_partitions == 10
    insert = await session.prepare(
        "INSERT INTO {keyspace}.latest_events_by_device (tenant, device_id, state, ts, value) "
        "VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ?",
        timestamps=(3,),
    )
    stats = Stats()
    limit = InFlightLimit(stats, initial=64, minimum=64, maximum=64)
    requests = Requests(session, session.config, stats, limit)
    hot = HotPartitions(10.0, 1_000_000, 10_000, stats)
    done = asyncio.Event()
    left = 0

    def one_done() -> None:
        nonlocal left
        left -= 1
        if left == 0:
            done.set()

    big = "x" * (PACK_BYTES // 2)  # two of these do not fit one batch
    values = {f"d{i:02}": "small" for i in range(40)} | {f"big{i}": big for i in range(3)}
    writes = []
    for device, value in values.items():
        row = (tenant, device, "on", 1_000, value, 10)
        writes.append(Write(("device", tenant, device), insert, row, Pending(one_done)))
        left += 1
    async with Sink(requests, PipelineConfig(), hot, stats) as sink:
        async with asyncio.timeout(30):
            await sink.submit(writes)
            await done.wait()
    # The 40 small ones in 4 batches of 10, the 3 big ones each alone.
    assert stats.requests == 4 + 3
    devices = ", ".join(f"'{d}'" for d in values)
    rows = await db.execute(
        f"SELECT device_id, value FROM {db.keyspace}.latest_events_by_device "
        f"WHERE tenant = %s AND device_id IN ({devices})",
        (tenant,),
    )
    assert {r.device_id: r.value for r in rows} == values


@on_session_loop
async def test_a_new_sink_counts_its_own_requests_not_the_last_ones(
    session: WriteSession,
) -> None:
    """The stats outlive a sink: in spool mode a gateway whose writes failed
    for give_up_after closes and opens again in one process. The old sink's
    requests cancelled before they ran never counted themselves out of
    stats.in_flight, and the new sink counted on from there: its drain()
    (before a state partition's rotation) waited for good, and the write
    loop with it."""
    stats = Stats()
    stats.in_flight = 3  # what an aborted sink left behind
    limit = InFlightLimit(stats, initial=64, minimum=64, maximum=64)
    requests = Requests(session, session.config, stats, limit)
    hot = HotPartitions(10.0, 1_000_000, 10_000, stats)
    async with Sink(requests, PipelineConfig(), hot, stats) as sink:
        assert stats.in_flight == 0
        assert sink.idle
        async with asyncio.timeout(1):
            await sink.drain()


class OneRangeDown:
    """Makes one request fail as a write to a token range with too few
    replicas up does (a cluster at RF 2 with one node down): the fault
    injected, at the driver (the compiled session's own methods cannot be
    patched). Every other request goes to the real Cassandra."""

    def __init__(self, session: WriteSession) -> None:
        self.down: Any = None
        self.attempts = 0
        if isinstance(session, write_session.AcsyllaSession):
            driver = session._session
            fault = self

            class Driver:
                def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
                    if statement is fault.down:
                        return fault.fail()
                    return driver.execute(statement, *args, **kwargs)

                def __getattr__(self, name: str) -> Any:
                    return getattr(driver, name)

            session._session = Driver()
        else:
            assert isinstance(session, write_session.PythonSession)
            db = session._db
            execute_timed = db.execute_timed

            async def faulty(request: Any, **kwargs: Any) -> Any:
                if request is self.down:
                    return await self.fail()
                return await execute_timed(request, **kwargs)

            db.execute_timed = faulty  # type: ignore[method-assign,assignment]

    async def fail(self) -> Any:
        self.attempts += 1
        await asyncio.sleep(0.002)  # a coordinator's round trip
        raise ConnectionError("Unavailable: 2 replicas needed, 1 alive")


async def _one_range_down(
    session: WriteSession, tenant: str, give_up: float
) -> tuple[Requests, OneRangeDown, Prepared]:
    """Requests over ``session`` giving up after ``give_up`` s, one write of
    which (``faulty.down``) fails as a token range short of replicas does;
    and the insert it binds."""
    insert = await session.prepare(
        "INSERT INTO {keyspace}.latest_events_by_device (tenant, device_id, state, ts, value) "
        "VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ?",
        timestamps=(3,),
    )
    faulty = OneRangeDown(session)
    stats = Stats()
    limit = InFlightLimit(stats, initial=64, minimum=64, maximum=64)
    config = session.config.model_copy(update={"give_up_after": give_up})
    requests = Requests(session, config, stats, limit)
    faulty.down = requests.bind(insert, (tenant, "down", "on", 1_000, "x", 10))
    return requests, faulty, insert


@on_session_loop
async def test_one_failing_request_backs_off_and_gives_up_while_others_succeed(
    session: WriteSession, tenant: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Other requests' answers neither cut a failing request's backoff short
    nor reset its give_up_after; /healthz's failing_for stays on meanwhile, and
    the failure is logged once, not once per retry."""
    give_up = 2.0
    requests, faulty, insert = await _one_range_down(session, tenant, give_up)
    stop = asyncio.Event()
    answered = 0
    failing_for: list[float] = []

    async def others() -> None:
        nonlocal answered
        while not stop.is_set():
            row = (tenant, f"up{answered % 10}", "on", 1_000 + answered, "x", 10)
            await requests.send(requests.bind(insert, row), 1)
            answered += 1
            failing_for.append(requests.failing_for or 0.0)
            await asyncio.sleep(0.01)

    caplog.set_level(logging.WARNING, logger="gateway.store.requests")
    beside = asyncio.create_task(others())
    started = time.monotonic()
    try:
        with pytest.raises(SinkError, match="give_up_after"):
            async with asyncio.timeout(give_up + 8):
                await requests.send(faulty.down, 1)
        # Timed here: awaiting the others' last request is not the give-up's
        # time (a CI run's took 5.2 s with it, on a loaded box).
        took = time.monotonic() - started
    finally:
        stop.set()
        await beside
    assert answered >= 10, answered  # the others went on all along
    assert give_up <= took < give_up + 1.5, took
    # Backoff from 50 ms, doubling, each sleep 0.5 to 1 of it: 7 attempts
    # fit 2 s at the shortest draws. Woken by every other answer, it made one
    # per answer.
    assert faulty.attempts <= 8, faulty.attempts
    assert max(failing_for) >= give_up / 2, failing_for
    logged = [r.getMessage() for r in caplog.records]
    assert sum("failed, retrying" in m for m in logged) == 1, logged
    assert not any("succeed again" in m for m in logged), logged


@on_session_loop
async def test_the_give_up_comes_at_give_up_after_not_a_backoff_later(
    session: WriteSession, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the longest jitter draws a failing request sleeps 100 ms, 200, 400
    and 800 (1.5 s in all) and fails a fifth time short of give_up_after 2
    s; its next sleep, 1.6 s in full, would give up at 3.1 s. The sleep ends
    at 2 s instead, and one more attempt decides. (With give_up_after 1.6 s
    the fifth attempt itself came after 1.6 s on a loaded CI box, the
    attempts' own round trips added to the sleeps, and gave up with no
    sleep to cut short.)"""
    give_up = 2.0
    requests, faulty, _ = await _one_range_down(session, tenant, give_up)
    monkeypatch.setattr(random, "random", lambda: 1.0)  # every sleep drawn in full
    started = time.monotonic()
    with pytest.raises(SinkError, match="give_up_after"):
        async with asyncio.timeout(give_up + 8):
            await requests.send(faulty.down, 1)
    took = time.monotonic() - started
    assert give_up <= took < give_up + 0.8, took
    assert faulty.attempts == 6, faulty.attempts  # 5 within, and the one at 2 s


@on_session_loop
async def test_tables_lists_the_schema(session: WriteSession) -> None:
    tables = await session.tables()
    assert tables is not None
    assert {"telemetry", "latest_events_by_state", "rejected_messages"} <= tables


@on_session_loop
async def test_a_bad_statement_is_not_transient(session: WriteSession) -> None:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the driver's own type
        await session.prepare("INSERT INTO {keyspace}.no_such_table (a) VALUES (?)")
    assert not isinstance(caught.value, session.transient)


@pytest.mark.skipif(not ACSYLLA_PLATFORM, reason="pyproject.toml installs no acsylla here")
def test_auto_prefers_acsylla_and_falls_back_for_tls(tmp_path: Path) -> None:
    assert choose_driver(CassandraConfig()) == "acsylla"
    assert choose_driver(CassandraConfig(driver="python")) == "python"
    tls = TlsConfig(enabled=True)
    assert choose_driver(CassandraConfig(tls=tls)) == "python"
    with pytest.raises(ConfigError, match=r"cassandra\.tls\.ca_file"):
        make_config(GATEWAY_CASSANDRA__DRIVER="acsylla", GATEWAY_CASSANDRA__TLS__ENABLED="true")
    ca, _ = self_signed(tmp_path)
    with_ca = TlsConfig(enabled=True, ca_file=ca)
    assert choose_driver(CassandraConfig(driver="acsylla", tls=with_ca)) == "acsylla"


def test_without_acsylla_auto_is_python_and_acsylla_is_a_config_error() -> None:
    # As on Linux aarch64, where pyproject.toml installs no acsylla.
    assert choose_driver(CassandraConfig(), acsylla=False) == "python"
    assert choose_driver(CassandraConfig(driver="python"), acsylla=False) == "python"
    with pytest.raises(ConfigError, match="acsylla is not installed"):
        choose_driver(CassandraConfig(driver="acsylla"), acsylla=False)


def test_unknown_driver_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"cassandra\.driver"):
        make_config(GATEWAY_CASSANDRA__DRIVER="java")


def test_acsylla_packs_only_where_every_node_holds_every_partition() -> None:
    simple = "org.apache.cassandra.locator.SimpleStrategy"
    nts = "org.apache.cassandra.locator.NetworkTopologyStrategy"
    assert every_node_holds_everything({"class": simple, "replication_factor": "1"}, ["dc1"])
    assert every_node_holds_everything({"class": simple, "replication_factor": "3"}, ["dc1"] * 3)
    assert not every_node_holds_everything({"class": simple, "replication_factor": "1"}, ["a"] * 3)
    two_dcs = ["dc1"] * 3 + ["dc2"] * 2
    assert every_node_holds_everything({"class": nts, "dc1": "3", "dc2": "2"}, two_dcs)
    assert not every_node_holds_everything({"class": nts, "dc1": "3"}, two_dcs)
    assert not every_node_holds_everything({"class": nts, "dc1": "2", "dc2": "2"}, two_dcs)
    assert not every_node_holds_everything({}, ["dc1"])  # keyspace not found
    assert not every_node_holds_everything({"class": simple}, ["dc1"])


def test_value_bytes_estimates_what_a_row_binds() -> None:
    assert value_bytes(["tenant", b"ab", 3, 2.5, None, UNSET, {"k": "vv", "n": 1.0}]) == (
        6 + 2 + 8 + 8 + 0 + 0 + len('{"k":"vv","n":1.0}')
    )
    assert value_bytes([OrderedDict(k="vv")]) == len('{"k":"vv"}')  # a dict of another class


def test_the_c_driver_s_connection_messages_are_warnings_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A link flapping for 90 s: 66 ERROR lines "C++ driver: Socket read error
    'connection reset by peer'" (journalctl -p err filled up), while the
    gateway's own lines about the outage were held to once a minute. The
    driver's connection messages are now warnings, each kind at most once a
    minute, saying how many were held back; its other messages pass as they did."""
    now = [1000.0]
    forward = write_session.DriverLog(clock=lambda: now[0])

    def said(text: str, level: str = "error") -> None:
        forward(SimpleNamespace(message=text, log_level=level.upper()))

    reset = "Socket read error 'connection reset by peer'"
    control = (
        "Unable to establish a control connection to host 127.0.0.1 because of the "
        "following error: Connection closed prematurely"
    )
    with caplog.at_level(logging.DEBUG, logger="gateway.store.write_session"):
        for _ in range(90):  # one of each a second for 90 s
            said(reset)
            said(control.replace("127.0.0.1", "10.0.0.7") if now[0] % 2 else control)
            now[0] += 1
        said("Unable to bind statement: wrong type", "error")  # not the link's
        said("no sharding info: ok on Cassandra", "warn")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("WARNING", f"C++ driver: {reset}"),
        ("WARNING", f"C++ driver: {control}"),
        ("WARNING", f"C++ driver: {reset} (59 more like it held back over the last 60 s)"),
        (
            "WARNING",
            f"C++ driver: {control} (59 more like it held back over the last 60 s)",
        ),
        ("ERROR", "C++ driver: Unable to bind statement: wrong type"),
        ("DEBUG", "C++ driver: no sharding info: ok on Cassandra"),
    ]
    # Bounded: a driver saying ever new things keeps a small table.
    for host in range(1000):
        name = "".join(chr(ord("a") + int(digit)) for digit in str(host))
        said(f"Connection pool was unable to connect to host {name}")
    assert len(forward.last) <= repeats.KINDS


def test_the_c_driver_s_warnings_are_said_once_a_minute_and_its_shard_chatter_is_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CI saw a gateway's requests answered "no hosts available" for over a
    minute with nothing in the log saying why: the driver logged at ERROR
    only, and what says why (a host overloaded, a connection closed after a
    server error, a pool that cannot reconnect) are its warnings. They are
    said now, each kind once a minute. Its "no sharding info" line, which
    names a connection, had been said once a minute as a warning on every
    Cassandra connection: it is DEBUG."""
    now = [1000.0]
    forward = write_session.DriverLog(clock=lambda: now[0])
    overloaded = "Host 127.0.0.1 is overloaded."
    shards = (
        "Could not retrieve sharding info from connection to 127.0.0.1. "
        "Continuing WITHOUT SHARD-AWARENESS."
    )
    with caplog.at_level(logging.DEBUG, logger="gateway.store.write_session"):
        for _ in range(30):
            forward(SimpleNamespace(message=overloaded, log_level="WARN"))
            forward(SimpleNamespace(message=shards, log_level="ERROR"))
            now[0] += 1
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines.count(("WARNING", f"C++ driver: {overloaded}")) == 1
    assert lines.count(("DEBUG", f"C++ driver: {shards}")) == 30
    assert len(lines) == 31


async def test_a_closed_acsylla_session_opens_no_new_one(keyspace: str) -> None:
    """A request still under way at close (the link probe is shielded from
    the stop) that finds no host must not open a new driver session, which
    nothing would close."""
    config = make_config(
        GATEWAY_CASSANDRA__DRIVER="acsylla", GATEWAY_CASSANDRA__RENEW_AFTER="1ms"
    ).cassandra
    async with open_write_session(config) as opened:
        assert isinstance(opened, write_session.AcsyllaSession)
    opened._found_no_host()  # what a request that found no host calls
    await asyncio.sleep(0.01)
    opened._found_no_host()
    assert opened._renewing is None


def _said_by_the_driver(caplog: pytest.LogCaptureFixture) -> bool:
    return any("C++ driver" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not ACSYLLA_PLATFORM, reason="pyproject.toml installs no acsylla here")
async def test_the_c_driver_still_reports_after_another_session_of_the_process_closes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acsylla gives the C++ driver one logging callback for the whole
    process, set by each cluster it creates and cleared by each one closed.
    `gateway run` opens two (the write path's and the roll-up worker's), and
    closes one when it replaces a session that gave its host up, or when a
    replacement cannot connect: from then on the driver's warnings and errors
    reached no log, for any session, until a restart. Here a second session
    opens and closes beside the first; then the first one's link drops."""
    # A fresh one: no kind of line held back from an earlier test.
    monkeypatch.setattr(write_session, "_forward_log", write_session.DriverLog())
    async with proxy() as link:
        config = make_config(
            GATEWAY_CASSANDRA__PORT=str(link.port), GATEWAY_CASSANDRA__DRIVER="acsylla"
        ).cassandra
        async with open_write_session(config) as kept:
            local = await kept.prepare("SELECT release_version FROM system.local")
            async with open_write_session(config):
                pass
            with caplog.at_level(logging.WARNING, logger="gateway.store.write_session"):
                link.drop()
                await wait_until(
                    lambda: _said_by_the_driver(caplog),
                    15,
                    "the link dropped and the C++ driver said something",
                )

            async def answers() -> bool:
                try:
                    await kept.read(local, ())
                except Exception:
                    return False
                return True

            # and the session still works once the driver has reconnected
            await wait_until(answers, 30, "the kept session answers again", interval=0.2)


@pytest.mark.skipif(not ACSYLLA_PLATFORM, reason="pyproject.toml installs no acsylla here")
async def test_sessions_of_one_config_share_a_cluster_closed_with_the_last(keyspace: str) -> None:
    """The reason is above; the bound: one cluster per config open at once."""
    config = make_config(GATEWAY_CASSANDRA__DRIVER="acsylla").cassandra
    same = make_config(GATEWAY_CASSANDRA__DRIVER="acsylla").cassandra  # equal, not the same object
    other = make_config(
        GATEWAY_CASSANDRA__DRIVER="acsylla", GATEWAY_CASSANDRA__REQUEST_TIMEOUT="7s"
    ).cassandra
    before = len(write_session._clusters)
    async with (
        open_write_session(config) as a,
        open_write_session(same) as b,
        open_write_session(other) as c,
    ):
        assert isinstance(a, write_session.AcsyllaSession)
        assert isinstance(b, write_session.AcsyllaSession)
        assert isinstance(c, write_session.AcsyllaSession)
        assert a._cluster is b._cluster
        assert c._cluster is not a._cluster
        assert len(write_session._clusters) == before + 2
        async with open_write_session(config):
            assert len(write_session._clusters) == before + 2
        # the first two still work after the third closed
        for opened in (a, b):
            local = await opened.prepare("SELECT release_version FROM system.local")
            assert await opened.read(local, ())
    assert len(write_session._clusters) == before


def test_repeats_says_how_many_it_held_back_once_the_minute_is_over() -> None:
    """The rule both drivers' lines go through (gateway/repeats.py)."""
    now = [0.0]
    said = repeats.Repeats(clock=lambda: now[0])
    retry = "Error attempting to reconnect to 127.0.0.1:9042, scheduling retry in {} seconds"
    out = []
    for delay in (1, 2, 4, 8, 10, 10, 10, 10, 10, 10):  # retries at 0, 1, 3, 7, 15, ... 65 s
        out.append(said.say(retry.format(delay)))
        now[0] += delay
    assert out == [
        retry.format(1),
        *[None] * 8,
        retry.format(10) + " (8 more like it held back over the last 65 s)",
    ]
