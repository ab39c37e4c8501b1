"""The `skiplock audit` command: gathers inputs and options, prints the report, sets the exit code.

Without --claim the command runs the static analysis (``run_static``).  With --schema
FILE and --claim FILE it runs the experiment (``run_experiment``, in _experiment.py):
the user's claim, concurrently, on a scratch copy of their schema, built on skiplock.lab.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from skiplock import SkiplockError
from skiplock.cli.common import dsn_option

from ._engine import AuditResult
from ._engine import audit as run_audit
from ._extract import discover, extract_file, extract_text
from ._report import render
from ._rules import RULES
from ._source import Extracted, Problem

__all__ = ["audit", "collect", "run_experiment_command", "run_static"]

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
@click.option(
    "--claim",
    "claim_file",
    default=None,
    metavar="FILE",
    help="Experiment: your claim (.sql or .py); run it concurrently on a scratch schema.",
)
@click.option(
    "--schema",
    "schema_file",
    default=None,
    metavar="FILE",
    help="Experiment: the DDL of your queue table(s), run in the scratch schema.",
)
@click.option(
    "--seed",
    "seed_file",
    default=None,
    metavar="FILE",
    help="Experiment: a script that fills the tables (':jobs' is the row count); "
    "default: generated rows.",
)
@click.option(
    "--param",
    "param_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Experiment: a value for a placeholder, by name (worker) or number (1); repeatable.",
)
@click.option(
    "--workers", default=8, show_default=True, type=click.IntRange(1, 64), help="Experiment."
)
@click.option(
    "--jobs", default=5000, show_default=True, type=click.IntRange(1), help="Experiment: rows."
)
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Experiment: seconds the load may take.",
)
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@dsn_option
def audit(
    paths: tuple[str, ...],
    sql_texts: tuple[str, ...],
    fmt: str,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    fail_on: str,
    no_fix: bool,
    list_rules: bool,
    claim_file: str | None,
    schema_file: str | None,
    seed_file: str | None,
    param_pairs: tuple[str, ...],
    workers: int,
    jobs: int,
    timeout: float,
    as_json: bool,
    dsn: str | None,
) -> None:
    """Find job-queue claims that can hand one job to two workers.

    Audits SQL in .sql files, in Python files (string literals passed to execute-like calls
    or assigned to names ending in SQL/QUERY), in directories (searched recursively), in
    --sql text, and on stdin ('-').  A comment "skiplock: ignore[SL005]" in a statement (or
    next to a Python literal) silences that rule there.

    With --schema FILE --claim FILE it also runs the claim: W workers drain N rows seeded
    in a scratch schema (your data is never touched), double claims are counted, and two
    sessions replay the race step by step.

    Exit status: 0 clean, 1 findings (or a race observed), 2 input that could not be
    audited (unparsable SQL is reported with its location) or run.
    """
    if list_rules:
        click.echo(_list_rules())
        return
    if as_json:
        fmt = "json"
    if claim_file is not None or schema_file is not None:
        if paths or sql_texts:
            raise click.UsageError("--claim runs one claim: leave out PATHs and --sql")
        if claim_file is None or schema_file is None:
            raise click.UsageError("the experiment needs both --schema FILE and --claim FILE")
        if fmt == "sarif":
            raise click.UsageError("--format sarif is for the static audit; use text or json")
        text, code = run_experiment_command(
            dsn,
            schema_file,
            claim_file,
            seed_file=seed_file,
            params=_params(param_pairs),
            workers=workers,
            jobs=jobs,
            timeout=timeout,
            fmt=fmt,
            fail_on=fail_on,
            fixes=not no_fix,
        )
        if text:
            click.echo(text)
        sys.exit(code)
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


def _params(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip():
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--param")
        out[name.strip()] = value
    return out


def run_experiment_command(
    dsn: str | None,
    schema_file: str,
    claim_file: str,
    *,
    seed_file: str | None = None,
    params: dict[str, str] | None = None,
    workers: int = 8,
    jobs: int = 5000,
    timeout: float = 120.0,
    fmt: str = "text",
    fail_on: str = "info",
    fixes: bool = True,
) -> tuple[str, int]:
    """The experiment as the command runs it: (report text, exit status).

    A problem (a bad DSN, a file that does not parse, a claim that fails on the schema)
    is one line on stderr and status 2, never a traceback.
    """
    from skiplock.connect import server_dsn

    from ._experiment import run_experiment

    try:
        server = server_dsn(dsn)
        result = run_experiment(
            server,
            schema_file,
            claim_file,
            seed_path=seed_file,
            workers=workers,
            jobs=jobs,
            params=params or {},
            timeout=timeout,
            fail_on=fail_on,
            progress=lambda line: click.echo(line, err=True),
        )
    except SkiplockError as exc:
        click.echo(f"skiplock: error: {exc}", err=True)
        return "", 2
    if fmt == "json":
        return json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str), (
            result.exit_code
        )
    return result.format(fixes=fixes), result.exit_code
