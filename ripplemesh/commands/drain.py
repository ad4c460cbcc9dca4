"""`ripplemesh drain`: the drain order to one worker over NATS, and its answer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from ripplemesh.commands import console, nats_connection, nats_options
from services.mesh.config import default_data_dir


@click.command()
@click.argument("worker_id")
@click.option(
    "--grace", "grace_s", default=30.0, show_default=True, help="Seconds to finish the work in flight."
)
@nats_options()
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def drain(
    worker_id: str, grace_s: float, nats_credentials: Path | None, nats_url: str | None, data_dir: Path | None
) -> None:
    """Drain a worker: no new work from now on, its work in flight finished within the grace
    period (what is left moves to other workers), then it exits."""
    import msgspec
    import nats
    import nats.errors

    from schemas.events import WorkerControl, WorkerState, encode_event, new_event_id
    from schemas.subjects import control_subject
    from services.mesh.bus import nats_servers

    services_file = (data_dir or default_data_dir()) / "credentials" / "services.json"
    url, credentials = nats_connection(nats_credentials, nats_url, services_file)
    order = WorkerControl(
        event_id=new_event_id(), occurred_at=time.time(), worker_id=worker_id, action="drain", grace_s=grace_s
    )

    async def go() -> WorkerState:
        nc = await nats.connect(nats_servers(url), **(credentials.connect_options() if credentials else {}))
        try:
            reply = await nc.request(control_subject(worker_id), encode_event(order), timeout=5)
            return msgspec.json.decode(reply.data, type=WorkerState)
        finally:
            await nc.drain()

    try:
        state = asyncio.run(go())
    except nats.errors.NoRespondersError:
        raise click.ClickException(
            f"no worker {worker_id!r} answers on {control_subject(worker_id)}"
        ) from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise click.ClickException(f"the drain order was not answered: {exc!r}") from exc
    console.print(
        f"{worker_id} is draining: {state.running} running, {state.queue_depth} queued; it exits "
        f"within {grace_s:g} s, and what is left moves to other workers"
    )
