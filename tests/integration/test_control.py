"""Cancel, pause, limits and results, on a real server with real concurrent workers."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import (
    AsyncQueue,
    ConfigError,
    Fail,
    Job,
    JobCancelled,
    JobFailed,
    JobStateError,
    Queue,
    UnknownJob,
    UnknownQueue,
    Worker,
)

HERE = Path(__file__).parent


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def status_of(queue: Queue, job_id: int) -> str:
    job = queue.get(job_id)
    assert job is not None
    return job.status


@pytest.fixture
def running_worker(queue: Queue) -> Iterator[Callable[..., Worker]]:
    started: list[tuple[Worker, threading.Thread]] = []

    def start(handler: Any, **kwargs: Any) -> Worker:
        kwargs.setdefault("poll_interval", 0.05)
        w = Worker(queue, handler, **kwargs)
        started.append((w, w.start()))
        return w

    yield start
    for w, t in started:
        w.stop(graceful=False)
        t.join(15)


# -- pause -------------------------------------------------------------------------------


def test_pause_stops_claims_at_the_next_claim_and_resume_restarts_them(queue: Queue) -> None:
    ids = queue.enqueue_many([{"n": n} for n in range(3)], queue="mail")
    queue.pause("mail")
    assert queue.claim(worker="w", queue="mail", limit=10) == []
    assert [c.paused for c in queue.queue_settings()] == [True]
    queue.resume("mail")
    assert {j.id for j in queue.claim(worker="w", queue="mail", limit=10)} == set(ids)


def test_a_running_worker_obeys_pause_without_restart(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    done: list[int] = []
    queue.enqueue({}, queue="mail")
    running_worker(lambda job: done.append(job.id), queues=["mail"])
    wait_until(lambda: len(done) == 1, what="first job")
    queue.pause("mail")
    paused_id = queue.enqueue({}, queue="mail")
    time.sleep(0.5)  # ten polls: a claim would have taken it
    assert status_of(queue, paused_id) == "pending"
    queue.resume("mail")
    wait_until(lambda: paused_id in done, what="job after resume")


def test_pausing_an_unknown_queue_is_an_error_and_changes_nothing(queue: Queue) -> None:
    with pytest.raises(UnknownQueue, match="'nope'"):
        queue.pause("nope")
    assert queue.queue_settings() == []


# -- bad limits ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"concurrency_limit": 0}, "0"),
        ({"concurrency_limit": -3}, "-3"),
        ({"concurrency_limit": 2.5}, "2.5"),
        ({"rate_limit": 0}, "0"),
        ({"rate_limit": -1.0}, "-1.0"),
        ({"rate_limit": math.nan}, "nan"),
        ({"rate_limit": 5, "rate_burst": 0.5}, "0.5"),
    ],
)
def test_bad_limits_name_the_value_and_change_nothing(
    queue: Queue, kwargs: dict[str, Any], shown: str
) -> None:
    with pytest.raises(ConfigError, match=shown):
        queue.configure_queue("mail", **kwargs)
    assert queue.queue_settings() == []


def test_configure_keeps_what_it_is_not_told_and_clears_on_request(queue: Queue) -> None:
    queue.configure_queue("mail", concurrency_limit=3)
    cfg = queue.configure_queue("mail", rate_limit=10.0)
    assert (cfg.concurrency_limit, cfg.rate_limit) == (3, 10.0)
    cfg = queue.configure_queue("mail", clear_concurrency_limit=True)
    assert (cfg.concurrency_limit, cfg.rate_limit) == (None, 10.0)


# -- limits under a race of worker processes -------------------------------------------------


def _spawn_workers(
    n: int, dsn: str, schema: str, log: Path, *extra: str
) -> list[subprocess.Popen[str]]:
    env = {
        **os.environ,
        "SKIPLOCK_DSN": dsn,
        "CONTROL_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "skiplock.cli",
                "worker",
                "--schema",
                schema,
                "--queue",
                "limited",
                "--handler",
                "control_handlers:interval",
                "--concurrency",
                "4",
                "--poll-interval",
                "0.02",
                "--no-migrate",
                *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at a tie)."""
    events = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.connections(72)
