"""Control of jobs and queues as I/O-free operations: cancel, pause, limits, results.

Like ``_ops``, each function yields the statements it needs and never touches a
connection, so ``Queue`` and ``AsyncQueue`` (generated from one source) run the same
code.  The statements are in ``sql/queries.sql``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from ._errors import (
    ConfigError,
    JobCancelled,
    JobFailed,
    JobStateError,
    PayloadError,
    UnknownJob,
    UnknownQueue,
)
from ._ops import Execute, Op
from ._sql import Statements

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "Encoded",
    "JobInfo",
    "QueueConfig",
    "RetryProgress",
    "RetryReport",
    "cancel",
    "check_limits",
    "configure",
    "delete",
    "encode_result",
    "error_line",
    "find_jobs",
    "queue_configs",
    "requeue",
    "retry_failed",
    "retry_jobs",
    "set_paused",
    "settle",
    "watch",
]

DEFAULT_MAX_RESULT_BYTES = 64 * 1024
FINAL = frozenset({"done", "failed", "cancelled"})
# throttled: waiting for a slot of its concurrency key (migration 0018).
STATUSES = frozenset({"pending", "running", "waiting", "throttled", *FINAL})


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue's settings as stored in ``queues`` (no row: all defaults)."""

    name: str
    paused: bool = False
    concurrency_limit: int | None = None
    rate_limit: float | None = None
    rate_burst: float | None = None
    store_results: bool = True

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> QueueConfig:
        return cls(
            name=row["name"],
            paused=row["paused"],
            concurrency_limit=row["concurrency_limit"],
            rate_limit=row["rate_limit"],
            rate_burst=row["rate_burst"],
            store_results=row["store_results"],
        )


class Encoded(str):
    """A result already checked and encoded (by a worker's handler thread)."""

    __slots__ = ()


def encode_result(value: Any, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> Encoded | None:
    """A handler's return value as JSON text for ``jobs.result``; None stays NULL.

    Raises PayloadError for a value JSON cannot hold or one over ``max_bytes``: the
    worker then fails the job (no retry: its side effects already happened) with that
    message, rather than lose the result silently.
    """
    if value is None or isinstance(value, Encoded):
        return value
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"handler result is not JSON-serialisable: {exc}") from None
    if "\\u0000" in text:
        raise PayloadError("handler result contains a NUL character, which jsonb cannot store")
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise PayloadError(
            f"handler result is {size} bytes, over the limit of {max_bytes}; "
            "store large results elsewhere and return a reference"
        )
    return Encoded(text)


# Upkeep moves a delayed or finished job to another partition by deleting it and
# inserting it there in one statement (migration 0009).  A write by id whose snapshot
# predates that move finds the old version deleted and matches nothing; the same write
# in a new statement finds the job in its new place.  So a write that matched nothing,
# on a job whose state says it should have, is run again (a move is rare, and one
# retry almost always suffices; three bound the loop).
MOVE_RETRIES = 3


def cancel(stmts: Statements, job_id: int) -> Op[str]:
    """Cancel a pending job, or ask a running one to stop; returns the job's status."""
    for _ in range(MOVE_RETRIES):
        rows = yield Execute(stmts.cancel, {"id": job_id})
        if rows:
            return str(rows[0]["status"])
        rows = yield Execute(stmts.job_state, {"id": job_id})
        if not rows:
            raise UnknownJob(job_id)
        if rows[0]["status"] not in ("pending", "running", "waiting"):
            break
    raise JobStateError(
        f"job {job_id} is already {rows[0]['status']}; only pending, waiting or running jobs "
        "can be cancelled"
    )


def _check_limit(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, not {value!r}")


def check_limits(
    concurrency_limit: int | None, rate_limit: float | None, rate_burst: float | None
) -> None:
    """ConfigError naming the value for a limit of 0 or below, NaN, or not a number."""
    if concurrency_limit is not None and (
        isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
    ):
        raise ConfigError(f"concurrency limit must be an integer, not {concurrency_limit!r}")
    _check_limit("concurrency limit", concurrency_limit)
    if concurrency_limit is not None and concurrency_limit > 2**31 - 1:
        raise ConfigError(f"concurrency limit {concurrency_limit} is too large")
    _check_limit("rate limit", rate_limit)
    _check_limit("rate burst", rate_burst)
    if rate_burst is not None and rate_burst < 1:
        raise ConfigError(f"rate burst must be at least 1 job, not {rate_burst!r}")


def configure(
    stmts: Statements,
    queue: str,
    *,
    concurrency_limit: int | None,
    rate_limit: float | None,
    rate_burst: float | None,
    store_results: bool | None,
    clear_concurrency: bool,
    clear_rate: bool,
    create: bool = True,
) -> Op[QueueConfig]:
    """Change a queue's settings (checked before any I/O), creating them with ``create``.

    Without ``create``, a queue with no jobs and no settings raises UnknownQueue, as
    ``set_paused`` does: a typo would otherwise configure a queue nobody uses.
    """
    check_limits(concurrency_limit, rate_limit, rate_burst)
    rows = yield Execute(
        stmts.configure_queue,
        {
            "queue": queue,
            "concurrency": concurrency_limit,
            "rate": None if rate_limit is None else float(rate_limit),
            "burst": None if rate_burst is None else float(rate_burst),
            "store_results": store_results,
            "clear_concurrency": clear_concurrency,
            "clear_rate": clear_rate,
            "create": create,
        },
    )
    if not rows:
        raise UnknownQueue(queue, "pass create=True to configure it before its first job")
    return QueueConfig.from_row(rows[0])


def set_paused(stmts: Statements, queue: str, paused: bool) -> Op[bool]:
    """Pause or resume a known queue; UnknownQueue for a name with no jobs or settings."""
    rows = yield Execute(stmts.set_paused, {"queue": queue, "paused": paused})
    if not rows:
        raise UnknownQueue(queue)
    return bool(rows[0]["paused"])


def queue_configs(stmts: Statements) -> Op[list[QueueConfig]]:
    rows = yield Execute(stmts.queue_settings, {})
    return [QueueConfig.from_row(r) for r in rows]


def watch(stmts: Statements, job_id: int, register: bool) -> Op[dict[str, Any]]:
    """The job's state; with ``register``, also ask its final write to notify."""
    for _ in range(MOVE_RETRIES):
        rows = yield Execute(stmts.watch if register else stmts.job_state, {"id": job_id})
        if rows:
            return rows[0]
    raise UnknownJob(job_id)


def settle(row: Mapping[str, Any]) -> tuple[bool, Any]:
    """(finished, result) for a job's state row; a failed or cancelled job raises."""
    status = row["status"]
    if status == "done":
        return True, row["result"]
    if status == "failed":
        raise JobFailed(int(row["id"]), row["last_error"])
    if status == "cancelled":
        raise JobCancelled(int(row["id"]))
    return False, None


def requeue(stmts: Statements, job_id: int) -> Op[None]:
    """Make a finished job pending again (an operator's retry)."""
    for _ in range(MOVE_RETRIES):
        rows = yield Execute(stmts.requeue, {"id": job_id, "schema": stmts.schema})
        if rows:
            return
        rows = yield Execute(stmts.job_state, {"id": job_id})
        if not rows:
            raise UnknownJob(job_id)
        if rows[0]["status"] not in ("done", "failed", "cancelled"):
            break
    raise JobStateError(
        f"job {job_id} is {rows[0]['status']}; only done, failed or cancelled jobs can be "
        "retried (cancel a running job first)"
    )


def delete(stmts: Statements, job_id: int) -> Op[None]:
    """Delete a job that is not running."""
    for _ in range(MOVE_RETRIES):
        rows = yield Execute(stmts.delete_job, {"id": job_id})
        if rows:
            return
        rows = yield Execute(stmts.job_state, {"id": job_id})
        if not rows:
            raise UnknownJob(job_id)
        if rows[0]["status"] == "running":
            break
    raise JobStateError(f"job {job_id} is running; cancel it before deleting it")


def error_line(error: str | None) -> str | None:
    """The one line of a job's ``last_error`` that says what went wrong.

    For a traceback that is the exception line after the last frame ("ValueError: bad
    invoice"), not a ``File ...`` line and not the last line, which may be the second
    line of a multi-line message or a note; the frames of an exception group carry a
    ``|`` margin, which is taken off.  For a text that does not open with a traceback (a
    ``Fail`` or ``Retry`` reason, a timeout, a lost lease) its first line.  At most 300
    characters.
    """
    if not error or not error.strip():
        return None
    lines = [line.rstrip() for line in error.splitlines() if line.strip()]
    first = lines[0]
    # A traceback opens with its header; one trimmed to its tail (_handlers keeps the
    # last 8,000 characters) with "..."; an exception group's with an indented "+".
    if not first.startswith(("Traceback (most recent call last)", "...", " ")):
        return _clip(first.strip())
    frames = [i for i, line in enumerate(lines) if line.lstrip(" |").startswith('File "')]
    if frames:
        frame = lines[frames[-1]]
        margin = frame[: len(frame) - len(frame.lstrip(" |"))]
        # The frame's own indentation is two spaces past the margin; its source line and
        # caret markers are indented further, the exception line is not.
        margin = margin[:-2] if margin.endswith("  ") else margin
        after = lines[frames[-1] + 1 :]
    else:
        # Trimmed inside the last frame line: the exception line is the first one at
        # the margin after the frame's indented source line.
        indented = [i for i, line in enumerate(lines) if line.startswith(" ")]
        margin, after = "", lines[indented[-1] + 1 :] if indented else lines[-1:]
    for line in after:
        rest = line[len(margin) :] if line.startswith(margin) else line
        if not rest.startswith(" "):
            return _clip(rest.strip())
    return _clip(lines[-1].strip())


def _clip(text: str) -> str:
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True, slots=True)
class JobInfo:
    """One job as ``Queue.find_jobs`` lists it: its state, without payload or result.

    ``last_error`` is the whole text the last failed attempt left (a traceback, or a
    reason); ``error`` is its one telling line (see ``error_line``).  ``task`` is None
    for a job of the handler-per-queue API.
    """

    id: int
    queue: str
    task: str | None
    status: str
    priority: int
    attempts: int
    max_attempts: int
    worker: str | None
    run_at: datetime
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    last_error: str | None

    @property
    def error(self) -> str | None:
        """The exception line of ``last_error`` ("ValueError: bad"), or None."""
        return error_line(self.last_error)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobInfo:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class RetryReport:
    """What a retry did: the jobs put back to pending, and those refused, with why.

    ``refused`` maps a job id to one line that starts with the job's status (or
    ``unknown``), as in ``"running: cancel it first, or let its attempt end"``.
    """

    retried: tuple[int, ...] = ()
    refused: dict[int, str] = field(default_factory=dict)


