"""Runs the audit: split and parse every statement, apply the rules, locate the findings.

Parsing happens per statement, so one broken statement is reported where it is and the
rest of the file is still audited.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pglast
from pglast import ast
from pglast.stream import RawStream

from ._checks import Hit, check_statement, check_unit, looks_like_queue
from ._extract import discover, extract_file, extract_text
from ._lexer import Chunk, Token, normalize, split_statements, tokenize
from ._model import StatementFacts, statement_facts, walk
from ._python import extract_python
from ._rules import RULES, Rule
from ._source import Extracted, Problem, SqlText, suppressed_ids

__all__ = [
    "AuditResult",
    "Finding",
    "Related",
    "audit",
    "audit_paths",
    "audit_python",
    "audit_sql",
]

_SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2}


@dataclass(frozen=True)
class Related:
    path: str
    line: int
    column: int
    message: str


@dataclass(frozen=True)
class Finding:
    """One rule violation at a place in the user's input."""

    rule: Rule
    path: str
    line: int
    column: int
    message: str
    related: tuple[Related, ...] = ()

    @property
    def rule_id(self) -> str:
        return self.rule.id

    @property
    def severity(self) -> str:
        return self.rule.severity

    @property
    def fix(self) -> str:
        return self.rule.fix


@dataclass
class AuditResult:
    findings: list[Finding] = field(default_factory=list)
    # Input that could not be audited: unparsable SQL, unreadable files (exit code 2).
    problems: list[Problem] = field(default_factory=list)
    # Dynamic SQL (f-strings, .format) that did not parse with placeholders: skipped.
    skipped: list[Problem] = field(default_factory=list)
    sources: int = 0
    statements: int = 0

    def exit_code(self, fail_on: str = "info") -> int:
        """0 clean, 1 findings at or above ``fail_on``, 2 when some input could not be read."""
        if self.problems:
            return 2
        threshold = _SEVERITY_ORDER[fail_on]
        if any(_SEVERITY_ORDER[f.severity] >= threshold for f in self.findings):
            return 1
        return 0


@dataclass(frozen=True)
class _Tok:
    token: Token
    depth: int


class Statement:
    """One SQL statement of a source, parsed, with the way back to the original text."""

    def __init__(self, sql: SqlText, chunk: Chunk) -> None:
        self.sql = sql
        self.chunk = chunk
        raw = sql.text[chunk.start : chunk.end]
        self.norm = normalize(raw)
        self.first = chunk.first - chunk.start
        self.suppressed = set(sql.suppressed)
        self.tokens: list[_Tok] = []
        depth = 0
        for tok in tokenize(self.norm.text):
            if tok.kind == "comment":
                self.suppressed |= suppressed_ids(tok.text)
                continue
            if tok.text == ")":
                depth -= 1
            self.tokens.append(_Tok(tok, depth))
            if tok.text == "(":
                depth += 1
        self.trees: list[Any] = []
        self.error: tuple[int, str] | None = None
        try:
            self.trees = [raw_stmt.stmt for raw_stmt in pglast.parse_sql(self.norm.text)]
        except pglast.parser.ParseError as exc:
            loc = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else -1
            message = self.norm.restore(str(exc.args[0]))
            self.error = (loc if loc >= 0 else self.first_offset(), message)
        except Exception as exc:  # parser limits (e.g. nesting depth): report, never crash
            self.error = (self.first_offset(), f"{type(exc).__name__}: {exc}")

    def first_offset(self) -> int:
        for i, orig in enumerate(self.norm.origin):
            if orig >= self.first:
                return i
        return 0

    def show(self, node: Any) -> str:
        """A parse-tree fragment as SQL, with the user's placeholders ("" if unprintable)."""
        try:
            return self.norm.restore(str(RawStream()(node)))
        except Exception:  # pglast cannot print every fragment on its own
            return ""

    def position(self, offset: int) -> tuple[int, int]:
        """(line, column) in the user's input of an offset of the parsed text."""
        return self.sql.locator.position(self.chunk.start + self.norm.original(offset))

    def select_keyword(self, select: Any, words: Sequence[str]) -> int:
        """Offset of the first of ``words`` at the nesting level of ``select`` (e.g. its FOR)."""
        locations = [
            int(n.location)
            for part in (select.targetList or (), select.fromClause or ())
            for top in part
            for n in walk(top, into_sublinks=False)
            if isinstance(getattr(n, "location", None), int) and n.location >= 0
        ]
        anchor = min(locations, default=self.first_offset())
        start = None
        for i, t in enumerate(self.tokens):
            if t.token.start > anchor:
                break
            if t.token.lower == "select":
                start = i
        if start is None:
            return anchor
        depth = self.tokens[start].depth
        for t in self.tokens[start:]:
            if t.depth < depth:
                break
            if t.depth == depth and t.token.lower in words:
                return t.token.start
        return anchor


