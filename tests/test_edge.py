"""The edge host (issue 16): what a new user meets first, starting while the
link to Cassandra is down, the systemd unit and its sd_notify, and installing
from the wheel alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from gateway.store.database import Database

from .helpers import ROOT, base_env, make_config, publish, running_gateway, topic

# ---------------------------------------------------------------- found as a new user


def _into_head(*args: str, env: dict[str, str]) -> tuple[str, int, str]:
    """`gateway ARGS | head -1` through a real pipe: head's output, the
    gateway's exit code and its stderr."""
    with subprocess.Popen(
        ["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as head:
        assert head.stdin is not None
        with subprocess.Popen(
            [sys.executable, "-m", "gateway", *args],
            stdout=head.stdin,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        ) as gateway:
            head.stdin.close()  # the gateway holds the only write end now
            first, _ = head.communicate(timeout=120)
            _, err = gateway.communicate(timeout=120)
    return first, gateway.returncode, err


async def test_a_long_listing_piped_into_head_ends_quietly(db: Database, tenant: str) -> None:
    # Far more than a pipe holds (64 KiB), so the gateway is still writing
    # when head has gone: every run meets the broken pipe.
    count = 4000
    now = int(time.time() * 1000)
    messages = [
        (
            topic(tenant, f"device-{i:06d}"),
            orjson.dumps({"ts": now - 1000, "state": "on", "value": i}),
        )
        for i in range(count)
    ]
    async with running_gateway(make_config(GATEWAY_SAMPLING__ENABLED="false")) as gw:
        await publish(messages)
        await gw.wait_handled(count, deadline=120)
    first, code, err = await asyncio.to_thread(
        _into_head, "devices", "--tenant", tenant, "--state", "on", env=base_env()
    )
    assert first.startswith("device-")
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err
    assert code == 141, err


def test_every_command_stops_quietly_when_its_reader_is_gone(tmp_path: Path) -> None:
    """Commands that need no service, their reader closed before they write:
    the broken pipe is certain (for output small enough to sit in the buffer
    until exit, too)."""
    tokens = tmp_path / "tokens.jsonl"
    env = base_env(GATEWAY_API__TOKENS_FILE=str(tokens))
    added = subprocess.run(
        [sys.executable, "-m", "gateway", "token", "add", "--tenant", "acme"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert added.returncode == 0, added.stderr
    for args in (["schema", "print"], ["token", "list"], ["token", "list", "--json"], ["--help"]):
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "gateway", *args],
                stdout=write,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            os.close(write)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert "BrokenPipeError" not in done.stderr, (args, done.stderr)
        # argparse ignores its own write errors: --help still ends with 0.
        assert done.returncode == (0 if args == ["--help"] else 141), (args, done.stderr)


def test_make_status_fails_when_the_services_are_not_running(tmp_path: Path) -> None:
    # A state directory where nothing was started: the real services, run
    # from another one, are left alone.
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "status", f"STATE_DIR={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0, done.stdout
    assert "mosquitto: not running" in done.stdout
    assert "cassandra: not running" in done.stdout
