"""`ripplemesh run-subscriber module:attribute`: join a running mesh with your subscriber."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import click


@click.command("run-subscriber")
@click.argument("target", nargs=-1, required=True)
@click.option("--nats-url", envvar="NATS_URL", required=True, help="The mesh's NATS server(s).")
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="A NATS user allowed to read the event subjects (a JSON file, as `ripplemesh up` writes).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where its spans go without OTEL_EXPORTER_OTLP_ENDPOINT (traces/, as the services').",
)
def run_subscriber(
    target: tuple[str, ...], nats_url: str, nats_credentials: Path | None, data_dir: Path | None
) -> None:
    """Run the subscribers named MODULE:ATTRIBUTE (a `ripplemesh.Subscriber`) until SIGTERM or
    Ctrl-C. The current directory is importable, as with `python -m`. Each handler runs in a
    span continuing the event's trace (to the collector, or `<data-dir>/traces/`)."""
    from ripplemesh.subscriber import Subscriber, run_subscribers
    from services.mesh.config import default_data_dir
    from services.mesh.runtime import setup_logging
    from services.mesh.tracing import setup_tracing, shutdown_tracing

    setup_logging("subscriber")  # JSON lines on stderr, as the services log
    sys.path.insert(0, str(Path.cwd()))
    subscribers = []
    for name in target:
        module_name, _, attribute = name.partition(":")
        if not attribute:
            raise click.UsageError(f"{name!r}: expected MODULE:ATTRIBUTE, e.g. examples.cache_alerts:alerts")
        try:
            found = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise click.ClickException(f"{name}: {exc}") from exc
        if not isinstance(found, Subscriber):
            raise click.ClickException(f"{name} is a {type(found).__name__}, not a ripplemesh Subscriber")
        subscribers.append(found)
    setup_tracing("subscriber", (data_dir or default_data_dir()).resolve())
    try:
        asyncio.run(run_subscribers(subscribers, nats_url=nats_url, credentials=nats_credentials))
    finally:
        shutdown_tracing()
