"""The page in a real browser, against an in-memory stand-in for /api/v1.

What a building manager does: log in with a token, see the state tiles, open
a state's devices, page and search through them, open a device, and watch a
change arrive without reloading. Also: the phone layout, escaping of data,
polling paused in a hidden tab, and what a 401 or a 4xx detail looks like.

The API itself, on the real services, is tested elsewhere; here the stand-in
(fake_api.py) lets each test change the data directly.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from playwright.async_api import Page, expect

from .fake_api import FakeApi, ago, rfc3339
from .stand_in import (
    ADMIN_TOKEN,
    LIVE_MS,
    TENANT_TOKEN,
    Shot,
    log_in,
    no_horizontal_overflow,
)


async def test_login_tiles_rows_and_a_live_change(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    await page.goto(url)
    await expect(page.locator("#token")).to_be_visible()
    await page.locator("#token").fill("not-a-token")
    await page.locator("#login").click()
    # The API's detail, verbatim.
    await expect(page.locator("#login-message")).to_contain_text("unknown or revoked token")

    await page.locator("#token").fill(TENANT_TOKEN)
    await page.locator("#login").click()
    # One tenant: straight to its tiles.
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    await expect(page.locator('[data-state="off"] .count')).to_have_text("2")
    await expect(page).to_have_url(f"{url}#/t/acme")
    await screenshot(page, "tiles")
    await page.evaluate("() => { window.sameDocument = true; }")

    await page.locator('[data-state="on"]').click()
    await expect(page).to_have_url(f"{url}#/t/acme/s/on")
    rows = page.locator("#device-rows tr")
    await expect(rows).to_have_count(3)
    row = page.locator('[data-device="dev-1"]')
    await expect(row).to_contain_text("21.5")
    await expect(row).to_contain_text("floor:1")
    await expect(row.locator(".age")).to_contain_text("ago")
    await screenshot(page, "table")

    # A device turns on and another off: the table follows, without a reload.
    api.put("acme", "dev-4", "on", 99.0)
    api.put("acme", "dev-2", "off", 0.0)
    await expect(page.locator('[data-device="dev-4"]')).to_be_visible(timeout=LIVE_MS)
    await expect(page.locator('[data-device="dev-2"]')).to_have_count(0, timeout=LIVE_MS)
    await expect(page.locator('[data-device="dev-4"]')).to_contain_text("99")

    # And the tiles' counts.
    await page.locator("#crumbs a", has_text="acme").click()
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    api.put("acme", "dev-5", "on", 1.0)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("4", timeout=LIVE_MS)
    await expect(page.locator('[data-state="off"] .count')).to_have_text("1", timeout=LIVE_MS)
    api.put("acme", "dev-9", "alarm", 0.0)
    await expect(page.locator('[data-state="alarm"] .count')).to_have_text("1", timeout=LIVE_MS)
    await screenshot(page, "tiles-after-changes")

    assert await page.evaluate("() => window.sameDocument") is True, "the page was reloaded"
    requests = api.api_requests()
    assert all(r.authorization == f"Bearer {TENANT_TOKEN}" for r in requests if r.status != 401)
    # Polling is conditional: unchanged answers come back as 304.
    assert any(r.status == 304 for r in requests), requests


async def test_admin_picks_a_tenant_pages_and_filters(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    await log_in(page, url, ADMIN_TOKEN)
    await expect(page.locator("[data-tenant]")).to_have_count(2)
    await screenshot(page, "tenants")
    await page.locator('[data-tenant="big"]').click()
    await expect(page.locator('[data-state="on"] .count')).to_have_text("250")
    await page.locator('[data-state="on"]').click()

    rows = page.locator("#device-rows tr")
    first = page.locator("#device-rows tr:first-child")
    await expect(rows).to_have_count(100)
    await expect(first).to_have_attribute("data-device", "dev-000")
    meta = page.locator("#devices-meta")
    await expect(meta).to_have_text("100 shown · 250 devices in on")
    await page.locator("#next-page").click()
    await expect(first).to_have_attribute("data-device", "dev-100")
    await expect(page.locator("#page-no")).to_have_text("page 2")
    # The state's total, from the states endpoint.
    await expect(meta).to_have_text("page 2 · 100 shown · 250 devices in on")
    await page.locator("#next-page").click()
    await expect(first).to_have_attribute("data-device", "dev-200")
    await expect(rows).to_have_count(50)
    await expect(page.locator("#next-page")).to_be_disabled()
    await page.locator("#prev-page").click()
    await expect(first).to_have_attribute("data-device", "dev-100")
    # A reload keeps the page, and "previous" still knows the way back.
    await page.reload()
    await expect(first).to_have_attribute("data-device", "dev-100")
    await page.locator("#prev-page").click()
    await expect(first).to_have_attribute("data-device", "dev-000")
    await expect(page.locator("#prev-page")).to_be_disabled()
    # The browser's back button walks the same pages.
    await page.go_back()
    await expect(first).to_have_attribute("data-device", "dev-100")
    await page.go_forward()
    await expect(first).to_have_attribute("data-device", "dev-000")

    await page.locator("#prefix").fill("dev-02")
    await page.locator("#apply-filter").click()
    await expect(rows).to_have_count(10)
    await expect(page).to_have_url(f"{url}#/t/big/s/on?prefix=dev-02")
    await page.locator("#tag").fill("floor:1")
    await page.locator("#tag").press("Enter")
    await expect(rows).to_have_count(3)  # dev-021, dev-025, dev-029
    # One page of matches: "on this page" only when there are others.
    await expect(meta).to_have_text("3 match · 250 devices in on, unfiltered")
    await screenshot(page, "filtered")
    # Clicking a tag chip filters by it.
    await page.locator("#clear-filter").click()
    await expect(rows).to_have_count(100)
    await page.locator('[data-device="dev-003"] button[data-tag="floor:3"]').click()
    await expect(page.locator("#tag")).to_have_value("floor:3")
    await expect(rows).to_have_count(62)
    await expect(page.locator("#tag")).to_be_focused()  # not lost with the row pressed

    # A tag is checked as it is typed: a hint, and no request, until it is
    # KEY:VALUE or KEY=VALUE (spaces around the separator are dropped).
    before = len(api.seen)
    await page.locator("#tag").fill("floor")
    hint = page.locator("#tag-hint")
    await expect(hint).to_be_visible()
    await expect(hint).to_contain_text("KEY:VALUE")
    await expect(page.locator("#tag")).to_have_attribute("aria-invalid", "true")
    await asyncio.sleep(1)  # past the 400 ms of search-as-you-type
    await page.locator("#tag").press("Enter")
    await asyncio.sleep(0.5)
    await expect(page.locator("#error")).to_be_hidden()
    await expect(page.locator("#problem-message")).to_be_hidden()
    await expect(page.locator("#live")).not_to_contain_text("reconnecting")
    await expect(rows).to_have_count(62)
    await page.locator("#tag").fill("floor = 1 ")
    await expect(page).to_have_url(f"{url}#/t/big/s/on?tag=floor%3A1")
    await expect(rows).to_have_count(63)
    await expect(page.locator("#tag")).not_to_have_attribute("aria-invalid", "true")
    tags = [r.path for r in api.api_requests(before) if "tag=" in r.path]
    assert tags
    assert all("tag=floor%3A" in p for p in tags), tags
    await page.locator("#clear-filter").click()
    await expect(rows).to_have_count(100)

    # A filter reads a bounded number of rows per request, as the real API
    # does: an empty page with a cursor says the search goes on, not "none".
    api.scan_budget = 50
    await page.locator("#prefix").fill("dev-24")
    await page.locator("#apply-filter").click()
    empty = page.locator("#devices-empty")
    searching = "No match among the devices searched so far: Next searches on."
    await expect(empty).to_have_text(searching)
    await expect(page.locator("#next-page")).to_be_enabled()
    for n in range(2, 6):  # dev-050.. to dev-200..249, 50 rows a request
        await page.locator("#next-page").click()
        await expect(page.locator("#page-no")).to_have_text(f"page {n}")
    await expect(rows).to_have_count(10)
    await expect(first).to_have_attribute("data-device", "dev-240")
    await expect(page.locator("#next-page")).to_be_disabled()
    await page.locator("#prefix").fill("nobody")
    await page.locator("#apply-filter").click()
    await expect(empty).to_have_text(searching)
    api.scan_budget = 10_000
    # Next pressed again while the next page is still loading is not lost (it
    # did nothing: the CI's load made this test's quick clicks land there).
    await page.locator("#clear-filter").click()
    await expect(rows).to_have_count(100)
    api.delay_s = 1.0
    await page.locator("#next-page").click()
    await expect(page.locator("#page-no")).to_have_text("page 2")
    await page.locator("#next-page").click()  # page 2's answer is a second away
    api.delay_s = 0
    await expect(page.locator("#page-no")).to_have_text("page 3", timeout=10_000)
    await expect(first).to_have_attribute("data-device", "dev-200")
    await page.locator("#prefix").fill("nobody-at-all")
    await page.locator("#apply-filter").click()
    await expect(empty).to_have_text("No devices match.")
    await expect(page.locator("#next-page")).to_be_disabled()


async def test_device_detail_chart_and_history(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    states = ["on", "on", "off", "off", "on", "alarm", "alarm", "on"]
    for i, state in enumerate(states):
        api.put("acme", "boiler", state, 40.0 + (i % 3) * 5, at=ago(600 - 60 * i))
    api.put("acme", "door", "closed", "shut", at=ago(300))
    api.put("acme", "door", "open", "ajar", at=ago(200))
    api.put("acme", "door", "closed", "shut", at=ago(100))

    await log_in(page, url, TENANT_TOKEN)
    await page.locator('[data-state="on"]').click()
    await page.locator('[data-device="boiler"]').click()
    await expect(page).to_have_url(f"{url}#/t/acme/d/boiler")
    await expect(page.locator('[data-testid="device-state"]')).to_have_text("on")
    await expect(page.locator('[data-testid="device-value"]')).to_have_text("45")
    chart = page.locator('[data-testid="chart-svg"]')
    await expect(chart).to_have_attribute("data-numeric", "")
    # on → off → on → alarm → on: four changes, each marked.
    await expect(chart.locator("line.change")).to_have_count(4)
    await expect(chart.locator("circle.point")).to_have_count(len(states))
    await expect(page.locator("#history-rows tr")).to_have_count(len(states))
    await screenshot(page, "device")

    # A change shows on the detail page too.
    api.put("acme", "boiler", "off", 12.0)
    await expect(page.locator('[data-testid="device-state"]')).to_have_text("off", timeout=LIVE_MS)
    await expect(chart.locator("line.change")).to_have_count(5, timeout=LIVE_MS)

    # Back to the table, forward, reload: the hash routes hold.
    await page.go_back()
    await expect(page.locator('[data-device="dev-1"]')).to_be_visible()
    await page.go_forward()
    await page.reload()
    await expect(page.locator('[data-testid="device-state"]')).to_have_text("off")

    # A device whose values are not numbers gets a state strip only.
    await page.goto(f"{url}#/t/acme/d/door")
    await expect(page.locator('[data-testid="device-value"]')).to_have_text("shut")
    await expect(chart).not_to_have_attribute("data-numeric", "")
    await expect(chart.locator("rect.state-seg")).to_have_count(3)
    await expect(chart.locator("line.change")).to_have_count(2)
    await screenshot(page, "device-strip")

    # An unknown device: the 404's detail, a way back, and no empty chart
    # and history under it; its first event shows without a reload.
    await page.goto(f"{url}#/t/acme/d/nope")
    await expect(page.locator('[data-testid="device-missing"]')).to_have_text(
        "404 not_found: no device 'nope' in tenant 'acme'"
    )
    await expect(page.locator('[data-testid="device-missing-back"]')).to_have_attribute(
        "href", "#/t/acme"
    )
    await expect(page.locator('[data-testid="device-history"]')).to_be_hidden()
    api.put("acme", "nope", "on", 1.0)
    await expect(page.locator('[data-testid="device-state"]')).to_have_text("on", timeout=LIVE_MS)
    await expect(page.locator('[data-testid="device-history"]')).to_be_visible()

    # A device by its id from the states page, whatever its state (the tiles
    # asked for the state first); a pasted id's spaces at the ends dropped.
    await page.goto(f"{url}#/t/acme")
    await page.locator("#device-id").fill("  door ")
    await page.locator("#device-form button").click()
    await expect(page).to_have_url(f"{url}#/t/acme/d/door")
    await expect(page.locator('[data-testid="device-value"]')).to_have_text("shut")


async def test_a_device_is_found_by_the_start_of_its_id_whatever_its_state(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    """The form took an exact id only, typed whole and in its case: "lobby"
    opened a 404 page for Lobby-1 (page probe's left-alone list)."""
    api.put("acme", "Lobby-1", "on", 1.0)
    api.put("acme", "lobby-2", "off", 2.0)
    api.put("acme", "lobby-3", "alarm-" + "x" * 60, 3.0)  # a long state, on a phone
    api.put("acme", "lobby", None, 5.0)  # no state: found by its exact id only
    api.put("acme", "hall-1", "on", 4.0)
    page = await new_page(phone=True)
    await log_in(page, url, TENANT_TOKEN)
    await expect(page).to_have_url(f"{url}#/t/acme")
    form, meta = page.locator("#device-form"), page.locator("[data-testid=found-meta]")
    field = page.locator("#device-id")
    await field.fill("LOBBY")
    await form.locator("button").click()
    await expect(meta).to_have_text("3 devices' ids start with “LOBBY”:")
    found = page.locator("[data-testid=found-device]")
    await expect(found).to_have_text(["Lobby-1", "lobby-2", "lobby-3"])
    await expect(page.locator("#found-list li").nth(1)).to_contain_text("off")
    await expect(page.locator("#found-list li time")).to_have_count(3)
    await no_horizontal_overflow(page)
    await screenshot(page, "found-phone")
    await found.nth(1).click()
    await expect(page).to_have_url(f"{url}#/t/acme/d/lobby-2")
    # Back on the tenant, the form is empty and the last search gone.
    await page.go_back()
    await expect(meta).to_have_text("")
    await expect(found).to_have_count(0)
    # Nothing found, said with the tenant; spaces alone are told what to type.
    await field.fill("cellar")
    await field.press("Enter")
    await expect(meta).to_have_text("No device of acme has an id that starts with “cellar”.")
    await field.fill("   ")
    await field.press("Enter")
    await expect(meta).to_have_text("Type a device's id, or the start of it.")
    # Some states too large to search at once are named.
    api.find_cut_short = ["off"]
    await field.fill("lobby-")
    await field.press("Enter")
    await expect(meta).to_contain_text("Not every device was searched: off holds too many")
    await expect(found).to_have_text(["Lobby-1", "lobby-2", "lobby-3"])
    # An id found exactly opens its device, one with no state too.
    await field.fill("lobby")
    await field.press("Enter")
    await expect(page).to_have_url(f"{url}#/t/acme/d/lobby")
    await page.go_back()
    # A search still under way when the reader goes elsewhere does not pull
    # them back to its device when its answer comes.
    api.delay_s = 1.0
    await field.fill("hall-1")
    await field.press("Enter")
    await expect(meta).to_have_text("Searching…")
    await page.locator("#rejected-link").click()
    await expect(page).to_have_url(f"{url}#/t/acme/rejected")
    api.delay_s = 0
    await page.wait_for_timeout(1500)
    await expect(page).to_have_url(f"{url}#/t/acme/rejected")


async def test_phone_layout_has_no_horizontal_overflow(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    api.put(
        "acme",
        "a-device-with-a-very-long-identifier-0123456789abcdef",
        "on",
        123456.789,
        tags={"building": "north-wing-annex", "floor": "3", "room": "b12-conference"},
    )
    for i in range(6):
        api.put("acme", "pump", ["off", "on"][i % 2], float(i * i), at=ago(300 - 50 * i))
    page = await new_page(phone=True)
    await page.goto(url)
    await no_horizontal_overflow(page)
    await screenshot(page, "phone-login")
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("5")
    await no_horizontal_overflow(page)
    await screenshot(page, "phone-tiles")

    await page.locator('[data-state="on"]').tap()
    await expect(page.locator("#device-rows tr")).to_have_count(5)
    await no_horizontal_overflow(page)
    await screenshot(page, "phone-table")
    # Touch targets: every button, tile, link and field in the view is at least 44 px high.
    heights = await page.evaluate(
        """() => [...document.querySelectorAll(
                '#view-devices button, #view-devices input, #view-devices .device-link')]
            .filter((el) => el.offsetParent !== null)
            .map((el) => [el.id || el.textContent, el.getBoundingClientRect().height])"""
    )
    small = [(name, h) for name, h in heights if h < 44]
    assert not small, f"touch targets under 44 px: {small}"

    await page.locator('[data-device="pump"]').tap()
    await expect(page.locator('[data-testid="chart-svg"] line.change')).to_have_count(5)
    await no_horizontal_overflow(page)
    await screenshot(page, "phone-device")

    # A long id in the breadcrumbs is cut with an ellipsis (a flex box showed
    # none: page probe), and stays a 44 px target.
    await page.goto(f"{url}#/t/acme/d/a-device-with-a-very-long-identifier-0123456789abcdef")
    await expect(page.locator("#device-title")).to_contain_text("a-device-with")
    crumb = await page.evaluate(
        """() => { const el = [...document.querySelectorAll('#crumbs span, #crumbs a')].pop();
             const cs = getComputedStyle(el);
             return [el.scrollWidth > el.clientWidth, cs.textOverflow, cs.display,
                     el.getBoundingClientRect().height]; }"""
    )
    assert crumb[:2] == [True, "ellipsis"], crumb
    assert "flex" not in crumb[2], crumb  # a flex box draws no ellipsis
    assert crumb[3] >= 44, crumb
    await no_horizontal_overflow(page)


async def test_data_is_shown_as_text_never_as_markup(page: Page, url: str, api: FakeApi) -> None:
    evil = '<img src=x onerror="window.injected=1">'
    api.put("acme", evil, "on", evil, tags={"note": "<b>bold</b>"}, metrics={"<i>": 1.0})
    api.put("acme", "dev-x", evil, 1.0)
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator(".tile .state-name", has_text=evil)).to_be_visible()
    await page.locator('[data-state="on"]').click()
    row = page.locator("#device-rows tr", has_text=evil)
    await expect(row.locator(".device-link")).to_have_text(evil)
    await expect(row.locator(".tag")).to_have_text("note:<b>bold</b>")
    await row.locator(".device-link").click()
    await expect(page.locator("#device-title")).to_have_text(evil)
    await expect(page.locator('[data-testid="device-value"]')).to_have_text(evil)
    assert await page.locator("main img, main b, main i").count() == 0
    assert await page.evaluate("() => window.injected") is None


async def test_polling_pauses_while_the_tab_is_hidden(page: Page, url: str, api: FakeApi) -> None:
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    await expect(page.locator("#live")).to_contain_text("live")
    set_hidden = """(hidden) => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => hidden});
        Object.defineProperty(document, "visibilityState",
            {configurable: true, get: () => (hidden ? "hidden" : "visible")});
        document.dispatchEvent(new Event("visibilitychange"));
    }"""
    await page.evaluate(set_hidden, True)
    await expect(page.locator("#live")).to_have_text("paused")
    await asyncio.sleep(0.5)  # one request may have been on its way
    before = len(api.seen)
    await asyncio.sleep(2.5)
    assert api.api_requests(before) == []

    api.put("acme", "dev-4", "on", 1.0)
    await page.evaluate(set_hidden, False)
    # Visible again: it polls at once and catches up.
    await expect(page.locator('[data-state="on"] .count')).to_have_text("4", timeout=LIVE_MS)


async def test_a_revoked_token_returns_to_the_login(page: Page, url: str, api: FakeApi) -> None:
    await log_in(page, url, TENANT_TOKEN)
    await page.locator('[data-state="on"]').click()
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    api.revoke(TENANT_TOKEN)
    await expect(page.locator("#token")).to_be_visible(timeout=LIVE_MS + 1_000)
    await expect(page.locator("#login-message")).to_contain_text("unknown or revoked token")
    assert await page.evaluate("() => sessionStorage.getItem('gateway.token')") is None

    # Logging in again returns to where the manager was.
    api.add_token(TENANT_TOKEN, ["acme"])
    await page.locator("#token").fill(TENANT_TOKEN)
    await page.locator("#login").click()
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    await expect(page).to_have_url(f"{url}#/t/acme/s/on")


async def test_log_out_and_another_tenants_403(page: Page, url: str, api: FakeApi) -> None:
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"]')).to_be_visible()
    await page.goto(f"{url}#/t/big")
    await expect(page.locator("#problem-message")).to_have_text(
        "403 forbidden: this token may not read tenant 'big'"
    )
    await expect(page.locator("#problem-hint")).to_have_text(
        "Your token does not give access to tenant big. "
        "Whoever runs the gateway can give you one that does."
    )
    await page.locator("#logout").click()
    await expect(page.locator("#token")).to_be_visible()
    await expect(page.locator("#login-message")).to_have_text("You are logged out.")
    assert await page.evaluate("() => sessionStorage.getItem('gateway.token')") is None
    before = len(api.seen)
    await asyncio.sleep(1.5)
    assert api.api_requests(before) == [], "a logged-out page keeps polling"


async def test_tabs_of_one_browser_share_the_login_and_the_logout(
    page: Page, url: str, api: FakeApi, new_page: Callable[..., Awaitable[Page]]
) -> None:
    """A device opened in a new tab (Ctrl-click, a bookmark) is shown, not the
    login: the token is the tab's (sessionStorage), and a new tab asks the
    others for it. Logging out, or in, in one tab does it in the others."""
    await log_in(page, url, TENANT_TOKEN)
    await page.locator('[data-state="on"]').click()
    await expect(page.locator("#device-rows tr")).to_have_count(3)

    # Ctrl-click on the link, and on the row outside it: each opens a new
    # tab, logged in, at the device; this tab stays at the list.
    async with page.context.expect_page() as opened:
        await page.locator('[data-device="dev-1"] a').first.click(modifiers=["Control"])
    by_link = await opened.value
    await expect(by_link.locator("#device-title")).to_have_text("dev-1")
    await expect(by_link.locator("#view-login")).to_be_hidden()
    async with page.context.expect_page() as opened:
        await page.locator('[data-device="dev-2"] td').last.click(modifiers=["Control"])
    by_row = await opened.value
    await expect(by_row.locator("#device-title")).to_have_text("dev-2")
    await expect(page).to_have_url(f"{url}#/t/acme/s/on")
    await by_row.close()

    # An address typed into a new tab.
    typed = await page.context.new_page()
    await typed.goto(f"{url}#/t/acme/s/off")
    await expect(typed.locator("#device-rows tr")).to_have_count(2)

    # Log out in one: every tab of that token is logged out.
    await typed.locator("#logout").click()
    for tab in (page, by_link):
        await expect(tab.locator("#token")).to_be_visible()
        await expect(tab.locator("#login-message")).to_have_text("You logged out in another tab.")
        assert await tab.evaluate("() => sessionStorage.getItem('gateway.token')") is None
    # Log in in one: the tabs at their login come back where they were.
    await page.locator("#token").fill(TENANT_TOKEN)
    await page.locator("#login").click()
    await expect(by_link.locator("#device-title")).to_have_text("dev-1")
    await expect(by_link.locator("#view-device")).to_be_visible()
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    # The tab that logged out left its view for the start (its tenant).
    await expect(typed.locator('[data-state="on"] .count')).to_have_text("3")

    # A tab at its login after a 401 (another token, revoked) does not take
    # the token another tab hands a new one: it was not asked for there.
    refused = await page.context.new_page()
    await refused.add_init_script(f"sessionStorage.setItem('gateway.token', '{ADMIN_TOKEN}')")
    await refused.goto(f"{url}#/")
    api.revoke(ADMIN_TOKEN)
    await expect(refused.locator("#login-message")).to_contain_text("not accepted (401)")
    fresh = await page.context.new_page()
    await fresh.goto(f"{url}#/t/acme/s/off")
    await expect(fresh.locator("#device-rows tr")).to_have_count(2)
    await asyncio.sleep(0.5)
    await expect(refused.locator("#token")).to_be_visible()
    assert await refused.evaluate("() => sessionStorage.getItem('gateway.token')") is None

    # Another browser (context) shares nothing: its new tab asks for a token.
    stranger = await new_page()
    await stranger.goto(f"{url}#/t/acme/s/on")
    await expect(stranger.locator("#token")).to_be_visible()
    await expect(stranger.locator("#login-message")).to_have_text("")


async def test_extreme_numbers_hidden_direction_marks_and_no_state_are_shown_as_stored(
    page: Page, url: str, api: FakeApi
) -> None:
    """Page probe: -1e308 showed as "-Infinity" and drew NaN paths, a huge
    reading's axis label was cut to "68e+29", "\u202eevil\u202c" read "live",
    and a device without a state had an empty badge and a strip named "null"."""
    api.put("acme", "deep", "on", -1e308, at=ago(120))
    api.put("acme", "deep", "on", -1e308, at=ago(60))
    api.put("acme", "huge", "on", 1.2345678901234568e29, at=ago(120))
    api.put("acme", "huge", "on", 5e-7, at=ago(60))
    api.put("acme", "evil", "on", "\u202eevil\u202c", tags={"room": "\u200bA"})
    api.put("acme", "plain", None, 1.0, at=ago(60))
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator('[data-device="deep"]')).to_contain_text("-1e+308")
    await expect(page.locator('[data-device="huge"]')).to_contain_text("5e-7")
    row = page.locator('[data-device="evil"]')
    await expect(row).to_contain_text("⟨U+202E⟩evil⟨U+202C⟩")
    await expect(row).to_contain_text("room:⟨U+200B⟩A")

    # deep: one value, so the band's ends (1% of it either side).
    for device, shown in (("deep", "-9.9e+307"), ("huge", "1.235e+29")):
        await page.goto(f"{url}#/t/acme/d/{device}")
        await expect(page.locator("[data-testid=chart-svg]")).to_be_visible()
        drawn = await page.evaluate(
            """() => [...document.querySelectorAll('#chart svg path, #chart svg circle')]
                .map((el) => (el.getAttribute('d') || '') + (el.getAttribute('cy') || ''))"""
        )
        assert drawn, device
        assert not [d for d in drawn if "NaN" in d or "Infinity" in d], (device, drawn)
        labels = await page.locator("#chart svg text.axis").all_text_contents()
        assert shown in labels, (device, labels)
        # Each label inside the picture: its left edge at or right of the svg's.
        inside = await page.evaluate(
            """() => {
                const svg = document.querySelector('#chart svg').getBoundingClientRect();
                return [...document.querySelectorAll('#chart svg text.axis')]
                    .every((t) => t.getBoundingClientRect().left >= svg.left - 0.5);
            }"""
        )
        assert inside, (device, labels)

    await page.goto(f"{url}#/t/acme/d/plain")
    await expect(page.locator("[data-testid=device-state]")).to_have_text(
        "no state: its events carry none, so no state lists it"
    )
    await expect(page.locator("[data-testid=chart-svg]")).to_be_visible()
    assert "null" not in (await page.locator("#chart").inner_text())
    assert "null" not in (await page.locator("#history-rows").inner_text())


