"""What workers and the routers' take-over say the same way about a request's work.

- `decode_completed`: the event that tells the ledger a request finished. A worker publishes it
  when its stream ends; the migrator publishes it for a worker lost between its stream's end and
  its report. Both derive its id from the work item handled, so the ledger stores it once.
- `sent_at`: when a work message was sent, read off its bytes; a restarted worker and the
  routers both tell its predecessor's work from its own by it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.events import DecodeCompleted, InferenceRequest, Usage, derived_event_id


def decode_completed(
    request: InferenceRequest,
    source_event_id: str,
    *,
    now: float,
    worker_id: str,
    gpu_type: str,
    gpu_seconds: float,
    kv_transfer_bytes: int,
    usage: Usage,
    finish_reason: Literal["stop", "length"],
) -> DecodeCompleted:
    workflow = request.workflow
    return DecodeCompleted(
        event_id=derived_event_id(source_event_id, "decode_completed"),
        occurred_at=now,
        request_id=request.request_id,
        tenant=request.tenant,
        workflow_id=workflow.workflow_id if workflow else None,
        worker_id=worker_id,
        gpu_type=gpu_type,
        gpu_seconds=gpu_seconds,
        kv_transfer_bytes=kv_transfer_bytes,
        usage=usage,
        finish_reason=finish_reason,
        latency_s=max(0.0, now - request.submitted_at),
        workflow_step=workflow.step if workflow else None,
        workflow_steps=workflow.steps if workflow else None,
        deadline_at=request.deadline_at,
        priority=request.priority,
        service_class=request.service_class,
        model=request.model,
    )


class _Sent(msgspec.Struct):
    occurred_at: float = 0.0


def sent_at(data: bytes | None) -> float:
    """A work message's `occurred_at` (0 for one that does not say, or does not decode: the
    oldest, so it is taken over, or dead-lettered, rather than kept)."""
    try:
        return msgspec.json.decode(data or b"", type=_Sent).occurred_at
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0.0
