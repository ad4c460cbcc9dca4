"""Admission's pure policy: quotas, validation, priority and bottom-up shedding, weighted fair
queuing, deadline feasibility, workflow protection, bounded deferral."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import WorkflowSpend
from services.admission.policy import (
    CONTINUATION,
    DOOMED,
    NEW,
    AdmissionLimits,
    AdmissionRequest,
    AdmissionState,
    Admit,
    Defer,
    FleetLoad,
    Prediction,
    QuotaLease,
    Reject,
    TenantQuota,
    TenantUsage,
    charge_quota,
    decide,
    drain,
    expire,
    fleet_load,
    leasable,
    lease_slice,
    next_due,
    note_finished,
    observe_fleet,
    release,
    return_lease,
    saturation,
    take_lease,
    take_outcomes,
    workflow_standing,
)
from services.router.policy import WorkerView

OPEN = TenantQuota()
LIMITS = AdmissionLimits()
_ids = iter(range(10**9))


def request(
    tenant: str = "t",
    priority: str = "standard",
    *,
    level: int = 0,
    tokens: tuple[int, int] = (100, 100),
    now: float = 0.0,
    deadline_s: float | None = None,
    standing: int = NEW,
    spent: float = 0.0,
    size: int = 0,
    rid: str | None = None,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid or f"r{next(_ids)}",
        tenant=tenant,
        priority=priority,
        input_tokens=tokens[0],
        output_tokens=tokens[1],
        submitted_at=now,
        deadline_at=now + deadline_s if deadline_s is not None else None,
        priority_level=level,
        workflow_standing=standing,
        workflow_spent_usd=spent,
        size_bytes=size,
    )


def decide_open(
    state: AdmissionState, req: AdmissionRequest, *, limits: AdmissionLimits = LIMITS, now: float = 0.0
) -> Admit | Defer | Reject:
    """`decide` for a tenant with an open quota."""
    return decide(state, request=req, quota=OPEN, limits=limits, now=now)


def fleet(*, waiting: int = 0, workers: int = 4, kv: float = 0.0, at: float = 0.0) -> FleetLoad:
    return FleetLoad(observed_at=at, workers=workers, waiting=waiting, running=0, kv_utilisation=kv)


def saturated_state(limits: AdmissionLimits = LIMITS) -> AdmissionState:
    state = AdmissionState()
    observe_fleet(state, fleet(waiting=int(4 * limits.queue_per_worker * 2)))
    return state


def free_one_slot(state: AdmissionState, limits: AdmissionLimits = LIMITS, *, below: float = 0.7) -> None:
    """A fresh heartbeat whose saturation lets exactly one request of any class in (the next
    admission counts as one more waiting request and pushes it over)."""
    workers = 4
    per = limits.queue_per_worker * workers
    waiting = math.ceil(below * per) - 1
    observe_fleet(state, fleet(waiting=waiting, workers=workers))
    assert saturation(state, limits) < below <= (waiting + 1) / per


def admitted(state: AdmissionState) -> list[str]:
    return [o.request.request_id for o in take_outcomes(state) if isinstance(o.decision, Admit)]


# ------------------------------------------------------------------ validation


def test_bad_input_is_invalid_with_a_clear_reason_and_nothing_is_queued() -> None:
    state = saturated_state()
    cases = {
        "unknown tenant": (request("ghost"), None),
        "priority level 1000 is out of range": (request(level=1000), OPEN),
        "priority level -101 is out of range": (request(level=-101), OPEN),
        "negative deadline": (request(deadline_s=-5.0), OPEN),
        "limit is 86400 s": (request(deadline_s=10 * 86400.0), OPEN),
        "not a time": (request(deadline_s=math.nan), OPEN),
        "priority must be one of": (request(priority="urgent"), OPEN),
    }
    for words, (bad, quota) in cases.items():
        decision = decide(state, request=bad, quota=quota, limits=LIMITS, now=0.0)
        assert isinstance(decision, Reject) and decision.reason == "invalid", words
        assert words.split(" is ")[0] in decision.message or words in decision.message, decision.message
    assert state.deferred == {} and state.usage == {}


def test_a_deadline_already_passed_is_a_deadline_rejection() -> None:
    late = request(now=0.0, deadline_s=1.0)
    decision = decide(AdmissionState(), request=late, quota=OPEN, limits=LIMITS, now=2.0)
    assert isinstance(decision, Reject) and decision.reason == "deadline"


# ------------------------------------------------------------------ quotas


def test_request_bucket_rejects_with_the_retry_after_the_bucket_gives() -> None:
    quota = TenantQuota(requests_per_s=2.0, request_burst=2.0)
    state = AdmissionState()
    observe_fleet(state, fleet())
    outcomes = [decide(state, request=request(), quota=quota, limits=LIMITS, now=10.0) for _ in range(3)]
    assert [o.outcome for o in outcomes] == ["admit", "admit", "reject"]
    third = outcomes[2]
    assert isinstance(third, Reject) and third.reason == "quota"
    assert third.retry_after_s == pytest.approx(0.5)
    # After the retry-after, it fits.
    later = decide(state, request=request(), quota=quota, limits=LIMITS, now=10.5)
    assert isinstance(later, Admit)


@pytest.mark.parametrize(
    ("quota", "tokens", "retry"),
    [
        (TenantQuota(input_tokens_per_s=1000.0, input_token_burst=1000.0), (600, 10), 0.2),
        (TenantQuota(output_tokens_per_s=100.0, output_token_burst=500.0), (10, 300), 1.0),
        (TenantQuota(tokens_per_s=1000.0, token_burst=1000.0), (300, 300), 0.2),
    ],
)
def test_input_output_and_total_token_buckets(
    quota: TenantQuota, tokens: tuple[int, int], retry: float
) -> None:
    usage = TenantUsage()
    first = charge_quota(usage, quota, request(tokens=tokens), LIMITS, 0.0)
    second = charge_quota(usage, quota, request(tokens=tokens), LIMITS, 0.0)
    assert first is None and isinstance(second, Reject) and second.reason == "quota"
    assert second.retry_after_s == pytest.approx(retry)


def test_a_request_larger_than_the_burst_never_fits() -> None:
    quota = TenantQuota(input_tokens_per_s=100.0, input_token_burst=500.0)
    rejected = charge_quota(TenantUsage(), quota, request(tokens=(800, 1)), LIMITS, 0.0)
    assert isinstance(rejected, Reject) and rejected.retry_after_s is None
    assert "more than tenant 't''s burst of 500" in rejected.message


def test_concurrency_cap_holds_until_a_request_ends_and_leases_lapse() -> None:
    quota = TenantQuota(max_concurrency=2)
    state = AdmissionState()
    observe_fleet(state, fleet())
    first, second = request(), request()
    for r in (first, second):
        assert isinstance(decide(state, request=r, quota=quota, limits=LIMITS, now=0.0), Admit)
    third = decide(state, request=request(), quota=quota, limits=LIMITS, now=0.0)
    assert isinstance(third, Reject) and "concurrency cap is 2" in third.message
    release(state, "t", first.request_id)
    assert isinstance(decide(state, request=request(), quota=quota, limits=LIMITS, now=0.0), Admit)
    # A lost completion: the lease lapses.
    lapsed = decide(state, request=request(), quota=quota, limits=LIMITS, now=LIMITS.lease_s + 1)
    assert isinstance(lapsed, Admit)


def test_charging_a_redelivered_request_twice_is_a_no_op() -> None:
    quota = TenantQuota(requests_per_s=1.0, request_burst=1.0, max_concurrency=5)
    usage = TenantUsage()
    again = request()
    assert charge_quota(usage, quota, again, LIMITS, 0.0) is None
    assert charge_quota(usage, quota, again, LIMITS, 0.0) is None
    assert usage.buckets["requests"].level == 0.0


def _admit_leased(
    usage: TenantUsage, lease: QuotaLease, quota: TenantQuota, r: AdmissionRequest, now: float
) -> bool:
    """A replica's charge: from its lease, else a new slice of the shared usage."""
    if lease.spend(r, now):
        return True
    taken = take_lease(usage, quota, r, lease_slice(quota, 0.2), now)
    if isinstance(taken, Reject):
        return False
    lease.add(taken)
    assert lease.spend(r, now)
    return True


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 2), st.floats(0.0, 0.5), st.integers(1, 400)), min_size=1, max_size=120
    )
)
def test_leases_across_replicas_never_admit_more_than_the_shared_buckets_allow(
    arrivals: list[tuple[int, float, int]],
) -> None:
    quota = TenantQuota(requests_per_s=20.0, request_burst=10.0, tokens_per_s=2000.0, token_burst=3000.0)
    assert leasable(quota)
    usage, leases = TenantUsage(), [QuotaLease() for _ in range(3)]
    now, admitted, tokens = 0.0, 0, 0
    for replica, gap, size in arrivals:
        now += gap
        r = request(tokens=(size, size))
        if _admit_leased(usage, leases[replica], quota, r, now):
            admitted, tokens = admitted + 1, tokens + r.tokens
        # Whatever the replicas hold or spent, the shared state allows no more than burst + refill.
        assert admitted <= 10.0 + 20.0 * now + 1e-6
        assert tokens <= 3000.0 + 2000.0 * now + 1e-6
    for lease in leases:  # unspent remainders go back, never above capacity
        return_lease(usage, quota, lease.take_all(), now)
    assert all(b.level <= b.capacity for b in usage.buckets.values())


def test_a_returned_lease_is_available_to_another_replica() -> None:
    quota = TenantQuota(requests_per_s=0.01, request_burst=10.0)
    assert lease_slice(quota, 0.2) == {"requests": pytest.approx(0.002)}  # slow tenants: one at a time
    quota = TenantQuota(requests_per_s=50.0, request_burst=10.0)
    usage, first, second = TenantUsage(), QuotaLease(), QuotaLease()
    assert _admit_leased(usage, first, quota, request(), 0.0)
    assert first.amounts == {"requests": pytest.approx(9.0)}  # a slice of 10: one spent
    assert usage.buckets["requests"].level == pytest.approx(0.0)
    rejected = take_lease(usage, quota, request(), lease_slice(quota, 0.2), 0.0)
    assert isinstance(rejected, Reject) and rejected.reason == "quota"
    return_lease(usage, quota, first.take_all(), 0.0)
    assert _admit_leased(usage, second, quota, request(), 0.0)
    assert not leasable(TenantQuota(requests_per_s=1.0, max_concurrency=3))  # a cap: per request


# ------------------------------------------------------------------ priority and shedding


def test_under_pressure_classes_are_admitted_top_down_and_levels_within_a_class() -> None:
    state = saturated_state()
    offered = [
        request(priority="sheddable", rid="sheddable"),
        request(priority="standard", rid="standard-low", level=-5),
        request(priority="standard", rid="standard-high", level=7),
        request(priority="critical", rid="critical"),
    ]
    for r in offered:
        assert isinstance(decide_open(state, r), Defer)
    order = []
    for step in range(1, 5):
        free_one_slot(state)
        drain(state, LIMITS, float(step))
        order += admitted(state)
    assert order == ["critical", "standard-high", "standard-low", "sheddable"]


