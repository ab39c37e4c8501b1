"""The `skiplock` command: parses arguments and calls the library, no logic of its own."""

from __future__ import annotations

import importlib
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from .._errors import ConfigError, PayloadError
from .._queue import Queue
from .common import (
    dsn_option,
    echo_json,
    json_option,
    schema_option,
    user_errors,
)

__all__ = ["main"]


class _Main(click.Group):
    """The core's commands, and the tools' (lab, audit, chaos, demo) imported when named.

    Each tool keeps its command in its own package and builds it on the public API (and
    ``skiplock.cli.common``); importing it only when asked for keeps ``skiplock enqueue``
    from loading pglast or the lab, and lets a tool's module import ``skiplock.cli``
    without an import cycle.
    """

    TOOLS = {
        "cancel": "skiplock.cli._control",
        "jobs": "skiplock.cli._jobs",
        "limit": "skiplock.cli._control",
        "pause": "skiplock.cli._control",
        "result": "skiplock.cli._control",
        "resume": "skiplock.cli._control",
        "retry": "skiplock.cli._jobs",
        "workflow": "skiplock.cli._control",
        "audit": "skiplock.audit._cli",
        "chaos": "skiplock.chaos._cli",
        "dashboard": "skiplock.dashboard._cli",
        "demo": "skiplock.demo._cli",
        "embedded": "skiplock.cli._embedded",
        "race": "skiplock.lab._cli",
        "worker": "skiplock.cli._worker",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.TOOLS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.TOOLS and cmd_name not in self.commands:
            module = importlib.import_module(self.TOOLS[cmd_name])
            self.add_command(getattr(module, cmd_name))
        return super().get_command(ctx, cmd_name)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="skiplock")
@click.pass_context
def main(ctx: click.Context) -> None:
    """skiplock: a PostgreSQL job queue that never hands one job to two workers."""
    from .._embedded import started_here

    before = set(started_here())
    ctx.call_on_close(lambda: _announce_embedded(before))


def _announce_embedded(before: set[Path]) -> None:
    """Say, as the command exits, that an embedded server it started keeps running.

    It is left up on purpose (the next command reuses it in milliseconds instead of
    starting it again), but a process still running after the command that started it
    should not be a surprise: one line says where its data is and how to stop it.
    Only a server this command started: one the process started before (a test run
    calling the command in-process) is not this command's news, and the line would
    land in the middle of its --json output.
    """
    from .._embedded import started_here

    for path in started_here():
        if path in before:
            continue
        click.echo(
            f"skiplock: the embedded PostgreSQL keeps running for the next command "
            f"(data in {path}); stop it with: skiplock embedded stop",
            err=True,
        )


def _queue(dsn: str | None, schema: str, **kwargs: Any) -> Queue:
    from .._config import resolve_dsn
    from .._embedded import embedded_data_dir

    if resolve_dsn(dsn) is None:
        # Say where the data lives: a user who forgot --dsn should notice at once.
        click.echo(
            f"skiplock: no DSN given; using embedded PostgreSQL in {embedded_data_dir()}", err=True
        )
    return Queue(dsn, schema=schema, **kwargs)


@main.command()
@dsn_option
@schema_option
@json_option
@user_errors
def migrate(dsn: str | None, schema: str, as_json: bool) -> None:
    """Create or upgrade the schema (idempotent; safe from many processes at once)."""
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        applied = q.migrate()
        if as_json:
            echo_json({"schema": schema, "applied": applied, "dsn": q.settings.display_dsn})
        elif applied:
            click.echo(f"schema {schema}: applied migrations {', '.join(map(str, applied))}")
        else:
            click.echo(f"schema {schema}: up to date")


def _run_at(delay: float | None, text: str | None) -> datetime | None:
    """--delay or --run-at as an aware time; ConfigError (exit 2) for a bad or naive one.

    A time without a zone is refused rather than guessed: the server would read it in
    its own TimeZone setting and the shell user in theirs, hours apart.  --delay counts
    from this machine's clock.
    """
    if delay is not None and text is not None:
        raise ConfigError("give --delay or --run-at, not both")
    if delay is not None:
        return datetime.now(UTC) + timedelta(seconds=delay)
    if text is None:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--run-at {text!r} is not an ISO 8601 time such as 2030-01-31T09:00:00+01:00"
        ) from None
    if at.tzinfo is None or at.utcoffset() is None:
        raise ConfigError(
            f"--run-at {text!r} has no timezone: add one, as in 2030-01-31T09:00:00Z (UTC) "
            "or 2030-01-31T09:00:00+01:00"
        )
    return at


