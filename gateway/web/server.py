"""The gateway's HTTP server: /metrics, /healthz and JSON routes, no dependencies.

Serves, over plain HTTP/1.1 with ``Connection: close`` (one request per
connection):

    GET /metrics   Prometheus text exposition format 0.0.4, from ``render_metrics()``
    GET /healthz   {"status": "ok"|"degraded", "checks": {...}}; 200 if healthy, else 503

Anything else: 404 for an unknown path, 405 (``Allow: GET``) for another
method on a known path, 400 for a malformed request line.

Bounds, so a scraper (or anything else that finds the port) cannot hurt the
gateway's event loop:

* The request line plus headers may be at most 8 KiB; more gets 431. Request
  bodies are never read.
* The whole request head must arrive within 5 s of the connection being
  accepted (slowloris); otherwise 408 and the connection is closed. Writing the
  response has the same deadline.
* At most 32 connections are served at once (a semaphore). A connection beyond
  that is answered 503 (``Retry-After: 1``) at once and closed: refused, not
  queued, so a flood cannot pile up waiting handlers.
* After an error response the server reads and discards what the client still
  sends (at most 64 KiB, at most 1 s) before closing, so the client sees the
  response rather than a TCP reset.

``render_metrics`` and ``health`` run on the event loop and must be cheap and
non-blocking. If one raises, the request gets a 500 with a short text body and
one warning is logged; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from ..errors import ConfigError
from .metrics import METRICS_CONTENT_TYPE

log = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"

MAX_HEADER_BYTES = 8 * 1024
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 32
LINGER_BYTES = 64 * 1024
LINGER_SECONDS = 1.0

# --------------------------------------------------------------------------
# HTTP server

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

_PATHS = ("/metrics", "/healthz")


@dataclass(slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = TEXT_CONTENT_TYPE
    headers: tuple[tuple[str, str], ...] = ()


def _text(status: int, text: str, *headers: tuple[str, str]) -> _Response:
    return _Response(status, text.encode(), TEXT_CONTENT_TYPE, headers)


class _HeadTooLarge(Exception):
    pass


class _Server:
    def __init__(
        self,
        render_metrics: Callable[[], str],
        health: Callable[[], tuple[bool, dict[str, object]]],
        read_timeout: float,
        max_connections: int,
        max_header_bytes: int,
        routes: Mapping[str, Callable[[Mapping[str, str]], object]],
    ) -> None:
        self.render_metrics = render_metrics
        self.routes = dict(routes)
        self.health = health
        self.read_timeout = read_timeout
        self.max_header_bytes = max_header_bytes
        self.slots = asyncio.Semaphore(max_connections)
        self.handlers: set[asyncio.Task[None]] = set()
        self.closing = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        answered = False  # otherwise (error, timeout, cancelled): reset the connection
        try:
            if self.closing:
                return
            if self.slots.locked():  # no await between this check and the acquire below
                await self._send(reader, writer, _text(503, "busy\n", ("Retry-After", "1")))
            else:
                async with self.slots:
                    response = await self._respond(reader)
                    await self._send(reader, writer, response)
            answered = True
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.debug("HTTP connection ended: %r", exc)
        except Exception:
            log.warning("HTTP handler failed", exc_info=True)
        finally:
            self.handlers.discard(task)
            if answered:
                writer.close()
                try:
                    async with asyncio.timeout(self.read_timeout):
                        await writer.wait_closed()
                except TimeoutError:
                    writer.transport.abort()
                except Exception as exc:  # the peer reset; nothing to do
                    log.debug("HTTP close: %r", exc)
            else:
                writer.transport.abort()

    async def _respond(self, reader: asyncio.StreamReader) -> _Response:
        try:
            async with asyncio.timeout(self.read_timeout):
                request_line = await self._read_head(reader)
        except TimeoutError:
            return _text(408, "request timeout\n")
        except _HeadTooLarge:
            return _text(431, f"request head over {self.max_header_bytes} bytes\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
            return _text(400, "bad request\n")
        method, target, _ = parts
        path, _, query = target.partition("?")
        if path not in _PATHS and path not in self.routes:
            return _text(404, "not found\n")
        if method != "GET":
            return _text(405, "method not allowed\n", ("Allow", "GET"))
        try:
            if path == "/metrics":
                return _Response(200, self.render_metrics().encode(), METRICS_CONTENT_TYPE)
            if path in self.routes:
                params = dict(urllib.parse.parse_qsl(query))
                result = self.routes[path](params)
                return _Response(
                    200, json.dumps(result, default=str, sort_keys=True).encode(), JSON_CONTENT_TYPE
                )
            ok, checks = self.health()
            body = {"status": "ok" if ok else "degraded", "checks": checks}
            return _Response(
                200 if ok else 503,
                json.dumps(body, default=str, sort_keys=True).encode(),
                JSON_CONTENT_TYPE,
            )
        except Exception:
            log.warning("GET %s failed", path, exc_info=True)
            return _text(500, "internal server error\n")

    async def _read_head(self, reader: asyncio.StreamReader) -> str:
        """The request line, once the whole head (up to the empty line) is read."""
        total = 0
        request_line: bytes | None = None
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _HeadTooLarge from None
            total += len(line)
            if total > self.max_header_bytes:
                raise _HeadTooLarge
            if line in (b"\r\n", b"\n"):
                if request_line is not None:
                    return request_line.decode("latin-1").rstrip("\r\n")
                continue  # RFC 9112 2.2: ignore empty lines before the request line
            if request_line is None:
                request_line = line

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: _Response
    ) -> None:
        head = [
            f"HTTP/1.1 {response.status} {_REASONS[response.status]}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: close",
            "Cache-Control: no-store",
        ]
        head.extend(f"{name}: {value}" for name, value in response.headers)
        async with asyncio.timeout(self.read_timeout):
            writer.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + response.body)
            await writer.drain()
        if response.status >= 400 and writer.can_write_eof():
            # Lingering close: discard what the client still sends so that
            # closing does not reset the connection before it reads the answer.
            writer.write_eof()
            discarded = 0
            with suppress(TimeoutError):
                async with asyncio.timeout(min(LINGER_SECONDS, self.read_timeout)):
                    while discarded < LINGER_BYTES:
                        chunk = await reader.read(LINGER_BYTES)
                        if not chunk:
                            break
                        discarded += len(chunk)

    async def close(self) -> None:
        self.closing = True
        handlers = list(self.handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


def _url(sockname: tuple[object, ...]) -> str:
    host, port = str(sockname[0]), sockname[1]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


@asynccontextmanager
async def serve(
    host: str,
    port: int,
    render_metrics: Callable[[], str],
    health: Callable[[], tuple[bool, dict[str, object]]],
    *,
    read_timeout: float = READ_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    max_header_bytes: int = MAX_HEADER_BYTES,
    routes: Mapping[str, Callable[[Mapping[str, str]], object]] | None = None,
) -> AsyncIterator[asyncio.Server]:
    """Serve /metrics and /healthz on ``host:port`` (0: any free port) while inside.

    The bound address is in ``server.sockets``. On exit the listening socket is
    closed and connections still being served are cancelled and closed.
    """
    state = _Server(
        render_metrics, health, read_timeout, max_connections, max_header_bytes, routes or {}
    )
    try:
        server = await asyncio.start_server(state.handle, host, port, limit=max_header_bytes)
    except OSError as exc:
        raise ConfigError(
            f"api: cannot listen on {host}:{port} ({exc.strerror}); set api.port, "
            "or api.enabled = false"
        ) from None
    try:
        log.info("metrics on %s", _url(server.sockets[0].getsockname()))
        yield server
    finally:
        server.close()
        await state.close()
        await server.wait_closed()
