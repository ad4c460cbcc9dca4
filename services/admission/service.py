"""Admission: consume prepared requests, decide (policy.py), publish the admitted ones for the
router, and answer rejected ones on their token subject with the reason and a retry-after."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from opentelemetry import trace
from prometheus_client import Counter
from starlette.routing import BaseRoute

from schemas.events import (
    RequestAdmitted,
    RequestPrepared,
    derived_event_id,
)
from schemas.subjects import ADMISSION_CONSUMER, admitted_subject
from services.admission.policy import (
    AdmissionLimits,
    AdmissionRequest,
    AdmissionState,
    Reject,
    TenantQuota,
    decide,
)
from services.mesh.consumer import Delivery
from services.mesh.rejection import publish_rejection
from services.mesh.runtime import Runtime
from services.mesh.tracing import tracer

DECISIONS = Counter(
    "ripplemesh_admission_decisions_total",
    "Admission decisions by outcome and reason.",
    ["tenant", "outcome", "reason"],
)

HTTP_STATUS = {"quota": 429, "capacity": 503, "deadline": 503, "invalid": 400, "no_workers": 503}


class AdmissionService:
    name: ClassVar[str] = "admission"

    def __init__(self) -> None:
        self.state = AdmissionState()
        self.runtime: Runtime | None = None

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        await runtime.consume(ADMISSION_CONSUMER, RequestPrepared, self._on_prepared, max_inflight=256)

    async def stop(self) -> None:
        return None

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        return {"tenants_tracked": len(self.state.usage)}

    def _quota(self, tenant: str) -> TenantQuota | None:
        assert self.runtime is not None
        config = self.runtime.config.tenants.get(tenant)
        if config is None:
            return None
        return TenantQuota(
            requests_per_s=config.requests_per_s,
            request_burst=config.request_burst,
            tokens_per_s=config.tokens_per_s,
            token_burst=config.token_burst,
        )

    async def _on_prepared(self, event: RequestPrepared, delivery: Delivery) -> None:
        assert self.runtime is not None
        request = event.request
        now = time.time()
        with tracer().start_as_current_span("admission.decide") as span:
            decision = decide(
                self.state,
                request=AdmissionRequest(
                    request_id=request.request_id,
                    tenant=request.tenant,
                    priority=request.priority,
                    input_tokens=len(request.prompt_tokens),
                    output_tokens=request.max_tokens,
                    submitted_at=request.submitted_at,
                    deadline_at=request.deadline_at,
                ),
                quota=self._quota(request.tenant),
                limits=AdmissionLimits(control="rate_limit"),
                now=now,
            )
            span.set_attribute("ripple.admission.outcome", decision.outcome)
            span.set_attribute("ripple.tenant", request.tenant)
        if isinstance(decision, Reject):
            DECISIONS.labels(request.tenant, "reject", decision.reason).inc()
            trace.get_current_span().set_attribute("ripple.admission.reason", decision.reason)
            await self._reject(event, decision, now)
            return
        DECISIONS.labels(request.tenant, "admit", "").inc()
        await self.runtime.bus.publish(
            admitted_subject(request.priority),
            RequestAdmitted(
                event_id=derived_event_id(event.event_id, "admitted"),
                occurred_at=now,
                request=request,
                waited_s=max(0.0, now - request.submitted_at),
            ),
        )

    async def _reject(self, event: RequestPrepared, decision: Reject, now: float) -> None:
        assert self.runtime is not None
        await publish_rejection(
            self.runtime.bus,
            source_event_id=event.event_id,
            request_id=event.request.request_id,
            tenant=event.request.tenant,
            workflow=event.request.workflow,
            deadline_at=event.request.deadline_at,
            stage="admission",
            reason=decision.reason,
            message=decision.message,
            http_status=HTTP_STATUS[decision.reason],
            retry_after_s=decision.retry_after_s,
        )
