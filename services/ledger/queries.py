"""The ledger's reports in SQL: the SELECTs behind its totals, its per-tenant sums and its figures
of merit, as functions of an open connection (the store, store.py, opens it).

- `totals`, `by_tenant`: sums over ``request_costs`` by status or by tenant.
- `task_statuses`: every task's status as of a time, tasks.py's rules written in SQL (a test
  holds the two equal).
- `report`, `figures`: the figures of merit (figures.py) for the fleet and per tenant, pool or
  workflow, over all time or since a given time: spend from ``events`` (by when it was
  incurred), task counts from ``tasks`` (by their last event), idle spend from ``idle_spend``.
- `quiet_workflows`: the workflows whose last event falls in a window (the abandonment sweep's).

What the rows become (sums normalised, dicts, `Figures`) is summaries.py's, which is pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.ledger.figures import Figures
from services.ledger.schema import STATUSES, events, idle_spend, ledger_errors, request_costs, tasks, workers
from services.ledger.summaries import (
    SUMS,
    FiguresByKey,
    facts_of,
    group_summaries,
    tenant_summaries,
    totals_summary,
    workflow_summary,
)
from services.ledger.tasks import WORKFLOW_KEY_PREFIX, TaskFacts

_rc = request_costs.c
_tc = tasks.c
_wc = workers.c
_ec = events.c
_ic = idle_spend.c

Dimension = Literal["tenant", "pool", "workflow"]
DIMENSIONS: tuple[Dimension, ...] = ("tenant", "pool", "workflow")

# The ``tasks`` columns of `TaskFacts`' fields, in order (summaries.facts_of reads them so).
TASK_FACT_COLUMNS = tuple(_tc[f.name] for f in dataclasses.fields(TaskFacts))
_WORKFLOW: sa.ColumnElement[str] = sa.literal_column("'workflow'", sa.Text)
# The pool of a worker whose heartbeat the ledger never saw.
UNKNOWN_POOL = "unknown"
_UNKNOWN_POOL: sa.ColumnElement[str] = sa.literal_column(f"'{UNKNOWN_POOL}'", sa.Text)


def _literal(value: str) -> sa.ColumnElement[str]:
    """An inlined string constant: the same SQL wherever it appears (GROUP BY matches)."""
    return sa.literal_column(f"'{value}'", sa.Text)


def _sums() -> list[sa.ColumnElement[Any]]:
    return [sa.func.coalesce(sa.func.sum(_rc[name]), 0).label(name) for name in SUMS]


# ---------------------------------------------------------------- requests


async def totals(conn: AsyncConnection) -> dict[str, Any]:
    """Requests by status, spend and GPU-seconds by phase, tokens, events and errors."""
    query = sa.select(_rc.status, sa.func.count().label("requests"), *_sums()).group_by(_rc.status)
    rows = (await conn.execute(query)).all()
    event_count = await conn.scalar(sa.select(sa.func.count()).select_from(events))
    error_count = await conn.scalar(sa.select(sa.func.count()).select_from(ledger_errors))
    return totals_summary(
        (row._mapping for row in rows), STATUSES, int(event_count or 0), int(error_count or 0)
    )


async def by_tenant(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Per tenant: requests by status, spend, GPU-seconds and tokens; biggest spender first."""
    query = sa.select(
        _rc.tenant,
        sa.func.count().label("requests"),
        *(sa.func.count().filter(_rc.status == s).label(s) for s in STATUSES),
        *_sums(),
    ).group_by(_rc.tenant)
    rows = (await conn.execute(query)).all()
    return tenant_summaries((row._mapping for row in rows), STATUSES)


async def by_class(conn: AsyncConnection) -> list[dict[str, Any]]:
    """Per service class (interactive, batch): requests by status, spend, GPU-seconds, tokens
    and the cost per completed request."""
    service_class = sa.func.coalesce(_rc.service_class, _literal("interactive"))
    return await _grouped(conn, service_class, "service_class", first="interactive")


async def by_model(conn: AsyncConnection) -> list[dict[str, Any]]:
    """The same per model (the model that served each request; "unknown" for a request no
    worker reported on, and for rows from before the ledger recorded it)."""
    return await _grouped(conn, sa.func.coalesce(_rc.model, _literal("unknown")), "model")


async def _grouped(
    conn: AsyncConnection, key: Any, name: str, first: str | None = None
) -> list[dict[str, Any]]:
    query = sa.select(
        key.label(name),
        sa.func.count().label("requests"),
        *(sa.func.count().filter(_rc.status == s).label(s) for s in STATUSES),
        *_sums(),
    ).group_by(key)
    rows = (await conn.execute(query)).all()
    return group_summaries((row._mapping for row in rows), STATUSES, name, first=first)


