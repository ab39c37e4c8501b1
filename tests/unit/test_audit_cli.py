"""`skiplock audit` from the command line: exit codes, formats, inputs.  No database."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from skiplock.audit import RULES
from skiplock.cli import main

POSTMORTEM = (
    "UPDATE jobs SET status = 'running', started_at = now(), worker = $1\n"
    "WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10)\n"
    "RETURNING id, payload;\n"
)
GOOD = (
    "WITH picked AS (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 10\n"
    "                FOR UPDATE SKIP LOCKED)\n"
    "UPDATE jobs j SET status = 'running', worker = $1,\n"
    "       locked_until = now() + interval '5 minutes'\n"
    "FROM picked WHERE j.id = picked.id RETURNING j.id;\n"
)


def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["audit", *args], input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_clean_sql_exits_0() -> None:
    code, out = run("--sql", GOOD)
    assert code == 0
    assert "no findings in 1 statement" in out


def test_findings_exit_1_with_linter_lines_and_fixes() -> None:
    code, out = run("--sql", POSTMORTEM)
    assert code == 1
    lines = out.splitlines()
    assert "<sql>:2:40: error SL001 The claim condition status = 'pending'" in out
    assert any(line.startswith("<sql>:1:17: warning SL005 ") for line in lines)
    assert any(line.startswith("  fix: ") for line in lines)
    assert lines[-1] == "2 findings (1 error, 1 warning) in 1 statement from 1 source"


def test_no_fix_leaves_the_hints_out() -> None:
    _, out = run("--no-fix", "--sql", POSTMORTEM)
    assert "fix:" not in out


def test_unparsable_sql_exits_2_with_its_location() -> None:
    sql = "SELECT 1;\nUPDATE jobs SET status = 'running'\nWHERE WHERE id = 1;\n" + POSTMORTEM
    code, out = run("--sql", sql)
    assert code == 2
    assert '<sql>:3:7: error SL000 could not parse SQL: syntax error at or near "WHERE"' in out
    # The rest of the input is still audited.
    assert "SL001" in out
    assert "Traceback" not in out


def test_unparsable_file_location_counts_placeholders_in_the_original_text(
    tmp_path: Path,
) -> None:
    f = tmp_path / "claim.sql"
    f.write_text("-- a comment\nUPDATE jobs SET worker = %(worker)s, status = 'x' WHER id = 1;\n")
    code, out = run(str(f))
    assert code == 2
    assert f"{f}:2:51: error SL000" in out


def test_stdin() -> None:
    code, out = run("-", stdin=POSTMORTEM)
    assert code == 1
    assert "<stdin>:2:40: error SL001" in out


def test_nothing_to_audit_is_a_usage_error() -> None:
    code, out = run()
    assert code == 2
    assert "--sql" in out


def test_missing_path_exits_2(tmp_path: Path) -> None:
    code, out = run(str(tmp_path / "nope.sql"))
    assert code == 2
    assert "no such file or directory" in out


def test_python_syntax_error_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text('def f(:\n    cur.execute("SELECT 1")\n')
    code, out = run(str(f))
    assert code == 2
    assert f"{f}:1:7: error SL000 cannot parse Python" in out


def test_directories_are_searched_recursively(tmp_path: Path) -> None:
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "claim.sql").write_text(POSTMORTEM)
    (tmp_path / "worker.py").write_text(
        "def done(cur, i):\n"
        "    cur.execute(\"UPDATE jobs SET status = 'done' WHERE id = %s\", (i,))\n"
    )
    (tmp_path / "notes.txt").write_text(POSTMORTEM)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.sql").write_text(POSTMORTEM)
    code, out = run("--format", "json", str(tmp_path))
    assert code == 1
    doc = json.loads(out)
    found = sorted((Path(f["path"]).name, f["rule"]) for f in doc["findings"])
    assert found == [("claim.sql", "SL001"), ("claim.sql", "SL005"), ("worker.py", "SL006")]


def test_json_document() -> None:
    code, out = run("--format", "json", "--sql", POSTMORTEM)
    assert code == 1
    doc = json.loads(out)
    assert doc["version"] == 1
    assert doc["errors"] == []
    assert doc["summary"]["findings"] == 2
    assert doc["summary"]["by_severity"] == {"error": 1, "warning": 1, "info": 0}
    first = next(f for f in doc["findings"] if f["rule"] == "SL001")
    assert first == {
        "rule": "SL001",
        "name": "claim-condition-not-rechecked",
        "severity": "error",
        "path": "<sql>",
        "line": 2,
        "column": 40,
        "message": first["message"],
        "fix": RULES["SL001"].fix,
        "related": [],
    }


def test_json_reports_parse_errors() -> None:
    code, out = run("--format", "json", "--sql", "SELEC 1")
    assert code == 2
    doc = json.loads(out)
    assert doc["errors"] == [
        {
            "path": "<sql>",
            "line": 1,
            "column": 1,
            "message": 'could not parse SQL: syntax error at or near "SELEC"',
        }
    ]


def test_sarif_shape(tmp_path: Path) -> None:
    f = tmp_path / "two_step.sql"
    f.write_text(
        "SELECT id FROM jobs WHERE status = 'pending' LIMIT 5;\n"
        "UPDATE jobs SET status = 'running', worker = $1 WHERE id = ANY($2);\n"
    )
    code, out = run("--format", "sarif", str(f))
    assert code == 1
    doc = json.loads(out)
    assert doc["version"] == "2.1.0"
    assert doc["$schema"].endswith("sarif-2.1.0.json")
    (run_,) = doc["runs"]
    driver = run_["tool"]["driver"]
    assert driver["name"] == "skiplock-audit"
    assert [r["id"] for r in driver["rules"]] == list(RULES)
    for rule in driver["rules"]:
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
        assert rule["shortDescription"]["text"]
        assert rule["help"]["text"].startswith("Fix: ")
    results = {r["ruleId"]: r for r in run_["results"]}
    assert set(results) == {"SL002", "SL007"}
    sl002 = results["SL002"]
    assert sl002["level"] == "error"
    assert driver["rules"][sl002["ruleIndex"]]["id"] == "SL002"
    loc = sl002["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"] == f.as_uri()
    assert loc["region"] == {"startLine": 1, "startColumn": 27}
    related = sl002["relatedLocations"][0]["physicalLocation"]["region"]
    assert related == {"startLine": 2, "startColumn": 8}
    assert results["SL007"]["level"] == "note"
    assert run_["invocations"][0]["executionSuccessful"] is True


def test_sarif_includes_parse_errors() -> None:
    code, out = run("--format", "sarif", "--sql", "UPDATE")
    assert code == 2
    run_ = json.loads(out)["runs"][0]
    assert [r["ruleId"] for r in run_["results"]] == ["SL000"]
    assert run_["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"] == {
        "uri": "%3Csql%3E"
    }
    assert run_["invocations"][0]["executionSuccessful"] is False


def test_select_ignore_and_fail_on() -> None:
    code, out = run("--select", "SL005", "--sql", POSTMORTEM)
    assert code == 1
    assert "SL005" in out and "SL001" not in out
    code, out = run("--ignore", "SL001,SL005", "--sql", POSTMORTEM)
    assert code == 0
    code, _ = run("--select", "SL005", "--fail-on", "error", "--sql", POSTMORTEM)
    assert code == 0
    code, out = run("--select", "SL999", "--sql", POSTMORTEM)
    assert code == 2
    assert "unknown rule id" in out


def test_comment_suppresses_a_rule() -> None:
    sql = "-- skiplock: ignore[SL005]\n" + POSTMORTEM
    _, out = run("--sql", sql)
    assert "SL005" not in out and "SL001" in out
    _, out = run("--sql", "-- skiplock: ignore\n" + POSTMORTEM)
    assert "no findings" in out


def test_several_sql_options() -> None:
    code, out = run("--sql", GOOD, "--sql", POSTMORTEM)
    assert code == 1
    assert "<sql:2>:2:40: error SL001" in out
    assert "<sql:1>" not in out


def test_list_rules() -> None:
    code, out = run("--list-rules")
    assert code == 0
    for rule in RULES.values():
        assert f"{rule.id} {rule.severity:<7} {rule.name}" in out
