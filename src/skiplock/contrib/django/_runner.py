"""The handler the ``skiplock_worker`` command gives skiplock's Worker: one Django task per job.

Each job names its task by ``module_path``; the handler imports it, checks that it is a
Django task, and calls it with the payload's args and kwargs (and a
TaskContext first when the task takes one).  The return value becomes the job's result;
an exception is left to skiplock's policy (retried until ``max_attempts``, traceback
kept as the job's last error).

Handlers run on the worker's threads, each with its own Django database connections
(Django's are per thread).  Like a request, a job starts and ends with
``close_old_connections()``, so a connection past ``CONN_MAX_AGE`` or broken by the task
is not handed to the next job, and the default (``CONN_MAX_AGE = 0``) closes it.

``django_worker`` builds the Worker the command runs; with tasks listed (``--task``,
OPTIONS ``tasks``) its claims take only their jobs, as ``skiplock.App``'s workers do.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from django.db import close_old_connections
from django.tasks.base import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from skiplock import ConfigError, Fail, Job, Queue, Worker
from skiplock.results import DEFAULT_MAX_RESULT_BYTES, encode_result

from ._backend import SkiplockBackend, load_task

__all__ = ["TaskRunner", "django_worker"]


class TaskRunner:
    """``runner(job)`` runs the Django task a skiplock job names."""

    def __init__(
        self,
        backend: SkiplockBackend,
        tasks: Mapping[str, Task] | None = None,
        *,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> None:
        self.backend = backend
        self.max_result_bytes = max_result_bytes
        # The tasks a restricted worker resolved at its start: no import per first job.
        self._tasks: dict[str, Task] = dict(tasks or {})

    def task(self, path: str) -> Task:
        task = self._tasks.get(path)
        if task is None:
            task = self._tasks[path] = load_task(path, self.backend.alias)
        return task

    def __call__(self, job: Job) -> Any:
        if job.task is None:
            raise Fail(f"job {job.id} names no task: not a Django task's job")
        try:
            task = self.task(job.task)
        except Exception as exc:
            # A deploy that removed the task, or a typo: no attempt will do better.
            raise Fail(str(exc)) from None
        payload = job.payload if isinstance(job.payload, dict) else {}
        args = list(payload.get("args", []))
        kwargs = dict(payload.get("kwargs", {}))
        result = self.backend.result_of(job, task)
        task = result.task  # on this backend, with the job's queue and priority
        sender = type(self.backend)
        close_old_connections()
        try:
            task_started.send(sender=sender, task_result=result)
            if task.takes_context:
                value = task.call(TaskContext(task_result=result), *args, **kwargs)
            else:
                value = task.call(*args, **kwargs)
        except Exception:
            last = job.attempts >= job.max_attempts
            finish(result, TaskResultStatus.FAILED if last else TaskResultStatus.READY)
            task_finished.send(sender=sender, task_result=result)  # logs exc_info
            raise  # skiplock's policy: retried until max_attempts, traceback kept
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and job.cancelled:
                raise  # skiplock's cancel of the job: the worker records it as cancelled
            # SystemExit, KeyboardInterrupt (a handler thread never gets a signal's: this
            # is the task's own): the task asked to stop, so the job ends FAILED now,
            # with the traceback, rather than run exit() again; the worker goes on.
            finish(result, TaskResultStatus.FAILED)
            task_finished.send(sender=sender, task_result=result)
            raise Fail(formatted(exc)) from None
        finally:
            close_old_connections()
        try:
            value = normalize_json(value)
            # What the job's row can hold (jsonb: no NaN, no NUL, the size limit): a
            # value refused there must be reported here, before task_finished says
            # SUCCESSFUL.
            encoded = encode_result(value, self.max_result_bytes)
        except (TypeError, ValueError) as exc:
            # Django's record of it: the TypeError with its traceback, logged at ERROR
            # by task_finished.  No retry: the task's side effects happened.
            finish(result, TaskResultStatus.FAILED)
            task_finished.send(sender=sender, task_result=result)
            raise Fail(formatted(exc)) from None
        finish(result, TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        task_finished.send(sender=sender, task_result=result)
        return encoded  # checked once: the worker stores it as it is


def finish(result: TaskResult, status: TaskResultStatus) -> None:
    """Mark the TaskResult the signals carry: its status, and when it finished."""
    object.__setattr__(result, "status", status)
    if status != TaskResultStatus.READY:
        object.__setattr__(result, "finished_at", datetime.now(UTC))


def formatted(exc: BaseException) -> str:
    """The exception as the job's last error: its traceback, which ends with the line
    that names its class (what the backend's task_error reads back)."""
    return "".join(traceback.format_exception(exc))


def django_worker(
    backend: SkiplockBackend,
    q: Queue,
    *,
    queues: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    **options: Any,
) -> Worker:
    """The skiplock Worker that runs ``backend``'s tasks (``manage.py skiplock_worker``).

    ``queues`` default to the backend's QUEUES and must be among them; when QUEUES is
    empty (Django's "any queue") and none are given, the worker serves the queues the
    database knows now (``known_queues``).  ``tasks`` (dotted paths of tasks or task
    modules) default to OPTIONS ``tasks``; when either lists any, the worker claims only
    those tasks' jobs, so a job of a task this code does not have waits, attempts
    untouched, for a worker that has it.  With neither it claims every job of its
    queues.  ``options`` are ``Worker``'s; ``prefetch`` defaults to 0 here: a claimed
    job starts at once, so RUNNING means that its task runs (a prefetched job would
    show RUNNING, with started_at and an attempt, while it waits for a thread).
    Raises ConfigError for a queue outside QUEUES or a task path that does not load.
    """
    if queues:
        names = list(queues)
    elif backend.queues:
        names = sorted(backend.queues)
    else:
        names = known_queues(q)
    unknown = sorted(set(names) - backend.queues) if backend.queues else []
    if unknown:
        raise ConfigError(f"queue(s) {unknown} are not in TASKS[{backend.alias!r}] QUEUES")
    known = backend.worker_tasks(tasks)
    options.setdefault("prefetch", 0)
    return Worker(
        q,
        TaskRunner(backend, known, max_result_bytes=q.settings.max_result_bytes),
        queues=names,
        tasks=None if known is None else sorted(known),
        **options,
    )


def known_queues(q: Queue) -> list[str]:
    """Every queue the database knows now: Django's default, those holding jobs, those
    with settings (``skiplock queue``).  QUEUES = [] lets tasks use any queue name, but
    a skiplock worker claims from named queues: one first used after the worker
    started is served from its next start (``skiplock status`` lists its jobs as
    waiting for a worker meanwhile)."""
    from django.tasks import DEFAULT_TASK_QUEUE_NAME

    with Queue(q.settings.dsn, schema=q.schema, max_size=1) as probe:
        names = {DEFAULT_TASK_QUEUE_NAME}
        names.update(str(row["queue"]) for row in probe.status())
        names.update(c.name for c in probe.queue_settings())
    return sorted(names)
