"""The audit corpus: every claim shape gets exactly the findings its header declares.

Each file in tests/audit_corpus starts with ``-- expect: SL001, SL005`` (``# expect:`` in
Python files) or ``expect: none``; a rule id appears once per expected finding.  Any
extra finding is a false positive and fails the test.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from skiplock.audit import RULES, audit_paths, audit_sql

CORPUS = Path(__file__).resolve().parent.parent / "audit_corpus"
_EXPECT = re.compile(r"^(?:--|#)\s*expect:\s*(?P<ids>.+)$", re.M)


def _expected(path: Path) -> list[str]:
    m = _EXPECT.search(path.read_text(encoding="utf-8"))
    assert m, f"{path.name} has no '-- expect:' header"
    ids = m.group("ids").strip()
    if ids == "none":
        return []
    return sorted(i.strip() for i in ids.split(","))


CASES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".sql", ".py"))


def test_corpus_is_substantial() -> None:
    assert len(CASES) >= 40
    assert (CORPUS / "postmortem_original.sql").exists()
    # Every rule (bar the parse error) is demonstrated by some corpus file.
    demonstrated = {rule for case in CASES for rule in _expected(case)}
    assert demonstrated == set(RULES) - {"SL000"}
    assert sum(1 for case in CASES if not _expected(case)) >= 15


@pytest.mark.parametrize("case", CASES, ids=[p.name for p in CASES])
def test_corpus_file(case: Path) -> None:
    result = audit_paths([case])
    assert result.problems == []
    got = sorted(f.rule_id for f in result.findings)
    assert got == _expected(case), "\n".join(
        f"{f.line}:{f.column} {f.rule_id} {f.message}" for f in result.findings
    )


def test_whole_corpus_at_once_matches_file_by_file() -> None:
    # Auditing a directory must not pair statements across files (units are per file).
    result = audit_paths([CORPUS])
    assert result.problems == []
    got = sorted((Path(f.path).name, f.rule_id) for f in result.findings)
    expected = sorted((case.name, rule) for case in CASES for rule in _expected(case))
    assert got == expected


def _queries_sql() -> str:
    return resources.files("skiplock").joinpath("sql", "queries.sql").read_text(encoding="utf-8")


def test_skiplock_own_statements_are_clean() -> None:
    text = _queries_sql().replace("{schema}", "skiplock")
    result = audit_sql(text, "queries.sql")
    assert result.problems == []
    assert result.findings == []
    assert result.statements >= 15


def test_skiplock_own_statements_are_clean_with_format_fields_left_in() -> None:
    # {schema} is a psycopg.sql field; the audit reads it as a placeholder name.
    result = audit_sql(_queries_sql(), "queries.sql")
    assert result.problems == []
    assert result.findings == []


def test_postmortem_original_is_flagged_where_the_condition_lives() -> None:
    result = audit_paths([CORPUS / "postmortem_original.sql"])
    (sl001,) = [f for f in result.findings if f.rule_id == "SL001"]
    lines = (CORPUS / "postmortem_original.sql").read_text().splitlines()
    # The finding points at `status` in the subquery's WHERE, not at the UPDATE.
    assert lines[sl001.line - 1][sl001.column - 1 :].startswith("status = 'pending'")
    assert "IN (subquery)" in sl001.message
    assert "re-check" in sl001.message
    assert "FOR UPDATE SKIP LOCKED" in sl001.fix
