"""The fleet simulator: faithful to the sim engine, deterministic, conserving requests and spend,
honest about prefix caching, driving the policy modules the services import, and reading the
real traces."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.events import InferenceRequest
from services.admission import policy as admission_policy
from services.admission.policy import Reject, TenantQuota
from services.autoscaler import policy as autoscaler_policy
from services.engines.base import VirtualClock
from services.engines.sim.engine import SimEngine
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import gpu, model_shape
from services.ledger import pricing
from services.ledger import tasks as ledger_tasks
from services.mesh.block_hash import chain_block_hashes
from services.router import baselines
from services.router import policy as router_policy
from services.router.policy import Placement, RouterConfig, RouteRequest
from services.simulator import (
    AgenticWorkload,
    AzureTrace,
    FleetSpec,
    MooncakeTrace,
    PoolSpec,
    SimOptions,
    parse_fleet,
    run_simulation,
)
from services.simulator import worker as worker_module
from services.simulator.core import RequestRecord, Simulator
from services.simulator.metrics import LatencySketch, SimResult
from services.simulator.policies import POLICY_NAMES, FleetPrefixView
from services.simulator.worker import StepCost
from services.simulator.workload import (
    AgenticTenant,
    ListWorkload,
    SingleRequest,
    Step,
    Tenant,
    load_workload,
    random_prompt_hashes,
)

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"no shared traces at {TRACES}")

MODEL = "sim-test"
BLOCK = 16
PRICES = {"H100": 3.0, "H200": 3.8}


KV_USD_PER_GB = 0.01


def fleet(*pools: PoolSpec, **fields: Any) -> FleetSpec:
    return FleetSpec(
        pools=list(pools), gpu_prices_per_hour=PRICES, kv_transfer_usd_per_gb=KV_USD_PER_GB, **fields
    )


def run(
    workload: Any, spec: FleetSpec, policy: str = "ripplemesh", **kwargs: Any
) -> tuple[SimResult, list[RequestRecord]]:
    log: list[RequestRecord] = []
    # The tenants' quotas only (no deferral), unless a test asks for admission's other controls.
    kwargs.setdefault("admission", "rate_limit")
    result = run_simulation(workload, spec, policy, request_log=log.append, **kwargs)
    return result, log


def comparable(result: SimResult) -> dict[str, Any]:
    data = msgspec.to_builtins(result)
    data.pop("wall_s")
    return data


def small_agentic(**overrides: Any) -> AgenticWorkload:
    fields: dict[str, Any] = {
        "workflows": 120,
        "rate_per_s": 4.0,
        "min_steps": 2,
        "max_steps": 5,
        "task_tokens": 300.0,
        "tool_tokens": 200.0,
        "output_tokens": 60.0,
        "think_s": 1.0,
        "seed": 7,
        "model": MODEL,
    }
    fields.update(overrides)
    return AgenticWorkload(**fields)


# ------------------------------------------------------------------ faithful to the sim engine


class _BatchLine(SingleRequest):
    """A request of the batch service class (a Batch API line's), outside a batch job."""

    __slots__ = ()
    service_class = "batch"


class _MixedList(ListWorkload):
    """ListWorkload whose requests are of the batch class where `batch` says so (by index)."""

    def __init__(self, requests: list[tuple[float, Step]], batch: list[bool], **kwargs: Any):
        super().__init__(requests, **kwargs)
        self.batch = batch

    def _builder(self, step: Step) -> Any:
        def build(arrival: float, index: int) -> SingleRequest:
            kind = _BatchLine if self.batch[index] else SingleRequest
            return kind(f"rq{index}", self._tenant.name, self._tenant.priority, arrival, step)

        return build


def _engine_reference(
    requests: list[tuple[float, list[int], int]],
    kv_capacity: int | None,
    batch: list[bool] | None = None,
) -> dict[str, tuple]:
    """Each request served by the real SimEngine on a VirtualClock: first token, finish, GPU-s
    (`batch`: which are of the batch service class)."""

    async def main() -> dict[str, tuple]:
        clock = VirtualClock()
        engine = SimEngine(
            model=MODEL,
            shape="llama-3.1-8b",
            clock=clock,
            max_context_tokens=131_072,
            kv_capacity_tokens=kv_capacity,
        )
        await engine.start()
        out: dict[str, tuple] = {}

        async def one(i: int, at: float, prompt: list[int], max_tokens: int) -> None:
            await clock.sleep(at)
            request = InferenceRequest(
                request_id=f"rq{i}",
                tenant="t",
                model=MODEL,
                api="nats",
                prompt_tokens=prompt,
                block_size=BLOCK,
                block_hashes=chain_block_hashes(prompt, BLOCK, model=MODEL),
                max_tokens=max_tokens,
                submitted_at=0.0,
                service_class="batch" if batch and batch[i] else "interactive",
            )
            result = await engine.prefill(request)
            first = clock.now()
            async for _ in engine.decode(request.request_id, result.first_token_id):
                pass
            out[request.request_id] = (
                first,
                clock.now(),
                sum(engine.gpu_seconds(request.request_id)),
                result.cached_tokens,
            )

        await asyncio.gather(*(one(i, at, p, m) for i, (at, p, m) in enumerate(requests)))
        out["preemptions"] = (engine.stats.preemptions,)
        await engine.stop()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("count", "rate", "kv_capacity", "batch_share"),
    [
        (60, 20.0, None, 0.0),
        (40, 2.0, None, 0.0),
        (120, 50.0, 20_000, 0.0),
        (80, 100.0, 8_000, 0.0),
        (100, 40.0, None, 0.5),
        (120, 50.0, 20_000, 0.6),
        (80, 100.0, 8_000, 0.5),
    ],
    ids=[
        "shared-prefixes",
        "low-load-long-decodes",
        "kv-pressure",
        "heavy-preemption",
        "mixed-classes",
        "mixed-classes-kv-pressure",
        "mixed-classes-heavy-preemption",
    ],
)
def test_workers_match_the_sim_engine_request_by_request(
    count: int, rate: float, kv_capacity: int | None, batch_share: float
) -> None:
    """The simulator's worker (event-driven, steps timed in chunks) against the async SimEngine on
    a VirtualClock: every request's first token, finish and GPU-seconds, preemptions included;
    with interactive and batch requests mixed, each class's order (interactive first) too."""
    rng = random.Random(count)
    shared = [rng.randrange(300, 600) for _ in range(200)]
    requests: list[tuple[float, list[int], int]] = []
    at = 0.0
    for i in range(count):
        at += rng.expovariate(rate)
        own = [rng.randrange(300, 600) for _ in range(rng.randint(20, 3000))]
        requests.append((at, shared + own if i % 2 else own, rng.randint(1, 300)))
    batch = [rng.random() < batch_share for _ in requests]
    reference = _engine_reference(requests, kv_capacity, batch)
    steps = [
        (
            at,
            Step(
                prompt_tokens=len(p), output_tokens=m, block_hashes=chain_block_hashes(p, BLOCK, model=MODEL)
            ),
        )
        for at, p, m in requests
    ]
    result, log = run(
        _MixedList(steps, batch, block_size=BLOCK, model=MODEL),
        fleet(PoolSpec(replicas=1, kv_capacity_tokens=kv_capacity)),
    )
    assert result.preemptions == reference.pop("preemptions")[0]
    if kv_capacity == 8_000:
        assert result.preemptions > 0
    by_id = {r.request_id: r for r in log}
    assert set(by_id) == set(reference)
    for rid, (first, done, gpu_s, cached) in reference.items():
        record = by_id[rid]
        assert record.outcome == "completed"
        assert record.first_token_at == pytest.approx(first, abs=1e-9)
        assert record.finished_at == pytest.approx(done, abs=1e-9)
        assert record.gpu_seconds == pytest.approx(gpu_s, abs=1e-9)
        assert record.cached_tokens == cached


