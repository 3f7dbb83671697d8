"""The page in trouble, in a real browser against the stand-in API: outages,
slow and hung answers, 4xx, small phones, long names, contrast, focus, live
updates under a scrolled reader. What the probe of the page at 390x844,
320x568 and 1280x860 found, and later reviews: each test failed before its
fix.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Literal

import pytest
from playwright.async_api import Page, expect

from .fake_api import ApiError, FakeApi, ago, rfc3339
from .stand_in import (
    ADMIN_TOKEN,
    LIVE_MS,
    TENANT_TOKEN,
    Shot,
    in_viewport,
    log_in,
    no_horizontal_overflow,
)


async def test_an_outage_shows_wherever_a_phone_is_scrolled(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    page = await new_page(phone=True)
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(100)
    await page.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")
    await expect(page.locator("#live")).to_contain_text("live")
    assert await in_viewport(page, "#live"), "the live indicator scrolled away"

    announce = page.locator('[role="status"]#status-announce')
    await expect(announce).to_have_text("")  # not "live" at every start
    api.fault = ApiError(503, "unavailable", "Cassandra did not answer")
    await expect(page.locator("#live")).to_contain_text("reconnecting", timeout=LIVE_MS + 1_000)
    # Told to a screen reader once, not with every second's new line.
    await expect(announce).to_have_text("Updates stopped: reconnecting to the gateway.")
    assert await in_viewport(page, "#live"), "an outage is not on screen when scrolled"
    await expect(page.locator("#status")).to_contain_text("Cassandra did not answer")
    await no_horizontal_overflow(page)
    await screenshot(page, "outage-scrolled")
    # Unscrolled, the whole message is above the fold, on every view.
    for view in ("#/t/big", "#/t/big/s/on", "#/t/big/d/dev-001"):
        await page.goto(f"{url}{view}")
        await expect(page.locator("#error")).to_contain_text("Cassandra did not answer")
        assert await in_viewport(page, "#error"), f"the error is below the fold on {view}"
    await screenshot(page, "outage-top")

    api.fault = None
    # After the backoff (up to 8 s) the next poll succeeds.
    await expect(page.locator("#live")).to_contain_text("live", timeout=15_000)
    await expect(page.locator("#error")).to_be_hidden()
    await expect(announce).to_have_text("Live again: the page updates by itself.")


# Where the status line draws "last update … ago": [that text, the boxes that
# cut it off (an element clipping its overflow, or the window)], or null.
STATUS_AGE = """() => {
    const bar = document.getElementById('status');
    const walker = document.createTreeWalker(bar, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const start = node.data.indexOf('last update');
        const end = node.data.indexOf(' ago', start);
        if (start < 0 || end < 0) continue;
        const range = document.createRange();
        range.setStart(node, start);
        range.setEnd(node, end + 4);
        const r = range.getBoundingClientRect();
        const cut = [];
        for (let el = node.parentElement; el && bar.contains(el); el = el.parentElement) {
            const box = el.getBoundingClientRect();
            const clips = getComputedStyle(el).overflowX !== 'visible';
            if (clips && (r.left < box.left - 0.5 || r.right > box.right + 0.5)) {
                cut.push(el.id || el.className);
            }
        }
        if (r.left < 0 || r.right > innerWidth || r.top < 0 || r.bottom > innerHeight) {
            cut.push('window');
        }
        return [range.toString(), cut];
    }
    return null;
}"""


@pytest.mark.parametrize("size", [(360, 640), (320, 568)])
async def test_an_outage_on_a_phone_still_says_how_old_the_data_is(
    new_page: Callable[..., Awaitable[Page]],
    url: str,
    api: FakeApi,
    screenshot: Shot,
    size: tuple[int, int],
) -> None:
    # The probe at 360 px: "● reconnecting… 503 unavailable: Cassandr…", the
    # age of the data on screen cut off after the error.
    page = await new_page(phone=True, size=size)
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    live = page.locator("#live")
    await expect(live).to_contain_text("live")

    api.fault = ApiError(503, "unavailable", "Cassandra did not answer")
    await expect(live).to_contain_text("reconnecting", timeout=LIVE_MS + 1_000)
    # The error is still said, after the age (cut short if it must be).
    await expect(page.locator("#status")).to_contain_text("Cassandra did not answer")
    age = re.compile(r"last update \d+ s ago")
    await expect(page.locator("#status")).to_contain_text(age)
    shown = await page.evaluate(STATUS_AGE)
    assert shown is not None, "no age in the status line"
    assert age.fullmatch(shown[0]), shown
    assert shown[1] == [], f"{shown[0]!r} is cut off by {shown[1]}"
    # It counts on, still whole.
    await expect(page.locator("#status")).to_contain_text(
        re.compile(r"last update [3-9] s ago"), timeout=5_000
    )
    shown = await page.evaluate(STATUS_AGE)
    assert shown is not None, "no age in the status line"
    assert shown[1] == [], f"{shown[0]!r} is cut off by {shown[1]}"
    await no_horizontal_overflow(page)
    await screenshot(page, f"outage-{size[0]}")
    api.fault = None


async def test_slow_answers_turn_live_into_stale_with_the_age(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    page = await new_page(phone=True)
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    live = page.locator("#live")
    await expect(live).to_contain_text("live")
    # The time of the last update, on a phone too.
    await expect(live.locator(".live-time")).to_be_visible()

    # Cassandra answers in 6 s: polls still succeed, but the data is old.
    api.delay_s = 6
    await expect(live).to_contain_text("stale", timeout=8_000)
    await expect(live).not_to_contain_text("live")
    await expect(live).to_contain_text(" s ago")
    assert await in_viewport(page, "#live")
    await screenshot(page, "stale")
    api.delay_s = 0
    await expect(live).to_contain_text("live", timeout=10_000)
    await expect(live).not_to_contain_text("stale")


async def test_a_request_that_never_answers_is_given_up_and_polling_goes_on(
    page: Page, url: str, api: FakeApi
) -> None:
    """A connection that died without a word (a phone changing cells): the
    poll waited on its request until the browser gave up, minutes later,
    and no other poll started meanwhile. Now it is given up after 20 s,
    counted as a failure ("reconnecting…"), and polling goes on."""
    await page.clock.install()  # time flows, and can be moved on
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    live = page.locator("#live")
    await expect(live).to_contain_text("live")
    # 4 s of real time: the page's 20 s pass on its own clock, moved on below
    # (and the stand-in's handler is done by the test's end: aiohttp waits
    # for it at shutdown, up to a minute).
    api.delay_s = 4
    await page.wait_for_timeout(1_500)  # a poll is under way, waiting
    await page.clock.fast_forward(21_000)
    await expect(live).to_contain_text("reconnecting")
    await expect(page.locator("#error")).to_contain_text("No answer in 20 s; retrying.")
    api.delay_s = 0
    await page.clock.fast_forward(5_000)  # past the backoff
    await expect(live).to_contain_text("live", timeout=10_000)
    await expect(page.locator("#error")).to_be_hidden()


async def test_a_4xx_shows_its_message_stops_and_offers_a_way_back(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"]')).to_be_visible()
    # Another tenant's data: a 403, not an outage.
    await page.goto(f"{url}#/t/big/s/on")
    problem = page.locator("#problem-message")
    await expect(problem).to_have_text("403 forbidden: this token may not read tenant 'big'")
    await expect(page.locator("#view-devices")).to_be_hidden()
    await expect(page.locator("#live")).not_to_contain_text("reconnecting")
    await expect(page.locator("#error")).to_be_hidden()
    await screenshot(page, "403")
    before = len(api.seen)
    await asyncio.sleep(3)
    assert api.api_requests(before) == [], "a 403 is retried"
    back = page.locator("#problem-link")
    await expect(back).to_have_attribute("href", "#/t/acme")
    await back.click()
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    await expect(problem).to_be_hidden()

    # A cursor that is not the API's (a hand-edited URL): a 400, and page 1.
    await page.goto(f"{url}#/t/acme/s/on?prefix=dev&cursor=_w&p=2")
    await expect(problem).to_have_text("400 bad_request: cursor is not one this API gave out")
    await expect(page.locator("#devices-meta")).to_be_hidden()
    before = len(api.seen)
    await asyncio.sleep(3)
    assert api.api_requests(before) == [], "a 400 is retried"
    await page.locator("#problem-link").click()
    await expect(page).to_have_url(f"{url}#/t/acme/s/on?prefix=dev")
    await expect(page.locator("#device-rows tr")).to_have_count(3)


async def test_a_proxy_s_error_page_is_quoted_by_its_title_and_busy_is_no_outage(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    """Behind nginx (as the README suggests), a 502's HTML page went into the
    banner as markup; and a 503 for too many requests at once read as
    "cannot reach its database" (page probe)."""
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"]')).to_be_visible()
    nginx = (
        "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
        "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
        "</body>\r\n</html>\r\n"
    )
    await page.route(
        "**/api/v1/**",
        lambda route: route.fulfill(status=502, body=nginx, content_type="text/html"),
    )
    error = page.locator("#error")
    await expect(error).to_contain_text("The gateway failed to answer.", timeout=LIVE_MS + 9_000)
    await expect(error).to_contain_text("502 Bad Gateway: 502 Bad Gateway)")
    for shown in (error, page.locator("#status")):
        assert "<" not in await shown.inner_text(), await shown.inner_text()
    await screenshot(page, "proxy-502")
    await page.unroute("**/api/v1/**")
    api.fault = ApiError(503, "busy", "busy: 64 requests under way, retry shortly")
    await expect(error).to_contain_text(
        "The gateway is busy answering other requests", timeout=LIVE_MS + 9_000
    )
    await expect(error).not_to_contain_text("database")
    api.fault = None
    await expect(page.locator("#live")).to_contain_text("live", timeout=15_000)


async def test_login_says_what_to_do_when_the_gateway_is_unreachable(
    page: Page, url: str, api: FakeApi
) -> None:
    await page.goto(url)
    await page.route("**/api/v1/**", lambda route: route.abort())
    await page.locator("#token").fill(TENANT_TOKEN)
    await page.locator("#login").click()
    message = page.locator("#login-message")
    # It does not retry by itself, so it must not say it does.
    await expect(message).to_contain_text("Cannot reach the gateway")
    await expect(message).to_contain_text("press Log in again")
    await expect(message).not_to_contain_text("retrying")
    await expect(page.locator("#login")).to_be_enabled()
    await page.unroute("**/api/v1/**")
    await page.locator("#login").click()
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")


ONE_LINE = """(sel) => [...document.querySelectorAll(sel)]
    .filter((el) => el.offsetParent !== null && el.textContent.trim())
    .map((el) => { const range = document.createRange(); range.selectNodeContents(el);
        const tops = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        return [el.textContent.trim(), tops.size]; })
    .filter(([, lines]) => lines > 1)"""


async def test_tables_break_long_ids_not_times_sizes_reasons_or_headers(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    long_id = "sensor-" + "0123456789abcdef" * 6
    api.put("acme", long_id, "on", 1.0, tags={"note": "x" * 80})
    api.rejected["acme"] = [
        {
            "received_at": rfc3339(ago(120 + i)),
            "topic": f"tenants/acme/devices/{long_id}/events",
            "device_id": long_id,
            "reason": "invalid_msgpack",
            "detail": "unpackb: " + "ff" * 150 if i == 0 else "extra data",
            "payload_size": 31_337,
        }
        for i in range(3)
    ]
    for phone in (False, True):
        page = await new_page(phone=phone)
        await log_in(page, url, TENANT_TOKEN)
        await page.goto(f"{url}#/t/acme/rejected")
        await expect(page.locator("#rejected-rows tr")).to_have_count(3)
        await no_horizontal_overflow(page)
        await expect(page.locator("#rejected-rows td[data-label=Size]").first).to_have_text(
            "31,337 B"
        )
        # No payload kept: a phone's card has no empty "Payload" line.
        payload = page.locator("#rejected-rows td[data-label=Payload]").first
        await (expect(payload).to_be_hidden() if phone else expect(payload).to_be_visible())
        await screenshot(page, f"rejected-{'phone' if phone else 'desk'}")
        if not phone:
            broken = await page.evaluate(
                ONE_LINE,
                "#rejected-table th, #rejected-rows time, #rejected-rows .reason-words,"
                " #rejected-rows .reason-code, #rejected-rows td:nth-child(6)",
            )
            assert broken == [], f"broken over lines: {broken}"
        await page.goto(f"{url}#/t/acme/s/on")
        await expect(page.locator("#device-rows tr")).to_have_count(4)
        await no_horizontal_overflow(page)
        if not phone:
            broken = await page.evaluate(
                ONE_LINE, "#device-table th[scope=col], #device-rows time, #device-rows .age"
            )
            assert broken == [], f"broken over lines: {broken}"
        await screenshot(page, f"devices-{'phone' if phone else 'desk'}")


CONTRAST = """(sel) => {
    const rgba = (c) => { const p = c.match(/rgba?\\(([^)]+)\\)/)[1].split(/[ ,/]+/).map(Number);
        return p.length > 3 ? p : [...p, 1]; };
    const background = (el) => { for (let e = el; e; e = e.parentElement) {
        const c = rgba(getComputedStyle(e).backgroundColor); if (c[3] > 0) return c; }
        return [255, 255, 255, 1]; };
    const lum = ([r, g, b]) => [r, g, b].map((x) => { x /= 255;
        return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; })
        .reduce((sum, x, i) => sum + x * [0.2126, 0.7152, 0.0722][i], 0);
    return [...document.querySelectorAll(sel)].filter((el) => el.offsetParent !== null)
        .map((el) => { const a = lum(rgba(getComputedStyle(el).color)), b = lum(background(el));
            return [el.id || el.textContent.trim(),
                    Math.round((Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05) * 100) / 100]; });
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_badges_and_buttons_reach_wcag_aa_contrast(
    page: Page, url: str, api: FakeApi, scheme: Literal["light", "dark"]
) -> None:
    await page.emulate_media(color_scheme=scheme)
    for state in ("open", "warning", "closed", "standby"):
        api.put("acme", f"d-{state}", state, 1.0)
    await log_in(page, url, TENANT_TOKEN)
    low = []
    for device in ("dev-1", "d-open", "d-warning", "d-closed", "d-standby"):
        await page.goto(f"{url}#/t/acme/d/{device}")
        await expect(page.locator('[data-testid="device-state"]')).to_be_visible()
        low += [c for c in await page.evaluate(CONTRAST, ".badge") if c[1] < 4.5]
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    low += [c for c in await page.evaluate(CONTRAST, "button:enabled, .tile") if c[1] < 4.5]
    await page.goto(f"{url}#/t/big")
    await expect(page.locator("#problem-link")).to_be_visible()
    low += [c for c in await page.evaluate(CONTRAST, "#problem-link") if c[1] < 4.5]
    assert low == [], f"under 4.5:1 in the {scheme} scheme: {low}"


# The colours given to a state's tile, badge, chart, legend and history rows
# in the view shown: [what, colour].
STATE_COLOURS = """() => {
    const view = document.querySelector('main > .view:not([hidden])');
    return [
        ...[...view.querySelectorAll('.tile, .badge, .legend li, .dot-label')].map((el) =>
            [el.className || el.tagName, el.style.getPropertyValue('--state-color')]),
        ...[...view.querySelectorAll('rect.state-seg, circle.point')].map((el) =>
            [el.getAttribute('class'), el.getAttribute('fill')])];
}"""


async def test_states_named_like_object_properties_get_a_colour(
    page: Page, url: str, api: FakeApi
) -> None:
    # The probe: a state named constructor had an invisible badge, its colour
    # "hsl(function Object() { [native code] } 62% 42%)": the colour of a
    # well-known name was looked up in a plain object, Object.prototype and
    # all. (Names are looked up in lower case: "Constructor" too.)
    names = ("constructor", "__proto__", "Constructor")
    for name in names:
        api.put("acme", f"d-{name}", "on", 1.0, at=ago(600))
        api.put("acme", f"d-{name}", name, 2.0)
    await log_in(page, url, TENANT_TOKEN)
    for name in names:
        await expect(page.locator(f'.tile[data-state="{name}"] .count')).to_have_text("1")
    colour = re.compile(r"hsl\(\d+ 62% (42|28)%\)|hsl\(220 8% (55|42)%\)")
    bad = [c for c in await page.evaluate(STATE_COLOURS) if not colour.fullmatch(c[1])]
    for name in names:
        await page.goto(f"{url}#/t/acme/d/d-{name}")
        badge = page.locator('[data-testid="device-state"]')
        await expect(badge).to_have_text(name)
        await expect(page.locator("#history-rows tr")).to_have_count(2)
        bad += [
            [name, *c] for c in await page.evaluate(STATE_COLOURS) if not colour.fullmatch(c[1])
        ]
        background = await badge.evaluate("(el) => getComputedStyle(el).backgroundColor")
        if background == "rgba(0, 0, 0, 0)":
            bad.append([name, "badge background", background])
    assert bad == [], f"not a colour: {bad}"


