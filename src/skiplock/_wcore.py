"""What every part of a worker reads: its identity, settings, counters and hooks.

A worker is one class composed of parts, each a module by responsibility: the claim
chain (``_wclaims``), handler outcomes and their writes (``_woutcomes``), the heartbeat
(``_wheartbeat``), liveness (``_wliveness``), upkeep (``_wupkeep``) and shutdown
(``_wshutdown``), put together with the arguments' checks in ``WorkerBase``.  Each
part decides; ``Worker`` (threads) and ``AsyncWorker`` (tasks) only wait and send the
queue's statements.  ``WorkerCore`` is the state the parts share, declared once so
that each part type-checks alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from ._control import error_line
from ._errors import SkiplockError, one_line
from ._job import Job

if TYPE_CHECKING:
    from ._base import QueueSettings
    from ._handlers import Handler

__all__ = [
    "Event",
    "Measure",
    "Trouble",
    "WorkerCore",
    "WorkerStats",
    "default_worker_name",
    "error_summary",
    "log_job",
    "one_line",
]

logger = logging.getLogger("skiplock.worker")

Event = Callable[[str, Job], None]
Measure = Callable[[str, float, str | None], None]


@dataclass
class WorkerStats:
    """Counters of one worker's life; read them while it runs or after."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    released: int = 0
    timed_out: int = 0
    lease_lost: int = 0
    heartbeats: int = 0
    # Held jobs whose lease ended before a heartbeat reached the server (an outage
    # longer than what was left of the lease): their outcome may then be refused.
    leases_lapsed: int = 0
    sweeps_recovered: int = 0
    db_errors: int = 0
    # Handlers still running when the shutdown grace ended: their outcomes are never
    # written, so those jobs run again once their leases run out.
    abandoned: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def error_summary(error: str | None) -> str | None:
    """The line of a handler's error text a log line has room for (``error_line``)."""
    return error_line(error)


def _seconds(delay: float) -> str:
    return f"{delay:.2g}s" if delay < 10 else f"{delay:.0f}s"


def log_job(
    worker: str,
    level: int,
    event: str,
    job: Job,
    text: str,
    *,
    error: str | None = None,
    delay: float | None = None,
) -> None:
    """Log one line about one attempt of a job, the same from both workers.

    The fields go on the record too (``extra``), so a JSON formatter can emit them
    without parsing the message.  The error's full text (a traceback) goes only to a
    second line at DEBUG: at WARNING and ERROR a line per failed attempt must stay one
    line, or a failing queue buries everything else in the log.
    """
    task = job.task  # the task layer's name for the job; None for handler-per-queue
    where = f"queue {job.queue}, task {task}" if task else f"queue {job.queue}"
    fields: dict[str, object] = {
        "worker": worker,
        "event": event,
        "job_id": job.id,
        "queue": job.queue,
        "task": task,
        "attempt": job.attempts,
        "max_attempts": job.max_attempts,
        "error": error_summary(error),
    }
    if delay is not None:
        fields["delay"] = round(delay, 3)
    logger.log(
        level,
        "worker %s: job %d (%s) attempt %d/%d %s",
        worker,
        job.id,
        where,
        job.attempts,
        job.max_attempts,
        text,
        extra=fields,
    )
    if error and "\n" in error.strip() and logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "worker %s: job %d attempt %d/%d error:\n%s",
            worker,
            job.id,
            job.attempts,
            job.max_attempts,
            error,
            extra={**fields, "event": "traceback"},
        )


class Trouble:
    """The log of one activity that keeps failing (claims, writes, heartbeats): a line
    when it starts failing or the reason changes, one when it works again; never a
    line per attempt, however long the outage (a read-only or full server)."""

    def __init__(self, worker: str, what: str) -> None:
        self.worker, self.what = worker, what
        self.failures = 0
        self._since = 0.0
        self._kind = ""

    def failed(self, exc: BaseException, retry: str = "backing off") -> int:
        """Count a failure (log it if it is news); returns the failures in a row."""
        self.failures += 1
        # The class says why, except for skiplock's own wrapper: then its cause does.
        cause = exc.__cause__ if isinstance(exc, SkiplockError) and exc.__cause__ else exc
        kind = type(cause).__name__
        if self.failures == 1 or kind != self._kind:
            if self.failures == 1:
                self._since = time.monotonic()
            logger.warning(
                "worker %s: %s failed (%s); %s, logged again when it works",
                self.worker,
                self.what,
                one_line(exc),
                retry,
            )
        self._kind = kind
        return self.failures

    def ok(self) -> None:
        if self.failures:
            logger.warning(
                "worker %s: %s works again after %d failure(s) over %.1fs",
                self.worker,
                self.what,
                self.failures,
                time.monotonic() - self._since,
            )
            self.failures, self._kind = 0, ""


class WorkerCore:
    """The state every part of a worker reads, set by ``WorkerBase.__init__``, and the
    few calls one part makes of another (defined by that part)."""

    name: str
    queues: list[str]
    tasks: list[str] | None  # the tasks it claims (None: every job of its queues)
    concurrency: int
    lease: float
    fuse_claims: bool  # a writer claims the slots its completions free, in their transaction
    stats: WorkerStats
    _handlers: dict[str, Handler]
    _settings: QueueSettings  # the queue's, with the worker's connection settings
    _on_event: Event | None
    _on_measure: Measure | None
    # Guards the attempts logged or to be logged (outcomes, heartbeats): in Worker,
    # the writers and the heartbeat thread read and write them.
    _log_lock: threading.Lock
    _more: bool  # the last claim of any chain came back full: more work may wait

    def _emit(self, event: str, job: Job) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event, job)
        except Exception:
            logger.exception("on_event hook failed for %s of job %s", event, job.id)

    def _measure(self, name: str, value: float, queue: str | None) -> None:
        if self._on_measure is None:
            return
        try:
            self._on_measure(name, value, queue)
        except Exception:
            logger.exception("on_measure hook failed for %s", name)

    def _upkeep_failed(self, what: str, exc: BaseException) -> None:
        # A sweep or prune that fails is retried at its next turn; any worker may do it.
        self.stats.add(db_errors=1)
        logger.debug("worker %s: %s failed: %s", self.name, what, one_line(exc))

    # Defined by a part, called by another.

    def _rewind(self, now: float) -> None:  # _wclaims
        raise NotImplementedError

    def _lost(self, jobs: Sequence[Job], what: str, *, heartbeat: bool = False) -> None:
        raise NotImplementedError  # _woutcomes
