"""The claim's start position: what it skips, that a worker still sees what sorts before
it, and that under a held xmin it keeps the claim's cost to the batch."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker
from skiplock._sql import statements


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


def _picked_buffers(dsn: str, schema: str, start: Any) -> int:
    """Shared buffers the claim's index scan touched (EXPLAIN ANALYZE, rolled back)."""
    p, r, i = start if start is not None else (None, None, None)
    params = {"queue": "default", "limit": 10, "worker": "x", "lease": 30.0}
    params |= {"from_priority": p, "from_run_at": r, "from_id": i, "tasks": None}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) ") + statements(schema).claim, params
        ).fetchall()
        conn.rollback()
    lines = [str(r[0]) for r in rows]
    for k, line in enumerate(lines):
        if "Index Scan using jobs_g2_claimable_idx" in line:  # the current generation
            for below in lines[k + 1 :]:
                m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", below)
                if m:
                    return int(m[1]) + int(m[2] or 0)
    raise AssertionError("\n".join(lines))


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
        from_head = _picked_buffers(dsn, schema, None)
        from_position = _picked_buffers(dsn, schema, start)
    finally:
        holder.rollback()
        holder.close()
    # From the head the scan visits the heap for the 2,000 dead entries (tens of pages);
    # from the position it reads a page or two of index and the 10 rows it takes.
    assert from_position * 4 < from_head, (from_position, from_head)
    assert from_position < 30, from_position
