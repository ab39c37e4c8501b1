"""`skiplock worker --app ... --pool process`: time limits, exits and retirement of
children, through the real command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from skiplock import Queue

from .test_cli import cli, wait_until

SCRIPT = str(Path(sys.executable).with_name("skiplock"))

APP = """
import os, sys
from pathlib import Path
from skiplock import App, SoftTimeLimitExceeded

app = App(schema=os.environ["ACCEPT_SCHEMA"])

@app.task(timeout=2, max_attempts=1)
def burn() -> None:
    while True:
        pass

@app.task(timeout=20, soft_timeout=0.5, max_attempts=1)
def tidy(marker: str) -> None:
    try:
        while True:
            pass
    except SoftTimeLimitExceeded:
        Path(marker).write_text("cleaned up")
        raise

@app.task(max_attempts=1)
def bye() -> None:
    sys.exit(3)

@app.task()
def pid() -> int:
    return os.getpid()
"""


def _descendants_cpu(pid: int) -> float:
    total = 0.0
    for p in psutil.Process(pid).children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_worker_with_a_process_pool(dsn: str, schema: str, tmp_path: Path) -> None:
    (tmp_path / "procapp.py").write_text(textwrap.dedent(APP))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"SKIPLOCK_DSN": dsn, "ACCEPT_SCHEMA": schema}
    args = ["worker", "--app", "procapp:app", "--pool", "process", "--concurrency", "2"]
    args += ["--max-tasks-per-child", "2", "--poll-interval", "0.05"]
    worker = subprocess.Popen(
        [SCRIPT, *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    q = Queue(dsn, schema=schema, max_size=2)
    try:
        q.migrate()
        # Enqueued by task name, not deferred: a task's max_attempts applies to defer().
        burn = q.enqueue({}, task="procapp.burn", max_attempts=1)
        marker = tmp_path / "marker"
        tidy = q.enqueue({"marker": str(marker)}, task="procapp.tidy", max_attempts=1)
        bye = q.enqueue({}, task="procapp.bye", max_attempts=1)
        pids = [q.enqueue({}, task="procapp.pid") for _ in range(4)]

        def status(job_id: int) -> str:
            job = q.get(job_id)
            return job.status if job is not None else "?"

        wait_until(lambda: all(status(i) == "done" for i in pids), 60, "the pid jobs")
        wait_until(lambda: status(burn) == "failed", 60, "the CPU-bound task's limit")
        wait_until(lambda: status(tidy) == "failed", 60, "the soft limit")
        wait_until(lambda: status(bye) == "failed", 60, "the exiting task")
        # Nothing of the killed task burns on: the worker's children sit idle.
        before = _descendants_cpu(worker.pid)
        time.sleep(1.0)
        assert _descendants_cpu(worker.pid) - before < 0.5
        errors = {i: (q.get(i).last_error or "") for i in (burn, tidy, bye)}  # type: ignore[union-attr]
        results = [q.get(i).result for i in pids]  # type: ignore[union-attr]
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
        q.close()
    assert worker.returncode == 0, err
    assert "killed after 2s (its timeout)" in errors[burn]
    assert "SoftTimeLimitExceeded" in errors[tidy] and marker.read_text() == "cleaned up"
    assert "SystemExit: 3" in errors[bye]
    # Two slots, each child retired after two jobs: at least 2 children ran 4 jobs,
    # and none of them is the worker.
    assert worker.pid not in results and len(set(results)) >= 2
    assert "job 1 (queue default, task procapp.burn) attempt 1/1 killed after 2s" in err


def test_renamed_options_still_work_with_a_line_on_stderr() -> None:
    r = cli("worker", "--poll", "0.1", "--pooler", "--handler", "no_such_module_x:fn")
    assert r.returncode == 2  # the bad handler, after the options were taken
    assert "--poll is deprecated; use --poll-interval" in r.stderr
    assert "--pooler is deprecated; use --transaction-pooler" in r.stderr
