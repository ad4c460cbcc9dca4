"""Two baseline scaling rules for the autoscaler's comparison (the simulator's `--autoscaler
dynamo-sla` and `hpa-queue`, `ripplemesh bench autoscale`). Pure, and of `policy.plan`'s shape:
a state, the models' `Observation`s, the `Pool`s and their `Replica`s, settings and the clock
in; the new state and a `Plan` (a `PoolDecision` per pool: the desired size, how many to add,
which replicas to drain, why) out.

Both pick the replicas to drain as Kubernetes' ReplicaSet controller picks pods to delete on a
scale-down: those not ready yet (warming) first, then the most recently started; `replicas` are
taken to be in the order they started (the simulator passes them so). Neither knows about the
prefix cache, prices or the fleet budget: those are what the ripple policy adds.

- `dynamo_sla`: NVIDIA Dynamo's SLA planner, throughput-based scaling with the constant load
  predictor (docs/pages/design-docs/planner-design.md, "Scaling Algorithm", and
  components/src/dynamo/planner/utils/prefill_planner.py, decode_planner.py and planner_core.py
  in github.com/ai-dynamo/dynamo).
- `hpa_queue`: a Kubernetes HorizontalPodAutoscaler on a queue-length metric, with KEDA's scale
  to and from zero (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/, "Algorithm
  details" and "Stabilization window"; keda.sh/docs/latest/reference/scaledobject-spec/,
  `cooldownPeriod`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.autoscaler.capacity import EngineProfile, Slo, replica_capacity
from services.autoscaler.policy import (
    ModelOutlook,
    Observation,
    Plan,
    Pool,
    PoolDecision,
    Replica,
    pool_decision,
    replicas_by_pool,
)


def _decision(pool: Pool, members: Sequence[Replica], desired: int, need: float, reason: str) -> PoolDecision:
    """The pool's decision for `desired` replicas: add the shortfall, or drain the surplus as a
    ReplicaSet would delete it (warming first, then the newest)."""
    warming = [r for r in members if r.state == "warming"]
    serving = [r for r in members if r.state == "serving"]
    current = len(warming) + len(serving)
    desired = max(0, desired)
    add = max(0, desired - current)
    ordered = list(reversed(warming)) + list(reversed(serving))
    remove = tuple(r.replica_id for r in ordered[: max(0, current - desired)])
    if add:
        reason = f"scale up {current} -> {desired}; {reason}"
    elif remove:
        reason = f"scale down {current} -> {desired}: drain {', '.join(remove)}; {reason}"
    else:
        reason = f"steady at {current}; {reason}"
    return pool_decision(pool, members, desired, add, remove, need, reason)


def _plan(now: float, decisions: Sequence[PoolDecision], outlooks: Sequence[ModelOutlook]) -> Plan:
    return Plan(
        at=now,
        pools=tuple(decisions),
        models=tuple(outlooks),
        cost_per_hour=round(sum(d.cost_per_hour for d in decisions), 4),
        budget_per_hour=None,
    )


def _outlook(
    model: str, observation: Observation | None, isl: float, osl: float, prefill: float, decode: float
) -> ModelOutlook:
    rate = observation.window.rate if observation is not None else 0.0
    return ModelOutlook(
        model=model,
        observed_rate=round(rate, 4),
        forecast_rate=round(rate, 4),
        horizon_s=0.0,
        mean_prompt=round(isl, 1),
        mean_output=round(osl, 1),
        hit_rate=0.0,
        prefill_load=prefill,
        decode_load=decode,
        ttft_p90_s=observation.ttft_p90_s if observation is not None else None,
        itl_p90_s=observation.itl_p90_s if observation is not None else None,
        held=observation.held if observation is not None else 0,
    )


# ---------------------------------------------------------------- Dynamo's SLA planner


@dataclass(frozen=True, slots=True)
class DynamoSettings:
    """The planner's arguments. `adjustment_interval_s` is Dynamo's default (180 s, "conservative"
    in its design doc); `min_endpoint` its default floor per component (1: no scale to zero)."""

    slo: Slo = field(default_factory=Slo)
    adjustment_interval_s: float = 180.0
    min_endpoint: int = 1
    correction: bool = True  # Dynamo's `--no-correction` off

    def __post_init__(self) -> None:
        if self.adjustment_interval_s <= 0:
            raise ValueError("adjustment_interval_s must be > 0")
        if self.min_endpoint < 0:
            raise ValueError("min_endpoint must be >= 0")


@dataclass(frozen=True, slots=True)
class DynamoState:
    """Per model: the correction factors (1.0 until measured) and the last interval's mean input
    and output lengths (the constant predictor's values)."""

    p_correction: Mapping[str, float] = field(default_factory=dict)
    d_correction: Mapping[str, float] = field(default_factory=dict)
    isl: Mapping[str, float] = field(default_factory=dict)
    osl: Mapping[str, float] = field(default_factory=dict)


def prefill_seconds(profile: EngineProfile, tokens: float) -> float:
    """One prompt of `tokens` prefilled alone (chunks of `max_batch_tokens`): the profile's TTFT,
    what Dynamo's prefill interpolator reads from its profiling sweep."""
    perf = profile.perf
    left, done, seconds = max(1, round(tokens)), 0, 0.0
    while left > 0:
        chunk = min(left, profile.max_batch_tokens)
        seconds += perf.prefill_seconds(chunk, done) + perf.step_overhead_s
        done += chunk
        left -= chunk
    return seconds


def dynamo_sla(
    state: DynamoState,
    observations: Iterable[Observation],
    pools: Sequence[Pool],
    replicas: Iterable[Replica],
    settings: DynamoSettings,
    now: float,
) -> tuple[DynamoState, Plan]:
    """NVIDIA Dynamo's SLA planner (throughput-based scaling), one adjustment interval.

    Per model, from the interval's metrics (Dynamo's Step 1; the simulator's window is the
    interval):

    - no traffic in the interval (no request, no measured TTFT or ITL): the adjustment is skipped
      (`plan_adjustment`: "skipping adjustment"), the pools stay as they are (at least
      `min_endpoint` per role: the deployment's own floor);
    - correction factors (Step 2): `prefill = measured TTFT / expected TTFT` (the profile's TTFT
      for one prompt of the mean input length), `decode = measured ITL / expected ITL` (the
      profile's step time at the decode replicas' concurrency, at context ISL + OSL/2). Dynamo
      reads the interval's averages; the observation carries p90s, which stand in for them;
    - load prediction (Step 3): the constant predictor, `next = current` (requests, ISL, OSL);
    - replicas (Step 4): prefill = ceil(requests x ISL / interval x min(1, prefill correction) /
      the profile's prefill tokens/s at ISL); decode = ceil(requests x OSL / interval / the best
      decode tokens/s of a replica whose ITL meets SLO / decode correction at context ISL +
      OSL/2), each at least `min_endpoint`. ISL is the full input: no cache-hit awareness.
      Where the model has no prefill pool (Dynamo's SLA mode is disaggregated) the decode pools
      carry both: the two fractional needs summed, then rounded up.

    Dynamo scales one deployment per role; several pools of a role are filled in their given
    order, each to its maximum (no choice by price), on that pool's own profile. Replica counts
    are set at once, up or down (no scale-down delay); the surplus drains."""
    seen = {o.model: o for o in observations}
    by_pool = replicas_by_pool(pools, replicas)
    p_corr, d_corr = dict(state.p_correction), dict(state.d_correction)
    isl_of, osl_of = dict(state.isl), dict(state.osl)
    decisions: dict[str, PoolDecision] = {}
    outlooks: list[ModelOutlook] = []
    for model in sorted({p.model for p in pools}):
        members = [p for p in pools if p.model == model]
        prefill_pools = [p for p in members if p.role == "prefill"]
        decode_pools = [p for p in members if p.role == "decode"]
        obs = seen.get(model)
        window = obs.window if obs is not None else None
        valid = (
            obs is not None
            and window is not None
            and window.arrivals > 0
            and obs.ttft_p90_s is not None
            and obs.itl_p90_s is not None
        )
        if not valid or window is None or obs is None:
            for group in (prefill_pools, decode_pools):
                for pool, size in _keep(group, by_pool, settings.min_endpoint).items():
                    decisions[pool.name] = _decision(
                        pool, by_pool[pool.name], size, 0.0, "no traffic: adjustment skipped"
                    )
            outlooks.append(_outlook(model, obs, isl_of.get(model, 0.0), osl_of.get(model, 0.0), 0.0, 0.0))
            continue
        isl = window.prompt_tokens / window.arrivals
        osl = window.output_tokens / window.completed if window.completed else osl_of.get(model, 1.0)
        isl_of[model], osl_of[model] = isl, osl
        interval = max(1e-9, window.end - window.start)
        context = isl + osl / 2.0
        first_prefill = (prefill_pools or decode_pools)[0]
        if settings.correction and obs.ttft_p90_s is not None:
            p_corr[model] = obs.ttft_p90_s / prefill_seconds(first_prefill.profile, isl)
        serving_decode = [r for p in decode_pools for r in by_pool[p.name] if r.state == "serving"]
        if settings.correction and obs.itl_p90_s is not None and serving_decode:
            concurrency = max(1, round(sum(r.running for r in serving_decode) / len(serving_decode)))
            perf = decode_pools[0].profile.perf
            expected = perf.decode_seconds(concurrency, int(concurrency * context)) + perf.step_overhead_s
            d_corr[model] = obs.itl_p90_s / expected
        num_req = float(window.arrivals)
        prefill_load = num_req * isl / interval * min(1.0, p_corr.get(model, 1.0))
        decode_load = num_req * osl / interval
        factor = d_corr.get(model, 1.0)
        corrected_itl = settings.slo.itl_s / factor if factor > 0 else settings.slo.itl_s
        itl_slo = Slo(ttft_s=settings.slo.ttft_s, itl_s=max(1e-6, corrected_itl))

        why_p = f"{num_req:.0f} req x ISL {isl:.0f} / {interval:.0f} s x min(1, {p_corr.get(model, 1.0):.2f})"
        why_d = f"{num_req:.0f} req x OSL {osl:.0f} / {interval:.0f} s at ITL {corrected_itl:.3g} s"
        if prefill_pools:
            needs_p = {p.name: prefill_load / _prefill_rate(p, isl) for p in prefill_pools}
            sizes = _fill_in_order(prefill_pools, needs_p, settings.min_endpoint)
            for p in prefill_pools:
                decisions[p.name] = _decision(
                    p, by_pool[p.name], sizes[p.name], needs_p[p.name], f"{why_p}: {prefill_load:.0f} tok/s"
                )
            needs_d = {p.name: decode_load / _decode_rate(p, isl, context, itl_slo) for p in decode_pools}
            why = f"{why_d}: {decode_load:.0f} tok/s"
        else:
            needs_d = {
                p.name: prefill_load / _prefill_rate(p, isl)
                + decode_load / _decode_rate(p, isl, context, itl_slo)
                for p in decode_pools
            }
            why = f"{why_p} + {why_d}"
        sizes = _fill_in_order(decode_pools, needs_d, settings.min_endpoint)
        for p in decode_pools:
            decisions[p.name] = _decision(p, by_pool[p.name], sizes[p.name], needs_d[p.name], why)
        outlooks.append(_outlook(model, obs, isl, osl, prefill_load, decode_load))
    new_state = DynamoState(p_correction=p_corr, d_correction=d_corr, isl=isl_of, osl=osl_of)
    return new_state, _plan(now, [decisions[p.name] for p in pools], outlooks)


def _prefill_rate(pool: Pool, isl: float) -> float:
    """The profile's prefill tokens per second for a prompt of `isl` tokens alone."""
    return isl / prefill_seconds(pool.profile, isl)


def _decode_rate(pool: Pool, isl: float, context: float, slo: Slo) -> float:
    """The most output tokens per second a replica gives with its ITL within `slo` (Dynamo's
    `find_best_throughput_per_gpu`): the largest batch whose step fits, KV and `max_running`
    allowing (capacity.py)."""
    return replica_capacity(pool.profile, uncached_prompt=isl, context=context, slo=slo).decode_tokens_per_s


def _keep(group: Sequence[Pool], by_pool: Mapping[str, list[Replica]], floor: int) -> dict[Pool, int]:
    """The pools as they are (within their limits), the role at least `floor` replicas."""
    sizes = {
        p: min(p.max_replicas, max(p.min_replicas, sum(1 for r in by_pool[p.name] if r.state != "draining")))
        for p in group
    }
    _floor(group, sizes, floor)
    return sizes


def _floor(group: Sequence[Pool], sizes: dict[Pool, int], floor: int) -> None:
    for pool in group:
        short = floor - sum(sizes.values())
        if short <= 0:
            return
        sizes[pool] += max(0, min(short, pool.max_replicas - sizes[pool]))


def _fill_in_order(group: Sequence[Pool], needs: Mapping[str, float], floor: int) -> dict[str, int]:
    """Replicas per pool for a role's load: each pool (in order) takes as much of what is left as
    its maximum allows; every pool at least its minimum, the role at least `floor`."""
    sizes: dict[Pool, int] = {}
    left = 1.0  # the share of the role's load not placed yet
    for pool in group:
        need = needs[pool.name]
        if need <= 0 or not math.isfinite(need):
            count = 0
        else:
            count = min(pool.max_replicas, math.ceil(left * need - 1e-9))
        count = max(pool.min_replicas, count)
        sizes[pool] = count
        if need > 0 and math.isfinite(need):
            left = max(0.0, left - count / need)
    _floor(group, sizes, floor)
    return {p.name: n for p, n in sizes.items()}


# ---------------------------------------------------------------- HPA on a queue, with KEDA


@dataclass(frozen=True, slots=True)
class HpaSettings:
    """HPA's defaults: the controller's sync period (`--horizontal-pod-autoscaler-sync-period`,
    15 s), tolerance (`--horizontal-pod-autoscaler-tolerance`, 0.1), scale-down stabilisation
    window (300 s), scale-up with no stabilisation and at most the larger of doubling or 4 more
    pods per period; KEDA's `cooldownPeriod` (300 s) before a pool with `minReplicaCount: 0`
    goes to zero, and activation (0 -> 1) as soon as its trigger's metric is above zero.

    The targets are the operator's: queued + running sequences per replica, for decode
    (aggregated) replicas and for prefill replicas (which hold a sequence only while prefilling
    it). Not fitted to any workload."""

    decode_target: float = 64.0
    prefill_target: float = 8.0
    interval_s: float = 15.0
    tolerance: float = 0.1
    scale_down_window_s: float = 300.0
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        if self.decode_target <= 0 or self.prefill_target <= 0:
            raise ValueError("targets must be > 0")
        if self.interval_s <= 0 or self.tolerance < 0 or self.scale_down_window_s < 0 or self.cooldown_s < 0:
            raise ValueError("interval_s must be > 0; tolerance, windows and cooldown >= 0")


@dataclass(frozen=True, slots=True)
class HpaState:
    """Per pool: its recent recommendations (time, replicas), and when KEDA last saw its trigger
    active (queued or running work, or requests held for the model)."""

    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    active_at: Mapping[str, float] = field(default_factory=dict)


def hpa_queue(
    state: HpaState,
    observations: Iterable[Observation],
    pools: Sequence[Pool],
    replicas: Iterable[Replica],
    settings: HpaSettings,
    now: float,
    *,
    queued: Mapping[str, int] | None = None,
) -> tuple[HpaState, Plan]:
    """One HPA sync per pool (a Deployment each), on the metric queued + running sequences per
    replica (`queued` maps a replica to the sequences waiting on it; `Replica.running` those in
    its batch).

    - Kubernetes' replica calculator: usage ratio = the metric averaged over the ready replicas /
      the target; within the tolerance (|ratio - 1| <= 0.1) nothing changes; otherwise desired =
      ceil(ratio x replicas). Replicas not ready yet (warming) count as using nothing on a
      scale-up and as at the target on a scale-down (as the calculator treats pods without a
      metric), so a scale-up in progress is not asked for again.
    - Behaviour (defaults): a scale-up acts at once, by at most max(double, +4); a scale-down
      takes the highest recommendation of the last 300 s (stabilisation window).
    - KEDA: at zero, the pool is activated (to max(1, min)) when its trigger is active: requests
      are held for the model (the gateway's queue every pool's ScaledObject watches); it goes to
      zero (where its minimum is 0) once the trigger has been inactive for `cooldown_s`. Between
      1 and its maximum, HPA decides.
    """
    seen = {o.model: o for o in observations}
    queued = queued or {}
    by_pool = replicas_by_pool(pools, replicas)
    recommendations = dict(state.recommendations)
    active_at = dict(state.active_at)
    decisions: list[PoolDecision] = []
    for pool in pools:
        members = by_pool[pool.name]
        ready = [r for r in members if r.state == "serving"]
        warming = [r for r in members if r.state == "warming"]
        current = len(ready) + len(warming)
        obs = seen.get(pool.model)
        held = obs.held if obs is not None else 0
        work = sum(r.running + queued.get(r.replica_id, 0) for r in ready)
        target = settings.prefill_target if pool.role == "prefill" else settings.decode_target
        if work > 0 or held > 0 or pool.name not in active_at:
            active_at[pool.name] = now
        floor = max(1, pool.min_replicas)
        if current == 0:
            proposal = floor if (held > 0 or pool.min_replicas > 0) else 0
            why = f"KEDA: {held} held, activate" if proposal else "KEDA: at zero, trigger inactive"
        elif not ready:
            proposal, why = current, "no ready replica reports the metric yet"
        else:
            proposal, why = _hpa_proposal(work, len(ready), len(warming), target, settings)
            proposal = min(proposal, max(2 * current, current + settings.scale_up_pods))
        history = tuple(
            (t, n) for t, n in recommendations.get(pool.name, ()) if now - t < settings.scale_down_window_s
        )
        desired = _stabilised(current, proposal, history)
        recommendations[pool.name] = (*history, (now, proposal))
        if current > 0:
            desired = max(floor, desired)
            idle_for = now - active_at[pool.name]
            if pool.min_replicas == 0 and work == 0 and held == 0 and idle_for >= settings.cooldown_s:
                desired = 0
                why = f"KEDA: trigger inactive {idle_for:.0f} s (cooldown {settings.cooldown_s:g} s)"
        desired = min(pool.max_replicas, desired)
        need = work / target
        decisions.append(_decision(pool, members, desired, need, why))
    outlooks = [
        _outlook(model, seen.get(model), 0.0, 0.0, 0.0, 0.0) for model in sorted({p.model for p in pools})
    ]
    return HpaState(recommendations=recommendations, active_at=active_at), _plan(now, decisions, outlooks)


def _hpa_proposal(
    work: int, ready: int, warming: int, target: float, settings: HpaSettings
) -> tuple[int, str]:
    current = ready + warming
    ratio = work / (ready * target)
    why = f"{work} sequences on {ready} ready, target {target:g}/replica: ratio {ratio:.2f}"
    if abs(ratio - 1.0) <= settings.tolerance:
        return current, why + " (within tolerance)"
    if ratio > 1.0:
        ratio = work / (current * target)  # warming replicas at zero use
    else:
        ratio = (work + warming * target) / (current * target)  # warming replicas at the target
    if abs(ratio - 1.0) <= settings.tolerance or (ratio > 1.0) != (work / (ready * target) > 1.0):
        return current, why
    return math.ceil(ratio * current - 1e-9), why


def _stabilised(current: int, proposal: int, history: Sequence[tuple[float, int]]) -> int:
    """Kubernetes' `stabilizeRecommendationWithBehaviors`: up at once to the proposal; down only to
    the highest recommendation within the window."""
    down = max([proposal, *(n for _, n in history)])
    recommendation = current
    if recommendation < proposal:
        recommendation = proposal
    if recommendation > down:
        recommendation = down
    return recommendation
