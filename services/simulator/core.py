"""The simulator: a discrete-event loop on a virtual clock that replays a workload through the
project's own policies and the sim engine's scheduling, and measures cost per successful task.

Time is virtual: a heap of (time, order) events, nothing waits on the wall clock, and a run
depends only on its inputs (the same workload, fleet and policy give the same result, bit for
bit). Per request, in the order the mesh's services act:

1. admission: `services.admission.policy.decide` with the tenant's quota and the request's
   deadline (a rejection fails the request, and its task);
2. router: the named routing policy (policies.py: `services.router.policy.place` for
   "ripplemesh", services/router/baselines.py for the baselines) on a `RouterState` fed by the
   workers' heartbeats every `heartbeat_s`, as the router service's is;
3. workers: a `SimWorker` per replica (worker.py: the sim engine's scheduler on its PerfModel and
   BlockManager); a prefill worker hands the request's KV to its decode worker (transfer time
   from the GPU's link), or one worker serves both;
4. ledger: each request's GPU-seconds priced by `services.ledger.pricing.price_gpu_seconds`
   and its KV hand-off by `price_kv_transfer`; each task's status decided by the ledger's own
   rules (`services.ledger.tasks.task_status`) from the facts its requests report: it succeeds
   when its final step completes in time, fails when a step is rejected or fails
   (step_failed), completes late (deadline_missed), or when the agent stops before its final
   step (abandoned, as the ledger rules after its task timeout). A failed task's spend is waste.
   A client abandons a request at its deadline (`abandon_past_deadline`): a failed step.
5. autoscaler: every `autoscale_interval_s`, `services.autoscaler.policy.plan` per pool; pools
   marked `autoscale` act on it (new replicas serve after `startup_s`, billed from their start;
   surplus ones drain after `scale_down_delay_s` and stop billing when empty).

Policies are called through their modules at each decision (never imported by value), so a
test that patches a policy module sees the simulator's decisions change.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from schemas.events import WorkflowSpend
from services.admission import policy as admission_policy
from services.admission.policy import (
    AdmissionRequest,
    AdmissionState,
    Admit,
    Defer,
    Prediction,
    Reject,
    workflow_standing,
)
from services.autoscaler import policy as autoscaler_policy
from services.autoscaler.policy import WorkerLoad
from services.ledger import pricing
from services.ledger import tasks as ledger_tasks
from services.mesh.config import MeshConfig
from services.router import policy as router_policy
from services.router.policy import (
    NoPlacement,
    RouterConfig,
    RouteRequest,
    RouterState,
    WorkerSpeed,
    WorkerView,
)
from services.router.speed import worker_speed
from services.simulator.admission import DEFAULT_ADMISSION, AdmissionVariant, parse_admission
from services.simulator.fleet import FleetSpec, PoolSpec
from services.simulator.metrics import FleetSample, LatencySketch, SimResult, latency_stats, ratio
from services.simulator.policies import FleetPrefixView, make_router, router_config_changes
from services.simulator.worker import CANCELLED, DONE, FINISHED, PREFILLED, Seq, SimWorker
from services.simulator.workload import Step, Task, Workload

# Event kinds.
_STEP, _ARRIVAL, _NEXT_STEP, _IMPORT, _DEADLINE, _HEARTBEAT, _AUTOSCALE, _READY, _KICK, _ADMISSION = range(10)

Progress = Callable[[int, int | None], None]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's outcome, for `Simulator(request_log=...)` (tests, per-request exports)."""

    request_id: str
    tenant: str
    arrival: float
    first_token_at: float | None
    finished_at: float
    outcome: str  # "completed", or "stage:reason" of its rejection or failure
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    gpu_seconds: float
    workers: tuple[str, ...]


RequestLog = Callable[[RequestRecord], None]


@dataclass(frozen=True, slots=True)
class SimOptions:
    abandon_past_deadline: bool = True  # clients give up on a request at its deadline
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    # The infinite-cache upper bound keeps every distinct prompt block hash seen (about 70 bytes
    # each): the one metric whose memory grows with the workload. Off for the largest runs.
    prefix_upper_bound: bool = True
    progress_every: int = 2000  # tasks between progress callbacks
    # ripplemesh's policy's knobs (and what admission's predictions read): the default's, or a
    # variant's (`policies.parse_router_config`).
    router_config: RouterConfig = field(default_factory=RouterConfig)


class _TaskRun:
    """A task in flight, with the facts the ledger keeps of it (services/ledger/tasks.py)."""

    __slots__ = (
        "deadline_misses",
        "ended",
        "final_completed_at",
        "gpu_s",
        "max_completed_step",
        "max_failed_step",
        "spend",
        "step_index",
        "succeeded",
        "task",
    )

    def __init__(self, task: Task):
        self.task = task
        self.step_index = 0
        self.spend = 0.0
        self.gpu_s = 0.0
        self.ended = False
        self.succeeded = False
        self.max_completed_step = 0
        self.max_failed_step = 0
        self.final_completed_at: float | None = None
        self.deadline_misses = 0


