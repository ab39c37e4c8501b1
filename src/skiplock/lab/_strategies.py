"""Claim strategies behind one interface, so the race and the replay can compare them by name.

A strategy is data: the statements of one claim transaction (``steps``), optionally the
statements that end a job inside that same transaction (``finish``, for ``hold-lock``),
an isolation level, and whether a serialization failure is retried.  Every strategy runs
on skiplock's own ``jobs`` table in a scratch schema migrated by the core, so they all
see the same table shape; the lab's statements live in ``sql/strategies.sql`` and the
``skip-locked`` strategy is the core's own claim statement, untouched.

Names: ``naive``, ``select-then-update``, ``for-update``, ``skip-locked`` (the default),
``serializable``, ``advisory``, ``hold-lock``; see :data:`STRATEGIES`.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import IsolationLevel, sql
from psycopg import errors as pgerrors

from skiplock import Queue
from skiplock.sqlfiles import load_named, statements

from ._steps import Query

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "ClaimContext",
    "ClaimOutcome",
    "ClaimStep",
    "Strategy",
    "claim_transaction",
    "custom_strategy",
    "get_strategy",
    "lab_statement",
    "run_steps",
    "scratch_schema",
    "seed_scratch",
]

DEFAULT_STRATEGY = "skip-locked"
QUEUE = "default"

ParamsFn = Callable[["ClaimContext", Sequence[int]], Mapping[str, Any]]


@functools.cache
def _lab_texts() -> dict[str, str]:
    return load_named("skiplock.lab", "sql", "strategies.sql")


def lab_statement(name: str, schema: str) -> sql.Composed:
    """Render the lab statement ``name`` for ``schema`` (a quoted identifier, never text).

    Parameters
    ----------
    name
        A ``-- name:`` header of ``sql/strategies.sql``.
    schema
        The scratch schema holding skiplock's ``jobs`` table.

    Returns
    -------
    psycopg.sql.Composed
        The statement, ready for ``cursor.execute`` with its parameters.
    """
    return sql.SQL(_lab_texts()[name]).format(schema=sql.Identifier(schema))


@dataclass(frozen=True)
class ClaimContext:
    """What one claim knows about its caller: the values its statements bind."""

    worker: str
    limit: int = 10
    queue: str = QUEUE
    lease: float = 300.0

    def params(self, ids: Sequence[int] = ()) -> dict[str, Any]:
        """The named parameters every lab statement may use."""
        return {
            "worker": self.worker,
            "limit": self.limit,
            "queue": self.queue,
            "lease": self.lease,
            "ids": list(ids),
            # skiplock's claim may start at a position in claim order: here the head.
            "from_priority": None,
            "from_run_at": None,
            "from_id": None,
            "tasks": None,  # any job, with or without a task
        }


def _standard_params(ctx: ClaimContext, ids: Sequence[int]) -> Mapping[str, Any]:
    return ctx.params(ids)


@dataclass(frozen=True)
class ClaimStep:
    """One statement of a claim transaction.

    ``render`` turns a schema name into the statement; ``params`` builds its parameters
    from the claim context and the ids the previous step returned.
    """

    label: str
    render: Callable[[str], Query]
    params: ParamsFn = _standard_params
    # The result column holding the job keys; None: ``id``, else the first column.
    id_column: str | None = None


@dataclass(frozen=True)
class Strategy:
    """A claim strategy: the statements of one claim and how its transaction runs.

    Attributes
    ----------
    name
        The name ``skiplock race --strategy`` takes.
    summary
        One line for help texts and reports.
    steps
        Run in order in one transaction; the last step's ``id`` column is the claim.
    finish
        Run in the claim's transaction after the work (``hold-lock`` only): the job ends
        in the transaction that claimed it.
    isolation
        The claim transaction's isolation level; None is the server default (READ
        COMMITTED unless configured otherwise).
    retry_serialization
        Retry the whole claim transaction on a serialization failure, counting retries.
    safe
        Whether the strategy is expected never to hand one job to two claimers.
    """

    name: str
    summary: str
    steps: tuple[ClaimStep, ...]
    finish: tuple[ClaimStep, ...] = ()
    isolation: IsolationLevel | None = None
    retry_serialization: bool = False
    safe: bool = True

    @property
    def holds_lock(self) -> bool:
        """True when the job runs inside the claim transaction (no lease)."""
        return bool(self.finish)

    def begin_sql(self) -> str:
        """The BEGIN statement that opens this strategy's claim transaction."""
        if self.isolation is None:
            return "BEGIN"
        return "BEGIN ISOLATION LEVEL " + self.isolation.name.replace("_", " ")


def _lab(name: str) -> Callable[[str], Query]:
    return functools.partial(lab_statement, name)


