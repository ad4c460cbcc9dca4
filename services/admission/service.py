"""Admission: for every prepared request, admit it now, defer it (a bounded wait), or reject it
early with a reason (policy.py decides; this is the shell).

- Quotas are shared by the replicas through the ADMISSION_QUOTAS KV bucket, charged with
  compare-and-set (shared_quota.py). A concurrency lease goes back when the request ends: every
  replica hears the completions (core NATS) and removes the lease the same way; a lost event is
  covered by the lease's lapse.
- The fleet's view is the router's: the WORKERS heartbeats (saturation, and `earliest_ttft` for
  deadline feasibility, with the prefix cache from the workers' KV events), refreshed every
  `REFRESH_S`, corrected by the admissions (every replica's, heard on ``rmesh.admitted.*``) and
  completions heard in the last heartbeat interval.
- A deferred request holds its message (the consume loop reports progress) and waits on a
  future that the drain loop settles when the policy admits or rejects it; the wait is bounded
  by the request's `due`, after which it is rejected here if the policy has not decided.
- Every outcome is a lifecycle event: AdmissionDecision (admitted, deferred) or RequestRejected,
  whose StreamFailed on the token subject carries the HTTP status (quota 429; capacity, deadline,
  no_workers 503; invalid 400) and the retry-after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram
from starlette.routing import BaseRoute

from schemas.events import (
    AdmissionDecision,
    CapacityWanted,
    DecodeCompleted,
    InferenceRequest,
    RequestAdmitted,
    RequestCancelled,
    RequestFailed,
    RequestPrepared,
    RequestRejected,
    TenantThrottle,
    WorkerState,
    decode_event,
    derived_event_id,
    new_event_id,
)
from schemas.subjects import (
    ADMISSION_CONSUMER,
    ADMISSION_QUOTAS,
    PREFIX,
    TENANT_THROTTLES,
    WORKERS,
    admitted_subject,
    event_subject,
)
from services.admission.policy import (
    CONTINUATION,
    DOOMED,
    AdmissionLimits,
    AdmissionRequest,
    AdmissionState,
    Admit,
    Decision,
    Defer,
    Prediction,
    Reject,
    TenantQuota,
    drain,
    expire,
    fleet_load,
    next_due,
    note_admitted,
    note_finished,
    observe_fleet,
    offer,
    prediction,
    saturation,
    take_outcomes,
    throttled,
    validate,
    workflow_standing,
)
from services.admission.shared_quota import SharedQuota
from services.mesh.config import TenantConfig, admission_messages_held
from services.mesh.consumer import Delivery
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.rejection import publish_rejection
from services.mesh.runtime import Runtime
from services.mesh.tracing import LateSpan
from services.mesh.workflow_spend_view import WorkflowSpendView
from services.router.kv_index import KvIndex
from services.router.kv_sync import KvSync
from services.router.policy import RouterState, earliest_first_token
from services.router.service import route_request, view_of

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "ripplemesh_admission_decisions_total",
    "Admission decisions by outcome and reason.",
    ["tenant", "outcome", "reason"],
)
SATURATION = Gauge(
    "ripplemesh_admission_saturation",
    "The fleet's saturation as admission sees it (1.0: its target load; KV usage, queue depth, "
    "time per output token), from the workers' heartbeats.",
)
DEFERRED = Gauge("ripplemesh_admission_deferred_requests", "Requests this replica holds deferred.")
DEFERRED_BYTES = Gauge("ripplemesh_admission_deferred_bytes", "Bytes of the requests held deferred.")
WAITED = Histogram(
    "ripplemesh_admission_deferral_seconds",
    "How long deferred requests waited, by outcome.",
    ["outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
HTTP_STATUS = {"quota": 429, "capacity": 503, "deadline": 503, "invalid": 400, "no_workers": 503}
STANDING = {CONTINUATION: "continuation", DOOMED: "doomed"}
# The fleet's view is recomputed this often from the latest heartbeats; admissions and
# completions of the last heartbeat interval are not in the heartbeats yet.
REFRESH_S = 0.5
HEARTBEAT_S = 1.0
OWN_IDS_KEPT = 20_000

_worker_decoder = msgspec.json.Decoder(WorkerState)
_throttle_decoder = msgspec.json.Decoder(TenantThrottle)


class _ClassOnly(msgspec.Struct):
    service_class: str = "interactive"


class _AdmittedClass(msgspec.Struct):
    """A `RequestAdmitted` read for its request's service class alone: the prompt's tokens are
    skipped, not decoded, on every admission any replica makes."""

    request: _ClassOnly


_admitted_decoder = msgspec.json.Decoder(_AdmittedClass)
_encoder = msgspec.json.Encoder()


def tenant_quota(config: TenantConfig) -> TenantQuota:
    return TenantQuota(
        requests_per_s=config.requests_per_s,
        request_burst=config.request_burst,
        tokens_per_s=config.tokens_per_s,
        token_burst=config.token_burst,
        input_tokens_per_s=config.input_tokens_per_s,
        input_token_burst=config.input_token_burst,
        output_tokens_per_s=config.output_tokens_per_s,
        output_token_burst=config.output_token_burst,
        max_concurrency=config.max_concurrency,
        weight=config.weight,
    )


def deferred_size(request: InferenceRequest) -> int:
    """About what holding the request costs: its prompt's token ids and block hashes, as JSON."""
    return 512 + 8 * len(request.prompt_tokens) + 20 * len(request.block_hashes)