class _RequestRun:
    __slots__ = (
        "arrival",
        "cached",
        "deadline_at",
        "done",
        "first_token_at",
        "gpu_s",
        "index",
        "outcome",
        "placed",
        "queue_s",
        "reserved",
        "rid",
        "route_request",
        "spec",
        "task_run",
        "upper_bound",
        "workers",
    )

    def __init__(self, task_run: _TaskRun, index: int, rid: str, spec: Step, arrival: float):
        self.task_run = task_run
        self.index = index
        self.rid = rid
        self.spec = spec
        self.arrival = arrival
        self.deadline_at = arrival + spec.deadline_s if spec.deadline_s is not None else None
        self.first_token_at: float | None = None
        self.workers: dict[Seq, SimWorker] = {}
        self.queue_s: float | None = None
        self.reserved: SimWorker | None = None  # a decode worker holding a place for the KV
        self.upper_bound = 0  # prompt tokens an infinite cache would hold for it
        self.gpu_s = 0.0
        self.cached = 0
        self.placed: tuple[str, ...] = ()
        self.outcome: tuple[str, float] | None = None  # to log once its GPU time is all charged
        self.done = False
        self.route_request: RouteRequest | None = None  # as last built (`Simulator._route_request`)


class _TenantFigures:
    __slots__ = ("admitted", "admitted_tokens", "requests", "slo_met")

    def __init__(self) -> None:
        self.requests = 0
        self.admitted = 0
        self.admitted_tokens = 0
        self.slo_met = 0


