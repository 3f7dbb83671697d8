"""The gateway's main job: receive → topics → decode → queue → writers → ack.

    receive.py    MQTT session; each message comes with an Ack
    topics.py     (tenant, device_id) from the topic, or a rejection
    decode.py     the payload into a validated Event, or a rejection
    (queue)       bounded asyncio.Queue of pipeline.queue_size
    state.py      latest_events_by_state / _by_device writes
    telemetry.py  raw, time-bucketed telemetry writes
    rejects.py    rejected_messages writes
    sink.py       batches per partition, in-flight cap, retries
    write_session.py  the driver the sink writes through (acsylla or Python)
    → Ack.done() once every write of the message is acknowledged by Cassandra

Promises: every message the broker hands over ends up written (event or
rejection) before it is acknowledged; nothing is dropped. Memory is bounded
twice: the broker sends at most ``mqtt.receive_maximum`` unacknowledged
messages, and when the queue (``pipeline.queue_size``) is full the receiver
stops reading the socket until it is half empty. On stop the receiver stops
reading, what was read is written and acknowledged (within
``shutdown_deadline``), and one summary line is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .api import GatewayMetrics, add_spool_metrics, gateway_metrics, serve
from .config import Config
from .decode import Decoder, Event
from .errors import DecodeError, SchemaError
from .metrics import Stats
from .receive import Delivery, Receiver
from .rejects import Rejection, Rejects
from .sampling import Sampler, Verdict
from .schema import missing_from
from .sink import Pending, Sink, Write
from .spool import Spool
from .state import LatestState
from .telemetry import Telemetry
from .topics import TopicMatcher
from .write_session import WriteSession, open_write_session

log = logging.getLogger(__name__)


_KEEP_ALL = Verdict(keep_raw=True, update_latest=True, reason="normal")


@dataclass(slots=True)
class _Item:
    delivery: Delivery
    event: Event | None
    rejection: Rejection | None
    verdict: Verdict = _KEEP_ALL


_STOP = object()
# Back-fill (old events) bypasses sampling: everything is written.
_BACKFILL = Verdict(keep_raw=True, update_latest=True, reason="backfill")


def _nothing() -> None:
    pass


class _SpoolDone:
    """A spooled message is done once Cassandra has it: delete it."""

    __slots__ = ("_pipeline", "_seq", "_size")

    def __init__(self, pipeline: Pipeline, seq: int, size: int) -> None:
        self._pipeline, self._seq, self._size = pipeline, seq, size

    def done(self) -> None:
        self._pipeline.spooled_done(self._seq, self._size)


def _rejection(
    delivery: Delivery, tenant: str, device: str | None, reason: str, detail: str
) -> Rejection:
    return Rejection(
        tenant, device, delivery.topic, reason, detail, delivery.payload, delivery.received_ms
    )


class Pipeline:
    """Everything between a delivery and its acknowledgement."""

    def __init__(
        self,
        config: Config,
        sink: Sink,
        stats: Stats,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.stats = stats
        self._latency = metrics.write_latency if metrics is not None else None
        self._sink = sink
        self._matcher = TopicMatcher(config.topics, config.limits)
        self._decoder = Decoder(config.limits)
        self._state = LatestState(sink, config, stats)
        self._telemetry = Telemetry(config)
        sink.hot.on_hot = self._telemetry.mark_hot
        sink.hot.on_window = self._telemetry.window_ended
        self._rejects = Rejects(config, stats)
        self.sampler = Sampler(config.sampling)
        self._backfill_ms = int(config.sampling.backfill_after * 1000)
        self._metrics = metrics
        self._queue: asyncio.Queue[_Item | object] = asyncio.Queue(config.pipeline.queue_size)
        self._overflow: deque[_Item | object] = deque()
        self._low_water = config.pipeline.queue_size // 2
        self._pause: Callable[[], None] = _nothing
        self._resume: Callable[[], None] = _nothing
        # Spool mode (gateway/spool.py): deliveries go to the spool first.
        self.spool: Spool | None = None
        self._inbox: list[Delivery] = []
        self._inbox_ready = asyncio.Event()
        self._spooled = asyncio.Event()
        self._to_delete: list[tuple[int, int]] = []
        self._delete_ready = asyncio.Event()
        self._closing = False
        self._writes_done = asyncio.Event()
        self._batch = config.pipeline.batch_max_events
        self._linger = config.pipeline.linger

    @property
    def subscriptions(self) -> list[str]:
        return self._matcher.subscriptions

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def classify(self, delivery: Delivery) -> _Item:
        """Topic and payload to an Event, or to a Rejection. Never raises."""
        tenant = ""
        device: str | None = None
        try:
            tenant, device = self._matcher.match(delivery.topic)
            event = self._decoder.decode(
                tenant, device, delivery.payload, delivery.content_type, delivery.received_ms
            )
        except DecodeError as exc:
            if not tenant:
                tenant = self._matcher.tenant_of(delivery.topic)
            return _Item(
                delivery, None, _rejection(delivery, tenant, device, exc.reason, exc.detail)
            )
        if event.ts_from_receive:
            self.stats.no_ts += 1
        if delivery.received_ms - event.ts_ms > self._backfill_ms:
            return _Item(delivery, event, None, _BACKFILL)
        verdict = self.sampler.decide(tenant, device, delivery.topic, event.state, event.metrics)
        if verdict.reject_reason is not None:
            if self._metrics is not None:
                self._metrics.quota_rejections.inc(tenant=tenant)
            self.stats.quota_rejected += 1
            detail = (
                f"new device {device!r} is over tenant {tenant!r}'s device quota "
                "(sampling.tenants.<tenant>.max_devices_per_tenant)"
            )
            return _Item(
                delivery, None, _rejection(delivery, tenant, device, verdict.reject_reason, detail)
            )
        return _Item(delivery, event, None, verdict)

    def set_flow(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """How to stop and restart reading from the broker."""
        self._pause, self._resume = pause, resume

    def accept(self, delivery: Delivery) -> None:
        """Receiver's handler: classify and enqueue; never blocks, never drops.

        When the queue fills, reading from the broker pauses (TCP holds the rest
        back). A message read after that, in the same socket read, is held in
        arrival order in a small overflow list (counted) until there is room.
        """
        if self.spool is not None:
            # Spool mode: append first, acknowledge once committed (spool_writer).
            self._inbox.append(delivery)
            self._inbox_ready.set()
            if len(self._inbox) >= self._queue.maxsize:
                self._pause()
            return
        item = self.classify(delivery)
        if self._overflow or self._queue.full():
            self._overflow.append(item)
            self.stats.overflow += 1
            self._pause()
            return
        self._queue.put_nowait(item)
        if self._queue.full():
            self._pause()

    def _refill(self) -> None:
        queue, overflow = self._queue, self._overflow
        while overflow and not queue.full():
            queue.put_nowait(overflow.popleft())
        if not overflow and queue.qsize() <= self._low_water:
            self._resume()

    async def close(self) -> None:
        """No more deliveries: the writer finishes what is queued, then returns."""
        if self.spool is not None:
            # What is spooled stays spooled; the reader stops and sends _STOP.
            self._closing = True
            self._inbox_ready.set()
            self._spooled.set()
            return
        self._overflow.append(_STOP)
        self._refill()

    # -- spool mode ----------------------------------------------------------

    async def spool_writer(self) -> None:
        """Append deliveries in group commits; acknowledge each once committed."""
        spool = self.spool
        assert spool is not None
        while True:
            await self._inbox_ready.wait()
            self._inbox_ready.clear()
            if not self._inbox:
                if self._closing:
                    return
                continue
            if spool.full:
                self._pause()  # the broker keeps the rest until there is room
                self.stats.spool_full_waits += 1
                await spool.wait_for_room()
            batch, self._inbox = self._inbox, []
            await spool.append([(d.received_ms, d.topic, d.content_type, d.payload) for d in batch])
            for delivery in batch:
                delivery.ack.done()
            self._spooled.set()
            if not spool.full:
                self._resume()
            if self._inbox:
                self._inbox_ready.set()

    async def spool_reader(self) -> None:
        """Feed spooled messages to the writers in arrival order."""
        spool = self.spool
        assert spool is not None
        queue, last = self._queue, 0
        while True:
            # Cleared before reading, so an append during the read is not missed.
            self._spooled.clear()
            room = queue.maxsize - queue.qsize()
            if self._closing:
                return  # what is spooled stays spooled; run() stops the writers
            records = await spool.read(last, min(room, self._batch)) if room > 0 else []
            if not records:
                if room > 0:
                    await self._spooled.wait()
                else:
                    await asyncio.sleep(0.005)  # the writers are behind; look again soon
                continue
            for record in records:
                ack = _SpoolDone(self, record.seq, len(record.payload))
                delivery = Delivery(
                    record.topic, record.payload, record.content_type, record.received_ms, ack
                )
                queue.put_nowait(self.classify(delivery))
            last = records[-1].seq

    @property
    def idle(self) -> bool:
        return self._queue.empty() and self.stats.in_flight == 0

    def writes_stopped(self) -> None:
        self._writes_done.set()

    def spooled_done(self, seq: int, size: int) -> None:
        self._to_delete.append((seq, size))
        self._delete_ready.set()

    async def spool_deleter(self) -> None:
        """Delete what Cassandra has, in batches."""
        spool = self.spool
        assert spool is not None
        while True:
            waiter = asyncio.ensure_future(self._delete_ready.wait())
            done = asyncio.ensure_future(self._writes_done.wait())
            await asyncio.wait((waiter, done), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            done.cancel()
            self._delete_ready.clear()
            batch, self._to_delete = self._to_delete, []
            if batch:
                await spool.delete([s for s, _ in batch], sum(n for _, n in batch))
            if self._writes_done.is_set() and not self._to_delete:
                return

    async def prepare(self, session: WriteSession) -> None:
        """Prepare every stage's statements (before the first message)."""
        await self._state.prepare(session)
        await self._telemetry.prepare(session)
        await self._rejects.prepare(session)

    async def write_loop(self) -> None:
        """Take chunks off the queue and write them until close()."""
        queue = self._queue
        while True:
            first = await queue.get()
            chunk: list[_Item] = []
            stop = first is _STOP
            if not stop:
                chunk.append(first)  # type: ignore[arg-type]
                if self._linger and queue.qsize() < self._batch and self.stats.in_flight:
                    # Cassandra is busy anyway: gather a fuller chunk (more rows
                    # per partition batch) instead of sending a trickle. When
                    # idle, the first message goes out at once.
                    await asyncio.sleep(self._linger)
            while not stop and len(chunk) < self._batch and not queue.empty():
                item = queue.get_nowait()
                if item is _STOP:
                    stop = True
                    break
                chunk.append(item)  # type: ignore[arg-type]
            self._refill()
            self.stats.queue_depth = queue.qsize()
            if chunk:
                self.stats.chunks += 1
                await self._write_chunk(chunk)
            if stop:
                await self._sink.drain()
                self._writes_done.set()
                return

    async def _write_chunk(self, chunk: list[_Item]) -> None:
        events = [item.event for item in chunk if item.event is not None]
        over, late = await self._state.prepare_chunk(events) if events else ([], {})
        over_ids = {id(e) for e in over}
        # Latest-table writes are last-write-wins by event time, so of several
        # events of one device in a chunk only the newest needs them (its
        # writes shadow the others'). Devices with a state-less event in the
        # chunk are left alone: that event doesn't move the device between states.
        newest: dict[tuple[str, str], Event] = {}
        stateless: set[tuple[str, str]] = set()
        for item in chunk:
            e = item.event
            if e is None or id(e) in over_ids or not item.verdict.update_latest:
                continue
            key = (e.tenant, e.device_id)
            if e.state is None:
                stateless.add(key)
            current = newest.get(key)
            if current is None or e.write_ts > current.write_ts:
                newest[key] = e
        writes: list[Write] = []
        for item in chunk:
            pending = Pending(self._done_callback(item))
            event = item.event
            if event is not None and id(event) in over_ids:
                detail = (
                    f"state {event.state!r} would exceed the tenant's "
                    f"{self.config.pipeline.max_states_per_tenant} states "
                    "(pipeline.max_states_per_tenant)"
                )
                item.rejection = _rejection(
                    item.delivery, event.tenant, event.device_id, "too_many_states", detail
                )
                item.event = event = None
            if event is not None:
                key = (event.tenant, event.device_id)
                verdict = item.verdict
                if verdict.update_latest and (newest[key] is event or key in stateless):
                    mine = self._state.writes(event, pending, late.get(id(event)))
                else:
                    mine = []
                    self.stats.coalesced += 1
                if verdict.keep_raw:
                    mine += self._telemetry.writes(event, pending)
                else:
                    self.stats.sampled_out += 1
                    if self._metrics is not None:
                        self._metrics.sampled_out.inc(tenant=event.tenant)
                if not mine:
                    # Decided and accounted for: nothing to write, acknowledge.
                    pending.on_done()
                writes += mine
            else:
                assert item.rejection is not None
                writes += self._rejects.writes(item.rejection, pending)
        await self._sink.submit(writes)

    def _done_callback(self, item: _Item) -> Callable[[], None]:
        stats = self.stats
        latency = self._latency

        def done() -> None:
            event = item.event
            if event is not None and item.verdict.keep_raw:
                stats.written += 1
                if latency is not None and event.sent_at_ms is not None:
                    # Publisher's clock to ours: meaningful when they agree (NTP).
                    latency.observe(max(0.0, time.time() - event.sent_at_ms / 1000))
            item.delivery.ack.done()

        return done


