"""Read tokens for the HTTP API: who may read which tenant.

A token is ``gwt_<id>_<secret>``. The id is public (``gateway token list``
shows it, ``gateway token revoke`` takes it); the secret is 256 random bits
and is shown once, by ``gateway token add``. The tokens file keeps only
``sha256(secret)``, so reading the file gives no token away. A token grants
one tenant, or every tenant (admin).

The file (``api.tokens_file``) is JSON Lines, one token a line, either
``"tenant": "acme"`` or ``"admin": true``::

    {"id":"3f9a1c2b","tenant":"acme","label":"lobby","created":"2025-01-01T12:00:00Z","sha256":"…"}
    {"id":"0b7d44e1","admin":true,"label":"ops","created":"2025-01-01T12:00:00Z","sha256":"…"}

Promises:

* ``verify`` is a dict lookup and one sha256 of the presented secret, compared
  with ``hmac.compare_digest``. It re-stats the file at most once per
  ``recheck_interval`` (1 s) and reloads it when it changed, so tokens added or
  revoked by another process (``gateway token add/revoke``) count within about
  a second in a running server.
* A missing file means no tokens. A corrupt file is a ``ConfigError`` naming
  the file and line when the store opens or changes it; a file that turns
  corrupt under a running store fails closed (no token is accepted, one error
  logged) until it is fixed.
* Writes are atomic (temporary file, fsync, ``os.replace``), mode 0600, under
  an exclusive lock (``<file>.lock``) so concurrent ``token add`` lose nothing.
* At most ``max_tokens`` (10,000) tokens; adding past it is a ``TokenError``.
* Neither tokens, secrets nor hashes are ever logged or put in a repr or an
  error message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from ..errors import ConfigError, GatewayError
from ..topic_filters import has_control, is_topic_level

log = logging.getLogger(__name__)

PREFIX = "gwt"
MAX_TOKENS = 10_000
MAX_LABEL_LENGTH = 200
# A tenant is a topic level (config.limits.max_topic_level_length is at most 1024).
MAX_TENANT_LENGTH = 1024
# Anything longer is not one of ours: refused before hashing.
_MAX_TOKEN_LENGTH = 256
# A record is well under this; a longer line is not one we wrote.
_MAX_LINE_BYTES = 4096
_ID_RE = re.compile(r"[0-9a-f]{8,32}")
# A token anywhere in a text (a log line quoting a request's header).
_TOKEN_IN_TEXT = re.compile(rf"({PREFIX}_[0-9a-f]{{8,32}}_)[A-Za-z0-9_-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_ID_BYTES = 4  # 8 hex digits: ids are for typing, uniqueness is checked
_SECRET_BYTES = 32


def mask_secrets(text: str) -> str:
    """``text`` with every token's secret replaced by ``...`` (its public id
    stays, so the log still says which token it was)."""
    return _TOKEN_IN_TEXT.sub(r"\1...", text)


class TokenError(GatewayError):
    """A token operation refused: unknown id, the cap reached, the file unwritable."""


def check_tenant(tenant: str) -> str:
    """``tenant`` if it can be one (a non-empty topic level), else ValueError saying why."""
    if not tenant:
        raise ValueError("a tenant must not be empty")
    if len(tenant) > MAX_TENANT_LENGTH:
        raise ValueError(f"a tenant is at most {MAX_TENANT_LENGTH} characters")
    if not is_topic_level(tenant):
        raise ValueError("a tenant is one topic level: no '/', '+', '#' or control characters")
    return tenant


def check_token_id(text: str) -> str:
    """The id of a token given by its id or whole (``gwt_<id>_<secret>``),
    else ValueError saying why, never echoing a secret."""
    if text.startswith(f"{PREFIX}_"):
        text = text.split("_")[1]  # the whole token pasted: never echo its secret
    if not _ID_RE.fullmatch(text):
        shown = repr(text) if len(text) <= 32 and "_" not in text else "given"
        raise ValueError(
            f"the id {shown} is not a token id (8 to 32 lowercase hex digits, as "
            "`gateway token list` shows)"
        )
    return text


def check_label(label: str) -> str:
    """``label`` if it fits on one line of ``token list``, else ValueError saying why."""
    if len(label) > MAX_LABEL_LENGTH:
        raise ValueError(f"a label is at most {MAX_LABEL_LENGTH} characters")
    if has_control(label):
        raise ValueError("a label must not hold control characters (tabs, newlines)")
    return label


def token_from_header(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


@dataclass(frozen=True, slots=True)
class Grant:
    """What a verified token may read: one tenant, or every tenant (``tenant`` None)."""

    token_id: str
    tenant: str | None

    @property
    def admin(self) -> bool:
        return self.tenant is None

    def allows(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One token as ``gateway token list`` shows it: never its secret or hash."""

    id: str
    tenant: str | None  # None: admin
    label: str
    created: datetime

    @property
    def admin(self) -> bool:
        return self.tenant is None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "admin": self.admin,
            "label": self.label,
            "created": _iso(self.created),
        }


