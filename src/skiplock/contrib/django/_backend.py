"""SkiplockBackend: Django's Tasks framework (``django.tasks``) on skiplock's jobs table.

Enqueue writes one skiplock job on Django's own psycopg 3 connection, so the job joins
whatever transaction that connection is in: inside ``transaction.atomic()`` it commits
or rolls back with the request's other writes, and no second connection is opened.
Results are read back on the same connection.  The ``skiplock_worker`` management
command runs the jobs (see ``_runner``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from importlib import import_module
from types import ModuleType
from typing import Any

import psycopg
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import Task, TaskError, TaskResult, TaskResultStatus
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone
from django.utils.json import normalize_json
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import JsonbLoader, JsonLoader

from skiplock import ConfigError, Job, PayloadError, Queue
from skiplock.schema import validate_schema
from skiplock.sqlfiles import statements

__all__ = [
    "DEFAULT_OPTIONS",
    "MIGRATE",
    "SkiplockBackend",
    "TaskArgumentsError",
    "from_skiplock_priority",
    "resolve_tasks",
    "task_error",
    "to_skiplock_priority",
]

DEFAULT_OPTIONS: Mapping[str, Any] = {
    "schema": "skiplock",
    "database": "default",
    "max_attempts": 5,
    "dsn": None,
    "tasks": None,
}

# skiplock's statuses as Django's.  A pending job after a failed attempt is READY:
# "ready to be executed again".  Django has no cancelled status; a cancelled job did not
# succeed, so it is FAILED, with a skiplock.JobCancelled error.
STATUS: Mapping[str, TaskResultStatus] = {
    "pending": TaskResultStatus.READY,
    "throttled": TaskResultStatus.READY,  # waiting for its concurrency key's slot
    "running": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def to_skiplock_priority(priority: int) -> int:
    """Django's priority (-100..100, higher runs first) as skiplock's (lower runs first).

    The negation: Django 100 is skiplock -100, Django 0 is skiplock 0 (skiplock's
    default, so Django jobs and plain skiplock jobs of priority 0 interleave by run_at).
    """
    return -int(priority)


def from_skiplock_priority(priority: int) -> int:
    return -int(priority)


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def task_error(last_error: str) -> TaskError:
    """A Django TaskError from a skiplock job's ``last_error``.

    A handler's exception is stored as its formatted traceback; the line after the last
    ``Traceback`` header's frames names the exception (``module.Class: message``,
    builtins without a module).  Anything else (a Retry's reason, a timeout, a result
    that could not be stored) is reported as ``skiplock.JobFailed``.
    """
    lines = last_error.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if headers:
        for line in lines[headers[-1] + 1 :]:
            if line and not line[0].isspace():
                m = _EXCEPTION_LINE.match(line)
                if m:
                    path = m.group(1)
                    return TaskError(
                        exception_class_path=path if "." in path else f"builtins.{path}",
                        traceback=last_error,
                    )
                break
    if last_error.startswith("timed out after"):
        return TaskError(exception_class_path="builtins.TimeoutError", traceback=last_error)
    return TaskError(exception_class_path="skiplock.JobFailed", traceback=last_error)


MIGRATE = "`python manage.py skiplock_migrate`"


def in_django(message: str) -> str:
    """A skiplock message with the advice a Django user can follow: skiplock's own
    errors say `skiplock migrate`, which needs a DSN the project already has."""
    return message.replace("`skiplock migrate`", MIGRATE)


def schema_problem(conn: psycopg.Connection[Any], schema: str, *, latest: bool) -> str | None:
    """Why ``schema`` cannot serve yet, or None: not created, or (``latest``) behind
    this skiplock's migrations.  Reads only the catalog and the migrations table, so
    inside ``atomic()`` it never aborts the caller's transaction."""
    from skiplock.schema import latest_migration, schema_version

    have = schema_version(conn, schema)
    want = latest_migration()
    if have == 0:
        return f"skiplock schema {schema!r} is missing or not migrated; run {MIGRATE}"
    if latest and have < want:
        return (
            f"skiplock schema {schema!r} is at migration {have}, this skiplock needs {want}; "
            f"run {MIGRATE}"
        )
    return None


def database_dsn(alias: str) -> str:
    """A libpq connection string for Django database ``alias`` (the worker's own)."""
    params = connections[alias].get_connection_params()
    kept = {
        k: v
        for k, v in params.items()
        if isinstance(v, str | int) and not isinstance(v, bool) and k != "client_encoding"
    }
    return make_conninfo("", **kept)


