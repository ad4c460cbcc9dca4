"""`ripplemesh ledger`: reports read from the cost ledger's database."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from services.mesh.config import ConfigError, default_data_dir, load_config


@click.group()
def ledger() -> None:
    """The cost ledger: cost per successful task, wasted and idle spend."""


@ledger.command("report")
@click.option(
    "--by",
    type=click.Choice(["tenant", "pool", "workflow"]),
    default=None,
    help="After the fleet's figures, one row per tenant, pool or workflow (latest first).",
)
@click.option(
    "--since",
    default=None,
    help="Only what was spent, and the tasks that ended, since then: a duration back from now "
    "(90s, 15m, 2h, 7d), an ISO 8601 time (UTC unless it says) or Unix seconds.",
)
@click.option(
    "--database-url",
    default=None,
    help="Ledger database (sqlite+aiosqlite:///... or postgresql+asyncpg://...). "
    "[default: SQLite at <data-dir>/ledger.db]",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    default=None,
    help="Mesh config, for its task_timeout_s (when a quiet workflow counts as abandoned).",
)
@click.option("--limit", default=50, show_default=True, help="Rows of --by workflow.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def ledger_report(
    by: str | None,
    since: str | None,
    database_url: str | None,
    data_dir: Path | None,
    config_file: Path | None,
    limit: int,
    as_json: bool,
) -> None:
    """Cost per successful task, wasted and idle spend, read from the ledger's database."""
    from services.ledger.report import ReportError, default_database_url, run_report

    try:
        config = load_config(config_file)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    url = database_url or default_database_url(data_dir or default_data_dir())
    try:
        run_report(
            database_url=url,
            by=by,
            since=since,
            limit=limit,
            task_timeout_s=config.task_timeout_s,
            console=Console(),
            as_json=as_json,
        )
    except ReportError as exc:
        raise click.ClickException(str(exc)) from exc
