"""The handler the ``skiplock_worker`` command gives skiplock's Worker: one Django task per job.

Each job names its task by ``module_path``; the handler imports it, checks that it is a
Django task of this backend, and calls it with the payload's args and kwargs (and a
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

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import close_old_connections
from django.tasks.base import Task, TaskContext, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from skiplock import ConfigError, Fail, Job, Queue, Worker

from ._backend import SkiplockBackend, load_task

__all__ = ["TaskRunner", "django_worker"]


class TaskRunner:
    """``runner(job)`` runs the Django task a skiplock job names."""

    def __init__(self, backend: SkiplockBackend, tasks: Mapping[str, Task] | None = None) -> None:
        self.backend = backend
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
            status = TaskResultStatus.FAILED if last else TaskResultStatus.READY
            object.__setattr__(result, "status", status)
            task_finished.send(sender=sender, task_result=result)  # logs exc_info
            raise
        finally:
            close_old_connections()
        try:
            value = normalize_json(value)
        except (TypeError, ValueError) as exc:
            # The task's side effects happened: running it again would repeat them.
            raise Fail(f"{job.task} returned a value that is not JSON: {exc}") from None
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        task_finished.send(sender=sender, task_result=result)
        return value


def django_worker(
    backend: SkiplockBackend,
    q: Queue,
    *,
    queues: Sequence[str] | None = None,
    tasks: Sequence[str] | None = None,
    **options: Any,
) -> Worker:
    """The skiplock Worker that runs ``backend``'s tasks (``manage.py skiplock_worker``).

    ``queues`` default to the backend's QUEUES and must be among them.  ``tasks``
    (dotted paths of tasks or task modules) default to OPTIONS ``tasks``; when either
    lists any, the worker claims only those tasks' jobs, so a job of a task this
    code does not have waits, attempts untouched, for a worker that has it.  With
    neither it claims every job of its queues.  ``options`` are ``Worker``'s.
    Raises ConfigError for a queue outside QUEUES or a task path that does not load.
    """
    names = list(queues) if queues else sorted(backend.queues)
    unknown = sorted(set(names) - backend.queues) if backend.queues else []
    if unknown:
        raise ConfigError(f"queue(s) {unknown} are not in TASKS[{backend.alias!r}] QUEUES")
    known = backend.worker_tasks(tasks)
    return Worker(
        q,
        TaskRunner(backend, known),
        queues=names,
        tasks=None if known is None else sorted(known),
        **options,
    )
