"""What extracted SQL is: texts, the units they run in, problems, and the way back to line/column.

Every piece of SQL keeps a way back to the line and column the user wrote it at, and
belongs to a "unit" (a .sql file, a Python function) inside which the two-step rule
looks for a SELECT followed by an UPDATE.  The readers (``_extract`` for .sql files and
text, ``_python`` for Python sources) both build these.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Extracted",
    "LineIndex",
    "Locator",
    "PositionTable",
    "Problem",
    "SqlText",
    "Unit",
    "suppressed_ids",
]

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
