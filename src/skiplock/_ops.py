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
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast

from psycopg import errors as pgerrors
from psycopg import sql

from ._errors import PayloadError, SkiplockError, UnknownJob
from ._job import ClaimedRow, Job, claimed_rows
from ._sql import Statements

__all__ = [
    "ClaimPosition",
    "Copy",
    "Edge",
    "Execute",
    "FenceResult",
    "Op",
    "Reserved",
    "claim",
    "encode_payload",
    "enqueue",
    "enqueue_graph",
    "enqueue_keyed",
    "enqueue_many",
    "fenced",
    "resumed",
]

T = TypeVar("T")
Row = dict[str, Any]
# A job's place in claim order: (priority, run_at, id).
ClaimPosition = tuple[int, datetime, int]


@dataclass(frozen=True, slots=True)
class Execute:
    query: sql.SQL | sql.Composed
    params: Mapping[str, Any] | None = None
    # How the driver makes the rows it sends back (None: a dict per row, ``Row``).
    rows: Callable[[Any], Callable[[Sequence[Any]], Any]] | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    query: sql.Composed
    rows: Sequence[tuple[Any, ...]]


Step = Execute | Copy
Op = Generator[Step, list[Row], T]

# An escaped NUL in JSON text (not preceded by an escaping backslash): jsonb rejects it.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20

# One encoder for every payload (encode() keeps no state between calls): json.dumps
# with options builds a new one at each call.  With the two shortcuts below, a small
# payload is checked and encoded in 1.4 µs instead of 2.6 (timeit), and encoding was a
# third of enqueue_many's time for 20,000 small payloads (cProfile).
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def encode_payload(payload: Any, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    """Serialise ``payload`` to JSON text, or raise PayloadError before anything is sent."""
    try:
        text = _ENCODER.encode(payload)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise PayloadError("payload is nested too deeply to serialise as JSON") from None
    # The substring test first: the regex (an escaped NUL, not an escaped backslash
    # before "u0000") runs only on text that could match.
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise PayloadError("payload contains a NUL character (\\u0000), which jsonb cannot store")
    try:
        # ASCII text is as many bytes as characters; anything else is encoded, which
        # also finds a lone surrogate.
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
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
    task: str | None = None,
    meta: str | None = None,
    concurrency_key: str | None = None,
    concurrency: int | None = None,
    rate_key: str | None = None,
    rate_every: float | None = None,
) -> Op[int]:
    """One unkeyed job in the caller's transaction (nothing is retried there)."""
    params = {
        "queue": queue,
        "payload": payload,
        "priority": priority,
        "run_at": run_at,
        "max_attempts": max_attempts,
        "task": task,
        "meta": meta,
        "concurrency_key": concurrency_key,
        "concurrency": concurrency,
        "rate_key": rate_key,
        "rate_every": rate_every,
    }
    limited = concurrency_key is not None or rate_key is not None
    rows = yield Execute(stmts.enqueue_plain_limited if limited else stmts.enqueue_plain, params)
    return int(rows[0]["id"])


def enqueue_keyed(
    stmts: Statements,
    *,
    queue: str,
    payloads: Sequence[str],
    keys: Sequence[str | None],
    priority: int,
    run_at: datetime | None,
    max_attempts: int,
    task: str | None,
    meta: str | None,
    unique_for: float | None,
    on_conflict: str,
    reserved: Reserved,
    spares: list[tuple[int, float]] | None = None,
    retry: bool = False,
) -> Op[list[int]]:
    """Jobs of which some have an idempotency key, under ids reserved beforehand; each
    row's id is its own, or that of the job holding its key (migration 0017 decides,
    and raises SQLSTATE SL409 for a conflict it must not answer with the holder).

    ``spares`` (a single enqueue): take a spare id as ``enqueue_one`` does, and leave
    the next one.  ``retry``: an earlier attempt with ``reserved`` may have committed
    unseen; the function counts the rows it finds under our ids as ours.
    """
    n = len(payloads)
    for _ in range(3):
        if reserved.ids is None:
            spare = _fresh_spare(spares) if spares is not None and n == 1 else None
            if spare is not None:
                reserved.ids = [spare]
            else:
                rows = yield Execute(stmts.reserve_ids, {"schema": stmts.schema, "n": n})
                reserved.ids = [int(r["nextval"]) for r in rows]
        params = {
            "ids": reserved.ids,
            "queue": queue,
            "payloads": list(payloads),
            "keys": list(keys),
            "priority": priority,
            "run_at": run_at,
            "max_attempts": max_attempts,
            "task": task,
            "meta": meta,
            "unique_for": unique_for,
            "on_conflict": on_conflict,
            "retry": retry,
            "spare": spares is not None,
            "schema": stmts.schema,
        }
        try:
            rows = yield Execute(stmts.enqueue_keyed, params)
        except pgerrors.UniqueViolation as exc:
            if not _is_id_collision(exc):
                raise
            # Our ids were handed out twice (see _taken); rows under them are not ours.
            reserved.ids = None
            retry = False
            continue
        out = [0] * n
        for r in rows:
            out[int(r["n"]) - 1] = int(r["id"])
        if spares is not None and rows and rows[0]["spare"] is not None:
            spares.append((int(rows[0]["spare"]), time.monotonic()))
        return out
    raise SkiplockError("enqueue: the reserved job ids kept colliding with other rows")


@dataclass
class Reserved:
    """The ids an enqueue took from the sequence before sending, kept across its retries.

    A retry after a lost reply looks for rows with these ids before sending again: the
    rows of one statement commit together, so any of them present means the lost
    attempt committed.  That turns "may or may not have committed" into a definite
    answer without an idempotency key.  (One case it cannot tell: after a failover that
    lost the old primary's last WAL, the new primary may hand the same ids to another
    producer before our retry looks; idempotency keys have no such gap.)
    """

    ids: list[int] | None = None


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
    reserved: Reserved | None = None,
    retry: bool = False,
    unique_for: float | None = None,
    on_conflict: str = "return",
    concurrency_keys: Sequence[str | None] | None = None,
    concurrency: int | None = None,
    rate_keys: Sequence[str | None] | None = None,
    rate_every: float | None = None,
) -> Op[list[int]]:
    """Insert ``payloads`` with ids reserved first; see ``Reserved`` for the retry.

    ``retry``: an earlier attempt with the same ``reserved`` may have committed unseen.
    Unkeyed rows go with one COPY; a batch with any key goes to ``enqueue_keyed``.
    """
    n = len(payloads)
    if n == 0:
        return []
    if keys is not None and len(keys) != n:
        raise ValueError(f"{n} payloads but {len(keys)} idempotency keys")
    if concurrency_keys is not None and len(concurrency_keys) != n:
        raise ValueError(f"{n} payloads but {len(concurrency_keys)} concurrency keys")
    if rate_keys is not None and len(rate_keys) != n:
        raise ValueError(f"{n} payloads but {len(rate_keys)} rate keys")
    held = reserved if reserved is not None else Reserved()
    if keys is not None and any(k is not None for k in keys):
        return (
            yield from enqueue_keyed(
                stmts,
                queue=queue,
                payloads=payloads,
                keys=keys,
                priority=priority,
                run_at=run_at,
                max_attempts=max_attempts,
                task=task,
                meta=meta,
                unique_for=unique_for,
                on_conflict=on_conflict,
                reserved=held,
                retry=retry,
            )
        )
    for _ in range(3):
        if held.ids is None:
            rows = yield Execute(stmts.reserve_ids, {"schema": stmts.schema, "n": n})
            held.ids = [int(r["nextval"]) for r in rows]
        elif retry and (yield from _present(stmts, held.ids, queue)):
            # The rows of one COPY commit together: the lost attempt committed all.
            return held.ids
        ids = held.ids
        try:
            yield _copy_step(
                stmts,
                ids,
                queue,
                payloads,
                priority,
                max_attempts,
                task,
                meta,
                run_at,
                concurrency_keys,
                concurrency,
                rate_keys,
                rate_every,
            )
            return ids
        except pgerrors.UniqueViolation as exc:
            if not _is_id_collision(exc):
                raise
            if (yield from _taken(stmts, ids, queue, retry)):
                return ids
            held.ids = None
            continue
    raise SkiplockError("enqueue: the reserved job ids kept colliding with other rows")


