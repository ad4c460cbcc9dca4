"""The simulator measures the Batch API's class: a day of interactive traffic with a daily shape,
alone and with a batch job released by the mesh's own policy (services/batch/policy.py)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from ripplemesh.bench.batch import QUICK, DayConfig, run_day
from ripplemesh.cli import main
from services.batch import policy as batch_policy
from services.simulator import SimOptions, parse_fleet, run_simulation
from services.simulator.batch import BATCH_CLASS, INTERACTIVE_CLASS, BatchJob
from services.simulator.workload import RagChatWorkload

# The bound on the interactive class with the batch on: SLO attainment within 2% of the
# run without it. What makes it hold by design: a line is released only while every worker runs
# fewer than slots_per_worker x target_occupancy (6) sequences in all and nothing interactive is
# queued or held back, it is admitted last (sheddable, lowest level), and 6 llama-3.1-8b decodes
# on an H100 add milliseconds to a step, against a TPOT SLO of 100 ms and a TTFT SLO of 2 s.
SLO_BOUND = 0.02


def test_a_day_with_a_batch_keeps_the_interactive_slo_and_finishes_the_batch(tmp_path: Path) -> None:
    out = tmp_path / "batch"
    result = CliRunner().invoke(main, ["bench", "batch", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "interactive SLO (ratio)" in result.output and "fleet $/task (ratio)" in result.output
    run = msgspec.json.decode((out / "summary.json").read_bytes())["runs"][0]
    # Every line of the batch completed, inside its window (the quick day's: an hour).
    assert run["batch_completed"] == run["batch_lines"] == QUICK.lines
    assert run["batch_within_window"] is True
    assert run["batch_completed_in_s"] <= QUICK.day_s
    alone_slo, mixed_slo, _ = run["slo_attainment"]
    assert mixed_slo >= alone_slo - SLO_BOUND
    # The batch is the cheapest work, and the fleet's cost per successful task falls with it.
    assert run["batch_cost_per_successful_task_usd"] < run["interactive_cost_per_successful_task_usd"][1]
    fleet_alone, fleet_mixed, _ = run["fleet_cost_per_successful_task_usd"]
    assert fleet_mixed < fleet_alone
    idle_alone, idle_mixed, _ = run["idle_share"]
    assert idle_mixed < idle_alone


def test_the_classes_add_up_and_the_interactive_workload_is_the_same() -> None:
    config = DayConfig(rate=0.2, lines=60, day_s=900.0)
    day = run_day(config, 1)
    alone, mixed = day.alone, day.mixed
    assert alone.by_class[INTERACTIVE_CLASS]["requests"] == mixed.by_class[INTERACTIVE_CLASS]["requests"]
    # The exact p99 is over every interactive first token, and none of the batch's.
    assert len(day.ttft_alone_s) == len(day.ttft_mixed_s) == alone.by_class[INTERACTIVE_CLASS]["requests"]
    assert BATCH_CLASS not in alone.by_class and alone.batch is None
    assert mixed.requests == sum(c["requests"] for c in mixed.by_class.values())
    assert mixed.tasks_succeeded == sum(c["tasks_succeeded"] for c in mixed.by_class.values())
    assert math.isclose(
        mixed.attributed_spend_usd, sum(c["attributed_spend_usd"] for c in mixed.by_class.values())
    )
    assert mixed.batch is not None and mixed.batch["completed"] == 60
    assert mixed.batch["release_decisions"]["released"] >= 1


def test_lines_are_released_by_the_mesh_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """No twin: the simulator calls services.batch.policy.release at each tick; a policy that
    releases nothing leaves the batch to expire at the end of its window."""
    calls: list[batch_policy.RunnerState] = []

    def hold(
        workers: object, state: batch_policy.RunnerState, limits: object, now: float
    ) -> batch_policy.Release:
        calls.append(state)
        return batch_policy.Release(0, "no_spare_capacity")

    monkeypatch.setattr(batch_policy, "release", hold)
    workload = RagChatWorkload(workflows=20, rate_per_s=0.2, burst_s=0.0, burst_factor=1.0, seed=0)
    job = BatchJob(lines=10, window_s=60.0)
    result = run_simulation(workload, parse_fleet("1xH100"), options=SimOptions(batch=job))
    assert calls and all(s.pending == 10 and s.in_flight == 0 for s in calls)
    assert result.batch is not None
    assert result.batch["completed"] == 0 and result.batch["expired"] == 10
    assert result.batch["within_window"] is False


def test_the_daily_shape_follows_its_cosine() -> None:
    day, rate, amplitude = 2400.0, 5.0, 0.6
    workload = RagChatWorkload(
        workflows=round(rate * day),
        rate_per_s=rate,
        burst_s=0.0,
        burst_factor=1.0,
        daily_amplitude=amplitude,
        day_s=day,
        peak_s=day * 14 / 24,
        seed=3,
    )
    hour = day / 24
    counts = [0] * 24
    for task in workload.tasks():
        if task.arrival_s < day:
            counts[int(task.arrival_s // hour)] += 1
    for h in (2, 8, 14, 20):
        phase = 2 * math.pi * ((h + 0.5) * hour - 14 * hour) / day
        expected = rate * hour * (1 + amplitude * math.cos(phase))
        assert abs(counts[h] - expected) < 5 * math.sqrt(expected), (h, counts[h], expected)
    assert counts[14] > 3 * counts[2]
    assert workload.describe()["daily"] == {"amplitude": amplitude, "day_s": day, "peak_s": day * 14 / 24}