async def test_history_range_and_rejected_messages(page: Page, url: str, api: FakeApi) -> None:
    api.put("acme", "meter", "on", 1.0, at=ago(3 * 3600))
    api.put("acme", "meter", "off", 2.0, at=ago(1800))
    api.put("acme", "meter", "on", 3.0, at=ago(60))
    api.rejected["acme"] = [
        {
            "received_at": rfc3339(ago(120)),
            "topic": "tenants/acme/devices/d1/events",
            "device_id": "d1",
            "reason": "bad_json",
            "detail": "<script>alert(1)</script> is not JSON",
            "payload_size": 31,
            "payload": '{"value": <b>NaN</b>, "x": 1}',
            "payload_encoding": "utf-8",
            "payload_truncated": False,
        },
        {
            "received_at": rfc3339(ago(180)),
            "topic": "tenants/acme/devices/d2/events",
            "device_id": "d2",
            "reason": "invalid_msgpack",
            "detail": "not valid MessagePack: unpack(b) received extra data.",
            "payload_size": 5000,
            "payload": "gaV2YWx1ZQE" + "A" * 200,
            "payload_encoding": "base64",
            "payload_truncated": True,
        },
    ]
    await log_in(page, url, TENANT_TOKEN)
    # A one-tenant token lands on its tenant; go on from there, not mid-redirect.
    await expect(page).to_have_url(f"{url}#/t/acme")
    await page.goto(f"{url}#/t/acme/d/meter")
    await expect(page.locator("#range")).to_have_value("24h")
    await expect(page.locator("#history-rows tr")).to_have_count(3)
    await page.locator("#range").select_option("1h")
    await expect(page).to_have_url(f"{url}#/t/acme/d/meter?range=1h")
    await expect(page.locator("#history-rows tr")).to_have_count(2)
    await page.reload()
    await expect(page.locator("#range")).to_have_value("1h")
    await expect(page.locator("#history-rows tr")).to_have_count(2)

    await page.goto(f"{url}#/t/acme")
    await page.locator("#rejected-link").click()
    rows = page.locator("#rejected-rows tr")
    await expect(rows).to_have_count(2)
    row = rows.first
    # A code the page has no words for shows as it is; a known one in words,
    # its code under it and what it means in its title.
    await expect(row.locator("td[data-label=Reason]")).to_have_text("bad_json")
    await expect(row.locator("[data-testid=reason-code]")).to_have_count(0)
    reason = rows.nth(1).locator("td[data-label=Reason]")
    await expect(reason.locator(".reason-words")).to_have_text("Not valid MessagePack")
    await expect(reason.locator("[data-testid=reason-code]")).to_have_text("invalid_msgpack")
    await expect(reason).to_have_attribute("title", re.compile("could not be read as MessagePack"))
    await expect(row.locator("[data-testid=rejected-device]")).to_have_attribute(
        "href", "#/t/acme/d/d1"
    )
    await expect(row.locator(".detail")).to_have_text("<script>alert(1)</script> is not JSON")
    # What the device sent, as text (never markup), and bytes said as base64,
    # long ones cut under a tap with how much more was sent.
    await expect(row.locator(".payload")).to_have_text('{"value": <b>NaN</b>, "x": 1}')
    payload = rows.nth(1).locator(".payload details")
    summary = payload.locator("summary")
    await expect(summary).to_contain_text("base64: gaV2YWx1ZQE")
    # Said before it is opened; the length is the kept text's alone.
    await expect(summary).to_contain_text(
        "(219 characters; cut: 5,000 bytes were sent, only the start is kept)"
    )
    await payload.locator("summary").click()
    await expect(payload).to_contain_text("(cut: 5,000 bytes were sent, only the start is kept)")


