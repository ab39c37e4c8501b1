"""Where the SQL to audit comes from: .sql files, Python sources, --sql text and stdin.

Every piece of SQL keeps a way back to the line and column the user wrote it at, and
belongs to a "unit" (a .sql file, a Python function) inside which the two-step rule
looks for a SELECT followed by an UPDATE.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = [
    "SOURCE_SUFFIXES",
    "Extracted",
    "LineIndex",
    "Locator",
    "PositionTable",
    "Problem",
    "SqlText",
    "Unit",
    "discover",
    "extract_file",
    "extract_text",
    "suppressed_ids",
]

SOURCE_SUFFIXES = (".sql", ".py")
# Directories that hold other people's code or generated files, never the user's queries.
_SKIP_DIRS = {"node_modules", "site-packages", "__pycache__", "venv", "build", "dist"}


_SUPPRESS = re.compile(r"skiplock:\s*ignore(?:\[(?P<ids>[A-Za-z0-9_, ]*)\])?")


def suppressed_ids(comment: str) -> frozenset[str]:
    """Rule ids a ``skiplock: ignore[SL005, SL007]`` comment silences; ``{"*"}`` for all."""
    m = _SUPPRESS.search(comment)
    if not m:
        return frozenset()
    ids = m.group("ids")
    if ids is None:
        return frozenset({"*"})
    return frozenset(i.strip().upper() for i in ids.split(",") if i.strip())


class Locator(Protocol):
    def position(self, index: int) -> tuple[int, int]:
        """1-based (line, column) in the input of the character at ``index`` of the text."""
        ...


class LineIndex:
    """Positions in a text that is itself the file (or --sql / stdin) content."""

    def __init__(self, text: str, line: int = 1, column: int = 1) -> None:
        self._starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        self._line = line
        self._column = column

    def position(self, index: int) -> tuple[int, int]:
        row = bisect.bisect_right(self._starts, index) - 1
        col = index - self._starts[row] + 1
        if row == 0:
            col += self._column - 1
        return row + self._line, col


class PositionTable:
    """Positions of text assembled from pieces (a Python literal, its escapes and f-fields)."""

    def __init__(self, positions: Sequence[tuple[int, int]], end: tuple[int, int]) -> None:
        self._positions = list(positions)
        self._end = end

    def position(self, index: int) -> tuple[int, int]:
        if 0 <= index < len(self._positions):
            return self._positions[index]
        return self._end


@dataclass(frozen=True)
class Problem:
    """Input that could not be audited.  Fatal problems make the exit code 2."""

    path: str
    line: int
    column: int
    message: str
    fatal: bool = True


@dataclass(eq=False)
class SqlText:
    """A piece of SQL text and where it came from."""

    path: str
    text: str
    locator: Locator
    # Python literals with {fields} are composed at run time: failing to parse one with
    # placeholders is a limit of the audit, not an error in the user's SQL.
    dynamic: bool = False
    # Rule ids silenced by a comment next to a Python literal ("*" silences all).
    suppressed: frozenset[str] = frozenset()


@dataclass
class Unit:
    """SQL texts executed together, in order: one .sql file or one Python function."""

    path: str
    name: str
    texts: list[SqlText] = field(default_factory=list)


@dataclass
class Extracted:
    texts: list[SqlText] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def extend(self, other: Extracted) -> None:
        self.texts.extend(other.texts)
        self.units.extend(other.units)
        self.problems.extend(other.problems)


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
        from ._python import extract_python

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
