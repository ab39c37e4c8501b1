"""Queue: the synchronous driver of skiplock's operations, over a connection pool."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from . import _migrate
from ._base import (
    MakeOp,
    QueueBase,
    QueueSettings,
    backoff,
    give_up,
    idle_connection_suspect,
    translate_error,
    unavailable,
)
from ._config import RetryPolicy
from ._errors import DatabaseUnavailable
from ._job import Job
from ._ops import Copy, Execute, FenceResult, Op

__all__ = ["Queue", "run_op"]

T = TypeVar("T")


@contextmanager
def _translated(settings: QueueSettings) -> Iterator[None]:
    """skiplock's own errors from statements run outside ``_execute`` (the CLI prints
    those as one line; a raw driver error would be a traceback)."""
    try:
        yield
    except psycopg.Error as exc:
        mapped = translate_error(exc, settings)
        if mapped is None:
            raise
        raise mapped from None


def run_op(conn: psycopg.Connection[Any], op: Op[T]) -> T:
    """Drive an I/O-free operation to completion on ``conn``."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        step = next(op)
        while True:
            if isinstance(step, Execute):
                cur.execute(step.query, step.params)
                rows = cur.fetchall() if cur.description is not None else []
            else:
                assert isinstance(step, Copy)
                with cur.copy(step.query) as copy:
                    for row in step.rows:
                        copy.write_row(row)
                rows = []
            step = op.send(rows)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        cur.close()


def _check_idle_connection(conn: psycopg.Connection[Any]) -> None:
    """The pool's check: ping only a connection ``idle_connection_suspect`` flags."""
    if idle_connection_suspect(conn):
        ConnectionPool.check_connection(conn)


