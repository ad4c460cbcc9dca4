"""What requests and tasks cost and how tasks end: GPU time and KV hand-offs priced by the
ledger's pricing, spend attributed to a task (or to waste once it failed), the ledger's task
rules (`services.ledger.tasks.task_status`), and the infinite-cache upper bound."""

from __future__ import annotations

from services.ledger import pricing
from services.ledger import tasks as ledger_tasks
from services.simulator.records import _RequestRun, _TaskRun
from services.simulator.state import SimState
from services.simulator.worker import Seq, SimWorker
from services.simulator.workload import Step


class Accounting(SimState):
    """The run's ledger: spend charged to requests and tasks, and tasks ended."""

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
        if task_run.model is not None:
            self.by_model[task_run.model].attributed_usd += usd
        if task_run.ended:
            if task_run.succeeded:
                self.successful_usd += usd
            else:
                self.wasted_usd += usd
        else:
            task_run.spend += usd

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
            if task_run.model is not None:
                self.by_model[task_run.model].succeeded += 1
            self.successful_usd += task_run.spend
            self.by_priority[task_run.task.priority][0] += 1
        else:
            self.tasks_failed[reason] = self.tasks_failed.get(reason, 0) + 1
            self.wasted_usd += task_run.spend
        if self.progress is not None and self.tasks_ended % self.options.progress_every == 0:
            self.progress(self.tasks_ended, self._total_hint)

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
