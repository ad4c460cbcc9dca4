"""Tasks: what the figure of merit counts. Pure functions, no I/O.

A task is a standalone request, or every request that shares a `workflow_id` (an agent run).
The ledger keeps one row of facts per task (``tasks``, store.py), each fact a sum, a maximum or a
minimum over the task's events, so that any order of events (and any batching) gives the same
row. A task's status is a function of those facts and of the time of evaluation (`task_status`);
the store evaluates the same rules in SQL (`queries.task_statuses`), and a test holds the two equal.

Rules, in order:

1. A request of the task completed after its ``deadline_at``: **failed** (``deadline_missed``).
2. Its final step completed: **succeeded**. The final step is the completion whose
   `workflow_step` equals its `workflow_steps` (a standalone request is one step of one).
3. A step failed (``RequestFailed`` or ``RequestRejected``) beyond the highest step completed:
   **failed** (``step_failed``). A failure is terminal unless the same step, or a later one,
   completes: a step retried under a new request id (with the same workflow step) revives the
   task, since status is always re-evaluated from everything recorded so far. A failure whose
   step is unknown (an older producer) is superseded only by the final step.
4. No event for longer than the task timeout: **failed** (``abandoned``), except for a workflow
   that never said how many steps it has (`WorkflowRef.steps` unset): if it went quiet with a
   step completed and no failure, its last completed step was its final one: **succeeded**.
5. Otherwise **running**.

A task's spend is every GPU-second and KV transfer its requests reported, retried and migrated
requests included; only events that carry cost or outcome (completions, failures, rejections)
belong to a task, because only they carry the workflow id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas.events import WorkflowSpend

TaskKind = Literal["request", "workflow"]
TaskStatus = Literal["running", "succeeded", "failed"]
FailureReason = Literal["step_failed", "deadline_missed", "abandoned"]

TASK_STATUSES: tuple[TaskStatus, ...] = ("running", "succeeded", "failed")
FAILURE_REASONS: tuple[FailureReason, ...] = ("step_failed", "deadline_missed", "abandoned")

# The step of a failure whose step is unknown: beyond any step, so only the final step's
# completion supersedes it. Fits a 32-bit INTEGER column.
UNKNOWN_STEP = 2**31 - 1

WORKFLOW_KEY_PREFIX = "wf:"
REQUEST_KEY_PREFIX = "rq:"


def task_key(workflow_id: str | None, request_id: str) -> str:
    """The task an event belongs to: its workflow's, else its request's own.

    Identifiers never hold ``:``, so the two kinds of key never collide.
    """
    if workflow_id:
        return WORKFLOW_KEY_PREFIX + workflow_id
    return REQUEST_KEY_PREFIX + request_id


def task_kind(key: str) -> TaskKind:
    return "workflow" if key.startswith(WORKFLOW_KEY_PREFIX) else "request"


def workflow_key(workflow_id: str) -> str:
    return WORKFLOW_KEY_PREFIX + workflow_id


@dataclass(frozen=True, slots=True)
class TaskFacts:
    """One task's row, as recorded (see `fold.TaskDelta` for how each fact combines)."""

    task_key: str
    tenant: str
    workflow_id: str | None
    steps: int | None
    max_completed_step: int
    max_failed_step: int
    final_completed_at: float | None
    deadline_misses: int
    completions: int
    failures: int
    gpu_seconds: float
    gpu_cost_usd: float
    kv_cost_usd: float
    first_event_at: float
    last_event_at: float

    @property
    def spend_usd(self) -> float:
        return self.gpu_cost_usd + self.kv_cost_usd


def task_status(
    *,
    steps: int | None,
    max_completed_step: int,
    max_failed_step: int,
    final_completed_at: float | None,
    deadline_misses: int,
    last_event_at: float,
    now: float,
    timeout_s: float,
) -> tuple[TaskStatus, FailureReason | None]:
    """The task's status and, when failed, why (the module's rules)."""
    if deadline_misses > 0:
        return "failed", "deadline_missed"
    if final_completed_at is not None:
        return "succeeded", None
    if max_failed_step > max_completed_step:
        return "failed", "step_failed"
    if now - last_event_at > timeout_s:
        if steps is None and max_completed_step > 0:
            return "succeeded", None
        return "failed", "abandoned"
    return "running", None


def status_of(facts: TaskFacts, now: float, timeout_s: float) -> tuple[TaskStatus, FailureReason | None]:
    return task_status(
        steps=facts.steps,
        max_completed_step=facts.max_completed_step,
        max_failed_step=facts.max_failed_step,
        final_completed_at=facts.final_completed_at,
        deadline_misses=facts.deadline_misses,
        last_event_at=facts.last_event_at,
        now=now,
        timeout_s=timeout_s,
    )


def workflow_spend(facts: TaskFacts, now: float, timeout_s: float) -> WorkflowSpend:
    """The WORKFLOW_SPEND bucket's value for a workflow task."""
    if facts.workflow_id is None:
        raise ValueError(f"task {facts.task_key!r} is not a workflow")
    status, reason = status_of(facts, now, timeout_s)
    return WorkflowSpend(
        workflow_id=facts.workflow_id,
        tenant=facts.tenant,
        spend_usd=max(0.0, facts.spend_usd),
        gpu_seconds=max(0.0, facts.gpu_seconds),
        steps_completed=facts.max_completed_step,
        steps=facts.steps,
        status=status,
        reason=reason,
        first_event_at=max(0.0, facts.first_event_at),
        last_event_at=max(0.0, facts.last_event_at),
        updated_at=now,
    )
