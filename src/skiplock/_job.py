"""The Job record handed to handlers and returned by claims."""

from __future__ import annotations

import json
import json.scanner
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, cast
from uuid import UUID

import psycopg
from psycopg.adapt import AdaptersMap, Buffer
from psycopg.types.json import JsonbLoader

__all__ = ["Attempt", "ClaimedRow", "Job", "JobStatus", "claimed_rows", "skiplock_adapters"]

JobStatus = str  # 'pending' | 'running' | 'done' | 'failed' | 'cancelled' | 'throttled'
Attempt = tuple[int, UUID | None]  # (job id, lease token): one claim of one job


class _Flag:
    """A flag one thread raises and others read.

    A plain attribute: under the GIL its assignment is atomic and seen by every thread,
    and nobody waits on it (handlers poll ``job.cancelled``).  A ``threading.Event``
    here cost every claimed job a lock and a condition, about 2 µs a job at claim.
    """

    __slots__ = ("up",)

    def __init__(self) -> None:
        self.up = False


@dataclass(frozen=True, slots=True)
class Job:
    """One row of ``jobs`` as seen by the claim (or by ``Queue.get``) that returned it.

    ``lease_token`` is the fence: complete, fail, retry, heartbeat and release succeed
    only while the row still carries it.  ``idempotency_key`` is stable across attempts
    of the same job; pass it to external providers so that a repeat attempt (after a
    lost lease or a crash) cannot repeat the side effect.
    """

    id: int
    queue: str
    payload: Any
    status: JobStatus
    priority: int
    attempts: int
    max_attempts: int
    worker: str | None
    lease_token: UUID | None
    locked_until: datetime | None
    run_at: datetime
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    last_error: str | None = None
    key: str | None = None
    result: Any = None
    store_result: bool = True
    # The task that runs this job (App.task, a Django task), None for handler-per-queue
    # jobs; ``meta`` is what travels with it besides its arguments (a trace context).
    task: str | None = None
    meta: Any = None
    # Set when a cancel of this job reaches its worker (at a heartbeat): a mutable cell
    # so that the frozen record can still carry it across threads.
    _cancel: _Flag = field(default_factory=_Flag, repr=False, compare=False)

    @property
    def attempt(self) -> Attempt:
        """This claim of the job: its id and lease token."""
        return (self.id, self.lease_token)

    @property
    def cancelled(self) -> bool:
        """True once a cancel of this running job has reached its worker.

        Cancelling is cooperative: a long handler checks this between steps and
        returns (or raises) early; whatever it then reports, the job ends ``cancelled``.
        An ``async def`` handler run by a worker is also cancelled as a task.
        """
        return self._cancel.up

    def mark_cancelled(self) -> None:
        """Record that a cancel reached this job (called by the worker, not handlers)."""
        self._cancel.up = True

    @property
    def idempotency_key(self) -> str:
        """The enqueue-time key if one was given, else ``skiplock:<queue>:<id>``."""
        return self.key if self.key is not None else f"skiplock:{self.queue}:{self.id}"

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Job:
        job = cls(
            id=row["id"],
            queue=row["queue"],
            payload=row["payload"],
            status=row["status"],
            priority=row["priority"],
            attempts=row["attempts"],
            max_attempts=row["max_attempts"],
            worker=row["worker"],
            lease_token=row["lease_token"],
            locked_until=row["locked_until"],
            run_at=row["run_at"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            last_error=row["last_error"],
            key=row["idempotency_key"],
            result=row.get("result"),
            store_result=bool(row.get("store_result", True)),
            task=row.get("task"),
            meta=row.get("meta"),
        )
        if row.get("cancel_requested"):
            job.mark_cancelled()
        return job


# The columns a claim returns for each of Job's fields, in the order of the fields.
_COLUMNS = (
    "id",
    "queue",
    "payload",
    "status",
    "priority",
    "attempts",
    "max_attempts",
    "worker",
    "lease_token",
    "locked_until",
    "run_at",
    "created_at",
    "started_at",
    "finished_at",
    "last_error",
    "idempotency_key",  # Job.key
    "result",
    "store_result",
    "task",
    "meta",
)
_FIELDS = tuple(f.name for f in fields(Job) if not f.name.startswith("_"))
if tuple("key" if c == "idempotency_key" else c for c in _COLUMNS) != _FIELDS:
    raise RuntimeError(f"Job's fields changed: update _COLUMNS to {_FIELDS}")

# One row of a claim: the job taken (None on the row that only reports the queue's
# settings), and whether the queue is limited (so its claims take the locked path).
ClaimedRow = tuple[Job | None, bool]


def claimed_rows(cursor: Any) -> Callable[[Sequence[Any]], ClaimedRow]:
    """A psycopg row factory for the claim statements: a Job straight from each row's
    values.

    The claim is the hot path of every worker, and building a dict per row and then a
    Job from it by name was a quarter of an AsyncWorker's CPU a job (py-spy, 20 columns
    a row).  The column positions are looked up once per result instead, and the
    values go to Job's constructor in field order.
    """
    names = [c.name for c in cursor.description or ()]
    at = {name: i for i, name in enumerate(names)}
    if "queue_limited" not in at:
        # psycopg also calls a row factory on the result the cursor still holds when
        # the factory is set, before the claim is sent: that result is not a claim's.
        return _not_a_claim
    pick = operator.itemgetter(*(at[c] for c in _COLUMNS))
    i_id, i_cancel, i_limited = at["id"], at["cancel_requested"], at["queue_limited"]

    def make(values: Sequence[Any]) -> ClaimedRow:
        if values[i_id] is None:
            return None, bool(values[i_limited])
        job = _new_job(pick(values))
        if values[i_cancel]:
            job.mark_cancelled()
        return job, bool(values[i_limited])

    return make


# Each field's slot, set through its descriptor, in field order (``_cancel`` apart).
_SLOTS = tuple(Job.__dict__[name].__set__ for name in _FIELDS)
_SET_CANCEL = Job.__dict__["_cancel"].__set__
_NEW = object.__new__


def _new_job(values: Sequence[Any]) -> Job:
    """``Job(*values)``, built at less than half its cost: a claim builds one per job.

    A frozen dataclass's ``__init__`` sets each of its 21 fields with
    ``object.__setattr__``, which looks the name up on the type every time: 2.6 µs a
    Job, against 1.6 µs through the slots' own descriptors (``timeit``).  Nothing is
    checked or converted on either path, and every field here is given, so the two
    build equal Jobs (tests/unit/test_job_rows.py compares them field by field).
    """
    job = _NEW(Job)
    for set_slot, value in zip(_SLOTS, values, strict=True):
        set_slot(job, value)
    _SET_CANCEL(job, _Flag())
    return job


def _not_a_claim(values: Sequence[Any]) -> ClaimedRow:
    raise TypeError("claimed_rows made rows of a statement that is not a claim")


# The scanner of the decoder json.loads uses when given no options (a JSONDecoder()
# builds its scan_once so): the same scanner, the same result.
_SCAN = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))


