"""`ripplemesh submit`: a prompt over NATS, as a tenant, its tokens printed as they stream."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from ripplemesh.commands import nats_connection, nats_options
from services.mesh.config import default_data_dir


@click.command()
@click.argument("prompt")
@click.option("--tenant", default=None, help="[default: the credentials' tenant, else demo]")
@click.option("--model", default="llama-3-8b", show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@nats_options(
    "The tenant's NATS credentials [default: <data-dir>/credentials/tenant-<tenant>.json if "
    "`ripplemesh up` wrote it]."
)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
def submit(
    prompt: str,
    tenant: str | None,
    model: str,
    max_tokens: int,
    nats_credentials: Path | None,
    nats_url: str | None,
    data_dir: Path | None,
) -> None:
    """Submit a prompt over NATS, as a tenant, and print its tokens as they stream."""
    from ripplemesh.client import MeshClient, MeshError, MeshUnavailable
    from services.mesh.nats_auth import tenant_credentials_path

    tenant_file = tenant_credentials_path((data_dir or default_data_dir()) / "credentials", tenant or "demo")
    url, credentials = nats_connection(nats_credentials, nats_url, tenant_file)
    tenant = tenant or (credentials.tenant if credentials else None) or "demo"
    if credentials is not None and credentials.tenant not in (None, tenant):
        raise click.UsageError(
            f"{nats_credentials or tenant_file} holds the credentials of tenant {credentials.tenant!r}"
        )

    async def go() -> None:
        async with MeshClient(url, tenant, model=model, credentials=credentials) as client:
            async for chunk in client.stream(prompt=prompt, max_tokens=max_tokens):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(go())
    except (MeshError, MeshUnavailable) as exc:
        raise click.ClickException(str(exc)) from exc
