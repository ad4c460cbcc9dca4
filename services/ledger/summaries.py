"""What the ledger's reads answer, made from the rows their SELECTs return: pure functions, no I/O.

The SQL is store.py's and queries.py's; this module only normalises, sums and shapes what comes
back. The drivers differ in the types they return (PostgreSQL's SUM of integers is NUMERIC, a
Decimal; SQLite may give an int for a whole REAL): the answers do not, they hold int and float.

- `request_summary`: one ``request_costs`` row, with its total cost and GPU-seconds.
- `totals_summary`, `tenant_summaries`: the sums per status or per tenant (`SUMS`), with the
  derived figures (`with_derived`).
- `facts_of`, `workflow_summary`: a ``tasks`` row as `TaskFacts`, and a workflow's line in a
  report.
- `FiguresByKey`: the figures of merit (figures.py) of each group, summed from the report's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.ledger.figures import Figures
from services.ledger.tasks import FailureReason, TaskFacts, TaskStatus, status_of

# The ``request_costs`` columns the totals sum: float ones, then integer ones.
FLOAT_SUMS = (
    "prefill_cost_usd",
    "decode_cost_usd",
    "kv_cost_usd",
    "prefill_gpu_seconds",
    "decode_gpu_seconds",
)
INT_SUMS = ("prompt_tokens", "cached_tokens", "completion_tokens", "kv_transfer_bytes")
SUMS = (*FLOAT_SUMS, *INT_SUMS)


def zero_sums() -> dict[str, float]:
    return {name: 0 for name in SUMS}


def sums_of(row: Mapping[Any, Any]) -> dict[str, float]:
    # PostgreSQL's SUM of integers is NUMERIC (Decimal): normalise to int and float.
    values: dict[str, float] = {name: float(row[name]) for name in FLOAT_SUMS}
    values.update({name: int(row[name]) for name in INT_SUMS})
    return values


def with_derived(sums: dict[str, float]) -> dict[str, float]:
    return {
        "spend_usd": sums["prefill_cost_usd"] + sums["decode_cost_usd"] + sums["kv_cost_usd"],
        "prefill_spend_usd": sums["prefill_cost_usd"],
        "decode_spend_usd": sums["decode_cost_usd"],
        "kv_transfer_spend_usd": sums["kv_cost_usd"],
        "gpu_seconds": sums["prefill_gpu_seconds"] + sums["decode_gpu_seconds"],
        "prefill_gpu_seconds": sums["prefill_gpu_seconds"],
        "decode_gpu_seconds": sums["decode_gpu_seconds"],
        **{name: sums[name] for name in INT_SUMS},
    }


def request_summary(row: Mapping[Any, Any]) -> dict[str, Any]:
    """A ``request_costs`` row as a dict of int and float, with its total cost and GPU-seconds."""
    result = dict(row)
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "kv_transfer_bytes"):
        result[name] = int(result[name])
    for name in (
        "prefill_gpu_seconds",
        "decode_gpu_seconds",
        "prefill_cost_usd",
        "decode_cost_usd",
    ):
        result[name] = float(result[name])
    result["kv_cost_usd"] = float(result["kv_cost_usd"])
    result["cost_usd"] = result["prefill_cost_usd"] + result["decode_cost_usd"] + result["kv_cost_usd"]
    result["gpu_seconds"] = result["prefill_gpu_seconds"] + result["decode_gpu_seconds"]
    return result


def totals_summary(
    rows: Iterable[Mapping[Any, Any]], statuses: Sequence[str], events: int, errors: int
) -> dict[str, Any]:
    """The totals from one row per status (its ``status``, ``requests`` and `SUMS`)."""
    by_status = {status: 0 for status in statuses}
    sums = zero_sums()
    for row in rows:
        by_status[row["status"]] = int(row["requests"])
        for name, value in sums_of(row).items():
            sums[name] += value
    return {
        "requests": by_status,
        "requests_total": sum(by_status.values()),
        **with_derived(sums),
        "events": events,
        "errors": errors,
    }


def tenant_summaries(rows: Iterable[Mapping[Any, Any]], statuses: Sequence[str]) -> list[dict[str, Any]]:
    """One dict per tenant row (its ``tenant``, ``requests``, a count per status and `SUMS`),
    biggest spender first."""
    tenants = [
        {
            "tenant": row["tenant"],
            "requests": int(row["requests"]),
            **{status: int(row[status]) for status in statuses},
            **with_derived(sums_of(row)),
        }
        for row in rows
    ]
    tenants.sort(key=lambda t: (-t["spend_usd"], t["tenant"]))
    return tenants


def group_summaries(
    rows: Iterable[Mapping[Any, Any]], statuses: Sequence[str], key: str, *, first: str | None = None
) -> list[dict[str, Any]]:
    """One dict per row of requests grouped by `key` (a service class, a model): the group,
    ``requests``, a count per status, `SUMS` with the derived figures, and
    ``cost_per_completed_request_usd`` (the group's whole spend over its completed requests,
    None with none completed); the group named `first` first, then by name."""
    classes: list[dict[str, Any]] = []
    for row in rows:
        summary: dict[str, Any] = {
            key: row[key],
            "requests": int(row["requests"]),
            **{status: int(row[status]) for status in statuses},
            **with_derived(sums_of(row)),
        }
        completed = summary.get("completed", 0)
        summary["cost_per_completed_request_usd"] = summary["spend_usd"] / completed if completed else None
        classes.append(summary)
    classes.sort(key=lambda c: (c[key] != first, c[key]))
    return classes


def facts_of(row: Sequence[Any]) -> TaskFacts:
    """A ``tasks`` row (the columns of `TaskFacts`' fields, in order) as facts. Both drivers
    return these columns as str, int and float already (SQLite may give an int for a whole REAL)."""
    final = row[6]
    return TaskFacts(
        row[0],
        row[1],
        row[2],
        row[3],
        row[4],
        row[5],
        None if final is None else float(final),
        row[7],
        row[8],
        row[9],
        float(row[10]),
        float(row[11]),
        float(row[12]),
        float(row[13]),
        float(row[14]),
    )


def workflow_summary(facts: TaskFacts, now: float, timeout_s: float) -> dict[str, Any]:
    """A workflow's line in a report by workflow: its whole spend, and its status as of `now`."""
    status, reason = status_of(facts, now, timeout_s)
    return {
        "workflow": facts.workflow_id,
        "tenant": facts.tenant,
        "status": status,
        "reason": reason,
        "steps": facts.steps,
        "steps_completed": facts.max_completed_step,
        "completions": facts.completions,
        "failures": facts.failures,
        "deadline_misses": facts.deadline_misses,
        "spend_usd": facts.spend_usd,
        "gpu_spend_usd": facts.gpu_cost_usd,
        "kv_transfer_spend_usd": facts.kv_cost_usd,
        "wasted_spend_usd": facts.spend_usd if status == "failed" else 0.0,
        "gpu_seconds": facts.gpu_seconds,
        "first_event_at": facts.first_event_at,
        "last_event_at": facts.last_event_at,
    }


class FiguresByKey:
    """The figures of each group (a tenant, a pool; the fleet under the key None), summed from
    the report's rows of spend, task counts and idle time. A group's figures start at zero when
    its first row comes; idle time is not attributed to tenants (their idle figures stay None)."""

    def __init__(self, by: str | None) -> None:
        self.by = by
        self.figures: dict[Any, Figures] = {}
        if by is None:
            self.of(None)  # the fleet has figures even when nothing was recorded

    def of(self, key: Any) -> Figures:
        found = self.figures.get(key)
        if found is None:
            found = self.figures[key] = Figures(
                idle_spend_usd=None if self.by == "tenant" else 0.0,
                idle_gpu_seconds=None if self.by == "tenant" else 0.0,
                provisioned_gpu_seconds=None if self.by == "tenant" else 0.0,
            )
        return found

    def add_spend(
        self, key: Any, gpu: float | None, kv: float | None, gpu_seconds: float | None, wasted: float | None
    ) -> None:
        """A row of summed event costs; a NULL sum (no event) adds nothing."""
        # The fleet's query aggregates without GROUP BY: over no events it still gives a row.
        if self.by is None and gpu is None and gpu_seconds is None:
            return
        figures = self.of(key)
        figures.gpu_spend_usd += float(gpu or 0.0)
        figures.kv_transfer_spend_usd += float(kv or 0.0)
        figures.gpu_seconds += float(gpu_seconds or 0.0)
        figures.wasted_spend_usd += float(wasted or 0.0)

    def add_tasks(self, key: Any, status: TaskStatus, reason: FailureReason | None, count: int) -> None:
        self.of(key).add_tasks(status, reason, count)

    def add_idle(self, key: Any, cost: float | None, seconds: float, provisioned: float) -> None:
        """A row of summed idle windows; a NULL cost (no window: the other sums are NULL too)
        adds nothing."""
        if cost is None:
            return
        figures = self.of(key)
        figures.idle_spend_usd = (figures.idle_spend_usd or 0.0) + float(cost)
        figures.idle_gpu_seconds = (figures.idle_gpu_seconds or 0.0) + float(seconds)
        provisioned_total = (figures.provisioned_gpu_seconds or 0.0) + float(provisioned)
        figures.provisioned_gpu_seconds = provisioned_total
