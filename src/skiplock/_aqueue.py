"""AsyncQueue: the asyncio driver of skiplock's I/O-free operations.

This file is the source of both drivers: ``scripts/async_to_sync.py`` turns it into
``_queue.py`` (``Queue``) by dropping ``async``/``await`` and renaming the async
primitives.  Code under ``if ASYNC:`` exists only here; its ``else:`` branch only in the
sync copy.  Edit this file, then run ``scripts/async_to_sync.py``; CI checks that the
generated file is current.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from datetime import datetime, timedelta
from time import monotonic
from types import TracebackType
from typing import Any, Final, TypeVar, cast

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from . import _control, _migrate, _ops
from ._base import (
    ConnectionSource,
    MakeOp,
    QueueBase,
    QueueSettings,
    backoff,
    give_up,
    idle_connection_suspect,
    reconnect_delay,
    stale_plan,
    translate_error,
    unavailable,
)
from ._config import RetryPolicy
from ._control import JobInfo, QueueConfig, RetryReport
from ._errors import DatabaseUnavailable
from ._job import Job
from ._ops import ClaimPosition, Copy, Execute, FenceResult, Op, resumed
from ._sql import channel_name

__all__ = ["AsyncQueue", "arun_op", "arun_together"]

ASYNC: Final = True  # mypy: always_true; the sync copy keeps the else branches

T = TypeVar("T")


async def _run_step(cur: psycopg.AsyncCursor[Any], step: Execute | Copy) -> list[Any]:
    if isinstance(step, Execute):
        cur.row_factory = step.rows or dict_row
        await cur.execute(step.query, step.params)
        return await cur.fetchall() if cur.description is not None else []
    async with cur.copy(step.query) as copy:
        for row in step.rows:
            await copy.write_row(row)
    return []


async def arun_op(conn: psycopg.AsyncConnection[Any], op: Op[T]) -> T:
    """Drive an I/O-free operation to completion on ``conn``."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        step = next(op)
        while True:
            try:
                rows = await _run_step(cur, step)
            except (psycopg.errors.UniqueViolation, psycopg.errors.NoDataFound) as exc:
                # The op may know what a duplicate means (an enqueue's retry whose lost
                # attempt committed meanwhile), or a missing parent (enqueue_graph); if
                # not, it raises it again.
                step = op.throw(exc)
            else:
                step = op.send(rows)
    except StopIteration as stop:
        return cast(T, stop.value)
    finally:
        await cur.close()


def _own_transaction(conn: psycopg.AsyncConnection[Any]) -> Any:
    """Nothing on an autocommit connection, whose pipeline is its transaction (see the
    function below); else an explicit transaction, so that the statements still
    commit together and at once."""
    return nullcontext() if conn.autocommit else conn.transaction()


async def arun_together(
    conn: psycopg.AsyncConnection[Any], complete: Op[FenceResult], claim: Op[list[Job]]
) -> tuple[FenceResult, list[Job]]:
    """The first statement of each operation in one transaction, sent in one pipeline
    (one round trip, one commit); each operation's further steps, if it has any, run
    after the commit on the same connection, one at a time.

    On an autocommit connection (the pool's, a worker's lane) the transaction is the
    pipeline's own: the server runs every statement up to the pipeline's one Sync as one
    implicit transaction, committed at the Sync, or rolled back whole if a statement
    fails.  psycopg's ``transaction()`` inside a pipeline adds a BEGIN, and at its end a
    COMMIT and a Sync of its own before the pipeline's: four round trips where one does
    (strace: 8 sends and 4 receives against 3 and 1), and three times the client CPU.
    """
    ops: list[Op[Any]] = [complete, claim]
    steps = [next(op) for op in ops]
    cursors = [conn.cursor(row_factory=dict_row) for _ in ops]
    try:
        async with conn.pipeline(), _own_transaction(conn):
            for cur, step in zip(cursors, steps, strict=True):
                assert isinstance(step, Execute)
                cur.row_factory = step.rows or dict_row
                await cur.execute(step.query, step.params)
        out: list[Any] = []
        for op, cur in zip(ops, cursors, strict=True):
            rows = await cur.fetchall() if cur.description is not None else []
            out.append(await arun_op(conn, resumed(op, rows)))
        return out[0], out[1]
    finally:
        for cur in cursors:
            await cur.close()


