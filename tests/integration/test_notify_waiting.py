"""Migration 0008: an enqueue notifies a queue only while one of its workers waits.

Whether a notification was sent is read without guessing at timeouts: after the
enqueue commits, the test sends a marker on the same channel; notifications arrive
in commit order, so the first one the listener gets is the enqueue's if there was
one, and the marker if there was not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

import skiplock._migrate as mod
from skiplock import AsyncQueue, AsyncWorker, Job, Queue, Worker
from skiplock._migrate import migrate_op
from skiplock._queue import run_op
from skiplock._sql import channel_name
from skiplock._workerbase import WorkerBase

from .test_aworker import until, with_worker
from .test_worker import running, wait_until

MARKER = "-- marker --"


@pytest.fixture
def listener(dsn: str, queue: Queue) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(queue.schema))))
        yield conn


def notes(
    admin: psycopg.Connection[Any], listener: psycopg.Connection[Any], schema: str
) -> list[str]:
    """The notifications since the last call: enqueues' queues, up to the marker sent now."""
    admin.execute("SELECT pg_notify(%s, %s)", (channel_name(schema), MARKER))
    got: list[str] = []
    for note in listener.notifies(timeout=10):
        if note.payload == MARKER:
            return got
        got.append(note.payload)
    raise AssertionError(f"the marker never arrived (got {got})")


def set_worker(
    admin: psycopg.Connection[Any], schema: str, name: str, queues: list[str], waiting: bool | None
) -> None:
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.workers (name, queues, waiting) VALUES (%s, %s, %s) "
            "ON CONFLICT (name) DO UPDATE SET queues = excluded.queues, waiting = excluded.waiting"
        ).format(sql.Identifier(schema)),
        (name, queues, waiting),
    )


def test_enqueue_notifies_only_queues_a_worker_waits_on(
    queue: Queue, admin: psycopg.Connection[Any], listener: psycopg.Connection[Any]
) -> None:
    s = queue.schema
    # Nobody registered: whoever listens is told, as before 0008.
    queue.enqueue({}, queue="a")
    assert notes(admin, listener, s) == ["a"]
    # A worker that has not said (a version-7 worker, or one just registered): told.
    set_worker(admin, s, "w1", ["a"], None)
    queue.enqueue({}, queue="a")
    assert notes(admin, listener, s) == ["a"]
    # Its only worker is busy: no NOTIFY, so no commit-time lock either.
    set_worker(admin, s, "w1", ["a"], False)
    queue.enqueue({}, queue="a")
    assert notes(admin, listener, s) == []
    queue.enqueue_many([{}, {}, {}], queue="a")
    assert notes(admin, listener, s) == []
    # A queue no registered worker serves: nobody to wake.
    queue.enqueue({}, queue="b")
    assert notes(admin, listener, s) == []
    # A second worker of the queue waits: told, once for the whole batch.
    set_worker(admin, s, "w2", ["x", "a"], True)
    queue.enqueue_many([{}, {}, {}], queue="a")
    assert notes(admin, listener, s) == ["a"]
    # Delayed jobs were never notified; they still are not.
    queue.enqueue({}, queue="a", run_at=datetime.now(UTC) + timedelta(hours=1))
    assert notes(admin, listener, s) == []


def test_0008_touches_no_job_and_a_version_7_worker_is_still_woken(
    admin: psycopg.Connection[Any], dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mod.migrations()
    monkeypatch.setattr(mod, "migrations", lambda: tuple(m for m in real if m.version < 8))
    run_op(admin, migrate_op(schema))
    s = sql.Identifier(schema)
    with Queue(dsn, schema=schema, max_size=2) as q:
        q.enqueue_many([{"n": n} for n in range(5)], queue="a")
        # A version-7 worker's claim (today's claim needs migration 0009's `part`).
        job = [
            Job.from_row(r)
            for r in admin.cursor(row_factory=dict_row).execute(
                sql.SQL(
                    "UPDATE {}.jobs SET status = 'running', worker = 'w7', attempts = 1,"
                    " started_at = now(), locked_until = now() + interval '300 s',"
                    " lease_token = gen_random_uuid()"
                    " WHERE id IN (SELECT min(id) + k FROM {}.jobs, generate_series(0, 1) AS k"
                    " GROUP BY k) RETURNING *"
                ).format(s, s)
            )
        ]
        # A version-7 worker's row, as its worker_seen writes it (no `waiting`).
        admin.execute(
            sql.SQL("INSERT INTO {}.workers (name, queues) VALUES ('w7', '{{a}}')").format(s)
        )
        cols = sql.SQL("SELECT * FROM {}.jobs ORDER BY id").format(s)
        before = admin.execute(cols).fetchall()
        monkeypatch.setattr(mod, "migrations", lambda: tuple(m for m in real if m.version < 9))
        assert run_op(admin, migrate_op(schema)) == [8]
        assert admin.execute(cols).fetchall() == before
        assert admin.execute(
            sql.SQL("SELECT waiting FROM {}.workers WHERE name = 'w7'").format(s)
        ).fetchone() == (None,)
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(schema))))
            q.enqueue({}, queue="a")
            assert notes(admin, listener, schema) == ["a"]
        # The old worker's lease tokens still fence, through 0009 too.
        monkeypatch.setattr(mod, "migrations", lambda: real)
        assert run_op(admin, migrate_op(schema)) == [m.version for m in real if m.version >= 9]
        assert q.complete_many([(j, None) for j in job]).lost == []


