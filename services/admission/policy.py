"""Admission's decisions: admit now, defer (a bounded wait), or reject early with a reason. Pure:
state in, decision out, no I/O, the clock passed in. The admission service and the simulator run
these same functions.

For every request, in this order:

1. `validate`: a known tenant, a numeric priority in range, a deadline that is neither before the
   request's submission nor absurdly far: otherwise `invalid`, nothing charged or queued.
2. `charge_quota`: the tenant's token buckets (requests/s, tokens/s, input tokens/s, output
   tokens/s; prompt and `max_tokens` are what is asked) and its concurrency cap (a lease per request
   in flight, released when the request ends or lapses). Over quota: `quota` (HTTP 429) with the
   time after which the bucket would hold enough. The usage is a plain value (`TenantUsage`) so
   replicas can share it through a KV bucket with compare-and-set.
3. `offer`: deadline feasibility (the router's prediction of the earliest first token, plus the
   decode, against the request's deadline: infeasible is `deadline` at once), then the deferral
   queue, which `drain` empties in priority order while the fleet's saturation allows:
   - class first (critical, standard, sheddable), then the numeric priority within the class
     (higher first; as Gateway API Inference Extension's InferenceObjective `priority`);
   - within a class and priority, a later step of an in-flight workflow (per the ledger's
     WORKFLOW_SPEND) before the first step of a new one, and a step of a workflow the ledger has
     already failed last (whatever it costs now is waste);
   - then start-time fair queuing on tokens between tenants (weights from the config): a tenant
     flooding the mesh does not starve a quiet one.
   Each class has its own saturation bound (sheddable the lowest), and a new workflow's first step
   a slightly lower one than a continuation, so under pressure the fleet sheds from the bottom up.
   The queue is bounded in entries and bytes: when full, the lowest-ranked entry (the new request
   included) is rejected (`capacity`, HTTP 503). A deferred request is decided by its `due`:
   the time its deadline stops being reachable, or, without a deadline, `max_defer_s` after it
   came.

Saturation is computed from the workers' heartbeats (KV usage, queue depth), corrected by the
admissions and completions heard since, and from the router's predicted wait for the request.

`decide` runs all three steps with local usage (the simulator, a single replica); outcomes for
deferred requests decided meanwhile accumulate in `state.outcomes` for the caller to take.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import PriorityClass, WorkflowSpend
from services.router.policy import LIVENESS_S, FirstToken, WorkerSpeed, WorkerView

CLASSES: tuple[PriorityClass, ...] = ("critical", "standard", "sheddable")
# Higher ranks first.
CLASS_RANK: dict[str, int] = {"critical": 2, "standard": 1, "sheddable": 0}
RejectReason = Literal["quota", "capacity", "deadline", "invalid", "no_workers"]
# "ripplemesh": everything in this module; "rate_limit": validation and quotas only (a plain
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
    # deadline can still be met: `_due_at`).
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


# ------------------------------------------------------------------ validation


def validate(
    request: AdmissionRequest, quota: TenantQuota | None, limits: AdmissionLimits, now: float
) -> Reject | None:
    if quota is None:
        return Reject("invalid", f"unknown tenant {request.tenant!r}", None)
    if request.priority not in CLASS_RANK:
        return Reject(
            "invalid", f"priority must be one of {', '.join(CLASSES)}, not {request.priority!r}", None
        )
    if not limits.min_priority_level <= request.priority_level <= limits.max_priority_level:
        return Reject(
            "invalid",
            f"priority level {request.priority_level} is out of range "
            f"[{limits.min_priority_level}, {limits.max_priority_level}]",
            None,
        )
    if request.input_tokens < 0 or request.output_tokens < 1:
        return Reject("invalid", "a request needs a prompt and max_tokens >= 1", None)
    deadline = request.deadline_at
    if deadline is not None:
        if not math.isfinite(deadline):
            return Reject("invalid", f"the deadline {deadline} is not a time", None)
        if deadline <= request.submitted_at:
            return Reject(
                "invalid",
                f"the deadline is {request.submitted_at - deadline:.3f} s before the request was "
                "submitted (a negative deadline)",
                None,
            )
        if deadline - request.submitted_at > limits.max_deadline_s:
            return Reject(
                "invalid",
                f"the deadline is {deadline - request.submitted_at:.0f} s after submission; the "
                f"limit is {limits.max_deadline_s:.0f} s",
                None,
            )
        if deadline <= now:
            return Reject("deadline", "the request's deadline passed before admission", None)
    return None


# ------------------------------------------------------------------ quotas


@dataclass(slots=True)
class Bucket:
    rate: float
    capacity: float
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.updated_at = max(self.updated_at, now)

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now); inf if it never fits."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)


@dataclass(slots=True)
class TenantUsage:
    """A tenant's quota state: its buckets' levels and its requests in flight (request id -> when
    the lease lapses). Shared between admission replicas (one KV entry per tenant)."""

    buckets: dict[str, Bucket] = field(default_factory=dict)
    in_flight: dict[str, float] = field(default_factory=dict)


def _asked(name: str, request: AdmissionRequest) -> float:
    if name == "requests":
        return 1.0
    if name == "input_tokens":
        return float(request.input_tokens)
    if name == "output_tokens":
        return float(request.output_tokens)
    return float(request.tokens)


def _synced_buckets(usage: TenantUsage, quota: TenantQuota, now: float) -> list[tuple[str, Bucket]]:
    """The tenant's limited buckets, brought to the configuration and refilled to `now`."""
    configured = list(quota.buckets())
    for name in [n for n in usage.buckets if n not in {c[0] for c in configured}]:
        del usage.buckets[name]  # the limit was lifted
    synced = []
    for name, rate, capacity in configured:
        bucket = usage.buckets.get(name)
        if bucket is None:
            bucket = usage.buckets[name] = Bucket(rate, capacity, capacity, now)
        elif bucket.rate != rate or bucket.capacity != capacity:  # the config changed
            bucket.rate, bucket.capacity = rate, capacity
            bucket.level = min(bucket.level, capacity)
        bucket.refill(now)
        synced.append((name, bucket))
    return synced


