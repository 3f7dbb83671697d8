"""The event: what decode hands to the table writers (a leaf both import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, init=False)
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

    # Written out, not generated: the dataclass's own __init__ is interpreted
    # Python even in the compiled module, and an event is built per message.
    def __init__(
        self,
        tenant: str,
        device_id: str,
        ts_ms: int,
        state: str | None,
        value_text: str | None,
        value_num: float | None,
        metrics: dict[str, float],
        tags: dict[str, str],
        received_ms: int,
        ts_from_receive: bool,
        sent_at_ms: float | None,
        event_id: int,
        write_ts: int,
        untimed_redelivery: bool = False,
        untimed_resent: bool = False,
    ) -> None:
        self.tenant = tenant
        self.device_id = device_id
        self.ts_ms = ts_ms
        self.state = state
        self.value_text = value_text
        self.value_num = value_num
        self.metrics = metrics
        self.tags = tags
        self.received_ms = received_ms
        self.ts_from_receive = ts_from_receive
        self.sent_at_ms = sent_at_ms
        self.event_id = event_id
        self.write_ts = write_ts
        self.untimed_redelivery = untimed_redelivery
        self.untimed_resent = untimed_resent
