"""Shared fixtures: the real Mosquitto and Cassandra started by `make up`.

A missing service fails the test run (never skips): in CI a skipped
integration test would hide exactly the breakage it exists to catch.
Tests isolate themselves with a fresh tenant name and MQTT client id each;
they share one test keyspace, created once per session through the CLI, and
one Cassandra session (`db`), which lives on pytest-asyncio's session loop.
`make test` runs them in pytest-xdist workers, a test file per worker at a
time, each worker with a Mosquitto of its own (helpers.MQTT_PORT); the fault
tests, which restart the shared services, run afterwards on their own.

Only fixtures and hooks live here; the plain helpers they use are in helpers.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.store.database import Database, connect

from .helpers import (
    CQL_PORT,
    MQTT_PORT,
    TEST_KEYSPACE,
    GatewayProcess,
    base_env,
    clear_session,
    make_config,
    reachable,
    run_cli,
)

FAULTS = Path(__file__).resolve().parent / "faults"
CLUSTER = Path(__file__).resolve().parent / "cluster"
SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")
# The longest files first (seconds of test time in one `make test`, 2026-11-27):
# the xdist workers take a file at a time in this order (the Makefile's
# --no-loadscope-reorder). xdist's own order, most tests first, left the long
# files of few tests to the end: the last 8% of the tests took 95 s of 391,
# one worker alone. In this order they took 16 s of 310, but the whole run
# was no shorter: two cores, four workers, the work is the same.
LONGEST_FIRST = (
    "test_spool_faults.py",  # 126
    "test_edge.py",  # 102
    "test_state_view.py",  # 96
    "test_page_trouble.py",  # 87
    "test_receive.py",  # 48
    "test_schema_migrate.py",  # 46
    "test_ingest.py",  # 46
    "test_page_static.py",  # 45
    "test_read_api.py",  # 37
    "test_rollups.py",  # 34
    "test_rollup_lease.py",  # 30 (2026-11-28, by itself)
    "test_signals.py",  # 34
    "test_quota.py",  # 31
    "test_noisy.py",  # 24
    "test_outage.py",  # 24
    "test_overload.py",  # 22 (one test)
    "test_services.py",  # 20
    "test_metadata.py",  # 18
    "test_inflight_limit.py",  # 18
    "test_scaling_out.py",  # 15
    "test_instances.py",  # 13
    "test_tokens.py",  # 13
    "test_sampling.py",  # 12
    "test_write_session.py",  # 10
    "test_slow_link.py",  # 10
    "test_simulate.py",  # 10
)


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if FAULTS in item.path.parents:
            item.add_marker(pytest.mark.faults)
        if CLUSTER in item.path.parents:
            item.add_marker(pytest.mark.cluster)
        # `db` is one session on the session loop (Database binds to the loop
        # it was opened on): a test that uses it runs on that loop too.
        if pytest_asyncio.is_async_test(item) and "db" in item.fixturenames:
            item.add_marker(SESSION_LOOP, append=False)
    # tests/faults/ restarts the shared broker and Cassandra: run those last.
    # Before them, the longest files first (a stable sort: a file's own
    # order is kept).
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: (FAULTS in item.path.parents, first.get(item.path.name, len(first)))
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """With ``TEST_DIGEST`` set (``make test`` sets it), append each failed
    test's final error and the last WARNING-and-up lines it logged to that
    file, which ``make test`` prints last: CI shows the end of a long output,
    where a failure's own report (and the reason a gateway stalled) is cut."""
    path = os.environ.get("TEST_DIGEST")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller writes what its workers report
    failed = [*terminalreporter.stats.get("failed", []), *terminalreporter.stats.get("error", [])]
    if not path or not failed:
        return
    with open(path, "a", encoding="utf-8") as digest:
        for report in failed:
            digest.write(f"== {report.nodeid} ({report.when})\n")
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:
                digest.write(f"   {crash.path}:{crash.lineno}: {crash.message[:400]}\n")
            logged = [
                line
                for title, text in report.sections
                if title.startswith("Captured log")
                for line in text.splitlines()
                if line.startswith(("WARNING", "ERROR", "CRITICAL"))
            ]
            digest.writelines(f"   {line[:300]}\n" for line in logged[-15:])


@pytest.fixture(scope="session")
def services() -> None:
    missing = [
        f"{name} on 127.0.0.1:{port}"
        for name, port in (("Mosquitto", MQTT_PORT), ("Cassandra", CQL_PORT))
        if not reachable(port)
    ]
    if missing:
        pytest.fail(
            f"required services not reachable: {', '.join(missing)}. "
            "Start them with `make up` (`make test` does this).",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def keyspace(services: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    # pytest-xdist workers start together: one applies the schema at a time
    # (two clients creating the same table at once can leave Cassandra with
    # two table ids); the others then find it in place, which changes nothing.
    lock = tmp_path_factory.getbasetemp().parent / "schema-apply.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = run_cli("schema", "apply")
    assert result.returncode == 0, result.stderr
    return TEST_KEYSPACE


@pytest.fixture
def tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def db(keyspace: str) -> AsyncIterator[Database]:
    async with connect(make_config().cassandra) as database:
        yield database


@pytest.fixture
def gateway_process(keyspace: str, tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    made: list[GatewayProcess] = []

    def factory(**env: str) -> GatewayProcess:
        proc = GatewayProcess(
            base_env(GATEWAY_MQTT__CLIENT_ID=f"gw-proc-{uuid.uuid4().hex[:12]}", **env),
            tmp_path / f"gateway-{len(made)}.log",
        )
        made.append(proc)
        return proc

    yield factory
    for proc in made:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()
        asyncio.run(clear_session(proc.env["GATEWAY_MQTT__CLIENT_ID"]))
