"""The consume loop every service uses for its durable JetStream consumers.

One module because it is one consume loop: the pull feed, the direct hand-off, presence,
progress reports and dead letters together decide when a message is acked, and the contract
below is only checkable read as a whole.

Contract (docs/architecture.md, "Reliability"):
- decode strictly into the consumer's event type; an undecodable message is dead-lettered to
  ``rmesh.dlq.<stream>`` with the reason and acked: it never stops the consumer;
- call the handler inside a consumer span whose parent is the message's creation context;
- ack only after the handler's effect; skip an `event_id` already handled (redelivery);
- on a transient error, nak with a growing delay; past ``max_deliver`` dead-letter with the reason;
  a `PermanentError` is dead-lettered at once;
- a long handler reports progress so its message is not redelivered to another replica;
- messages the server gave up on after ``max_deliver`` ack timeouts are dead-lettered too.

Messages are pulled continuously (one outstanding pull sized by free capacity), so a message is
handled as soon as it arrives rather than when a batch fills.

Direct hand-off (``fast_path``, the request path's consumers): the publisher's JetStream
publish is also heard on a core NATS queue subscription to the consumer's subject, so the
handler starts at core NATS latency, before the stream has stored the message and delivered
it. The stored copy stays the record: when it is delivered it is held (progress reported)
until the handler has finished, then acked; if the handler failed it takes the usual path
(nak with backoff, dead letter); if the process dies meanwhile it is redelivered. Replicas of
one durable announce themselves on ``rmesh.presence.<durable>``: the direct hand-off runs only
in a replica that hears no other (a direct copy and the stored copy could otherwise go to two
replicas, and the request be handled twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from schemas.events import DeadLetter, derived_event_id, new_event_id
from schemas.subjects import ConsumerSpec, dlq_subject
from services.mesh.bus import DIRECT_SOURCES, Bus, direct_subject, stream_subject_of
from services.mesh.inline_sub import subscribe_inline
from services.mesh.tracing import REQUEST_ID, LateSpan, extract_context, subject_family

log = logging.getLogger(__name__)

E = TypeVar("E")

MESSAGES = Counter(
    "ripplemesh_consumer_messages_total",
    "Messages handled by a consumer, by outcome.",
    ["consumer", "outcome"],
)
HANDLER_SECONDS = Histogram(
    "ripplemesh_consumer_handler_seconds",
    "Time from delivery to ack.",
    ["consumer"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

PULL_EXPIRES_S = 5.0
PULL_HEARTBEAT_S = 1.0
MAX_PULL_BATCH = 256
SEEN_IDS_KEPT = 50_000
# Direct hand-off: replicas of a durable announce themselves every PRESENCE_EVERY_S on
# PRESENCE_PREFIX + durable; one not heard for PEER_TIMEOUT_S is gone. A replica listens for
# LISTEN_BEFORE_DIRECT_S before it takes messages directly, and starts pulling
# ANNOUNCE_BEFORE_PULL_S after its first announcement: a replica that was alone and taking
# messages directly has heard it by then and stopped, and the stored copies of what it took
# just before (stored and delivered within milliseconds) have gone to its own pull.
PRESENCE_PREFIX = "rmesh.presence."
PRESENCE_EVERY_S = 1.0
PEER_TIMEOUT_S = 3.0
LISTEN_BEFORE_DIRECT_S = 1.5
ANNOUNCE_BEFORE_PULL_S = 0.1


class PermanentError(Exception):
    """The message is valid but can never be processed: dead-letter it now, do not retry."""


class Deferred(Exception):
    """Not this consumer's to handle now: put the message back, delivered again after `delay_s`
    if it has deliveries left (a failure neither logged nor counted as one)."""

    def __init__(self, delay_s: float, reason: str):
        super().__init__(reason)
        self.delay_s = delay_s


@dataclass(frozen=True, slots=True)
class Delivery:
    subject: str
    headers: dict[str, str]
    num_delivered: int
    stream_seq: int


Handler = Callable[[E, Delivery], Awaitable[None]]
# Told of a message that does not decode (with the reason), before it is dead-lettered: a
# consumer whose senders wait for an answer (ingress's NATS clients) can still give one.
UndecodableHook = Callable[[Delivery, bytes, str], Awaitable[None]]


class _SeenIds:
    """Recently handled event ids (bounded): a redelivered message is acked, not reprocessed."""

    def __init__(self, capacity: int = SEEN_IDS_KEPT):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def add(self, event_id: str) -> None:
        self._ids[event_id] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)


class _ProgressReporter:
    """Tells the server a message is still being worked on, every `interval_s`, until cancelled.

    A timer rather than a task: most handlers finish long before the first tick.
    """

    def __init__(self, msg: Msg, interval_s: float):
        self._msg = msg
        self._interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(interval_s, self._tick)
        self._sending: asyncio.Task[None] | None = None

    def _tick(self) -> None:
        self._sending = self._loop.create_task(self._send())
        self._handle = self._loop.call_later(self._interval_s, self._tick)

    async def _send(self) -> None:
        with contextlib.suppress(Exception):
            await self._msg.in_progress()

    def cancel(self) -> None:
        self._handle.cancel()
        if self._sending is not None:
            self._sending.cancel()


# What the pull loop is told of a message already handed to `deliver`.
_DELIVERED = object()


class PullFeed:
    """Keeps one pull request outstanding on a durable consumer and hands each message to
    `deliver` as it arrives (no queue between its arrival and its handler)."""

    def __init__(
        self,
        bus: Bus,
        stream: str,
        durable: str,
        free_capacity: Callable[[], int],
        capacity_freed: asyncio.Event,
        deliver: Callable[[Msg], None],
    ):
        self._bus = bus
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._free_capacity = free_capacity
        self._capacity_freed = capacity_freed
        self._deliver = deliver
        # Status messages, a marker per delivered message (for the pull's count), None to stop.
        self._queue: asyncio.Queue[Msg | object | None] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._inbox = ""
        self._stopping = False

    async def start(self) -> None:
        self._inbox = self._bus.nc.new_inbox()

        def on_msg(msg: Msg) -> None:
            status = msg.headers.get("Status") if msg.headers else None
            if status is not None and not msg.data:
                self._queue.put_nowait(msg)
            elif not self._stopping:  # once stopping, left unacked: redelivered elsewhere
                self._deliver(msg)
                self._queue.put_nowait(_DELIVERED)

        # Called from the connection's read loop: the handler's task starts one loop turn sooner.
        self._sub = await subscribe_inline(self._bus.nc, self._inbox, on_msg)

    def stop(self) -> None:
        self._stopping = True
        self._queue.put_nowait(None)
        self._capacity_freed.set()

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def run(self) -> None:
        """Issue pulls for as many messages as there is room for, until stopped."""
        while not self._stopping:
            free = min(self._free_capacity(), MAX_PULL_BATCH)
            if free <= 0:
                self._capacity_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity_freed.wait(), timeout=1.0)
                continue
            request = {
                "batch": free,
                "expires": int(PULL_EXPIRES_S * 1e9),
                "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9),
            }
            try:
                await self._bus.nc.publish(self._api, json.dumps(request).encode(), reply=self._inbox)
            except Exception as exc:  # disconnected: the client reconnects, we retry
                log.warning("pull request failed", extra={"error": repr(exc)})
                await asyncio.sleep(0.25)
                continue
            remaining = free
            while remaining > 0 and not self._stopping:
                if self._queue.empty():
                    try:
                        # Silence past a few heartbeats means the pull was lost (reconnect): reissue.
                        # One timer (wait_for would add a task per message).
                        async with asyncio.timeout(PULL_HEARTBEAT_S * 3):
                            msg = await self._queue.get()
                    except TimeoutError:
                        break
                else:
                    msg = self._queue.get_nowait()
                if msg is None:
                    return
                if msg is _DELIVERED:
                    remaining -= 1
                    continue
                assert isinstance(msg, Msg)
                if msg.headers and msg.headers.get("Status") == "100":
                    continue  # idle heartbeat
                break  # 404 no messages / 408 expired / 409 limits: this pull is over


class Consumer(Generic[E]):
    """Runs one durable consumer's loop until stopped. See the module docstring for the contract."""

    def __init__(
        self,
        bus: Bus,
        spec: ConsumerSpec,
        event_type: Any,
        handler: Handler[E],
        *,
        max_inflight: int = 64,
        fast_path: bool = False,
        on_undecodable: UndecodableHook | None = None,
    ):
        self.bus = bus
        self.spec = spec
        self.handler = handler
        self.on_undecodable = on_undecodable
        self.max_inflight = max_inflight
        self._decoder: msgspec.json.Decoder[E] = msgspec.json.Decoder(event_type)
        self._seen = _SeenIds()
        self._inflight: set[asyncio.Task[None]] = set()
        self._capacity_freed = asyncio.Event()
        self._feed = PullFeed(bus, spec.stream, spec.durable, self._free, self._capacity_freed, self._start)
        self._loop_task: asyncio.Task[None] | None = None
        self._advisory_sub: Subscription | None = None
        # event_id -> its handler running now (either path), with the stored copy once delivered.
        self._running: dict[str, _Running] = {}
        self._presence: _Presence | None = _Presence(bus, spec.durable) if fast_path else None
        # The per-message metrics' children, looked up once.
        self._count_ok = MESSAGES.labels(spec.durable, "ok")
        self._count_direct = MESSAGES.labels(spec.durable, "direct")
        self._count_duplicate = MESSAGES.labels(spec.durable, "duplicate")
        self._handler_seconds = HANDLER_SECONDS.labels(spec.durable)
        self._direct_sub: Subscription | None = None
        self._stopping = False

    def _free(self) -> int:
        return self.max_inflight - len(self._inflight)

    async def start(self) -> None:
        await self.bus.ensure_consumer(self.spec)
        await self._feed.start()
        advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.spec.stream}.{self.spec.durable}"
        self._advisory_sub = await self.bus.nc.subscribe(advisory, cb=self._on_max_deliveries)
        if self._presence is not None:
            await self._presence.start()
            # Publishers in the mesh send a direct copy (bus.py); others (a tenant's client on
            # rmesh.req) only publish to the stream: their publish itself is heard.
            subject = self.spec.filter_subject
            if subject.startswith(DIRECT_SOURCES):
                subject = direct_subject(subject)
            # Inline like the pull's inbox: a direct copy is seen before its stored copy, which
            # the server sends after it.
            self._direct_sub = await subscribe_inline(
                self.bus.nc, subject, self._on_direct, queue=self.spec.durable
            )
        self._loop_task = asyncio.create_task(self._run(), name=f"consume-{self.spec.durable}")

    async def _run(self) -> None:
        if self._presence is not None:
            await asyncio.sleep(ANNOUNCE_BEFORE_PULL_S)
        await self._feed.run()

    def _start(self, msg: Msg) -> None:
        """A stored copy delivered by the pull."""
        if self._running or self._presence is not None:
            event_id = msg.headers.get("Nats-Msg-Id") if msg.headers else None
            if event_id:
                running = self._running.get(event_id)
                if running is not None:
                    running.hold(msg, max(self.spec.ack_wait_s / 3, 0.5))
                    return
                if event_id in self._seen:  # taken directly and done: the record goes
                    self._track(asyncio.create_task(self._ack(msg)))
                    self._count_direct.inc()
                    return
        self._track(asyncio.create_task(self._handle(msg)))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._inflight.add(task)
        task.add_done_callback(self._done)

    def _on_direct(self, msg: Msg) -> None:
        """The publish itself, heard on core NATS before the stream delivers its stored copy."""
        if self._stopping or self._presence is None or not self._presence.alone() or self._free() <= 0:
            return
        try:
            event = self._decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the stored copy is dead-lettered
        event_id: str = getattr(event, "event_id", "")
        if not event_id or event_id in self._running or event_id in self._seen:
            return
        running = _Running()
        self._running[event_id] = running
        self._track(asyncio.create_task(self._handle_direct(msg, event, event_id, running)))

    async def _handle_direct(self, msg: Msg, event: E, event_id: str, running: _Running) -> None:
        started = time.perf_counter()
        name = self.spec.durable
        headers = msg.headers or {}
        subject = stream_subject_of(msg.subject)
        delivery = Delivery(subject, headers, 1, 0)
        failure: Exception | None = None
        late = self._process_span(subject, headers, event, event_id, 1, {"ripple.direct": True})
        try:
            with late.activate() as span:
                try:
                    await self.handler(event, delivery)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    span.set_status(Status(StatusCode.ERROR, repr(exc)))
                    failure = exc
        except asyncio.CancelledError:
            # Shutdown mid-handler: the stored copy stays unacked and is redelivered.
            self._running.pop(event_id, None)
            running.release()
            raise
        finally:
            late.record()
        self._running.pop(event_id, None)
        stored = running.release()
        if failure is None:
            self._seen.add(event_id)
            if stored is not None:
                await self._ack(stored)
            self._count_ok.inc()
            self._handler_seconds.observe(time.perf_counter() - started)
            return
        # Failed: the stored copy takes the usual path (here now, or when it is delivered).
        if stored is None:
            log.warning(
                "direct handler failed; the stored copy retries",
                extra={"consumer": name, "error": repr(failure)},
            )
            return
        stored_delivery = _delivery_of(stored)
        if isinstance(failure, PermanentError):
            await self._dead_letter(stored, stored_delivery, f"rejected by handler: {failure}")
            MESSAGES.labels(name, "dead_lettered").inc()
        else:
            await self._retry_or_dead_letter(stored, stored_delivery, failure)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._capacity_freed.set()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop fetching, let in-flight handlers finish (up to `grace_s`), then cancel the rest."""
        self._stopping = True
        self._feed.stop()
        if self._direct_sub is not None:
            with contextlib.suppress(Exception):
                await self._direct_sub.unsubscribe()
        if self._presence is not None:
            await self._presence.stop()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._loop_task, timeout=2.0)
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        await self._feed.close()
        if self._advisory_sub is not None:
            with contextlib.suppress(Exception):
                await self._advisory_sub.unsubscribe()

    # ------------------------------------------------------------ one message

    async def _handle(self, msg: Msg) -> None:
        started = time.perf_counter()
        name = self.spec.durable
        delivery = _delivery_of(msg)
        headers = delivery.headers
        try:
            event = self._decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if self.on_undecodable is not None:
                try:
                    await self.on_undecodable(delivery, msg.data, str(exc))
                except Exception as hook_exc:  # the dead letter below still keeps the message
                    log.warning("undecodable-message hook failed", extra={"error": repr(hook_exc)})
            await self._dead_letter(msg, delivery, f"undecodable: {exc}")
            MESSAGES.labels(name, "dead_lettered").inc()
            return
        event_id: str = getattr(event, "event_id", "")
        if event_id and event_id in self._seen:
            await self._ack(msg)
            self._count_duplicate.inc()
            return
        if self._presence is not None and event_id:
            running = self._running.get(event_id)
            if running is not None:  # its direct copy is being handled: this one waits for it
                running.hold(msg, max(self.spec.ack_wait_s / 3, 0.5))
                return
            # Its direct copy, if it comes later, is left to this one.
            placeholder = _Running()
            self._running[event_id] = placeholder
            try:
                await self._handle_event(msg, delivery, headers, event, event_id, started)
            finally:
                self._running.pop(event_id, None)
                redelivered = placeholder.release()
            if redelivered is not None:  # delivered again meanwhile: settle that delivery too
                if event_id in self._seen:
                    await self._ack(redelivered)
                else:
                    self._track(asyncio.create_task(self._handle(redelivered)))
            return
        await self._handle_event(msg, delivery, headers, event, event_id, started)

    def _process_span(
        self,
        subject: str,
        headers: dict[str, str],
        event: object,
        event_id: str,
        delivery_count: int,
        extra: dict[str, Any] | None = None,
    ) -> LateSpan:
        """The consumer span of one handling (OTel messaging conventions), child of the
        publisher's context carried in the headers. Built by the SDK once the handler is done
        (LateSpan): the handler's own message does not wait on it."""
        attributes: dict[str, Any] = {
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.destination.name": subject,
            "messaging.consumer.group.name": self.spec.durable,
            "messaging.message.id": event_id,
            "messaging.message.delivery_count": delivery_count,
        }
        if extra:
            attributes.update(extra)
        request_id = _request_id_of(event)
        if request_id is not None:
            attributes[REQUEST_ID] = request_id
        return LateSpan(
            f"process {subject_family(subject)}",
            context=extract_context(headers),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        )

    async def _handle_event(
        self, msg: Msg, delivery: Delivery, headers: dict[str, str], event: E, event_id: str, started: float
    ) -> None:
        name = self.spec.durable
        late = self._process_span(msg.subject, headers, event, event_id, delivery.num_delivered)
        try:
            with late.activate() as span:
                progress = _ProgressReporter(msg, max(self.spec.ack_wait_s / 3, 0.5))
                try:
                    await self.handler(event, delivery)
                except asyncio.CancelledError:
                    # Shutdown mid-handler: leave it unacked; it is redelivered to a live replica.
                    raise
                except PermanentError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    await self._dead_letter(msg, delivery, f"rejected by handler: {exc}")
                    MESSAGES.labels(name, "dead_lettered").inc()
                    return
                except Deferred as exc:
                    span.set_attribute("ripple.deferred", str(exc))
                    await self._defer(msg, exc)
                    return
                except Exception as exc:
                    span.record_exception(exc)
                    span.set_status(Status(StatusCode.ERROR, repr(exc)))
                    await self._retry_or_dead_letter(msg, delivery, exc)
                    return
                finally:
                    progress.cancel()
        finally:
            late.record()
        if event_id:
            self._seen.add(event_id)
        await self._ack(msg)
        self._count_ok.inc()
        self._handler_seconds.observe(time.perf_counter() - started)

    async def _defer(self, msg: Msg, deferred: Deferred) -> None:
        with contextlib.suppress(Exception):
            await msg.nak(delay=deferred.delay_s)
        MESSAGES.labels(self.spec.durable, "deferred").inc()

    async def _retry_or_dead_letter(self, msg: Msg, delivery: Delivery, exc: Exception) -> None:
        if isinstance(exc, Deferred):  # a direct copy's handler deferred it: so is the stored one
            await self._defer(msg, exc)
            return
        attempt = delivery.num_delivered
        if attempt >= self.spec.max_deliver:
            await self._dead_letter(msg, delivery, f"failed after {attempt} deliveries: {exc!r}")
            MESSAGES.labels(self.spec.durable, "dead_lettered").inc()
            return
        backoff = self.spec.backoff_s[min(attempt - 1, len(self.spec.backoff_s) - 1)]
        log.warning(
            "handler failed; will retry",
            extra={"consumer": self.spec.durable, "attempt": attempt, "error": repr(exc)},
        )
        with contextlib.suppress(Exception):
            await msg.nak(delay=backoff)
        MESSAGES.labels(self.spec.durable, "retried").inc()

    async def _dead_letter(self, msg: Msg, delivery: Delivery, reason: str) -> None:
        letter = DeadLetter(
            event_id=new_event_id(),
            occurred_at=time.time(),
            stream=self.spec.stream,
            consumer=self.spec.durable,
            subject=msg.subject,
            reason=reason[:2000],
            num_delivered=delivery.num_delivered,
            headers=delivery.headers,
            data=msg.data,
        )
        log.warning("dead-lettered", extra={"consumer": self.spec.durable, "reason": reason[:300]})
        try:
            await self.bus.publish(dlq_subject(self.spec.stream), letter)
        except Exception as exc:
            # Nothing is lost: without a dead letter stored the message stays on its stream.
            log.error("dead-letter publish failed", extra={"error": repr(exc)})
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        await self._ack(msg)

    async def _ack(self, msg: Msg) -> None:
        try:
            await msg.ack()
        except Exception as exc:  # connection lost: the message is redelivered and deduplicated
            log.warning("ack failed", extra={"error": repr(exc)})

    async def _on_max_deliveries(self, advisory: Msg) -> None:
        """The server gave up on a message (ack timeouts): copy it to the dead-letter stream."""
        try:
            body = json.loads(advisory.data)
            seq = int(body["stream_seq"])
            stored = await self.bus.js.get_msg(self.spec.stream, seq)
            letter = DeadLetter(
                # Every replica of this consumer hears the advisory; one id stores it once.
                event_id=derived_event_id(f"{self.spec.stream}:{seq}", "max_deliveries"),
                occurred_at=time.time(),
                stream=self.spec.stream,
                consumer=self.spec.durable,
                subject=stored.subject or "",
                reason=f"not acked after max_deliver={body.get('deliveries')} deliveries",
                num_delivered=int(body.get("deliveries", 0)),
                headers=dict(stored.headers or {}),
                data=stored.data or b"",
            )
            await self.bus.publish(dlq_subject(self.spec.stream), letter)
            with contextlib.suppress(Exception):
                await self.bus.js.delete_msg(self.spec.stream, seq)
        except Exception as exc:
            log.error("max-deliveries advisory not handled", extra={"error": repr(exc)})


