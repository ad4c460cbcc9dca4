"""Several models on one simulated fleet: each request names its model, each pool serves one, the
router places a request only on its model's workers, a model with no worker holds and rejects
only its own requests, the autoscaler sizes each model's pools on that model's traffic, and the
result reports per model figures that add up to the totals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from ripplemesh.commands.simulate import simulate as simulate_command
from services.simulator import AgenticWorkload, FleetSpec, PoolSpec, SimOptions, parse_fleet, run_simulation
from services.simulator.core import RequestRecord
from services.simulator.metrics import SimResult
from services.simulator.policies import POLICY_NAMES
from services.simulator.recorded import WorkflowTrace
from services.simulator.workload import AgenticTenant, ListWorkload, Step, load_workload, random_prompt_hashes

BLOCK = 16
PRICES = {"H100": 3.0, "H200": 3.8}
ALPHA, BETA = "alpha", "beta"


def fleet(*pools: PoolSpec) -> FleetSpec:
    return FleetSpec(pools=list(pools), gpu_prices_per_hour=PRICES, kv_transfer_usd_per_gb=0.01)


def run(
    workload: Any, spec: FleetSpec, policy: str = "ripplemesh", **kwargs: Any
) -> tuple[SimResult, list[RequestRecord]]:
    log: list[RequestRecord] = []
    result = run_simulation(workload, spec, policy, request_log=log.append, **kwargs)
    return result, log


def two_models(**overrides: Any) -> AgenticWorkload:
    fields: dict[str, Any] = {
        "workflows": 80,
        "rate_per_s": 4.0,
        "min_steps": 2,
        "max_steps": 4,
        "task_tokens": 300.0,
        "tool_tokens": 200.0,
        "output_tokens": 50.0,
        "think_s": 1.0,
        "seed": 11,
        "model": ALPHA,
        "models": ((ALPHA, 2.0), (BETA, 1.0)),
    }
    fields.update(overrides)
    return AgenticWorkload(**fields)


# alpha aggregated on two H100s; beta disaggregated (a prefill and a decode H100: KV hand-offs).
TWO_POOLS = (
    PoolSpec(name="alpha", model=ALPHA, replicas=2),
    PoolSpec(name="beta-prefill", role="prefill", model=BETA, replicas=1),
    PoolSpec(name="beta-decode", model=BETA, replicas=1),
)
POOL_MODEL = {p.name: p.model for p in TWO_POOLS}


def pool_of(worker_id: str) -> str:
    return worker_id.rpartition("-")[0]


def check_adds_up(result: SimResult) -> None:
    models = result.by_model.values()
    for key, total in (
        ("requests", result.requests),
        ("completed", result.requests_completed),
        ("rejected", sum(result.rejections.values())),
        ("failed", sum(result.failures.values())),
        ("held", result.held_requests),
        ("tasks", result.tasks),
        ("tasks_succeeded", result.tasks_succeeded),
    ):
        assert sum(m[key] for m in models) == total, key
    for key, total in (
        ("total_spend_usd", result.total_spend_usd),
        ("attributed_spend_usd", result.attributed_spend_usd),
        ("kv_transfer_spend_usd", result.kv_transfer_spend_usd),
        ("provisioned_gpu_seconds", result.provisioned_gpu_seconds),
    ):
        assert sum(m[key] for m in models) == pytest.approx(total, rel=1e-9, abs=1e-12), key
    for m in models:
        assert m["completed"] + m["rejected"] + m["failed"] == m["requests"]
        assert m["cost_per_successful_task_usd"] == (
            m["total_spend_usd"] / m["tasks_succeeded"] if m["tasks_succeeded"] else None
        )


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_each_request_is_placed_on_its_models_workers_and_the_models_figures_add_up(policy: str) -> None:
    result, log = run(two_models(), fleet(*TWO_POOLS), policy)
    assert set(result.by_model) == {ALPHA, BETA}
    by_model = {model: [r for r in log if r.model == model] for model in (ALPHA, BETA)}
    assert len(by_model[ALPHA]) > len(by_model[BETA]) > 20  # the 2:1 mix
    for record in log:
        assert record.workers and {POOL_MODEL[pool_of(w)] for w in record.workers} == {record.model}
    # alpha's requests on one worker; beta's KV handed off between its prefill and decode workers
    # (the baselines disaggregate whenever a prefill worker is live; ripplemesh weighs it).
    assert all(len(set(r.workers)) == 1 for r in by_model[ALPHA])
    if policy != "ripplemesh":
        assert all(len(set(r.workers)) == 2 for r in by_model[BETA] if r.outcome == "completed")
        assert result.by_model[BETA]["kv_transfer_spend_usd"] > 0
    assert result.by_model[ALPHA]["kv_transfer_spend_usd"] == 0.0
    for model, records in by_model.items():
        figures = result.by_model[model]
        assert figures["requests"] == len(records)
        assert figures["completed"] == sum(r.outcome == "completed" for r in records) > 0
        assert figures["pools"] == [p.name for p in TWO_POOLS if p.model == model]
    check_adds_up(result)
    assert [p["model"] for p in result.fleet["pools"]] == [ALPHA, BETA, BETA]


def test_the_models_prompts_are_on_their_own_hash_chains() -> None:
    workload = two_models(workflows=40)
    first: dict[tuple[str, str | None], set[int]] = {}
    for task in workload.tasks():
        step = task.step(1)
        first.setdefault((task.tenant, step.model), set()).update(step.block_hashes[:4])
    # A tenant's system prompt is one chain per model: the same within a model, none shared.
    for tenant in {t for t, _ in first}:
        alpha, beta = first.get((tenant, ALPHA)), first.get((tenant, BETA))
        if alpha and beta:
            assert len(alpha) == len(beta) == 4 and not alpha & beta
    # The mix drawn last: without it, every draw (tenants, sizes, arrivals) is as before.
    single = [(t.arrival_s, t.tenant, t.steps) for t in two_models(models=()).tasks()]
    mixed = [(t.arrival_s, t.tenant, t.steps) for t in workload.tasks()]
    assert mixed == single[: len(mixed)]


def steps(model: str, n: int, start: float, gap: float, salt: int) -> list[tuple[float, Step]]:
    prompt = 48 * BLOCK
    return [
        (
            start + i * gap,
            Step(
                prompt_tokens=prompt,
                output_tokens=40,
                block_hashes=random_prompt_hashes(model, BLOCK, prompt // BLOCK, salt + i),
                deadline_s=60.0,
                model=model,
            ),
        )
        for i in range(n)
    ]


def test_a_model_without_workers_holds_and_rejects_only_its_own_requests() -> None:
    alpha = steps(ALPHA, 60, 0.0, 0.25, salt=0)
    beta = steps(BETA, 20, 0.1, 0.5, salt=10_000)
    only_alpha = fleet(PoolSpec(name="alpha", model=ALPHA, replicas=2))
    mixed, log = run(ListWorkload(alpha + beta, block_size=BLOCK, model=ALPHA), only_alpha)
    _, alone_log = run(ListWorkload(alpha, block_size=BLOCK, model=ALPHA), only_alpha)

    a, b = mixed.by_model[ALPHA], mixed.by_model[BETA]
    assert (a["requests"], a["completed"], a["held"], a["rejected"]) == (60, 60, 0, 0)
    assert (b["requests"], b["completed"], b["held"], b["rejected"]) == (20, 0, 20, 20)
    assert b["pools"] == [] and b["total_spend_usd"] == 0.0
    assert mixed.rejections == {"admission:no_capacity_in_time": 20}
    assert {r.outcome for r in log if r.model == BETA} == {"admission:no_capacity_in_time"}
    assert all(r.workers == () for r in log if r.model == BETA)
    check_adds_up(mixed)

    # alpha's requests fare exactly as without beta's: the same workers, times and GPU time.
    def served(records: list[RequestRecord]) -> list[tuple[Any, ...]]:
        return sorted(
            (r.arrival, r.first_token_at, r.finished_at, r.workers, r.gpu_seconds, r.cached_tokens)
            for r in records
            if r.model == ALPHA
        )

    assert served(log) == served(alone_log)


@pytest.mark.parametrize("autoscaler", ["ripple", "hpa-queue"])
def test_the_autoscaler_sizes_each_models_pools_on_that_models_traffic(autoscaler: str) -> None:
    # Every request names beta; the workload's default model (and the first pool's) is alpha.
    workload = ListWorkload(steps(BETA, 40, 0.0, 1.0, salt=0), block_size=BLOCK, model=ALPHA)
    pools = [
        PoolSpec(
            name=name, model=model, replicas=0, autoscale=True, min_replicas=0, max_replicas=2, startup_s=5.0
        )
        for name, model in (("alpha", ALPHA), ("beta", BETA))
    ]
    result, log = run(workload, fleet(*pools), options=SimOptions(autoscaler=autoscaler))
    desired = {
        name: max(d.desired for p in result.autoscale_plans for d in p.pools if d.pool == name)
        for name in ("alpha", "beta")
    }
    assert desired == {"alpha": 0, "beta": desired["beta"]} and desired["beta"] >= 1
    assert {pool_of(w) for r in log for w in r.workers} == {"beta"}
    beta = result.by_model[BETA]
    assert beta["held"] > 0 and beta["completed"] == beta["requests"] == 40
    assert result.by_model[ALPHA]["requests"] == 0 and result.by_model[ALPHA]["total_spend_usd"] == 0.0
    check_adds_up(result)


def test_one_models_fleet_reports_that_model_as_the_whole() -> None:
    result, _ = run(two_models(models=(), workflows=30), fleet(PoolSpec(replicas=2)))
    ((model, figures),) = result.by_model.items()
    assert model == ALPHA and figures["pools"] == ["decode-h100-0"]
    assert figures["cost_per_successful_task_usd"] == pytest.approx(result.cost_per_successful_task_usd)
    check_adds_up(result)


def test_a_fleet_string_names_each_pools_model() -> None:
    def models(spec: str) -> list[tuple[str | None, str]]:
        return [(p.model, p.shape) for p in parse_fleet(spec).pools]

    # One model's shapes (precision aside): the pools serve the workload's model, as before.
    assert models("4xH100/llama-3-8b,4xH200/llama-3-8b:fp8") == [
        (None, "llama-3-8b"),
        (None, "llama-3-8b:fp8"),
    ]
    assert models("16xH200/llama-3.1-8b:fp8") == [(None, "llama-3.1-8b:fp8")]
    # Shapes of two models: each pool serves the model it names.
    assert models("2xH100/llama-3.1-8b,2xH100/llama-3-70b:fp8@2") == [
        ("llama-3.1-8b", "llama-3.1-8b"),
        ("llama-3-70b", "llama-3-70b:fp8"),
    ]
    # MODEL=SHAPE: a model of another name; a pool naming nothing serves the workload's.
    assert models("prefill:1xH100/qwen-7b=llama-3-8b,decode:2xH100/qwen-7b=llama-3-8b,1xH100") == [
        ("qwen-7b", "llama-3-8b"),
        ("qwen-7b", "llama-3-8b"),
        (None, "llama-3.1-8b"),
    ]
    with pytest.raises(
        ValueError, match=re.escape("a model of another name takes a shape: qwen-7b=llama-3.1-8b")
    ):
        parse_fleet("2xH100/llama-3.1-8b,2xH100/qwen-7b")
    # A model's prefill pool needs a decode pool of that model.
    with pytest.raises(ValueError, match="prefills for qwen-7b, which has no decode pool"):
        run_simulation(two_models(workflows=1), parse_fleet("2xH100,prefill:1xH100/qwen-7b=llama-3.1-8b"))


def test_generator_options_name_a_mix_or_each_tenants_model() -> None:
    mix = load_workload("agentic:workflows=20,models=a:3/b:1/c")
    assert isinstance(mix, AgenticWorkload) and mix.models == (("a", 3.0), ("b", 1.0), ("c", 1.0))
    assert mix.describe()["models"] == [["a", 3.0], ["b", 1.0], ["c", 1.0]]
    assert {t.step(1).model for t in mix.tasks()} == {"a", "b", "c"}
    per_tenant = load_workload("agentic:workflows=30,tenant_models=batch:b")
    assert isinstance(per_tenant, AgenticWorkload)
    named = {(t.tenant, t.step(1).model) for t in per_tenant.tasks()}
    assert {m for tenant, m in named if tenant == "batch"} == {"b"}
    assert {m for tenant, m in named if tenant != "batch"} == {None}  # the workload's model
    tenant = AgenticTenant("only", model="z")
    assert {
        t.step(1).model
        for t in AgenticWorkload(workflows=5, tenants_spec=(tenant,), models=(("y", 1.0),)).tasks()
    } == {"z"}
    for bad in ("models=a:-1", "models=a/a", "tenant_models=nobody:b", "tenant_models=batch"):
        with pytest.raises(ValueError):
            load_workload(f"agentic:workflows=5,{bad}")


def write_trace(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def trace_line(at: float, model: str | None, **fields: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"timestamp": at, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 3]}
    if model is not None:
        line["model"] = model
    return {**line, **fields}


def test_a_workflow_traces_lines_name_their_model(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "models.jsonl",
        [
            trace_line(0, "a", workflow_id="w", step=1, steps=2),
            trace_line(100, "b"),
            trace_line(200, None),
            trace_line(3000, "a", workflow_id="w", step=2, steps=2),
        ],
    )
    trace = load_workload(str(path))
    assert isinstance(trace, WorkflowTrace) and trace.describe()["models"] == ["a", "b"]
    models = [(t.task_id, t.step(1).model) for t in trace.tasks()]
    assert models == [("w", "a"), ("mc1", "b"), ("mc2", None)]
    # The same hash ids on two models are two prefixes.
    first = [t.step(1).block_hashes for t in trace.tasks()]
    assert not set(first[0]) & set(first[1])
    changed = write_trace(
        tmp_path / "changed.jsonl",
        [trace_line(0, "a", workflow_id="w", step=1), trace_line(50, "b", workflow_id="w", step=2)],
    )
    with pytest.raises(
        ValueError, match=re.escape("changed.jsonl:2: workflow 'w' names model 'a' (line 1), not 'b'")
    ):
        WorkflowTrace(changed)


def test_simulate_takes_a_fleet_per_model(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "generator"
    ran = runner.invoke(
        simulate_command,
        [
            "--workload",
            "agentic:workflows=40,rate_per_s=2,seed=3,models=llama-3.1-8b:2/qwen-7b:1",
            "--fleet",
            "2xH100/llama-3.1-8b,1xH100/qwen-7b=llama-3.1-8b",
            "--policy",
            "ripplemesh",
            "--no-plots",
            "--out",
            str(out),
        ],
    )
    assert ran.exit_code == 0, ran.output
    assert "by model" in ran.output and "qwen-7b" in ran.output
    result = json.loads((out / "ripplemesh.json").read_bytes())
    by_model = result["by_model"]
    assert set(by_model) == {"llama-3.1-8b", "qwen-7b"}
    assert by_model["qwen-7b"]["pools"] == ["decode-h100-1"] and by_model["qwen-7b"]["requests"] > 0
    assert sum(m["requests"] for m in by_model.values()) == result["requests"]
    assert sum(m["tasks_succeeded"] for m in by_model.values()) == result["tasks_succeeded"] > 0
    check_adds_up(msgspec.convert(result, SimResult))

    # A workflow trace's lines name their models; a model the fleet lacks is held, then rejected.
    trace = write_trace(
        tmp_path / "trace.jsonl",
        [trace_line(i * 500, "a" if i % 3 else "b", deadline_ms=30_000) for i in range(12)],
    )
    out = tmp_path / "trace"
    args = ["--workload", str(trace), "--fleet", "1xH100/a=llama-3.1-8b", "--policy", "round_robin"]
    ran = runner.invoke(simulate_command, [*args, "--no-plots", "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    by_model = json.loads((out / "round_robin.json").read_bytes())["by_model"]
    assert (by_model["a"]["requests"], by_model["a"]["completed"]) == (8, 8)
    assert (by_model["b"]["requests"], by_model["b"]["held"], by_model["b"]["rejected"]) == (4, 4, 4)
