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
"""

from __future__ import annotations

from typing import Any

from django.db import close_old_connections
from django.tasks.base import Task, TaskContext, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils.json import normalize_json

from skiplock import Fail, Job

from ._backend import SkiplockBackend, load_task

__all__ = ["TaskRunner"]


class TaskRunner:
    """``runner(job)`` runs the Django task a skiplock job names."""

    def __init__(self, backend: SkiplockBackend) -> None:
        self.backend = backend
        self._tasks: dict[str, Task] = {}

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
