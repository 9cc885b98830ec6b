"""`kvlease version`."""

from __future__ import annotations

import click

from .. import PROTOCOL_VERSION, __version__


@click.command()
def version() -> None:
    """Print the kvlease and protocol versions."""
    click.echo(f"kvlease {__version__} (protocol version {PROTOCOL_VERSION})")
