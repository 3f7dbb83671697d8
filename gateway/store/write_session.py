"""The connection the sink writes through: prepare, bind, batch, execute.

Two drivers sit behind one small interface, chosen by ``cassandra.driver``:

* ``acsylla``: asyncio over the DataStax C++ driver. It costs about a quarter
  of the CPU per request of the Python driver (``bench/drivers.py``); with
  both drivers' requests packed (below), the gateway spends about 1.45x the
  CPU per message through the Python driver (``bench/results/acsylla_packing.md``). Wheels exist for
  Linux x86_64 (and macOS); it is installed there with the gateway.
* ``python``: the DataStax Python driver (``cassandra-driver``), available on
  every platform. The CLI's reads and ``schema apply`` always use it.
* ``auto`` (the default): acsylla when it is installed, Cassandra TLS is
  off and ``cassandra.compression`` is ``none``, else python (the C++ driver
  offers no protocol compression). The C++ driver cannot use the system's CA store, so TLS
  through acsylla needs ``cassandra.tls.ca_file`` and ``driver = "acsylla"``.

What both keep, so the stages don't care which one runs:

* statements are prepared once, with fully qualified table names;
* :data:`UNSET` leaves a parameter unset (no tombstone), ``None`` binds null;
* timestamp parameters are epoch milliseconds (``Prepared.timestamps`` names
  them; acsylla wants seconds, converted here so that every millisecond
  survives exactly);
* ``USING TIMESTAMP`` and TTL parameters are plain integers;
* batches are UNLOGGED; writes use client-side (monotonic) timestamps;
* results are lists of dicts keyed by column name (``[applied]`` included).
  :meth:`WriteSession.read` fetches every row of a SELECT READ_PAGE rows at
  a time (the roll-up worker's reads can be large); :meth:`execute` of a
  statement through acsylla sends no page size, so Cassandra answers it in
  one response (the write path's reads are single small partitions);
* :attr:`WriteSession.transient` lists the errors worth retrying (timeouts,
  unavailable replicas, lost connections, overload), the sink's concern.

Partitions per request (:attr:`WriteSession.batch_partitions`): a request
costs the gateway (and Cassandra) more than a row: through the Python driver
several times more (``execute_async``: query plan, timer, encoding, the IO
thread's wake-up and callbacks), through acsylla less but still the sink's
task, the limiter and a callback. So the sink packs up to 10 partitions whose
replicas are the same (:meth:`WriteSession.replicas`) into one UNLOGGED
batch, under :data:`PACK_BYTES` of values (:meth:`WriteSession.size`). The
Python driver knows each partition's replicas from its token map. acsylla has
no token map to ask, so it packs only where the answer is known without one:
when every node holds every partition (one node; or a replication factor of
at least the number of nodes, in every data centre), checked once at start
(:meth:`WriteSession.plan_packing`); otherwise it sends one partition per
request. A node added later while packing only costs a forwarding hop for
the partitions the coordinator does not hold. 10 and the size keep such batches under
Cassandra's default warning thresholds (``unlogged_batch_across_partitions_warn_threshold``
10, ``batch_size_warn_threshold`` 5 KiB) and far under the failure threshold
(50 KiB), which a single-partition batch is exempt from.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
from cassandra.cluster import NoHostAvailable
from cassandra.connection import ConnectionException
from cassandra.protocol import (
    IsBootstrappingErrorMessage,
    OverloadedErrorMessage,
    ServerError,
)
from cassandra.query import UNSET_VALUE, BatchStatement, BatchType

from cassandra import (
    CoordinationFailure,
    InvalidRequest,
    OperationTimedOut,
    ReadTimeout,
    Unavailable,
    WriteTimeout,
)

from ..config import CassandraConfig
from ..errors import ConfigError, SchemaError
from ..repeats import Repeats
from ..stats import Stats
from .database import DICT_ROWS, Database, cannot_connect, connect

log = logging.getLogger(__name__)

# Leave this parameter unset: the column keeps what it had (no tombstone).
UNSET: Any = UNSET_VALUE

Rows = list[dict[str, Any]]

# Bytes of bound values a batch of several partitions may carry. Cassandra
# warns above 5 KiB of mutations, which count more than the values: 3 KiB of
# the bench's rows made 5.01 KiB.
PACK_BYTES = 2 * 1024
# Rows per page of WriteSession.read: the Python driver's default fetch size.
READ_PAGE = 5_000
# Rows the event loop decodes or aggregates between two yields to whatever
# else is ready (MQTT reads, write answers, acknowledgements): a read's page
# (AcsyllaSession.read), and the roll-up worker's rows (rollups.py). Handled
# in one go, a page of READ_PAGE rows held the loop for up to 50 ms, and a
# roll-up group's 26,000 rows up to 120 ms, a dozen times a minute
# (bench/PERFORMANCE.md, "Roll-ups and the event loop").
YIELD_ROWS = 1_000


class Prepared:
    """A prepared statement and which of its parameters are timestamps."""

    __slots__ = ("cql", "native", "timestamps")

    def __init__(self, cql: str, native: Any, timestamps: Sequence[int]) -> None:
        self.cql = cql
        self.native = native
        self.timestamps = frozenset(timestamps)


class WriteSession(ABC):
    """What the sink and the stages need from a Cassandra connection."""

    name: str
    transient: tuple[type[BaseException], ...]
    # Partitions one request may carry (see the module docstring).
    batch_partitions = 1
    # The in-flight limit's floor when cassandra.min_in_flight is unset
    # (store/limit.py): the fewest requests in flight that keep this driver busy.
    in_flight_floor = 64

    def __init__(self, config: CassandraConfig) -> None:
        self.config = config
        self.keyspace = config.keyspace
        # Called when a new driver session has replaced one that gave its
        # host up (AcsyllaSession): requests.py wakes what sleeps in backoff.
        self.renewed: Callable[[], None] = _nothing

    def cql(self, template: str) -> str:
        return template.replace("{keyspace}", self.keyspace)

    @abstractmethod
    async def prepare(self, template: str, timestamps: Sequence[int] = ()) -> Prepared:
        """Prepare ``template`` (``{keyspace}`` is filled in)."""

    def out_of_date(self, exc: BaseException) -> SchemaError:
        """A statement Cassandra refused to prepare: the keyspace lacks a
        table or column of this version (an upgrade without ``schema apply``)."""
        return SchemaError(
            f"keyspace {self.keyspace!r} lacks what this version of the gateway writes "
            f"({exc}): run `gateway schema apply`"
        )

    @abstractmethod
    def bind(self, prepared: Prepared, values: Sequence[Any]) -> Any:
        """A bound statement, ready for :meth:`execute` or :meth:`batch`."""

    @abstractmethod
    def batch(self, statements: Sequence[Any]) -> Any:
        """An UNLOGGED batch of bound statements (the caller keeps it to one partition)."""

    @abstractmethod
    async def execute(self, request: Any) -> Rows:
        """Send a bound statement or batch; its rows as dicts."""

    async def read(self, prepared: Prepared, values: Sequence[Any]) -> Rows:
        """Every row of a SELECT, fetched READ_PAGE rows at a time."""
        return await self.execute(self.bind(prepared, values))

    async def execute_timed(self, request: Any) -> tuple[Rows, float]:
        """:meth:`execute`, and when it was answered (``time.monotonic()``):
        here when the event loop got to the answer; a driver that answers on
        a thread of its own says when that thread did, so that the in-flight
        limit (limit.py) does not read the event loop's busy spells as
        Cassandra queueing."""
        rows = await self.execute(request)
        return rows, time.monotonic()

    def replicas(self, statement: Any) -> Hashable:
        """What a bound statement's partition may share a batch by (when
        :attr:`batch_partitions` > 1): its replicas."""
        return None

    def size(self, statement: Any, values: Sequence[Any]) -> int:
        """Bytes of a bound statement's values (when :attr:`batch_partitions` > 1),
        here estimated from ``values``: text and blobs by length, numbers 8."""
        return value_bytes(values)

    async def plan_packing(self, user: str = "the write path") -> None:  # noqa: B027 - most drivers decide nothing
        """Decide :attr:`batch_partitions` once connected (the keyspace exists);
        ``user`` names the session's user in the log line."""

    @abstractmethod
    async def tables(self) -> set[str] | None:
        """The keyspace's tables, or None when the keyspace does not exist."""


