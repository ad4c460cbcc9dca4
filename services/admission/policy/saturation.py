"""How loaded the fleet is: `fleet_load` (the live workers' heartbeats), corrected by what was
admitted and finished since (`observe_fleet`, `note_admitted`, `note_finished`); the time per
output token it gives (`decode_step_s`); a request's `prediction` from the router's earliest first
token; and `saturation` (1.0: the fleet at its target load), which each class is admitted below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.admission.policy.state import AdmissionState, FleetLoad
from services.admission.policy.types import AdmissionLimits, AdmissionRequest, Prediction
from services.router.policy import LIVENESS_S, FirstToken, WorkerSpeed, WorkerView


def fleet_load(workers: Iterable[WorkerView], now: float) -> FleetLoad:
    live = waiting = running = used = total = context = 0
    fastest: WorkerSpeed | None = None
    fastest_step = math.inf
    for w in workers:
        if w.draining or now - w.heartbeat_at > LIVENESS_S:
            continue
        live += 1
        waiting += w.queue_depth
        running += w.running
        used += w.kv_blocks_used
        total += w.kv_blocks_total
        context += w.context_tokens if w.context_tokens is not None else w.kv_blocks_used * w.block_size
        step = w.speed.decode_step_seconds(1, 0.0)
        if step < fastest_step:
            fastest, fastest_step = w.speed, step
    return FleetLoad(now, live, waiting, running, used / total if total else 0.0, context, fastest)


def decode_step_s(state: AdmissionState, joining: int = 0) -> float:
    """The time per output token the fleet gives now, by the router's roofline
    (`WorkerSpeed.decode_step_seconds`) of its fastest worker: every request in the system (running,
    waiting, admitted since the heartbeat, less those finished, plus `joining`) spread over the live
    workers, each with the running batches' mean context. 0 with no live worker."""
    fleet = state.fleet
    if fleet is None or fleet.workers == 0 or fleet.fastest is None:
        return 0.0
    in_system = fleet.running + fleet.waiting + state.admitted_since - state.finished_since + joining
    batch = max(1.0, in_system / fleet.workers)
    per_sequence = fleet.context_tokens / fleet.running if fleet.running else 0.0
    return fleet.fastest.decode_step_seconds(max(1, round(batch)), batch * per_sequence)


def prediction(
    first: FirstToken | None, request: AdmissionRequest, state: AdmissionState
) -> Prediction | None:
    """A `Prediction` from the router's earliest first token (`router.policy.earliest_first_token`;
    None: no live placement): the last token follows at the time per token the fleet gives now
    with this request in it (`decode_step_s`)."""
    if first is None:
        return None
    decode = max(0, request.output_tokens - 1) * decode_step_s(state, joining=1)
    return Prediction(first.ttft_s, first.ttft_s + decode, first.wait_s)


def observe_fleet(state: AdmissionState, fleet: FleetLoad) -> None:
    """A fresh view of the workers: what was admitted or finished before it is in it."""
    state.fleet = fleet
    state.admitted_since = state.batch_admitted_since = 0
    state.finished_since = state.batch_finished_since = 0


def note_admitted(state: AdmissionState, count: int = 1, *, batch: int = 0) -> None:
    """Another replica admitted `count` requests, `batch` of them Batch API lines (this state
    counts its own: `count_admitted`)."""
    state.admitted_since += count
    state.batch_admitted_since += batch


def count_admitted(state: AdmissionState, request: AdmissionRequest) -> None:
    """This state admitted `request`."""
    note_admitted(state, batch=1 if request.service_class == "batch" else 0)


def note_finished(state: AdmissionState, count: int = 1, *, batch: int = 0) -> None:
    state.finished_since += count
    state.batch_finished_since += batch


def saturation(
    state: AdmissionState,
    limits: AdmissionLimits,
    prediction: Prediction | None = None,
    service_class: str = "interactive",
) -> float:
    """1.0 is the fleet at its target load for a request of `service_class`: the largest of KV
    usage over `kv_high`, requests waiting per live worker (heartbeats, plus admitted, minus
    finished since) over `queue_per_worker`, the time per output token (`decode_step_s`) over
    `tpot_high_s`, and the predicted wait for the first token (queueing, not the request's own
    prefill: a long prompt on an idle fleet is no load) over `wait_high_s`. inf with no live
    worker. For an interactive request the Batch API lines admitted since the heartbeats are
    not waiting ahead of it (the engines run it first); they still load the decode steps."""
    fleet = state.fleet
    if fleet is None or fleet.workers == 0:
        return math.inf
    admitted, finished = state.admitted_since, state.finished_since
    if service_class != "batch":
        admitted -= state.batch_admitted_since
        finished -= state.batch_finished_since
    waiting = max(0, fleet.waiting + admitted - finished)
    value = max(
        fleet.kv_utilisation / limits.kv_high,
        waiting / (fleet.workers * limits.queue_per_worker),
        decode_step_s(state) / limits.tpot_high_s,
        prediction.wait_s / limits.wait_high_s if prediction is not None else 0.0,
    )
    return value
