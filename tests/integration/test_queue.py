"""Queue against a real PostgreSQL: enqueue, claim, the fenced writes, sweep, dedup."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import (
    ConfigError,
    DatabaseUnavailable,
    DuplicateJob,
    Job,
    JobStateError,
    LeaseLost,
    PayloadError,
    Queue,
    UnknownJob,
)
from skiplock._queue import run_op


def row(admin: psycopg.Connection[Any], schema: str, job_id: int) -> dict[str, Any]:
    cur = admin.cursor(row_factory=psycopg.rows.dict_row)
    cur.execute(
        sql.SQL("SELECT * FROM {}.jobs WHERE id = %s").format(sql.Identifier(schema)), (job_id,)
    )
    found = cur.fetchone()
    assert found is not None
    return found


def expire(admin: psycopg.Connection[Any], schema: str, job_id: int) -> None:
    """Move a lease into the past instead of sleeping until it runs out."""
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET locked_until = now() - interval '1 second' WHERE id = %s"
        ).format(sql.Identifier(schema)),
        (job_id,),
    )


def test_enqueue_claim_complete(queue: Queue) -> None:
    job_id = queue.enqueue({"invoice": 7}, queue="emails")
    [job] = queue.claim(worker="w1", queue="emails", limit=10, lease=30)
    assert (job.id, job.queue, job.payload, job.attempts) == (job_id, "emails", {"invoice": 7}, 1)
    assert job.worker == "w1" and job.status == "running" and job.lease_token is not None
    assert job.idempotency_key == f"skiplock:emails:{job_id}"
    assert queue.claim(worker="w2", queue="emails") == []
    queue.complete(job)
    done = queue.get(job_id)
    assert done is not None and done.status == "done" and done.finished_at is not None


def test_claim_order_priority_then_run_at_then_id(queue: Queue) -> None:
    past = datetime.now(UTC) - timedelta(minutes=5)
    a = queue.enqueue("a", priority=5)
    b = queue.enqueue("b", priority=0)
    c = queue.enqueue("c", priority=0, run_at=past)
    future = queue.enqueue("later", run_at=datetime.now(UTC) + timedelta(hours=1))
    jobs = queue.claim(worker="w", limit=10)
    assert [j.id for j in jobs] == [c, b, a]
    assert future not in [j.id for j in jobs]


def test_claim_respects_queue(queue: Queue) -> None:
    queue.enqueue(1, queue="a")
    queue.enqueue(2, queue="b")
    assert [j.payload for j in queue.claim(worker="w", queue="b", limit=5)] == [2]


def test_fencing_after_sweep_and_reclaim(queue: Queue, admin: psycopg.Connection[Any]) -> None:
    job_id = queue.enqueue({"n": 1})
    [first] = queue.claim(worker="w1", lease=30)
    expire(admin, queue.schema, job_id)
    assert queue.sweep() == 1
    swept = queue.get(job_id)
    assert swept is not None and swept.status == "pending" and swept.attempts == 1
    assert "lease expired on worker w1" in (swept.last_error or "")
    [second] = queue.claim(worker="w2", lease=30)
    assert second.id == job_id and second.attempts == 2
    assert second.lease_token != first.lease_token
    before = row(admin, queue.schema, job_id)
    lost_before = queue.lease_lost_count
    for stale_write in (
        lambda: queue.complete(first),
        lambda: queue.fail(first, "late failure"),
        lambda: queue.heartbeat(first, lease=600),
        lambda: queue.release(first),
        lambda: queue.retry(first, delay=1),
    ):
        with pytest.raises(LeaseLost) as err:
            stale_write()
        assert err.value.job_ids == [job_id]
    assert queue.lease_lost_count == lost_before + 5
    assert row(admin, queue.schema, job_id) == before  # the stale writes changed nothing
    queue.complete(second)
    assert row(admin, queue.schema, job_id)["status"] == "done"
    with pytest.raises(LeaseLost):
        queue.complete(second)  # a second completion is rejected too


def test_sweep_window_looks_back_only_that_far(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    recent, old = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    queue.claim(worker="w1", lease=30, limit=2)
    expire(admin, queue.schema, recent)  # ran out 1 s ago
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET locked_until = now() - interval '2 minutes' WHERE id = %s"
        ).format(sql.Identifier(queue.schema)),
        (old,),
    )
    assert queue.sweep(window=60.0) == 1  # the one that ran out within the last minute
    assert row(admin, queue.schema, recent)["status"] == "pending"
    assert row(admin, queue.schema, old)["status"] == "running"
    assert queue.sweep() == 1  # no window: all the way back
    assert row(admin, queue.schema, old)["status"] == "pending"
    for bad in (-1.0, float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError, match="sweep window"):
            queue.sweep(window=bad)


def test_expired_but_untouched_lease_may_still_complete(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w1", lease=30)
    expire(admin, queue.schema, job_id)
    queue.complete(job)  # nobody swept or re-claimed: the token is still good
    assert queue.sweep() == 0
    done = queue.get(job_id)
    assert done is not None and done.status == "done"


def test_cancel_of_a_running_job_is_cooperative_and_never_ends_done(queue: Queue) -> None:
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w1")
    assert queue.cancel(job_id) == "running"  # asked, not yet seen
    assert not job.cancelled
    queue.heartbeat(job)  # the lease is still ours: the worker may clean up
    assert job.cancelled
    queue.complete(job, {"partial": True})  # the handler finished anyway
    cancelled = queue.get(job_id)
    assert cancelled is not None and cancelled.status == "cancelled"
    with pytest.raises(JobStateError, match="already cancelled"):
        queue.cancel(job_id)
    with pytest.raises(UnknownJob, match="no job with id 999999"):
        queue.cancel(999999)


def test_cancel_of_a_pending_job_is_immediate(queue: Queue) -> None:
    job_id = queue.enqueue({})
    assert queue.cancel(job_id) == "cancelled"
    assert queue.claim(worker="w1") == []
    got = queue.get(job_id)
    assert got is not None and got.status == "cancelled" and got.finished_at is not None


def test_a_cancelled_job_handed_back_or_swept_ends_cancelled(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    a, b, c = (queue.enqueue({"n": n}) for n in range(3))
    jobs = {j.id: j for j in queue.claim(worker="w1", limit=3)}
    for job_id in (a, b, c):
        queue.cancel(job_id)
    assert queue.fail(jobs[a], "boom") == "cancelled"  # no retry of a cancelled job
    queue.release(jobs[b])
    expire(admin, queue.schema, c)
    assert queue.sweep() == 1
    assert {queue.get(i).status for i in (a, b, c)} == {"cancelled"}  # type: ignore[union-attr]
    assert queue.claim(worker="w2", limit=3) == []


def test_sweep_exhausted_job_fails_with_reason(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    job_id = queue.enqueue({}, max_attempts=2)
    for _ in range(2):
        [_job] = queue.claim(worker="w1")
        expire(admin, queue.schema, job_id)
        queue.sweep()
    final = queue.get(job_id)
    assert final is not None and final.status == "failed" and final.attempts == 2
    assert "during attempt 2 of 2" in (final.last_error or "")
    assert queue.claim(worker="w1") == []


def test_heartbeat_keeps_a_job_from_the_sweeper(queue: Queue) -> None:
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w1", lease=30)
    new_expiry = queue.heartbeat(job, lease=120)
    assert new_expiry > datetime.now(UTC) + timedelta(seconds=100)
    assert queue.sweep() == 0
    got = queue.get(job_id)
    assert got is not None and got.status == "running"


def test_sweep_skips_a_row_being_heartbeated_without_waiting(
    queue: Queue, dsn: str, admin: psycopg.Connection[Any]
) -> None:
    """A heartbeat in flight holds the row lock; the sweeper must skip it, not block or win."""
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w1", lease=30)
    expire(admin, queue.schema, job_id)
    with psycopg.connect(dsn) as beat:
        beat.execute(
            sql.SQL(
                "UPDATE {}.jobs SET locked_until = now() + interval '1 minute' "
                "WHERE id = %s AND lease_token = %s AND status = 'running'"
            ).format(sql.Identifier(queue.schema)),
            (job.id, job.lease_token),
        )
        # Transaction open: the heartbeat has not committed yet.
        with psycopg.connect(dsn, autocommit=True) as sweeper:
            sweeper.execute("SET lock_timeout = '2s'")  # a wait would fail loudly, not hang
            q2 = sql.SQL(
                "WITH e AS MATERIALIZED (SELECT id FROM {s}.jobs WHERE status = 'running' "
                "AND locked_until < now() FOR UPDATE SKIP LOCKED) SELECT count(*) FROM e"
            ).format(s=sql.Identifier(queue.schema))
            assert sweeper.execute(q2).fetchone() == (0,)
        assert queue.sweep() == 0
        beat.commit()
    queue.complete(job)


def test_concurrent_sweepers_return_each_job_once(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    queue.enqueue_many([{"n": i} for i in range(600)])
    claimed = queue.claim(worker="dead", limit=600, lease=30)
    assert len(claimed) == 600
    admin.execute(
        sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1 second'").format(
            sql.Identifier(queue.schema)
        )
    )
    counts: list[int] = []
    lock = threading.Lock()

    def sweep() -> None:
        with Queue(queue.settings.dsn, schema=queue.schema, max_size=1) as q:
            n = q.sweep(limit=50)
        with lock:
            counts.append(n)

    threads = [threading.Thread(target=sweep) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts) == 600
    assert all(j.status == "pending" for j in (queue.get(c.id) for c in claimed) if j)


def test_fail_retries_with_backoff_then_fails(queue: Queue) -> None:
    job_id = queue.enqueue({}, max_attempts=2)
    [job] = queue.claim(worker="w")
    assert queue.fail(job, "boom", delay=60) == "pending"
    retried = queue.get(job_id)
    assert retried is not None and retried.last_error == "boom"
    assert retried.run_at > datetime.now(UTC) + timedelta(seconds=50)
    assert queue.claim(worker="w") == []  # not due yet
    with queue.connection() as c:
        c.execute(
            sql.SQL("UPDATE {}.jobs SET run_at = now() WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (job_id,),
        )
    [again] = queue.claim(worker="w")
    assert again.attempts == 2
    assert queue.fail(again, "boom again") == "failed"  # attempts exhausted
    final = queue.get(job_id)
    assert final is not None and final.status == "failed" and final.finished_at is not None


def test_fail_without_retry_ends_at_once(queue: Queue) -> None:
    job_id = queue.enqueue({}, max_attempts=10)
    [job] = queue.claim(worker="w")
    assert queue.fail(job, "permanent", retry=False) == "failed"
    final = queue.get(job_id)
    assert final is not None and final.status == "failed" and final.attempts == 1


def test_default_backoff_comes_from_the_policy(queue: Queue) -> None:
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w")
    queue.fail(job, "x")
    got = queue.get(job_id)
    assert got is not None and got.status == "pending"
    # RetryPolicy defaults: 1 s after the first attempt, +-20 % jitter
    assert got.run_at > datetime.now(UTC) + timedelta(seconds=0.5)


def test_release_gives_the_attempt_back(queue: Queue) -> None:
    job_id = queue.enqueue({})
    [job] = queue.claim(worker="w")
    queue.release(job)
    got = queue.get(job_id)
    assert got is not None and got.status == "pending" and got.attempts == 0
    [again] = queue.claim(worker="w2")
    assert again.attempts == 1
    with pytest.raises(LeaseLost):
        queue.release(job)


def test_idempotency_key_dedups(queue: Queue) -> None:
    a = queue.enqueue({"v": 1}, idempotency_key="invoice-7")
    b = queue.enqueue({"v": 1}, idempotency_key="invoice-7")
    c = queue.enqueue({"v": 3}, idempotency_key="invoice-7", queue="other")
    assert a == b != c
    # Other arguments under a held key: an error naming the job, never that job's id.
    with pytest.raises(DuplicateJob, match=f"held by job {a}"):
        queue.enqueue({"v": 2}, idempotency_key="invoice-7")
    [job] = queue.claim(worker="w")
    assert job.idempotency_key == "invoice-7" and job.payload == {"v": 1}


def test_idempotency_key_under_concurrent_enqueue(queue: Queue) -> None:
    ids: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def go() -> None:
        with Queue(queue.settings.dsn, schema=queue.schema, max_size=1) as q:
            barrier.wait()
            got = q.enqueue({}, idempotency_key="same")
        with lock:
            ids.append(got)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert len(queue.claim(worker="w", limit=10)) == 1


def test_enqueue_many_copy(queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": i} for i in range(1000)], queue="bulk", priority=3)
    assert len(ids) == len(set(ids)) == 1000
    jobs = queue.claim(worker="w", queue="bulk", limit=1000)
    assert sorted(j.id for j in jobs) == sorted(ids)
    assert {j.payload["n"] for j in jobs} == set(range(1000))
    assert {j.priority for j in jobs} == {3}
    assert queue.enqueue_many([]) == []


def test_enqueue_many_with_keys(queue: Queue) -> None:
    first = queue.enqueue(1, idempotency_key="k1")
    ids = queue.enqueue_many([1, 2, 2, 4], idempotency_keys=["k1", "k2", "k2", None])
    assert ids[0] == first
    assert ids[1] == ids[2] != ids[3]
    assert len(queue.claim(worker="w", limit=10)) == 3


def test_enqueue_in_the_callers_transaction(queue: Queue, dsn: str) -> None:
    with psycopg.connect(dsn) as app:
        app.execute("CREATE TEMP TABLE invoices (id int)")
        app.execute("INSERT INTO invoices VALUES (1)")
        queue.enqueue({"invoice": 1}, conn=app)
        app.rollback()
        assert queue.claim(worker="w") == []  # rolled back with the business write
        app.execute("CREATE TEMP TABLE invoices (id int)")
        app.execute("INSERT INTO invoices VALUES (2)")
        job_id = queue.enqueue({"invoice": 2}, conn=app)
        assert queue.get(job_id) is None  # not visible before commit
        app.commit()
    [job] = queue.claim(worker="w")
    assert job.payload == {"invoice": 2}


def test_bad_inputs_write_nothing(queue: Queue) -> None:
    with pytest.raises(PayloadError):
        queue.enqueue({"when": datetime.now()})
    with pytest.raises(PayloadError):
        queue.enqueue("nul\x00byte")
    with pytest.raises(PayloadError, match="payload #2"):
        queue.enqueue_many([1, 2, object()])
    with pytest.raises(ConfigError):
        queue.enqueue({}, queue="bad queue")
    with pytest.raises(ConfigError):
        queue.enqueue({}, queue="x'); DROP TABLE jobs; --")
    with pytest.raises(ValueError):
        queue.enqueue({}, max_attempts=0)
    small = Queue(queue.settings.dsn, schema=queue.schema, max_payload_bytes=100, max_size=1)
    with pytest.raises(PayloadError, match="over the limit"):
        small.enqueue("x" * 200)
    small.close()
    assert queue.status() == []


def test_unmigrated_schema_is_a_clear_error(dsn: str) -> None:
    with (
        Queue(dsn, schema="skiplock_never_migrated", max_size=1) as q,
        pytest.raises(ConfigError, match="skiplock migrate"),
    ):
        q.enqueue({})


def test_unreachable_dsn_is_a_clear_error() -> None:
    with pytest.raises(DatabaseUnavailable) as err:
        Queue("postgresql://someone:hunter2@127.0.0.1:1/nowhere", connect_timeout=2)
    assert "hunter2" not in str(err.value)
    assert "127.0.0.1" in str(err.value)


def test_job_dataclass_is_frozen(queue: Queue) -> None:
    queue.enqueue({})
    [job] = queue.claim(worker="w")
    with pytest.raises(AttributeError):
        job.lease_token = None  # type: ignore[misc]
    assert isinstance(job, Job)


def test_enqueue_after_backends_were_terminated(dsn: str, schema: str, queue: Queue) -> None:
    """Idle pooled connections killed by the server are noticed before an enqueue uses them."""
    app = f"skiplock-test-terminate:{schema}"
    with Queue(dsn, schema=schema, application_name=app, min_size=3, max_size=3) as q:
        q.enqueue({"warm": True})
        with psycopg.connect(dsn, autocommit=True) as admin:
            row = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s",
                (app,),
            ).fetchone()
            assert row is not None and row[0] >= 1
            # Wait until the server has really closed them (state observed, not slept on).
            for _ in range(500):
                left = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
                ).fetchone()
                if left == (0,):
                    break
                threading.Event().wait(0.01)
        ids = [q.enqueue({"n": n}) for n in range(5)]  # no key: must not be retried blindly
    assert len(set(ids)) == 5
    assert len(queue.claim(worker="w", limit=10)) == 6


def test_retried_handback_after_a_lost_reply_is_not_a_lost_lease(queue: Queue) -> None:
    """fail committed, its reply was lost, another worker re-claimed: the retry must
    still know the first try committed (handback_token), not report LeaseLost."""
    from skiplock import _ops
    from skiplock._queue import run_op
    from skiplock._sql import statements

    job_id = queue.enqueue({})
    [mine] = queue.claim(worker="w1")
    assert queue.fail(mine, "boom", delay=0) == "pending"  # committed; pretend the reply was lost
    [theirs] = queue.claim(worker="w2")
    assert theirs.id == job_id and theirs.lease_token != mine.lease_token
    params = {"errors": ["boom"], "delays": [0.0], "retries": [True]}
    with queue.connection() as conn:
        blind = run_op(conn, _ops.fenced(statements(queue.schema), "fail", [mine], params))
        retried = run_op(
            conn, _ops.fenced(statements(queue.schema), "fail", [mine], params, recheck=True)
        )
    assert blind.lost == [job_id]  # without the re-check: indistinguishable from a lost lease
    assert retried.lost == [] and job_id in retried.done
    got = queue.get(job_id)
    assert got is not None and got.status == "running" and got.worker == "w2"  # untouched
    # A worker that never handed the job back still gets LeaseLost.
    with pytest.raises(LeaseLost):
        queue.complete(mine)


def test_two_attempts_of_one_job_are_told_apart(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """A worker whose lease ran out may claim the same job again while its old attempt
    still runs: every fenced write answers per attempt (id and token), not per id."""
    job_id = queue.enqueue({})
    [old] = queue.claim(worker="w1")
    expire(admin, queue.schema, job_id)
    assert queue.sweep() == 1
    [new] = queue.claim(worker="w1")
    assert (old.id, old.attempt != new.attempt) == (new.id, True)
    beat = queue.heartbeat_many([old, new])
    assert beat.row(new) is not None and beat.row(old) is None and beat.lost == [job_id]
    done = queue.complete_many([old, new])
    assert done.row(new) is not None and done.row(old) is None and done.lost == [job_id]


@pytest.mark.parametrize("keyed", [False, True], ids=["copy", "keys"])
def test_enqueue_many_retry_after_a_lost_reply_returns_the_committed_ids(
    queue: Queue, keyed: bool
) -> None:
    """A retry of enqueue_many (same reserved ids) after an attempt that committed but
    whose reply was lost answers with the committed ids and inserts nothing more."""
    keys = ["a", None, "c"] if keyed else None
    make = queue._enqueue_many_op([{"n": i} for i in range(3)], "default", 0, None, 5, keys)
    with queue.connection() as conn:
        first = run_op(conn, make(False))  # committed; pretend the reply never came
        again = run_op(conn, make(True))
    assert again == first
    assert _jobs(queue) == 3


def test_enqueue_many_retry_waits_for_a_lost_attempt_still_running(queue: Queue, dsn: str) -> None:
    """The lost attempt has not committed yet when the retry looks: the retry's insert
    waits on the primary key and, once the first commits, returns its ids."""
    make = queue._enqueue_many_op([{"n": i} for i in range(3)], "default", 0, None, 5, None)
    with psycopg.connect(dsn) as slow:  # not autocommit: the first attempt stays open
        first = run_op(slow, make(False))
        out: list[object] = []
        with queue.connection() as conn:
            t = threading.Thread(target=lambda: out.append(run_op(conn, make(True))))
            t.start()
            time.sleep(0.3)
            assert t.is_alive()  # waiting for the first attempt's rows
            slow.commit()
            t.join(10)
    assert out == [first]
    assert _jobs(queue) == 3


def test_enqueue_many_retry_sends_again_when_the_lost_attempt_did_not_commit(
    queue: Queue, dsn: str
) -> None:
    make = queue._enqueue_many_op([{"n": i} for i in range(3)], "default", 0, None, 5, None)
    with psycopg.connect(dsn) as aborted:
        first = run_op(aborted, make(False))
        aborted.rollback()
    with queue.connection() as conn:
        again = run_op(conn, make(True))
    assert again == first  # the same reserved ids, now committed
    assert _jobs(queue) == 3


def _jobs(q: Queue) -> int:
    with q.connection() as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(q.schema))
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_one_producers_ids_follow_its_enqueues(queue: Queue) -> None:
    """Unkeyed enqueues take an id reserved by the previous insert (retry safety at no
    extra round trip); keyed ones and batches in between must not make a later job's id
    smaller than an earlier one's."""
    ids: list[int] = []
    for n in range(3):
        ids.append(queue.enqueue({"n": n}))
        ids.append(queue.enqueue({"n": n}, idempotency_key=f"k{n}"))
        ids.extend(queue.enqueue_many([{"n": n}, {"n": n}]))
        ids.append(queue.enqueue({"n": n}))
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