def test_a_lightly_saturated_fleet_sheds_from_the_bottom_up() -> None:
    state = AdmissionState()
    # 0.8 saturation: under critical's and standard's bounds, over sheddable's (0.75).
    observe_fleet(state, fleet(waiting=13, workers=4))
    assert 0.75 < saturation(state, LIMITS) < 0.85
    assert isinstance(decide_open(state, request(priority="critical")), Admit)
    assert isinstance(decide_open(state, request(priority="sheddable")), Defer)


def test_a_full_queue_rejects_the_lowest_ranked_request() -> None:
    limits = AdmissionLimits(max_deferred=2)
    state = saturated_state(limits)
    low = [request(priority="sheddable", rid=f"low{i}") for i in range(2)]
    for r in low:
        decide_open(state, r, limits=limits)
    # A standard request pushes out a sheddable one (the later of the two).
    assert isinstance(decide_open(state, request(rid="std"), limits=limits), Defer)
    shed = take_outcomes(state)
    assert [o.request.request_id for o in shed] == ["low1"]
    assert isinstance(shed[0].decision, Reject) and shed[0].decision.reason == "capacity"
    # Another sheddable one finds nothing below it: it is the one rejected.
    rejected = decide_open(state, request(priority="sheddable"), limits=limits)
    assert isinstance(rejected, Reject) and rejected.reason == "capacity"
    assert set(state.deferred) == {"low0", "std"}


def test_the_queue_is_bounded_in_bytes() -> None:
    limits = AdmissionLimits(max_deferred_bytes=1000)
    state = saturated_state(limits)
    assert isinstance(decide_open(state, request(size=600), limits=limits), Defer)
    full = decide_open(state, request(size=600), limits=limits)
    assert isinstance(full, Reject) and full.reason == "capacity"
    assert state.deferred_bytes == 600


# ------------------------------------------------------------------ fairness


def test_weighted_fair_queuing_shares_tokens_by_weight_within_a_class() -> None:
    state = saturated_state()
    weights = {"heavy": 2.0, "light": 1.0}
    limits = AdmissionLimits(max_deferred=10_000)
    # Both tenants flood the queue (the light one first, with larger requests).
    for _ in range(300):
        for tenant, tokens in (("light", (300, 100)), ("heavy", (150, 50))):
            r = request(tenant, tokens=tokens)
            decide(state, request=r, quota=TenantQuota(weight=weights[tenant]), limits=limits, now=0.0)
    served: Counter[str] = Counter()
    for step in range(60):  # about 180 of the 600 admitted: both tenants stay backlogged
        free_one_slot(state, limits)
        drain(state, limits, step * 0.01)
        for outcome in take_outcomes(state):
            assert isinstance(outcome.decision, Admit)
            served[outcome.request.tenant] += outcome.request.tokens
    share = served["heavy"] / (served["heavy"] + served["light"])
    assert share == pytest.approx(2 / 3, abs=0.02)


def test_a_quiet_tenant_is_not_starved_by_a_flood() -> None:
    state = saturated_state()
    limits = AdmissionLimits(max_deferred=10_000)
    for _ in range(500):
        decide_open(state, request("flood"), limits=limits)
    quiet = request("quiet", rid="quiet")
    decide_open(state, quiet, limits=limits, now=1.0)
    order: list[str] = []
    for step in range(3):
        free_one_slot(state, limits)
        drain(state, limits, 1.0 + step)
        order += admitted(state)
    assert "quiet" in order[:2]


def test_a_request_served_out_of_tag_order_does_not_erase_other_tenants_credit() -> None:
    state = saturated_state()
    for _ in range(6):  # tenant b's backlog: start tags 0, 200, ..., 1000
        decide_open(state, request("b"))
    # A later step of one of b's workflows goes ahead of everything (start tag 1200).
    decide_open(state, request("b", rid="b-step2", standing=CONTINUATION, spent=0.1), now=0)
    free_one_slot(state)
    drain(state, LIMITS, 1.0)
    assert admitted(state)[:1] == ["b-step2"]
    # Tenant a, quiet so far, is served next to b's oldest, not after all of b's backlog.
    decide_open(state, request("a", rid="a-first"), now=2.0)
    order: list[str] = []
    for step in range(3, 6):
        free_one_slot(state)
        drain(state, LIMITS, float(step))
        order += admitted(state)
    assert "a-first" in order[:2], order


# ------------------------------------------------------------------ deadlines


def test_an_infeasible_deadline_is_rejected_at_once() -> None:
    state = AdmissionState()
    observe_fleet(state, fleet())

    def predict(r: AdmissionRequest) -> Prediction:
        return Prediction(ttft_s=1.5, finish_s=9.0)

    tight = decide(
        state, request=request(deadline_s=8.0), quota=OPEN, limits=LIMITS, now=0.0, predict=predict
    )
    assert isinstance(tight, Reject) and tight.reason == "deadline"
    assert "1.00 s past the deadline" in tight.message and tight.retry_after_s == 1.5
    roomy = decide(
        state, request=request(deadline_s=10.0), quota=OPEN, limits=LIMITS, now=0.0, predict=predict
    )
    assert isinstance(roomy, Admit)
    assert state.deferred == {}


