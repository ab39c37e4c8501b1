"""Per-key concurrency (migration 0018): at most N jobs of one key run at once.

A keyed job waits `throttled` (a status the claim never reads) until its key has a free
slot; the slot is released in the transaction of the write that ends the job.  These
tests run real workers against the limit, check fairness across keys, and check that
every way a keyed job ends (or does not end) releases its slot once, including two
completions of one key at the same instant, driven with pg_blocking_pids.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, ConfigError, Job, Queue, Worker

from .test_worker import running, wait_until


def _states(admin: psycopg.Connection[Any], queue: Queue, key: str) -> dict[str, list[int]]:
    rows = admin.execute(
        sql.SQL(
            "SELECT status, array_agg(id ORDER BY id) FROM {}.jobs "
            "WHERE concurrency_key = %s GROUP BY status"
        ).format(sql.Identifier(queue.schema)),
        (key,),
    ).fetchall()
    return {str(s): list(ids) for s, ids in rows}


def _admitted(admin: psycopg.Connection[Any], queue: Queue, key: str) -> int:
    s = _states(admin, queue, key)
    return len(s.get("pending", [])) + len(s.get("running", []))


def _blocked_by(admin: psycopg.Connection[Any], pid: int) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
        (pid,),
    ).fetchone()
    return row is not None and int(row[0]) > 0


@pytest.mark.connections(36)
def test_limit_holds_across_concurrent_workers(queue: Queue) -> None:
    """Limit 1 over 24 keys, three Workers of 6 handlers each: no key ever runs two of
    its jobs at once (from the handlers' own start/end times), and every job runs once."""
    keys = [f"k{i}" for i in range(24)]
    expected = 0
    for k in keys:
        queue.enqueue_many([{"k": k, "n": n} for n in range(4)], concurrency_key=k, concurrency=1)
        expected += 4
    spans: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    lock = threading.Lock()

    def handler(job: Job) -> None:
        start = time.monotonic()
        time.sleep(0.005)  # the handler's work: long enough for overlaps to show
        with lock:
            spans[job.payload["k"]].append((start, time.monotonic(), job.id))

    workers = [
        Worker(queue, handler, concurrency=6, lease=10, poll_interval=0.05, name=f"w{i}")
        for i in range(3)
    ]
    with running(workers[0]), running(workers[1]), running(workers[2]):
        wait_until(lambda: sum(len(v) for v in spans.values()) >= expected, what="all jobs")
    ran = [jid for v in spans.values() for _, _, jid in v]
    assert len(ran) == expected and len(set(ran)) == expected
    for k, v in spans.items():
        v.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(v):
            assert start >= end, f"key {k}: two jobs ran at once"


def test_a_tenants_backlog_does_not_hold_back_another_tenant(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """2,000 jobs of tenant a, then one of tenant b: b's job is in the first claim of 10
    (in plain claim order it would be 2,001st), and a has exactly its limit claimable."""
    queue.enqueue_many([{"n": n} for n in range(2000)], concurrency_key="tenant:a", concurrency=3)
    b = queue.enqueue({"n": 0}, concurrency_key="tenant:b", concurrency=3)
    plain = queue.enqueue({"n": 0})
    claimed = queue.claim(worker="w", limit=10, lease=30)
    ids = {j.id for j in claimed}
    assert b in ids and plain in ids
    assert len(claimed) == 5  # a's three admitted, b's, the plain one
    assert len(_states(admin, queue, "tenant:a")["throttled"]) == 1997


def test_each_way_a_keyed_job_ends_releases_its_slot_once(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    key = "customer:1"
    ids = [
        queue.enqueue({"n": n}, concurrency_key=key, concurrency=1, max_attempts=2)
        for n in range(6)
    ]
    assert _states(admin, queue, key) == {"pending": ids[:1], "throttled": ids[1:]}

    # A retry (with a delay) and a sweep back to pending keep the slot: nobody else is
    # admitted while the job is still the key's turn.
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.fail(job, "busy", delay=30.0, retry=True)
    assert _states(admin, queue, key)["pending"] == ids[:1]
    admin.execute(
        sql.SQL("UPDATE {}.jobs SET run_at = now() WHERE id = %s").format(
            sql.Identifier(queue.schema)
        ),
        (ids[0],),
    )
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    assert job.id == ids[0] and job.attempts == 2
    # Out of attempts: the failure ends it and admits the next, once.
    queue.fail(job, "boom", retry=True)
    assert _states(admin, queue, key)["failed"] == ids[:1]
    assert _states(admin, queue, key)["pending"] == ids[1:2]

    # Cancel of a pending (admitted) job releases; cancel of a throttled one does not
    # admit an extra job.
    assert queue.cancel(ids[1]) == "cancelled"
    assert queue.cancel(ids[3]) == "cancelled"
    assert _states(admin, queue, key)["pending"] == ids[2:3]

    # A sweep with attempts left keeps the slot; the completion releases it.
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    admin.execute(  # the lease ran out
        sql.SQL(
            "UPDATE {}.jobs SET locked_until = now() - interval '1 second' WHERE id = %s"
        ).format(sql.Identifier(queue.schema)),
        (job.id,),
    )
    assert queue.sweep() == 1
    assert _states(admin, queue, key)["pending"] == ids[2:3]
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.complete(job)
    assert _states(admin, queue, key)["pending"] == ids[4:5]

    # Delete of an admitted job releases; a requeue waits for a slot like a new job.
    queue.delete(ids[4])
    assert _states(admin, queue, key)["pending"] == ids[5:6]
    queue.requeue(ids[2])
    assert _states(admin, queue, key)["throttled"] == ids[2:3]
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.complete(job)
    assert _states(admin, queue, key)["pending"] == ids[2:3]
    assert _admitted(admin, queue, key) == 1


def test_two_completions_at_once_admit_the_right_number(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """Limit 2, both slots running, three waiting.  One completion commits while the
    other waits for the key's row (seen in pg_blocking_pids): the second must count
    the first's admission, so exactly two waiters are admitted, not one or three."""
    key = "k"
    ids = [queue.enqueue({"n": n}, concurrency_key=key, concurrency=2) for n in range(5)]
    first, second = sorted(queue.claim(worker="w", limit=5, lease=30), key=lambda j: j.id)
    schema = sql.Identifier(queue.schema)
    errors: list[BaseException] = []

    def complete_second() -> None:
        try:
            queue.complete(second)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with psycopg.connect(dsn) as holder:
        # The first completion, as the `complete` statement writes it, left open.
        holder.execute(
            sql.SQL(
                "UPDATE {}.jobs SET status = 'done', finished_at = now(), locked_until = NULL "
                "WHERE id = %s AND lease_token = %s"
            ).format(schema),
            (first.id, first.lease_token),
        )
        pid = holder.info.backend_pid
        t = threading.Thread(target=complete_second, daemon=True)
        t.start()
        wait_until(lambda: _blocked_by(admin, pid), what="the second completion to wait")
        holder.commit()
    t.join(10)
    assert not errors
    assert _states(admin, queue, key) == {
        "done": [first.id, second.id],
        "pending": ids[2:4],
        "throttled": ids[4:],
    }


def test_upkeep_moves_keep_a_delayed_keyed_job_and_its_slot(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """A retry delayed past a minute is moved to the current generation by upkeep (a
    DELETE and an INSERT, not an UPDATE): it keeps its key and its turn, nobody else is
    admitted, and the finished jobs moved to their day release nothing again."""
    key = "k"
    ids = [queue.enqueue({"n": n}, concurrency_key=key, concurrency=1) for n in range(3)]
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.fail(job, "later", delay=3600.0, retry=True)
    schema = sql.Identifier(queue.schema)
    part_sql = sql.SQL("SELECT part FROM {}.jobs WHERE id = %s").format(schema)
    before = admin.execute(part_sql, (ids[0],)).fetchone()
    # Rotate to a new generation, then let upkeep move the delayed job out of the old.
    admin.execute(sql.SQL("SELECT * FROM {}.upkeep(0, 0, 0, 1000)").format(schema))
    moved = False
    for _ in range(10):
        rows = admin.execute(
            sql.SQL("SELECT action FROM {}.upkeep(0, 1000000, 1000000, 1000)").format(schema)
        ).fetchall()
        moved = moved or any(r[0] == "moved" for r in rows)
    assert moved
    row = admin.execute(
        sql.SQL("SELECT part, status, concurrency_key FROM {}.jobs WHERE id = %s").format(schema),
        (ids[0],),
    ).fetchone()
    assert row is not None and row[1:] == ("pending", key)
    assert before is not None and row[0] != before[0]
    assert _states(admin, queue, key) == {"pending": ids[:1], "throttled": ids[1:]}


def test_task_concurrency_key_template_and_callable(dsn: str, schema: str) -> None:
    app = App(dsn, schema=schema, max_size=4)
    app.queue.migrate()
    try:

        @app.task(concurrency_key="customer:{customer_id}")
        def sync(customer_id: int, full: bool = False) -> None: ...

        @app.task(concurrency_key=lambda region, **_: f"region:{region}", concurrency=2)
        def report(region: str, day: str) -> None: ...

        a = sync.defer(customer_id=7)
        b = sync.defer(customer_id=7, full=True)
        c = sync.defer(customer_id=8)
        many = report.defer_many([{"region": "eu", "day": str(d)} for d in range(3)])
        got = {j.id: j.status for j in (app.queue.get(i) for i in [a, b, c, *many]) if j}
        assert got == {
            a: "pending",
            b: "throttled",
            c: "pending",
            many[0]: "pending",
            many[1]: "pending",
            many[2]: "throttled",
        }
        with pytest.raises(ConfigError, match="names 'customer', not an argument"):

            @app.task(concurrency_key="{customer}")
            def bad(customer_id: int) -> None: ...

    finally:
        app.close()


def test_bad_concurrency_options_are_refused_before_sending(queue: Queue) -> None:
    with pytest.raises(ValueError, match="concurrency needs a concurrency_key"):
        queue.enqueue({}, concurrency=2)
    with pytest.raises(
        ValueError, match=r"concurrency \(jobs of one key.* must be an integer from 1"
    ):
        queue.enqueue({}, concurrency_key="k", concurrency=0)
    with pytest.raises(ValueError, match="concurrency_key must be a non-empty string"):
        queue.enqueue({}, concurrency_key="", concurrency=1)
    with pytest.raises(ValueError, match="cannot be combined with an idempotency key"):
        queue.enqueue({}, concurrency_key="k", concurrency=1, idempotency_key="i")
    parent = queue.enqueue({})
    with pytest.raises(ValueError, match="after cannot be combined with a concurrency_key"):
        queue.enqueue({}, concurrency_key="k", concurrency=1, after=[parent])
    assert [j["id"] for j in queue.list_jobs()] == [parent]


def test_a_requeue_from_its_day_waits_for_a_slot(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """A requeue of a job moved to its day is a cross-partition UPDATE, which fires the
    INSERT and DELETE triggers, not the UPDATE ones: the job still goes through
    admission, waiting while another job of its key holds the slot."""
    key = "k"
    (first,) = [queue.enqueue({"n": 0}, concurrency_key=key, concurrency=1)]
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.complete(job)
    schema = sql.Identifier(queue.schema)
    admin.execute(sql.SQL("SELECT * FROM {}.upkeep(0, 0, 0, 1000)").format(schema))
    for _ in range(10):
        admin.execute(sql.SQL("SELECT * FROM {}.upkeep(0, 1000000, 1000000, 1000)").format(schema))
    part_sql = sql.SQL("SELECT part FROM {}.jobs WHERE id = %s").format(schema)
    row = admin.execute(part_sql, (first,)).fetchone()
    assert row is not None and row[0] >= 1000000  # in its day
    later = queue.enqueue({"n": 1}, concurrency_key=key, concurrency=1)
    queue.requeue(first)
    row = admin.execute(part_sql, (first,)).fetchone()
    assert row is not None and row[0] < 1000000
    assert _states(admin, queue, key) == {"pending": [later], "throttled": [first]}
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.complete(job)
    assert _states(admin, queue, key) == {"done": [later], "pending": [first]}


def test_a_retried_failed_job_waits_for_its_keys_slot(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """``retry_jobs`` of a keyed job goes through admission as a requeue does: while
    another job of its key holds the only slot, the retried one waits throttled, and is
    admitted by the write that ends the holder.  (It was made pending at once, so two
    jobs of a limit-1 key could run together.)"""
    key = "c1"
    first, second = (
        queue.enqueue({"n": n}, concurrency_key=key, concurrency=1, max_attempts=1)
        for n in range(2)
    )
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    assert job.id == first
    queue.fail(job, "boom", retry=True)
    assert _states(admin, queue, key) == {"failed": [first], "pending": [second]}

    report = queue.retry_jobs([first])
    assert report.retried == (first,)
    assert _states(admin, queue, key) == {"pending": [second], "throttled": [first]}
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    assert job.id == second
    queue.complete(job)
    assert _states(admin, queue, key) == {"done": [second], "pending": [first]}

    # With its slot free, a retried job is admitted at once.
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    queue.fail(job, "boom again", retry=True)
    queue.retry_jobs([first])
    assert _states(admin, queue, key) == {"done": [second], "pending": [first]}