def test_concurrency_limit_holds_across_eight_worker_processes(
    queue: Queue, dsn: str, tmp_path: Path
) -> None:
    limit, jobs = 3, 64
    queue.configure_queue("limited", concurrency_limit=limit)
    ids = queue.enqueue_many([{"sleep": 0.05} for _ in range(jobs)], queue="limited")
    log = tmp_path / "intervals.log"
    procs = _spawn_workers(8, dsn, queue.schema, log)
    try:
        wait_until(
            lambda: (
                all(status_of(queue, i) == "done" for i in ids[-4:])
                and sum(1 for _ in log.open()) >= jobs
                if log.exists()
                else False
            ),
            timeout=120,
            what="all jobs done",
        )
    finally:
        _stop(procs)
    rows = [line.split() for line in log.read_text().splitlines()]
    assert sorted(int(r[0]) for r in rows) == sorted(ids)  # each exactly once
    assert len({r[3] for r in rows}) > 1, "only one process ran jobs: not a race"
    seen = max_overlap([(float(r[1]), float(r[2])) for r in rows])
    print(f"\nconcurrency limit {limit}: max observed concurrency {seen} over {jobs} jobs")
    assert seen <= limit
    assert seen == limit, "the limit was never reached: the test shows nothing"


@pytest.mark.connections(72)
def test_rate_limit_holds_across_eight_worker_processes(
    queue: Queue, dsn: str, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    rate, burst, jobs = 20.0, 2.0, 40
    queue.configure_queue("limited", rate_limit=rate, rate_burst=burst)
    ids = queue.enqueue_many([{"sleep": 0} for _ in range(jobs)], queue="limited")
    procs = _spawn_workers(8, dsn, queue.schema, tmp_path / "starts.log")
    try:
        wait_until(
            lambda: all(status_of(queue, i) == "done" for i in ids), timeout=120, what="drain"
        )
    finally:
        _stop(procs)
    # started_at is the claim statement's own time, the one the bucket is kept by.
    starts = [
        r[0].timestamp()
        for r in admin.execute(
            sql.SQL("SELECT started_at FROM {}.jobs ORDER BY started_at").format(
                sql.Identifier(queue.schema)
            )
        ).fetchall()
    ]
    assert len(starts) == jobs
    worst = 0.0
    for i in range(len(starts)):
        for j in range(i, len(starts)):
            allowed = burst + rate * (starts[j] - starts[i])
            worst = max(worst, (j - i + 1) - allowed)
    span = starts[-1] - starts[0]
    print(
        f"\nrate limit {rate}/s burst {burst}: {jobs} starts over {span:.2f}s, worst excess {worst}"
    )
    assert worst <= 1e-6
    assert span >= (jobs - burst) / rate - 0.05


# -- results and wait --------------------------------------------------------------------------


def test_wait_returns_the_handlers_result_woken_by_notify(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    def handler(job: Job) -> Any:
        time.sleep(0.2)
        if job.payload.get("fail"):
            raise Fail("card declined")
        return {"sum": job.payload["a"] + job.payload["b"]}

    ok = queue.enqueue({"a": 2, "b": 3})
    bad = queue.enqueue({"fail": True})
    running_worker(handler)
    began = time.monotonic()
    assert queue.wait(ok, timeout=20, poll_interval=30) == {"sum": 5}
    took = time.monotonic() - began
    assert took < 5, "the NOTIFY did not wake wait; it fell back to polling"
    with pytest.raises(JobFailed, match="card declined"):
        queue.wait(bad, timeout=20)


def test_wait_errors(queue: Queue) -> None:
    pending = queue.enqueue({})
    with pytest.raises(TimeoutError, match=str(pending)):
        queue.wait(pending, timeout=0.2, poll_interval=0.05)
    queue.cancel(pending)
    with pytest.raises(JobCancelled):
        queue.wait(pending, timeout=5)
    with pytest.raises(UnknownJob):
        queue.wait(987654321, timeout=1)


def test_a_result_too_large_fails_the_job_with_the_reason(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    job_id = queue.enqueue({})
    running_worker(lambda job: "x" * 100_000)
    with pytest.raises(JobFailed, match="over the limit"):
        queue.wait(job_id, timeout=20)


def test_results_off_for_a_queue_store_nothing(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    queue.configure_queue("quiet", store_results=False)
    job_id = queue.enqueue({}, queue="quiet")
    running_worker(lambda job: {"big": "secret"}, queues=["quiet"])
    assert queue.wait(job_id, timeout=20) is None


def test_async_wait(queue: Queue, running_worker: Callable[..., Worker]) -> None:
    job_id = queue.enqueue({"n": 21})
    running_worker(lambda job: job.payload["n"] * 2)

    async def main() -> Any:
        async with AsyncQueue(queue.settings.dsn, schema=queue.schema) as aq:
            return await aq.wait(job_id, timeout=20)

    assert asyncio.run(main()) == 42


# -- cooperative cancel through a worker --------------------------------------------------------


def test_cancel_reaches_a_running_sync_handler_within_a_second(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    seen: dict[str, float] = {}
    started = threading.Event()

    def handler(job: Job) -> str:
        started.set()
        while not job.cancelled:
            time.sleep(0.005)
        seen["at"] = time.monotonic()
        return "stopped early"

    job_id = queue.enqueue({})
    running_worker(handler, lease=30)  # heartbeats every 10 s: only the NOTIFY is fast
    assert started.wait(20)
    asked = time.monotonic()
    assert queue.cancel(job_id) == "running"
    wait_until(lambda: "at" in seen, timeout=10, what="handler to see the cancel")
    print(f"\ncancel -> handler saw it: {seen['at'] - asked:.3f}s")
    assert seen["at"] - asked < 1.0
    wait_until(lambda: status_of(queue, job_id) == "cancelled", what="cancelled")
    with pytest.raises(JobCancelled):
        queue.wait(job_id, timeout=5)


def test_cancel_cancels_an_async_handlers_task(
    queue: Queue, running_worker: Callable[..., Worker]
) -> None:
    state: dict[str, bool] = {}

    async def handler(job: Job) -> None:
        state["started"] = True
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    job_id = queue.enqueue({})
    w = running_worker(handler, lease=30)
    wait_until(lambda: state.get("started", False), what="handler start")
    queue.cancel(job_id)
    wait_until(lambda: status_of(queue, job_id) == "cancelled", what="cancelled")
    assert state.get("cancelled")
    wait_until(lambda: w.stats.snapshot()["cancelled"] == 1, what="cancelled counted")
    assert w.stats.snapshot()["completed"] == 0


# -- operator actions (the dashboard's buttons) ------------------------------------------------


def test_requeue_delete_list_and_throughput(queue: Queue) -> None:
    a, b, c = queue.enqueue_many([{"n": n} for n in range(3)], queue="ops")
    ja, jb = queue.claim(worker="w", queue="ops", limit=2)
    queue.fail(ja, "boom", retry=False)
    queue.complete(jb)
    with pytest.raises(JobStateError, match="pending"):
        queue.requeue(c)
    queue.requeue(a)
    again = queue.get(a)
    assert again is not None and (again.status, again.attempts) == ("pending", 0)
    with pytest.raises(UnknownJob):
        queue.requeue(424242)
    [jc] = [j for j in queue.claim(worker="w", queue="ops", limit=5) if j.id == c] or [None]
    assert jc is not None
    with pytest.raises(JobStateError, match="running"):
        queue.delete(c)
    queue.delete(b)
    assert queue.get(b) is None
    rows = queue.list_jobs(queue="ops")
    assert [r["id"] for r in rows] == [c, a]
    assert [r["id"] for r in queue.list_jobs(queue="ops", status="running")] == [c, a]
    assert queue.list_jobs(queue="ops", before_id=c, limit=1)[0]["id"] == a
    with pytest.raises(ValueError, match="unknown status"):
        queue.list_jobs(status="nope")
    queue.complete(jc)
    counts = {(r["queue"], r["status"]): r["jobs"] for r in queue.throughput(window=600, bucket=60)}
    assert counts.get(("ops", "done")) == 1


def test_configure_refuses_an_unknown_queue_only_when_asked(queue: Queue) -> None:
    with pytest.raises(UnknownQueue, match="'mial': it has no jobs and no settings; pass create"):
        queue.configure_queue("mial", concurrency_limit=2, create=False)
    assert queue.queue_settings() == []
    queue.enqueue({}, queue="mail")  # a queue with a job exists, settings or not
    assert queue.configure_queue("mail", concurrency_limit=2, create=False).concurrency_limit == 2
    assert queue.configure_queue("mail", rate_limit=1.0, create=False).concurrency_limit == 2
    # The default still sets up a queue before its first job (limits belong there first).
    assert queue.configure_queue("later", concurrency_limit=1).name == "later"