def _areconnecting(closing: threading.Event) -> type[psycopg.AsyncConnection[Any]]:
    """A connection class for the pool whose ``connect`` retries on the lanes' schedule.

    psycopg_pool retries a failed connect after 1 s, then 2, 4, 8 s
    (``AttemptWithBackoff.INITIAL_DELAY``, a class constant shared by every pool in the
    process, so not ours to change): after a server restart a producer waited up to
    ~5 s past the server's return.  ``connection_class`` is the pool's public hook
    into how a connection is made, so the retrying happens inside ``connect``: at once,
    then 25 ms doubling to 0.25 s (``reconnect_delay``), until it works or the queue
    closes.  The pool's own backoff then never starts, and a caller waiting for a
    connection gets the first one the server accepts.  A wrong password or database
    still fails fast in ``open()``, which connects directly first.
    """

    class Reconnecting(psycopg.AsyncConnection[Any]):
        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
            failures = 0
            while True:
                try:
                    return await super().connect(conninfo, **kwargs)
                except psycopg.OperationalError:
                    failures += 1
                    if closing.is_set():
                        raise
                    await asyncio.sleep(reconnect_delay(failures))

    return Reconnecting


class AsyncQueue(QueueBase):
    """A skiplock queue on one Postgres schema, over a connection pool.

    ``Queue`` is safe to share between threads and opens on creation; ``AsyncQueue``
    is its asyncio twin: create it, then ``await q.open()`` (or ``async with``).

    Parameters
    ----------
    dsn
        libpq URL or key=value string.  None: ``SKIPLOCK_DSN``, else ``DATABASE_URL``,
        else a private embedded PostgreSQL started on demand.
    schema
        The Postgres schema holding skiplock's tables (quoted as an identifier).
    application_name
        Shown in ``pg_stat_activity``; workers set ``skiplock-worker:<name>``.
    max_size
        Connections in the pool.
    check_connections
        Before lending a pooled connection, check (with a zero-timeout select, and
        a round trip only if the server sent something while it was idle) that the
        server has not closed it, so an enqueue is not lost to a dead connection.
    open
        ``Queue`` only: connect at once (the default).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "skiplock",
        application_name: str = "skiplock",
        min_size: int = 1,
        max_size: int = 10,
        max_payload_bytes: int = 1 << 20,
        retry_policy: RetryPolicy | None = None,
        connect_timeout: float = 10.0,
        check_connections: bool = True,
        pooler: bool = False,
        open: bool = not ASYNC,
    ) -> None:
        self._configure(
            dsn,
            schema=schema,
            application_name=application_name,
            min_size=min_size,
            max_size=max_size,
            max_payload_bytes=max_payload_bytes,
            retry_policy=retry_policy,
            connect_timeout=connect_timeout,
            check_connections=check_connections,
            pooler=pooler,
        )
        self._pool: AsyncConnectionPool | ConnectionSource | None = None
        if ASYNC:
            if open:
                raise ValueError("AsyncQueue opens in an event loop: await q.open()")
        elif open:
            self.open()

    @classmethod
    def from_settings(
        cls,
        settings: QueueSettings,
        *,
        min_size: int = 1,
        max_size: int = 4,
        check_connections: bool = False,
        connections: ConnectionSource | None = None,
    ) -> AsyncQueue:
        """A queue with ``settings``, as workers build their own (``Queue``: open).

        ``connections``: lend connections from this instead of a pool of our own (a
        worker's lane, which reconnects on skiplock's schedule).
        """
        q = cls.__new__(cls)
        q._init_base(settings)
        q._min_size, q._max_size, q._check = min_size, max(max_size, min_size), check_connections
        q._pool = connections
        if connections is not None:
            pass  # open already: the source connects on first use
        elif ASYNC:
            pass  # an AsyncQueue opens in the event loop: await q.open()
        else:
            q.open()
        return q

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self) -> None:
        """Connect (fail fast with a clear error) and start the pool."""
        if self._pool is not None:
            return
        s = self.settings
        try:
            # One direct connection first: the pool would only say "timed out", while
            # libpq's own message says why (refused, bad password, no such database).
            conn = await psycopg.AsyncConnection.connect(s.dsn, **s.connect_kwargs())
            await conn.close()
        except psycopg.Error as exc:
            raise unavailable(exc, s, "connect") from None
        self._closing = threading.Event()
        pool = AsyncConnectionPool(
            s.dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs=s.connect_kwargs(),
            check=self._check_pooled if self._check else None,
            connection_class=_areconnecting(self._closing),
            # Only reached when a connect fails while the queue closes (_areconnecting
            # retries until then); 0 would leave waiting callers parked.
            reconnect_timeout=300.0,
            name=f"skiplock-{s.application_name}",
            open=False,
        )
        await pool.open(wait=False)
        self._pool = pool

    async def _check_pooled(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The pool's check: ping only a connection ``idle_connection_suspect`` flags.

        A connection the server cut while idle means its idle siblings were most likely
        cut too (a restart, a failover).  The pool would find them one lend at a time
        and sleep 1 s after the second (its check loop's backoff); ``pool.check()``
        drops them all at once and starts their replacements, so the caller waits only
        for the first new connection.
        """
        try:
            if idle_connection_suspect(conn):
                await AsyncConnectionPool.check_connection(conn)
        except psycopg.Error:
            if isinstance(self._pool, AsyncConnectionPool):
                await self._pool.check()
            raise

    async def close(self) -> None:
        closing: threading.Event | None = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()  # the pool's connect retries stop, so its workers can exit
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def __aenter__(self) -> AsyncQueue:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def connection(self) -> Any:
        """Borrow a pooled connection (autocommit): ``with q.connection() as c``."""
        if self._pool is None:
            # Say how to open it: an AsyncQueue cannot connect in its constructor (no
            # event loop there), and a Queue is only unopened after close() or open=False.
            if ASYNC:
                how = "'async with AsyncQueue(...) as q:' or 'await q.open()'"
            else:
                how = "'with Queue(...) as q:' or 'q.open()'"
            raise DatabaseUnavailable(f"{type(self).__name__} is not open: use {how} first")
        return self._pool.connection(timeout=self.settings.connect_timeout)

    # -- the driver ----------------------------------------------------------------------

    @asynccontextmanager
    async def _writable(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection for a write, closed if the server refuses writes (or a
        prepared statement, after a migration).

        A demoted primary or a read-only server answers ReadOnlySqlTransaction.  The
        connection is closed (the pool makes a new one) so that, with a multi-host DSN
        and target_session_attrs=read-write, the caller's retry connects to the server
        that takes writes instead of trying this one again.
        """
        async with self.connection() as c:
            try:
                yield c
            except pgerrors.ReadOnlySqlTransaction:
                await c.close()
                raise
            except pgerrors.FeatureNotSupported as exc:
                # A migration added a column while this connection held a prepared
                # statement that returns the whole row: PostgreSQL refuses it for good.
                # A new connection prepares it anew; give_up retries on one.
                if stale_plan(exc):
                    await c.close()
                raise

    async def _execute(
        self,
        make_op: MakeOp,
        *,
        conn: psycopg.AsyncConnection[Any] | None = None,
        idempotent: bool = True,
        what: str = "query",
    ) -> Any:
        if conn is not None:
            # The caller's connection and transaction: their commit decides, their
            # error handling applies.
            try:
                return await arun_op(conn, make_op(False))
            except psycopg.Error as exc:
                mapped = translate_error(exc, self.settings)
                if mapped is not None:
                    raise mapped from None
                raise
        attempt = 0
        while True:
            sent = False
            try:
                async with self._writable() as c:
                    sent = True
                    return await arun_op(c, make_op(attempt > 0))
            except (PoolTimeout, psycopg.Error) as exc:
                attempt += 1
                fatal = give_up(
                    exc,
                    sent=sent,
                    idempotent=idempotent,
                    attempt=attempt,
                    settings=self.settings,
                    what=what,
                )
                if fatal is not None:
                    raise fatal from fatal.__cause__
            await asyncio.sleep(backoff(attempt))

    # -- schema --------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Create or upgrade the schema; returns the versions applied (idempotent)."""
        applied = await self._execute(
            lambda _after: _migrate.migrate_op(self.schema), idempotent=False, what="migrate"
        )
        return list(applied)

    # -- producers -----------------------------------------------------------------------

    async def enqueue(
        self,
        payload: Any,
        *,
        queue: str = "default",
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int = 5,
        idempotency_key: str | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        after: Sequence[int] | None = None,
        on_parent_failure: str = "cancel",
        concurrency_key: str | None = None,
        concurrency: int | None = None,
        rate_key: str | None = None,
        rate_every: float | None = None,
    ) -> int:
        """Add one job and return its id.

        ``priority``: lower runs first.  ``run_at``: not before this time.  With an
        ``idempotency_key``, a job already enqueued with that key in this queue is
        not duplicated (docs/tasks.md, "Unique jobs"): the key holds for as long as
        that job is kept, or with ``unique_for`` (seconds or a timedelta) while it is
        pending or running and that long after it finished.  ``on_conflict``:
        ``"return"`` its id if its payload (and task) are the same, else raise
        ``DuplicateJob``; ``"replace"`` its payload if it has not started; ``"raise"``
        always.  With ``conn``, the insert joins that connection's transaction and
        exists only if the caller commits.  ``task`` names the function that runs it
        (``App.task`` sets it; workers of an App claim only the tasks they know) and
        ``meta`` travels with it (a trace context).

        ``after``: ids of jobs this one waits for.  It is ``waiting`` (never claimed)
        until every one of them has finished, and is released in the transaction
        that finishes the last (docs/workflows.md).  When one of them fails or is
        cancelled, this job is cancelled with its waiting descendants
        (``on_parent_failure="cancel"``, the default), or runs all the same
        (``"run"``).  ``parent_results`` reads their outcomes.

        With a ``concurrency_key`` and ``concurrency=N``, at most N jobs of that key
        run at once across all workers; the others wait, status ``throttled``,
        unclaimed (docs/workflows.md, "Per-key concurrency").  Not yet with an
        ``idempotency_key`` or ``after``.

        With a ``rate_key`` and ``rate_every`` (seconds), the job takes the next free
        slot of that key, ``rate_every`` after the key's previous one, and does not
        run before it (docs/workflows.md, "Per-task rate limits").  Not yet with an
        ``idempotency_key`` or ``after``.
        """
        if after is not None:
            if idempotency_key is not None:
                raise ValueError("after cannot be combined with an idempotency_key")
            if concurrency_key is not None:
                raise ValueError("after cannot be combined with a concurrency_key (not yet)")
            if rate_key is not None:
                raise ValueError("after cannot be combined with a rate limit (not yet)")
            make_after = self._after_op(
                [payload],
                queue,
                priority,
                run_at,
                max_attempts,
                task,
                meta,
                after,
                on_parent_failure,
            )
            ids = await self._execute(make_after, conn=conn, what="enqueue")
            return int(ids[0])
        make = self._enqueue_op(
            payload,
            queue,
            priority,
            run_at,
            max_attempts,
            idempotency_key,
            task,
            meta,
            retryable=conn is None,
            unique_for=unique_for,
            on_conflict=on_conflict,
            concurrency_key=concurrency_key,
            concurrency=concurrency,
            rate_key=rate_key,
            rate_every=rate_every,
        )
        # Safe to send again after a lost reply: the key's unique index, or the id
        # reserved first (see _ops.Reserved).
        job_id = await self._execute(make, conn=conn, what="enqueue")
        return int(job_id)

    async def enqueue_many(
        self,
        payloads: Sequence[Any],
        *,
        queue: str = "default",
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int = 5,
        idempotency_keys: Sequence[str | None] | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
        task: str | None = None,
        meta: Mapping[str, Any] | None = None,
        unique_for: float | timedelta | None = None,
        on_conflict: str = "return",
        after: Sequence[int] | None = None,
        on_parent_failure: str = "cancel",
        concurrency_key: str | Sequence[str | None] | None = None,
        concurrency: int | None = None,
        rate_key: str | Sequence[str | None] | None = None,
        rate_every: float | None = None,
    ) -> list[int]:
        """Add many jobs with one COPY; returns their ids in order.

        With ``idempotency_keys`` (one per payload, None for none) each keyed job is
        deduplicated as ``enqueue`` does, against the jobs there and against the
        earlier rows of the batch; a conflict that raises enqueues none of them.
        ``after``, ``on_parent_failure``: as for ``enqueue``; every job of the batch
        waits for every job named (one statement, not a COPY).
        ``concurrency_key``/``concurrency``: as for ``enqueue``; one key for them all, or
        a sequence of one key (or None) per payload.  ``rate_key``/``rate_every``: the
        same; the jobs take consecutive slots of their keys, in order, in the one COPY.
        """
        if after is not None:
            if idempotency_keys is not None:
                raise ValueError("after cannot be combined with idempotency_keys")
            if concurrency_key is not None:
                raise ValueError("after cannot be combined with a concurrency_key (not yet)")
            if rate_key is not None:
                raise ValueError("after cannot be combined with a rate limit (not yet)")
            make_after = self._after_op(
                payloads,
                queue,
                priority,
                run_at,
                max_attempts,
                task,
                meta,
                after,
                on_parent_failure,
            )
            return list(await self._execute(make_after, conn=conn, what="enqueue_many"))
        make = self._enqueue_many_op(
            payloads,
            queue,
            priority,
            run_at,
            max_attempts,
            idempotency_keys,
            task,
            meta,
            unique_for=unique_for,
            on_conflict=on_conflict,
            concurrency_key=concurrency_key,
            concurrency=concurrency,
            rate_key=rate_key,
            rate_every=rate_every,
        )
        # Safe to send again after a lost reply: its ids are reserved first and a
        # retry looks for them before sending (see _ops.Reserved).
        ids = await self._execute(make, conn=conn, what="enqueue_many")
        return list(ids)

    async def _enqueue_graph(
        self,
        rows: Sequence[_ops.GraphRow],
        edges: Sequence[_ops.Edge],
        *,
        conn: psycopg.AsyncConnection[Any] | None = None,
        output: Any = None,
    ) -> list[int]:
        """Jobs and the edges between them, in one statement (the canvas's path)."""
        make = self._graph_op(rows, edges, output)
        return list(await self._execute(make, conn=conn, what="enqueue"))

    async def workflow(self, workflow_id: int) -> dict[str, Any] | None:
        """A workflow (a canvas deferred by ``skiplock.chain``, ``group``, ``chord``):
        ``id``, ``output`` (the job ids whose results make its result), ``created_at``
        and ``steps``, each a dict with ``id``, ``task``, ``status``, ``attempts``,
        ``max_attempts`` and ``last_error``, in the order written.  None: no such
        workflow."""
        got = await self._execute(self._workflow_op(workflow_id), what="workflow")
        return cast(dict[str, Any] | None, got)

    async def parent_results(self, job_id: int) -> list[dict[str, Any]]:
        """The jobs ``job_id`` waited for (its ``after``), in the order it named them:
        one dict each with ``id``, ``status``, ``result`` (the handler's return value,
        when the queue stores results) and ``last_error``.  A parent dropped by
        retention has ``status`` None.  A child calls it with its own ``job.id``."""
        return list(await self._execute(self._parents_op(job_id), what="parent_results"))

    # -- consumers -----------------------------------------------------------------------

    async def claim(
        self,
        *,
        worker: str,
        queue: str = "default",
        limit: int = 1,
        lease: float = 30.0,
        conn: psycopg.AsyncConnection[Any] | None = None,
        start: ClaimPosition | None = None,
        tasks: Sequence[str] | None = None,
    ) -> list[Job]:
        """Take up to ``limit`` due jobs, committed, each with a fresh lease token.

        A paused queue gives nothing; a queue with a concurrency or rate limit gives
        no more than the limit allows.  With ``conn`` the claim joins that connection's
        transaction and commits with it (the "hold the lock for the whole job"
        pattern); the caller owns errors.  ``start`` (priority, run_at, id) begins the
        scan at that place in claim order instead of the head: jobs sorting before it
        are not taken by this claim (the worker's ``ClaimCursor`` passes it).
        ``tasks``: take only jobs of these tasks (None: any job).
        """
        own = conn is None or conn.autocommit
        jobs = await self._execute(
            self._claim_op(worker, queue, limit, lease, own, start, tasks),
            conn=conn,
            what="claim",
        )
        return list(jobs)

    async def heartbeat(self, job: Job, *, lease: float = 30.0) -> datetime:
        """Extend the job's lease to now + ``lease``; returns the new expiry.

        A cancel asked since the last beat turns ``job.cancelled`` true.
        """
        result = await self.heartbeat_many([job], lease=lease)
        self._raise_if_lost(result, "heartbeat")
        return cast(datetime, result.done[job.id]["locked_until"])

    async def heartbeat_many(self, jobs: Sequence[Job], *, lease: float = 30.0) -> FenceResult:
        """Heartbeat many jobs in one statement; ``lost`` lists those no longer ours."""
        res: FenceResult = await self._execute(
            self._fenced_op("heartbeat", jobs, {"lease": float(lease)}), what="heartbeat"
        )
        return res

    async def complete(self, job: Job, result: Any = None) -> None:
        """Mark the job done, storing ``result`` (JSON) for ``wait``.

        A job whose cancel was asked ends ``cancelled`` instead.  Raises LeaseLost (and
        changes nothing) if the job is not ours, PayloadError (before any write) if the
        result cannot be stored.
        """
        self._raise_if_lost(await self.complete_many([(job, result)], _count=False), "complete")

    async def complete_many(
        self,
        items: Sequence[Job | tuple[Job, Any]],
        *,
        _count: bool = True,
        _recheck: bool = False,
    ) -> FenceResult:
        """Complete many jobs in one statement, each fenced by its own token.

        An item is a job, or ``(job, result)``.
        """
        jobs, params = self._complete_params(items)
        res: FenceResult = await self._execute(
            self._fenced_op("complete", jobs, params, recheck=_recheck), what="complete"
        )
        if _count:
            self._count_lost(len(res.lost))
        return res

    async def _complete_and_claim(
        self,
        items: Sequence[Job | tuple[Job, Any]],
        claim: MakeOp,
        *,
        recheck: bool = False,
    ) -> tuple[FenceResult, list[Job]]:
        """``complete_many(items)`` and ``claim`` (a ``_claim_op``) in one pipelined
        transaction: one round trip and one commit where apart there are two.

        Each statement is unchanged: the completion is fenced per job by its token, the
        claim takes rows with SKIP LOCKED and re-checks them, and both commit at once.
        What would follow either of them (the recheck after a lost reply, a limited
        queue's locked path) runs after the commit, as it would on its own.  Not retried
        here: if the call fails, neither happened (or, with a lost reply, both may have);
        the caller writes the batch again with ``recheck``, as after any failed write,
        and jobs claimed unseen come back when their leases run out, as after any claim
        whose reply was lost.  The workers' ``fuse_claims``.
        """
        jobs, params = self._complete_params(items)
        complete = self._fenced_op("complete", jobs, params, recheck)(False)
        async with self._writable() as conn:
            res, claimed = await arun_together(conn, complete, claim(False))
        self._count_lost(len(res.lost))
        return res, claimed

    async def fail(
        self, job: Job, error: str | None = None, *, retry: bool = True, delay: float | None = None
    ) -> str:
        """Record a failed attempt; returns the job's new status.

        With ``retry`` (the default) the job runs again after the retry policy's
        backoff (or ``delay``) while attempts remain, else it ends ``failed``.
        ``retry=False`` ends it ``failed`` at once.
        """
        result = await self.fail_many([(job, error, delay, retry)], _count=False)
        self._raise_if_lost(result, "fail")
        return str(result.done[job.id]["status"])

    async def fail_many(
        self,
        items: Sequence[tuple[Job, str | None, float | None, bool]],
        *,
        _count: bool = True,
        _recheck: bool = False,
    ) -> FenceResult:
        """``fail`` for many jobs in one statement: (job, error, delay or None, retry)."""
        jobs = [it[0] for it in items]
        res: FenceResult = await self._execute(
            self._fenced_op("fail", jobs, self._fail_params(items), _recheck), what="fail"
        )
        if _count:
            self._count_lost(len(res.lost))
        return res

    async def retry(self, job: Job, *, delay: float = 0.0, error: str | None = None) -> str:
        """Run the job again after ``delay`` seconds (the attempt counts)."""
        return await self.fail(job, error, retry=True, delay=delay)

    async def release(self, job: Job) -> None:
        """Give a claimed job back at once, and the attempt with it."""
        self._raise_if_lost(await self.release_many([job], _count=False), "release")

    async def release_many(self, jobs: Sequence[Job], *, _count: bool = True) -> FenceResult:
        """``release`` for many jobs in one statement."""
        res: FenceResult = await self._execute(self._fenced_op("release", jobs), what="release")
        if _count:
            self._count_lost(len(res.lost))
        return res

    # -- maintenance ---------------------------------------------------------------------

    async def sweep(self, *, limit: int = 1000, window: float | None = None) -> int:
        """Return jobs with expired leases to pending (or failed); returns how many.

        ``window``: look only at leases that ran out in the last that many seconds (a
        worker passes a little more than the time since its previous sweep, which took
        the older ones); None looks at all of them.
        """
        total = 0
        while True:
            rows = await self._execute(self._sweep_op(limit, window), what="sweep")
            total += len(rows)
            if len(rows) < limit:
                return total

    async def prune(
        self, *, older_than: float = 7 * 86400.0, limit: int = 1000, max_batches: int | None = None
    ) -> int:
        """Drop the days of finished jobs whose every job is older than ``older_than``
        seconds, with their idempotency keys; returns how many jobs went.

        Retention drops whole partitions (migration 0009), so a finished job is kept
        for ``older_than`` and at most a day more, and no row is deleted one by one.
        ``limit`` and ``max_batches`` are accepted for the callers of the row-by-row
        retention this replaced; they no longer change anything.
        """
        del limit, max_batches
        return int(await self._execute(self._prune_op(older_than), what="prune"))

    async def upkeep(self, *, max_steps: int = 50) -> dict[str, int]:
        """Rotate the generations of ``jobs`` and empty the ones no longer current.

        Each step is one short transaction (``upkeep()`` in migration 0009): a rotation,
        a batch of finished or delayed jobs moved out of an old generation, the
        truncation of an old generation found empty, the one ANALYZE a generation
        gets in its life (0011), without which completions read it whole, or the drop
        of a generation a backlog added once it is surplus (0014).  Steps run until
        there is nothing to do, another session holds the upkeep, a truncation or a
        drop would wait for a lock (``busy``), or ``max_steps``.  Workers call this at
        each sweep.  Returns the steps taken by kind, and ``jobs_moved``.
        """
        done: dict[str, int] = {}
        for _ in range(max_steps):
            rows = await self._execute(self._upkeep_op(), what="upkeep")
            if not rows:
                break
            action = str(rows[0]["action"])
            done[action] = done.get(action, 0) + 1
            if action == "moved":
                done["jobs_moved"] = done.get("jobs_moved", 0) + int(rows[0]["jobs"])
            if action == "busy":
                break
        return done

    async def get(self, job_id: int) -> Job | None:
        """The job's current row, or None."""
        return cast(Job | None, await self._execute(self._get_op(job_id), what="get"))

    # -- control -------------------------------------------------------------------------

    async def cancel(self, job_id: int) -> str:
        """Cancel a job; returns its status after the call.

        A pending job ends ``cancelled`` at once (``"cancelled"``).  A running job is
        asked to stop (``"running"``): its worker sees the request within a heartbeat
        (woken at once when it listens), ``job.cancelled`` turns true, and the job
        ends ``cancelled`` whatever the handler then reports.  UnknownJob for an id
        that does not exist, JobStateError for a job already finished.
        """
        return str(await self._execute(self._cancel_op(job_id), what="cancel"))

    async def pause(self, queue: str) -> None:
        """Stop every worker claiming from ``queue`` at its next claim (no restart).

        Running jobs go on.  UnknownQueue for a queue with no jobs and no settings.
        """
        await self._execute(self._pause_op(queue, True), what="pause")

    async def resume(self, queue: str) -> None:
        """Undo ``pause``: workers claim from ``queue`` again at their next poll."""
        await self._execute(self._pause_op(queue, False), what="resume")

    async def configure_queue(
        self,
        queue: str,
        *,
        concurrency_limit: int | None = None,
        rate_limit: float | None = None,
        rate_burst: float | None = None,
        store_results: bool | None = None,
        clear_concurrency_limit: bool = False,
        clear_rate_limit: bool = False,
        create: bool = True,
    ) -> QueueConfig:
        """Set a queue's limits, held in Postgres for every worker on every host.

        Parameters
        ----------
        concurrency_limit
            At most this many jobs of the queue running at once, across all workers.
        rate_limit
            At most this many jobs started per second (a token bucket of
            ``rate_burst`` jobs, default one second's worth and at least 1).
        store_results
            Keep handlers' return values (default on).
        clear_concurrency_limit, clear_rate_limit
            Remove a limit.  None leaves a setting as it is.
        create
            Set up a queue that has no jobs and no settings yet (the default: limits
            belong in place before the first job).  False refuses such a name with
            UnknownQueue, like ``pause``: what ``skiplock limit`` does unless given
            ``--create``, since a typed name is more likely a typo.

        Raises
        ------
        ConfigError
            A limit that is not a positive number (before any write).
        UnknownQueue
            ``create=False`` and the queue has no jobs and no settings.
        """
        cfg = await self._execute(
            self._configure_op(
                queue,
                concurrency_limit,
                rate_limit,
                rate_burst,
                store_results,
                clear_concurrency_limit,
                clear_rate_limit,
                create,
            ),
            what="configure_queue",
        )
        return cast(QueueConfig, cfg)

    async def requeue(self, job_id: int) -> None:
        """Run a done, failed or cancelled job again, with fresh attempts (an operator's
        retry).  UnknownJob, or JobStateError for a pending or running job."""
        await self._execute(self._requeue_op(job_id), what="requeue")

    async def delete(self, job_id: int) -> None:
        """Delete a job that is not running.  UnknownJob, or JobStateError if running."""
        await self._execute(self._delete_op(job_id), what="delete")

    async def list_jobs(
        self,
        *,
        queue: str | None = None,
        status: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
    ) -> list[dict[str, Any]]:
        """Jobs newest first, filtered by queue and status; page with ``before_id``.

        Rows carry the job's columns but the payload and result (``get`` has them), and
        the first 200 characters of the last error as ``last_error_head``.
        """
        op = self._list_jobs_op(queue, status, limit, before_id)
        return list(await self._execute(op, what="list_jobs"))

    async def find_jobs(
        self,
        *,
        status: str | Sequence[str] | None = None,
        queue: str | None = None,
        task: str | None = None,
        since: datetime | timedelta | None = None,
        error: str | None = None,
        limit: int = 50,
        before_id: int | None = None,
    ) -> list[JobInfo]:
        """Jobs matching every filter given, newest first: ``q.find_jobs(status="failed")``.

        Parameters
        ----------
        status
            One status (``"failed"``) or several; None: any.
        queue, task
            The job's queue; its task name (``module.function`` for an App's task).
        since
            An aware datetime, or a timedelta meaning that long ago: jobs finished at
            or after it, and unfinished jobs created at or after it.
        error
            Text the job's ``last_error`` contains, ignoring case.
        limit
            At most this many rows (1 to 10,000).
        before_id
            Only ids below this one: the next page after a page whose last id it is.

        Returns
        -------
        list[JobInfo]
            Each job's state without payload or result (``get`` has them); ``.error`` is
            the exception line of ``last_error``.

        Raises
        ------
        ValueError, ConfigError
            A bad filter (an unknown status, a naive datetime), before any query.
        """
        op = self._find_jobs_op(status, queue, task, since, error, limit, before_id)
        return list(await self._execute(op, what="find_jobs"))

    async def retry_jobs(self, job_ids: Sequence[int]) -> RetryReport:
        """Run failed or cancelled jobs again: an operator's retry, by id.

        Each job becomes pending again, due at once, with ``attempts`` 0: a fresh budget
        of its ``max_attempts`` (a job with a concurrency key waits ``throttled`` for a
        free slot of its key first, as a new one would).  ``last_error`` is kept until
        the next attempt writes its own; ``finished_at``, ``started_at``, ``worker``,
        ``result`` and a cancel request are cleared.  The job keeps its id, payload,
        priority and idempotency key: no new job is made.  A job that is pending,
        running or done is refused and left as it is, and so is an unknown id;
        ``RetryReport.refused`` says why, per id.
        A retry racing another retry or a worker is safe: the status is checked on the
        locked row, so a job is retried once and claimed once.
        """
        report = await self._execute(self._retry_jobs_op(job_ids), what="retry_jobs")
        return cast(RetryReport, report)

    async def retry_failed(
        self,
        *,
        queue: str | None = None,
        task: str | None = None,
        since: datetime | timedelta | None = None,
    ) -> RetryReport:
        """Run every failed job matching the filters again, as ``retry_jobs`` does.

        ``since`` (an aware datetime, or a timedelta meaning that long ago) takes jobs
        that failed at or after it.  Cancelled jobs are not taken (retry them by id).
        Jobs go in batches of 500, in id order, each job at most once per call, even if
        it fails again meanwhile.
        """
        op = self._retry_failed_op(queue, task, since)
        return cast(RetryReport, await self._execute(op, what="retry_failed"))

    async def throughput(
        self, *, window: float = 3600.0, bucket: float = 60.0
    ) -> list[dict[str, Any]]:
        """Jobs finished per ``bucket`` seconds over the last ``window`` seconds:
        rows of queue, status, at (the bucket's start) and jobs."""
        op = self._throughput_op(window, bucket)
        return list(await self._execute(op, what="throughput"))

    async def queue_settings(self) -> list[QueueConfig]:
        """The settings of every queue that has any (pause, limits, results)."""
        return list(await self._execute(self._queues_op(), what="queue_settings"))

    async def wait(
        self, job_id: int, timeout: float | None = None, *, poll_interval: float = 1.0
    ) -> Any:
        """Wait for the job to finish and return its result (the handler's return value).

        Woken by LISTEN/NOTIFY when the job's final write commits, with a poll every
        ``poll_interval`` seconds as the fallback (behind a transaction pooler, say).
        Raises JobFailed (with the job's last error) or JobCancelled, UnknownJob for an
        unknown id, and TimeoutError when ``timeout`` seconds pass first.
        """
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be positive, not {poll_interval!r}")
        s = self.settings
        deadline = None if timeout is None else monotonic() + timeout
        try:
            conn = await psycopg.AsyncConnection.connect(s.dsn, **s.connect_kwargs())
        except psycopg.Error as exc:
            raise unavailable(exc, s, "wait") from None
        async with conn:
            try:
                if not s.pooler:  # LISTEN needs a session; a pooler gives none
                    channel = sql.Identifier(channel_name(s.schema))
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                row = await arun_op(conn, self._watch_op(job_id, True)(False))
                while True:
                    finished, result = _control.settle(row)
                    if finished:
                        return result
                    left = poll_interval if deadline is None else deadline - monotonic()
                    if left <= 0:
                        raise TimeoutError(f"job {job_id} did not finish within {timeout:g}s")
                    if s.pooler:
                        await asyncio.sleep(min(left, poll_interval))
                    else:
                        async for _note in conn.notifies(
                            timeout=min(left, poll_interval), stop_after=1
                        ):
                            pass
                    row = await arun_op(conn, self._watch_op(job_id, False)(False))
            except psycopg.Error as exc:
                mapped = translate_error(exc, s, "wait")
                if mapped is not None:
                    raise mapped from None
                raise unavailable(exc, s, "wait") from None

    async def status(self, *, attempts_alert: int = 3) -> list[dict[str, Any]]:
        """Counts per queue and status, oldest pending age, expired leases, high attempts."""
        rows = await self._execute(self._status_op(attempts_alert), what="status")
        return list(rows)

    async def unserved(self, *, alive: float = 30.0) -> list[dict[str, Any]]:
        """Due jobs whose task no worker seen in the last ``alive`` seconds serves.

        One row per queue and task: ``jobs`` and ``oldest_seconds``.  During a rolling
        deploy these are the new tasks' jobs waiting for a worker that knows them.
        """
        rows = await self._execute(self._unserved_op(alive), what="status")
        return list(rows)

    async def register_worker(
        self, name: str, *, queues: Sequence[str], tasks: Sequence[str] | None
    ) -> None:
        """Record (or refresh) what worker ``name`` serves; workers call it at each sweep."""
        await self._execute(self._worker_seen_op(name, queues, tasks), what="register worker")

    async def worker_waiting(self, name: str, waiting: bool) -> None:
        """Say whether worker ``name`` sleeps until an enqueue notifies it.

        Producers skip the NOTIFY (and the commit-time lock it takes) for a queue none
        of whose workers waits; workers call this when they turn idle or busy.
        """
        await self._execute(self._worker_waiting_op(name, waiting), what="worker waiting")

    async def unregister_worker(self, name: str) -> None:
        """Remove worker ``name``'s record (a clean stop)."""
        await self._execute(self._worker_gone_op(name), what="unregister worker")
