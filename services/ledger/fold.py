"""Folding a batch of lifecycle events into one change per request: pure functions, no I/O.

`fold(events, prices)` turns the new (not yet recorded) events of a batch, in delivery order, into
one `RequestDelta` per request and the pricing errors. The store applies every delta with the same
upsert (store.py), and the result is the row that applying the events one at a time would give:

- added columns (GPU-seconds, costs, KV transfer bytes) are summed;
- replaced columns take the latest reported value: prompt and cached tokens from either phase's
  report (a decode's usage is the request's total), the rest from their own phase's report;
  `has_prefill` / `has_decode` say whether the delta replaces them at all;
- the tenant is the first event's (it only matters when the delta creates the row);
- the workflow id is the first one known, and an existing row's wins;
- routing only fills workers still unknown; the worker that reports a completion always wins;
- status: a decode's report completes the request; a failure or rejection sets its status unless
  the request is completed (a late report of a retried step); routing and prefill leave it as it
  is (``running`` for a new row). Each event is one of these three functions of the row's status,
  and any sequence of them is again one of the three, told apart by its value on ``running``
  (``running``: keep; ``completed``: complete; ``failed``/``rejected``: set unless completed). So
  `RequestDelta.status` is the status the sequence gives a new row, and the upsert reconstructs
  the status it gives an existing one from it.

The one difference with one event at a time: an existing row's sum gains the delta's sum, not each
term in turn, which can differ in the last bit of a float when one batch adds several terms to the
same column of the same request (retried steps).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import (
    DecodeCompleted,
    FleetObserved,
    LifecycleEvent,
    PrefillCompleted,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from services.ledger.pricing import PricingError, price_gpu_seconds

Status = Literal["running", "completed", "failed", "rejected"]


@dataclass(slots=True)
class RequestDelta:
    """The change a batch makes to one request's row (``request_costs``), column by column.

    As a new row it is exactly the row the batch's events would have created; `has_prefill`,
    `has_decode` and `status` tell the upsert how to combine it with an existing row.
    """

    request_id: str
    tenant: str
    workflow_id: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    gpu_type_prefill: str | None = None
    gpu_type_decode: str | None = None
    prefill_gpu_seconds: float = 0.0
    decode_gpu_seconds: float = 0.0
    prefill_cost_usd: float = 0.0
    decode_cost_usd: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    kv_transfer_bytes: int = 0
    status: Status = "running"
    finish_reason: str | None = None
    latency_s: float | None = None
    # Whether a prefill (decode) report is among the events: its columns then replace the row's.
    has_prefill: bool = False
    has_decode: bool = False


@dataclass(frozen=True, slots=True)
class PricingFailure:
    """GPU time that could not be priced: 0 US$ added, the reason kept in ``ledger_errors``."""

    event_id: str
    request_id: str
    reason: str


@dataclass(slots=True)
class Folded:
    requests: list[RequestDelta] = field(default_factory=list)  # in order of first event
    errors: list[PricingFailure] = field(default_factory=list)  # in order of events


def fold(events: Iterable[LifecycleEvent], prices: Mapping[str, float]) -> Folded:
    """One delta per request for `events` (each counted: duplicates must be dropped before)."""
    deltas: dict[str, RequestDelta] = {}
    errors: list[PricingFailure] = []
    for event in events:
        if isinstance(event, FleetObserved):
            continue  # recorded in ``events`` only
        delta = deltas.get(event.request_id)
        if delta is None:
            delta = deltas[event.request_id] = RequestDelta(request_id=event.request_id, tenant=event.tenant)
        if isinstance(event, PrefillCompleted):
            cost = _price(event, prices, errors)
            delta.has_prefill = True
            delta.prefill_worker = event.worker_id
            delta.gpu_type_prefill = event.gpu_type
            delta.prefill_gpu_seconds += event.gpu_seconds
            delta.prefill_cost_usd += cost
            delta.prompt_tokens = event.prompt_tokens
            delta.cached_tokens = event.cached_tokens
            _know_workflow(delta, event.workflow_id)
        elif isinstance(event, DecodeCompleted):
            cost = _price(event, prices, errors)
            delta.has_decode = True
            delta.decode_worker = event.worker_id
            delta.gpu_type_decode = event.gpu_type
            delta.decode_gpu_seconds += event.gpu_seconds
            delta.decode_cost_usd += cost
            delta.kv_transfer_bytes += event.kv_transfer_bytes
            # Usage is the request's total, not a delta: it replaces, never adds.
            delta.prompt_tokens = event.usage.prompt_tokens
            delta.cached_tokens = event.usage.cached_tokens
            delta.completion_tokens = event.usage.completion_tokens
            delta.status = "completed"
            delta.finish_reason = event.finish_reason
            delta.latency_s = event.latency_s
            _know_workflow(delta, event.workflow_id)
        elif isinstance(event, RequestFailed):
            delta.status = _unless_completed(delta.status, "failed")
            _know_workflow(delta, event.workflow_id)
        elif isinstance(event, RequestRejected):
            delta.status = _unless_completed(delta.status, "rejected")
        elif isinstance(event, RequestRouted):
            # The workers that report completion are authoritative; routing only fills gaps.
            if delta.prefill_worker is None:
                delta.prefill_worker = event.prefill_worker
            if delta.decode_worker is None:
                delta.decode_worker = event.decode_worker
    return Folded(requests=list(deltas.values()), errors=errors)


def _know_workflow(delta: RequestDelta, workflow_id: str | None) -> None:
    if delta.workflow_id is None:
        delta.workflow_id = workflow_id


def _unless_completed(status: Status, new: Status) -> Status:
    return status if status == "completed" else new


def _price(
    event: PrefillCompleted | DecodeCompleted, prices: Mapping[str, float], errors: list[PricingFailure]
) -> float:
    """The event's cost; on a pricing error, 0 and the reason appended to `errors`."""
    try:
        return price_gpu_seconds(event.gpu_type, event.gpu_seconds, prices)
    except PricingError as exc:
        phase = "prefill" if isinstance(event, PrefillCompleted) else "decode"
        errors.append(
            PricingFailure(
                event_id=event.event_id,
                request_id=event.request_id,
                reason=f"{phase} not priced: {exc}; "
                f"{event.gpu_seconds} GPU-seconds on worker {event.worker_id} left unpriced",
            )
        )
        return 0.0
