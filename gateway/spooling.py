"""Spooling while Cassandra is unreachable: how ``gateway run`` starts, in spool
mode, when no connection to Cassandra can be opened, and what it goes back to
when its writes have failed for ``cassandra.give_up_after`` (app.run).

An edge host that reboots during a link outage is exactly when the spool
matters, so in spool mode such a start does not exit. :func:`spool_until_reachable`
runs the intake alone: the MQTT session, the spool's group commits (each
message acknowledged once committed, as in full mode), ``/healthz`` (503) and
``/metrics``, and the status line, saying "spooling, Cassandra unreachable
since <time>". Meanwhile it opens a connection the way ``gateway run`` will,
with capped exponential backoff and jitter (:data:`RETRY_MIN` to
:data:`RETRY_MAX` seconds, the drivers' own reconnection bounds), for as long
as it takes: the spool is bounded, and when it is full acknowledgements pause
and the broker's persistent session holds the rest.

Once a connection opens, the intake stops (what it received is committed and
acknowledged; what the broker sends during the switch waits in the persistent
session) and ``app.run`` opens the full gateway, which drains the spool in
arrival order. Until then the page is served and the read API answers 503
with Retry-After (it reads Cassandra); nothing is sampled either: the
sampler judges each spooled message at its arrival time when it is drained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager

from .aio import backoff
from .config import CassandraConfig, Config
from .errors import CassandraUnreachable
from .ingest.receive import Delivery, Receiver
from .ingest.spool import Spool, SpoolSource
from .ingest.topics import TopicMatcher
from .sd_notify import Notifier
from .stats import Stats
from .store.schema import incomplete
from .store.write_session import open_write_session
from .units import utc_text
from .web.api import read_api_unavailable
from .web.metrics import gateway_registry
from .web.page import add_page
from .web.server import build_app, serve

log = logging.getLogger(__name__)

RETRY_MIN = 0.5
RETRY_MAX = 10.0
# A failed attempt is logged at most this often (the status line says the rest).
LOG_EVERY = 60.0


# Where the drivers report a failed connect (with a traceback, from
# cassandra-driver) on every attempt; the attempts are reported here instead.
_DRIVER_LOGGERS = ("cassandra.cluster", "gateway.store.write_session")


@contextmanager
def _drivers_quiet() -> Iterator[None]:
    drop = logging.Filter("-")  # a name no logger has: it passes nothing
    loggers = [logging.getLogger(name) for name in _DRIVER_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def unreachable_since(wall: float) -> str:
    """What /healthz and the status line say while the spool takes everything."""
    return f"spooling, Cassandra unreachable since {utc_text(wall)}"


def schema_missing(why: str) -> str:
    """What they say while Cassandra answers without the gateway's tables."""
    return f"spooling, Cassandra answers, but its {why}"


class _Waiting:
    """What the gateway waits for, as /healthz and the status line say it."""

    def __init__(self, unreachable: str, state: str | None) -> None:
        self.unreachable = unreachable  # said again when Cassandra stops answering
        self.state = state or unreachable


class _NotYet:
    """The spool's queue while there are no writers: its feed task is not run."""

    async def put(self, delivery: Delivery) -> None:
        raise AssertionError("nothing is fed from the spool before Cassandra answers")


