"""The queue between receiving and writing: classify, queue, write, acknowledge.

    source        MQTT (receive.py), or the spool (spool.py) in spool mode
    classify      topics.py → decode.py → sampling.py: an Event, or a Rejection
    (queue)       bounded queue of pipeline.queue_size (ItemQueue)
    write loop    chunks of the queue → the device quota (store/quota.py) for the
                  devices it must settle → the table writers in gateway/store/
                  (latest, telemetry, roll-up marks, metadata, rejects) → the sink;
                  events with metadata entries to look up wait for its worker
    → the delivery's ``ack.done()`` once every write of it is acknowledged

Promises: every delivery ends up written (event or rejection) before it is
acknowledged; nothing is dropped. Memory is bounded: a push source (MQTT)
hands deliveries to :meth:`Pipeline.accept`, which never blocks; when the
queue fills it pauses the source's socket reads (``Flow``) until the queue is
half empty, and the few messages already read are held, in order and counted,
in an overflow list. A pull source (the spool) awaits :meth:`Pipeline.put`.
:meth:`Pipeline.close` lets the write loop finish what is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..config import Config
from ..errors import DecodeError
from ..event import Event
from ..stats import Stats
from ..store.latest import LatestState
from ..store.metadata import Held, Metadata
from ..store.quota import DeviceQuota
from ..store.rejects import Rejection, Rejects
from ..store.rollups import RollupMarks
from ..store.rotate import StateRotation
from ..store.sink import Pending, Sink, Write
from ..store.telemetry import Telemetry
from ..topic_filters import covers
from .decode import Decoder
from .receive import Delivery
from .sampling import QUOTA_PENDING, QUOTA_REFUSED, Sampler, Verdict
from .topics import TopicMatcher

_KEEP_ALL = Verdict(keep_raw=True, update_latest=True, reason="normal")
# Back-fill (old events) bypasses sampling: everything within the device quota is written.
_BACKFILL = Verdict(keep_raw=True, update_latest=True, reason="backfill")


@dataclass(slots=True, init=False)
class Item:
    """A classified delivery: an event with its verdict, or a rejection."""

    delivery: Delivery
    event: Event | None
    rejection: Rejection | None
    verdict: Verdict = _KEEP_ALL
    # Of a device whose tenant's quota the write loop must settle first.
    quota_pending: bool = False

    # Written out: a dataclass's generated __init__ is interpreted (event.py).
    def __init__(
        self,
        delivery: Delivery,
        event: Event | None,
        rejection: Rejection | None,
        verdict: Verdict = _KEEP_ALL,
        quota_pending: bool = False,
    ) -> None:
        self.delivery = delivery
        self.event = event
        self.rejection = rejection
        self.verdict = verdict
        self.quota_pending = quota_pending


log = logging.getLogger(__name__)
# A message no filter of ours matches is said at most this often (s).
STALE_SUBSCRIPTION_EVERY = 60.0

_STOP = object()
# Asks the write loop to start due state-partition rotations (see tick()).
_TICK = object()


class ItemQueue:
    """The bounded queue between classifying and writing: what asyncio.Queue
    does for it (put_nowait, get, and put for pull sources), compiled.
    asyncio.Queue's methods are interpreted Python: about 15 calls of them
    per message here (bench/PERFORMANCE.md). Waiters are woken in order, and
    a waiter cancelled after its wake-up passes it on, as asyncio.Queue does."""

    def __init__(self, maxsize: int) -> None:
        self._items: deque[Item | object] = deque()
        self._maxsize = maxsize
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self._maxsize

    def put_nowait(self, item: Item | object) -> None:
        if self.full():
            raise asyncio.QueueFull
        self._items.append(item)
        _wake_next(self._getters)

    def get_nowait(self) -> Item | object:
        if self.empty():
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        _wake_next(self._putters)
        return item

    async def get(self) -> Item | object:
        while self.empty():
            getter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                _give_up(self._getters, getter, not self.empty())
                raise
        return self.get_nowait()

    async def put(self, item: Item | object) -> None:
        while self.full():
            putter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._putters.append(putter)
            try:
                await putter
            except BaseException:
                _give_up(self._putters, putter, not self.full())
                raise
        self.put_nowait(item)


def _wake_next(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return


def _give_up(
    waiters: deque[asyncio.Future[None]], waiter: asyncio.Future[None], could_go: bool
) -> None:
    """A waiter cancelled: out of the line. If it had been woken (it is done,
    not cancelled) and the queue still lets one go, the next one is woken."""
    waiter.cancel()  # nothing if it was woken
    with contextlib.suppress(ValueError):  # woken: no longer in line
        waiters.remove(waiter)
    if could_go and not waiter.cancelled():
        _wake_next(waiters)


class Flow(Protocol):
    """How the pipeline slows a push source down (the MQTT receiver)."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class NoFlow:
    """For pull sources, which wait for room instead."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _newer(a: Event, b: Event) -> bool:
    """``a`` goes after ``b`` in a device's latest tables: by write time, ties
    (a tie-break collision) to the larger event id, as in store/latest.py."""
    return a.write_ts > b.write_ts or (a.write_ts == b.write_ts and a.event_id > b.event_id)


def rejection(
    delivery: Delivery, tenant: str, device: str | None, reason: str, detail: str
) -> Rejection:
    return Rejection(
        tenant, device, delivery.topic, reason, detail, delivery.payload, delivery.received_ms
    )


def over_quota(delivery: Delivery, tenant: str, device: str, stats: Stats) -> Rejection:
    """The rejection of a device beyond its tenant's device quota, counted."""
    stats.quota_by_tenant.add(tenant)
    stats.quota_rejected += 1
    detail = (
        f"new device {device!r} is over the device quota of tenant {tenant!r} "
        "(sampling.tenants.<tenant>.max_devices_per_tenant)"
    )
    return rejection(delivery, tenant, device, "quota", detail)


class Classifier:
    """Topic and payload to an Event with its sampling verdict, or a Rejection."""

    def __init__(self, config: Config, sampler: Sampler, stats: Stats) -> None:
        self._matcher = TopicMatcher(config.topics, config.limits)
        self._decoder = Decoder(config.limits)
        self._sampler = sampler
        self._stats = stats
        self._backfill_ms = int(config.sampling.backfill_after * 1000)
        self._filters = [tuple(f.split("/")) for f in self._matcher.subscriptions]
        self._stale_said = -STALE_SUBSCRIPTION_EVERY
        # Per device, its queued events pending its quota, in queue order
        # (QUOTA_PENDING: the write loop settles the device when the first
        # of them comes, and decides them all then: Pipeline._settle_quota).
        # A newer event of such a device is left pending behind them, so the
        # sampler judges the device's events in the order they came. Decided
        # at once, it was judged before them, and they, later, as late events
        # against its newer state: a change back among them was taken for no
        # change and sampled out. Holds only queued events.
        self._pending: dict[tuple[str, str], list[Item]] = {}

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def subscriptions(self) -> list[str]:
        return self._matcher.subscriptions

    def _unsubscribed(self, topic: str, error: DecodeError) -> tuple[str, str]:
        """A topic no template takes (``error``): if no filter of ours
        matches it either, it came through a subscription of an earlier
        config, said and counted; of a template's shape but a tenant the
        template does not list (a tenant moved to another shard), it is
        written all the same, since this session may be the only one that
        held it (writes are idempotent). Else ``error`` is raised again."""
        if not self._subscribed(topic):
            self._stale_subscription(topic)
            unlisted = self._matcher.unlisted(topic)
            if unlisted is not None:
                return unlisted
        raise error

    def _subscribed(self, topic: str) -> bool:
        """Whether one of this config's filters matches the topic."""
        levels = tuple(topic.split("/"))
        return any(covers(f, levels) for f in self._filters)

    def _stale_subscription(self, topic: str) -> None:
        """A message no filter of ours matches: the broker keeps a persistent
        session's subscriptions, so an earlier config's (a wider template
        before a shard of tenants) still delivers, and messages under both
        arrive twice. MQTT cannot list a session's subscriptions: say what
        to do, once a minute."""
        self._stats.stale_subscription += 1
        now = time.monotonic()
        if now - self._stale_said >= STALE_SUBSCRIPTION_EVERY:
            self._stale_said = now
            log.warning(
                "a message on %r matches none of this config's topic filters (%s): the "
                "broker session holds a subscription of an earlier config, and messages "
                "under both arrive twice (those of a template's shape are written all the "
                "same). Start this config under a new mqtt.client_id, then `gateway "
                "forget-session` the old one (%d such messages so far)",
                topic,
                ", ".join(self.subscriptions),
                self._stats.stale_subscription,
            )

    def classify(self, delivery: Delivery) -> Item:
        """Never raises: a bad message is data (a Rejection), not an exception."""
        tenant = ""
        device: str | None = None
        try:
            try:
                tenant, device = self._matcher.match(delivery.topic)
            except DecodeError as exc:
                tenant, device = self._unsubscribed(delivery.topic, exc)
            event = self._decoder.decode(
                tenant,
                device,
                delivery.payload,
                delivery.content_type,
                delivery.received_ms,
                delivery.received_us,
            )
        except DecodeError as exc:
            if not tenant:
                tenant = self._matcher.tenant_of(delivery.topic)
            return Item(delivery, None, rejection(delivery, tenant, device, exc.reason, exc.detail))
        if event.ts_from_receive:
            self._stats.no_ts += 1
            if delivery.redelivered or delivery.retained:
                # Its receive time says nothing of its age: it goes behind every
                # timed write of the device (gateway/store/latest.py).
                event.untimed_redelivery = True
                event.untimed_resent = not delivery.retained
                event.write_ts %= 1000
        # Judged at the message's arrival time: a backlog drained from the spool
        # keeps the rate it arrived at, and does not look noisy.
        now = delivery.received_ms / 1000
        if delivery.received_ms - event.ts_ms > self._backfill_ms:
            # Kept without sampling, yet within the device quota; and the
            # sampler must still see the state it brings: the device's next
            # state change is judged against it.
            admission = self._sampler.admission(tenant, device, now)
            if admission is QUOTA_REFUSED:
                self._sampler.count_refused(tenant)
                return self._over_quota(delivery, tenant, device)
            self._sampler.observe(tenant, device, event.state, event.write_ts)
            behind = bool(self._pending) and (tenant, device) in self._pending
            return self._queued(
                Item(delivery, event, None, _BACKFILL, admission is QUOTA_PENDING or behind)
            )
        if self._pending and (tenant, device) in self._pending:
            verdict = QUOTA_PENDING  # behind its events still pending, decided after them
        else:
            verdict = self._sampler.decide(
                tenant,
                device,
                delivery.topic,
                event.state,
                event.metrics,
                event.write_ts,
                now,
                event.value_num,
            )
        if verdict is QUOTA_REFUSED:
            return self._over_quota(delivery, tenant, device)
        return self._queued(Item(delivery, event, None, verdict, verdict is QUOTA_PENDING))

    def _queued(self, item: Item) -> Item:
        """Keep an item pending its quota with its device's (``_pending``)."""
        if item.quota_pending:
            event = item.event
            assert event is not None
            self._pending.setdefault((event.tenant, event.device_id), []).append(item)
        return item

    def take_pending(self, key: tuple[str, str]) -> list[Item]:
        """The device's items pending its quota, oldest first, to be decided
        now (Pipeline._settle_quota): its next events are decided as they come."""
        return self._pending.pop(key, [])

    def _over_quota(self, delivery: Delivery, tenant: str, device: str) -> Item:
        """A device the quota refused within QUOTA_RECHECK: rejected, counted."""
        return Item(delivery, None, over_quota(delivery, tenant, device, self._stats))


