"""``python manage.py skiplock_worker``: run the Django tasks enqueued on skiplock.

Runs until SIGTERM or SIGINT: the first stops claiming and gives running tasks the
shutdown grace to finish (unstarted jobs go back at once, attempt returned) and exits
0; a second exits at once, and the jobs still held run again when their lease ends.

``--task`` (or the backend's OPTIONS ``tasks``) limits the claims to the tasks listed,
so a worker on old code in a rolling deploy leaves a new task's jobs alone.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser

from skiplock import Queue, SkiplockError

from ..._backend import SkiplockBackend, in_django, schema_problem
from ..._commands import skiplock_backend
from ..._runner import django_worker

logger = logging.getLogger("skiplock.worker")


class Command(BaseCommand):  # type: ignore[misc]  # django is untyped
    help = "Run Django tasks enqueued on skiplock until SIGTERM/SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="Q",
            help="A queue to serve (repeat it); default: the backend's QUEUES.",
        )
        parser.add_argument(
            "--task",
            action="append",
            dest="tasks",
            metavar="PATH",
            help="A task (app.tasks.send) or module of tasks (app.tasks) to run, and "
            "claim only those (repeat it); default: OPTIONS 'tasks', else every task.",
        )
        parser.add_argument("--concurrency", type=int, default=4, help="Tasks at once [4].")
        parser.add_argument(
            "--lease",
            type=float,
            default=30.0,
            help="Seconds a claim lasts without a heartbeat [30]; heartbeats every lease/3.",
        )
        parser.add_argument(
            "--job-timeout", type=float, default=None, help="Seconds a task may run."
        )
        parser.add_argument(
            "--shutdown-grace",
            type=float,
            default=30.0,
            help="Seconds running tasks get to finish at a stop [30].",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=0,
            help="Jobs claimed ahead of a free thread [0]. A prefetched job reads RUNNING "
            "(attempt counted) before its task starts; more throughput for short tasks.",
        )
        parser.add_argument("--name", default=None, help="The worker's name (host-pid).")
        parser.add_argument("--backend", default=None, help="The TASKS alias (default: the one).")
        parser.add_argument(
            "--health-port",
            type=int,
            default=None,
            help="Serve GET /livez and /readyz on this port (0: any free one; docs/deploy.md).",
        )
        parser.add_argument(
            "--health-host",
            default="127.0.0.1",
            help="Address for --health-port [127.0.0.1]; 0.0.0.0 in a container.",
        )
        parser.add_argument(
            "--health-stall",
            type=float,
            default=60.0,
            help="Seconds a loop may spend in one step before /livez fails [60].",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        log_to_stderr(logging.DEBUG if options["verbosity"] > 1 else logging.INFO)
        backend = skiplock_backend(options["backend"])
        grace = options["shutdown_grace"]
        # The worker takes its settings from the Queue and opens its own connections:
        # unopened, a queue or task path that is wrong is refused before any connect.
        q = Queue(
            backend.worker_dsn(),
            schema=backend.schema,
            application_name=f"skiplock-django:{backend.alias}",
            open=False,
        )
        try:
            worker = django_worker(
                backend,
                q,
                queues=options["queues"],
                tasks=options["tasks"],
                concurrency=options["concurrency"],
                lease=options["lease"],
                job_timeout=options["job_timeout"],
                shutdown_grace=grace,
                name=options["name"],
                prefetch=options["prefetch"],
                health_port=options["health_port"],
                health_host=options["health_host"],
                health_stall=options["health_stall"],
            )
            ready_or_stop(backend)  # after the checks that need no connection
            if worker.tasks is not None:
                logger.info("worker %s: claims only tasks %s", worker.name, ",".join(worker.tasks))
            worker.handle_signals("tasks")
            worker.run()
        except SkiplockError as exc:
            raise CommandError(in_django(str(exc))) from None
        finally:
            q.close()


def ready_or_stop(backend: SkiplockBackend) -> None:
    """Stop the command, with what to run, if the schema is missing or behind: claims
    on it would fail, and be retried, for as long as the worker runs."""
    try:
        with psycopg.connect(backend.worker_dsn(), autocommit=True, connect_timeout=10) as conn:
            problem = schema_problem(conn, backend.schema, latest=True)
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CommandError(f"task backend {backend.alias!r}: cannot connect: {first}") from None
    if problem is not None:
        raise CommandError(f"task backend {backend.alias!r}: {problem}")


class PrintedElsewhere(logging.Filter):
    """Drops a record that a console handler on its way to the root already prints:
    with DEBUG = True, Django's own LOGGING prints django.* records (django.tasks'
    lines) on its "console" handler, and the root's would print each a second time."""

    def filter(self, record: logging.LogRecord) -> bool:
        node: logging.Logger | None = logging.getLogger(record.name)
        while node is not None and node is not logging.root:
            for h in node.handlers:
                if (
                    type(h) is logging.StreamHandler
                    and h.stream in (sys.stderr, sys.stdout)
                    and record.levelno >= h.level
                    and h.filter(record)
                ):
                    return False
            node = node.parent if node.propagate else None
        return True


def log_to_stderr(level: int) -> None:
    """Worker and task log lines on stderr, unless the project's LOGGING already gives
    the root logger handlers (then its configuration decides)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(PrintedElsewhere())
    root.addHandler(handler)
    root.setLevel(level)
