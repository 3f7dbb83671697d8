"""Read tokens of the HTTP API (gateway/web/tokens.py) and `gateway token add/list/revoke`.

The CLI works on a tokens file under tmp_path; a TokenStore in this process
plays the running server that must see what the CLI changed. No broker or
Cassandra needed. Most cases call the command in-process
(``gateway.tools.cli.main``: a second of interpreter start-up saved each,
about 40 s of a loaded ``make test``); the ones about what a real process
prints (its log included) or about several processes at once run it as one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import stat
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import orjson
import pytest

from gateway.config import load_config
from gateway.errors import ConfigError
from gateway.tools.cli import main
from gateway.web.tokens import (
    MAX_TOKENS,
    Grant,
    TokenError,
    TokenStore,
    token_from_header,
)

from .helpers import base_env, run_cli, wait_until_blocking

TOKEN_RE = re.compile(r"gwt_([0-9a-f]{8})_([A-Za-z0-9_-]{43})")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def token_env(path: Path) -> dict[str, str]:
    return base_env(GATEWAY_API__TOKENS_FILE=str(path))


def cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gateway token ARGS` in-process, with only token_env(path) as the environment."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, token_env(path), clear=True),
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        try:
            code = main(["token", *args])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(
        ["gateway", "token", *args], code, out.getvalue(), err.getvalue()
    )


def real_cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gateway token ARGS` as a process of its own, as a user runs it."""
    return run_cli("token", *args, env=token_env(path), timeout=60)


def add_token(path: Path, *args: str) -> tuple[str, str, str]:
    """`gateway token add ARGS`: (token, id, secret), read from the last line of stdout."""
    result = cli(path, "add", *args)
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    match = TOKEN_RE.fullmatch(last)
    assert match, f"last line is not a token: {result.stdout!r}"
    return last, match.group(1), match.group(2)


def listed(path: Path) -> list[dict[str, object]]:
    result = cli(path, "list", "--json")
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, object]] = orjson.loads(result.stdout)
    return rows


def line(token_id: str, **fields: object) -> bytes:
    record: dict[str, object] = {
        "id": token_id,
        "tenant": "acme",
        "label": "",
        "created": "2025-01-01T12:00:00Z",
        "sha256": hashlib.sha256(token_id.encode()).hexdigest(),
    }
    record |= fields
    return orjson.dumps({k: v for k, v in record.items() if v is not None}) + b"\n"


# ---------------------------------------------------------------- the CLI round trip


