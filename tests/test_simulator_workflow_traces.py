"""Workflow traces (services/simulator/recorded.py) and the generator's two more families: the
format read back as written, closed-loop replay against open-loop replay, a failed or rejected
step ending its workflow, bad lines named or counted, plain Mooncake files read as before, and
the coding and rag-chat families run through `ripplemesh simulate` with their defining shapes."""

from __future__ import annotations

import gc
import io
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from rich.console import Console

from ripplemesh.commands.simulate import simulate as simulate_command
from services.mesh.block_hash import chain_block_hashes
from services.simulator import FleetSpec, MooncakeTrace, PoolSpec, SimOptions, run_simulation
from services.simulator.command import simulate
from services.simulator.core import RequestRecord
from services.simulator.metrics import SimResult
from services.simulator.recorded import WorkflowTrace
from services.simulator.workload import (
    CodingAgentWorkload,
    RagChatWorkload,
    SingleRequest,
    load_workload,
)

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"no shared traces at {TRACES}")

MODEL = "llama-3.1-8b"
SPEC = FleetSpec(pools=[PoolSpec(replicas=1)], gpu_prices_per_hour={"H100": 3.0, "H200": 3.8})


def line(timestamp_ms: float, prompt: int, output: int, ids: list[int], **fields: Any) -> dict[str, Any]:
    return {
        "timestamp": timestamp_ms,
        "input_length": prompt,
        "output_length": output,
        "hash_ids": ids,
        **fields,
    }


def write(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((text if isinstance(text, str) else json.dumps(text)) + "\n" for text in lines))
    return path


def run(workload: Any, **kwargs: Any) -> tuple[SimResult, dict[str, RequestRecord]]:
    log: list[RequestRecord] = []
    kwargs.setdefault("admission", "none")
    result = run_simulation(workload, SPEC, "round_robin", request_log=log.append, **kwargs)
    return result, {record.request_id: record for record in log}


