"""Options and error handling every command shares, the core's and the tools' alike."""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .._errors import ConfigError, SkiplockError

__all__ = [
    "dsn_option",
    "echo_json",
    "json_option",
    "require_extra",
    "schema_option",
    "user_errors",
]

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


def _json_value(value: Any) -> Any:
    """What JSON lacks, as a script reading ``--json`` expects it.

    A Decimal (``numeric`` from PostgreSQL, e.g. ``extract(epoch ...)``) is a number, not
    the string ``str()`` would make of it; a time is ISO 8601.  Anything else is str()-ed.
    """
    if isinstance(value, decimal.Decimal):
        integral = value.is_finite() and value == value.to_integral_value()
        return int(value) if integral else float(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)


def echo_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON with sorted keys; numbers stay JSON numbers."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=_json_value))


def require_extra(what: str, extra: str, *modules: str) -> None:
    """Raise ConfigError (one line, exit 2) if a module of an optional extra is missing.

    A command that needs an extra calls this before any other work, so a user who
    installed plain ``skiplock`` reads which extra to install instead of a traceback
    ending in ``No module named 'jinja2'``.

    Parameters
    ----------
    what
        What needs the extra, as the sentence's subject ("the dashboard").
    extra
        The extra's name in ``pip install 'skiplock[extra]'``.
    modules
        The modules the extra provides, imported to check they really load.

    Raises
    ------
    ConfigError
        Naming the extra and the pip command.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(
                f"{what} needs the {extra!r} extra: pip install 'skiplock[{extra}]'"
            ) from None


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
