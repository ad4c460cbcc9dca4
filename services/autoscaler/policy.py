"""The autoscaler's plan: how many replicas each pool should have, which ones go, and why. Pure:
state, observations and the clock in; the new state and a plan out. The mesh's autoscaler
service and the simulator run this same function.

Per model, once per planning interval (and at once when a request is held for a model with no
replica, or a measured SLO is missed):

1. **Forecast** (forecast.py): the arrival rate a replica started now would meet once it is
   ready (the horizon is the pools' start-up time plus an interval), the larger of that and the
   rate seen now; the request mix (prompt, output, cache hit) as moving averages.
2. **Load**: uncached prompt tokens per second for prefill (the cache hit rate lowers it), output
   tokens per second for decode, plus the prompt backlog waiting to be prefilled, to clear within
   the TTFT SLO.
3. **Reactive correction**: where a measured TTFT (or inter-token latency) is over its SLO while
   traffic arrives, the role grows to at least its serving replicas x measured / SLO (at most
   `max_reactive_factor`), replicas warming counting towards it: the profile was optimistic,
   and a burst does not wait for the forecast.
4. **Allocation** (capacity.py): each pool's replicas cover a share of the load; a model with a
   prefill pool is disaggregated (prefill pools take the prompts, decode pools the outputs),
   otherwise its decode pools serve both. The pools of one role are filled cheapest per unit of
   work first (price over what one replica does at the SLO), within each pool's min and max; so
   capacity is added where it is cheapest and, when the need falls, removed where it is dearest.
   The prefill/decode split is an output of the loads, not a constant.
5. **Fleet budget** ($/hour across models): the plan is cut, dearest work first, until it fits.
6. **Hysteresis**: a scale-up acts at once (replicas warming count as capacity coming); a
   scale-down needs the load to fit fewer replicas even at `scale_down_band` of the target
   utilisation, continuously for `scale_down_delay_s`, and that long after the pool last grew.
   The replicas that go are the warming ones first, then those holding the fewest cached blocks
   (the fleet loses the least cached prefix) and the least running work; they are drained.
7. **Zero**: a model whose pools allow zero goes to zero after `idle_to_zero_s` without traffic;
   a held request brings one replica per role back at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.autoscaler.capacity import EngineProfile, ReplicaCapacity, Slo, replica_capacity
from services.autoscaler.forecast import ForecastSettings, ModelForecast, Window

Role = Literal["prefill", "decode"]
ReplicaState = Literal["warming", "serving", "draining"]


@dataclass(frozen=True, slots=True)
class Pool:
    """A pool of identical replicas serving one model (config: the pool's GPU, price, limits)."""

    name: str
    model: str
    role: Role  # "decode" pools serve prefill too where the model has no prefill pool
    gpu_type: str
    price_per_hour: float
    profile: EngineProfile
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < 0:
            raise ValueError(f"pool {self.name}: replica limits must be >= 0")
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"pool {self.name}: min_replicas {self.min_replicas} > max_replicas {self.max_replicas}"
            )
        if self.price_per_hour < 0:
            raise ValueError(f"pool {self.name}: price_per_hour must be >= 0")


@dataclass(frozen=True, slots=True)
class Replica:
    replica_id: str
    pool: str
    state: ReplicaState
    cached_blocks: int = 0
    running: int = 0


@dataclass(frozen=True, slots=True)
class Observation:
    """One model's traffic over the last window, and what was measured of it."""

    model: str
    window: Window
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    queued_prompt_tokens: int = 0  # waiting on the workers to be prefilled
    held: int = 0  # waiting for a replica: the model has none that serves
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Settings:
    slo: Slo = field(default_factory=Slo)
    interval_s: float = 5.0
    # Not fitted: HPA's default stabilisation window is 300 s; a minute suits a fleet whose
    # replicas start in about that.
    scale_down_delay_s: float = 60.0
    scale_down_band: float = 0.85
    idle_to_zero_s: float = 300.0
    budget_per_hour: float | None = None
    max_reactive_factor: float = 2.0
    # A prompt's KV handed from a prefill to a decode worker costs this (the ledger prices it
    # so): 0 plans disaggregated whenever the model has prefill pools.
    kv_transfer_usd_per_gb: float = 0.0
    forecast: ForecastSettings = field(default_factory=ForecastSettings)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if not 0 < self.scale_down_band <= 1:
            raise ValueError("scale_down_band must be in (0, 1]")
        if self.budget_per_hour is not None and self.budget_per_hour < 0:
            raise ValueError("budget_per_hour must be >= 0")
        if self.max_reactive_factor < 1:
            raise ValueError("max_reactive_factor must be >= 1")