async def test_rejected_says_when_it_shows_only_the_newest_and_never_another_tenants_nothing(
    page: Page, url: str, api: FakeApi
) -> None:
    """The page asked for the API's default 100 and showed them as "the last
    24 hours"; and opening a tenant's list after another's showed the other's
    "Nothing rejected" until the answer came."""

    def rejected(i: int) -> dict[str, Any]:
        return {
            "received_at": rfc3339(ago(10 + i)),
            "topic": f"tenants/acme/devices/d{i}/events",
            "device_id": f"d{i}",
            "reason": "invalid_json",
            "detail": "not valid JSON",
            "payload_size": 3,
        }

    api.rejected["acme"] = [rejected(i) for i in range(600)]
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/empty/rejected")
    await expect(page.locator("#rejected-empty")).to_be_visible()
    api.delay_s = 1.0
    await page.goto(f"{url}#/t/acme/rejected")
    await expect(page.locator("#rejected-meta")).to_have_text("Loading…")
    await expect(page.locator("#rejected-empty")).to_be_hidden()
    api.delay_s = 0
    await expect(page.locator("#rejected-rows tr")).to_have_count(500)
    await expect(page.locator("#rejected-meta")).to_contain_text("The newest 500 are shown")
    await expect(page.locator("#rejected-meta")).to_contain_text("older ones of the last 24 hours")
    await expect(page.locator("#rejected-rows tr").first).to_contain_text("d0")
    # Exactly 500: none left out, so no such note (it went by the count alone).
    api.rejected["exact"] = [rejected(i) for i in range(500)]
    await page.goto(f"{url}#/t/exact/rejected")
    await expect(page.locator("#rejected-rows tr")).to_have_count(500)
    await expect(page.locator("#rejected-meta")).to_have_text("")


