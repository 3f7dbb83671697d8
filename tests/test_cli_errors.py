"""Bad command-line input: an error that names the option and says what it
accepts (exit 2), before anything is connected. Cassandra and the broker are
pointed at ports nobody listens on, so a command that connected first would
fail with a connection error instead of the one asserted."""

from __future__ import annotations

import pytest

from tests.helpers import base_env, run_cli

NOWHERE = {"GATEWAY_CASSANDRA__PORT": "1", "GATEWAY_MQTT__PORT": "1"}


def _fails(*args: str, **env: str) -> str:
    result = run_cli(*args, env=base_env(**NOWHERE, **env))
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert "connect" not in result.stderr.lower(), result.stderr
    return result.stderr


def test_a_log_level_outside_the_list_is_refused_and_the_list_shown() -> None:
    err = _fails("--log-level", "LOUD", "schema", "print")
    assert "argument --log-level: expected DEBUG, INFO, WARNING or ERROR (got 'LOUD')" in err
    assert run_cli("schema", "print", "--log-level", "error").returncode == 0


def test_gateway_log_level_in_the_environment_sets_the_level() -> None:
    result = run_cli("schema", "print", env=base_env(GATEWAY_LOG_LEVEL="debug"))
    assert result.returncode == 0, result.stderr
    err = _fails("schema", "print", GATEWAY_LOG_LEVEL="LOUD")
    assert "GATEWAY_LOG_LEVEL: expected DEBUG, INFO, WARNING or ERROR (got 'LOUD')" in err


@pytest.mark.parametrize("hours", ["x", "1.5", "0", "169"])
def test_rejected_hours_says_what_it_takes(hours: str) -> None:
    err = _fails("rejected", "--tenant", "t", "--hours", hours)
    assert f"argument --hours: a whole number of hours from 1 to 168 (got {hours!r})" in err
    assert "_hours" not in err


@pytest.mark.parametrize("command", ["history", "rejected"])
@pytest.mark.parametrize("limit", ["0", "-1", "100001", "many"])
def test_a_limit_out_of_range_is_refused(command: str, limit: str) -> None:
    args = ["history", "--tenant", "t", "d"] if command == "history" else ["rejected"]
    err = _fails(*args, "--limit", limit)
    assert f"argument --limit: a whole number from 1 to 100000 (got {limit!r})" in err


def test_history_refuses_a_range_that_ends_before_it_starts() -> None:
    err = _fails("history", "--tenant", "t", "d", "--since", "1h", "--until", "2h")
    assert "--since: must be before --until" in err


def test_rollup_range_errors_come_before_connecting() -> None:
    err = _fails("rollup", "--tenant", "t", "d", "--step", "1m", "--since", "2000-01-01T00:00:00Z")
    assert "--since: the range holds more than" in err
    err = _fails("rollup", "--tenant", "t", "d", "--step", "1m", "--since", "1h", "--until", "2h")
    assert "--since: must be before --until" in err