def _shortfall(
    buckets: list[tuple[str, Bucket]], quota: TenantQuota, request: AdmissionRequest
) -> Reject | None:
    """Over quota (with the retry-after its buckets give), or None when every bucket holds enough."""
    wait = 0.0
    for name, bucket in buckets:
        needed = _asked(name, request)
        wait_here = bucket.wait_for(needed)
        if wait_here == math.inf:
            return Reject(
                "quota",
                f"the request asks {needed:.0f} {name.replace('_', ' ')}, more than tenant "
                f"{request.tenant!r}'s burst of {bucket.capacity:.0f}",
                None,
            )
        wait = max(wait, wait_here)
    if wait > 0:
        limited = ", ".join(f"{rate:g} {name.replace('_', ' ')}/s" for name, rate, _ in quota.buckets())
        return Reject("quota", f"tenant {request.tenant!r} is over its quota ({limited})", wait)
    return None


def charge_quota(
    usage: TenantUsage, quota: TenantQuota, request: AdmissionRequest, limits: AdmissionLimits, now: float
) -> Reject | None:
    """Charge the request to the tenant's buckets and take a concurrency lease, or reject it with
    the retry-after its buckets give. Charging the same request twice (a redelivery) is a no-op."""
    if request.request_id in usage.in_flight:
        return None
    buckets = _synced_buckets(usage, quota, now)
    rejected = _shortfall(buckets, quota, request)
    if rejected is not None:
        return rejected
    for lapsed in [r for r, until in usage.in_flight.items() if until <= now]:
        del usage.in_flight[lapsed]
    if quota.max_concurrency is not None and len(usage.in_flight) >= quota.max_concurrency:
        return Reject(
            "quota",
            f"tenant {request.tenant!r} has {len(usage.in_flight)} requests in flight; its "
            f"concurrency cap is {quota.max_concurrency}",
            limits.concurrency_retry_after_s,
        )
    for name, bucket in buckets:
        bucket.level -= _asked(name, request)
    if quota.max_concurrency is not None:
        lease = now + limits.lease_s
        if request.deadline_at is not None:
            lease = min(lease, request.deadline_at + 1.0)
        usage.in_flight[request.request_id] = lease
    return None