ACTIVE = """() => { const el = document.activeElement;
    const row = el && el.closest('tr');
    return [el ? el.tagName.toLowerCase() : null, el && el.id,
            row ? row.dataset.device : null, el && el.dataset ? el.dataset.tag || null : null]; }"""


async def test_keyboard_focus_survives_paging_and_live_updates(
    page: Page, url: str, api: FakeApi
) -> None:
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    first = page.locator("#device-rows tr:first-child")
    await expect(first).to_have_attribute("data-device", "dev-000")
    await expect(page.locator("#next-page")).to_be_enabled()
    await page.locator("#next-page").focus()
    await page.keyboard.press("Enter")
    await expect(first).to_have_attribute("data-device", "dev-100")
    # Still on the pager, so Enter again goes on.
    await expect(page.locator("#next-page")).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(first).to_have_attribute("data-device", "dev-200")
    # The last page: Next is disabled, so the focus goes to the list's heading.
    await expect(page.locator("#next-page")).to_be_disabled()
    await expect(page.locator("#devices-title")).to_be_focused()
    await page.locator("#prev-page").focus()
    await page.keyboard.press("Enter")
    await expect(first).to_have_attribute("data-device", "dev-100")
    await expect(page.locator("#prev-page")).to_be_focused()

    # A live update rebuilds a row: the focused link or chip in it keeps the focus.
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(3)
    await page.locator('[data-device="dev-2"] .device-link').focus()
    api.put("acme", "dev-2", "on", 77.0)
    await expect(page.locator('[data-device="dev-2"]')).to_contain_text("77", timeout=LIVE_MS)
    assert await page.evaluate(ACTIVE) == ["a", "", "dev-2", None]
    await page.locator('[data-device="dev-3"] button[data-tag="room:r3"]').focus()
    api.put("acme", "dev-3", "on", 78.0)
    await expect(page.locator('[data-device="dev-3"]')).to_contain_text("78", timeout=LIVE_MS)
    assert await page.evaluate(ACTIVE) == ["button", "", "dev-3", "room:r3"]