def test_add_verify_list_revoke_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "state" / "api" / "tokens.jsonl"  # parents do not exist yet
    token, token_id, secret = add_token(path, "--tenant", "acme", "--label", "floor 3")
    admin, admin_id, admin_secret = add_token(path, "--admin", "--label", "ops")

    store = TokenStore(path)
    assert store.verify(token) == Grant(token_id, "acme")
    grant = store.verify(admin)
    assert grant == Grant(admin_id, None)
    assert grant.admin
    assert grant.allows("acme")
    assert grant.allows("anyone")
    tenant_grant = store.verify(token)
    assert tenant_grant is not None
    assert tenant_grant.allows("acme")
    assert not tenant_grant.allows("other")
    assert not tenant_grant.admin

    # The file: only hashes, mode 0600, no temporary files left beside it.
    data = path.read_text()
    for s in (token, secret, admin, admin_secret):
        assert s not in data
    assert hashlib.sha256(secret.encode()).hexdigest() in data
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokens.jsonl", "tokens.jsonl.lock"]

    rows = listed(path)
    assert [(r["id"], r["tenant"], r["admin"], r["label"]) for r in rows] == [
        (token_id, "acme", False, "floor 3"),
        (admin_id, None, True, "ops"),
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", str(r["created"])) for r in rows)
    text = cli(path, "list")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split("\t")[:3] == [token_id, "acme", "floor 3"]
    assert lines[1].split("\t")[:3] == [admin_id, "*admin*", "ops"]
    assert str(path) in text.stderr
    for out in (text.stdout + text.stderr, orjson.dumps(rows).decode()):
        assert secret not in out
        assert hashlib.sha256(secret.encode()).hexdigest() not in out

    revoked = cli(path, "revoke", token_id)
    assert revoked.returncode == 0, revoked.stderr
    assert token_id in revoked.stdout
    assert [r["id"] for r in listed(path)] == [admin_id]
    assert TokenStore(path).verify(token) is None
    assert TokenStore(path).verify(admin) == Grant(admin_id, None)


def test_token_add_prints_the_token_once_and_only_on_stdout(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    result = real_cli(path, "add", "--tenant", "acme", "--log-level", "DEBUG")
    assert result.returncode == 0, result.stderr
    token = result.stdout.splitlines()[-1]
    assert TOKEN_RE.fullmatch(token)
    assert result.stdout.count(token) == 1
    assert "shown once" in result.stdout
    secret = token.split("_", 2)[2]
    assert secret not in result.stderr
    # Two tokens are never the same.
    assert add_token(path, "--tenant", "acme")[0] != token


def test_revoke_unknown_id_names_it(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    add_token(path, "--tenant", "acme")
    result = cli(path, "revoke", "deadbeef")
    assert result.returncode == 1
    assert "deadbeef" in result.stderr
    assert str(path) in result.stderr
    assert len(listed(path)) == 1


def test_revoke_takes_the_whole_token_and_never_echoes_its_secret(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    token, token_id, secret = add_token(path, "--tenant", "acme")
    result = cli(path, "revoke", token)
    assert result.returncode == 0, result.stderr
    assert token_id in result.stdout
    assert secret not in result.stdout + result.stderr
    assert listed(path) == []
    # A mistyped whole token: a usage error that does not repeat it.
    bad = cli(path, "revoke", f"gwt_{token_id}X_{secret}")
    assert bad.returncode == 2
    assert secret not in bad.stdout + bad.stderr
    # Not an id at all: a usage error (it was 1, as for an unknown id).
    bad = cli(path, "revoke", "nope")
    assert bad.returncode == 2
    assert "argument ID: the id 'nope' is not a token id" in bad.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((), "--tenant --admin"),
        (("--tenant", "acme", "--admin"), "--admin"),
        (("--tenant", ""), "--tenant"),
        (("--tenant", "a/b"), "--tenant"),
        (("--tenant", "acme", "--label", "two\nlines"), "--label"),
        (("--tenant", "acme", "--label", "x" * 201), "--label"),
        # Longer than a topic level may be: a tenant that can never send.
        (("--tenant", "t" * 129), "--tenant: 129 characters, over limits.max_topic_level_length"),
        (("--tenant", "t" * 600), "--tenant"),
    ],
)
def test_token_add_usage_errors_name_the_argument(
    tmp_path: Path, args: tuple[str, ...], named: str
) -> None:
    path = tmp_path / "tokens.jsonl"
    result = cli(path, "add", *args)
    assert result.returncode == 2
    assert named in result.stderr
    assert not path.exists()


def test_concurrent_adds_lose_no_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gateway", "token", "add", "--tenant", f"t{i}"],
            env=token_env(path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    tokens = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        tokens.append(out.splitlines()[-1])
    assert sorted(str(r["tenant"]) for r in listed(path)) == [f"t{i}" for i in range(6)]
    store = TokenStore(path)
    assert [store.verify(t) is not None for t in tokens] == [True] * 6


# ---------------------------------------------------------------- a running store sees changes


def test_running_store_rechecks_the_file_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    clock = FakeClock()
    store = TokenStore(path, clock=clock)
    assert store.list() == ()  # no file: no tokens

    token, token_id, _ = add_token(path, "--tenant", "acme")  # another process
    assert store.verify(token) is None  # within the interval the file is not looked at
    clock.now += 1.0
    assert store.verify(token) == Grant(token_id, "acme")

    assert cli(path, "revoke", token_id).returncode == 0
    assert store.verify(token) is not None
    clock.now += 1.0
    assert store.verify(token) is None
    assert store.list() == ()


def test_running_store_picks_up_add_and_revoke_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    store = TokenStore(path)  # the real clock and the default interval
    token, token_id, _ = add_token(path, "--tenant", "acme")
    wait_until_blocking(lambda: store.verify(token) is not None, 5, "the added token counts")
    other, _, _ = add_token(path, "--admin")
    assert cli(path, "revoke", token_id).returncode == 0
    wait_until_blocking(lambda: store.verify(token) is None, 5, "the revoked token is refused")
    wait_until_blocking(lambda: store.verify(other) is not None, 5, "the admin token counts")
    # The file removed: no tokens.
    path.unlink()
    wait_until_blocking(lambda: store.verify(other) is None, 5, "no file, no tokens")


def test_in_process_changes_count_at_once(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    store = TokenStore(path, clock=FakeClock())
    new = store.add(tenant="acme", label="api")
    assert store.verify(new.token) == Grant(new.info.id, "acme")
    assert new.token not in repr(new)
    assert [info.id for info in store.list()] == [new.info.id]
    assert store.revoke(new.info.id) == new.info
    assert store.verify(new.token) is None
    with pytest.raises(ValueError, match="not both"):
        store.add(tenant="acme", admin=True)
    with pytest.raises(ValueError, match="not both or neither"):
        store.add()


# ---------------------------------------------------------------- verify


def test_verify_refuses_anything_but_a_listed_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    store = TokenStore(path)
    new = store.add(tenant="acme")
    token_id, secret = new.info.id, new.token.split("_", 2)[2]
    wrong = "A" if secret[0] != "A" else "B"
    for candidate in (
        "",
        "gwt",
        f"gwt_{token_id}",
        f"gwt_{token_id}_",
        f"gwt_{token_id}_{wrong}{secret[1:]}",  # one character off
        f"gwt_{token_id}_{secret}x",
        f"gwt_{token_id}_{secret[:-1]}",
        f"xyz_{token_id}_{secret}",
        f"gwt_deadbeef_{secret}",  # another id
        f"gwt_{token_id}_{secret}é",
        f"gwt_{token_id}_{secret}" + "a" * 300,
        f" {new.token}",
        secret,
    ):
        assert store.verify(candidate) is None, candidate
    assert store.verify(new.token) is not None


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Bearer gwt_1_2", "gwt_1_2"),
        ("bearer  gwt_1_2 ", "gwt_1_2"),
        ("Basic dXNlcjpwdw==", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_token_from_header(header: str | None, expected: str | None) -> None:
    assert token_from_header(header) == expected


# ---------------------------------------------------------------- a corrupt file


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b"not json\n", "not a JSON object"),
        (b"[1, 2]\n", "not a JSON object"),
        (line("0000000b", sha256=None), "missing key 'sha256'"),
        (line("0000000b", sha256="ab" * 31), "sha256"),
        (line("0000000b", sha256="AB" * 32), "sha256"),
        (line("0000000a"), "already on line 1"),
        (line("0000000b", admin=True), "admin"),
        (line("0000000b", tenant=None), "missing key 'tenant'"),
        (line("0000000b", tenant="a/b"), "tenant"),
        (line("0000000b", tenant=7), "tenant"),
        (line("0000000b", created="yesterday"), "created"),
        (line("0000000b", role="admin"), "unknown key 'role'"),
        (line("XYZ"), "id"),
        (b"{" + b" " * 5000 + b"}\n", "longer than"),
    ],
)
def test_corrupt_file_error_names_file_and_line(tmp_path: Path, bad: bytes, says: str) -> None:
    path = tmp_path / "tokens.jsonl"
    path.write_bytes(line("0000000a") + b"\n" + bad)  # a blank line is fine: bad is line 3
    with pytest.raises(ConfigError) as caught:
        TokenStore(path)
    message = str(caught.value)
    assert f"tokens file {path}, line 3: " in message
    assert says in message
    assert hashlib.sha256(b"0000000b").hexdigest() not in message  # never quotes the line


def test_cli_on_a_corrupt_file_names_file_and_line_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    content = line("0000000a") + line("0000000b", sha256="ab" * 31)
    path.write_bytes(content)
    for args in (("list",), ("add", "--tenant", "acme"), ("revoke", "0000000a")):
        result = cli(path, *args)
        assert result.returncode == 2, args
        assert f"tokens file {path}, line 2: sha256" in result.stderr
    assert path.read_bytes() == content


def test_a_file_turned_corrupt_under_a_running_store_fails_closed_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway")
    path = tmp_path / "tokens.jsonl"
    clock = FakeClock()
    store = TokenStore(path, clock=clock)
    new = store.add(tenant="acme")
    good = path.read_bytes()

    path.write_bytes(good + b"{oops\n")
    clock.now += 1
    assert store.verify(new.token) is None  # closed: the file may have meant a revoke
    assert store.error is not None
    assert f"{path}, line 2" in str(store.error)
    for _ in range(3):
        clock.now += 1
        store.verify(new.token)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1  # once per broken version, not per request
    assert f"{path}, line 2" in errors[0].getMessage()

    path.write_bytes(good)
    clock.now += 1
    assert store.verify(new.token) is not None
    assert store.error is None
    secret = new.token.split("_", 2)[2]
    assert secret not in caplog.text
    assert hashlib.sha256(secret.encode()).hexdigest() not in caplog.text


# ---------------------------------------------------------------- bounds


def test_cap_reached_in_the_library(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    store = TokenStore(path, max_tokens=3)
    for i in range(3):
        store.add(tenant=f"t{i}")
    with pytest.raises(TokenError, match=r"already holds 3 tokens, the most allowed \(3\)"):
        store.add(admin=True)
    assert len(store) == 3
    store.revoke(store.list()[0].id)
    store.add(admin=True)  # room again

    path.write_bytes(path.read_bytes() + line("0000000f"))
    with pytest.raises(ConfigError, match=rf"{path}, line 4: more than 3 tokens"):
        TokenStore(path, max_tokens=3)


def test_cap_reached_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    path.write_bytes(b"".join(line(f"{i:08x}", tenant=f"t{i % 7}") for i in range(MAX_TOKENS)))
    os.chmod(path, 0o600)
    result = cli(path, "add", "--tenant", "acme")
    assert result.returncode == 1
    assert f"{path} already holds {MAX_TOKENS} tokens" in result.stderr
    assert "revoke" in result.stderr
    assert len(path.read_bytes().splitlines()) == MAX_TOKENS
    assert len(listed(path)) == MAX_TOKENS  # a full file is still read


# ---------------------------------------------------------------- config


def test_tokens_file_default_and_environment() -> None:
    assert load_config(None, {}).api.tokens_file == Path("gateway-tokens.jsonl")
    env = {"GATEWAY_API__TOKENS_FILE": "/var/lib/gateway/tokens.jsonl"}
    assert load_config(None, env).api.tokens_file == Path("/var/lib/gateway/tokens.jsonl")


def test_folders_made_for_the_tokens_file_are_private(tmp_path: Path) -> None:
    """Missing folders on the way to api.tokens_file were made with the
    umask's mode: 0777 under umask 000, a folder of secrets anyone could fill."""
    path = tmp_path / "etc" / "gateway" / "tokens.jsonl"
    old = os.umask(0)
    try:
        TokenStore(path).add(tenant="acme")
    finally:
        os.umask(old)
    for folder in (tmp_path / "etc", tmp_path / "etc" / "gateway"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
