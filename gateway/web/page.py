"""The building managers' page: the files of ``gateway/web/static/``, shipped
inside the package (no CDN, no build step; it works offline on an edge host).

``/`` is ``index.html``; every other file of the folder is served at
``/<name>``. The routes are fixed when the application is built, from the
files present, so no request path ever reaches the file system. Files are sent
by aiohttp's ``FileResponse`` (ETag and Last-Modified, so a reload costs 304s),
with ``Cache-Control: no-cache`` so an upgraded gateway's page is picked up,
and a Content-Security-Policy that allows the page's own files and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from .server import Handler

STATIC = Path(__file__).resolve().parent / "static"
# The page needs nothing but its own files and the API (no inline script or
# style, no other origin): anything else a browser refuses.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Cache-Control": "no-cache", "Content-Security-Policy": CSP}


def add_page(app: web.Application) -> None:
    """The ``extra`` for :func:`gateway.web.server.build_app` that serves the page."""
    files = {p.name: p for p in sorted(STATIC.iterdir()) if p.is_file()}
    if "index.html" not in files:
        raise RuntimeError(f"the page is missing from the package: no {STATIC / 'index.html'}")

    def sender(path: Path) -> Handler:
        async def send(request: web.Request) -> web.StreamResponse:
            return web.FileResponse(path, headers=HEADERS)

        return send

    app.router.add_get("/", sender(files["index.html"]))
    for name, path in files.items():
        app.router.add_get(f"/{name}", sender(path))
