"""`ripplemesh schemas`: the event contract's generated documents."""

from __future__ import annotations

import click


@click.group()
def schemas() -> None:
    """The event contract's generated documents."""


@schemas.command("generate")
@click.option("--check", is_flag=True, help="Only check that the generated files are current.")
def schemas_generate(check: bool) -> None:
    """Write JSON Schema and AsyncAPI documents from the msgspec Structs."""
    from schemas.generate import main as generate_main

    raise SystemExit(generate_main(["--check"] if check else []))
