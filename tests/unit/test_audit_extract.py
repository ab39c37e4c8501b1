"""Finding SQL and keeping its positions: the lexer, placeholders and Python literals."""

from __future__ import annotations

from pathlib import Path

import pytest

from skiplock.audit import audit_paths, audit_sql
from skiplock.audit._lexer import normalize, split_statements

RACY = (
    "UPDATE jobs SET status = 'running', locked_until = now() + interval '1 minute' "
    "WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 1)"
)


def _pieces(text: str) -> list[str]:
    return [text[c.start : c.end].strip() for c in split_statements(text)]


def test_split_ignores_semicolons_in_literals_comments_and_bodies() -> None:
    text = (
        "SELECT ';', \"a;b\", E'\\';' FROM t; -- one; two\n"
        "/* outer /* inner; */ still; */ SELECT $$ ; $$, $fn$ ; $fn$;\n"
        "-- only a comment;\n"
        "\\set x 1\n"
        ";;SELECT 3"
    )
    pieces = _pieces(text)
    assert len(pieces) == 3
    assert pieces[0].startswith("SELECT ';'")
    assert pieces[2] == "SELECT 3"


def test_normalize_placeholders() -> None:
    text = "SELECT %s, %(a)s, %(a)s, :b, x::int, :b, '%s :c', arr[1:n], 5 %% 2, {schema}.jobs"
    norm = normalize(text)
    assert norm.text == (
        "SELECT $1, $2, $2, $3, x::int, $3, '%s :c', arr[1:n], 5 % 2, _fmt_schema.jobs"
    )
    # Each stand-in maps back to where its placeholder starts in the original.
    assert norm.original(norm.text.index("$2")) == text.index("%(a)s")
    assert norm.original(norm.text.index("x::int")) == text.index("x::int")
    assert norm.restore("a = $2 AND b = _fmt_schema") == "a = %(a)s AND b = {schema}"


def test_normalize_numbers_after_existing_dollar_params() -> None:
    assert normalize("SELECT $2, %s").text == "SELECT $2, $3"


def test_psql_variables_and_assignment_operator() -> None:
    norm = normalize("SELECT f(a := 1), :'name', :\"col\" FROM t")
    assert norm.text == "SELECT f(a := 1), $1, _fmt_col FROM t"


def test_positions_survive_placeholder_rewrites() -> None:
    sql = (
        "UPDATE jobs SET status = 'running', worker = %(worker)s, note = :note\n"
        "WHERE id IN (SELECT id FROM jobs WHERE status = %(pending)s LIMIT %(n)s)"
    )
    (finding,) = [f for f in audit_sql(sql).findings if f.rule_id == "SL001"]
    assert (finding.line, finding.column) == (2, 40)
    assert "status = %(pending)s" in finding.message


