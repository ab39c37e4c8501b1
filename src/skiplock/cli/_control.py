"""`skiplock cancel | pause | resume | limit | result | workflow`: control of jobs and queues."""

from __future__ import annotations

from typing import Any

import click

from ._main import _queue
from .common import dsn_option, echo_json, json_option, schema_option, user_errors

__all__ = ["cancel", "limit", "pause", "result", "resume", "workflow"]


@click.command()
@click.argument("job_id", type=int)
@dsn_option
@schema_option
@json_option
@user_errors
def cancel(job_id: int, dsn: str | None, schema: str, as_json: bool) -> None:
    """Cancel a job: a pending one at once, a running one at its worker's next heartbeat."""
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        status = q.cancel(job_id)
    if as_json:
        echo_json({"id": job_id, "status": status})
    elif status == "running":
        click.echo(f"job {job_id}: cancel requested; its worker stops it at the next heartbeat")
    else:
        click.echo(f"job {job_id}: cancelled")


def _set_paused(queue_name: str, paused: bool, dsn: str | None, schema: str, as_json: bool) -> None:
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        if paused:
            q.pause(queue_name)
        else:
            q.resume(queue_name)
    if as_json:
        echo_json({"queue": queue_name, "paused": paused})
    else:
        click.echo(f"queue {queue_name}: {'paused' if paused else 'resumed'}")


@click.command()
@click.argument("queue_name", metavar="QUEUE")
@dsn_option
@schema_option
@json_option
@user_errors
def pause(queue_name: str, dsn: str | None, schema: str, as_json: bool) -> None:
    """Stop every worker claiming from QUEUE (running jobs go on); no restart needed."""
    _set_paused(queue_name, True, dsn, schema, as_json)


@click.command()
@click.argument("queue_name", metavar="QUEUE")
@dsn_option
@schema_option
@json_option
@user_errors
def resume(queue_name: str, dsn: str | None, schema: str, as_json: bool) -> None:
    """Let workers claim from QUEUE again."""
    _set_paused(queue_name, False, dsn, schema, as_json)


@click.command()
@click.argument("queue_name", metavar="QUEUE", required=False)
@click.option("--concurrency", type=int, default=None, help="Jobs running at once, all hosts.")
@click.option("--rate", type=float, default=None, help="Jobs started per second.")
@click.option("--burst", type=float, default=None, help="Jobs that may start at once (>= 1).")
@click.option("--clear-concurrency", is_flag=True, help="Remove the concurrency limit.")
@click.option("--clear-rate", is_flag=True, help="Remove the rate limit.")
@click.option("--results/--no-results", default=None, help="Store handlers' return values.")
@click.option(
    "--create",
    is_flag=True,
    help="Set up QUEUE even though it has no jobs or settings yet (else refused: a typo?).",
)
@dsn_option
@schema_option
@json_option
@user_errors
def limit(
    queue_name: str | None,
    concurrency: int | None,
    rate: float | None,
    burst: float | None,
    clear_concurrency: bool,
    clear_rate: bool,
    results: bool | None,
    create: bool,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Set QUEUE's limits (held in Postgres for every worker); no QUEUE: list all settings.

    A QUEUE with no jobs and no settings is refused, as `pause` refuses it, unless
    --create is given: that is how a queue gets its limits before its first job.
    """
    from .._errors import UnknownQueue

    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        if queue_name is None:
            configs = q.queue_settings()
        else:
            try:
                cfg = q.configure_queue(
                    queue_name,
                    concurrency_limit=concurrency,
                    rate_limit=rate,
                    rate_burst=burst,
                    store_results=results,
                    clear_concurrency_limit=clear_concurrency,
                    clear_rate_limit=clear_rate,
                    create=create,
                )
            except UnknownQueue:
                raise UnknownQueue(
                    queue_name, "pass --create to set it up before its first job"
                ) from None
            configs = [cfg]
    rows: list[dict[str, Any]] = [
        {
            "queue": c.name,
            "paused": c.paused,
            "concurrency_limit": c.concurrency_limit,
            "rate_limit": c.rate_limit,
            "rate_burst": c.rate_burst,
            "store_results": c.store_results,
        }
        for c in configs
    ]
    if as_json:
        echo_json({"queues": rows})
        return
    if not rows:
        click.echo("no queue has settings: all run, unlimited, results kept")
    for r in rows:
        click.echo(
            f"{r['queue']}: {'paused' if r['paused'] else 'running'}, "
            f"concurrency {r['concurrency_limit'] or 'unlimited'}, "
            f"rate {r['rate_limit'] or 'unlimited'}"
            + (f"/s (burst {r['rate_burst']:g})" if r["rate_burst"] else "")
            + f", results {'kept' if r['store_results'] else 'dropped'}"
        )


@click.command()
@click.argument("job_id", type=int)
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for it to finish.")
@click.option("--timeout", type=float, default=None, help="Seconds to wait (default: forever).")
@dsn_option
@schema_option
@user_errors
def result(job_id: int, wait: bool, timeout: float | None, dsn: str | None, schema: str) -> None:
    """Print a job's result as JSON (exit 1 if it failed or was cancelled, 3 on timeout)."""
    from .._errors import JobCancelled, JobFailed, UnknownJob

    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        try:
            if wait:
                value = q.wait(job_id, timeout=timeout)
            else:
                job = q.get(job_id)
                if job is None:
                    raise UnknownJob(job_id)
                if job.status != "done":
                    click.echo(f"skiplock: job {job_id} is {job.status}", err=True)
                    raise SystemExit(1 if job.status in ("failed", "cancelled") else 3)
                value = job.result
        except (JobFailed, JobCancelled) as exc:
            click.echo(f"skiplock: {exc}", err=True)
            raise SystemExit(1) from None
        except TimeoutError as exc:
            click.echo(f"skiplock: {exc}", err=True)
            raise SystemExit(3) from None
    echo_json(value)


@click.command()
@click.argument("workflow_id", type=int)
@dsn_option
@schema_option
@json_option
@user_errors
def workflow(workflow_id: int, dsn: str | None, schema: str, as_json: bool) -> None:
    """Show a workflow's steps (a chain, group or chord of tasks) and their states."""
    from .._errors import UnknownJob

    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        wf = q.workflow(workflow_id)
    if wf is None:
        err = UnknownJob(workflow_id)
        err.args = (f"no workflow with id {workflow_id} (a workflow's id is its first job's)",)
        raise err
    if as_json:
        echo_json(wf)
        return
    counts: dict[str, int] = {}
    for step in wf["steps"]:
        status = step["status"] or "pruned"
        counts[status] = counts.get(status, 0) + 1
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    click.echo(f"workflow {wf['id']}: {len(wf['steps'])} steps ({summary})")
    for n, step in enumerate(wf["steps"], 1):
        error = (step["last_error"] or "").strip().splitlines()
        tail = f"  {error[-1][:100]}" if error else ""
        click.echo(
            f"{n:>4}  job {step['id']:<10} {step['task'] or '-'!s:<30} "
            f"{step['status'] or 'pruned'!s:<9} attempts {step['attempts'] or 0}/"
            f"{step['max_attempts'] or '-'}{tail}"
        )
    click.echo(f"output: {_ids(wf['output'])}")


def _ids(output: Any) -> str:
    """A workflow's output as job ids: 17, or [17, 18, [19, 20]]."""
    if isinstance(output, list):
        return "[" + ", ".join(_ids(o) for o in output) + "]"
    return f"job {output}" if not isinstance(output, list) else str(output)
