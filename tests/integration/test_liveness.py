"""Crash detection faster than the lease: a worker's session-level mark and sweep_dead."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Job, Queue, Worker
from skiplock._liveness import DEFAULT_GRACE, Liveness

from .test_worker import running, wait_until


def marks(admin: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    q = sql.SQL("SELECT name, mark_pid FROM {}.workers").format(sql.Identifier(schema))
    return dict(admin.execute(q).fetchall())


def test_a_dead_session_gives_its_jobs_back_within_the_grace(queue: Queue, admin: Any) -> None:
    """A worker's session ends (as at SIGKILL): with the default 30 s lease, its job is
    given back after about the grace, and another worker runs it."""
    job_id = queue.enqueue({"n": 1})
    ghost = Liveness(queue.settings, "ghost", queues=["default"], tasks=None)
    assert ghost.step() == 0 and ghost.marked
    [held] = queue.claim(worker="ghost", lease=30.0)
    assert held.id == job_id
    ran: list[Job] = []
    with running(Worker(queue, ran.append, lease=30.0)):
        wait_until(lambda: "ghost" in marks(admin, queue.schema), what="ghost's mark")
        ghost.close()  # the session ends; PostgreSQL drops the lock with it
        gone = time.monotonic()
        wait_until(lambda: len(ran) == 1, timeout=20, what="the job to run again")
        recovery = time.monotonic() - gone
    print(f"\nsession ended -> job running again: {recovery:.2f}s (lease 30s)")
    assert ran[0].id == job_id and ran[0].attempts == 2
    assert DEFAULT_GRACE <= recovery < 2.5
    done = queue.get(job_id)
    assert done is not None and done.status == "done"
    assert "ghost" not in marks(admin, queue.schema)  # the dead worker's row is gone


def test_a_live_worker_whose_mark_alone_is_gone_keeps_its_job(
    queue: Queue, admin: Any, dsn: str
) -> None:
    """The mark's connection is cut and cannot come back (a full server, say), but the
    worker's other sessions are open: it is alive, and only its lease may take the job.
    Once its last session ends too, the job goes back within the grace."""
    from dataclasses import replace

    half = replace(queue.settings, application_name="skiplock-worker:half")
    job_id = queue.enqueue({"n": 1})
    live = Liveness(half, "half", queues=["default"], tasks=None)
    assert live.step() == 0 and live.marked
    [held] = queue.claim(worker="half", lease=30.0)
    other = psycopg.connect(dsn, application_name="skiplock-worker:half")  # its claims lane
    ran: list[Job] = []
    try:
        with running(Worker(queue, ran.append, lease=30.0, name="sweeper")):
            live.close()  # the mark is gone for good
            time.sleep(3 * DEFAULT_GRACE)  # a dozen sweep_dead rounds must leave it alone
            now = queue.get(job_id)
            assert now is not None and now.status == "running"
            assert now.lease_token == held.lease_token and ran == []
            other.close()  # now the process is gone
            wait_until(lambda: len(ran) == 1, timeout=20, what="the job to run again")
    finally:
        other.close()
    assert ran[0].attempts == 2


def test_a_dropped_liveness_connection_back_within_the_grace_keeps_the_job(
    queue: Queue, admin: Any
) -> None:
    release = threading.Event()
    started = threading.Event()

    def park(job: Job) -> None:
        started.set()
        release.wait(30)

    job_id = queue.enqueue({})
    w = Worker(queue, park, lease=30.0, name="dropped")
    try:
        with running(w):
            assert started.wait(20)
            wait_until(lambda: marks(admin, queue.schema).get("dropped") is not None, what="mark")
            first = marks(admin, queue.schema)["dropped"]
            before = queue.get(job_id)
            admin.execute("SELECT pg_terminate_backend(%s)", (first,))
            wait_until(
                lambda first=first: marks(admin, queue.schema).get("dropped") not in (None, first),
                what="the worker to mark again on a new connection",
            )
            # Two graces with the worker's own sweeps and a second sweeper running.
            other = Worker(queue, lambda j: None, lease=30.0, name="sweeper")
            with running(other):
                time.sleep(2 * DEFAULT_GRACE + 0.5)
            after = queue.get(job_id)
            assert before is not None and after is not None
            assert after.status == "running" and after.lease_token == before.lease_token
            release.set()
            wait_until(lambda b=before: (queue.get(job_id) or b).status == "done", what="done")
    finally:
        release.set()
    done = queue.get(job_id)
    assert done is not None and done.attempts == 1
    assert w.stats.lease_lost == 0 and w.stats.completed == 1


def test_behind_a_pooler_there_is_no_mark(dsn: str, schema: str, admin: Any) -> None:
    """Session state does not survive a transaction pooler: the lease alone decides."""
    with Queue(dsn, schema=schema, max_size=2, pooler=True) as q:
        q.migrate()
        w = Worker(q, lambda j: None, sweep_interval=0.05, name="pooled")
        assert not w.liveness
        with running(w):
            wait_until(lambda: "pooled" in marks(admin, schema), what="registration")
            assert marks(admin, schema)["pooled"] is None


def test_async_worker_marks_and_unmarks(queue: Queue, admin: Any) -> None:
    import asyncio

    from skiplock import AsyncQueue, AsyncWorker

    async def handler(job: Job) -> None:
        return None

    async def main() -> tuple[Any, Any]:
        w = AsyncWorker(AsyncQueue(queue.settings.dsn, schema=queue.schema), handler, name="aw")
        task = asyncio.create_task(w.run())
        end = time.monotonic() + 20
        while marks(admin, queue.schema).get("aw") is None and time.monotonic() < end:
            await asyncio.sleep(0.02)
        during = marks(admin, queue.schema).get("aw")
        w.stop()
        await task
        return during, marks(admin, queue.schema).get("aw")

    during, after = asyncio.run(main())
    assert during is not None and after is None


def held_mark(admin: psycopg.Connection[Any], schema: str, name: str) -> int | None:
    """The backend pid holding ``name``'s mark now (its lock granted in pg_locks), or None."""
    q = sql.SQL(
        "SELECT w.mark_pid FROM {}.workers AS w JOIN pg_locks AS l"
        " ON l.pid = w.mark_pid AND l.locktype = 'advisory' AND l.granted"
        " AND l.classid = w.mark_key1::oid AND l.objid = w.mark_key2::oid"
        " WHERE w.name = %s"
    ).format(sql.Identifier(schema))
    row = admin.execute(q, (name,)).fetchone()
    return None if row is None else int(row[0])


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.connections(24)
def test_a_worker_whose_connections_are_all_reset_marks_again_at_once(
    queue: Queue, admin: Any, dsn: str, kind: str
) -> None:
    """Every connection of a live worker is reset (a load balancer restarts): nothing
    tells it from a dead one but its mark coming back within the grace.  Its listener
    sees the reset first and the liveness thread marks again at once, well inside the
    grace, not after waiting out its interval once to notice and again after failing.
    The job it runs keeps its lease token throughout, with a second worker sweeping."""
    import asyncio
    import statistics

    from skiplock import AsyncQueue, AsyncWorker
    from skiplock.chaos import ChaosProxy, proxied_dsn, upstream_of

    release = threading.Event()
    started = threading.Event()

    def park(job: Job) -> None:
        started.set()
        release.wait(60)

    async def apark(job: Job) -> None:
        await asyncio.to_thread(park, job)

    job_id = queue.enqueue({})
    gaps: list[float] = []
    with ChaosProxy(upstream_of(dsn)) as proxy:
        pdsn = proxied_dsn(dsn, proxy.port)
        if kind == "sync":
            pq = Queue(pdsn, schema=queue.schema, max_size=4)
            w = Worker(pq, park, lease=30.0, name="reset")
            t = w.start()
            stop = w.stop
        else:
            aw = AsyncWorker(AsyncQueue(pdsn, schema=queue.schema), apark, lease=30.0, name="reset")
            t = threading.Thread(target=lambda: asyncio.run(aw.run()))
            t.start()
            stop = aw.stop
        try:
            assert started.wait(20)
            before = queue.get(job_id)
            with running(Worker(queue, lambda j: None, lease=30.0, name="sweeper")):
                for _ in range(5):
                    wait_until(lambda: held_mark(admin, queue.schema, "reset") is not None)
                    time.sleep(0.4)  # the liveness thread is somewhere in its interval
                    old = held_mark(admin, queue.schema, "reset")
                    t0 = time.monotonic()
                    assert proxy.reset() >= 3  # liveness, listener, claims and more
                    # A new mark, on a new backend: the old one's lock may linger in
                    # pg_locks for a moment after the reset.
                    wait_until(
                        lambda old=old: held_mark(admin, queue.schema, "reset") not in (None, old),
                        timeout=DEFAULT_GRACE * 5,
                        what="the mark to come back",
                    )
                    gaps.append(time.monotonic() - t0)
                time.sleep(2 * DEFAULT_GRACE)
            after = queue.get(job_id)
        finally:
            release.set()
            stop()  # safe from any thread, for both workers
            t.join(30)
    print(f"\n{kind}: mark back after a reset of every connection: {sorted(gaps)}")
    assert before is not None and after is not None
    assert after.status == "running" and after.lease_token == before.lease_token
    # Before the liveness thread stepped at once, the median was 0.38 s (at most 0.53).
    assert statistics.median(gaps) < 0.2, gaps
    assert max(gaps) < DEFAULT_GRACE / 2, gaps