# cassandra-driver's errors worth retrying (WriteSession.transient).
_PYTHON_TRANSIENT: tuple[type[BaseException], ...] = (
    OperationTimedOut,
    WriteTimeout,
    ReadTimeout,
    Unavailable,
    CoordinationFailure,
    NoHostAvailable,
    ConnectionException,
    OverloadedErrorMessage,
    IsBootstrappingErrorMessage,
    ServerError,
    ConnectionError,
)


class PythonSession(WriteSession):
    """The DataStax Python driver (``cassandra-driver``)."""

    name = "python (cassandra-driver)"
    batch_partitions = 10
    # Its IO thread shares the GIL with the event loop, so under load requests
    # queue inside the client: 30-45 ms median latency at 64 in flight against
    # a local Cassandra that answers in 2 ms. The limit cannot tell that queue
    # from the link's and held at 64, which over a 20 ms link cost a quarter of
    # the throughput; 256 kept 0.94-1.09x the local rate at 20-100 ms
    # (bench/results/slow_link_python.md).
    in_flight_floor = 256
    transient = _PYTHON_TRANSIENT

    def __init__(self, db: Database) -> None:
        super().__init__(db.config)
        self._db = db

    async def prepare(self, template: str, timestamps: Sequence[int] = ()) -> Prepared:
        cql = self.cql(template)
        # Session.prepare blocks on the network: never on the event loop.
        try:
            native = await asyncio.get_running_loop().run_in_executor(None, self._db.prepare, cql)
        except InvalidRequest as exc:
            raise self.out_of_date(exc) from None
        return Prepared(cql, native, timestamps)

    def bind(self, prepared: Prepared, values: Sequence[Any]) -> Any:
        # UNSET is the driver's own UNSET_VALUE; millisecond ints bind as timestamps.
        return prepared.native.bind(values)

    def batch(self, statements: Sequence[Any]) -> Any:
        batch = BatchStatement(batch_type=BatchType.UNLOGGED)
        for statement in statements:
            batch.add(statement)
        return batch

    async def execute(self, request: Any) -> Rows:
        rows: Rows = await self._db.execute(request, profile=DICT_ROWS)
        return rows

    async def execute_timed(self, request: Any) -> tuple[Rows, float]:
        rows, answered = await self._db.execute_timed(request, profile=DICT_ROWS)
        return rows, answered

    def replicas(self, statement: Any) -> Hashable:
        return self._db.replicas(statement)

    def size(self, statement: Any, values: Sequence[Any]) -> int:
        return sum(len(v) for v in statement.values if isinstance(v, bytes))

    async def tables(self) -> set[str] | None:
        def read() -> set[str] | None:
            meta = self._db.cluster.metadata.keyspaces.get(self.keyspace)
            return None if meta is None else set(meta.tables)

        return await asyncio.get_running_loop().run_in_executor(None, read)


