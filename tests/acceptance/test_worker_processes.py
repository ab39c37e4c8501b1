"""`skiplock worker --processes N`: one command, N worker processes, real signals.

The jobs are recorded by ``handlers:record`` with the pid that ran them, so the tests
see which child ran what, and that a child killed with SIGKILL was replaced.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import psutil
import pytest
from psycopg import sql

from skiplock import Queue

from .test_cli import env, executions, wait_until, workers  # noqa: F401  (fixtures)


def children(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children()


def registered(queue: Queue) -> set[str]:
    """The workers whose claim loop has started (it registers at its first sweep)."""
    with queue.connection() as c:
        q = sql.SQL("SELECT name FROM {}.workers").format(sql.Identifier(queue.schema))
        return {str(name) for (name,) in c.execute(q).fetchall()}


@pytest.mark.connections(24)
def test_jobs_run_in_n_processes_and_a_signal_stops_them_all(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
    executions: Callable[[], list[tuple[int, int, int]]],  # noqa: F811
) -> None:
    w = workers("--processes", "2", "--concurrency", "2", "--prefetch", "0", "--name", "pw")
    # Both claiming before any job exists: a child slow to start would leave them all
    # to the other one.
    wait_until(lambda: registered(queue) == {"pw-1", "pw-2"}, what="both children")
    ids = queue.enqueue_many([{"sleep": 0.3} for _ in range(8)])
    wait_until(lambda: len(executions()) == 8, what="8 executions")
    pids = {pid for _, _, pid in executions()}
    kids = children(w)
    assert len(kids) == 2 and pids <= {k.pid for k in kids}, (pids, kids)
    assert len(pids) == 2  # 2 handlers each could not run 8 jobs of 0.3 s in parallel
    wait_until(lambda: all((queue.get(i) or pytest.fail()).status == "done" for i in ids))
    names = {(queue.get(i) or pytest.fail()).worker for i in ids}
    assert names == {"pw-1", "pw-2"}
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0, w.stderr.read() if w.stderr else ""
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)
    err = w.stderr.read() if w.stderr else ""
    assert "stopping 2 worker processes" in err
    # Each child logs as a worker command does (its INFO lines were lost once).
    assert "worker pw-1: queues default" in err and "worker pw-2: queues default" in err


def test_a_killed_child_is_started_again_and_its_job_runs_again(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
    executions: Callable[[], list[tuple[int, int, int]]],  # noqa: F811
) -> None:
    job_id = queue.enqueue({"sleep_first": 60})
    w = workers("--processes", "2", "--lease", "30", "--name", "pk")
    wait_until(lambda: len(executions()) == 1, what="the first attempt")
    [(_, _, victim)] = executions()
    assert victim in {k.pid for k in children(w)}
    psutil.Process(victim).kill()
    # Replaced: a new child, under a new name (pk-N.2), so the dead one's session end
    # gives its job back at once (sweep_dead) instead of after its 30 s lease.
    wait_until(lambda: len(children(w)) == 2 and victim not in {k.pid for k in children(w)})
    wait_until(lambda: len(executions()) == 2, timeout=20, what="the job run again")
    job = queue.get(job_id)
    assert job is not None and job.attempts == 2
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    err = w.stderr.read() if w.stderr else ""
    assert f"(pid {victim}) exited with -9" in err and "starting it again" in err


def test_a_second_signal_exits_at_once(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
    executions: Callable[[], list[tuple[int, int, int]]],  # noqa: F811
) -> None:
    queue.enqueue({"sleep": 60})
    w = workers("--processes", "2", "--grace", "60")
    wait_until(lambda: len(executions()) == 1, what="start")
    w.send_signal(signal.SIGTERM)
    # The child's own line, not the supervisor's: two deliveries of one signal that
    # reach a process before its handler runs are one signal to Python, so the second
    # is sent once the child has taken the first.
    wait_until(
        lambda: "signal again to exit now" in (w.stderr.readline() if w.stderr else ""),
        what="first signal seen by the child running the job",
    )
    w.send_signal(signal.SIGTERM)
    assert w.wait(15) == 128 + signal.SIGTERM


def test_metrics_port_is_refused_with_processes(
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
) -> None:
    w = workers("--processes", "2", "--metrics-port", "0")
    assert w.wait(30) == 2
    assert "--metrics-port serves one process" in (w.stderr.read() if w.stderr else "")


def test_a_bad_handler_exits_2_before_any_child_starts(
    workers: Callable[..., subprocess.Popen[str]],  # noqa: F811
) -> None:
    w = workers("--processes", "2", "--handler", "handlers:no_such_function")
    assert w.wait(30) == 2
    assert "no_such_function" in (w.stderr.read() if w.stderr else "")