@main.command()
@click.argument("payload", required=False)
@click.option("--queue", "queue_name", default="default", show_default=True)
@click.option("--priority", default=0, show_default=True, help="Lower runs first.")
@click.option("--max-attempts", default=5, show_default=True)
@click.option(
    "--key",
    "idempotency_key",
    default=None,
    help="Idempotency key: a repeat with the same payload returns the first job's id; "
    "another payload is an error naming that job.",
)
@click.option(
    "--max-payload-bytes",
    default=1 << 20,
    show_default=True,
    help="Refuse payloads larger than this (UTF-8 bytes of the JSON text).",
)
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=None,
    help="Run no earlier than this many seconds from now.",
)
@click.option(
    "--run-at",
    "run_at_text",
    default=None,
    metavar="ISO8601",
    help="Run no earlier than this time, with its timezone "
    "(2030-01-31T09:00:00+01:00, or Z for UTC); a time without one is refused.",
)
@click.option(
    "--file",
    "payload_file",
    type=click.File("r"),
    default=None,
    help="Read JSON lines from a file ('-' for stdin), one job per line.",
)
@dsn_option
@schema_option
@json_option
@user_errors
def enqueue(
    payload: str | None,
    queue_name: str,
    priority: int,
    max_attempts: int,
    idempotency_key: str | None,
    max_payload_bytes: int,
    delay: float | None,
    run_at_text: str | None,
    payload_file: Any,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Enqueue PAYLOAD (a JSON document), or one job per line of --file."""
    if (payload is None) == (payload_file is None):
        raise click.UsageError("give a JSON PAYLOAD argument or --file, not both")
    run_at = _run_at(delay, run_at_text)
    docs: list[Any] = []
    lines = [payload] if payload is not None else [ln for ln in payload_file if ln.strip()]
    for n, line in enumerate(lines, 1):
        try:
            docs.append(json.loads(line))
        except json.JSONDecodeError as exc:
            where = "payload" if payload is not None else f"line {n}"
            raise PayloadError(
                f"{where} is not valid JSON: {exc.msg} at column {exc.colno}"
            ) from None
    with _queue(dsn, schema, min_size=1, max_size=1, max_payload_bytes=max_payload_bytes) as q:
        if len(docs) == 1:
            ids = [
                q.enqueue(
                    docs[0],
                    queue=queue_name,
                    priority=priority,
                    max_attempts=max_attempts,
                    idempotency_key=idempotency_key,
                    run_at=run_at,
                )
            ]
        else:
            if idempotency_key is not None:
                raise click.UsageError("--key applies to a single job")
            ids = q.enqueue_many(
                docs,
                queue=queue_name,
                priority=priority,
                max_attempts=max_attempts,
                run_at=run_at,
            )
    if as_json:
        echo_json({"queue": queue_name, "ids": ids})
    else:
        click.echo("\n".join(map(str, ids)))


@main.command()
@dsn_option
@schema_option
@json_option
@user_errors
def sweep(dsn: str | None, schema: str, as_json: bool) -> None:
    """Return jobs whose lease expired to pending (or failed, when out of attempts), once."""
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        n = q.sweep()
    if as_json:
        echo_json({"swept": n})
    else:
        click.echo(f"swept {n} job(s)")


@main.command()
@click.option(
    "--older-than", default=7 * 86400.0, show_default=True, help="Seconds since the job finished."
)
@click.option(
    "--batch", default=1000, show_default=True, help="Kept for old scripts; days go whole."
)
@dsn_option
@schema_option
@json_option
@user_errors
def prune(older_than: float, batch: int, dsn: str | None, schema: str, as_json: bool) -> None:
    """Drop the days of finished jobs (done, failed, cancelled) older than --older-than."""
    with _queue(dsn, schema, min_size=1, max_size=1) as q:
        n = q.prune(older_than=older_than, limit=batch)
    if as_json:
        echo_json({"deleted": n})
    else:
        click.echo(f"deleted {n} finished job(s)")


@main.command()
@click.option(
    "--attempts-alert",
    default=3,
    show_default=True,
    help="Flag jobs with at least this many attempts.",
)
@click.option(
    "--app",
    "app_path",
    default=None,
    metavar="MODULE:APP",
    help="A skiplock.App: show every cluster its queues live on (--dsn replaces its dsn).",
)
@dsn_option
@schema_option
@json_option
@user_errors
def status(
    attempts_alert: int, app_path: str | None, dsn: str | None, schema: str, as_json: bool
) -> None:
    """Counts per queue and status, oldest pending age, expired leases, high attempts."""
    clusters: list[str | None] = [dsn]
    if app_path is not None:
        from .._handlers import load_object
        from .._tasks import App

        app = load_object(app_path, what="app")
        if not isinstance(app, App):
            raise ConfigError(f"--app {app_path!r} is a {type(app).__name__}, not a skiplock.App")
        source = click.get_current_context().get_parameter_source("schema")
        if source is click.core.ParameterSource.DEFAULT:
            schema = app.schema
        clusters = [dsn if dsn is not None else app.dsn, *app.clusters[1:]]
    shown = []
    for where in clusters:
        with _queue(where, schema, min_size=1, max_size=1) as q:
            rows = q.status(attempts_alert=attempts_alert)
            unserved = q.unserved()
            shown.append((q.settings.display_dsn, rows, unserved))
    if as_json:
        if app_path is None:
            echo_json({"queues": shown[0][1], "unserved": shown[0][2]})
        else:
            echo_json({"clusters": [{"dsn": d, "queues": r, "unserved": u} for d, r, u in shown]})
        return
    for where_shown, rows, unserved in shown:
        on = "" if app_path is None else f" on {where_shown}"
        _print_status(f"skiplock status ({schema}){on}", on, attempts_alert, rows, unserved)


def _print_status(title: str, on: str, attempts_alert: int, rows: Any, unserved: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "queue",
        "status",
        "jobs",
        "oldest pending",
        "expired leases",
        f"attempts >= {attempts_alert}",
    ):
        table.add_column(col, justify="left" if col in ("queue", "status") else "right")
    for r in rows:
        age = r["oldest_pending_seconds"]
        table.add_row(
            r["queue"],
            r["status"],
            str(r["jobs"]),
            f"{float(age):.1f}s" if age is not None else "-",
            str(r["expired_leases"]),
            str(r["high_attempts"]),
        )
    if not rows:
        click.echo(f"no jobs{on}")
        return
    Console().print(table)
    if unserved:
        waiting = Table(title="waiting for a worker that knows the task (not failed, not charged)")
        for col in ("queue", "task", "jobs", "oldest"):
            waiting.add_column(col, justify="right" if col in ("jobs", "oldest") else "left")
        for u in unserved:
            waiting.add_row(u["queue"], u["task"], str(u["jobs"]), f"{u['oldest_seconds']:.1f}s")
        Console().print(waiting)


@main.command()
@click.option("--producer", default=None, help="Producer role [default: <schema>_producer].")
@click.option(
    "--worker", "worker_role", default=None, help="Worker role [default: <schema>_worker]."
)
@click.option("--login", is_flag=True, help="Let the roles log in (otherwise grant them to yours).")
@click.option(
    "--password-env",
    default=None,
    metavar="VAR",
    help="Environment variable holding the password of both roles.",
)
@click.option("--producer-password-env", default=None, metavar="VAR", help="The producer's only.")
@click.option("--worker-password-env", default=None, metavar="VAR", help="The worker's only.")
@click.option("--print-sql", is_flag=True, help="Print the SQL instead of running it (no server).")
@dsn_option
@schema_option
@json_option
@user_errors
def roles(
    producer: str | None,
    worker_role: str | None,
    login: bool,
    password_env: str | None,
    producer_password_env: str | None,
    worker_password_env: str | None,
    print_sql: bool,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Create least-privilege producer and worker roles and grant them (idempotent).

    The producer may only enqueue; the worker may only read and update jobs (claim,
    heartbeat, complete, fail, release, sweep).  Run it as the schema's owner after
    `skiplock migrate`, and again after upgrades.  Passwords are read from environment
    variables, never from the command line, and sent as SCRAM verifiers.
    """
    import os

    from .._roles import default_role_names, ensure_roles, roles_script, validate_role

    default_producer, default_worker = default_role_names(schema)
    names = {
        "producer": validate_role(default_producer if producer is None else producer),
        "worker": validate_role(default_worker if worker_role is None else worker_role),
    }
    sources = {
        "producer": producer_password_env or password_env,
        "worker": worker_password_env or password_env,
    }
    if any(sources.values()) and not login:
        raise click.UsageError("a password is only useful with --login")
    if print_sql:
        with_pw = tuple(names[k] for k, var in sources.items() if var)
        click.echo(
            roles_script(
                schema,
                producer=names["producer"],
                worker=names["worker"],
                login=login,
                password_roles=with_pw,
            ),
            nl=False,
        )
        return
    passwords: dict[str, str] = {}
    for kind, var in sources.items():
        if var:
            value = os.environ.get(var)
            if not value:
                raise ConfigError(f"environment variable {var} (password of the {kind}) is unset")
            passwords[names[kind]] = value
    with _queue(dsn, schema, min_size=1, max_size=1) as q, q.connection() as conn:
        ensure_roles(
            conn,
            schema,
            producer=names["producer"],
            worker=names["worker"],
            login=login,
            passwords=passwords,
        )
    if as_json:
        echo_json(
            {
                "schema": schema,
                "producer": names["producer"],
                "worker": names["worker"],
                "login": login,
                "passwords_set": sorted(passwords),
            }
        )
    else:
        click.echo(
            f"schema {schema}: producer role {names['producer']}, worker role {names['worker']}"
            + (" (login)" if login else " (no login: GRANT them to your login roles)")
        )


@main.command()
@click.option(
    "--grace",
    default=60.0,
    show_default=True,
    help="Seconds past its lease a running job may be before it counts.",
)
@click.option(
    "--attempts-alert",
    default=3,
    show_default=True,
    help="Flag live jobs with at least this many attempts.",
)
@click.option(
    "--lock-waits-alert",
    default=2,
    show_default=True,
    help="Flag this many worker sessions waiting on a lock at once.",
)
@click.option(
    "--samples", default=5, show_default=True, help="pg_stat_activity samples, 0.2s apart."
)
@click.option(
    "--workers",
    "worker_pattern",
    default="skiplock-worker:%",
    show_default=True,
    help="LIKE pattern of the worker sessions' application_name.",
)
@click.option("--audit-table", default=None, metavar="TABLE", help="Your record of side effects.")
@click.option("--key-column", default=None, help="Its column holding the job's key.")
@click.option("--time-column", default="created_at", show_default=True, help="Its timestamp.")
@click.option(
    "--window", default="7d", show_default=True, help="How far back to look (s/m/h/d/w, or all)."
)
@dsn_option
@schema_option
@json_option
@user_errors
def verify(
    grace: float,
    attempts_alert: int,
    lock_waits_alert: int,
    samples: int,
    worker_pattern: str,
    audit_table: str | None,
    key_column: str | None,
    time_column: str,
    window: str,
    dsn: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Check a live database; exit 1 if something is wrong, 0 if clean, 2 on errors.

    Expired leases nobody swept, jobs with many attempts, jobs completed more than once,
    worker sessions waiting on locks (a serialising claim) and, with --audit-table and
    --key-column, keys your audit table recorded twice: the postmortem's checks.
    """
    from .._verify import AuditSpec, parse_window
    from .._verify import verify as run_verify

    if (audit_table is None) != (key_column is None):
        raise click.UsageError("--audit-table and --key-column go together")
    audit = None
    if audit_table is not None and key_column is not None:
        audit = AuditSpec(audit_table, key_column, time_column, parse_window(window))
    with _queue(dsn, schema, min_size=1, max_size=1) as q, q.connection() as conn:
        report = run_verify(
            conn,
            schema,
            dsn_shown=q.settings.display_dsn,
            grace=grace,
            attempts_alert=attempts_alert,
            lock_waits_alert=lock_waits_alert,
            samples=samples,
            workers=worker_pattern,
            audit=audit,
        )
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(report.render())
    sys.exit(report.exit_code)
