"""Topic templates -> subscriptions, and topics -> (tenant, device_id). No services needed."""

from __future__ import annotations

import logging
import time

import orjson
import pytest

from gateway.config import DEFAULT_TEMPLATE, Config, LimitsConfig, TopicTemplate
from gateway.errors import DecodeError
from gateway.ingest.topics import TopicMatcher
from gateway.store.database import Database
from gateway.topic_filters import filter_levels, meets

from .helpers import (
    clear_session,
    device_row,
    make_config,
    publish,
    running_gateway,
    subscribe_session,
    topic,
)

LIMITS = LimitsConfig()
MAX_LEVEL = LIMITS.max_topic_level_length


def _matcher(*templates: TopicTemplate, limits: LimitsConfig = LIMITS) -> TopicMatcher:
    return TopicMatcher(list(templates) or [TopicTemplate()], limits)


def _reject(matcher: TopicMatcher, topic: str) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        matcher.match(topic)
    assert info.value.reason == "topic"
    assert info.value.detail
    assert str(info.value) == f"topic: {info.value.detail}"
    return info.value


SITE = TopicTemplate(template="site/{device_id}/events", tenant="site-a")


def test_default_template_subscription() -> None:
    assert _matcher().subscriptions == ["tenants/+/devices/+/events"]


def test_default_template_match() -> None:
    matcher = _matcher()
    assert matcher.match("tenants/acme/devices/dev-001/events") == ("acme", "dev-001")
    assert matcher.match("tenants/Ünïcode-ten/devices/dév 1/events") == ("Ünïcode-ten", "dév 1")


def test_fixed_tenant_template() -> None:
    matcher = _matcher(SITE)
    assert matcher.subscriptions == ["site/+/events"]
    assert matcher.match("site/pump-7/events") == ("site-a", "pump-7")
    _reject(matcher, "tenants/acme/devices/pump-7/events")


def test_several_templates_subscriptions_and_matching() -> None:
    matcher = _matcher(TopicTemplate(), SITE, TopicTemplate(template="{_}/x/{tenant}/{device_id}"))
    assert matcher.subscriptions == ["tenants/+/devices/+/events", "site/+/events", "+/x/+/+"]
    assert matcher.match("tenants/acme/devices/d1/events") == ("acme", "d1")
    assert matcher.match("site/d2/events") == ("site-a", "d2")
    assert matcher.match("anything/x/beta/d3") == ("beta", "d3")


def test_first_matching_template_wins() -> None:
    catch_all = TopicTemplate(template="{_}/{device_id}/events", tenant="first")
    specific = TopicTemplate(template="site/{device_id}/events", tenant="second")
    assert _matcher(catch_all, specific).match("site/d1/events") == ("first", "d1")
    assert _matcher(specific, catch_all).match("site/d1/events") == ("second", "d1")
    assert _matcher(specific, catch_all).match("other/d1/events") == ("first", "d1")


def test_a_shard_of_tenants() -> None:
    shard = TopicTemplate(tenants=["acme", "globex"])
    matcher = _matcher(shard)
    assert matcher.subscriptions == [
        "tenants/acme/devices/+/events",
        "tenants/globex/devices/+/events",
    ]
    assert matcher.match("tenants/globex/devices/d1/events") == ("globex", "d1")
    assert _reject(matcher, "tenants/initech/devices/d1/events").detail == (
        "topic 'tenants/initech/devices/d1/events' matches no configured template"
    )
    assert matcher.tenant_of("tenants/initech/devices/d1/events") == ""
    assert matcher.tenant_of("tenants/acme/devices//events") == "acme"


def test_a_shard_leaves_other_tenants_to_later_templates() -> None:
    # The first template that matches wins; a listed template does not match
    # another tenant, so a later template may take it.
    shard = TopicTemplate(template="{tenant}/{device_id}", tenants=["acme"])
    rest = TopicTemplate(template="{_}/{device_id}", tenant="others")
    matcher = _matcher(shard, rest)
    # "+/+" covers "acme/+": subscribed to both, Mosquitto delivers each acme
    # message twice (tests/test_receive.py), so only the wider one is subscribed.
    assert matcher.subscriptions == ["+/+"]
    assert matcher.match("acme/d1") == ("acme", "d1")
    assert matcher.match("initech/d1") == ("others", "d1")