@dataclass(frozen=True, slots=True)
class GraphRow:
    """One job of ``enqueue_graph``, its payload and meta already encoded."""

    queue: str
    payload: str
    priority: int
    run_at: datetime | None
    max_attempts: int
    task: str | None = None
    meta: str | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """``child`` (an index into the batch) waits for ``parent``: another index into the
    batch when ``local``, else the id of a job that exists.  ``pos``: the parent's place
    among the child's parents.  ``cancel``: the parent's failure cancels the child."""

    parent: int
    child: int
    pos: int
    cancel: bool = True
    local: bool = False


def enqueue_graph(
    stmts: Statements,
    *,
    rows: Sequence[GraphRow],
    edges: Sequence[Edge],
    reserved: Reserved,
    retry: bool = False,
    output: Any = None,
) -> Op[list[int]]:
    """Insert ``rows`` and the ``edges`` between them in one statement (migration 0016's
    ``enqueue_graph``); returns the rows' ids in order.  Ids are reserved first, so
    that edges can name rows of the batch and a retry can look for them (``Reserved``):
    the rows of one statement commit together, so the first is enough to look for.
    ``output``: a workflow's output, batch indices nested in lists; not None records
    the batch as a workflow under its first id."""
    n = len(rows)
    if n == 0:
        return []
    for _ in range(3):
        if reserved.ids is None:
            got = yield Execute(stmts.reserve_ids, {"schema": stmts.schema, "n": n})
            reserved.ids = [int(r["nextval"]) for r in got]
        elif retry and (yield from _present(stmts, reserved.ids[:1], rows[0].queue)):
            return reserved.ids
        ids = reserved.ids
        try:
            yield Execute(
                stmts.enqueue_graph,
                {
                    "ids": ids,
                    "queues": [r.queue for r in rows],
                    "payloads": [r.payload for r in rows],
                    "priorities": [r.priority for r in rows],
                    "run_ats": [r.run_at for r in rows],
                    "max_attempts": [r.max_attempts for r in rows],
                    "tasks": [r.task for r in rows],
                    "metas": [r.meta for r in rows],
                    "parents": [ids[e.parent] if e.local else e.parent for e in edges],
                    "children": [ids[e.child] for e in edges],
                    "positions": [e.pos for e in edges],
                    "cancels": [e.cancel for e in edges],
                    "workflow": None if output is None else json.dumps(_ids_of(output, ids)),
                },
            )
        except pgerrors.NoDataFound as exc:
            # The function names the first parent it could not find.
            missing = re.search(r"no job (\d+)", str(exc.diag.message_primary or ""))
            raise UnknownJob(int(missing[1]) if missing else 0) from None
        except pgerrors.UniqueViolation as exc:
            if not _is_id_collision(exc):
                raise
            if (yield from _taken(stmts, ids[:1], rows[0].queue, retry)):
                return ids
            reserved.ids = None
            continue
        return ids
    raise SkiplockError("enqueue: the reserved job ids kept colliding with other rows")


def _ids_of(shape: Any, ids: Sequence[int]) -> Any:
    """A nested list of batch indices, with each index replaced by its job id."""
    if isinstance(shape, int):
        return ids[shape]
    return [_ids_of(s, ids) for s in shape]


