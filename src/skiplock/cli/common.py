"""Options and error handling every command shares, the core's and the tools' alike."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._errors import SkiplockError

__all__ = ["dsn_option", "echo_json", "json_option", "schema_option", "user_errors"]

F = TypeVar("F", bound=Callable[..., Any])

dsn_option = click.option(
    "--dsn",
    default=None,
    metavar="DSN",
    help="PostgreSQL URL or key=value string. Default: $SKIPLOCK_DSN, else $DATABASE_URL, "
    "else an embedded PostgreSQL.",
)
schema_option = click.option(
    "--schema",
    default="skiplock",
    show_default=True,
    help="Postgres schema holding skiplock's tables.",
)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object instead of a table."
)


def echo_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON with sorted keys; values JSON lacks are str()-ed."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def user_errors(fn: F) -> F:
    """Print skiplock's own errors as one line on stderr and exit 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SkiplockError as exc:
            click.echo(f"skiplock: error: {exc}", err=True)
            sys.exit(2)
        except ValueError as exc:
            click.echo(f"skiplock: error: {exc}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]
