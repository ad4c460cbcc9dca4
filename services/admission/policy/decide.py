"""Admission's decision on a request: `offer` (deadline feasibility, then admit now or join the
deferral queue, shedding its lowest entry when full), `drain` (reject what is due, admit from the
queue's head while saturation allows), and `decide` (`validate`, `charge_quota` on local usage,
then `offer`, as the simulator and a single replica run it); `release` gives a lease back.
"""

from __future__ import annotations

import heapq
import math

from services.admission.policy.queue import (
    due_at,
    enqueue,
    expired,
    lowest,
    queue_head,
    remove,
    retry_after,
    tags,
)
from services.admission.policy.quota import TenantUsage, charge_quota, release_quota, validate
from services.admission.policy.saturation import count_admitted, saturation
from services.admission.policy.state import AdmissionState
from services.admission.policy.types import (
    AdmissionLimits,
    AdmissionRequest,
    Admit,
    Decision,
    Defer,
    Outcome,
    Predictor,
    Reject,
    TenantQuota,
    no_prediction,
)


def decide(
    state: AdmissionState,
    *,
    request: AdmissionRequest,
    quota: TenantQuota | None,
    limits: AdmissionLimits,
    now: float,
    predict: Predictor = no_prediction,
    lazy: bool = False,
) -> Decision:
    """Validate, charge the tenant's quota (local usage) and offer: the request's own decision.
    Deferred requests decided meanwhile are in `state.outcomes`. `lazy`: as `offer`'s."""
    rejected = validate(request, quota, limits, now)
    if rejected is not None or quota is None:
        return rejected or Reject("invalid", "unknown tenant", None)
    if limits.control == "none":
        return Admit()
    usage = state.usage.get(request.tenant)
    if usage is None:
        usage = state.usage[request.tenant] = TenantUsage()
    rejected = charge_quota(usage, quota, request, limits, now)
    if rejected is not None:
        return rejected
    if limits.control == "rate_limit":
        return Admit()
    decision = offer(state, request, quota.weight, limits, now, predict, lazy)
    if isinstance(decision, Reject):
        release_quota(usage, request.request_id)
    return decision


def release(state: AdmissionState, tenant: str, request_id: str) -> None:
    """The request ended (completed, failed or rejected): its concurrency lease goes back."""
    usage = state.usage.get(tenant)
    if usage is not None:
        release_quota(usage, request_id)