def _core_claim(schema: str) -> Query:
    # skiplock's own claim, exactly the statement Queue.claim runs.
    return statements(schema).claim


_NAIVE = (ClaimStep("claim", _lab("naive_claim")),)

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "naive",
            "UPDATE ... WHERE id IN (SELECT ... LIMIT n): the postmortem's double claim",
            _NAIVE,
            safe=False,
        ),
        Strategy(
            "select-then-update",
            "SELECT pending ids, then UPDATE them by id, in one transaction",
            (
                ClaimStep("select", _lab("select_pending")),
                ClaimStep("update", _lab("update_by_ids")),
            ),
            safe=False,
        ),
        Strategy(
            "for-update",
            "CTE with plain FOR UPDATE: correct, but claimers wait on each other",
            (ClaimStep("claim", _lab("for_update_claim")),),
        ),
        Strategy(
            "skip-locked",
            "skiplock's claim: FOR UPDATE SKIP LOCKED, status re-checked, leased",
            (ClaimStep("claim", _core_claim),),
        ),
        Strategy(
            "serializable",
            "the naive claim under SERIALIZABLE, retried on serialization failure",
            _NAIVE,
            isolation=IsolationLevel.SERIALIZABLE,
            retry_serialization=True,
        ),
        Strategy(
            "advisory",
            "pg_try_advisory_xact_lock on ordered candidates, status re-checked",
            (ClaimStep("claim", _lab("advisory_claim")),),
        ),
        Strategy(
            "hold-lock",
            "SELECT ... FOR UPDATE SKIP LOCKED, transaction open while the job runs",
            (ClaimStep("claim", _lab("hold_lock_claim")),),
            finish=(ClaimStep("finish", _lab("hold_lock_finish")),),
        ),
    )
}


