"""Autoscaler: plan each pool's size (policy.py) and carry the plan out through an actuator.

Every `interval_s`, and at once when admission holds a request for a model with no worker
(`CapacityWanted`) or the window's TTFT is already over the SLO, it:

1. closes the traffic window (traffic.py: arrivals from ``rmesh.prepared.*``, prefills and
   decodes from their lifecycle events, heard on core NATS: a window missed while this process
   restarts only delays the forecast);
2. reads the fleet from the WORKERS heartbeats (serving or draining) and from the actuator
   (started, not heartbeating yet: warming);
3. plans, under an `autoscaler.plan` span, and publishes the plan as a `ScalingDecision`
   (`mode` act or observe) on ``rmesh.events.scaling``;
4. acting, sends each pool's change to the actuator, bounded by `actuator_timeout_s`; a failure
   is logged, counted and named in the next decision's `failed`, and the plan is made again at
   the next interval (nothing is lost: running replicas are untouched).

Without an actuator (`ripplemesh run autoscaler` alone) it only observes. Which pools it sizes
comes from the `[autoscaler]` config; without pools there, it plans the pools its workers
announce, each kept at its size (observe-only, in effect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import propagate, trace
from opentelemetry.trace import Link
from prometheus_client import Counter, Gauge, Histogram
from starlette.routing import BaseRoute

from schemas.events import (
    CapacityWanted,
    DecodeCompleted,
    ModelOutlook,
    PoolPlan,
    PrefillCompleted,
    RequestPrepared,
    ScalingDecision,
    WorkerState,
    decode_event,
    new_event_id,
)
from schemas.subjects import PREFIX, WORKERS, event_subject
from services.autoscaler.actuator import Actuator, ActuatorError, PoolActual, ScaleAction
from services.autoscaler.capacity import EngineProfile, Slo
from services.autoscaler.forecast import ForecastSettings
from services.autoscaler.policy import Plan, PlannerState, Pool, Replica, Settings, plan
from services.autoscaler.traffic import TrafficMeter
from services.engines.sim.perf import PerfModel
from services.engines.sim.profiles import gpu, model_shape
from services.mesh.config import AutoscalerConfig, MeshConfig
from services.mesh.heartbeat_watch import HeartbeatWatch
from services.mesh.runtime import Runtime
from services.mesh.tracing import extract_context, link_to, tracer

log = logging.getLogger(__name__)

REPLICAS = Gauge("ripplemesh_autoscaler_replicas", "Replicas per pool (serving + warming).", ["pool"])
DESIRED = Gauge("ripplemesh_autoscaler_desired_replicas", "The plan's replicas per pool.", ["pool"])
SCALE_EVENTS = Counter(
    "ripplemesh_autoscaler_scale_events_total",
    "Replicas started (up) or drained (down), by pool and the plan's trigger.",
    ["pool", "direction", "trigger"],
)
ACTUATOR_FAILURES = Counter(
    "ripplemesh_autoscaler_actuator_failures_total", "Actions the platform failed.", ["pool"]
)
TIME_TO_READY = Histogram(
    "ripplemesh_autoscaler_time_to_ready_seconds",
    "From the plan that started a replica to its first heartbeat.",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
COST = Gauge("ripplemesh_autoscaler_cost_per_hour", "The planned fleet's $/hour.")

# What makes a plan: its interval, a TTFT over the SLO, a request held for want of a worker.
TRIGGERS = ("interval", "slo", "held")
# A TTFT over the SLO in the window so far plans at once, at most this often.
SLO_CHECK_S = 1.0
MIN_REPLAN_S = 2.0
# A `CapacityWanted` counts this long (admission repeats it while it holds requests).
HELD_FOR_S = 10.0
# At most this many requests (arrived, slow) of each kind are linked from a plan's span.
LINKS_KEPT = 8

_state_decoder = msgspec.json.Decoder(WorkerState)


class AutoscalerService:
    name: ClassVar[str] = "autoscaler"
    background: ClassVar[bool] = True  # see services.mesh.runtime.BACKGROUND_NICENESS

    def __init__(self, actuator: Actuator | None = None) -> None:
        self.runtime: Runtime | None = None
        self.actuator = actuator
        self.state = PlannerState()
        self.last_plan: Plan | None = None
        self.last_decision: ScalingDecision | None = None
        self.workers: dict[str, WorkerState] = {}
        self._held: dict[str, tuple[int, float]] = {}  # model -> (held, heard at)
        self._wake = asyncio.Event()
        self._trigger: str = "interval"
        self._failed: list[str] = []
        self._slow: list[Link] = []
        # Requests that arrived since the last plan (the first LINKS_KEPT): the traffic it
        # forecast from.
        self._arrivals: list[Link] = []
        self._started_by: dict[str, tuple[str, float]] = {}  # worker -> (decision id, planned at)
        self._subscriptions: list[Subscription] = []
        self._time_scales: dict[str, float] = {}  # per pool, its workers' last (kept at zero)
        self.meter = TrafficMeter(started_at=time.time())

    # ------------------------------------------------------------ lifecycle

    async def start(self, runtime: Runtime) -> None:
        self.runtime = runtime
        if self.actuator is None:
            self.actuator = _actuator_from_options(runtime)
        nc = runtime.bus.nc
        for subject, handler in (
            (f"{PREFIX}.prepared.*", self._on_prepared),
            (event_subject("prefill_completed"), self._on_event),
            (event_subject("decode_completed"), self._on_event),
            (event_subject("capacity"), self._on_event),
        ):
            self._subscriptions.append(await nc.subscribe(subject, cb=handler))
        runtime.spawn(self._watch_workers(), "watch-workers")
        runtime.spawn(self._plan_loop(), "plan")
        runtime.spawn(self._slo_watch(), "slo-watch")

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    def routes(self) -> list[BaseRoute]:
        return []

    def health(self) -> dict[str, Any]:
        plan_ = self.last_plan
        return {
            "mode": "act" if self.actuator is not None else "observe",
            "pools": {p.pool: p.desired for p in plan_.pools} if plan_ else {},
            "cost_per_hour": plan_.cost_per_hour if plan_ else None,
        }

    @property
    def config(self) -> AutoscalerConfig:
        assert self.runtime is not None
        return self.runtime.config.autoscaler

    # ------------------------------------------------------------ what it hears

    async def _on_prepared(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # admission dead-letters it; a rate estimate does not depend on it
        if isinstance(event, RequestPrepared):
            request = event.request
            self.meter.arrived(request.model, len(request.prompt_tokens), request.max_tokens)
            if len(self._arrivals) < LINKS_KEPT:
                span = trace.get_current_span(extract_context(msg.headers)).get_span_context()
                if span.is_valid:
                    self._arrivals.append(Link(span, {"ripple.link": "arrival"}))

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # the ledger dead-letters it
        if isinstance(event, PrefillCompleted):
            self.meter.prefilled(
                event.worker_id, event.request_id, event.prompt_tokens, event.cached_tokens, event.ttft_s
            )
            if event.ttft_s > self.config.ttft_slo_s and len(self._slow) < LINKS_KEPT:
                span = trace.get_current_span(extract_context(msg.headers)).get_span_context()
                if span.is_valid:
                    self._slow.append(
                        Link(span, {"ripple.link": "slow_request", "ripple.ttft_s": event.ttft_s})
                    )
        elif isinstance(event, DecodeCompleted):
            self.meter.completed(
                event.worker_id, event.request_id, event.usage.completion_tokens, event.latency_s
            )
        elif isinstance(event, CapacityWanted):
            self._held[event.model] = (event.held, time.time())
            self._wake_for("held")

    async def _watch_workers(self) -> None:
        assert self.runtime is not None
        watch = HeartbeatWatch(await self.runtime.bus.key_value(WORKERS))
        async for entry in watch.updates():
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.workers.pop(entry.key, None)
                continue
            try:
                state = _state_decoder.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("bad worker state ignored", extra={"key": entry.key})
                continue
            if state.worker_id not in self.workers and state.worker_id in self._started_by:
                _, planned_at = self._started_by.pop(state.worker_id)
                TIME_TO_READY.observe(max(0.0, time.time() - planned_at))
            self.workers[state.worker_id] = state
            self.meter.worker_models[state.worker_id] = state.model
            self._time_scales[state.pool] = state.time_scale

    def _wake_for(self, trigger: str) -> None:
        if self._trigger == "interval" or trigger == "held":
            self._trigger = trigger
        self._wake.set()

    async def _slo_watch(self) -> None:
        """A burst does not wait for the interval: a TTFT over the SLO in the window plans now."""
        while True:
            await asyncio.sleep(SLO_CHECK_S)
            models = {w.model for w in self.workers.values()}
            if any((self.meter.ttft_p90(m) or 0.0) > self.config.ttft_slo_s for m in models):
                self._wake_for("slo")

    # ------------------------------------------------------------ planning

    async def _plan_loop(self) -> None:
        last = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.interval_s)
            # A wake right after a plan waits a little: one burst, one plan.
            await asyncio.sleep(max(0.0, last + MIN_REPLAN_S - time.time()))
            self._wake.clear()
            trigger, self._trigger = self._trigger, "interval"
            try:
                await self.plan_once(trigger)
            except Exception:
                log.exception("planning failed; the last plan stands")
            last = time.time()

    async def plan_once(self, trigger: str = "interval") -> ScalingDecision:
        assert self.runtime is not None
        now = time.time()
        actual = await self._actual()
        pools = self._pools(actual)
        for pool in pools:  # every pool's series from the start, so increase() sees its first step
            for direction in ("up", "down"):
                for known in TRIGGERS:
                    SCALE_EVENTS.labels(pool.name, direction, known)
        models = sorted({p.model for p in pools})
        held = {m: n for m, (n, at) in self._held.items() if now - at <= HELD_FOR_S}
        queued: dict[str, int] = {}
        in_flight: dict[str, int] = {}
        for worker in self.workers.values():
            queued[worker.model] = queued.get(worker.model, 0) + (worker.queued_tokens or 0)
            in_flight[worker.model] = in_flight.get(worker.model, 0) + worker.running + worker.queue_depth
        # A plan woken right after another sees the window so far, which goes on accumulating.
        long_enough = now - self.meter.started_at >= 0.5 * self.config.interval_s
        observations = self.meter.close(
            now, models, queued_prompt_tokens=queued, in_flight=in_flight, held=held, reset=long_enough
        )
        replicas = self._replicas(pools, actual)
        # What the plan used: the requests that arrived and those over the TTFT SLO since the
        # last plan, and each worker's latest utilisation sample (which links its batch).
        links = [*self._arrivals, *self._slow]
        self._arrivals, self._slow = [], []
        for worker in self.workers.values():
            links += link_to(worker.utilisation_traceparent, {"ripple.link": "used_sample"})
        mode = "act" if self.actuator is not None else "observe"
        with tracer().start_as_current_span("autoscaler.plan", links=links) as span:
            self.state, result = plan(self.state, observations, pools, replicas, self._settings(), now)
            decision_id = new_event_id()
            span.set_attribute("ripple.autoscaler.decision_id", decision_id)
            span.set_attribute("ripple.autoscaler.trigger", trigger)
            span.set_attribute("ripple.autoscaler.mode", mode)
            span.set_attribute("ripple.autoscaler.cost_per_hour", result.cost_per_hour)
            for p in result.pools:
                span.set_attribute(f"ripple.autoscaler.{p.pool}.desired", p.desired)
                span.set_attribute(f"ripple.autoscaler.{p.pool}.reason", p.reason)
            failed, self._failed = self._failed, []
            if mode == "act":
                await self._act(result, decision_id, trigger, span)
            decision = _decision(decision_id, now, mode, trigger, result, failed)
        self.last_plan, self.last_decision = result, decision
        COST.set(result.cost_per_hour)
        for p in result.pools:
            REPLICAS.labels(p.pool).set(p.serving + p.warming)
            DESIRED.labels(p.pool).set(p.desired)
        await self.runtime.bus.publish(event_subject("scaling"), decision)
        return decision

    async def _act(self, result: Plan, decision_id: str, trigger: str, span: trace.Span) -> None:
        assert self.actuator is not None
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        for change in result.changes:
            action = ScaleAction(
                pool=change.pool,
                desired=change.desired,
                add=change.add,
                remove=change.remove,
                decision_id=decision_id,
                reason=change.reason,
                traceparent=carrier.get("traceparent"),
            )
            try:
                await asyncio.wait_for(self.actuator.apply(action), self.config.actuator_timeout_s)
            except (ActuatorError, TimeoutError, OSError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("scaling action failed", extra={"pool": change.pool, "error": error})
                ACTUATOR_FAILURES.labels(change.pool).inc()
                span.set_attribute(f"ripple.autoscaler.{change.pool}.failed", error)
                self._failed.append(f"{change.pool}: {error}")
                continue
            if change.add:
                SCALE_EVENTS.labels(change.pool, "up", trigger).inc(change.add)
            if change.remove:
                SCALE_EVENTS.labels(change.pool, "down", trigger).inc(len(change.remove))

    async def _actual(self) -> dict[str, PoolActual]:
        if self.actuator is None:
            return {}
        try:
            return await asyncio.wait_for(self.actuator.actual(), self.config.actuator_timeout_s)
        except (ActuatorError, TimeoutError, OSError) as exc:
            log.warning(
                "the platform's fleet could not be read", extra={"error": str(exc) or type(exc).__name__}
            )
            return {}

    def _settings(self) -> Settings:
        c = self.config
        return Settings(
            slo=Slo(ttft_s=c.ttft_slo_s, itl_s=self._itl_slo()),
            interval_s=c.interval_s,
            scale_down_delay_s=c.scale_down_delay_s,
            idle_to_zero_s=c.idle_to_zero_s,
            budget_per_hour=c.budget_per_hour,
            kv_transfer_usd_per_gb=self.runtime.config.kv_transfer_usd_per_gb if self.runtime else 0.0,
            forecast=ForecastSettings(season_s=c.season_s),
        )

    def _itl_slo(self) -> float:
        """The configured ITL SLO, or admission's: the time per token it admits below, so the
        plan sizes the fleet for the load admission lets in."""
        assert self.runtime is not None
        return self.config.itl_slo_s or self.runtime.config.admission.tpot_high_s

    def _pools(self, actual: dict[str, PoolActual]) -> list[Pool]:
        assert self.runtime is not None
        config = self.runtime.config
        configured = config.autoscaler.pools
        if configured:
            return [
                Pool(
                    name=p.name,
                    model=p.model,
                    role=p.role,
                    gpu_type=p.gpu_type,
                    price_per_hour=config.gpu_prices_per_hour.get(p.gpu_type, 0.0),
                    profile=_profile(config, p.model, p.gpu_type, self._time_scale(p.name)),
                    min_replicas=p.min_replicas,
                    max_replicas=p.max_replicas,
                    startup_s=p.startup_s,
                )
                for p in configured
            ]
        bounded = [a for a in actual.values() if a.model is not None and a.max_replicas is not None]
        if bounded:  # the platform's limits (`up --autoscale`)
            pools = []
            for a in sorted(bounded, key=lambda a: a.pool):
                role, gpu_type = a.pool.split("-", 1)
                pools.append(
                    Pool(
                        name=a.pool,
                        model=a.model or "",
                        role="prefill" if role == "prefill" else "decode",
                        gpu_type=gpu_type,
                        price_per_hour=config.gpu_prices_per_hour.get(gpu_type, 0.0),
                        profile=_profile(config, a.model or "", gpu_type, self._time_scale(a.pool)),
                        min_replicas=a.min_replicas or 0,
                        max_replicas=a.max_replicas or 0,
                        startup_s=a.startup_s if a.startup_s is not None else 60.0,
                    )
                )
            return pools
        # None configured: the pools the workers announce, each kept at its size.
        sizes: dict[str, list[WorkerState]] = {}
        for worker in self.workers.values():
            sizes.setdefault(worker.pool, []).append(worker)
        pools = []
        for name, members in sorted(sizes.items()):
            first = members[0]
            pools.append(
                Pool(
                    name=name,
                    model=first.model,
                    role=first.role,
                    gpu_type=first.gpu_type,
                    price_per_hour=first.price_per_hour,
                    profile=_profile(config, first.model, first.gpu_type, first.time_scale),
                    min_replicas=len(members),
                    max_replicas=len(members),
                )
            )
        return pools

    def _time_scale(self, pool: str) -> float:
        return self._time_scales.get(pool, 1.0)

    def _replicas(self, pools: list[Pool], actual: dict[str, PoolActual]) -> list[Replica]:
        names = {p.name for p in pools}
        replicas: list[Replica] = []
        seen: set[str] = set()
        for worker in self.workers.values():
            if worker.pool not in names:
                continue
            seen.add(worker.worker_id)
            replicas.append(
                Replica(
                    worker.worker_id,
                    worker.pool,
                    "draining" if worker.draining else "serving",
                    cached_blocks=worker.kv_blocks_cached,
                    running=worker.running,
                )
            )
        for pool, members in actual.items():
            if pool not in names:
                continue
            for replica_id in members.replicas:
                if replica_id not in seen:
                    state = "draining" if replica_id in members.stopping else "warming"
                    replicas.append(Replica(replica_id, pool, state))
        return replicas


def _profile(config: MeshConfig, model: str, gpu_type: str, time_scale: float) -> EngineProfile:
    """The pool's replicas as the sim engine's performance model sees them (the model's shape
    from the config; an unknown GPU is planned as an H100)."""
    model_config = config.model(model)
    shape = model_shape(model_config.shape if model_config is not None else "llama-3-8b")
    try:
        device = gpu(gpu_type)
    except ValueError:
        device = gpu("H100")
    perf = PerfModel(device, shape)
    return EngineProfile(perf=perf, kv_capacity_tokens=perf.kv_capacity_tokens(0.9), time_scale=time_scale)


def _decision(
    decision_id: str, now: float, mode: str, trigger: str, result: Plan, failed: list[str]
) -> ScalingDecision:
    return ScalingDecision(
        event_id=decision_id,
        occurred_at=now,
        mode=mode,  # type: ignore[arg-type]
        trigger=trigger,  # type: ignore[arg-type]
        pools=[
            PoolPlan(
                pool=p.pool,
                model=p.model,
                role=p.role,
                gpu_type=p.gpu_type,
                serving=p.serving,
                warming=p.warming,
                draining=p.draining,
                desired=p.desired,
                add=p.add,
                remove=list(p.remove),
                utilisation=p.utilisation,
                cost_per_hour=p.cost_per_hour,
                reason=p.reason,
            )
            for p in result.pools
        ],
        models=[
            ModelOutlook(
                model=m.model,
                observed_rate=m.observed_rate,
                forecast_rate=m.forecast_rate,
                horizon_s=m.horizon_s,
                mean_prompt=m.mean_prompt,
                mean_output=m.mean_output,
                hit_rate=m.hit_rate,
                prefill_load=round(m.prefill_load, 2),
                decode_load=round(m.decode_load, 2),
                ttft_p90_s=m.ttft_p90_s,
                itl_p90_s=m.itl_p90_s,
                held=m.held,
            )
            for m in result.models
        ],
        cost_per_hour=result.cost_per_hour,
        budget_per_hour=result.budget_per_hour,
        failed=failed,
    )


def _actuator_from_options(runtime: Runtime) -> Actuator | None:
    """`--actuator launcher` (what `ripplemesh up --autoscale` passes) or `kubernetes`."""
    kind = runtime.options.extra.get("actuator")
    if kind == "launcher":
        from services.autoscaler.launcher_actuator import LauncherActuator

        return LauncherActuator(runtime.bus.nc)
    if kind == "kubernetes":
        import os

        from services.autoscaler.kubernetes_actuator import KubernetesActuator

        pools = [p.name for p in runtime.config.autoscaler.pools]
        return KubernetesActuator.from_environment(os.environ.get("POD_NAMESPACE", "ripplemesh"), pools)
    return None
