"""A stand-in for the gateway's /api/v1, in memory, for testing the page alone.

It speaks the API's contract as the page relies on it (bearer tokens, 401 and
403, JSON errors with a detail, ETag and 304, cursor paging, prefix and tag
filters, history newest first) and serves the page's files the way the
gateway will: index.html at /, its siblings beside it, with a strict Content
Security Policy so that any inline script or style in the page shows up as a
console error. Tests change its data directly and watch the page follow.

The real API is tested against the real services elsewhere; this is only the
page's self-check.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
MAX_LIMIT = 500
_R = TypeVar("_R", bound=web.StreamResponse)


def rfc3339(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Seen:
    """One request the fake answered."""

    path: str
    status: int
    authorization: str | None
    if_none_match: str | None


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


@dataclass
class FakeApi:
    # token -> the tenants it may read; None for an admin token.
    tokens: dict[str, frozenset[str] | None] = field(default_factory=dict)
    # tenant -> device id -> its newest event (with "state" and "device_id")
    latest: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # The states a device search reports as cut short (too many rows to read at once).
    find_cut_short: list[str] = field(default_factory=list)
    # (tenant, device id) -> events, oldest first
    history: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    known_states: dict[str, set[str]] = field(default_factory=dict)
    rejected: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # tenant -> {state: count}: /states answers these instead of the live counts.
    held_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    changed_at: dict[str, datetime] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    # Rows a filtered devices page reads at most (the real API's SCAN_BUDGET):
    # past it, a short page with a cursor.
    scan_budget: int = 10_000
    # Faults for the page's error handling: every API answer waits delay_s
    # (a slow link to Cassandra), and while fault is set every API request
    # after the token check gets it (an outage: 503).
    delay_s: float = 0.0
    fault: ApiError | None = None

    # ------------------------------------------------------------ test-side

    def add_token(self, token: str, tenants: list[str] | None) -> None:
        self.tokens[token] = None if tenants is None else frozenset(tenants)

    def revoke(self, token: str) -> None:
        del self.tokens[token]

    def put(
        self,
        tenant: str,
        device_id: str,
        state: str | None,
        value: Any = None,
        *,
        tags: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        at: datetime | None = None,
    ) -> None:
        """A device's new event, as if the gateway had just stored it."""
        when = at or datetime.now(UTC)
        previous = self.latest.get(tenant, {}).get(device_id)
        event = {
            "ts": rfc3339(when),
            "state": state,
            "value": value,
            "metrics": metrics or {},
            "tags": tags if tags is not None else (previous or {}).get("tags", {}),
        }
        self.history.setdefault((tenant, device_id), []).append(event)
        self.history[(tenant, device_id)].sort(key=lambda e: e["ts"])
        if previous is None or event["ts"] >= previous["ts"]:
            self.latest.setdefault(tenant, {})[device_id] = {"device_id": device_id, **event}
        if state is not None:  # an event without one leaves the device in none
            self.known_states.setdefault(tenant, set()).add(state)
        self.changed_at[tenant] = datetime.now(UTC)

    def history_of(self, tenant: str) -> list[list[dict[str, Any]]]:
        return [events for (t, _), events in self.history.items() if t == tenant]

    def api_requests(self, since: int = 0) -> list[Seen]:
        return [s for s in self.seen[since:] if s.path.startswith("/api/")]

    # ------------------------------------------------------------ the API

    def _authorize(self, request: web.Request, tenant: str | None) -> frozenset[str] | None:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        if token is None or token not in self.tokens:
            raise ApiError(401, "unauthorized", "unknown or revoked token")
        allowed = self.tokens[token]
        if tenant is not None and allowed is not None and tenant not in allowed:
            raise ApiError(403, "forbidden", f"this token may not read tenant {tenant!r}")
        return allowed

    def _states(self, tenant: str) -> dict[str, Any]:
        counts = dict.fromkeys(sorted(self.known_states.get(tenant, set())), 0)
        for device in self.latest.get(tenant, {}).values():
            if device["state"] is not None:
                counts[device["state"]] += 1
        # Counts as the real API's cache can hold them (up to 10 s old).
        counts |= self.held_counts.get(tenant, {})
        return {
            "tenant": tenant,
            # The time of the data, not of the request: an unchanged answer
            # keeps its ETag, as the real API's cached counts do.
            "as_of": rfc3339(self.changed_at.get(tenant, datetime(2024, 1, 1, tzinfo=UTC))),
            "cached_for_s": 2,
            "states": [{"state": s, "devices": n} for s, n in counts.items()],
        }

    def _devices(self, tenant: str, state: str, query: Any) -> dict[str, Any]:
        limit = _int(query.get("limit", "100"), "limit", 1, MAX_LIMIT)
        prefix = query.get("prefix", "")
        tag = query.get("tag")
        key = value = None
        if tag is not None:
            key, sep, value = tag.partition(":")
            if not sep or not key:
                raise ApiError(400, "bad_request", f"tag must be key:value, got {tag!r}")
        after = _decode_cursor(query["cursor"]) if query.get("cursor") else None
        in_state = sorted(
            (
                d
                for d in self.latest.get(tenant, {}).values()
                if d["state"] == state and (after is None or d["device_id"] > after)
            ),
            key=lambda d: d["device_id"],
        )
        filtered = bool(prefix) or key is not None
        scanned = in_state[: self.scan_budget] if filtered else in_state
        page: list[dict[str, Any]] = []
        last = None
        for d in scanned:
            if len(page) == limit:
                break
            last = d["device_id"]
            named = d["device_id"].casefold().startswith(prefix.casefold())
            if named and (key is None or d["tags"].get(key) == value):
                page.append(d)
        if len(page) == limit:
            more = any(
                d["device_id"] > page[-1]["device_id"]
                and d["device_id"].startswith(prefix)
                and (key is None or d["tags"].get(key) == value)
                for d in in_state
            )
            cursor = page[-1]["device_id"] if more else None
        else:
            # The budget ran out before the page filled: go on from the last row read.
            cursor = last if len(scanned) < len(in_state) else None
        return {
            "tenant": tenant,
            "state": state,
            "devices": [{k: d[k] for k in ("device_id", "ts", "value", "tags")} for d in page],
            "next_cursor": _encode_cursor(cursor) if cursor else None,
        }

    def _history(self, tenant: str, device_id: str, query: Any) -> dict[str, Any]:
        limit = _int(query.get("limit", "100"), "limit", 1, MAX_LIMIT)
        since = _time(query.get("since") or "24h", "since")
        events = [
            e
            for e in reversed(self.history.get((tenant, device_id), []))
            if datetime.fromisoformat(e["ts"]) >= since
        ]
        start = int(_decode_cursor(query["cursor"])) if query.get("cursor") else 0
        page = events[start : start + limit]
        more = start + limit < len(events)
        return {
            "events": page,
            "next_cursor": _encode_cursor(str(start + limit)) if more else None,
        }

    def _find(self, tenant: str, query: Any) -> dict[str, Any]:
        # As the real API: the exact id first, then by id, whatever the case.
        prefix = query.get("prefix") or ""
        if not prefix:
            raise ApiError(400, "bad_parameter", "prefix: required: the start of a device id")
        limit = _int(query.get("limit", "100"), "limit", 1, MAX_LIMIT)
        devices = self.latest.get(tenant, {})
        found = sorted(
            (
                d
                for d in devices.values()
                # One with no state only by its exact id: no state's list holds it.
                if d["device_id"].casefold().startswith(prefix.casefold())
                and (d["state"] is not None or d["device_id"] == prefix)
            ),
            key=lambda d: (d["device_id"] != prefix, d["device_id"]),
        )
        keys = ("device_id", "state", "ts", "value", "tags")
        return {
            "tenant": tenant,
            "prefix": prefix,
            "devices": [{k: d[k] for k in keys} for d in found[:limit]],
            "complete": len(found) <= limit and not self.find_cut_short,
            "cut_short": list(self.find_cut_short),
        }

    async def _handle(self, request: web.Request) -> web.Response:
        tenant = request.match_info.get("tenant")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            allowed = self._authorize(request, tenant)
            if self.fault is not None:
                raise self.fault
            body = self._answer(request, tenant, allowed)
        except ApiError as exc:
            data = {"error": exc.error, "detail": exc.detail}
            return self._log(request, web.json_response(data, status=exc.status))
        raw = orjson.dumps(body)
        etag = '"' + hashlib.sha256(raw).hexdigest()[:20] + '"'
        if request.headers.get("If-None-Match") == etag:
            return self._log(request, web.Response(status=304, headers={"ETag": etag}))
        response = web.Response(body=raw, content_type="application/json")
        response.headers["ETag"] = etag
        response.headers["Cache-Control"] = "no-cache"
        return self._log(request, response)

    def _answer(
        self, request: web.Request, tenant: str | None, allowed: frozenset[str] | None
    ) -> dict[str, Any]:
        name = request.match_info.route.name
        info = request.match_info
        if name == "me":
            tenants = sorted(self.latest) if allowed is None else sorted(allowed)
            return {"admin": allowed is None, "tenants": tenants}
        assert tenant is not None
        if name == "states":
            return self._states(tenant)
        if name == "devices":
            return self._devices(tenant, info["state"], request.query)
        if name == "find":
            return self._find(tenant, request.query)
        if name in ("device", "history"):
            # As the real API: a device the tenant never had is a 404 on both.
            device = self.latest.get(tenant, {}).get(info["device_id"])
            if device is None:
                detail = f"no device {info['device_id']!r} in tenant {tenant!r}"
                raise ApiError(404, "not_found", detail)
            return (
                device
                if name == "device"
                else self._history(tenant, info["device_id"], request.query)
            )
        if name == "meta_tags":
            # As metadata records them: every key the tenant's devices have sent.
            keys = {k for events in self.history_of(tenant) for e in events for k in e["tags"]}
            return {"tenant": tenant, "tags": sorted(keys), "truncated": False, "capped": False}
        if name == "rejected":
            # As the real API: newest first, at most limit (default 100, up to MAX_LIMIT).
            since = rfc3339(_time(request.query.get("since") or "1h", "since"))
            limit = min(int(request.query.get("limit") or 100), MAX_LIMIT)
            rows = [r for r in self.rejected.get(tenant, []) if r["received_at"] >= since]
            rows.sort(key=lambda r: str(r["received_at"]), reverse=True)
            return {"tenant": tenant, "rejected": rows[:limit], "truncated": len(rows) > limit}
        raise AssertionError(name)

    def _log(self, request: web.Request, response: _R) -> _R:
        self.seen.append(
            Seen(
                path=request.path_qs,
                status=response.status,
                authorization=request.headers.get("Authorization"),
                if_none_match=request.headers.get("If-None-Match"),
            )
        )
        return response

    # ------------------------------------------------------------ serving

    def app(self, static: Path) -> web.Application:
        files = {p.name: p for p in static.iterdir() if p.is_file()}

        async def page_file(request: web.Request) -> web.StreamResponse:
            name = request.match_info.get("name") or "index.html"
            if name not in files:
                raise web.HTTPNotFound()
            response = web.FileResponse(files[name], headers={"Content-Security-Policy": CSP})
            self._log(request, response)
            return response

        app = web.Application()
        prefix = "/api/v1"
        for path, name in (
            ("/me", "me"),
            ("/tenants/{tenant}/states", "states"),
            ("/tenants/{tenant}/states/{state}/devices", "devices"),
            ("/tenants/{tenant}/devices", "find"),
            ("/tenants/{tenant}/devices/{device_id}", "device"),
            ("/tenants/{tenant}/devices/{device_id}/history", "history"),
            ("/tenants/{tenant}/rejected", "rejected"),
            ("/tenants/{tenant}/meta/tags", "meta_tags"),
        ):
            app.router.add_get(prefix + path, self._handle, name=name)
        app.router.add_get("/", page_file)
        app.router.add_get("/{name}", page_file)
        return app

    @asynccontextmanager
    async def serve(self, static: Path) -> AsyncIterator[str]:
        """Serve on a free loopback port; yields the page's URL."""
        runner = web.AppRunner(self.app(static), access_log=None)
        await runner.setup()
        # Our own socket, so the port is known without reaching into aiohttp.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        try:
            await web.SockSite(runner, sock).start()
            yield f"http://127.0.0.1:{port}/"
        finally:
            await runner.cleanup()
            sock.close()


def _int(raw: str, name: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ApiError(400, "bad_request", f"{name} must be an integer from {low} to {high}")
    return value


def _time(raw: str, name: str) -> datetime:
    """An RFC 3339 time or a duration ago (``2h``), as the real API takes."""
    if match := re.fullmatch(r"(\d+)([smhd])", raw):
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]
        return ago(int(match[1]) * unit)
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise ApiError(400, "bad_request", f"{name} must be an RFC 3339 time or like 2h") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _encode_cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError:
        raise ApiError(400, "bad_request", "cursor is not one this API gave out") from None


def ago(seconds: float) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)
