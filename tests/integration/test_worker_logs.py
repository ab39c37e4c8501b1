"""The log line each failed attempt leaves, from Worker and AsyncWorker alike."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import AsyncWorker, Job, Queue, Retry, RetryPolicy, Worker

from .test_worker import wait_until

KINDS = ["sync", "async"]


@contextmanager
def running(
    kind: str,
    queue: Queue,
    sync_handler: Callable[[Job], Any],
    async_handler: Callable[[Job], Any],
    **kw: Any,
) -> Iterator[Worker | AsyncWorker]:
    """Either worker, in a thread of its own, stopped (gracefully) on the way out."""
    kw.setdefault("poll_interval", 0.05)
    w: Worker | AsyncWorker
    if kind == "sync":
        w = Worker(queue, sync_handler, **kw)
        t = w.start()
    else:
        w = AsyncWorker(queue, async_handler, **kw)
        t = threading.Thread(target=asyncio.run, args=(w.run(),), daemon=True)
        t.start()
    try:
        yield w
    finally:
        w.stop()
        t.join(timeout=30)
        assert not t.is_alive()


@pytest.fixture
def fast(queue: Queue) -> Iterator[Queue]:
    """The test's queue with retries 50 ms apart (no jitter), so attempts follow quickly."""
    q = Queue(
        queue.settings.dsn,
        schema=queue.schema,
        max_size=2,
        retry_policy=RetryPolicy(base=0.05, factor=1.0, jitter=0.0),
    )
    yield q
    q.close()


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Callable[[int], list[logging.LogRecord]]:
    """The WARNING-and-above records about one job, in order."""
    caplog.set_level(logging.DEBUG, logger="skiplock.worker")

    def about(job_id: int) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if getattr(r, "job_id", None) == job_id and r.levelno >= logging.WARNING
        ]

    return about


def at(r: logging.LogRecord, *names: str) -> tuple[Any, ...]:
    """Fields a record carries through ``extra=`` (the level name too, for brevity)."""
    return tuple(getattr(r, name) for name in names)


def gated() -> tuple[threading.Event, threading.Event, Callable[[Job], Any], Callable[[Job], Any]]:
    """Handlers (sync, async) that set ``entered`` and return once ``gate`` is set."""
    entered, gate = threading.Event(), threading.Event()

    def handler(job: Job) -> None:
        entered.set()
        gate.wait(30)

    async def ahandler(job: Job) -> None:
        entered.set()
        while not gate.is_set():
            await asyncio.sleep(0.01)

    return entered, gate, handler, ahandler


def status(q: Queue, job_id: int) -> str | None:
    job = q.get(job_id)
    return None if job is None else job.status