class Simulator:
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
        self._quotas = self.admission_variant.quotas({n: t.quota for n, t in workload.tenants.items()})
        self._admitting: dict[str, _RequestRun] = {}  # deferred requests (and the one being decided)
        self._deadlines: dict[str, _RequestRun] = {}  # requests in flight whose client has a deadline
        self._admission_tick_at: float | None = None
        self.deferred = 0
        self.deferral = LatencySketch()
        self.by_tenant: dict[str, _TenantFigures] = {}
        self.slo_by_priority: dict[str, list[int]] = {}  # priority -> [met, issued]
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
        self._below_since: dict[str, float] = {}
        self._desired: dict[str, int] = {}
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

    # ------------------------------------------------------------ the fleet

    def _new_worker(self, pool: PoolSpec, index: int, now: float) -> SimWorker:
        label = pool.label(index)
        counter = self._pool_counter.setdefault(label, itertools.count())
        worker_id = f"{label}-{next(counter)}"
        model = pool.model or self.workload.model
        engine = pool.engine(model=model, block_size=self.block_size)
        worker = SimWorker(
            worker_id,
            engine,
            pool=label,
            role=pool.role,
            tensor_parallel=pool.tensor_parallel,
            on_import_admitted=self._import_admitted,
            on_first_block=self.prefix.stored_first_block,
        )
        worker.provisioned_at = now
        self._pool_of[worker_id] = pool
        self.all_workers.append(worker)
        return worker

    def _serve(self, worker: SimWorker, now: float) -> None:
        worker.ready_at = now
        self.serving[worker.worker_id] = worker
        self.prefix.changed()
        self._observe(worker, now)

    def _observe(self, worker: SimWorker, now: float) -> None:
        blocks = worker.blocks
        speed = self._speeds.get(worker.worker_id)
        if speed is None:
            speed = self._speeds[worker.worker_id] = worker_speed(
                worker.perf, max_batch_tokens=worker.max_batch_tokens, max_running=worker.max_running
            )
        self.router_state.observe(
            WorkerView(
                worker_id=worker.worker_id,
                role=worker.role,  # type: ignore[arg-type]
                model=worker.model,
                block_size=worker.block_size,
                queue_depth=len(worker.waiting),
                running=len(worker.running) + len(worker.ready),
                kv_blocks_total=blocks.total_blocks,
                kv_blocks_used=blocks.used_blocks,
                heartbeat_at=now,
                draining=worker.draining,
                gpu_type=worker.gpu_type,
                price_per_hour=self.prices.get(worker.gpu_type, 0.0) * worker.tensor_parallel,
                speed=speed,
                kv_blocks_free=blocks.free_blocks,
                queued_tokens=self._queued_tokens(worker, now),
                context_tokens=worker.context_tokens(),
            )
        )

    def _queued_tokens(self, worker: SimWorker, now: float) -> int:
        """The prompt tokens the worker has yet to prefill (what a heartbeat reports): the rest of
        the prompts in its batch, and the uncached part of those waiting."""
        total = sum(seq.prompt_len + seq.generated - seq.computed for seq in worker.prefilling)
        if not worker.waiting:
            return total
        self.prefix.now = now
        size = worker.block_size
        for seq in worker.waiting:
            if not seq.kv_import:
                cached = self.prefix.overlap(worker.worker_id, seq.hashes) * size
                total += max(1, seq.prompt_len + seq.generated - cached)
        return total

    def _remove(self, worker: SimWorker, now: float) -> None:
        worker.removed_at = now
        self.serving.pop(worker.worker_id, None)
        self.prefix.changed()
        self.starting.pop(worker.worker_id, None)
        self.router_state.forget(worker.worker_id)

    # ------------------------------------------------------------ events

    def _push(self, at: float, kind: int, obj: Any, late: int = 0) -> None:
        heapq.heappush(self._heap, (at, late, next(self._order), kind, obj))

    def _kick(self, worker: SimWorker, now: float) -> None:
        """The worker may start a step now, after the other events of this instant (the engine's
        loop wakes after the coroutines that woke it)."""
        if not worker.busy and not worker.kick_pending:
            worker.kick_pending = True
            self._push(now, _KICK, worker, late=1)

    def _start(self, worker: SimWorker, now: float, *, coast: bool = True) -> None:
        if worker.busy:
            return
        end = worker.schedule(now, coast=coast)
        if end is not None:
            worker.step_version += 1
            self._push(end, _STEP, (worker, worker.step_version))

    def _touch(self, worker: SimWorker, now: float) -> None:
        """The worker is about to change at `now`: a chunk of timed-ahead steps stops after the
        step in flight (whose end becomes the worker's step event)."""
        if worker.busy:
            end = worker.interrupt(now)
            if end is not None:
                worker.step_version += 1
                self._push(end, _STEP, (worker, worker.step_version))

    def _pull_task(self) -> None:
        task = next(self._tasks, None)
        self._next_task = task
        if task is not None:
            self._push(task.arrival_s, _ARRIVAL, task)

    def _work_left(self) -> bool:
        return self._next_task is not None or self.active_tasks > 0

    def run(self) -> SimResult:
        started = time.perf_counter()
        for index, pool in enumerate(self.fleet.pools):
            for _ in range(pool.replicas):
                self._serve(self._new_worker(pool, index, 0.0), 0.0)
        self._pull_task()
        self._push(self.fleet.heartbeat_s, _HEARTBEAT, None)
        self._push(0.0, _AUTOSCALE, None)
        # What exists now lives for the whole run and only grows (the workers' KV caches, whose
        # LRU lists reach millions of entries): the cyclic GC's full passes would scan it again
        # and again, more each time, though it never holds garbage. Frozen, they scan only what
        # the run creates (requests, which end); refcounting still frees the frozen objects.
        # And a run makes no cycles (a request is freed when it ends, by its reference counts:
        # tested), so the collector's passes find nothing: they are made 70 times rarer (CPython's
        # default runs one every 700 allocations; 300,000 Azure requests on 1,000 workers: 100
        # -> 89 s CPU, the same peak RSS), not stopped, in case something ever does.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        try:
            self.events = self._loop()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        if self.progress is not None:
            self.progress(self.tasks_ended, self._total_hint)
        result = self._result(time.perf_counter() - started)
        self._break_cycles()
        return result

    def _break_cycles(self) -> None:
        """Drop the workers' callbacks into the simulator and its prefix view, the run's only
        reference cycles, so that the run, KV caches and all, goes by reference counts when it
        ends. Left to the collector, unfrozen into its oldest generation, it waits for a full
        pass, which comes only once that generation has grown by a quarter: a process making
        run after run (a sweep's worker) kept them all (9.8 GB after 430 runs)."""
        for worker in self.all_workers:
            worker.on_import_admitted = None
            worker.on_first_block = None

    def _loop(self) -> int:
        """Pop and handle events until none is left; returns how many."""
        heap = self._heap
        pop = heapq.heappop
        events = 0
        while heap:
            at, _, _, kind, obj = pop(heap)
            self.now = at
            events += 1
            if kind == _STEP:
                worker, version = obj
                if version == worker.step_version:
                    self._step_end(worker, at)
            elif kind == _KICK:
                obj.kick_pending = False
                self._start(obj, at)
            elif kind == _ARRIVAL:
                self._arrival(obj, at)
            elif kind == _NEXT_STEP:
                task_run, spec = obj
                self._issue(task_run, spec, at)
            elif kind == _IMPORT:
                self._import_done(obj[0], obj[1], at)
            elif kind == _DEADLINE:
                pending = self._deadlines.pop(obj, None)
                if pending is not None:
                    self._deadline(pending, at)
            elif kind == _HEARTBEAT:
                self._heartbeat(at)
            elif kind == _AUTOSCALE:
                self._autoscale(at)
            elif kind == _READY:
                self.starting.pop(obj.worker_id, None)
                if obj.removed_at is None:
                    self._serve(obj, at)
            elif kind == _ADMISSION:
                if at == self._admission_tick_at:
                    self._admission_tick(at)
        return events

    # ------------------------------------------------------------ tasks and requests

    def _arrival(self, task: Task, now: float) -> None:
        self._pull_task()
        if self.first_arrival is None:
            self.first_arrival = now
        self.tasks += 1
        self.active_tasks += 1
        counts = self.by_priority.setdefault(task.priority, [0, 0])
        counts[1] += 1
        self._issue(_TaskRun(task), task.step(1), now)

    def _issue(self, task_run: _TaskRun, spec: Step, now: float) -> None:
        task = task_run.task
        index = task_run.step_index = task_run.step_index + 1
        rid = f"{task.task_id}-{index}" if task.workflow else task.task_id
        req = _RequestRun(task_run, index, rid, spec, now)
        self.requests += 1
        if self._admit(req, now):
            self._route(req, now)

    def _route_request(self, req: _RequestRun, admission_wait_s: float = 0.0) -> RouteRequest:
        """The request as the router sees it (and admission's prediction of its first token): built
        once, again only if the workflow's spend or admission's hold on it changed since (the
        fields that move)."""
        task_run = req.task_run
        built = req.route_request
        if (
            built is not None
            and built.workflow_spent_usd == task_run.spend
            and built.admission_wait_s == admission_wait_s
        ):
            return built
        task, spec = task_run.task, req.spec
        built = req.route_request = RouteRequest(
            request_id=req.rid,
            tenant=task.tenant,
            model=self.workload.model,
            block_size=self.block_size,
            block_hashes=spec.block_hashes,
            prompt_tokens=spec.prompt_tokens,
            max_tokens=spec.output_tokens,
            priority=task.priority,
            deadline_at=req.deadline_at,
            workflow_id=task.task_id if task.workflow else None,
            workflow_step=req.index if task.workflow else None,
            workflow_steps=task.steps if task.workflow else None,
            workflow_spent_usd=task_run.spend,
            admission_wait_s=admission_wait_s,
        )
        return built

    def _route(self, req: _RequestRun, now: float, admission_wait_s: float = 0.0) -> None:
        """Place an admitted request (held back `admission_wait_s` by admission) and hand it to
        its workers."""
        spec, rid = req.spec, req.rid
        prompt, output = spec.prompt_tokens, spec.output_tokens
        self.prefix.now = now
        placement = self.router(self.router_state, self._route_request(req, admission_wait_s), now)
        if isinstance(placement, NoPlacement):
            self._reject(req, "router", placement.reason, now)
            return
        prefill_worker = self.serving.get(placement.prefill_worker)
        decode_worker = self.serving.get(placement.decode_worker)
        if prefill_worker is None or decode_worker is None:
            self._reject(req, "router", "no_workers", now)
            return
        for worker in {
            prefill_worker.worker_id: prefill_worker,
            decode_worker.worker_id: decode_worker,
        }.values():
            verdict = worker.check(prompt, output)
            if verdict is not None:
                self._fail(req, "engine", verdict[0], now)
                return
        req.upper_bound = self._upper_bound(spec)
        seq = Seq(rid, prompt, spec.block_hashes, output, req, kv_import=False)
        req.placed = (prefill_worker.worker_id, decode_worker.worker_id)
        req.workers[seq] = prefill_worker
        self._touch(prefill_worker, now)
        prefill_worker.submit(seq, now)
        if decode_worker is not prefill_worker:
            decode_worker.reserved += 1
            req.reserved = decode_worker
        self._kick(prefill_worker, now)
        if req.deadline_at is not None and self.options.abandon_past_deadline:
            # The event names the request; the request itself is let go of when it ends.
            self._deadlines[req.rid] = req
            self._push(req.deadline_at, _DEADLINE, req.rid)

    # ------------------------------------------------------------ admission

    def _admit(self, req: _RequestRun, now: float) -> bool:
        """Admission's decision on a new request: True when it goes on to the router now."""
        task = req.task_run.task
        figures = self.by_tenant.get(task.tenant)
        if figures is None:
            figures = self.by_tenant[task.tenant] = _TenantFigures()
        figures.requests += 1
        self.slo_by_priority.setdefault(task.priority, [0, 0])[1] += 1
        if self.admission.fleet is None:
            self._observe_fleet(now)
        self._admitting[req.rid] = req
        decision = admission_policy.decide(
            self.admission,
            request=self._admission_request(req),
            quota=self._quotas.get(task.tenant),
            limits=self.admission_limits,
            now=now,
            predict=self._predict,
            lazy=True,
        )
        if isinstance(decision, Defer):
            self.deferred += 1
            self._schedule_admission(decision.due)
        else:
            del self._admitting[req.rid]
        go = isinstance(decision, Admit)
        if go:
            self._admitted(req, 0.0)
        elif isinstance(decision, Reject):
            self._reject(req, "admission", decision.reason, now)
        self._admission_outcomes(now)
        return go

    def _admission_request(self, req: _RequestRun) -> AdmissionRequest:
        task_run = req.task_run
        task, spec = task_run.task, req.spec
        # The ledger's running total, as WORKFLOW_SPEND would hold it for the workflow.
        spend = (
            WorkflowSpend(
                workflow_id=task.task_id,
                tenant=task.tenant,
                spend_usd=task_run.spend,
                gpu_seconds=task_run.gpu_s,
                steps_completed=task_run.max_completed_step,
                steps=task.steps,
                status="running",
                first_event_at=task.arrival_s,
                last_event_at=req.arrival,
                updated_at=req.arrival,
            )
            if task.workflow and req.index > 1
            else None
        )
        return AdmissionRequest(
            request_id=req.rid,
            tenant=task.tenant,
            priority=task.priority,
            input_tokens=spec.prompt_tokens,
            output_tokens=spec.output_tokens,
            submitted_at=req.arrival,
            deadline_at=req.deadline_at,
            workflow_id=task.task_id if task.workflow else None,
            workflow_step=req.index if task.workflow else None,
            workflow_standing=workflow_standing(req.index if task.workflow else None, spend),
            workflow_spent_usd=task_run.spend,
            # About what the mesh holds for a deferred request: its RequestPrepared, JSON.
            size_bytes=600 + 6 * spec.prompt_tokens + 20 * len(spec.block_hashes),
        )

    def _predict(self, request: AdmissionRequest) -> Prediction | None:
        """The router's prediction of the request's first token (earliest_ttft over the live
        placements), and of its last at the time per token the fleet gives now."""
        now = self.now
        self.prefix.now = now
        route = self._route_request(self._admitting[request.request_id])
        first = router_policy.earliest_first_token(self.router_state, route, self.prefix, now)
        return admission_policy.prediction(first, request, self.admission)

    def _admitted(self, req: _RequestRun, waited_s: float) -> None:
        figures = self.by_tenant[req.task_run.task.tenant]
        figures.admitted += 1
        figures.admitted_tokens += req.spec.prompt_tokens + req.spec.output_tokens
        if waited_s > 0:
            self.deferral.add(waited_s)

    def _admission_outcomes(self, now: float) -> None:
        """Route or reject the deferred requests admission has decided."""
        for outcome in admission_policy.take_outcomes(self.admission):
            req = self._admitting.pop(outcome.request.request_id)
            decision = outcome.decision
            if isinstance(decision, Admit):
                self._admitted(req, decision.waited_s)
                self._route(req, now, decision.waited_s)
            else:
                self._reject(req, "admission", decision.reason, now)

    def _schedule_admission(self, at: float) -> None:
        if self._admission_tick_at is None or at < self._admission_tick_at:
            self._admission_tick_at = at
            self._push(at, _ADMISSION, None, late=1)

    def _admission_tick(self, now: float) -> None:
        self._admission_tick_at = None
        admission_policy.drain(self.admission, self.admission_limits, now, self._predict)
        self._admission_outcomes(now)
        due = admission_policy.next_due(self.admission)
        if due is not None:
            self._schedule_admission(due)

    def _observe_fleet(self, now: float) -> None:
        """The workers' heartbeats, as admission sees them (the router's view of them)."""
        admission_policy.observe_fleet(
            self.admission, admission_policy.fleet_load(self.router_state.workers.values(), now)
        )
        if self.admission.deferred:
            self._schedule_admission(now)

    def _ended(self, req: _RequestRun, now: float, *, admitted: bool, slo_met: bool = False) -> None:
        """A request ended: its concurrency lease goes back; one admitted frees the fleet."""
        task = req.task_run.task
        self._deadlines.pop(req.rid, None)
        admission_policy.release(self.admission, task.tenant, req.rid)
        if slo_met:
            self.slo_by_priority[task.priority][0] += 1
            self.by_tenant[task.tenant].slo_met += 1
        if admitted:
            admission_policy.note_finished(self.admission)
            if self.admission.deferred:
                self._schedule_admission(now)

    def _upper_bound(self, spec: Step) -> int:
        """The prompt tokens an infinite cache shared by the whole fleet would hold: the leading
        blocks of this prompt that some earlier request's prompt had."""
        if not self.options.prefix_upper_bound or not self.workload.prefix_sharing:
            return 0
        hashes = spec.block_hashes
        seen = self._seen
        n = len(hashes)
        matched = 0
        if n and hashes[0] in seen:
            if hashes[n - 1] in seen:
                matched = n
            else:  # seen chains are prefix-closed: binary search for the first unseen block
                low, high = 1, n - 1
                while low < high:
                    middle = (low + high) // 2
                    if hashes[middle] in seen:
                        low = middle + 1
                    else:
                        high = middle
                matched = low
        if matched < n:
            seen.update(hashes[matched:])
        return min(matched * self.block_size, spec.prompt_tokens - 1) if matched else 0

    def _charge(self, req: _RequestRun, worker: SimWorker, seq: Seq) -> None:
        """Price the sequence's GPU time on this worker, once, when it leaves the worker."""
        gpu_s = worker.gpu_seconds(seq) * worker.tensor_parallel
        usd = pricing.price_gpu_seconds(worker.gpu_type, gpu_s, self.prices)
        self.attributed_gpu_s += gpu_s
        req.gpu_s += gpu_s
        req.task_run.gpu_s += gpu_s
        self._spend(req.task_run, usd)

    def _spend(self, task_run: _TaskRun, usd: float) -> None:
        self.attributed_usd += usd
        if task_run.ended:
            if task_run.succeeded:
                self.successful_usd += usd
            else:
                self.wasted_usd += usd
        else:
            task_run.spend += usd

    def _release(self, req: _RequestRun, seq: Seq) -> None:
        worker = req.workers.pop(seq)
        self._touch(worker, self.now)
        worker.release(seq)
        self._charge(req, worker, seq)
        if req.outcome is not None and not req.workers:
            self._log(req, *req.outcome)

    def _step_end(self, worker: SimWorker, now: float) -> None:
        if worker.in_chunk:
            exact = worker.chunk_due(now)
            if exact is not None:  # woken a hair early: the chunk's last step ends at `exact`
                worker.step_version += 1
                self._push(exact, _STEP, (worker, worker.step_version))
                return
        handoffs = worker.end_step(now)
        # The engine schedules its next step before the coroutines its step woke run (which
        # change the worker: no chunk of steps is timed ahead then).
        self._start(worker, now, coast=not handoffs)
        for kind, seq in handoffs:
            req: _RequestRun = seq.owner
            if kind == FINISHED:
                self._release(req, seq)
                self._complete(req, now)
            elif kind == PREFILLED:
                self._prefilled(worker, req, seq, now)
            elif kind == CANCELLED:
                self._release(req, seq)
        if not worker.busy:
            self._start(worker, now)

    def _prefilled(self, worker: SimWorker, req: _RequestRun, seq: Seq, now: float) -> None:
        req.first_token_at = now
        req.cached = seq.cached_tokens
        req.queue_s = seq.admitted_at - seq.enqueued_at
        # Prefix-cache accounting over the requests whose prefill ran.
        self.prompt_tokens += seq.prompt_len
        self.cached_tokens += seq.cached_tokens
        self.upper_bound_tokens += req.upper_bound
        decode_worker = req.reserved
        if decode_worker is None:  # aggregated: decode() on the same engine
            self._touch(worker, now)
            if worker.start_decode(seq):
                self._release(req, seq)
                self._complete(req, now)
            return
        # Disaggregated: the prefill worker lets go of the sequence; the decode worker imports it.
        self._release(req, seq)
        req.reserved = None
        decode_worker.reserved -= 1
        imported = Seq(req.rid, seq.prompt_len, seq.hashes, seq.max_tokens, req, kv_import=True)
        req.workers[imported] = decode_worker
        self._touch(decode_worker, now)
        decode_worker.submit_import(imported, now)
        self._kick(decode_worker, now)

    def _import_admitted(self, worker: SimWorker, seq: Seq, now: float) -> None:
        moved = (seq.prompt_len - seq.cached_tokens) * worker.kv_bytes_per_token
        usd = pricing.price_kv_transfer(moved, self.kv_usd_per_gb)
        self.kv_transfer_bytes += moved
        self.kv_transfer_usd += usd
        self._spend(seq.owner.task_run, usd)
        self._push(now + worker.kv_transfer_seconds(seq), _IMPORT, (worker, seq))

    def _import_done(self, worker: SimWorker, seq: Seq, now: float) -> None:
        self._touch(worker, now)
        if not worker.import_done(seq):
            return  # released meanwhile (its request was abandoned)
        req: _RequestRun = seq.owner
        self._touch(worker, now)
        if worker.start_decode(seq):
            self._release(req, seq)
            self._complete(req, now)
        else:
            self._kick(worker, now)

    def _complete(self, req: _RequestRun, now: float) -> None:
        req.done = True
        self.requests_completed += 1
        spec = req.spec
        first = req.first_token_at if req.first_token_at is not None else now
        ttft = first - req.arrival
        self.ttft.add(ttft)
        tpot = (now - first) / (spec.output_tokens - 1) if spec.output_tokens > 1 else None
        if tpot is not None:
            self.tpot.add(tpot)
        self.e2e.add(now - req.arrival)
        if req.queue_s is not None:
            self.queue.add(req.queue_s)
        if self.request_log is not None:
            self._log(req, "completed", now)
        ttft_ok = ttft <= self.options.slo_ttft_s
        tpot_ok = tpot is None or tpot <= self.options.slo_tpot_s
        self.slo_ttft_met += ttft_ok
        self.slo_tpot_met += tpot_ok
        self.slo_met += ttft_ok and tpot_ok
        self._ended(req, now, admitted=True, slo_met=ttft_ok and tpot_ok)
        task_run = req.task_run
        task_run.max_completed_step = max(task_run.max_completed_step, req.index)
        if req.deadline_at is not None and now > req.deadline_at:
            task_run.deadline_misses += 1
        if req.index >= task_run.task.steps:
            task_run.final_completed_at = now
        status, reason = self._task_status(task_run, now)
        if status != "running":
            self._end_task(task_run, reason, now)
        elif spec.fails:
            # The agent cannot use this step's result and stops: the ledger rules the workflow
            # abandoned once it has been quiet for the task timeout.
            status, reason = self._task_status(task_run, now, later=self.task_timeout_s + 1.0)
            self._end_task(task_run, reason if status == "failed" else None, now)
        else:
            following = task_run.task.step(req.index + 1)
            self._push(now + following.think_s, _NEXT_STEP, (task_run, following))

    def _task_status(self, task_run: _TaskRun, now: float, *, later: float = 0.0) -> tuple[str, str | None]:
        """The ledger's verdict on the task's facts (services/ledger/tasks.py), at `now` or, with
        no further event, `later` seconds on."""
        return ledger_tasks.task_status(
            steps=task_run.task.steps,
            max_completed_step=task_run.max_completed_step,
            max_failed_step=task_run.max_failed_step,
            final_completed_at=task_run.final_completed_at,
            deadline_misses=task_run.deadline_misses,
            last_event_at=now,
            now=now + later,
            timeout_s=self.task_timeout_s,
        )

    def _step_failed(self, req: _RequestRun, now: float) -> None:
        task_run = req.task_run
        task_run.max_failed_step = max(task_run.max_failed_step, req.index)
        status, reason = self._task_status(task_run, now)
        self._end_task(task_run, reason if status == "failed" else None, now)

    def _log(self, req: _RequestRun, outcome: str, now: float) -> None:
        if self.request_log is None:
            return
        req.outcome = None
        self.request_log(
            RequestRecord(
                request_id=req.rid,
                tenant=req.task_run.task.tenant,
                arrival=req.arrival,
                first_token_at=req.first_token_at,
                finished_at=now,
                outcome=outcome,
                prompt_tokens=req.spec.prompt_tokens,
                output_tokens=req.spec.output_tokens,
                cached_tokens=req.cached,
                gpu_seconds=req.gpu_s,
                workers=req.placed,
            )
        )

    def _reject(self, req: _RequestRun, stage: str, reason: str, now: float) -> None:
        key = f"{stage}:{reason}"
        self.rejections[key] = self.rejections.get(key, 0) + 1
        if self.request_log is not None:
            self._log(req, key, now)
        req.done = True
        self._ended(req, now, admitted=stage != "admission")
        self._step_failed(req, now)

    def _fail(self, req: _RequestRun, stage: str, reason: str, now: float) -> None:
        key = f"{stage}:{reason}"
        self.failures[key] = self.failures.get(key, 0) + 1
        if self.request_log is not None:
            if req.workers:  # a step in flight still holds it: logged when it lets go
                req.outcome = (key, now)
            else:
                self._log(req, key, now)
        req.done = True
        self._ended(req, now, admitted=True)
        self._step_failed(req, now)

    def _deadline(self, req: _RequestRun, now: float) -> None:
        if req.done:
            return
        # The client gives up: its request is cancelled wherever it is.
        for seq in list(req.workers):
            worker = req.workers[seq]
            if seq.state == DONE:
                continue
            self._touch(worker, now)
            if worker.cancel(seq):
                self._release_cancelled(req, seq, worker)
        if req.reserved is not None:
            req.reserved.reserved -= 1
            req.reserved = None
        self._fail(req, "client", "deadline", now)

    def _release_cancelled(self, req: _RequestRun, seq: Seq, worker: SimWorker) -> None:
        req.workers.pop(seq, None)
        self._charge(req, worker, seq)

    def _end_task(self, task_run: _TaskRun, reason: str | None, now: float) -> None:
        if task_run.ended:
            return
        task_run.ended = True
        self.active_tasks -= 1
        self.tasks_ended += 1
        self.end_time = max(self.end_time, now)
        if reason is None:
            task_run.succeeded = True
            self.tasks_succeeded += 1
            self.successful_usd += task_run.spend
            self.by_priority[task_run.task.priority][0] += 1
        else:
            self.tasks_failed[reason] = self.tasks_failed.get(reason, 0) + 1
            self.wasted_usd += task_run.spend
        if self.progress is not None and self.tasks_ended % self.options.progress_every == 0:
            self.progress(self.tasks_ended, self._total_hint)

    # ------------------------------------------------------------ heartbeats and the autoscaler

    def _heartbeat(self, now: float) -> None:
        for worker in list(self.serving.values()):
            # The host publishes its engine's KV events with each heartbeat; the router's view
            # here reads the caches directly (FleetPrefixView), so they are only let go of.
            worker.blocks.drain_events()
            worker.advance(now)
            if worker.draining and worker.idle and worker.reserved == 0:
                self._remove(worker, now)
                continue
            self._observe(worker, now)
        self._observe_fleet(now)
        if self._work_left():
            self._push(now + self.fleet.heartbeat_s, _HEARTBEAT, None)

    def _autoscale(self, now: float) -> None:
        serving_total = provisioned = desired_total = queued = running = used = blocks = 0
        for index, pool in enumerate(self.fleet.pools):
            label = pool.label(index)
            members = [w for w in self.serving.values() if w.pool == label]
            for w in members:
                w.advance(now)
            active = [w for w in members if not w.draining]
            loads = [
                WorkerLoad(
                    w.worker_id,
                    w.pool,
                    w.role,  # type: ignore[arg-type]
                    w.gpu_type,
                    len(w.waiting),
                    len(w.running) + len(w.ready),
                    w.blocks.used_blocks,
                    w.blocks.total_blocks,
                    now,
                )
                for w in active
            ]
            plans = autoscaler_policy.plan(loads, self.fleet.targets(pool), now)
            starting = [w for w in self.starting.values() if w.pool == label]
            current = len(active) + len(starting)
            desired = plans[0].desired_replicas if plans else current
            if pool.autoscale:
                high = pool.max_replicas or max(pool.replicas, pool.min_replicas)
                desired = max(pool.min_replicas, min(high, desired))
                self._act(pool, index, label, desired, current, active, starting, now)
            self._desired[label] = desired
            serving_total += len(active)
            provisioned += len(members) + len(starting)
            desired_total += desired
            for w in members:
                queued += len(w.waiting)
                running += len(w.running) + len(w.ready)
                used += w.blocks.used_blocks
                blocks += w.blocks.total_blocks
        self.timeline.append(
            FleetSample(
                t=now,
                serving=serving_total,
                provisioned=provisioned,
                desired=desired_total,
                queued=queued,
                running=running,
                kv_utilisation=round(used / blocks, 4) if blocks else 0.0,
            )
        )
        if self._work_left():
            self._push(now + self.fleet.autoscale_interval_s, _AUTOSCALE, None)

    def _act(
        self,
        pool: PoolSpec,
        index: int,
        label: str,
        desired: int,
        current: int,
        active: list[SimWorker],
        starting: list[SimWorker],
        now: float,
    ) -> None:
        if desired > current:
            self._below_since.pop(label, None)
            for _ in range(desired - current):
                worker = self._new_worker(pool, index, now)
                self.starting[worker.worker_id] = worker
                self._push(now + pool.startup_s, _READY, worker)
            return
        if desired == current:
            self._below_since.pop(label, None)
            return
        since = self._below_since.setdefault(label, now)
        if now - since < self.fleet.scale_down_delay_s:
            return
        self._below_since.pop(label, None)
        surplus = current - desired
        for worker in reversed(starting):  # the newest first: replicas not serving yet
            if surplus == 0:
                break
            self._remove(worker, now)
            surplus -= 1
        for worker in reversed(active):
            if surplus == 0:
                break
            worker.draining = True
            self._observe(worker, now)
            surplus -= 1

    # ------------------------------------------------------------ the result

    def _result(self, wall_s: float) -> SimResult:
        end = self.end_time
        start = self.first_arrival if self.first_arrival is not None else 0.0
        duration = max(0.0, end - start)
        provisioned_gpu_s = 0.0
        provisioned_usd = 0.0
        busy_gpu_s = 0.0
        preemptions = 0
        for worker in self.all_workers:
            stop = worker.removed_at if worker.removed_at is not None else end
            seconds = max(0.0, min(stop, end) - worker.provisioned_at) * worker.tensor_parallel
            provisioned_gpu_s += seconds
            provisioned_usd += pricing.price_gpu_seconds(worker.gpu_type, seconds, self.prices)
            busy_gpu_s += worker.busy_seconds * worker.tensor_parallel
            preemptions += worker.preemptions
        replicas = [s.provisioned for s in self.timeline]
        completed = self.requests_completed
        return SimResult(
            policy=self.policy_name,
            workload=self.workload.describe(),
            fleet=_describe_fleet(self.fleet, self.block_size),
            seed=self.seed,
            cost_per_successful_task_usd=ratio(provisioned_usd + self.kv_transfer_usd, self.tasks_succeeded),
            total_spend_usd=provisioned_usd + self.kv_transfer_usd,
            attributed_spend_usd=self.attributed_usd,
            idle_spend_usd=max(0.0, provisioned_usd + self.kv_transfer_usd - self.attributed_usd),
            wasted_spend_usd=self.wasted_usd,
            successful_spend_usd=self.successful_usd,
            busy_gpu_seconds=busy_gpu_s,
            attributed_gpu_seconds=self.attributed_gpu_s,
            provisioned_gpu_seconds=provisioned_gpu_s,
            gpu_utilisation=ratio(busy_gpu_s, provisioned_gpu_s),
            kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_spend_usd=self.kv_transfer_usd,
            tasks=self.tasks,
            tasks_succeeded=self.tasks_succeeded,
            tasks_failed=dict(sorted(self.tasks_failed.items())),
            task_success_by_priority=dict(sorted(self.by_priority.items())),
            requests=self.requests,
            requests_completed=completed,
            rejections=dict(sorted(self.rejections.items())),
            failures=dict(sorted(self.failures.items())),
            goodput_tasks_per_s=ratio(self.tasks_succeeded, duration),
            duration_s=duration,
            ttft_s=latency_stats(self.ttft),
            tpot_s=latency_stats(self.tpot),
            e2e_s=latency_stats(self.e2e),
            queue_s=latency_stats(self.queue),
            slo={
                "ttft_s": self.options.slo_ttft_s,
                "tpot_s": self.options.slo_tpot_s,
                # Over every request issued: a rejected or failed request misses its SLO.
                "attainment": ratio(self.slo_met, self.requests),
                "ttft_attainment": ratio(self.slo_ttft_met, self.requests),
                "tpot_attainment": ratio(self.slo_tpot_met, self.requests),
            },
            prefix_cache={
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": ratio(self.cached_tokens, self.prompt_tokens),
                "upper_bound_tokens": self.upper_bound_tokens if self.options.prefix_upper_bound else None,
                "upper_bound_hit_rate": (
                    ratio(self.upper_bound_tokens, self.prompt_tokens)
                    if self.options.prefix_upper_bound
                    else None
                ),
            },
            preemptions=preemptions,
            fleet_timeline=self.timeline,
            peak_replicas=max(replicas, default=0),
            mean_replicas=sum(replicas) / len(replicas) if replicas else None,
            wall_s=wall_s,
            events=self.events,
            admission=self.admission_variant.name,
            router_config=router_config_changes(self.options.router_config),
            deferred_requests=self.deferred,
            deferral_s=latency_stats(self.deferral),
            slo_by_priority={
                p: ratio(met, issued) for p, (met, issued) in sorted(self.slo_by_priority.items())
            },
            tenants=self._tenant_figures(),
        )

    def _tenant_figures(self) -> dict[str, dict[str, Any]]:
        tenants = self.workload.tenants
        class_tokens: dict[str, int] = {}
        class_weight: dict[str, float] = {}
        for name, figures in self.by_tenant.items():
            tenant = tenants[name]
            class_tokens[tenant.priority] = class_tokens.get(tenant.priority, 0) + figures.admitted_tokens
            class_weight[tenant.priority] = class_weight.get(tenant.priority, 0.0) + tenant.quota.weight
        out: dict[str, dict[str, Any]] = {}
        for name, figures in sorted(self.by_tenant.items()):
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


def _mesh_config() -> MeshConfig:
    """The mesh's configuration: GPU prices, the KV transfer price and the task timeout."""
    from services.mesh.config import load_config

    return load_config()


def _describe_fleet(fleet: FleetSpec, block_size: int) -> dict[str, Any]:
    return {
        "block_size": block_size,
        "heartbeat_s": fleet.heartbeat_s,
        "autoscale_interval_s": fleet.autoscale_interval_s,
        "pools": [
            {
                "name": pool.label(i),
                "role": pool.role,
                "gpu": pool.gpu,
                "shape": pool.shape,
                "replicas": pool.replicas,
                "autoscale": pool.autoscale,
                "min_replicas": pool.min_replicas,
                "max_replicas": pool.max_replicas,
                "tensor_parallel": pool.tensor_parallel,
            }
            for i, pool in enumerate(fleet.pools)
        ],
    }


def run_simulation(
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
) -> SimResult:
    """Replay `workload` on `fleet` under the routing policy `policy` (policies.POLICY_NAMES)."""
    return Simulator(
        workload,
        fleet,
        policy,
        seed=seed,
        options=options,
        progress=progress,
        prices=prices,
        request_log=request_log,
        admission=admission,
    ).run()