class PayloadLoader(JsonbLoader):
    """Loads ``jsonb`` as psycopg's own loader does, without ``json.loads``' wrapping.

    Every claimed job's payload is a ``jsonb`` value, and ``json.loads`` of a small one
    took 2.0 µs, of which the scan itself is 0.4: the rest finds the text's encoding
    and matches whitespace with a regular expression before and after the value.  What
    PostgreSQL sends for a ``jsonb`` has neither leading nor trailing whitespace, so
    this scans it at once; anything else (whitespace, an error, a ``loads`` set with
    ``psycopg.types.json.set_json_loads``) goes to the loader psycopg would have used,
    which gives the same value or raises the same error.
    """

    def load(self, data: Buffer) -> Any:
        if self.loads is json.loads:
            try:
                text = str(data, "utf-8", "surrogatepass")
                value, end = _SCAN(text, 0)
            except (StopIteration, ValueError):
                pass
            else:
                if end == len(text):
                    return value
        return super().load(data)


def skiplock_adapters() -> AdaptersMap:
    """The adapters of a connection skiplock opens: psycopg's global ones, as they are
    when it connects, with ``jsonb`` text loaded by ``PayloadLoader``."""
    adapters = AdaptersMap(psycopg.adapters)
    adapters.register_loader("jsonb", PayloadLoader)
    return adapters
