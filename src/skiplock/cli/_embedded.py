"""`skiplock embedded stop`: stop the embedded PostgreSQL that commands leave running."""

from __future__ import annotations

import click

from .._embedded import embedded_data_dir, stop_embedded
from .common import echo_json, json_option, user_errors

__all__ = ["embedded"]


@click.group()
def embedded() -> None:
    """The embedded PostgreSQL used when no DSN is given (it outlives each command)."""


@embedded.command()
@json_option
@user_errors
def stop(as_json: bool) -> None:
    """Stop the embedded server ($SKIPLOCK_DATA_DIR, else the user data dir); data stays."""
    path = embedded_data_dir()
    stopped = stop_embedded(path)
    if as_json:
        echo_json({"data_dir": str(path), "stopped": stopped})
    elif stopped:
        click.echo(f"stopped the embedded PostgreSQL in {path}")
    else:
        click.echo(f"the embedded PostgreSQL in {path} is not running")