# A replica's quota lease: a slice of the tenant's shared buckets taken in advance (counted as
# consumed there) and spent locally, request by request, with no shared write per request.
# Leasing applies to tenants without a concurrency cap (a cap needs each request's own entry).


def leasable(quota: TenantQuota) -> bool:
    """Whether the tenant's requests can be charged to a local lease."""
    return quota.max_concurrency is None and any(True for _ in quota.buckets())


def lease_slice(quota: TenantQuota, lease_s: float) -> dict[str, float]:
    """How much of each bucket a replica takes at a time: `lease_s` seconds of its rate."""
    return {name: rate * lease_s for name, rate, _ in quota.buckets()}


def take_lease(
    usage: TenantUsage,
    quota: TenantQuota,
    request: AdmissionRequest,
    want: dict[str, float],
    now: float,
) -> Reject | dict[str, float]:
    """Take a slice of the shared buckets: at least what `request` asks, up to `want` of each
    bucket as far as its level allows. Over quota: the rejection `charge_quota` would give."""
    buckets = _synced_buckets(usage, quota, now)
    rejected = _shortfall(buckets, quota, request)
    if rejected is not None:
        return rejected
    taken = {}
    for name, bucket in buckets:
        amount = max(_asked(name, request), min(want.get(name, 0.0), bucket.level))
        bucket.level -= amount
        taken[name] = amount
    return taken


def return_lease(usage: TenantUsage, quota: TenantQuota, amounts: dict[str, float], now: float) -> None:
    """Give a lease's unspent remainder back to the shared buckets (never above their capacity)."""
    for name, bucket in _synced_buckets(usage, quota, now):
        bucket.level = min(bucket.capacity, bucket.level + amounts.get(name, 0.0))


@dataclass(slots=True)
class QuotaLease:
    """What a replica holds of a tenant's buckets, and when it last spent from it."""

    amounts: dict[str, float] = field(default_factory=dict)
    spent_at: float = 0.0

    def add(self, taken: dict[str, float]) -> None:
        for name, amount in taken.items():
            self.amounts[name] = self.amounts.get(name, 0.0) + amount

    def spend(self, request: AdmissionRequest, now: float) -> bool:
        """Charge the request to the lease if it holds enough of every bucket it was taken from."""
        asked = {name: _asked(name, request) for name in self.amounts}
        if not self.amounts or any(self.amounts[name] < amount for name, amount in asked.items()):
            return False
        for name, amount in asked.items():
            self.amounts[name] -= amount
        self.spent_at = now
        return True

    def running_low(self, slice_: dict[str, float]) -> bool:
        """Under half a slice of some bucket left: time to take more before it runs out."""
        return any(self.amounts.get(name, 0.0) < amount / 2 for name, amount in slice_.items())

    def take_all(self) -> dict[str, float]:
        amounts, self.amounts = self.amounts, {}
        return amounts


def release_quota(usage: TenantUsage, request_id: str) -> bool:
    """The request ended: give its concurrency lease back. False if it held none."""
    return usage.in_flight.pop(request_id, None) is not None


# ------------------------------------------------------------------ the fleet's saturation


@dataclass(frozen=True, slots=True)
class FleetLoad:
    """The workers' state as their heartbeats last told it."""

    observed_at: float
    workers: int  # live workers (not draining, heartbeat fresh)
    waiting: int  # requests queued on them
    running: int
    kv_utilisation: float  # KV blocks used / KV blocks, over live workers
    context_tokens: int = 0  # KV tokens of the running batches
    fastest: WorkerSpeed | None = None  # the live worker whose lone decode step is quickest


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


