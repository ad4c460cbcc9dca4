"""A worker's requests in flight, and what stops them early: a client's cancellation, a
revocation (the router moved the request elsewhere), a drain.

- Each request's work runs as its own task through `run`, registered by request id, so it can be
  stopped on its own: the task is cancelled, the engine's sequence released (its KV freed, the
  engine aborts it) and the GPU time it spent that no completion event reports goes to the
  ledger as a `WorkStopped`.
- Cancellations come as `RequestCancelled` lifecycle events (core subscription to
  ``rmesh.events.cancelled``). A cancelled request's work is stopped at once, and work for it
  that arrives later is dropped; both are acked, never retried.
- Orders come on ``rmesh.control.<worker>`` (`WorkerControl`): ``revoke`` stops requests now
  served elsewhere; ``drain`` says draining in the next heartbeat (sent at once, so routers stop
  placing here), stops taking work, lets the work in flight finish within the grace period and
  cuts what is left (left unacked on the WORK stream: the router migrates it once this worker's
  WORKERS entry is gone), then has the process exit; ``ping`` only answers. A request with a
  reply subject is answered with the worker's `WorkerState`, which is how routers probe a
  worker whose heartbeat is late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Gauge

from schemas.events import (
    DecodeWork,
    InferenceRequest,
    PrefillWork,
    RequestCancelled,
    WorkerControl,
    WorkerState,
    WorkStopped,
    derived_event_id,
    encode_event,
)
from schemas.subjects import control_subject, event_subject
from services.mesh.consumer import Deferred, Delivery

if TYPE_CHECKING:
    from services.engines.base import Engine
    from services.mesh.runtime import Runtime

log = logging.getLogger(__name__)

StopReason = Literal["cancelled", "revoked", "drained"]
W = TypeVar("W", PrefillWork, DecodeWork)

# Cancelled request ids remembered, for work that arrives after its cancellation.
CANCELS_KEPT = 100_000
DEFAULT_DRAIN_GRACE_S = 30.0

STOPPED = Counter(
    "ripplemesh_worker_requests_stopped_total",
    "Requests a worker stopped before their end, by reason (cancelled, revoked, drained).",
    ["worker", "reason"],
)
DROPPED = Counter(
    "ripplemesh_worker_cancelled_work_dropped_total",
    "Work dropped on arrival because its request was already cancelled.",
    ["worker"],
)
HANDED_BACK = Counter(
    "ripplemesh_worker_predecessor_work_deferred_total",
    "Work sent to this worker id before this process started, left to the routers to take over.",
    ["worker"],
)
DRAINING = Gauge("ripplemesh_worker_draining", "1 while the worker drains.", ["worker"])

_cancel_decoder = msgspec.json.Decoder(RequestCancelled)
_control_decoder = msgspec.json.Decoder(WorkerControl)


class LifecycleHost(Protocol):
    """What the lifecycle needs of the worker it runs in (`services.engines.host.EngineHost`).

    A protocol rather than the host class itself, so this module does not import the host that
    imports it."""

    worker_id: str
    runtime: Runtime
    engine: Engine
    # Set by a drain; read back into heartbeats and health.
    draining: bool

    def state(self) -> WorkerState: ...

    async def heartbeat(self) -> None: ...

    def predecessors_work_left_for(self, sent_at: float) -> float: ...


@dataclass(eq=False, slots=True)
class InFlight:
    """One request's work on this worker."""

    request: InferenceRequest
    source_event_id: str
    task: asyncio.Task[None]
    stop_reason: StopReason | None = None
    # Whether this worker already reported the prefill's GPU time (PrefillCompleted).
    prefill_reported: bool = False
    tokens_generated: int = 0


