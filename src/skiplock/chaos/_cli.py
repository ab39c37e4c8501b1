"""``skiplock chaos``: producers, worker processes and faults together, then the checker."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from skiplock.cli.common import dsn_option, echo_json, json_option, user_errors

from ._faults import FAULTS
from ._run import ChaosConfig, run_chaos

__all__ = ["chaos"]


def _faults(value: str) -> tuple[str, ...]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["all"]:
        # failover needs a primary and standby of its own, patroni a Patroni cluster of
        # its own, the rest a single server.
        return tuple(f for f in FAULTS if f not in ("failover", "patroni"))
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise click.BadParameter(
            f"unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}, 'all' or 'none'",
            param_hint="--faults",
        )
    return tuple(dict.fromkeys(names))


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def render(j: dict[str, Any]) -> None:
    """The human table of a report's JSON: counts, causes, recovery, per-phase figures."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"skiplock chaos: {j['duration']:g}s, {j['workers']} workers, "
        f"{j['rate']:g} jobs/s, lease {j['lease']:g}s, faults {','.join(j['faults']) or 'none'}",
        show_header=True,
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    causes = ", ".join(f"{c} {n}" for c, n in sorted(j["duplicated_execution_causes"].items()))
    recovery = [s for s in j["recovery_seconds"] if s is not None]
    rec = (
        f"{len(recovery)} kills: min {min(recovery):.2f}s, max {max(recovery):.2f}s, "
        f"mean {sum(recovery) / len(recovery):.2f}s"
        if recovery
        else "-"
    )
    rows: list[tuple[str, Any]] = [
        ("jobs enqueued (attempted)", j["enqueued"]),
        ("  acknowledged / unknown outcome / failed", _triple(j)),
        ("  unknown that completed (recovered)", j["recovered"]),
        ("completed", j["completed"]),
        ("failed as their handler intends", j["failed_as_expected"]),
        ("lost", j["lost"]),
        ("unexpected", j["unexpected"]),
        ("duplicated executions", j["duplicated_executions"]),
        ("  causes", causes or "-"),
        ("duplicated completions", j["duplicated_completions"]),
        ("worker commits", "synchronous" if j["synchronous_commit"] else "asynchronous"),
        ("worker claims", "fused with completions" if j.get("fuse_claims") else "apart"),
        ("workers", "AsyncWorker" if j.get("async_workers") else "Worker"),
        ("replication (failover)", j["replication"] or "-"),
        ("re-executed after a crash or failover", j["reexecuted_after_crash"]),
        (
            "  acknowledged completions a crash or failover took back",
            j["completions_lost_in_crash"],
        ),
        ("LeaseLost rejections", j["lease_lost_rejections"]),
        ("  rejected writes that had committed", j["lease_lost_violations"]),
        ("completions found only in the final read", j["unlogged_completions"]),
        ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(j["faults_injected"].items()))),
        ("recovery after kill", rec),
        ("  per kill (s)", " ".join(_fmt(s) for s in j["recovery_seconds"]) or "-"),
        ("worker exits (crashes)", j["worker_exits"]),
        ("server back -> first claim (s)", _spread(j["back_to_claim"])),
        ("server back -> every worker claims (s)", _spread(j["back_to_claim_every_worker"])),
        ("server back -> first enqueue (s)", _spread(j["back_to_enqueue"])),
        ("leases lapsed unreached (workers' count)", j["worker_stats"].get("leases_lapsed", "-")),
        ("worker reconnects", j["worker_stats"].get("reconnects", "-")),
    ]
    wf = j.get("workflows")
    if wf:
        shapes = ", ".join(f"{k} {n}" for k, n in wf["shapes"].items())
        rows += [
            ("workflows (committed)", f"{wf['workflows']}: {shapes or '-'}"),
            ("  steps / done / runs", f"{wf['steps']} / {wf['steps_done']} / {wf['step_runs']}"),
            ("  children / releases logged", f"{wf['children']} / {_fmt(wf['releases'])}"),
            ("  steps cancelled below a failed one", j["cancelled_as_expected"]),
            (
                "  step re-runs explained / unexplained",
                f"{wf['reruns_explained']} / {wf['reruns_unexplained']}",
            ),
            ("  started before a parent completed", wf["early_starts"]),
            ("  released before a parent completed", wf["early_releases"]),
            ("  least margin, parent done -> child start (s)", wf["min_start_margin"]),
            ("  stranded waiting", wf["stranded_waiting"]),
            ("  released other than once", wf["release_mismatches"]),
        ]
    for phase in ("before", "during", "after", "drain"):
        if phase in j["throughput"]:
            secs = j["phases"].get(phase)
            rows.append((f"throughput {phase} (jobs/s)", f"{j['throughput'][phase]:.1f}"))
            if secs is not None:
                rows[-1] = (rows[-1][0], f"{rows[-1][1]} over {secs:.1f}s")
    order = ("before", "during", "vacuum_with_long_tx", "after", "vacuum_after_long_tx")
    dead = j["dead_tuples"]
    for k in sorted(dead, key=lambda k: order.index(k) if k in order else len(order)):
        rows.append((f"dead tuples {k.replace('_', ' ')}", dead[k]))
    rows.append(("verdict", "VALID" if j["valid"] else "INVALID: " + "; ".join(j["problems"])))
    for name, value in rows:
        table.add_row(name, _fmt(value))
    Console().print(table)


