"""The `ripplemesh` command: the click group, with the commands of ripplemesh/commands/ on it."""

from __future__ import annotations

import click

from ripplemesh.commands import ENGINE_CHOICES
from ripplemesh.commands.bench import bench
from ripplemesh.commands.drain import drain
from ripplemesh.commands.keys import hash_key
from ripplemesh.commands.ledger import ledger
from ripplemesh.commands.schemas import schemas
from ripplemesh.commands.serve import _SERVICE_CLASSES, SERVICES, run, status, up
from ripplemesh.commands.simulate import SIM_POLICIES, simulate, sweep
from ripplemesh.commands.submit import submit
from ripplemesh.commands.subscribers import run_subscriber
from ripplemesh.commands.top import top
from ripplemesh.commands.trace import trace

__all__ = ["ENGINE_CHOICES", "SERVICES", "SIM_POLICIES", "_SERVICE_CLASSES", "main"]


@click.group()
def main() -> None:
    """ripplemesh: a control plane for LLM inference on a GPU fleet."""


for command in (
    run,
    up,
    status,
    submit,
    drain,
    trace,
    top,
    bench,
    simulate,
    sweep,
    ledger,
    schemas,
    hash_key,
    run_subscriber,
):
    main.add_command(command)
