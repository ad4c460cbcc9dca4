"""`ripplemesh sweep`: every policy at every point, margins against the cheapest baseline, and a
sweep that resumes from the runs already made (real simulator runs on a small workload)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from services.autoscaler.capacity import EngineProfile, Slo, replica_capacity
from services.router.policy import RouterConfig
from services.simulator.capacity import capacity, fleet_request_rate, offered_work
from services.simulator.fleet import parse_fleet
from services.simulator.sweep import (
    ARRIVALS_S,
    AZURE_FLEET,
    COST_VERDICTS,
    FAMILIES,
    FAMILY_FLEET,
    LOADS,
    MOONCAKE_WINDOWS,
    SweepPoint,
    cell_path,
    cost_interval,
    family_points,
    family_runs,
    mean_interval,
    parse_seeds,
    router_points,
    run_sweep,
    summarise,
    write_summary,
)
from services.simulator.workload import ListWorkload, Step, load_workload, random_prompt_hashes

POLICIES = ("ripplemesh", "round_robin", "least_loaded")
POINTS = [
    SweepPoint(
        f"agentic-s{seed}-x4",
        "agentic-x4",
        f"agentic:workflows=40,rate_per_s=2,seed={seed}",
        "1xH100,1xH200",
        4.0,
    )
    for seed in (0, 1)
]


def _cost(path: Path) -> float:
    return float(json.loads(path.read_bytes())["cost_per_successful_task_usd"])


def test_a_sweep_compares_every_point_with_its_cheapest_baseline_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sweep = run_sweep(POINTS, tmp_path, policies=POLICIES, admissions=("ripplemesh",), jobs=2)
    assert (sweep.ran, sweep.read) == (6, 0)
    assert [m.point for m in sweep.margins] == ["agentic-s0-x4", "agentic-s1-x4"]
    for point, margin in zip(POINTS, sweep.margins, strict=True):
        costs = {p: _cost(cell_path(tmp_path, point, "ripplemesh", p)) for p in POLICIES}
        cheapest = min(("round_robin", "least_loaded"), key=lambda p: costs[p])
        assert margin.best == cheapest
        assert margin.cost_vs_best == pytest.approx(costs["ripplemesh"] / costs[cheapest] - 1)
    # The seeds draw different workloads, so the two points are two measurements.
    assert sweep.margins[0].cost_vs_best != sweep.margins[1].cost_vs_best

    # Run again: every cell is read, none re-run; a damaged one is run again, with a warning.
    stamps = {p: cell_path(tmp_path, POINTS[0], "ripplemesh", p).stat().st_mtime_ns for p in POLICIES}
    damaged = cell_path(tmp_path, POINTS[1], "ripplemesh", "least_loaded")
    damaged.write_text('{"policy": "least_lo')
    with caplog.at_level(logging.WARNING, logger="services.simulator.sweep"):
        again = run_sweep(POINTS, tmp_path, policies=POLICIES, admissions=("ripplemesh",), jobs=1)
    assert (again.ran, again.read) == (1, 5)
    assert "unreadable" in caplog.text and "least_loaded" in caplog.text
    assert {p: cell_path(tmp_path, POINTS[0], "ripplemesh", p).stat().st_mtime_ns for p in POLICIES} == stamps
    assert again.margins == sweep.margins  # the same figures: the run is deterministic

    json_path, markdown_path = write_summary(again, tmp_path)
    summary = json.loads(json_path.read_bytes())
    (group,) = summary["groups"]
    assert group["points"] == 2
    assert group["cheapest"] == sum(m.cost_vs_best < 0 for m in again.margins)
    # Pooled: each policy's spend over its successful tasks at both points.
    pooled, task_spend, idle = {}, {}, {}
    for policy in POLICIES:
        cells = [
            json.loads(cell_path(tmp_path, point, "ripplemesh", policy).read_bytes()) for point in POINTS
        ]
        spend = sum(c["total_spend_usd"] for c in cells)
        succeeded = sum(c["tasks_succeeded"] for c in cells)
        pooled[policy] = spend / succeeded
        task_spend[policy] = sum(c["successful_spend_usd"] for c in cells) / succeeded
        idle[policy] = sum(c["idle_spend_usd"] for c in cells) / spend
    best = min(("round_robin", "least_loaded"), key=lambda p: pooled[p])
    assert group["pooled_best"] == best
    figures = summary["pooled"]["agentic-x4 ripplemesh"]
    assert {p: figures[p]["cost_per_success_usd"] for p in POLICIES} == pytest.approx(pooled)
    assert group["pooled_cost_vs_best"] == pytest.approx(pooled["ripplemesh"] / pooled[best] - 1)
    # Where the spend went: idle, and what a successful task took itself, against that baseline.
    assert (group["idle_share"], group["best_idle_share"]) == pytest.approx((idle["ripplemesh"], idle[best]))
    assert 0 < group["idle_share"] < 1
    assert group["task_spend_vs_best"] == pytest.approx(task_spend["ripplemesh"] / task_spend[best] - 1)
    assert group["nothing_wasted_vs_best"] == pytest.approx(task_spend["ripplemesh"] / pooled[best] - 1)
    assert group["nothing_wasted_vs_best"] < group["pooled_cost_vs_best"]
    _, spend_row, told_row = [
        line for line in markdown_path.read_text().splitlines() if line.startswith("| agentic-x4")
    ]
    assert f"{group['nothing_wasted_vs_best']:+.2%}" in spend_row
    rows = [line for line in markdown_path.read_text().splitlines() if line.startswith("| agentic-s")]
    assert len(rows) == 2
    for row, margin in zip(rows, again.margins, strict=True):
        # A baseline cheaper than ripplemesh shows in bold.
        assert ("| **+" in row) == (margin.cost_vs_best >= 0)
    # What the two points can tell: the per-point margins against the pooled cheapest baseline,
    # their geometric mean and a t interval on two points (12.71 standard errors each side).
    margins = [
        _cost(cell_path(tmp_path, point, "ripplemesh", "ripplemesh"))
        / _cost(cell_path(tmp_path, point, "ripplemesh", best))
        for point in POINTS
    ]
    interval = group["cost_interval"]
    assert interval["points"] == 2
    assert interval["mean"] == pytest.approx(math.sqrt(margins[0] * margins[1]) - 1)
    assert interval["low"] < min(margins) - 1 <= max(margins) - 1 < interval["high"]
    assert COST_VERDICTS[-1 if interval["high"] < 0 else 1 if interval["low"] > 0 else 0] in told_row


def test_an_interval_tells_a_difference_only_when_the_points_agree_beyond_their_spread() -> None:
    # Mooncake x4's three windows as measured at 95e776f: +0.01%, +0.49%, +0.06% dearer. All
    # three are dearer, but three points this spread do not tell a 0.2% difference from none.
    light = cost_interval([1.0001, 1.0049, 1.0006], [1.0, 1.0, 1.0])
    assert light.points == 3 and light.sign() == 0
    assert light.mean == pytest.approx((1.0001 * 1.0049 * 1.0006) ** (1 / 3) - 1)
    # Fifteen seeds 20-34% cheaper: cheaper, and the interval says how much with what spread.
    seeds = [0.80, 0.76, 0.72, 0.74, 0.69, 0.78, 0.73, 0.75, 0.71, 0.77, 0.66, 0.74, 0.70, 0.79, 0.76]
    heavy = cost_interval(seeds, [1.0] * 15)
    assert heavy.sign() == -1 and heavy.low < -0.25 < heavy.high < -0.2
    # Student's t, not the normal: with three points the half-width is 4.30 standard errors.
    three = mean_interval([1.0, 2.0, 3.0])
    assert (three.low, three.mean, three.high) == pytest.approx((2 - 2.4841, 2.0, 2 + 2.4841), abs=1e-4)
    # One point says nothing of the spread; a run with no success has no finite margin.
    assert mean_interval([0.5]).sign() == 0 and math.isinf(mean_interval([0.5]).high)
    assert cost_interval([0.0, 1.0], [1.0, 1.0]).sign() == 0


def test_the_system_comparison_takes_the_cheapest_baseline_under_any_admission(tmp_path: Path) -> None:
    policies = ("ripplemesh", "round_robin", "least_loaded")
    admissions = ("ripplemesh", "rate_limit")
    sweep = run_sweep(POINTS[:1], tmp_path, policies=policies, admissions=admissions, jobs=2)
    costs = {(p, a): _cost(cell_path(tmp_path, POINTS[0], a, p)) for p in policies for a in admissions}
    cheapest = min((c, f"{p} ({a})") for (p, a), c in costs.items() if p != "ripplemesh")
    groups = {g.admission: g for g in summarise(sweep)}
    for admission in admissions:
        group = groups[admission]
        assert group.any_admission_best == cheapest[1]
        assert group.any_admission_cost_vs_best == pytest.approx(
            costs[("ripplemesh", admission)] / cheapest[0] - 1
        )
        # Never kinder than the comparison under the same admission: it is among the choices.
        assert group.any_admission_cost_vs_best >= group.pooled_cost_vs_best - 1e-12


def test_the_router_sweep_is_the_issue_comparison(tmp_path: Path) -> None:
    points = router_points(tmp_path / "trace.jsonl")
    assert len(points) == 32  # x 2 admissions: the 64 runs per policy of docs/router.md
    groups = {p.group for p in points}
    assert groups == {f"mooncake-x{x}" for x in (4, 12, 24, 40)} | {f"agentic-x{x}" for x in (1, 5, 10, 20)}
    assert len({p.name for p in points}) == 32
    # Held-out seeds: the same rates and groups, read against the same targets.
    held_out = router_points(tmp_path / "trace.jsonl", parse_seeds("5-9"))
    assert {p.name for p in held_out if p.group == "agentic-x20"} == {
        f"agentic-s{s}-x20" for s in range(5, 10)
    }
    assert {p.group for p in held_out} == groups
    assert parse_seeds("0,3, 7-8,3") == (0, 3, 7, 8)
    for bad in ("9-5", "x", "-1", ""):
        with pytest.raises(ValueError, match=r"expected e\.g\. 5-9"):
            parse_seeds(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "no-such-point"], "no point matches"),
        (["--only", "agentic-s0-x1$", "--policy", "round_robin", "--policy", "least_loaded"], "must include"),
        (["--only", "agentic-s0-x1$", "--admission", "bogus"], "unknown admission"),
        (["--only", "mooncake-w0-x4$", "--trace", "missing.jsonl"], "is not there"),
        (["--only", "agentic-s0-x1$", "--router-config", "no_such_knob=1"], "unknown router config"),
        (["--only", "agentic-s0-x1$", "--router-config", "dearest_gate=high"], "expected a number"),
        (["--only", "agentic-s0-x1$", "--seeds", "9-5"], "expected e.g. 5-9"),
        (["--suite", "families", "--only", "agentic-s0-x1$"], "no point matches"),
        (["--suite", "families", "--only", "mooncake-w0-5x$", "--traces", "missing"], "is not there"),
        (
            ["--only", "agentic-s0-x1$", "--router-config", "latency_worth_usd_per_s=1"],
            "unknown router config",
        ),
    ],
)
def test_a_sweep_with_bad_options_says_what_is_wrong_and_runs_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ripplemesh", "sweep", "--out", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_run_that_fails_stops_the_sweep_with_its_error_and_leaves_no_cell(tmp_path: Path) -> None:
    bad = SweepPoint("bad", "bad", "agentic:workflows=10,no_such_option=1", "1xH100", 1.0)
    with pytest.raises(ValueError, match="no_such_option"):
        run_sweep([bad], tmp_path, policies=("ripplemesh", "round_robin"), admissions=("ripplemesh",), jobs=1)
    assert not list(tmp_path.rglob("*.json"))


def test_a_router_variant_remakes_only_ripplemesh_runs_made_with_another_config(tmp_path: Path) -> None:
    point = POINTS[:1]
    policies = ("ripplemesh", "round_robin")
    first = run_sweep(point, tmp_path, policies=policies, admissions=("ripplemesh",), jobs=1)
    ours = cell_path(tmp_path, POINTS[0], "ripplemesh", "ripplemesh")
    theirs = cell_path(tmp_path, POINTS[0], "ripplemesh", "round_robin")
    stamp = theirs.stat().st_mtime_ns
    assert json.loads(ours.read_bytes())["router_config"] == {}

    # A variant that never places: ripplemesh's run is made again, the baseline's is read.
    variant = RouterConfig(min_success_probability=1.5)
    second = run_sweep(
        point, tmp_path, policies=policies, admissions=("ripplemesh",), jobs=1, router_config=variant
    )
    assert (second.ran, second.read) == (1, 1)
    assert theirs.stat().st_mtime_ns == stamp
    made = json.loads(ours.read_bytes())
    assert made["router_config"] == {"min_success_probability": 1.5}
    assert made["tasks_succeeded"] == 0 and made["rejections"].get("router:infeasible", 0) > 0
    assert second.margins[0].cost_vs_best != first.margins[0].cost_vs_best

    # The same variant again: nothing to make.
    third = run_sweep(
        point, tmp_path, policies=policies, admissions=("ripplemesh",), jobs=1, router_config=variant
    )
    assert (third.ran, third.read) == (0, 2)


TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
GENERATORS = ("agentic", "coding", "rag-chat")


def test_capacity_is_where_the_offered_work_meets_the_fleets_roofline() -> None:
    # Ten requests a second apart, each 4,096 prompt tokens (256 blocks of 16) and 200 out; the
    # last five repeat the first five's prompts, which are whole blocks: cached, all of them.
    prompts = [random_prompt_hashes("llama-3.1-8b", 16, 256, i % 5) for i in range(10)]
    steps = [(float(i), Step(4096, 200, prompts[i])) for i in range(10)]
    work = offered_work([ListWorkload(steps)])
    assert (work.tasks, work.requests, work.span_s) == (10, 10, 9.0)
    assert (work.prompt_tokens, work.uncached_tokens, work.output_tokens) == (4096, 2048, 200)
    # Each replica serves the mix at the smaller of its prefill-bound and decode-bound rates, at
    # the autoscaler's own figures for the pool's sim engine; a fleet, the sum.
    fleet = parse_fleet("1xH100,1xH200")
    expected = 0.0
    for pool in fleet.pools:
        engine = pool.engine(model="llama-3.1-8b", block_size=16)
        profile = EngineProfile(
            engine.perf, engine.blocks.total_blocks * 16, engine.max_batch_tokens, engine.max_running
        )
        cap = replica_capacity(profile, uncached_prompt=2048, context=4196, slo=Slo())
        expected += min(cap.prefill_tokens_per_s / 2048, cap.decode_tokens_per_s / 200)
    assert fleet_request_rate(fleet, work) == pytest.approx(expected)
    at = capacity([ListWorkload(steps)], fleet)
    assert at.rate_scale == pytest.approx(expected / (10 / 9))
    # Twice the fleet serves twice; a 70B model on it, far less; an autoscaled fleet has no size.
    assert fleet_request_rate(parse_fleet("2xH100,2xH200"), work) == pytest.approx(2 * expected)
    assert (
        fleet_request_rate(parse_fleet("1xH100/llama-3.3-70b:fp8,1xH200/llama-3.3-70b:fp8"), work)
        < expected / 3
    )
    with pytest.raises(ValueError, match="fixed fleet"):
        fleet_request_rate(parse_fleet("1..4xH100"), work)
    # A pool of another model serves none of it.
    h100 = fleet_request_rate(parse_fleet("1xH100"), work)
    assert fleet_request_rate(parse_fleet("1xH100,1xH200/qwen-7b=llama-3.1-8b"), work) == pytest.approx(h100)
    # The router suite's rates, read by the rule: its lightest agentic rate is well under
    # capacity, its heaviest well over.
    agentic = next(p for p in router_points(Path("unused.jsonl"), (0,)) if p.name == "agentic-s0-x1")
    scale = capacity([load_workload(agentic.workload)], parse_fleet(agentic.fleet)).rate_scale
    assert 1 / scale < 0.25 and 20 / scale > 2


def test_the_families_generator_points_are_each_family_at_four_loads_of_its_capacity() -> None:
    points = family_points(Path("unused"), (10, 11), lambda name: name.startswith(GENERATORS))
    assert len(points) == 3 * 2 * 4
    assert {p.group for p in points} == {f"{f}-{load}" for f in GENERATORS for load, _ in LOADS}
    assert [p.name for p in points if p.group == "coding-2x"] == ["coding-s10-2x", "coding-s11-2x"]
    # No name is the router suite's, so the two never read each other's runs.
    assert not {p.name for p in points} & {p.name for p in router_points(Path("unused.jsonl"), range(15))}
    by_name = {p.name: p for p in points}
    minimum = {f.name: f.min_tasks for f in FAMILIES}
    for family in GENERATORS:
        for seed in (10, 11):
            run = [by_name[f"{family}-s{seed}-{load}"] for load, _ in LOADS]
            # One capacity per run, a rate scale to three figures: the loads are its multiples.
            one = run[1].rate_scale
            assert one == float(f"{one:.3g}")
            assert [p.rate_scale for p in run] == pytest.approx([k * one for _, k in LOADS], rel=1e-9)
            assert all(p.fleet == FAMILY_FLEET for p in run)
            assert all(p.workload.startswith(f"{family}:seed={seed},") for p in run)
        for point in (by_name[f"{family}-s10-{load}"] for load, _ in LOADS):
            # Five minutes of arrivals at the point's rate at least, and the family's minimum.
            workload = load_workload(point.workload, rate_scale=point.rate_scale)
            arrivals = [task.arrival_s for task in workload.tasks()]
            assert len(arrivals) >= minimum[family]
            assert arrivals[-1] >= ARRIVALS_S * 0.8
        # At 5x the minutes set the size, not the minimum: five of them, about.
        assert arrivals[-1] <= ARRIVALS_S * 1.2
    # Per second at capacity: coding's workflows are the heaviest, rag-chat's chats the lightest.
    at_capacity = {
        f.name: family_runs(f, Path("unused"), (10,))[0].capacity().tasks_per_s
        for f in FAMILIES
        if f.name in GENERATORS
    }
    assert at_capacity["coding"] < 1 < at_capacity["agentic"] < at_capacity["rag-chat"]


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"no shared traces at {TRACES}")
def test_the_families_suite_holds_every_family_and_trace_window_at_every_load() -> None:
    points = family_points(TRACES)
    families = [f.name for f in FAMILIES]
    assert families == ["agentic", "coding", "rag-chat", "mooncake", "azure-conv", "azure-code"]
    assert len(points) == len(families) * 3 * len(LOADS)  # three seeds or windows each
    groups: dict[str, list[SweepPoint]] = {}
    for point in points:
        groups.setdefault(point.group, []).append(point)
    assert list(groups) == [f"{f}-{load}" for f in families for load, _ in LOADS]
    assert all(len(group) == 3 for group in groups.values())
    # The traces: every window whole at every load, with the router suite's deadline; Mooncake's
    # are the router suite's windows; the Azure traces run on the older pair.
    mooncake = groups["mooncake-5x"]
    assert [(p.window, p.limit) for p in mooncake] == list(MOONCAKE_WINDOWS)
    assert all(p.deadline_s == 30.0 and p.fleet == FAMILY_FLEET for p in mooncake)
    assert {p.fleet for p in groups["azure-code-1x"] + groups["azure-conv-light"]} == {AZURE_FLEET}
    # At capacity every trace runs faster than recorded: the hour's rate is light for its fleet.
    for family in ("mooncake", "azure-conv", "azure-code"):
        for at, over in zip(groups[f"{family}-1x"], groups[f"{family}-5x"], strict=True):
            assert 1 < at.rate_scale < 10
            assert over.rate_scale == pytest.approx(5 * at.rate_scale, rel=1e-9)


def test_a_families_sweep_runs_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ripplemesh",
            "sweep",
            "--suite",
            "families",
            "--only",
            "^coding-s10-5x$",
            "--policy",
            "ripplemesh",
            "--policy",
            "round_robin",
            "--admission",
            "ripplemesh",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (point,) = family_points(Path("unused"), (10,), lambda name: name == "coding-s10-5x")
    for policy in ("ripplemesh", "round_robin"):
        cell = json.loads(cell_path(out, point, "ripplemesh", policy).read_bytes())
        assert cell["workload"]["rate_scale"] == point.rate_scale
        assert cell["workload"]["name"] == "coding" and cell["workload"]["seed"] == 10
    (group,) = json.loads((out / "summary.json").read_bytes())["groups"]
    assert (group["group"], group["points"]) == ("coding-5x", 1)
