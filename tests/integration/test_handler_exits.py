"""A handler that exits (sys.exit, KeyboardInterrupt) ends its attempt, never its slot.

Issue 38: `SystemExit` escaped the handler, killed its thread, and the heartbeat kept
the dead job's lease alive for ever while the next job waited behind it.  Each test
here runs the failing job first, on one slot, and requires the job after it to finish.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import Any

import pytest

from skiplock import App, AsyncQueue, AsyncWorker, Job, Queue, Worker
from skiplock.chaos import ChaosProxy, proxied_dsn, upstream_of

from .test_worker import counts, running, wait_until


def _exit(kind: str) -> None:
    if kind == "sys.exit":
        sys.exit(3)
    raise KeyboardInterrupt


def _row(queue: Queue, job_id: int) -> dict[str, Any]:
    job = queue.get(job_id)
    assert job is not None
    return {"status": job.status, "last_error": job.last_error or "", "attempts": job.attempts}


@pytest.mark.parametrize("kind", ["sys.exit", "KeyboardInterrupt"])
@pytest.mark.parametrize("style", ["sync", "async"])
def test_a_handler_that_exits_fails_its_attempt_and_the_next_job_runs(
    queue: Queue, kind: str, style: str
) -> None:
    ran: list[str] = []

    def sync_handler(job: Job) -> None:
        ran.append(job.payload)
        if job.payload == "bye":
            _exit(kind)

    async def async_handler(job: Job) -> None:
        ran.append(job.payload)
        if job.payload == "bye":
            _exit(kind)

    bye = queue.enqueue("bye", max_attempts=1)
    hello = queue.enqueue("hello")
    handler: Any = sync_handler if style == "sync" else async_handler
    with running(Worker(queue, handler, concurrency=1, lease=5, poll_interval=0.05)) as w:
        wait_until(lambda: counts(queue).get("done", 0) == 1, timeout=15, what="the next job")
        wait_until(lambda: w.inflight() == [], timeout=5, what="nothing held")
    assert ran == ["bye", "hello"]
    failed = _row(queue, bye)
    assert failed["status"] == "failed"
    expected = "SystemExit: 3" if kind == "sys.exit" else "KeyboardInterrupt"
    assert expected in failed["last_error"]
    assert "the worker went on" in failed["last_error"]
    assert _row(queue, hello)["status"] == "done"
    assert w.stats.failed == 1 and w.stats.completed == 1


@pytest.mark.parametrize("kind", ["sys.exit", "KeyboardInterrupt"])
def test_async_worker_survives_a_handler_that_exits(dsn: str, schema: str, kind: str) -> None:
    queue = Queue(dsn, schema=schema, max_size=2)
    queue.migrate()
    bye = queue.enqueue("bye", max_attempts=1)
    queue.enqueue("hello")
    ran: list[str] = []

    async def handler(job: Job) -> None:
        ran.append(job.payload)
        if job.payload == "bye":
            _exit(kind)

    async def main() -> AsyncWorker:
        w = AsyncWorker(
            AsyncQueue(dsn, schema=schema), handler, concurrency=1, lease=5, poll_interval=0.05
        )
        task = asyncio.create_task(w.run())
        end = time.monotonic() + 15
        while counts(queue).get("done", 0) < 1:
            assert not task.done(), "the worker stopped"
            assert time.monotonic() < end, "the next job never ran"
            await asyncio.sleep(0.02)
        w.stop()
        await asyncio.wait_for(task, 30)
        return w

    try:
        w = asyncio.run(main())
        job = queue.get(bye)
    finally:
        queue.close()
    assert ran == ["bye", "hello"]
    assert w.stats.failed == 1 and w.stats.completed == 1
    assert job is not None and job.status == "failed"
    expected = "SystemExit: 3" if kind == "sys.exit" else "KeyboardInterrupt"
    assert expected in (job.last_error or "")


@pytest.mark.parametrize("worker_kind", ["worker", "async_worker"])
def test_a_task_that_calls_sys_exit_fails_cleanly(dsn: str, schema: str, worker_kind: str) -> None:
    """The issue's reproduction through the task layer: sync and async tasks."""
    app = App(dsn, schema=schema)
    app.queue.migrate()

    @app.task(max_attempts=1)
    def bye() -> None:
        sys.exit(3)

    @app.task(max_attempts=1)
    async def abye() -> None:
        sys.exit(4)

    @app.task()
    def hello() -> str:
        return "hi"

    first, second = bye.defer(), abye.defer()
    last = hello.defer()
    try:
        if worker_kind == "worker":
            with running(app.worker(concurrency=1, lease=5, poll_interval=0.05)):
                assert app.wait(last, timeout=20) == "hi"
        else:

            async def main() -> None:
                w = app.async_worker(concurrency=1, lease=5, poll_interval=0.05)
                task = asyncio.create_task(w.run())
                try:
                    while (job := app.queue.get(last)) is None or job.status != "done":
                        assert not task.done(), "the worker stopped"
                        await asyncio.sleep(0.02)
                finally:
                    w.stop()
                    await asyncio.wait_for(task, 30)

            asyncio.run(asyncio.wait_for(main(), 30))
        for job_id, code in ((first, 3), (second, 4)):
            job = app.queue.get(job_id)
            assert job is not None and job.status == "failed"
            assert f"SystemExit: {code}" in (job.last_error or "")
    finally:
        app.close()


def test_writers_stop_when_run_returns_even_if_outcomes_cannot_be_written(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer owing outcomes to an unreachable server gives up after the grace and
    says so; run() returns with no thread of the worker left behind."""
    setup = Queue(dsn, schema=schema, max_size=1)
    setup.migrate()
    setup.close()
    release = threading.Event()
    started = threading.Event()

    def handler(job: Job) -> None:
        started.set()
        release.wait(10)

    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=schema, max_size=2)
        try:
            q.enqueue("x")
            w = Worker(q, handler, concurrency=1, lease=30, poll_interval=0.05, shutdown_grace=1)
            t = w.start()
            assert started.wait(15)
            proxy.refuse(60)  # no new connection, and the open ones cut
            proxy.reset()
            w.stop()
            release.set()
            with caplog.at_level(logging.WARNING, logger="skiplock.worker"):
                t.join(timeout=30)
            assert not t.is_alive()
            left = [x for x in threading.enumerate() if x.name.startswith(f"skiplock-{w.name}")]
            assert left == [], f"threads outlived run(): {[x.name for x in left]}"
            assert "1 result(s) unwritten at exit" in caplog.text
        finally:
            proxy.refuse(0)
            q.close()
