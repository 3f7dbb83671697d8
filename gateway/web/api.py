"""The building managers' read API: JSON under ``/api/v1``, behind read tokens.

Every answer comes from ``gateway/store/queries.py``, the module the CLI reads
through, so the page, curl and ``gateway devices`` always agree. Routes (all
``GET``; README, "The read API"):

    /api/v1/me                                          the token's tenants
    /api/v1/tenants/{t}/states                          states and device counts
    /api/v1/tenants/{t}/states/{s}/devices              one page of a state's devices
    /api/v1/tenants/{t}/devices?prefix=P                devices by id prefix, any state
    /api/v1/tenants/{t}/devices/{d}                     a device's latest event
    /api/v1/tenants/{t}/devices/{d}/history             its raw events, newest first
    /api/v1/tenants/{t}/devices/{d}/rollups             its 1-minute or 1-hour aggregates
    /api/v1/tenants/{t}/meta/metrics                    metric names the tenant uses
    /api/v1/tenants/{t}/meta/tags                       tag keys
    /api/v1/tenants/{t}/meta/tags/{k}/values            a tag key's values
    /api/v1/tenants/{t}/meta/devices?tag=KEY=VALUE      devices that carry a tag value
    /api/v1/tenants/{t}/rejected                        bad messages and why
    /api/v1/openapi.json                                this API, as OpenAPI 3.1

Promises:

* **Access.** ``Authorization: Bearer <token>`` (``gateway token add``). No or
  an unknown token: 401. A token of another tenant: 403. Both are checked
  before any parameter, so a caller without access gets nothing else. An
  admin token reads every tenant. Tokens are never logged (aiohttp's access log is off).
* **Errors** are ``{"error", "detail"}``: 400 names the bad parameter, 404
  an unknown device (or, answering no roll-ups, an unknown metric); Cassandra
  unreachable or refusing is 503, never a 500.
* **Live pages by conditional polling.** Every answer carries an ``ETag`` (a
  hash of its body); a request with a matching ``If-None-Match`` gets 304 and
  no body. The page polls about once a second while visible. Polling was
  chosen over server-sent events because ``gateway serve`` has no MQTT feed
  to push from (it would poll Cassandra anyway), a poll needs no long-lived
  connection (the server caps requests, not sockets), and it passes any
  proxy unchanged.
* **Bounded and cheap under many viewers.** Answers are cached per path and
  query for ``LIST_TTL`` (0.5 s), so any number of open pages costs about
  two Cassandra reads a second per distinct view; concurrent misses share one
  read. State counts read every device row of the tenant, so they are cached
  longer, ``cached_for_s`` (1 s, or 10 s when counting took over 200 ms), and
  say so in the answer. At most ``CACHE_SIZE`` answers (2048) and ``CACHE_BYTES``
  (32 MiB) of them are kept (LRU); an answer over 2 MiB is not kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from aiohttp import web
from cassandra.cluster import NoHostAvailable

from cassandra import DriverException, RequestExecutionException

from ..config import Config
from ..errors import QueryError
from ..lru import LRU
from ..stats import Cache
from ..store import queries
from ..store.database import Database
from .openapi import OPENAPI
from .routes import (
    DEFAULT_LIMIT,
    DEFAULT_METRIC,
    DEFAULT_STEP,
    MAX_LIMIT,
    PREFIX,
    ROUTES,
    max_length,
)
from .server import AddRoutes, error_response, once_per
from .tokens import Grant, TokenStore, token_from_header

log = logging.getLogger(__name__)
# A request any holder of a token can repeat: its log line at most every 10 s.
failures = once_per(10.0, logging.getLogger(f"{__name__}.cassandra"))

LIST_TTL = 0.5
COUNTS_TTL = 1.0
SLOW_COUNTS_TTL = 10.0
CACHE_SIZE = 2048
# And at most this many bytes of answers: a history page can be hundreds of
# KB (500 events of long values), and 2048 of them an edge host's memory. An
# answer over a sixteenth of it is not kept (still computed once for all
# who ask at the same time).
CACHE_BYTES = 32 * 1024 * 1024


@dataclass(slots=True)
class _Cached:
    expires: float
    body: bytes
    etag: str
    status: int = 200


class _ApiError(Exception):
    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


class ReadApi:
    """The routes, with the Cassandra session, tokens and cache they share."""

    def __init__(self, db: Database, config: Config, tokens: TokenStore) -> None:
        self._db = db
        self._config = config
        self._tokens = tokens
        self._cache: LRU[str, _Cached] = LRU(CACHE_SIZE)
        self._cache_bytes = 0
        self._inflight: dict[str, asyncio.Future[_Cached]] = {}

    def caches(self) -> dict[str, Cache]:
        """For the ``gateway_cache_*`` metrics: the answers kept (``CACHE_SIZE``)."""
        return {"api_answers": self._cache}

    def add_routes(self, app: web.Application) -> None:
        for route in ROUTES:
            # A segment is anything but "/": aiohttp's default also refuses
            # "{" and "}", which states, devices and tenants may hold.
            path = PREFIX + re.sub(r"\{(\w+)\}", r"{\1:[^/]+}", route.template)
            handler = getattr(self, route.handler)
            app.router.add_get(path, self._handle(handler, frozenset(p.name for p in route.params)))
        app.router.add_get(PREFIX + "/openapi.json", self._openapi)

    # -- plumbing ---------------------------------------------------------

    def _handle(
        self,
        handler: Callable[[web.Request, Grant], Awaitable[_Cached]],
        params: frozenset[str],
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                # The token first: who may not read the tenant learns nothing
                # about its parameters (401 or 403, never a 400).
                grant = self._grant(request, request.match_info.get("tenant"))
                _check_params(request.query, params)
                answer = await handler(request, grant)
            except _ApiError as exc:
                headers = {401: [("WWW-Authenticate", "Bearer")], 503: [("Retry-After", "2")]}
                return error_response(
                    request,
                    exc.status,
                    exc.detail,
                    code=exc.code,
                    headers=headers.get(exc.status, []),
                )
            except QueryError as exc:
                if exc.parameter is not None:
                    return error_response(request, 400, str(exc), code="bad_parameter")
                return error_response(
                    request, 503, str(exc), code="unavailable", headers=[("Retry-After", "2")]
                )
            except (DriverException, RequestExecutionException, NoHostAvailable, OSError) as exc:
                # Once per 10 s at most: pages left open through an outage
                # ask every second or two each, and an edge host's disk is small.
                failures.warning("read API: Cassandra failed: %s", exc)
                detail = f"Cassandra did not answer: {type(exc).__name__}"
                return error_response(
                    request, 503, detail, code="unavailable", headers=[("Retry-After", "2")]
                )
            caching = {"ETag": answer.etag, "Cache-Control": "no-cache"}
            if _not_modified(request.headers.get("If-None-Match", ""), answer):
                return web.Response(status=304, headers=caching)
            return web.Response(
                status=answer.status,
                body=answer.body,
                content_type="application/json",
                headers=caching,
            )

        return run

    def _grant(self, request: web.Request, tenant: str | None = None) -> Grant:
        token = token_from_header(request.headers.get("Authorization"))
        if token is None:
            raise _ApiError(401, "unauthorized", "send a read token: Authorization: Bearer <token>")
        grant = self._tokens.verify(token)
        if grant is None and self._tokens.error is not None:
            # The file could not be read (a half-written line): no token is
            # accepted until it is fixed, but this one may be good. A 401
            # logged every open page out and made it forget its token.
            raise _ApiError(
                503,
                "unavailable",
                "the gateway cannot read its tokens file now (its log says why); try again",
            )
        if grant is None:
            raise _ApiError(401, "unauthorized", "unknown or revoked token")
        if tenant is not None and not grant.allows(tenant):
            raise _ApiError(403, "forbidden", f"this token does not read tenant {tenant!r}")
        return grant

    async def _cached(
        self,
        key: str,
        ttl: float,
        compute: Callable[[], Awaitable[tuple[Any, float]]],
        versioned: Callable[[Any], Any] | None = None,
    ) -> _Cached:
        """The answer for ``key``, computed at most once per ``ttl`` however
        many ask; ``compute`` returns the body and how long it may be kept
        (``ttl`` when 0). The ETag covers ``versioned(body)`` (the whole
        body when None)."""
        now = time.monotonic()
        found = self._cache.get(key)
        if found is not None and found.expires > now:
            return found
        running = self._inflight.get(key)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[_Cached] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            body, keep = await compute()
            answer = _answer(body, None if versioned is None else versioned(body))
            answer.expires = time.monotonic() + (keep or ttl)
            self._keep(key, answer)
            future.set_result(answer)
            return answer
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            del self._inflight[key]

    def _keep(self, key: str, answer: _Cached) -> None:
        """Into the cache, within CACHE_SIZE answers and CACHE_BYTES bytes."""
        cache = self._cache
        old = cache.pop(key)
        if old is not None:
            self._cache_bytes -= len(old.body)
        if len(answer.body) > CACHE_BYTES // 16:
            cache.evictions += 1  # forgotten at once: counted as the bound's
            return
        evicted = cache.put(key, answer)
        self._cache_bytes += len(answer.body) - (len(evicted[1].body) if evicted else 0)
        while self._cache_bytes > CACHE_BYTES and (gone := cache.evict_oldest()) is not None:
            self._cache_bytes -= len(gone[1].body)

    # -- routes -------------------------------------------------------------

    async def _me(self, request: web.Request, grant: Grant) -> _Cached:
        if grant.tenant is not None:
            return _answer({"admin": False, "tenants": [grant.tenant]})
        configured = set(self._config.tenants) - {"default"}  # a section, not a tenant

        async def compute() -> tuple[Any, float]:
            known = await queries.tenants(self._db)
            return {"admin": True, "tenants": sorted(configured | set(known))}, 0

        return await self._cached("me:admin", COUNTS_TTL, compute)

    async def _states(self, request: web.Request, grant: Grant) -> _Cached:
        tenant = request.match_info["tenant"]

        async def compute() -> tuple[Any, float]:
            started = time.monotonic()
            counts = await queries.state_counts(self._db, self._config, tenant)
            took = time.monotonic() - started
            keep = COUNTS_TTL if took < 0.2 else SLOW_COUNTS_TTL
            return {
                "tenant": tenant,
                "as_of": queries.iso(datetime.now(UTC)),
                "cached_for_s": keep,
                "states": [{"state": s, "devices": n} for s, n in counts],
            }, keep

        # The ETag leaves out "as_of" (the time of each count): the same
        # counts are a 304, and the tiles are not redrawn every second.
        return await self._cached(f"states:{tenant}", COUNTS_TTL, compute, _without_as_of)

    async def _devices(self, request: web.Request, grant: Grant) -> _Cached:
        tenant = request.match_info["tenant"]
        state = queries.asked_state(request.match_info["state"])
        query = request.query
        limit = _int(query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        cursor = query.get("cursor") or None
        prefix = query.get("prefix", "")
        tag = queries.parse_tag(query["tag"]) if query.get("tag") else None

        async def compute() -> tuple[Any, float]:
            page = await queries.devices_page(
                self._db,
                self._config,
                tenant,
                state,
                limit=limit,
                cursor=cursor,
                prefix=prefix,
                tag=tag,
            )
            return {
                "tenant": tenant,
                "state": state,
                "devices": [d.as_json() for d in page.devices],
                "next_cursor": page.next_cursor,
            }, 0

        return await self._cached(f"devices:{request.path_qs}", LIST_TTL, compute)

    async def _find(self, request: web.Request, grant: Grant) -> _Cached:
        tenant = request.match_info["tenant"]
        prefix = request.query.get("prefix", "")
        limit = _int(request.query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)

        async def compute() -> tuple[Any, float]:
            found = await queries.find_devices(self._db, self._config, tenant, prefix, limit=limit)
            return {
                "tenant": tenant,
                "prefix": prefix,
                "devices": found.as_json(),
                "complete": found.complete,
                "cut_short": found.cut_short,
            }, 0

        return await self._cached(f"find:{request.path_qs}", LIST_TTL, compute)

    async def _device(self, request: web.Request, grant: Grant) -> _Cached:
        tenant, device = request.match_info["tenant"], request.match_info["device_id"]
        answer = await self._latest(tenant, device)
        if answer.body == b"null":
            raise _no_device(tenant, device)
        return answer

    async def _latest(self, tenant: str, device: str) -> _Cached:
        """The device's latest event (``null``: none), cached: a page open on
        a missing device asks for it, and its history, every poll."""

        async def compute() -> tuple[Any, float]:
            row = await queries.latest_event(self._db, tenant, device)
            if row is None:
                return None, 0
            return row.as_json(), 0

        return await self._cached(f"device:{tenant}/{device}", LIST_TTL, compute)

    async def _history(self, request: web.Request, grant: Grant) -> _Cached:
        tenant, device = request.match_info["tenant"], request.match_info["device_id"]
        query = request.query
        since, until = _day_range(query, self._config.limits.max_future_skew)
        limit = _int(query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        cursor = query.get("cursor") or None

        async def compute() -> tuple[Any, float]:
            page = await queries.history_page(self._db, tenant, device, since, until, limit, cursor)
            if not page.events and cursor is None:
                await self._known_device(tenant, device)
            return {
                "tenant": tenant,
                "device_id": device,
                "events": [e.as_json() for e in page.events],
                "next_cursor": page.next_cursor,
            }, 0

        # By the query as sent: "since=7d", the page's, is one key every poll.
        return await self._cached(f"history:{request.path_qs}", LIST_TTL, compute)

    async def _rollups(self, request: web.Request, grant: Grant) -> _Cached:
        tenant, device = request.match_info["tenant"], request.match_info["device_id"]
        query = request.query
        # Up to now: past it, since=7d of minutes was over the windows' cap.
        since, until = _day_range(query, 0)
        step_text = query.get("step") or DEFAULT_STEP
        step = queries.parse_step(step_text)
        queries.check_rollup_range(step, since, until, since_given=bool(query.get("since")))
        metric = query.get("metric") or DEFAULT_METRIC

        async def compute() -> tuple[Any, float]:
            rows, done = await asyncio.gather(
                queries.rollups(self._db, tenant, device, metric, step, since, until),
                queries.rollups_done_until(self._db),
            )
            if not rows:
                # Nothing: a device, or else a metric, the tenant never had
                # (a misspelling) is a 404 naming it, as the CLI's `rollup`
                # hints at them.
                await self._known_device(tenant, device)
                await self._known_metric(tenant, metric)
            return {
                "tenant": tenant,
                "device_id": device,
                "metric": metric,
                "step": step_text,
                "rollups": [r.as_json() for r in rows],
                # Windows of what was written from then on are not done yet.
                "done_until": None if done is None else queries.iso(done),
            }, 0

        return await self._cached(f"rollups:{request.path_qs}", LIST_TTL, compute)

    async def _known_device(self, tenant: str, device: str) -> None:
        """A 404 for a device the tenant never had (as its ``/devices/{d}``),
        but not for one whose raw rows were written around the gateway."""
        if (await self._latest(tenant, device)).body == b"null" and not (
            await queries.device_has_rows(self._db, tenant, device)
        ):
            raise _no_device(tenant, device)

    async def _known_metric(self, tenant: str, metric: str) -> None:
        """A 404 for a metric no device of the tenant ever sent, by its
        metadata: not when metadata is off or the tenant's is capped (its
        lists may miss names then)."""
        if not self._config.metadata.enabled:
            return
        known, capped = await asyncio.gather(
            queries.meta_metrics(self._db, tenant),
            queries.meta_capped(self._db, tenant, self._config),
        )
        names, cut = queries.meta_cut(known)
        if metric in names or capped or cut or not names:
            return
        raise _ApiError(
            404,
            "not_found",
            f"metric: no device of tenant {tenant!r} has sent a metric {metric!r}; "
            f"its metrics: {queries.first_names(names)}",
        )

    async def _meta(self, request: web.Request, grant: Grant) -> _Cached:
        tenant = request.match_info["tenant"]
        what = request.path.rsplit("/", 1)[-1]
        db = self._db
        if what == "devices":
            text = request.query.get("tag", "")
            key, value = queries.parse_tag(text)
        else:
            key = request.match_info.get("key", "")

        async def compute() -> tuple[Any, float]:
            answer: dict[str, Any] = {"tenant": tenant}
            if what == "metrics":
                name, found = "metrics", await queries.meta_metrics(db, tenant)
            elif what == "tags":
                name, found = "tags", await queries.meta_tag_keys(db, tenant)
            elif what == "values":
                answer["tag"] = key
                name, found = "values", await queries.meta_tag_values(db, tenant, key)
            else:
                answer |= {"tag": key, "value": value}
                name, found = "devices", await queries.meta_tag_devices(db, tenant, key, value)
            # "truncated": the list holds queries.MAX_META entries and there are more.
            answer[name], answer["truncated"] = queries.meta_cut(found)
            answer["capped"] = await queries.meta_capped(db, tenant, self._config)
            return answer, 0

        return await self._cached(f"meta:{request.path_qs}", COUNTS_TTL, compute)

    async def _rejected(self, request: web.Request, grant: Grant) -> _Cached:
        tenant = request.match_info["tenant"]
        query = request.query
        now = datetime.now(UTC)
        since = _time(query, "since", now - timedelta(hours=1), now)
        queries.check_rejected_since(since, now)
        limit = _int(query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)

        async def compute() -> tuple[Any, float]:
            # One more than asked: whether older ones were left out.
            rows = await queries.rejected(self._db, tenant, since, limit + 1)
            return {
                "tenant": tenant,
                "rejected": [r.as_json() for r in rows[:limit]],
                "truncated": len(rows) > limit,
            }, 0

        return await self._cached(f"rejected:{request.path_qs}", LIST_TTL, compute)

    async def _openapi(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(OPENAPI, dumps=lambda v: orjson.dumps(v).decode())


def read_api_unavailable(why: Callable[[], str]) -> AddRoutes:
    """The read API while the gateway only spools (Cassandra unreachable at
    start, gateway/spooling.py): every path of it answers 503 with
    Retry-After, so an open page says "reconnecting" and comes back by itself
    once the full gateway takes over. A 404 (no such path) stopped it for good."""

    async def unavailable(request: web.Request) -> web.StreamResponse:
        return error_response(
            request, 503, why(), code="unavailable", headers=[("Retry-After", "2")]
        )

    def add_routes(app: web.Application) -> None:
        app.router.add_get(PREFIX + "/{path:.*}", unavailable)

    return add_routes


def read_api(
    db: Database,
    config: Config,
    tokens: TokenStore,
    track_caches: Callable[[Mapping[str, Cache]], None] = lambda caches: None,
) -> AddRoutes:
    """The ``extra`` for :func:`gateway.web.server.build_app`; its cache goes
    to ``track_caches`` (``Stats.track_caches``, for the metrics)."""
    api = ReadApi(db, config, tokens)
    track_caches(api.caches())
    return api.add_routes


def _no_device(tenant: str, device: str) -> _ApiError:
    return _ApiError(404, "not_found", f"no device {device!r} in tenant {tenant!r}")


def _answer(body: Any, versioned: Any = None) -> _Cached:
    """``body`` as JSON, with an ETag over ``versioned`` (the body when None)."""
    data = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    tagged = data if versioned is None else orjson.dumps(versioned, option=orjson.OPT_SORT_KEYS)
    return _Cached(0.0, data, '"' + hashlib.blake2b(tagged, digest_size=12).hexdigest() + '"')


def _without_as_of(body: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in body.items() if name != "as_of"}


def _not_modified(if_none_match: str, answer: _Cached) -> bool:
    """Whether If-None-Match names the answer's ETag (weakly, as a GET
    compares), or is ``*``, which any current answer matches (RFC 9110
    13.1.2): an error answer is not one."""
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",") if t.strip()}
    return answer.etag in tags or ("*" in tags and answer.status == 200)


def _check_params(query: Mapping[str, str], allowed: frozenset[str]) -> None:
    """Each parameter known to the route, given once, and not too long."""
    seen: set[str] = set()
    for name, value in query.items():
        if name not in allowed:
            takes = ", ".join(sorted(allowed)) if allowed else "none"
            raise queries.bad_parameter(name, f"not a parameter of this path (it takes: {takes})")
        if name in seen:
            raise queries.bad_parameter(name, "given more than once")
        seen.add(name)
        most = max_length(name)
        if len(value) > most:
            raise queries.bad_parameter(name, f"longer than {most} characters")


def _int(query: Any, name: str, default: int, low: int, high: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise queries.bad_parameter(name, f"expected a whole number, got {text!r}") from None
    if not low <= value <= high:
        raise queries.bad_parameter(name, f"must be between {low} and {high} (got {value})")
    return value


def _day_range(query: Any, ahead: float) -> tuple[datetime, datetime]:
    """``since`` and ``until`` from the query: the last 24 hours unless given,
    up to ``ahead`` seconds past now (history's: ``limits.max_future_skew``,
    an event a device's fast clock dated ahead is stored, and was left out of
    its history until its time came)."""
    now = datetime.now(UTC)
    since = _time(query, "since", now - timedelta(hours=24), now)
    until = _time(query, "until", now + timedelta(seconds=ahead), now)
    queries.check_order(
        since,
        until,
        since_given=bool(query.get("since")),
        until_given=bool(query.get("until")),
        ahead=ahead,
    )
    return since, until


def _time(query: Any, name: str, default: datetime, now: datetime) -> datetime:
    text = query.get(name)
    if text is None or text == "":
        return default
    return queries.parse_time(name, text, now)
