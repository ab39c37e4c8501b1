"""The process pool (``pool="process"``): time limits that stop the work, children
that die or are retired without costing more than their attempt, fencing unchanged.

Issue 38: a sync task past its timeout was failed and retried while its thread went
on burning CPU.  Here each slot's child is killed at the deadline; the tests sample
the child's CPU time with psutil to show that it stops.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql

from skiplock import App, ConfigError, Job, Queue, Worker

from .procpool_handlers import app as module_app
from .procpool_handlers import handle
from .test_worker import counts, running, wait_until


def _pids(d: Path) -> list[int]:
    f = d / "pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def _job(queue: Queue, job_id: int) -> Job:
    job = queue.get(job_id)
    assert job is not None
    return job


def _cpu(pid: int) -> float | None:
    """The process's CPU seconds so far; None once it is gone (or a zombie)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.NoSuchProcess:
        return None


def test_a_cpu_bound_task_stops_at_its_timeout_and_its_retry_runs_alone(
    queue: Queue, tmp_path: Path
) -> None:
    job_id = queue.enqueue({"do": "burn", "dir": str(tmp_path)}, max_attempts=2)
    w = Worker(
        queue, handle, pool="process", concurrency=2, job_timeout=3, lease=10, poll_interval=0.05
    )
    samples: dict[int, list[tuple[float, float]]] = {}
    overlap: list[tuple[int, int]] = []
    with running(w):
        end = time.monotonic() + 40
        while _job(queue, job_id).status != "failed":
            assert time.monotonic() < end, "the job never failed"
            now = time.monotonic()
            alive = []
            for pid in _pids(tmp_path):
                cpu = _cpu(pid)
                if cpu is not None:
                    samples.setdefault(pid, []).append((now, cpu))
                    alive.append(pid)
            if len(alive) > 1:
                overlap.append((alive[0], alive[1]))
            time.sleep(0.1)
        wait_until(lambda: all(_cpu(p) is None for p in _pids(tmp_path)), 5, "children gone")
    first, second = _pids(tmp_path)
    assert first != second
    assert overlap == [], "two children burned CPU for the same job at once"
    for pid in (first, second):
        seen = samples[pid]
        # It really ran (on 2 cores shared with a load of 15 a CPU-bound child gets
        # about a tenth of a core, so the bar is low)...
        assert seen[-1][1] - seen[0][1] > 0.05, seen
        # ...and stopped within about its 3 s: its last sample alive came before
        # 3 s + the reap's slack after its first.
        assert seen[-1][0] - seen[0][0] < 4.5, seen
    job = _job(queue, job_id)
    assert job.attempts == 2
    assert "killed after 3s" in (job.last_error or "")
    assert w.stats.timed_out == 2


def test_soft_timeout_lets_the_task_clean_up(queue: Queue, tmp_path: Path) -> None:
    job_id = queue.enqueue({"do": "soft", "dir": str(tmp_path)}, max_attempts=1)
    w = Worker(
        queue,
        handle,
        pool="process",
        concurrency=1,
        job_timeout=20,
        soft_timeout=0.5,
        poll_interval=0.05,
    )
    with running(w):
        wait_until(lambda: _job(queue, job_id).status == "failed", 20, "the soft limit")
    assert (tmp_path / "cleanup").read_text().startswith("cleaned up in ")
    error = _job(queue, job_id).last_error or ""
    assert "SoftTimeLimitExceeded: soft time limit of 0.5s exceeded" in error
    assert w.stats.timed_out == 0  # the hard limit never came


def test_max_tasks_per_child_recycles_children(queue: Queue) -> None:
    ids = [queue.enqueue({"do": "pid"}) for _ in range(5)]
    w = Worker(
        queue, handle, pool="process", concurrency=1, max_tasks_per_child=2, poll_interval=0.05
    )
    with running(w):
        wait_until(lambda: counts(queue).get("done", 0) == 5, 30, "five jobs")
    pids = [_job(queue, i).result for i in ids]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4], pids
    assert os.getpid() not in pids


def test_max_memory_per_child_recycles_a_child_that_grows(queue: Queue) -> None:
    ids = [queue.enqueue({"do": "grow"}) for _ in range(3)]
    w = Worker(
        queue, handle, pool="process", concurrency=1, max_memory_per_child=48, poll_interval=0.05
    )
    with running(w):
        wait_until(lambda: counts(queue).get("done", 0) == 3, 30, "three jobs")
    pids = [_job(queue, i).result for i in ids]
    assert len(set(pids)) == 3, pids  # each job left its child above 48 MiB


@pytest.mark.parametrize("how", ["sys.exit", "os._exit", "SIGKILL"])
def test_a_child_that_dies_fails_only_its_attempt(queue: Queue, tmp_path: Path, how: str) -> None:
    payload: dict[str, Any] = {"do": "gated" if how == "SIGKILL" else how, "dir": str(tmp_path)}
    dying = queue.enqueue(payload, max_attempts=1)
    nxt = queue.enqueue({"do": "pid"})
    w = Worker(queue, handle, pool="process", concurrency=1, lease=5, poll_interval=0.05)
    with running(w):
        if how == "SIGKILL":
            wait_until(lambda: bool(_pids(tmp_path)), 20, "the child to start")
            os.kill(_pids(tmp_path)[0], signal.SIGKILL)
        wait_until(lambda: _job(queue, nxt).status == "done", 20, "the next job")
        wait_until(lambda: w.inflight() == [], 5, "nothing held")
    job = _job(queue, dying)
    assert job.status == "failed"
    expected = {
        "sys.exit": "SystemExit: 3",
        "os._exit": "the handler process died (exit code 7)",
        "SIGKILL": "the handler process died (killed by SIGKILL)",
    }[how]
    assert expected in (job.last_error or "")
    assert w.stats.failed == 1 and w.stats.completed == 1


