"""The gateway's HTTP side: one aiohttp application, served on the gateway's own loop.

:func:`build_app` makes the :class:`aiohttp.web.Application`; :func:`serve` runs
it (``AppRunner`` + ``TCPSite``, in-process, on the running event loop: no
thread, no second loop, no signal handlers taken) while inside. Routes:

    GET /metrics         Prometheus text format 0.0.4 (``generate_latest`` of the
                         registry from ``gateway/web/metrics.py``)
    GET /healthz         {"status": "ok"|"degraded", "checks": {...}}; 200 if healthy, else 503
    GET /noisy?tenant=T  the tenant's noisy devices (JSON list), for ``gateway noisy``

aiohttp's router answers 404 for an unknown path and 405 (with ``Allow``) for
another method on a known one; ``GET`` routes answer ``HEAD`` too. Under
``/api`` every error (4xx, 5xx, our 503) is JSON ``{"error": code, "detail":
sentence}``; elsewhere it is short text. An ``HTTPException`` raised with a JSON
body passes through unchanged.

**Adding routes** (the read API, the static page): pass callables in
``build_app(..., extra=[add_api, add_page])``. Each is called once as
``fn(app)`` before the application is frozen and may add routes
(``app.router.add_get``), a sub-application (``app.add_subapp("/api/v1",
api)``, whose own middlewares then apply to it alone), startup/cleanup hooks
or ``app[web.AppKey(...)]`` values. The bounds below and the JSON errors cover
whatever it adds. Dependencies go in through closures, never module globals.

**Bounds, and where each comes from** (defaults in :class:`Limits`):

* Request head (aiohttp's parser, via ``handler_args``): request line at most
  ``max_line_size`` (64 KiB) bytes, each header at most ``max_field_size`` (8190),
  at most ``max_headers`` (64) headers; more is answered 400 and the connection
  closed. Request bodies: a handler that reads one gets 413 past
  ``client_max_size`` (64 KiB, aiohttp); our routes never read bodies, and an
  unread body is drained for at most ``lingering_time`` (1 s, aiohttp) before
  the connection is closed.
* Slow and idle clients (aiohttp's ``keepalive_timeout``, 5 s): since aiohttp
  3.14.4 the timer starts when the connection is accepted, so a connection
  whose first request head is not complete within 5 s is closed, and so is one
  idle for 5 s after a response; dribbling bytes does not extend it. aiohttp
  has no separate header-read deadline and answers nothing (the old server
  sent 408): the connection is just closed. There is no deadline on *writing* a
  response: a client that stops reading holds one response's bytes until TCP
  gives up or the gateway stops.
* Concurrency (ours, :func:`_admission`): aiohttp accepts every connection and
  has no cap of its own (its maintainers leave that to the application), so a
  middleware lets at most ``max_requests`` (32) requests be handled at once,
  half of them for one token, and answers the next 503 with ``Retry-After:
  1`` and ``Connection: close``, refused rather than queued, and counted
  (``gateway_http_busy_refusals_total``). It bounds handlers (the read API's
  Cassandra queries), not idle sockets: those are bounded in time by
  ``keepalive_timeout``, in number only by the OS.
* Measured (ours, :func:`_measured`, outermost): every request is counted by
  route template and status and timed (:class:`~gateway.web.metrics.HttpStats`);
  labels are bounded by the routes the application has.
* Logs: aiohttp's protocol errors (bad requests) and failing handlers log
  through ``gateway.web.http``, at most one record per message per 10 s,
  with any token's secret masked (a parser error quotes the header line);
  a bad request as one WARNING line, without aiohttp's traceback.
  The per-request access log is off.
* Stopping (aiohttp's ``AppRunner.cleanup``): the listener closes first, idle
  connections are closed, requests under way get ``shutdown_timeout`` (2 s)
  to finish and are then cancelled.

Handlers run on the event loop and must be cheap and non-blocking. If one
raises, the request gets a 500 and one warning is logged; serving goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, generate_latest

from ..errors import ConfigError
from .metrics import METRICS_CONTENT_TYPE, HttpCollector, HttpStats
from .tokens import mask_secrets

log = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
API_PREFIX = "/api"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Health = Callable[[], tuple[bool, dict[str, object]]]
Noisy = Callable[[str], list[dict[str, object]]]
AddRoutes = Callable[[web.Application], None]


@dataclass(frozen=True, slots=True)
class Limits:
    """The HTTP side's bounds (see the module docstring for what enforces each)."""

    # aiohttp's 8190 was less than the read API's longest valid request: a tag
    # parameter of 4,096 characters percent-encodes to up to 48 KiB (12 bytes
    # for a 4-byte character), and a cursor and a prefix come beside it. Such
    # a request got aiohttp's plain-text 400, before any of our code (and its
    # JSON errors) ran.
    max_line_size: int = 64 * 1024
    max_field_size: int = 8190
    max_headers: int = 64
    client_max_size: int = 64 * 1024
    keepalive_timeout: float = 5.0
    lingering_time: float = 1.0
    max_requests: int = 32


