"""`ripplemesh hash-key`: the digest of a tenant's API key."""

from __future__ import annotations

import hashlib

import click


@click.command("hash-key")
@click.argument("api_key")
def hash_key(api_key: str) -> None:
    """Print the SHA-256 digest to put in a tenant's api_keys_sha256."""
    click.echo(hashlib.sha256(api_key.encode()).hexdigest())