async def test_times_drawn_before_midnight_get_their_date_after_it(
    page: Page, url: str, api: FakeApi
) -> None:
    """A page left open overnight (a wall tablet) kept "20:44:10" for
    yesterday's events: times are drawn once, without a date when they are
    of today, and only the ages were refreshed."""
    now = datetime.now(UTC)
    # The browser's clock: 30 s before the next midnight (UTC, as the tests'
    # browser); the event a minute before that, by the browser's clock (the
    # stand-in serves it whatever the time), so that it is of "today" there
    # whenever the test runs.
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    api.put("acme", "meter", "on", 1.0, at=midnight - timedelta(seconds=90))
    await page.clock.install(time=midnight - timedelta(seconds=30))
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/s/on")
    seen = page.locator('[data-device="meter"] time')
    await expect(seen).not_to_contain_text(str(now.year))  # today's: the time alone
    await page.clock.fast_forward(40_000)
    await expect(seen).to_contain_text(str(now.year))  # yesterday's now: with its date


async def test_a_whole_list_is_its_own_count_whatever_the_cached_counts_say(
    page: Page, url: str, api: FakeApi
) -> None:
    """The count came from /states, which the server keeps for up to 10 s,
    while the list is read fresh: "No devices are in state on right now"
    beside "1 device in on". A list on one page, unfiltered, is the count."""
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/s/on")
    rows = page.locator("#device-rows tr")
    await expect(rows).to_have_count(3)
    api.held_counts["acme"] = {"on": 5}
    api.put("acme", "dev-2", "off", 0.0)
    await expect(rows).to_have_count(2, timeout=LIVE_MS)
    await expect(page.locator("#devices-meta")).to_have_text("2 shown · 2 devices in on")