class AcsyllaSession(WriteSession):
    """acsylla: asyncio over the DataStax C++ driver."""

    name = "acsylla (DataStax C++ driver)"

    def __init__(
        self,
        config: CassandraConfig,
        opened: tuple[Any, Any],
        reopen: Callable[[], Awaitable[tuple[Any, Any]]],
        stats: Stats | None = None,
    ) -> None:
        """``opened``: the driver's cluster and session; ``reopen`` opens
        another such pair (``cassandra.renew_after``); ``stats`` counts the new ones."""
        super().__init__(config)
        from acsylla import (  # noqa: PLC0415 - optional
            create_batch_unlogged,
            create_statement,
            errors,
        )

        self._cluster, self._session = opened
        self._reopen = reopen
        self._stats = stats or Stats()
        self._no_hosts = errors.CassErrorLibNoHostsAvailable
        self._no_host_since: float | None = None  # since when requests find no host
        self._renew_after = config.renew_after
        self._renew_tried = -self._renew_after  # when a new session was last tried
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False
        self._new_batch = create_batch_unlogged
        self._create_statement = create_statement
        self._invalid_query = errors.CassErrorServerInvalidQuery
        self.transient = _acsylla_transient()

    async def prepare(self, template: str, timestamps: Sequence[int] = ()) -> Prepared:
        cql = self.cql(template)
        try:
            native = await self._session.create_prepared(cql, timeout=self.config.request_timeout)
        except self._invalid_query as exc:
            raise self.out_of_date(exc) from None
        return Prepared(cql, native, timestamps)

    def bind(self, prepared: Prepared, values: Sequence[Any]) -> Any:
        listed = list(values)
        for index in prepared.timestamps:
            value = listed[index]
            if value is not None and value is not UNSET:
                listed[index] = _seconds(value)
        first_unset = _first_unset(listed)
        if first_unset < 0:
            return prepared.native.bind(listed)  # about half the CPU of one by one
        # Values up to the first UNSET in one call, then one by one, leaving
        # each UNSET unbound: protocol v4 sends "unset", not null.
        statement = prepared.native.bind()
        if first_unset:
            statement.bind_list(listed[:first_unset])
        for index in range(first_unset + 1, len(listed)):
            value = listed[index]
            if value is not UNSET:
                statement.bind(index, value)
        return statement

    async def read(self, prepared: Prepared, values: Sequence[Any]) -> Rows:
        statement = self.bind(prepared, values)
        statement.set_page_size(READ_PAGE)  # unset, Cassandra sends all in one
        rows: Rows = []
        while True:
            result = await self._answer(self._session.execute(statement))
            for n, row in enumerate(result, 1):
                rows.append(row.as_dict())
                if n % YIELD_ROWS == 0:
                    await asyncio.sleep(0)
            if not result.has_more_pages():
                return rows
            statement.set_page_state(result.page_state())

    def batch(self, statements: Sequence[Any]) -> Any:
        batch = self._new_batch()
        for statement in statements:
            batch.add_statement(statement)
        return batch

    async def execute(self, request: Any) -> Rows:
        if hasattr(request, "add_statement"):
            result = await self._answer(self._session.execute_batch(request))
        else:
            result = await self._answer(self._session.execute(request))
        if not result.column_count():
            return []
        return [row.as_dict() for row in result]

    def replicas(self, statement: Any) -> Hashable:
        return None  # packing only when every node holds every partition

    async def plan_packing(self, user: str = "the write path") -> None:
        dcs = [r["data_center"] for r in await self._query("SELECT data_center FROM system.local")]
        dcs += [
            r["data_center"] for r in await self._query("SELECT data_center FROM system.peers_v2")
        ]
        found = await self._query(
            "SELECT replication FROM system_schema.keyspaces "
            f"WHERE keyspace_name = '{self.keyspace}'"
        )
        replication = dict(found[0]["replication"]) if found else {}
        if every_node_holds_everything(replication, dcs):
            self.batch_partitions = 10
            log.info(
                "Cassandra nodes: %d, each holding every partition of %r: "
                "up to %d partitions per request of %s",
                len(dcs),
                self.keyspace,
                self.batch_partitions,
                user,
            )

    async def _query(self, cql: str) -> Rows:
        return await self.execute(self._create_statement(cql))

    async def tables(self) -> set[str] | None:
        meta = self._session.get_metadata()
        if self.keyspace not in meta.get_keyspaces():
            return None
        return set(meta.get_tables(self.keyspace))

    async def _answer(self, request: Awaitable[Any]) -> Any:
        """The driver's answer to ``request`` (a read's page, a write): one
        that found no host goes to :meth:`_found_no_host`, any other clears it.
        Reads did not clear it, so a read-only session (the roll-up worker's)
        counted one from hours before as part of a new run of failures."""
        try:
            result = await request
        except self._no_hosts:
            self._found_no_host()
            raise
        self._no_host_since = None
        return result

    def _found_no_host(self) -> None:
        """A request found no host: after ``cassandra.renew_after`` of that, open a new
        driver session (in the background; the requests keep retrying)."""
        now = time.monotonic()
        since = self._no_host_since
        if since is None:
            self._no_host_since = now
        elif (
            now - since >= self._renew_after
            and now - self._renew_tried >= self._renew_after
            and self._renewing is None
            and not self._closed  # a request still under way at close (the shielded probe)
        ):
            self._renew_tried = now
            self._renewing = asyncio.create_task(self._renew(now - since))

    async def _renew(self, failing_for: float) -> None:
        try:
            try:
                opened = await self._reopen()
            except Exception as exc:
                # Cassandra unreachable too: an outage, which the gateway's own
                # lines say (this one would every renew_after); tried again then.
                log.debug("a new Cassandra driver session could not connect either: %s", exc)
                return
            old = (self._cluster, self._session)
            self._cluster, self._session = opened
            self._no_host_since = None
            self._stats.cassandra_sessions_renewed += 1
            log.warning(
                "Cassandra requests found no host for %.0f s while a new connection succeeds "
                "(the C++ driver gives a host up for good after an authentication or protocol "
                "error while reconnecting): writing through a new driver session",
                failing_for,
            )
            self.renewed()
            try:
                await _close_acsylla(*old)
            except Exception as exc:
                log.info("closing the driver session given up: %s", exc)
        finally:
            self._renewing = None

    async def close(self) -> None:
        self._closed = True
        renewing = self._renewing
        if renewing is not None:
            # Let it end (the driver's connect_timeout bounds it): a connect
            # cancelled half-way may not return.
            await asyncio.wait({renewing})
        await _close_acsylla(self._cluster, self._session)


