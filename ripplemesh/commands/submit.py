"""`ripplemesh submit`: a prompt over NATS, as a tenant, its tokens printed as they stream."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from services.mesh.config import default_data_dir


@click.command()
@click.argument("prompt")
@click.option("--tenant", default=None, help="[default: the credentials' tenant, else demo]")
@click.option("--model", default="llama-3-8b", show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option(
    "--nats-credentials",
    envvar="RIPPLEMESH_NATS_CREDENTIALS",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The tenant's NATS credentials [default: <data-dir>/credentials/tenant-<tenant>.json if "
    "`ripplemesh up` wrote it].",
)
@click.option(
    "--nats-url",
    envvar="NATS_URL",
    default=None,
    help="NATS server(s), comma-separated [default: the credentials' servers, else nats://127.0.0.1:4222].",
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
    from services.mesh.nats_auth import CredentialsError, load_credentials, tenant_credentials_path

    if nats_credentials is None:
        candidate = tenant_credentials_path(
            (data_dir or default_data_dir()) / "credentials", tenant or "demo"
        )
        nats_credentials = candidate if candidate.exists() else None
    try:
        credentials = load_credentials(nats_credentials) if nats_credentials else None
    except CredentialsError as exc:
        raise click.ClickException(str(exc)) from exc
    tenant = tenant or (credentials.tenant if credentials else None) or "demo"
    if credentials is not None and credentials.tenant not in (None, tenant):
        raise click.UsageError(f"{nats_credentials} holds the credentials of tenant {credentials.tenant!r}")
    url = nats_url or (",".join(credentials.servers) if credentials and credentials.servers else None)
    url = url or "nats://127.0.0.1:4222"

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
