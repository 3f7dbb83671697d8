"""The fault tests in spool mode (issue 16): Cassandra away under load, SIGKILL
while the spool commits, the spool's bound reached, and the disk full.

None of them touches the shared services: Cassandra is cut through the
cuttable proxy of helpers.py, which the gateway reaches instead of
127.0.0.1:9042, and the full disk is a tiny tmpfs of the test's own. Each
gateway subscribes only to its test's tenant (a template with a fixed tenant),
so its counters (``acked``, the spool's depth) count that test's messages
alone, whatever else is published on the shared broker.

The promise checked everywhere: nothing acknowledged is lost (every message
the broker PUBACKed to the publisher ends up in Cassandra), and the gateway
says what it is doing (log lines, /healthz, /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from gateway.errors import SpoolDiskFull, SpoolError
from gateway.ingest.receive import Delivery
from gateway.ingest.spool import READ_ONLY_WHY, Record, Spool, SpoolSource
from gateway.stats import Stats
from gateway.store.database import Database

from .helpers import (
    CQL_PORT,
    Acks,
    CuttableProxy,
    GatewayProcess,
    Publisher,
    Unfed,
    Unpaused,
    assert_all_stored,
    base_env,
    free_port,
    http_get,
    make_config,
    proxy,
    publish,
    rejected_since,
    run_cli,
    running_gateway,
    telemetry_keys,
    topic,
    wait_until,
)

# The outage of the first test, in seconds. The issue asks for "minutes"; make
# test's budget allows a quarter of one. SPOOL_OUTAGE_S=180 runs the long version.
OUTAGE_S = float(os.environ.get("SPOOL_OUTAGE_S", "15"))


def _own_topics(tenant: str) -> str:
    """GATEWAY_TOPICS for a gateway that subscribes to this tenant's devices only."""
    return f'[{{template = "tenants/{tenant}/devices/{{device_id}}/events", tenant = "{tenant}"}}]'


def _spool_env(
    tenant: str, spool: Path, cassandra_port: int, api_port: int, **extra: str
) -> dict[str, str]:
    return {
        "GATEWAY_TOPICS": _own_topics(tenant),
        "GATEWAY_CASSANDRA__PORT": str(cassandra_port),
        "GATEWAY_SAMPLING__ENABLED": "false",
        "GATEWAY_SPOOL__ENABLED": "true",
        "GATEWAY_SPOOL__PATH": str(spool),
        "GATEWAY_API__PORT": str(api_port),
        # Stopping with Cassandra away waits this long for the writes under way
        # (then leaves them in the spool): not 10 s here.
        "GATEWAY_PIPELINE__SHUTDOWN_DEADLINE": "1",
        **extra,
    }


async def _healthz(port: int) -> tuple[int, dict[str, object]]:
    code, body = await asyncio.to_thread(http_get, port, "/healthz")
    checks = orjson.loads(body)["checks"]
    assert isinstance(checks, dict)
    return code, checks


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$")


async def _metrics(port: int) -> dict[str, float]:
    """The unlabelled samples of /metrics (labelled ones summed by name)."""
    code, body = await asyncio.to_thread(http_get, port, "/metrics")
    assert code == 200
    samples: dict[str, float] = {}
    for line in body.decode().splitlines():
        if match := _SAMPLE.match(line):
            name, value = match.groups()
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def _published(publisher: Publisher) -> int:
    """Messages the broker PUBACKed to the publisher so far (read from its thread)."""
    return sum(len(events) for events in list(publisher.published.values()))


# ---------------------------------------------------------------- Cassandra away under load