def _nothing() -> None:
    pass


async def _close_acsylla(cluster: Any, session: Any) -> None:
    try:
        await session.close()
    finally:
        _clusters.release(cluster)


@dataclass(slots=True)
class _Shared:
    config: CassandraConfig
    loop: asyncio.AbstractEventLoop
    cluster: Any
    users: int


class SharedClusters:
    """acsylla clusters, one per config and event loop, shared by the driver
    sessions open on it and closed with the last of them.

    acsylla gives the C++ driver one logging callback for the whole process:
    every cluster it creates sets it, and every one closed clears it, for
    every session. `gateway run` opened a cluster per session: the write
    path's, the roll-up worker's, and one for each session replacing one that
    gave its host up (``cassandra.renew_after``), closing the one it
    replaced or the one that could not connect. After the first such close the
    driver's warnings and errors reached no log, for any session, until a
    restart; and a driver thread logging just as a cluster is closed can
    still hold the callback's freed data. With one cluster per config, a
    gateway closes its cluster only when it stops. Sessions of different
    configs in one process (tests, tools) still have one cluster each: the
    limit is said in the README. Bounded by the configs open at once."""

    def __init__(self) -> None:
        self._open: list[_Shared] = []

    def acquire(self, config: CassandraConfig, create: Callable[[], Any]) -> Any:
        """The cluster for ``config`` on the running loop, ``create``d if none is open."""
        loop = asyncio.get_running_loop()
        for shared in self._open:
            if shared.loop is loop and shared.config == config:
                shared.users += 1
                return shared.cluster
        cluster = create()
        self._open.append(_Shared(config, loop, cluster, 1))
        return cluster

    def release(self, cluster: Any) -> None:
        """One session on ``cluster`` is closed (or never opened); the last closes it."""
        for shared in self._open:
            if shared.cluster is cluster:
                shared.users -= 1
                if shared.users > 0:
                    return
                self._open.remove(shared)
                break
        # Closes the socket pair the cluster uses to wake the event loop.
        cluster.destroy()

    def __len__(self) -> int:
        return len(self._open)


