"""Bad command-line input: an error that names the option and says what it
accepts (exit 2), before anything is connected. Cassandra and the broker are
pointed at ports nobody listens on, so a command that connected first would
fail with a connection error instead of the one asserted. The commands run
in-process (``gateway.tools.cli.main``), which saves a second of start-up per
case; tests/test_edge.py runs the installed command itself."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway import app
from gateway.config import Config, load_config
from gateway.errors import CassandraUnreachable
from gateway.stats import Stats
from gateway.store import queries
from gateway.tools.cli import _parser, _Progress, _run, main

from .helpers import base_env, free_port, run_cli

NOWHERE = {"GATEWAY_CASSANDRA__PORT": "1", "GATEWAY_MQTT__PORT": "1"}


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run `gateway ARGS` in-process with ENV: (exit code, stderr)."""
    for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)

    def run(*args: str, **env: str) -> tuple[int, str]:
        with monkeypatch.context() as patched:
            for name, value in (NOWHERE | env).items():
                patched.setenv(name, value)
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse
                code = int(exc.code or 0)
        return code, capsys.readouterr().err

    return run


Run = Callable[..., tuple[int, str]]


def _fails(gateway: Run, *args: str, **env: str) -> str:
    code, err = gateway(*args, **env)
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert "connect" not in err.lower(), err
    return err


def test_a_log_level_outside_the_list_is_refused_and_the_list_shown(gateway: Run) -> None:
    err = _fails(gateway, "--log-level", "LOUD", "schema", "print")
    assert "argument --log-level: expected DEBUG, INFO, WARNING or ERROR (got 'LOUD')" in err
    assert gateway("schema", "print", "--log-level", "error")[0] == 0


def test_gateway_log_level_in_the_environment_sets_the_level(gateway: Run) -> None:
    assert gateway("schema", "print", GATEWAY_LOG_LEVEL="debug")[0] == 0
    err = _fails(gateway, "schema", "print", GATEWAY_LOG_LEVEL="LOUD")
    assert "GATEWAY_LOG_LEVEL: expected DEBUG, INFO, WARNING or ERROR (got 'LOUD')" in err


@pytest.mark.parametrize("hours", ["x", "1.5", "0", "169"])
def test_rejected_hours_says_what_it_takes(gateway: Run, hours: str) -> None:
    err = _fails(gateway, "rejected", "--tenant", "t", "--hours", hours)
    assert f"argument --hours: a whole number of hours from 1 to 168 (got {hours!r})" in err
    assert "_hours" not in err


def test_rejected_since_says_what_it_takes_and_is_not_given_with_hours(gateway: Run) -> None:
    err = _fails(gateway, "rejected", "--tenant", "t", "--since", "yesterday")
    assert "--since: 'yesterday' is neither an RFC 3339 time (2026-01-31T09:00:00Z" in err, err
    assert "nor a duration like 2h (one number and a unit: ms, s, m, h or d)" in err, err
    err = _fails(gateway, "rejected", "--tenant", "t", "--since", "1h", "--hours", "2")
    assert "argument --hours: not allowed with argument --since" in err


@pytest.mark.parametrize("command", ["history", "rejected"])
@pytest.mark.parametrize("limit", ["0", "-1", "100001", "many"])
def test_a_limit_out_of_range_is_refused(gateway: Run, command: str, limit: str) -> None:
    args = ["history", "--tenant", "t", "d"] if command == "history" else ["rejected"]
    err = _fails(gateway, *args, "--tenant", "t", "--limit", limit)
    assert f"argument --limit: a whole number from 1 to 100000 (got {limit!r})" in err


def test_rejected_needs_a_tenant(gateway: Run) -> None:
    """Without one it listed the messages whose topic named no tenant, which
    read as every tenant's (CLI probe): --tenant '' asks for those."""
    err = _fails(gateway, "rejected")
    assert "the following arguments are required: --tenant" in err