# How far back the planner remembers how many replicas served: past any TTFT worth reacting to.
SERVING_HISTORY_S = 600.0


@dataclass(frozen=True, slots=True)
class PlannerState:
    forecasts: Mapping[str, ModelForecast] = field(default_factory=dict)
    busy_at: Mapping[str, float] = field(default_factory=dict)  # per model: last traffic seen
    below_since: Mapping[str, float] = field(default_factory=dict)  # per pool
    grew_at: Mapping[str, float] = field(default_factory=dict)  # per pool
    # Per pool, (when, replicas serving) at each recent plan: the capacity a measured latency
    # came from, when the requests behind it waited plans ago.
    serving_history: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelOutlook:
    model: str
    observed_rate: float
    forecast_rate: float
    horizon_s: float
    mean_prompt: float
    mean_output: float
    hit_rate: float
    prefill_load: float  # uncached prompt tokens per second planned for
    decode_load: float  # output tokens per second planned for
    ttft_p90_s: float | None
    itl_p90_s: float | None
    held: int
    # The squared coefficient of variation of a prompt's uncached tokens (0: not measured), which
    # lowers the prefill utilisation planned at (capacity.py).
    uncached_cv2: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolDecision:
    pool: str
    model: str
    role: Role
    gpu_type: str
    serving: int
    warming: int
    draining: int
    desired: int
    add: int
    remove: tuple[str, ...]
    utilisation: float  # predicted share of the pool's SLO capacity in use once the plan is done
    cost_per_hour: float  # the pool's once the plan is done
    reason: str

    @property
    def changes(self) -> bool:
        return self.add > 0 or bool(self.remove)


@dataclass(frozen=True, slots=True)
class Plan:
    at: float
    pools: tuple[PoolDecision, ...]
    models: tuple[ModelOutlook, ...]
    cost_per_hour: float
    budget_per_hour: float | None

    def pool(self, name: str) -> PoolDecision | None:
        return next((p for p in self.pools if p.pool == name), None)

    @property
    def changes(self) -> tuple[PoolDecision, ...]:
        return tuple(p for p in self.pools if p.changes)


def plan(
    state: PlannerState,
    observations: Iterable[Observation],
    pools: Sequence[Pool],
    replicas: Iterable[Replica],
    settings: Settings,
    now: float,
) -> tuple[PlannerState, Plan]:
    seen = {o.model: o for o in observations}
    forecasts = dict(state.forecasts)
    busy_at = dict(state.busy_at)
    for model in {p.model for p in pools}:
        busy_at.setdefault(model, now)  # first planned now: idle counts from here
    for model, observation in seen.items():
        if not _long_enough(observation, settings):
            continue  # a plan woken right after another: too short a window to say a rate
        forecasts[model] = forecasts.get(model, ModelForecast()).observe(
            observation.window, settings.forecast
        )
        if (
            observation.window.arrivals
            or observation.held
            or observation.in_flight
            or observation.queued_prompt_tokens
        ):
            busy_at[model] = now
    by_pool = replicas_by_pool(pools, replicas)
    serving_history = {
        p.name: (
            *((t, n) for t, n in state.serving_history.get(p.name, ()) if now - t < SERVING_HISTORY_S),
            (now, sum(1 for r in by_pool[p.name] if r.state == "serving")),
        )
        for p in pools
    }

    models = sorted({p.model for p in pools})
    outlooks: list[ModelOutlook] = []
    targets: dict[str, _Target] = {}
    for model in models:
        members = [p for p in pools if p.model == model]
        forecast = forecasts.get(model, ModelForecast())
        outlook = _outlook(model, members, forecast, seen.get(model), settings, now)
        outlooks.append(outlook)
        # A TTFT is measured as requests get their first token: they waited that long, on the
        # replicas serving then. Replicas that joined since are capacity the measure never saw.
        lookback = max(settings.interval_s, outlook.ttft_p90_s or 0.0)
        measured_on = {
            p.name: min(n for t, n in serving_history[p.name] if now - t <= lookback) for p in members
        }
        targets.update(_allocate(outlook, members, by_pool, measured_on, busy_at.get(model), settings, now))
    current = {p.name: sum(1 for r in by_pool[p.name] if r.state != "draining") for p in pools}
    _fit_budget(targets, pools, current, settings)

    below_since = dict(state.below_since)
    grew_at = dict(state.grew_at)
    decisions = []
    for pool in pools:
        decision = _decide(pool, targets[pool.name], by_pool[pool.name], below_since, grew_at, settings, now)
        decisions.append(decision)
    new_state = PlannerState(
        forecasts=forecasts,
        busy_at=busy_at,
        below_since=below_since,
        grew_at=grew_at,
        serving_history=serving_history,
    )
    return new_state, Plan(
        at=now,
        pools=tuple(decisions),
        models=tuple(outlooks),
        cost_per_hour=round(sum(d.cost_per_hour for d in decisions), 4),
        budget_per_hour=settings.budget_per_hour,
    )


