"""A killed worker process's jobs are back in about a second with the default 30 s lease;
a stopped (SIGSTOP) one keeps them.  Real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue

from .test_cli import env, executions, wait_until, workers  # noqa: F401  (fixtures)


def marked(admin: psycopg.Connection[Any], schema: str, name: str) -> bool:
    q = sql.SQL("SELECT mark_pid IS NOT NULL FROM {}.workers WHERE name = %s").format(
        sql.Identifier(schema)
    )
    row = admin.execute(q, (name,)).fetchone()
    return bool(row and row[0])


def test_sigkill_with_the_default_lease_runs_again_within_two_seconds(
    queue: Queue,
    admin: psycopg.Connection[Any],
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
    executions: Callable[[], list[tuple[int, int, int]]],  # noqa: F811
) -> None:
    job_id = queue.enqueue({"sleep_first": 120})
    a = workers("--name", "a")  # the default lease: 30 s
    wait_until(lambda: len(executions()) == 1, what="worker a to start the job")
    b = workers("--name", "b")
    wait_until(lambda: marked(admin, queue.schema, "b"), what="worker b up")
    a.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    a.wait(10)
    wait_until(lambda: len(executions()) == 2, timeout=30, what="the job to run again")
    recovery = time.monotonic() - killed_at
    runs = executions()
    assert [(r[0], r[1]) for r in runs] == [(job_id, 1), (job_id, 2)]
    assert runs[0][2] == a.pid and runs[1][2] == b.pid
    print(f"\nSIGKILL -> job running again: {recovery:.2f}s (default lease 30s)")
    assert recovery <= 2.5  # about the 1 s grace plus a liveness round or two
    job = queue.get(job_id)
    assert job is not None and "lost its session" in (job.last_error or "")


@pytest.mark.connections(24)
def test_sigstop_beyond_the_grace_is_not_swept_before_the_lease(
    queue: Queue,
    admin: psycopg.Connection[Any],
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
    executions: Callable[[], list[tuple[int, int, int]]],  # noqa: F811
) -> None:
    job_id = queue.enqueue({"sleep_first": 4})
    a = workers("--name", "a", "--lease", "30")
    wait_until(lambda: len(executions()) == 1, what="worker a to start the job")
    b = workers("--name", "b")
    wait_until(lambda: marked(admin, queue.schema, "b"), what="worker b up")
    held = queue.get(job_id)
    a.send_signal(signal.SIGSTOP)
    try:
        # Stopped for three graces: its session, and so its mark, stays; b sweeps
        # about twelve times meanwhile and must leave the job alone.
        time.sleep(3.0)
        now = queue.get(job_id)
        assert held is not None and now is not None
        assert now.status == "running" and now.lease_token == held.lease_token
        assert len(executions()) == 1
    finally:
        a.send_signal(signal.SIGCONT)
    wait_until(lambda: (queue.get(job_id) or held).status == "done", timeout=30, what="done")
    done = queue.get(job_id)
    assert done is not None and done.attempts == 1 and done.worker == "a"
    assert b.poll() is None
