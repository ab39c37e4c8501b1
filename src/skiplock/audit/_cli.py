"""The `skiplock audit` command: gathers inputs and options, prints the report, sets the exit code.

Today the command runs the static analysis (``run_static``).  The experiment (running
the user's claim concurrently on a scratch schema, built on skiplock.lab) is meant to
arrive as extra options on this same command (--dsn, --schema FILE, --claim FILE,
--workers, --jobs) and a branch in ``audit`` to a second runner; the static path stays.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import click

from ._engine import AuditResult
from ._engine import audit as run_audit
from ._extract import Extracted, Problem, discover, extract_file, extract_text
from ._report import render
from ._rules import RULES

__all__ = ["audit", "collect", "run_static"]

_FORMATS = ("text", "json", "sarif")
_LEVELS = ("info", "warning", "error")


def _rule_ids(values: Sequence[str], option: str) -> set[str]:
    ids = {v.strip().upper() for value in values for v in value.split(",") if v.strip()}
    unknown = sorted(ids - set(RULES))
    if unknown:
        raise click.BadParameter(f"unknown rule id(s): {', '.join(unknown)}", param_hint=option)
    return ids


def collect(paths: Sequence[str], sql_texts: Sequence[str], stdin_text: str | None) -> Extracted:
    """Every input as extracted SQL; missing paths become problems (exit 2), not exceptions."""
    extracted = Extracted()
    for n, text in enumerate(sql_texts, 1):
        extracted.extend(extract_text(text, "<sql>" if len(sql_texts) == 1 else f"<sql:{n}>"))
    for raw in paths:
        if raw == "-":
            extracted.extend(extract_text(stdin_text or "", "<stdin>"))
            continue
        path = Path(raw)
        if not path.exists():
            extracted.problems.append(Problem(raw, 1, 1, "no such file or directory"))
            continue
        for found in discover([path]):
            extracted.extend(extract_file(found))
    return extracted


def _filter(result: AuditResult, select: set[str], ignore: set[str]) -> AuditResult:
    result.findings = [
        f
        for f in result.findings
        if (not select or f.rule_id in select) and f.rule_id not in ignore
    ]
    return result


def _list_rules() -> str:
    lines = []
    for rule in RULES.values():
        lines.append(f"{rule.id} {rule.severity:<7} {rule.name}")
        lines.append(f"    {rule.summary}")
        lines.append(f"    fix: {rule.fix}")
    return "\n".join(lines)


@click.command("audit")
@click.argument("paths", nargs=-1, metavar="[PATH|-]...")
@click.option(
    "--sql", "sql_texts", multiple=True, metavar="SQL", help="Audit this SQL text (repeatable)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(_FORMATS),
    default="text",
    show_default=True,
    help="text: linter lines; json: one document; sarif: SARIF 2.1.0 for code scanning.",
)
@click.option(
    "--select",
    "select",
    multiple=True,
    metavar="IDS",
    help="Report only these rules (e.g. SL001,SL002).",
)
@click.option("--ignore", "ignore", multiple=True, metavar="IDS", help="Do not report these rules.")
@click.option(
    "--fail-on",
    type=click.Choice(_LEVELS),
    default="info",
    show_default=True,
    help="Lowest severity that makes the exit code 1.",
)
@click.option(
    "--no-fix", is_flag=True, help="Text format: leave out the fix hint under each finding."
)
@click.option("--list-rules", is_flag=True, help="Describe every rule and exit.")
def audit(
    paths: tuple[str, ...],
    sql_texts: tuple[str, ...],
    fmt: str,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    fail_on: str,
    no_fix: bool,
    list_rules: bool,
) -> None:
    """Find job-queue claims that can hand one job to two workers.

    Audits SQL in .sql files, in Python files (string literals passed to execute-like calls
    or assigned to names ending in SQL/QUERY), in directories (searched recursively), in
    --sql text, and on stdin ('-').  A comment "skiplock: ignore[SL005]" in a statement (or
    next to a Python literal) silences that rule there.

    Exit status: 0 clean, 1 findings, 2 input that could not be audited (unparsable SQL is
    reported with its location).
    """
    if list_rules:
        click.echo(_list_rules())
        return
    # The experiment mode branches off here once it exists; everything below is static.
    selected = _rule_ids(select, "--select")
    ignored = _rule_ids(ignore, "--ignore")
    if not paths and not sql_texts:
        raise click.UsageError("give files or directories to audit, --sql TEXT, or '-' for stdin")
    text, code = run_static(
        paths, sql_texts, selected, ignored, fmt=fmt, fail_on=fail_on, fixes=not no_fix
    )
    click.echo(text)
    sys.exit(code)


def run_static(
    paths: Sequence[str],
    sql_texts: Sequence[str],
    select: set[str],
    ignore: set[str],
    *,
    fmt: str = "text",
    fail_on: str = "info",
    fixes: bool = True,
) -> tuple[str, int]:
    """The static audit as the command runs it: (report text, exit status)."""
    stdin_text = sys.stdin.read() if "-" in paths else None
    result = _filter(run_audit(collect(paths, sql_texts, stdin_text)), select, ignore)
    return render(result, fmt, fixes=fixes), result.exit_code(fail_on)