class Queue(QueueBase):
    """A skiplock queue on one Postgres schema.  Safe to share between threads.

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
    pooler
        The DSN points at a transaction pooler (PgBouncer ``pool_mode=transaction``):
        no server-side prepared statements, no session settings; workers poll
        instead of LISTEN.  See docs/pgbouncer.md.
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
        open: bool = True,
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
        self._pool: ConnectionPool | None = None
        if open:
            self.open()

    @classmethod
    def from_settings(
        cls,
        settings: QueueSettings,
        *,
        min_size: int = 1,
        max_size: int = 4,
        check_connections: bool = False,
    ) -> Queue:
        q = cls.__new__(cls)
        q._init_base(settings)
        q._min_size, q._max_size, q._check, q._pool = (
            min_size,
            max(max_size, min_size),
            check_connections,
            None,
        )
        q.open()
        return q

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Connect (fail fast with a clear error) and start the pool."""
        if self._pool is not None:
            return
        s = self.settings
        try:
            # One direct connection first: the pool would only say "timed out", while
            # libpq's own message says why (refused, bad password, no such database).
            psycopg.connect(s.dsn, **s.connect_kwargs()).close()
        except psycopg.Error as exc:
            raise unavailable(exc, s, "connect") from None
        pool = ConnectionPool(
            s.dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs=s.connect_kwargs(),
            check=_check_idle_connection if self._check else None,
            # Retry with backoff while callers wait; 0 gives up after two immediate tries
            # and leaves every waiting caller parked until its own timeout.
            reconnect_timeout=300.0,
            name=f"skiplock-{s.application_name}",
            open=False,
        )
        pool.open(wait=False)
        self._pool = pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Queue:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def connection(self) -> Any:
        """Borrow a pooled connection (autocommit), e.g. ``with q.connection() as c``."""
        if self._pool is None:
            raise DatabaseUnavailable("queue is closed")
        return self._pool.connection(timeout=self.settings.connect_timeout)

    # -- the driver ----------------------------------------------------------------------

    def _execute(
        self,
        make_op: MakeOp,
        *,
        conn: psycopg.Connection[Any] | None = None,
        idempotent: bool = True,
        what: str = "query",
    ) -> Any:
        if conn is not None:
            # The caller's connection and transaction: their commit decides, their
            # error handling applies.
            try:
                return run_op(conn, make_op(False))
            except psycopg.Error as exc:
                mapped = translate_error(exc, self.settings)
                if mapped is not None:
                    raise mapped from None
                raise
        attempt = 0
        while True:
            sent = False
            try:
                with self.connection() as c:
                    sent = True
                    return run_op(c, make_op(attempt > 0))
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
                    raise fatal  # noqa: B904 - give_up set the cause
            time.sleep(backoff(attempt))

    # -- schema --------------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Create or upgrade the schema; returns the versions applied (idempotent)."""
        with _translated(self.settings), self.connection() as conn:
            return _migrate.migrate(conn, self.schema)

    # -- producers -----------------------------------------------------------------------

    def enqueue(
        self,
        payload: Any,
        *,
        queue: str = "default",
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int = 5,
        idempotency_key: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> int:
        """Add one job and return its id.

        ``priority``: lower runs first.  ``run_at``: not before this time.  With an
        ``idempotency_key``, a job already enqueued with that key in this queue is
        not duplicated: its id is returned.  With ``conn``, the insert joins that
        connection's transaction and exists only if the caller commits.
        """
        make = self._enqueue_op(payload, queue, priority, run_at, max_attempts, idempotency_key)
        return int(
            self._execute(make, conn=conn, idempotent=idempotency_key is not None, what="enqueue")
        )

    def enqueue_many(
        self,
        payloads: Sequence[Any],
        *,
        queue: str = "default",
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int = 5,
        idempotency_keys: Sequence[str | None] | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[int]:
        """Add many jobs with one COPY; returns their ids in order."""
        make = self._enqueue_many_op(
            payloads, queue, priority, run_at, max_attempts, idempotency_keys
        )
        return list(self._execute(make, conn=conn, idempotent=False, what="enqueue_many"))

    # -- consumers -----------------------------------------------------------------------

    def claim(
        self,
        *,
        worker: str,
        queue: str = "default",
        limit: int = 1,
        lease: float = 30.0,
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[Job]:
        """Take up to ``limit`` due jobs, committed, each with a fresh lease token.

        With ``conn`` the claim joins that connection's transaction and commits with
        it (the "hold the lock for the whole job" pattern); the caller owns errors.
        """
        make = self._claim_op(worker, queue, limit, lease)
        return list(self._execute(make, conn=conn, what="claim"))

    def heartbeat(self, job: Job, *, lease: float = 30.0) -> datetime:
        """Extend the job's lease to now + ``lease``; returns the new expiry."""
        result = self.heartbeat_many([job], lease=lease)
        self._raise_if_lost(result, "heartbeat")
        return result.done[job.id]["locked_until"]  # type: ignore[no-any-return]

    def heartbeat_many(self, jobs: Sequence[Job], *, lease: float = 30.0) -> FenceResult:
        """Heartbeat many jobs in one statement; ``lost`` lists those no longer ours."""
        res: FenceResult = self._execute(
            self._fenced_op("heartbeat", jobs, {"lease": float(lease)}), what="heartbeat"
        )
        return res

    def complete(self, job: Job) -> None:
        """Mark the job done.  Raises LeaseLost (and changes nothing) if it is not ours."""
        self._raise_if_lost(self.complete_many([job], _count=False), "complete")

    def complete_many(
        self, jobs: Sequence[Job], *, _count: bool = True, _recheck: bool = False
    ) -> FenceResult:
        """Complete many jobs in one statement, each fenced by its own token."""
        res: FenceResult = self._execute(
            self._fenced_op("complete", jobs, recheck=_recheck), what="complete"
        )
        if _count:
            self._count_lost(len(res.lost))
        return res

    def fail(
        self, job: Job, error: str | None = None, *, retry: bool = True, delay: float | None = None
    ) -> str:
        """Record a failed attempt; returns the job's new status.

        With ``retry`` (the default) the job runs again after the retry policy's
        backoff (or ``delay``) while attempts remain, else it ends ``failed``.
        ``retry=False`` ends it ``failed`` at once.
        """
        result = self.fail_many([(job, error, delay, retry)], _count=False)
        self._raise_if_lost(result, "fail")
        return str(result.done[job.id]["status"])

    def fail_many(
        self,
        items: Sequence[tuple[Job, str | None, float | None, bool]],
        *,
        _count: bool = True,
        _recheck: bool = False,
    ) -> FenceResult:
        """``fail`` for many jobs in one statement: (job, error, delay or None, retry)."""
        jobs = [it[0] for it in items]
        res: FenceResult = self._execute(
            self._fenced_op("fail", jobs, self._fail_params(items), _recheck), what="fail"
        )
        if _count:
            self._count_lost(len(res.lost))
        return res

    def retry(self, job: Job, *, delay: float = 0.0, error: str | None = None) -> str:
        """Run the job again after ``delay`` seconds (the attempt counts)."""
        return self.fail(job, error, retry=True, delay=delay)

    def release(self, job: Job) -> None:
        """Give a claimed job back at once, and the attempt with it."""
        self._raise_if_lost(self.release_many([job], _count=False), "release")

    def release_many(self, jobs: Sequence[Job], *, _count: bool = True) -> FenceResult:
        res: FenceResult = self._execute(self._fenced_op("release", jobs), what="release")
        if _count:
            self._count_lost(len(res.lost))
        return res

    # -- maintenance ---------------------------------------------------------------------

    def sweep(self, *, limit: int = 1000) -> int:
        """Return jobs with expired leases to pending (or failed); returns how many."""
        total = 0
        while True:
            rows = self._execute(self._sweep_op(limit), what="sweep")
            total += len(rows)
            if len(rows) < limit:
                return total

    def prune(
        self, *, older_than: float = 7 * 86400.0, limit: int = 1000, max_batches: int | None = None
    ) -> int:
        """Delete finished jobs older than ``older_than`` seconds, ``limit`` rows at a time."""
        total, batches = 0, 0
        while max_batches is None or batches < max_batches:
            with _translated(self.settings), self.connection() as c:
                cur = c.execute(
                    self._stmts.prune, {"older_than": float(older_than), "limit": limit}
                )
                n = cur.rowcount
            total += n
            batches += 1
            if n < limit:
                break
        return total

    def get(self, job_id: int) -> Job | None:
        """The job's current row, or None."""
        return self._execute(self._get_op(job_id), what="get")  # type: ignore[no-any-return]

    def cancel(self, job_id: int) -> bool:
        """Cancel a pending or running job; a running job's worker then gets LeaseLost."""
        return bool(self._execute(self._cancel_op(job_id), what="cancel"))

    def status(self, *, attempts_alert: int = 3) -> list[dict[str, Any]]:
        """Counts per queue and status, oldest pending age, expired leases, high attempts."""
        with _translated(self.settings), self.connection() as c:
            cur = c.cursor(row_factory=dict_row)
            rows: list[dict[str, Any]] = cur.execute(
                self._stmts.status, {"attempts_alert": attempts_alert}
            ).fetchall()
            return rows
