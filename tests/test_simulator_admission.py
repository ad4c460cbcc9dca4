"""The simulator runs admission's own policy: deferral with a timed re-check in the event loop,
and the variants `ripplemesh simulate --admission` compares."""

from __future__ import annotations

from typing import Any

import pytest

from services.admission import policy as admission_policy
from services.admission.policy import TenantQuota
from services.router import policy as router_policy
from services.router.policy import RouterConfig
from services.simulator import run_simulation
from services.simulator.admission import parse_admission
from services.simulator.core import RequestRecord, SimOptions
from services.simulator.fleet import FleetSpec, PoolSpec
from services.simulator.workload import SHARED_TENANTS, AgenticWorkload

MODEL = "sim-test"


def overload(workflows: int = 600, rate: float = 8.0) -> AgenticWorkload:
    """About four times the agent runs one H100 serves, for 75 s: every control of admission is
    exercised, and without admission the fleet's queue grows until deadlines pass."""
    return AgenticWorkload(
        workflows=workflows, rate_per_s=rate, tenants_spec=SHARED_TENANTS, block_size=16, model=MODEL
    )


FLEET = FleetSpec(pools=[PoolSpec(replicas=1)])


def test_deferred_requests_are_decided_before_their_deadline_and_every_request_ends_once() -> None:
    log: list[RequestRecord] = []
    # A deferral queue of 64 (4,096 by default, which this burst never fills): a full queue's
    # shedding is exercised too.
    result = run_simulation(overload(), FLEET, request_log=log.append, admission="ripplemesh:max_deferred=64")
    assert result.admission.startswith("ripplemesh") and result.deferred_requests > 0
    assert result.deferral_s is not None and result.deferral_s.count > 0
    workload = overload()
    deadlines = {t.name: t.step_deadline_s for t in workload.tenants_spec}
    for record in log:
        deadline = deadlines[record.tenant]
        assert deadline is not None
        if record.outcome.startswith("admission:"):
            # Decided in time: a rejection comes before the deadline, never at or after it.
            assert record.finished_at < record.arrival + deadline
    assert len(log) == result.requests == len({r.request_id for r in log})
    assert result.requests_completed + sum(result.rejections.values()) + sum(result.failures.values()) == (
        result.requests
    )
    assert {"admission:capacity"} <= set(result.rejections)


def test_under_overload_admission_protects_critical_traffic_and_cuts_waste() -> None:
    # Admission's own controls against none, behind a router that refuses only hopeless
    # deadlines (its refusal of tasks not worth their cost, of new workflows past the decode
    # knee and of the dearest new tasks, controls of its own, off in both runs).
    lax = SimOptions(
        router_config=RouterConfig(worth_probability=0.0, new_task_max_tpot_s=None, dearest_task_factor=None)
    )
    admitted = run_simulation(overload(), FLEET, admission="ripplemesh", options=lax)
    uncontrolled = run_simulation(overload(), FLEET, admission="none", options=lax)
    assert uncontrolled.deferred_requests == 0 and not any(
        k.startswith("admission:") for k in uncontrolled.rejections
    )
    critical = admitted.slo_by_priority["critical"]
    assert critical is not None and critical > (uncontrolled.slo_by_priority["critical"] or 0.0)
    assert admitted.wasted_spend_usd / admitted.total_spend_usd < uncontrolled.wasted_spend_usd / (
        uncontrolled.total_spend_usd
    )
    assert (admitted.goodput_tasks_per_s or 0.0) > (uncontrolled.goodput_tasks_per_s or 0.0)
    # Bottom-up: the critical tenant is served first. The sheddable one, whose steps have
    # minutes to spare, waits behind it (deferred rather than turned away) and meets the TTFT
    # objective less often.
    tenants = admitted.tenants
    assert tenants["batch"]["slo_attainment"] < tenants["assistant"]["slo_attainment"]
    # Every step here has a deadline, and the default queue holds the burst: admission turns
    # nothing away for capacity; a deferred step is served, or rejected when its deadline can no
    # longer be met.
    assert "admission:capacity" not in admitted.rejections and "admission:deadline" in admitted.rejections


def test_under_overload_the_router_sheds_the_dearest_new_tasks_and_a_success_costs_less() -> None:
    # At overload the router refuses the first steps of the dearest new tasks (the longest
    # workflows) once the fleet is past keeping up, so the fleet's time goes to tasks that take
    # less of it and a successful task costs less than with that refusal off: under the rate
    # limiter, where nothing else sheds, and behind the project's admission, which sheds by
    # priority and saturation first.
    steps = {t.task_id: t.steps for t in overload().tasks()}
    log: list[RequestRecord] = []
    shedding = {
        "rate_limit": run_simulation(overload(), FLEET, admission="rate_limit", request_log=log.append),
        "ripplemesh": run_simulation(overload(), FLEET, admission="ripplemesh"),
    }
    # The rule's bar is the same for the standard and sheddable classes, and 1.5 x dearer for
    # the critical one: among the first two, the refused tasks are the long ones; with one bar
    # for all, more critical tasks are refused.
    priority = {t.name: t.priority for t in overload().tenants_spec}

    def refused_first_steps(records: list[RequestRecord], critical: bool) -> tuple[list[int], list[int]]:
        """The steps of the class's new tasks the router refused as saturated, and of all tried."""
        refused, tried = [], []
        for record in records:
            if record.request_id.endswith("-1") and (priority[record.tenant] == "critical") == critical:
                task_steps = steps[record.request_id.rsplit("-", 1)[0]]
                tried.append(task_steps)
                if record.outcome == "router:saturated":
                    refused.append(task_steps)
        return refused, tried

    others, others_tried = refused_first_steps(log, critical=False)
    assert len(others) > 20 and sum(others) / len(others) > sum(others_tried) / len(others_tried) + 1
    one_bar = SimOptions(router_config=RouterConfig(dearest_priority_factor={}))
    one_bar_log: list[RequestRecord] = []
    run_simulation(overload(), FLEET, admission="rate_limit", request_log=one_bar_log.append, options=one_bar)
    critical_refused = len(refused_first_steps(log, critical=True)[0])
    assert critical_refused < len(refused_first_steps(one_bar_log, critical=True)[0])
    off = SimOptions(router_config=RouterConfig(dearest_task_factor=None))
    for admission, bound in (("rate_limit", 0.95), ("ripplemesh", 0.98)):
        not_shedding = run_simulation(overload(), FLEET, admission=admission, options=off)
        cost = shedding[admission].cost_per_successful_task_usd
        assert cost is not None and not_shedding.cost_per_successful_task_usd is not None
        assert cost < bound * not_shedding.cost_per_successful_task_usd, admission


def test_the_simulator_calls_the_admission_module(monkeypatch: pytest.MonkeyPatch) -> None:
    drained: list[float] = []
    real = admission_policy.drain

    def watched(state: Any, limits: Any, now: float, predict: Any = admission_policy.no_prediction) -> None:
        drained.append(now)
        real(state, limits, now, predict)

    monkeypatch.setattr(admission_policy, "drain", watched)
    result = run_simulation(overload(workflows=60), FLEET)
    assert result.deferred_requests > 0 and len(drained) > result.deferred_requests / 10


def test_the_router_sees_how_long_admission_held_each_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # What presses the fleet for the router's refusals includes admission's hold on a request
    # (RequestAdmitted.waited_s in the mesh): in the simulator, the time from its arrival to the
    # router's decision, zero for one admitted at once.
    seen: dict[str, tuple[float, float]] = {}
    real = router_policy.place

    def watched(state: Any, request: Any, prefix: Any, now: float) -> Any:
        seen[request.request_id] = (now, request.admission_wait_s)
        return real(state, request, prefix, now)

    monkeypatch.setattr(router_policy, "place", watched)
    log: list[RequestRecord] = []
    result = run_simulation(overload(workflows=120), FLEET, request_log=log.append)
    assert result.deferred_requests > 0
    arrivals = {record.request_id: record.arrival for record in log}
    waits = [wait for _, wait in seen.values()]
    for request_id, (decided_at, wait) in seen.items():
        assert wait == pytest.approx(decided_at - arrivals[request_id], abs=1e-9), request_id
    assert 0.0 in waits and max(waits) > 1.0  # some straight through, some held past a second


def test_variants_parse_and_the_rate_limiter_splits_a_fleet_rate_by_weight() -> None:
    variant = parse_admission("rate_limit:tokens_per_s=70000,burst_s=2")
    assert variant.limits.control == "rate_limit"
    quotas = variant.quotas({t.name: t.quota for t in SHARED_TENANTS})
    total_weight = sum(t.quota.weight for t in SHARED_TENANTS)
    assert quotas["agents-a"] == TenantQuota(
        tokens_per_s=70000 * 2 / total_weight, token_burst=2 * 70000 * 2 / total_weight, weight=2.0
    )
    tuned = parse_admission("ripplemesh:queue_per_worker=6,max_deferred=10")
    assert tuned.limits.queue_per_worker == 6.0 and tuned.limits.max_deferred == 10
    for bad, words in (
        ("bouncer", "unknown admission 'bouncer'"),
        ("ripplemesh:queue=3", "unknown admission option 'queue'"),
        ("ripplemesh:queue_per_worker=lots", "expected a number"),
        ("rate_limit:tokens_per_s=-1", "must be > 0"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_admission(bad)


def test_the_rate_limiter_variant_rejects_on_quota_only() -> None:
    result = run_simulation(overload(workflows=80), FLEET, admission="rate_limit:tokens_per_s=20000")
    assert result.deferred_requests == 0
    assert set(k for k in result.rejections if k.startswith("admission:")) == {"admission:quota"}
