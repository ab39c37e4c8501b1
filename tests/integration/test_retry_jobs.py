"""Failed jobs found and run again: Queue.find_jobs, retry_jobs and retry_failed.

A retry puts the same row back to pending (never a new job), moves it to the current
generation, and must stay safe against a concurrent worker and a concurrent retry: the
races are driven with real connections and pg_blocking_pids, never sleeps.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from skiplock import AsyncQueue, ConfigError, Job, JobInfo, Queue, RetryReport, _control
from skiplock._ops import Execute
from skiplock.sqlfiles import statements

from .test_worker import wait_until


def _traceback(exc: BaseException) -> str:
    try:
        raise exc
    except BaseException as caught:
        return "".join(traceback.format_exception(caught))


def _fail(queue: Queue, q: str, n: int, error: str, task: str | None = None) -> list[int]:
    """n jobs of queue q (and task) that ended failed with ``error``."""
    ids = queue.enqueue_many([{"n": i} for i in range(n)], queue=q, task=task)
    jobs = queue.claim(worker="w", queue=q, limit=n)
    assert sorted(j.id for j in jobs) == sorted(ids)
    queue.fail_many([(j, error, None, False) for j in jobs])
    return ids


def _row(admin: psycopg.Connection[Any], schema: str, job_id: int) -> tuple[Any, ...] | None:
    return admin.execute(
        sql.SQL(
            "SELECT status, attempts, last_error, part < 1000000, finished_at, "
            "run_at <= now(), count(*) OVER () FROM {}.jobs WHERE id = %s"
        ).format(sql.Identifier(schema)),
        (job_id,),
    ).fetchone()


def _count(admin: psycopg.Connection[Any], schema: str) -> int:
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone()
    assert row is not None
    return int(row[0])


# -- finding them ------------------------------------------------------------------------------


def test_find_jobs_filters_and_the_exception_line(queue: Queue) -> None:
    tb = _traceback(ValueError("bad invoice\nsecond line of the message"))
    bills = _fail(queue, "billing", 2, tb, task="billing.send")
    mails = _fail(queue, "mail", 1, "KeyError: 'to'", task="mail.send")
    pending = queue.enqueue({}, queue="billing", task="billing.send")
    cancelled = queue.enqueue({}, queue="billing", task="billing.other")
    queue.cancel(cancelled)

    rows = queue.find_jobs(status="failed")
    assert [r.id for r in rows] == sorted(bills + mails, reverse=True)  # newest first
    assert all(isinstance(r, JobInfo) for r in rows)
    bill = next(r for r in rows if r.id == bills[0])
    assert (bill.queue, bill.task, bill.status, bill.attempts) == (
        "billing",
        "billing.send",
        "failed",
        1,
    )
    assert bill.last_error == tb
    assert bill.error == "ValueError: bad invoice"  # not a 'File ...' line, not the last
    assert bill.finished_at is not None and bill.worker == "w"

    assert {r.id for r in queue.find_jobs(task="billing.send")} == {*bills, pending}
    assert {r.id for r in queue.find_jobs(status="failed", task="billing.send")} == set(bills)
    assert {r.id for r in queue.find_jobs(queue="mail")} == set(mails)
    assert {r.id for r in queue.find_jobs(error="KEYERROR")} == set(mails)  # any case
    assert {r.id for r in queue.find_jobs(error="100%")} == set()  # no LIKE wildcards
    assert {r.id for r in queue.find_jobs(status=["cancelled", "pending"])} == {
        pending,
        cancelled,
    }
    assert len(queue.find_jobs(since=timedelta(minutes=5))) == 5
    assert queue.find_jobs(since=datetime.now(UTC) + timedelta(minutes=5)) == []
    page = queue.find_jobs(limit=2)
    assert len(page) == 2
    rest = queue.find_jobs(before_id=page[-1].id)
    assert [r.id for r in page + rest] == sorted([*bills, *mails, pending, cancelled])[::-1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"status": "broken"}, "unknown status 'broken'"),
        ({"since": datetime(2030, 1, 1)}, "since 2030-01-01T00:00:00 has no timezone"),
        ({"since": "1h"}, "since must be a datetime, a timedelta or None"),
        ({"limit": 0}, "limit must be an integer from 1 to 10000"),
        ({"error": ""}, "error must be a non-empty string"),
    ],
)
def test_find_jobs_refuses_a_bad_filter_in_one_line(
    queue: Queue, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        queue.find_jobs(**kwargs)


def test_a_bad_queue_or_task_name_is_a_config_error(queue: Queue) -> None:
    with pytest.raises(ConfigError, match="invalid queue name"):
        queue.retry_failed(queue="")
    with pytest.raises(ConfigError, match="task name"):
        queue.find_jobs(task="")


# -- retrying them -----------------------------------------------------------------------------


def test_retry_jobs_puts_failed_and_cancelled_jobs_back_and_refuses_the_rest(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    [failed] = _fail(queue, "ops", 1, "boom")
    cancelled = queue.enqueue({}, queue="ops")
    queue.cancel(cancelled)
    pending = queue.enqueue({}, queue="other")
    done = queue.enqueue({}, queue="done")
    [job] = queue.claim(worker="w", queue="done")
    queue.complete(job)
    running = queue.enqueue({}, queue="run")
    [held] = queue.claim(worker="w", queue="run")
    before = _count(admin, queue.schema)

    report = queue.retry_jobs([failed, cancelled, pending, done, running, 424242, failed])
    assert isinstance(report, RetryReport)
    assert sorted(report.retried) == sorted([failed, cancelled])
    assert report.refused == {
        pending: "pending: it has not failed; it runs when due",
        done: "done: it succeeded; enqueue a new job to run it again",
        running: "running: cancel it first, or let its attempt end",
        424242: "unknown: no job with this id",
    }
    assert _count(admin, queue.schema) == before  # the same rows: no new job
    # Pending, due now, a fresh attempt budget, the last error kept, in a generation.
    assert _row(admin, queue.schema, failed) == ("pending", 0, "boom", True, None, True, 1)
    assert _row(admin, queue.schema, cancelled)[:2] == ("pending", 0)  # type: ignore[index]
    # The refused ones are untouched, and the running one's lease still fences.
    assert _row(admin, queue.schema, done)[0] == "done"  # type: ignore[index]
    queue.complete(held)
    assert {j.id for j in queue.claim(worker="w2", queue="ops", limit=5)} == {failed, cancelled}
    assert queue.retry_jobs([]) == RetryReport()


def test_a_retried_job_runs_again_with_its_full_budget(queue: Queue) -> None:
    job_id = queue.enqueue({}, queue="ops", max_attempts=2)
    for _ in range(2):
        [job] = queue.claim(worker="w", queue="ops")
        queue.fail(job, "boom", delay=0)
    assert queue.get(job_id).status == "failed"  # type: ignore[union-attr]
    assert queue.retry_jobs([job_id]).retried == (job_id,)
    [job] = queue.claim(worker="w", queue="ops")
    assert (job.id, job.attempts) == (job_id, 1)
    assert queue.fail(job, "again", delay=0) == "pending"  # 1 of 2: retried by policy


def test_a_job_moved_to_its_day_is_retried_from_there(
    queue: Queue, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upkeep moves finished jobs to a partition per day, which no claim reads: the
    retry must bring the row back to a generation, or it would never run."""
    [job_id] = _fail(queue, "ops", 1, "boom")
    monkeypatch.setattr(queue, "ROTATE_ROWS", 1)
    monkeypatch.setattr(queue, "ROTATE_AFTER", 0.0)
    queue.upkeep()
    queue.upkeep()
    assert _row(admin, queue.schema, job_id)[3] is False  # type: ignore[index]  # in its day
    assert queue.retry_jobs([job_id]).retried == (job_id,)
    assert _row(admin, queue.schema, job_id)[:4] == ("pending", 0, "boom", True)  # type: ignore[index]
    assert [j.id for j in queue.claim(worker="w", queue="ops")] == [job_id]