_clusters = SharedClusters()


def value_bytes(values: Sequence[Any]) -> int:
    """About the bytes ``values`` bind to: text by characters (UTF-8 may be
    more; PACK_BYTES leaves room), maps (metrics, tags) by the length of
    their JSON (what their keys and values take, about; three times cheaper
    to get than summing them in Python), others 8."""
    size = 0
    for value in values:
        kind = type(value)  # exact types first: this runs for every row
        if kind is str:
            size += len(value)
        elif kind is int or kind is float:
            size += 8
        elif isinstance(value, dict):
            size += len(orjson.dumps(value))
        elif isinstance(value, str | bytes):
            size += len(value)
        elif value is not None and value is not UNSET:
            size += 8
    return size


def every_node_holds_everything(replication: dict[str, str], data_centres: list[str]) -> bool:
    """Whether a keyspace with this replication (system_schema.keyspaces)
    puts every partition on every one of these nodes (their data centres)."""
    strategy = replication.get("class", "")
    try:
        if strategy.endswith("SimpleStrategy"):
            return int(replication["replication_factor"]) >= len(data_centres)
        if strategy.endswith("NetworkTopologyStrategy"):
            nodes = Counter(data_centres)
            return all(int(replication.get(dc, "0")) >= n for dc, n in nodes.items())
    except (KeyError, ValueError):
        return False
    return False


