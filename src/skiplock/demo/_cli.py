"""``skiplock demo``: the postmortem's invoicing system as one command, with a verdict."""

from __future__ import annotations

from typing import Any

import click

from skiplock.cli.common import dsn_option, echo_json, json_option, user_errors
from skiplock.lab import DEFAULT_STRATEGY, STRATEGIES

from ._run import DemoConfig, DemoResult, run_demo

__all__ = ["demo", "render_summary"]


@click.command()
@click.option(
    "--invoices",
    default=2000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Invoices to email, one job each.",
)
@click.option(
    "--workers",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Email worker processes.",
)
@click.option(
    "--strategy",
    default=DEFAULT_STRATEGY,
    show_default=True,
    type=click.Choice(list(STRATEGIES)),
    help="How workers claim jobs.  skip-locked runs skiplock's Worker; any other runs the "
    "postmortem's poll loop with that claim (naive is the original, racy one).",
)
@click.option(
    "--no-idempotency",
    is_flag=True,
    help="Send emails without an Idempotency-Key: a job that runs twice emails twice.",
)
@click.option(
    "--kill-worker",
    is_flag=True,
    help="SIGKILL one worker process a quarter of the way through; its jobs run again "
    "after the lease.",
)
@json_option
@dsn_option
@user_errors
def demo(
    invoices: int,
    workers: int,
    strategy: str,
    no_idempotency: bool,
    kill_worker: bool,
    as_json: bool,
    dsn: str | None,
) -> None:
    """Run the postmortem's invoicing system and count the emails customers received.

    Seeds invoices in a scratch schema (dropped at the end), enqueues one job per invoice,
    and drains the backlog with worker processes that email each invoice through a local
    fake provider honouring Idempotency-Key.  Then: emails the provider accepted,
    duplicates, repeats the key suppressed, and unique violations in the audit table.
    Try --strategy naive --no-idempotency for the incident, and --kill-worker.
    """
    config = DemoConfig(
        invoices=invoices,
        workers=workers,
        strategy=strategy,
        idempotency=not no_idempotency,
        kill_worker=kill_worker,
        dsn=dsn,
    )
    config.check()  # bad combinations fail before anything is seeded
    if as_json:
        echo_json(run_demo(config).to_dict())
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    err = Console(stderr=True)
    with Progress(
        TextColumn("[bold]draining invoices"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        # A bar redrawn into a log file is noise; the phase lines still get there.
        disable=not err.is_terminal,
    ) as progress:
        task = progress.add_task("drain", total=invoices, start=False)

        def on_progress(done: int, total: int) -> None:
            progress.start_task(task)
            progress.update(task, completed=done, total=total)

        def on_phase(text: str) -> None:
            progress.console.print(f"[dim]{text}[/]")

        result = run_demo(config, on_progress=on_progress, on_phase=on_phase)
    Console().print(render_summary(result))


def render_summary(r: DemoResult) -> Any:
    """The terminal summary: a two-column table and a one-line verdict."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    keys = "on" if r.idempotency else "off"
    table = Table(
        title=f"skiplock demo: {r.invoices:,} invoices, {r.workers} worker processes, "
        f"strategy {r.strategy}, idempotency keys {keys}",
        show_header=False,
        title_justify="left",
    )
    table.add_column(style="bold")
    table.add_column()
    bad = "[bold red]{}[/]"
    dup = f"{r.duplicate_emails:,}"
    if r.duplicate_emails:
        dup = bad.format(dup) + f" ({r.invoices_emailed_more_than_once:,} customers)"
    audit = f"{r.audit_duplicates:,}"
    if r.audit_duplicates:
        audit = bad.format(audit) + " unique violations"
    table.add_row("invoices", f"{r.invoices:,}")
    table.add_row("emails accepted by the provider", f"{r.emails_accepted:,}")
    table.add_row("duplicate emails", dup)
    table.add_row("repeats suppressed by idempotency key", f"{r.suppressed_by_idempotency:,}")
    table.add_row("audit-table duplicates", audit)
    table.add_row(
        "drain time", f"{r.drain_seconds:.2f} s ({r.invoices_per_second:,.0f} invoices/s)"
    )
    table.add_row("jobs per worker", "  ".join(f"{w}={n:,}" for w, n in r.jobs_per_worker.items()))
    if r.jobs_failed:
        table.add_row("jobs failed", bad.format(f"{r.jobs_failed:,}"))
    k = r.killed_worker
    if k is not None:
        again = "none ran again"
        if k.ran_again_after_seconds is not None:
            again = f"{k.jobs_recovered} ran again within {k.ran_again_after_seconds:.2f} s"
        table.add_row(
            "killed worker",
            f"{k.name} (pid {k.pid}), SIGKILLed after {k.at_jobs_finished:,} jobs finished, "
            f"holding {k.jobs_held} job(s) ({k.already_emailed} already emailed): "
            f"{again} of the kill",
        )
    lines: list[Any] = [table]
    if r.duplicate_emails:
        lines.append(
            Text.from_markup(
                f"[bold red]{r.invoices_emailed_more_than_once:,} customers received the same "
                "invoice email more than once.[/]"
            )
        )
        if r.audit_error:
            lines.append(Text(f"The audit table noticed after the fact: ERROR:  {r.audit_error}"))
    elif r.emails_accepted == r.invoices:
        lines.append(Text.from_markup("[bold green]Every invoice was emailed exactly once.[/]"))
    else:
        lines.append(
            Text.from_markup(
                f"[bold red]{r.invoices - r.emails_accepted:,} invoices were not emailed.[/]"
            )
        )
    return Group(*lines)
