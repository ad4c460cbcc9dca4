"""The `ripplemesh` command's commands, a module per command or group; `ripplemesh.cli` puts
them on its group. Each imports its heavy dependencies (torch, SQLAlchemy, the simulator) only
when it runs, so that `ripplemesh --help` stays quick."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console

if TYPE_CHECKING:
    from services.mesh.nats_auth import NatsCredentials

F = TypeVar("F", bound=Callable[..., Any])

console = Console(stderr=True)

ENGINE_CHOICES = ["sim", "hf", "vllm"]


NATS_URL_HELP = (
    "NATS server(s), comma-separated [default: the credentials' servers, else nats://127.0.0.1:4222]."
)
SERVICES_CREDENTIALS_HELP = (
    "The services' NATS user [default: <data-dir>/credentials/services.json if it exists]."
)


def nats_options(credentials_help: str = SERVICES_CREDENTIALS_HELP) -> Callable[[F], F]:
    """`--nats-credentials` and `--nats-url`, as the commands that join a running mesh take them."""

    def decorate(command: F) -> F:
        command = click.option("--nats-url", envvar="NATS_URL", default=None, help=NATS_URL_HELP)(command)
        return click.option(
            "--nats-credentials",
            envvar="RIPPLEMESH_NATS_CREDENTIALS",
            type=click.Path(path_type=Path, dir_okay=False),
            default=None,
            help=credentials_help,
        )(command)

    return decorate


def nats_connection(
    credentials_file: Path | None, nats_url: str | None, default_file: Path
) -> tuple[str, NatsCredentials | None]:
    """The NATS URL and credentials a command connects with: the file given, else `default_file`
    if it exists (what `ripplemesh up` wrote); the URL given, else the credentials' servers, else
    the local default. A credentials file that does not read is a one-line error."""
    from services.mesh.nats_auth import CredentialsError, load_credentials

    if credentials_file is None and default_file.exists():
        credentials_file = default_file
    try:
        credentials = load_credentials(credentials_file) if credentials_file else None
    except CredentialsError as exc:
        raise click.ClickException(str(exc)) from exc
    url = nats_url or (",".join(credentials.servers) if credentials and credentials.servers else None)
    return url or "nats://127.0.0.1:4222", credentials