@dataclass(frozen=True, slots=True)
class NewToken:
    """What ``add`` returns: the token itself exists only here (kept out of the repr)."""

    info: TokenInfo
    token: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class _Entry:
    info: TokenInfo
    digest: bytes = field(repr=False)
    grant: Grant


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("ascii")).digest()


# Identity of the file's current version: os.replace gives a new inode, and
# every write changes mtime and almost always size.
_FileKey = tuple[int, int, int, int, int] | None


def _file_key(info: os.stat_result) -> _FileKey:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class TokenStore:
    """The tokens in one file. Opening reads it (a corrupt file raises ConfigError).

    Not thread-safe: use it from one thread (the event loop). ``verify`` may
    read the file when it changed (a few ms at 10,000 tokens, at most once a
    second); the rest of the time it is a stat per second and a dict lookup.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_tokens: int = MAX_TOKENS,
        recheck_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self._path = path
        self._max = max_tokens
        self._interval = recheck_interval
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._key: _FileKey = None
        self._failed_key: _FileKey = None
        self._checked = clock()
        self._error: ConfigError | None = None
        self._key, self._entries = self._read()

    @property
    def path(self) -> Path:
        return self._path

    @property
    def error(self) -> ConfigError | None:
        """Why the file could not be reloaded (no token is accepted meanwhile), else None."""
        return self._error

    def __len__(self) -> int:
        self._maybe_reload()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenStore({str(self._path)!r}, {len(self._entries)} tokens)"

    # -- reading ------------------------------------------------------------

    def verify(self, token: str) -> Grant | None:
        """The grant of a valid token, else None. Cheap enough for every request."""
        self._maybe_reload()
        if len(token) > _MAX_TOKEN_LENGTH or not token.isascii():
            return None
        prefix, _, rest = token.partition("_")
        token_id, _, secret = rest.partition("_")
        if prefix != PREFIX or not secret:
            return None
        entry = self._entries.get(token_id)
        if entry is None:
            return None
        if not hmac.compare_digest(_digest(secret), entry.digest):
            return None
        return entry.grant

    def list(self) -> tuple[TokenInfo, ...]:
        """Every token, oldest first."""
        self._maybe_reload()
        return tuple(entry.info for entry in self._entries.values())

    def refresh(self, *, force: bool = False) -> None:
        """Reload the file if it changed since the last look (``verify`` does this itself).

        Never raises for a corrupt file: the store then fails closed and
        ``error`` says why; it recovers once the file is fixed.
        """
        self._checked = self._clock()
        try:
            key = _file_key(self._path.stat())
        except FileNotFoundError:
            key = None
        except OSError as exc:
            self._fail(None, ConfigError(f"cannot read tokens file {self._path}: {exc.strerror}"))
            return
        if not force and key == self._key and self._error is None:
            return
        if not force and key is not None and key == self._failed_key:
            return  # still the broken version: logged once already
        try:
            self._key, self._entries = self._read()
        except ConfigError as exc:
            self._fail(key, exc)
            return
        self._error = None
        self._failed_key = None
        log.info("tokens file %s reloaded: %d tokens", self._path, len(self._entries))

    def _maybe_reload(self) -> None:
        if self._clock() - self._checked >= self._interval:
            self.refresh()

    def _fail(self, key: _FileKey, exc: ConfigError) -> None:
        # Fail closed: a revoke that went wrong must not leave old tokens valid.
        self._entries = {}
        self._key = None
        if self._error is None or str(exc) != str(self._error):
            log.error("%s; no token is accepted until it is fixed", exc)
        self._failed_key = key
        self._error = exc

    def _read(self) -> tuple[_FileKey, dict[str, _Entry]]:
        try:
            with self._path.open("rb") as f:
                key = _file_key(os.fstat(f.fileno()))
                limit = self._max * _MAX_LINE_BYTES
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None, {}
        except OSError as exc:
            raise ConfigError(f"cannot read tokens file {self._path}: {exc.strerror}") from None
        if len(data) > limit:
            raise ConfigError(
                f"tokens file {self._path} is over {limit} bytes: not a tokens file, "
                f"or more than {self._max} tokens"
            )
        return key, self._parse(data)

    def _parse(self, data: bytes) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        lines: dict[str, int] = {}
        for number, line in enumerate(data.split(b"\n"), start=1):
            if not line.strip():
                continue
            where = f"tokens file {self._path}, line {number}"
            # Messages never quote the line: it may hold a hash, or a token
            # pasted there by mistake.
            if len(line) > _MAX_LINE_BYTES:
                raise ConfigError(f"{where}: longer than {_MAX_LINE_BYTES} bytes")
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise ConfigError(f"{where}: not a JSON object") from None
            try:
                entry = _entry(record)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if entry.info.id in lines:
                raise ConfigError(
                    f"{where}: id {entry.info.id} is already on line {lines[entry.info.id]}"
                )
            if len(entries) == self._max:
                raise ConfigError(f"{where}: more than {self._max} tokens")
            lines[entry.info.id] = number
            entries[entry.info.id] = entry
        return entries

    # -- changing -----------------------------------------------------------

    def add(self, *, tenant: str | None = None, admin: bool = False, label: str = "") -> NewToken:
        """A new token for ``tenant``, or for every tenant with ``admin=True``.

        The token is in the result only; the file gets its hash.
        Raises ValueError for a bad tenant or label, TokenError at the cap or
        when the file cannot be written, ConfigError when it is corrupt.
        """
        if admin == (tenant is not None):
            raise ValueError("give a tenant or admin=True, not both or neither")
        if tenant is not None:
            check_tenant(tenant)
        check_label(label)
        secret = secrets.token_urlsafe(_SECRET_BYTES)
        with self._locked():
            entries = self._read()[1]
            if len(entries) >= self._max:
                raise TokenError(
                    f"tokens file {self._path} already holds {len(entries)} tokens, the most "
                    f"allowed ({self._max}); revoke unused ones with `gateway token revoke`"
                )
            token_id = secrets.token_hex(_ID_BYTES)
            while token_id in entries:
                token_id = secrets.token_hex(_ID_BYTES)
            info = TokenInfo(
                id=token_id,
                tenant=tenant,
                label=label,
                created=datetime.now(UTC).replace(microsecond=0),
            )
            entries[token_id] = _Entry(info, _digest(secret), Grant(token_id, tenant))
            self._write(entries)
        return NewToken(info, f"{PREFIX}_{token_id}_{secret}")

    def revoke(self, token_id: str) -> TokenInfo:
        """Remove a token by id (or by the whole token); TokenError naming the id if unknown."""
        try:
            token_id = check_token_id(token_id)
        except ValueError as exc:
            raise TokenError(str(exc)) from None
        with self._locked():
            entries = self._read()[1]
            entry = entries.pop(token_id, None)
            if entry is None:
                raise TokenError(
                    f"no token with id {token_id} in {self._path} (`gateway token list` shows them)"
                )
            self._write(entries)
        return entry.info

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # Read-modify-write under an exclusive lock: two `token add` at once
        # would otherwise each write a file without the other's token.
        lock_path = self._path.with_name(self._path.name + ".lock")
        try:
            _make_private_folders(self._path.parent)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise TokenError(f"cannot lock tokens file {self._path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _write(self, entries: Mapping[str, _Entry]) -> None:
        data = b"".join(orjson.dumps(_record(e)) + b"\n" for e in entries.values())
        parent = self._path.parent
        try:
            # mkstemp creates the file with mode 0600.
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{self._path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            dir_fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            key = _file_key(self._path.stat())
        except OSError as exc:
            raise TokenError(f"cannot write tokens file {self._path}: {exc.strerror}") from None
        self._entries = dict(entries)
        self._key = key
        self._failed_key = None
        self._error = None
        self._checked = self._clock()


def _record(entry: _Entry) -> dict[str, Any]:
    info = entry.info
    scope: dict[str, Any] = {"admin": True} if info.tenant is None else {"tenant": info.tenant}
    return {
        "id": info.id,
        **scope,
        "label": info.label,
        "created": _iso(info.created),
        "sha256": entry.digest.hex(),
    }


_KEYS = {"id", "label", "created", "sha256"}


def _entry(record: object) -> _Entry:
    """A record of the file as an _Entry; ValueError naming the bad key."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    _check_keys(record.keys())
    token_id = record["id"]
    if not isinstance(token_id, str) or not _ID_RE.fullmatch(token_id):
        raise ValueError("id: 8 to 32 lowercase hex digits expected")
    tenant = record.get("tenant")
    if "admin" in record:
        if record["admin"] is not True or "tenant" in record:
            raise ValueError('an admin token has "admin": true and no tenant')
    elif not isinstance(tenant, str):
        raise ValueError('tenant: a string expected (or "admin": true)')
    else:
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise ValueError(f"tenant: {exc}") from None
    label = record["label"]
    if not isinstance(label, str):
        raise ValueError("label: a string expected")
    try:
        check_label(label)
    except ValueError as exc:
        raise ValueError(f"label: {exc}") from None
    created = record["created"]
    try:
        when = datetime.fromisoformat(created) if isinstance(created, str) else None
    except ValueError:
        when = None
    if when is None:
        raise ValueError("created: an RFC 3339 time expected")
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    digest = record["sha256"]
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        raise ValueError("sha256: 64 lowercase hex digits expected")
    info = TokenInfo(id=token_id, tenant=tenant, label=label, created=when)
    return _Entry(info, bytes.fromhex(digest), Grant(token_id, tenant))


def _check_keys(keys: Iterable[str]) -> None:
    present = set(keys)
    missing = sorted(_KEYS - present)
    if missing:
        raise ValueError(f"missing key {missing[0]!r}")
    if "tenant" not in present and "admin" not in present:
        raise ValueError("missing key 'tenant' (or \"admin\": true)")
    unknown = sorted(present - _KEYS - {"tenant", "admin"})
    if unknown:
        raise ValueError(f"unknown key {mask_secrets(unknown[0])!r}")


def _make_private_folders(folder: Path) -> None:
    """``folder`` and any missing parents, each created readable by this user
    only (mkdir's parents=True gave them 0777 under umask 000: a folder of
    secrets anyone could list and fill)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700)
        path.chmod(0o700)  # whatever the umask took away or left
