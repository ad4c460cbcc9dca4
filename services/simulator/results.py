"""A run's result: the tallies, the fleet's provisioned time and the tenants' figures summed up
into a `SimResult`."""

from __future__ import annotations

from typing import Any

from services.ledger import pricing
from services.simulator.fleet import FleetSpec
from services.simulator.metrics import SimResult, latency_stats, ratio
from services.simulator.policies import router_config_changes
from services.simulator.records import ModelFigures
from services.simulator.state import SimState


def result_of(sim: SimState, wall_s: float) -> SimResult:
    """The run's `SimResult`, from its state once the loop has ended."""
    end = sim.end_time
    start = sim.first_arrival if sim.first_arrival is not None else 0.0
    duration = max(0.0, end - start)
    provisioned_gpu_s = 0.0
    provisioned_usd = 0.0
    busy_gpu_s = 0.0
    preemptions = 0
    by_model: dict[str, list[float]] = {}  # model -> [provisioned GPU-seconds, US$]
    for worker in sim.all_workers:
        stop = worker.removed_at if worker.removed_at is not None else end
        seconds = max(0.0, min(stop, end) - worker.provisioned_at) * worker.tensor_parallel
        usd = pricing.price_gpu_seconds(worker.gpu_type, seconds, sim.prices)
        provisioned_gpu_s += seconds
        provisioned_usd += usd
        busy_gpu_s += worker.busy_seconds * worker.tensor_parallel
        preemptions += worker.preemptions
        provisioned = by_model.setdefault(worker.model, [0.0, 0.0])
        provisioned[0] += seconds
        provisioned[1] += usd
    replicas = [s.provisioned for s in sim.timeline]
    completed = sim.requests_completed
    return SimResult(
        policy=sim.policy_name,
        workload=sim.workload.describe(),
        fleet=_describe_fleet(sim.fleet, sim.block_size, sim.workload.model),
        seed=sim.seed,
        cost_per_successful_task_usd=ratio(provisioned_usd + sim.kv_transfer_usd, sim.tasks_succeeded),
        total_spend_usd=provisioned_usd + sim.kv_transfer_usd,
        attributed_spend_usd=sim.attributed_usd,
        idle_spend_usd=max(0.0, provisioned_usd + sim.kv_transfer_usd - sim.attributed_usd),
        wasted_spend_usd=sim.wasted_usd,
        successful_spend_usd=sim.successful_usd,
        busy_gpu_seconds=busy_gpu_s,
        attributed_gpu_seconds=sim.attributed_gpu_s,
        provisioned_gpu_seconds=provisioned_gpu_s,
        gpu_utilisation=ratio(busy_gpu_s, provisioned_gpu_s),
        kv_transfer_bytes=sim.kv_transfer_bytes,
        kv_transfer_spend_usd=sim.kv_transfer_usd,
        tasks=sim.tasks,
        tasks_succeeded=sim.tasks_succeeded,
        tasks_failed=dict(sorted(sim.tasks_failed.items())),
        task_success_by_priority=dict(sorted(sim.by_priority.items())),
        requests=sim.requests,
        requests_completed=completed,
        rejections=dict(sorted(sim.rejections.items())),
        failures=dict(sorted(sim.failures.items())),
        goodput_tasks_per_s=ratio(sim.tasks_succeeded, duration),
        duration_s=duration,
        ttft_s=latency_stats(sim.ttft),
        tpot_s=latency_stats(sim.tpot),
        e2e_s=latency_stats(sim.e2e),
        queue_s=latency_stats(sim.queue),
        slo={
            "ttft_s": sim.options.slo_ttft_s,
            "tpot_s": sim.options.slo_tpot_s,
            # Over every request issued: a rejected or failed request misses its SLO.
            "attainment": ratio(sim.slo_met, sim.requests),
            "ttft_attainment": ratio(sim.slo_ttft_met, sim.requests),
            "tpot_attainment": ratio(sim.slo_tpot_met, sim.requests),
        },
        prefix_cache={
            "prompt_tokens": sim.prompt_tokens,
            "cached_tokens": sim.cached_tokens,
            "hit_rate": ratio(sim.cached_tokens, sim.prompt_tokens),
            "upper_bound_tokens": sim.upper_bound_tokens if sim.options.prefix_upper_bound else None,
            "upper_bound_hit_rate": (
                ratio(sim.upper_bound_tokens, sim.prompt_tokens) if sim.options.prefix_upper_bound else None
            ),
        },
        preemptions=preemptions,
        fleet_timeline=sim.timeline,
        peak_replicas=max(replicas, default=0),
        mean_replicas=sum(replicas) / len(replicas) if replicas else None,
        wall_s=wall_s,
        events=sim.events,
        admission=sim.admission_variant.name,
        router_config=router_config_changes(sim.options.router_config),
        deferred_requests=sim.deferred,
        deferral_s=latency_stats(sim.deferral),
        slo_by_priority={p: ratio(met, issued) for p, (met, issued) in sorted(sim.slo_by_priority.items())},
        tenants=_tenant_figures(sim),
        autoscaler=sim.autoscaler.name,
        autoscale_plans=sim.plans,
        held_requests=sim.held_requests,
        by_class=sim.class_summary(),
        batch=sim.batch_summary(),
        by_model=_model_figures(sim, by_model),
        router_calibration=sim.router_state.calibration.summary(),
    )