def _first_unset(values: list[Any]) -> int:
    """The index of the first UNSET, or -1. By identity: ``UNSET in values``
    compared each value with ``==`` (a map's __eq__ among them)."""
    for index in range(len(values)):
        if values[index] is UNSET:
            return index
    return -1


def _seconds(ms: int) -> float:
    """Epoch ms as the seconds acsylla wants for a timestamp. It stores
    ``int(seconds * 1000)``, which truncates: ``ms / 1000`` would come back one
    millisecond short for some values. Half a millisecond towards the far side
    of zero makes the truncation land on ``ms`` exactly (a double's error here
    is under a microsecond); tests/test_write_session.py checks the edges."""
    return (ms + 0.5) / 1000 if ms >= 0 else (ms - 0.5) / 1000


def _acsylla_transient() -> tuple[type[BaseException], ...]:
    """acsylla's errors worth retrying (:attr:`WriteSession.transient`)."""
    from acsylla import errors  # noqa: PLC0415 - optional

    return (
        errors.CassErrorServerWriteTimeout,
        errors.CassErrorServerReadTimeout,
        errors.CassErrorServerUnavailable,
        errors.CassErrorServerWriteFailure,
        errors.CassErrorServerReadFailure,
        errors.CassErrorServerOverloaded,
        errors.CassErrorServerIsBootstrapping,
        errors.CassErrorServerServerError,
        errors.CassErrorServerTruncateError,
        errors.CassErrorLibRequestTimedOut,
        errors.CassErrorLibNoHostsAvailable,
        errors.CassErrorLibUnableToConnect,
        errors.CassErrorLibRequestQueueFull,
        errors.CassErrorLibNoStreams,
        errors.CassErrorLibWriteError,
        errors.CassErrorLibNoAvailableIoThread,
        errors.CassExceptionConnectionError,
        errors.CassErrorSslClosed,
        ConnectionError,
    )


def unavailable_errors() -> tuple[type[BaseException], ...]:
    """What a request through either driver raises when Cassandra cannot
    answer it once connected (replicas down, overloaded, a timeout: each
    session's :attr:`~WriteSession.transient`): a command says it in one
    line (``database.unanswered``), not as a traceback. Not an invalid
    query or a bad value: those are bugs, and keep their traceback. Nor
    the OSErrors among them: a command's own output raises those too (a
    reader gone: BrokenPipeError, said as exit 141)."""
    found = _PYTHON_TRANSIENT + (_acsylla_transient() if acsylla_installed() else ())
    return tuple(error for error in found if not issubclass(error, OSError))


def acsylla_installed() -> bool:
    """Installed and loadable (a wheel whose C++ library fails to load counts as absent)."""
    try:
        import acsylla  # noqa: F401, PLC0415 - optional
    except ImportError:
        return False
    return True


def choose_driver(config: CassandraConfig, acsylla: bool | None = None) -> str:
    """``acsylla`` or ``python`` for this config (see the module docstring);
    ``acsylla``: whether it is installed (by default, :func:`acsylla_installed`)."""
    if acsylla is None:
        acsylla = acsylla_installed()
    if config.driver == "python":
        return "python"
    if config.driver == "acsylla":
        if not acsylla:
            raise ConfigError(
                'cassandra.driver = "acsylla", but acsylla is not installed '
                "(pip install acsylla; wheels exist for Linux x86_64 and macOS), "
                'or set cassandra.driver = "python"'
            )
        return "acsylla"  # with TLS, the config checked that tls.ca_file is set
    # Only the Python driver compresses (the C++ driver has no compression).
    plain = not config.tls.enabled and config.compression == "none"
    return "acsylla" if acsylla and plain else "python"


# The C++ driver's messages about its connections (a socket error, a host it
# cannot reach) come many a second while a link flaps, and so may its warnings
# (a host overloaded, a connection closed after a server error, a pool that
# cannot reconnect: what says why requests find no host): each kind is logged
# at most once a minute, at WARNING (the gateway's own lines say the outage),
# the next saying how many were held back (repeats.py).
_LINK = re.compile(r"socket|connect", re.IGNORECASE)


