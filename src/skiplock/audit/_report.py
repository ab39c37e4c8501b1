"""Audit output for people (linter lines), for scripts (JSON) and for code-scanning UIs (SARIF)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import PurePath
from typing import Any
from urllib.parse import quote

from ._engine import AuditResult, Finding
from ._rules import RULES
from ._source import Problem

__all__ = ["render", "render_json", "render_sarif", "render_text"]

_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _version() -> str:
    try:
        return metadata.version("skiplock")
    except metadata.PackageNotFoundError:  # running from a source tree without metadata
        return "0"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def render_text(result: AuditResult, *, fixes: bool = True) -> str:
    lines: list[str] = []
    for p in result.problems:
        lines.append(f"{p.path}:{p.line}:{p.column}: error SL000 {p.message}")
    for f in result.findings:
        lines.append(f"{f.path}:{f.line}:{f.column}: {f.severity} {f.rule_id} {f.message}")
        for r in f.related:
            lines.append(f"  related: {r.path}:{r.line}:{r.column}: {r.message}")
        if fixes:
            lines.append(f"  fix: {f.fix}")
    for p in result.skipped:
        lines.append(f"{p.path}:{p.line}:{p.column}: note {p.message}")
    counts = {
        s: sum(f.severity == s for f in result.findings) for s in ("error", "warning", "info")
    }
    where = f"{_plural(result.statements, 'statement')} from {_plural(result.sources, 'source')}"
    if result.findings:
        detail = ", ".join(
            f"{n} {s}" if s == "info" else _plural(n, s) for s, n in counts.items() if n
        )
        summary = f"{_plural(len(result.findings), 'finding')} ({detail}) in {where}"
    else:
        summary = f"no findings in {where}"
    if result.problems:
        summary += f"; {_plural(len(result.problems), 'input')} could not be audited"
    lines.append(summary)
    return "\n".join(lines)


def _location(path: str, line: int, column: int) -> dict[str, Any]:
    return {"path": path, "line": line, "column": column}


def _finding_json(f: Finding) -> dict[str, Any]:
    return {
        "rule": f.rule_id,
        "name": f.rule.name,
        "severity": f.severity,
        **_location(f.path, f.line, f.column),
        "message": f.message,
        "fix": f.fix,
        "related": [
            {**_location(r.path, r.line, r.column), "message": r.message} for r in f.related
        ],
    }


def _problem_json(p: Problem) -> dict[str, Any]:
    return {**_location(p.path, p.line, p.column), "message": p.message}


def render_json(result: AuditResult) -> str:
    doc = {
        "version": 1,
        "findings": [_finding_json(f) for f in result.findings],
        "errors": [_problem_json(p) for p in result.problems],
        "skipped": [_problem_json(p) for p in result.skipped],
        "summary": {
            "sources": result.sources,
            "statements": result.statements,
            "findings": len(result.findings),
            "errors": len(result.problems),
            "by_severity": {
                s: sum(f.severity == s for f in result.findings)
                for s in ("error", "warning", "info")
            },
        },
    }
    return json.dumps(doc, indent=2)


def _uri(path: str) -> str:
    pure = PurePath(path)
    if pure.is_absolute():
        return pure.as_uri()
    return quote(pure.as_posix())


def _physical(path: str, line: int, column: int) -> dict[str, Any]:
    return {
        "physicalLocation": {
            "artifactLocation": {"uri": _uri(path)},
            "region": {"startLine": line, "startColumn": column},
        }
    }


def render_sarif(result: AuditResult) -> str:
    rule_ids = list(RULES)
    rules = [
        {
            "id": r.id,
            "name": r.name,
            "shortDescription": {"text": r.summary},
            "fullDescription": {"text": r.summary},
            "help": {"text": f"Fix: {r.fix}"},
            "defaultConfiguration": {"level": _SARIF_LEVEL[r.severity]},
        }
        for r in RULES.values()
    ]
    results: list[dict[str, Any]] = []
    for p in result.problems:
        results.append(
            {
                "ruleId": "SL000",
                "ruleIndex": rule_ids.index("SL000"),
                "level": "error",
                "message": {"text": p.message},
                "locations": [_physical(p.path, p.line, p.column)],
            }
        )
    for f in result.findings:
        entry: dict[str, Any] = {
            "ruleId": f.rule_id,
            "ruleIndex": rule_ids.index(f.rule_id),
            "level": _SARIF_LEVEL[f.severity],
            "message": {"text": f"{f.message} Fix: {f.fix}"},
            "locations": [_physical(f.path, f.line, f.column)],
        }
        if f.related:
            entry["relatedLocations"] = [
                {"id": i, **_physical(r.path, r.line, r.column), "message": {"text": r.message}}
                for i, r in enumerate(f.related, 1)
            ]
        results.append(entry)
    notifications = [
        {
            "level": "note",
            "message": {"text": p.message},
            "locations": [_physical(p.path, p.line, p.column)],
        }
        for p in result.skipped
    ]
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "skiplock-audit",
                "version": _version(),
                "rules": rules,
            }
        },
        "columnKind": "unicodeCodePoints",
        "invocations": [
            {
                "executionSuccessful": not result.problems,
                "toolExecutionNotifications": notifications,
            }
        ],
        "results": results,
    }
    return json.dumps({"$schema": _SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}, indent=2)


def render(result: AuditResult, fmt: str, *, fixes: bool = True) -> str:
    if fmt == "json":
        return render_json(result)
    if fmt == "sarif":
        return render_sarif(result)
    return render_text(result, fixes=fixes)
