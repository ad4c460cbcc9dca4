"""Folding a batch of lifecycle events into one change per request: pure functions, no I/O.

`fold(events, prices)` turns the new (not yet recorded) events of a batch, in delivery order, into
one `RequestDelta` per request and the pricing errors. The store applies every delta with the same
upsert (upserts.py), and the result is the row that applying the events one at a time would give:

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

The same batch also gives one `TaskDelta` per task (tasks.py): sums, maxima and minima of the
task's facts, so that the order of events never matters; one `WorkerBusy` per worker (the
GPU-seconds it reported, from which idle time is derived: idle.py); and one `EventRow` per event,
with its cost, for the figures by time window, tenant and pool.

KV transfer bytes (a decode's `kv_transfer_bytes`) are priced at `kv_usd_per_gb` and belong to
the decode: to its request, task and worker.

The one difference with one event at a time: an existing row's sum gains the delta's sum, not each
term in turn, which can differ in the last bit of a float when one batch adds several terms to the
same column of the same request (retried steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import (
    AdmissionDecision,
    CapacityWanted,
    DecodeCompleted,
    FleetObserved,
    LifecycleEvent,
    PrefillCompleted,
    RequestCancelled,
    RequestFailed,
    RequestMigrated,
    RequestRejected,
    RequestRouted,
    RouteDecision,
    ScalingDecision,
    WorkStopped,
)
from services.ledger.pricing import PricingError, price_gpu_seconds, price_kv_transfer
from services.ledger.tasks import UNKNOWN_STEP, TaskKind, task_key

Status = Literal["running", "completed", "failed", "rejected"]
# The events that tell a step's outcome.
_StepEvent = DecodeCompleted | RequestFailed | RequestRejected | RequestCancelled


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
    # Added; replaced by a decode's report (like finish_reason); known ones fill gaps.
    kv_cost_usd: float = 0.0
    completed_at: float | None = None
    deadline_at: float | None = None
    workflow_step: int | None = None
    workflow_steps: int | None = None
    # 'batch' for a Batch API line (from its decode's report); None: interactive. Fills a gap.
    service_class: str | None = None
    # The model that served it (from its prefill's or decode's report). Fills a gap.
    model: str | None = None
    # Whether a prefill (decode) report is among the events: its columns then replace the row's.
    has_prefill: bool = False
    has_decode: bool = False


@dataclass(slots=True)
class TaskDelta:
    """The change a batch makes to one task's row (``tasks``). Every fact combines with the
    row's by a sum (costs, counts), a maximum (steps, last event) or a minimum (final
    completion, first event); the tenant and workflow id are the row's once it exists."""

    task_key: str
    kind: TaskKind
    workflow_id: str | None
    tenant: str
    first_event_at: float
    last_event_at: float
    steps: int | None = None
    max_completed_step: int = 0
    max_failed_step: int = 0
    final_completed_at: float | None = None
    deadline_misses: int = 0
    completions: int = 0
    failures: int = 0
    gpu_seconds: float = 0.0
    gpu_cost_usd: float = 0.0
    kv_cost_usd: float = 0.0
    kv_transfer_bytes: int = 0


@dataclass(slots=True)
class WorkerBusy:
    """GPU time a worker reported in a batch (added to ``workers``), priced or not."""

    worker_id: str
    gpu_type: str
    busy_gpu_seconds: float = 0.0
    busy_cost_usd: float = 0.0


# One ``events`` row: the event's id and type, what it concerns, and what it cost (None where it
# carries no GPU time, or its GPU time could not be priced). `recorded_at` is the store's.
EventRow = tuple[
    str,  # event_id
    str,  # type
    str | None,  # request_id
    str | None,  # tenant
    float,  # occurred_at
    str | None,  # task_key
    str | None,  # worker_id
    str | None,  # gpu_type
    float | None,  # gpu_seconds
    float | None,  # cost_usd (GPU)
    int | None,  # kv_transfer_bytes
    float | None,  # kv_cost_usd
]
EVENT_ROW_FIELDS = (
    "event_id",
    "type",
    "request_id",
    "tenant",
    "occurred_at",
    "task_key",
    "worker_id",
    "gpu_type",
    "gpu_seconds",
    "cost_usd",
    "kv_transfer_bytes",
    "kv_cost_usd",
)