# ---------------------------------------------------------------- tasks


def tasks_with_events(after: float, until: float | None = None, *, workflows_only: bool = False) -> Any:
    """The tasks with an event in [`after`, ∞), or in (`after`, `until`]: those whose last event
    is there are among them. ``tasks`` has no index on its last event (every batch would rewrite
    it): a window of tasks is found through the events' time index instead."""
    query = sa.select(_ec.task_key).where(_ec.task_key.is_not(None))
    if until is None:
        query = query.where(_ec.occurred_at >= after)
    else:
        query = query.where(_ec.occurred_at > after, _ec.occurred_at <= until)
    if workflows_only:
        query = query.where(_ec.task_key.startswith(WORKFLOW_KEY_PREFIX, autoescape=True))
    return query


def tasks_query(size: int) -> sa.Select[Any]:
    """The facts of `size` tasks, by key (bound as ``key0`` ... ``key<size-1>``)."""
    return sa.select(*TASK_FACT_COLUMNS).where(
        _tc.task_key.in_([sa.bindparam(f"key{i}", type_=sa.Text) for i in range(size)])
    )


async def quiet_workflows(conn: AsyncConnection, after: float, until: float) -> list[TaskFacts]:
    """Workflows whose last event is in (`after`, `until`]: those a sweep at `until` + the
    task timeout finds newly abandoned, unless they ended already."""
    query = sa.select(*TASK_FACT_COLUMNS).where(
        _tc.task_key.in_(tasks_with_events(after, until, workflows_only=True)),
        _tc.kind == _WORKFLOW,
        _tc.last_event_at > after,
        _tc.last_event_at <= until,
    )
    return [facts_of(row) for row in await conn.execute(query)]


def task_statuses(now: float, timeout_s: float) -> Any:
    """Every task's status and failure reason as of `now`: tasks.py's rules, in SQL."""
    now_ = sa.literal(now, sa.Double)
    timeout_ = sa.literal(timeout_s, sa.Double)
    quiet = (now_ - _tc.last_event_at) > timeout_
    quiet_success = sa.and_(quiet, _tc.steps.is_(None), _tc.max_completed_step > 0)
    missed = _tc.deadline_misses > 0
    final = _tc.final_completed_at.is_not(None)
    failed_step = _tc.max_failed_step > _tc.max_completed_step
    status = sa.case(
        (missed, _literal("failed")),
        (final, _literal("succeeded")),
        (failed_step, _literal("failed")),
        (quiet_success, _literal("succeeded")),
        (quiet, _literal("failed")),
        else_=_literal("running"),
    )
    reason = sa.case(
        (missed, _literal("deadline_missed")),
        (final, sa.null()),
        (failed_step, _literal("step_failed")),
        (quiet_success, sa.null()),
        (quiet, _literal("abandoned")),
        else_=sa.null(),
    )
    return sa.select(
        _tc.task_key,
        _tc.tenant,
        _tc.last_event_at,
        status.label("status"),
        reason.label("reason"),
    ).subquery("task_status")


# ---------------------------------------------------------------- figures


async def report(
    conn: AsyncConnection,
    *,
    now: float,
    task_timeout_s: float,
    since: float | None,
    by: Dimension | None,
    limit: int,
) -> dict[str, Any]:
    """The figures of merit for the fleet, and per tenant, pool or workflow (`by`), over
    everything recorded or since `since`; task statuses as of `now` (store.py `report`)."""
    statuses = task_statuses(now, task_timeout_s)
    fleet = await _figures(conn, statuses, since, None)
    groups: list[dict[str, Any]] = []
    if by == "workflow":
        groups = await _workflows(conn, now, task_timeout_s, since, limit)
    elif by is not None:
        by_key = await _figures(conn, statuses, since, by)
        groups = [{by: key, **figures.as_dict()} for key, figures in by_key.items()]
        groups.sort(key=lambda g: (-g["spend_usd"], str(g[by])))
    error_query = sa.select(sa.func.count()).select_from(ledger_errors)
    if since is not None:
        error_query = error_query.where(ledger_errors.c.occurred_at >= since)
    errors = int(await conn.scalar(error_query) or 0)
    return {
        "since": since,
        "until": now,
        "task_timeout_s": task_timeout_s,
        "fleet": {**fleet[None].as_dict(), "errors": errors},
        "by": by,
        "groups": groups,
    }