# ---------------------------------------------------------------- load


def _long_enough(observation: Observation, settings: Settings) -> bool:
    window = observation.window
    return window.end - window.start >= 0.5 * settings.interval_s


def _outlook(
    model: str,
    members: Sequence[Pool],
    forecast: ModelForecast,
    observation: Observation | None,
    settings: Settings,
    now: float,
) -> ModelOutlook:
    horizon = max(p.startup_s for p in members) + settings.interval_s
    long_enough = observation is not None and _long_enough(observation, settings)
    observed = observation.window.rate if observation is not None and long_enough else forecast.level
    ahead = forecast.predict(now + horizon, settings.forecast)
    rate = max(observed, ahead)
    uncached = forecast.mean_prompt * (1.0 - forecast.hit_rate)
    queued = observation.queued_prompt_tokens if observation is not None else 0
    held = observation.held if observation is not None else 0
    # The backlog on the workers clears within the TTFT SLO; held requests (no replica yet)
    # wait for one to start anyway, so theirs is spread over the start-up horizon.
    prefill_load = (
        rate * uncached + queued / settings.slo.ttft_s + held * uncached / max(settings.slo.ttft_s, horizon)
    )
    decode_load = rate * forecast.mean_output
    return ModelOutlook(
        model=model,
        observed_rate=round(observed, 4),
        forecast_rate=round(ahead, 4),
        horizon_s=horizon,
        mean_prompt=round(forecast.mean_prompt, 1),
        mean_output=round(forecast.mean_output, 1),
        hit_rate=round(forecast.hit_rate, 4),
        prefill_load=prefill_load,
        decode_load=decode_load,
        ttft_p90_s=observation.ttft_p90_s if observation is not None else None,
        itl_p90_s=observation.itl_p90_s if observation is not None else None,
        held=held,
        uncached_cv2=round(forecast.uncached_cv2, 4),
    )


@dataclass(slots=True)
class _Target:
    """A pool's target sizes: `up` at the target utilisation, `down` the size a scale-down may
    go to (the load at the down band); `need` the fractional replicas its share needs."""

    up: int
    down: int
    need: float
    unit_cost: float  # $/hour per replica-share of the role's whole load (lower is cheaper work)
    floor: int  # the fewest the budget may cut it to
    reasons: list[str]
    immediate_down: bool = False  # to zero, or cut by the budget: no delay