def test_step_cost_is_perf_step_shares() -> None:
    """StepCost (decodes taken together) equals PerfModel.step_shares part by part."""
    rng = random.Random(3)
    for shape in ("llama-3.1-8b", "llama-3-70b:fp8"):
        perf = PerfModel(gpu("H100"), model_shape(shape), 2 if "70b" in shape else 1)
        cost = StepCost(perf)
        for _ in range(200):
            parts = [(rng.randint(1, 4000), rng.randint(0, 20_000)) for _ in range(rng.randint(0, 3))]
            contexts = [rng.randint(1, 30_000) for _ in range(rng.randint(0, 64))]
            if not parts and not contexts:
                continue
            expected = perf.step_shares(parts + [(1, c) for c in contexts])
            if parts:
                seconds, shares, d0, d1 = cost(parts, len(contexts), sum(contexts))
                assert shares == pytest.approx(expected[: len(parts)], rel=1e-12)
            else:
                seconds, d0, d1 = cost.decodes_only(len(contexts), sum(contexts))
            assert seconds == pytest.approx(sum(expected), rel=1e-12)
            for c, share in zip(contexts, expected[len(parts) :], strict=True):
                assert d0 + d1 * c == pytest.approx(share, rel=1e-9)


@pytest.mark.parametrize("scenario", ["plain", "stressful"])
def test_chunked_steps_change_nothing(monkeypatch: pytest.MonkeyPatch, scenario: str) -> None:
    """Timing steady-decode steps ahead in chunks gives the step-by-step result, bit for bit,
    with cancellations, preemption, KV hand-offs and rejections in the mix."""
    if scenario == "plain":
        workload, spec = small_agentic(workflows=60), fleet(PoolSpec(replicas=3, kv_capacity_tokens=60_000))
    else:
        workload, spec = _stressful()
    chunked, chunked_log = run(workload, spec, "dynamo_kv")
    monkeypatch.setattr(worker_module.SimWorker, "_chunk", lambda self, *a: None)
    stepwise, stepwise_log = run(workload, spec, "dynamo_kv")
    assert stepwise.events > chunked.events
    a, b = comparable(chunked), comparable(stepwise)
    a.pop("events"), b.pop("events")
    assert a == b
    assert chunked_log == stepwise_log


