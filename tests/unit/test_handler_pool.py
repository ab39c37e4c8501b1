"""HandlerPool's watchdog: no handler thread can die with its job still counted as running."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime

import pytest

from skiplock import Job, _handlers
from skiplock._handlers import VANISHED, HandlerPool, Outcome


def _job(n: int) -> Job:
    now = datetime.now(UTC)
    return Job(
        id=n,
        queue="default",
        payload=None,
        status="running",
        priority=0,
        attempts=1,
        max_attempts=3,
        worker="w",
        lease_token=uuid.uuid4(),
        locked_until=now,
        run_at=now,
        created_at=now,
    )


def _wait(cond: object, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_handler_thread_gone_without_an_outcome_is_reaped_and_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread that vanished (no Python path can, today: this stands in for whatever
    might) is seen by reap(): its job comes back as vanished, dead() keeps its lease
    from the heartbeat meanwhile, and a new thread takes the slot."""
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    release = threading.Event()
    done: list[tuple[int, Outcome]] = []

    def run(job: Job) -> Outcome:
        release.wait(10)
        return Outcome("ok")

    real = threading.current_thread
    first = threading.Event()

    def current_thread() -> threading.Thread:
        # The first job's thread is recorded as one that has already ended.
        if not first.is_set():
            first.set()
            return gone
        return real()

    monkeypatch.setattr(_handlers.threading, "current_thread", current_thread)
    pool = HandlerPool(1, run, lambda j, o: done.append((j.id, o)), lambda j: None, "t")
    try:
        pool.submit(_job(1))
        _wait(lambda: pool.running_jobs() != [])
        [attempt] = pool.dead()
        assert attempt[0] == 1
        timed_out, vanished = pool.reap(time.monotonic())
        assert timed_out == [] and [j.id for j in vanished] == [1]
        assert pool.dead() == set() and pool.running_jobs() == []
        # The slot has a new thread: the next job runs while the first thread is stuck.
        release.set()
        pool.submit(_job(2))
        _wait(lambda: any(n == 2 for n, _ in done))
        # The first thread's late result is dropped, not reported for a reaped job.
        time.sleep(0.05)
        assert [n for n, _ in done] == [2]
    finally:
        release.set()
        pool.shutdown()
    assert VANISHED.kind == "retry"


def test_an_exception_handing_over_the_outcome_does_not_kill_the_slot() -> None:
    calls: list[int] = []

    def on_done(job: Job, outcome: Outcome) -> None:
        calls.append(job.id)
        if job.id == 1:
            raise RuntimeError("boom")

    pool = HandlerPool(1, lambda j: Outcome("ok"), on_done, lambda j: None, "t")
    try:
        pool.submit(_job(1))
        pool.submit(_job(2))
        _wait(lambda: calls == [1, 2])
        assert pool.reap(time.monotonic()) == ([], [])
    finally:
        pool.shutdown()
