"""Router: keep a live view of the workers (WORKERS KV bucket) and of what each caches (the KV
index, kv_index.py, kept current by kv_sync.py), place each admitted request (policy.py), send it
to its prefill worker, and record the decision as an event and a span."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from itertools import islice
from typing import Any, ClassVar, Literal

import msgspec
from opentelemetry import trace
from prometheus_client import Counter, Gauge
from starlette.routing import BaseRoute

from schemas.events import (
    InferenceRequest,
    PrefillWork,
    RequestAdmitted,
    RequestRouted,
    RouteDecision,
    WorkerState,
    derived_event_id,
)
from schemas.subjects import ROUTER_CONSUMER, WORKERS, event_subject, work_subject
from services.mesh.config import MeshConfig
from services.mesh.consumer import Delivery
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.rejection import publish_rejection
from services.mesh.resumption import first_seq
from services.mesh.runtime import Runtime
from services.mesh.tracing import ReservedSpan
from services.mesh.workflow_spend_view import WorkflowSpendView
from services.router import reporting
from services.router.feedback import Feedback, count_peer_placement
from services.router.kv_index import KvIndex
from services.router.kv_sync import KvSync
from services.router.migration import Migrator
from services.router.policy import (
    DEFAULT_SPEED,
    LIVENESS_S,
    NoPlacement,
    NoPrefix,
    RouterConfig,
    RouteRequest,
    RouterState,
    WorkerView,
    cached_tokens,
    place,
)
from services.router.speed import MIN_TIME_SCALE, speed_for, time_scaled

log = logging.getLogger(__name__)

PLACEMENTS = Counter("ripplemesh_router_placements_total", "Placements by mode.", ["mode"])
LIVE_WORKERS = Gauge("ripplemesh_router_live_workers", "Live workers in the router's view.")
# At start-up workers may not have sent their first heartbeat yet: wait this long for one.
WAIT_FOR_WORKERS_S = 5.0
# While the view of the workers is stale (no heartbeat heard, WORKERS unreadable), up to this long.
WAIT_FOR_STALE_VIEW_S = 20.0
# Candidates whose cached prefix the decision span lists (the longest first).
SPAN_KV_CANDIDATES = 16
# The policy named on a decision that placed nothing (a Placement names its own).
POLICY = "ripplemesh"
# How a policy's refusal reaches the client (RequestRejected.reason).
REJECTION_REASONS: dict[str, Literal["capacity", "deadline", "invalid", "no_workers"]] = {
    "infeasible": "deadline",
    "saturated": "capacity",
    "invalid": "invalid",
    "no_workers": "no_workers",
}

_worker_decoder = msgspec.json.Decoder(WorkerState)


def view_of(state: WorkerState, shapes: dict[str, str] | None = None) -> WorkerView:
    """The policy's view of a heartbeat; its speed from the GPU type and the model's shape
    (`shapes`: model name -> sim model shape, from the mesh config), when both are known.

    A worker whose engine runs its modelled GPU time faster than the wall clock (a sim engine at
    `--time-scale`) is seen as a GPU that many times faster and dearer by the hour: its work then
    takes the wall time it will take, and costs what the ledger will charge for it (the modelled
    GPU seconds at the GPU's price)."""
    speed = speed_for(state.gpu_type, (shapes or {}).get(state.model, state.model)) or DEFAULT_SPEED
    scale = max(MIN_TIME_SCALE, state.time_scale)
    return WorkerView(
        worker_id=state.worker_id,
        role=state.role,
        model=state.model,
        block_size=state.block_size,
        queue_depth=state.queue_depth,
        running=state.running,
        kv_blocks_total=state.kv_blocks_total,
        kv_blocks_used=state.kv_blocks_used,
        heartbeat_at=state.occurred_at,
        draining=state.draining,
        pool=state.pool,
        gpu_type=state.gpu_type,
        price_per_hour=state.price_per_hour / scale,
        kv_blocks_free=state.kv_blocks_free,
        queued_tokens=state.queued_tokens,
        context_tokens=state.context_tokens,
        adapters=tuple(state.adapters),
        adapter_load_s=state.adapter_load_s * scale,
        speed=time_scaled(speed, scale),
    )


def route_request(
    request: InferenceRequest, workflow_spent_usd: float = 0.0, admission_wait_s: float = 0.0
) -> RouteRequest:
    """The policy's view of an admitted request (`workflow_spent_usd`: the ledger's running
    spend of its workflow, from the WORKFLOW_SPEND bucket, when known; `admission_wait_s`: how
    long admission held it back, RequestAdmitted's `waited_s`)."""
    workflow = request.workflow
    return RouteRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        model=request.model,
        block_size=request.block_size,
        block_hashes=request.block_hashes,
        prompt_tokens=len(request.prompt_tokens),
        max_tokens=request.max_tokens,
        priority=request.priority,
        deadline_at=request.deadline_at,
        workflow_id=workflow.workflow_id if workflow is not None else None,
        workflow_step=workflow.step if workflow is not None else None,
        workflow_steps=workflow.steps if workflow is not None else None,
        workflow_spent_usd=workflow_spent_usd,
        adapter=request.adapter,
        admission_wait_s=admission_wait_s,
    )