async def test_a_misspelt_state_or_range_in_the_address_is_said_or_mended(
    page: Page, url: str
) -> None:
    """Page probe: #/t/acme/s/onn read "No devices are in state onn right
    now", as if the state existed, and ?range=99y showed 24 hours with 99y
    left in the address."""
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/s/onn")
    await expect(page.locator("#devices-empty")).to_have_text(
        "No device of acme has ever been in state onn; its states: off, on."
    )
    # A tag filter that finds nothing: a key no device sent is named as such
    # ("No devices match." alone for a misspelt key: page probe).
    await page.goto(f"{url}#/t/acme/s/on?tag=flor:1")
    await expect(page.locator("#devices-empty")).to_have_text(
        "No device of acme has ever sent a tag flor; its tag keys: floor, room."
    )
    await page.goto(f"{url}#/t/acme/s/on?tag=floor:99")
    await expect(page.locator("#devices-empty")).to_have_text("No devices match.")
    await page.goto(f"{url}#/t/acme/d/dev-1?range=99y")
    await expect(page.locator("#device-title")).to_have_text("dev-1")
    await expect(page).to_have_url(f"{url}#/t/acme/d/dev-1")
    await expect(page.locator("#range")).to_have_value("24h")


async def test_back_from_a_device_returns_to_where_the_reader_was_in_the_list(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    """Every change of view scrolled to the top: checking devices one by one
    60 rows down, each Back landed on row 1 again."""
    page = await new_page(phone=True, size=(390, 844))
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(100)
    await page.evaluate("() => window.scrollTo(0, 6000)")
    row = page.locator('[data-device="dev-060"]')
    await row.scroll_into_view_if_needed()
    await page.wait_for_timeout(300)
    before = await page.evaluate("() => window.scrollY")
    await row.locator("a").click()
    await expect(page.locator('[data-testid="device-state"]')).to_have_text("on")
    assert await page.evaluate("() => window.scrollY") < before  # the device, from its top
    await page.go_back()
    await expect(page.locator("#device-rows tr")).to_have_count(100)
    await expect(row).to_be_in_viewport()
    assert abs(await page.evaluate("() => window.scrollY") - before) < 5
