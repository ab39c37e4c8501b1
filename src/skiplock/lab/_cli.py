"""``skiplock race``: the postmortem's load test and its two psql windows, as one command."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from skiplock.cli.common import dsn_option, echo_json, json_option, require_extra, user_errors
from skiplock.connect import server_dsn

from ._race import RaceResult, run_race
from ._replay import replay
from ._strategies import DEFAULT_STRATEGY, STRATEGIES

__all__ = ["race", "write_plot"]


def _strategies(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["all"]:
        return list(STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown strategy {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(STRATEGIES)} or 'all'",
            param_hint="--strategy",
        )
    # A strategy named twice would only be raced twice under one key.
    return list(dict.fromkeys(names))


def _table(results: dict[str, RaceResult]) -> Any:
    from rich.table import Table

    first = next(iter(results.values()))
    mode = "processes" if first.processes else "threads"
    table = Table(
        title=f"skiplock race: {first.workers} workers ({mode}), {first.jobs} jobs, "
        f"batch {first.batch}, poll {first.poll_ms:g} ms, work {first.work_ms:g} ms/job"
    )
    columns = (
        "strategy", "jobs", "claims", "double claims", "duplicate jobs", "jobs/s",
        "claim p50 ms", "claim p99 ms", "lock-wait share", "serialization retries", "deadlocks",
        "seconds",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in results.values():
        doubles = str(r.double_claims)
        if r.double_claims:
            doubles = f"[bold red]{doubles}[/]"
        retries = str(r.serialization_retries)
        if r.serialization_retries:
            retries += f" ({r.serialization_retry_rate:.0%})"
        table.add_row(
            r.strategy,
            str(r.jobs),
            str(r.claims),
            doubles,
            str(r.duplicate_jobs),
            f"{r.throughput:,.0f}",
            f"{r.latency_p50_ms:.2f}",
            f"{r.latency_p99_ms:.2f}",
            f"{r.lock_wait_share:.0%}",
            retries,
            str(r.deadlocks),
            f"{r.seconds:.2f}",
        )
    return table


def write_plot(results: dict[str, RaceResult], path: str | Path) -> Path:
    """Write a PNG comparing the strategies: throughput, double claims, lock-wait share.

    Parameters
    ----------
    results
        ``run_race``'s output, keyed by strategy name.
    path
        The PNG to write (parent directories must exist).

    Returns
    -------
    Path
        Where the plot went.
    """
    require_extra("--plot", "plot", "matplotlib")
    import matplotlib

    # Agg: no display needed, and no GUI backend probing on a server.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels: Sequence[tuple[str, list[float], str]] = (
        ("throughput (jobs/s)", [results[n].throughput for n in names], "tab:blue"),
        ("double claims", [float(results[n].double_claims) for n in names], "tab:red"),
        ("lock-wait share (%)", [results[n].lock_wait_share * 100 for n in names], "tab:orange"),
    )
    first = next(iter(results.values()))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2))
    for ax, (title, values, color) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color=color)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=30)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:,.0f}" if v >= 10 or v == int(v) else f"{v:.1f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    fig.suptitle(f"skiplock race: {first.workers} workers, {first.jobs} jobs, batch {first.batch}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@click.command()
@click.option(
    "--strategy",
    "strategy_list",
    default=DEFAULT_STRATEGY,
    show_default=True,
    metavar="S[,S...]",
    help=f"Claim strategies, comma-separated, or 'all': {', '.join(STRATEGIES)}.",
)
@click.option("--workers", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option(
    "--jobs",
    default=None,
    type=click.IntRange(0),
    help="Jobs seeded.  [default: 20000; 10 with --replay]",
)
@click.option(
    "--batch",
    default=None,
    type=click.IntRange(1),
    help="Jobs per claim (the LIMIT).  [default: 10; 3 with --replay]",
)
@click.option(
    "--poll-ms",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    help="A worker claims at most every P ms (0: back to back; 1000 is the postmortem).",
)
@click.option(
    "--work-ms", default=0.0, show_default=True, type=click.FloatRange(0), help="Work per job."
)
@click.option("--processes", is_flag=True, help="One process per worker instead of a thread.")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    metavar="FILE.png",
    type=click.Path(dir_okay=False),
    help="Also write a PNG comparing the strategies.",
)
@click.option(
    "--replay",
    "do_replay",
    is_flag=True,
    help="Instead of racing, drive two sessions step by step and print the timeline.",
)
@click.option(
    "--timeout",
    default=600.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds one strategy's drain may take.",
)
@dsn_option
@json_option
@user_errors
def race(
    strategy_list: str,
    workers: int,
    jobs: int | None,
    batch: int | None,
    poll_ms: float,
    work_ms: float,
    processes: bool,
    plot_path: str | None,
    do_replay: bool,
    timeout: float,
    dsn: str | None,
    as_json: bool,
) -> None:
    """Race claim strategies: W workers drain N jobs; count double claims and lock waits.

    Each strategy gets a freshly seeded scratch schema, dropped at the end.  With
    --replay, two sessions claim step by step instead (the postmortem's two psql
    windows): naive shows both holding the same jobs, skip-locked disjoint sets.
    """
    names = _strategies(strategy_list)
    if do_replay and (plot_path or processes):
        raise click.UsageError("--replay drives two sessions; --plot and --processes do not apply")
    if plot_path:
        require_extra("--plot", "plot", "matplotlib")  # before the race, not after it
    server = server_dsn(dsn)
    if do_replay:
        timelines = {n: replay(server, n, jobs=jobs or 10, limit=batch or 3) for n in names}
        if as_json:
            echo_json({n: t.to_dict() for n, t in timelines.items()})
        else:
            click.echo("\n\n".join(t.format() for t in timelines.values()))
        return

    def progress(r: RaceResult) -> None:
        click.echo(f"  {r.strategy}: {r.seconds:.2f}s, {r.double_claims} double claims", err=True)

    click.echo(
        f"racing {', '.join(names)}: {workers} workers, {jobs if jobs is not None else 20000} "
        "jobs each",
        err=True,
    )
    results = run_race(
        server,
        names,
        on_result=progress,
        workers=workers,
        jobs=20000 if jobs is None else jobs,
        batch=batch or 10,
        poll_ms=poll_ms,
        work_ms=work_ms,
        processes=processes,
        timeout=timeout,
    )
    plotted = write_plot(results, plot_path) if plot_path else None
    if as_json:
        echo_json({n: r.to_dict() for n, r in results.items()})
    else:
        from rich.console import Console

        Console(width=max(Console().width, 160)).print(_table(results))
    if plotted is not None:
        click.echo(f"plot written to {plotted}", err=as_json)
    sys.stdout.flush()