def router_config(config: MeshConfig) -> RouterConfig:
    """The policy's configuration from the mesh's: the ledger's KV transfer price, and whether
    admission controls the load (where it enforces quotas only, the router is the only
    shedding under overload and sheds at its own bar)."""
    return RouterConfig(
        kv_transfer_usd_per_gb=config.kv_transfer_usd_per_gb,
        admission_controls_load=config.admission.limits().controls_load,
    )


class RouterService:
    name: ClassVar[str] = "router"

    def __init__(self) -> None:
        self.state = RouterState()
        self.runtime: Runtime | None = None
        self._workers_changed = asyncio.Event()
        self.kv_index: KvIndex | None = None
        self.kv_sync: KvSync | None = None
        self._shapes: dict[str, str] = {}
        # Liveness, and taking over the work of lost or drained workers (migration.py).
        self.migrator: Migrator | None = None
        # This replica, among the routers sharing the admitted stream (feedback.py).
        self.replica_id = f"router-{uuid.uuid4().hex[:12]}"
        self.predictions = reporting.Predictions(self.state)
        self.workflow_spend: WorkflowSpendView | None = None
        self.feedback: Feedback | None = None
        self.workers_watch: HeartbeatWatch | None = None

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.state.config = router_config(runtime.config)
        self.state.calibration.prior_spread = self.state.config.relative_error
        self._shapes = {m.name: m.shape for m in runtime.config.models}
        self.kv_index = KvIndex(runtime.config.block_size)
        self.kv_sync = KvSync(runtime.bus.nc, self.kv_index)
        runtime.spawn(self.kv_sync.run(), "kv-sync")
        # Counted when scraped: counting on every heartbeat read every worker a thousand times a
        # second on a fleet of a thousand.
        LIVE_WORKERS.set_function(lambda: len(live_workers_any(self.state)))
        runtime.spawn(self._watch_workers(), "watch-workers")
        self.migrator = Migrator(
            runtime,
            max_migrations=runtime.config.max_migrations,
            max_output_tokens=runtime.config.max_migrated_output_tokens,
        )
        await self.migrator.start()
        self.workflow_spend = WorkflowSpendView(runtime.bus)
        runtime.spawn(self.workflow_spend.run(), "workflow-spend")
        self.feedback = Feedback(
            runtime.bus.nc,
            on_decision=self._on_route_decision,
            on_prefill_completed=self.predictions.compare,
            on_ended=self.predictions.ended,
        )
        runtime.spawn(self.feedback.run(), "feedback")
        # Hear the other replicas before placing anything (bounded: they are advisory).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.feedback.subscribed.wait(), timeout=2.0)
        await runtime.consume(
            ROUTER_CONSUMER, RequestAdmitted, self._on_admitted, max_inflight=256, direct=True
        )

    async def stop(self) -> None:
        return None

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        health: dict[str, Any] = {"workers": len(live_workers_any(self.state))}
        if self.kv_sync is not None:
            health["kv_index"] = self.kv_sync.health()
        if self.migrator is not None:
            health["migration"] = self.migrator.health()
        # How its predictions have turned out, per GPU type (policy/calibration.py).
        health["calibration"] = self.state.calibration.summary()
        return health

    async def _watch_workers(self) -> None:
        assert self.runtime is not None
        # Started again when it breaks or falls silent (its consumer lost with a NATS node).
        self.workers_watch = HeartbeatWatch(await self.runtime.bus.key_value(WORKERS))
        async for entry in self.workers_watch.updates():
            if entry.value is None:
                continue  # a delete marker without a value
            if entry.operation in ("DEL", "PURGE"):
                self.state.forget(entry.key)
                if self.kv_sync is not None:
                    self.kv_sync.forget(entry.key)
                continue
            try:
                worker = _worker_decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad worker state ignored", extra={"key": entry.key, "error": str(exc)})
                continue
            self.state.observe(view_of(worker, self._shapes))
            if self.kv_sync is not None:
                self.kv_sync.observe(worker)
            self._workers_changed.set()

    async def _on_admitted(self, event: RequestAdmitted, delivery: Delivery) -> None:
        assert self.runtime is not None
        request = event.request
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + WAIT_FOR_WORKERS_S
        stale_give_up_at = loop.time() + WAIT_FOR_STALE_VIEW_S
        workflow_id = request.workflow.workflow_id if request.workflow is not None else None
        spent = self.workflow_spend.spent(workflow_id) if self.workflow_spend is not None else 0.0
        route = route_request(request, spent, event.waited_s)
        decide_started_ns = time.time_ns()
        while True:
            decided_at = time.time()
            started = time.perf_counter()
            decision = place(
                self.state,
                route,
                self.kv_index if self.kv_index is not None else NoPrefix(),
                decided_at,
            )
            decision_s = time.perf_counter() - started
            if not (isinstance(decision, NoPlacement) and decision.reason == "no_workers"):
                break
            remaining = give_up_at - loop.time()
            if remaining <= 0 and self.workers_watch is not None and self.workers_watch.stale:
                # No heartbeat from anyone and WORKERS unreadable (a NATS node lost, its
                # stream electing a leader): the fleet is not known dead; wait for the view.
                remaining = stale_give_up_at - loop.time()
            if remaining <= 0:
                break
            self._workers_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._workers_changed.wait(), timeout=min(remaining, 0.25))
        decide_ended_ns = time.time_ns()
        now = decided_at  # PrefillWork's time is the decision's: the prediction's TTFT counts from it
        chosen = reporting.chosen_option(decision) if not isinstance(decision, NoPlacement) else None
        # The decision's span is built after the work is sent, with the id the work names.
        decision_span = ReservedSpan()
        if not isinstance(decision, NoPlacement):
            assert chosen is not None
            # The work first: the first token waits on it. The decision's span and records are
            # bookkeeping, done once it is on its way.
            await self.runtime.bus.publish(
                work_subject("prefill", decision.prefill_worker),
                PrefillWork(
                    event_id=derived_event_id(event.event_id, "prefill"),
                    occurred_at=now,
                    request=request,
                    prefill_worker=decision.prefill_worker,
                    decode_worker=decision.decode_worker,
                    prediction=chosen,
                    decision_traceparent=decision_span.traceparent,
                ),
            )
        # The decision's span covers the decision alone (its times), whenever it is recorded.
        span = decision_span.start("router.decide", start_time=decide_started_ns)
        try:
            policy = decision.policy if not isinstance(decision, NoPlacement) else POLICY
            span.set_attributes(
                reporting.span_attributes(
                    decision,
                    policy=policy,
                    replica=self.replica_id,
                    decision_s=decision_s,
                    workflow_spent_usd=spent,
                )
            )
            record = reporting.decision_event(
                event_id=derived_event_id(event.event_id, "route_decision"),
                decided_at=decided_at,
                request=request,
                decision=decision,
                policy=policy,
                replica=self.replica_id,
                decision_s=decision_s,
                workflow_spent_usd=spent,
            )
            reporting.count_decision(record)
            if isinstance(decision, NoPlacement):
                with trace.use_span(span, end_on_exit=False):
                    await self._reject(event, decision)
                    await self.runtime.bus.publish(event_subject("route_decision"), record)
                return
            self._record_cached_prefix(span, request)
        finally:
            span.end(end_time=decide_ended_ns)
        PLACEMENTS.labels(decision.mode).inc()
        assert chosen is not None
        prefiller = self.state.workers.get(chosen.prefill_worker)
        decoder = self.state.workers.get(chosen.decode_worker)
        self.predictions.record(
            request.request_id,
            chosen,
            decided_at,
            policy=decision.policy,
            pool=prefiller.pool if prefiller is not None else "",
            indexed_cached_tokens=decision.indexed_cached_tokens,
            prefill_gpu=prefiller.gpu_type if prefiller is not None else "",
            decode_gpu=decoder.gpu_type if decoder is not None else "",
        )
        routed = RequestRouted(
            event_id=derived_event_id(event.event_id, "routed"),
            occurred_at=now,
            request_id=request.request_id,
            tenant=request.tenant,
            mode=decision.mode,
            prefill_worker=decision.prefill_worker,
            decode_worker=decision.decode_worker,
            candidates=decision.candidates,
            predicted_load=decision.decode_load,
        )
        # The other replicas count this placement on the workers' load as soon as they read it.
        await asyncio.gather(
            self.runtime.bus.publish(event_subject("route_decision"), record),
            self.runtime.bus.publish(event_subject("routed"), routed),
        )

    def _on_route_decision(self, decision: RouteDecision) -> None:
        """Another replica's placement: count it on its workers' load (feedback.py)."""
        count_peer_placement(self.state, decision, self.replica_id)

    def _record_cached_prefix(self, span: Any, request: InferenceRequest) -> None:
        """The prefix each live worker caches, from the KV index, on the decision span: the
        longest few as ``worker=tokens``."""
        if self.kv_index is None:
            return
        try:
            size, prompt = self.kv_index.block_size, len(request.prompt_tokens)
            workers, now = self.state.workers, time.time()
            # Deepest first, reading only as many workers as are shown (a prefix can be shared
            # by a thousand).
            live = (
                (worker_id, depth)
                for depth, worker_ids in self.kv_index.matches(request.block_hashes).deepest()
                for worker_id in worker_ids
                if (worker := workers.get(worker_id)) is not None
                and worker.model == request.model
                and now - worker.heartbeat_at <= LIVENESS_S
            )
            shown = [
                f"{worker_id}={cached_tokens(depth, prompt, size)}"
                for worker_id, depth in islice(live, SPAN_KV_CANDIDATES)
            ]
            span.set_attribute("ripple.router.cached_tokens_by_worker", shown)
        except Exception as exc:  # the index is advisory: never fail a placement over it
            log.warning("KV prefix lookup failed", extra={"error": repr(exc)})

    async def _reject(self, event: RequestAdmitted, decision: NoPlacement) -> None:
        assert self.runtime is not None
        await publish_rejection(
            self.runtime.bus,
            source_event_id=event.event_id,
            request_id=event.request.request_id,
            tenant=event.request.tenant,
            workflow=event.request.workflow,
            deadline_at=event.request.deadline_at,
            service_class=event.request.service_class,
            stage="router",
            reason=REJECTION_REASONS[decision.reason],
            message=decision.message,
            http_status=500 if decision.reason == "invalid" else 503,
            retry_after_s=decision.retry_after_s,
            seq=first_seq(event.request),  # a migrated request's stream is past seq 0
        )


def live_workers_any(state: RouterState) -> list[WorkerView]:
    """Every worker heard from within the policy's liveness window, of any model and role."""
    now = time.time()
    return [w for w in state.workers.values() if now - w.heartbeat_at <= LIVENESS_S]