@dataclass(slots=True)
class _Entry:
    request: AdmissionRequest
    key: tuple[int, int, int, float, int]  # dispatch order, smallest first
    start: float  # fair-queuing start tag
    finish: float
    due: float
    offered_at: float
    prediction: Prediction | None
    predicted_at: float
    removed: bool = False


@dataclass(slots=True)
class AdmissionState:
    usage: dict[str, TenantUsage] = field(default_factory=dict)
    fleet: FleetLoad | None = None
    # Requests admitted (by any replica) and finished since `fleet` was observed.
    admitted_since: int = 0
    finished_since: int = 0
    saturation: float = 0.0  # the last computed (a metric)
    deferred: dict[str, _Entry] = field(default_factory=dict)
    deferred_bytes: int = 0
    # Decisions on deferred requests, for the caller to take (`take_outcomes`).
    outcomes: list[Outcome] = field(default_factory=list)
    _queue: list[tuple[tuple[int, int, int, float, int], _Entry]] = field(default_factory=list)
    _due: list[tuple[float, int, _Entry]] = field(default_factory=list)
    # The queue by shedding rank, lowest first (`_lowest`); removed entries are dropped lazily.
    _ranks: list[tuple[tuple[int, int, int, float, float], int, _Entry]] = field(default_factory=list)
    _virtual: dict[str, float] = field(default_factory=dict)  # per class
    # Per class, the queued entries by start tag: the fair queue's virtual time is the smallest
    # start tag still waiting (entries served out of tag order, ahead of others by level or
    # workflow standing, must not pull it forward: it would erase the other tenants' credit).
    _starts: dict[str, list[tuple[float, int, _Entry]]] = field(default_factory=dict)
    _last_finish: dict[tuple[str, str], float] = field(default_factory=dict)  # (class, tenant)
    _seq: int = 0


def observe_fleet(state: AdmissionState, fleet: FleetLoad) -> None:
    """A fresh view of the workers: what was admitted or finished before it is in it."""
    state.fleet = fleet
    state.admitted_since = 0
    state.finished_since = 0


def note_admitted(state: AdmissionState, count: int = 1) -> None:
    """Another replica admitted requests (this state counts its own)."""
    state.admitted_since += count


def note_finished(state: AdmissionState, count: int = 1) -> None:
    state.finished_since += count


def saturation(state: AdmissionState, limits: AdmissionLimits, prediction: Prediction | None = None) -> float:
    """1.0 is the fleet at its target load: the largest of KV usage over `kv_high`, requests
    waiting per live worker (heartbeats, plus admitted, minus finished since) over
    `queue_per_worker`, the time per output token (`decode_step_s`) over `tpot_high_s`, and the
    predicted wait for the first token (queueing, not the request's own prefill: a long prompt
    on an idle fleet is no load) over `wait_high_s`. inf with no live worker."""
    fleet = state.fleet
    if fleet is None or fleet.workers == 0:
        return math.inf
    waiting = max(0, fleet.waiting + state.admitted_since - state.finished_since)
    value = max(
        fleet.kv_utilisation / limits.kv_high,
        waiting / (fleet.workers * limits.queue_per_worker),
        decode_step_s(state) / limits.tpot_high_s,
        prediction.wait_s / limits.wait_high_s if prediction is not None else 0.0,
    )
    return value


# ------------------------------------------------------------------ deciding


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


def _standing_key(request: AdmissionRequest) -> tuple[int, int, int]:
    return (CLASS_RANK[request.priority], request.priority_level, request.workflow_standing)


