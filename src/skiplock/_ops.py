"""The queue's operations as I/O-free generators, run by the sync and async drivers.

Each operation yields the statements it needs (``Execute`` or ``Copy``) and receives
the rows back; it never touches a connection.  ``Queue`` and ``AsyncQueue`` only differ
in how they run a step, so the logic - dedup on enqueue, fencing, the re-check after a
dropped connection - exists once.  This is psycopg's own generator design, applied one
level up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from psycopg import sql

from ._errors import PayloadError, SkiplockError
from ._job import Job
from ._sql import Statements

__all__ = [
    "ClaimPosition",
    "Copy",
    "Execute",
    "FenceResult",
    "Op",
    "claim",
    "encode_payload",
    "enqueue",
    "enqueue_many",
    "fenced",
]

T = TypeVar("T")
Row = dict[str, Any]
# A job's place in claim order: (priority, run_at, id).
ClaimPosition = tuple[int, datetime, int]


@dataclass(frozen=True, slots=True)
class Execute:
    query: sql.SQL | sql.Composed
    params: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    query: sql.Composed
    rows: Sequence[tuple[Any, ...]]


Step = Execute | Copy
Op = Generator[Step, list[Row], T]

# An escaped NUL in JSON text (not preceded by an escaping backslash): jsonb rejects it.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20


def encode_payload(payload: Any, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    """Serialise ``payload`` to JSON text, or raise PayloadError before anything is sent."""
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise PayloadError("payload is nested too deeply to serialise as JSON") from None
    if _JSON_NUL.search(text):
        raise PayloadError("payload contains a NUL character (\\u0000), which jsonb cannot store")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        # A lone surrogate (from a bad decode, say) has no UTF-8 form to send.
        bad = exc.object[exc.start : exc.end]
        raise PayloadError(
            f"payload contains {bad!r}, a lone surrogate that UTF-8 (and jsonb) cannot hold"
        ) from None
    if size > max_bytes:
        raise PayloadError(
            f"payload is {size} bytes, over the limit of {max_bytes}; "
            "store the data elsewhere and enqueue its id"
        )
    return text


def enqueue(
    stmts: Statements,
    *,
    queue: str,
    payload: str,
    priority: int,
    run_at: datetime | None,
    max_attempts: int,
    key: str | None,
    task: str | None = None,
    meta: str | None = None,
) -> Op[int]:
    params = {
        "queue": queue,
        "payload": payload,
        "priority": priority,
        "run_at": run_at,
        "max_attempts": max_attempts,
        "idempotency_key": key,
        "task": task,
        "meta": meta,
    }
    # The unique index decides; the lookup runs as a new statement so that under READ
    # COMMITTED it sees the row whose commit made our insert conflict.  A row pruned in
    # between makes the insert succeed on the next round.
    for _ in range(3):
        rows = yield Execute(stmts.enqueue, params)
        if rows:
            return int(rows[0]["id"])
        rows = yield Execute(stmts.find_by_keys, {"queues": [queue], "keys": [key]})
        if rows:
            return int(rows[0]["id"])
    raise SkiplockError(
        f"enqueue with idempotency key {key!r} conflicts with a row this transaction "
        "cannot see; run it at READ COMMITTED"
    )


def enqueue_many(
    stmts: Statements,
    *,
    queue: str,
    payloads: Sequence[str],
    priority: int,
    run_at: datetime | None,
    max_attempts: int,
    keys: Sequence[str | None] | None,
    task: str | None = None,
    meta: str | None = None,
) -> Op[list[int]]:
    n = len(payloads)
    if n == 0:
        return []
    rows = yield Execute(stmts.reserve_ids, {"schema": stmts.schema, "n": n})
    ids = [int(r["nextval"]) for r in rows]
    if keys is None or all(k is None for k in keys):
        if run_at is None:
            yield Copy(
                stmts.copy_jobs,
                [
                    (i, queue, p, priority, max_attempts, task, meta)
                    for i, p in zip(ids, payloads, strict=True)
                ],
            )
        else:
            yield Copy(
                stmts.copy_jobs_at,
                [
                    (i, queue, p, priority, max_attempts, task, meta, run_at)
                    for i, p in zip(ids, payloads, strict=True)
                ],
            )
        return ids
    if len(keys) != n:
        raise ValueError(f"{n} payloads but {len(keys)} idempotency keys")
    rows = yield Execute(
        stmts.enqueue_rows,
        {
            "ids": ids,
            "queues": [queue] * n,
            "payloads": list(payloads),
            "priorities": [priority] * n,
            "run_ats": [run_at] * n,
            "max_attempts": [max_attempts] * n,
            "keys": list(keys),
            "task": task,
            "meta": meta,
        },
    )
    inserted = {int(r["id"]) for r in rows}
    skipped = [k for i, k in zip(ids, keys, strict=True) if i not in inserted]
    if not skipped:
        return ids
    rows = yield Execute(stmts.find_by_keys, {"queues": [queue] * len(skipped), "keys": skipped})
    existing = {r["idempotency_key"]: int(r["id"]) for r in rows}
    out: list[int] = []
    for i, k in zip(ids, keys, strict=True):
        if i in inserted:
            out.append(i)
        elif k in existing:
            out.append(existing[k])
        else:
            raise SkiplockError(
                f"enqueue with idempotency key {k!r} conflicts with a row "
                "this transaction cannot see"
            )
    return out


def claim(
    stmts: Statements,
    *,
    worker: str,
    queue: str,
    limit: int,
    lease: float,
    own_transaction: bool = True,
    start: ClaimPosition | None = None,
    tasks: Sequence[str] | None = None,
) -> Op[list[Job]]:
    """The claim: one statement, or for a limited queue the locked path.

    ``own_transaction``: the connection is in autocommit, so the locked path opens and
    commits its own transaction; otherwise it joins the caller's, whose commit then
    ends the turn of this queue's claims.  ``start``: the position in claim order the
    scan starts at (None: the head); see ``ClaimCursor``.  ``tasks``: only jobs of
    these tasks (None: any job, with or without a task).
    """
    p, r, i = start if start is not None else (None, None, None)
    params = {
        "worker": worker,
        "queue": queue,
        "limit": limit,
        "lease": lease,
        "from_priority": p,
        "from_run_at": r,
        "from_id": i,
        "tasks": None if tasks is None else list(tasks),
    }
    rows = yield Execute(stmts.claim, params)
    if rows and rows[0]["queue_limited"]:
        if own_transaction:
            yield Execute(sql.SQL("BEGIN"))
        yield Execute(stmts.lock_queue, {"queue": queue})
        rows = yield Execute(stmts.claim_limited, params)
        if own_transaction:
            yield Execute(sql.SQL("COMMIT"))
    jobs = [Job.from_row(r) for r in rows if r["id"] is not None]
    # RETURNING order is unspecified; hand jobs out in claim order.
    jobs.sort(key=lambda j: (j.priority, j.run_at, j.id))
    return jobs


@dataclass(slots=True)
class FenceResult:
    """Which jobs a fenced write reached (``done``) and which had lost their lease."""

    done: dict[int, Row] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    # By attempt, (id, lease token): what a worker holding two attempts of a job reads.
    attempts: dict[tuple[int, Any], Row] = field(default_factory=dict)

    def row(self, job: Job) -> Row | None:
        """The answer for this attempt of the job; None if its lease was lost."""
        return self.attempts.get((job.id, job.lease_token))


# States a job may be found in, still carrying our token, when a write we cannot see the
# answer to did commit.  Heartbeat has none: repeating it is harmless.
_OUTCOMES: dict[str, frozenset[str]] = {
    "complete": frozenset({"done", "cancelled"}),
    "fail": frozenset({"pending", "failed", "cancelled"}),
    "release": frozenset({"pending", "cancelled"}),
    "heartbeat": frozenset(),
}


def fenced(
    stmts: Statements,
    action: str,
    jobs: Sequence[Job],
    params: Mapping[str, Any] | None = None,
    *,
    recheck: bool = False,
) -> Op[FenceResult]:
    """Run the fenced statement ``action`` for ``jobs``; report who lost the lease.

    ``recheck`` is set when an earlier try of the same write died with its connection:
    a job that no longer matches may be one our earlier try already moved.
    """
    if action not in _OUTCOMES:
        raise ValueError(f"not a fenced action: {action}")
    result = FenceResult()
    if not jobs:
        return result
    for job in jobs:
        if job.lease_token is None:
            raise ValueError(f"job {job.id} carries no lease token; it was not claimed")
    ids = [j.id for j in jobs]
    tokens = [j.lease_token for j in jobs]
    rows = yield Execute(getattr(stmts, action), {"ids": ids, "tokens": tokens, **(params or {})})
    # An attempt is (id, token): a worker may hold a job's old attempt (its lease ran
    # out, the job was swept) beside a new one it claimed again.
    reached = {(int(r["id"]), r["lease_token"]): r for r in rows}
    if action == "heartbeat":
        for job in jobs:
            row = reached.get((job.id, job.lease_token))
            if row is not None and row["cancel_requested"]:
                job.mark_cancelled()
    missing = [j for j in jobs if (j.id, j.lease_token) not in reached]
    if missing and recheck and _OUTCOMES[action]:
        rows = yield Execute(
            stmts.fence_outcome,
            {"ids": [j.id for j in missing], "tokens": [j.lease_token for j in missing]},
        )
        for r in rows:
            if r["current_lease"] and r["status"] in _OUTCOMES[action]:
                reached[(int(r["id"]), r["lease_token"])] = r
            elif not r["current_lease"] and action in ("fail", "release"):
                # Our hand-back committed and the job has moved on (re-claimed).
                reached[(int(r["id"]), r["lease_token"])] = r
    result.attempts = reached
    result.done = {job_id: r for (job_id, _), r in reached.items()}
    result.lost = [j.id for j in jobs if (j.id, j.lease_token) not in reached]
    return result
