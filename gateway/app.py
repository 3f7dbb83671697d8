"""The application object: one :class:`Gateway` owns every resource of `gateway run`.

:func:`open_gateway` builds the parts in dependency order on one
``AsyncExitStack`` (write session, sink, spool, HTTP server) and hands each
its dependencies at construction; leaving it closes them in reverse order.
:meth:`Gateway.run` runs the tasks (receive, the spool's three tasks in spool
mode, the write loop, the status line, the roll-up worker) in one ``TaskGroup``
until ``stop`` is set, and then shuts down as the pipeline promises: stop reading, write and
acknowledge what was read (within ``shutdown_deadline``), log one summary line.

Where a message goes::

    ingest/receive.py  MQTT → Delivery (with its Ack)
    ingest/spool.py    (spool mode) Delivery → SQLite → Delivery
    ingest/pipeline.py classify (ingest/topics, decode, sampling) → queue → chunks
    store/latest.py, store/telemetry.py, store/rejects.py   rows for each table
    store/quota.py     the device quota, for devices new to this process
    store/rollups.py, store/metadata.py   dirty-window marks, metadata entries
    store/sink.py      batches per partition → store/requests.py (retries) → Cassandra
    → Ack.done(): PUBACK, in receive order
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector

from . import COMPILED
from .config import Config
from .errors import CassandraUnreachable, ConfigError, SchemaMissing, WritesFailing
from .ingest.pipeline import Classifier, Flow, NoFlow, Pipeline
from .ingest.receive import Handler, Receiver
from .ingest.sampling import QUOTA_RECHECK, Sampler
from .ingest.spool import Spool, SpoolSource, stranded
from .sd_notify import Notifier
from .spooling import schema_missing, spool_until_reachable, unreachable_since
from .stats import Cache, Stats
from .store import queries
from .store.clock import ClockWatch
from .store.database import Database, cannot_connect, connect
from .store.hot import HotPartitions
from .store.latest import LatestState
from .store.limit import INITIAL_IN_FLIGHT, InFlightLimit
from .store.metadata import Metadata
from .store.quota import DeviceQuota
from .store.rejects import Rejects
from .store.requests import Requests
from .store.rollups import RollupMarks, RollupWorker
from .store.rotate import StateRotation
from .store.schema import incomplete
from .store.sink import Sink
from .store.telemetry import Telemetry
from .store.write_session import WriteSession, open_write_session
from .web.api import read_api, read_api_unavailable
from .web.metrics import CachesCollector, NoisyRate, gateway_registry
from .web.page import add_page
from .web.server import AddRoutes, build_app, serve
from .web.tokens import TokenStore

log = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds between two probes of the event loop's lag (Gateway._probe_loop).
LAG_PROBE = 0.1
# Without an answer from Cassandra for this long (no traffic), the link is
# probed (Gateway._watch_link), so /healthz tells a dead link on a quiet site.
LINK_PROBE = 5.0


class Gateway:
    """The running gateway: its parts, its health and its noisy devices."""

    def __init__(
        self,
        config: Config,
        stats: Stats,
        *,
        receiver: Receiver,
        requests: Requests,
        sink: Sink,
        pipeline: Pipeline,
        rotation: StateRotation,
        sampler: Sampler,
        spool: SpoolSource | None,
        shutdown_deadline: float,
        rollups: RollupWorker | None = None,
        clock: ClockWatch | None = None,
    ) -> None:
        self.config = config
        self.stats = stats
        self._receiver = receiver
        self._requests = requests
        self._sink = sink
        self._pipeline = pipeline
        self._rotation = rotation
        self._sampler = sampler
        self._spool = spool
        self._shutdown_deadline = shutdown_deadline
        self._rollups = rollups
        self._clock = clock

    def _behind(self) -> bool:
        """The write path is behind what arrives: half the broker's window of
        unacknowledged messages waits (Receiver.behind), or, where that window
        does not hold the backlog back (the spool, QoS 0, a broker that sends
        past it), more than half the queue (Pipeline.backlogged). The roll-up
        worker spreads every minute over ``rollups.spread`` meanwhile."""
        return self._receiver.behind() or self._pipeline.backlogged()

    # -- answers for the HTTP side -------------------------------------------

    def health(self) -> tuple[bool, dict[str, object]]:
        connected = self._receiver.connected.is_set()
        refused = self._receiver.refused
        failing = self._requests.failing_for
        details: dict[str, object] = {
            "mqtt": "connected" if connected else "disconnected",
            # Which session this is: `gateway forget-session` will not end it.
            "mqtt_client_id": self.config.mqtt.client_id,
            "cassandra": "ok" if failing is None else self._failing(failing),
            "queue_depth": self._pipeline.queue_depth,
            "in_flight": self.stats.in_flight,
        }
        disk_full = False
        if self._spool is not None:
            spool = self._spool.spool
            details["spool"] = spool.depth
            details["spool_state"] = spool.state()
            # At the bound it acknowledges as fast as Cassandra drains (backpressure,
            # as without the spool); a full disk stops it until someone makes room.
            disk_full = spool.disk_full_since is not None
        if self._rollups is not None:
            details["rollup_worker"] = self._rollups.role
        if self.stats.clock_offset_s is not None:
            # Cassandra's clock minus this host's (store/clock.py).
            details["clock_offset_s"] = round(self.stats.clock_offset_s, 3)
        if refused:
            # Connected, but deaf to these filters' messages (an ACL, a broker
            # without shared subscriptions): "ok" hid it.
            details["mqtt_refused"] = refused
        healthy = connected and not refused and failing is None and not disk_full
        return healthy, details

    def _failing(self, seconds: float) -> str:
        if self._spool is not None:
            return unreachable_since(time.time() - seconds)
        return f"writes failing for {seconds:.0f} s"

    def noisy(self, tenant: str) -> list[dict[str, object]]:
        """The tenant's noisy devices, noisiest first (``since``: RFC 3339 UTC
        to the ms, as every read answer dates; it was epoch seconds)."""
        return [
            {
                "device_id": d.device_id,
                "observed_rate": round(d.observed_rate, 3),
                "kept_rate": round(d.kept_rate, 3),
                "since": queries.iso(datetime.fromtimestamp(d.since, UTC)),
                "sampled_out": d.sampled_out,
            }
            for d in self._sampler.noisy(tenant)
        ]

    def noisy_rates(self) -> list[NoisyRate]:
        """Every tracked tenant's noisy devices, for the metrics."""
        return [
            NoisyRate(tenant, d.device_id, d.observed_rate, d.kept_rate)
            for tenant in self._sampler.tenant_counters()
            for d in self._sampler.noisy(tenant)
        ]

    # -- running ----------------------------------------------------------

    async def run(
        self,
        stop: asyncio.Event,
        ready: asyncio.Event | None = None,
        notifier: Notifier | None = None,
    ) -> Stats:
        """Run until ``stop`` is set; returns the counters."""
        notifier = notifier or Notifier()
        # Ready once running, not once the broker answers: the receiver
        # reconnects by itself, and systemd would kill a gateway waiting for it.
        notifier.notify("READY=1", "STATUS=running")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(notifier.keep_alive(stop))
            # The tasks that feed and drain the queue; in spool mode they are
            # cancelled at stop (what they hold stays spooled).
            feeding = [tasks.create_task(self._pipeline.write_loop())]
            if self._spool is not None:
                spool = self._spool
                tasks.create_task(spool.append(stop))
                feeding.append(tasks.create_task(spool.feed()))
                tasks.create_task(spool.delete())
                handler = spool.accept
            else:
                handler = self._pipeline.accept
            tasks.create_task(self._receive(handler, stop, feeding))
            tasks.create_task(self._status(stop))
            tasks.create_task(self._until_stop(self._rotation.run(), stop))
            tasks.create_task(self._until_stop(self._probe_loop(), stop))
            tasks.create_task(self._until_stop(self._watch_link(), stop))
            if self._rollups is not None:
                self._rollups.backlogged = self._behind
                tasks.create_task(self._until_stop(self._rollups.run(), stop))
            if self._clock is not None:
                tasks.create_task(self._until_stop(self._clock.run(), stop))
            tasks.create_task(self._signal_ready(stop, ready))
        log.info("stopped: %s", self.stats.summary())
        return self.stats

    async def _probe_loop(self) -> None:
        """Measure the event loop's stalls: how late a LAG_PROBE sleep wakes
        (``gateway_event_loop_lag_seconds``)."""
        loop = asyncio.get_running_loop()
        observe = self.stats.loop_lag.observe
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PROBE)
            observe(max(0.0, loop.time() - before - LAG_PROBE))

    async def _watch_link(self) -> None:
        """While Cassandra has not answered for LINK_PROBE seconds (nothing to
        write), ask it something small (Requests.probe)."""
        requests = self._requests
        while True:
            await asyncio.sleep(LINK_PROBE)
            if time.monotonic() - requests.answered_at >= LINK_PROBE:
                # Shielded: a stop lets it end on the driver's own timeout.
                await asyncio.shield(requests.probe())

    async def _until_stop(self, work: Coroutine[Any, Any, None], stop: asyncio.Event) -> None:
        """Run ``work`` until ``stop``: state-partition rotations (store/rotate.py),
        the roll-up worker (store/rollups.py) and the loop's lag probe. A
        rotation or a roll-up pass cut short is finished after the next start."""
        working = asyncio.create_task(work)
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (working, stopping):
                task.cancel()
            await asyncio.gather(working, stopping, return_exceptions=True)
        if working.done() and not working.cancelled() and working.exception() is not None:
            raise working.exception()  # type: ignore[misc]

    async def _receive(
        self, handler: Handler, stop: asyncio.Event, feeding: list[asyncio.Task[None]]
    ) -> None:
        try:
            await self._receiver.run(handler, stop)
        finally:
            if self._spool is None:
                self._pipeline.close()
            else:
                self._spool.close()
                await self._stop_spooled_writes(feeding)

    async def _stop_spooled_writes(self, feeding: list[asyncio.Task[None]]) -> None:
        """Spool mode, stopping: finish the writes under way if they complete within
        the deadline, else drop them; their messages are still in the spool and are
        read again at the next start (the writes are idempotent)."""
        assert self._spool is not None
        writer, *feed = feeding
        for task in feed:
            # It may wait for room in a full queue: stop it now, not at the
            # deadline; the record it was handing over is still spooled.
            task.cancel()
        try:
            async with asyncio.timeout(self._shutdown_deadline):
                while not self._pipeline.idle:  # noqa: ASYNC110 - derived; polled only at stop
                    await asyncio.sleep(0.05)
        except TimeoutError:
            # Not "stopping": after give_up_after the process goes on spooling.
            log.warning("closing with Cassandra writes unfinished; they stay in the spool")
        writer.cancel()
        self._sink.abort()
        self._spool.writes_stopped()

    async def _status(self, stop: asyncio.Event) -> None:
        interval = self.config.pipeline.status_interval
        while not stop.is_set():
            try:
                async with asyncio.timeout(interval):
                    await stop.wait()
            except TimeoutError:
                self.stats.queue_depth = self._pipeline.queue_depth
                failing = self._requests.failing_for
                if failing is not None and self._spool is not None:
                    log.info("status: %s; %s", self._failing(failing), self.stats.status_line())
                else:
                    log.info("status: %s", self.stats.status_line())
                self._pipeline.tick()  # rotations due while no event follows

    async def _signal_ready(self, stop: asyncio.Event, ready: asyncio.Event | None) -> None:
        connected = asyncio.ensure_future(self._receiver.connected.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait((connected, stopped), return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        stopped.cancel()
        if ready is not None and self._receiver.connected.is_set():
            ready.set()


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions of ``group`` and of the groups nested in it."""
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


async def _enter_if(
    wanted: bool, stack: AsyncExitStack, manager: Callable[[], AbstractAsyncContextManager[T]]
) -> T | None:
    """What ``manager()`` gives, entered into ``stack``, when ``wanted``."""
    return await stack.enter_async_context(manager()) if wanted else None


def _opening_server(config: Config, stats: Stats) -> AbstractAsyncContextManager[Any]:
    """What the API port answers while the gateway opens after spool mode:
    /healthz 503 "opening", /metrics, the page, and a read API that is not
    there yet (503, so an open page waits)."""

    def health() -> tuple[bool, dict[str, object]]:
        return False, {"cassandra": "answers again: opening the gateway"}

    app = build_app(
        metrics=gateway_registry(stats),
        health=health,
        extra=[read_api_unavailable(lambda: "read API not ready: opening the gateway"), add_page],
    )
    return serve(app, config.api.host, config.api.port)


class _Opening:
    """Awaits a step of opening the gateway, once its session is connected:
    a transient error there (the link dropped while statements were
    prepared) is an unreachable Cassandra, as a failed connect is, so that
    spool mode spools and tries again. It was a traceback and exit 1."""

    def __init__(self, config: Config, transient: tuple[type[BaseException], ...]) -> None:
        self._config = config
        self._transient = transient

    async def __call__(self, step: Awaitable[T]) -> T:
        try:
            return await step
        except self._transient as exc:
            raise cannot_connect(self._config.cassandra, exc) from None


async def _check_schema(session: WriteSession) -> None:
    why = incomplete(session.keyspace, await session.tables())
    if why is not None:
        raise SchemaMissing(why)


@asynccontextmanager
async def open_gateway(
    config: Config,
    stats: Stats | None = None,
    *,
    shutdown_deadline: float = 10.0,
    before_serving: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[Gateway]:
    """Build every part of the gateway, in dependency order; close them in
    reverse. ``before_serving`` frees the API port for it (a server that
    answered while it opened)."""
    stats = stats or Stats()
    async with AsyncExitStack() as stack:
        # The sessions open together: each takes several round trips (12 s
        # over a link of 1 s round trips), and one after another they took
        # three times that before READY. What went wrong with the write
        # path's is said first, and the schema check names what is missing.
        write, rollup_session, reader = await asyncio.gather(
            stack.enter_async_context(open_write_session(config.cassandra, stats)),
            _enter_if(
                config.rollups.enabled and config.rollups.worker,
                stack,
                lambda: open_write_session(config.cassandra, stats),
            ),
            _enter_if(config.api.enabled, stack, lambda: connect(config.cassandra)),
            return_exceptions=True,
        )
        if isinstance(write, BaseException):
            raise write
        session = write
        opening = _Opening(config, session.transient)
        await opening(_check_schema(session))
        for failed in (rollup_session, reader):
            if isinstance(failed, BaseException):
                raise failed
        await opening(session.plan_packing())
        log.info("writing to Cassandra through %s", session.name)
        log.info(
            "per-message modules: %s",
            f"{len(COMPILED)} compiled (mypyc)"
            if COMPILED
            else "plain Python (GATEWAY_COMPILE=1 at install compiles them: setup.py)",
        )
        cassandra = config.cassandra
        limit = InFlightLimit(
            stats,
            initial=INITIAL_IN_FLIGHT,
            minimum=cassandra.in_flight_floor(session.in_flight_floor),
            maximum=cassandra.max_in_flight,
            adaptive=cassandra.adaptive_in_flight,
        )
        requests = Requests(session, cassandra, stats, limit)
        telemetry = Telemetry(config)
        hot_cfg = config.hot_partitions
        hot = HotPartitions(
            hot_cfg.window,
            hot_cfg.threshold,
            hot_cfg.max_tracked,
            stats,
            on_hot=telemetry.mark_hot,
            on_window=telemetry.window_ended,
        )
        sink = await stack.enter_async_context(Sink(requests, config.pipeline, hot, stats))
        latest = LatestState(requests, config, stats)
        rotation = StateRotation(requests, latest, config, stats)
        rejects = Rejects(config, stats)
        marks = RollupMarks(config, stats) if config.rollups.enabled else None
        metadata = Metadata(requests, sink, config, stats) if config.metadata.enabled else None
        quotas = any(t.max_devices_per_tenant is not None for t in config.sampling.tenants.values())
        quota = DeviceQuota(requests, stats, recheck=QUOTA_RECHECK) if quotas else None
        worker: RollupWorker | None = None
        if isinstance(rollup_session, WriteSession):
            # A session of its own (the same driver as the write path's): its
            # reads never queue behind the write path's in-flight cap. Its
            # cursor is never ahead of a mark: RollupMarks.prepare starts it
            # at this minute too, and marks are written after READY.
            await opening(rollup_session.plan_packing("the roll-up worker"))
            worker = RollupWorker(rollup_session, config, stats)
        # Together: each statement is a round trip, and over a slow link (1 s)
        # one after another they took over a minute before READY.
        clock = ClockWatch(session, stats)
        writers = (latest, rotation, telemetry, rejects, marks, metadata, quota)
        await opening(
            asyncio.gather(
                requests.prepare_probe(),
                *(w.prepare(session) for w in writers if w is not None),
                clock.prepare(),
                *(() if worker is None else (worker.start(),)),
            )
        )
        sampler = Sampler(config.sampling)
        for cached in (sampler, telemetry, latest, marks, metadata, quota):
            if cached is not None:
                stats.track_caches(cached.caches())
        classifier = Classifier(config, sampler, stats)
        receiver = Receiver(
            config.mqtt,
            classifier.subscriptions,
            stats,
            max_payload_bytes=config.limits.max_payload_bytes,
            shutdown_deadline=shutdown_deadline,
        )
        spool: Spool | None = None
        if config.spool.enabled:
            spool = await stack.enter_async_context(
                Spool(config.spool.path, config.spool.max_records, config.spool.max_bytes)
            )
            if isinstance(stats.spool, Spool):
                spool.carry_over(stats.spool)  # spool-only mode came first (spooling.py)
            stats.spool = spool
            log.info("spool %s: %d messages waiting", config.spool.path, spool.depth)
        # In spool mode the spool source, not the pipeline, holds the broker back.
        flow: Flow = receiver if spool is None else NoFlow()
        pipeline = Pipeline(
            config,
            classifier,
            latest,
            rotation,
            telemetry,
            rejects,
            sink,
            stats,
            flow,
            rollups=marks,
            metadata=metadata,
            quota=quota,
        )
        source = (
            SpoolSource(
                spool,
                pipeline,
                receiver,
                stats,
                config.pipeline.queue_size,
                config.spool.commit_delay,
                config.mqtt.receive_maximum,
            )
            if spool is not None
            else None
        )
        gateway = Gateway(
            config,
            stats,
            receiver=receiver,
            requests=requests,
            sink=sink,
            pipeline=pipeline,
            rotation=rotation,
            sampler=sampler,
            spool=source,
            shutdown_deadline=shutdown_deadline,
            rollups=worker,
            clock=clock,
        )
        if isinstance(reader, Database):
            # The read side has a session of its own (the CLI's driver): its
            # reads never queue behind the write path's in-flight cap.
            app = build_app(
                metrics=gateway_registry(stats, noisy=gateway.noisy_rates, spool=spool),
                health=gateway.health,
                noisy=gateway.noisy,
                extra=read_side(reader, config, stats.track_caches),
            )
            if before_serving is not None:
                await before_serving()
            await stack.enter_async_context(serve(app, config.api.host, config.api.port))
        yield gateway


def read_side(
    db: Database, config: Config, track_caches: Callable[[Mapping[str, Cache]], None]
) -> list[AddRoutes]:
    """The read API and the page, for ``gateway run`` and ``gateway serve``;
    the API's cache goes to ``track_caches`` (for ``gateway_cache_*``)."""
    tokens = TokenStore(config.api.tokens_file)
    log.info("read tokens from %s (%d now)", tokens.path, len(tokens))
    return [read_api(db, config, tokens, track_caches), add_page]


async def serve_read_side(config: Config, stop: asyncio.Event) -> None:
    """`gateway serve`: the read API, the page, /healthz and /metrics, with no
    MQTT and no writes: for a host building managers reach while edge
    gateways come and go. Runs until ``stop`` is set."""
    async with connect(config.cassandra) as db:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        caches: dict[str, Cache] = {}
        registry.register(CachesCollector(caches))

        def health() -> tuple[bool, dict[str, object]]:
            up = [h for h in db.cluster.metadata.all_hosts() if h.is_up]
            return bool(up), {"cassandra": f"{len(up)} node(s) up", "mode": "serve (read only)"}

        app = build_app(metrics=registry, health=health, extra=read_side(db, config, caches.update))
        async with serve(app, config.api.host, config.api.port) as listening:
            log.info("read side on %s/ (page), %s/api/v1 (API)", listening.url, listening.url)
            await stop.wait()


async def run(
    config: Config,
    stop: asyncio.Event,
    *,
    stats: Stats | None = None,
    shutdown_deadline: float = 10.0,
    ready: asyncio.Event | None = None,
    notifier: Notifier | None = None,
) -> Stats:
    """`gateway run`: open the gateway, run it until ``stop`` is set, close it.

    In spool mode a start that cannot reach Cassandra spools until it can
    (gateway/spooling.py), then opens the gateway; so does a gateway whose
    writes have failed for ``cassandra.give_up_after``, once it has closed
    (what it had taken is in the spool). Without the spool it ends
    at once: nothing could be taken meanwhile (the broker's persistent session
    keeps the backlog either way), and the service manager restarts it."""
    stats = stats or Stats()
    if not config.spool.enabled and (said := stranded(config.spool.path)):
        raise ConfigError(said)
    since: float | None = None
    waiting: str | None = None  # what spool mode waits for, if not Cassandra itself
    notifier = notifier or Notifier()
    while True:
        # After spool mode (READY sent, so systemd's watchdog runs) the
        # watchdog is fed while the gateway opens: that takes round trips,
        # 34.5 s over 1.6 s ones, and WatchdogSec=30 killed it each time. It
        # is fed until the gateway has closed too: closing after give_up_after
        # waits out the writes under way (shutdown_deadline), the roll-up
        # lease's release and the driver, once Gateway.run's own pings have
        # stopped. Spool mode is the only one that comes back round this loop
        # (without the spool every way out raises).
        closed = asyncio.Event()
        spooling = config.spool.enabled
        feeding = asyncio.create_task(notifier.keep_alive(closed)) if spooling else None
        # And /healthz, /metrics and the page are served while it opens:
        # monitoring saw 28 s of refused connections over 1.6 s round trips.
        answering = AsyncExitStack()
        if since and config.api.enabled:
            await answering.enter_async_context(_opening_server(config, stats))
        try:
            async with open_gateway(
                config,
                stats,
                shutdown_deadline=shutdown_deadline,
                before_serving=answering.aclose,
            ) as gateway:
                return await gateway.run(stop, ready, notifier)
        # A star: raised after the sink opened, it comes in the sink's group.
        except* CassandraUnreachable as group:
            exc = group.exceptions[0]
            if not config.spool.enabled:
                raise CassandraUnreachable(
                    f"{exc} (cassandra.contact_points, cassandra.port); not retried without "
                    "the spool: with spool.enabled the gateway starts anyway and spools"
                ) from None
            since = since or time.time()
            waiting = None
            log.warning("%s: taking messages into the spool until it answers", exc)
        except* WritesFailing as group:
            # Spool mode, writes failing for give_up_after: the intake alone,
            # as at a start without Cassandra, in this process. It used to
            # exit for the service manager to start it again into spooling;
            # a host without one (a container without a restart policy, a
            # terminal) stopped taking messages.
            if not config.spool.enabled or stop.is_set():
                raise  # no spool, or stopping anyway: exit 1 as before
            # except* keeps the groups it came through: the leaves are the
            # WritesFailing (a filter on the top level found none if nested).
            failing = [e for e in _leaves(group) if isinstance(e, WritesFailing)]
            # When they began to fail: not now less give_up_after, which the
            # close's wait for the writes under way (up to shutdown_deadline)
            # moved on by 10 s (field-engineer probe).
            since = min(e.since for e in failing)
            waiting = None
            log.warning(
                "%s: closing the gateway; taking messages into the spool until Cassandra answers",
                failing[0],
            )
        except* SchemaMissing as group:
            # Spooling, the link came back to a keyspace without the tables
            # (installed while the link was down, or a release that adds
            # one): that ended the intake, at every restart.
            if not config.spool.enabled:
                raise group.exceptions[0] from None
            since = since or time.time()
            waiting = schema_missing(str(group.exceptions[0]))
            log.error("%s: taking messages into the spool until it is complete", waiting)
        finally:
            closed.set()
            if feeding is not None:
                await feeding
            await answering.aclose()
        if not await spool_until_reachable(
            config,
            stats,
            stop,
            since=since,
            waiting=waiting,
            shutdown_deadline=shutdown_deadline,
            ready=ready,
            notifier=notifier,
        ):
            log.info("stopped: %s", stats.summary())
            return stats
