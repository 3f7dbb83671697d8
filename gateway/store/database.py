"""The Cassandra session, owned by an async context manager.

``connect(config)`` yields a :class:`Database`: the driver session plus
``execute()``, which bridges the driver's callback futures into asyncio (the
callbacks run on the driver's IO thread, so they only hand the result over
with ``call_soon_threadsafe``). Connecting and shutting down block on sockets
and run in an executor, never on the event loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, Session
from cassandra.policies import (
    DCAwareRoundRobinPolicy,
    ExponentialReconnectionPolicy,
    TokenAwarePolicy,
)
from cassandra.query import PreparedStatement, Statement, dict_factory

from cassandra import ConsistencyLevel, Unavailable, UnresolvableContactPoints

from ..config import CassandraConfig
from ..errors import CassandraUnreachable, ConfigError, SinkError

log = logging.getLogger(__name__)

# Execution profile whose rows are dicts keyed by column name (the write session's).
DICT_ROWS = "dict_rows"


class Database:
    """A connected session and the helpers every stage uses."""

    def __init__(self, cluster: Cluster, session: Session, config: CassandraConfig) -> None:
        self.cluster = cluster
        self.session = session
        self.config = config
        self.keyspace = config.keyspace
        self._loop = asyncio.get_running_loop()
        self._prepared: dict[str, PreparedStatement] = {}

    def prepare(self, cql: str) -> PreparedStatement:
        # Blocks on the network: call it from an executor thread (start-up only).
        return self.session.prepare(cql.replace("{keyspace}", self.keyspace))

    async def prepared(self, cql: str) -> PreparedStatement:
        """``cql`` prepared once per connection (the read side's hot queries);
        the set of statements is fixed by the code, so the cache is bounded."""
        found = self._prepared.get(cql)
        if found is None:
            found = await self._loop.run_in_executor(None, self.prepare, cql)
            self._prepared[cql] = found
        return found

    def execute(
        self,
        statement: Statement | str,
        params: Sequence[Any] | None = None,
        *,
        profile: object = EXEC_PROFILE_DEFAULT,
    ) -> asyncio.Future[Any]:
        """Send a statement; the returned future resolves to all its rows."""
        return self._send(statement, params, profile, timed=False)

    def replicas(self, statement: Any) -> Hashable:
        """What a bound statement's partition may share a batch by: the nodes
        that hold it, from the driver's token map (the token-aware policy's own
        lookup; empty without one, where the policy cannot route either)."""
        key = statement.routing_key
        if key is None:
            return id(statement)  # unknown: a batch of its own
        return frozenset(self.cluster.metadata.get_replicas(self.keyspace, key))

    def execute_timed(
        self, statement: Statement, *, profile: object = EXEC_PROFILE_DEFAULT
    ) -> asyncio.Future[tuple[Any, float]]:
        """:meth:`execute`, resolving to (rows, when the driver's thread got
        the answer, in ``time.monotonic()``): a latency that leaves out how
        long the event loop took to get to it."""
        return self._send(statement, None, profile, timed=True)

    def _send(
        self, statement: Statement | str, params: Sequence[Any] | None, profile: object, timed: bool
    ) -> asyncio.Future[Any]:
        loop = self._loop
        future: asyncio.Future[Any] = loop.create_future()
        response = self.session.execute_async(statement, params, execution_profile=profile)

        def on_rows(rows: Any) -> None:
            if response.has_more_pages:
                # Rare here (small reads); fetching the next page is async too.
                collected.extend(rows)
                response.start_fetching_next_page()
                return
            collected.extend(rows or ())
            result = (collected, time.monotonic()) if timed else collected
            loop.call_soon_threadsafe(_resolve, future, result)

        def on_error(exc: BaseException) -> None:
            loop.call_soon_threadsafe(_fail, future, exc)

        collected: list[Any] = []
        response.add_callbacks(on_rows, on_error)
        return future


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def cannot_connect(config: CassandraConfig, exc: BaseException) -> CassandraUnreachable:
    """The error of a failed connect, naming every contact point (both drivers)."""
    where = ", ".join(f"{h}:{config.port}" for h in config.contact_points)
    return CassandraUnreachable(f"cannot connect to Cassandra at {where}: {_reason(exc)}")


# What the drivers wrap the cause of a failed connect in, to unwrap for one short line:
# cassandra-driver's "Tried connecting to [...]. Last error: Connection refused",
# acsylla's "No hosts available: Underlying connection error: Connect error 'connection refused'".
_LAST_ERROR = re.compile(r"Last error: (.+)$|Connect error '(.+)'$")


def _reason(exc: BaseException) -> str:
    """The cause of a failed connect, short when the drivers' wrapping is known."""
    errors = getattr(exc, "errors", None)  # NoHostAvailable: {host: error}
    causes = list(errors.values()) if isinstance(errors, dict) and errors else [exc]
    text = str(causes[0])
    found = _LAST_ERROR.search(text)
    if found is None:
        return text
    reason = found.group(1) or found.group(2)
    return reason[:1].lower() + reason[1:]


