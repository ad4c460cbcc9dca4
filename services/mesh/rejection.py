"""Telling a client, and the ledger, that a request will not be served.

Ingress, admission and router reject requests the same way: a `StreamFailed` on the request's
token subject (what the client sees: an HTTP status and a retry-after) and a `RequestRejected`
lifecycle event (what the ledger and the audit log see). Ids derive from the event being handled,
so a redelivered input rejects once.
"""

from __future__ import annotations

import time
from typing import Literal

from schemas.events import RequestRejected, ServiceClass, StreamFailed, WorkflowRef, derived_event_id
from schemas.subjects import event_subject, tokens_subject
from services.mesh.bus import Bus

Reason = Literal["quota", "capacity", "deadline", "invalid", "no_workers"]


async def publish_rejection(
    bus: Bus,
    *,
    source_event_id: str,
    request_id: str,
    tenant: str,
    stage: Literal["ingress", "admission", "router"],
    reason: Reason,
    message: str,
    http_status: int,
    retry_after_s: float | None = None,
    workflow: WorkflowRef | None = None,
    deadline_at: float | None = None,
    seq: int = 0,
    service_class: ServiceClass = "interactive",
) -> None:
    """`workflow` and `deadline_at` (the request's, when known) let the ledger fail the
    rejected request's workflow. `seq` is where the client's stream stands: 0, except for a
    request placed again mid-stream (a migration). `service_class` (a Batch API line's "batch")
    lets the ledger count the rejection in its class."""
    now = time.time()
    await bus.publish(
        tokens_subject(tenant, request_id),
        StreamFailed(
            event_id=derived_event_id(source_event_id, "failed"),
            occurred_at=now,
            request_id=request_id,
            seq=seq,
            code=reason,
            message=message,
            http_status=http_status,
            retry_after_s=retry_after_s,
        ),
    )
    await bus.publish(
        event_subject("rejected"),
        RequestRejected(
            event_id=derived_event_id(source_event_id, "rejected"),
            occurred_at=now,
            request_id=request_id,
            tenant=tenant,
            stage=stage,
            reason=reason,
            message=message,
            retry_after_s=retry_after_s,
            workflow_id=workflow.workflow_id if workflow else None,
            workflow_step=workflow.step if workflow else None,
            workflow_steps=workflow.steps if workflow else None,
            deadline_at=deadline_at,
            service_class=service_class,
        ),
    )
