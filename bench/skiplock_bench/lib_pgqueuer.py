"""pgqueuer under the bench, run the way its CLI and its own benchmark run it: asyncpg
(psycopg if asyncpg is missing), uvloop, a QueueManager with its default batch size."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import psycopg

from .procs import Channel, ChildResult, ChildSpec

NAME = "pgqueuer"
SELF_STOPPING = True  # QueueManager.run(mode=drain) returns once the queue is empty
ENTRYPOINT = "noop"
CHUNK = 100_000

T = TypeVar("T")


def available() -> bool:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


def driver_name() -> str:
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        return "psycopg"
    return "asyncpg"


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_fn())  # type: ignore[arg-type]
    result: T = uvloop.run(coro_fn())
    return result


async def _driver(dsn: str) -> Any:
    if driver_name() == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        return AsyncpgDriver(await asyncpg.connect(dsn=dsn))
    from pgqueuer.db import PsycopgDriver

    return PsycopgDriver(await psycopg.AsyncConnection.connect(dsn, autocommit=True))


async def _queries(dsn: str) -> Any:
    from pgqueuer.queries import Queries

    return Queries(await _driver(dsn))


async def _close(queries: Any) -> None:
    conn = getattr(queries.driver, "_connection", None)
    if conn is not None:
        await conn.close()


def setup(dsn: str) -> None:
    async def go() -> None:
        q = await _queries(dsn)
        if not await q.schema_is_installed():
            await q.install()
        await _close(q)

    _run(go)


def reset(dsn: str) -> None:
    # TRUNCATE: a fresh heap, like skiplock's fresh schema.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics RESTART IDENTITY")


def enqueue_bulk(dsn: str, n: int, first: int = 0) -> float:
    payloads = [str(first + i).encode() for i in range(n)]

    async def go() -> float:
        q = await _queries(dsn)
        start = time.perf_counter()
        for lo in range(0, n, CHUNK):
            part = payloads[lo : lo + CHUNK]
            await q.enqueue([ENTRYPOINT] * len(part), part, [0] * len(part))
        elapsed = time.perf_counter() - start
        await _close(q)
        return elapsed

    return _run(go)


def enqueue_single(dsn: str, m: int) -> float:
    async def go() -> float:
        q = await _queries(dsn)
        start = time.perf_counter()
        for i in range(m):
            await q.enqueue(ENTRYPOINT, str(i).encode(), 0)
        elapsed = time.perf_counter() - start
        await _close(q)
        return elapsed

    return _run(go)


def db_state(dsn: str, n: int) -> tuple[str, bool]:
    """pgqueuer deletes a finished job from its queue table and logs it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        queued = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        rows = conn.execute(
            "SELECT status::text, count(*) FROM pgqueuer_log "
            "WHERE status IN ('successful', 'exception', 'canceled', 'failed') "
            "GROUP BY 1 ORDER BY 1"
        ).fetchall()
    left = int(queued[0]) if queued else -1
    counts = {str(s): int(c) for s, c in rows}
    text = f"queue {left}; log " + (", ".join(f"{s} {c}" for s, c in counts.items()) or "empty")
    return text, left == 0 and counts.get("successful", 0) == n and sum(counts.values()) == n


def _qm(queries: Any) -> Any:
    from pgqueuer.qm import QueueManager

    return QueueManager(queries)


def _run_kwargs(spec: ChildSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "batch_size" in spec.options:
        out["batch_size"] = spec.options["batch_size"]
    if "max_concurrent_tasks" in spec.options:
        out["max_concurrent_tasks"] = spec.options["max_concurrent_tasks"]
    return out


def drain_child(spec: ChildSpec, chan: Channel) -> None:
    from pgqueuer import types

    seen: list[int] = []

    async def main() -> None:
        qm = _qm(await _queries(spec.dsn))

        @qm.entrypoint(ENTRYPOINT)  # type: ignore[untyped-decorator]
        async def noop(job: Any) -> None:
            seen.append(int(job.payload))
            chan.progress[spec.index] += 1

        chan.ready[spec.index].set()
        await asyncio.get_running_loop().run_in_executor(None, chan.go.wait)
        await qm.run(mode=types.QueueExecutionMode.drain, **_run_kwargs(spec))
        t_end = time.monotonic()
        chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, t_end=t_end))

    _run(main)


def pickup_child(spec: ChildSpec, chan: Channel) -> None:
    latencies: list[float] = []
    seen: list[int] = []

    async def main() -> None:
        qm = _qm(await _queries(spec.dsn))

        @qm.entrypoint(ENTRYPOINT)  # type: ignore[untyped-decorator]
        async def noop(job: Any) -> None:
            t = time.monotonic()
            n, t0 = job.payload.decode().split(":")
            latencies.append(t - float(t0))
            seen.append(int(n))
            chan.got.set()

        loop = asyncio.get_running_loop()

        def stopper() -> None:
            chan.stop.wait()
            loop.call_soon_threadsafe(qm.shutdown.set)

        threading.Thread(target=stopper, daemon=True).start()
        loop.call_later(0.5, chan.ready[spec.index].set)  # listening and idle first
        await qm.run(**_run_kwargs(spec), dequeue_timeout=timedelta(seconds=30))
        chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, latencies=latencies))

    _run(main)


def pickup_producer(dsn: str, chan: Channel, samples: int, gap: tuple[float, float]) -> int:
    async def go() -> int:
        q = await _queries(dsn)
        loop = asyncio.get_running_loop()
        timeouts = 0
        for i in range(samples):
            chan.got.clear()
            await q.enqueue(ENTRYPOINT, f"{i}:{time.monotonic()!r}".encode(), 0)
            if not await loop.run_in_executor(None, chan.got.wait, 10.0):
                timeouts += 1
            await asyncio.sleep(random.uniform(*gap))
        await _close(q)
        return timeouts

    return _run(go)