def enqueue_one(
    stmts: Statements,
    *,
    queue: str,
    payload: str,
    priority: int,
    run_at: datetime | None,
    max_attempts: int,
    task: str | None,
    meta: str | None,
    reserved: Reserved,
    spares: list[tuple[int, float]],
    retry: bool = False,
    concurrency_key: str | None = None,
    concurrency: int | None = None,
    rate_key: str | None = None,
    rate_every: float | None = None,
) -> Op[int]:
    """One unkeyed job under a reserved id, in one round trip once ``spares`` has one.

    ``spares``: (id, monotonic time) reserved by earlier inserts (each returns the
    next), shared by a queue's callers.  A spare is used only if no other enqueue of
    this queue took ids since (they clear it) and it is under ``SPARE_MAX_AGE`` old, so
    one producer's ids keep the order of its enqueues and stay close to commit order
    (an unused spare is a gap in the ids, as a rolled-back insert leaves).  Retries
    work as in ``enqueue_many``.
    """
    for _ in range(3):
        if reserved.ids is None:
            spare = _fresh_spare(spares)
            if spare is not None:
                reserved.ids = [spare]
            else:
                rows = yield Execute(stmts.reserve_ids, {"schema": stmts.schema, "n": 1})
                reserved.ids = [int(rows[0]["nextval"])]
        elif retry and (yield from _present(stmts, reserved.ids, queue)):
            return reserved.ids[0]
        job_id = reserved.ids[0]
        params = {
            "id": job_id,
            "queue": queue,
            "payload": payload,
            "priority": priority,
            "run_at": run_at,
            "max_attempts": max_attempts,
            "task": task,
            "meta": meta,
            "concurrency_key": concurrency_key,
            "concurrency": concurrency,
            "rate_key": rate_key,
            "rate_every": rate_every,
            "schema": stmts.schema,
        }
        try:
            limited = concurrency_key is not None or rate_key is not None
            rows = yield Execute(
                stmts.enqueue_one_limited if limited else stmts.enqueue_one, params
            )
        except pgerrors.UniqueViolation as exc:
            if not _is_id_collision(exc):
                raise
            if (yield from _taken(stmts, reserved.ids, queue, retry)):
                return job_id
            reserved.ids = None
            continue
        spares.append((int(rows[0]["spare"]), time.monotonic()))
        return job_id
    raise SkiplockError("enqueue: the reserved job ids kept colliding with other rows")


SPARE_MAX_AGE = 1.0


def _is_id_collision(exc: pgerrors.UniqueViolation) -> bool:
    """A duplicate job id: the primary key of jobs, reported by the partition's index
    (``jobs_g2_pkey``, say) since migration 0009."""
    name = exc.diag.constraint_name or ""
    return name.startswith("jobs_") and name.endswith("pkey")


def _fresh_spare(spares: list[tuple[int, float]]) -> int | None:
    while True:
        try:
            spare, at = spares.pop()
        except IndexError:
            return None
        if time.monotonic() - at <= SPARE_MAX_AGE:
            return spare


def _taken(stmts: Statements, ids: Sequence[int], queue: str, retry: bool) -> Op[set[int]]:
    """After a duplicate id: our ids that hold our rows (empty: take new ids).

    On a retry, our lost attempt may have been still running when we looked and have
    committed since (the primary key made this send wait for it).  Otherwise, or if
    the rows are not ours, the ids were handed out twice: after a failover that lost
    the old primary's last WAL the sequence went back (or a spare from before it).
    """
    if not retry:
        return set()
    return (yield from _present(stmts, ids, queue))