def _allocate(
    outlook: ModelOutlook,
    members: Sequence[Pool],
    by_pool: Mapping[str, list[Replica]],
    measured_on: Mapping[str, int],
    busy_at: float | None,
    settings: Settings,
    now: float,
) -> dict[str, _Target]:
    uncached = outlook.mean_prompt * (1.0 - outlook.hit_rate)
    context = outlook.mean_prompt + outlook.mean_output / 2.0
    cv2 = outlook.uncached_cv2
    disaggregated, mode_reason = _serving_mode(members, uncached, context, cv2, settings)
    idle = busy_at is not None and now - busy_at >= settings.idle_to_zero_s
    targets: dict[str, _Target] = {}
    for role in ("prefill", "decode"):
        group = [p for p in members if p.role == role]
        if not group:
            continue
        if role == "prefill" and not disaggregated:
            for p in group:  # the decode pools serve the prompts: these stay at their minimum
                reason = f"{mode_reason}; kept at its minimum"
                targets[p.name] = _Target(p.min_replicas, p.min_replicas, 0.0, 0.0, p.min_replicas, [reason])
            continue
        capacities = {
            p.name: replica_capacity(
                p.profile, uncached_prompt=uncached, context=context, slo=settings.slo, uncached_cv2=cv2
            )
            for p in group
        }
        factor, why = _reactive(outlook, role, disaggregated, settings)

        # The forecast's need as the profile says; a missed SLO scales the replicas serving (below),
        # not the need, which would count the same shortfall twice while replicas warm.
        needs = {p.name: _share(outlook, role, disaggregated, capacities[p.name]) for p in group}
        up = _fill(group, needs, 1.0)
        down = _fill(group, needs, 1.0 / settings.scale_down_band)
        if factor > 1.0:
            # Measured over the SLO: the replicas it was measured on fell short, whatever the
            # profile says. Those that joined since, and those warming, count towards it: they
            # are capacity already come or coming, not more needed.
            measured = sum(measured_on[p.name] for p in group)
            _grow_to(group, up, math.ceil(measured * factor - 1e-9), needs)
            why = [f"{why[0]} on the {measured} serving then"] if why else why
            for name, size in up.items():
                down[name] = max(down[name], size)
        to_zero = idle and all(p.min_replicas == 0 for p in group) and outlook.held == 0
        reasons = {p.name: list(why) for p in group}
        running_now = sum(1 for p in group for r in by_pool[p.name] if r.state != "draining")
        if to_zero:
            for p in group:
                up[p.name] = down[p.name] = 0
                if by_pool[p.name]:
                    reasons[p.name].append(f"idle {settings.idle_to_zero_s:g} s: to zero")
        # A role with traffic keeps one replica until idle; one at zero comes back for a held
        # request (traffic alone cannot reach a role with no replica: admission holds it).
        elif sum(up.values()) == 0 and (outlook.held or (running_now and not idle)):
            cheapest = min(group, key=lambda p: (p.price_per_hour * max(needs[p.name], 1e-9), p.name))
            if cheapest.max_replicas > 0:
                up[cheapest.name] = down[cheapest.name] = max(down[cheapest.name], 1)
                reasons[cheapest.name].append(
                    f"from zero: {outlook.held} held" if outlook.held else "in use: one stays until idle"
                )
        for p in group:
            cap = capacities[p.name]
            reasons[p.name].append(_load_reason(outlook, role, disaggregated, cap, needs[p.name]))
            targets[p.name] = _Target(
                up=up[p.name],
                down=max(up[p.name], down[p.name]),
                need=needs[p.name],
                unit_cost=p.price_per_hour * needs[p.name],
                floor=max(p.min_replicas, 1 if up[p.name] and sum(up.values()) == up[p.name] else 0),
                reasons=reasons[p.name],
                immediate_down=to_zero,
            )
    return targets


def _serving_mode(
    members: Sequence[Pool], uncached: float, context: float, cv2: float, settings: Settings
) -> tuple[bool, str]:
    """Disaggregated (prefill pools take the prompts) or aggregated (decode pools take both):
    disaggregated when the model has prefill pools and a prompt's prefill on the cheapest of
    them, plus handing its KV to a decode worker, costs less than prefilling it on the
    cheapest decode pool. (The ITL that disaggregation protects is the SLO's business: the
    aggregated capacity accounts for prefill time on the decode replicas.)"""
    prefill = [p for p in members if p.role == "prefill" and p.max_replicas > 0]
    decode = [p for p in members if p.role == "decode" and p.max_replicas > 0]
    if not prefill:
        return False, "aggregated: no prefill pool"
    if not decode or settings.kv_transfer_usd_per_gb <= 0:
        return True, "disaggregated"

    def prefill_usd(pool: Pool) -> float:
        cap = replica_capacity(
            pool.profile, uncached_prompt=uncached, context=context, slo=settings.slo, uncached_cv2=cv2
        )
        if cap.prefill_at_slo <= 0:
            return math.inf
        return uncached / cap.prefill_at_slo * pool.price_per_hour / 3600.0

    kv_bytes = uncached * min(p.profile.perf.model.kv_bytes_per_token for p in decode)
    hand_off = kv_bytes / 1e9 * settings.kv_transfer_usd_per_gb
    apart = min(prefill_usd(p) for p in prefill) + hand_off
    together = min(prefill_usd(p) for p in decode)
    if apart < together:
        return True, f"disaggregated: prefill + KV hand-off ${apart:.2e} < ${together:.2e} on decode"
    return False, f"aggregated: prefill + KV hand-off ${apart:.2e} >= ${together:.2e} on decode"