def offer(
    state: AdmissionState,
    request: AdmissionRequest,
    weight: float,
    limits: AdmissionLimits,
    now: float,
    predict: Predictor = no_prediction,
    lazy: bool = False,
) -> Decision:
    """Feasibility, then the deferral queue, then `drain`: Admit, Defer (until `due`) or Reject.
    The request must be valid and its quota charged.

    `lazy` (the simulator): a request without a deadline is predicted only when `drain` weighs it
    at the head of the queue, the one decision its prediction takes part in; until then its entry
    has none (so a rejection while deferred carries the default retry-after, and the service's
    record of a deferral no predicted TTFT: the service predicts every request at once)."""
    if request.request_id in state.deferred:
        return Defer(state.deferred[request.request_id].due, "already deferred")
    predicted = request.deadline_at is not None or not lazy
    prediction = predict(request) if predicted else None
    if request.deadline_at is not None and prediction is not None:
        late = now + prediction.finish_s - request.deadline_at
        if late > 0:
            return Reject(
                "deadline",
                f"the deadline cannot be met: the earliest first token is predicted in "
                f"{prediction.ttft_s:.2f} s and the last in {prediction.finish_s:.2f} s, "
                f"{late:.2f} s past the deadline",
                retry_after(prediction),
            )
    if len(state.deferred) >= limits.max_deferred or (
        state.deferred_bytes + request.size_bytes > limits.max_deferred_bytes and state.deferred
    ):
        victim = lowest(state, request, weight, limits)
        if victim is None:
            return Reject(
                "capacity",
                f"the fleet is saturated and the deferral queue is full ({len(state.deferred)} "
                "requests of equal or higher priority wait)",
                retry_after(prediction),
            )
        remove(state, victim)
        state.outcomes.append(
            Outcome(
                victim.request,
                Reject(
                    "capacity",
                    "shed while deferred: the fleet is saturated and a higher-priority request "
                    "needed the place",
                    retry_after(victim.prediction),
                ),
            )
        )
    if not state.deferred:
        # Nothing queued: the request is the head at once. `drain`'s decision on it, without the
        # queue's bookkeeping when it is admitted (the same outcome, the same fair-queuing state).
        due = due_at(request, limits, now, prediction)
        if due > now:  # else it expires at once in `drain`
            bound = limits.admit_below(request.priority, request.workflow_standing)
            if not predicted and saturation(state, limits, service_class=request.service_class) < bound:
                prediction, predicted = predict(request), True
            if predicted:
                value = saturation(state, limits, prediction, request.service_class)
                if value < bound:
                    state.saturation = value
                    start, finish = tags(state, request, weight)
                    state._seq += 1
                    state._last_finish[(request.priority, request.tenant)] = finish
                    state._virtual[request.priority] = max(state._virtual.get(request.priority, 0.0), start)
                    count_admitted(state, request)
                    return Admit(0.0, "admitted")
    # Not yet predicted (lazy): `drain` predicts it when it reaches the head.
    entry = enqueue(state, request, weight, limits, now, prediction, now if predicted else -math.inf)
    before = len(state.outcomes)
    drain(state, limits, now, predict)
    for i in range(before, len(state.outcomes)):
        outcome = state.outcomes[i]
        if outcome.request is request:
            del state.outcomes[i]
            decision = outcome.decision
            if isinstance(decision, Admit):
                return Admit(0.0, "admitted")
            return decision
    return Defer(entry.due)


def drain(
    state: AdmissionState, limits: AdmissionLimits, now: float, predict: Predictor = no_prediction
) -> None:
    """Decide what the deferral queue can decide now, into `state.outcomes`: reject what is due
    (or can no longer meet its deadline), then admit from the head while saturation allows."""
    due = state._due
    while due and (due[0][2].removed or due[0][0] <= now):
        _, _, entry = heapq.heappop(due)
        if entry.removed:
            continue
        remove(state, entry)
        state.outcomes.append(Outcome(entry.request, expired(state, entry, now)))
    while True:
        head = queue_head(state)
        if head is None:
            break
        request = head.request
        bound = limits.admit_below(request.priority, request.workflow_standing)
        if request.deadline_at is None and head.predicted_at != now:
            # Without a deadline the prediction only adds its wait to the saturation: when the
            # fleet is over the bound without it, the answer is the same and it is not needed.
            value = saturation(state, limits, service_class=request.service_class)
            if value >= bound:
                state.saturation = value
                break
        if head.predicted_at != now:
            head.prediction = predict(request)
            head.predicted_at = now
        prediction = head.prediction
        if (
            request.deadline_at is not None
            and prediction is not None
            and now + prediction.finish_s > request.deadline_at
        ):
            remove(state, head)
            state.outcomes.append(
                Outcome(
                    request,
                    Reject(
                        "deadline",
                        f"deferred {now - head.offered_at:.2f} s; the deadline can no longer be met "
                        f"(last token predicted {prediction.finish_s:.2f} s from now)",
                        retry_after(prediction),
                    ),
                )
            )
            continue
        value = saturation(state, limits, prediction, request.service_class)
        state.saturation = value
        if value >= bound:
            break
        remove(state, head)
        starts = state._starts.get(request.priority, [])
        while starts and starts[0][2].removed:
            heapq.heappop(starts)
        served = min(head.start, starts[0][0]) if starts else head.start
        state._virtual[request.priority] = max(state._virtual.get(request.priority, 0.0), served)
        key = (request.priority, request.tenant)
        state._last_finish[key] = max(state._last_finish.get(key, 0.0), head.finish)
        count_admitted(state, request)
        waited = now - head.offered_at
        state.outcomes.append(Outcome(request, Admit(waited, "after_deferral" if waited > 0 else "admitted")))
