"""`skiplock jobs | retry`: find jobs (failed ones, mostly) and run them again."""

from __future__ import annotations

import re
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from .._control import STATUSES
from .._errors import ConfigError
from ._main import _queue
from .common import dsn_option, echo_json, json_option, schema_option, user_errors

__all__ = ["jobs", "parse_since", "retry"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_since(text: str | None) -> datetime | timedelta | None:
    """--since as a duration ago (``90s``, ``30m``, ``2h``, ``1d``, a bare number is
    seconds) or an ISO 8601 time with its timezone; ConfigError (exit 2) otherwise.

    A time without a zone is refused, as ``enqueue --run-at`` refuses one: the server
    and the shell user would each read it in their own zone, hours apart.
    """
    if text is None:
        return None
    ago = _AGO.fullmatch(text.strip())
    if ago:
        return timedelta(seconds=float(ago[1]) * _UNITS[ago[2] or "s"])
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--since {text!r} is neither a duration (90s, 30m, 2h, 1d) nor an ISO 8601 "
            "time such as 2030-01-31T09:00:00+01:00"
        ) from None
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigError(
            f"--since {text!r} has no timezone: add one, as in 2030-01-31T09:00:00Z (UTC) "
            "or 2030-01-31T09:00:00+01:00, or give a duration (2h)"
        )
    return at


def _ago(value: datetime | None) -> str:
    if value is None:
        return "-"
    seconds = max((datetime.now(UTC) - value).total_seconds(), 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


_since_option = click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="Jobs finished (unfinished: created) since: a duration ago (30m, 2h, 1d) "
    "or an ISO 8601 time with its timezone.",
)
_queue_option = click.option("--queue", "queue_name", default=None, help="Only this queue.")
_task_option = click.option(
    "--task", default=None, help="Only this task (its name, as in the job's row)."
)


@click.command()
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(sorted(STATUSES)),
    help="Only jobs in this status (repeat for several).",
)
@_queue_option
@_task_option
@_since_option
@click.option("--error", default=None, help="Only jobs whose last error contains this text.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Rows at most."
)
@dsn_option
@schema_option
@json_option
@user_errors
def jobs(
    statuses: tuple[str, ...],
    queue_name: str | None,
    task: str | None,
    since: str | None,
    error: str | None,
    limit: int,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """List jobs, newest first: `skiplock jobs --status failed --task billing.send`.

    The error column is the exception line of the job's last error ("ValueError: bad");
    --json gives the whole text too.
    """
    when = parse_since(since)
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        rows = q.find_jobs(
            status=list(statuses) or None,
            queue=queue_name,
            task=task,
            since=when,
            error=error,
            limit=limit,
        )
    if as_json:
        echo_json({"jobs": [{**asdict(r), "error": r.error} for r in rows]})
        return
    if not rows:
        click.echo("no jobs match")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"skiplock jobs ({schema})")
    for col in ("id", "queue", "task", "status", "attempts", "when", "error"):
        table.add_column(col, justify="right" if col in ("id", "attempts") else "left")
    for r in rows:
        table.add_row(
            str(r.id),
            r.queue,
            r.task or "-",
            r.status,
            f"{r.attempts}/{r.max_attempts}",
            _ago(r.finished_at or r.created_at),
            r.error or "",
        )
    console = Console()
    if not console.is_terminal:
        # Piped or captured: no terminal to fit, and a row split over lines defeats grep.
        console = Console(width=240)
    console.print(table)
    if len(rows) == limit:
        click.echo(f"(the newest {limit}; --limit for more)", err=True)


@click.command()
@click.argument("job_ids", metavar="[ID]...", nargs=-1, type=int)
@click.option(
    "--failed", is_flag=True, help="Retry every failed job matching --queue, --task, --since."
)
@_queue_option
@_task_option
@_since_option
@dsn_option
@schema_option
@json_option
@user_errors
def retry(
    job_ids: tuple[int, ...],
    failed: bool,
    queue_name: str | None,
    task: str | None,
    since: str | None,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Run failed or cancelled jobs again, by ID, or every failed one with --failed.

    Each goes back to pending, due now, with a fresh attempt budget (attempts 0); its
    last error stays until the next attempt.  A pending, running or done job is refused
    and left alone.  Exit 1 if any ID was refused.
    """
    if failed == bool(job_ids):
        raise click.UsageError("give job IDs or --failed, not both")
    if job_ids and (queue_name or task or since):
        raise click.UsageError("--queue, --task and --since go with --failed")
    when = parse_since(since)
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        if failed:
            report = q.retry_failed(queue=queue_name, task=task, since=when)
        else:
            report = q.retry_jobs(job_ids)
    refused: list[dict[str, Any]] = [
        {"id": job_id, "reason": reason} for job_id, reason in sorted(report.refused.items())
    ]
    if as_json:
        echo_json({"retried": list(report.retried), "refused": refused})
    else:
        if report.retried:
            ids = ", ".join(map(str, report.retried))
            click.echo(f"retried {len(report.retried)} job(s): {ids}")
        elif failed:
            click.echo("no failed job matches")
        for r in refused:
            click.echo(f"refused job {r['id']}: {r['reason']}")
    if refused and not failed:
        raise SystemExit(1)
