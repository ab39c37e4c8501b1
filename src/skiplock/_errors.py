"""Exceptions raised by skiplock; every one derives from SkiplockError."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DatabaseUnavailable",
    "DuplicateJob",
    "Fail",
    "JobCancelled",
    "JobFailed",
    "JobStateError",
    "LeaseLost",
    "PayloadError",
    "Retry",
    "SkiplockError",
    "SoftTimeLimitExceeded",
    "UnknownJob",
    "UnknownQueue",
]


def one_line(exc: BaseException) -> str:
    """An exception's first line, for a log line or a status (its class if it says nothing).

    Not in ``__all__``: the core's modules share it; the public names are the errors.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SkiplockError(Exception):
    """Base class of skiplock's own errors; their message is meant for a user, one line."""


class ConfigError(SkiplockError):
    """A setting is malformed: a DSN, a schema or queue name, a handler path."""


class PayloadError(SkiplockError, ValueError):
    """A payload is not JSON, holds a NUL character, or exceeds the size limit."""


class DatabaseUnavailable(SkiplockError):
    """Postgres could not be reached, or the connection broke and retries ran out."""


class LeaseLost(SkiplockError):
    """A fenced write found no running job holding this lease token.

    The lease ran out and the job was swept or claimed by another worker, or it was
    cancelled.  The write changed nothing.  Whatever the handler did is now a duplicate
    attempt, which is why side effects carry the job's idempotency key.
    """

    def __init__(self, job_ids: list[int], action: str) -> None:
        self.job_ids = job_ids
        self.action = action
        ids = ", ".join(str(i) for i in job_ids)
        super().__init__(f"lease lost: {action} of job {ids} changed nothing")


class UnknownJob(SkiplockError, LookupError):
    """No job has this id (it never existed, or it was pruned)."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"no job with id {job_id}")


class UnknownQueue(ConfigError, LookupError):
    """The queue has neither jobs nor settings: most likely a typo."""

    def __init__(self, queue: str, hint: str = "") -> None:
        self.queue = queue
        # hint: how to make it exist on purpose, where the caller can (limit --create).
        told = f"unknown queue {queue!r}: it has no jobs and no settings"
        super().__init__(f"{told}; {hint}" if hint else told)


class DuplicateJob(SkiplockError):
    """An enqueue's idempotency key is held by another job, and the enqueue may not be
    answered with that job's id: its arguments differ, it has started (a replace came
    too late), or ``on_conflict="raise"``.  Nothing was enqueued.

    ``job_id`` is the job holding the key, ``status`` its status when looked at, and
    ``reason`` one of ``"arguments"``, ``"started"``, ``"exists"``.
    """

    def __init__(self, job_id: int, key: str, queue: str, status: str, reason: str) -> None:
        self.job_id = job_id
        self.key = key
        self.queue = queue
        self.status = status
        self.reason = reason
        held = f"key {key!r} in queue {queue!r} is held by job {job_id} ({status})"
        if reason == "arguments":
            why = (
                "with other arguments; pass on_conflict='replace' to replace them "
                "while it has not started, or use another key"
            )
        elif reason == "started":
            why = "which has started: its arguments can no longer be replaced"
        else:
            why = "and on_conflict='raise'"
        super().__init__(f"{held} {why}")


class JobStateError(SkiplockError):
    """The job is not in a state that allows the operation (cancel a finished job)."""


class JobFailed(SkiplockError):
    """``wait`` found the job ended ``failed``; ``error`` is its last error.  Waiting
    on a workflow, ``job_id`` is the step that failed and ``workflow_id`` is set."""

    workflow_id: int | None = None

    def __init__(self, job_id: int, error: str | None) -> None:
        self.job_id = job_id
        self.error = error
        last = (error or "no error recorded").strip().splitlines()
        super().__init__(f"job {job_id} failed: {last[-1] if last else error}")


class JobCancelled(SkiplockError):
    """``wait`` found the job ended ``cancelled`` (a workflow's step: ``workflow_id``)."""

    workflow_id: int | None = None

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} was cancelled")


class Retry(Exception):
    """Raise from a handler to ask for another attempt after ``delay`` seconds.

    The attempt counts; a job with no attempts left ends ``failed``.  ``raise Retry(5)
    from exc`` (or a Retry raised while handling ``exc``) keeps ``exc`` in the job's
    ``last_error``: "retry requested: ValueError: boom", then its traceback.
    """

    def __init__(self, delay: float = 0.0, reason: str | None = None) -> None:
        self.delay = float(delay)
        self.reason = reason
        super().__init__(reason or f"retry requested in {delay:g}s")


class Fail(Exception):
    """Raise from a handler to end the job as ``failed`` at once, with no retry."""


class SoftTimeLimitExceeded(Exception):
    """Raised inside a task running in a process pool (``pool="process"``) when it
    passes its ``soft_timeout``: catch it to clean up before the hard ``timeout`` kills
    the child.  Left uncaught, the attempt fails (and is retried) with its traceback.
    """
