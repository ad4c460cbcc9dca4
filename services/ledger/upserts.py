"""The statements the ledger writes with: one upsert per table that a batch or the idle sampler
changes, built for a dialect (SQLite or PostgreSQL), and the order of the fields in their rows.

A batch's deltas (fold.py) land on the rows already there through these upserts: added columns
add, maxima and minima combine, the rest are replaced or only fill a gap, as fold.py describes
(and why that gives the row recording the events one at a time would). Their only parameters
are the rows' values: the store (store.py) compiles each statement once and sends its rows as
plain tuples, in the order of the `*_FIELDS` below.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from services.ledger.fold import EVENT_ROW_FIELDS, RequestDelta, TaskDelta, WorkerBusy
from services.ledger.schema import idle_spend, request_costs, tasks, workers

_rc = request_costs.c
_tc = tasks.c
_wc = workers.c
_ic = idle_spend.c

# Columns a delta adds to an existing row; the others it replaces or fills (see fold.py).
_REQUEST_ADDED = (
    "prefill_gpu_seconds",
    "decode_gpu_seconds",
    "prefill_cost_usd",
    "decode_cost_usd",
    "kv_transfer_bytes",
    "kv_cost_usd",
)
_TASK_ADDED = (
    "deadline_misses",
    "completions",
    "failures",
    "gpu_seconds",
    "gpu_cost_usd",
    "kv_cost_usd",
    "kv_transfer_bytes",
)

# Rows go to the store's compiled statements as tuples of these fields' values, in this order.
EVENT_FIELDS = (*EVENT_ROW_FIELDS, "recorded_at")
# A delta's fields (the request_costs columns: has_* are told by them, see the upsert), then
# updated_at.
_DELTA_FIELDS = tuple(
    f.name for f in dataclasses.fields(RequestDelta) if f.name not in ("has_prefill", "has_decode")
)
REQUEST_FIELDS = (*_DELTA_FIELDS, "updated_at")
_TASK_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(TaskDelta))
TASK_FIELDS = (*_TASK_DELTA_FIELDS, "updated_at")
_BUSY_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerBusy))
BUSY_FIELDS = (*_BUSY_DELTA_FIELDS, "updated_at")
ERROR_FIELDS = ("event_id", "request_id", "reason", "occurred_at")
ACCOUNT_FIELDS = (
    "worker_id",
    "pool",
    "gpu_type",
    "started_at",
    "idle_covered_until",
    "idle_busy_counted_s",
    "idle_debt_s",
    "last_seen_at",
    "updated_at",
)
IDLE_FIELDS = (
    "window_start",
    "pool",
    "gpu_type",
    "window_s",
    "provisioned_gpu_seconds",
    "busy_gpu_seconds",
    "idle_gpu_seconds",
    "idle_cost_usd",
    "samples",
    "updated_at",
)
# A delta's values, in its fields' order above (updated_at is the store's to add).
delta_values: Callable[[RequestDelta], tuple[Any, ...]] = operator.attrgetter(*_DELTA_FIELDS)
task_values: Callable[[TaskDelta], tuple[Any, ...]] = operator.attrgetter(*_TASK_DELTA_FIELDS)
busy_values: Callable[[WorkerBusy], tuple[Any, ...]] = operator.attrgetter(*_BUSY_DELTA_FIELDS)

# Inlined rather than bound, so that the upsert's only parameters are the rows' fields.
_RUNNING: sa.ColumnElement[str] = sa.literal_column("'running'", sa.Text)
_COMPLETED: sa.ColumnElement[str] = sa.literal_column("'completed'", sa.Text)


def upsert_requests(dialect: str) -> Any:
    """One upsert for every `RequestDelta`: a new row is the delta itself; an existing one
    combines with it as fold.py describes."""
    stmt = insert(dialect, request_costs)
    excluded = stmt.excluded
    # Whether the delta holds a prefill (decode) report: only such a report sets its GPU
    # type. Told by the row itself, so that the statement's only parameters are its values.
    has_prefill = excluded.gpu_type_prefill.is_not(None)
    has_decode = excluded.gpu_type_decode.is_not(None)

    def replaced_if(reported: sa.ColumnElement[Any], name: str) -> sa.ColumnElement[Any]:
        return sa.case((reported, excluded[name]), else_=_rc[name])

    updates: dict[str, Any] = {
        "updated_at": excluded.updated_at,
        "workflow_id": sa.func.coalesce(_rc.workflow_id, excluded.workflow_id),
        # A completion's worker replaces; routing's (the delta's otherwise) only fills a gap.
        "prefill_worker": sa.case(
            (has_prefill, excluded.prefill_worker),
            else_=sa.func.coalesce(_rc.prefill_worker, excluded.prefill_worker),
        ),
        "decode_worker": sa.case(
            (has_decode, excluded.decode_worker),
            else_=sa.func.coalesce(_rc.decode_worker, excluded.decode_worker),
        ),
        "gpu_type_prefill": replaced_if(has_prefill, "gpu_type_prefill"),
        "gpu_type_decode": replaced_if(has_decode, "gpu_type_decode"),
        "prompt_tokens": replaced_if(sa.or_(has_prefill, has_decode), "prompt_tokens"),
        "cached_tokens": replaced_if(sa.or_(has_prefill, has_decode), "cached_tokens"),
        "completion_tokens": replaced_if(has_decode, "completion_tokens"),
        "finish_reason": replaced_if(has_decode, "finish_reason"),
        "latency_s": replaced_if(has_decode, "latency_s"),
        # The delta's status is the one its events give a running request: 'running' keeps
        # the row's, and a completed request stays completed.
        "status": sa.case(
            (
                sa.or_(excluded.status == _RUNNING, _rc.status == _COMPLETED),
                _rc.status,
            ),
            else_=excluded.status,
        ),
        "completed_at": replaced_if(has_decode, "completed_at"),
        "deadline_at": sa.func.coalesce(_rc.deadline_at, excluded.deadline_at),
        "workflow_step": sa.func.coalesce(_rc.workflow_step, excluded.workflow_step),
        "workflow_steps": sa.func.coalesce(_rc.workflow_steps, excluded.workflow_steps),
        "service_class": sa.func.coalesce(_rc.service_class, excluded.service_class),
        "model": sa.func.coalesce(_rc.model, excluded.model),
    }
    updates.update({name: _rc[name] + excluded[name] for name in _REQUEST_ADDED})
    return stmt.on_conflict_do_update(index_elements=[_rc.request_id], set_=updates)


def upsert_tasks(dialect: str) -> Any:
    """One upsert for every `TaskDelta`: sums add, maxima and minima combine, the row's tenant
    and workflow id stay (fold.py)."""
    stmt = insert(dialect, tasks)
    excluded = stmt.excluded
    updates: dict[str, Any] = {
        "workflow_id": sa.func.coalesce(_tc.workflow_id, excluded.workflow_id),
        "steps": greatest(dialect, _tc.steps, excluded.steps, nullable=True),
        "max_completed_step": greatest(dialect, _tc.max_completed_step, excluded.max_completed_step),
        "max_failed_step": greatest(dialect, _tc.max_failed_step, excluded.max_failed_step),
        "final_completed_at": least(
            dialect, _tc.final_completed_at, excluded.final_completed_at, nullable=True
        ),
        "first_event_at": least(dialect, _tc.first_event_at, excluded.first_event_at),
        "last_event_at": greatest(dialect, _tc.last_event_at, excluded.last_event_at),
        "updated_at": excluded.updated_at,
    }
    updates.update({name: _tc[name] + excluded[name] for name in _TASK_ADDED})
    return stmt.on_conflict_do_update(index_elements=[_tc.task_key], set_=updates)


def upsert_busy(dialect: str) -> Any:
    """Each worker's running sums of reported GPU time (the idle sampler's input)."""
    stmt = insert(dialect, workers)
    excluded = stmt.excluded
    updates = {
        "gpu_type": excluded.gpu_type,
        "busy_gpu_seconds": _wc.busy_gpu_seconds + excluded.busy_gpu_seconds,
        "busy_cost_usd": _wc.busy_cost_usd + excluded.busy_cost_usd,
        "updated_at": excluded.updated_at,
    }
    return stmt.on_conflict_do_update(index_elements=[_wc.worker_id], set_=updates)


def upsert_accounts(dialect: str) -> Any:
    """A sampled worker's pool, start and idle account; its busy sums are the batches'."""
    stmt = insert(dialect, workers)
    excluded = stmt.excluded
    # Every field of the row but its key (ACCOUNT_FIELDS[0], the worker id).
    updates = {name: excluded[name] for name in ACCOUNT_FIELDS[1:]}
    return stmt.on_conflict_do_update(index_elements=[_wc.worker_id], set_=updates)


def upsert_idle(dialect: str) -> Any:
    """The idle sampler's shares of idle time, summed per pool and window (idle.py)."""
    stmt = insert(dialect, idle_spend)
    excluded = stmt.excluded
    updates: dict[str, Any] = {
        name: _ic[name] + excluded[name]
        for name in (
            "provisioned_gpu_seconds",
            "busy_gpu_seconds",
            "idle_gpu_seconds",
            "idle_cost_usd",
            "samples",
        )
    }
    updates["updated_at"] = excluded.updated_at
    keys = [_ic.window_start, _ic.pool, _ic.gpu_type]
    return stmt.on_conflict_do_update(index_elements=keys, set_=updates)


def greatest(dialect: str, a: Any, b: Any, *, nullable: bool = False) -> Any:
    """The larger of two values; with `nullable`, a NULL is no value (the other wins)."""
    if dialect == "postgresql":
        return sa.func.greatest(a, b)  # ignores NULLs
    if nullable:  # SQLite's max(a, b) is NULL when either is
        return sa.func.max(sa.func.coalesce(a, b), sa.func.coalesce(b, a))
    return sa.func.max(a, b)


def least(dialect: str, a: Any, b: Any, *, nullable: bool = False) -> Any:
    """The smaller of two values; with `nullable`, a NULL is no value (the other wins)."""
    if dialect == "postgresql":
        return sa.func.least(a, b)
    if nullable:
        return sa.func.min(sa.func.coalesce(a, b), sa.func.coalesce(b, a))
    return sa.func.min(a, b)


def insert(dialect: str, table: sa.Table) -> Any:
    """A dialect-specific INSERT, for its ON CONFLICT clauses."""
    if dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)