async def spool_until_reachable(
    config: Config,
    stats: Stats,
    stop: asyncio.Event,
    *,
    since: float,
    waiting: str | None = None,
    shutdown_deadline: float,
    ready: asyncio.Event | None = None,
    notifier: Notifier | None = None,
) -> bool:
    """Run the intake alone until a connection to Cassandra opens, with the
    schema complete (True), or ``stop`` is set (False). ``since``: wall time
    the outage was first seen; ``waiting``: what to say if not that
    (:func:`schema_missing`)."""
    state = _Waiting(unreachable_since(since), waiting)
    reachable = asyncio.Event()
    done = asyncio.Event()  # the intake stops: Cassandra answers, or stop
    async with AsyncExitStack() as stack:
        spool = await stack.enter_async_context(
            Spool(config.spool.path, config.spool.max_records, config.spool.max_bytes)
        )
        if isinstance(stats.spool, Spool):
            spool.carry_over(stats.spool)  # the gateway that closed came first (app.run)
        stats.spool = spool
        # No writer's queue while spooling: a gateway that closed after
        # give_up_after left the depth its queue had, shown until it opened again.
        stats.queue_depth = 0
        log.info("spool %s: %d messages waiting", config.spool.path, spool.depth)
        receiver = Receiver(
            config.mqtt,
            TopicMatcher(config.topics, config.limits).subscriptions,
            stats,
            max_payload_bytes=config.limits.max_payload_bytes,
            shutdown_deadline=shutdown_deadline,
        )
        source = SpoolSource(
            spool,
            _NotYet(),
            receiver,
            stats,
            config.pipeline.queue_size,
            config.spool.commit_delay,
            config.mqtt.receive_maximum,
        )
        if config.api.enabled:

            def health() -> tuple[bool, dict[str, object]]:
                return False, {
                    "mqtt": "connected" if receiver.connected.is_set() else "disconnected",
                    "mqtt_client_id": config.mqtt.client_id,
                    "cassandra": state.state,
                    "spool": spool.depth,
                    "spool_state": spool.state(),
                }

            app = build_app(
                metrics=gateway_registry(stats, spool=spool),
                health=health,
                # The page too (a reload finds it), over a read API that says
                # it is not there yet.
                extra=[
                    read_api_unavailable(lambda: f"read API not ready: {state.state}"),
                    add_page,
                ],
            )
            await stack.enter_async_context(serve(app, config.api.host, config.api.port))
        notifier = notifier or Notifier()
        notifier.notify("READY=1", f"STATUS={state.state}")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(notifier.keep_alive(done))
            tasks.create_task(source.append(done))
            tasks.create_task(_receive(receiver, source, done))
            tasks.create_task(_connect(config.cassandra, state, reachable, done, stop))
            tasks.create_task(_status(stats, state, done, config.pipeline.status_interval))
            if ready is not None:
                tasks.create_task(_signal_ready(receiver, ready, done))
    return reachable.is_set()


async def _receive(receiver: Receiver, source: SpoolSource, done: asyncio.Event) -> None:
    try:
        # Stopping waits until what was received is committed and acknowledged.
        await receiver.run(source.accept, done)
    finally:
        source.close()


async def _connect(
    config: CassandraConfig,
    waiting: _Waiting,
    reachable: asyncio.Event,
    done: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    attempt = 0
    logged = time.monotonic()
    told = -math.inf  # of a missing schema
    try:
        while True:
            attempt += 1
            delay = random.uniform(RETRY_MIN, backoff(attempt, RETRY_MIN, RETRY_MAX))
            try:
                async with asyncio.timeout(delay):
                    await stop.wait()
                return
            except TimeoutError:
                pass
            try:
                # Exactly the connection `gateway run` opens (same driver, same
                # checks); closed at once, the gateway opens its own.
                with _drivers_quiet():
                    async with open_write_session(config) as session:
                        why = incomplete(session.keyspace, await session.tables())
            except CassandraUnreachable as exc:
                waiting.state = waiting.unreachable
                if time.monotonic() - logged >= LOG_EVERY:
                    logged = time.monotonic()
                    log.warning("still spooling, %d attempts so far: %s", attempt, exc)
                continue
            if why is not None:
                # It answers, but writing would fail: spool on, and say why.
                waiting.state = schema_missing(why)
                if time.monotonic() - told >= LOG_EVERY:  # the first time at once
                    told = time.monotonic()
                    log.error("still %s", waiting.state)
                continue
            log.info("Cassandra answers after %d attempts: opening the gateway", attempt)
            reachable.set()
            return
    finally:
        done.set()


async def _status(stats: Stats, waiting: _Waiting, done: asyncio.Event, interval: float) -> None:
    while not done.is_set():
        try:
            async with asyncio.timeout(interval):
                await done.wait()
        except TimeoutError:
            log.info("status: %s; %s", waiting.state, stats.status_line())


async def _signal_ready(receiver: Receiver, ready: asyncio.Event, done: asyncio.Event) -> None:
    connected = asyncio.ensure_future(receiver.connected.wait())
    stopped = asyncio.ensure_future(done.wait())
    await asyncio.wait((connected, stopped), return_when=asyncio.FIRST_COMPLETED)
    connected.cancel()
    stopped.cancel()
    if receiver.connected.is_set():
        ready.set()
