"""`ripplemesh ledger report`: the figures of merit, read from the ledger's database directly.

It needs no running mesh: it opens the database the ledger writes (SQLite file or PostgreSQL),
brings its schema up to date if it is older, and prints the fleet's figures (figures.py), then
one row per tenant, pool or workflow (`--by`), over everything or since `--since`.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from services.ledger.figures import SinceError, parse_since
from services.ledger.store import DIMENSIONS, Dimension, LedgerStore, default_database_url

__all__ = ["ReportError", "default_database_url", "print_report", "run_report"]


class ReportError(ValueError):
    """A report that cannot be made: bad arguments, or no ledger database there."""


def run_report(
    *,
    database_url: str,
    by: str | None = None,
    since: str | None = None,
    limit: int = 50,
    task_timeout_s: float = 600.0,
    console: Console | None = None,
    as_json: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """Print the ledger's figures (a rich table, or JSON with `as_json`) and return them."""
    now = time.time() if now is None else now
    if by is not None and by not in DIMENSIONS:
        raise ReportError(f"--by must be one of {', '.join(DIMENSIONS)}, not {by!r}")
    try:
        start = parse_since(since, now) if since else None
    except SinceError as exc:
        raise ReportError(str(exc)) from exc
    _check_database(database_url)
    report = asyncio.run(_report(database_url, by, start, limit, task_timeout_s, now))
    console = console or Console()
    if as_json:
        console.print_json(json.dumps(report))
    else:
        print_report(report, console)
    return report


async def _report(
    url: str, by: Dimension | None, since: float | None, limit: int, timeout_s: float, now: float
) -> dict[str, Any]:
    store = await LedgerStore.open(url)
    try:
        return await store.report(now=now, task_timeout_s=timeout_s, since=since, by=by, limit=limit)
    finally:
        await store.close()


def _check_database(url: str) -> None:
    """A SQLite ledger must exist: a report never creates an empty database by mistake."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ReportError(f"invalid database URL {url!r}: {exc}") from exc
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if not database or database == ":memory:" or not Path(database).is_file():
            where = database or url
            raise ReportError(f"no ledger database at {where!r} (give --database-url or --data-dir)")


def print_report(report: dict[str, Any], console: Console) -> None:
    fleet = report["fleet"]
    window = "everything recorded" if report["since"] is None else f"since {_time(report['since'])}"
    table = Table(title=f"Ledger: {window} (as of {_time(report['until'])})", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    tasks = fleet["tasks"]
    failed_by_reason = fleet["failed_by_reason"].items()
    reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in failed_by_reason if n)
    for name, value in (
        ("cost per successful task", _usd(fleet["cost_per_successful_task_usd"])),
        ("spend (all)", _usd(fleet["spend_usd"])),
        ("  GPU (prefill + decode)", _usd(fleet["gpu_spend_usd"])),
        ("  KV transfer", _usd(fleet["kv_transfer_spend_usd"])),
        ("  idle GPU", _usd(fleet["idle_spend_usd"])),
        ("wasted (failed tasks)", f"{_usd(fleet['wasted_spend_usd'])} ({_percent(fleet['waste_fraction'])})"),
        ("tasks succeeded", str(tasks["succeeded"])),
        ("tasks failed", f"{tasks['failed']}" + (f" ({reasons})" if reasons else "")),
        ("tasks running", str(tasks["running"])),
        ("GPU-seconds busy / idle", f"{fleet['gpu_seconds']:,.1f} / {fleet['idle_gpu_seconds'] or 0:,.1f}"),
        ("unpriced (ledger errors)", str(fleet["errors"])),
        ("task timeout", f"{report['task_timeout_s']:g} s"),
    ):
        table.add_row(name, value)
    console.print(table)
    by, groups = report["by"], report["groups"]
    if by is None:
        return
    if not groups:
        console.print(f"no {by} in this window")
        return
    if by == "workflow":
        console.print(_workflow_table(groups))
        return
    table = Table(title=f"By {by}", show_header=True)
    table.add_column(by)
    for column in ("cost / successful task", "spend", "wasted", "idle", "succeeded", "failed", "running"):
        table.add_column(column, justify="right")
    for group in groups:
        counts = group["tasks"]
        table.add_row(
            str(group[by]),
            _usd(group["cost_per_successful_task_usd"]),
            _usd(group["spend_usd"]),
            _usd(group["wasted_spend_usd"]),
            "n/a" if group["idle_spend_usd"] is None else _usd(group["idle_spend_usd"]),
            str(counts["succeeded"]),
            str(counts["failed"]),
            str(counts["running"]),
        )
    console.print(table)
    if by == "tenant":
        console.print("idle GPU time is not attributed to tenants: a tenant's cost per task is its own spend")


def _workflow_table(groups: list[dict[str, Any]]) -> Table:
    table = Table(title="By workflow (latest first)", show_header=True)
    for column in ("workflow", "tenant", "status", "steps", "spend", "wasted", "last event"):
        table.add_column(column, justify="left" if column in ("workflow", "tenant", "status") else "right")
    for group in groups:
        status = group["status"] + (f" ({group['reason'].replace('_', ' ')})" if group["reason"] else "")
        steps = f"{group['steps_completed']}/{group['steps'] if group['steps'] is not None else '?'}"
        table.add_row(
            group["workflow"],
            group["tenant"],
            status,
            steps,
            _usd(group["spend_usd"]),
            _usd(group["wasted_spend_usd"]),
            _time(group["last_event_at"]),
        )
    return table


def _usd(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"${value:,.2f}"
    if abs(value) >= 1:
        return f"${value:,.4f}"
    return f"${value:.6f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _time(value: float) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
