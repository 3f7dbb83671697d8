"""The event: what decode hands to the table writers (a leaf both import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Event:
    """One validated device event, ready for the writers."""

    tenant: str
    device_id: str
    ts_ms: int
    state: str | None
    value_text: str | None
    value_num: float | None
    metrics: dict[str, float]
    tags: dict[str, str]
    received_ms: int
    ts_from_receive: bool
    sent_at_ms: float | None
    event_id: int
    write_ts: int
    # No ts, and the broker says it may have sent it before (MQTT DUP): its
    # receive-time stamp says nothing of its age (gateway/store/latest.py).
    untimed_redelivery: bool = False
    # ... sent again because it was not acknowledged (DUP, not a retained
    # copy): newer than what was acknowledged before it.
    untimed_resent: bool = False
