"""AsyncQueue: the asyncio driver of the same I/O-free operations Queue runs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from ._base import (
    MakeOp,
    QueueBase,
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

__all__ = ["AsyncQueue", "arun_op"]

T = TypeVar("T")


async def arun_op(conn: psycopg.AsyncConnection[Any], op: Op[T]) -> T:
    """Drive an I/O-free operation to completion on an async connection."""
    cur = conn.cursor(row_factory=dict_row)
    try:
        step = next(op)
        while True:
            if isinstance(step, Execute):
                await cur.execute(step.query, step.params)
                rows = await cur.fetchall() if cur.description is not None else []
            else:
                assert isinstance(step, Copy)
                async with cur.copy(step.query) as copy:
                    for row in step.rows:
                        await copy.write_row(row)
                rows = []
            step = op.send(rows)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        await cur.close()


async def _acheck_idle_connection(conn: psycopg.AsyncConnection[Any]) -> None:
    """The async pool's check: ping only a connection ``idle_connection_suspect`` flags."""
    if idle_connection_suspect(conn):
        await AsyncConnectionPool.check_connection(conn)


class AsyncQueue(QueueBase):
    """The asyncio twin of Queue, for async web handlers and async workers.

    Create it, then ``await q.open()`` (or ``async with AsyncQueue(...) as q``).
    Methods and semantics are Queue's; see there.
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
        self._pool: AsyncConnectionPool | None = None

    async def open(self) -> None:
        if self._pool is not None:
            return
        s = self.settings
        try:
            conn = await psycopg.AsyncConnection.connect(s.dsn, **s.connect_kwargs())
            await conn.close()
        except psycopg.Error as exc:
            raise unavailable(exc, s, "connect") from None
        pool = AsyncConnectionPool(
            s.dsn,
            min_size=self._min_size,
            max_size=self._max_size,
            kwargs=s.connect_kwargs(),
            check=_acheck_idle_connection if self._check else None,
            # Retry with backoff while callers wait; 0 gives up after two immediate tries
            # and leaves every waiting caller parked until its own timeout.
            reconnect_timeout=300.0,
            name=f"skiplock-async-{s.application_name}",
            open=False,
        )
        await pool.open(wait=False)
        self._pool = pool

    async def close(self) -> None:
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

    async def _execute(
        self,
        make_op: MakeOp,
        *,
        conn: psycopg.AsyncConnection[Any] | None = None,
        idempotent: bool = True,
        what: str = "query",
    ) -> Any:
        if conn is not None:
            try:
                return await arun_op(conn, make_op(False))
            except psycopg.Error as exc:
                mapped = translate_error(exc, self.settings)
                if mapped is not None:
                    raise mapped from None
                raise
        if self._pool is None:
            raise DatabaseUnavailable("queue is not open; await q.open() first")
        attempt = 0
        while True:
            sent = False
            try:
                async with self._pool.connection(timeout=self.settings.connect_timeout) as c:
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
                    raise fatal  # noqa: B904 - give_up set the cause
            await asyncio.sleep(backoff(attempt))

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
    ) -> int:
        make = self._enqueue_op(payload, queue, priority, run_at, max_attempts, idempotency_key)
        return int(
            await self._execute(
                make, conn=conn, idempotent=idempotency_key is not None, what="enqueue"
            )
        )

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
    ) -> list[int]:
        make = self._enqueue_many_op(
            payloads, queue, priority, run_at, max_attempts, idempotency_keys
        )
        return list(await self._execute(make, conn=conn, idempotent=False, what="enqueue_many"))

    async def claim(
        self, *, worker: str, queue: str = "default", limit: int = 1, lease: float = 30.0
    ) -> list[Job]:
        return list(await self._execute(self._claim_op(worker, queue, limit, lease), what="claim"))

    async def heartbeat(self, job: Job, *, lease: float = 30.0) -> datetime:
        res: FenceResult = await self._execute(
            self._fenced_op("heartbeat", [job], {"lease": float(lease)}), what="heartbeat"
        )
        self._raise_if_lost(res, "heartbeat")
        return res.done[job.id]["locked_until"]  # type: ignore[no-any-return]

    async def complete(self, job: Job) -> None:
        res: FenceResult = await self._execute(self._fenced_op("complete", [job]), what="complete")
        self._raise_if_lost(res, "complete")

    async def fail(
        self, job: Job, error: str | None = None, *, retry: bool = True, delay: float | None = None
    ) -> str:
        items = [(job, error, delay, retry)]
        res: FenceResult = await self._execute(
            self._fenced_op("fail", [job], self._fail_params(items)), what="fail"
        )
        self._raise_if_lost(res, "fail")
        return str(res.done[job.id]["status"])

    async def retry(self, job: Job, *, delay: float = 0.0, error: str | None = None) -> str:
        return await self.fail(job, error, retry=True, delay=delay)

    async def release(self, job: Job) -> None:
        res: FenceResult = await self._execute(self._fenced_op("release", [job]), what="release")
        self._raise_if_lost(res, "release")

    async def sweep(self, *, limit: int = 1000) -> int:
        total = 0
        while True:
            rows = await self._execute(self._sweep_op(limit), what="sweep")
            total += len(rows)
            if len(rows) < limit:
                return total

    async def get(self, job_id: int) -> Job | None:
        return await self._execute(self._get_op(job_id), what="get")  # type: ignore[no-any-return]

    async def cancel(self, job_id: int) -> bool:
        return bool(await self._execute(self._cancel_op(job_id), what="cancel"))
