"""AsyncQueue runs the same operations as Queue, for async web handlers."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from skiplock import (
    AsyncQueue,
    DatabaseUnavailable,
    DuplicateJob,
    LeaseLost,
    PayloadError,
    Queue,
)


def test_async_enqueue_claim_complete(queue: Queue) -> None:
    async def main() -> None:
        async with AsyncQueue(queue.settings.dsn, schema=queue.schema) as aq:
            one = await aq.enqueue({"invoice": 1}, queue="emails")
            same = await aq.enqueue({"invoice": 1}, queue="emails", idempotency_key="k")
            again = await aq.enqueue({"invoice": 1}, queue="emails", idempotency_key="k")
            with pytest.raises(DuplicateJob, match=f"held by job {same}"):
                await aq.enqueue({"invoice": 2}, queue="emails", idempotency_key="k")
            many = await aq.enqueue_many([{"n": i} for i in range(100)], queue="emails")
            assert same == again and len(many) == 100
            jobs = await aq.claim(worker="w", queue="emails", limit=200)
            assert {j.id for j in jobs} == {one, same, *many}
            await aq.heartbeat(jobs[0], lease=60)
            await aq.complete(jobs[0])
            with pytest.raises(LeaseLost):
                await aq.complete(jobs[0])
            assert await aq.fail(jobs[1], "x", retry=False) == "failed"
            await aq.release(jobs[2])
            assert await aq.sweep() == 0
            got = await aq.get(one)
            assert got is not None
            with pytest.raises(PayloadError):
                await aq.enqueue({1, 2})

    asyncio.run(main())


def test_async_enqueue_in_callers_transaction(queue: Queue) -> None:
    async def main() -> None:
        async with AsyncQueue(queue.settings.dsn, schema=queue.schema) as aq:
            async with await psycopg.AsyncConnection.connect(queue.settings.dsn) as conn:
                await aq.enqueue({"x": 1}, conn=conn)
                await conn.rollback()
                job_id = await aq.enqueue({"x": 2}, conn=conn)
                await conn.commit()
            jobs = await aq.claim(worker="w", limit=10)
            assert [j.id for j in jobs] == [job_id]

    asyncio.run(main())


def test_async_unreachable() -> None:
    async def main() -> None:
        aq = AsyncQueue("postgresql://x:pw@127.0.0.1:1/db", connect_timeout=2)
        with pytest.raises(DatabaseUnavailable):
            await aq.open()

    asyncio.run(main())


def test_an_unopened_queue_says_how_to_open_it(queue: Queue) -> None:
    async def main() -> None:
        aq = AsyncQueue(queue.settings.dsn, schema=queue.schema)
        with pytest.raises(DatabaseUnavailable) as info:
            await aq.enqueue({"n": 1})
        assert str(info.value) == (
            "AsyncQueue is not open: use 'async with AsyncQueue(...) as q:' or "
            "'await q.open()' first"
        )
        await aq.open()  # what the message says works
        try:
            assert await aq.enqueue({"n": 1}) > 0
        finally:
            await aq.close()

    asyncio.run(main())
    closed = Queue(queue.settings.dsn, schema=queue.schema)
    closed.close()
    with pytest.raises(DatabaseUnavailable) as info:
        closed.enqueue({"n": 1})
    assert str(info.value) == "Queue is not open: use 'with Queue(...) as q:' or 'q.open()' first"