def _py(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "mod.py"
    path.write_text(source, encoding="utf-8")
    return path


def _at(path: Path, line: int, column: int) -> str:
    return path.read_text(encoding="utf-8").splitlines()[line - 1][column - 1 :]


def test_python_escapes_keep_columns(tmp_path: Path) -> None:
    src = (
        "def claim(cur):\n"
        "    cur.execute(\"UPDATE jobs SET status = \\t'running', locked_until = now() \\\n"
        "WHERE id IN (SELECT id FROM jobs WHERE status = 'p\\u00e9nding' LIMIT 1)\")\n"
    )
    path = _py(tmp_path, src)
    result = audit_paths([path])
    (f,) = [f for f in result.findings if f.rule_id == "SL001"]
    assert f.line == 3
    assert _at(path, f.line, f.column).startswith("status = 'p\\u00e9nding'")


def test_python_implicit_concatenation_with_comments(tmp_path: Path) -> None:
    src = (
        "CLAIM_SQL = (\n"
        "    \"UPDATE jobs SET status = 'running', locked_until = now() \"  # lease\n"
        "    # the candidates\n"
        "    r\"WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' LIMIT 1)\"\n"
        ")\n"
    )
    path = _py(tmp_path, src)
    sl001, sl007 = audit_paths([path]).findings
    assert (sl001.rule_id, sl007.rule_id) == ("SL001", "SL007")
    assert (sl001.line, _at(path, sl001.line, sl001.column)[:6]) == (4, "status")
    assert _at(path, sl007.line, sl007.column).startswith("LIMIT 1)")


def test_python_wrappers_and_names(tmp_path: Path) -> None:
    src = (
        "import textwrap\n"  # noqa: S608
        "from psycopg import sql\n\n"
        "def a(cur, table):\n"
        f"    q = textwrap.dedent({RACY!r})\n"
        "    cur.execute(q)\n\n"
        "def b(cur, table):\n"
        f"    cur.execute(sql.SQL({RACY.replace('jobs', '{table}')!r}).format(table=table))\n\n"
        "def c(conn):\n"
        f"    return conn.exec_driver_sql({RACY!r}.strip())\n\n"
        "def d(cur, rows):\n"
        "    execute_values(cur, \"UPDATE jobs SET status = 'done' WHERE id = %s\", rows)\n"
    )
    result = audit_paths([_py(tmp_path, src)])
    assert result.problems == []
    got = sorted((f.line, f.rule_id) for f in result.findings)
    assert got == [(5, "SL001"), (9, "SL001"), (12, "SL001"), (15, "SL006")]


def test_python_ignores_non_sql_strings_and_bytes(tmp_path: Path) -> None:
    src = (
        'LOG_QUERY = "level=info"\n'
        "def f(x, cur):\n"
        '    x.execute("run the thing")\n'
        "    cur.execute(b\"UPDATE jobs SET status = 'done' WHERE id = 1\")\n"
        "    print(\"UPDATE jobs SET status = 'done' WHERE id = 1\")\n"
    )
    result = audit_paths([_py(tmp_path, src)])
    assert result.findings == [] and result.problems == [] and result.statements == 0


def test_python_suppression_comment(tmp_path: Path) -> None:
    src = (
        "def done(cur, i):\n"
        "    cur.execute(\n"
        "        # skiplock: ignore[SL006]\n"
        "        \"UPDATE jobs SET status = 'done' WHERE id = %s\", (i,)\n"
        "    )\n"
    )
    assert audit_paths([_py(tmp_path, src)]).findings == []


@pytest.mark.parametrize(("together", "expected"), [(True, ["SL002"]), (False, [])])
def test_two_step_is_per_function_with_module_constants(
    tmp_path: Path, together: bool, expected: list[str]
) -> None:
    head = (
        "PENDING_SQL = \"SELECT id FROM jobs WHERE status = 'pending' ORDER BY id\"\n"
        "TAKE_SQL = \"UPDATE jobs SET status = 'running', worker = %s WHERE id = ANY(%s)\"\n\n"
    )
    if together:
        body = (
            "def claim(cur, me):\n"
            "    cur.execute(PENDING_SQL)\n"
            "    ids = [r[0] for r in cur.fetchall()]\n"
            "    cur.execute(TAKE_SQL, (me, ids))\n"
        )
    else:
        body = (
            "def report(cur):\n"
            "    cur.execute(PENDING_SQL)\n\n"
            "def take(cur, me, ids):\n"
            "    cur.execute(TAKE_SQL, (me, ids))\n"
        )
    result = audit_paths([_py(tmp_path, head + body)])
    assert [f.rule_id for f in result.findings] == expected


def test_dynamic_sql_that_does_not_parse_is_skipped_not_an_error(tmp_path: Path) -> None:
    src = 'def f(cur, cond, order):\n    cur.execute(f"SELECT * FROM jobs WHERE {cond} {order}")\n'
    result = audit_paths([_py(tmp_path, src)])
    assert result.problems == []
    assert result.exit_code() == 0
    (skipped,) = result.skipped
    assert (skipped.line, skipped.column) == (2, 51)
    assert "{order}" in skipped.message


def test_static_python_sql_that_does_not_parse_is_an_error(tmp_path: Path) -> None:
    src = 'def f(cur):\n    cur.execute("UPDATE jobs SET status = WHERE id = 1")\n'
    result = audit_paths([_py(tmp_path, src)])
    (problem,) = result.problems
    assert (problem.line, problem.column) == (2, 43)
    assert result.exit_code() == 2
