"""What the page's tests against the stand-in API share: its seeded data,
tokens, and small checks of the page."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from playwright.async_api import Page, expect

from .fake_api import FakeApi, ago

TENANT_TOKEN = "tok-acme-0123456789"
ADMIN_TOKEN = "tok-admin-0123456789"
# The promise: a change shows within 2 s, without a reload.
LIVE_MS = 2_000

Shot = Callable[[Page, str], Awaitable[Path]]


def seeded_api() -> FakeApi:
    """Tenant acme (5 devices, 3 on, 2 off) and tenant big (250 devices on)."""
    fake = FakeApi()
    fake.add_token(TENANT_TOKEN, ["acme"])
    fake.add_token(ADMIN_TOKEN, None)
    for i, state in enumerate(["on", "on", "on", "off", "off"], start=1):
        fake.put(
            "acme",
            f"dev-{i}",
            state,
            20.0 + i,
            tags={"floor": str(i % 3), "room": f"r{i}"},
            at=ago(60 * i),
        )
    fake.put("acme", "dev-1", "on", 21.5, metrics={"temperature": 21.5}, at=ago(5))
    for i in range(250):
        fake.put("big", f"dev-{i:03d}", "on", i, tags={"floor": str(i % 4)}, at=ago(30))
    return fake


async def log_in(page: Page, url: str, token: str) -> None:
    await page.goto(url)
    await page.locator("#token").fill(token)
    await page.locator("#login").click()
    await expect(page.locator("#view-login")).to_be_hidden()


async def no_horizontal_overflow(page: Page) -> None:
    widths = await page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], f"page is {widths[0]} px wide in a {widths[1]} px window"


async def in_viewport(page: Page, selector: str) -> bool:
    """Whether the element is shown and at least partly inside the window."""
    return bool(
        await page.evaluate(
            """(sel) => { const el = document.querySelector(sel);
            if (!el || el.closest('[hidden]')) return false;
            const r = el.getBoundingClientRect();
            return r.height > 0 && r.bottom > 0 && r.top < innerHeight; }""",
            selector,
        )
    )
