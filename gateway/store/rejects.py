"""Bad messages become rows of ``rejected_messages``, never exceptions.

Each rejection keeps the tenant (when the topic gave one), the topic, the
reason code and sentence, the receive time and the payload truncated to
``limits.rejected_payload_bytes``. It is counted by reason and logged at most
``pipeline.reject_log_per_s`` times a second, so a flood of garbage cannot
flood the log. Once its row is written the message is acknowledged like any
other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..config import Config
from ..identity import rejection_id
from ..stats import Stats
from .sink import Pending, Write
from .write_session import UNSET, Prepared, WriteSession

log = logging.getLogger(__name__)

HOUR_MS = 3_600_000


@dataclass(slots=True)
class Rejection:
    tenant: str
    device_id: str | None
    topic: str
    reason: str
    detail: str
    payload: bytes
    received_ms: int


class Rejects:
    _insert: Prepared

    def __init__(self, config: Config, stats: Stats) -> None:
        self._stats = stats
        self._keep = config.limits.rejected_payload_bytes
        self._rate = config.pipeline.reject_log_per_s
        # The bucket holds at least one line's token: under 1/s (0.2: one line
        # per 5 s) it held under one, and nothing was ever logged. 0: none.
        self._burst = max(1.0, self._rate) if self._rate > 0 else 0.0
        self._tokens = self._burst
        self._last = time.monotonic()
        self._suppressed = 0

    async def prepare(self, session: WriteSession) -> None:
        self._insert = await session.prepare(
            "INSERT INTO {keyspace}.rejected_messages "
            "(tenant, hour_start, received_at, id, topic, device_id, reason, detail, payload, "
            "payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            timestamps=(1, 2),
        )

    def writes(self, rejection: Rejection, pending: Pending) -> list[Write]:
        self._stats.rejected += 1
        self._stats.rejected_by_reason[rejection.reason] += 1
        self._log(rejection)
        hour = rejection.received_ms - rejection.received_ms % HOUR_MS
        return [
            Write(
                ("rejected", rejection.tenant, hour),
                self._insert,
                (
                    rejection.tenant,
                    hour,
                    rejection.received_ms,
                    rejection_id(rejection.received_ms, rejection.topic, rejection.payload),
                    rejection.topic,
                    rejection.device_id if rejection.device_id is not None else UNSET,
                    rejection.reason,
                    rejection.detail,
                    rejection.payload[: self._keep],
                    len(rejection.payload),
                ),
                pending,
            )
        ]

    def _log(self, rejection: Rejection) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1:
            self._suppressed += 1
            return
        self._tokens -= 1
        more = f" ({self._suppressed} more not logged)" if self._suppressed else ""
        self._suppressed = 0
        log.warning(
            "rejected message on %r: %s: %s%s",
            rejection.topic,
            rejection.reason,
            rejection.detail,
            more,
        )