def test_heartbeats_report_the_batch_context_of_steady_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a heartbeat reports as the batch's context counts the tokens a steady decode has
    generated since it joined (kept in the worker's running sums, not on the sequence)."""
    seen: list[tuple[int, int]] = []
    observe = Simulator._observe

    def checked(self: Simulator, worker: worker_module.SimWorker, now: float) -> None:
        expected = 0
        for seq in worker.running:
            since = worker.k - seq.k0 if seq.dec else 0  # steady steps not settled on the sequence
            expected += seq.prompt_len + seq.generated + since
        seen.append((worker.context_tokens(), expected))
        observe(self, worker, now)

    monkeypatch.setattr(Simulator, "_observe", checked)
    run_simulation(small_agentic(workflows=40, output_tokens=300.0), fleet(PoolSpec(replicas=2)))
    assert all(got == expected for got, expected in seen)
    assert sum(expected > 0 for _, expected in seen) > 20


def test_memory_holds_the_tasks_in_flight_not_the_workload() -> None:
    """The workload is pulled a task at a time and a request's state goes when it ends: midway
    through 3,000 agent runs only those in flight are alive, and nothing per request is left at
    the end."""
    from services.simulator import core as core_module
    from services.simulator import workload as workload_module

    def alive(kind: type) -> int:
        # Reachable ones: garbage in cycles waits for the collector, at times other tests'
        # allocations decide, and is not state kept.
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is kind)

    counts: list[tuple[int, int, int]] = []
    simulator: Simulator | None = None

    def progress(done: int, total: int | None) -> None:
        assert simulator is not None
        counts.append((done, alive(workload_module._Workflow), alive(core_module._RequestRun)))

    workload = small_agentic(workflows=3000, rate_per_s=20.0, max_steps=3, output_tokens=30.0)
    simulator = Simulator(
        workload,
        fleet(PoolSpec(replicas=4)),
        "round_robin",
        options=SimOptions(progress_every=500),
        progress=progress,
    )
    result = simulator.run()
    assert result.tasks == 3000 and len(counts) >= 6
    in_flight = [(workflows, requests) for done, workflows, requests in counts if 0 < done < 3000]
    # In flight: 20 arrivals/s, each for a few seconds. (A pending deadline event that held its
    # request until the deadline passed kept 2,500 of the 3,000 alive.)
    assert in_flight and max(w for w, _ in in_flight) < 400 and max(r for _, r in in_flight) < 400
    gc.collect()
    assert alive(workload_module._Workflow) == 0 and alive(core_module._RequestRun) == 0
    assert alive(worker_module.Seq) == 0


@pytest.mark.parametrize(("policy", "admission"), [("ripplemesh", "ripplemesh"), ("dynamo_kv", "rate_limit")])
def test_an_ended_request_and_a_finished_run_are_freed_without_the_cycle_collector(
    policy: str, admission: str
) -> None:
    """Nothing of a request is in a reference cycle, so it goes when it ends, by reference counts
    alone: left to the cycle collector, requests pile up in its oldest generation, whose full
    passes over a 1,000-worker fleet's caches cost more the longer the run. Nor is the run
    itself: it goes, KV caches and all, when `run_simulation` returns (left in cycles, a
    sweep's worker process, making run after run, held 9.8 GB after 430 of them). Test: the
    stressful workload, every path taken, with the collector off."""
    from services.engines.sim.blocks import BlockManager
    from services.simulator import core as core_module

    workload, spec = _stressful()
    gc.collect()
    gc.disable()
    try:
        result, log = run(workload, spec, policy, admission=admission)
        alive = Counter(type(o) for o in gc.get_objects())
    finally:
        gc.enable()
    assert result.requests == len(log) > 300 and result.rejections
    assert result.failures or policy == "ripplemesh"  # it refuses what would fail
    assert alive[core_module._RequestRun] == 0 and alive[worker_module.Seq] == 0
    run_state = (Simulator, worker_module.SimWorker, BlockManager, FleetPrefixView)
    assert {kind.__name__: alive[kind] for kind in run_state} == dict.fromkeys(
        (kind.__name__ for kind in run_state), 0
    )


def test_the_router_sheds_at_its_own_bar_only_where_admission_controls_no_load() -> None:
    """The simulator tells the router what the run's admission does, as the router service
    reads it from the mesh config: on the agentic workload's overload (x20, 1,000 workflows) a
    lower bar for a router that is the only shedding refuses more new tasks under rate_limit,
    and changes nothing behind the project's admission. A run records the config it was given,
    not what admission made of it (the sweep compares that record)."""
    lower = RouterConfig(dearest_task_factor_alone=0.5)
    runs = {}
    for admission in ("rate_limit", "ripplemesh"):
        for name, config in (("shipped", RouterConfig()), ("lower", lower)):
            workload = load_workload("agentic:workflows=1000,rate_per_s=2,seed=0", rate_scale=20.0)
            runs[admission, name] = run_simulation(
                workload,
                parse_fleet("2xH100,2xH200"),
                "ripplemesh",
                seed=0,
                options=SimOptions(prefix_upper_bound=False, router_config=config),
                admission=admission,
            )
    shed = {key: result.rejections.get("router:saturated", 0) for key, result in runs.items()}
    assert shed["rate_limit", "lower"] > shed["rate_limit", "shipped"] > 0
    assert comparable(runs["ripplemesh", "lower"]) | {"router_config": {}} == comparable(
        runs["ripplemesh", "shipped"]
    )
    assert runs["rate_limit", "lower"].router_config == {"dearest_task_factor_alone": 0.5}


@pytest.mark.parametrize("scenario", ["long-decodes", "stressful"])
def test_steps_applied_as_arrays_change_nothing(monkeypatch: pytest.MonkeyPatch, scenario: str) -> None:
    """A chunk's steps applied with numpy (`_advance_arrays`) give the plain loop's result, bit
    for bit: the same times, GPU-seconds, KV blocks and evictions."""
    if scenario == "long-decodes":
        workload = small_agentic(workflows=40, output_tokens=500.0, think_s=4.0)
        spec = fleet(PoolSpec(replicas=2, kv_capacity_tokens=40_000))
    else:
        workload, spec = _stressful()
    vectorised = []
    original = worker_module.SimWorker._advance_arrays

    def counted(self: worker_module.SimWorker, now: float, bound: int) -> int:
        vectorised.append(bound)
        return original(self, now, bound)

    monkeypatch.setattr(worker_module.SimWorker, "_advance_arrays", counted)
    monkeypatch.setattr(worker_module, "VECTOR_STEPS", 10**9)
    looped, looped_log = run(workload, spec, "dynamo_kv")
    assert not vectorised
    monkeypatch.setattr(worker_module, "VECTOR_STEPS", 1)
    arrays, arrays_log = run(workload, spec, "dynamo_kv")
    assert len(vectorised) > 50 and max(vectorised) > 100
    assert comparable(arrays) == comparable(looped)
    assert arrays_log == looped_log


