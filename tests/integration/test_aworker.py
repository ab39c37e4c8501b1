"""AsyncWorker: the same leases, heartbeats, fencing, shutdown and hung-handler handling
as Worker, for async def handlers on one event loop, against a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import (
    AsyncQueue,
    AsyncWorker,
    ConfigError,
    Fail,
    Job,
    JobCancelled,
    JobFailed,
    Queue,
    Retry,
)

from .test_worker import assert_released_unstarted, counts


async def until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def with_worker(
    queue: Queue,
    handler: Any,
    body: Callable[[AsyncWorker, AsyncQueue], Awaitable[None]],
    **kw: Any,
) -> AsyncWorker:
    """Run ``body`` while an AsyncWorker runs on the same loop; stop it after."""
    kw.setdefault("poll_interval", 0.05)

    async def main() -> AsyncWorker:
        w = AsyncWorker(queue, handler, **kw)
        async with AsyncQueue(queue.settings.dsn, schema=queue.schema) as aq:
            runner = asyncio.create_task(w.run())
            try:
                await body(w, aq)
            finally:
                w.stop()
                await asyncio.wait_for(runner, 30)
        return w

    return asyncio.run(main())


def test_runs_async_handlers_and_stores_results(queue: Queue) -> None:
    async def handler(job: Job) -> Any:
        await asyncio.sleep(0.01)
        if job.payload.get("fail"):
            raise Fail("no")
        if job.payload.get("retry") and job.attempts == 1:
            raise Retry(0)
        return job.payload["n"] * 2

    ids = queue.enqueue_many([{"n": n} for n in range(50)])
    bad = queue.enqueue({"fail": True})
    again = queue.enqueue({"retry": True, "n": 5})

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        assert [await aq.wait(i, timeout=20) for i in ids] == [n * 2 for n in range(50)]
        assert await aq.wait(again, timeout=20) == 10
        with pytest.raises(JobFailed):
            await aq.wait(bad, timeout=20)

    w = with_worker(queue, handler, body, concurrency=8)
    stats = w.stats.snapshot()
    assert (stats["completed"], stats["failed"], stats["retried"]) == (51, 1, 1)


def test_sync_handlers_are_refused(queue: Queue) -> None:
    with pytest.raises(ConfigError, match="async def"):
        AsyncWorker(queue, lambda job: None)


def test_heartbeats_keep_a_slow_live_job(queue: Queue) -> None:
    async def handler(job: Job) -> str:
        await asyncio.sleep(2.5)  # over twice the lease
        return "kept"

    job_id = queue.enqueue({})

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        for _ in range(25):  # another worker sweeps all along
            assert await aq.sweep() == 0
            await asyncio.sleep(0.1)
        assert await aq.wait(job_id, timeout=20) == "kept"

    w = with_worker(queue, handler, body, lease=1.0)
    assert w.stats.snapshot()["heartbeats"] >= 2


def test_a_hung_handler_that_swallows_cancellation_is_abandoned(queue: Queue) -> None:
    finished: dict[int, float] = {}

    async def handler(job: Job) -> None:
        if job.attempts == 1:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(1.5)  # ignores the cancel, returns late
        finished[job.attempts] = time.monotonic()

    job_id = queue.enqueue({})

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        assert await aq.wait(job_id, timeout=20) is None  # the second attempt's result
        await until(lambda: 1 in finished, what="the abandoned attempt to return")

    w = with_worker(queue, handler, body, job_timeout=0.3, concurrency=1)
    assert w.stats.snapshot()["timed_out"] == 1
    # The worker did not wait for the stuck attempt: the retry ran and finished first.
    assert finished[2] < finished[1]


def test_cancel_cancels_the_handlers_task(queue: Queue) -> None:
    state: dict[str, float] = {}

    async def handler(job: Job) -> None:
        state["started"] = time.monotonic()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            state["cancelled"] = time.monotonic()
            raise

    job_id = queue.enqueue({})

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: "started" in state, what="start")
        await asyncio.sleep(0.2)  # the listener is up by now
        asked = time.monotonic()
        assert await aq.cancel(job_id) == "running"
        with pytest.raises(JobCancelled):
            await aq.wait(job_id, timeout=20)
        assert state["cancelled"] - asked < 1.0  # the NOTIFY, not a 10 s heartbeat

    w = with_worker(queue, handler, body, lease=30)
    assert w.stats.snapshot()["cancelled"] == 1


def test_lease_lost_mid_handler_changes_nothing(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    gate = asyncio.Event()

    async def handler(job: Job) -> None:
        await gate.wait()

    job_id = queue.enqueue({})

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: len(w.inflight()) == 1, what="claim")
        admin.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (job_id,),
        )
        assert await aq.sweep() == 1
        [mine] = await aq.claim(worker="new-owner", lease=300)
        gate.set()
        await until(lambda: w.stats.snapshot()["lease_lost"] >= 1, what="lease lost")
        got = await aq.get(job_id)
        assert got is not None and got.status == "running" and got.worker == "new-owner"
        await aq.complete(mine)

    with_worker(queue, handler, body, lease=30, sweep_interval=3600, listen=False)


def test_graceful_stop_finishes_running_handlers(queue: Queue) -> None:
    done: list[int] = []

    async def handler(job: Job) -> None:
        await asyncio.sleep(0.5)
        done.append(job.id)

    ids = queue.enqueue_many([{}] * 4)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: len(w.inflight()) == 4, what="claims")

    with_worker(queue, handler, body, concurrency=4)
    assert sorted(done) == sorted(ids)
    assert {queue.get(i).status for i in ids} == {"done"}  # type: ignore[union-attr]


def test_concurrency_limit_holds_for_async_workers(queue: Queue) -> None:
    running = {"now": 0, "most": 0}

    async def handler(job: Job) -> None:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(0.05)
        running["now"] -= 1

    queue.configure_queue("default", concurrency_limit=2)
    ids = queue.enqueue_many([{}] * 20)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: len(w.inflight()) == 0 and w.stats.snapshot()["completed"] == 20)

    with_worker(queue, handler, body, concurrency=8)
    assert running["most"] == 2
    assert {queue.get(i).status for i in ids} == {"done"}  # type: ignore[union-attr]


def test_prefetch_holds_more_jobs_but_runs_only_concurrency_handlers(queue: Queue) -> None:
    running = {"now": 0, "most": 0, "held": 0}
    worker: list[AsyncWorker] = []

    async def handler(job: Job) -> None:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        running["held"] = max(running["held"], len(worker[0].inflight()))
        await asyncio.sleep(0.01)
        running["now"] -= 1

    ids = queue.enqueue_many([{}] * 30)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        worker.append(w)
        await until(lambda: w.stats.snapshot()["completed"] == 30, what="drain")

    with_worker(queue, handler, body, concurrency=2, prefetch=4)
    assert running["most"] == 2
    assert running["held"] == 6  # claimed in batches beyond the running two
    assert {queue.get(i).status for i in ids} == {"done"}  # type: ignore[union-attr]


def test_graceful_stop_releases_prefetched_jobs_no_handler_started(queue: Queue) -> None:
    gate = asyncio.Event()
    started: list[int] = []

    async def handler(job: Job) -> None:
        started.append(job.id)
        await gate.wait()

    ids = queue.enqueue_many([{}] * 4)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: len(started) == 1 and w.stats.claimed == 4, what="claims")
        w.stop()
        # The three unstarted come back while the running one finishes in the grace.
        await until(lambda: counts(queue).get("pending") == 3, what="release")
        gate.set()

    w = with_worker(queue, handler, body, concurrency=1, prefetch=3, shutdown_grace=10)
    assert w.stats.released == 3
    assert_released_unstarted(queue, ids, started[0])


@pytest.mark.connections(24)
def test_two_async_workers_run_each_job_exactly_once(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    seen: list[int] = []

    async def handler(job: Job) -> None:
        seen.append(job.id)

    ids = queue.enqueue_many([{}] * 500)

    async def main() -> None:
        workers = [AsyncWorker(queue, handler, concurrency=8, poll_interval=0.05) for _ in "ab"]
        runners = [asyncio.create_task(w.run()) for w in workers]
        await until(lambda: len(seen) >= 500, what="drain")
        await asyncio.sleep(0.3)
        for w in workers:
            w.stop()
        await asyncio.gather(*runners)
        assert all(w.stats.snapshot()["completed"] > 0 for w in workers), "not a race"

    asyncio.run(main())
    assert sorted(seen) == sorted(ids)
    completions = admin.execute(
        sql.SQL("SELECT max(completions), min(completions) FROM {}.jobs").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone()
    assert completions == (1, 1)


@pytest.mark.parametrize("chains", [1, 2])
def test_outcomes_of_ready_handlers_go_out_in_one_write(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, chains: int
) -> None:
    """Handlers that finish without awaiting anything all finish before the writer
    writes: with room for 40 jobs, 120 no-op jobs are completed 40 at a time (each
    write also claiming the next 40), not in pieces of a few.  The writer used to write
    as soon as the first outcome came, and the jobs its own claim had started were
    written 4 to 8 at a time.  With two chains each holds and writes 20 at a time."""
    batches: list[int] = []
    complete_many = AsyncQueue.complete_many
    complete_and_claim = AsyncQueue._complete_and_claim

    async def counted_many(self: AsyncQueue, items: Any, *a: Any, **k: Any) -> Any:
        batches.append(len(items))
        return await complete_many(self, items, *a, **k)

    async def counted_fused(self: AsyncQueue, items: Any, *a: Any, **k: Any) -> Any:
        batches.append(len(items))
        return await complete_and_claim(self, items, *a, **k)

    monkeypatch.setattr(AsyncQueue, "complete_many", counted_many)
    monkeypatch.setattr(AsyncQueue, "_complete_and_claim", counted_fused)
    queue.enqueue_many([{"n": i} for i in range(120)])

    async def noop(job: Job) -> None:
        return None

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: w.stats.completed == 120, what="120 completions")

    with_worker(queue, noop, body, concurrency=4, prefetch=36, chains=chains)
    # Here: [40, 40, 40] (one chain); before: [8, 36, 8, 36, 8, 24].
    per = 40 // chains
    assert sum(batches) == 120 and len(batches) <= 120 // per + 1, batches
    assert min(batches[:-1]) >= per // 2, batches