def test_retry_failed_takes_the_matching_failed_jobs_batch_by_batch(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue, "RETRY_BATCH", 2)
    bills = _fail(queue, "billing", 5, "boom", task="billing.send")
    others = _fail(queue, "billing", 2, "boom", task="billing.other")
    mails = _fail(queue, "mail", 1, "boom", task="billing.send")
    cancelled = queue.enqueue({}, queue="billing", task="billing.send")
    queue.cancel(cancelled)

    assert queue.retry_failed(since=datetime.now(UTC) + timedelta(minutes=1)) == RetryReport()
    report = queue.retry_failed(queue="billing", task="billing.send")
    assert report == RetryReport(tuple(bills), {})  # 3 batches of 2, in id order
    assert queue.retry_failed(queue="billing", task="billing.send") == RetryReport()
    report = queue.retry_failed(since=timedelta(minutes=5))
    assert sorted(report.retried) == sorted(others + mails)
    assert queue.get(cancelled).status == "cancelled"  # type: ignore[union-attr]  # by id only


def test_a_job_that_fails_again_meanwhile_is_retried_once_per_call(dsn: str, queue: Queue) -> None:
    """retry_failed reads the matching ids once, then retries them a batch at a time: a
    job retried by an early batch that fails again before a later batch is not taken a
    second time (else a call could go on retrying a job that a worker fails at once).
    The operation is driven a statement at a time, and the first retried job is run and
    failed again between batches."""
    ids = _fail(queue, "ops", 3, "boom")
    stmts = queue._stmts
    op = _control.retry_failed(
        stmts, {"queue": "ops", "task": None, "since": None}, _control.RetryProgress(), batch=1
    )
    failed_again: list[int] = []
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        step = next(op)
        while True:
            assert isinstance(step, Execute)
            rows = conn.execute(step.query, step.params).fetchall()
            if step.query is stmts.retry_jobs and not failed_again:
                [job] = queue.claim(worker="w", queue="ops")
                assert queue.fail(job, "again", retry=False) == "failed"
                failed_again.append(job.id)
            try:
                step = op.send(rows)
            except StopIteration as stop:
                report = stop.value
                break
    assert failed_again == ids[:1]
    assert report == RetryReport(tuple(ids), {})
    assert queue.get(ids[0]).status == "failed"  # type: ignore[union-attr]
    assert queue.retry_failed().retried == (ids[0],)  # the next call takes it


