"""The gateway's small error tree.

Foreign errors (driver, paho, pydantic, OS) are converted at module boundaries
with ``raise ... from``. A bad *message* is not an exception that escapes a loop:
it becomes a :class:`Rejection` (see ``decode``) and is recorded as data.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class ConfigError(GatewayError):
    """The configuration is invalid; the message names the offending key."""


class DecodeError(GatewayError):
    """A payload or topic could not be turned into an event.

    ``reason`` is a short machine-friendly code (``invalid_json``, ``topic``,
    ``too_large`` ...) and ``detail`` a human sentence; both are stored in
    ``rejected_messages``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class SinkError(GatewayError):
    """Cassandra refused a write in a way retrying cannot fix, or gave up."""


class WritesFailing(SinkError):
    """Cassandra writes kept failing for ``cassandra.give_up_after``. In spool
    mode ``gateway run`` closes the gateway and spools until Cassandra answers
    again (gateway/spooling.py); without the spool it stops. ``since``: when
    they began to fail (time.time())."""

    def __init__(self, message: str, since: float) -> None:
        super().__init__(message)
        self.since = since


class CassandraUnreachable(SinkError):
    """No connection to Cassandra could be opened (address, link or credentials).
    In spool mode ``gateway run`` spools and keeps trying instead (gateway/spooling.py)."""


class SpoolError(GatewayError):
    """The on-disk spool failed (the message names its path)."""


class SpoolDiskFull(SpoolError):
    """A spool commit failed because the disk is full (SQLITE_FULL): nothing of
    it was committed. The spool source retries; nothing is acknowledged meanwhile."""


class SchemaError(GatewayError):
    """The schema could not be applied, or is missing."""


class SchemaMissing(SchemaError):
    """The keyspace, or tables of it, are not there (`gateway schema apply`
    makes them): in spool mode the gateway spools on until they are. A table
    of an older layout (a column missing) is a plain :class:`SchemaError`:
    the next open would fail the same way, so it is not waited for."""


class QueryError(GatewayError):
    """A read that cannot be answered: Cassandra refused it (the message says
    why and what to change), or a parameter is bad (``parameter`` names it)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class BrokerError(GatewayError):
    """The MQTT broker could not be reached or refused us."""
