"""A real browser for the page's tests: Debian's Chromium, driven by Playwright.

Playwright's own browser download cannot work here (only package registries
are reachable), so it drives the system browser: `chromium` from apt
(`bash tests/browser/chromium.sh install`; `make test` does it). A missing
browser or a missing `playwright` package fails the test, never skips it.

Fixtures:
- `browser`: one headless Chromium for the session.
- `new_page(phone=False, size=None)`: a fresh context and page; `phone=True`
  gives a 360x740 touch screen, `size=(w, h)` another window size. Uncaught
  page errors and console errors (a CSP violation, a bad script) fail the
  test at teardown; "Failed to load resource" lines are not errors of the
  page (a 401 or 404 the page handles).
  A failing test leaves a screenshot of each of its pages.
- `page`: `new_page()` for a desktop-sized window.
- `screenshot(page, name)`: saves a full-page PNG as
  `tests/browser/output/<run>/<test>-<name>.png`, where <run> is the run's
  start time and pid (git-ignored; the newest 5 runs are kept). The folder is
  printed at the end of the run. Not pytest's own temporary folder: on a
  shared machine every pytest run of every user rotates that one (3 kept),
  and screenshots were gone before anyone looked.

Run: `.venv/bin/python -m pytest tests/browser` (`make test` runs them too).

Every async test in tests/browser/ runs on pytest-asyncio's session loop,
where the session's browser lives (as tests using `db` do in tests/conftest.py).
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from .fake_api import FakeApi
from .stand_in import seeded_api

if TYPE_CHECKING:
    from playwright.async_api import Browser, ConsoleMessage, Page

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "output"  # git-ignored by tests/browser/.gitignore
KEEP_RUNS = 5
CHROMIUM = "/usr/bin/chromium"
SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")
# Playwright's own default is 30 s; a page that needs more is broken.
DEFAULT_TIMEOUT_MS = 10_000

SCREENSHOT_DIR = pytest.StashKey[Path]()
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@dataclass(frozen=True, kw_only=True)
class Screen:
    width: int
    height: int
    mobile: bool = False
    scale: float = 1


DESKTOP = Screen(width=1280, height=860)
# The narrowest phone the page promises to serve (the "usable on a phone").
PHONE = Screen(width=360, height=740, mobile=True, scale=2)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents and pytest_asyncio.is_async_test(item):
            item.add_marker(SESSION_LOOP, append=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Kept so a page fixture can tell at teardown whether its test failed.
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    folder = config.stash.get(SCREENSHOT_DIR, None)
    if folder is not None and any(folder.iterdir()):
        terminalreporter.write_line(f"browser screenshots: {folder}")


def chromium_executable() -> str:
    """The system Chromium, or a failed test saying how to install it."""
    found = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if found is None:
        pytest.fail(
            "Chromium is not installed: the browser tests need Debian's `chromium` package. "
            "Install it with `bash tests/browser/chromium.sh install` (make test does this).",
            pytrace=False,
        )
    return found


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    executable = chromium_executable()
    try:
        from playwright.async_api import Error, async_playwright  # noqa: PLC0415
    except ImportError:
        pytest.fail(
            "The Python package `playwright` is missing: install the test extra "
            "(`.venv/bin/pip install -e '.[test]'`; make test does this).",
            pytrace=False,
        )
    async with async_playwright() as playwright:
        try:
            # chromium_sandbox=False passes --no-sandbox: as root (this project's
            # machines, CI) Chromium refuses to start with its sandbox on.
            launched = await playwright.chromium.launch(
                executable_path=executable,
                headless=True,
                chromium_sandbox=False,
                timeout=60_000,
            )
        except Error as exc:
            pytest.fail(f"Chromium ({executable}) did not start: {exc}", pytrace=False)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture(scope="session")
def screenshot_dir(request: pytest.FixtureRequest) -> Path:
    # One folder per run (start time, then pid: runs at the same time don't mix).
    folder = OUTPUT / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    for old in sorted(p for p in OUTPUT.iterdir() if p.is_dir())[:-KEEP_RUNS]:
        shutil.rmtree(old, ignore_errors=True)
    request.config.stash[SCREENSHOT_DIR] = folder
    return folder


def _file_name(node_name: str, name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{node_name}-{name}")[:150] + ".png"


@pytest.fixture
def screenshot(
    request: pytest.FixtureRequest, screenshot_dir: Path
) -> Callable[[Page, str], Awaitable[Path]]:
    async def take(page: Page, name: str) -> Path:
        path = screenshot_dir / _file_name(request.node.name, name)
        # Playwright creates the folder should a newer run have pruned it.
        await page.screenshot(path=path, full_page=True)
        return path

    return take


@pytest_asyncio.fixture(loop_scope="session")
async def new_page(
    browser: Browser, request: pytest.FixtureRequest, screenshot_dir: Path
) -> AsyncIterator[Callable[..., Awaitable[Page]]]:
    pages: list[Page] = []
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # Chromium logs every 4xx/5xx answer as "Failed to load resource";
        # the page handles those itself (login on 401, the detail on 404).
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            problems.append(f"console error: {message.text}")

    async def open_page(*, phone: bool = False, size: tuple[int, int] | None = None) -> Page:
        screen = PHONE if phone else DESKTOP
        if size is not None:
            screen = Screen(width=size[0], height=size[1], mobile=phone, scale=screen.scale)
        context = await browser.new_context(
            viewport={"width": screen.width, "height": screen.height},
            is_mobile=screen.mobile,
            has_touch=screen.mobile,
            device_scale_factor=screen.scale,
            locale="en-GB",
            timezone_id="UTC",
        )
        context.set_default_timeout(DEFAULT_TIMEOUT_MS)
        page = await context.new_page()
        page.on("console", on_console)
        page.on("pageerror", lambda exc: problems.append(f"uncaught error: {exc}"))
        pages.append(page)
        return page

    yield open_page

    failed = any(report.failed for report in request.node.stash.get(REPORTS, {}).values())
    for i, page in enumerate(pages):
        if failed and not page.is_closed():
            await page.screenshot(
                path=screenshot_dir / _file_name(request.node.name, f"failed-{i}"), full_page=True
            )
        await page.context.close()
    if problems:
        pytest.fail("the page reported errors:\n  " + "\n  ".join(problems), pytrace=False)


@pytest_asyncio.fixture(loop_scope="session")
async def page(new_page: Callable[..., Awaitable[Page]]) -> Page:
    return await new_page()


@pytest.fixture(scope="session")
def static_dir() -> Path:
    """The page's files, found as the server finds them: package data of gateway.web."""
    folder = importlib.resources.files("gateway.web") / "static"
    assert isinstance(folder, Path), f"gateway.web is not installed as files: {folder!r}"
    assert (folder / "index.html").is_file(), f"no index.html in {folder}"
    return folder


# The stand-in API (fake_api.py) and the page served beside it, for
# test_page_static.py and test_page_trouble.py.
@pytest.fixture
def api() -> FakeApi:
    return seeded_api()


@pytest_asyncio.fixture(loop_scope="session")
async def url(api: FakeApi, static_dir: Path) -> AsyncIterator[str]:
    async with api.serve(static_dir) as base:
        yield base
