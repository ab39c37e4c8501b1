"""The postmortem's test, with skiplock's claim: every job claimed exactly once."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from skiplock import Queue

JOBS = 20_000


# Set in each pool process (ProcessPoolExecutor's initializer): the processes start
# claiming together, as the threads do, so a process that starts late still competes.
_start: Any = None


def _set_start(barrier: Any) -> None:
    global _start
    _start = barrier


def claim_until_empty(dsn: str, schema: str, name: str) -> list[int]:
    """One worker with its own connection, claiming batches of 10 until nothing is left."""
    got: list[int] = []
    with Queue(dsn, schema=schema, min_size=1, max_size=1, application_name=f"claim-{schema}") as q:
        if _start is not None:
            _start.wait(120)
        while True:
            jobs = q.claim(worker=name, queue="emails", limit=10, lease=300)
            if not jobs:
                return got
            got.extend(j.id for j in jobs)


@pytest.mark.connections(30)
def test_16_threads_claim_20000_jobs_exactly_once(queue: Queue) -> None:
    queue.enqueue_many([{"invoice": n} for n in range(JOBS)], queue="emails")
    claimed: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def worker(n: int) -> None:
        start.wait()
        ids = claim_until_empty(queue.settings.dsn, queue.schema, f"w{n}")
        with lock:
            claimed.extend(ids)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    assert len(claimed) == len(set(claimed)) == JOBS
    print(f"\n16 threads x {JOBS} jobs: {JOBS / elapsed:,.0f} jobs claimed/s ({elapsed:.2f}s)")


# Four processes started together race claim for claim whatever the backlog; the
# thread test above keeps the postmortem's 20,000 in the default run, and this one
# runs that count with the slow tests (.ci/run).
@pytest.mark.parametrize("jobs", [5_000, pytest.param(JOBS, marks=pytest.mark.slow)])
def test_4_processes_claim_every_job_exactly_once(queue: Queue, jobs: int) -> None:
    queue.enqueue_many([{"invoice": n} for n in range(jobs)], queue="emails")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    with ProcessPoolExecutor(4, mp_context=ctx, initializer=_set_start, initargs=(start,)) as pool:
        futures = [
            pool.submit(claim_until_empty, queue.settings.dsn, queue.schema, f"p{i}")
            for i in range(4)
        ]
        results = [f.result(timeout=300) for f in futures]
    claimed = [i for r in results for i in r]
    assert len(claimed) == len(set(claimed)) == jobs
    assert all(results), "every process should have claimed something"