def worker_waiting(admin: psycopg.Connection[Any], schema: str, name: str) -> bool | None:
    row = admin.execute(
        sql.SQL("SELECT waiting FROM {}.workers WHERE name = %s").format(sql.Identifier(schema)),
        (name,),
    ).fetchone()
    return None if row is None else row[0]


@pytest.mark.parametrize("fuse_claims", [False, True])
def test_a_busy_worker_says_so_and_turns_waiting_when_the_queue_runs_dry(
    queue: Queue, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch, fuse_claims: bool
) -> None:
    # With fuse_claims the claims that run the queue dry are the writer's, not the claim
    # loop's: the worker must turn waiting all the same, not at its next poll.
    monkeypatch.setattr(WorkerBase, "BUSY_AFTER", 0.2)
    gate = threading.Event()
    done: list[int] = []

    def handler(job: Any) -> None:
        gate.wait(30)
        done.append(job.id)

    queue.enqueue_many([{} for _ in range(40)])
    name = f"busy-{queue.schema}"
    w = Worker(
        queue,
        handler,
        concurrency=2,
        prefetch=2,
        poll_interval=60,
        name=name,
        sweep_interval=0.05,
        fuse_claims=fuse_claims,
    )
    with running(w):
        # Every slot taken and the last claim full: the worker claims again as soon as
        # slots free, so it tells producers not to notify.
        wait_until(lambda: worker_waiting(admin, queue.schema, name) is False, what="waiting false")
        gate.set()
        wait_until(lambda: len(done) == 40, what="the 40 jobs")
        wait_until(lambda: worker_waiting(admin, queue.schema, name) is True, what="waiting true")
        # Idle and waiting: an enqueue wakes it at once (the poll is a minute away).
        t0 = time.monotonic()
        queue.enqueue({})
        wait_until(lambda: len(done) == 41, timeout=5, what="the job enqueued while idle")
        assert time.monotonic() - t0 < 2


def test_a_job_committed_as_the_worker_turns_waiting_is_not_left_to_the_poll(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race the look-again covers: the producer's trigger reads the worker as busy
    # (no NOTIFY), the worker turns waiting and claims before the producer commits.
    # The look-again is stretched so that the producer's commit surely lands first.
    monkeypatch.setattr(WorkerBase, "BUSY_AFTER", 0.1)
    monkeypatch.setattr(WorkerBase, "LOOK_AGAIN", 1.0)
    gate = threading.Event()
    done: list[int] = []

    def handler(job: Any) -> None:
        if job.payload.get("slow"):
            gate.wait(30)
        done.append(job.id)

    queue.enqueue_many([{"slow": True} for _ in range(4)])
    name = f"race-{queue.schema}"
    w = Worker(
        queue, handler, concurrency=1, prefetch=1, poll_interval=60, name=name, sweep_interval=0.05
    )
    with running(w), psycopg.connect(dsn) as producer:
        wait_until(lambda: worker_waiting(admin, queue.schema, name) is False, what="waiting false")
        late = queue.enqueue({}, conn=producer)  # in the producer's open transaction
        gate.set()
        wait_until(lambda: worker_waiting(admin, queue.schema, name) is True, what="waiting true")
        wait_until(lambda: len(done) == 4, what="the slow jobs")
        t0 = time.monotonic()
        producer.commit()
        wait_until(lambda: late in done, timeout=10, what="the late job")
        assert time.monotonic() - t0 < 5  # the poll would take a minute


def test_a_worker_that_does_not_listen_never_asks_for_notifications(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    name = f"poll-{queue.schema}"
    w = Worker(
        queue, lambda job: None, listen=False, poll_interval=0.05, name=name, sweep_interval=0.05
    )
    with running(w):
        wait_until(lambda: worker_waiting(admin, queue.schema, name) is False, what="waiting false")


def test_async_worker_says_it_waits(queue: Queue, admin: psycopg.Connection[Any]) -> None:
    name = f"async-{queue.schema}"
    seen: list[int] = []

    async def handler(job: Job) -> None:
        seen.append(job.id)

    async def body(w: AsyncWorker, aq: AsyncQueue) -> None:
        await until(lambda: worker_waiting(admin, queue.schema, name) is True, what="waiting")
        t0 = time.monotonic()
        job_id = await aq.enqueue({})
        await until(lambda: job_id in seen, timeout=5, what="the job")
        assert time.monotonic() - t0 < 2  # woken, not polled

    with_worker(queue, handler, body, poll_interval=60, name=name, sweep_interval=0.05)