def test_duplicate_and_covered_subscriptions_are_merged() -> None:
    one = TopicTemplate(template="a/{device_id}", tenant="x")
    two = TopicTemplate(template="a/{device_id}", tenant="y")
    three = TopicTemplate(template="{_}/{device_id}", tenant="z")
    assert _matcher(one, two).subscriptions == ["a/+"]
    assert _matcher(one, two, three).subscriptions == ["+/+"]
    # A shard's filters under another template's '+' at the tenant level.
    shard = TopicTemplate(tenants=["acme", "globex"])
    ignored = TopicTemplate(template="tenants/{tenant}/{_}/{device_id}/events")
    assert _matcher(shard, ignored).subscriptions == ["tenants/+/+/+/events"]
    assert _matcher(shard, TopicTemplate()).subscriptions == ["tenants/+/devices/+/events"]


def test_templates_that_overlap_without_one_covering_the_other_are_refused() -> None:
    """Neither filter can be left out, and the broker would deliver a message
    matching both twice: the config says which two, and a topic both match."""
    with pytest.raises(
        ValueError,
        match=r"topics\.1 \(a/acme/\+/\+\) and topics\.0 "
        r"\(a/\+/x/\+\) both match topics such as 'a/acme/x/x'",
    ):
        Config(
            topics=[
                TopicTemplate(template="a/{tenant}/x/{device_id}"),
                TopicTemplate(template="a/acme/{_}/{device_id}", tenant="acme"),
            ]
        )
    # Shards of different tenants, or templates of different shapes, share nothing.
    Config(
        topics=[
            TopicTemplate(tenants=["acme"]),
            TopicTemplate(template="tenants/{tenant}/{_}/{device_id}/x", tenants=["acme"]),
        ]
    )
    Config(topics=[TopicTemplate(tenants=["acme"]), TopicTemplate(tenants=["globex"])])


def test_ignored_level() -> None:
    matcher = _matcher(TopicTemplate(template="{_}/{tenant}/{_}/{device_id}"))
    assert matcher.subscriptions == ["+/+/+/+"]
    assert matcher.match("region-1/acme/line-2/d9") == ("acme", "d9")
    # An ignored level is not checked: empty, long or odd values are fine there.
    assert matcher.match("/acme/" + "x" * (MAX_LEVEL + 50) + "/d9") == ("acme", "d9")


@pytest.mark.parametrize(
    "topic",
    [
        "other/acme/devices/d1/events",
        "tenants/acme/device/d1/events",
        "tenants/acme/devices/d1/event",
        "Tenants/acme/devices/d1/events",
    ],
)
def test_no_template_matches(topic: str) -> None:
    error = _reject(_matcher(), topic)
    assert repr(topic) in error.detail
    assert "matches no configured template" in error.detail


@pytest.mark.parametrize(
    "topic",
    [
        "tenants/acme/devices/d1",
        "tenants/acme/devices/d1/events/extra",
        "tenants/acme/devices/d1/events/",
        "/tenants/acme/devices/d1/events",
        "",
        "tenants",
    ],
)
def test_wrong_number_of_levels(topic: str) -> None:
    assert "matches no configured template" in _reject(_matcher(), topic).detail


def test_empty_device_level() -> None:
    error = _reject(_matcher(), "tenants/a/devices//events")
    assert "empty device_id level" in error.detail
    assert "'tenants/a/devices//events'" in error.detail


@pytest.mark.parametrize(
    ("topic", "level"),
    [("tenants/acme/devices/./events", "device_id"), ("tenants/../devices/d1/events", "tenant")],
)
def test_levels_no_url_can_name_are_refused(topic: str, level: str) -> None:
    """A device "." was stored, but its page asked for /devices/ and its
    history for another route: browsers drop "." and ".." path segments,
    encoded or not (read-side probe)."""
    error = _reject(_matcher(), topic)
    assert f"{level} level" in error.detail
    assert "URL" in error.detail


def test_empty_tenant_level() -> None:
    assert "empty tenant level" in _reject(_matcher(), "tenants//devices/d1/events").detail