def _retry_after(prediction: Prediction | None) -> float:
    return max(1.0, prediction.ttft_s) if prediction is not None else 5.0


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
                _retry_after(prediction),
            )
    if len(state.deferred) >= limits.max_deferred or (
        state.deferred_bytes + request.size_bytes > limits.max_deferred_bytes and state.deferred
    ):
        victim = _lowest(state, request, weight, limits)
        if victim is None:
            return Reject(
                "capacity",
                f"the fleet is saturated and the deferral queue is full ({len(state.deferred)} "
                "requests of equal or higher priority wait)",
                _retry_after(prediction),
            )
        _remove(state, victim)
        state.outcomes.append(
            Outcome(
                victim.request,
                Reject(
                    "capacity",
                    "shed while deferred: the fleet is saturated and a higher-priority request "
                    "needed the place",
                    _retry_after(victim.prediction),
                ),
            )
        )
    if not state.deferred:
        # Nothing queued: the request is the head at once. `drain`'s decision on it, without the
        # queue's bookkeeping when it is admitted (the same outcome, the same fair-queuing state).
        due = _due_at(request, limits, now, prediction)
        if due > now:  # else it expires at once in `drain`
            bound = limits.admit_below(request.priority, request.workflow_standing)
            if not predicted and saturation(state, limits) < bound:
                prediction, predicted = predict(request), True
            if predicted:
                value = saturation(state, limits, prediction)
                if value < bound:
                    state.saturation = value
                    start, finish = _tags(state, request, weight)
                    state._seq += 1
                    state._last_finish[(request.priority, request.tenant)] = finish
                    state._virtual[request.priority] = max(state._virtual.get(request.priority, 0.0), start)
                    state.admitted_since += 1
                    return Admit(0.0, "admitted")
    # Not yet predicted (lazy): `drain` predicts it when it reaches the head.
    entry = _enqueue(state, request, weight, limits, now, prediction, now if predicted else -math.inf)
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


def _tags(state: AdmissionState, request: AdmissionRequest, weight: float) -> tuple[float, float]:
    key = (request.priority, request.tenant)
    start = max(state._virtual.get(request.priority, 0.0), state._last_finish.get(key, 0.0))
    return start, start + request.tokens / max(weight, 1e-9)


def _lowest(
    state: AdmissionState, newcomer: AdmissionRequest, weight: float, limits: AdmissionLimits
) -> _Entry | None:
    """The queued entry to shed for `newcomer`, if one ranks below it: the lowest class, priority
    level and workflow standing; among continuations the least spent; else the latest start tag
    (the most-served tenant's)."""
    start, _ = _tags(state, newcomer, weight)
    ranks = state._ranks
    while ranks and ranks[0][2].removed:
        heapq.heappop(ranks)
    if not ranks or ranks[0][0] >= _shed_rank(newcomer, start):
        return None
    return ranks[0][2]


def _shed_rank(request: AdmissionRequest, start: float) -> tuple[int, int, int, float, float]:
    """Shed first: the lowest class, level, standing, workflow spend, then the latest start tag."""
    return (*_standing_key(request), request.workflow_spent_usd, -start)


def _enqueue(
    state: AdmissionState,
    request: AdmissionRequest,
    weight: float,
    limits: AdmissionLimits,
    now: float,
    prediction: Prediction | None,
    predicted_at: float,
) -> _Entry:
    start, finish = _tags(state, request, weight)
    state._last_finish[(request.priority, request.tenant)] = finish
    due = _due_at(request, limits, now, prediction)
    state._seq += 1
    rank = _standing_key(request)
    key = (-rank[0], -rank[1], -rank[2], start, state._seq)
    entry = _Entry(request, key, start, finish, max(now, due), now, prediction, predicted_at)
    state.deferred[request.request_id] = entry
    state.deferred_bytes += request.size_bytes
    heapq.heappush(state._queue, (key, entry))
    ranks = state._ranks
    if len(ranks) > 64 and len(ranks) > 2 * len(state.deferred):
        # Mostly removed entries: keep the queued ones only.
        ranks[:] = [r for r in ranks if not r[2].removed]
        heapq.heapify(ranks)
    heapq.heappush(ranks, (_shed_rank(request, start), state._seq, entry))
    heapq.heappush(state._due, (entry.due, state._seq, entry))
    heapq.heappush(state._starts.setdefault(request.priority, []), (start, state._seq, entry))
    return entry