class AdmissionService:
    name: ClassVar[str] = "admission"

    def __init__(self) -> None:
        self.replica_id = f"admission-{uuid.uuid4().hex[:12]}"
        self.state = AdmissionState()
        self.limits = AdmissionLimits()
        self.router_state = RouterState()
        self.runtime: Runtime | None = None
        self.kv_index: KvIndex | None = None
        self.kv_sync: KvSync | None = None
        self.workflow_spend: WorkflowSpendView | None = None
        self._quotas: dict[str, TenantQuota] = {}
        self.quota: SharedQuota | None = None
        self._waiters: dict[str, asyncio.Future[Admit | Reject]] = {}
        self._requests: dict[str, InferenceRequest] = {}  # deferred (and being decided)
        self._wake = asyncio.Event()
        # When requests were admitted and finished lately, and whether each was a Batch API line.
        self._recent_admitted: deque[tuple[float, bool]] = deque()
        self._recent_finished: deque[tuple[float, bool]] = deque()
        self._own: OrderedDict[str, None] = OrderedDict()  # ids of RequestAdmitted we published
        self._capacity_wanted_at: dict[str, float] = {}
        self._throttles: dict[
            str, TenantThrottle
        ] = {}  # tenant -> the latest control event  # model -> last CapacityWanted published
        self._subscriptions: list[Subscription] = []
        self._shapes: dict[str, str] = {}

    # ------------------------------------------------------------ lifecycle

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        config = runtime.config
        self.limits = config.admission.limits()
        self._quotas = {name: tenant_quota(t) for name, t in config.tenants.items()}
        self._shapes = {m.name: m.shape for m in config.models}
        self.quota = SharedQuota(
            await runtime.bus.key_value(ADMISSION_QUOTAS), self._quotas, self.limits, runtime.spawn
        )
        self.kv_index = KvIndex(config.block_size)
        self.kv_sync = KvSync(runtime.bus.nc, self.kv_index)
        runtime.spawn(self.kv_sync.run(), "kv-sync")
        runtime.spawn(self._watch_workers(), "watch-workers")
        runtime.spawn(self._watch_throttles(), "watch-throttles")
        self.workflow_spend = WorkflowSpendView(runtime.bus)
        runtime.spawn(self.workflow_spend.run(), "workflow-spend")
        nc = runtime.bus.nc
        self._subscriptions = [
            await nc.subscribe(f"{PREFIX}.admitted.*", cb=self._on_admitted_anywhere),
            *[
                await nc.subscribe(event_subject(kind), cb=self._on_finished)
                for kind in ("decode_completed", "failed", "rejected", "cancelled")
            ],
        ]
        runtime.spawn(self._refresh_loop(), "admission-refresh")
        runtime.spawn(self._drain_loop(), "admission-drain")
        runtime.spawn(self.quota.lease_loop(), "admission-leases")
        # Deferred requests hold their messages: room for a full queue and the requests in hand.
        # The consumer's max_ack_pending bounds all replicas together (config validation checks
        # one replica's share; a replica cannot see how many others run).
        held = admission_messages_held(self.limits.max_deferred)
        log.info(
            "admission holds up to %d messages unacknowledged; the consumer allows %d: %d replicas "
            "with full deferral queues fit",
            held,
            ADMISSION_CONSUMER.max_ack_pending,
            ADMISSION_CONSUMER.max_ack_pending // held,
        )
        await runtime.consume(
            ADMISSION_CONSUMER,
            RequestPrepared,
            self._on_prepared,
            max_inflight=held,
            direct=True,
        )

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        if self.quota is not None:
            await self.quota.return_all()

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        fleet = self.state.fleet
        return {
            "replica": self.replica_id,
            "tenants_tracked": self.quota.tenants_tracked if self.quota else 0,
            "deferred": len(self.state.deferred),
            "workers": fleet.workers if fleet is not None else 0,
            # None while no live worker is known (saturation is infinite then).
            "saturation": self.state.saturation if math.isfinite(self.state.saturation) else None,
        }

    # ------------------------------------------------------------ the fleet's view

    async def _watch_throttles(self) -> None:
        """The TENANT_THROTTLES bucket (control events put by subscribers), watched like the
        workers' heartbeats; an entry that does not decode is logged and ignored."""
        assert self.runtime is not None
        watch = HeartbeatWatch(await self.runtime.bus.key_value(TENANT_THROTTLES), silent_after_s=60.0)
        async for entry in watch.updates():
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._throttles.pop(entry.key, None)
                continue
            try:
                throttle = _throttle_decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad tenant throttle ignored", extra={"key": entry.key, "error": str(exc)})
                continue
            self._throttles[throttle.tenant] = throttle
            log.info(
                "tenant throttled",
                extra={"tenant": throttle.tenant, "until": throttle.until, "by": throttle.source},
            )

    async def _watch_workers(self) -> None:
        """The WORKERS bucket, watched as the router watches it (started again when it breaks or
        falls silent)."""
        assert self.runtime is not None
        watch = HeartbeatWatch(await self.runtime.bus.key_value(WORKERS))
        async for entry in watch.updates():
            self._on_worker(entry.key, entry.value, entry.operation)

    def _on_worker(self, key: str, value: bytes | None, operation: str | None) -> None:
        if operation in ("DEL", "PURGE") or value is None:
            self.router_state.forget(key)
            if self.kv_sync is not None:
                self.kv_sync.forget(key)
            return
        try:
            worker = _worker_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("bad worker state ignored", extra={"key": key, "error": str(exc)})
            return
        self.router_state.observe(view_of(worker, self._shapes))
        if self.kv_sync is not None:
            self.kv_sync.observe(worker)

    def refresh(self, now: float) -> None:
        """The fleet as the latest heartbeats tell it, with what happened since they were sent."""
        for recent in (self._recent_admitted, self._recent_finished):
            while recent and recent[0][0] < now - HEARTBEAT_S:
                recent.popleft()
        observe_fleet(self.state, fleet_load(self.router_state.workers.values(), now))
        admitted, finished = self._recent_admitted, self._recent_finished
        note_admitted(self.state, len(admitted), batch=sum(batch for _, batch in admitted))
        note_finished(self.state, len(finished), batch=sum(batch for _, batch in finished))
        value = saturation(self.state, self.limits)
        self.state.saturation = value
        SATURATION.set(value)

    async def _refresh_loop(self) -> None:
        while True:
            self.refresh(time.time())
            self._wake.set()
            await asyncio.sleep(REFRESH_S)

    async def _on_admitted_anywhere(self, msg: Msg) -> None:
        """Every replica's admissions (ours are counted when made)."""
        event_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        if event_id in self._own:
            return
        try:
            batch = _admitted_decoder.decode(msg.data).request.service_class == "batch"
        except (msgspec.DecodeError, msgspec.ValidationError):
            batch = False  # counted as interactive: the fleet's load, not this request, matters
        self._recent_admitted.append((time.time(), batch))
        note_admitted(self.state, batch=int(batch))

    async def _on_finished(self, msg: Msg) -> None:
        """A request ended: the fleet has room again, and its concurrency lease goes back."""
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the ledger dead-letters it; nothing here depends on it
        if not isinstance(event, DecodeCompleted | RequestFailed | RequestRejected | RequestCancelled):
            return
        if isinstance(event, RequestRejected) and event.stage != "router":
            return  # never admitted (or rejected by admission, which gave the lease back)
        # A cancel carries no class: a client's own request.
        batch = getattr(event, "service_class", "interactive") == "batch"
        self._recent_finished.append((time.time(), batch))
        note_finished(self.state, batch=int(batch))
        self._wake.set()
        quota = self._quotas.get(event.tenant)
        if quota is not None and quota.max_concurrency is not None:
            try:
                assert self.quota is not None
                await self.quota.release(event.tenant, event.request_id)
            except Exception as exc:  # the lease lapses instead
                log.warning("lease not released", extra={"request_id": event.request_id, "error": repr(exc)})

    # ------------------------------------------------------------ deciding

    def _admission_request(self, request: InferenceRequest) -> AdmissionRequest:
        workflow = request.workflow
        spend = None
        if workflow is not None and self.workflow_spend is not None:
            spend = self.workflow_spend.get(workflow.workflow_id)
        return AdmissionRequest(
            request_id=request.request_id,
            tenant=request.tenant,
            priority=request.priority,
            input_tokens=len(request.prompt_tokens),
            output_tokens=request.max_tokens,
            submitted_at=request.submitted_at,
            deadline_at=request.deadline_at,
            priority_level=request.priority_level,
            workflow_id=workflow.workflow_id if workflow is not None else None,
            workflow_step=workflow.step if workflow is not None else None,
            workflow_standing=workflow_standing(workflow.step if workflow is not None else None, spend),
            workflow_spent_usd=spend.spend_usd if spend is not None else 0.0,
            size_bytes=deferred_size(request),
            service_class=request.service_class,
        )

    def _predict(self, request: AdmissionRequest) -> Prediction | None:
        """The router's earliest first token for the request on the live fleet, and its last."""
        held = self._requests.get(request.request_id)
        if held is None or self.kv_index is None:
            return None
        spend = request.workflow_spent_usd
        route = route_request(held, spend)
        first = earliest_first_token(self.router_state, route, self.kv_index, time.time())
        return prediction(first, request, self.state)

    async def _decide(self, request: InferenceRequest, admission: AdmissionRequest, now: float) -> Decision:
        quota = self._quotas.get(request.tenant)
        rejected = validate(admission, quota, self.limits, now)
        if rejected is not None or quota is None:
            return rejected or Reject("invalid", f"unknown tenant {request.tenant!r}", None)
        rejected = throttled(self._throttles, request.tenant, now)
        if rejected is not None:
            return rejected
        if self.limits.control == "none":
            return Admit()
        # The tenant's rate is when it sent, not when admission got to it: a backlog that an
        # outage held back (admission restarting, a NATS node lost) and releases at once is
        # charged as it arrived, not as a burst of the tenant's. Never later than now, so a
        # client's clock cannot buy refill.
        assert self.quota is not None
        rejected = await self.quota.charge(admission, quota, min(now, request.submitted_at))
        if rejected is not None:
            return rejected
        if self.limits.control == "rate_limit":
            return Admit()
        self._requests[request.request_id] = request
        decision = offer(self.state, admission, quota.weight, self.limits, time.time(), self._predict)
        if isinstance(decision, Defer):
            # Registered before any await, so that the drain loop's decision finds it.
            self._waiters[request.request_id] = asyncio.get_running_loop().create_future()
        else:
            self._requests.pop(request.request_id, None)
        self._settle()
        return decision

    def _settle(self) -> None:
        """Hand the policy's decisions on deferred requests to their waiting handlers."""
        for outcome in take_outcomes(self.state):
            rid = outcome.request.request_id
            self._requests.pop(rid, None)
            waiter = self._waiters.get(rid)
            if waiter is not None and not waiter.done():
                waiter.set_result(outcome.decision)
            else:
                log.warning("a deferred request's decision found no handler", extra={"request_id": rid})
        DEFERRED.set(len(self.state.deferred))
        DEFERRED_BYTES.set(self.state.deferred_bytes)

    async def _wait(self, request_id: str, due: float) -> Admit | Reject:
        """Until the policy decides the deferred request, and never past its `due`."""
        waiter = self._waiters[request_id]
        self._wake.set()
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, due - time.time()) + 0.05)
            if waiter.done():
                return waiter.result()
            # Its due passed without a decision (a busy loop): reject it here.
            rejected = expire(self.state, request_id, time.time())
            self._requests.pop(request_id, None)
            self._settle()
            return rejected or Reject("capacity", "deferred past its due", 1.0)
        finally:
            self._waiters.pop(request_id, None)

    async def _drain_loop(self) -> None:
        while True:
            due = next_due(self.state)
            timeout = REFRESH_S if due is None else min(REFRESH_S, max(0.0, due - time.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            if self.state.deferred:
                drain(self.state, self.limits, time.time(), self._predict)
                self._settle()

    async def _on_prepared(self, event: RequestPrepared, delivery: Delivery) -> None:
        assert self.runtime is not None
        request = event.request
        admission = self._admission_request(request)
        # The decision's span covers the decision alone; built by the SDK after RequestAdmitted
        # is out (LateSpan), which the router waits on.
        late = LateSpan("admission.decide")
        admitted_now = False
        try:
            with late.activate() as span:
                decision = await self._decide(request, admission, time.time())
            if isinstance(decision, Admit):
                await self._publish_admitted(event)
                admitted_now = True
            span.set_attribute("ripple.admission.outcome", decision.outcome)
            span.set_attribute("ripple.tenant", request.tenant)
            span.set_attribute("ripple.admission.saturation", self.state.saturation)
            span.set_attribute("ripple.admission.standing", STANDING.get(admission.workflow_standing, "new"))
        finally:
            late.record()
        if isinstance(decision, Defer):
            DECISIONS.labels(request.tenant, "defer", decision.reason).inc()
            if self.state.fleet is None or self.state.fleet.workers == 0:
                await self._want_capacity(request.model, decision.due)
            held = self.state.deferred.get(request.request_id)
            predicted = held.prediction if held is not None else None
            await self._record(
                event,
                admission,
                "deferred",
                decision.reason,
                due_at=decision.due,
                predicted_ttft_s=predicted.ttft_s if predicted is not None else None,
            )
            decision = await self._wait(request.request_id, decision.due)
            WAITED.labels(decision.outcome).observe(max(0.0, time.time() - event.occurred_at))
        if isinstance(decision, Reject):
            DECISIONS.labels(request.tenant, "reject", decision.reason).inc()
            trace.get_current_span().set_attribute("ripple.admission.reason", decision.reason)
            assert self.quota is not None
            await self.quota.give_back(admission)
            await self._reject(event, decision)
            return
        DECISIONS.labels(request.tenant, "admit", decision.reason).inc()
        if not admitted_now:
            await self._publish_admitted(event)
        await self._record(event, admission, "admitted", decision.reason, waited_s=decision.waited_s)

    async def _want_capacity(self, model: str, due_at: float) -> None:
        """Held for want of any worker (scaled to zero, or all lost): the autoscaler hears it
        and plans at once. Once a second at most per model; a failure is only logged (the
        autoscaler's interval plans it anyway)."""
        assert self.runtime is not None
        now = time.time()
        if now - self._capacity_wanted_at.get(model, 0.0) < 1.0:
            return
        self._capacity_wanted_at[model] = now
        held = len(self.state.deferred)
        try:
            await self.runtime.bus.publish(
                event_subject("capacity"),
                CapacityWanted(
                    event_id=new_event_id(), occurred_at=now, model=model, held=held, due_at=due_at
                ),
            )
        except Exception as exc:
            log.warning("capacity wanted, not published", extra={"model": model, "error": repr(exc)})

    async def _publish_admitted(self, event: RequestPrepared) -> None:
        assert self.runtime is not None
        request = event.request
        now = time.time()
        event_id = derived_event_id(event.event_id, "admitted")
        self._own[event_id] = None  # before the publish: its echo may come back first
        while len(self._own) > OWN_IDS_KEPT:
            self._own.popitem(last=False)
        batch = request.service_class == "batch"
        self._recent_admitted.append((now, batch))
        if not self.limits.controls_load:
            note_admitted(self.state, batch=int(batch))  # drain counts its own admissions
        await self.runtime.bus.publish(
            admitted_subject(request.priority),
            RequestAdmitted(
                event_id=event_id,
                occurred_at=now,
                request=request,
                waited_s=max(0.0, now - request.submitted_at),
            ),
        )

    async def _record(
        self,
        event: RequestPrepared,
        admission: AdmissionRequest,
        outcome: str,
        reason: str,
        *,
        waited_s: float = 0.0,
        due_at: float | None = None,
        predicted_ttft_s: float | None = None,
    ) -> None:
        assert self.runtime is not None
        request = event.request
        await self.runtime.bus.publish(
            event_subject("admission"),
            AdmissionDecision(
                event_id=derived_event_id(event.event_id, f"admission-{outcome}"),
                occurred_at=time.time(),
                request_id=request.request_id,
                tenant=request.tenant,
                admission=self.replica_id,
                outcome=outcome,  # type: ignore[arg-type]
                reason=reason,
                priority=request.priority,
                priority_level=request.priority_level,
                waited_s=waited_s,
                due_at=due_at,
                saturation=self.state.saturation if math.isfinite(self.state.saturation) else None,
                predicted_ttft_s=predicted_ttft_s,
                workflow_id=admission.workflow_id,
                workflow_step=admission.workflow_step,
                workflow_standing=STANDING.get(admission.workflow_standing, "new"),  # type: ignore[arg-type]
                workflow_spent_usd=admission.workflow_spent_usd,
            ),
        )

    async def _reject(self, event: RequestPrepared, decision: Reject) -> None:
        assert self.runtime is not None
        await publish_rejection(
            self.runtime.bus,
            source_event_id=event.event_id,
            request_id=event.request.request_id,
            tenant=event.request.tenant,
            workflow=event.request.workflow,
            deadline_at=event.request.deadline_at,
            service_class=event.request.service_class,
            stage="admission",
            reason=decision.reason,
            message=decision.message,
            http_status=HTTP_STATUS[decision.reason],
            retry_after_s=decision.retry_after_s,
        )