# ------------------------------------------------------------------ determinism


def test_same_inputs_same_result() -> None:
    workload = small_agentic()
    spec = fleet(PoolSpec(replicas=4))
    for policy in ("ripplemesh", "sglang_cache_aware"):
        assert comparable(run_simulation(workload, spec, policy)) == comparable(
            run_simulation(workload, spec, policy)
        )


def test_same_result_in_another_process_with_another_hash_seed(tmp_path: Path) -> None:
    """No dependence on Python's per-process string hashing (set or dict order of str keys)."""
    script = (
        "import json, msgspec, sys\n"
        "from services.simulator import AgenticWorkload, FleetSpec, PoolSpec, run_simulation\n"
        "w = AgenticWorkload(workflows=60, rate_per_s=4.0, max_steps=4, output_tokens=40.0, seed=5,\n"
        "                    model='m')\n"
        "f = FleetSpec(pools=[PoolSpec(replicas=3)], gpu_prices_per_hour={'H100': 3.0})\n"
        "r = msgspec.to_builtins(run_simulation(w, f, 'llmd_weighted')); r.pop('wall_s')\n"
        "print(json.dumps(r, sort_keys=True))\n"
    )
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0])["tasks"] == 60


# ------------------------------------------------------------------ conservation


def _stressful() -> tuple[AgenticWorkload, FleetSpec]:
    tenants = (
        AgenticTenant("fast", "critical", 0.4, system_prompt_tokens=600, step_deadline_s=1.5),
        AgenticTenant("slow", "standard", 0.4, system_prompt_tokens=1200, step_deadline_s=60.0),
        AgenticTenant(
            "capped",
            "sheddable",
            0.2,
            system_prompt_tokens=300,
            step_deadline_s=None,
            quota=TenantQuota(requests_per_s=1.0, request_burst=2.0, tokens_per_s=4000.0, token_burst=8000.0),
        ),
    )
    workload = small_agentic(
        workflows=150, rate_per_s=12.0, tenants_spec=tenants, failure_rate=0.05, output_tokens=120.0
    )
    spec = fleet(
        PoolSpec(role="prefill", replicas=2, kv_capacity_tokens=30_000),
        PoolSpec(role="decode", replicas=2, kv_capacity_tokens=12_000, gpu="H200"),
    )
    return workload, spec


def test_every_request_ends_exactly_once_and_spend_adds_up() -> None:
    workload, spec = _stressful()
    result, log = run(workload, spec, "dynamo_kv")
    # Every path was taken: rejections, client abandonment, failures, preemption, KV hand-off.
    assert result.rejections.get("admission:quota", 0) > 0
    assert result.failures.get("client:deadline", 0) > 0
    assert result.tasks_failed.get("step_failed", 0) > 0  # rejected or abandoned steps
    assert result.tasks_failed.get("abandoned", 0) > 0  # the agent stopped on an unusable result
    assert result.preemptions > 0
    assert result.kv_transfer_bytes > 0
    # Requests: each one ends once, as completed, rejected or failed.
    ids = Counter(r.request_id for r in log)
    assert len(ids) == len(log) == result.requests
    assert max(ids.values()) == 1
    outcomes = Counter("completed" if r.outcome == "completed" else r.outcome for r in log)
    assert outcomes["completed"] == result.requests_completed
    assert (
        result.requests_completed + sum(result.rejections.values()) + sum(result.failures.values())
        == result.requests
    )
    # Tasks: each one succeeds or fails.
    assert result.tasks == 150
    assert result.tasks_succeeded + sum(result.tasks_failed.values()) == result.tasks
    assert sum(s for s, _ in result.task_success_by_priority.values()) == result.tasks_succeeded
    assert sum(t for _, t in result.task_success_by_priority.values()) == result.tasks
    # Spend: every GPU-second the engines spent is some request's, priced once.
    assert result.attributed_gpu_seconds == pytest.approx(result.busy_gpu_seconds, rel=1e-9)
    assert sum(r.gpu_seconds for r in log) == pytest.approx(result.attributed_gpu_seconds, rel=1e-9)
    busy_usd = sum(
        pricing.price_gpu_seconds(gpu_type, seconds, PRICES)
        for gpu_type, seconds in _busy_by_gpu(workload, spec).items()
    )
    kv_usd = pricing.price_kv_transfer(result.kv_transfer_bytes, KV_USD_PER_GB)
    assert result.kv_transfer_spend_usd == pytest.approx(kv_usd, rel=1e-9)
    assert result.attributed_spend_usd == pytest.approx(busy_usd + kv_usd, rel=1e-9)
    assert result.successful_spend_usd + result.wasted_spend_usd == pytest.approx(
        result.attributed_spend_usd, rel=1e-9
    )
    assert result.wasted_spend_usd > 0
    assert result.idle_spend_usd == pytest.approx(
        result.total_spend_usd - result.attributed_spend_usd, rel=1e-9
    )
    assert result.cost_per_successful_task_usd == pytest.approx(
        result.total_spend_usd / result.tasks_succeeded
    )


def _busy_by_gpu(workload: AgenticWorkload, spec: FleetSpec) -> dict[str, float]:
    simulator = Simulator(workload, spec, "dynamo_kv", admission="rate_limit")  # as run() above
    simulator.run()
    busy: dict[str, float] = {}
    for worker in simulator.all_workers:
        busy[worker.gpu_type] = busy.get(worker.gpu_type, 0.0) + worker.busy_seconds * worker.tensor_parallel
    return busy


