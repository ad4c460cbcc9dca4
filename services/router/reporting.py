"""What the router says about each decision, and how its predictions turn out.

- `span_attributes`: the ``ripple.router.*`` attributes of the ``router.decide`` span (the chosen
  placement, its predictions, the runners-up with their scores, the policy, the candidates).
- `decision_event`: the `RouteDecision` lifecycle event, for every decision, placed or not.
- `Predictions`: the predictions of this router's recent placements (bounded), matched against
  the `PrefillCompleted` events the workers publish, for the prediction-error histograms.
- Prometheus metrics: decisions by policy, outcome and mode; decision latency; prediction errors.

TTFT is counted from the routing decision (when the policy is called) to the first token, as the
policy predicts it; the worker's PrefillCompleted `occurred_at` is when the first token went out.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from opentelemetry.util.types import AttributeValue
from prometheus_client import Counter, Gauge, Histogram

from schemas.events import (
    DecodeCompleted,
    InferenceRequest,
    PrefillCompleted,
    RequestFailed,
    RouteDecision,
    RouteOption,
)
from services.router.policy import NoPlacement, Placement, RouterState, ScoredOption

DECISIONS = Counter(
    "ripplemesh_router_decisions_total",
    "Routing decisions, by policy, outcome (placed, or the NoPlacement reason: no_workers, "
    "invalid, infeasible) and mode (aggregated, disaggregated; none when not placed).",
    ["policy", "outcome", "mode"],
)
DECISION_SECONDS = Histogram(
    "ripplemesh_router_decision_seconds",
    "Time the policy took to decide one request (the last place() call; waits for workers aside).",
    buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1),
)
# Errors are recorded by size, labelled by direction (over: the prediction was above what
# happened; under: below; exact), so each histogram keeps its sum (a histogram of signed values
# would not export one).
CACHED_TOKENS_ERROR = Histogram(
    "ripplemesh_router_prediction_error_cached_tokens",
    "|Actual - predicted| cached prompt tokens, per placement whose prefill completed.",
    ["direction"],
    buckets=(0, 1, 16, 64, 256, 1024, 4096),
)
TTFT_ERROR = Histogram(
    "ripplemesh_router_prediction_error_ttft_seconds",
    "|Actual - predicted| time from the routing decision to the first token.",
    ["direction"],
    buckets=(0.001, 0.005, 0.025, 0.1, 0.5, 1.0, 5.0),
)
PROMPT_TOKENS = Counter(
    "ripplemesh_router_prompt_tokens_total",
    "Prompt tokens of this router's placements whose prefill completed, by policy, the prefill "
    "worker's pool and source (cached: the prefix cache; computed).",
    ["policy", "pool", "source"],
)
PREDICTIONS = Counter(
    "ripplemesh_router_predictions_total",
    "This router's predictions, by what became of them: compared (with the prefill's outcome), "
    "completed (its completion time to the calibration), missed (failed past its deadline: the "
    "time so far to the calibration), expired (no end heard in time), dropped (the map was full).",
    ["outcome"],
)
CALIBRATION = Gauge(
    "ripplemesh_router_calibration",
    "How the router's predictions turn out per GPU type (its calibration): completion_ratio "
    "(actual over predicted completion time, geometric mean), completion_spread (the log-ratio's "
    "spread), cached_share (the share of an indexed prefix prefills found).",
    ["gpu_type", "figure"],
)

# The runners-up shown on the span and in the event.
RUNNERS_UP_SHOWN = 3


def _seconds(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else 0.0


def _score(value: float) -> float | None:
    """A score or an expected cost per success for the contract: None when infinite (success
    out of reach)."""
    return value if math.isfinite(value) and value >= 0 else None


def _probability(value: float) -> float:
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def chosen_option(placement: Placement) -> RouteOption:
    return RouteOption(
        mode=placement.mode,
        prefill_worker=placement.prefill_worker,
        decode_worker=placement.decode_worker,
        cached_tokens=max(0, placement.predicted_cached_tokens),
        ttft_s=_seconds(placement.predicted_ttft_s),
        cost_usd=_seconds(placement.predicted_cost_usd),
        success_probability=_probability(placement.success_probability),
        expected_cost_per_success_usd=_score(placement.expected_cost_per_success_usd),
        score=_score(placement.score) if placement.score is not None else None,
        completion_s=_seconds(placement.predicted_completion_s),
    )


def runner_up(option: ScoredOption) -> RouteOption:
    return RouteOption(
        mode=option.mode,
        prefill_worker=option.prefill_worker,
        decode_worker=option.decode_worker,
        cached_tokens=max(0, option.cached_tokens),
        ttft_s=_seconds(option.ttft_s),
        cost_usd=_seconds(option.cost_usd),
        success_probability=_probability(option.success_probability),
        expected_cost_per_success_usd=_score(option.expected_cost_per_success_usd),
        score=_score(option.score),
        completion_s=_seconds(option.completion_s),
    )


def _usd(value: float | None) -> str:
    return "inf" if value is None else f"{value:.6f}"


def describe(option: RouteOption) -> str:
    """One option on one line, for a span attribute and `ripplemesh trace`: the score it was
    ranked by first (lower is better), then what it predicted."""
    workers = option.prefill_worker
    if option.decode_worker != option.prefill_worker:
        workers = f"{option.prefill_worker}>{option.decode_worker}"
    return (
        f"{option.mode} {workers} score=${_usd(option.score)} "
        f"cached={option.cached_tokens} ttft={option.ttft_s:.3f}s cost=${option.cost_usd:.6f} "
        f"p={option.success_probability:.3f} per_success=${_usd(option.expected_cost_per_success_usd)}"
    )


def kv_blocks(request: InferenceRequest) -> int:
    """The KV blocks the request will hold (prompt and output), as the policy counts them."""
    return -(-(len(request.prompt_tokens) + request.max_tokens) // request.block_size)


def span_attributes(
    decision: Placement | NoPlacement,
    *,
    policy: str,
    replica: str,
    decision_s: float,
    workflow_spent_usd: float,
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "ripple.router.policy": policy,
        "ripple.router.replica": replica,
        "ripple.router.decision_s": decision_s,
        "ripple.router.workflow_spent_usd": workflow_spent_usd,
    }
    if isinstance(decision, NoPlacement):
        attributes["ripple.router.outcome"] = decision.reason
        attributes["ripple.router.message"] = decision.message
        if decision.retry_after_s is not None:
            attributes["ripple.router.retry_after_s"] = decision.retry_after_s
        return attributes
    chosen = chosen_option(decision)
    attributes.update(
        {
            "ripple.router.outcome": "placed",
            "ripple.router.mode": decision.mode,
            "ripple.router.prefill_worker": decision.prefill_worker,
            "ripple.router.decode_worker": decision.decode_worker,
            "ripple.router.candidates": decision.candidates,
            "ripple.router.decode_load": decision.decode_load,
            "ripple.router.predicted_cached_tokens": chosen.cached_tokens,
            "ripple.router.predicted_ttft_s": chosen.ttft_s,
            "ripple.router.predicted_cost_usd": chosen.cost_usd,
            "ripple.router.success_probability": chosen.success_probability,
            "ripple.router.runners_up": [
                describe(runner_up(o)) for o in decision.runners_up[:RUNNERS_UP_SHOWN]
            ],
        }
    )
    if chosen.expected_cost_per_success_usd is not None:
        attributes["ripple.router.expected_cost_per_success_usd"] = chosen.expected_cost_per_success_usd
    if chosen.score is not None:
        attributes["ripple.router.score"] = chosen.score
    return attributes


def decision_event(
    *,
    event_id: str,
    decided_at: float,
    request: InferenceRequest,
    decision: Placement | NoPlacement,
    policy: str,
    replica: str,
    decision_s: float,
    workflow_spent_usd: float,
) -> RouteDecision:
    workflow = request.workflow
    placement = decision if isinstance(decision, Placement) else None
    return RouteDecision(
        event_id=event_id,
        occurred_at=decided_at,
        request_id=request.request_id,
        tenant=request.tenant,
        router=replica,
        policy=policy,
        outcome="placed" if isinstance(decision, Placement) else decision.reason,
        message=decision.message if isinstance(decision, NoPlacement) else None,
        chosen=chosen_option(placement) if placement is not None else None,
        runners_up=[runner_up(o) for o in placement.runners_up[:RUNNERS_UP_SHOWN]] if placement else [],
        candidates=placement.candidates if placement is not None else 0,
        decision_s=max(0.0, decision_s),
        prompt_tokens=len(request.prompt_tokens),
        kv_blocks=kv_blocks(request),
        workflow_id=workflow.workflow_id if workflow is not None else None,
        workflow_step=workflow.step if workflow is not None else None,
        workflow_steps=workflow.steps if workflow is not None else None,
        workflow_spent_usd=max(0.0, workflow_spent_usd),
        priority=request.priority,
    )


def count_decision(event: RouteDecision) -> None:
    mode = event.chosen.mode if event.chosen is not None else "none"
    DECISIONS.labels(event.policy, event.outcome, mode).inc()
    DECISION_SECONDS.observe(event.decision_s)


def _direction(error: float) -> str:
    """An error's direction, from actual - predicted."""
    return "under" if error > 0 else "over" if error < 0 else "exact"