# The server's own words in a cassandra-driver error ('Error from server:
# code=1000 [Unavailable exception] message="Cannot achieve ..." info={...}').
_SERVER_MESSAGE = re.compile(r'message="([^"]*)"')


def unanswered(exc: BaseException) -> str:
    """Why Cassandra could not answer a request (one of
    ``write_session.unavailable_errors()``),
    in one line: the replicas up against those needed when it says so (a
    node or two down), else the driver's reason and its type."""
    errors = getattr(exc, "errors", None)  # NoHostAvailable: {host: error}
    cause = next(iter(errors.values())) if isinstance(errors, dict) and errors else exc
    if isinstance(cause, Unavailable) and cause.required_replicas is not None:
        level = ConsistencyLevel.value_to_name.get(cause.consistency, str(cause.consistency))
        return (
            f"at {level}, {cause.alive_replicas} of the {cause.required_replicas} replicas "
            "it needs are up (nodes down?)"
        )
    text = str(cause)
    found = _SERVER_MESSAGE.search(text)
    reason = found.group(1) if found else text
    return f"{reason} ({type(cause).__name__})" if reason else type(cause).__name__


def build_cluster(config: CassandraConfig, ssl_context: ssl.SSLContext | None = None) -> Cluster:
    # Without local_dc the driver takes the datacentre of the contact point it
    # first connects to as local (RoundRobinPolicy sent requests to every
    # datacentre, where LOCAL_QUORUM is another DC's quorum).
    policy = TokenAwarePolicy(DCAwareRoundRobinPolicy(local_dc=config.local_dc or ""))
    consistency = getattr(ConsistencyLevel, config.consistency)
    profile = ExecutionProfile(
        load_balancing_policy=policy,
        consistency_level=consistency,
        request_timeout=config.request_timeout,
    )
    dict_rows = ExecutionProfile(
        load_balancing_policy=policy,
        consistency_level=consistency,
        request_timeout=config.request_timeout,
        row_factory=dict_factory,
    )
    auth = None
    if config.username is not None:
        password = config.password.get_secret_value() if config.password else ""
        auth = PlainTextAuthProvider(username=config.username, password=password)
    return Cluster(
        contact_points=list(config.contact_points),
        # The driver's default (True) compresses whenever lz4 or snappy happens
        # to be installed; only cassandra.compression decides here.
        compression=_compression(config),
        port=config.port,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile, DICT_ROWS: dict_rows},
        auth_provider=auth,
        ssl_context=ssl_context,
        connect_timeout=config.connect_timeout,
        # The driver's default waits up to 10 minutes between reconnection
        # attempts; an edge link that comes back should be used within seconds.
        reconnection_policy=ExponentialReconnectionPolicy(base_delay=0.5, max_delay=10.0),
        control_connection_timeout=config.connect_timeout,
        # One connection per host carries thousands of concurrent requests
        # (protocol v4+); more would only cost memory on a small edge host.
        protocol_version=4,
    )


def _compression(config: CassandraConfig) -> str | bool:
    if config.compression == "none":
        return False
    # The driver compresses with the lz4 package, an optional dependency.
    if importlib.util.find_spec("lz4") is None:
        raise ConfigError(
            f'cassandra.compression = "{config.compression}" needs the lz4 package '
            '(pip install lz4), or set it to "none"'
        )
    return config.compression


@asynccontextmanager
async def connect(config: CassandraConfig, *, keyspace: bool = True) -> AsyncIterator[Database]:
    """Connect (in an executor) and always shut the cluster down on exit."""
    loop = asyncio.get_running_loop()
    try:
        cluster = build_cluster(config, config.tls.context())
    except UnresolvableContactPoints:
        # No contact point resolves (DNS down with the link, or a typo).
        raise cannot_connect(config, OSError("no contact point resolves to an address")) from None
    try:
        session = await loop.run_in_executor(None, cluster.connect)
    except Exception as exc:
        await loop.run_in_executor(None, cluster.shutdown)
        raise cannot_connect(config, exc) from None
    try:
        if keyspace:
            try:
                await loop.run_in_executor(None, session.set_keyspace, config.keyspace)
            except Exception:
                raise SinkError(
                    f"keyspace {config.keyspace!r} does not exist: run `gateway schema apply`"
                ) from None
        yield Database(cluster, session, config)
    finally:
        await loop.run_in_executor(None, cluster.shutdown)
