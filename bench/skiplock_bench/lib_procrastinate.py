"""procrastinate under the bench: PsycopgConnector, an async task, run_worker_async with
the worker's ``concurrency`` (its knob for throughput) and a pool big enough for it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from typing import Any

import psycopg

from .procs import Channel, ChildResult, ChildSpec

NAME = "procrastinate"
SELF_STOPPING = True  # run_worker_async(wait=False) returns once no job is left
TASK = "noop"
CHUNK = 50_000


def available() -> bool:
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        return False
    return True


def _app(dsn: str, pool: int, seen: list[int] | None = None, on_run: Any = None) -> Any:
    import procrastinate

    # psycopg_pool's default is 4 connections; a worker of concurrency C holds one per
    # running job while it writes the outcome, so give it C + 2 rather than throttle it.
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=dsn, min_size=1, max_size=pool)
    )

    async def noop(n: int, t0: float | None = None) -> None:
        if on_run is not None:
            on_run(n, t0)

    app.task(name=TASK)(noop)
    return app


def setup(dsn: str) -> None:
    async def go() -> None:
        app = _app(dsn, 2)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(go())


def reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers "
            "RESTART IDENTITY CASCADE"
        )


def enqueue_bulk(dsn: str, n: int, first: int = 0) -> float:
    kwargs = [{"n": first + i} for i in range(n)]

    async def go() -> float:
        app = _app(dsn, 2)
        async with app.open_async():
            task = app.tasks[TASK]
            async with app.connector.pool.connection():  # pool warm before the clock
                pass
            start = time.perf_counter()
            for lo in range(0, n, CHUNK):
                await task.batch_defer_async(*kwargs[lo : lo + CHUNK])
            return time.perf_counter() - start

    return asyncio.run(go())


def enqueue_single(dsn: str, m: int) -> float:
    async def go() -> float:
        app = _app(dsn, 2)
        async with app.open_async():
            task = app.tasks[TASK]
            async with app.connector.pool.connection():
                pass
            start = time.perf_counter()
            for i in range(m):
                await task.defer_async(n=i)
            return time.perf_counter() - start

    return asyncio.run(go())


def db_state(dsn: str, n: int) -> tuple[str, bool]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY 1 ORDER BY 1"
        ).fetchall()
    counts = {str(s): int(c) for s, c in rows}
    text = ", ".join(f"{s} {c}" for s, c in counts.items()) or "empty"
    return text, counts.get("succeeded", 0) == n and sum(counts.values()) == n


def drain_child(spec: ChildSpec, chan: Channel) -> None:
    seen: list[int] = []

    def on_run(n: int, _t0: float | None) -> None:
        seen.append(n)
        chan.progress[spec.index] += 1

    async def main() -> None:
        app = _app(spec.dsn, spec.concurrency + 2, on_run=on_run)
        async with app.open_async():
            async with app.connector.pool.connection():
                pass
            chan.ready[spec.index].set()
            await asyncio.get_running_loop().run_in_executor(None, chan.go.wait)
            await app.run_worker_async(
                concurrency=spec.concurrency,
                wait=False,
                install_signal_handlers=False,
                name=spec.name,
            )
            t_end = time.monotonic()
        chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, t_end=t_end))

    asyncio.run(main())


def pickup_child(spec: ChildSpec, chan: Channel) -> None:
    latencies: list[float] = []
    seen: list[int] = []

    def on_run(n: int, t0: float | None) -> None:
        latencies.append(time.monotonic() - (t0 or 0.0))
        seen.append(n)
        chan.got.set()

    async def main() -> None:
        app = _app(spec.dsn, spec.concurrency + 2, on_run=on_run)
        async with app.open_async():
            loop = asyncio.get_running_loop()
            worker = asyncio.create_task(
                app.run_worker_async(
                    concurrency=spec.concurrency, install_signal_handlers=False, name=spec.name
                )
            )
            await asyncio.sleep(0.5)  # listening and idle before the first job
            chan.ready[spec.index].set()
            await loop.run_in_executor(None, chan.stop.wait)
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(worker, timeout=30)
        chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, latencies=latencies))

    asyncio.run(main())


def pickup_producer(dsn: str, chan: Channel, samples: int, gap: tuple[float, float]) -> int:
    async def go() -> int:
        app = _app(dsn, 2)
        timeouts = 0
        async with app.open_async():
            task = app.tasks[TASK]
            loop = asyncio.get_running_loop()
            for i in range(samples):
                chan.got.clear()
                await task.defer_async(n=i, t0=time.monotonic())
                if not await loop.run_in_executor(None, chan.got.wait, 10.0):
                    timeouts += 1
                await asyncio.sleep(random.uniform(*gap))
        return timeouts

    return asyncio.run(go())