def _copy_step(
    stmts: Statements,
    ids: Sequence[int],
    queue: str,
    payloads: Sequence[str],
    priority: int,
    max_attempts: int,
    task: str | None,
    meta: str | None,
    run_at: datetime | None,
    concurrency_keys: Sequence[str | None] | None = None,
    concurrency: int | None = None,
    rate_keys: Sequence[str | None] | None = None,
    rate_every: float | None = None,
) -> Copy:
    if rate_keys is not None:
        # Rate-limited jobs (migration 0020) have COPYs of their own: each row takes its
        # key's next slot in the insert trigger, in row order.
        ckeys = concurrency_keys if concurrency_keys is not None else [None] * len(ids)
        rows = [
            (
                i,
                queue,
                p,
                priority,
                max_attempts,
                task,
                meta,
                k,
                None if k is None else concurrency,
                rk,
                None if rk is None else rate_every,
            )
            for i, p, k, rk in zip(ids, payloads, ckeys, rate_keys, strict=True)
        ]
        if run_at is None:
            return Copy(stmts.copy_jobs_rate, rows)
        return Copy(stmts.copy_jobs_rate_at, [(*r, run_at) for r in rows])
    if concurrency_keys is not None:
        # Jobs with concurrency keys (migration 0018) have COPYs of their own, so that
        # jobs without send what they always did.
        limits = [None if k is None else concurrency for k in concurrency_keys]
        if run_at is None:
            return Copy(
                stmts.copy_jobs_concurrency,
                [
                    (i, queue, p, priority, max_attempts, task, meta, k, c)
                    for i, p, k, c in zip(ids, payloads, concurrency_keys, limits, strict=True)
                ],
            )
        return Copy(
            stmts.copy_jobs_concurrency_at,
            [
                (i, queue, p, priority, max_attempts, task, meta, k, c, run_at)
                for i, p, k, c in zip(ids, payloads, concurrency_keys, limits, strict=True)
            ],
        )
    if run_at is None:
        return Copy(
            stmts.copy_jobs,
            [
                (i, queue, p, priority, max_attempts, task, meta)
                for i, p in zip(ids, payloads, strict=True)
            ],
        )
    return Copy(
        stmts.copy_jobs_at,
        [
            (i, queue, p, priority, max_attempts, task, meta, run_at)
            for i, p in zip(ids, payloads, strict=True)
        ],
    )


def _present(stmts: Statements, ids: Sequence[int], queue: str) -> Op[set[int]]:
    """Which of our reserved ids hold rows of our queue."""
    rows = yield Execute(stmts.enqueued_ids, {"ids": list(ids), "queue": queue})
    return {int(r["id"]) for r in rows}


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
    rows = cast(list[ClaimedRow], (yield Execute(stmts.claim, params, claimed_rows)))
    if rows and rows[0][1]:  # a limited queue
        if own_transaction:
            yield Execute(sql.SQL("BEGIN"))
        yield Execute(stmts.lock_queue, {"queue": queue})
        rows = cast(list[ClaimedRow], (yield Execute(stmts.claim_limited, params, claimed_rows)))
        if own_transaction:
            yield Execute(sql.SQL("COMMIT"))
    jobs = [job for job, _ in rows if job is not None]
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

    A list in ``params`` as long as ``jobs`` holds one value per job (results, errors,
    delays).  The jobs go to the server in id order, their values with them: each
    statement locks its rows in the order of its arrays, and a worker's heartbeat and
    its writer may name the same jobs at once.  In two orders each could hold a row the
    other waits for, a deadlock that PostgreSQL breaks only after ``deadlock_timeout``
    (1 s), failing one of them (tests/integration/test_fence_order.py).
    """
    if action not in _OUTCOMES:
        raise ValueError(f"not a fenced action: {action}")
    result = FenceResult()
    if not jobs:
        return result
    for job in jobs:
        if job.lease_token is None:
            raise ValueError(f"job {job.id} carries no lease token; it was not claimed")
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].id)
    values = {
        k: [v[i] for i in order] if isinstance(v, list) and len(v) == len(jobs) else v
        for k, v in (params or {}).items()
    }
    jobs = [jobs[i] for i in order]
    ids = [j.id for j in jobs]
    tokens = [j.lease_token for j in jobs]
    rows = yield Execute(getattr(stmts, action), {"ids": ids, "tokens": tokens, **values})
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


def resumed(op: Op[T], rows: list[Row]) -> Op[T]:
    """``op`` past its first step, which ``rows`` answered: the rest, for a driver to
    run as any other op (errors it throws in reach ``op`` too).

    For a driver that sends the first steps of several ops together (a pipeline) and
    then lets each op go on alone.
    """
    try:
        step = op.send(rows)
        while True:
            try:
                answer = yield step
            except Exception as exc:
                step = op.throw(exc)
            else:
                step = op.send(answer)
    except StopIteration as stop:
        return cast(T, stop.value)