def test_history_refuses_a_range_that_ends_before_it_starts(gateway: Run) -> None:
    err = _fails(gateway, "history", "--tenant", "t", "d", "--since", "1h", "--until", "2h")
    assert "--since: must be before --until" in err
    # The same duration ago at both ends is an empty range: refused (each end
    # took its own now, so since came a moment before until, and it passed).
    err = _fails(gateway, "history", "--tenant", "t", "d", "--since", "5m", "--until", "5m")
    assert "--since: must be before --until" in err
    # --since in the future with no --until: until is now, and says so (it
    # named an --until the user never gave).
    err = _fails(gateway, "history", "--tenant", "t", "d", "--since", "2099-01-01T00:00:00Z")
    assert "--since: must be before --until (now plus limits.max_future_skew, unless" in err, err
    err = _fails(gateway, "rejected", "--tenant", "t", "--since", "2099-01-01T00:00:00Z")
    assert "--since: 2099-01-01T00:00:00.000Z is in the future" in err, err


def test_a_duration_ago_may_have_a_minus_sign(gateway: Run) -> None:
    """`--since -5m` was argparse's "expected one argument" (probe): a value
    with a leading minus reads as an option. It is 5m ago, as `5m` is."""
    now = datetime(2026, 11, 29, 12, tzinfo=UTC)
    assert queries.parse_time("since", "-5m", now) == queries.parse_time("since", "5m", now)
    err = _fails(gateway, "history", "--tenant", "t", "d", "--since", "-1h", "--until", "-2h")
    assert "--since: must be before --until" in err, err
    err = _fails(gateway, "rollup", "--tenant", "t", "d", "--until", "-5", "--since=-2h")
    assert "--until: '-5' has no unit: give a duration ago such as 30m" in err, err
    # "--" is no duration: --since still lacks its value.
    err = _fails(gateway, "history", "--tenant", "t", "--since", "--", "-1h")
    assert "argument --since: expected one argument" in err, err


def test_a_time_with_a_lower_case_z_is_taken() -> None:
    """RFC 3339 allows "t" and "z" in lower case; fromisoformat refused the z."""
    assert queries.parse_time("since", "2026-11-28t09:00:00z") == datetime(
        2026, 11, 28, 9, tzinfo=UTC
    )


def test_rollup_range_errors_come_before_connecting(gateway: Run) -> None:
    err = _fails(
        gateway, "rollup", "--tenant", "t", "d", "--step", "1m", "--since", "2000-01-01T00:00:00Z"
    )
    assert "--since: the range holds more than" in err
    assert err.rstrip().endswith("or take a longer step"), err
    # An hour is the longest step: no longer one is suggested.
    err = _fails(
        gateway, "rollup", "--tenant", "t", "d", "--step", "1h", "--since", "2000-01-01T00:00:00Z"
    )
    assert err.rstrip().endswith("move since later or until earlier"), err
    # A far --until with the default --since: --until is blamed (it named
    # --since, which the user never gave).
    err = _fails(
        gateway, "rollup", "--tenant", "t", "d", "--step", "1m", "--until", "2099-01-01T00:00:00Z"
    )
    assert "--until: the range holds more than 10080 windows of 60 s" in err, err
    assert "to 2099-01-01T00:00:00.000Z): move until earlier (since is 24 h ago" in err, err
    err = _fails(
        gateway, "rollup", "--tenant", "t", "d", "--step", "1m", "--since", "1h", "--until", "2h"
    )
    assert "--since: must be before --until" in err
    # --until alone, before the default --since (24 h ago): it was --since
    # that was blamed, which the user never gave.
    for command in ("rollup", "history"):
        err = _fails(gateway, command, "--tenant", "t", "d", "--until", "2d")
        assert "--until: must be after --since, 24 h ago unless given" in err, err


