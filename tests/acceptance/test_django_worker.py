"""``python manage.py skiplock_worker`` as a user runs it: a real process, real signals.

Tasks are enqueued in this process through Django's API (the test project's TASKS, on
a fresh schema) and run by the worker subprocess; results are read back with
``get_result``.  No sleeps order events: each wait polls with a deadline.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django.tasks", reason="Django 6 is not installed (it needs Python 3.12+)")

PROJECT = Path(__file__).parents[1] / "django_project"
if str(PROJECT) not in sys.path:
    sys.path.insert(0, str(PROJECT))

from djsetup import configure, project_env, using_schema  # noqa: E402

from skiplock import Queue  # noqa: E402

from .test_cli import wait_until  # noqa: E402


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@pytest.fixture(scope="module", autouse=True)
def django_project(dsn: str) -> None:
    configure(dsn)


@pytest.fixture
def worker(dsn: str, queue: Queue, tmp_path: Path) -> Iterator[WorkerProcess]:
    """A ``manage.py skiplock_worker`` on this test's schema, with TASKS pointed there too."""
    log = tmp_path / "worker.log"
    with using_schema(queue.schema), log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "skiplock_worker", "--concurrency", "2"],
            cwd=PROJECT,
            env=project_env(dsn, queue.schema),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        w = WorkerProcess(proc, log)
        try:
            wait_until(lambda: "concurrency 2" in w.output() or proc.poll() is not None)
            assert proc.poll() is None, w.output()
            yield w
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def finished(result: Any) -> Callable[[], bool]:
    def check() -> bool:
        result.refresh()
        return bool(result.is_finished)

    return check


def test_tasks_run_and_their_results_come_back(worker: WorkerProcess) -> None:
    from testproj.tasks import add, ask_database, double_later, send_email, where_am_i

    results = {
        "add": add.enqueue(2, 3),
        "email": send_email.enqueue("a@example.com", subject="hi"),
        "context": where_am_i.enqueue("t1"),
        "async": double_later.enqueue(21),
        "db": ask_database.enqueue(),
    }
    for name, result in results.items():
        wait_until(finished(result), what=f"{name} to finish\n{worker.output()}")
        assert result.status == "SUCCESSFUL", (name, result.errors)
        assert result.attempts == 1 and result.errors == []
        assert result.started_at <= result.finished_at
    assert results["add"].return_value == 5
    assert results["email"].return_value == {"sent": "a@example.com", "subject": "hi"}
    # The context described the running job: its id, its first attempt.
    assert results["context"].return_value == {
        "id": results["context"].id,
        "attempt": 1,
        "status": "RUNNING",
        "tag": "t1",
    }
    assert results["async"].return_value == 42
    assert results["db"].return_value == 42


def test_a_raising_task_is_retried_then_failed(worker: WorkerProcess) -> None:
    from testproj.tasks import Boom, explode

    result = explode.enqueue("kaboom")
    # max_attempts is 2 in the test project: one retry (after ~1 s of backoff), then FAILED.
    wait_until(finished(result), what=f"explode to fail\n{worker.output()}")
    assert result.status == "FAILED"
    assert result.attempts == 2
    [error] = result.errors
    assert error.exception_class is Boom
    assert "kaboom" in error.traceback and "raise Boom(message)" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        _ = result.return_value


def test_sigterm_lets_the_running_task_finish_and_exits_0(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    from testproj.tasks import hang

    started = tmp_path / "started"
    result = hang.enqueue(1.0, str(started))
    # Wait for the task body, not for RUNNING: a claimed job is RUNNING before a handler
    # thread takes it, and a SIGTERM in that gap hands it back unstarted (READY, the
    # attempt returned), which is right for the worker and wrong for this test.
    wait_until(started.exists, what=f"hang to start\n{worker.output()}")
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=60) == 0, worker.output()
    result.refresh()
    assert (result.status, result.return_value) == ("SUCCESSFUL", "woke")
    assert "SIGTERM: finishing running tasks" in worker.output()


def test_a_task_that_exits_fails_and_the_worker_goes_on(worker: WorkerProcess) -> None:
    from testproj.tasks import add, bye, interrupt

    # Two threads, two tasks that end them: a worker they could wedge would not run `add`.
    exits = [bye.enqueue(3), interrupt.enqueue()]
    after = add.enqueue(1, 2)
    wait_until(finished(after), what=f"the job after the exits\n{worker.output()}")
    assert after.return_value == 3
    for result, cls in zip(exits, (SystemExit, KeyboardInterrupt), strict=True):
        wait_until(finished(result), what=f"{cls.__name__} to fail\n{worker.output()}")
        assert (result.status, result.attempts) == ("FAILED", 1)
        assert result.errors[0].exception_class is cls
    assert worker.proc.poll() is None  # the worker still runs
    log = worker.output()
    assert f"ERROR django.tasks: Task id={exits[0].id} path=testproj.tasks.bye state=FAILED" in log


def test_before_migrating_the_worker_stops_with_the_command_to_run(dsn: str, queue: Queue) -> None:
    unmigrated = f"{queue.schema}_none"  # never created
    done = subprocess.run(
        [sys.executable, "manage.py", "skiplock_worker"],
        cwd=PROJECT,
        env=project_env(dsn, unmigrated),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert (
        f"skiplock schema '{unmigrated}' is missing or not migrated; "
        "run `python manage.py skiplock_migrate`" in done.stderr
    ), done.stderr
    assert "claim failed" not in done.stderr  # stopped, not retried


def test_under_debug_each_log_line_is_printed_once(dsn: str, queue: Queue, tmp_path: Path) -> None:
    from testproj.tasks import add

    with using_schema(queue.schema):
        result = add.enqueue(5, 6)
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "skiplock_worker", "--concurrency", "1"],
            cwd=PROJECT,
            env={**project_env(dsn, queue.schema), "SKIPLOCK_DJANGO_DEBUG": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            done = f"Task id={result.id} path=testproj.tasks.add state=SUCCESSFUL"
            wait_until(
                lambda: done in log.read_text(), what=f"the task's log line\n{log.read_text()}"
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    # Django's DEBUG console prints django.* records; the worker's handler does not repeat them.
    assert text.count(done) == 1, text
    assert text.count("worker ") >= 1 and text.count(" stopped: ") == 1, text
