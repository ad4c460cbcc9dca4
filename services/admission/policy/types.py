"""What admission reads and answers: a tenant's terms (`TenantQuota`), admission's limits
(`AdmissionLimits`), a request (`AdmissionRequest`), the router's prediction for it
(`Prediction`), and the decisions (`Admit`, `Defer`, `Reject`; `Outcome` for a deferred one).

It decides two things of its own: a request's workflow standing (`workflow_standing`: a later step
of a running workflow, a new request, or a step of a failed workflow) and the saturation bound a
request is admitted below (`AdmissionLimits.admit_below`: its class's, lower for a new workflow).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from schemas.events import PriorityClass, WorkflowSpend

CLASSES: tuple[PriorityClass, ...] = ("critical", "standard", "sheddable")
# Higher ranks first.
CLASS_RANK: dict[str, int] = {"critical": 2, "standard": 1, "sheddable": 0}
RejectReason = Literal["quota", "capacity", "deadline", "invalid", "no_workers"]
# "ripplemesh": everything in this package; "rate_limit": validation and quotas only (a plain
# per-tenant rate limiter); "none": validation only (no admission control).
Control = Literal["ripplemesh", "rate_limit", "none"]
CONTROLS: tuple[Control, ...] = ("ripplemesh", "rate_limit", "none")

# Workflow standing, higher first: a step of a running workflow with spend, a new request, a step
# of a workflow the ledger has already failed.
CONTINUATION, NEW, DOOMED = 2, 1, 0

# ------------------------------------------------------------------ configuration


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """A tenant's admission terms: rates and bursts of its token buckets (None: no limit), its
    concurrency cap, and its weight in fair queuing within a priority class. A bucket's burst
    defaults to one second of its rate."""

    requests_per_s: float | None = None
    request_burst: float | None = None
    tokens_per_s: float | None = None  # prompt + max output
    token_burst: float | None = None
    input_tokens_per_s: float | None = None
    input_token_burst: float | None = None
    output_tokens_per_s: float | None = None  # max_tokens asked
    output_token_burst: float | None = None
    max_concurrency: int | None = None
    weight: float = 1.0

    def buckets(self) -> Iterable[tuple[str, float, float]]:
        """(name, rate, capacity) of each limited bucket."""
        for name, rate, burst in (
            ("requests", self.requests_per_s, self.request_burst),
            ("tokens", self.tokens_per_s, self.token_burst),
            ("input_tokens", self.input_tokens_per_s, self.input_token_burst),
            ("output_tokens", self.output_tokens_per_s, self.output_token_burst),
        ):
            if rate is not None:
                yield name, rate, burst if burst is not None else rate


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    control: Control = "ripplemesh"
    min_priority_level: int = -100
    max_priority_level: int = 100
    # A deadline further than this from submission is a client error, not a wish.
    max_deadline_s: float = 24 * 3600.0
    # The deferral queue (per replica). Entries are small (the bytes bound holds its memory);
    # the entry bound is set for a burst of a few thousand requests held while the fleet drains.
    max_deferred: int = 4096
    max_deferred_bytes: int = 64 * 1024 * 1024
    # The longest wait of a request without a deadline (one with a deadline waits while the
    # deadline can still be met: `queue.due_at`).
    max_defer_s: float = 30.0
    # Saturation (1.0: the fleet at its target load) below which each class is admitted; a new
    # workflow's first step needs `new_workflow_factor` times its class's bound.
    critical_below: float = 1.5
    standard_below: float = 0.9
    sheddable_below: float = 0.75
    new_workflow_factor: float = 0.95
    # What saturation 1.0 means: KV usage, requests waiting per live worker, predicted TTFT.
    kv_high: float = 0.95
    queue_per_worker: float = 4.0
    wait_high_s: float = 2.0
    tpot_high_s: float = 0.035
    # A concurrency lease lapses after this when no completion is heard (a lost event).
    lease_s: float = 600.0
    concurrency_retry_after_s: float = 1.0
    # Margin kept before a deadline when no prediction is available (no live workers).
    deadline_margin_s: float = 0.05

    @property
    def controls_load(self) -> bool:
        """Whether admission keeps the fleet at its capacity (deferring and shedding on its
        saturation bounds), rather than enforcing quotas only or nothing."""
        return self.control == "ripplemesh"

    def admit_below(self, priority: str, standing: int) -> float:
        bound = (
            self.critical_below
            if priority == "critical"
            else self.standard_below
            if priority == "standard"
            else self.sheddable_below
        )
        return bound if standing == CONTINUATION else bound * self.new_workflow_factor


# ------------------------------------------------------------------ requests and decisions


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    request_id: str
    tenant: str
    priority: str  # a PriorityClass once validated
    input_tokens: int
    output_tokens: int  # max_tokens
    submitted_at: float
    deadline_at: float | None = None  # absolute, on the clock passed in as `now`; for the last token
    priority_level: int = 0  # within the class; higher first
    workflow_id: str | None = None
    workflow_step: int | None = None
    workflow_standing: int = NEW  # workflow_standing(...)
    workflow_spent_usd: float = 0.0
    size_bytes: int = 0  # what holding it deferred costs in memory
    # "batch" (a Batch API line) or "interactive": the engines run an interactive request ahead
    # of waiting batch lines (services/engines/scheduling.py), so those are no queue ahead of it.
    service_class: str = "interactive"

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def workflow_standing(step: int | None, spend: WorkflowSpend | None) -> int:
    """CONTINUATION for a later step of a workflow the ledger has running with spend; DOOMED for a
    step of one the ledger has already failed; NEW otherwise (first steps, unknown workflows)."""
    if spend is None or step is None:
        return NEW
    if spend.status == "failed":
        return DOOMED
    if spend.status == "running" and step > 1 and (spend.spend_usd > 0 or spend.steps_completed > 0):
        return CONTINUATION
    return NEW


@dataclass(frozen=True, slots=True)
class Prediction:
    """The router's prediction for a request placed now: seconds to its first and last token, and
    how much of the wait for the first is queueing behind other work (the load it measures)."""

    ttft_s: float
    finish_s: float
    wait_s: float = 0.0


Predictor = Callable[[AdmissionRequest], Prediction | None]


def no_prediction(request: AdmissionRequest) -> Prediction | None:
    return None


@dataclass(frozen=True, slots=True)
class Admit:
    waited_s: float = 0.0
    reason: str = "admitted"  # "admitted", or "after_deferral"
    outcome: Literal["admit"] = "admit"


@dataclass(frozen=True, slots=True)
class Defer:
    due: float  # decided (admitted or rejected) by then
    reason: str = "saturated"
    outcome: Literal["defer"] = "defer"


@dataclass(frozen=True, slots=True)
class Reject:
    reason: RejectReason
    message: str
    retry_after_s: float | None
    outcome: Literal["reject"] = "reject"


Decision = Admit | Defer | Reject


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a deferred request (or one a newcomer pushed out of the queue)."""

    request: AdmissionRequest
    decision: Admit | Reject
