"""The simulator runs the autoscaler's policy (services/autoscaler/policy.py) and its baselines
(services/autoscaler/baselines.py): bursts scale up and calm drains, pools go to zero and come
back for a held request, capacity goes to the cheaper GPU first, runs are deterministic, and
`ripplemesh bench autoscale --quick` prints its table."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from ripplemesh.cli import main
from services.simulator import FleetSpec, PoolSpec, SimOptions, parse_fleet, run_simulation
from services.simulator.core import RequestRecord
from services.simulator.metrics import SimResult
from services.simulator.workload import AgenticWorkload, ListWorkload, Step, random_prompt_hashes

MODEL = "sim-test"
PRICES = {"H100": 3.0, "H200": 3.8}


def fleet(*pools: PoolSpec, **fields: Any) -> FleetSpec:
    return FleetSpec(pools=list(pools), gpu_prices_per_hour=PRICES, kv_transfer_usd_per_gb=0.01, **fields)


def run(workload: Any, spec: FleetSpec, autoscaler: str = "ripple") -> tuple[SimResult, list[RequestRecord]]:
    log: list[RequestRecord] = []
    result = run_simulation(
        workload,
        spec,
        options=SimOptions(autoscaler=autoscaler),
        request_log=log.append,
        admission="rate_limit",
    )
    return result, log


def bursty(**overrides: Any) -> AgenticWorkload:
    """Two calm minutes around a 15 s burst at 8x the rate."""
    fields: dict[str, Any] = {
        "workflows": 480,
        "rate_per_s": 2.0,
        "burst_factor": 8.0,
        "burst_s": 15.0,
        "burst_every_s": 75.0,
        "min_steps": 2,
        "max_steps": 4,
        "task_tokens": 300.0,
        "tool_tokens": 200.0,
        "output_tokens": 120.0,
        "think_s": 1.0,
        "seed": 7,
        "model": MODEL,
    }
    fields.update(overrides)
    return AgenticWorkload(**fields)


def autoscaled(**fields: Any) -> FleetSpec:
    # A small KV cache: the decode batch a replica holds is memory-bound, so a burst needs more.
    return fleet(
        PoolSpec(
            replicas=1,
            autoscale=True,
            min_replicas=1,
            max_replicas=8,
            startup_s=10.0,
            kv_capacity_tokens=30_000,
        ),
        autoscale_interval_s=2.0,
        scale_down_delay_s=10.0,
        **fields,
    )


def conserved(result: SimResult) -> None:
    """Every request issued ended once: completed, rejected or failed, with a reason."""
    assert result.requests == result.requests_completed + sum(result.rejections.values()) + sum(
        result.failures.values()
    )


def comparable(result: SimResult) -> dict[str, Any]:
    data = msgspec.to_builtins(result)
    data.pop("wall_s")
    return data


def request(
    at: float, salt: int, deadline_s: float | None = None, output_tokens: int = 20
) -> tuple[float, Step]:
    hashes = random_prompt_hashes(MODEL, 16, 25, salt)
    step = Step(prompt_tokens=400, output_tokens=output_tokens, block_hashes=hashes, deadline_s=deadline_s)
    return (at, step)


def test_a_burst_scales_up_and_the_calm_drains_back_down_losing_no_request() -> None:
    result, log = run(bursty(), autoscaled())
    conserved(result)
    assert result.tasks_succeeded == result.tasks == 480
    timeline = result.fleet_timeline
    burst_start = 60.0  # each 75 s period ends with its 15 s burst
    before = max(s.provisioned for s in timeline if s.t < burst_start)
    peak = max(s.provisioned for s in timeline)
    assert peak > before and peak == result.peak_replicas
    peak_at = next(s.t for s in timeline if s.provisioned == peak)
    assert burst_start <= peak_at < burst_start + 30.0  # grown during the burst, replicas warming 10 s
    assert timeline[-1].provisioned < peak
    # Back down by draining the replicas the plan names, after the scale-down delay.
    drains = [(p.t, d) for p in result.autoscale_plans for d in p.pools if d.remove]
    assert drains and all("scale down" in d.reason and "drain" in d.reason for _, d in drains)
    assert all(t > peak_at for t, _ in drains)
    # A drained replica finished its work: no request of the run failed or was cut.
    assert all(r.outcome == "completed" for r in log)


def test_idle_goes_to_zero_and_a_held_request_brings_a_replica_back() -> None:
    requests = [request(float(i), i) for i in range(5)] + [
        request(100.3, 99),
        request(100.5, 98, deadline_s=2.0),
    ]
    spec = fleet(
        PoolSpec(replicas=0, autoscale=True, min_replicas=0, max_replicas=4, startup_s=5.0),
        autoscale_interval_s=2.0,
        idle_to_zero_s=20.0,
    )
    result, log = run(ListWorkload(requests, model=MODEL), spec)
    conserved(result)
    outcomes = {r.request_id: r for r in log}
    # From zero at the start: held until the first replica is ready (5 s), then served.
    assert all(outcomes[f"rq{i}"].outcome == "completed" for i in range(5))
    assert outcomes["rq0"].first_token_at is not None and outcomes["rq0"].first_token_at >= 5.0
    # Idle for 20 s: to zero (nothing billed), until the request at 100.3 s.
    zero = [s for s in result.fleet_timeline if 40.0 <= s.t < 100.0]
    assert zero and all(s.provisioned == 0 for s in zero)
    held = next(p for p in result.autoscale_plans if p.t > 100.0)  # at once, not at 102 s
    assert (held.t, held.trigger, held.pools[0].add) == (100.3, "held", 1)
    assert outcomes["rq5"].outcome == "completed" and outcomes["rq5"].first_token_at >= 105.3
    # One held with a deadline shorter than a replica's start: rejected with the reason, not lost.
    assert outcomes["rq6"].outcome == "admission:no_capacity_in_time"
    assert result.rejections == {"admission:no_capacity_in_time": 1}
    assert result.held_requests == 7
    # Billed only while provisioned: two short stints.
    assert result.provisioned_gpu_seconds < 0.5 * result.duration_s


def test_the_compact_fleet_syntax_allows_zero() -> None:
    spec = parse_fleet("prefill:0..4xH100,decode:0..8xH200")
    assert [(p.replicas, p.min_replicas, p.max_replicas, p.autoscale) for p in spec.pools] == [
        (0, 0, 4, True),
        (0, 0, 8, True),
    ]


def test_capacity_goes_to_the_pool_cheaper_per_output_token_first() -> None:
    # Short prompts, long outputs: decode-bound. An H200 (more memory bandwidth, the same FLOPS)
    # decodes more tokens per dollar than an H100 at these prices.
    requests = [request(i / 15.0, i, output_tokens=800) for i in range(600)]
    spec = fleet(
        PoolSpec(gpu="H100", replicas=1, autoscale=True, min_replicas=0, max_replicas=8, startup_s=10.0),
        PoolSpec(gpu="H200", replicas=0, autoscale=True, min_replicas=0, max_replicas=8, startup_s=10.0),
        autoscale_interval_s=2.0,
    )
    result, _ = run(ListWorkload(requests, model=MODEL), spec)
    conserved(result)
    grows = [p for p in result.autoscale_plans if any(d.add for d in p.pools)]
    assert grows
    first = {d.pool: d for d in grows[0].pools}
    assert first["decode-h200-1"].add > 0 and first["decode-h100-0"].add == 0
    added = {name: sum(d.add for p in grows for d in p.pools if d.pool == name) for name in first}
    assert added["decode-h200-1"] > added["decode-h100-0"]


@pytest.mark.parametrize("baseline", ["hpa-queue", "dynamo-sla"])
def test_the_baselines_run_and_scale_otherwise_than_ripple(baseline: str) -> None:
    ripple, _ = run(bursty(), autoscaled())
    other, log = run(bursty(), autoscaled(), baseline)
    conserved(other)
    assert other.autoscaler == baseline and ripple.autoscaler == "ripple"
    assert other.tasks == ripple.tasks and len(log) == other.requests
    sizes = [s.provisioned for s in other.fleet_timeline]
    assert sizes != [s.provisioned for s in ripple.fleet_timeline]
    assert other.autoscale_plans and all(len(p.pools) == 1 for p in other.autoscale_plans)
    # Each at its own interval: HPA's 15 s sync, Dynamo's 180 s adjustment (here: its first only).
    times = [p.t for p in other.autoscale_plans]
    assert times[:2] == ([0.0, 16.0] if baseline == "hpa-queue" else [0.0])[:2]


def test_a_bad_autoscaler_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown autoscaler 'keda'"):
        run(bursty(workflows=5), autoscaled(), "keda")
    with pytest.raises(ValueError, match="unknown autoscaler option 'colour'"):
        run(bursty(workflows=5), autoscaled(), "hpa-queue:colour=3")


def test_the_same_seed_gives_the_same_run() -> None:
    spec = parse_fleet("prefill:0..4xH100,decode:1..6xH100,decode:0..6xH200")
    first, _ = run(bursty(workflows=200), spec)
    second, _ = run(bursty(workflows=200), spec)
    assert comparable(first) == comparable(second)
    other, _ = run(bursty(workflows=200, seed=8), spec)
    assert comparable(other) != comparable(first)


def test_bench_autoscale_quick_prints_the_table(tmp_path: Path) -> None:
    outcome = CliRunner().invoke(main, ["bench", "autoscale", "--quick", "--out", str(tmp_path)])
    assert outcome.exit_code == 0, outcome.output
    text = outcome.output
    for name in ("ripple", "dynamo-sla", "hpa-queue", "fixed", "$/successful task", "x best baseline"):
        assert name in text
    assert "best baseline" in text and "Target (ratio <= 0.8 at equal or better SLO attainment)" in text
    assert (tmp_path / "summary.json").is_file()
    assert (tmp_path / "autoscale_agentic-bursts.png").is_file()


def test_the_fixed_fleet_search_finds_the_fewest_replicas_of_each_type_that_reach_the_slo() -> None:
    """Bisection per decode GPU type, independent of any autoscaler's run: here SLO attainment
    is a fifth a replica on H100 and a third on H200, so 0.9 takes 5 H100s or 3 H200s."""
    from ripplemesh.bench.autoscale import searched_fleets

    @dataclasses.dataclass
    class Tried:
        fleet: str
        slo: float

    asked: list[str] = []

    def fixed_run(spec: FleetSpec) -> Tried:
        sizes = {p.gpu: p.replicas for p in spec.pools if p.replicas}
        assert len(sizes) == 1 and all(p.role == "decode" for p in spec.pools if p.replicas)
        gpu, n = next(iter(sizes.items()))
        asked.append(f"{n}x{gpu}")
        return Tried(f"{n}x{gpu}", min(1.0, n / (5 if gpu == "H100" else 3)))

    spec = parse_fleet("prefill:0..8xH100,decode:0..16xH100,decode:0..16xH200")
    found = searched_fleets(spec, fixed_run, 0.9)  # type: ignore[arg-type]
    assert [t.fleet for t in found] == ["5xH100", "4xH100", "3xH200", "2xH200"]
    assert len(asked) <= 2 * 6  # a bisection's tries, not every size