class DriverLog:
    """The C++ driver's logging callback: its records into this module's log."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._repeats = Repeats(clock=clock)
        self.last = self._repeats.last  # kind: (logged at, held back since)

    def __call__(self, message: Any) -> None:
        text = str(getattr(message, "message", message))
        level = {"CRITICAL": logging.CRITICAL, "ERROR": logging.ERROR}.get(
            str(getattr(message, "log_level", "")).upper(), logging.WARNING
        )
        if "sharding info" in text:
            # ScyllaDB's driver says so on every Cassandra connection: expected.
            log.debug("C++ driver: %s", text)
        elif level == logging.WARNING or _LINK.search(text):
            said = self._repeats.say(text)
            if said is not None:
                log.warning("C++ driver: %s", said)
        else:
            log.log(level, "C++ driver: %s", text)


_forward_log = DriverLog()


async def _open_acsylla(config: CassandraConfig, stats: Stats | None) -> AcsyllaSession:
    import acsylla  # noqa: PLC0415 - optional

    options: dict[str, Any] = {}
    if config.username is not None:
        options["username"] = config.username
        options["password"] = config.password.get_secret_value() if config.password else ""
    tls = config.tls
    if tls.enabled:
        assert tls.ca_file is not None  # CassandraConfig requires it with acsylla
        options["ssl_enabled"] = True
        options["ssl_trusted_cert"] = _read("cassandra.tls.ca_file", tls.ca_file)
        if tls.cert_file is not None and tls.key_file is not None:
            options["ssl_cert"] = _read("cassandra.tls.cert_file", tls.cert_file)
            options["ssl_private_key"] = _read("cassandra.tls.key_file", tls.key_file)
        options["ssl_verify_flags"] = (
            acsylla.SSLVerifyFlags.PEER_IDENTITY
            if tls.verify_hostname
            else acsylla.SSLVerifyFlags.PEER_CERT
        )
    if config.local_dc:
        options["load_balance_dc_aware"] = config.local_dc

    async def connect() -> tuple[Any, Any]:
        try:
            cluster = _clusters.acquire(config, lambda: _create_cluster(acsylla, config, options))
        except acsylla.errors.CassException as exc:
            # Raised while the options are applied: a certificate or key the
            # C++ driver cannot parse, most likely.
            raise ConfigError(
                f"cassandra (driver acsylla): {exc} (check cassandra.tls.*)"
            ) from None
        try:
            session = await cluster.create_session()
        except Exception as exc:
            # (Not when cancelled: the driver may still answer the connect,
            # into the cluster's socket pair. The cluster stays open.)
            _clusters.release(cluster)
            raise cannot_connect(config, exc) from None
        return cluster, session

    return AcsyllaSession(config, await connect(), connect, stats)


def _read(key: str, path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc}") from None


def _create_cluster(acsylla: Any, config: CassandraConfig, options: dict[str, Any]) -> Any:
    return acsylla.create_cluster(
        list(config.contact_points),
        port=config.port,
        protocol_version=4,
        consistency=config.consistency,
        connect_timeout=config.connect_timeout,
        request_timeout=config.request_timeout,
        # An edge link that comes back should be used within seconds.
        exponential_reconnect_base_delay_ms=500,
        exponential_reconnect_max_delay_ms=10_000,
        # Client-side write times, as the Python driver does.
        timestamp_gen="monotonic",
        token_aware_routing=True,
        # Its warnings and errors reach our log (those about its connections
        # and its warnings once a minute per kind: DriverLog); its chatter
        # ("no shard awareness" on Cassandra) at DEBUG.
        log_level="warn",
        logging_callback=_forward_log,
        **options,
    )


def open_write_session(
    config: CassandraConfig, stats: Stats | None = None
) -> AbstractAsyncContextManager[WriteSession]:
    """Connect with the chosen driver; always disconnect on exit. ``stats``
    counts what the session does on its own (cassandra_sessions_renewed)."""
    return _Connected(config, stats)


class _Connected:
    """:func:`open_write_session`'s context: a class, not an async generator,
    which mypyc does not compile (this module is compiled: setup.py)."""

    def __init__(self, config: CassandraConfig, stats: Stats | None) -> None:
        self._config = config
        self._stats = stats
        self._exit = AsyncExitStack()

    async def __aenter__(self) -> WriteSession:
        if choose_driver(self._config) == "python":
            return PythonSession(await self._exit.enter_async_context(connect(self._config)))
        session = await _open_acsylla(self._config, self._stats)
        self._exit.push_async_callback(session.close)
        return session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._exit.__aexit__(exc_type, exc, tb)