# --------------------------------------------------------------------------
# Logs a client can provoke: rate-limited


class _OncePer(logging.Filter):
    """At most one record per message template per ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[object, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        last = self._last.get(record.msg)
        if last is not None and now - last < self.interval:
            return False
        if len(self._last) > 100:  # templates are few; bounded anyway
            self._last.clear()
        self._last[record.msg] = now
        return True


class _MaskTokens(logging.Filter):
    """No token's secret in a record: aiohttp's parser errors quote the
    request's header lines (a token with a stray CR is a bad header line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = mask_secrets(record.getMessage()), None
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = mask_secrets(text)
        return True


class _BadRequestsBrief(logging.Filter):
    """A request aiohttp could not parse (a line over its bound, a bad header)
    is the client's mistake, not ours: one WARNING line, not an ERROR with a
    traceback, which any client without a token could fill the log with."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        # aiohttp's own record ("Error handling request ..."), not ours.
        if isinstance(exc, HttpProcessingError) and str(record.msg).startswith(
            "Error handling request"
        ):
            # Masked before it is cut: a token cut short may not look like one.
            lines = (exc.message or type(exc).__name__).split()
            said = mask_secrets(" ".join(lines))[:300]
            record.msg = f"{record.getMessage()}: a bad request, answered {exc.code}: {said}"
            record.args = record.exc_info = record.exc_text = None
            # Lowered, never raised: aiohttp logs a first request's bad
            # method (TLS, scanners) at DEBUG.
            record.levelno = min(record.levelno, logging.WARNING)
            record.levelname = logging.getLevelName(record.levelno)
        return True


def once_per(interval: float, logger: logging.Logger) -> logging.Logger:
    """``logger``, keeping at most one record per message template per ``interval`` s."""
    logger.addFilter(_OncePer(interval))
    return logger


http_log = once_per(10.0, logging.getLogger(f"{__package__}.http"))
http_log.addFilter(_BadRequestsBrief())
http_log.addFilter(_MaskTokens())  # last: it masks what the others left


# --------------------------------------------------------------------------
# Errors and admission


def _is_api(request: web.Request) -> bool:
    path = request.path
    return path == API_PREFIX or path.startswith(f"{API_PREFIX}/")


# Fixed, not derived from the reason phrase (Python 3.13 renamed 413's, for one).
_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    500: "internal_error",
    503: "unavailable",
}


def _code(status: int, reason: str) -> str:
    """``Method Not Allowed`` → ``method_not_allowed`` for statuses not in ``_CODES``."""
    return _CODES.get(status) or "_".join(reason.lower().replace("-", " ").split())


def error_response(
    request: web.Request,
    status: int,
    detail: str,
    *,
    code: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
) -> web.Response:
    """An error answer: JSON ``{"error", "detail"}`` under /api, short text elsewhere."""
    response = web.Response(status=status, headers={"Cache-Control": "no-store"})
    for name, value in headers:
        response.headers[name] = value
    if _is_api(request):
        body = {"error": code or _code(status, response.reason), "detail": detail}
        response.body = orjson.dumps(body)
        response.content_type = JSON_CONTENT_TYPE
    else:
        response.text = f"{detail}\n"
    return response


_NOT_COPIED = ("Content-Type", "Content-Length")
_DETAILS = {
    404: "no such path: {path}",
    405: "{method} is not allowed on {path}",
}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """HTTP errors in the JSON shape under /api; an unexpected error is a 500, logged."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not _is_api(request) or exc.content_type == JSON_CONTENT_TYPE:
            raise
        default = exc.text is None or exc.text == f"{exc.status}: {exc.reason}"
        template = _DETAILS.get(exc.status)
        if default and template:
            detail = template.format(method=request.method, path=request.path)
        else:
            detail = exc.text or exc.reason
        keep = [(k, v) for k, v in exc.headers.items() if k not in _NOT_COPIED]
        return error_response(request, exc.status, detail, headers=keep)
    except Exception:
        http_log.warning("%s %s failed", request.method, request.path, exc_info=True)
        return error_response(request, 500, "internal server error")


