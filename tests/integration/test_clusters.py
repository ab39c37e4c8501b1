"""One App over two PostgreSQL clusters (App(queues=...), docs/scaling.md).

The first cluster is the test server (fixture ``dsn``); the second a scratch cluster
this module starts once.  Each cluster is a whole skiplock of its own: the tests check
the routing, that exactly-once holds on each with two workers serving both, that a
worker killed mid-job has its jobs on both clusters run again after their leases, and
the one-line refusals (a transactional defer on another database's connection, a
workflow spanning clusters).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, ClusterWorkers, ConfigError, Job, Worker, chain, group
from skiplock.chaos import ScratchCluster

SCRIPT = str(Path(sys.executable).with_name("skiplock"))


@pytest.fixture(scope="module")
def dsn2() -> Iterator[str]:
    with ScratchCluster() as cluster:
        yield cluster.dsn


def _app(dsn: str, dsn2: str, schema: str) -> App:
    return App(dsn, schema=schema, queues={"reports": dsn2}, max_size=4)


def _jobs(where: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(where) as c:
        q = sql.SQL("SELECT id, queue, status, attempts FROM {}.jobs ORDER BY id")
        return c.execute(q.format(sql.Identifier(schema))).fetchall()


def test_defer_routes_by_queue_and_wait_finds_the_job_on_its_cluster(
    dsn: str, dsn2: str, schema: str
) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="default")
    def here(n: int) -> int:
        return n

    @app.task(queue="reports")
    def there(n: int) -> int:
        return -n

    try:
        assert app.clusters == [dsn, dsn2]
        app.migrate()
        a = here.defer(n=1)
        b = there.defer(n=2)
        many = there.defer_many([{"n": 3}, {"n": 4}])
        assert [r[1] for r in _jobs(dsn, schema)] == ["default"]
        assert [r[1] for r in _jobs(dsn2, schema)] == ["reports"] * 3
        assert [r[0] for r in _jobs(dsn2, schema)] == [b, *many]
        w = app.worker(concurrency=2, poll_interval=0.05)
        assert isinstance(w, ClusterWorkers)
        assert [x.queues for x in w.workers] == [["default"], ["reports"]]
        # Served alone, a queue on one cluster gets a plain Worker on that cluster.
        alone = app.worker(queues=["reports"])
        assert isinstance(alone, Worker) and alone.queues == ["reports"]
        t = w.start()
        try:
            assert app.wait(a, timeout=30) == 1
            assert app.wait(b, timeout=30, queue="reports") == -2
            assert [app.wait(i, timeout=30, queue="reports") for i in many] == [-3, -4]
        finally:
            w.stop()
            t.join(30)
        assert not t.is_alive()
        assert w.stats.completed == 4
    finally:
        app.close()


def test_defer_async_routes_by_queue(dsn: str, dsn2: str, schema: str) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="reports")
    def there(n: int) -> int:
        return n

    async def main() -> int:
        try:
            job_id = await there.defer_async(n=5)
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                with pytest.raises(ConfigError, match="lives on another database"):
                    await there.configure(conn=conn).defer_async(n=6)
            async with await psycopg.AsyncConnection.connect(dsn2) as conn:
                await there.configure(conn=conn).defer_async(n=7)
            return job_id
        finally:
            await app.aclose()

    app.migrate()
    job_id = asyncio.run(main())
    assert [r[:2] for r in _jobs(dsn2, schema)][:1] == [(job_id, "reports")]
    assert len(_jobs(dsn2, schema)) == 2 and _jobs(dsn, schema) == []


def test_transactional_defer_refuses_a_connection_on_another_database(
    dsn: str, dsn2: str, schema: str
) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="default")
    def here(n: int) -> int:
        return n

    @app.task(queue="reports")
    def there(n: int) -> int:
        return n

    try:
        app.migrate()
        with psycopg.connect(dsn) as conn:
            with pytest.raises(ConfigError, match="'reports' lives on another database") as e:
                there.configure(conn=conn).defer(n=1)
            assert "\n" not in str(e.value)
            with pytest.raises(ConfigError, match="lives on another database"):
                there.defer_many([{"n": 2}], conn=conn)
            # The transaction was not spoilt: a job of the connection's own database joins it.
            here.configure(conn=conn).defer(n=3)
        with psycopg.connect(dsn2) as conn:
            there.configure(conn=conn).defer(n=4)
            with pytest.raises(ConfigError, match="'default' lives on another database"):
                here.configure(conn=conn).defer(n=5)
        assert [r[1] for r in _jobs(dsn, schema)] == ["default"]
        assert [r[1] for r in _jobs(dsn2, schema)] == ["reports"]
    finally:
        app.close()


def test_one_cluster_app_never_asks_a_connection_its_server(dsn: str, queue: Any) -> None:
    app = App(dsn, schema=queue.schema, max_size=2)

    @app.task
    def t(n: int) -> int:
        return n

    try:
        with psycopg.connect(dsn) as conn:
            t.configure(conn=conn).defer(n=1)
        assert len(app._conn_identities) == 0 and app._identities == {}
    finally:
        app.close()


def test_a_workflow_cannot_span_clusters(dsn: str, dsn2: str, schema: str) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="default")
    def here(n: int) -> int:
        return n

    @app.task(queue="reports")
    def there(n: int) -> int:
        return n + 1

    try:
        app.migrate()
        with pytest.raises(ConfigError, match="a dependency cannot cross clusters") as e:
            chain(here.s(1), there.s()).defer()
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match="cannot span clusters"):
            group(here.s(1), there.s(2)).defer()
        assert _jobs(dsn, schema) == [] and _jobs(dsn2, schema) == []
        # All on the second cluster: written there, and its handle waits there.
        wf = chain(there.s(1), there.s()).defer()
        assert wf.queue == "reports" and len(_jobs(dsn2, schema)) == 2
        w = app.worker(queues=["reports"], poll_interval=0.05)
        t = w.start()
        try:
            assert app.wait(wf, timeout=30) == 3
        finally:
            w.stop()
            t.join(30)
    finally:
        app.close()


@pytest.mark.connections(24)
def test_each_job_runs_once_on_each_cluster_with_two_workers(
    dsn: str, dsn2: str, schema: str
) -> None:
    app = _app(dsn, dsn2, schema)
    runs: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def note(job: Job) -> None:
        with lock:
            runs[(job.queue, job.id)] += 1

    @app.task(queue="default")
    def here(n: int, job: Job) -> int:
        note(job)
        return n

    @app.task(queue="reports")
    def there(n: int, job: Job) -> int:
        note(job)
        return n

    try:
        app.migrate()
        ids = {
            "default": here.defer_many([{"n": i} for i in range(200)]),
            "reports": there.defer_many([{"n": i} for i in range(200)]),
        }
        workers = [app.worker(concurrency=4, poll_interval=0.02, name=f"w{n}") for n in range(2)]
        threads = [w.start() for w in workers]
        try:
            for where in (dsn, dsn2):
                _wait_for(
                    lambda w=where: all(r[2] == "done" for r in _jobs(w, schema)), 60, "all done"
                )
        finally:
            for w in workers:
                w.stop()
            for t in threads:
                t.join(30)
        expected = {(q, i) for q, queue_ids in ids.items() for i in queue_ids}
        assert set(runs) == expected
        assert max(runs.values()) == 1, [k for k, v in runs.items() if v > 1]
        # Both workers served both clusters' jobs (none was idle on either).
        assert all(w.stats.completed > 0 for w in workers)
        for where in (dsn, dsn2):
            rows = _jobs(where, schema)
            assert {r[2] for r in rows} == {"done"} and {r[3] for r in rows} == {1}
    finally:
        app.close()


def test_async_worker_serves_one_cluster(dsn: str, dsn2: str, schema: str) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="default")
    def here() -> None: ...

    @app.task(queue="reports")
    def there() -> None: ...

    with pytest.raises(ConfigError, match="one async_worker per cluster"):
        app.async_worker()
    assert app.async_worker(queues=["reports"]).queues == ["reports"]


def test_health_port_is_refused_over_two_clusters(dsn: str, dsn2: str, schema: str) -> None:
    app = _app(dsn, dsn2, schema)

    @app.task(queue="default")
    def here() -> None: ...

    @app.task(queue="reports")
    def there() -> None: ...

    with pytest.raises(ConfigError, match="one worker per cluster"):
        app.worker(health_port=0)


APP = """
import os, time
from skiplock import App, Job

