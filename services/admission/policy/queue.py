"""The deferral queue's order and bookkeeping: the dispatch order (class, priority level,
workflow standing, then the fair-queuing start tag between tenants: `standing_key`, `tags`), the
entry shed when the queue is full (`lowest`, `shed_rank`), when a deferred request must be
decided by (`due_at`) and what it is told when that passes (`expired`, `expire`), the earliest
such time (`next_due`), and the retry-after of a capacity or deadline rejection (`retry_after`).
The decisions on deferred requests wait in `state.outcomes` for the caller (`take_outcomes`).
"""

from __future__ import annotations

import heapq

from services.admission.policy.state import AdmissionState, Entry
from services.admission.policy.types import (
    CLASS_RANK,
    AdmissionLimits,
    AdmissionRequest,
    Outcome,
    Prediction,
    Reject,
)


def standing_key(request: AdmissionRequest) -> tuple[int, int, int]:
    return (CLASS_RANK[request.priority], request.priority_level, request.workflow_standing)


def retry_after(prediction: Prediction | None) -> float:
    return max(1.0, prediction.ttft_s) if prediction is not None else 5.0


def tags(state: AdmissionState, request: AdmissionRequest, weight: float) -> tuple[float, float]:
    key = (request.priority, request.tenant)
    start = max(state._virtual.get(request.priority, 0.0), state._last_finish.get(key, 0.0))
    return start, start + request.tokens / max(weight, 1e-9)


def lowest(
    state: AdmissionState, newcomer: AdmissionRequest, weight: float, limits: AdmissionLimits
) -> Entry | None:
    """The queued entry to shed for `newcomer`, if one ranks below it: the lowest class, priority
    level and workflow standing; among continuations the least spent; else the latest start tag
    (the most-served tenant's)."""
    start, _ = tags(state, newcomer, weight)
    ranks = state._ranks
    while ranks and ranks[0][2].removed:
        heapq.heappop(ranks)
    if not ranks or ranks[0][0] >= shed_rank(newcomer, start):
        return None
    return ranks[0][2]


def shed_rank(request: AdmissionRequest, start: float) -> tuple[int, int, int, float, float]:
    """Shed first: the lowest class, level, standing, workflow spend, then the latest start tag."""
    return (*standing_key(request), request.workflow_spent_usd, -start)


def enqueue(
    state: AdmissionState,
    request: AdmissionRequest,
    weight: float,
    limits: AdmissionLimits,
    now: float,
    prediction: Prediction | None,
    predicted_at: float,
) -> Entry:
    start, finish = tags(state, request, weight)
    state._last_finish[(request.priority, request.tenant)] = finish
    due = due_at(request, limits, now, prediction)
    state._seq += 1
    rank = standing_key(request)
    key = (-rank[0], -rank[1], -rank[2], start, state._seq)
    entry = Entry(request, key, start, finish, max(now, due), now, prediction, predicted_at)
    state.deferred[request.request_id] = entry
    state.deferred_bytes += request.size_bytes
    heapq.heappush(state._queue, (key, entry))
    ranks = state._ranks
    if len(ranks) > 64 and len(ranks) > 2 * len(state.deferred):
        # Mostly removed entries: keep the queued ones only.
        ranks[:] = [r for r in ranks if not r[2].removed]
        heapq.heapify(ranks)
    heapq.heappush(ranks, (shed_rank(request, start), state._seq, entry))
    heapq.heappush(state._due, (entry.due, state._seq, entry))
    heapq.heappush(state._starts.setdefault(request.priority, []), (start, state._seq, entry))
    return entry


def due_at(
    request: AdmissionRequest, limits: AdmissionLimits, now: float, prediction: Prediction | None
) -> float:
    """When a deferred request must be decided by. A deadline
    is the client's own word on how long it will wait: a request carrying one waits while the
    deadline can still be met (a sheddable step with minutes to spare is served once a burst
    has passed, not turned away when a fixed wait runs out); one without waits `max_defer_s`."""
    if request.deadline_at is not None:
        margin = prediction.finish_s if prediction is not None else limits.deadline_margin_s
        return request.deadline_at - margin
    return now + limits.max_defer_s


def remove(state: AdmissionState, entry: Entry) -> None:
    entry.removed = True
    request = entry.request
    del state.deferred[request.request_id]
    state.deferred_bytes -= request.size_bytes
    key = (request.priority, request.tenant)
    if state._last_finish.get(key) == entry.finish:
        # Nothing of the tenant's was served after it: give back its place in the fair queue.
        state._last_finish[key] = entry.start


def queue_head(state: AdmissionState) -> Entry | None:
    queue = state._queue
    while queue and queue[0][1].removed:
        heapq.heappop(queue)
    return queue[0][1] if queue else None


def expired(state: AdmissionState, entry: Entry, now: float) -> Reject:
    waited = now - entry.offered_at
    if state.fleet is None or state.fleet.workers == 0:
        return Reject("no_workers", f"no live worker after {waited:.2f} s deferred", 5.0)
    if entry.request.deadline_at is not None:  # its deadline set its due (`due_at`)
        return Reject(
            "deadline",
            f"deferred {waited:.2f} s; the fleet stayed saturated until the deadline could no longer be met",
            retry_after(entry.prediction),
        )
    return Reject(
        "capacity",
        f"deferred {waited:.2f} s, the longest wait allowed; the fleet stayed saturated "
        f"(saturation {state.saturation:.2f})",
        retry_after(entry.prediction),
    )


def expire(state: AdmissionState, request_id: str, now: float) -> Reject | None:
    """A deferred request's wait ran out in the caller (its timer): reject it now. None when it was
    decided already."""
    entry = state.deferred.get(request_id)
    if entry is None:
        return None
    remove(state, entry)
    return expired(state, entry, now)


def next_due(state: AdmissionState) -> float | None:
    """When the earliest deferred request must be decided."""
    due = state._due
    while due and due[0][2].removed:
        heapq.heappop(due)
    return due[0][0] if due else None


def take_outcomes(state: AdmissionState) -> list[Outcome]:
    outcomes, state.outcomes = state.outcomes, []
    return outcomes
