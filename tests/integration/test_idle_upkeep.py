"""An idle worker sweeps on time whatever its poll interval.

A worker with nothing to do waits for a notification or its next poll.  If that wait
were not cut short to its next sweep, a worker polling once a minute would recover a
dead claimant's expired lease (and refresh its own row) once a minute too, not every
``sweep_interval``.  Only a sweep gives an expired lease back: the claim takes pending
jobs only, so the job below runs again only if the idle worker sweeps.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from skiplock import AsyncQueue, AsyncWorker, Job, Queue, Worker

from .test_aworker import until, with_worker
from .test_worker import running, wait_until

LEASE = 0.5
# The poll is a minute away: anything done within a few seconds was done by a sweep.
IDLE = {"poll_interval": 60.0, "sweep_interval": 0.2, "liveness": False}


def orphan(queue: Queue) -> int:
    """A job claimed by a worker that then vanished: its lease runs out in LEASE s.

    Enqueued and claimed in one transaction, so the running worker, woken by the
    enqueue's notification at commit, finds it already taken.
    """
    with psycopg.connect(queue.settings.dsn) as conn:
        job_id = queue.enqueue({"n": 1}, conn=conn)
        (job,) = queue.claim(worker="vanished", lease=LEASE, conn=conn)
    assert job.id == job_id
    return job_id


def test_idle_worker_recovers_an_expired_lease_within_its_sweep_interval(queue: Queue) -> None:
    done: list[int] = []
    with running(Worker(queue, lambda job: done.append(job.id), **IDLE)):
        time.sleep(0.1)  # the worker has claimed nothing and waits on its long poll
        t0 = time.monotonic()
        job_id = orphan(queue)
        wait_until(lambda: done == [job_id], timeout=10, what="the orphaned job")
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("retention", [None, 3600.0])
def test_idle_async_worker_recovers_an_expired_lease_within_its_sweep_interval(
    queue: Queue, retention: float | None
) -> None:
    done: list[int] = []

    async def handler(job: Job) -> None:
        done.append(job.id)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        t0 = time.monotonic()
        job_id = orphan(queue)
        await until(lambda: done == [job_id], timeout=10, what="the orphaned job")
        assert time.monotonic() - t0 < 5

    kw: dict[str, Any] = dict(IDLE, retention=retention)
    with_worker(queue, handler, body, **kw)
