"""Topic templates: which MQTT subscriptions to make, and who sent a message.

A template such as ``tenants/{tenant}/devices/{device_id}/events`` becomes one
QoS 1 subscription (``tenants/+/devices/+/events``); for each message the
named levels are read back from its topic. ``{_}`` matches any level and is
ignored. A template without ``{tenant}`` has a fixed tenant from the config.
A template with a ``tenants`` list becomes one subscription per listed tenant
(``tenants/acme/devices/+/events``) and matches only those: an instance's shard.

Promises: a topic that matches no template, or whose tenant or device level is
empty, too long, or holds control characters, raises ``DecodeError("topic", ...)``
with a sentence saying which. The first matching template wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LimitsConfig, TopicTemplate
from ..errors import DecodeError
from ..topic_filters import NO_URL_NAMES, NO_URL_REASON, covers, has_control, unseen_char

_NAMED = {"{tenant}": "tenant", "{device_id}": "device_id", "{_}": "_"}


@dataclass(frozen=True, slots=True)
class _Compiled:
    levels: tuple[str | None, ...]  # fixed word, or None for a named level
    tenant_index: int | None
    device_index: int
    fixed_tenant: str | None
    only_tenants: frozenset[str] | None  # the template's tenants list, if any
    subscriptions: tuple[str, ...]
    fixed: tuple[tuple[int, str], ...]  # (index, word) of each fixed level

    def fits(self, parts: list[str]) -> bool:
        """Whether a topic's levels (as many as the template's) have its fixed words."""
        for index, word in self.fixed:  # noqa: SIM110 - no generator per message
            if parts[index] != word:
                return False
        return True


def _compile(template: TopicTemplate) -> _Compiled:
    parts = template.template.split("/")
    levels = tuple(None if part in _NAMED else part for part in parts)
    tenant_index = parts.index("{tenant}") if "{tenant}" in parts else None
    return _Compiled(
        levels=levels,
        tenant_index=tenant_index,
        device_index=parts.index("{device_id}"),
        fixed_tenant=template.tenant,
        only_tenants=frozenset(template.tenants) if template.tenants else None,
        subscriptions=tuple(template.filters()),
        fixed=tuple((i, level) for i, level in enumerate(levels) if level is not None),
    )


class TopicMatcher:
    """Maps message topics to (tenant, device_id) using the configured templates."""

    def __init__(self, templates: list[TopicTemplate], limits: LimitsConfig) -> None:
        self._templates = [_compile(t) for t in templates]
        self._max_level = limits.max_topic_level_length

    @property
    def subscriptions(self) -> list[str]:
        """The templates' filters, each once, leaving out any that another
        covers (``a/x/+`` under ``a/+/+``): the broker would deliver a message
        once per matching subscription. Templates that overlap otherwise are
        refused by the config."""
        kept: list[str] = []
        for n, template in enumerate(self._templates):
            # One template's filters differ in a fixed tenant: only another's can cover them.
            others = [
                tuple(f.split("/"))
                for m, t in enumerate(self._templates)
                if m != n and len(t.levels) == len(template.levels)
                for f in t.subscriptions
            ]
            for f in template.subscriptions:
                mine = tuple(f.split("/"))
                if not any(o != mine and covers(o, mine) for o in others):
                    kept.append(f)
        return list(dict.fromkeys(kept))

    def match(self, topic: str) -> tuple[str, str]:
        """Return (tenant, device_id) for a topic, or raise DecodeError('topic')."""
        parts = topic.split("/")
        for tpl in self._templates:
            if len(parts) != len(tpl.levels):
                continue
            if not tpl.fits(parts):
                continue
            if tpl.tenant_index is None:
                assert tpl.fixed_tenant is not None  # guaranteed by TopicTemplate
                tenant = tpl.fixed_tenant
            else:
                tenant = parts[tpl.tenant_index]
                if tpl.only_tenants is not None and tenant not in tpl.only_tenants:
                    continue  # not this template's tenants: another template may take it
            device = parts[tpl.device_index]
            self._check_level("device_id", device, topic)
            if tpl.tenant_index is not None:
                self._check_level("tenant", tenant, topic)
            return tenant, device
        raise DecodeError("topic", f"topic {topic!r} matches no configured template")

    def unlisted(self, topic: str) -> tuple[str, str] | None:
        """(tenant, device_id) for a topic of a template's shape whose tenant
        that template does not list, else None. Such a message comes from a
        subscription an earlier config left in the broker session (a tenant
        moved to another shard): the caller writes it rather than lose it."""
        parts = topic.split("/")
        for tpl in self._templates:
            if (
                tpl.only_tenants is None
                or tpl.tenant_index is None
                or len(parts) != len(tpl.levels)
                or not tpl.fits(parts)
            ):
                continue
            tenant, device = parts[tpl.tenant_index], parts[tpl.device_index]
            self._check_level("device_id", device, topic)
            self._check_level("tenant", tenant, topic)
            return tenant, device
        return None

    def tenant_of(self, topic: str) -> str:
        """Best-effort tenant for a topic that failed to match fully ('' if none)."""
        parts = topic.split("/")
        for tpl in self._templates:
            if len(parts) != len(tpl.levels):
                continue
            if tpl.tenant_index is None:
                return tpl.fixed_tenant or ""
            tenant = parts[tpl.tenant_index]
            if tpl.only_tenants is not None and tenant not in tpl.only_tenants:
                continue
            if tenant and len(tenant) <= self._max_level and not has_control(tenant):
                return tenant
        return ""

    def _check_level(self, name: str, value: str, topic: str) -> None:
        if not value:
            raise DecodeError("topic", f"topic {topic!r} has an empty {name} level")
        if len(value) > self._max_level:
            raise DecodeError(
                "topic",
                f"{name} level of {len(value)} characters is over the limit of "
                f"{self._max_level} (limits.max_topic_level_length)",
            )
        # As a state's (decode.state_problem): "d\u200b1" looked exactly like
        # "d1" on the page and in the CLI and was another device, and so was
        # "d1 " (a state's edge whitespace is dropped; an id is not changed).
        # One scan finds controls and invisible characters alike.
        unseen = unseen_char(value)
        if unseen is not None:
            if has_control(unseen):
                raise DecodeError("topic", f"{name} level {value!r} holds control characters")
            raise DecodeError(
                "topic",
                f"{name} level {value!r} holds U+{ord(unseen):04X}, an invisible character, "
                "so the page and the CLI could not tell it from another",
            )
        if value[0].isspace() or value[-1].isspace():
            if value.isspace():  # not on every message: only past the edge test
                raise DecodeError("topic", f"{name} level {value!r} is only whitespace")
            raise DecodeError(
                "topic",
                f"{name} level {value!r} starts or ends with whitespace, so the page and "
                f"the CLI could not tell it from {value.strip()!r}",
            )
        if value in NO_URL_NAMES:
            raise DecodeError("topic", f"{name} level {value!r}: {NO_URL_REASON}")
