"""A Batch API job in the simulator: N lines submitted at the start with a completion window,
released into the fleet by the mesh's own policy (`services.batch.policy.release`, called through
its module at every tick, as the runner service calls it), and the figures of each service class.

The runner's side, as services/batch/service.py does it:

- every `tick_s` (the runner's 0.25 s) the policy sees the live decode workers as their last
  heartbeats tell the router (`running`, `queue_depth`, KV use, draining), the lines waiting and
  in flight, and when it last saw interactive pressure or pushback; the lines it releases are
  issued as single requests of the job's tenant, class `sheddable` at admission's lowest
  `priority_level`, service class `batch`;
- **pressure**: an interactive request admission deferred, or refused for capacity; **pushback**:
  one of the job's lines deferred, or refused for capacity or quota (the runner's rule on
  `rmesh.events.admission` and `rmesh.events.rejected`);
- a line refused (admission or router) goes back to the queue, as a 429/503 does in the mesh; a
  line that fails on a worker is a failed line; past the window no line is released (the rest
  expire), lines in flight finish.

Each attempt is a task of its own to the ledger's rules: a refused attempt is a failed task
(nothing spent on it), its retry another task.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from services.admission.policy import AdmissionRequest
from services.batch import policy as batch_policy
from services.simulator.admission_flow import AdmissionFlow
from services.simulator.metrics import ratio
from services.simulator.records import ClassFigures, _RequestRun, _TaskRun, completion_counted
from services.simulator.state import _BATCH
from services.simulator.worker import SimWorker
from services.simulator.workload import SingleRequest, Step, Task, Tenant, random_prompt_hashes

BATCH_CLASS = "batch"
INTERACTIVE_CLASS = "interactive"


@dataclass(frozen=True, slots=True)
class BatchJob:
    """A Batch API job: `lines` requests submitted at `submitted_at`, to finish within
    `window_s` (the API's 24 h). Sizes are log-normal around their means (sigma `spread`),
    drawn from `seed`; every line's prompt is its own (no prefix shared)."""

    lines: int = 1000
    prompt_tokens: float = 1000.0
    output_tokens: float = 300.0
    spread: float = 0.6
    max_tokens: int = 8192
    window_s: float = 86_400.0
    submitted_at: float = 0.0
    tick_s: float = 0.25  # the runner's loop
    tenant: str = "batch-api"
    seed: int = 0
    limits: batch_policy.BatchLimits = field(default_factory=batch_policy.BatchLimits)

    def __post_init__(self) -> None:
        if self.lines < 0 or self.window_s <= 0 or self.tick_s <= 0:
            raise ValueError("a batch needs lines >= 0, window_s > 0 and tick_s > 0")

    def describe(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "spread": self.spread,
            "window_s": self.window_s,
            "submitted_at": self.submitted_at,
            "tick_s": self.tick_s,
            "seed": self.seed,
            "limits": dataclasses.asdict(self.limits),
        }


class BatchLine(SingleRequest):
    """One attempt at a batch line: a single request of the batch class."""

    __slots__ = ("line",)
    service_class = BATCH_CLASS

    def __init__(self, task_id: str, tenant: str, arrival_s: float, step: Step, line: int):
        super().__init__(task_id, tenant, "sheddable", arrival_s, step)
        self.line = line


class _BatchRun:
    """The runner's state for the job: lines waiting (their index), in flight, and done."""

    __slots__ = (
        "attempts",
        "completed",
        "completed_at",
        "decisions",
        "expired",
        "failed",
        "in_flight",
        "last_pressure_at",
        "last_pushback_at",
        "pending",
        "steps",
        "ticking",
    )

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.pending: list[int] = list(range(len(steps)))[::-1]  # popped from the end: line 0 first
        self.in_flight: set[str] = set()
        self.completed = 0
        self.failed = 0
        self.expired = 0
        self.attempts = 0
        self.completed_at: float | None = None
        self.last_pressure_at: float | None = None
        self.last_pushback_at: float | None = None
        self.decisions: dict[str, int] = {}
        self.ticking = False


def _lines(job: BatchJob, model: str, block_size: int) -> list[Step]:
    rng = random.Random(job.seed)
    sigma = job.spread

    def size(mean: float) -> int:
        mu = math.log(max(mean, 1.0)) - sigma * sigma / 2.0
        return max(1, min(job.max_tokens, round(rng.lognormvariate(mu, sigma))))

    steps = []
    for i in range(job.lines):
        prompt, output = size(job.prompt_tokens), size(job.output_tokens)
        hashes = random_prompt_hashes(model, block_size, prompt // block_size, salt=(1 << 30) + i)
        steps.append(Step(prompt_tokens=prompt, output_tokens=output, block_hashes=hashes))
    return steps


class BatchFlow(AdmissionFlow):
    """The runner's loop and the per-class figures, over admission and the requests' lives."""

    def _setup_batch(self) -> None:
        job = self.options.batch
        self._batch: _BatchRun | None = None
        if job is None:
            return
        tenant = Tenant(job.tenant, "sheddable")
        self.tenants[job.tenant] = tenant
        self._quotas.update(self.admission_variant.quotas({job.tenant: tenant.quota}))
        self._batch = _BatchRun(_lines(job, self.workload.model, self.block_size))
        self._batch_tick_soon(job.submitted_at)

    def _class_of(self, task: Task) -> ClassFigures:
        figures = self.by_class.get(task.service_class)
        if figures is None:
            figures = self.by_class[task.service_class] = ClassFigures()
        return figures

    # ------------------------------------------------------------ the runner's loop

    def _batch_tick_soon(self, at: float) -> None:
        run = self._batch
        if run is not None and not run.ticking:
            run.ticking = True
            self._push(at, _BATCH, None)

    def _batch_tick(self, now: float) -> None:
        run, job = self._batch, self.options.batch
        assert run is not None and job is not None
        run.ticking = False
        if not run.pending:
            return  # woken again when a refused line comes back
        if batch_policy.expired(job.submitted_at + job.window_s, now):
            run.expired += len(run.pending)
            run.pending.clear()
            return
        workers = [
            batch_policy.WorkerLoad.of(w)
            for w in self.router_state.workers.values()
            if w.role != "prefill" and w.model == self.workload.model and w.worker_id in self.serving
        ]
        state = batch_policy.RunnerState(
            pending=len(run.pending),
            in_flight=len(run.in_flight),
            last_pressure_at=run.last_pressure_at,
            last_pushback_at=run.last_pushback_at,
        )
        decision = batch_policy.release(workers, state, job.limits, now)
        run.decisions[decision.reason] = run.decisions.get(decision.reason, 0) + 1
        for _ in range(decision.count):
            self._issue_line(run, job, run.pending.pop(), now)
        self._batch_tick_soon(now + job.tick_s)

    def _issue_line(self, run: _BatchRun, job: BatchJob, line: int, now: float) -> None:
        run.attempts += 1
        task = BatchLine(f"batch{line}-{run.attempts}", job.tenant, now, run.steps[line], line)
        run.in_flight.add(task.task_id)
        if self.first_arrival is None:
            self.first_arrival = now
        self.tasks += 1
        self.active_tasks += 1
        self.by_priority.setdefault(task.priority, [0, 0])[1] += 1
        self._class_of(task).tasks += 1
        self._issue(_TaskRun(task), task.step(1), now)

    def _work_left(self) -> bool:
        run = self._batch
        return super()._work_left() or (run is not None and bool(run.pending or run.in_flight))

    # ------------------------------------------------------------ what the runner hears

    def _admission_request(self, req: _RequestRun) -> AdmissionRequest:
        request = super()._admission_request(req)
        if req.task_run.task.service_class == BATCH_CLASS:
            # As the mesh's `prepare` runs a batch line: the lowest level of the lowest class.
            return dataclasses.replace(request, priority_level=self.admission_limits.min_priority_level)
        return request

    def _admit(self, req: _RequestRun, now: float, *, counted: bool = False) -> bool:
        deferred = self.deferred
        go = super()._admit(req, now, counted=counted)
        if self.deferred > deferred:
            self._held_back(req, now)
        return go

    def _held_back(self, req: _RequestRun, now: float) -> None:
        run = self._batch
        if run is None:
            return
        if req.task_run.task.service_class == BATCH_CLASS:
            run.last_pushback_at = now
        else:
            run.last_pressure_at = now

    def _reject(self, req: _RequestRun, stage: str, reason: str, now: float) -> None:
        task = req.task_run.task
        own = task.service_class == BATCH_CLASS
        if stage == "admission" and (reason == "capacity" or (own and reason == "quota")):
            self._held_back(req, now)
        run = self._batch
        if own and run is not None and isinstance(task, BatchLine) and task.task_id in run.in_flight:
            # Refused for now: the line goes back to the queue (a 429/503 in the mesh), and this
            # attempt ends as a failed task of its own.
            run.in_flight.discard(task.task_id)
            run.pending.append(task.line)
            self._batch_tick_soon(now)
        super()._reject(req, stage, reason, now)

    # ------------------------------------------------------------ per-class figures

    def _issue(self, task_run: _TaskRun, spec: Step, now: float) -> None:
        self._class_of(task_run.task).requests += 1
        super()._issue(task_run, spec, now)

    def _arrival(self, task: Task, now: float) -> None:
        self._class_of(task).tasks += 1
        super()._arrival(task, now)

    def _complete(self, req: _RequestRun, now: float) -> None:
        with completion_counted(self._class_of(req.task_run.task), req, now, self):
            super()._complete(req, now)

    def _charge(self, req: _RequestRun, worker: SimWorker, seq: Any) -> None:
        before = self.attributed_usd
        super()._charge(req, worker, seq)
        self._class_of(req.task_run.task).attributed_usd += self.attributed_usd - before

    def _end_task(self, task_run: _TaskRun, reason: str | None, now: float) -> None:
        if task_run.ended:
            return
        super()._end_task(task_run, reason, now)
        task = task_run.task
        if task_run.succeeded:
            self._class_of(task).succeeded += 1
        run = self._batch
        if run is None or not isinstance(task, BatchLine) or task.task_id not in run.in_flight:
            return
        run.in_flight.discard(task.task_id)
        if task_run.succeeded:
            run.completed += 1
            if run.completed + run.failed == len(run.steps):
                run.completed_at = now
        else:
            run.failed += 1
        if run.pending:
            self._batch_tick_soon(now)

    def batch_summary(self) -> dict[str, Any] | None:
        run, job = self._batch, self.options.batch
        if run is None or job is None:
            return None
        took = run.completed_at - job.submitted_at if run.completed_at is not None else None
        return {
            **job.describe(),
            "completed": run.completed,
            "failed": run.failed,
            "expired": run.expired,
            "attempts": run.attempts,
            "completed_in_s": took,
            "within_window": took is not None and run.failed == 0 and took <= job.window_s,
            "release_decisions": dict(sorted(run.decisions.items())),
        }

    def class_summary(self) -> dict[str, dict[str, Any]]:
        """Per service class: requests, SLO attainment (over the requests issued), TTFT p99, tasks
        succeeded, the ledger's spend and cost per successful task (its spend over its tasks
        that succeeded, as GET /v1/ledger/classes reports it)."""
        out: dict[str, dict[str, Any]] = {}
        for name, f in sorted(self.by_class.items()):
            out[name] = {
                "requests": f.requests,
                "completed": f.completed,
                "slo_attainment": ratio(f.slo_met, f.requests),
                "ttft_p50_s": f.ttft.quantile(0.5),
                "ttft_p99_s": f.ttft.quantile(0.99),
                "tasks": f.tasks,
                "tasks_succeeded": f.succeeded,
                "attributed_spend_usd": f.attributed_usd,
                "cost_per_successful_task_usd": ratio(f.attributed_usd, f.succeeded),
            }
        return out
