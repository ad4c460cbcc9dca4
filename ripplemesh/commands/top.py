"""`ripplemesh top`: a live terminal view of a running mesh (ripplemesh/top.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from ripplemesh.commands import nats_connection, nats_options
from services.mesh.config import default_data_dir


def ledger_url_of(data_dir: Path) -> str | None:
    """The ledger's HTTP address as `ripplemesh up` wrote it in ``<data_dir>/supervisor.json``."""
    try:
        url = json.loads((data_dir / "supervisor.json").read_text())["children"]["ledger"]["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url if isinstance(url, str) else None


@click.command()
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between frames.",
)
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--window",
    "window_s",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="Seconds of rejections and prefills counted (rejections by reason, each worker's hit rate).",
)
@click.option(
    "--ledger-url",
    envvar="RIPPLEMESH_LEDGER_URL",
    default=None,
    help="The ledger's HTTP address, for the cost per successful task [default: the ledger of the "
    "`ripplemesh up` in --data-dir, from its supervisor.json].",
)
@nats_options()
@click.option(
    "--timeout",
    "timeout_s",
    default=3.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds any one read (and the connection) may take.",
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def top(
    interval: float,
    once: bool,
    window_s: float,
    ledger_url: str | None,
    nats_credentials: Path | None,
    nats_url: str | None,
    timeout_s: float,
    data_dir: Path | None,
) -> None:
    """A live view of a running mesh: each worker's batch, queue, KV use, cache and heartbeat;
    each pool's desired (the autoscaler's latest plan) and actual replicas; recent rejections by
    reason; the ledger's cost per successful task. Ctrl-C exits."""
    import time

    from rich.console import Console
    from rich.live import Live

    from ripplemesh.top import MeshWatch, TopError, render

    directory = data_dir or default_data_dir()
    url, credentials = nats_connection(
        nats_credentials, nats_url, directory / "credentials" / "services.json"
    )
    ledger_note = None
    if ledger_url is None:
        ledger_url = ledger_url_of(directory)
        if ledger_url is None:
            ledger_note = f"no ledger address: pass --ledger-url (none in {directory / 'supervisor.json'})"
    console = Console()

    async def go() -> None:
        watch = await MeshWatch.open(
            url,
            credentials.connect_options() if credentials else {},
            window_s=window_s,
            ledger_url=ledger_url,
            ledger_note=ledger_note,
            timeout_s=timeout_s,
        )
        try:
            await watch.catch_up()
            snapshot = await watch.snapshot()
            if once:
                console.print(render(snapshot, time.time()))
                return
            try:
                with Live(render(snapshot, time.time()), console=console, auto_refresh=False) as live:
                    while True:
                        await asyncio.sleep(interval)
                        snapshot = await watch.snapshot()
                        live.update(render(snapshot, time.time()), refresh=True)
            finally:
                if not console.is_terminal:
                    console.line()  # Live ends its last frame with one only on a terminal
        finally:
            await watch.close()

    try:
        asyncio.run(go())
    except TopError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass
