"""The simulator's state and its clock: the event kinds, the heap of (time, order) events that
`Simulator._loop` pops, the services' state (admission's, the router's view), the fleet's
workers, the workload's cursor and the run's tallies, all set up by `SimState.__init__`."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from services.admission.policy import AdmissionState
from services.autoscaler.capacity import EngineProfile
from services.autoscaler.forecast import Window
from services.mesh.config import MeshConfig
from services.router import policy as router_policy
from services.router.policy import RouterState, WorkerSpeed
from services.simulator.admission import DEFAULT_ADMISSION, AdmissionVariant, parse_admission
from services.simulator.autoscaling import TrafficWindow, parse_autoscaler
from services.simulator.fleet import FleetSpec, PoolSpec
from services.simulator.metrics import FleetSample, LatencySketch, PlanRecord
from services.simulator.policies import FleetPrefixView, make_router
from services.simulator.records import (
    ClassFigures,
    ModelFigures,
    Progress,
    RequestLog,
    SimOptions,
    _RequestRun,
    _TenantFigures,
)
from services.simulator.worker import SimWorker
from services.simulator.workload import Task, Workload

# Event kinds.
(
    _STEP,
    _ARRIVAL,
    _NEXT_STEP,
    _IMPORT,
    _DEADLINE,
    _HEARTBEAT,
    _AUTOSCALE,
    _READY,
    _KICK,
    _ADMISSION,
    _PLAN,
    _HOLD,
    _BATCH,
) = range(13)


class SimState:
    """Everything a run holds, and the clock: events are pushed here and popped by the loop."""

    def __init__(
        self,
        workload: Workload,
        fleet: FleetSpec,
        policy: str = "ripplemesh",
        *,
        seed: int = 0,
        options: SimOptions | None = None,
        progress: Progress | None = None,
        prices: dict[str, float] | None = None,
        request_log: RequestLog | None = None,
        admission: AdmissionVariant | str = DEFAULT_ADMISSION,
    ):
        self.request_log = request_log
        self.admission_variant = parse_admission(admission) if isinstance(admission, str) else admission
        self.workload = workload
        self.fleet = fleet
        self.policy_name = policy
        self.seed = seed
        self.options = options or SimOptions()
        self.progress = progress
        self.block_size = fleet.block_size or workload.block_size
        _check_models(fleet, workload.model)
        if fleet.heartbeat_s > router_policy.LIVENESS_S:
            raise ValueError(
                f"heartbeat_s ({fleet.heartbeat_s}) must not exceed the router's liveness "
                f"window ({router_policy.LIVENESS_S} s)"
            )
        config = _mesh_config()
        self.prices = dict(prices or fleet.gpu_prices_per_hour or config.gpu_prices_per_hour)
        self.kv_usd_per_gb = (
            fleet.kv_transfer_usd_per_gb
            if fleet.kv_transfer_usd_per_gb is not None
            else config.kv_transfer_usd_per_gb
        )
        self.task_timeout_s = config.task_timeout_s
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._order = itertools.count()
        # Services' state.
        self.admission = AdmissionState()
        self.admission_limits = self.admission_variant.limits
        # The tenants admission knows: the workload's (and a Batch API job's, batch.py).
        self.tenants = dict(workload.tenants)
        self._quotas = self.admission_variant.quotas({n: t.quota for n, t in workload.tenants.items()})
        self._admitting: dict[str, _RequestRun] = {}  # deferred requests (and the one being decided)
        self._deadlines: dict[str, _RequestRun] = {}  # requests in flight whose client has a deadline
        self._admission_tick_at: float | None = None
        self.deferred = 0
        self.deferral = LatencySketch()
        self.by_tenant: dict[str, _TenantFigures] = {}
        self.slo_by_priority: dict[str, list[int]] = {}  # priority -> [met, issued]
        self.by_class: dict[str, ClassFigures] = {}  # service class (Task.service_class) -> figures
        self.by_model: dict[str, ModelFigures] = {}  # the model requests name -> figures
        # The router learns from admission's config whether it is the only shedding (as the
        # router service does from the mesh config); the run records the options' config.
        self.router_state = RouterState(
            config=dataclasses.replace(
                self.options.router_config, admission_controls_load=self.admission_limits.controls_load
            )
        )
        self.serving: dict[str, SimWorker] = {}  # workers that take (or finish) work
        self.all_workers: list[SimWorker] = []
        self.starting: dict[str, SimWorker] = {}
        self.prefix = FleetPrefixView(self.serving, shared_prefixes=workload.prefix_sharing)
        self._speeds: dict[str, WorkerSpeed] = {}  # each worker's roofline, for the router's view
        self.router = make_router(policy, self.prefix)
        self._pool_of: dict[str, PoolSpec] = {}
        self._pool_counter: dict[str, itertools.count[int]] = {}
        # The autoscaler (autoscaling.py): its plans, the traffic each observes, the replicas
        # it wants per pool, the pools as it sees them, and the requests held for a replica.
        self.autoscaler = parse_autoscaler(self.options.autoscaler, fleet, self.kv_usd_per_gb)
        self._desired: dict[str, int] = {}
        self._profiles: dict[str, EngineProfile] = {}
        # The traffic since the last plan of the model whose request is in hand (each model's is
        # its `ModelFigures.window`; lifecycle.py reads this one, set to the request's model's).
        self._window = TrafficWindow()
        self._window_start = 0.0
        self._last_windows: dict[str, Window] = {}  # per model: the last interval plan's
        self._next_plan_at = 0.0
        self._plan_pending = False
        self._planned_at: float | None = None
        self._arrivals_since_sample = 0
        self.plans: list[PlanRecord] = []
        self._decode_live: dict[str, int] = {}  # per model: decode workers serving, not draining
        self._held: dict[str, tuple[_RequestRun, bool]] = {}  # rid -> (request, admitted already)
        self.held_requests = 0
        self.in_flight = 0  # requests issued and not ended
        # The workload.
        self._tasks: Iterator[Task] = workload.tasks()
        self._next_task: Task | None = None
        self._total_hint = workload.count_hint()
        self.active_tasks = 0
        # Metrics.
        self.tasks = 0
        self.tasks_ended = 0
        self.tasks_succeeded = 0
        self.tasks_failed: dict[str, int] = {}
        self.by_priority: dict[str, list[int]] = {}
        self.requests = 0
        self.requests_completed = 0
        self.rejections: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.attributed_usd = 0.0
        self.attributed_gpu_s = 0.0
        self.wasted_usd = 0.0
        self.successful_usd = 0.0
        self.kv_transfer_bytes = 0
        self.kv_transfer_usd = 0.0
        self.ttft = LatencySketch()
        self.tpot = LatencySketch()
        self.e2e = LatencySketch()
        self.queue = LatencySketch()
        self.slo_met = 0
        self.slo_ttft_met = 0
        self.slo_tpot_met = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.upper_bound_tokens = 0
        self._seen: set[int] = set()
        self.timeline: list[FleetSample] = []
        self.first_arrival: float | None = None
        self.end_time = 0.0
        self.events = 0

    def _push(self, at: float, kind: int, obj: Any, late: int = 0) -> None:
        heapq.heappush(self._heap, (at, late, next(self._order), kind, obj))

    def _pull_task(self) -> None:
        task = next(self._tasks, None)
        self._next_task = task
        if task is not None:
            self._push(task.arrival_s, _ARRIVAL, task)

    def _figures_of(self, model: str) -> ModelFigures:
        figures = self.by_model.get(model)
        if figures is None:
            figures = self.by_model[model] = ModelFigures()
        return figures

    def _work_left(self) -> bool:
        return self._next_task is not None or self.active_tasks > 0

    def class_summary(self) -> dict[str, dict[str, Any]]:
        """Per service class figures (batch.py)."""
        return {}

    def batch_summary(self) -> dict[str, Any] | None:
        """The Batch API job's outcome (batch.py); None without one."""
        return None


def _check_models(fleet: FleetSpec, default_model: str) -> None:
    """Each model's prefill pools need a decode pool of that model (a pool naming no model
    serves the workload's)."""
    decode = {p.model or default_model for p in fleet.pools if p.role == "decode"}
    for index, pool in enumerate(fleet.pools):
        model = pool.model or default_model
        if pool.role == "prefill" and model not in decode:
            raise ValueError(f"pool {pool.label(index)} prefills for {model}, which has no decode pool")


def _mesh_config() -> MeshConfig:
    """The mesh's configuration: GPU prices, the KV transfer price and the task timeout."""
    from services.mesh.config import load_config

    return load_config()
