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
5. autoscaler: every `autoscale_interval_s` (and at once when a request is held), the named
   autoscaler (autoscaling.py: `services.autoscaler.policy.plan` for "ripple", the baselines of
   services/autoscaler/baselines.py) plans every pool from the traffic since its last plan and
   the replicas; pools marked `autoscale` act on the plan (new replicas serve after `startup_s`,
   billed from their start; those it removes drain and stop billing when empty). A request for
   a model with no decode worker serving is held until one is ready (then admitted and routed)
   or until its deadline (or `hold_limit_s`), then rejected ("no_capacity_in_time").

Policies are called through their modules at each decision (never imported by value), so a
test that patches a policy module sees the simulator's decisions change.

This module holds the event loop (`Simulator.run`, `_loop`, the heartbeats) and
`run_simulation`; the rest is layered beneath `Simulator`, one concern a module: state.py (the
run's state and clock), accounting.py (spend and task verdicts), replicas.py (the fleet and the
autoscaler), lifecycle.py (a request's life), admission_flow.py (admission's glue), batch.py (a
Batch API job), per_model.py (several models on one fleet), records.py (per-request records and
`SimOptions`) and results.py (the `SimResult`).
"""

from __future__ import annotations

import gc
import heapq
import time

from services.simulator.admission import DEFAULT_ADMISSION, AdmissionVariant
from services.simulator.fleet import FleetSpec
from services.simulator.metrics import SimResult
from services.simulator.per_model import PerModel
from services.simulator.records import (
    Progress,
    RequestLog,
    RequestRecord,
    SimOptions,
    _RequestRun,
    _TaskRun,
    _TenantFigures,
)
from services.simulator.results import result_of
from services.simulator.state import (
    _ADMISSION,
    _ARRIVAL,
    _AUTOSCALE,
    _BATCH,
    _DEADLINE,
    _HEARTBEAT,
    _HOLD,
    _IMPORT,
    _KICK,
    _NEXT_STEP,
    _PLAN,
    _READY,
    _STEP,
)
from services.simulator.workload import Workload

__all__ = [
    "Progress",
    "RequestLog",
    "RequestRecord",
    "SimOptions",
    "Simulator",
    "_RequestRun",
    "_TaskRun",
    "_TenantFigures",
    "run_simulation",
]


class Simulator(PerModel):
    """One run: the event loop over the fleet (replicas.py), the requests' lives (lifecycle.py),
    admission's glue (admission_flow.py), a Batch API job's runner (batch.py), the figures per
    model (per_model.py) and the ledger's accounting (accounting.py), on the state and clock of
    state.py; `run` returns the `SimResult` (results.py)."""

    def run(self) -> SimResult:
        started = time.perf_counter()
        for index, pool in enumerate(self.fleet.pools):
            for _ in range(pool.replicas):
                self._serve(self._new_worker(pool, index, 0.0), 0.0)
        self._setup_batch()
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
        result = result_of(self, time.perf_counter() - started)
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
                    if self._held and obj.role == "decode":
                        self._release_held(at)
            elif kind == _ADMISSION:
                if at == self._admission_tick_at:
                    self._admission_tick(at)
            elif kind == _PLAN:
                self._held_plan(at)
            elif kind == _HOLD:
                self._hold_expired(obj, at)
            elif kind == _BATCH:
                self._batch_tick(at)
        return events

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
