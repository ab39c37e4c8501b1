"""Where the SQL to audit comes from: .sql files, Python sources, --sql text and stdin.

The types it hands out (``SqlText``, ``Unit``, ``Extracted``, ``Problem``) live in
``_source``, which the Python reader builds too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from ._python import extract_python
from ._source import Extracted, LineIndex, Problem, SqlText, Unit

__all__ = ["SOURCE_SUFFIXES", "discover", "extract_file", "extract_text"]

SOURCE_SUFFIXES = (".sql", ".py")
# Directories that hold other people's code or generated files, never the user's queries.
_SKIP_DIRS = {"node_modules", "site-packages", "__pycache__", "venv", "build", "dist"}


def extract_text(text: str, path: str) -> Extracted:
    """SQL given directly (a .sql file, --sql, stdin): one text, one unit."""
    sql = SqlText(path, text, LineIndex(text))
    return Extracted([sql], [Unit(path, path, [sql])])


def extract_file(path: Path, display: str | None = None) -> Extracted:
    """Read a .sql or .py file; unreadable input becomes a problem, never an exception."""
    shown = display or str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return Extracted(problems=[Problem(shown, 1, 1, f"cannot read file: {exc.strerror}")])
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return Extracted(problems=[Problem(shown, line, 1, "file is not valid UTF-8")])
    if path.suffix == ".py":
        return extract_python(text, shown)
    return extract_text(text, shown)


def discover(paths: Iterable[Path]) -> Iterator[Path]:
    """Files to audit: the given files, and .sql/.py files below the given directories."""
    for path in paths:
        if not path.is_dir():
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    yield Path(root) / name