@dataclass(frozen=True, slots=True)
class PricingFailure:
    """GPU time that could not be priced: 0 US$ added, the reason kept in ``ledger_errors``."""

    event_id: str
    request_id: str
    reason: str


@dataclass(slots=True)
class Folded:
    requests: list[RequestDelta] = field(default_factory=list)  # in order of first event
    tasks: list[TaskDelta] = field(default_factory=list)  # in order of first event
    workers: list[WorkerBusy] = field(default_factory=list)  # in order of first report
    events: list[EventRow] = field(default_factory=list)  # one per event, in order
    errors: list[PricingFailure] = field(default_factory=list)  # in order of events


def fold(events: Iterable[LifecycleEvent], prices: Mapping[str, float], kv_usd_per_gb: float = 0.0) -> Folded:
    """One delta per request, task and worker for `events`, and one row per event (each event
    counted: duplicates must be dropped before)."""
    deltas: dict[str, RequestDelta] = {}
    tasks: dict[str, TaskDelta] = {}
    workers: dict[str, WorkerBusy] = {}
    rows: list[EventRow] = []
    errors: list[PricingFailure] = []
    for event in events:
        tag = _TAGS[type(event)]
        if isinstance(event, FleetObserved | ScalingDecision | CapacityWanted):
            # The autoscaler's plans, admission's calls for capacity: recorded in ``events`` only.
            rows.append(_row_without_cost(event.event_id, tag, event.occurred_at))
            continue
        if isinstance(event, RouteDecision | AdmissionDecision):
            # Admission's and the router's reasoning (RequestRouted and RequestRejected carry its effects): an
            # event row for the audit trail, no cost and no change to the request's row.
            rows.append(
                _row_without_cost(event.event_id, tag, event.occurred_at, event.request_id, event.tenant)
            )
            continue
        delta = deltas.get(event.request_id)
        if delta is None:
            delta = deltas[event.request_id] = RequestDelta(request_id=event.request_id, tenant=event.tenant)
        if isinstance(event, RequestRouted):
            # The workers that report completion are authoritative; routing only fills gaps.
            if delta.prefill_worker is None:
                delta.prefill_worker = event.prefill_worker
            if delta.decode_worker is None:
                delta.decode_worker = event.decode_worker
            # No workflow id on a routing decision: it belongs to no task (it costs nothing).
            rows.append(
                _row_without_cost(event.event_id, tag, event.occurred_at, event.request_id, event.tenant)
            )
            continue
        workflow_id = event.workflow_id
        key = task_key(workflow_id, event.request_id)
        task = tasks.get(key)
        if task is None:
            task = tasks[key] = TaskDelta(
                task_key=key,
                kind="workflow" if workflow_id else "request",
                workflow_id=workflow_id or None,
                tenant=event.tenant,
                first_event_at=event.occurred_at,
                last_event_at=event.occurred_at,
            )
        else:
            task.first_event_at = min(task.first_event_at, event.occurred_at)
            task.last_event_at = max(task.last_event_at, event.occurred_at)
        if isinstance(event, PrefillCompleted | DecodeCompleted):
            cost = _price(event, prices, errors)
            # GPU time that is not a duration (negative, NaN: only from a producer that skipped
            # validation) is an error (above) and adds nothing anywhere.
            seconds = event.gpu_seconds if _is_duration(event.gpu_seconds) else 0.0
            kv_cost = 0.0
            kv_bytes: int | None = None
            delta.model = delta.model or event.model
            if isinstance(event, PrefillCompleted):
                delta.has_prefill = True
                delta.prefill_worker = event.worker_id
                delta.gpu_type_prefill = event.gpu_type
                delta.prefill_gpu_seconds += seconds
                delta.prefill_cost_usd += cost or 0.0
                delta.prompt_tokens = event.prompt_tokens
                delta.cached_tokens = event.cached_tokens
            else:
                kv_cost = _price_kv(event, kv_usd_per_gb, errors)
                kv_bytes = max(0, event.kv_transfer_bytes)
                delta.has_decode = True
                delta.decode_worker = event.worker_id
                delta.gpu_type_decode = event.gpu_type
                delta.decode_gpu_seconds += seconds
                delta.decode_cost_usd += cost or 0.0
                delta.kv_transfer_bytes += kv_bytes
                delta.kv_cost_usd += kv_cost
                # Usage is the request's total, not a delta: it replaces, never adds.
                delta.prompt_tokens = event.usage.prompt_tokens
                delta.cached_tokens = event.usage.cached_tokens
                delta.completion_tokens = event.usage.completion_tokens
                delta.status = "completed"
                delta.finish_reason = event.finish_reason
                delta.latency_s = event.latency_s
                delta.completed_at = event.occurred_at
                if event.service_class != "interactive":
                    delta.service_class = event.service_class
                _complete(task, event, workflow_id)
                task.kv_cost_usd += kv_cost
                task.kv_transfer_bytes += kv_bytes
            _charge_gpu_time(task, workers, event, key, tag, seconds, cost, rows, kv_bytes, kv_cost)
        elif isinstance(event, WorkStopped):
            # GPU time of a request stopped early (cancelled, revoked, drained): spent on the
            # request and its task, by the worker; the request's status is the cancellation's
            # or the migration's outcome, not this report's.
            cost = _price(event, prices, errors)
            seconds = event.gpu_seconds if _is_duration(event.gpu_seconds) else 0.0
            delta.decode_gpu_seconds += seconds
            delta.decode_cost_usd += cost or 0.0
            _charge_gpu_time(task, workers, event, key, tag, seconds, cost, rows)
        elif isinstance(event, RequestMigrated):
            # A migration counts against its task (an event row with the task's key and the
            # worker it left); the re-prefill's GPU time comes with its own PrefillCompleted.
            rows.append(
                _row_without_cost(
                    event.event_id,
                    tag,
                    event.occurred_at,
                    event.request_id,
                    event.tenant,
                    key,
                    event.from_worker,
                )
            )
        else:  # RequestFailed | RequestRejected | RequestCancelled: the request's step failed
            # A cancelled request is no success: it fails its task, and what it spent is waste.
            new_status: Status = "rejected" if isinstance(event, RequestRejected) else "failed"
            delta.status = _unless_completed(delta.status, new_status)
            if not isinstance(event, RequestCancelled) and event.service_class != "interactive":
                delta.service_class = event.service_class
            task.failures += 1
            task.max_failed_step = max(task.max_failed_step, _step_of(event, workflow_id, UNKNOWN_STEP))
            task.steps = _max_steps(task.steps, _steps_of(event, workflow_id))
            worker_id = event.worker_id if isinstance(event, RequestFailed) else None
            rows.append(
                _row_without_cost(
                    event.event_id, tag, event.occurred_at, event.request_id, event.tenant, key, worker_id
                )
            )
        _know_workflow(delta, event)
    return Folded(
        requests=list(deltas.values()),
        tasks=list(tasks.values()),
        workers=list(workers.values()),
        events=rows,
        errors=errors,
    )


