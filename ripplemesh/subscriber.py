"""Subscribers: your own service on the mesh's event stream, in a few lines.

    from ripplemesh.subscriber import Subscriber
    from schemas.events import PrefillCompleted

    alerts = Subscriber("cache-alerts")

    @alerts.on(PrefillCompleted)
    async def prefilled(event: PrefillCompleted, context: Context) -> None:
        ...

    @alerts.on_subject("rmesh.events.scaling_decision")   # or by subject (NATS wildcards)
    async def scaled(event: LifecycleEvent, context: Context) -> None:
        ...

and `ripplemesh run-subscriber mymodule:alerts`. A subscriber reads the lifecycle events
(``rmesh.events.>``: every routing, admission, prefill, decode, failure and scaling decision)
through the same consume loop the mesh's own services use (services/mesh/consumer.py):

- a durable JetStream consumer named after it (restarted, it goes on where it stopped; with
  `durable=False` a fresh one each run), starting from `start_from`: "new", "all" (what the
  stream keeps: LIFECYCLE holds 7 days) or a `datetime`;
- at-least-once: a message is acked once its handler returned; an event already handled
  (its `event_id`) is skipped if redelivered; `Context.event_id` for your own idempotency;
- a handler that raises is retried with backoff, then dead-lettered to ``rmesh.dlq.LIFECYCLE``
  with the reason; one that runs past `handler_timeout_s` counts as raising; raise
  `PermanentError` to dead-letter at once; a message that does not decode is dead-lettered;
  events no handler wants are acked and skipped. A subscriber never dies on a bad message;
- the handler runs in a span continuing the event's trace, and is counted in
  ``ripplemesh_subscriber_events_total{subscriber,handler,outcome}`` and timed in
  ``ripplemesh_subscriber_handler_seconds``;
- `Context.publish` sends an event back; `Context.throttle_tenant` is the documented control
  subject admission honours (a tenant's new requests refused until a time); stopping (SIGTERM,
  or the `stop` event of `run`) lets handlers in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import signal
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nats.js.errors import KeyNotFoundError
from prometheus_client import Counter, Histogram

from schemas.events import Event, LifecycleEvent, TenantThrottle, encode_event, new_event_id
from schemas.subjects import LIFECYCLE, PREFIX, TENANT_THROTTLES, ConsumerSpec
from services.mesh.bus import Bus
from services.mesh.consumer import Consumer, Delivery, PermanentError
from services.mesh.nats_auth import NatsCredentials, load_credentials

__all__ = ["Context", "PermanentError", "Subscriber", "run_subscribers"]

EVENTS = Counter(
    "ripplemesh_subscriber_events_total",
    "Events a subscriber's handlers took, by outcome (ok, error, timeout, skipped).",
    ["subscriber", "handler", "outcome"],
)
HANDLER_SECONDS = Histogram(
    "ripplemesh_subscriber_handler_seconds",
    "Time a subscriber's handler took.",
    ["subscriber", "handler"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)

StartFrom = Literal["new", "all"] | datetime.datetime
EVENTS_PREFIX = f"{PREFIX}.events."
# The event types a subscriber can ask for: those the lifecycle stream carries.
LIFECYCLE_TYPES: frozenset[type] = frozenset(typing.get_args(LifecycleEvent))


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return index == len(wanted) - 1 and len(tokens) > index
        if index >= len(tokens) or (token != "*" and token != tokens[index]):
            return False
    return len(tokens) == len(wanted)


@dataclass(frozen=True, slots=True)
class Context:
    """What a handler gets beside its event."""

    subscriber: str
    subject: str
    event_id: str
    delivered: int  # 1 the first time; more on a redelivery
    bus: Bus

    async def publish(self, subject: str, event: Event) -> None:
        """Publish an event (acknowledged by the stream that keeps `subject`)."""
        await self.bus.publish(subject, event)

    async def throttle_tenant(self, tenant: str, *, until: float, reason: str) -> None:
        """The control subject admission honours: the tenant's new requests are refused (429,
        Retry-After) until `until` (seconds since the epoch). Put in TENANT_THROTTLES."""
        throttle = TenantThrottle(
            event_id=new_event_id(),
            occurred_at=time.time(),
            tenant=tenant,
            until=until,
            reason=reason,
            source=self.subscriber,
        )
        kv = await self.bus.key_value(TENANT_THROTTLES)
        await kv.put(tenant, encode_event(throttle))

    async def lift_throttle(self, tenant: str) -> None:
        kv = await self.bus.key_value(TENANT_THROTTLES)
        with contextlib.suppress(KeyNotFoundError):
            await kv.delete(tenant)


Handler = Callable[[Any, Context], Awaitable[None]]


@dataclass
class Subscriber:
    name: str
    start_from: StartFrom = "new"
    durable: bool = True
    handler_timeout_s: float = 30.0
    max_inflight: int = 64
    # A failing handler's event is delivered again after these delays, at most max_deliver
    # times in all, then dead-lettered with the handler's error.
    max_deliver: int = 5
    retry_backoff_s: tuple[float, ...] = (0.1, 0.5, 2.0, 5.0)
    handlers: dict[type, list[Handler]] = field(default_factory=dict)
    subject_handlers: list[tuple[str, Handler]] = field(default_factory=list)
    consumer: Consumer[Any] | None = None
    bus: Bus | None = None
    _children: dict[str, tuple[Any, Any, Any, Any, Any]] = field(default_factory=dict, repr=False)
    _running: dict[asyncio.Task[Any], float] = field(default_factory=dict, repr=False)
    _overdue: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)
    _watch: asyncio.Task[None] | None = field(default=None, repr=False)

    def on(self, *event_types: type) -> Callable[[Handler], Handler]:
        """Register a handler for these event types (schemas.events classes)."""
        if not event_types:
            raise TypeError("on() needs at least one event type")
        unknown = [getattr(t, "__name__", repr(t)) for t in event_types if t not in LIFECYCLE_TYPES]
        if unknown:
            offered = ", ".join(sorted(t.__name__ for t in LIFECYCLE_TYPES))
            raise TypeError(f"{', '.join(unknown)}: not on the event stream; a subscriber can take {offered}")

        def register(handler: Handler) -> Handler:
            for event_type in event_types:
                self.handlers.setdefault(event_type, []).append(handler)
            return handler

        return register

    def on_subject(self, pattern: str) -> Callable[[Handler], Handler]:
        """Register a handler for every event published on subjects matching `pattern` (NATS
        wildcards, under ``rmesh.events.``; schemas/asyncapi.json lists each event's subject)."""
        if not pattern.startswith(EVENTS_PREFIX) or not pattern[len(EVENTS_PREFIX) :]:
            raise ValueError(f"{pattern!r}: a subscriber reads subjects under {EVENTS_PREFIX}")
        tokens = pattern.split(".")
        if any(t == "" or (("*" in t or ">" in t) and t not in ("*", ">")) for t in tokens) or (
            ">" in tokens[:-1]
        ):
            raise ValueError(f"{pattern!r}: not a NATS subject pattern")

        def register(handler: Handler) -> Handler:
            self.subject_handlers.append((pattern, handler))
            return handler

        return register

    def _handlers_for(self, event: Any, subject: str) -> list[Handler]:
        by_type = self.handlers.get(type(event), [])
        if not self.subject_handlers:
            return by_type
        by_subject = [h for pattern, h in self.subject_handlers if subject_matches(pattern, subject)]
        return by_type + [h for h in by_subject if h not in by_type]

    def spec(self) -> ConsumerSpec:
        durable = self.name if self.durable else f"{self.name}-{int(time.time() * 1000)}"
        if isinstance(self.start_from, datetime.datetime):
            deliver: Literal["all", "new", "by_start_time"] = "by_start_time"
            start_time: float | None = self.start_from.timestamp()
        else:
            deliver, start_time = self.start_from, None
        return ConsumerSpec(
            durable=f"sub-{durable}",
            stream=LIFECYCLE.name,
            filter_subject=f"{PREFIX}.events.>",
            ack_wait_s=max(10.0, self.handler_timeout_s * 1.5),
            max_deliver=self.max_deliver,
            backoff_s=self.retry_backoff_s,
            inactive_threshold_s=None if self.durable else 300.0,
            deliver=deliver,
            start_time=start_time,
        )

    async def start(self, bus: Bus) -> None:
        if not self.handlers and not self.subject_handlers:
            raise ValueError(
                f"subscriber {self.name!r} has no handler (use @subscriber.on(EventType) or .on_subject)"
            )
        self.bus = bus
        consumer: Consumer[Any] = Consumer(
            bus, self.spec(), LifecycleEvent, self._dispatch, max_inflight=self.max_inflight
        )
        await consumer.start()
        self.consumer = consumer
        self._watch = asyncio.create_task(self._watchdog(), name=f"subscriber-{self.name}-watchdog")

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.consumer is not None:
            await self.consumer.stop(grace_s)
            self.consumer = None
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _dispatch(self, event: Any, delivery: Delivery) -> None:
        assert self.bus is not None
        handlers = self._handlers_for(event, delivery.subject)
        if not handlers:
            self._metrics("-")[2].inc()
            return
        context = Context(
            self.name, delivery.subject, getattr(event, "event_id", ""), delivery.num_delivered, self.bus
        )
        task = asyncio.current_task()
        for handler in handlers:
            label = getattr(handler, "__name__", "handler")
            ok, error, _, timeout, seconds = self._metrics(label)
            started = time.perf_counter()
            # The watchdog (one task for the subscriber, not a timer per event: this is every
            # event's path) cancels a handler past its time; that cancellation becomes its error.
            if task is not None:
                self._running[task] = started
            try:
                await handler(event, context)
            except asyncio.CancelledError:
                if task is None or task not in self._overdue:
                    raise  # stopping
                self._overdue.discard(task)
                task.uncancel()
                timeout.inc()
                raise RuntimeError(f"handler {label} ran past {self.handler_timeout_s:g} s") from None
            except Exception:
                error.inc()
                raise
            finally:
                if task is not None:
                    self._running.pop(task, None)
                seconds.observe(time.perf_counter() - started)
            ok.inc()

    async def _watchdog(self) -> None:
        every = min(1.0, self.handler_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            late = time.perf_counter() - self.handler_timeout_s
            for task, started in list(self._running.items()):
                if started < late and task not in self._overdue:
                    self._overdue.add(task)
                    task.cancel()

    def _metrics(self, handler: str) -> tuple[Any, Any, Any, Any, Any]:
        """The handler's counters (ok, error, skipped, timeout) and timer, looked up once."""
        found = self._children.get(handler)
        if found is None:
            found = self._children[handler] = (
                EVENTS.labels(self.name, handler, "ok"),
                EVENTS.labels(self.name, handler, "error"),
                EVENTS.labels(self.name, handler, "skipped"),
                EVENTS.labels(self.name, handler, "timeout"),
                HANDLER_SECONDS.labels(self.name, handler),
            )
        return found


async def run_subscribers(
    subscribers: list[Subscriber],
    *,
    nats_url: str,
    credentials: NatsCredentials | Path | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run subscribers until `stop` is set (or SIGTERM/SIGINT when none is given)."""
    if isinstance(credentials, Path):
        credentials = load_credentials(credentials)
    bus = await Bus.connect(nats_url, "subscriber", credentials=credentials)
    stop = stop or _stop_on_signals()
    try:
        for subscriber in subscribers:
            await subscriber.start(bus)
        await stop.wait()
    finally:
        for subscriber in subscribers:
            with contextlib.suppress(Exception):
                await subscriber.stop()
        await bus.close()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop
