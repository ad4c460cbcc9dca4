"""The router's calibration (services/router/policy/calibration.py): its predictions' errors,
learned per GPU type from how placements turned out, change what it decides: a pessimistic
router stops refusing steps it can serve, a late one refuses what it cannot, a prefix the
index claims but prefills do not find stops counting as cached, and each GPU type keeps its own.
"""

from __future__ import annotations

import math

from services.router.policy import NoPlacement, Placement, RouterState, place
from services.router.policy.calibration import PRIOR_SAMPLES, WINDOW_SAMPLES, Calibration
from tests.router_views import FixedPrefix, state_of
from tests.test_router_policy import NOW, TOTAL, decide, request, view


def pessimistic(state: RouterState, gpu_type: str, ratio: float, samples: int = 300) -> RouterState:
    """`samples` placements on `gpu_type` that took `ratio` of their predicted time."""
    for i in range(samples):
        predicted = 2.0 + (i % 10)
        state.observe_completion(gpu_type, predicted, predicted * ratio)
    return state


def test_before_any_completion_the_prior_holds() -> None:
    calibration = Calibration(prior_spread=0.4)
    assert calibration.success_probability("H100", 10.0, 10.0) == 0.5
    # A log-normal spread of 0.4: a deadline at 1.5x the prediction is met about 84% of the time.
    assert math.isclose(calibration.success_probability("H100", 10.0, 15.0), 0.84, abs_tol=0.01)
    assert calibration.success_probability("H100", 10.0, -1.0) == 0.0
    assert calibration.summary() == {}


def test_the_residuals_converge_on_how_predictions_turn_out_and_follow_a_change() -> None:
    calibration = Calibration(prior_spread=0.4)
    for i in range(2000):
        predicted = 1.0 + i % 20
        calibration.observe_completion("H100", predicted, predicted * 0.7)
    figures = calibration.summary()["H100"]
    assert math.isclose(figures["completion_ratio"], 0.7, rel_tol=0.02)
    assert figures["completion_spread"] < 0.1  # they all agree: a narrow spread (floored)
    assert figures["completion_samples"] == 2000
    # The load changes: predictions now run 40% short. Within two windows the bias has gone 86%
    # of the way (a decaying average over about one window).
    for i in range(int(2 * WINDOW_SAMPLES)):
        predicted = 1.0 + i % 20
        calibration.observe_completion("H100", predicted, predicted * 1.4)
    assert 1.2 < calibration.summary()["H100"]["completion_ratio"] < 1.4
    # Nonsense (negative, infinite) is not learned from.
    calibration.observe_completion("H100", -1.0, 3.0)
    calibration.observe_completion("H100", math.inf, 3.0)
    assert calibration.summary()["H100"]["completion_samples"] == 2000 + 2 * WINDOW_SAMPLES


def test_a_router_whose_predictions_run_pessimistic_places_a_step_it_refused() -> None:
    # A step predicted to need most of its 3.4 s deadline: under the prior's spread the task's
    # chance is not worth a pressed fleet's price. Once completions there have taken 60% of
    # their predicted time, the same step on the same fleet is placed, with better odds.
    task = {"output": 300, "workflow_id": "wf", "workflow_steps": 4, "workflow_step": 1}
    full = {"used": 27_000, "running": 30}

    def fleet() -> RouterState:
        return state_of(view("a", **full), view("b", **full))

    step = request(deadline_in=3.6, admission_wait_s=2.0, **task)
    before = place(fleet(), step, FixedPrefix(), NOW)
    assert isinstance(before, NoPlacement) and before.reason in ("saturated", "infeasible"), before
    after = place(pessimistic(fleet(), "H100", 0.6), step, FixedPrefix(), NOW)
    assert isinstance(after, Placement), after
    assert after.success_probability > 0.95


def test_a_router_whose_predictions_run_late_lowers_its_odds_and_refuses() -> None:
    task = {"output": 300, "workflow_id": "wf", "workflow_steps": 4, "workflow_step": 1}
    idle = {"used": 1000, "running": 30}
    step = request(deadline_in=8.0, **task)
    before = decide(state_of(view("a", **idle), view("b", **idle)), step)
    assert before.success_probability > 0.9
    late = pessimistic(state_of(view("a", **idle), view("b", **idle)), "H100", 3.0)
    after = place(late, step, FixedPrefix(), NOW)
    # Three times the predicted time does not fit the deadline: not worth trying at all.
    assert isinstance(after, NoPlacement) and after.reason == "infeasible", after


def test_each_gpu_type_keeps_its_own_calibration() -> None:
    # H100s that ran late say nothing of the H200s: a step is placed on an H200 rather than on
    # the H100 the prediction alone prefers, where its odds are now poor.
    task = {"output": 300, "deadline_in": 8.0}
    idle = {"used": 1000, "running": 30}
    state = state_of(view("h100", gpu="H100", **idle), view("h200", gpu="H200", **idle))
    pessimistic(state, "H100", 3.0)
    chosen = decide(state, request(**task))
    assert chosen.decode_worker == "h200", chosen
    assert chosen.success_probability > 0.9
    summary = state.calibration.summary()
    assert set(summary) == {"H100"} and summary["H100"]["completion_samples"] == 300


def test_a_prefix_the_index_claims_but_prefills_do_not_find_stops_counting_as_cached() -> None:
    # The index says the worker holds the request's 2,048-token prefix; prefills there have
    # lately found a quarter of what it claimed (evicted before they ran). The prediction then
    # counts on a quarter, and a longer first token; the share learned is on the index's claim.
    prefix = FixedPrefix({"a": 128})
    req = request(prompt=2048 + 64)
    trusted = decide(state_of(view("a", used=TOTAL // 4)), req, prefix)
    assert trusted.predicted_cached_tokens == 2048 and trusted.indexed_cached_tokens == 2048
    state = state_of(view("a", used=TOTAL // 4))
    for _ in range(500):
        state.observe_cached("H100", 2048, 512)
    doubted = decide(state, req, prefix)
    assert doubted.indexed_cached_tokens == 2048
    assert 448 <= doubted.predicted_cached_tokens <= 640, doubted  # a quarter, and the prior's 1
    assert doubted.predicted_ttft_s > trusted.predicted_ttft_s
    assert 0.25 < state.calibration.found_share("H100") < 0.3
    # Observing against the index's claim, not the discounted prediction: the share holds.
    for _ in range(500):
        state.observe_cached("H100", doubted.indexed_cached_tokens, 512)
    assert 0.25 < state.calibration.found_share("H100") < 0.27


def test_the_prior_weighs_as_a_few_completions() -> None:
    # One surprising completion moves the estimate, but by about 1/(PRIOR_SAMPLES + 1) of it.
    calibration = Calibration(prior_spread=0.4)
    calibration.observe_completion("H100", 10.0, 10.0 * math.e)
    ratio = calibration.summary()["H100"]["completion_ratio"]
    assert math.isclose(math.log(ratio), 1.0 / (PRIOR_SAMPLES + 1), rel_tol=0.05)


def test_the_simulator_runs_the_calibration_and_reports_what_it_learned() -> None:
    # The simulator feeds the same calibration from its own completions: every completed
    # request ripplemesh placed is one residual on its decode worker's GPU type; a baseline,
    # which predicts nothing, learns nothing.
    from services.simulator.core import SimOptions, run_simulation
    from services.simulator.fleet import parse_fleet
    from services.simulator.workload import load_workload

    workload = load_workload("agentic:workflows=120,seed=3")
    options = SimOptions(prefix_upper_bound=False)
    ours = run_simulation(workload, parse_fleet("1xH100,1xH200"), "ripplemesh", options=options)
    learned = ours.router_calibration
    assert set(learned) == {"H100", "H200"}
    samples = sum(int(g["completion_samples"]) for g in learned.values())
    assert samples == ours.requests_completed + ours.failures.get("client:deadline", 0)
    assert all(0.2 < g["completion_ratio"] < 5.0 and g["cached_share"] > 0.5 for g in learned.values())
    baseline = run_simulation(workload, parse_fleet("1xH100,1xH200"), "round_robin", options=options)
    assert baseline.router_calibration == {}