@pytest.mark.parametrize("kind", KINDS)
def test_a_raising_handler_logs_a_warning_per_retry_and_an_error_at_the_end(
    kind: str,
    fast: Queue,
    lines: Callable[[int], list[logging.LogRecord]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    def handler(job: Job) -> None:
        raise ValueError(f"bad invoice {job.payload['invoice']}")

    async def ahandler(job: Job) -> None:
        handler(job)

    job_id = fast.enqueue({"invoice": 7}, queue="emails", max_attempts=3)
    with running(kind, fast, handler, ahandler, queues=["emails"]):
        wait_until(lambda: status(fast, job_id) == "failed", what="the final failure")
        wait_until(lambda: len(lines(job_id)) == 3, what="the third line")
    got = lines(job_id)
    for r in got:
        print(f"{r.levelname} {r.name}: {r.getMessage()}")
    assert [at(r, "levelname", "event", "attempt") for r in got] == [
        ("WARNING", "retried", 1),
        ("WARNING", "retried", 2),
        ("ERROR", "failed", 3),
    ]
    for r in got:
        fields = {k: getattr(r, k) for k in ("queue", "task", "max_attempts", "error")}
        assert fields == {
            "queue": "emails",
            "task": None,
            "max_attempts": 3,
            "error": "ValueError: bad invoice 7",
        }
        message = r.getMessage()
        assert f"job {job_id} (queue emails) attempt {at(r, 'attempt')[0]}/3 failed" in message
        assert "ValueError: bad invoice 7" in message
        assert "Traceback" not in message and "\n" not in message
    assert at(got[0], "delay") == (0.05,) and "retrying in 0.05s" in got[0].getMessage()
    assert got[2].getMessage().endswith("no attempts left, job failed")
    # The whole traceback is there for whoever turns DEBUG on, once per attempt.
    tracebacks = [
        r
        for r in caplog.records
        if getattr(r, "job_id", None) == job_id and getattr(r, "event", "") == "traceback"
    ]
    assert len(tracebacks) == 3 and all(r.levelno == logging.DEBUG for r in tracebacks)
    assert "Traceback (most recent call last)" in tracebacks[0].getMessage()


@pytest.mark.parametrize("kind", KINDS)
def test_a_deliberate_retry_logs_at_info_with_its_cause_and_keeps_it_in_last_error(
    kind: str, fast: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """``raise Retry(0) from exc`` is the handler's choice, not a failure: one INFO line
    "retry requested: ValueError: boom" per attempt, and the cause, with its traceback,
    in last_error, where it used to read "retry requested by handler"."""

    def handler(job: Job) -> None:
        try:
            raise ValueError("boom")
        except ValueError as exc:
            raise Retry(0.05) from exc

    async def ahandler(job: Job) -> None:
        handler(job)

    job_id = fast.enqueue({}, queue="emails", max_attempts=2)
    caplog.set_level(logging.INFO, logger="skiplock.worker")
    with running(kind, fast, handler, ahandler, queues=["emails"]):
        wait_until(lambda: status(fast, job_id) == "failed", what="the final failure")
        wait_until(
            lambda: len([r for r in caplog.records if getattr(r, "job_id", None) == job_id]) >= 2,
            what="both lines",
        )
    got = [r for r in caplog.records if getattr(r, "job_id", None) == job_id]
    assert [at(r, "levelname", "event", "attempt") for r in got] == [
        ("INFO", "retried", 1),
        ("ERROR", "failed", 2),
    ]
    assert all(r.error == "retry requested: ValueError: boom" for r in got)  # type: ignore[attr-defined]
    assert "attempt 1/2 retry requested: ValueError: boom; retrying in 0.05s" in got[0].getMessage()
    assert "failed" not in got[0].getMessage()
    job = fast.get(job_id)
    assert job is not None and job.last_error is not None
    first, rest = job.last_error.split("\n", 1)
    assert first == "retry requested: ValueError: boom"
    assert (
        rest.startswith("Traceback (most recent call last)") and 'raise ValueError("boom")' in rest
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeout_logs_one_line_per_attempt(
    kind: str, fast: Queue, lines: Callable[[int], list[logging.LogRecord]]
) -> None:
    release = threading.Event()

    def handler(job: Job) -> None:
        release.wait(60)

    async def ahandler(job: Job) -> None:
        await asyncio.sleep(3600)  # cancelled at the timeout

    job_id = fast.enqueue({}, max_attempts=2)
    try:
        with running(kind, fast, handler, ahandler, job_timeout=0.3, concurrency=2) as w:
            wait_until(lambda: status(fast, job_id) == "failed", what="the final failure")
            wait_until(lambda: len(lines(job_id)) == 2, what="the second line")
    finally:
        release.set()
    got = lines(job_id)
    assert w.stats.timed_out == 2
    assert [(*at(r, "levelname", "event"), r.getMessage().split(") ", 1)[1]) for r in got] == [
        ("WARNING", "retried", "attempt 1/2 timed out after 0.3s; retrying in 0.05s"),
        ("ERROR", "failed", "attempt 2/2 timed out after 0.3s; no attempts left, job failed"),
    ]
    assert {at(r, "error") for r in got} == {("timed out after 0.3s",)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancel_logs_one_warning(
    kind: str, queue: Queue, lines: Callable[[int], list[logging.LogRecord]]
) -> None:
    started = threading.Event()

    def handler(job: Job) -> None:
        started.set()
        wait_until(lambda: job.cancelled, timeout=30, what="the cancel")

    async def ahandler(job: Job) -> None:
        started.set()
        await asyncio.sleep(3600)  # the worker cancels the task

    job_id = queue.enqueue({})
    # A 1.5 s lease: its heartbeat (every 0.5 s) brings the cancel even without NOTIFY.
    with running(kind, queue, handler, ahandler, lease=1.5) as w:
        assert started.wait(20)
        assert queue.cancel(job_id) == "running"
        wait_until(lambda: status(queue, job_id) == "cancelled", what="the cancel to land")
        wait_until(lambda: len(lines(job_id)) == 1, what="the line")
    [line] = lines(job_id)
    assert w.stats.cancelled == 1
    assert at(line, "levelname", "event", "attempt") == ("WARNING", "cancelled", 1)
    expected = f"job {job_id} (queue default) attempt 1/5 cancelled while running"
    assert line.getMessage().endswith(expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("lease", "by_heartbeat"),
    [(30.0, False), (1.5, True)],  # no heartbeat in the test's time; one every 0.5 s
    ids=["found-by-the-write", "found-by-a-heartbeat"],
)
def test_a_lost_lease_logs_one_warning_per_attempt(
    kind: str,
    lease: float,
    by_heartbeat: bool,
    queue: Queue,
    admin: psycopg.Connection[Any],
    lines: Callable[[int], list[logging.LogRecord]],
) -> None:
    entered, gate, handler, ahandler = gated()
    job_id = queue.enqueue({})
    # No listener (its reconnect beats held jobs) and no sweeps: only the test moves
    # the lease.
    quiet: dict[str, Any] = {"lease": lease, "sweep_interval": 3600, "listen": False}
    with running(kind, queue, handler, ahandler, **quiet) as w:
        assert entered.wait(20)
        # Another worker's claim, in one statement: no heartbeat of ours can renew the
        # lease between an expiry and a sweep.
        admin.execute(
            sql.SQL(
                "UPDATE {}.jobs SET lease_token = gen_random_uuid(), worker = 'new-owner',"
                " locked_until = now() + interval '300s' WHERE id = %s"
            ).format(sql.Identifier(queue.schema)),
            (job_id,),
        )
        if by_heartbeat:
            wait_until(lambda: w.stats.lease_lost >= 1, what="a heartbeat to find it lost")
        gate.set()
        # The handler's write is refused too (counted), but logged only once.
        refused = 2 if by_heartbeat else 1
        wait_until(lambda: w.stats.lease_lost >= refused, what="the refused write")
        wait_until(lambda: len(lines(job_id)) >= 1, what="the line")
    [line] = lines(job_id)
    assert at(line, "levelname", "event", "attempt") == ("WARNING", "lease_lost", 1)
    why = "the heartbeat found it swept" if by_heartbeat else "the write changed nothing"
    assert f"lease lost: {why}" in line.getMessage()


@pytest.mark.parametrize("kind", KINDS)
def test_handlers_cut_off_at_the_end_of_the_grace_are_counted_and_logged_once(
    kind: str, queue: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="skiplock.worker")
    release = threading.Event()
    started = threading.Event()

    def handler(job: Job) -> None:
        started.set()
        release.wait(60)

    async def ahandler(job: Job) -> None:
        started.set()
        await asyncio.sleep(3600)

    job_id = queue.enqueue({})
    try:
        with running(kind, queue, handler, ahandler, shutdown_grace=0.2) as w:
            assert started.wait(20)
    finally:
        release.set()
    assert w.stats.abandoned == 1
    [line] = [r for r in caplog.records if getattr(r, "event", "") == "abandoned"]
    assert at(line, "levelname", "job_ids") == ("ERROR", [job_id])
    assert "1 job(s) abandoned" in line.getMessage()
    assert "retried once their lease (30s) runs out" in line.getMessage()
    assert status(queue, job_id) == "running"  # until the lease runs out and a sweep