def _share(outlook: ModelOutlook, role: Role, disaggregated: bool, cap: ReplicaCapacity) -> float:
    """Replicas of one capacity that would carry this role's whole load."""
    if role == "prefill":
        return _per(outlook.prefill_load, cap.prefill_at_slo)
    if disaggregated:
        return _per(outlook.decode_load, cap.decode_at_slo)
    return _per(outlook.prefill_load, cap.prefill_at_slo) + _per(outlook.decode_load, cap.decode_at_slo)


def _per(load: float, per_replica: float) -> float:
    if load <= 0:
        return 0.0
    return load / per_replica if per_replica > 0 else math.inf


def _reactive(
    outlook: ModelOutlook, role: Role, disaggregated: bool, settings: Settings
) -> tuple[float, list[str]]:
    """The factor the role's load is scaled by where a measured latency is over its SLO."""
    if outlook.observed_rate == 0 and outlook.held == 0:
        return 1.0, []  # latencies of requests from a load that has gone
    measured: list[tuple[str, float | None, float]] = []
    if role == "prefill" or not disaggregated:
        measured.append(("TTFT", outlook.ttft_p90_s, settings.slo.ttft_s))
    if role == "decode":
        measured.append(("ITL", outlook.itl_p90_s, settings.slo.itl_s))
    factor, why = 1.0, []
    for name, value, target in measured:
        if value is not None and value > target:
            f = min(settings.max_reactive_factor, value / target)
            if f > factor:
                factor = f
                why = [f"{name} p90 {value:.3g} s over the SLO {target:g} s: load x{f:.2f}"]
    return factor, why


def _fill(group: Sequence[Pool], needs: Mapping[str, float], scale: float) -> dict[str, int]:
    """Replicas per pool for one role: every pool at its minimum, the rest of the load placed on
    the pools cheapest per unit of work first, each up to its maximum."""
    sizes = {p.name: p.min_replicas for p in group}
    left = 1.0 - sum(sizes[p.name] / (needs[p.name] * scale) for p in group if needs[p.name] > 0)
    if all(needs[p.name] <= 0 for p in group):
        return sizes
    for pool in sorted(group, key=lambda p: (p.price_per_hour * needs[p.name], p.name)):
        if left <= 1e-9:
            break
        need = needs[pool.name] * scale
        if not math.isfinite(need):
            continue
        extra = min(pool.max_replicas - sizes[pool.name], math.ceil(left * need - 1e-9))
        if extra > 0:
            sizes[pool.name] += extra
            left -= extra / need
    return sizes


def _grow_to(group: Sequence[Pool], sizes: dict[str, int], total: int, needs: Mapping[str, float]) -> None:
    """Add replicas, cheapest work first, until the role has `total` (or every pool is full)."""
    for pool in sorted(group, key=lambda p: (p.price_per_hour * needs[p.name], p.name)):
        extra = min(pool.max_replicas - sizes[pool.name], total - sum(sizes.values()))
        if extra > 0:
            sizes[pool.name] += extra


def _load_reason(
    outlook: ModelOutlook, role: Role, disaggregated: bool, cap: ReplicaCapacity, need: float
) -> str:
    rate = f"{outlook.observed_rate:.3g}/s now, {outlook.forecast_rate:.3g}/s in {outlook.horizon_s:g} s"
    if role == "prefill" or not disaggregated:
        work = f"{outlook.prefill_load:.0f} prompt tok/s at hit {outlook.hit_rate:.0%}"
        if outlook.uncached_cv2 > 0:
            work += f" (prefill at {cap.prefill_utilisation:.0%}: prompts' CV^2 {outlook.uncached_cv2:.2g})"
        if not disaggregated:
            work += f" + {outlook.decode_load:.0f} output tok/s"
    else:
        work = f"{outlook.decode_load:.0f} output tok/s (batch {cap.decode_batch} at the ITL SLO)"
    return f"{rate}: {work} need {need:.2f} replicas here"


# ---------------------------------------------------------------- budget and hysteresis