# Why a job was not retried, by the status the retry found it in.
_REFUSALS = {
    "pending": "pending: it has not failed; it runs when due",
    "running": "running: cancel it first, or let its attempt end",
    "done": "done: it succeeded; enqueue a new job to run it again",
    None: "unknown: no job with this id",
}


@dataclass(slots=True)
class RetryProgress:
    """A retry's progress so far.  The driver runs an operation again from the start
    after a transient error (a serialization failure, a dropped connection); what an
    earlier run already committed must then be reported, not retried or refused anew."""

    retried: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    # retry_failed's ids, read once: a job retried by this call that fails again before
    # the call ends is not taken again (a loop could otherwise chase a job that fails
    # at once, for as long as a worker keeps failing it).
    todo: list[int] | None = None

    def report(self) -> RetryReport:
        return RetryReport(tuple(self.retried), dict(self.refused))


def find_jobs(stmts: Statements, params: Mapping[str, Any]) -> Op[list[JobInfo]]:
    rows = yield Execute(stmts.find_jobs, params)
    return [JobInfo.from_row(r) for r in rows]


def _retry_ids(stmts: Statements, ids: Sequence[int], progress: RetryProgress) -> Op[None]:
    """Retry ``ids`` (failed or cancelled jobs), recording each outcome in ``progress``."""
    handled = set(progress.retried) | set(progress.refused)
    todo = sorted({i for i in ids if i not in handled})
    for _ in range(MOVE_RETRIES):
        if not todo:
            return
        rows = yield Execute(stmts.retry_jobs, {"ids": todo, "schema": stmts.schema})
        moved: list[int] = []
        for row in rows:
            job_id, status = int(row["id"]), row["status"]
            if row["retried"]:
                progress.retried.append(job_id)
            elif status in ("failed", "cancelled"):
                moved.append(job_id)  # moved by another statement meanwhile: ask again
            else:
                progress.refused[job_id] = _REFUSALS.get(status, f"{status}: not retried")
        todo = moved
    for job_id in todo:
        progress.refused[job_id] = "moving: the job kept moving between partitions; try again"


def retry_jobs(stmts: Statements, ids: Sequence[int], progress: RetryProgress) -> Op[RetryReport]:
    """Retry the failed or cancelled jobs among ``ids``; refuse the others, each with why."""
    yield from _retry_ids(stmts, ids, progress)
    return progress.report()


def retry_failed(
    stmts: Statements, filters: Mapping[str, Any], progress: RetryProgress, batch: int = 500
) -> Op[RetryReport]:
    """Retry every failed job matching ``filters`` (queue, task, since), ``batch`` at a time."""
    if progress.todo is None:
        rows = yield Execute(stmts.failed_ids, filters)
        progress.todo = [int(r["id"]) for r in rows]
    for start in range(0, len(progress.todo), batch):
        yield from _retry_ids(stmts, progress.todo[start : start + batch], progress)
    return progress.report()