def test_oversized_levels() -> None:
    matcher = _matcher()
    ok = "d" * MAX_LEVEL
    assert matcher.match(f"tenants/acme/devices/{ok}/events") == ("acme", ok)
    assert matcher.match(f"tenants/{ok}/devices/d1/events") == (ok, "d1")

    long = "d" * (MAX_LEVEL + 1)
    error = _reject(matcher, f"tenants/acme/devices/{long}/events")
    assert "device_id level" in error.detail
    assert f"{MAX_LEVEL + 1} characters" in error.detail
    assert f"limit of {MAX_LEVEL}" in error.detail
    assert "limits.max_topic_level_length" in error.detail
    assert long not in error.detail  # the detail stays short

    error = _reject(matcher, f"tenants/{long}/devices/d1/events")
    assert "tenant level" in error.detail
    assert "limits.max_topic_level_length" in error.detail


def test_level_limit_counts_characters_and_is_configurable() -> None:
    matcher = _matcher(limits=LimitsConfig(max_topic_level_length=4))
    assert matcher.match("tenants/ab/devices/éééé/events") == ("ab", "éééé")
    assert "limit of 4" in _reject(matcher, "tenants/ab/devices/abcde/events").detail


@pytest.mark.parametrize(
    "char", ["\x00", "\x01", "\n", "\t", "\x1b", "\x1f", "\x7f", "\x85", "\x9f"]
)
def test_control_characters_in_device_id(char: str) -> None:
    error = _reject(_matcher(), f"tenants/acme/devices/dev{char}1/events")
    assert "device_id level" in error.detail
    assert "control characters" in error.detail


def test_control_characters_in_tenant() -> None:
    error = _reject(_matcher(), "tenants/ac\x00me/devices/d1/events")
    assert "tenant level" in error.detail
    assert "control characters" in error.detail


@pytest.mark.parametrize("char", [" ", "\xa0", "é", "😀", "~", "\u200d"])
def test_printable_and_unicode_characters_allowed(char: str) -> None:
    topic = f"tenants/acme/devices/dev{char}1/events"
    assert _matcher().match(topic) == ("acme", f"dev{char}1")


@pytest.mark.parametrize(
    ("level", "code"),
    [
        ("d\u200b1", "U+200B"),
        ("d\u20281", "U+2028"),
        ("\ufeffd1", "U+FEFF"),
        ("d\u31641", "U+3164"),
    ],
)
def test_invisible_characters_in_ids_are_refused(level: str, code: str) -> None:
    """ "d\u200b1" was stored as a device of its own, shown exactly as "d1"
    (probe); states refused these already."""
    error = _reject(_matcher(), f"tenants/acme/devices/{level}/events")
    assert f"device_id level {level!r} holds {code}, an invisible character" in error.detail
    error = _reject(_matcher(), f"tenants/{level}/devices/d1/events")
    assert f"tenant level {level!r} holds {code}" in error.detail


@pytest.mark.parametrize("level", ["d1 ", " d1", "d1\xa0", "\u3000d1"])
def test_ids_with_whitespace_at_an_end_are_refused(level: str) -> None:
    error = _reject(_matcher(), f"tenants/acme/devices/{level}/events")
    assert (
        f"device_id level {level!r} starts or ends with whitespace, so the page and the CLI "
        "could not tell it from 'd1'"
    ) in error.detail


@pytest.mark.parametrize("level", [" ", "\xa0\u3000"])
def test_ids_of_whitespace_alone_are_told_so(level: str) -> None:
    """It was told "could not tell it from ''"."""
    error = _reject(_matcher(), f"tenants/acme/devices/{level}/events")
    assert error.detail == f"device_id level {level!r} is only whitespace"


def test_tenant_of_best_effort() -> None:
    matcher = _matcher(TopicTemplate(), SITE)
    assert matcher.tenant_of("tenants/acme/devices/d1/events") == "acme"
    # The device level is bad, but the tenant is still known.
    assert matcher.tenant_of("tenants/acme/devices//events") == "acme"
    assert matcher.tenant_of("tenants/acme/devices/d\x00/events") == "acme"
    # Fixed-tenant template with the right shape.
    assert matcher.tenant_of("site//events") == "site-a"
    # A bad tenant level is not reported.
    assert matcher.tenant_of("tenants//devices/d1/events") == ""
    assert matcher.tenant_of("tenants/a\x07b/devices/d1/events") == ""
    assert matcher.tenant_of("tenants/" + "t" * (MAX_LEVEL + 1) + "/devices/d1/events") == ""
    # Nothing of the right shape.
    assert matcher.tenant_of("a/b") == ""
    assert matcher.tenant_of("") == ""