def mooncake_hashes(ids: list[int], prompt: int) -> list[int]:
    """What the Mooncake loader makes of a line's hash ids (full 512-token blocks, chained)."""
    return chain_block_hashes(ids[: prompt // 512], 1, model=MODEL)


# ------------------------------------------------------------------ the format


def test_a_workflow_trace_reads_back_as_written(tmp_path: Path) -> None:
    review = {"tenant": "acme", "priority": "critical", "workflow_id": "review-7", "steps": 3}
    batch = {"tenant": "nightly", "priority": "sheddable", "workflow_id": "batch-1"}
    path = write(
        tmp_path / "recorded.jsonl",
        [
            line(0, 1100, 50, [1, 2, 3], **review, step=1, deadline_ms=1500, e2e_deadline_ms=20_000),
            line(200, 600, 30, [40, 41], **batch, step=1, completed_ms=2_200),
            line(1_000, 700, 10, [90, 91]),  # a single request: Mooncake's fields only
            line(4_000, 1300, 60, [1, 2, 4], **review, step=2, completed_ms=5_000),
            line(6_500, 1500, 20, [1, 2, 4, 5], **review, step=3),
            line(9_200, 900, 30, [40, 41], **batch, step=2),
        ],
    )
    trace = load_workload(str(path))
    assert isinstance(trace, WorkflowTrace) and trace.replay == "closed"  # picked by its fields
    assert {name: t.priority for name, t in trace.tenants.items()} == {
        "trace": "standard",  # the single request's, as a Mooncake trace's
        "acme": "critical",
        "nightly": "sheddable",
    }
    tasks = list(trace.tasks())
    assert [(t.task_id, t.tenant, t.priority, t.steps, t.workflow) for t in tasks] == [
        ("review-7", "acme", "critical", 3, True),
        ("batch-1", "nightly", "sheddable", 2, True),
        ("mc2", "trace", "standard", 1, False),
    ]
    assert [t.arrival_s for t in tasks] == [0.0, 0.2, 1.0]
    review_steps = [tasks[0].step(i) for i in (1, 2, 3)]
    assert [s.prompt_tokens for s in review_steps] == [1100, 1300, 1500]
    assert [s.output_tokens for s in review_steps] == [50, 60, 20]
    assert [s.block_hashes for s in review_steps] == [
        mooncake_hashes([1, 2, 3], 1100),
        mooncake_hashes([1, 2, 4], 1300),
        mooncake_hashes([1, 2, 4, 5], 1500),
    ]
    assert review_steps[0].block_hashes[:2] == review_steps[1].block_hashes[:2]  # a shared prefix
    assert (review_steps[0].first_token_deadline_s, review_steps[0].deadline_s) == (1.5, 20.0)
    assert (review_steps[1].first_token_deadline_s, review_steps[1].deadline_s) == (None, None)
    # Think time: from step 1's arrival (no completed_ms), then from step 2's recorded completion.
    assert [s.think_s for s in review_steps] == [0.0, 4.0, 1.5]
    batch_steps = [tasks[1].step(i) for i in (1, 2)]
    assert [s.think_s for s in batch_steps] == [0.0, 7.0]  # 9.2 s less its completion at 2.2 s
    assert tasks[2].step(1).block_hashes == mooncake_hashes([90, 91], 700)
    assert trace.count_hint() == 3

    opened = load_workload(f"{path}:replay=open")
    assert isinstance(opened, WorkflowTrace) and opened.replay == "open" and opened.count_hint() == 6
    lines = list(opened.tasks())
    assert [t.task_id for t in lines] == [
        "review-7-1",
        "batch-1-1",
        "mc2",
        "review-7-2",
        "review-7-3",
        "batch-1-2",
    ]
    assert all(isinstance(t, SingleRequest) for t in lines)
    assert [t.arrival_s for t in lines] == [0.0, 0.2, 1.0, 4.0, 6.5, 9.2]
    assert [t.tenant for t in lines] == ["acme", "nightly", "trace", "acme", "acme", "nightly"]
    assert lines[3].step(1).think_s == 0.0  # open: no waits, every line at its timestamp

    twice = list(WorkflowTrace(path, repeat=2).tasks())
    assert [t.task_id for t in twice][3:] == ["review-7.r1", "batch-1.r1", "mc5"]
    assert twice[3].arrival_s > 9.2
    assert twice[3].step(1).block_hashes[0] != twice[0].step(1).block_hashes[0]  # its own prefixes
    described = trace.describe()
    assert (described["replay"], described["lines"], described["workflows"], described["skipped_lines"]) == (
        "closed",
        6,
        2,
        0,
    )


# ------------------------------------------------------------------ closed and open loop


@pytest.mark.parametrize("completed_ms", [95_000, None], ids=["completion-recorded", "arrival-gap"])
def test_closed_loop_issues_a_step_after_the_previous_completes_here_not_at_its_timestamp(
    tmp_path: Path, completed_ms: int | None
) -> None:
    """Step 2 was recorded 100 s after step 1 arrived (95 s after it completed, when recorded):
    closed loop it is issued at step 1's completion in the simulation plus the think time, open
    loop at 100 s."""
    done = {"completed_ms": completed_ms} if completed_ms is not None else {}
    path = write(
        tmp_path / "slow.jsonl",
        [
            line(0, 1200, 40, [1, 2, 3], workflow_id="w", step=1, **done),
            line(100_000, 1400, 40, [1, 2, 4], workflow_id="w", step=2),
        ],
    )
    think_s = 5.0 if completed_ms is not None else 100.0
    result, log = run(WorkflowTrace(path))
    first, second = log["w-1"], log["w-2"]
    assert first.finished_at < 5.0  # step 1 completes in well under the recorded 95 s
    assert second.arrival == pytest.approx(first.finished_at + think_s)
    assert second.arrival != pytest.approx(100.0)
    assert (result.tasks, result.tasks_succeeded, result.requests_completed) == (1, 1, 2)

    opened, open_log = run(WorkflowTrace(path, replay="open"))
    assert open_log["w-2"].arrival == pytest.approx(100.0)
    assert opened.tasks == 2  # open loop: every line its own task


@pytest.mark.parametrize(
    ("fields", "admission", "outcome"),
    [
        ({"e2e_deadline_ms": 1}, "ripplemesh", ("rejections", "admission:deadline")),
        ({"deadline_ms": 1}, "none", ("failures", "client:first_token_deadline")),
    ],
    ids=["rejected", "failed"],
)
def test_a_rejected_or_failed_step_ends_its_recorded_workflow(
    tmp_path: Path, fields: dict[str, Any], admission: str, outcome: tuple[str, str]
) -> None:
    lines: list[dict[str, Any] | str] = []
    for w in range(3):
        for step in (1, 2, 3):
            extra = fields if step == 1 else {}
            ids = [10 * w + k for k in range(step + 2)]
            lines.append(line(w * 10 + step, 1200, 30, ids, workflow_id=f"w{w}", step=step, **extra))
    lines.sort(key=lambda entry: entry["timestamp"] if isinstance(entry, dict) else 0)
    result, log = run(WorkflowTrace(write(tmp_path / "doomed.jsonl", lines)), admission=admission)
    field, key = outcome
    assert getattr(result, field) == {key: 3}
    assert result.requests == 3 and sorted(log) == ["w0-1", "w1-1", "w2-1"]  # no later step issued
    assert result.tasks_failed == {"step_failed": 3} and result.tasks_succeeded == 0
    gc.collect()
    from services.simulator import recorded

    assert not [o for o in gc.get_objects() if type(o) is recorded._RecordedWorkflow]


def test_a_late_first_token_is_a_missed_deadline_when_clients_wait(tmp_path: Path) -> None:
    path = write(
        tmp_path / "late.jsonl", [line(0, 4000, 20, list(range(8)), workflow_id="w", step=1, deadline_ms=1)]
    )
    result, _ = run(WorkflowTrace(path), options=SimOptions(abandon_past_deadline=False))
    assert result.tasks_failed == {"deadline_missed": 1} and not result.failures


# ------------------------------------------------------------------ bad lines

GOOD = [
    line(5, 1200, 40, [1, 2, 3], workflow_id="w", step=1, steps=3),
    line(10, 700, 40, [7, 8]),
]
BAD = {
    "not-json": ("{not json", "malformed"),
    "missing-field": ({"timestamp": 20, "input_length": 10, "output_length": 3}, "hash_ids"),
    "mistyped-field": (line(20, "long", 3, [1]), "input_length"),
    "unknown-priority": (line(20, 100, 3, [1], priority="urgent"), "priority"),
    "step-out-of-order": (
        line(20, 1300, 40, [1, 2, 4], workflow_id="w", step=3, steps=3),
        "after its step 1",
    ),
    "steps-disagree": (line(20, 1300, 40, [1, 2, 4], workflow_id="w", step=2, steps=4), "3 at line 1"),
    "step-before-step-1": (line(20, 100, 3, [1], workflow_id="other", step=2), "before its step 1"),
    "tenant-changes": (line(20, 1300, 40, [1, 2, 4], workflow_id="w", step=2, tenant="x"), "tenant"),
    "step-arrives-first": (
        line(0, 1300, 40, [1, 2, 4], workflow_id="w", step=2),
        "arrives before its step 1",
    ),
    "step-without-workflow": (line(20, 100, 3, [1], step=1), "without workflow_id"),
    "too-few-hash-ids": (line(20, 2048, 3, [1, 2]), "hash_ids"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_line_is_an_error_naming_the_file_and_the_line(tmp_path: Path, kind: str) -> None:
    bad, words = BAD[kind]
    path = write(tmp_path / "bad.jsonl", [*GOOD, bad])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: ") as error:
        WorkflowTrace(path)
    assert words in str(error.value)


def test_a_workflow_recorded_short_of_its_steps_stops_where_the_recording_did(tmp_path: Path) -> None:
    """Its step 2 failed in the recording (or the recording ended): no step 3 to replay, so the
    agent stops after step 2 and the ledger rules the workflow abandoned."""
    path = write(
        tmp_path / "cut.jsonl",
        [
            line(0, 1200, 40, [1, 2, 3], workflow_id="w", step=1, steps=3, completed_ms=800),
            line(2_000, 1300, 40, [1, 2, 4], workflow_id="w", step=2, steps=3),
        ],
    )
    trace = WorkflowTrace(path)
    assert trace.describe()["workflows_cut_short"] == 1
    (task,) = trace.tasks()
    assert task.steps == 3 and [task.step(1).fails, task.step(2).fails] == [False, True]
    result, log = run(WorkflowTrace(path))
    assert sorted(log) == ["w-1", "w-2"] and result.requests_completed == 2
    assert result.tasks_failed == {"abandoned": 1}


def test_skip_bad_counts_and_skips_bad_lines_and_the_results_report_them(tmp_path: Path) -> None:
    good = [
        line(5, 1200, 40, [1, 2, 3], workflow_id="w", step=1, steps=2),
        line(10, 700, 40, [7, 8]),
        line(5_000, 1300, 40, [1, 2, 4], workflow_id="w", step=2, steps=2),
    ]
    path = write(tmp_path / "mixed.jsonl", [good[0], *(bad for bad, _ in BAD.values()), *good[1:]])
    trace = load_workload(f"{path}:skip_bad=true")
    assert isinstance(trace, WorkflowTrace) and trace.skipped_lines == len(BAD)
    assert [(t.task_id, t.steps) for t in trace.tasks()] == [("w", 2), ("mc1", 1)]
    assert load_workload(str(path), skip_bad=True).describe()["skipped_lines"] == len(BAD)
    # A retried step (its step 2 again) is skipped, and the steps after it follow on.
    retried = write(
        tmp_path / "retried.jsonl",
        [good[0], good[2], line(6_000, 1300, 40, [1, 2, 4], workflow_id="w", step=2, steps=2)],
    )
    assert WorkflowTrace(retried, skip_bad=True).skipped_lines == 1

    runner = CliRunner()
    common = ["--workload", str(path), "--fleet", "1xH100", "--policy", "round_robin", "--no-plots"]
    strict = runner.invoke(simulate_command, common)
    assert strict.exit_code == 2 and "mixed.jsonl:2:" in strict.output
    out = tmp_path / "out"
    skipped = runner.invoke(simulate_command, [*common, "--skip-bad", "--out", str(out)])
    assert skipped.exit_code == 0, skipped.output
    result = json.loads((out / "round_robin.json").read_bytes())
    assert result["workload"]["skipped_lines"] == len(BAD) and result["workload"]["first_skipped"].startswith(
        "line 2: "
    )
    assert (result["tasks"], result["requests"]) == (2, 3)


# ------------------------------------------------------------------ plain Mooncake files


@needs_traces
def test_a_plain_mooncake_file_loads_exactly_as_before(tmp_path: Path) -> None:
    with (TRACES / "conversation_trace.jsonl").open() as source:
        head = list(itertools.islice(source, 300))
    path = tmp_path / "conversation_head.jsonl"
    path.write_text("".join(head))
    loaded = load_workload(str(path), rate_scale=30.0, deadline_s=20.0)
    assert type(loaded) is MooncakeTrace  # no workflow field: the Mooncake loader, unchanged
    reference = MooncakeTrace(
        TRACES / "conversation_trace.jsonl", limit=300, rate_scale=30.0, deadline_s=20.0
    )

    def tasks(workload: Any) -> list[tuple[str, str, str, float, Any]]:
        return [(t.task_id, t.tenant, t.priority, t.arrival_s, t.step(1)) for t in workload.tasks()]

    assert tasks(loaded) == tasks(reference)
    # Read as a workflow trace, its lines are the same single requests, and replay the same.
    as_workflow = load_workload(f"{path}:kind=workflow", rate_scale=30.0, deadline_s=20.0)
    assert isinstance(as_workflow, WorkflowTrace)
    assert tasks(as_workflow) == tasks(reference)
    assert as_workflow.count_hint() == loaded.count_hint() == 300

    def comparable(workload: Any) -> dict[str, Any]:
        data = msgspec.to_builtins(run_simulation(workload, FleetSpec(pools=[PoolSpec(replicas=2)])))
        for key in ("wall_s", "workload"):
            data.pop(key)
        return data

    assert comparable(as_workflow) == comparable(loaded)
    with pytest.raises(ValueError, match="replay: only for kind=workflow"):
        load_workload(f"{path}:kind=mooncake,replay=open")


# ------------------------------------------------------------------ two more families


def quiet() -> Console:
    return Console(file=io.StringIO(), width=250)


def test_the_coding_family_shares_long_contexts_a_cache_aware_router_reuses(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["--workload", "coding:workflows=40", "--fleet", "4xH100", "--seed", "3", "--no-plots"]
    args += ["--policy", "round_robin", "--policy", "sglang_cache_aware", "--out", str(tmp_path)]
    ran = runner.invoke(simulate_command, args)
    assert ran.exit_code == 0, ran.output
    hits = {}
    for policy in ("round_robin", "sglang_cache_aware"):
        result = json.loads((tmp_path / f"{policy}.json").read_bytes())
        assert result["workload"]["name"] == "coding" and result["workload"]["seed"] == 3
        hits[policy] = result["prefix_cache"]["hit_rate"]
        assert result["prefix_cache"]["prompt_tokens"] / result["requests"] > 20_000  # long prompts
        assert result["prefix_cache"]["upper_bound_hit_rate"] > 0.85  # mostly shared
    assert hits["sglang_cache_aware"] > 0.8
    assert hits["sglang_cache_aware"] > hits["round_robin"] + 0.1
    workload = CodingAgentWorkload(workflows=60, seed=3)
    firsts: dict[str, set[int]] = {}
    for task in workload.tasks():
        assert task.steps >= 3
        step = task.step(1)
        # Past the system prompt, a tenant's workflows begin with one of its repositories.
        firsts.setdefault(task.tenant, set()).add(step.block_hashes[200])
    assert all(1 < len(contexts) <= 6 for contexts in firsts.values())


def test_the_rag_chat_family_is_bursty_and_mostly_one_turn() -> None:
    def gaps_cv(workload: Any) -> float:
        arrivals = [task.arrival_s for task in workload.tasks()]
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    workload = RagChatWorkload(workflows=2000)
    assert gaps_cv(workload) > 1.3
    assert 0.9 < gaps_cv(RagChatWorkload(workflows=2000, burst_factor=1.0)) < 1.1  # Poisson without bursts
    steps = [task.steps for task in workload.tasks()]
    assert steps.count(1) / len(steps) > 0.5 and max(steps) == 3
    results = simulate(
        workload="rag-chat:workflows=300",
        fleet="2xH100",
        policies=["round_robin"],
        out=None,
        plots=False,
        console=quiet(),
    )
    (result,) = results
    assert result.workload["name"] == "rag-chat" and result.tasks == 300
    assert result.tasks_succeeded > 0.9 * result.tasks
    # Arrivals per autoscaler interval: far more spread than a Poisson process's (var = mean).
    counts = [sample.arrivals for sample in result.fleet_timeline]
    assert statistics.pvariance(counts) / statistics.mean(counts) > 3.0


def test_generator_specs_take_the_families_and_step_weights() -> None:
    coding = load_workload("coding:workflows=5,seed=2")
    assert isinstance(coding, CodingAgentWorkload) and coding.workflows == 5 and coding.seed == 2
    weighted = load_workload("agentic:workflows=200,min_steps=1,max_steps=3,step_weights=1/0/1")
    assert {task.steps for task in weighted.tasks()} == {1, 3}
    with pytest.raises(ValueError, match="step_weights"):
        load_workload("rag-chat:step_weights=1/1")
    with pytest.raises(ValueError, match="unknown rag-chat option"):
        load_workload("rag-chat:bogus=1")
    with pytest.raises(ValueError, match="skip_bad is for trace files"):
        load_workload("coding", skip_bad=True)


# ------------------------------------------------------------------ the bench's recorded trace


def test_the_bench_writes_a_valid_workflow_trace_and_replays_it_closed_loop(tmp_path: Path) -> None:
    from ripplemesh.bench.simulator import WORKFLOW_TRACE, run_simulator_bench, write_workflow_trace

    workflows = write_workflow_trace(tmp_path / WORKFLOW_TRACE, 600, workflows_per_s=8.0)
    trace = WorkflowTrace(tmp_path / WORKFLOW_TRACE)  # strict: every line good
    assert trace.describe()["lines"] == 600 and trace.count_hint() == workflows
    assert trace.describe()["workflows_cut_short"] == 0
    (row,) = run_simulator_bench(console=quiet(), scenarios=("workflow",), requests=600, workers=8)
    assert row["requests"] == row["completed"] == 600 and row["tasks"] == workflows