def test_lease_lost_while_a_child_runs_changes_nothing(
    queue: Queue, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    job_id = queue.enqueue({"do": "gated", "dir": str(tmp_path)})
    # No listener: its (re)connect heartbeats held jobs (see test_worker's twin).
    w = Worker(
        queue, handle, pool="process", concurrency=1, lease=30, sweep_interval=3600, listen=False
    )
    with running(w):
        wait_until(lambda: bool(_pids(tmp_path)), 20, "the child to start")
        admin.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (job_id,),
        )
        assert queue.sweep() == 1
        [mine] = queue.claim(worker="new-owner", lease=300)
        (tmp_path / "gate").touch()  # the child returns "late"
        wait_until(lambda: w.stats.lease_lost >= 1, 20, "the refused write")
    got = _job(queue, job_id)
    assert got.status == "running" and got.worker == "new-owner"
    assert got.lease_token == mine.lease_token and got.result is None
    queue.complete(mine)


def test_a_cancel_kills_the_child_running_the_job(queue: Queue, tmp_path: Path) -> None:
    job_id = queue.enqueue({"do": "gated", "dir": str(tmp_path)})
    nxt = queue.enqueue({"do": "pid"})
    w = Worker(queue, handle, pool="process", concurrency=1, lease=3, poll_interval=0.05)
    with running(w):
        wait_until(lambda: bool(_pids(tmp_path)), 20, "the child to start")
        queue.cancel(job_id)
        wait_until(lambda: _job(queue, nxt).status == "done", 20, "the next job")
    assert _job(queue, job_id).status == "cancelled"
    assert _cpu(_pids(tmp_path)[0]) is None  # its child was killed, never ungated


def test_shutdown_kills_a_child_still_running_at_the_end_of_the_grace(
    queue: Queue, tmp_path: Path
) -> None:
    queue.enqueue({"do": "gated", "dir": str(tmp_path)})
    w = Worker(queue, handle, pool="process", concurrency=1, shutdown_grace=0.2)
    with running(w):
        wait_until(lambda: bool(_pids(tmp_path)), 20, "the child to start")
    [pid] = _pids(tmp_path)
    assert _cpu(pid) is None, "the child outlived its worker"
    assert w.stats.abandoned == 1


def test_an_apps_sync_and_async_tasks_run_in_children(queue: Queue) -> None:
    ids = [queue.enqueue({"n": n}, task=t) for n, t in ((1, "pp.double"), (2, "pp.adouble"))]
    with running(module_app.worker(using=queue, pool="process", concurrency=1)):
        wait_until(lambda: counts(queue).get("done", 0) == 2, 30, "both tasks")
    first, second = (_job(queue, i).result for i in ids)
    assert (first["value"], second["value"]) == (2, 4)
    assert first["pid"] == second["pid"] != os.getpid()


def test_a_handler_that_will_not_load_in_a_child_stops_the_start(queue: Queue) -> None:
    from .procpool_broken import handler

    w = Worker(queue, handler, pool="process", concurrency=2)
    with pytest.raises(ConfigError, match="could not start: RuntimeError: this module refuses"):
        w.run()


def _local_handler(job: Job) -> None:
    return None


def test_a_handler_children_cannot_import_is_refused(queue: Queue) -> None:
    def nested(job: Job) -> None:
        return None

    with pytest.raises(ConfigError, match="importable module"):
        Worker(queue, nested, pool="process")
    with pytest.raises(ConfigError, match="needs pool='process'"):
        Worker(queue, _local_handler, soft_timeout=1)
    with pytest.raises(ConfigError, match="shorter than the timeout"):
        Worker(queue, _local_handler, pool="process", job_timeout=1, soft_timeout=2)
    app = App(queue.settings.dsn, schema=queue.schema)

    @app.task()
    def t() -> None: ...

    # The app is a local here: no module-level name a child could import it by.
    with pytest.raises(ConfigError, match="module-level name"):
        app.worker(pool="process")


@pytest.mark.connections(24)
def test_a_chain_runs_in_children_each_step_given_its_parents_result(queue: Queue) -> None:
    """A canvas step under the process pool reads its parent's result in the child (a
    connection of the child's own): the chain's value passes from step to step."""
    from skiplock import chain

    from .procpool_handlers import add

    producer = App(queue.settings.dsn, schema=queue.schema)
    padd = producer.task(name="pp.add")(add.fn)
    try:
        flow = chain(padd.s(1, 2), padd.s(3), padd.s(10)).defer()
        with running(module_app.worker(using=queue, pool="process", concurrency=2)):
            assert producer.wait(flow, timeout=60) == 16
    finally:
        producer.close()
