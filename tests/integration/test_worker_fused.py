"""Worker(fuse_claims=True): completions and the next claim in one transaction keep the
exactly-once and fencing properties of the two statements run apart."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker

from .test_worker import counts, running, wait_until


def _completions(admin: psycopg.Connection[Any], schema: str) -> dict[int, int]:
    rows = admin.execute(
        sql.SQL("SELECT id, completions FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


def test_fused_worker_runs_and_completes_each_job_once(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    seen: list[int] = []
    lock = threading.Lock()
    fused = 0

    def handler(job: Job) -> None:
        with lock:
            seen.append(job.payload["n"])

    n = 3000
    queue.enqueue_many([{"n": i} for i in range(n)])
    w = Worker(queue, handler, concurrency=8, lease=10, fuse_claims=True)
    real = w._complete_and_claim

    def counting(*args: Any) -> Any:
        nonlocal fused
        fused += 1
        return real(*args)

    w._complete_and_claim = counting  # type: ignore[method-assign]
    with running(w):
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain")
    assert sorted(seen) == list(range(n))
    assert w.stats.completed == n and w.stats.lease_lost == 0
    assert set(_completions(admin, queue.schema).values()) == {1}
    assert fused > 0, "the fused path never ran"


def test_fused_write_refuses_a_lost_lease_and_its_claim_still_counts(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    gate = threading.Event()
    entered = threading.Event()
    ran: list[int] = []

    def handler(job: Job) -> None:
        if job.payload.get("slow"):
            entered.set()
            gate.wait(30)
        ran.append(job.id)

    slow_id = queue.enqueue({"slow": True})
    # No listener and a long poll: after its first claim, the claim loop sleeps, so
    # jobs enqueued below can only be taken by the fused claim of the slow job's write.
    w = Worker(
        queue,
        handler,
        concurrency=2,
        lease=30,
        sweep_interval=3600,
        listen=False,
        poll_interval=60,
        prefetch=0,
        fuse_claims=True,
    )
    with running(w):
        assert entered.wait(10)
        # Another worker takes the slow job over: expire, sweep, re-claim.
        admin.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (slow_id,),
        )
        assert queue.sweep() == 1
        [theirs] = queue.claim(worker="new-owner", lease=300)
        assert theirs.id == slow_id
        others = queue.enqueue_many([{"n": i} for i in range(3)])
        began = time.monotonic()
        gate.set()
        wait_until(lambda: w.stats.lease_lost >= 1, what="lease lost")
        wait_until(lambda: counts(queue).get("done", 0) == 3, what="fused claim", timeout=20)
        assert time.monotonic() - began < 20  # not the claim loop's 60 s poll
    # The stale write changed nothing: the new owner's token and lease stand.
    got = queue.get(slow_id)
    assert got is not None and got.status == "running" and got.worker == "new-owner"
    assert got.lease_token == theirs.lease_token
    assert _completions(admin, queue.schema)[slow_id] == 0
    assert sorted(i for i in ran if i != slow_id) == sorted(others)
    queue.complete(theirs)
    assert set(_completions(admin, queue.schema).values()) == {1}