def _charge_gpu_time(
    task: TaskDelta,
    workers: dict[str, WorkerBusy],
    event: PrefillCompleted | DecodeCompleted | WorkStopped,
    key: str,
    tag: str,
    seconds: float,
    cost: float | None,
    rows: list[EventRow],
    kv_bytes: int | None = None,
    kv_cost: float = 0.0,
) -> None:
    """GPU time a worker reported for a request: on the request's task, on the worker's busy
    time (for idle time), and as the event's row."""
    task.gpu_seconds += seconds
    task.gpu_cost_usd += cost or 0.0
    busy = workers.get(event.worker_id)
    if busy is None:
        busy = workers[event.worker_id] = WorkerBusy(event.worker_id, event.gpu_type)
    busy.gpu_type = event.gpu_type
    busy.busy_gpu_seconds += seconds
    busy.busy_cost_usd += (cost or 0.0) + kv_cost
    rows.append(
        (
            event.event_id,
            tag,
            event.request_id,
            event.tenant,
            event.occurred_at,
            key,
            event.worker_id,
            event.gpu_type,
            seconds,
            cost,
            kv_bytes,
            kv_cost if kv_bytes is not None else None,
        )
    )


def _is_duration(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds >= 0


def _complete(task: TaskDelta, event: DecodeCompleted, workflow_id: str | None) -> None:
    """A decode's report: a completed step, perhaps the final one, perhaps past its deadline."""
    task.completions += 1
    step = _step_of(event, workflow_id, 0)
    steps = _steps_of(event, workflow_id)
    task.max_completed_step = max(task.max_completed_step, step)
    task.steps = _max_steps(task.steps, steps)
    if steps is not None and step >= steps:
        done = task.final_completed_at
        task.final_completed_at = event.occurred_at if done is None else min(done, event.occurred_at)
    if event.deadline_at is not None and event.occurred_at > event.deadline_at:
        task.deadline_misses += 1


def _step_of(event: _StepEvent, workflow_id: str | None, unknown: int) -> int:
    if workflow_id is None:
        return 1  # a standalone request is a task of one step
    return event.workflow_step if event.workflow_step is not None else unknown


def _steps_of(event: _StepEvent, workflow_id: str | None) -> int | None:
    if workflow_id is None:
        return 1
    return event.workflow_steps


def _max_steps(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


def _know_workflow(
    delta: RequestDelta,
    event: PrefillCompleted
    | DecodeCompleted
    | RequestFailed
    | RequestRejected
    | RequestCancelled
    | RequestMigrated
    | WorkStopped,
) -> None:
    """The request's workflow, step and deadline: the first known (the row's, once it has them)."""
    if delta.workflow_id is None:
        delta.workflow_id = event.workflow_id
    if isinstance(event, PrefillCompleted | WorkStopped):
        return
    if delta.workflow_step is None:
        delta.workflow_step = event.workflow_step
    if delta.workflow_steps is None:
        delta.workflow_steps = event.workflow_steps
    if delta.deadline_at is None:
        delta.deadline_at = event.deadline_at


def _unless_completed(status: Status, new: Status) -> Status:
    return status if status == "completed" else new


_TAGS: dict[type, str] = {
    cls: str(cls.__struct_config__.tag)
    for cls in (
        RequestRejected,
        AdmissionDecision,
        RequestRouted,
        RouteDecision,
        PrefillCompleted,
        DecodeCompleted,
        RequestFailed,
        RequestCancelled,
        RequestMigrated,
        WorkStopped,
        FleetObserved,
        ScalingDecision,
        CapacityWanted,
    )
}


def _row_without_cost(
    event_id: str,
    tag: str,
    occurred_at: float,
    request_id: str | None = None,
    tenant: str | None = None,
    task_key: str | None = None,
    worker_id: str | None = None,
) -> EventRow:
    """The row of an event that carries no GPU time: its GPU type and cost columns empty."""
    return (event_id, tag, request_id, tenant, occurred_at, task_key, worker_id, None, None, None, None, None)


def _price_kv(event: DecodeCompleted, usd_per_gb: float, errors: list[PricingFailure]) -> float:
    """The KV transfer's cost; on a pricing error, 0 and the reason appended to `errors`."""
    if not event.kv_transfer_bytes:
        return 0.0
    try:
        return price_kv_transfer(event.kv_transfer_bytes, usd_per_gb)
    except PricingError as exc:
        errors.append(
            PricingFailure(
                event_id=event.event_id,
                request_id=event.request_id,
                reason=f"KV transfer not priced: {exc}; {event.kv_transfer_bytes} bytes left unpriced",
            )
        )
        return 0.0


def _price(
    event: PrefillCompleted | DecodeCompleted | WorkStopped,
    prices: Mapping[str, float],
    errors: list[PricingFailure],
) -> float | None:
    """The event's cost; on a pricing error, None and the reason appended to `errors`."""
    try:
        return price_gpu_seconds(event.gpu_type, event.gpu_seconds, prices)
    except PricingError as exc:
        phase = {PrefillCompleted: "prefill", DecodeCompleted: "decode"}.get(type(event), "stopped work")
        errors.append(
            PricingFailure(
                event_id=event.event_id,
                request_id=event.request_id,
                reason=f"{phase} not priced: {exc}; "
                f"{event.gpu_seconds} GPU-seconds on worker {event.worker_id} left unpriced",
            )
        )
        return None