class TaskArgumentsError(PayloadError, TypeError):
    """A task's arguments cannot be stored as JSON.

    Django's contract for ``enqueue`` is a TypeError ("Unsupported type", as
    ``normalize_json`` raises); skiplock's is PayloadError (a ValueError).  This is both,
    so a caller written against either catches it.  It lives here, not in skiplock's
    core: making every PayloadError a TypeError would change what a plain skiplock
    caller's ``except TypeError`` catches for a contract that is Django's only.
    """


class SkiplockBackend(BaseTaskBackend):  # type: ignore[misc]  # django is untyped
    """Django Tasks on skiplock.

    ``TASKS = {"default": {"BACKEND": "skiplock.contrib.django.SkiplockBackend",
    "QUEUES": [...], "OPTIONS": {...}}}``; OPTIONS (all optional):

    ``schema``
        The Postgres schema of skiplock's tables (default ``"skiplock"``); create it
        with ``python manage.py skiplock_migrate`` or ``skiplock migrate``.
    ``database``
        The ``DATABASES`` alias jobs are written on (default ``"default"``): it must
        be PostgreSQL through psycopg 3.  Enqueues join its transaction.
    ``max_attempts``
        Attempts per job before it ends FAILED (default 5; 1: never retried).
    ``dsn``
        The worker's connection string; default: built from the database's settings.
    ``tasks``
        Dotted paths of the tasks the worker runs: a task (``"app.tasks.send"``) or a
        module, standing for the tasks of this backend it holds (``"app.tasks"``).
        The worker claims only those, so during a rolling deploy a worker on old code
        leaves a new task's job pending for one that has it.  Default None: every
        job of the worker's queues (Django keeps no registry of tasks to list them).
    """

    supports_defer = True  # run_after -> the job's run_at
    supports_async_task = True  # async def tasks run in the worker (async_to_sync)
    supports_get_result = True  # any process: the job row holds status and result
    supports_priority = True  # mapped onto skiplock's claim order

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = set(self.options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']: unknown option(s) {sorted(unknown)}; "
                f"skiplock takes {sorted(DEFAULT_OPTIONS)}"
            )
        opts = {**DEFAULT_OPTIONS, **self.options}
        self.schema: str = opts["schema"]
        self.database: str = opts["database"]
        self.max_attempts: int = opts["max_attempts"]
        self.dsn: str | None = opts["dsn"]
        self.task_paths: Sequence[str] | None = opts["tasks"]
        self._queue: Queue | None = None
        self._schema_seen = False  # schema_problem() found none on this connection

    # -- configuration -------------------------------------------------------------------

    def setting(self, key: str) -> str:
        """The setting an OPTIONS error names, as the user wrote it."""
        return f"TASKS[{self.alias!r}]['OPTIONS'][{key!r}]"

    def options_problem(self) -> str | None:
        """Why ``schema`` or ``max_attempts`` cannot be used, naming the setting, or None."""
        try:
            validate_schema(self.schema)
        except ConfigError as exc:
            return f"{self.setting('schema')}: {exc}"
        ma = self.max_attempts
        if type(ma) is not int or ma < 1:
            return f"{self.setting('max_attempts')} must be a positive integer, not {ma!r}"
        return None

    def database_problem(self) -> str | None:
        """Why the configured database cannot hold jobs, or None."""
        if self.database not in settings.DATABASES:
            return f"DATABASES has no alias {self.database!r}"
        conn = connections[self.database]
        if conn.vendor != "postgresql":
            return (
                f"DATABASES[{self.database!r}] is {conn.vendor}; "
                "skiplock needs PostgreSQL (ENGINE django.db.backends.postgresql)"
            )
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            return f"DATABASES[{self.database!r}] runs on psycopg2; skiplock needs psycopg 3"
        return None

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        problems: list[checks.CheckMessage] = list(super().check(**kwargs))
        problem = self.database_problem()
        if problem is not None:
            problems.append(
                checks.Error(
                    f"Task backend {self.alias!r}: {problem}.",
                    hint="Point TASKS[...]['OPTIONS']['database'] at a PostgreSQL alias.",
                    obj=type(self).__qualname__,
                    id="skiplock.E001",
                )
            )
        problem = self.options_problem()
        if problem is not None:
            problems.append(checks.Error(f"{problem}.", id="skiplock.E002"))
        problem = task_paths_problem(self.task_paths)
        if problem is not None:
            problems.append(
                checks.Error(
                    f"{self.setting('tasks')} {problem}.",
                    hint="List dotted paths of tasks or task modules, or leave 'tasks' "
                    "out to run every task.",
                    id="skiplock.E003",
                )
            )
        return problems

    def worker_tasks(self, paths: Sequence[str] | None = None) -> dict[str, Task] | None:
        """The tasks a worker of this backend runs, by the name jobs carry (their
        ``module_path``): those of ``paths``, else of OPTIONS ``tasks``; None (every
        task) when neither lists any.  Each path is imported now, so a worker whose code
        lacks one stops at its start rather than leave that task's jobs to wait unseen.
        """
        where = "--task"
        if paths is None:
            paths, where = self.task_paths, self.setting("tasks")
        if paths is None:
            return None
        problem = task_paths_problem(paths)
        if problem is not None:
            raise ConfigError(f"{where} {problem}")
        try:
            return resolve_tasks(paths, self.alias)
        except NotATask as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def worker_dsn(self) -> str:
        return self.dsn if self.dsn is not None else database_dsn(self.database)

    def queue(self) -> Queue:
        """The skiplock Queue that builds this backend's statements (never opened: every
        statement runs on Django's connection)."""
        if self._queue is None:
            self._queue = Queue(
                self.worker_dsn(),
                schema=self.schema,
                application_name=f"skiplock-django:{self.alias}",
                open=False,
            )
        return self._queue

    def _connection(self) -> psycopg.Connection[Any]:
        problem = self.options_problem()
        if problem is not None:
            raise ImproperlyConfigured(problem)
        problem = self.database_problem()
        if problem is not None:
            raise ImproperlyConfigured(f"task backend {self.alias!r}: {problem}")
        wrapper = connections[self.database]
        # Django's own guard: after an error inside atomic() (caught, the block going
        # on) its transaction can only roll back; say so, as the ORM would.
        wrapper.validate_no_broken_transaction()
        wrapper.ensure_connection()
        conn: psycopg.Connection[Any] = wrapper.connection
        if not self._schema_seen:
            # Once per backend (Django makes one per thread): before migrating, a
            # statement on a missing table would abort the caller's atomic() block.
            problem = schema_problem(conn, self.schema, latest=False)
            if problem is not None:
                raise ConfigError(f"task backend {self.alias!r}: {problem}")
            self._schema_seen = True
        return conn

    # -- producers -----------------------------------------------------------------------

    def enqueue(self, task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> TaskResult:
        self.validate_task(task)
        try:
            norm_args = normalize_json(list(args))
            norm_kwargs = normalize_json(dict(kwargs))
        except (TypeError, ValueError) as exc:
            raise TaskArgumentsError(
                f"{task.module_path}: arguments must be JSON-serialisable ({exc}); "
                "pass ids and plain values, not objects"
            ) from None
        payload: dict[str, Any] = {"args": norm_args, "kwargs": norm_kwargs}
        if task.run_after is not None:
            # The job's run_at moves with each retry; the task's run_after is what the
            # caller asked for, and get_result() gives the task back as it was enqueued.
            payload["run_after"] = task.run_after.isoformat()
        conn = self._connection()
        try:
            job_id = self.queue().enqueue(
                payload,
                queue=task.queue_name,
                priority=to_skiplock_priority(task.priority),
                run_at=_aware(task.run_after),
                max_attempts=self.max_attempts,
                conn=conn,
                task=task.module_path,
            )
        except PayloadError as exc:  # NaN, a NUL character, the size limit
            raise TaskArgumentsError(f"{task.module_path}: {exc}") from None
        job = self.get_job(job_id)
        assert job is not None  # just inserted on this connection
        result = TaskResult(
            task=task,
            id=str(job_id),
            status=TaskResultStatus.READY,
            # The row's own time, so that refresh() and get_result() agree with it.
            enqueued_at=job.created_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=norm_args,
            kwargs=norm_kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    # -- results -------------------------------------------------------------------------

    def get_job(self, job_id: int) -> Job | None:
        """The job's row, read on Django's connection (so inside ``atomic()`` it sees
        the transaction's own enqueues)."""
        conn = self._connection()
        with conn.cursor(row_factory=dict_row) as cur:
            # Django loads jsonb as text on its connections; this cursor parses it.
            cur.adapters.register_loader("jsonb", JsonbLoader)
            cur.adapters.register_loader("json", JsonLoader)
            cur.execute(statements(self.schema).get, {"id": job_id})
            row = cur.fetchone()
        return None if row is None else Job.from_row(row)

    def get_result(self, result_id: str) -> TaskResult:
        try:
            job_id = int(result_id)
        except (TypeError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        if not 0 < job_id < 2**63:
            raise TaskResultDoesNotExist(result_id)
        job = self.get_job(job_id)
        if job is None or job.task is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            return self.result_of(job)
        except NotATask as exc:
            # A deploy removed the task (or its module no longer imports): there is
            # no Task to describe the job with.  Its row is still there for skiplock's
            # own tools (skiplock status, the dashboard, Queue.get).
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from None

    def result_of(self, job: Job, task: Task | None = None) -> TaskResult:
        """The TaskResult a job's row describes (``task``: the job's task, already
        loaded; else it is imported by the name the job carries)."""
        if task is None:
            task = load_task(job.task or "", self.alias)
        payload = job.payload if isinstance(job.payload, dict) else {}
        run_after = payload.get("run_after")
        # The task as it was enqueued: on this backend (Task.using(backend=...) may
        # have sent a task declared for another alias here), with the job's priority
        # and queue, and the run_after it was given, if any (not the row's run_at,
        # which a retry moves).  A queue since dropped from QUEUES fails validation:
        # the task is then kept as declared.
        with suppress(InvalidTask):
            task = task.using(
                priority=from_skiplock_priority(job.priority),
                queue_name=job.queue,
                run_after=datetime.fromisoformat(run_after) if isinstance(run_after, str) else None,
                backend=self.alias,
            )
        errors: list[TaskError] = []
        if job.status == "cancelled":
            errors.append(
                TaskError(
                    exception_class_path="skiplock.JobCancelled",
                    traceback=job.last_error or "cancelled",
                )
            )
        elif job.last_error:
            errors.append(task_error(job.last_error))
        result = TaskResult(
            task=task,
            id=str(job.id),
            status=STATUS[job.status],
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            # skiplock keeps the count of attempts and the last worker's name; Django
            # counts attempts as len(worker_ids).
            worker_ids=[job.worker or ""] * job.attempts,
        )
        if job.status == "done":
            object.__setattr__(result, "_return_value", job.result)
        return result


class NotATask(InvalidTask):  # type: ignore[misc]
    """A job names something that is not a Django task of this backend."""


_DOTTED = re.compile(r"(?!\d)\w+(?:\.(?!\d)\w+)*")


def task_paths_problem(paths: object) -> str | None:
    """Why ``paths`` is not a list of dotted paths, or None.  A bare string is refused:
    read as a sequence it would be one path per character."""
    if paths is None:
        return None
    if isinstance(paths, str) or not isinstance(paths, Sequence):
        return f"must be a list of dotted paths, not {paths!r}"
    if not paths:
        return "is empty: such a worker could run nothing"
    bad = [p for p in paths if not isinstance(p, str) or not _DOTTED.fullmatch(p)]
    if bad:
        return f"holds {bad!r}, not dotted paths"
    return None


def resolve_tasks(paths: Sequence[str], alias: str) -> dict[str, Task]:
    """The Django Tasks at ``paths`` that backend ``alias`` runs, by ``module_path``.

    A path names a task, or a module standing for every task it holds (its own or
    imported, declared for any backend: ``Task.using(backend=...)`` moves them), so a
    worker that lists modules runs what its code defines and no more.  A path that does
    not import, or names no task, raises NotATask: a typo would otherwise leave that
    task's jobs pending with nobody told.
    """
    found: dict[str, Task] = {}
    for path in paths:
        module = _module(path)
        if module is None:
            task = load_task(path, alias)
            found[task.module_path] = task
            continue
        # Every task it holds, whatever its declared backend: Task.using(backend=...)
        # can send any of them here.
        held = [v for v in vars(module).values() if isinstance(v, Task)]
        if not held:
            raise NotATask(f"module {path!r} holds no django.tasks Task")
        for task in held:
            found[task.module_path] = task
    return found


def _module(path: str) -> ModuleType | None:
    """The module at ``path``, or None when ``path`` itself is no module (maybe an
    attribute of one).  An import error inside the module is raised as NotATask."""
    try:
        return import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name == path:
            return None
        raise NotATask(f"cannot import {path!r}: {exc}") from None
    except ImportError as exc:
        raise NotATask(f"cannot import {path!r}: {exc}") from None


def load_task(path: str, alias: str) -> Task:
    """The Django Task at ``path`` (its ``module_path``).

    A task is declared for one backend but ``Task.using(backend=...)`` sends it to any:
    a job in this backend's schema was enqueued through it (or an alias sharing the
    schema), so the task runs here whatever its declared backend.  ``alias`` names the
    backend in the errors.
    """
    from django.utils.module_loading import import_string

    try:
        obj = import_string(path)
    except ImportError as exc:
        raise NotATask(f"cannot import task {path!r} (backend {alias!r}): {exc}") from None
    if not isinstance(obj, Task):
        raise NotATask(f"{path!r} is {type(obj).__name__}, not a django.tasks Task")
    return obj


def _aware(run_after: datetime | None) -> datetime | None:
    """A task's run_after as skiplock takes it: aware.  Django refuses a naive one
    under USE_TZ; without it a naive time is meant in TIME_ZONE, as Django reads it,
    while skiplock refuses naive times rather than guess their zone."""
    if run_after is None or timezone.is_aware(run_after):
        return run_after
    aware: datetime = timezone.make_aware(run_after, timezone.get_default_timezone())
    return aware