class WorkerLifecycle:
    def __init__(self, host: LifecycleHost):
        self.host = host
        self.inflight: dict[str, InFlight] = {}
        self._cancelled: OrderedDict[str, str] = OrderedDict()  # request id -> tenant
        self._subs: list[Subscription] = []
        self._drain: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self.host.worker_id

    async def start(self) -> None:
        nc = self.host.runtime.bus.nc
        self._subs = [
            await nc.subscribe(event_subject("cancelled"), cb=self._on_cancelled),
            await nc.subscribe(control_subject(self.worker_id), cb=self._on_control),
        ]

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    # ------------------------------------------------------------ work

    def guarded(
        self, handler: Callable[[W, Delivery], Awaitable[None]]
    ) -> Callable[[W, Delivery], Awaitable[None]]:
        """A work handler that runs through `run` (stoppable, dropped once cancelled)."""

        async def run_guarded(work: W, delivery: Delivery) -> None:
            # Work sent before this process started (left by a killed predecessor, or stored
            # late, its publish retried through a stream's election): the routers take it over.
            # Served here too, it would be streamed twice; it waits for them instead, on the
            # stream, while this worker serves what was sent to it.
            wait_s = self.host.predecessors_work_left_for(work.occurred_at)
            if wait_s > 0:
                HANDED_BACK.labels(self.worker_id).inc()
                raise Deferred(wait_s, "a predecessor's work: the routers take it over")
            await self.run(work.request, work.event_id, lambda: handler(work, delivery))

        return run_guarded

    async def run(
        self, request: InferenceRequest, source_event_id: str, body: Callable[[], Awaitable[None]]
    ) -> None:
        """Run one request's work as its own task. Returns when it is done, or was stopped for
        good (cancelled, revoked: its message is acked); raises CancelledError when the
        handler itself is cancelled (a drain's grace is over, a shutdown): the work's message
        stays unacked, for the router to migrate."""
        rid = request.request_id
        if self._cancelled.get(rid) == request.tenant:
            DROPPED.labels(self.worker_id).inc()
            log.info("work for a cancelled request dropped", extra={"request_id": rid})
            return
        task = asyncio.create_task(_awaited(body), name=f"work-{rid}")
        entry = InFlight(request, source_event_id, task)
        self.inflight[rid] = entry
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if entry.stop_reason is not None and (current is None or current.cancelling() == 0):
                await self._report_stopped(entry, entry.stop_reason)
                return
            # Cut by a drain or a shutdown: say what was spent, leave the message for migration.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._report_stopped(entry, "drained"), timeout=2.0)
            raise
        finally:
            if self.inflight.get(rid) is entry:
                del self.inflight[rid]

    def stop(self, request_id: str, reason: StopReason, *, tenant: str | None = None) -> bool:
        """Stop a request's work now (`tenant`: only if the request is that tenant's)."""
        entry = self.inflight.get(request_id)
        if entry is None or entry.stop_reason is not None:
            return False
        if tenant is not None and entry.request.tenant != tenant:
            log.warning(
                "cancellation by another tenant ignored",
                extra={"request_id": request_id, "tenant": tenant},
            )
            return False
        entry.stop_reason = reason
        entry.task.cancel()
        return True

    def prefill_reported(self, request_id: str) -> None:
        entry = self.inflight.get(request_id)
        if entry is not None:
            entry.prefill_reported = True

    def tokens_generated(self, request_id: str, tokens: int) -> None:
        entry = self.inflight.get(request_id)
        if entry is not None:
            entry.tokens_generated = tokens

    async def _report_stopped(self, entry: InFlight, reason: StopReason) -> None:
        host, request = self.host, entry.request
        rid = request.request_id
        host.engine.release(rid)  # frees its KV (an engine aborts the sequence); idempotent
        prefill_s, decode_s = host.engine.gpu_seconds(rid)
        spent = decode_s + (0.0 if entry.prefill_reported else prefill_s)
        STOPPED.labels(self.worker_id, reason).inc()
        log.info(
            "request stopped",
            extra={
                "request_id": rid,
                "reason": reason,
                "gpu_seconds": spent,
                "tokens": entry.tokens_generated,
            },
        )
        await host.runtime.bus.publish(
            event_subject("work_stopped"),
            WorkStopped(
                event_id=derived_event_id(entry.source_event_id, "stopped"),
                occurred_at=time.time(),
                request_id=rid,
                tenant=request.tenant,
                workflow_id=request.workflow.workflow_id if request.workflow else None,
                worker_id=self.worker_id,
                gpu_type=host.engine.info.gpu_type,
                gpu_seconds=spent,
                tokens_generated=entry.tokens_generated,
                reason=reason,
            ),
        )

    # ------------------------------------------------------------ cancellations and orders

    async def _on_cancelled(self, msg: Msg) -> None:
        try:
            cancelled = _cancel_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad cancellation ignored", extra={"error": str(exc)})
            return
        self._cancelled[cancelled.request_id] = cancelled.tenant
        while len(self._cancelled) > CANCELS_KEPT:
            self._cancelled.popitem(last=False)
        self.stop(cancelled.request_id, "cancelled", tenant=cancelled.tenant)

    async def _on_control(self, msg: Msg) -> None:
        try:
            order = _control_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad control message ignored", extra={"error": str(exc)})
            return
        if order.worker_id != self.worker_id:
            log.warning("control message for another worker ignored", extra={"for": order.worker_id})
            return
        if order.action == "revoke":
            for request_id in order.request_ids:
                entry = self.inflight.get(request_id)
                if (
                    order.work_event_ids
                    and entry is not None
                    and entry.source_event_id not in order.work_event_ids
                ):
                    continue  # running for the work that replaced the revoked one: keep it
                if self.stop(request_id, "revoked"):
                    log.info("request revoked", extra={"request_id": request_id, "reason": order.reason})
        elif order.action == "drain" and self._drain is None:
            grace = order.grace_s if order.grace_s is not None else DEFAULT_DRAIN_GRACE_S
            await self.mark_draining()
            self._drain = self.host.runtime.spawn(self.drain(grace), "drain")
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(encode_event(self.host.state()))

    async def mark_draining(self) -> None:
        """Say draining in a heartbeat now: routers stop placing work here at once."""
        self.host.draining = True
        DRAINING.labels(self.worker_id).set(1)
        with contextlib.suppress(Exception):
            await self.host.heartbeat()

    async def drain(self, grace_s: float) -> None:
        """Take no new work, let what is in flight finish within `grace_s` (what is left stays on
        the WORK stream for the router to migrate), then have the process exit."""
        runtime = self.host.runtime
        log.info("draining", extra={"grace_s": grace_s, "in_flight": len(self.inflight)})
        await runtime.stop_consumers(grace_s)
        log.info("drained: exiting", extra={"handed_off": len(self.inflight)})
        runtime.request_stop()

    def health(self) -> dict[str, Any]:
        return {"in_flight": len(self.inflight), "draining": self.host.draining}


async def _awaited(body: Callable[[], Awaitable[None]]) -> None:
    await body()