class Pipeline:
    """Everything between a delivery and its acknowledgement."""

    def __init__(
        self,
        config: Config,
        classifier: Classifier,
        latest: LatestState,
        rotation: StateRotation,
        telemetry: Telemetry,
        rejects: Rejects,
        sink: Sink,
        stats: Stats,
        flow: Flow,
        *,
        rollups: RollupMarks | None = None,
        metadata: Metadata | None = None,
        quota: DeviceQuota | None = None,
    ) -> None:
        self._rollups = rollups
        self._metadata = metadata
        self._quota = quota
        self._sampler = classifier.sampler
        self._max_states = config.pipeline.max_states_per_tenant
        self._classify = classifier.classify
        self._classifier = classifier
        self._latest = latest
        self._rotation = rotation
        self._telemetry = telemetry
        self._rejects = rejects
        self._sink = sink
        self._stats = stats
        self._flow = flow
        self._queue = ItemQueue(config.pipeline.queue_size)
        self._overflow: deque[Item | object] = deque()
        self._low_water = config.pipeline.queue_size // 2
        self._batch = config.pipeline.batch_max_events
        self._linger = config.pipeline.linger
        # Per device, its newest queued event that will surely write the
        # latest tables (_note_queued): a chunk's older events of the device
        # leave them to it. Entries leave with their event (_taken), so
        # this holds at most the queued events.
        self._queued_newest: dict[tuple[str, str], Event] = {}
        self._arrival_rate = 0.0  # messages/s (_count_arrivals)
        self._arrivals = 0
        self._window_ms = 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def backlogged(self) -> bool:
        """More than half the queue waits (the mark below which reading
        resumes): the writer is behind what arrives. With QoS 1 the broker's
        window (``mqtt.receive_maximum``) bounds the queue, by default at
        that mark."""
        return bool(self._overflow) or self._queue.qsize() > self._low_water

    @property
    def idle(self) -> bool:
        """Nothing queued or held and no Cassandra request in flight."""
        held = self._metadata is not None and not self._metadata.idle
        return self._queue.empty() and not held and self._sink.idle

    def accept(self, delivery: Delivery) -> None:
        """A push source's handler: classify and enqueue; never blocks, never drops.

        When the queue fills, reading from the broker pauses (TCP holds the rest
        back). A message read after that, in the same socket read, is held in
        arrival order in a small overflow list (counted) until there is room.
        """
        item = self._classify(delivery)
        self._read_ahead(item)
        self._note_queued(item)
        if self._overflow or self._queue.full():
            self._overflow.append(item)
            self._stats.overflow += 1
            self._flow.pause_reading()
            return
        self._queue.put_nowait(item)
        if self._queue.full():
            self._flow.pause_reading()

    async def put(self, delivery: Delivery) -> None:
        """A pull source's handler: classify and enqueue, waiting for room."""
        item = self._classify(delivery)
        self._read_ahead(item)
        self._note_queued(item)
        await self._queue.put(item)

    def _read_ahead(self, item: Item) -> None:
        event = item.event
        if event is not None and item.verdict.update_latest:
            self._latest.read_ahead(event)  # its device's newest write, unless known

    def _note_queued(self, item: Item) -> None:
        """Remember the event if it is its device's newest queued one that
        is sure to write the latest tables when its chunk comes: with a
        state, decided (no quota to settle), not sampled out of them, and
        delivered again should the gateway die before writing it (by the
        broker at QoS 1, unacknowledged until then; by the spool, whose
        record stays until then). Whether its state is registered is asked
        when a chunk would rely on it."""
        event = item.event
        if (
            event is None
            or event.state is None
            or item.quota_pending
            or not item.verdict.update_latest
            or not item.delivery.ack.comes_back
        ):
            return
        key = (event.tenant, event.device_id)
        known = self._queued_newest.get(key)
        if known is None or _newer(event, known):
            self._queued_newest[key] = event

    def _taken(self, item: Item) -> None:
        """The item left the queue for a chunk: no longer a later event."""
        event = item.event
        if event is not None:
            key = (event.tenant, event.device_id)
            if self._queued_newest.get(key) is event:
                del self._queued_newest[key]

    def _refill(self) -> None:
        queue, overflow = self._queue, self._overflow
        while overflow and not queue.full():
            queue.put_nowait(overflow.popleft())
        if not overflow and queue.qsize() <= self._low_water:
            self._flow.resume_reading()

    def close(self) -> None:
        """No more deliveries: the write loop finishes what is queued, then returns."""
        self._overflow.append(_STOP)
        self._refill()

    def tick(self) -> None:
        """Start rotations that came due with the last events although none
        follow (an idle gateway): the write loop does it between chunks, the
        one place no write is being built. Skipped when the queue is busy:
        then the next chunk does it."""
        if self._latest.due and not self._overflow and self._queue.empty():
            self._queue.put_nowait(_TICK)

    async def _start_rotations(self) -> None:
        if self._latest.due:
            # State partitions to rotate into a fresh generation
            # (store/rotate.py): the writes in flight land first, so the copy
            # sees every one that went to the old generation only.
            await self._sink.drain()
            await self._rotation.begin_due()

    async def write_loop(self) -> None:
        """Take chunks off the queue and write them until close(); the
        latest writer's read-ahead and the metadata worker run beside, as
        long as this does."""
        async with asyncio.TaskGroup() as tasks:
            reader = tasks.create_task(self._latest.reader())
            if self._metadata is not None:
                tasks.create_task(self._metadata.run())
            await self._write_chunks()
            reader.cancel()  # nothing is queued any more

    def _should_linger(self) -> bool:
        """Wait ``linger`` for a fuller chunk? Yes when Cassandra is busy
        anyway, or when the last second's arrival rate expects at least one
        more message within ``linger``: a chunk of several costs far fewer
        wake-ups of this process, the driver's threads and Cassandra than
        one chunk each (live at 500 msg/s, about 40% of the gateway's CPU;
        bench/PERFORMANCE.md). A sparse stream goes out at once."""
        if self._queue.qsize() >= self._batch:
            return False
        return bool(self._stats.in_flight) or self._arrival_rate * self._linger >= 1.0

    def _count_arrivals(self, chunk: list[Item]) -> None:
        """The arrival rate (messages/s, by receive time) over windows of about a second."""
        self._arrivals += len(chunk)
        newest = chunk[-1].delivery.received_ms
        elapsed = newest - self._window_ms
        if elapsed >= 1000:
            self._arrival_rate = self._arrivals * 1000 / elapsed
            self._arrivals = 0
            self._window_ms = newest

    async def _write_chunks(self) -> None:
        queue = self._queue
        while True:
            first = await queue.get()
            if first is _TICK:
                await self._start_rotations()
                continue
            chunk: list[Item] = []
            stop = first is _STOP
            if not stop:
                chunk.append(first)  # type: ignore[arg-type]
                self._taken(first)  # type: ignore[arg-type]
                if self._linger and self._should_linger():
                    self._stats.lingers += 1
                    await asyncio.sleep(self._linger)
            while not stop and len(chunk) < self._batch and not queue.empty():
                item = queue.get_nowait()
                if item is _STOP:
                    stop = True
                    break
                if item is _TICK:
                    continue  # this chunk starts them anyway
                chunk.append(item)  # type: ignore[arg-type]
                self._taken(item)  # type: ignore[arg-type]
            self._refill()
            self._stats.queue_depth = queue.qsize()
            if chunk:
                self._count_arrivals(chunk)
                self._stats.chunks += 1
                await self._write_chunk(chunk)
            if stop:
                if self._metadata is not None:
                    await self._metadata.close()  # its held rows submitted
                await self._sink.drain()
                return

    async def _settle_quota(self, chunk: list[Item]) -> None:
        """Admit or refuse the devices of the chunk's pending events (their
        tenants' quotas are in Cassandra: store/quota.py), before anything
        of them is written: a refused device's events become rejections, an
        admitted device's get the sampler's verdict, in queue order."""
        pending = [item for item in chunk if item.quota_pending]
        if not pending:
            return
        sampler = self._sampler
        wanted: dict[tuple[str, str], int] = {}
        refused: set[tuple[str, str]] = set()  # by an earlier chunk's settle
        for item in pending:
            event = item.event
            assert event is not None
            key = (event.tenant, event.device_id)
            if key in wanted or key in refused:
                continue
            admission = sampler.admission(*key)
            cap = sampler.quota(event.tenant)
            if admission is QUOTA_REFUSED:
                refused.add(key)
            elif admission is QUOTA_PENDING and cap is not None:
                wanted[key] = cap
        if wanted and self._quota is not None:
            settled = await self._quota.settle(wanted)
            for key in wanted:
                sampler.settled(*key, admitted=key not in settled)
            refused |= settled
        # Every pending event of these devices, this chunk's and those still
        # queued behind it, in order: left for their own chunks, they kept the
        # devices' newer events pending too for as long as a backlog lasted,
        # out of the cross-chunk coalescing (_note_queued).
        in_chunk = {id(item) for item in pending}
        keys: dict[tuple[str, str], None] = {}
        for item in pending:
            event = item.event
            assert event is not None
            keys[(event.tenant, event.device_id)] = None
        for key in keys:
            for item in self._classifier.take_pending(key):
                event = item.event
                assert event is not None
                delivery = item.delivery
                item.quota_pending = False
                if key in refused:
                    sampler.count_refused(event.tenant)
                    item.rejection = over_quota(delivery, *key, self._stats)
                    item.event = None
                    continue
                if item.verdict is QUOTA_PENDING:  # back-fill keeps its own
                    item.verdict = sampler.decide(
                        event.tenant,
                        event.device_id,
                        delivery.topic,
                        event.state,
                        event.metrics,
                        event.write_ts,
                        delivery.received_ms / 1000,
                        event.value_num,
                    )
                if id(item) not in in_chunk:
                    self._note_queued(item)  # still queued: now a later event like any

    async def _write_chunk(self, chunk: list[Item]) -> None:
        await self._settle_quota(chunk)
        events = [item.event for item in chunk if item.event is not None]
        over: list[Event] = []
        stale: set[int] = set()
        if events:
            new = await self._latest.new_states(events)
            if new:
                # Writes in flight may belong to newer events whose deletes did
                # not cover a new state: let them land before registering it.
                await self._sink.drain()
                await self._latest.register(new)
            over = await self._latest.over_budget(events)
        over_ids = {id(e) for e in over}
        if events:
            # The newest write of devices met for the first time. (Metadata's
            # reads and entry counts are not awaited here: its worker does
            # them, holding the events' acknowledgements; store/metadata.py.)
            stale = await self._latest.prepare_chunk(events, over_ids)
            await self._start_rotations()
        skip = over_ids | stale
        # Latest-table writes are last-write-wins by event time, so of several
        # events of one device in a chunk only the newest needs them (its
        # writes shadow the others'). Devices with a state-less event in the
        # chunk are left alone: that event doesn't move the device between states.
        newest: dict[tuple[str, str], Event] = {}
        stateless: set[tuple[str, str]] = set()
        for item in chunk:
            e = item.event
            if e is None or id(e) in skip or not item.verdict.update_latest:
                continue
            key = (e.tenant, e.device_id)
            if e.state is None:
                stateless.add(key)
            current = newest.get(key)
            if current is None or _newer(e, current):
                newest[key] = e
        # And of a device with a newer event still queued that will write
        # them (_note_queued; its state already registered, so no budget can
        # refuse it), none in this chunk does: a backlog's device writes its
        # latest rows once per stretch of the queue, not once per chunk. If
        # the gateway dies first, the queued event was not acknowledged and
        # comes again; the prepare_chunk above recorded this chunk's newest
        # write time, which that event is above.
        later = self._queued_newest
        if later:
            for key, e in list(newest.items()):
                queued = later.get(key)
                if (
                    queued is not None
                    and key not in stateless
                    and _newer(queued, e)
                    and self._latest.registered(queued.tenant, queued.state)
                ):
                    del newest[key]
        writes: list[Write] = []
        held: Held = []
        stats = self._stats
        rollups, metadata = self._rollups, self._metadata
        for item in chunk:
            pending = Pending(self._done_callback(item))
            event = item.event
            if event is not None and id(event) in over_ids:
                detail = (
                    f"state {event.state!r} would exceed the tenant's "
                    f"{self._max_states} states (pipeline.max_states_per_tenant)"
                )
                item.rejection = rejection(
                    item.delivery, event.tenant, event.device_id, "too_many_states", detail
                )
                item.event = event = None
            if event is not None:
                key = (event.tenant, event.device_id)
                verdict = item.verdict
                if (
                    verdict.update_latest
                    and id(event) not in stale
                    and (newest.get(key) is event or key in stateless)
                ):
                    mine = self._latest.writes(event, pending)
                else:
                    mine = []
                    stats.coalesced += 1
                rows = [] if metadata is None else metadata.writes_now(event, pending)
                if rows is None:
                    held.append((event, pending))  # acknowledged once the worker is done
                else:
                    mine += rows
                if verdict.keep_raw:
                    mine += self._telemetry.writes(event, pending)
                    if rollups is not None:
                        # Its window's dirty mark goes with the raw row, so it
                        # is in Cassandra before the ack (store/rollups.py).
                        mine += rollups.writes(event, pending)
                else:
                    stats.sampled_out += 1
                    stats.sampled_out_by_tenant.add(event.tenant)
                if not mine and rows is not None:
                    # Decided and accounted for: nothing to write, acknowledge.
                    pending.on_done()
                writes += mine
            else:
                assert item.rejection is not None
                writes += self._rejects.writes(item.rejection, pending)
        await self._sink.submit(writes)
        if metadata is not None:
            # Each held pending has an extra count since writes_now, so its
            # other writes could not complete it during the submit; the worker
            # gives it back after submitting the event's metadata rows.
            await metadata.hold(held)

    def _done_callback(self, item: Item) -> Callable[[], None]:
        stats = self._stats

        def done() -> None:
            event = item.event
            if event is not None and item.verdict.keep_raw:
                stats.written += 1
                if event.sent_at_ms is not None:
                    # Publisher's clock to ours: meaningful when they agree (NTP).
                    stats.write_latency.observe(max(0.0, time.time() - event.sent_at_ms / 1000))
            item.delivery.ack.done()

        return done