def _measured(http: HttpStats) -> Middleware:
    """Every request counted by route and status, and timed (the outermost
    middleware: refusals at the cap and errors turned into answers count too)."""

    @web.middleware
    async def measured(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        http.under_way += 1
        status = "cancelled"  # unless it is answered or fails
        try:
            response = await handler(request)
            status = str(response.status)
            return response
        except web.HTTPException as exc:  # outside /api, _errors lets aiohttp answer them
            status = str(exc.status)
            raise
        except Exception:  # _errors answers every other error: none reach here today
            status = "500"
            raise
        finally:
            http.under_way -= 1
            resource = request.match_info.route.resource
            route = "unmatched" if resource is None else resource.canonical
            http.observe(route, status, time.monotonic() - started)

    return measured


def _admission(max_requests: int, http: HttpStats) -> Middleware:
    """At most ``max_requests`` read API requests handled at once, and half
    of them for one token (its Authorization header); beyond, 503 at once
    (refused, not queued). /metrics, /healthz and the page's
    files are never refused: they read no Cassandra, and a Cassandra that
    hangs (every API request waiting) made monitoring blind and the page
    impossible to load just when they were needed."""
    # One token may have half of them: a tenant sending slow queries (a long
    # range, a hung Cassandra replica) left every other tenant "busy".
    per_token = max(1, max_requests // 2)
    # The requests under way, by token: at most max_requests entries.
    by_token: dict[str, int] = {}

    @web.middleware
    async def admission(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _is_api(request):
            return await handler(request)
        token = request.headers.get("Authorization", "")
        mine = by_token.get(token, 0)
        active = sum(by_token.values())
        if active >= max_requests:
            busy = f"busy: {active} requests under way, retry shortly"
        elif mine >= per_token:
            busy = f"busy: {mine} requests under way for this token, retry shortly"
        else:
            busy = ""
        if busy:
            response = error_response(
                request, 503, busy, code="busy", headers=[("Retry-After", "1")]
            )
            http.busy += 1
            response.force_close()
            return response
        by_token[token] = mine + 1
        try:
            return await handler(request)
        finally:
            left = by_token[token] - 1
            if left:
                by_token[token] = left
            else:
                del by_token[token]

    return admission


# --------------------------------------------------------------------------
# The application


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body, default=str, option=orjson.OPT_SORT_KEYS),
        content_type=JSON_CONTENT_TYPE,
        headers={"Cache-Control": "no-store"},
    )


def build_app(
    *,
    metrics: CollectorRegistry,
    health: Health,
    noisy: Noisy | None = None,
    extra: Iterable[AddRoutes] = (),
    limits: Limits = Limits(),
) -> web.Application:
    """The application: /metrics, /healthz, /noisy (when there is ingest to ask;
    not in ``gateway serve``), then whatever each ``extra(app)`` adds."""
    http = HttpStats()
    metrics.register(HttpCollector(http))
    app = web.Application(
        middlewares=[_measured(http), _admission(limits.max_requests, http), _errors],
        client_max_size=limits.client_max_size,
        # Keyword arguments of aiohttp's protocol (RequestHandler), applied to
        # every connection this application is served on.
        handler_args={
            "max_line_size": limits.max_line_size,
            "max_field_size": limits.max_field_size,
            "max_headers": limits.max_headers,
            "keepalive_timeout": limits.keepalive_timeout,
            "lingering_time": limits.lingering_time,
            "logger": http_log,
            "access_log": None,
        },
    )

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics),
            headers={"Content-Type": METRICS_CONTENT_TYPE, "Cache-Control": "no-store"},
        )

    async def get_health(request: web.Request) -> web.Response:
        ok, checks = health()
        return _json({"status": "ok" if ok else "degraded", "checks": checks}, 200 if ok else 503)

    async def get_noisy(request: web.Request) -> web.Response:
        assert noisy is not None
        return _json(noisy(request.query.get("tenant", "")))

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", get_health)
    if noisy is not None:
        app.router.add_get("/noisy", get_noisy)
    for add in extra:
        add(app)
    return app


# --------------------------------------------------------------------------
# Serving


@dataclass(frozen=True, slots=True)
class Listening:
    """Where :func:`serve` listens (from ``AppRunner.addresses``)."""

    addresses: tuple[tuple[str, int], ...]

    @property
    def host(self) -> str:
        return self.addresses[0][0]

    @property
    def port(self) -> int:
        return self.addresses[0][1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@asynccontextmanager
async def serve(
    app: web.Application, host: str, port: int, *, shutdown_timeout: float = 2.0
) -> AsyncIterator[Listening]:
    """Serve ``app`` on ``host:port`` (0: any free port) on the running loop while inside.

    On exit the listener closes, idle connections are closed and requests under
    way get ``shutdown_timeout`` seconds before they are cancelled.
    """
    # handle_signals=False (the default, spelled out): the gateway owns SIGTERM.
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ConfigError(
                f"api: cannot listen on {host}:{port} ({exc.strerror}); set api.port, "
                "or api.enabled = false"
            ) from None
        listening = Listening(tuple((str(a[0]), int(a[1])) for a in runner.addresses))
        log.info("metrics on %s/metrics", listening.url)
        yield listening
    finally:
        await runner.cleanup()