def get_strategy(name: str) -> Strategy:
    """Look a strategy up by name.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the known ones.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        known = ", ".join(STRATEGIES)
        raise ValueError(f"unknown strategy {name!r}; choose from: {known}") from None


def custom_strategy(
    statement: Query,
    *,
    name: str = "custom",
    params: Mapping[str, Any] | None = None,
    isolation: IsolationLevel | None = None,
    retry_serialization: bool = False,
) -> Strategy:
    """Wrap one raw claim statement (a user's, say) as a single-step strategy.

    Parameters
    ----------
    statement
        The claim.  A ``str`` is a ``psycopg.sql`` template: ``{schema}`` becomes the
        scratch schema as a quoted identifier, so literal braces must be doubled.  A
        composed statement or ``bytes`` is used as is.
    name
        Shown in timelines and reports.
    params
        Extra parameters, merged over the standard ones (``worker``, ``limit``,
        ``queue``, ``lease``, ``ids``); the statement may use any of them by name.
    isolation, retry_serialization
        As in :class:`Strategy`.

    Returns
    -------
    Strategy
        Its ``safe`` flag is False: a custom claim earns nothing on trust.
    """
    extra = dict(params or {})

    def render(schema: str) -> Query:
        if isinstance(statement, str):
            return sql.SQL(statement).format(schema=sql.Identifier(schema))
        return statement

    def bind(ctx: ClaimContext, ids: Sequence[int]) -> Mapping[str, Any]:
        return {**ctx.params(ids), **extra}

    return Strategy(
        name,
        "custom claim statement",
        (ClaimStep("claim", render, bind),),
        isolation=isolation,
        retry_serialization=retry_serialization,
        safe=False,
    )


# -- running a claim ------------------------------------------------------------------


def ids_of(cur: psycopg.Cursor[Any], column: str | None = None) -> list[int]:
    """The ``column`` of the rows a claim returned (default ``id``, else the first column)."""
    if cur.description is None:
        return []
    names = [c.name for c in cur.description]
    if column is not None and column in names:
        col = names.index(column)
    else:
        col = names.index("id") if "id" in names else 0
    # A NULL id claimed nothing: skiplock's own claim answers with one such row when it
    # takes no job, to carry the queue's settings (pause, limits) back to the caller.
    return [int(row[col]) for row in cur.fetchall() if row[col] is not None]


def run_steps(
    conn: psycopg.Connection[Any],
    steps: Sequence[ClaimStep],
    schema: str,
    ctx: ClaimContext,
    ids: Sequence[int] = (),
) -> list[int]:
    """Run ``steps`` in order on ``conn`` (in whatever transaction it is in).

    Each step's parameters see the ids the previous step returned; the ids of the last
    step are returned.
    """
    current = list(ids)
    with conn.cursor() as cur:
        for step in steps:
            cur.execute(step.render(schema), step.params(ctx, current))
            current = ids_of(cur, step.id_column)
    return current


@dataclass
class ClaimOutcome:
    """What one claim transaction did: the ids it took and what it cost."""

    ids: list[int]
    retries: int = 0
    latency: float = 0.0
    deadlocks: int = 0


def claim_transaction(
    conn: psycopg.Connection[Any],
    strategy: Strategy,
    schema: str,
    ctx: ClaimContext,
    *,
    work: Callable[[list[int]], None] | None = None,
    max_retries: int = 1000,
) -> ClaimOutcome:
    """Run one whole claim transaction of ``strategy`` on ``conn`` and commit it.

    Parameters
    ----------
    conn
        An autocommit connection with no transaction open; the claim opens its own with
        the strategy's isolation level.
    strategy, schema, ctx
        What to run, on which scratch schema, with which worker name and batch size.
    work
        Called with the claimed ids.  For a ``hold-lock`` strategy it runs inside the
        claim transaction, before the ``finish`` statements; otherwise it is not called
        here (the caller works after the commit, outside any transaction).
    max_retries
        Serialization failures (``retry_serialization`` only) and deadlocks retried
        before giving up.

    Returns
    -------
    ClaimOutcome
        ``latency`` is the time from the first BEGIN to the committed claim (for a
        hold-lock strategy, to the claim statement's return); ``retries`` counts
        serialization failures, ``deadlocks`` the deadlocks the server broke.
    """
    retries = deadlocks = 0
    start = time.perf_counter()
    while True:
        latency = 0.0
        try:
            # The isolation level is applied when psycopg sends BEGIN, so it is restored
            # on every exit path; a plain `SET TRANSACTION` would need one per attempt.
            conn.isolation_level = strategy.isolation
            with conn.transaction():
                ids = run_steps(conn, strategy.steps, schema, ctx)
                if strategy.holds_lock:
                    latency = time.perf_counter() - start
                    if work is not None and ids:
                        work(ids)
                    if ids:
                        run_steps(conn, strategy.finish, schema, ctx, ids)
            if not strategy.holds_lock:
                latency = time.perf_counter() - start
            return ClaimOutcome(ids, retries, latency, deadlocks)
        except pgerrors.SerializationFailure:
            if not strategy.retry_serialization or retries >= max_retries:
                raise
            retries += 1
        except pgerrors.DeadlockDetected:
            # Claims that update overlapping rows in different orders (naive,
            # select-then-update) deadlock now and then; the server already aborted one
            # of them, and a worker would simply claim again.
            if deadlocks >= max_retries:
                raise
            deadlocks += 1
        finally:
            conn.isolation_level = None


# -- scratch schemas ------------------------------------------------------------------


def seed_scratch(
    dsn: str, schema: str, jobs: int, *, application_name: str = "skiplock-lab"
) -> None:
    """(Re)create ``schema`` as a fresh skiplock schema holding ``jobs`` pending jobs.

    Uses only the core's public API (``Queue.migrate``, ``Queue.enqueue_many``); any
    previous schema of that name is dropped first.  Job ids run 1..``jobs`` in claim
    order, so a replay's "jobs 1, 2, 3" are the first three claims.
    """
    with psycopg.connect(dsn, autocommit=True, application_name=application_name) as conn:
        conn.execute(lab_statement("drop_schema", schema))
    with Queue(dsn, schema=schema, application_name=application_name, max_size=1) as q:
        q.migrate()
        if jobs > 0:
            q.enqueue_many([{"n": n} for n in range(1, jobs + 1)], queue=QUEUE)
    with psycopg.connect(dsn, autocommit=True, application_name=application_name) as conn:
        conn.execute(lab_statement("analyze_jobs", schema))


def drop_scratch(dsn: str, schema: str, *, terminate_prefix: str | None = None) -> None:
    """Drop ``schema``; first end sessions whose application_name starts with the prefix."""
    with psycopg.connect(dsn, autocommit=True, application_name="skiplock-lab") as conn:
        if terminate_prefix:
            conn.execute(lab_statement("terminate_sessions", schema), {"prefix": terminate_prefix})
        conn.execute(lab_statement("drop_schema", schema))


@contextmanager
def scratch_schema(
    dsn: str, jobs: int, *, schema: str | None = None, keep: bool = False
) -> Iterator[str]:
    """A seeded scratch skiplock schema for the block, dropped afterwards.

    Parameters
    ----------
    dsn
        Where to create it.
    jobs
        How many pending jobs to seed (ids 1..jobs).
    schema
        Its name; default ``skiplock_lab_<random>``.
    keep
        Leave it in place afterwards (for inspection).

    Yields
    ------
    str
        The schema name, for ``lab_statement`` or a raw ``{schema}.jobs`` claim.
    """
    name = schema or f"skiplock_lab_{uuid.uuid4().hex[:10]}"
    seed_scratch(dsn, name, jobs)
    try:
        yield name
    finally:
        if not keep:
            drop_scratch(dsn, name, terminate_prefix=f"skiplock-lab:{name}")