def test_a_failed_step_fails_its_workflow_and_its_spend_is_waste() -> None:
    workload = small_agentic(workflows=40, failure_rate=1.0)  # every first step's result is unusable
    result = run_simulation(workload, fleet(PoolSpec(replicas=2)))
    assert result.tasks_succeeded == 0
    assert result.tasks_failed == {"abandoned": 40}  # the ledger's verdict on a workflow that stops
    assert result.requests == 40  # no later step was issued
    assert result.wasted_spend_usd == pytest.approx(result.attributed_spend_usd)
    assert result.cost_per_successful_task_usd is None


def test_a_late_step_misses_its_deadline() -> None:
    tenants = (AgenticTenant("t", "standard", 1.0, system_prompt_tokens=500, step_deadline_s=0.05),)
    workload = small_agentic(workflows=30, tenants_spec=tenants, output_tokens=200.0)
    # Without admission's deadline feasibility (which would reject these at once), and routed by
    # a baseline (ripplemesh's router refuses a deadline it cannot meet, too).
    abandoned = run_simulation(workload, fleet(PoolSpec(replicas=1)), "least_loaded", admission="none")
    assert abandoned.failures.get("client:deadline", 0) > 0
    assert abandoned.tasks_failed.get("step_failed", 0) > 0  # a cancelled step is a failed step
    late = run_simulation(
        workload,
        fleet(PoolSpec(replicas=1)),
        "least_loaded",
        options=SimOptions(abandon_past_deadline=False),
        admission="none",
    )
    assert late.tasks_failed.get("deadline_missed", 0) > 0
    assert not late.failures  # they completed, too late


# ------------------------------------------------------------------ prefix caching


