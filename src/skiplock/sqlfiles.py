"""Named SQL files: the core's statements, and the loader for a tool's own ``.sql`` files.

skiplock keeps every statement in a ``.sql`` file under a ``-- name: x`` header (the core's
``sql/queries.sql``, the lab's ``lab/sql/strategies.sql``).  Tools that race, benchmark or
audit the core's own claim read it from here rather than copying its text.
"""

from __future__ import annotations

from importlib import resources

from ._sql import Statements, parse_named, statements

__all__ = ["Statements", "load_named", "parse_named", "statements"]


def load_named(package: str, *path: str) -> dict[str, str]:
    """Read a ``.sql`` file shipped in ``package`` and split it into {name: statement}.

    Parameters
    ----------
    package
        The importable package holding the file, e.g. ``"skiplock.lab"``.
    *path
        The file's path inside the package, e.g. ``"sql", "strategies.sql"``.

    Returns
    -------
    dict[str, str]
        Each ``-- name: x`` block's text, stripped, without its final semicolon.

    Raises
    ------
    ValueError
        A name is defined twice in the file.
    """
    text = resources.files(package).joinpath(*path).read_text(encoding="utf-8")
    return parse_named(text)