async def _stop_spooled_writes(
    pipeline: Pipeline, sink: Sink, writers: list[asyncio.Task[None]], deadline: float
) -> None:
    """Spool mode, stopping: finish the writes under way if they complete within
    the deadline, else drop them; their messages are still in the spool and are
    read again at the next start (the writes are idempotent)."""
    try:
        async with asyncio.timeout(deadline):
            while not pipeline.idle:  # noqa: ASYNC110 - idle is derived; polled only at stop
                await asyncio.sleep(0.05)
    except TimeoutError:
        log.warning("stopping with Cassandra writes unfinished; they stay in the spool")
    for task in writers:
        task.cancel()
    sink.abort()
    pipeline.writes_stopped()


async def _status(pipeline: Pipeline, interval: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with asyncio.timeout(interval):
                await stop.wait()
        except TimeoutError:
            pipeline.stats.queue_depth = pipeline.queue_depth
            log.info("status: %s", pipeline.stats.status_line())


async def run(
    config: Config,
    stop: asyncio.Event,
    *,
    stats: Stats | None = None,
    shutdown_deadline: float = 10.0,
    ready: asyncio.Event | None = None,
) -> Stats:
    """Run until ``stop`` is set; returns the counters."""
    stats = stats or Stats()
    async with open_write_session(config.cassandra) as session:
        missing = missing_from(session.keyspace, await session.tables())
        if missing:
            raise SchemaError(
                f"schema incomplete in keyspace {config.cassandra.keyspace!r} "
                f"(missing: {', '.join(missing)}): run `gateway schema apply`"
            )
        log.info("writing to Cassandra through %s", session.name)
        metrics = gateway_metrics(stats)
        async with Sink(session, config, stats, metrics) as sink:
            pipeline = Pipeline(config, sink, stats, metrics)
            await pipeline.prepare(session)
            receiver = Receiver(
                config.mqtt, pipeline.subscriptions, stats, shutdown_deadline=shutdown_deadline
            )
            pipeline.set_flow(receiver.pause_reading, receiver.resume_reading)

            writers: list[asyncio.Task[None]] = []

            async def receive() -> None:
                try:
                    await receiver.run(pipeline.accept, stop)
                finally:
                    await pipeline.close()
                    if pipeline.spool is not None:
                        await _stop_spooled_writes(pipeline, sink, writers, shutdown_deadline)

            async def signal_ready() -> None:
                connected = asyncio.ensure_future(receiver.connected.wait())
                stopped = asyncio.ensure_future(stop.wait())
                await asyncio.wait((connected, stopped), return_when=asyncio.FIRST_COMPLETED)
                connected.cancel()
                stopped.cancel()
                if ready is not None and receiver.connected.is_set():
                    ready.set()

            def health() -> tuple[bool, dict[str, object]]:
                failing = sink.failing_for
                details: dict[str, object] = {
                    "mqtt": "connected" if receiver.connected.is_set() else "disconnected",
                    "cassandra": "ok" if failing is None else f"writes failing for {failing:.0f} s",
                    "queue_depth": pipeline.queue_depth,
                    "in_flight": stats.in_flight,
                }
                return receiver.connected.is_set() and failing is None, details

            def noisy(params: Mapping[str, str]) -> list[dict[str, object]]:
                tenant = params.get("tenant", "")
                wall_offset = time.time() - time.monotonic()
                return [
                    {
                        "device_id": d.device_id,
                        "observed_rate": round(d.observed_rate, 3),
                        "kept_rate": round(d.kept_rate, 3),
                        "since": d.since + wall_offset,
                        "sampled_out": d.sampled_out,
                    }
                    for d in pipeline.sampler.noisy(tenant)
                ]

            def mirror_noisy() -> None:
                gauge = metrics.noisy_rate
                gauge.clear()
                for tenant in pipeline.sampler.tenant_counters():
                    for d in pipeline.sampler.noisy(tenant):
                        gauge.set(
                            d.observed_rate, tenant=tenant, device_id=d.device_id, rate="observed"
                        )
                        gauge.set(d.kept_rate, tenant=tenant, device_id=d.device_id, rate="kept")

            metrics.registry.on_render(mirror_noisy)
            api = (
                serve(
                    config.api.host,
                    config.api.port,
                    metrics.render,
                    health,
                    routes={"/noisy": noisy},
                )
                if config.api.enabled
                else contextlib.nullcontext()
            )
            spool = (
                Spool(config.spool.path, config.spool.max_records, config.spool.max_bytes)
                if config.spool.enabled
                else None
            )
            async with (
                api,
                spool if spool is not None else contextlib.nullcontext(),
                asyncio.TaskGroup() as tasks,
            ):
                if spool is not None:
                    pipeline.spool = spool
                    stats.spool = spool
                    add_spool_metrics(metrics, spool)
                    log.info("spool %s: %d messages waiting", config.spool.path, spool.depth)
                    tasks.create_task(pipeline.spool_writer())
                    tasks.create_task(pipeline.spool_reader())
                    tasks.create_task(pipeline.spool_deleter())
                tasks.create_task(receive())
                writers.append(tasks.create_task(pipeline.write_loop()))
                tasks.create_task(_status(pipeline, config.pipeline.status_interval, stop))
                tasks.create_task(signal_ready())
    log.info("stopped: %s", stats.summary())
    return stats