def _unique(count: int, prompt: int = 1024) -> ListWorkload:
    steps = [
        (
            i * 0.05,
            Step(
                prompt_tokens=prompt,
                output_tokens=16,
                block_hashes=random_prompt_hashes(MODEL, BLOCK, prompt // BLOCK, i),
            ),
        )
        for i in range(count)
    ]
    return ListWorkload(steps, block_size=BLOCK, model=MODEL)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_no_prefix_sharing_means_no_cache_hits(policy: str) -> None:
    result, _ = run(_unique(150), fleet(PoolSpec(replicas=4)), policy)
    assert result.requests_completed == 150
    assert result.prefix_cache["cached_tokens"] == 0
    assert result.prefix_cache["upper_bound_tokens"] == 0


@needs_traces
def test_azure_trace_has_no_prefix_sharing() -> None:
    trace = AzureTrace(TRACES / "AzureLLMInferenceTrace_code.csv", limit=300, rate_scale=5.0)
    result, _ = run(trace, fleet(PoolSpec(replicas=2)), "sglang_cache_aware")
    assert result.requests == 300
    assert result.prefix_cache["hit_rate"] == 0.0
    assert result.prefix_cache["upper_bound_hit_rate"] == 0.0


@pytest.mark.parametrize("policy", ["dynamo_kv", "llmd_weighted", "sglang_cache_aware"])
def test_one_shared_prefix_is_cached_near_the_upper_bound(policy: str) -> None:
    prefix = random_prompt_hashes(MODEL, BLOCK, 128, 10**6)  # 2048 shared tokens
    steps = []
    for i in range(200):
        own = random_prompt_hashes(MODEL, BLOCK, 2, i)
        steps.append(
            (i * 0.02, Step(prompt_tokens=2048 + 40, output_tokens=20, block_hashes=prefix + own[:2]))
        )
    result, _ = run(ListWorkload(steps, block_size=BLOCK, model=MODEL), fleet(PoolSpec(replicas=8)), policy)
    bound = result.prefix_cache["upper_bound_hit_rate"]
    assert bound is not None and bound > 0.9
    assert result.prefix_cache["hit_rate"] >= 0.9 * bound


def test_cache_aware_routing_beats_load_balancing_on_agent_runs() -> None:
    workload = small_agentic(workflows=150, rate_per_s=6.0)
    spec = fleet(PoolSpec(replicas=8))
    hits = {
        p: run_simulation(workload, spec, p).prefix_cache["hit_rate"]
        for p in ("round_robin", "sglang_cache_aware")
    }
    assert hits["sglang_cache_aware"] > hits["round_robin"] + 0.1


def test_prefix_view_binary_search_equals_the_linear_walk() -> None:
    """The fast overlap (binary search) equals BlockManager.cached_prefix_blocks on real caches,
    evictions included."""
    workload = small_agentic(workflows=80, rate_per_s=8.0)
    simulator = Simulator(workload, fleet(PoolSpec(replicas=3, kv_capacity_tokens=15_000)), "llmd_weighted")
    simulator.run()
    chains: list[list[int]] = []
    for task in workload.tasks():
        for index in range(1, task.steps + 1):
            chains.append(task.step(index).block_hashes)
    view = FleetPrefixView(simulator.serving)
    view.now = simulator.now
    distinct = len({h for chain in chains for h in chain})
    assert sum(w.blocks.cached_blocks for w in simulator.serving.values()) < distinct  # caches evicted
    checked = 0
    for worker_id, worker in simulator.serving.items():
        for chain in chains:
            expected = worker.blocks.cached_prefix_blocks(chain)
            assert view.overlap(worker_id, chain) == expected
            checked += expected > 0
    assert checked > 0


@pytest.mark.parametrize("serving", ["aggregated", "disaggregated"])
def test_fleet_overlaps_from_the_first_block_index_equal_visiting_every_worker(
    monkeypatch: pytest.MonkeyPatch, serving: str
) -> None:
    """`overlaps` visits only the workers its first-block index names, and applies a worker's
    steps timed ahead only when they could evict the match; at every routing decision of a run
    (evictions, a small index sweep, the fleet growing, KV imported by decode workers) it equals
    walking every worker's cache with its steps applied."""
    monkeypatch.setattr(FleetPrefixView, "SWEEP_SLACK", 4)
    indexed = FleetPrefixView.overlaps
    answers: list[int] = []

    def checked(self: FleetPrefixView, block_hashes: list[int]) -> dict[str, int]:
        got = indexed(self, block_hashes)
        every = {}
        for worker_id, worker in self.workers.items():
            worker.advance(self.now)  # the steps timed ahead, applied: what the cache holds now
            if matched := worker.blocks.cached_prefix_blocks(block_hashes):
                every[worker_id] = matched
        assert list(got.items()) == list(every.items())
        answers.append(len(got))
        return got

    monkeypatch.setattr(FleetPrefixView, "overlaps", checked)
    pools = [
        PoolSpec(
            replicas=2,
            autoscale=True,
            min_replicas=2,
            max_replicas=6,
            startup_s=5.0,
            kv_capacity_tokens=20_000,
        )
    ]
    if serving == "disaggregated":
        pools.insert(0, PoolSpec(role="prefill", replicas=2, kv_capacity_tokens=20_000))
    spec = fleet(*pools, autoscale_interval_s=2.0, sequences_per_replica=4.0)
    # Disaggregated, dynamo_kv hands every request's KV to a decode worker; admission's predictions
    # (the router's earliest_ttft) call overlaps whatever routes.
    policy = "ripplemesh" if serving == "aggregated" else "dynamo_kv"
    result = run_simulation(small_agentic(workflows=150, rate_per_s=10.0), spec, policy)
    assert result.peak_replicas > 2 + len(pools) - 1
    assert len(answers) > 100 and sum(n > 1 for n in answers) > 10  # several workers caching a prefix
    if serving == "disaggregated":
        assert result.kv_transfer_bytes > 0


# ------------------------------------------------------------------ the policies are the services'


def _first_pool_worker(result_log: list[RequestRecord]) -> set[str]:
    return {r.workers[0] for r in result_log if r.workers}


def test_router_policy_is_the_services_module(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = _unique(40)
    spec = fleet(PoolSpec(replicas=4))
    _, log = run(workload, spec, "ripplemesh")
    assert len(_first_pool_worker(log)) == 4  # least-loaded spreads the load
    calls = []

    def everything_on_worker_2(state: Any, request: RouteRequest, prefix: Any, now: float) -> Placement:
        calls.append(now)
        return Placement("aggregated", "decode-h100-0-2", "decode-h100-0-2", len(state.workers), 0.0)

    monkeypatch.setattr(router_policy, "place", everything_on_worker_2)
    _, log = run(workload, spec, "ripplemesh")
    assert _first_pool_worker(log) == {"decode-h100-0-2"}
    assert len(calls) == 40


@pytest.mark.parametrize("name", baselines.BASELINES)
def test_baselines_are_the_router_modules(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    seen: list[str] = []

    def pinned(state: Any, **kwargs: Any) -> Placement:
        seen.append(kwargs["request_id"])
        return Placement("aggregated", "decode-h100-0-1", "decode-h100-0-1", 4, 0.0)

    monkeypatch.setattr(baselines, name, pinned)
    _, log = run(_unique(20), fleet(PoolSpec(replicas=4)), name)
    assert _first_pool_worker(log) == {"decode-h100-0-1"}
    assert len(seen) == 20


def test_admission_autoscaler_ledger_and_pricing_are_the_services_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workload = _unique(30)
    spec = fleet(PoolSpec(replicas=2))
    baseline = run_simulation(workload, spec)
    monkeypatch.setattr(admission_policy, "decide", lambda state, **kw: Reject("capacity", "full", None))
    monkeypatch.setattr(
        autoscaler_policy,
        "plan",
        lambda state, observations, pools, replicas, settings, now: (
            state,
            autoscaler_policy.Plan(at=now, pools=(), models=(), cost_per_hour=0.0, budget_per_hour=None),
        ),
    )
    monkeypatch.setattr(pricing, "price_gpu_seconds", lambda gpu_type, seconds, prices: 1.0)
    patched = run_simulation(workload, spec)
    monkeypatch.undo()
    monkeypatch.setattr(ledger_tasks, "task_status", lambda **facts: ("failed", "abandoned"))
    ledger = run_simulation(workload, spec)
    assert ledger.tasks_failed == {"abandoned": 30} and ledger.tasks_succeeded == 0
    assert patched.rejections == {"admission:capacity": 30}
    assert patched.tasks_succeeded == 0 and baseline.tasks_succeeded == 30
    assert all(s.desired == 0 for s in patched.fleet_timeline)  # plan() gave nothing
    assert all(s.desired == s.provisioned == 2 for s in baseline.fleet_timeline)  # the fixed pool
    assert patched.total_spend_usd == 2.0  # two workers, priced by the patched function
    assert baseline.total_spend_usd != 2.0


def test_the_autoscaler_grows_and_shrinks_an_autoscaled_pool() -> None:
    burst = small_agentic(workflows=400, rate_per_s=40.0, output_tokens=150.0)
    spec = fleet(
        PoolSpec(replicas=1, autoscale=True, min_replicas=1, max_replicas=12, startup_s=10.0),
        autoscale_interval_s=2.0,
        scale_down_delay_s=10.0,
        sequences_per_replica=8.0,
    )
    result = run_simulation(burst, spec)
    assert result.tasks_succeeded == 400
    assert result.peak_replicas > 1
    assert result.mean_replicas is not None and result.mean_replicas < result.peak_replicas
    assert result.fleet_timeline[-1].provisioned < result.peak_replicas
    assert max(s.desired for s in result.fleet_timeline) <= 12
    # Billed from the start of each replica to its removal, never beyond the run.
    assert result.provisioned_gpu_seconds < result.peak_replicas * result.duration_s


def test_disaggregated_serving_hands_kv_to_the_decode_pool() -> None:
    # least_loaded disaggregates whenever a prefill worker is live (ripplemesh chooses by cost).
    result, log = run(
        small_agentic(workflows=40),
        fleet(PoolSpec(role="prefill", replicas=1), PoolSpec(replicas=2)),
        "least_loaded",
    )
    assert result.tasks_succeeded == 40
    assert result.kv_transfer_bytes > 0
    assert result.kv_transfer_spend_usd == pytest.approx(
        pricing.price_kv_transfer(result.kv_transfer_bytes, KV_USD_PER_GB)
    )
    assert all(r.workers[0].startswith("prefill") and r.workers[1].startswith("decode") for r in log)


# ------------------------------------------------------------------ workloads


@needs_traces
def test_mooncake_loader_reads_the_real_traces() -> None:
    conversation = MooncakeTrace(TRACES / "conversation_trace.jsonl")
    assert conversation.count_hint() == 12_031
    tasks = list(conversation.tasks())
    assert len(tasks) == 12_031
    assert tasks[-1].arrival_s == pytest.approx(3536.999)
    first = tasks[0].step(1)
    assert (first.prompt_tokens, first.output_tokens) == (6758, 500)
    # 512-token blocks, full ones only, chained: requests that share hash id 0 share block 0.
    assert len(first.block_hashes) == 6758 // 512
    assert tasks[1].step(1).block_hashes[0] == first.block_hashes[0]
    assert tasks[1].step(1).block_hashes[1] != first.block_hashes[1]
    # Expanded to 16-token engine blocks: 32 chained sub-blocks per hash id.
    fine = list(MooncakeTrace(TRACES / "conversation_trace.jsonl", block_size=16, limit=2).tasks())
    a, b = fine[0].step(1).block_hashes, fine[1].step(1).block_hashes
    assert len(a) == 6758 // 16
    assert a[:32] == b[:32] and a[32] != b[32]
    synthetic = MooncakeTrace(TRACES / "synthetic_trace.jsonl")
    assert sum(1 for _ in synthetic.tasks()) == 3993


@needs_traces
def test_mooncake_prefix_reuse_matches_the_published_upper_bound() -> None:
    """SOURCES.md: leading-block reuse with an infinite cache is 36.6% for the conversation trace."""
    trace = MooncakeTrace(TRACES / "conversation_trace.jsonl", limit=3000, rate_scale=20.0)
    simulator = Simulator(trace, fleet(PoolSpec(replicas=2)), "ripplemesh")
    seen = 0
    total = 0
    for task in trace.tasks():
        step = task.step(1)
        seen += simulator._upper_bound(step)
        total += step.prompt_tokens
    assert 0.25 < seen / total < 0.5


@needs_traces
def test_azure_loader_reads_the_real_traces() -> None:
    conv = AzureTrace(TRACES / "AzureLLMInferenceTrace_conv.csv")
    tasks = list(conv.tasks())
    assert len(tasks) == conv.count_hint() == 19_366
    assert tasks[0].arrival_s == 0.0
    assert tasks[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    first = tasks[0].step(1)
    assert (first.prompt_tokens, first.output_tokens) == (374, 44)
    assert len(first.block_hashes) == 374 // 16
    assert 3000 < tasks[-1].arrival_s < 3600
    code = AzureTrace(TRACES / "AzureLLMInferenceTrace_code.csv")
    assert sum(1 for _ in code.tasks()) == 8819


@needs_traces
def test_rate_scaling_windows_limits_and_repeats() -> None:
    path = TRACES / "AzureLLMInferenceTrace_conv.csv"
    plain = [t.arrival_s for t in AzureTrace(path, limit=200).tasks()]
    fast = [t.arrival_s for t in AzureTrace(path, limit=200, rate_scale=4.0).tasks()]
    assert fast == pytest.approx([a / 4.0 for a in plain])
    window = list(AzureTrace(path, window=(600.0, 900.0)).tasks())
    everything = [t.arrival_s for t in AzureTrace(path).tasks()]
    assert len(window) == sum(1 for a in everything if 600.0 <= a < 900.0)
    assert window[0].arrival_s < 5.0 and window[-1].arrival_s < 300.0
    twice = list(AzureTrace(path, repeat=2, limit=40_000).tasks())
    assert len(twice) == 2 * 19_366
    assert twice[19_366].arrival_s > everything[-1]
    assert twice[0].step(1).block_hashes[0] != twice[19_366].step(1).block_hashes[0]


def test_agentic_steps_grow_by_the_previous_output_and_share_its_prefix() -> None:
    workload = small_agentic(workflows=20, failure_rate=0.3)
    again = small_agentic(workflows=20, failure_rate=0.3)
    tenants = {t.name: t for t in workload.tenants_spec}
    for task, same in zip(workload.tasks(), again.tasks(), strict=True):
        assert task.workflow and workload.min_steps <= task.steps <= workload.max_steps
        steps = [task.step(i) for i in range(1, task.steps + 1)]
        assert steps == [same.step(i) for i in range(1, same.steps + 1)]  # deterministic
        assert steps[0].prompt_tokens > tenants[task.tenant].system_prompt_tokens
        assert steps[0].think_s == 0.0
        for before, after in itertools.pairwise(steps):
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert after.block_hashes[: len(before.block_hashes)] == before.block_hashes
            assert after.deadline_s == tenants[task.tenant].step_deadline_s
        for step in steps:
            assert len(step.block_hashes) == step.prompt_tokens // BLOCK
    # Workflows of one tenant share its system prompt's blocks; other tenants' do not.
    by_tenant: dict[str, list[int]] = {}
    for task in workload.tasks():
        by_tenant.setdefault(task.tenant, []).append(task.step(1).block_hashes[0])
    firsts = {tenant: set(hashes) for tenant, hashes in by_tenant.items()}
    assert all(len(h) == 1 for h in firsts.values())
    assert len({next(iter(h)) for h in firsts.values()}) == len(firsts)


def test_workload_specs_and_fleet_specs_parse() -> None:
    workload = load_workload("agentic:workflows=10,rate_per_s=3,seed=4", rate_scale=2.0)
    assert isinstance(workload, AgenticWorkload) and workload.workflows == 10 and workload.rate_scale == 2.0
    with pytest.raises(ValueError, match="unknown agentic option"):
        load_workload("agentic:bogus=1")
    spec = parse_fleet("prefill:4xH200/llama-3.1-8b:fp8,decode:2..16xH100@2")
    prefill, decode = spec.pools
    assert (prefill.role, prefill.replicas, prefill.gpu, prefill.shape) == (
        "prefill",
        4,
        "H200",
        "llama-3.1-8b:fp8",
    )
    assert (decode.role, decode.replicas, decode.autoscale, decode.max_replicas, decode.tensor_parallel) == (
        "decode",
        2,
        True,
        16,
        2,
    )
    assert parse_fleet("64xH100").replicas == 64
    with pytest.raises(ValueError, match="bad pool"):
        parse_fleet("lots of GPUs")


def test_latency_sketch_quantiles_are_within_one_percent() -> None:
    rng = random.Random(1)
    values = [rng.lognormvariate(0.0, 2.0) for _ in range(20_000)]
    sketch = LatencySketch()
    for v in values:
        sketch.add(v)
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[int(q * (len(ordered) - 1))]
        assert sketch.quantile(q) == pytest.approx(exact, rel=0.02)
    assert sketch.count == 20_000 and len(sketch.buckets) < 2000


def test_a_tenant_over_quota_is_rejected_by_admission() -> None:
    capped = Tenant(
        "capped",
        "sheddable",
        TenantQuota(requests_per_s=1.0, request_burst=1.0, tokens_per_s=1e9, token_burst=1e9),
    )
    steps = [
        (
            i * 0.01,
            Step(prompt_tokens=64, output_tokens=4, block_hashes=random_prompt_hashes(MODEL, BLOCK, 4, i)),
        )
        for i in range(10)
    ]
    result = run_simulation(
        ListWorkload(steps, block_size=BLOCK, model=MODEL, tenant=capped), fleet(PoolSpec(replicas=1))
    )
    assert result.rejections == {"admission:quota": 9}
    assert result.task_success_by_priority == {"sheddable": [1, 10]}


def test_the_harness_compares_every_policy_on_one_workload(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from services.simulator.harness import compare

    console = Console(file=io.StringIO(), width=250)
    results = compare(
        small_agentic(workflows=20),
        fleet(PoolSpec(replicas=2)),
        POLICY_NAMES,
        out=tmp_path,
        console=console,
        plots=False,
    )
    assert [r.policy for r in results] == list(POLICY_NAMES)
    assert len({r.tasks for r in results}) == 1  # the identical workload each time
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["policy"] for r in written] == list(POLICY_NAMES)
    assert (tmp_path / "dynamo_kv.json").exists()
    table = console.file.getvalue()  # type: ignore[attr-defined]
    assert "$/successful task" in table and "sglang_cache_aware" in table
    pytest.importorskip("matplotlib")
    from services.simulator.harness import plot_results

    paths = plot_results(results, tmp_path)
    assert sorted(p.name for p in paths) == ["cost_per_task.png", "fleet_size.png", "latency_cdf.png"]


# ------------------------------------------------------------------ a variant of ripplemesh's policy


def test_simulate_runs_a_variant_of_the_router_config_and_records_it(tmp_path: Path) -> None:
    def simulate(*extra: str) -> subprocess.CompletedProcess[str]:
        command = ["simulate", "--workload", "agentic:workflows=40,seed=2", "--fleet", "1xH100"]
        command += ["--policy", "ripplemesh", "--no-plots", "--no-upper-bound", *extra]
        return subprocess.run(
            [sys.executable, "-m", "ripplemesh", *command],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=120,
        )

    for name, config in (("default", []), ("variant", ["--router-config", "min_success_probability=1.5"])):
        assert simulate("--out", str(tmp_path / name), *config).returncode == 0
    default = json.loads((tmp_path / "default" / "ripplemesh.json").read_bytes())
    variant = json.loads((tmp_path / "variant" / "ripplemesh.json").read_bytes())
    assert default["router_config"] == {} and default["tasks_succeeded"] > 0
    # No placement can reach a chance above 1: every step with a deadline is refused.
    assert variant["router_config"] == {"min_success_probability": 1.5}
    assert variant["tasks_succeeded"] == 0 and variant["rejections"]["router:infeasible"] == variant["tasks"]

    bad = simulate("--router-config", "relative_error=wide")
    assert bad.returncode == 2 and "router config option relative_error='wide'" in bad.stderr