@dataclass(slots=True)
class _Prediction:
    cached_tokens: int
    ttft_s: float
    decided_at: float
    policy: str
    pool: str
    completion_s: float = 0.0  # 0: the policy predicts none (a baseline)
    indexed_cached_tokens: int = 0
    prefill_gpu: str = ""
    decode_gpu: str = ""


class Predictions:
    """This router's recent predictions, by request, until the request ends (bounded in number
    and age: a request that never reports is forgotten). Its prefill's outcome is compared in the
    histograms; with its end, both go to the router's calibration (`RouterState.observe_cached`,
    `observe_completion`): the cached prefix found, and the completion time, or for a request
    failed past its deadline the time it had taken (at least that)."""

    def __init__(
        self, state: RouterState | None = None, *, capacity: int = 100_000, max_age_s: float = 600.0
    ):
        self.state = state
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._by_request: OrderedDict[str, _Prediction] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_request)

    def record(
        self,
        request_id: str,
        chosen: RouteOption,
        decided_at: float,
        *,
        policy: str = "",
        pool: str = "",
        indexed_cached_tokens: int = 0,
        prefill_gpu: str = "",
        decode_gpu: str = "",
    ) -> None:
        self._by_request[request_id] = _Prediction(
            chosen.cached_tokens,
            chosen.ttft_s,
            decided_at,
            policy,
            pool,
            chosen.completion_s or 0.0,
            indexed_cached_tokens,
            prefill_gpu,
            decode_gpu,
        )
        self._by_request.move_to_end(request_id)
        while len(self._by_request) > self.capacity:
            self._by_request.popitem(last=False)
            PREDICTIONS.labels("dropped").inc()

    def compare(self, completed: PrefillCompleted, now: float | None = None) -> tuple[int, float] | None:
        """(actual - predicted cached tokens, actual - predicted TTFT) for a prefill this router
        placed, observed in the histograms; None for another router's (or a forgotten) one."""
        self._expire(time.time() if now is None else now)
        prediction = self._by_request.get(completed.request_id)
        if prediction is None:
            return None
        cached_error = completed.cached_tokens - prediction.cached_tokens
        ttft_error = max(0.0, completed.occurred_at - prediction.decided_at) - prediction.ttft_s
        CACHED_TOKENS_ERROR.labels(_direction(cached_error)).observe(abs(cached_error))
        TTFT_ERROR.labels(_direction(ttft_error)).observe(abs(ttft_error))
        PREDICTIONS.labels("compared").inc()
        # The cache hit rate the policy's placements got, per pool: the ripple of its choices.
        tokens = PROMPT_TOKENS.labels(prediction.policy, prediction.pool or completed.gpu_type, "cached")
        tokens.inc(completed.cached_tokens)
        computed = PROMPT_TOKENS.labels(prediction.policy, prediction.pool or completed.gpu_type, "computed")
        computed.inc(max(0, completed.prompt_tokens - completed.cached_tokens))
        if self.state is not None and prediction.completion_s > 0.0:
            gpu_type = prediction.prefill_gpu or completed.gpu_type
            self.state.observe_cached(gpu_type, prediction.indexed_cached_tokens, completed.cached_tokens)
            _export_calibration(self.state, gpu_type)
        if prediction.completion_s <= 0.0:
            self._by_request.pop(completed.request_id, None)  # nothing more to learn from it
        return cached_error, ttft_error

    def ended(self, event: DecodeCompleted | RequestFailed, now: float | None = None) -> float | None:
        """The request's end: its completion time against the prediction, for the calibration
        (a failure only when past its deadline: it took at least that long). Returns the time
        observed, None when nothing was."""
        self._expire(time.time() if now is None else now)
        prediction = self._by_request.pop(event.request_id, None)
        if prediction is None or prediction.completion_s <= 0.0 or self.state is None:
            return None
        if isinstance(event, RequestFailed) and (
            event.deadline_at is None or event.occurred_at < event.deadline_at
        ):
            return None  # failed for another reason: says nothing of the time it would take
        taken = max(0.0, event.occurred_at - prediction.decided_at)
        gpu_type = prediction.decode_gpu or (event.gpu_type if isinstance(event, DecodeCompleted) else "")
        self.state.observe_completion(gpu_type, prediction.completion_s, taken)
        _export_calibration(self.state, gpu_type)
        PREDICTIONS.labels("completed" if isinstance(event, DecodeCompleted) else "missed").inc()
        return taken

    def _expire(self, now: float) -> None:
        horizon = now - self.max_age_s
        while self._by_request:
            request_id, oldest = next(iter(self._by_request.items()))
            if oldest.decided_at >= horizon:
                break
            del self._by_request[request_id]
            PREDICTIONS.labels("expired").inc()


def _export_calibration(state: RouterState, gpu_type: str) -> None:
    figures = state.calibration.figures(gpu_type)
    for figure in ("completion_ratio", "completion_spread", "cached_share"):
        if figure in figures:
            CALIBRATION.labels(gpu_type, figure).set(figures[figure])
