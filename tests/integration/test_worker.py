"""The Worker in-process: batches, retries, timeouts, heartbeats, shutdown, LISTEN."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Fail, Job, Queue, Retry, Worker
from skiplock._base import QueueBase


def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    t = worker.start()
    try:
        yield worker
    finally:
        worker.stop()
        t.join(timeout=30)
        assert not t.is_alive()


def counts(q: Queue) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in q.status():
        out[r["status"]] = out.get(r["status"], 0) + r["jobs"]
    return out


def test_worker_drains_and_runs_each_job_once(queue: Queue) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            seen.append(job.payload["n"])

    queue.enqueue_many([{"n": i} for i in range(2000)])
    with running(Worker(queue, handler, concurrency=8, lease=10)) as w:
        wait_until(lambda: counts(queue).get("done", 0) == 2000, what="drain")
    assert sorted(seen) == list(range(2000))
    assert w.stats.completed == 2000 and w.stats.lease_lost == 0


def test_raising_handler_is_retried_then_failed_without_blocking_others(queue: Queue) -> None:
    calls: dict[str, int] = {}

    def handler(job: Job) -> None:
        calls[job.payload] = calls.get(job.payload, 0) + 1
        if job.payload == "always":
            raise RuntimeError("provider down")
        if job.payload == "flaky" and job.attempts < 3:
            raise ConnectionError("transient")

    bad = queue.enqueue("always", max_attempts=3)
    flaky = queue.enqueue("flaky", max_attempts=5)
    queue.enqueue_many(["fine"] * 50)
    fast = Queue(
        queue.settings.dsn,
        schema=queue.schema,
        max_size=2,
        retry_policy=__import__("skiplock").RetryPolicy(base=0.05, jitter=0.0),
    )
    with running(Worker(fast, handler, concurrency=4, lease=10, poll_interval=0.05)):
        wait_until(lambda: counts(queue).get("done", 0) == 51 and counts(queue).get("failed") == 1)
    failed = queue.get(bad)
    assert failed is not None and failed.status == "failed" and failed.attempts == 3
    assert "RuntimeError: provider down" in (failed.last_error or "")
    assert "Traceback" in (failed.last_error or "")
    ok = queue.get(flaky)
    assert ok is not None and ok.status == "done" and ok.attempts == 3
    fast.close()


def test_retry_and_fail_requests(queue: Queue) -> None:
    def handler(job: Job) -> None:
        if job.payload == "later":
            raise Retry(delay=3600, reason="rate limited")
        raise Fail("invoice was deleted")

    later = queue.enqueue("later")
    never = queue.enqueue("never", max_attempts=10)
    with running(Worker(queue, handler, concurrency=2, lease=10)):
        wait_until(
            lambda: counts(queue).get("failed") == 1 and counts(queue).get("running") is None
        )
        wait_until(lambda: (queue.get(later) or Job).attempts == 1)  # type: ignore[arg-type]
    j_later, j_never = queue.get(later), queue.get(never)
    assert (
        j_later is not None and j_later.status == "pending" and j_later.last_error == "rate limited"
    )
    assert j_never is not None and j_never.status == "failed" and j_never.attempts == 1
    assert j_never.last_error == "invoice was deleted"


def test_hung_sync_handler_times_out_and_capacity_survives(queue: Queue) -> None:
    release = threading.Event()

    def handler(job: Job) -> None:
        if job.payload == "hang" and job.attempts == 1:
            release.wait(60)

    hung = queue.enqueue("hang")
    queue.enqueue_many(["quick"] * 20)
    try:
        with running(
            Worker(queue, handler, concurrency=1, lease=10, job_timeout=0.5, poll_interval=0.05)
        ) as w:
            # concurrency 1 and the only thread hung: the quick jobs still run.
            wait_until(lambda: counts(queue).get("done", 0) >= 20, what="quick jobs")
            assert w.stats.timed_out >= 1
            got = queue.get(hung)
            assert got is not None and "timed out after 0.5s" in (got.last_error or "")
    finally:
        release.set()


def test_async_handler_is_cancelled_at_timeout(queue: Queue) -> None:
    cancelled = threading.Event()

    async def handler(job: Job) -> None:
        if job.attempts == 1:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    job_id = queue.enqueue({})
    fast = Queue(
        queue.settings.dsn,
        schema=queue.schema,
        max_size=2,
        retry_policy=__import__("skiplock").RetryPolicy(base=0.01, jitter=0.0),
    )
    with running(
        Worker(fast, handler, concurrency=1, lease=10, job_timeout=0.3, poll_interval=0.05)
    ):
        wait_until(lambda: counts(queue).get("done") == 1)
    assert cancelled.is_set()
    got = queue.get(job_id)
    assert got is not None and got.attempts == 2
    fast.close()


@pytest.mark.connections(24)
def test_heartbeat_keeps_a_slow_job_from_the_sweeper(queue: Queue) -> None:
    """Lease 1 s, job 3 s, another worker sweeping every 0.1 s: never taken away."""
    runs: list[str] = []

    def slow(job: Job) -> None:
        runs.append("slow")
        time.sleep(3.0)

    def other(job: Job) -> None:
        runs.append("other")

    job_id = queue.enqueue({})
    with running(Worker(queue, slow, concurrency=1, lease=1.0, name="slow")) as w:
        wait_until(lambda: runs == ["slow"])
        with running(
            Worker(queue, other, concurrency=1, lease=1.0, sweep_interval=0.1, name="thief")
        ) as t:
            wait_until(lambda: counts(queue).get("done") == 1, timeout=10)
        assert t.stats.sweeps_recovered == 0
    assert runs == ["slow"]
    got = queue.get(job_id)
    assert got is not None and got.attempts == 1 and got.worker == "slow"
    assert w.stats.heartbeats >= 2 and w.stats.lease_lost == 0


def test_graceful_stop_releases_unstarted_jobs(queue: Queue) -> None:
    gate = threading.Event()
    started: list[int] = []

    def handler(job: Job) -> None:
        started.append(job.id)
        gate.wait(30)

    ids = queue.enqueue_many([{}] * 4)
    w = Worker(queue, handler, concurrency=1, prefetch=3, lease=30, shutdown_grace=10)
    t = w.start()
    wait_until(lambda: len(started) == 1 and w.stats.claimed == 4)
    w.stop()
    # The running handler may finish within the grace; the three unstarted come back.
    wait_until(lambda: counts(queue).get("pending") == 3, what="release")
    gate.set()
    t.join(10)
    assert not t.is_alive()
    assert w.stats.released == 3
    assert_released_unstarted(queue, ids, started[0])


def assert_released_unstarted(queue: Queue, ids: list[int], ran: int) -> None:
    """After a graceful stop: the job that ran is done once, the unstarted ones are
    pending again and were charged no attempt."""
    for job_id in ids:
        got = queue.get(job_id)
        assert got is not None
        if job_id == ran:
            assert got.status == "done" and got.attempts == 1
        else:
            assert got.status == "pending" and got.attempts == 0


def test_listen_notify_wakes_an_idle_worker(queue: Queue, admin: psycopg.Connection[Any]) -> None:
    seen = threading.Event()
    name = f"listen-{queue.schema}"
    with running(Worker(queue, lambda job: seen.set(), concurrency=1, poll_interval=60, name=name)):

        def listening() -> bool:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = %s AND query LIKE 'LISTEN%%'",
                (f"skiplock-worker:{name}",),
            ).fetchone()
            return bool(row and row[0])

        # The listener is in place (seen by the server); polling alone would take 60 s.
        wait_until(listening, what="the LISTEN connection")
        t0 = time.monotonic()
        queue.enqueue({})
        assert seen.wait(5)
        assert time.monotonic() - t0 < 2


def test_polling_only_mode(queue: Queue) -> None:
    seen = threading.Event()
    with running(Worker(queue, lambda job: seen.set(), listen=False, poll_interval=0.1)):
        queue.enqueue({})
        assert seen.wait(5)


def test_handler_per_queue_and_application_name(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    got: list[tuple[str, Any]] = []
    block = threading.Event()

    def emails(job: Job) -> None:
        got.append(("emails", job.payload))
        block.wait(10)

    def sms(job: Job) -> None:
        got.append(("sms", job.payload))

    queue.enqueue(1, queue="emails")
    queue.enqueue(2, queue="sms")
    with running(Worker(queue, {"emails": emails, "sms": sms}, concurrency=2, name="mail-1")):
        wait_until(lambda: len(got) == 2)
        names = [
            r[0] for r in admin.execute("SELECT application_name FROM pg_stat_activity").fetchall()
        ]
        assert "skiplock-worker:mail-1" in names
        block.set()
    assert sorted(got) == [("emails", 1), ("sms", 2)]


def test_lease_lost_mid_handler_changes_nothing(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def handler(job: Job) -> None:
        entered.set()
        gate.wait(30)

    job_id = queue.enqueue({})
    # No listener: its (re)connect heartbeats held jobs, which could renew the lease
    # between the expiry below and the sweep.
    quiet = Worker(queue, handler, concurrency=1, lease=30, sweep_interval=3600, listen=False)
    with running(quiet) as w:
        assert entered.wait(10)
        # Another worker takes the job over: expire, sweep, re-claim.
        admin.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (job_id,),
        )
        assert queue.sweep() == 1
        [mine] = queue.claim(worker="new-owner", lease=300)
        gate.set()
        wait_until(lambda: w.stats.lease_lost >= 1)
    got = queue.get(job_id)
    assert got is not None and got.status == "running" and got.worker == "new-owner"
    assert got.lease_token == mine.lease_token
    queue.complete(mine)


@pytest.mark.parametrize(
    "bad", [{"concurrency": 0}, {"lease": 0}, {"lease": 3, "heartbeat_interval": 5}]
)
def test_bad_worker_settings(queue: Queue, bad: dict[str, Any]) -> None:
    from skiplock import ConfigError

    with pytest.raises(ConfigError):
        Worker(queue, lambda job: None, **bad)


def test_unknown_queue_in_mapping(queue: Queue) -> None:
    from skiplock import ConfigError

    with pytest.raises(ConfigError, match="no handler for queue"):
        Worker(queue, {"emails": lambda job: None}, queues=["sms"])


def test_on_event_hook_sees_the_life_of_each_job(queue: Queue) -> None:
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def on_event(event: str, job: Job) -> None:
        with lock:
            events.append((event, job.id))

    def handler(job: Job) -> None:
        if job.payload == "bad":
            raise Fail("no")

    good = queue.enqueue("good")
    bad = queue.enqueue("bad")
    with running(Worker(queue, handler, concurrency=2, on_event=on_event)):
        wait_until(lambda: counts(queue).get("done") == 1 and counts(queue).get("failed") == 1)
        wait_until(lambda: len(events) == 6)
    assert [e for e, i in events if i == good] == ["claimed", "started", "completed"]
    assert [e for e, i in events if i == bad] == ["claimed", "started", "failed"]


def test_worker_retention_drops_days_of_finished_jobs(
    queue: Queue, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention drops whole days (migration 0009): the jobs, once their generation has
    rotated and upkeep has moved them to their day, go with it when the day is older than
    the retention; the jobs of a younger day stay."""
    monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 1)  # rotate at every sweep
    monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)
    queue.enqueue_many([{}] * 30)
    # Run by hand, not by a worker, whose upkeep may move them to today first.
    jobs = queue.claim(worker="w", limit=30)
    assert len(jobs) == 30 and queue.complete_many([(j, None) for j in jobs]).lost == []
    s = sql.Identifier(queue.schema)
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET finished_at = finished_at - interval '3 days' WHERE id IN "
            "(SELECT id FROM {}.jobs ORDER BY id LIMIT 20)"
        ).format(s, s)
    )
    w = Worker(queue, lambda job: None, retention=86400.0, prune_interval=0.05, sweep_interval=0.05)
    with running(w):
        wait_until(lambda: counts(queue) == {"done": 10}, what="the old day dropped")
    days = admin.execute(
        sql.SQL(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = {}::regclass AND c.relname LIKE 'jobs_d%%'"
        ).format(sql.Literal(f'"{queue.schema}".jobs'))
    ).fetchall()
    assert len(days) == 1  # today's, holding the ten


def test_claims_stay_within_capacity_while_the_writer_lags(queue: Queue) -> None:
    """Finished-but-unwritten jobs still hold a lease and count against capacity."""
    gate = threading.Event()

    class SlowWriter(Worker):
        def _write(self, *args: Any, **kwargs: Any) -> None:
            gate.wait(30)  # the database is slow to take completions
            super()._write(*args, **kwargs)

    queue.enqueue_many([{}] * 500)
    w = SlowWriter(queue, lambda job: None, concurrency=4, prefetch=2, lease=30)
    with running(w):
        wait_until(lambda: w.stats.claimed >= 6, what="first claims")
        for _ in range(50):  # the claim loop gets every chance to overreach
            time.sleep(0.01)
            assert len(w.inflight()) <= w.capacity
        assert w.stats.claimed <= w.capacity
        gate.set()
        wait_until(lambda: counts(queue).get("done") == 500, what="drain")
    assert w.stats.claimed == 500