def test_tenant_of_without_fixed_tenant_template() -> None:
    assert _matcher().tenant_of("x/acme/y/d1/z") == "acme"
    assert _matcher().tenant_of("site/d1/events") == ""


async def test_a_subscription_left_by_an_earlier_config_is_said(
    keyspace: str, tenant: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker keeps a persistent session's subscriptions: narrowing
    `topics` (a shard of tenants) left the earlier, wider filter in place,
    so other tenants' messages kept arriving, each rejected, and this
    shard's arrived twice (read-side probe). The gateway cannot list a
    session's subscriptions (MQTT has no such request); it now says when a
    message matches none of its own filters, and what to do."""
    caplog.set_level(logging.WARNING, logger="gateway")
    client_id = f"narrow-{tenant}"
    try:
        # An earlier config's session, as `gateway run` with the default
        # template left it.
        await subscribe_session(client_id, "tenants/+/devices/+/events")
        narrow = make_config(
            GATEWAY_MQTT__CLIENT_ID=client_id,
            GATEWAY_TOPICS=f'[{{template = "{DEFAULT_TEMPLATE}", tenants = ["{tenant}"]}}]',
        )
        async with running_gateway(narrow) as gw:
            await publish([(topic(f"o{tenant}", "d1"), b'{"state": "on"}')])
            await gw.wait_for(lambda s: s.stale_subscription >= 1)
    finally:
        await clear_session(client_id)
    said = [r.getMessage() for r in caplog.records if "matches none of" in r.getMessage()]
    assert len(said) == 1, said
    assert "gateway forget-session" in said[0]


async def test_a_tenant_moved_off_an_instance_loses_nothing_its_session_held(
    db: Database, tenant: str
) -> None:
    """README's recipe for moving a tenant between shards: stop both, edit
    both lists, start both. The old owner's session held what was published
    meanwhile (its old subscription), and the old owner, no longer listing
    the tenant, rejected it ("matches no configured template"), filed under
    no tenant: the device's newest state was lost (instances probe: 3 of 3).
    A message of a template's shape whose tenant is not listed can only come
    from such a subscription: it is written (writes are idempotent)."""
    client_id = f"moved-{tenant}"
    try:
        # The old owner's session, as its list [tenant] left it.
        await subscribe_session(client_id, f"tenants/{tenant}/devices/+/events")
        ts = int(time.time() * 1000)
        await publish([(topic(tenant, "d1"), orjson.dumps({"ts": ts, "state": "off"}))])
        now_owns = f'[{{template = "{DEFAULT_TEMPLATE}", tenants = ["o{tenant}"]}}]'
        config = make_config(GATEWAY_MQTT__CLIENT_ID=client_id, GATEWAY_TOPICS=now_owns)
        async with running_gateway(config) as gw:
            await gw.wait_for(lambda s: s.written + s.rejected >= 1)
            assert (gw.stats.written, gw.stats.rejected, gw.stats.stale_subscription) == (1, 0, 1)
    finally:
        await clear_session(client_id)
    assert (await device_row(db, tenant, "d1")).state == "off"


@pytest.mark.parametrize(
    ("override", "subscribed", "meets_it"),
    [
        ("#", "a/+/b", True),
        ("a/#", "a/+/b", True),
        ("a/x/#", "a/+/b", True),
        ("a/x/b/#", "a/+/b", True),  # '#' matches its parent level too
        ("a/x/b/c/#", "a/+/b", False),
        ("b/#", "a/+/b", False),
        ("+/+/+", "a/+/b", True),
        ("+/+", "a/+/b", False),
        ("a/+/c", "a/+/b", False),
        ("a/x/b", "a/+/b", True),
        ("+/#", "$dev/+/b", False),  # a wildcard first level never matches a $ topic
        ("$dev/#", "$dev/+/b", True),
    ],
)
def test_an_override_filter_meets_a_subscription(
    override: str, subscribed: str, meets_it: bool
) -> None:
    """What config's check of sampling.overrides asks: can any topic match both?"""
    assert meets(filter_levels(override), tuple(subscribed.split("/"))) is meets_it