def _spread(xs: list[float | None]) -> str:
    got = sorted(x for x in xs if x is not None)
    if not got:
        return "-"
    return (
        f"{len(got)}/{len(xs)}: min {got[0]:.2f}, median {got[len(got) // 2]:.2f}, "
        f"max {got[-1]:.2f}"
    )


def _triple(j: dict[str, Any]) -> str:
    return f"{j['acknowledged']} / {j['unknown_enqueues']} / {j['failed_enqueues']}"


@click.command()
@click.option("--duration", default=60.0, show_default=True, help="Seconds of load (all phases).")
@click.option("--workers", default=4, show_default=True, help="Worker processes.")
@click.option("--rate", default=100.0, show_default=True, help="Jobs enqueued per second.")
@click.option(
    "--faults",
    "faults",
    default="kill,pause,terminate,proxy",
    show_default=True,
    help=f"Comma-separated, from {','.join(FAULTS)}; or 'all' or 'none'. "
    "restart, crash, exhaust, maxconn and readonly start a scratch cluster; failover a "
    "primary and standby; patroni etcd and two Patroni nodes (apt-get install patroni "
    "etcd-server).",
)
@click.option("--lease", default=2.0, show_default=True, help="Workers' lease in seconds.")
@click.option("--concurrency", default=4, show_default=True, help="Handlers per worker.")
@click.option(
    "--fault-interval",
    default=3.0,
    show_default=True,
    help="Mean seconds between two faults of one kind.",
)
@click.option(
    "--synchronous-commit/--async-commit",
    "synchronous_commit",
    default=None,
    help="Workers' commit mode (default: the Worker's own default).",
)
@click.option(
    "--fuse-claims/--apart-claims",
    "fuse_claims",
    default=None,
    help="Workers complete each batch and claim the slots it frees in one transaction, "
    "or claim apart (default: the Worker's own default).",
)
@click.option(
    "--async-workers",
    is_flag=True,
    help="The worker processes run AsyncWorker (handlers in threads of its loop).",
)
@click.option(
    "--sync-replication/--async-replication",
    "sync_replication",
    default=True,
    show_default=True,
    help="failover: the primary waits for the standby before acknowledging a commit.",
)
@click.option(
    "--restart-every",
    default=None,
    type=float,
    help="Restart the server exactly this often (seconds) instead of at random.",
)
@click.option(
    "--workflows",
    is_flag=True,
    help="Producers also write small workflows (a chain of 3, a diamond, a chord of 5, "
    "now and then a chain whose head fails) through after=, and the checker holds "
    "every step to its parents: none started before they completed, none stranded "
    "waiting, each released once.",
)
@click.option(
    "--workflow-rate",
    default=None,
    type=float,
    help="Workflows written per second, all producers together (implies --workflows; "
    "default: --rate / 20).",
)
@click.option("--seed", default=None, type=int, help="Seed for the fault schedule.")
@click.option(
    "--keep-history",
    default=None,
    metavar="DIR",
    help="Keep the history files (JSON lines) under DIR.",
)
@dsn_option
@json_option
@user_errors
def chaos(
    duration: float,
    workers: int,
    rate: float,
    faults: str,
    lease: float,
    concurrency: int,
    fault_interval: float,
    synchronous_commit: bool | None,
    fuse_claims: bool | None,
    async_workers: bool,
    sync_replication: bool,
    restart_every: float | None,
    workflows: bool,
    workflow_rate: float | None,
    seed: int | None,
    keep_history: str | None,
    dsn: str | None,
    as_json: bool,
) -> None:
    """Run producers, worker processes and faults together, then check the history.

    Exits 1 if a job was lost, seen unexpectedly, completed twice, or run twice for a
    reason other than its worker being killed or paused.  The run uses a scratch schema
    (dropped after) on --dsn or the embedded server.
    """
    cfg = ChaosConfig(
        duration=duration,
        workers=workers,
        rate=rate,
        faults=_faults(faults),
        dsn=dsn,
        lease=lease,
        concurrency=concurrency,
        fault_interval=fault_interval,
        seed=seed,
        keep_history=keep_history,
        synchronous_commit=synchronous_commit,
        restart_every=restart_every,
        sync_replication=sync_replication,
        fuse_claims=fuse_claims,
        async_workers=async_workers,
        # A rate of workflows asks for them.
        workflows=workflows or workflow_rate is not None,
        workflow_rate=workflow_rate,
    )

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(f"chaos: {msg}", err=True)

    # The pool's reconnection chatter is expected here; the report counts what matters.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    report = run_chaos(cfg, progress)
    if as_json:
        echo_json(report.to_json())
    else:
        render(report.to_json())
    if not report.valid:
        sys.exit(1)