def _fit_budget(
    targets: dict[str, _Target], pools: Sequence[Pool], current: Mapping[str, int], settings: Settings
) -> None:
    """Cut the plan, dearest work first, until the fleet's $/hour (replicas serving and warming
    once the plan is done) fits the budget."""
    budget = settings.budget_per_hour
    if budget is None:
        return
    price = {p.name: p.price_per_hour for p in pools}

    def size(name: str) -> int:
        t, now_size = targets[name], current[name]
        return t.up if t.up > now_size else (t.down if t.immediate_down and t.down < now_size else now_size)

    while sum(size(name) * price[name] for name in targets) > budget + 1e-9:
        cuttable = [
            (targets[name].unit_cost, price[name], name)
            for name in targets
            if size(name) > targets[name].floor
        ]
        if not cuttable:
            for t in targets.values():
                t.reasons.append(f"the pools' minimums cost more than the budget ${budget:g}/h")
            return
        *_, name = max(cuttable)
        target, cut_to = targets[name], size(name) - 1
        target.up = min(target.up, cut_to)
        target.down = min(target.down, cut_to)
        target.immediate_down = True
        if not any("budget" in r for r in target.reasons):
            target.reasons.append(f"capped by the fleet budget ${budget:g}/h")


def _decide(
    pool: Pool,
    target: _Target,
    members: Sequence[Replica],
    below_since: dict[str, float],
    grew_at: dict[str, float],
    settings: Settings,
    now: float,
) -> PoolDecision:
    warming = [r for r in members if r.state == "warming"]
    serving = [r for r in members if r.state == "serving"]
    current = len(warming) + len(serving)
    reasons = list(target.reasons)
    add, remove = 0, tuple[str, ...]()
    desired = current
    if target.up > current:
        add = target.up - current
        desired = target.up
        grew_at[pool.name] = now
        below_since.pop(pool.name, None)
        reasons.insert(0, f"scale up {current} -> {desired}")
    elif target.down < current:
        since = below_since.setdefault(pool.name, now)
        settled = now - since >= settings.scale_down_delay_s and now - grew_at.get(pool.name, -math.inf) >= (
            settings.scale_down_delay_s
        )
        if settled or target.immediate_down:
            desired = target.down
            remove = _to_remove(warming, serving, current - desired)
            below_since.pop(pool.name, None)
            reasons.insert(0, f"scale down {current} -> {desired}: drain {', '.join(remove)}")
        else:
            wait = settings.scale_down_delay_s - min(now - since, now - grew_at.get(pool.name, -math.inf))
            reasons.insert(
                0, f"steady at {current}: fits {target.down}, scale-down in {max(0.0, wait):.0f} s"
            )
    else:
        below_since.pop(pool.name, None)
        reasons.insert(0, f"steady at {current}")
    return pool_decision(pool, members, desired, add, remove, target.need, "; ".join(reasons))


def pool_decision(
    pool: Pool,
    members: Sequence[Replica],
    desired: int,
    add: int,
    remove: tuple[str, ...],
    need: float,
    reason: str,
) -> PoolDecision:
    """A pool's decision as plans report it (this policy's and the baselines'): its replicas by
    state, the change, and the predicted use and $/hour once done (`need`: the fractional
    replicas its load needs; utilisation -1 for a load with no replica to carry it)."""
    utilisation = need / desired if desired else (0.0 if need == 0 else math.inf)
    return PoolDecision(
        pool=pool.name,
        model=pool.model,
        role=pool.role,
        gpu_type=pool.gpu_type,
        serving=sum(1 for r in members if r.state == "serving"),
        warming=sum(1 for r in members if r.state == "warming"),
        draining=sum(1 for r in members if r.state == "draining"),
        desired=desired,
        add=add,
        remove=remove,
        utilisation=round(utilisation, 4) if math.isfinite(utilisation) else -1.0,
        cost_per_hour=round(desired * pool.price_per_hour, 4),
        reason=reason,
    )


def replicas_by_pool(pools: Sequence[Pool], replicas: Iterable[Replica]) -> dict[str, list[Replica]]:
    """Each pool's replicas (those of pools not given are left out)."""
    by_pool: dict[str, list[Replica]] = {p.name: [] for p in pools}
    for replica in replicas:
        if replica.pool in by_pool:
            by_pool[replica.pool].append(replica)
    return by_pool


def _to_remove(warming: Sequence[Replica], serving: Sequence[Replica], count: int) -> tuple[str, ...]:
    """The warming replicas first (nothing cached, nothing running), then those whose going
    loses the fewest cached blocks and the least running work."""
    ordered = list(reversed(warming)) + sorted(
        serving, key=lambda r: (r.cached_blocks, r.running, r.replica_id)
    )
    return tuple(r.replica_id for r in ordered[:count])