async def figures(
    conn: AsyncConnection,
    *,
    now: float,
    task_timeout_s: float,
    since: float | None,
    by: Literal["tenant", "pool"] | None,
) -> dict[Any, Figures]:
    """`report`'s figures as `Figures`, by tenant or pool (or the fleet's, under None)."""
    return await _figures(conn, task_statuses(now, task_timeout_s), since, by)


async def _figures(
    conn: AsyncConnection, statuses: Any, since: float | None, by: Dimension | None
) -> dict[Any, Figures]:
    """Figures by `by`'s key (None: the fleet, under the key None)."""
    out = FiguresByKey(by)
    pool = sa.func.coalesce(_wc.pool, _UNKNOWN_POOL)
    key = {None: sa.null(), "tenant": _ec.tenant, "pool": pool}[by]
    # Spend, by when it was incurred; waste: that of tasks failed as of now.
    cost = sa.func.coalesce(_ec.cost_usd, 0.0) + sa.func.coalesce(_ec.kv_cost_usd, 0.0)
    failed = statuses.c.status == _literal("failed")
    sources = events.join(statuses, statuses.c.task_key == _ec.task_key)
    if by == "pool":
        sources = sources.outerjoin(workers, _wc.worker_id == _ec.worker_id)
    spend = (
        sa.select(
            key.label("key"),
            sa.func.sum(_ec.cost_usd).label("gpu"),
            sa.func.sum(_ec.kv_cost_usd).label("kv"),
            sa.func.sum(_ec.gpu_seconds).label("gpu_seconds"),
            sa.func.sum(sa.case((failed, cost), else_=0.0)).label("wasted"),
        )
        .select_from(sources)
        .where(_ec.gpu_seconds.is_not(None))
    )
    if since is not None:
        spend = spend.where(_ec.occurred_at >= since)
    if by is not None:
        spend = spend.group_by(key)
    for row in await conn.execute(spend):
        out.add_spend(row.key, row.gpu, row.kv, row.gpu_seconds, row.wasted)
    # Tasks, by when they saw their last event.
    if by == "pool":
        touched = (
            sa.select(_ec.task_key, pool.label("key"))
            .distinct()
            .select_from(events.outerjoin(workers, _wc.worker_id == _ec.worker_id))
            .where(_ec.gpu_seconds.is_not(None))
        )
        if since is not None:
            touched = touched.where(_ec.occurred_at >= since)
        touched_sq = touched.subquery("touched")
        counts = sa.select(
            touched_sq.c.key, statuses.c.status, statuses.c.reason, sa.func.count().label("n")
        ).select_from(touched_sq.join(statuses, statuses.c.task_key == touched_sq.c.task_key))
        group = [touched_sq.c.key]
    else:
        task_key = statuses.c.tenant if by == "tenant" else sa.null()
        counts = sa.select(
            task_key.label("key"), statuses.c.status, statuses.c.reason, sa.func.count().label("n")
        )
        group = [statuses.c.tenant] if by == "tenant" else []
    if since is not None:
        counts = counts.where(
            statuses.c.task_key.in_(tasks_with_events(since)), statuses.c.last_event_at >= since
        )
    counts = counts.group_by(*group, statuses.c.status, statuses.c.reason)
    for count in await conn.execute(counts):
        out.add_tasks(count.key, count.status, count.reason, int(count.n))
    # Idle time, by pool (the fleet's is every pool's).
    if by != "tenant":
        idle = sa.select(
            (_ic.pool if by == "pool" else sa.null()).label("key"),
            sa.func.sum(_ic.idle_cost_usd).label("cost"),
            sa.func.sum(_ic.idle_gpu_seconds).label("seconds"),
            sa.func.sum(_ic.provisioned_gpu_seconds).label("provisioned"),
        )
        if since is not None:
            idle = idle.where(_ic.window_start + _ic.window_s > since)
        if by == "pool":
            idle = idle.group_by(_ic.pool)
        for window in await conn.execute(idle):
            out.add_idle(window.key, window.cost, window.seconds, window.provisioned)
    return out.figures


async def _workflows(
    conn: AsyncConnection, now: float, timeout_s: float, since: float | None, limit: int
) -> list[dict[str, Any]]:
    """The latest workflows (by last event), with their whole spend and status."""
    query = sa.select(*TASK_FACT_COLUMNS).where(_tc.kind == _WORKFLOW)
    if since is not None:
        query = query.where(_tc.task_key.in_(tasks_with_events(since)), _tc.last_event_at >= since)
    query = query.order_by(_tc.last_event_at.desc(), _tc.task_key).limit(limit)
    return [workflow_summary(facts_of(row), now, timeout_s) for row in await conn.execute(query)]