def _due_at(
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


def _remove(state: AdmissionState, entry: _Entry) -> None:
    entry.removed = True
    request = entry.request
    del state.deferred[request.request_id]
    state.deferred_bytes -= request.size_bytes
    key = (request.priority, request.tenant)
    if state._last_finish.get(key) == entry.finish:
        # Nothing of the tenant's was served after it: give back its place in the fair queue.
        state._last_finish[key] = entry.start


def _head(state: AdmissionState) -> _Entry | None:
    queue = state._queue
    while queue and queue[0][1].removed:
        heapq.heappop(queue)
    return queue[0][1] if queue else None


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
        _remove(state, entry)
        state.outcomes.append(Outcome(entry.request, _expired(state, entry, now)))
    while True:
        head = _head(state)
        if head is None:
            break
        request = head.request
        bound = limits.admit_below(request.priority, request.workflow_standing)
        if request.deadline_at is None and head.predicted_at != now:
            # Without a deadline the prediction only adds its wait to the saturation: when the
            # fleet is over the bound without it, the answer is the same and it is not needed.
            value = saturation(state, limits)
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
            _remove(state, head)
            state.outcomes.append(
                Outcome(
                    request,
                    Reject(
                        "deadline",
                        f"deferred {now - head.offered_at:.2f} s; the deadline can no longer be met "
                        f"(last token predicted {prediction.finish_s:.2f} s from now)",
                        _retry_after(prediction),
                    ),
                )
            )
            continue
        value = saturation(state, limits, prediction)
        state.saturation = value
        if value >= bound:
            break
        _remove(state, head)
        starts = state._starts.get(request.priority, [])
        while starts and starts[0][2].removed:
            heapq.heappop(starts)
        served = min(head.start, starts[0][0]) if starts else head.start
        state._virtual[request.priority] = max(state._virtual.get(request.priority, 0.0), served)
        key = (request.priority, request.tenant)
        state._last_finish[key] = max(state._last_finish.get(key, 0.0), head.finish)
        state.admitted_since += 1
        waited = now - head.offered_at
        state.outcomes.append(Outcome(request, Admit(waited, "after_deferral" if waited > 0 else "admitted")))


def _expired(state: AdmissionState, entry: _Entry, now: float) -> Reject:
    waited = now - entry.offered_at
    if state.fleet is None or state.fleet.workers == 0:
        return Reject("no_workers", f"no live worker after {waited:.2f} s deferred", 5.0)
    if entry.request.deadline_at is not None:  # its deadline set its due (`_due_at`)
        return Reject(
            "deadline",
            f"deferred {waited:.2f} s; the fleet stayed saturated until the deadline could no longer be met",
            _retry_after(entry.prediction),
        )
    return Reject(
        "capacity",
        f"deferred {waited:.2f} s, the longest wait allowed; the fleet stayed saturated "
        f"(saturation {state.saturation:.2f})",
        _retry_after(entry.prediction),
    )


def expire(state: AdmissionState, request_id: str, now: float) -> Reject | None:
    """A deferred request's wait ran out in the caller (its timer): reject it now. None when it was
    decided already."""
    entry = state.deferred.get(request_id)
    if entry is None:
        return None
    _remove(state, entry)
    return _expired(state, entry, now)


def next_due(state: AdmissionState) -> float | None:
    """When the earliest deferred request must be decided."""
    due = state._due
    while due and due[0][2].removed:
        heapq.heappop(due)
    return due[0][0] if due else None


def take_outcomes(state: AdmissionState) -> list[Outcome]:
    outcomes, state.outcomes = state.outcomes, []
    return outcomes