SMALL_TARGETS = """() => [...document.querySelectorAll(
        'header a, header button, main a, main button, main input, main select')]
    .filter((el) => el.offsetParent !== null)
    .map((el) => { const r = el.getBoundingClientRect();
        return [el.id || el.textContent.trim(), Math.round(r.width), Math.round(r.height)]; })
    .filter(([, w, h]) => w < 44 || h < 44)"""


async def test_every_tap_target_is_at_least_44_px_square(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    api.put("acme", "d", "on", 1.0, tags={"k": "v"})
    page = await new_page(phone=True)
    await log_in(page, url, ADMIN_TOKEN)
    await expect(page.locator("[data-tenant]")).to_have_count(2)
    small = await page.evaluate(SMALL_TARGETS)
    views = ("#/t/acme", "#/t/acme/s/on", "#/t/acme/d/d", "#/t/acme/rejected", "#/t/big/s/on")
    for view in views:
        await page.goto(f"{url}{view}")
        await expect(page.locator("#live")).to_contain_text("live")
        small += [[view, *target] for target in await page.evaluate(SMALL_TARGETS)]
    assert small == [], f"tap targets under 44x44 px: {small}"


async def test_a_device_with_one_event_holds_its_state_until_now(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    api.put("acme", "lonely", "off", "shut", at=ago(3600))
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/d/lonely")
    chart = page.locator('[data-testid="chart-svg"]')
    await expect(chart.locator("rect.state-seg")).to_have_count(1)
    # The strip reaches the right edge, which is now, not a minute after the event.
    right = await page.evaluate(
        """() => { const svg = document.querySelector('[data-testid="chart-svg"]');
            const seg = svg.querySelector('rect.state-seg');
            return [Number(seg.getAttribute('x')) + Number(seg.getAttribute('width')),
                    svg.viewBox.baseVal.width]; }"""
    )
    assert right[0] >= right[1] - 12, right
    await expect(chart.locator("text.axis").last).to_have_text("now")
    caption = page.locator("#chart figcaption")
    await expect(caption).to_contain_text("off since")
    await expect(caption).to_contain_text("no change of state")
    await expect(caption).not_to_contain_text(" to ")
    await screenshot(page, "one-event")


async def test_a_range_without_events_says_when_the_last_came_and_offers_a_wider_one(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    """A device last seen days ago read "No events to chart." and "No events
    in this range." on the default 24 hours, and nothing said to try 7 days."""
    api.put("acme", "quiet", "off", "shut", at=ago(3 * 86400 + 5 * 3600 + 600))
    api.put("acme", "gone", "off", "shut", at=ago(9 * 86400 + 1800 - 30))  # rounded up
    api.put("acme", "lately", "off", "shut", at=ago(3600 + 40 * 60 - 30))  # rounded up
    page = await new_page(phone=True)
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/d/quiet")
    said = page.locator('[data-testid="empty-range"]')
    # Not "3 d ago", nor "1 h ago" below: both read as inside the range.
    await expect(said).to_have_text(
        "No events in this range: the last one came 3\u00a0d 6\u00a0h ago."
    )
    await no_horizontal_overflow(page)
    assert await page.evaluate(SMALL_TARGETS) == []
    await screenshot(page, "empty-range")
    # The chart is drawn again 150 ms after a resize (a phone turned): the
    # hint with it, not "No events to chart." (a screenshot's resize did it).
    await page.set_viewport_size({"width": 600, "height": 800})
    await page.wait_for_timeout(500)
    await expect(said).to_be_visible()
    await page.locator('[data-testid="wider-range"]').click()
    await expect(page.locator("#history-meta")).to_contain_text("1 event in the chart")
    await expect(page.locator("#range")).to_have_value("7d")
    await page.goto(f"{url}#/t/acme/d/gone")
    await expect(said).to_have_text(
        "No events in this range: the last one came 9\u00a0d 30\u00a0min ago. That is before "
        "the longest range here (the last 7 days)."
    )
    await expect(page.locator('[data-testid="wider-range"]')).to_have_count(0)
    await page.goto(f"{url}#/t/acme/d/lately?range=1h")
    await expect(said).to_have_text(
        "No events in this range: the last one came 1\u00a0h 40\u00a0min ago."
    )


async def test_the_chart_says_when_it_shows_only_the_newest_500_events(
    page: Page, url: str, api: FakeApi, screenshot: Shot
) -> None:
    for i in range(520):  # one every 10 s: 87 minutes, inside "last 24 hours"
        api.put("acme", "chatty", ["on", "off"][i // 100 % 2], float(i), at=ago(10 * (520 - i)))
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/d/chatty")
    note = page.locator('[data-testid="chart-limit"]')
    await expect(note).to_contain_text("newest 500 events, back to")
    await expect(note).to_contain_text("older events in this range are not shown")
    await expect(page.locator('[data-testid="chart-svg"] circle.point')).to_have_count(0)
    await screenshot(page, "limit")
    # A range that holds all its events says nothing of the kind.
    await page.goto(f"{url}#/t/acme/d/chatty?range=1h")
    await expect(page.locator("#history-meta")).to_contain_text("events in the chart")
    await expect(page.locator("#history-meta")).not_to_contain_text("older")
    await expect(note).to_have_count(0)


@pytest.mark.parametrize("size", [(320, 568), (390, 844)])
async def test_no_horizontal_overflow_on_small_phones_in_any_state(
    new_page: Callable[..., Awaitable[Page]],
    url: str,
    api: FakeApi,
    screenshot: Shot,
    size: tuple[int, int],
) -> None:
    long_id = "a-device-with-a-very-long-identifier-0123456789abcdef"
    api.put("acme", long_id, "on", 123456.789, tags={"building": "north-wing-annex"})
    api.rejected["acme"] = [
        {
            "received_at": rfc3339(ago(60)),
            "topic": f"tenants/acme/devices/{long_id}/events",
            "device_id": long_id,
            "reason": "invalid_msgpack",
            "detail": "unpackb: " + "ff" * 100,
            "payload_size": 31_337,
        }
    ]
    page = await new_page(phone=True, size=size)
    await log_in(page, url, TENANT_TOKEN)
    views = ("#/t/acme", "#/t/acme/s/on", f"#/t/acme/d/{long_id}", "#/t/acme/rejected")
    for view in views:
        await page.goto(f"{url}{view}")
        await expect(page.locator("#live")).to_contain_text("live")
        await no_horizontal_overflow(page)
    await page.goto(f"{url}#/t/acme/s/on")
    await page.locator("#tag").fill("no-separator")  # the hint under the field
    await expect(page.locator("#tag-hint")).to_contain_text("KEY:VALUE")
    await no_horizontal_overflow(page)
    await page.goto(f"{url}#/t/big")  # the 403 problem view
    await expect(page.locator("#problem-message")).to_be_visible()
    await no_horizontal_overflow(page)
    api.fault = ApiError(503, "unavailable", "Cassandra did not answer: " + "x" * 120)
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator("#live")).to_contain_text("reconnecting")
    await no_horizontal_overflow(page)
    await screenshot(page, "outage")


# The rows inside the window below the status line: [device, top in px].
ON_SCREEN = """() => {
    const below = document.getElementById('status').getBoundingClientRect().bottom;
    return [...document.querySelectorAll('#device-rows tr')]
        .map((r) => [r.dataset.device, r.getBoundingClientRect()])
        .filter(([, b]) => b.bottom > below && b.top < innerHeight)
        .map(([d, b]) => [d, Math.round(b.top)]); }"""


async def _big_list_on_a_phone(new_page: Callable[..., Awaitable[Page]], url: str) -> Page:
    """A phone at the first page of tenant big's 250 devices in "on"."""
    page = await new_page(phone=True, size=(390, 844))
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(100)
    return page


async def test_the_new_devices_bar_leaves_the_pager_free_when_it_comes_at_the_end(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    """The reader is at the end of the list when devices come: the bar showed
    over Previous and Next until they scrolled again (page probe, phone)."""
    page = await _big_list_on_a_phone(new_page, url)
    await page.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")
    await page.wait_for_timeout(300)
    api.put("big", "dev-0005", "on", 1.0)
    bar = page.locator("#new-devices")
    await expect(bar).to_be_visible(timeout=LIVE_MS)
    overlap = await page.evaluate(
        """() => {
        const bar = document.getElementById('new-devices').getBoundingClientRect();
        return [...document.querySelectorAll('#pager button')].some((b) => {
            const r = b.getBoundingClientRect();
            return Math.min(bar.bottom, r.bottom) > Math.max(bar.top, r.top)
                && Math.min(bar.right, r.right) > Math.max(bar.left, r.left); }); }"""
    )
    assert not overlap, "the bar covers Previous or Next"


async def test_a_busy_devices_history_stays_put_under_the_reader(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    """Scrolled into a device's history table, the reader's row slid down a
    row per new event (page probe: 203 px in 14 s on a phone)."""
    for i in range(40):
        api.put("acme", "busy", "on", float(i), at=ago(600 - i * 10))
    page = await new_page(phone=True, size=(390, 844))
    await log_in(page, url, TENANT_TOKEN)
    await page.goto(f"{url}#/t/acme/d/busy")
    rows = page.locator("#history-rows tr")
    await expect(rows).to_have_count(40)
    await rows.nth(15).scroll_into_view_if_needed()
    await page.evaluate("() => window.scrollBy(0, 200)")
    reading = rows.nth(15)
    before = await reading.bounding_box()
    when = await reading.locator("td").first.inner_text()  # events 10 s apart
    assert before is not None
    for i in range(3):
        api.put("acme", "busy", "off", 100.0 + i, at=ago(3 - i))
    await expect(rows).to_have_count(43, timeout=LIVE_MS)
    same = rows.filter(has=page.locator("td").first.get_by_text(when, exact=True))
    after = await same.bounding_box()
    assert after is not None
    assert abs(after["y"] - before["y"]) <= 2, (before, after)


async def test_back_from_a_device_puts_the_same_row_under_the_thumb(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    """Devices came into the list above the reader while they looked at one:
    back, the list came back at the same offset, with another row under the
    thumb (page probe: 309 px before, 711 after)."""
    page = await _big_list_on_a_phone(new_page, url)
    await page.evaluate("() => window.scrollTo(0, 2500)")
    await page.wait_for_timeout(200)
    before = await page.evaluate(ON_SCREEN)
    device, top = before[0]  # the row at the top of the screen
    tapped = before[1][0]  # on screen whole, so the click scrolls nothing
    await page.locator(f'[data-device="{tapped}"] a').first.click()
    await expect(page.locator("#device-title")).to_have_text(tapped)
    assert await page.evaluate("() => window.scrollY") == 0
    for came in ("dev-0005", "dev-0015", "dev-0025"):
        api.put("big", came, "on", 1.0, tags={"floor": "9"})
    await page.go_back()
    await expect(page.locator('[data-device="dev-0005"]')).to_have_count(1, timeout=LIVE_MS)
    after = dict(await page.evaluate(ON_SCREEN))
    assert device in after, (device, after)
    assert abs(after[device] - top) <= 2, (device, top, after[device])


async def test_live_updates_keep_a_scrolled_list_steady(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi, screenshot: Shot
) -> None:
    page = await new_page(phone=True, size=(390, 844))
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    rows = page.locator("#device-rows tr")
    meta = page.locator("#devices-meta")
    await expect(rows).to_have_count(100)
    await expect(meta).to_have_text("100 shown · 250 devices in on")
    # As in Safari, which has no scroll anchoring of its own (Chromium's
    # hides a change of height above the screen).
    await page.evaluate("() => { document.documentElement.style.overflowAnchor = 'none'; }")
    await page.evaluate("() => window.scrollTo(0, 6000)")
    before = await page.evaluate(ON_SCREEN)
    assert len(before) >= 3, before
    # Above the screen two devices leave the state and three enter it; one on
    # screen changes its value. What is under the finger must not move.
    on_screen = before[1][0]
    for gone in ("dev-001", "dev-002"):
        api.put("big", gone, "off", 0.0)
    for came in ("dev-0005", "dev-0015", "dev-0025"):
        api.put("big", came, "on", 1.0, tags={"floor": "9"})
    api.put("big", on_screen, "on", 4242.0)
    await expect(page.locator(f'[data-device="{on_screen}"]')).to_contain_text(
        "4242", timeout=LIVE_MS
    )
    assert await page.evaluate(ON_SCREEN) == before
    # Those that left are kept, greyed and marked (dev-099, pushed to page 2
    # by those that came, too: one page of several cannot tell the two
    # apart); those that came are counted.
    left = page.locator("#device-rows tr.left")
    await expect(left).to_have_count(3)
    await expect(page.locator('[data-device="dev-001"]')).to_contain_text("left this page")
    await expect(page.locator('[data-device="dev-099"]')).to_contain_text("left this page")
    await expect(page.locator('[data-device="dev-0005"]')).to_have_count(0)
    bar = page.locator("#new-devices")
    await expect(bar).to_be_visible()
    await expect(bar).to_contain_text("3 new")
    await expect(meta).to_have_text("97 shown · 3 left this page · 3 new · 251 devices in on")
    await no_horizontal_overflow(page)
    await screenshot(page, "steady-scrolled")
    # Scrolled to the end, the bar leaves the pager uncovered (it hid the
    # page number and the inner edges of Previous and Next).
    overlap = await page.evaluate(
        """() => { const back = window.scrollY;
        window.scrollTo(0, document.body.scrollHeight);
        const bar = document.getElementById('new-devices').getBoundingClientRect();
        const pager = document.getElementById('pager').getBoundingClientRect();
        window.scrollTo(0, back);  // before any poll: the rows stay as they were
        const y = Math.min(bar.bottom, pager.bottom) - Math.max(bar.top, pager.top);
        const x = Math.min(bar.right, pager.right) - Math.max(bar.left, pager.left);
        return y > 0 && x > 0; }"""
    )
    assert not overlap, "the new-devices bar covers the pager"
    # Another poll changes nothing on screen.
    await asyncio.sleep(1.5)
    assert await page.evaluate(ON_SCREEN) == before

    # "Show" brings the list up to date, keeping the top row where it was.
    await bar.click()
    await expect(left).to_have_count(0)
    await expect(rows).to_have_count(100)
    await expect(page.locator('[data-device="dev-0005"]')).to_have_count(1)
    await expect(bar).to_be_hidden()
    await expect(meta).to_have_text("100 shown · 251 devices in on")
    assert (await page.evaluate(ON_SCREEN))[0] == before[0]

    # Scrolled back to the top, the list follows live again, and a device
    # that left while the reader was away goes as they come back.
    api.put("big", "dev-003", "off", 0.0)
    await expect(page.locator('[data-device="dev-003"]')).to_have_class(
        re.compile(r"\bleft\b"), timeout=LIVE_MS
    )
    await page.evaluate("() => window.scrollTo(0, 0)")
    await expect(page.locator('[data-device="dev-003"]')).to_have_count(0, timeout=LIVE_MS)
    api.put("big", "dev-0001", "on", 1.0)
    await expect(page.locator('[data-device="dev-0001"]')).to_have_count(1, timeout=LIVE_MS)
    await expect(bar).to_be_hidden()
    await expect(meta).to_have_text("100 shown · 251 devices in on")


async def test_next_goes_on_after_the_last_row_shown_not_the_newest_answer(
    new_page: Callable[..., Awaitable[Page]], url: str, api: FakeApi
) -> None:
    """Scrolled into page 1, the rows hold still while a device above leaves
    the state; the newest answer's page then ends one device later (dev-100),
    a device the rows never showed. Next took that answer's cursor, so page
    2 began at dev-101 and dev-100 was on neither page."""
    page = await new_page(phone=True, size=(390, 844))
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    rows = page.locator("#device-rows tr")
    await expect(rows).to_have_count(100)
    await expect(rows.last).to_have_attribute("data-device", "dev-099")
    await page.evaluate("() => window.scrollTo(0, 6000)")
    api.put("big", "dev-001", "off", 0.0)
    await expect(page.locator('[data-device="dev-001"]')).to_have_class(
        re.compile(r"\bleft\b"), timeout=LIVE_MS
    )
    await expect(rows.last).to_have_attribute("data-device", "dev-099")
    await page.locator("#next-page").click()
    await expect(page.locator("#page-no")).to_have_text("page 2")
    await expect(rows.first).to_have_attribute("data-device", "dev-100")


async def test_a_misspelt_tenant_is_not_shown_as_an_empty_one(
    page: Page, url: str, api: FakeApi
) -> None:
    api.latest["empty"] = {}  # known (it has sent something), but no device now
    await log_in(page, url, ADMIN_TOKEN)
    await expect(page.locator("[data-tenant]")).to_have_count(3)
    empty = page.locator("#states-empty")
    await page.goto(f"{url}#/t/acmee")
    await expect(empty).to_have_text(
        "No tenant named acmee has sent anything (known tenants: acme, big, empty)."
    )
    await page.goto(f"{url}#/t/empty")
    await expect(empty).to_have_text("This tenant has no devices yet.")
    # A tenant that sends its first message while the page shows it: its states.
    await page.goto(f"{url}#/t/late")
    await expect(empty).to_contain_text("No tenant named late")
    api.put("late", "d", "on", 1.0)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("1", timeout=LIVE_MS)
    await expect(empty).to_be_hidden()


async def test_an_outage_says_the_list_could_not_be_loaded_not_loading(
    page: Page, url: str, api: FakeApi
) -> None:
    await log_in(page, url, TENANT_TOKEN)
    await expect(page.locator('[data-state="on"] .count')).to_have_text("3")
    api.fault = ApiError(503, "unavailable", "Cassandra did not answer")
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(page.locator("#error")).to_contain_text("Cassandra did not answer")
    meta = page.locator("#devices-meta")
    await expect(meta).to_have_text(
        "The device list could not be loaded; the page will try again by itself."
    )
    await page.goto(f"{url}#/t/acme/d/dev-1")
    await expect(page.locator("#error")).to_contain_text("Cassandra did not answer")
    await expect(page.locator("#device-latest")).to_have_text(
        "This device could not be loaded; the page will try again by itself."
    )
    await page.goto(f"{url}#/t/acme/s/on")
    await expect(meta).to_contain_text("could not be loaded")
    api.fault = None
    # The first retry is 2 s after the first failure.
    await expect(page.locator("#device-rows tr")).to_have_count(3, timeout=5_000)
    await expect(meta).to_have_text("3 shown · 3 devices in on")
    await expect(page.locator("#error")).to_be_hidden()


async def test_a_list_scrolled_under_the_desktop_bar_holds_still(
    page: Page, url: str, api: FakeApi
) -> None:
    await log_in(page, url, ADMIN_TOKEN)
    await page.goto(f"{url}#/t/big/s/on")
    await expect(page.locator("#device-rows tr")).to_have_count(100)
    await page.evaluate("() => { document.documentElement.style.overflowAnchor = 'none'; }")
    # The list's first row just under the bar that sticks at the top.
    await page.evaluate(
        """() => { const bar = document.querySelector('header.bar').getBoundingClientRect();
        const rows = document.getElementById('device-rows').getBoundingClientRect();
        window.scrollBy(0, rows.top - bar.bottom + 10); }"""
    )
    before = await page.evaluate(ON_SCREEN)
    api.put("big", "dev-0000", "on", 1.0)
    await expect(page.locator("#new-devices")).to_contain_text("1 new", timeout=LIVE_MS)
    assert await page.evaluate(ON_SCREEN) == before
