"""`ripplemesh trace`: a request's span tree from the locally written traces."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from services.mesh.config import default_data_dir


@click.command()
@click.argument("request_id")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--ripple",
    is_flag=True,
    help="Follow the request's decisions forward to their effects: the placement's prefill, the "
    "later requests its cache served, the utilisation samples of its batch, the plans made on them.",
)
def trace(request_id: str, data_dir: Path | None, ripple: bool) -> None:
    """Print a request's span tree from the locally written traces. REQUEST_ID is the mesh's
    id, the id of the OpenAI response (chatcmpl-..., cmpl-...), or the x-request-id the client
    sent."""
    from ripplemesh.traces import load_spans, render_ripple, render_tree, request_trace
    from services.mesh.tracing import traces_dir

    directory = (data_dir or default_data_dir()).resolve()
    every_span = load_spans(directory)
    spans = request_trace(every_span, request_id)
    if not spans:
        raise click.ClickException(
            f"no spans found for request {request_id} in {traces_dir(directory)} (the mesh's "
            "request id, a chatcmpl-/cmpl- response id, or a client's x-request-id)"
        )
    Console().print(render_ripple(spans, every_span) if ripple else render_tree(spans))