def test_a_deferred_request_is_decided_before_its_deadline() -> None:
    state = saturated_state()

    def predict(r: AdmissionRequest) -> Prediction:
        return Prediction(ttft_s=0.5, finish_s=2.0)

    waiting = request(deadline_s=10.0)
    deferred = decide(state, request=waiting, quota=OPEN, limits=LIMITS, now=0.0, predict=predict)
    assert isinstance(deferred, Defer) and deferred.due == pytest.approx(8.0)
    assert next_due(state) == pytest.approx(8.0)
    drain(state, LIMITS, 7.9, predict)
    assert take_outcomes(state) == []
    drain(state, LIMITS, 8.0, predict)
    (outcome,) = take_outcomes(state)
    assert isinstance(outcome.decision, Reject) and outcome.decision.reason == "deadline"
    assert state.deferred == {}


def test_a_deferred_request_whose_deadline_becomes_infeasible_is_rejected_then() -> None:
    state = saturated_state()
    slow = {"finish": 2.0}

    def predict(r: AdmissionRequest) -> Prediction:
        return Prediction(ttft_s=0.5, finish_s=slow["finish"])

    waiting = request(deadline_s=10.0, rid="waiting")
    assert isinstance(
        decide(state, request=waiting, quota=OPEN, limits=LIMITS, now=0.0, predict=predict), Defer
    )
    slow["finish"] = 9.5  # the fleet slowed while it waited
    free_one_slot(state)
    drain(state, LIMITS, 1.0, predict)
    (outcome,) = take_outcomes(state)
    assert isinstance(outcome.decision, Reject) and outcome.decision.reason == "deadline"


def test_without_a_deadline_a_wait_is_bounded_by_max_defer() -> None:
    state = saturated_state()
    deferred = decide_open(state, request(), now=5.0)
    assert isinstance(deferred, Defer) and deferred.due == 5.0 + LIMITS.max_defer_s
    drain(state, LIMITS, deferred.due)
    (outcome,) = take_outcomes(state)
    assert isinstance(outcome.decision, Reject) and outcome.decision.reason == "capacity"


def test_a_request_with_a_deadline_waits_past_max_defer_while_its_deadline_can_be_met() -> None:
    # A sheddable step with five minutes to spare, deferred behind a burst: it is not turned away
    # when max_defer_s runs out, and it is served once the fleet has room.
    state = saturated_state()

    def predict(r: AdmissionRequest) -> Prediction:
        return Prediction(ttft_s=0.5, finish_s=4.0)

    patient = request(priority="sheddable", deadline_s=300.0)
    deferred = decide(state, request=patient, quota=OPEN, limits=LIMITS, now=0.0, predict=predict)
    assert isinstance(deferred, Defer) and deferred.due == pytest.approx(296.0)
    assert deferred.due > LIMITS.max_defer_s
    drain(state, LIMITS, 3 * LIMITS.max_defer_s, predict)
    assert take_outcomes(state) == [] and patient.request_id in state.deferred
    free_one_slot(state)
    drain(state, LIMITS, 3 * LIMITS.max_defer_s, predict)
    (outcome,) = take_outcomes(state)
    assert isinstance(outcome.decision, Admit) and outcome.decision.waited_s == 3 * LIMITS.max_defer_s


def test_no_live_worker_ends_a_wait_with_no_workers() -> None:
    state = AdmissionState()
    observe_fleet(state, fleet(workers=0))
    deferred = decide_open(state, request())
    assert isinstance(deferred, Defer)
    rejected = expire(state, next(iter(state.deferred)), 1.0)
    assert isinstance(rejected, Reject) and rejected.reason == "no_workers"
    assert expire(state, "gone", 1.0) is None


# ------------------------------------------------------------------ workflows


def test_a_later_workflow_step_goes_ahead_of_a_new_workflow_in_its_class_only() -> None:
    state = saturated_state()
    for r in (
        request(rid="new", standing=NEW),
        request(rid="doomed", standing=DOOMED),
        request(rid="step3", standing=CONTINUATION, spent=0.02),
        request(rid="critical-new", priority="critical", standing=NEW),
    ):
        decide_open(state, r)
    order: list[str] = []
    for step in range(1, 5):
        free_one_slot(state)
        drain(state, LIMITS, float(step))
        order += admitted(state)
    assert order == ["critical-new", "step3", "new", "doomed"]


