"""The claim's start position: what it skips, that a worker still sees what sorts before
it, and that under a held xmin it keeps the claim's cost to the batch."""

from __future__ import annotations

import threading
import time

import psycopg

from skiplock import Job, Queue, Worker

from .test_claim_plan import pick_buffers


def test_a_claim_from_a_position_takes_only_jobs_at_or_after_it(queue: Queue) -> None:
    ids = [queue.enqueue({"i": i}) for i in range(5)]
    third = queue.get(ids[2])
    start = (third.priority, third.run_at, third.id)
    got = queue.claim(worker="w", limit=10, start=start)
    assert [j.id for j in got] == ids[2:]
    assert [j.id for j in queue.claim(worker="w", limit=10)] == ids[:2]  # from the head


def test_a_worker_serves_jobs_that_sort_before_its_position(queue: Queue) -> None:
    """A higher priority enqueued later and a lease swept back both sort before the
    worker's position; its claims from the head (every 50 ms on a clean table) find them."""
    seen: list[int] = []
    done = threading.Event()

    def handler(job: Job) -> None:
        seen.append(job.id)
        if job.payload.get("last"):
            done.set()

    queue.enqueue_many([{"i": i} for i in range(30)])
    w = Worker(queue, handler, concurrency=2, lease=10)
    t = w.start()
    try:
        deadline = time.monotonic() + 20
        while len(seen) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) == 30
        urgent = queue.enqueue({"last": True}, priority=-5)
        assert done.wait(10), "the job before the position was never claimed"
        assert urgent in seen
    finally:
        w.stop()
        t.join(timeout=30)


def test_under_a_held_xmin_a_claim_from_the_position_stays_with_the_batch(
    dsn: str, queue: Queue, schema: str
) -> None:
    queue.enqueue_many([{"i": i} for i in range(3000)])
    holder = psycopg.connect(dsn)
    try:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT txid_current()")
        start = None
        for _ in range(200):  # 2,000 jobs claimed and done while the snapshot is held
            jobs = queue.claim(worker="w", limit=10, start=start)
            start = max((j.priority, j.run_at, j.id) for j in jobs)
            queue.complete_many([(j, None) for j in jobs])
        from_head = pick_buffers(dsn, schema, None, limit=10)[0]
        from_position = pick_buffers(dsn, schema, start, limit=10)[0]
    finally:
        holder.rollback()
        holder.close()
    # From the position the pick reads a page or two of each generation's index and
    # locks and reads the 10 rows it takes (27 buffers measured); from the head it also
    # visits the heap for the 2,000 dead entries, tens of pages more (82 measured).
    assert from_position < 40, from_position
    assert from_head - from_position >= 30, (from_position, from_head)