@pytest.mark.slow
async def test_cassandra_away_under_load_the_spool_keeps_acknowledging(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """A fleet publishes steadily while the link to Cassandra is cut for
    OUTAGE_S seconds (15 by default; SPOOL_OUTAGE_S=180 for three minutes):
    the gateway keeps acknowledging, so the broker's backlog for its session
    stays small, and says it is spooling; once the link is back everything
    is in Cassandra and the spool is empty. (Past cassandra.give_up_after,
    10 min, the gateway closes and spools until Cassandra answers: the test
    below.)"""
    api = free_port()
    rate = 200
    async with proxy() as link:
        gw = gateway_process(**_spool_env(tenant, tmp_path / "spool.sqlite", link.port, api))
        # Off the loop: the proxy runs on it, and the gateway connects through it.
        await asyncio.to_thread(gw.start)
        publisher = Publisher(tenant, devices=20, rate=rate, count=int(rate * (OUTAGE_S + 8)))
        publisher.start()

        async def written(at_least: int) -> bool:
            return (await _metrics(api))["gateway_events_written_total"] >= at_least

        await wait_until(lambda: written(rate), 30, "the fleet being written", interval=0.2)
        await link.cut()
        cut = time.monotonic()
        acked_at_cut = (await _metrics(api))["gateway_acks_sent_total"]
        published_at_cut = _published(publisher)
        backlog = depth = 0.0
        said_spooling = False
        while time.monotonic() - cut < OUTAGE_S:
            await asyncio.sleep(1)
            metrics = await _metrics(api)  # before counting published: never under-counts
            backlog = max(backlog, _published(publisher) - metrics["gateway_acks_sent_total"])
            depth = max(depth, metrics["gateway_spool_depth"])
            code, checks = await _healthz(api)
            if str(checks["cassandra"]).startswith("spooling, Cassandra unreachable since "):
                assert code == 503
                said_spooling = True
        metrics = await _metrics(api)
        acked_in_outage = metrics["gateway_acks_sent_total"] - acked_at_cut
        published_in_outage = _published(publisher) - published_at_cut
        assert said_spooling, "/healthz never said it was spooling"
        assert "status: spooling, Cassandra unreachable since " in gw.output()
        # Acknowledged all along: without the spool the backlog would have grown
        # to mqtt.receive_maximum (1,000) within 5 s, and stayed there.
        assert published_in_outage >= 0.5 * rate * OUTAGE_S  # the fleet kept going
        assert acked_in_outage >= 0.9 * published_in_outage, (acked_in_outage, metrics)
        assert backlog < 1000, backlog
        assert depth >= 0.9 * published_in_outage, depth
        assert metrics["gateway_events_written_total"] < _published(publisher)
        await link.start()  # the link is back, on the same port
        await _all_stored_and_drained(db, tenant, publisher, gw, api)
    out = gw.output()
    assert "Cassandra writes succeed again after" in out
    logging.getLogger(__name__).info(
        "outage %.0f s: max backlog %d, max spool depth %d", OUTAGE_S, backlog, depth
    )


async def test_writes_failing_past_give_up_after_go_back_to_spooling(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """In spool mode, writes failing for cassandra.give_up_after made the
    gateway exit 1, for the service manager to start it again into spooling:
    a host without one (a container without a restart policy, a terminal)
    stopped taking messages. Now it closes the gateway and spools in the
    same process, and opens it again once Cassandra answers."""
    api = free_port()
    rate = 100
    async with proxy() as link:
        gw = gateway_process(
            **_spool_env(
                tenant,
                tmp_path / "spool.sqlite",
                link.port,
                api,
                GATEWAY_CASSANDRA__GIVE_UP_AFTER="3s",
                GATEWAY_CASSANDRA__REQUEST_TIMEOUT="1s",
            )
        )
        await asyncio.to_thread(gw.start)
        publisher = Publisher(tenant, devices=10, rate=rate, count=rate * 16)
        publisher.start()

        async def written(at_least: int) -> bool:
            return (await _metrics(api))["gateway_events_written_total"] >= at_least

        await wait_until(lambda: written(rate), 30, "the fleet being written", interval=0.2)
        cut = time.time()
        await link.cut()
        await wait_until(
            lambda: "closing the gateway; taking messages into the spool" in gw.output(),
            30,
            "the gateway closing after give_up_after",
        )
        assert gw.proc is not None
        assert gw.proc.poll() is None, gw.output()  # still running
        # The HTTP server closes with the gateway and opens again to spool:
        # connections are refused for that moment.
        await wait_until(lambda: _spooling(api), 30, "serving again, spooling")
        # Spooling in the same process: acknowledging, and saying so.
        acked = (await _metrics(api))["gateway_acks_sent_total"]
        await wait_until(
            lambda: _acked_more(api, acked + rate), 20, "acknowledging while spooling", 0.2
        )
        code, checks = await _healthz(api)
        assert code == 503
        assert str(checks["cassandra"]).startswith("spooling, Cassandra unreachable since "), checks
        # Since the writes began to fail, soon after the cut: not now less
        # give_up_after, which the close's wait had moved on (field probe).
        since = datetime.fromisoformat(str(checks["cassandra"]).rsplit(" ", 1)[1]).timestamp()
        assert cut - 1.5 <= since <= cut + 3, (cut, checks)
        # Closing after give_up_after is not a stop: the log said "stopping".
        assert "stopping with Cassandra writes unfinished" not in gw.output()
        # The closed gateway's queue is not shown as still queued (it said
        # what the queue held when the gateway closed, for as long as it spooled).
        assert (await _metrics(api))["gateway_queue_depth"] == 0
        await link.start()
        await _all_stored_and_drained(db, tenant, publisher, gw, api)
    assert "Cassandra answers after" in gw.output()


async def _acked_more(port: int, at_least: float) -> bool:
    return (await _metrics(port))["gateway_acks_sent_total"] >= at_least


async def _all_stored_and_drained(
    db: Database, tenant: str, publisher: Publisher, gw: GatewayProcess, api: int
) -> None:
    """Once the link is back: every published event stored once, the spool
    empty, /healthz 200, and a clean stop."""
    await asyncio.to_thread(publisher.join, 60)
    await assert_all_stored(db, tenant, publisher, deadline=120)

    async def drained() -> bool:
        return (await _metrics(api))["gateway_spool_depth"] == 0

    await wait_until(drained, 60, "the spool emptied")
    await wait_until(lambda: _healthz_ok(api), 30, "/healthz 200 again")
    gw.signal(signal.SIGTERM)
    assert await asyncio.to_thread(gw.wait, 30) == 0


async def _spooling(port: int) -> bool:
    try:
        code, checks = await _healthz(port)
    except OSError:  # not serving (URLError is one)
        return False
    return code == 503 and str(checks["cassandra"]).startswith("spooling")


async def _healthz_ok(port: int) -> bool:
    code, _ = await _healthz(port)
    return code == 200


# ---------------------------------------------------------------- SIGKILL while the spool commits


@dataclass
class _Sent:
    """Events the broker acknowledged, by device: what ``assert_all_stored``
    reads of a Publisher."""

    published: dict[str, list[dict[str, object]]] = field(default_factory=dict)


@pytest.mark.slow
async def test_sigkill_while_the_spool_commits_loses_nothing_acknowledged(
    db: Database, tenant: str, gateway_process: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """The link is down, so every message goes through the spool's group
    commits (the intake of a start while Cassandra is unreachable); the gateway
    is killed mid-stream, then restarted with the link back. Every
    message the broker got a PUBACK for ends up in Cassandra: the committed
    ones from the spool, the others redelivered from the persistent session."""
    api = free_port()
    spool = tmp_path / "spool.sqlite"
    link = CuttableProxy()
    await link.start()
    await link.cut()  # down before the gateway starts
    try:
        gw = gateway_process(**_spool_env(tenant, spool, link.port, api))
        await asyncio.to_thread(gw.start)
        # In bursts (100 awaiting their PUBACK at once), so each group commit
        # holds many messages; the broker acknowledges them whatever the gateway does.
        sent = _Sent()
        base = int(time.time() * 1000)
        messages = []
        for i in range(6000):
            event: dict[str, object] = {
                "ts": base + i,
                "state": ("on", "off", "alarm")[(i // 7) % 3],
                "value": i,
            }
            sent.published.setdefault(f"d{i % 20}", []).append(event)
            messages.append((topic(tenant, f"d{i % 20}"), orjson.dumps(event)))
        done: list[int] = []
        burst = threading.Thread(target=lambda: done.append(asyncio.run(publish(messages))))
        burst.start()

        # Until the kill: at no scrape has the gateway acknowledged more than it
        # has committed to the spool (one snapshot of both, on its event loop).
        acked = ahead = 0.0
        async with asyncio.timeout(30):
            while acked < 1000:
                metrics = await _metrics(api)
                acked = metrics["gateway_acks_sent_total"]
                ahead = max(ahead, acked - metrics["gateway_spool_depth"])
        assert ahead <= 0, f"{ahead:.0f} messages acknowledged before they were committed"
        acked_before = (await _metrics(api))["gateway_acks_sent_total"]
        gw.kill()
        assert burst.is_alive(), "the kill should land mid-stream"
        await link.start()
        await asyncio.to_thread(gw.start)
        waiting = [int(n) for n in re.findall(r"spool \S+: (\d+) messages waiting", gw.output())]
        assert len(waiting) == 2
        # Every message acknowledged before the kill was committed to the spool first.
        assert waiting[1] >= acked_before, (waiting, acked_before)
        await asyncio.to_thread(burst.join, 60)
        assert done == [6000]
        await assert_all_stored(db, tenant, sent, deadline=120)

        async def drained() -> bool:
            return (await _metrics(api))["gateway_spool_depth"] == 0

        await wait_until(drained, 60, "the spool emptied")
        gw.signal(signal.SIGTERM)
        assert await asyncio.to_thread(gw.wait, 30) == 0
    finally:
        await link.cut()


# ---------------------------------------------------------------- the spool's bound

KEEPALIVE = 5  # the least mqtt.keepalive allows


@pytest.mark.slow
async def test_at_the_spool_bound_acks_pause_and_nothing_is_lost(
    db: Database, tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    bound = 300
    spool = tmp_path / "spool.sqlite"
    api = free_port()
    async with proxy() as link:
        config = make_config(
            **_spool_env(
                tenant,
                spool,
                link.port,
                api,
                GATEWAY_SPOOL__MAX_RECORDS=str(bound),
                GATEWAY_MQTT__KEEPALIVE=str(KEEPALIVE),
            )
        )
        async with running_gateway(config) as gw:
            await link.cut()
            publisher = Publisher(tenant, devices=10, rate=5000, count=1000)
            publisher.start()
            # The broker takes all of them (PUBACKs to the publisher) and keeps
            # what the gateway does not acknowledge in its persistent session.
            await asyncio.to_thread(publisher.join, 60)
            await gw.wait_for(lambda s: s.acked >= bound, deadline=30)
            # Held at the bound (reads paused) for longer than the broker's
            # keepalive allows silence (1.5 x): would it take more, or lose
            # its connection for not reading the broker's answers?
            await asyncio.sleep(1.5 * KEEPALIVE + 2)
            assert gw.stats.acked == bound
            assert (gw.stats.connects, gw.stats.disconnects) == (1, 0)
            assert gw.stats.spool.depth == bound
            assert not gw.task.done()
            full = [r.getMessage() for r in caplog.records if "spool full at" in r.getMessage()]
            assert full, "no log line said the spool was full"
            assert str(spool) in full[0]
            assert "spool.max_records" in full[0]
            metrics = await _metrics(api)
            assert metrics["gateway_spool_full"] == 1
            assert metrics["gateway_spool_full_total"] >= 1
            code, checks = await _healthz(api)
            assert code == 503
            assert "full" in str(checks["spool_state"])
            await link.start()
            await assert_all_stored(db, tenant, publisher, deadline=90)
            await gw.wait_for(lambda s: s.spool.depth == 0 and s.acked == 1000, deadline=60)
            assert (await _metrics(api))["gateway_spool_full"] == 0
    assert any("spool has room again" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the disk full


@contextlib.contextmanager
def _tiny_disk(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a tmpfs at {where} (the disk-full test needs root): {done.stderr}",
            pytrace=False,
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _fill(path: Path, leave: int = 0) -> None:
    """Fill the file system ``path`` is on with ``path``, but ``leave`` bytes."""
    path.write_bytes(b"\0" * (shutil.disk_usage(path.parent).free - leave))
    assert 0 <= shutil.disk_usage(path.parent).free - leave < 8192  # a block or two


async def test_disk_full_is_not_acknowledged_and_flows_once_there_is_room(
    db: Database, tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk fills while the spool holds messages Cassandra does not have
    yet. A commit that fails for it (SQLITE_FULL) acknowledges nothing: the
    gateway says so, keeps its broker session and retries, and the broker
    holds those messages. When the link is back the spooled messages are
    written, and deleted on the reserve the spool kept beside it. Once room
    is made, everything flows."""
    caplog.set_level(logging.INFO, logger="gateway")

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    api = free_port()
    sent = _Sent()
    base = int(time.time() * 1000)
    messages = []
    for i in range(400):
        event = {"ts": base + i, "state": "on", "value": i}
        sent.published.setdefault(f"d{i % 10}", []).append(event)
        messages.append((topic(tenant, f"d{i % 10}"), orjson.dumps(event)))
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        spool = disk / "spool.sqlite"
        async with proxy() as link:
            config = make_config(**_spool_env(tenant, spool, link.port, api))
            async with running_gateway(config) as gw:
                await link.cut()
                await publish(messages[:200])
                await gw.wait_for(lambda s: s.acked == 200, deadline=30)  # spooled
                _fill(disk / "filler")
                await publish(messages[200:])  # the broker has them all
                await wait_until(
                    lambda: bool(said("spool disk full at")), 30, "the disk full, said"
                )
                await asyncio.sleep(1)  # retrying meanwhile
                assert not gw.task.done()
                assert gw.stats.acked == 200  # none of those since
                assert str(spool) in said("spool disk full at")[0]
                metrics = await _metrics(api)
                assert metrics["gateway_spool_disk_full_total"] >= 1
                assert metrics["gateway_spool_disk_full"] == 1
                code, checks = await _healthz(api)
                assert code == 503
                assert str(checks["spool_state"]).startswith(f"disk full at {spool} since ")
                # A reader (`gateway check`, say) holds a snapshot meanwhile,
                # so no checkpoint can give the WAL's room back: the disk stays
                # full through the drain.
                with _snapshot(spool):
                    await link.start()
                    # Written to Cassandra, and deleted from the spool: their
                    # deletes, refused at first, go through on the room the
                    # spool kept back beside it (its reserve), given back for them.
                    await gw.wait_for(
                        lambda s: s.written >= 200 and s.spool.depth == 0, deadline=60
                    )
                    assert not gw.task.done()
                    assert said("gave back its reserve")
                    # Drained, but the disk is still full, so no append can
                    # commit: it still says so. A delete that went through said
                    # "room again ... acknowledging again", /healthz turned 200
                    # and the next refusal was logged at once: flapping at
                    # every delete.
                    await asyncio.sleep(1)
                    code, checks = await _healthz(api)
                    assert code == 503, checks
                    assert (await _metrics(api))["gateway_spool_disk_full"] == 1
                    assert not said("spool disk has room again")
                    refused = [m for m in said("spool disk full at") if "gave back" not in m]
                    assert len(refused) == 1, refused  # once a minute at most
                (disk / "filler").unlink()  # room again
                await assert_all_stored(db, tenant, sent, deadline=60)
                await gw.wait_for(lambda s: s.acked == 400 and s.spool.depth == 0, deadline=30)
                assert (await _metrics(api))["gateway_spool_disk_full"] == 0
                code, checks = await _healthz(api)
                assert checks["spool_state"] == "ok"
    assert said("spool disk has room again")


async def test_a_spool_that_filled_its_own_disk_drains_once_cassandra_answers(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """The spool on a small file system of its own (an SD-card partition),
    the link down until the spool itself fills it: no filler anyone could
    remove. When Cassandra answered, every delete needed room in SQLite's WAL
    and failed, so nothing was ever removed and it stayed "DISK FULL" for
    good (probe of the edge host: 3 minutes, across restarts). Appends now
    leave the deletes room for their WAL."""
    api = free_port()
    base = int(time.time() * 1000)
    messages = [
        (topic(tenant, f"d{i % 10}"), orjson.dumps({"ts": base + i, "value": "x" * 500}))
        for i in range(3000)
    ]
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        async with proxy() as link:
            await link.cut()
            config = make_config(**_spool_env(tenant, disk / "spool.sqlite", link.port, api))
            async with running_gateway(config) as gw:
                publishing = asyncio.create_task(publish(messages))
                await gw.wait_for(lambda s: s.spool is not None and s.spool_disk_full > 0, 60)
                await link.start()  # Cassandra answers again
                await publishing  # every message taken in the end (the broker held the rest)
                # At least: the gateway subscribes to every tenant of the
                # worker's broker, and another test's late messages count too.
                await gw.wait_for(lambda s: s.acked >= 3000 and s.spool.depth == 0, 120)
    stored = [len(await telemetry_keys(db, tenant, f"d{d}")) for d in range(10)]
    assert stored == [300] * 10


@contextlib.contextmanager
def _snapshot(path: Path) -> Iterator[sqlite3.Connection]:
    """A reader holding a read snapshot of the spool at ``path``, as `gateway
    check` does while it reads every page: no checkpoint completes past it
    while it is open (closing it early is fine)."""
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    with contextlib.closing(reader):
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM spool").fetchone()
        yield reader


async def _filled(spool: Spool, payload: int, batch: int) -> list[int]:
    """Append ``batch`` messages of ``payload`` bytes at a time until refused."""
    seqs: list[int] = []
    with contextlib.suppress(SpoolDiskFull):
        while True:
            seqs += await spool.append([(2, "t/a", None, b"x" * payload)] * batch)
    return seqs


async def _appended_within(spool: Spool, tries: int) -> list[int]:
    """An append of one message as the spool source retries it: again after
    each refusal, up to ``tries`` times."""
    for _ in range(tries - 1):
        with contextlib.suppress(SpoolDiskFull):
            return await spool.append([(3, "t/b", None, b"y" * 530)])
    return await spool.append([(3, "t/b", None, b"y" * 530)])


def _files(disk: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in disk.iterdir()}


async def test_appends_leave_room_for_the_checkpoint_the_wal_owes(tmp_path: Path) -> None:
    """The spool emptied, its WAL 1 MB, 0 bytes free, and every append
    refused for good (a `make test` run, 2 of 14): appends had counted the
    pages deletes freed as room, but while no checkpoint had completed those
    pages were in the WAL, not in the main file, and a checkpoint needs the
    main file to grow by every page it has not taken in yet. The appends took
    that room, so no checkpoint could complete, the WAL could never start
    over, and each commit needed it to grow. Appends now leave that growth
    free, and a refused one first checkpoints."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "spool.sqlite"
        async with Spool(path, 100_000, 1 << 30) as spool:
            await spool.append([(1, "t/a", None, b"a")])
            with _snapshot(path) as reader:
                # The spool fills and drains behind it: the WAL holds every
                # page the main file has yet to take in, and grows by every commit.
                seqs = [1, *await _filled(spool, 530, 20)]
                while seqs:  # Cassandra has them: the deletes
                    await spool.delete(seqs[:100])
                    del seqs[:100]
                assert spool.depth == 0
                # Cassandra keeps up: each message appended is deleted soon after.
                taken = 0
                with contextlib.suppress(SpoolDiskFull):
                    while taken < 500:
                        await spool.delete(await _appended_within(spool, 1))
                        taken += 1
                reader.close()  # the snapshot let go: a checkpoint can complete
                seqs = await _appended_within(spool, 3)
            assert spool.depth == 1, _files(disk)
            assert [r.seq for r in await spool.read(0, 10)] == seqs
            assert _files(disk)["spool.sqlite-wal"] <= 2 * 512 * 1024, _files(disk)


async def test_a_backlog_too_large_for_one_commit_is_not_the_disk_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backlog's commit too large for the room left was refused, and the
    source took it for the disk full: each halving said "disk full", then
    "room again after 0 s", counted a refusal and waited half a second (22
    times in one drain by hand), and /healthz said 503 through almost all of
    each halving. It now halves at once; a single message refused is the
    disk full."""
    caplog.set_level(logging.INFO, logger="gateway")
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        async with Spool(disk / "spool.sqlite", 100_000, 1 << 30) as spool:
            stats = Stats()
            source = SpoolSource(spool, Unfed(), Unpaused(), stats, 1000)
            acks = Acks()
            states: set[str] = set()  # what /healthz would have said meanwhile
            appending = asyncio.create_task(source.append())
            for i in range(600):  # 600 KB: fits, but not in one commit
                source.accept(Delivery("t/a", b"x" * 1000, None, i, acks.of(str(i))))
            async with asyncio.timeout(30):
                while len(acks.done) < 600:
                    states.add(spool.state())
                    await asyncio.sleep(0)
            source.close()
            await appending
            assert spool.depth == 600
            assert states == {"ok"}
    assert acks.done == [str(i) for i in range(600)]
    assert stats.spool_disk_full == 0
    said = [r.getMessage() for r in caplog.records if "spool disk" in r.getMessage()]
    assert said == []


async def test_deletes_wait_for_a_reader_rather_than_take_the_checkpoints_room(
    tmp_path: Path,
) -> None:
    """Deletes while a reader held the WAL (no checkpoint completes) grew it
    into the room left, then into the reserve, until the disk was full: once
    the reader let go, the checkpoint had no room to complete, and 5,056
    written messages could never be deleted (a fuzz of the spool). Near a
    full disk a delete now waits for the reader instead, and goes through
    once it lets go."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "spool.sqlite"
        async with Spool(path, 100_000, 1 << 30) as spool:
            await spool.append([(1, "t/a", None, b"a")])
            with _snapshot(path):
                seqs = [1, *await _filled(spool, 100, 100)]
                waited = []
                for at in range(0, len(seqs), 1500):
                    try:
                        await spool.delete(seqs[at : at + 1500])
                    except SpoolDiskFull as exc:
                        waited.append(str(exc))
                assert waited, "no delete waited"
                assert "waits, as a reader of the spool" in waited[0]
            for at in range(0, len(seqs), 1500):  # the reader let go
                await spool.delete(seqs[at : at + 1500])
            assert spool.depth == 0
            assert await _appended_within(spool, 3)


async def test_an_empty_spool_whose_wal_cannot_be_checkpointed_starts_a_new_file(
    tmp_path: Path,
) -> None:
    """A spool left empty by an earlier version with a WAL no checkpoint can
    complete (7 MB of pages the main file has yet to take in, and no room for
    it to grow): every message was refused, for good. An empty spool in that
    state starts a new file (there is nothing in it to lose), and numbers on
    from where it was, so a feed that has read up to there misses nothing.
    The state is built with SQLite directly: checkpoints off (as a reader held
    them off), 6,000 messages in and out, then the disk filled by another
    program; closing could not checkpoint either, so the WAL stays."""
    with _tiny_disk(tmp_path / "disk", "8m") as disk:
        path = disk / "spool.sqlite"
        async with Spool(path, 100_000, 1 << 30) as spool:
            await spool.append([(1, "t/a", None, b"a")])
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as earlier:
            earlier.execute("PRAGMA wal_autocheckpoint = 0")
            earlier.execute("BEGIN")
            for _ in range(6000):
                earlier.execute(
                    "INSERT INTO spool (received_ms, topic, content_type, payload) "
                    "VALUES (2, 't/a', NULL, ?)",
                    (b"x" * 530,),
                )
            earlier.execute("COMMIT")
            earlier.execute("DELETE FROM spool")
            (last,) = earlier.execute("SELECT seq FROM sqlite_sequence").fetchone()
            _fill(disk / "filler")
        assert _files(disk)["spool.sqlite-wal"] > 6 << 20
        async with Spool(path, 100_000, 1 << 30) as spool:
            assert spool.depth == 0
            with pytest.raises(SpoolDiskFull):  # a new file, but 3 MB do not fit even so
                await spool.append([(3, "t/b", None, b"y" * 1500)] * 2000)
            # Another program takes the room back before anything committed:
            # a second new file, which numbered from 1 (review).
            _fill(disk / "filler2")
            with pytest.raises(SpoolDiskFull):
                await spool.append([(3, "t/b", None, b"y" * 530)])
            (disk / "filler2").unlink()
            seqs = await spool.append([(3, "t/b", None, b"y" * 530)])
            assert seqs == [last + 1]
            assert [r.seq for r in await spool.read(last, 10)] == seqs
            assert _files(disk)["spool.sqlite-wal"] < 512 * 1024, _files(disk)
        async with Spool(path, 100_000, 1 << 30) as spool:  # and it opens again as it was
            assert spool.depth == 1
            assert [r.seq for r in await spool.read(0, 10)] == seqs


async def test_a_removed_spool_wal_stops_acknowledging(tmp_path: Path) -> None:
    """The spool's -wal removed while open (a cleanup job, `rm spool.sqlite-*`):
    every commit since the last checkpoint went into the removed file and was
    acknowledged, and a SIGKILL then lost them (probe: 600 acknowledged, 0
    left). The WAL is now checked with the main file before each commit."""
    path = tmp_path / "spool.sqlite"
    async with Spool(path, 1000, 1 << 20) as spool:
        await spool.append([(1, "t/a", None, b"x")] * 10)
        Path(f"{path}-wal").unlink()  # noqa: ASYNC240
        with pytest.raises(SpoolError, match=r"spool\.sqlite-wal was removed or replaced"):
            await spool.append([(2, "t/a", None, b"y")])


def test_check_says_the_spool_disk_is_full(tmp_path: Path) -> None:
    """The spool's file system full: the running gateway answers 503 (disk
    full, acknowledgements paused) while `gateway check` said "spool: ok"
    and exited 0."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "spool.sqlite"

        async def spool_some() -> None:
            async with Spool(path, 1000, 1 << 20) as spool:
                await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")] * 100)

        asyncio.run(spool_some())
        _fill(disk / "filler")
        env = base_env(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
        done = run_cli("check", env=env)
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[0].startswith("the spool's disk is full"), done.stdout
    assert "spool: DISK FULL" in done.stdout


async def test_check_and_the_gateway_agree_when_the_spool_disk_is_nearly_full(
    tmp_path: Path,
) -> None:
    """256 KiB free on the spool's file system: `gateway check` said "spool:
    ok" (its rule was 64 KiB), while the gateway refused every append there,
    since appends leave the deletes 512 KiB plus twice their payload. Both now
    apply the spool's one rule."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "spool.sqlite"
        async with Spool(path, 1000, 1 << 20) as spool:
            await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")] * 100)
            _fill(disk / "filler", leave=256 * 1024)
            with pytest.raises(SpoolDiskFull):
                await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")])
        env = base_env(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
        done = await asyncio.to_thread(run_cli, "check", env=env)
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[0].startswith("the spool's disk is full"), done.stdout
    assert "spool: DISK FULL" in done.stdout


async def test_check_says_the_disk_is_full_before_the_spool_is_created(tmp_path: Path) -> None:
    """The first `gateway check` on a fresh edge host, before the gateway has
    created its spool: it said "spool: empty (... not created yet)" and ok on
    a disk where the gateway then refused every append. It applies the same
    rule to the file system the file will be made on (its directory too, which
    the gateway makes), and still creates nothing."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "new" / "spool.sqlite"
        env = base_env(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
        _fill(disk / "filler", leave=256 * 1024)
        done = await asyncio.to_thread(run_cli, "check", env=env)
        assert not path.parent.exists()
        async with Spool(path, 1000, 1 << 20) as spool:
            with pytest.raises(SpoolDiskFull):
                await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")])
        shutil.rmtree(path.parent)
        (disk / "filler").unlink()
        roomy = await asyncio.to_thread(run_cli, "check", env=env)
    assert done.returncode == 1, done.stdout
    assert done.stdout.splitlines()[0].startswith("the spool's disk is full"), done.stdout
    assert (
        f"spool: DISK FULL (no room for a message of limits.max_payload_bytes), {path} "
        "not created yet"
    ) in done.stdout
    assert roomy.returncode == 0, roomy.stdout
    assert f"spool: empty ({path} not created yet)" in roomy.stdout


def _remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)


async def test_check_and_the_gateway_say_the_spool_is_on_a_read_only_file_system(
    tmp_path: Path,
) -> None:
    """The spool's file system mounted read-only (a failing SD card the kernel
    remounted so looks exactly like this). Before the spool was created,
    `gateway check` said "spool: empty (... not created yet)" and exited 0,
    and the gateway then refused to start: "... is not writable by this
    user", which sends the engineer to chmod. With a spool there, check said
    "cannot read the spool ...: unable to open database file". Both now say
    "read-only file system", check in its first line."""
    with _tiny_disk(tmp_path / "disk", "2m") as disk:
        path = disk / "new" / "spool.sqlite"
        env = base_env(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
        _remount(disk, "ro")
        before = await asyncio.to_thread(run_cli, "check", env=env)
        with pytest.raises(SpoolError) as refused_before:
            async with Spool(path, 1000, 1 << 20):
                pass
        _remount(disk, "rw")
        async with Spool(path, 1000, 1 << 20) as spool:
            await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")] * 10)
        _remount(disk, "ro")
        after = await asyncio.to_thread(run_cli, "check", env=env)
        with pytest.raises(SpoolError) as refused_after:
            async with Spool(path, 1000, 1 << 20):
                pass
    for done in (before, after):
        assert done.returncode == 1, done.stdout
        first = done.stdout.splitlines()[0]
        assert first.startswith(f"cannot write the spool {path}: "), done.stdout
        assert first.endswith(f": {disk} is a read-only file system{READ_ONLY_WHY}"), done.stdout
        assert f"spool: cannot write {path}: {disk} is a read-only file system" in done.stdout
        assert "this user" not in done.stdout
    for refused in (refused_before, refused_after):
        said = str(refused.value)
        assert said == f"spool {path}: {disk} is a read-only file system{READ_ONLY_WHY}", said


def test_check_says_a_spool_this_user_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gateway check` never asked whether the spool could be written: "spool:
    empty (... not created yet)" and ok where the gateway then refused to
    start. It asks what the gateway asks (ingest/spool.py, unwritable), before
    and after the file exists. The tests run as root: os.access is made to say
    what it says to a user without write permission (the fault injected)."""
    from gateway.tools.check import _spool  # noqa: PLC0415

    path = tmp_path / "new" / "spool.sqlite"
    config = make_config(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
    real = os.access
    denied = {tmp_path}
    monkeypatch.setattr(os, "access", lambda p, mode: p not in denied and real(p, mode))
    ok, line, problem = _spool(config)
    assert not ok
    assert problem == f"cannot write the spool {path}: {tmp_path} is not writable by this user"
    assert line == f"spool: cannot write {path}: {tmp_path} is not writable by this user"
    denied.clear()

    async def spool_some() -> None:
        async with Spool(path, 1000, 1 << 20) as spool:
            await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")] * 5)

    asyncio.run(spool_some())
    assert _spool(config)[0]
    denied.add(path)
    ok, line, problem = _spool(config)
    assert not ok
    assert problem == f"cannot write the spool {path}: {path} is not writable by this user"


def test_a_spool_turned_off_while_holding_messages_is_said_not_stranded(tmp_path: Path) -> None:
    """Messages acknowledged into the spool, then spool.enabled set to false:
    `gateway run` started without a word and never drained them, and `gateway
    check` said all was well (probe: 500 messages left). Both now name the
    file and what to do; `gateway run` does not start over them."""
    path = tmp_path / "spool.sqlite"

    async def spool_some() -> None:
        async with Spool(path, 1000, 1 << 20) as spool:
            await spool.append([(int(time.time() * 1000), "t/a", None, b"{}")] * 50)

    asyncio.run(spool_some())
    env = base_env(GATEWAY_SPOOL__ENABLED="false", GATEWAY_SPOOL__PATH=str(path))
    said = f"spool.enabled is false, but the spool {path} holds 50 messages"
    checked = run_cli("check", env=env)
    assert checked.returncode == 1
    assert checked.stdout.startswith(said), checked.stdout
    ran = run_cli("run", env=env, timeout=60)
    assert ran.returncode == 2
    assert said in ran.stderr, ran.stderr


async def test_a_keyspace_without_its_tables_keeps_the_gateway_spooling(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """Spool mode, and Cassandra answers but the schema is not there (a host
    installed while the link was down, or a release that adds a table): the
    gateway exited with "schema incomplete", at every restart, and took no
    more messages. It now spools on, and /healthz says why; once `gateway
    schema apply` has made them, it opens and drains the spool."""
    api = free_port()
    keyspace = f"nothing_{uuid.uuid4().hex[:8]}"  # not there yet
    env = _spool_env(
        tenant, tmp_path / "spool.sqlite", CQL_PORT, api, GATEWAY_CASSANDRA__KEYSPACE=keyspace
    )
    now = int(time.time() * 1000)
    messages = [(topic(tenant, f"d{i}"), orjson.dumps({"ts": now + i})) for i in range(20)]
    try:
        async with running_gateway(make_config(**env)) as gw:
            await publish(messages)
            await gw.wait_for(lambda s: s.acked == 20, deadline=30)  # spooled
            assert gw.stats.spool is not None
            assert gw.stats.spool.depth == 20
            code, checks = await _healthz(api)
            assert code == 503
            said = str(checks["cassandra"])
            assert said.startswith("spooling, Cassandra answers, but its schema incomplete "), said
            assert f"in keyspace '{keyspace}'" in said, said
            assert not gw.task.done()
            applied = await asyncio.to_thread(
                run_cli, "schema", "apply", env=base_env(GATEWAY_CASSANDRA__KEYSPACE=keyspace)
            )
            assert applied.returncode == 0, applied.stderr
            await gw.wait_for(lambda s: s.written == 20, deadline=60)  # drained
    finally:
        await db.execute(f"DROP KEYSPACE IF EXISTS {keyspace}")


def test_a_damaged_spool_is_said_with_what_to_do(tmp_path: Path) -> None:
    """A spool file damaged on disk (a page of garbage): `gateway run` ended
    with the bare "database disk image is malformed" (or a traceback, when
    the read met it) at every restart, `gateway check` could call it ok, and
    with the spool off it was ignored without a word. Each now names the
    file, says it is damaged and what to do; nothing starts over it."""
    path = tmp_path / "spool.sqlite"

    async def spool_some() -> None:
        async with Spool(path, 1000, 1 << 24) as spool:
            await spool.append([(int(time.time() * 1000), "t/a", None, b"x" * 3000)] * 50)

    asyncio.run(spool_some())
    with path.open("r+b") as file:
        file.seek(4096 * 20)
        file.write(b"\xff" * 4096)
    advice = (
        f"the file is damaged: stop the gateway and move it and its WAL aside (mv {path} "
        f"{path}.damaged; mv {path}-wal {path}.damaged-wal; rm -f {path}-shm)"
    )
    env = base_env(GATEWAY_SPOOL__ENABLED="true", GATEWAY_SPOOL__PATH=str(path))
    checked = run_cli("check", env=env)
    assert checked.returncode == 1
    first = checked.stdout.splitlines()[0]
    assert first.startswith(f"cannot read the spool {path} (database disk image is malformed)")
    assert advice in first, first
    assert f"spool: DAMAGED, cannot read {path}" in checked.stdout
    ran = run_cli("run", env=env, timeout=60)
    assert ran.returncode == 1
    assert advice in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr
    off = run_cli("run", env=env | {"GATEWAY_SPOOL__ENABLED": "false"}, timeout=60)
    assert off.returncode == 2
    assert f"spool.enabled is false, but the spool {path} cannot be read" in off.stderr
    assert advice in off.stderr, off.stderr
    # The advice, followed as given, puts what can still be read into a new
    # spool that the gateway opens (`.recover` gave nothing on this sqlite3,
    # and the WAL left behind was lost: field-engineer probe).
    steps = first.split("; then `", 1)[1].split("` (Debian package sqlite3)", 1)[0]
    moved = subprocess.run(
        [
            "bash",
            "-c",
            f"mv {path} {path}.damaged; mv {path}-wal {path}.damaged-wal 2>/dev/null; "
            f"rm -f {path}-shm; {steps}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert moved.returncode == 0, moved.stderr

    async def recovered() -> list[Record]:
        async with Spool(path, 1000, 1 << 24) as spool:
            return await spool.read(0, 100)

    records = asyncio.run(recovered())
    assert 0 < len(records) < 50, len(records)  # the damaged page's are gone
    assert {(r.topic, r.payload) for r in records} == {("t/a", b"x" * 3000)}
    assert "DAMAGED" not in run_cli("check", env=env).stdout  # it opens


async def test_healthz_says_the_link_is_down_with_nothing_to_write(
    tenant: str, tmp_path: Path
) -> None:
    """The link drops on a quiet site: /healthz said "cassandra": "ok" (200)
    for as long as nothing was written (probe: minutes), while `gateway
    check` on the same host said it cannot connect. Cassandra is now asked
    something small whenever it has not answered for LINK_PROBE seconds."""
    api = free_port()
    async with proxy() as link:
        config = make_config(**_spool_env(tenant, tmp_path / "spool.sqlite", link.port, api))
        async with running_gateway(config):
            code, checks = await _healthz(api)
            assert (code, checks["cassandra"]) == (200, "ok")
            await link.cut()

            async def down() -> bool:
                code, checks = await _healthz(api)
                return code == 503 and checks["cassandra"] != "ok"

            await wait_until(down, 30, "/healthz says the link is down", interval=1)
            await link.start()

            async def up() -> bool:
                return (await _healthz(api))[0] == 200

            await wait_until(up, 30, "/healthz says ok again", interval=1)


async def test_rejections_written_again_from_the_spool_are_one_row_each(
    db: Database, tenant: str, tmp_path: Path
) -> None:
    """A spool replays what Cassandra may already have (a restart after the
    answers were lost on the link: the probe got 400 rows for 200 bad
    messages). A raw row is the same row again; a rejection got a random time
    UUID each time. Its id now comes from its receive time, topic and payload."""
    path = tmp_path / "spool.sqlite"
    now = int(time.time() * 1000)
    bad = [(now + i, topic(tenant, f"d{i % 5}"), None, b"not json %d" % i) for i in range(20)]
    config = make_config(**_spool_env(tenant, path, CQL_PORT, free_port()))
    for _ in range(2):  # the second time: the same records, spooled again
        async with Spool(path, 1000, 1 << 20) as spool:
            await spool.append(bad)
        async with running_gateway(config) as gw:
            await gw.wait_for(lambda s: s.rejected == 20 and s.spool.depth == 0, 60)
    assert len(await rejected_since(db, tenant, now)) == 20


async def test_the_spool_full_from_spool_only_mode_is_reported_once(
    tenant: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Started with Cassandra away, the gateway spools alone until the spool
    is full; when Cassandra answers it opens the full gateway on the same
    file. That reopening said "spool full" a second time and then "room again
    after 0 s", and /healthz's "full since" jumped to the switch (probe of
    the edge host). Since when it is full now goes on across the switch."""
    caplog.set_level(logging.INFO, logger="gateway")
    bound = 100
    async with proxy() as link:
        await link.cut()  # away from the start: spool-only mode
        env = _spool_env(
            tenant,
            tmp_path / "spool.sqlite",
            link.port,
            free_port(),
            GATEWAY_SPOOL__MAX_RECORDS=str(bound),
        )
        async with running_gateway(make_config(**env)) as gw:
            await publish((topic(tenant, f"d{i % 10}"), f'{{"value": {i}}}') for i in range(300))
            await gw.wait_for(lambda s: s.acked >= bound, deadline=30)
            full_at = time.monotonic()
            await asyncio.sleep(4)
            await link.start()
            await gw.wait_for(lambda s: s.acked == 300 and s.spool.depth == 0, deadline=90)
    said = [r.getMessage() for r in caplog.records]
    assert sum("spool full at" in m for m in said) == 1, said
    (room,) = [m for m in said if "spool has room again" in m]
    seconds = float(re.search(r"after (\d+) s", room)[1])  # type: ignore[index]
    assert seconds >= 4, room
    assert seconds <= time.monotonic() - full_at + 1, room