# -- races -------------------------------------------------------------------------------------


def _blocked_on(admin: psycopg.Connection[Any], app: str, pid: int) -> bool:
    row = admin.execute(
        "SELECT %s = ANY (pg_blocking_pids(pid)) FROM pg_stat_activity "
        "WHERE application_name = %s AND state = 'active'",
        (pid, app),
    ).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("moved", [False, True], ids=["in-place", "across-partitions"])
def test_two_retries_of_one_job_retry_it_once_and_it_is_claimed_once(
    dsn: str,
    queue: Queue,
    admin: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    moved: bool,
) -> None:
    """The first retry holds the row, uncommitted; the second waits for it (seen in
    pg_blocking_pids), then finds the job pending and refuses it.  When the first moved
    the row to another generation the second's statement fails with a serialization
    error instead, and is run again: the same answer.  Meanwhile a claim skips the row,
    and after the commit two claimers take it once."""
    [job_id] = _fail(queue, "ops", 1, "boom")
    if moved:  # the current generation moves on: the retry then moves the row
        monkeypatch.setattr(queue, "ROTATE_ROWS", 1)
        monkeypatch.setattr(queue, "ROTATE_AFTER", 0.0)
        assert queue.upkeep(max_steps=1) == {"rotated": 1}
    stmts = statements(queue.schema)
    first = psycopg.connect(dsn)
    app = f"retry-race-{queue.schema}"
    answers: list[Any] = []
    try:
        rows = first.execute(stmts.retry_jobs, {"ids": [job_id], "schema": queue.schema})
        assert rows.fetchall() == [(job_id, True, None)]
        with Queue(dsn, schema=queue.schema, application_name=app, max_size=1) as q2:

            def second() -> None:
                try:
                    answers.append(q2.retry_jobs([job_id]))
                except BaseException as exc:
                    answers.append(exc)

            t = threading.Thread(target=second)
            t.start()
            wait_until(
                lambda: _blocked_on(admin, app, first.info.backend_pid),
                what="the second retry waits for the first",
            )
            assert queue.claim(worker="early", queue="ops") == []  # not pending yet
            first.commit()
            t.join(timeout=30)
    finally:
        first.close()
    assert answers == [RetryReport((), {job_id: "pending: it has not failed; it runs when due"})], (
        answers
    )
    row = _row(admin, queue.schema, job_id)
    assert row is not None and row[:2] == ("pending", 0) and row[-1] == 1
    assert (row[3] is True) and _count(admin, queue.schema) == 1

    claimed: list[list[Job]] = []
    with (
        Queue(dsn, schema=queue.schema, max_size=1) as qa,
        Queue(dsn, schema=queue.schema, max_size=1) as qb,
    ):
        barrier = threading.Barrier(2)

        def claim(q: Queue, name: str) -> None:
            barrier.wait()
            claimed.append(q.claim(worker=name, queue="ops"))

        threads = [threading.Thread(target=claim, args=(q, n)) for q, n in ((qa, "a"), (qb, "b"))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
    assert sorted(len(c) for c in claimed) == [0, 1]


def test_retries_racing_workers_run_each_failed_job_exactly_once_more(
    dsn: str, queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three operators run retry_failed at once, in small batches (so their statements
    wait on each other's rows), while two workers claim and complete: each failed job is
    retried by exactly one of them and claimed exactly once."""
    monkeypatch.setattr(Queue, "RETRY_BATCH", 20)
    ids = _fail(queue, "ops", 300, "boom")
    reports: list[RetryReport] = []
    claims: Counter[int] = Counter()
    lock = threading.Lock()
    stop = threading.Event()
    start = threading.Barrier(5)

    def operator() -> None:
        with Queue(dsn, schema=queue.schema, max_size=1) as q:
            start.wait()
            report = q.retry_failed(queue="ops")
        with lock:
            reports.append(report)

    def worker(name: str) -> None:
        with Queue(dsn, schema=queue.schema, max_size=1) as q:
            start.wait()
            while not stop.is_set():
                jobs = q.claim(worker=name, queue="ops", limit=10)
                with lock:
                    claims.update(j.id for j in jobs)
                if jobs:
                    q.complete_many([(j, None) for j in jobs])

    threads = [threading.Thread(target=operator) for _ in range(3)]
    threads += [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(claims) == len(ids), timeout=60, what="every job claimed")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    retried = Counter(i for r in reports for i in r.retried)
    assert sorted(retried) == sorted(ids) and set(retried.values()) == {1}
    assert set(claims.values()) == {1}
    statuses = Counter(r.status for r in queue.find_jobs(queue="ops", limit=1000))
    assert statuses == {"done": len(ids)}


# -- the async driver --------------------------------------------------------------------------


def test_the_async_queue_finds_and_retries_the_same_way(dsn: str, queue: Queue) -> None:
    [job_id] = _fail(queue, "ops", 1, "boom", task="t.x")

    async def main() -> None:
        async with AsyncQueue(dsn, schema=queue.schema, max_size=1) as aq:
            [info] = await aq.find_jobs(status="failed", task="t.x")
            assert (info.id, info.error) == (job_id, "boom")
            assert (await aq.retry_jobs([job_id])).retried == (job_id,)
            assert (await aq.retry_failed()).retried == ()

    asyncio.run(main())
