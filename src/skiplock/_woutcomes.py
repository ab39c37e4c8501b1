"""Handler outcomes, the fenced writes that carry them, and what each answer meant.

A handler's outcome (``_handlers.Outcome``) becomes one of two fenced writes, batched by
the writer: completions, and hand-backs (retry or fail; ``split``).  Each statement
answers, per attempt, with the row it changed or nothing: nothing means the lease was
lost (``LeaseLost``), and the write changed nothing.  Here those answers become the
counters, the ``on_event`` calls and one log line per attempt, the same from both
workers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ._base import _clamp_delay
from ._errors import ConfigError
from ._handlers import CANCELLED, Outcome
from ._job import Attempt, Job
from ._ops import FenceResult
from ._wcore import WorkerCore, _seconds, error_summary, log_job

__all__ = ["WorkerOutcomes"]


class WorkerOutcomes(WorkerCore):
    """Timeouts, outcomes as writes, and the meaning of their answers."""

    job_timeout: float | None
    shortest_timeout: float | None
    _task_timeouts: dict[str, float]
    _timeouts: set[Attempt]
    _requested: set[Attempt]
    _lost_logged: dict[Attempt, None]

    def _init_outcomes(
        self, job_timeout: float | None, task_timeouts: Mapping[str, float] | None
    ) -> None:
        if job_timeout is not None and not job_timeout > 0:
            raise ConfigError(f"job timeout must be positive, not {job_timeout!r}")
        self.job_timeout = job_timeout
        self._task_timeouts = dict(task_timeouts or {})
        for task_name, t in self._task_timeouts.items():
            if not t > 0:
                raise ConfigError(f"task {task_name!r}: timeout must be positive, not {t!r}")
        # The shortest timeout any job here may have: how often to look for overruns.
        every = [t for t in (job_timeout, *self._task_timeouts.values()) if t]
        self.shortest_timeout = min(every) if every else None
        # Attempts this worker timed out, until their hand-back says how they ended: that
        # line then says "timed out" (one line per attempt, not one per step).
        self._timeouts = set()
        # Attempts whose handler raised Retry: logged as asked for, not as a failure.
        self._requested = set()
        # Attempts a heartbeat already logged as lost: their write, refused later by the
        # fence, must not log them again.  Written by two threads in Worker.
        self._lost_logged = {}
        self._log_lock = threading.Lock()

    def timeout_for(self, job: Job) -> float | None:
        """Seconds this job's attempt may run: its task's timeout, else the worker's."""
        if job.task is not None and job.task in self._task_timeouts:
            return self._task_timeouts[job.task]
        return self.job_timeout

    def split(
        self,
        batch: Sequence[tuple[Job, Outcome]],
    ) -> tuple[
        list[tuple[Job, Any]],
        list[tuple[Job, str | None, float | None, bool]],
    ]:
        """Handler outcomes as the two fenced writes: completions and hand-backs.

        A retry's delay is drawn here from the retry policy (not by the statement) so
        that the log line of the retry can say when the job runs again.
        """
        policy = self._settings.retry_policy
        requested = [job.attempt for job, o in batch if o.requested]
        if requested:
            with self._log_lock:
                self._requested.update(requested)
        done = [(job, o.result) for job, o in batch if o.kind == "ok"]
        failed: list[tuple[Job, str | None, float | None, bool]] = [
            (
                job,
                o.error,
                _clamp_delay(policy.delay(job.attempts) if o.delay is None else float(o.delay)),
                o.kind == "retry",
            )
            for job, o in batch
            if o.kind != "ok"
        ]
        return done, failed

    def _timed_out(self, job: Job, timeout: float | None, *, killed: bool = False) -> Outcome:
        """Count a handler past its timeout; returns the outcome to write for it
        (``killed``: its process was, by the process pool)."""
        self.stats.add(timed_out=1)
        self._emit("timed_out", job)
        with self._log_lock:
            self._timeouts.add(job.attempt)
        if killed:
            return Outcome("retry", f"killed after {timeout or 0.0:g}s (its timeout)")
        return Outcome("retry", f"timed out after {timeout or 0.0:g}s")

    def completed(self, items: Sequence[tuple[Job, Any]], res: FenceResult) -> None:
        """Count and report a completion statement's answer."""
        cancelled = 0
        lost: list[Job] = []
        for job, _ in items:
            row = res.row(job)
            if row is None:
                lost.append(job)
                self._emit("lease_lost", job)
            elif row["status"] == "cancelled":
                cancelled += 1
                self._emit("cancelled", job)
                log_job(self.name, logging.WARNING, "cancelled", job, "cancelled while running")
            else:
                self._emit("completed", job)
        self.stats.add(completed=len(res.attempts) - cancelled, cancelled=cancelled)
        self._lost(lost, "the write changed nothing")

    def handed_back(
        self, items: Sequence[tuple[Job, str | None, float | None, bool]], res: FenceResult
    ) -> None:
        """Count and report a fail/retry statement's answer, and log each job's line."""
        by_status = {"pending": 0, "failed": 0, "cancelled": 0}
        lost: list[Job] = []
        for job, error, delay, retry in items:
            with self._log_lock:
                timed_out = job.attempt in self._timeouts
                self._timeouts.discard(job.attempt)
                requested = job.attempt in self._requested
                self._requested.discard(job.attempt)
            row = res.row(job)
            if row is None:
                lost.append(job)
                self._emit("lease_lost", job)
                continue
            status = str(row["status"])
            by_status[status] = by_status.get(status, 0) + 1
            event = {"pending": "retried", "failed": "failed"}.get(status, status)
            self._emit(event, job)
            self._log_hand_back(job, event, error, delay, retry, timed_out, requested)
        self.stats.add(
            retried=by_status["pending"],
            failed=by_status["failed"],
            cancelled=by_status["cancelled"],
        )
        self._lost(lost, "the write changed nothing")

    def _log_hand_back(
        self,
        job: Job,
        event: str,
        error: str | None,
        delay: float | None,
        retry: bool,
        timed_out: bool,
        requested: bool = False,
    ) -> None:
        # The row's status after the fenced write decides, not the outcome we asked
        # for: the statement knows the attempts left and whether a cancel came first.
        what = error_summary(error) if timed_out else f"failed: {error_summary(error)}"
        if event == "failed":
            why = "no attempts left" if retry else "not retried"
            log_job(self.name, logging.ERROR, event, job, f"{what}; {why}, job failed", error=error)
        elif event == "cancelled":
            summary = error_summary(error)
            text = "cancelled while running"
            if summary and summary != CANCELLED.error:
                text += f" ({summary})"  # what the handler raised on its way out
            log_job(self.name, logging.WARNING, event, job, text, error=error)
        else:
            # 'retried'; or the row has moved on already (a retry after a lost reply
            # found our hand-back committed and the job claimed again): it runs again.
            when = f"retrying in {_seconds(delay)}" if delay is not None else "retrying"
            if requested:
                # The handler asked for it (Retry): news, not a failure.  Its reason,
                # with the exception it was raised from, is the line's first part.
                what = error_summary(error) or "retry requested"
            log_job(
                self.name,
                logging.INFO if requested else logging.WARNING,
                event,
                job,
                f"{what}; {when}",
                error=error,
                delay=delay,
            )

    def released(self, jobs: Sequence[Job], res: FenceResult) -> None:
        self.stats.add(released=len(res.attempts))
        lost = [job for job in jobs if res.row(job) is None]
        gone = {job.attempt for job in lost}
        for job in jobs:
            self._emit("lease_lost" if job.attempt in gone else "released", job)
        self._lost(lost, "the release changed nothing")

    def _lost(self, jobs: Sequence[Job], what: str, *, heartbeat: bool = False) -> None:
        """Count attempts the fence refused; one line each, once per attempt.

        A heartbeat that finds an attempt lost logs it; the handler's outcome, written
        later and refused too, is counted again (a stale write) but not logged again.
        """
        if not jobs:
            return
        self.stats.add(lease_lost=len(jobs))
        for job in jobs:
            with self._log_lock:
                if heartbeat:
                    self._lost_logged[job.attempt] = None
                    # An attempt whose handler never returns would stay here forever.
                    if len(self._lost_logged) > 10_000:
                        del self._lost_logged[next(iter(self._lost_logged))]
                elif job.attempt in self._lost_logged:
                    del self._lost_logged[job.attempt]
                    continue
            log_job(self.name, logging.WARNING, "lease_lost", job, f"lease lost: {what}")