app = App(
    os.environ["CL_MAIN"],
    schema=os.environ["CL_SCHEMA"],
    queues={"reports": os.environ["CL_SECOND"]},
    max_size=2,
)
LOG = os.environ["CL_LOG"]


def _hang(job: Job) -> str:
    with open(LOG, "a") as f:
        f.write(f"{job.queue} {job.id} {job.attempts} {os.getpid()}\\n")
    if job.attempts == 1:
        time.sleep(600)  # killed here, mid-job
    return f"again {job.attempts}"


@app.task(queue="default")
def here(job: Job) -> str:
    return _hang(job)


@app.task(queue="reports")
def there(job: Job) -> str:
    return _hang(job)
"""


def _wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.chaos
def test_a_killed_worker_process_has_its_jobs_on_both_clusters_run_again(
    dsn: str, dsn2: str, schema: str, tmp_path: Path
) -> None:
    (tmp_path / "twoclusters.py").write_text(textwrap.dedent(APP))
    log = tmp_path / "runs.log"
    log.touch()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"CL_MAIN": dsn, "CL_SECOND": dsn2, "CL_SCHEMA": schema, "CL_LOG": str(log)}
    cmd = [SCRIPT, "worker", "--app", "twoclusters:app", "--lease", "2", "--migrate"]
    proc = subprocess.Popen(
        [*cmd, "--sweep-interval", "0.5"], cwd=tmp_path, env=env, stderr=subprocess.PIPE
    )
    # This process's side of the same app: the same task names, on the same clusters.
    app = _app(dsn, dsn2, schema)

    def again(job: Job) -> str:
        with log.open("a") as f:
            f.write(f"{job.queue} {job.id} {job.attempts} {os.getpid()}\n")
        return f"again {job.attempts}"

    def again_there(job: Job) -> str:
        return again(job)

    here = app.task(name="twoclusters.here", queue="default")(again)
    there = app.task(name="twoclusters.there", queue="reports")(again_there)
    try:
        # The worker process migrated both clusters; defer one job to each.
        _wait_for(lambda: _migrated(dsn2, schema), 30, "the second cluster's schema")
        a, b = here.defer(), there.defer()
        _wait_for(lambda: len(log.read_text().splitlines()) >= 2, 30, "both jobs started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        started = [line.split() for line in log.read_text().splitlines()]
        assert sorted((q, int(i)) for q, i, *_ in started) == [("default", a), ("reports", b)]
        # One `skiplock worker --app` process had claimed the jobs of both clusters.
        assert {int(pid) for *_, pid in started} == {proc.pid}
        # Another worker (in this process) finds both once their leases run out.
        w = app.worker(poll_interval=0.05, sweep_interval=0.5, lease=5)
        t = w.start()
        try:
            assert app.wait(a, timeout=60) == "again 2"
            assert app.wait(b, timeout=60, queue="reports") == "again 2"
        finally:
            w.stop()
            t.join(30)
        runs = Counter(
            (q, int(i)) for q, i, *_ in (x.split() for x in log.read_text().splitlines())
        )
        assert runs == {("default", a): 2, ("reports", b): 2}
        assert [r[2:] for r in _jobs(dsn, schema)] == [("done", 2)]
        assert [r[2:] for r in _jobs(dsn2, schema)] == [("done", 2)]
    finally:
        app.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _migrated(where: str, schema: str) -> bool:
    with psycopg.connect(where) as c:
        row = c.execute("SELECT to_regclass(%s)", (f"{schema}.jobs",)).fetchone()
        return row is not None and row[0] is not None


def test_status_shows_every_cluster_of_an_app(
    dsn: str, dsn2: str, schema: str, tmp_path: Path
) -> None:
    (tmp_path / "twoclusters.py").write_text(textwrap.dedent(APP))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"CL_MAIN": dsn, "CL_SECOND": dsn2, "CL_SCHEMA": schema, "CL_LOG": "/dev/null"}
    app = _app(dsn, dsn2, schema)

    @app.task(queue="reports")
    def there() -> None: ...

    try:
        app.migrate()
        there.defer()
        there.defer()
    finally:
        app.close()
    out = subprocess.run(
        [SCRIPT, "status", "--app", "twoclusters:app", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    clusters = json.loads(out.stdout)["clusters"]
    assert len(clusters) == 2
    assert clusters[0]["queues"] == []
    assert [(r["queue"], r["status"], r["jobs"]) for r in clusters[1]["queues"]] == [
        ("reports", "pending", 2)
    ]
    text = subprocess.run(
        [SCRIPT, "status", "--app", "twoclusters:app"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert text.returncode == 0, text.stderr
    assert "no jobs on" in text.stdout and "reports" in text.stdout


def test_a_cluster_unreachable_at_start_stops_the_other_worker_too(queue: Any) -> None:
    from skiplock import Queue

    bad = Queue("postgresql://postgres@127.0.0.1:1/x", schema=queue.schema, open=False)
    w = ClusterWorkers(
        [
            Worker(queue, lambda job: None, queues=["default"], poll_interval=0.05),
            Worker(bad, lambda job: None, queues=["reports"], poll_interval=0.05),
        ]
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            w.run()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the reachable cluster's worker went on alone"
    assert len(errors) == 1 and "cannot reach PostgreSQL" in str(errors[0])
    assert w.workers[0].stopping


@pytest.mark.parametrize("processes", ["1", "2"])
def test_worker_cli_refuses_one_health_port_over_two_clusters(
    dsn: str, dsn2: str, schema: str, tmp_path: Path, processes: str
) -> None:
    (tmp_path / "twoclusters.py").write_text(textwrap.dedent(APP))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"CL_MAIN": dsn, "CL_SECOND": dsn2, "CL_SCHEMA": schema, "CL_LOG": "/dev/null"}
    cmd = [SCRIPT, "worker", "--app", "twoclusters:app", "--health-port", "0"]
    out = subprocess.run(
        [*cmd, "--processes", processes],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "run one worker per cluster" in out.stderr