def _finding(hit: Hit) -> Finding | None:
    stmt = hit.stmt
    assert isinstance(stmt, Statement)
    if "*" in stmt.suppressed or hit.rule in stmt.suppressed:
        return None
    line, column = stmt.position(hit.offset)
    related = []
    message = hit.message
    for other, offset, text in hit.related:
        assert isinstance(other, Statement)
        r_line, r_col = other.position(offset)
        related.append(Related(other.sql.path, r_line, r_col, text))
        where = (
            f"line {r_line}" if other.sql.path == stmt.sql.path else f"{other.sql.path}:{r_line}"
        )
        message = message.replace("{related}", where)
    return Finding(RULES[hit.rule], stmt.sql.path, line, column, message, tuple(related))


def _claimed_tables(facts: Iterable[StatementFacts], hits: Iterable[Hit]) -> set[str]:
    """Tables some statement claims from: completions on them are checked for a fence."""
    tables = {h.table for h in hits if h.rule in ("SL002", "SL005") and h.table}
    for f in facts:
        tables |= {d.target.relname for d in f.dmls if d.is_claim and d.target.relname}
        for sf in f.selects:
            if sf.node.lockingClause and sf.node.limitCount is not None:
                tables |= {r.relname for r in sf.rels if r.kind == "table" and r.relname}
    return tables


def audit(extracted: Extracted) -> AuditResult:
    """Audit SQL already extracted from its sources."""
    result = AuditResult(problems=list(extracted.problems))
    by_text: dict[int, list[tuple[Statement, StatementFacts]]] = {}
    hits: list[Hit] = []
    all_facts: list[StatementFacts] = []
    for sql in extracted.texts:
        parsed = by_text.setdefault(id(sql), [])
        for chunk in split_statements(sql.text):
            stmt = Statement(sql, chunk)
            result.statements += 1
            if stmt.error is not None:
                offset, message = stmt.error
                line, column = stmt.position(offset)
                problem = Problem(sql.path, line, column, f"could not parse SQL: {message}")
                if sql.dynamic:
                    result.skipped.append(
                        Problem(
                            sql.path,
                            line,
                            column,
                            f"skipped SQL composed at run time ({message} with placeholders)",
                            fatal=False,
                        )
                    )
                else:
                    result.problems.append(problem)
                continue
            for tree in stmt.trees:
                if not isinstance(tree, ast.Node):
                    continue
                try:
                    facts = statement_facts(tree)
                    found = check_statement(stmt, facts)
                except Exception as exc:  # a shape the rules do not expect: say so, go on
                    line, column = stmt.position(stmt.first_offset())
                    message = f"could not audit this statement ({type(exc).__name__}: {exc})"
                    result.problems.append(Problem(sql.path, line, column, message))
                    continue
                all_facts.append(facts)
                parsed.append((stmt, facts))
                hits.extend(found)
    for unit in extracted.units:
        items = [item for sql in unit.texts for item in by_text.get(id(sql), [])]
        hits.extend(check_unit(items))
    claimed = _claimed_tables(all_facts, hits)
    seen: set[tuple[str, str, int, int]] = set()
    for hit in hits:
        if (
            hit.rule == "SL006"
            and hit.table not in claimed
            and not looks_like_queue(hit.table or "")
        ):
            continue
        finding = _finding(hit)
        if finding is None:
            continue
        key = (finding.rule_id, finding.path, finding.line, finding.column)
        if key not in seen:
            seen.add(key)
            result.findings.append(finding)
    result.sources = len(
        {sql.path for sql in extracted.texts} | {p.path for p in extracted.problems}
    )
    result.findings.sort(key=lambda f: (f.path, f.line, f.column, f.rule_id))
    result.problems.sort(key=lambda p: (p.path, p.line, p.column))
    return result


def audit_sql(text: str, path: str = "<sql>") -> AuditResult:
    """Audit SQL text (one or more statements)."""
    return audit(extract_text(text, path))


def audit_python(text: str, path: str = "<python>") -> AuditResult:
    """Audit the SQL embedded in Python source text."""
    return audit(extract_python(text, path))


def audit_paths(paths: Iterable[str | Path]) -> AuditResult:
    """Audit .sql and .py files; directories are searched recursively."""
    extracted = Extracted()
    for path in discover(Path(p) for p in paths):
        extracted.extend(extract_file(path))
    return audit(extracted)