def _model_figures(sim: SimState, provisioned: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per model: the pools serving it and what its requests and tasks did and cost."""
    pools: dict[str, list[str]] = {}
    for index, pool in enumerate(sim.fleet.pools):
        pools.setdefault(pool.model or sim.workload.model, []).append(pool.label(index))
    out: dict[str, dict[str, Any]] = {}
    for model in sorted(set(pools) | set(sim.by_model) | set(provisioned)):
        f = sim.by_model.get(model) or ModelFigures()
        gpu_s, usd = provisioned.get(model, (0.0, 0.0))
        total = usd + f.kv_transfer_usd
        out[model] = {
            "pools": pools.get(model, []),
            "requests": f.requests,
            "completed": f.completed,
            "rejected": f.rejected,
            "failed": f.failed,
            "held": f.held,
            "slo_attainment": ratio(f.slo_met, f.requests),
            "ttft_p50_s": f.ttft.quantile(0.5),
            "ttft_p99_s": f.ttft.quantile(0.99),
            "tasks": f.tasks,
            "tasks_succeeded": f.succeeded,
            "provisioned_gpu_seconds": gpu_s,
            "total_spend_usd": total,
            "attributed_spend_usd": f.attributed_usd,
            "idle_spend_usd": max(0.0, total - f.attributed_usd),
            "kv_transfer_spend_usd": f.kv_transfer_usd,
            "cost_per_successful_task_usd": ratio(total, f.succeeded),
        }
    return out


def _tenant_figures(sim: SimState) -> dict[str, dict[str, Any]]:
    tenants = sim.tenants
    class_tokens: dict[str, int] = {}
    class_weight: dict[str, float] = {}
    for name, figures in sim.by_tenant.items():
        tenant = tenants[name]
        class_tokens[tenant.priority] = class_tokens.get(tenant.priority, 0) + figures.admitted_tokens
        class_weight[tenant.priority] = class_weight.get(tenant.priority, 0.0) + tenant.quota.weight
    out: dict[str, dict[str, Any]] = {}
    for name, figures in sorted(sim.by_tenant.items()):
        tenant = tenants[name]
        out[name] = {
            "priority": tenant.priority,
            "weight": tenant.quota.weight,
            "requests": figures.requests,
            "admitted": figures.admitted,
            "admitted_tokens": figures.admitted_tokens,
            "slo_attainment": ratio(figures.slo_met, figures.requests),
            "token_share_in_class": ratio(figures.admitted_tokens, class_tokens[tenant.priority]),
            "weight_share_in_class": ratio(tenant.quota.weight, class_weight[tenant.priority]),
        }
    return out


def _describe_fleet(fleet: FleetSpec, block_size: int, default_model: str) -> dict[str, Any]:
    return {
        "block_size": block_size,
        "heartbeat_s": fleet.heartbeat_s,
        "autoscale_interval_s": fleet.autoscale_interval_s,
        "scale_down_delay_s": fleet.scale_down_delay_s,
        "ttft_slo_s": fleet.ttft_slo_s,
        "itl_slo_s": fleet.itl_slo_s,
        "idle_to_zero_s": fleet.idle_to_zero_s,
        "budget_per_hour": fleet.budget_per_hour,
        "hold_limit_s": fleet.hold_limit_s,
        "pools": [
            {
                "name": pool.label(i),
                "role": pool.role,
                "gpu": pool.gpu,
                "shape": pool.shape,
                "model": pool.model or default_model,
                "replicas": pool.replicas,
                "autoscale": pool.autoscale,
                "min_replicas": pool.min_replicas,
                "max_replicas": pool.high,
                "startup_s": pool.startup_s,
                "tensor_parallel": pool.tensor_parallel,
            }
            for i, pool in enumerate(fleet.pools)
        ],
    }