def _delivery_of(msg: Msg) -> Delivery:
    headers = dict(msg.headers or {})
    try:
        meta = msg.metadata
        return Delivery(msg.subject, headers, meta.num_delivered, meta.sequence.stream)
    except Exception:
        return Delivery(msg.subject, headers, 1, 0)


class _Running:
    """A handler running for one event id, and the stored copy waiting for its outcome."""

    __slots__ = ("_progress", "stored")

    def __init__(self) -> None:
        self.stored: Msg | None = None
        self._progress: _ProgressReporter | None = None

    def hold(self, msg: Msg, progress_every_s: float) -> None:
        """The stored copy arrived while the handler runs: keep it (reporting progress)."""
        if self._progress is not None:
            self._progress.cancel()
        self.stored = msg  # a redelivery replaces the previous delivery: only its ack counts
        self._progress = _ProgressReporter(msg, progress_every_s)

    def release(self) -> Msg | None:
        if self._progress is not None:
            self._progress.cancel()
            self._progress = None
        return self.stored


class _Presence:
    """The replicas of one durable, heard on core NATS: the direct hand-off runs only alone."""

    def __init__(self, bus: Bus, durable: str):
        self._bus = bus
        self._subject = PRESENCE_PREFIX + durable
        self._me = new_event_id().encode()
        self._peers: dict[bytes, float] = {}
        self._started = 0.0
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._started = time.monotonic()

        async def heard(msg: Msg) -> None:
            if msg.data != self._me:
                if msg.data.startswith(b"bye:"):
                    self._peers.pop(msg.data[4:], None)
                else:
                    self._peers[msg.data] = time.monotonic()

        self._sub = await self._bus.nc.subscribe(self._subject, cb=heard)
        self._task = asyncio.create_task(self._announce(), name=f"presence-{self._subject}")

    async def _announce(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._bus.nc.publish(self._subject, self._me)
            await asyncio.sleep(PRESENCE_EVERY_S)

    def alone(self) -> bool:
        now = time.monotonic()
        if now - self._started < LISTEN_BEFORE_DIRECT_S:
            return False
        if self._peers:
            for peer, heard_at in list(self._peers.items()):
                if now - heard_at > PEER_TIMEOUT_S:
                    del self._peers[peer]
            return not self._peers
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self._bus.nc.publish(self._subject, b"bye:" + self._me)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


def _request_id_of(event: object) -> str | None:
    request_id = getattr(event, "request_id", None)
    if request_id is None:
        inner = getattr(event, "request", None)
        request_id = getattr(inner, "request_id", None)
    return request_id if isinstance(request_id, str) else None