def test_a_full_queue_sheds_new_workflows_before_continuations() -> None:
    limits = AdmissionLimits(max_deferred=2)
    state = saturated_state(limits)
    decide_open(state, request(rid="cont", standing=CONTINUATION, spent=0.1), limits=limits, now=0)
    decide_open(state, request(rid="new"), limits=limits, now=0)
    decide_open(state, request(rid="cont2", standing=CONTINUATION, spent=0.05), limits=limits, now=0)
    (shed,) = take_outcomes(state)
    assert shed.request.request_id == "new"
    # Among continuations, the least spent goes first.
    decide_open(state, request(rid="cont3", standing=CONTINUATION, spent=0.5), limits=limits, now=0)
    (shed,) = take_outcomes(state)
    assert shed.request.request_id == "cont2"


def _spend(status: str, spent: float, completed: int) -> WorkflowSpend:
    return WorkflowSpend(
        workflow_id="wf",
        tenant="t",
        spend_usd=spent,
        gpu_seconds=1.0,
        steps_completed=completed,
        status=status,  # type: ignore[arg-type]
        first_event_at=0.0,
        last_event_at=1.0,
        updated_at=1.0,
    )


def test_workflow_standing_comes_from_the_ledgers_running_total() -> None:
    assert workflow_standing(2, _spend("running", 0.01, 1)) == CONTINUATION
    assert workflow_standing(1, _spend("running", 0.0, 0)) == NEW
    assert workflow_standing(3, None) == NEW  # the ledger does not know it (yet)
    assert workflow_standing(4, _spend("failed", 0.3, 3)) == DOOMED
    assert workflow_standing(None, None) == NEW


# ------------------------------------------------------------------ saturation and controls


def test_saturation_from_kv_queue_and_predicted_wait_with_corrections() -> None:
    state = AdmissionState()
    assert saturation(state, LIMITS) == math.inf
    views = [
        WorkerView(
            "w0",
            "decode",
            "m",
            16,
            queue_depth=4,
            running=3,
            kv_blocks_total=100,
            kv_blocks_used=50,
            heartbeat_at=9.5,
        ),
        WorkerView(
            "w1",
            "decode",
            "m",
            16,
            queue_depth=4,
            running=3,
            kv_blocks_total=100,
            kv_blocks_used=90,
            heartbeat_at=9.5,
        ),
        WorkerView(
            "gone",
            "decode",
            "m",
            16,
            queue_depth=99,
            running=9,
            kv_blocks_total=100,
            kv_blocks_used=100,
            heartbeat_at=1.0,
        ),
    ]
    observe_fleet(state, fleet_load(views, 10.0))
    assert state.fleet is not None and state.fleet.workers == 2 and state.fleet.waiting == 8
    assert saturation(state, LIMITS) == pytest.approx(max(0.7 / LIMITS.kv_high, 8 / 8))
    state.admitted_since, state.finished_since = 6, 2
    assert saturation(state, LIMITS) == pytest.approx(12 / 8)
    waited = Prediction(ttft_s=10.0, finish_s=11.0, wait_s=10.0)
    assert saturation(state, LIMITS, waited) == pytest.approx(5.0)
    # A long prompt's own prefill is not load: only the wait behind other work counts.
    own_prefill = Prediction(ttft_s=10.0, finish_s=11.0, wait_s=0.0)
    assert saturation(state, LIMITS, own_prefill) == pytest.approx(12 / 8)


def test_the_rate_limiter_and_no_control_variants() -> None:
    quota = TenantQuota(requests_per_s=1.0, request_burst=1.0)
    for control, outcomes in (("rate_limit", ["admit", "reject"]), ("none", ["admit", "admit"])):
        limits = AdmissionLimits(control=control)  # type: ignore[arg-type]
        state = saturated_state(limits)  # saturation does not matter to either
        got = [
            decide(state, request=request(), quota=quota, limits=limits, now=0.0).outcome for _ in range(2)
        ]
        assert got == outcomes
        assert state.deferred == {}


# ------------------------------------------------------------------ property: nothing waits forever


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["critical", "standard", "sheddable"]),
            st.floats(0.0, 5.0),  # arrival offset
            st.one_of(st.none(), st.floats(0.5, 40.0)),  # deadline
            st.integers(0, 40),  # fleet waiting at the next heartbeat
        ),
        min_size=1,
        max_size=60,
    )
)
def test_every_offered_request_is_decided_once_and_none_after_its_deadline(
    arrivals: list[tuple[str, float, float | None, int]],
) -> None:
    limits = AdmissionLimits(max_deferred=20)
    state = AdmissionState()
    observe_fleet(state, fleet(waiting=40))
    now = 0.0
    decided: dict[str, tuple[str, float]] = {}
    offered: dict[str, AdmissionRequest] = {}

    def predict(r: AdmissionRequest) -> Prediction:
        return Prediction(0.2, 1.0)

    def record(rid: str, outcome: str) -> None:
        assert rid not in decided, f"{rid} decided twice"
        decided[rid] = (outcome, now)

    for priority, offset, deadline, waiting in arrivals:
        # The shell's timer: what falls due before the next arrival is decided when due.
        while (due := next_due(state)) is not None and due <= now + offset:
            now = max(now, due)
            drain(state, limits, now, predict)
            for o in take_outcomes(state):
                record(o.request.request_id, o.decision.outcome)
        now += offset
        r = request(priority=priority, now=now, deadline_s=deadline)
        offered[r.request_id] = r
        decision = decide(state, request=r, quota=OPEN, limits=limits, now=now, predict=predict)
        if not isinstance(decision, Defer):
            record(r.request_id, decision.outcome)
        for o in take_outcomes(state):
            record(o.request.request_id, o.decision.outcome)
        observe_fleet(state, fleet(waiting=waiting))
        drain(state, limits, now, predict)
        for o in take_outcomes(state):
            record(o.request.request_id, o.decision.outcome)
    while (due := next_due(state)) is not None:
        now = max(now, due)
        drain(state, limits, now, predict)
        for o in take_outcomes(state):
            record(o.request.request_id, o.decision.outcome)
    assert set(decided) == set(offered) and state.deferred == {} and state.deferred_bytes == 0
    for rid, (outcome, at) in decided.items():
        deadline_at = offered[rid].deadline_at
        if deadline_at is not None and outcome == "admit":
            assert at < deadline_at
        if deadline_at is not None:
            assert at <= deadline_at


def test_batch_lines_admitted_since_the_heartbeat_are_no_queue_ahead_of_an_interactive_request() -> None:
    # The engines run an interactive request ahead of waiting Batch API lines: a burst of lines
    # the runner just released must not make admission defer the next chat request, while the
    # next line sees them all ahead of it.
    state = AdmissionState()
    observe_fleet(state, fleet(waiting=0, workers=2))
    per = 2 * LIMITS.queue_per_worker
    for _ in range(6):
        decide_open(state, dataclasses.replace(request(priority="sheddable"), service_class="batch"))
    assert state.admitted_since == state.batch_admitted_since == 6
    assert saturation(state, LIMITS, service_class="batch") == pytest.approx(6 / per)
    assert saturation(state, LIMITS) == 0.0
    chat = request(priority="sheddable")
    assert isinstance(decide_open(state, chat), Admit)
    # One interactive admitted since: it is ahead of the next of either class.
    assert saturation(state, LIMITS) == pytest.approx(1 / per)
    assert saturation(state, LIMITS, service_class="batch") == pytest.approx(7 / per)
    # Finished lines free the batch's count only.
    note_finished(state, 4, batch=4)
    assert saturation(state, LIMITS) == pytest.approx(1 / per)
    assert saturation(state, LIMITS, service_class="batch") == pytest.approx(3 / per)
    # A fresh heartbeat holds them (in its queue depth) and the counts start again.
    observe_fleet(state, fleet(waiting=2, workers=2))
    assert state.batch_admitted_since == state.batch_finished_since == 0