def test_init_writes_where_config_says_and_refuses_two_places(
    gateway: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gateway --config F init` and `gateway init --config F` write F (it
    wrote ./gateway.toml, ignoring --config); a path and a different
    --config are refused."""
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    assert gateway("--config", str(first), "init")[0] == 0
    assert gateway("init", "--config", str(second))[0] == 0
    assert first.read_text().startswith("#")
    assert second.exists()
    assert not (tmp_path / "gateway.toml").exists()
    err = _fails(gateway, "init", str(first), "--config", str(second))
    assert f"two places to write, {first} and --config {second}" in err
    assert gateway("init", str(first), "--config", str(first), "--force")[0] == 0
    # --systemd writes the unit to PATH: --config (a config file) is refused,
    # where it was overwritten by the unit with --force (final review).
    before = first.read_text()
    err = _fails(gateway, "init", "--systemd", "--config", str(first), "--force")
    assert "--systemd writes the unit to PATH; --config names a config file" in err
    assert first.read_text() == before
    assert gateway("init", "--systemd")[0] == 0
    assert (tmp_path / "gateway.service").read_text().startswith("# The gateway as a systemd")


def test_init_refuses_a_directory_and_follows_gateway_config(
    gateway: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`init DIR` said "DIR exists; not replacing it (--force to do so)" and
    --force then failed with "Is a directory"; `init ''` said ". exists";
    GATEWAY_CONFIG, which every other command reads, was ignored."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for force in ((), ("--force",)):
        err = _fails(gateway, "init", "d", *force)
        assert "is a directory (give a file name" in err, err
        # '' is no path at all (it said "'.' is a directory").
        err = _fails(gateway, "init", "", *force)
        assert "argument path: must not be empty" in err, err
    target = tmp_path / "from-env.toml"
    code, err = gateway("init", GATEWAY_CONFIG=str(target))
    assert code == 0, err
    assert target.read_text().startswith("#")
    assert not (tmp_path / "gateway.toml").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("device", "--tenant", "t", "\udcff\udcfe"),  # bytes 0xff 0xfe from the shell
        ("devices", "--tenant", "t", "--state", "\udcff"),
        ("history", "--tenant", "t", "d" * 70_000),
        ("devices", "--tenant", "t" * 600, "--state", "on"),
        ("rollup", "--tenant", "t", "d", "--metric", "m" * 513),
        # A tag as long as the API's tag parameter (4,096: a 1,024-character value fits).
        ("meta", "devices", "--tenant", "t", "k=" + "v" * 4095),
    ],
)
def test_a_name_that_is_not_utf8_or_too_long_is_refused(
    gateway: Run, args: tuple[str, ...]
) -> None:
    """Not valid UTF-8 (a terminal in Latin-1) or over 64 KiB was a traceback
    (blaming Cassandra for the first); the API takes 512 characters, 4,096
    for a tag."""
    err = _fails(gateway, *args)
    most = 4096 if args[0] == "meta" else 512
    assert "not valid UTF-8" in err or f"longer than {most} characters" in err, err
    assert len(err) < 1000  # a long name is not echoed whole


@pytest.mark.parametrize(
    "args",
    [
        ("quota", "--tenant", "bad/x", "--recount"),  # wrote a count no topic can reach
        ("devices", "--tenant", "a+b", "--state", "on"),  # said "0 devices", as if there were none
        ("history", "--tenant", "#", "d"),
        ("noisy", "--tenant", "t/"),
        ("rejected", "--tenant", "x/y"),
    ],
)
def test_a_tenant_no_topic_can_name_is_refused(gateway: Run, args: tuple[str, ...]) -> None:
    """A tenant is one topic level. `gateway quota --tenant bad/x --recount`
    was accepted and wrote a count for a tenant no message can belong to; the
    reads answered "0 devices", as if the tenant were empty."""
    err = _fails(gateway, *args)
    assert "argument --tenant: a tenant is one topic level" in err, err


@pytest.mark.parametrize(
    ("args", "argument"),
    [(("init", ""), "path"), (("check", "--config", ""), "--config")],
)
def test_an_empty_path_is_refused(gateway: Run, args: tuple[str, ...], argument: str) -> None:
    """Path('') is '.': `init ''` said "'.' is a directory" (CLI probe)."""
    err = _fails(gateway, *args)
    assert f"argument {argument}: must not be empty" in err, err


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        (("history", "--tenant", "t", ""), "device_id"),
        (("devices", "--tenant", "t", "--state", ""), "--state"),
        (("quota", "--tenant", "t", "--release", ""), "--release"),  # said "not admitted: "
        (("meta", "values", "--tenant", "t", ""), "KEY"),
    ],
)
def test_an_empty_device_state_or_key_is_refused(
    gateway: Run, args: tuple[str, ...], argument: str
) -> None:
    """No device, state or key is empty: one was looked up and said missing."""
    err = _fails(gateway, *args)
    assert f"argument {argument}: must not be empty" in err, err


def test_a_state_is_trimmed_as_the_decoder_stores_it(gateway: Run) -> None:
    """`--state 'on '` listed nobody: the decoder stores a device's "on " as
    "on". Only whitespace is refused, naming the option."""
    assert _parser().parse_args(["devices", "--tenant", "t", "--state", " on\t"]).state == "on"
    err = _fails(gateway, "devices", "--tenant", "t", "--state", "  ")
    assert "argument --state: '  ' is only whitespace, and no state is" in err, err


@pytest.mark.parametrize(
    "args",
    [
        ("devices", "--tenant", "", "--state", "on"),
        ("quota", "--tenant", ""),
        ("meta", "tags", "--tenant", ""),
        ("rollup", "--tenant", "", "d1"),
    ],
)
def test_an_empty_tenant_is_refused_where_only_rejected_takes_one(
    gateway: Run, args: tuple[str, ...]
) -> None:
    """`--tenant ''` is how `gateway rejected` lists messages whose topic
    named no tenant. The other commands passed it to Cassandra, which
    refused the empty key, and printed the driver's traceback."""
    err = _fails(gateway, *args)
    assert "argument --tenant: must not be empty" in err, err


@pytest.mark.parametrize(
    "args",
    [("devices", "--tenant", "acme", "--state", "on"), ("history", "--tenant", "acme", "d1")],
)
def test_a_read_that_cannot_reach_cassandra_says_so_in_one_line(args: tuple[str, ...]) -> None:
    """The driver's own reports of the failed connect (a warning and an
    error, from cassandra.cluster) came before the command's line. (A
    process of its own: in this one, pytest's log capture holds the root
    logger, and the command's stderr handler is never installed.)"""
    done = run_cli(*args, env=base_env(GATEWAY_CASSANDRA__PORT="1"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        "gateway: cannot connect to Cassandra at 127.0.0.1:1: connection refused"
    ], done.stderr


@pytest.mark.parametrize("since", ["20261126", "1764161000", "1764161000000", "90"])
def test_a_time_without_a_unit_is_refused(gateway: Run, since: str) -> None:
    """A bare number was read as seconds ago: a date typed as 20261126 went
    back 234 days, an epoch time 56 years, without a word."""
    err = _fails(gateway, "history", "--tenant", "t", "d", "--since", since)
    assert f"--since: {since!r} has no unit" in err, err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("history", "--tenant", "t", "d", "--since", "90"), "--since: '90' has no unit"),
        (("rollup", "--tenant", "t", "d", "--step", "2m"), "--step: expected 1m or 1h"),
        (("meta", "devices", "--tenant", "t", "floor"), "KEY=VALUE: expected KEY:VALUE"),
        # It said "expected KEY:VALUE ... (got '')" (probe).
        (("meta", "devices", "--tenant", "t", ""), "KEY=VALUE: required: KEY:VALUE or KEY=VALUE"),
    ],
)
def test_an_argument_checked_after_parsing_is_reported_as_argparse_reports_its_own(
    gateway: Run, args: tuple[str, ...], said: str
) -> None:
    """Such errors came as ``gateway: --since: ...``, with no usage, where
    argparse's (a --limit out of range) come as the command's usage line, then
    ``gateway history: error: ...``: two formats for one kind of mistake."""
    err = _fails(gateway, *args)
    command = " ".join(args[: 2 if args[0] == "meta" else 1])
    assert err.startswith(f"usage: gateway {command} [-h]"), err
    assert f"\ngateway {command}: error: {said}" in err, err
    assert "gateway: " not in err, err


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (("devices", "--tenant", "t", "--state", "on", "--bogus"), "gateway devices"),
        (("history", "--tenant", "t", "d1", "--bogus"), "gateway history"),
        (("schema", "apply", "--bogus"), "gateway schema apply"),
        (("token", "list", "--bogus"), "gateway token list"),
    ],
)
def test_an_unknown_option_is_refused_with_the_command_s_usage(
    gateway: Run, args: tuple[str, ...], usage: str
) -> None:
    """argparse reports an argument no parser took with the top-level usage
    (``gateway [-h] ... COMMAND ...``), which names none of the command's
    options, once the command's own arguments were all there."""
    err = _fails(gateway, *args)
    assert err.startswith(f"usage: {usage} [-h]"), err
    assert f"\n{usage}: error: unrecognized arguments: --bogus" in err, err


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        (("--devices", "1000000000"), "--devices"),  # built in memory first: 22 GB, then killed
        (("--count", "-5"), "--count"),
        (("--duration", "-1"), "--duration"),
        (("--tenant", "+"), "--tenant"),
        (("--tenant", "a/b"), "--tenant"),  # published into another topic tree
        # These said "rate must be ...", naming no option.
        (("--rate", "0"), "--rate"),
        (("--rate", "nan"), "--rate"),
        (("--noisy", "2"), "--noisy"),
    ],
)
def test_simulate_refuses_what_it_cannot_do(
    gateway: Run, args: tuple[str, ...], argument: str
) -> None:
    err = _fails(gateway, "simulate", *args)
    assert f"argument {argument}:" in err, err


def _answering(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A listener on a free port answering every connection with ``reply``."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(4096)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (b"\x00\x07\x00\x00garbage\r\n\r\n", "does not speak HTTP (BadStatusLine)"),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", "answered 404 Not Found"),
    ],
)
def test_noisy_names_what_answers_instead_of_the_gateway(
    gateway: Run, reply: bytes, said: str
) -> None:
    """Another service on api.port (Cassandra's, say) gave a BadStatusLine
    traceback; `gateway serve` (no /noisy) was "cannot reach"."""
    listener, _ = _answering(reply)
    try:
        code, err = gateway(
            "noisy", "--tenant", "t", GATEWAY_API__PORT=str(listener.getsockname()[1])
        )
    finally:
        listener.close()
    assert code == 1, err
    assert "Traceback" not in err
    assert said in err, err


@pytest.mark.parametrize("spool", [False, True])
def test_run_hides_the_drivers_reports_of_its_first_connect_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, spool: bool
) -> None:
    """Without the spool, `gateway run` with Cassandra away printed four of the
    drivers' lines (two C++ driver errors, a warning and an error from
    cassandra-driver) before its one line saying so. They are hidden until the
    gateway is open (READY), then logged again. With the spool too: its own
    attempts are quiet (gateway/spooling.py), but the first one logged
    cassandra-driver's ERROR at every start during an outage (field-engineer
    probe)."""
    drivers = [logging.getLogger(n) for n in ("cassandra.cluster", "gateway.store.write_session")]

    async def fake_run(config: Config, stop: asyncio.Event, **kw: Any) -> Stats:
        for logger in drivers:
            logger.error("while opening")
        kw["notifier"].notify("READY=1", "STATUS=running")
        for logger in drivers:
            logger.error("once open")
        return Stats()

    async def unreachable(config: Config, stop: asyncio.Event, **kw: Any) -> Stats:
        for logger in drivers:
            logger.error("while opening")
        raise CassandraUnreachable("cannot connect to Cassandra at 127.0.0.1:1")

    config = load_config(None, {"GATEWAY_SPOOL__ENABLED": str(spool).lower()})
    threshold = gc.get_threshold()
    caplog.set_level(logging.INFO)
    try:
        monkeypatch.setattr(app, "run", fake_run)
        assert asyncio.run(_run(config)) == 0
        monkeypatch.setattr(app, "run", unreachable)
        with pytest.raises(CassandraUnreachable):
            asyncio.run(_run(config))
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    for logger in drivers:
        logger.error("after the run")
    assert [(r.name, r.getMessage()) for r in caplog.records if r.name != "gateway"] == [
        *[(logger.name, "once open") for logger in drivers],
        *[(logger.name, "after the run") for logger in drivers],
    ]


@pytest.mark.parametrize(("chunk", "young"), [(2000, 100_000), (500, 50_000), (5000, 250_000)])
def test_run_s_young_collection_holds_a_chunk(
    monkeypatch: pytest.MonkeyPatch, chunk: int, young: int
) -> None:
    """The cyclic collector's young generation is at least a chunk's objects
    (about 50 per message): below that, nearly every full chunk was a
    collection that walked it all."""
    seen: list[tuple[int, ...]] = []

    async def fake_run(config: Config, stop: asyncio.Event, **kw: Any) -> Stats:
        seen.append(gc.get_threshold())
        return Stats()

    config = load_config(None, {"GATEWAY_PIPELINE__BATCH_MAX_EVENTS": str(chunk)})
    threshold = gc.get_threshold()
    try:
        monkeypatch.setattr(app, "run", fake_run)
        assert asyncio.run(_run(config)) == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    assert seen == [(young, 10, 10)]


@pytest.mark.parametrize("command", ["devices", "history", "rollup", "rejected", "meta"])
def test_help_says_what_a_command_does_with_examples_and_exit_status(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"examples:\n  gateway {command} " in out, out
    assert "exit status: 0 done, 1 failed" in out, out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("gateway 0.")


def test_noisy_with_no_gateway_running_says_connection_refused(gateway: Run) -> None:
    """It printed the raw "(URLError: <urlopen error [Errno 111] Connection refused>)"."""
    code, err = gateway("noisy", "--tenant", "t", GATEWAY_API__PORT=str(free_port()))
    assert code == 1, err
    assert "/noisy?tenant=t: connection refused; is `gateway run` up" in err, err
    assert "URLError" not in err


def _commands(capsys: pytest.CaptureFixture[str], words: tuple[str, ...] = ()) -> set[str]:
    """Every command a user types, from ``--help`` (the subcommands a help
    lists, 4 spaces in, under "positional arguments"), followed down."""
    with pytest.raises(SystemExit):
        _parser().parse_args([*words, "--help"])
    names = re.findall(r"^    ([a-z][a-z-]*)(?:\s|$)", capsys.readouterr().out, re.MULTILINE)
    found: set[str] = set()
    for name in names:
        found |= _commands(capsys, (*words, name)) or {" ".join(("gateway", *words, name))}
    return found


def test_the_readmes_command_reference_lists_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's table of commands against the CLI's parser (a command
    added or gone without the table following fails here)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Command reference", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(gateway [a-z -]+)` \|", table, re.MULTILINE))
    commands = _commands(capsys)
    assert {"gateway run", "gateway meta devices", "gateway token add"} <= commands
    assert commands - listed == set(), "in the CLI, not in the README's table"
    assert listed - commands == set(), "in the README's table, not in the CLI"


def test_the_readmes_command_reference_names_only_options_the_commands_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each row's options (``--name``) against that command's usage line: an
    option renamed or gone without the table following fails here."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Command reference", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `gateway ([a-z -]+)` \|.*\|\s*([^|]*?)\s*\|$", table, re.MULTILINE)
    assert len(rows) > 20
    wrong = []
    for command, options in rows:
        with pytest.raises(SystemExit):
            _parser().parse_args([*command.split(), "--help"])
        usage = capsys.readouterr().out.split("\n\n", 1)[0]  # the usage lines
        wrong += [
            f"gateway {command}: {option}"
            for option in re.findall(r"`(--[a-z-]+)`", options)
            if not re.search(rf"{re.escape(option)}(?![a-z-])", usage)
        ]
    assert wrong == []


class _Terminal:
    """A stderr that is a terminal, recording what reached it at each flush."""

    def __init__(self) -> None:
        self.buffer = ""
        self.flushed: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buffer += text
        return len(text)

    def flush(self) -> None:
        self.flushed.append(self.buffer)


def test_progress_on_a_terminal_is_one_line_shown_at_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rebuild-rollups and meta count rewrote their line in place without
    flushing it: stderr is line-buffered, so a terminal saw it only at the end."""
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with _Progress() as say:
        say("step 1, reading a day")
        assert terminal.flushed[-1] == "\rstep 1, reading a day\x1b[K"
        say("step 2")  # shorter: the rest of the line is erased
        assert terminal.flushed[-1] == "\rstep 1, reading a day\x1b[K\rstep 2\x1b[K"
    assert terminal.buffer.endswith("\rstep 2\x1b[K\n")


def _to_full_disk(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command with its output going to /dev/full (every write: ENOSPC)."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "gateway", *args],
            env=env,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )


def test_an_output_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """`> /dev/full` (a full disk) ended every command with a traceback, and
    `token add` left a valid token in the file that nobody had seen: it is
    shown once, and its secret was lost (CLI probe)."""
    env = base_env(GATEWAY_API__TOKENS_FILE=str(tmp_path / "tokens.jsonl"))
    done = _to_full_disk("schema", "print", env=env)
    assert done.returncode == 1
    assert done.stderr == "gateway: cannot write the output: No space left on device\n"
    done = _to_full_disk("token", "add", "--tenant", "acme", env=env)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "cannot write the token (No space left on device); token " in done.stderr
    assert "revoked" in done.stderr
    listed = run_cli("token", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert orjson.loads(listed.stdout) == []
