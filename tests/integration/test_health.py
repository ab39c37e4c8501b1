"""/livez and /readyz of a running worker, wedged and starved on purpose.

A worker is wedged by a lock it waits on (an ACCESS EXCLUSIVE lock on the jobs table
for the claim loop, a row lock for the writer), seen waiting with pg_blocking_pids, and
by a handler that blocks an AsyncWorker's event loop; the database is taken away with
the chaos proxy (connections reset and refused) and the schema left unmigrated.  No
sleep orders anything: each wait polls the endpoint with a deadline, and the bounds
checked are the worker's own ``health_stall``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import AsyncQueue, AsyncWorker, ConfigError, Job, Queue, Worker
from skiplock.chaos import ChaosProxy, proxied_dsn, upstream_of

Doc = dict[str, Any]


def get(port: int, path: str) -> tuple[int, Doc]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(port: int, path: str, status: int, timeout: float = 30.0) -> tuple[float, Doc]:
    """Poll until ``path`` answers ``status``; returns when (monotonic) and the body."""
    end = time.monotonic() + timeout
    while True:
        got, doc = get(port, path)
        if got == status:
            return time.monotonic(), doc
        if time.monotonic() > end:
            raise AssertionError(f"{path} still {got} {doc}, not {status}")
        time.sleep(0.02)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def blocked_by(admin: psycopg.Connection[Any], blocker: int, worker: str) -> bool:
    """A session of ``worker`` waits for a lock ``blocker`` holds."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = %s AND %s = ANY(pg_blocking_pids(pid))",
        (f"skiplock-worker:{worker}", blocker),
    ).fetchone()
    return bool(row and row[0])


@pytest.fixture
def run_worker() -> Iterator[Callable[..., Worker]]:
    """Start a Worker in a thread; it is stopped and joined after the test."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(q: Queue, handler: Callable[[Job], Any], **options: Any) -> Worker:
        options.setdefault("poll_interval", 0.05)
        w = Worker(q, handler, health_port=0, **options)
        started.append((w, w.start()))
        wait_until(lambda: w.health is not None, "the health server")
        return w

    yield start
    for w, t in started:
        w.stop(graceful=False)
        t.join(30)


def port_of(w: Worker | AsyncWorker) -> int:
    assert w.health is not None
    return w.health.port


def test_an_idle_worker_is_live_and_ready_and_its_server_ends_with_run(
    queue: Queue, run_worker: Callable[..., Worker]
) -> None:
    # Its loops wait longer than the bound at a time (the claim loop 5 s for work, the
    # heartbeat 10 s with nothing to beat): waits are not steps, so it stays live.
    w = run_worker(
        queue,
        lambda job: None,
        name="h-idle",
        health_stall=1.5,
        poll_interval=5.0,
        sweep_interval=10.0,
    )
    port = port_of(w)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        status, doc = get(port, "/livez")
        assert (status, doc) == (200, {"live": True, "worker": "h-idle"})
        time.sleep(0.05)
    status, doc = get(port, "/readyz")
    assert status == 200 and doc["ready"] is True, doc
    assert doc["schema"] == queue.schema and doc["version"] >= 15
    assert get(port, "/metrics")[0] == 404
    # The server and its check thread end before run() returns.
    w.stop()
    wait_until(lambda: w.health is None, "run() to return")
    assert not [t.name for t in threading.enumerate() if "h-idle-health" in t.name]
    with pytest.raises(urllib.error.URLError):
        get(port, "/livez")


def test_a_claim_loop_blocked_on_a_lock_fails_livez_until_the_lock_goes(
    queue: Queue,
    admin: psycopg.Connection[Any],
    run_worker: Callable[..., Worker],
) -> None:
    stall = 0.5
    w = run_worker(queue, lambda job: None, name="h-lock", health_stall=stall)
    port = port_of(w)
    assert get(port, "/livez")[0] == 200
    admin_pid = admin.info.backend_pid
    admin.execute("BEGIN")
    admin.execute(
        sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(queue.schema))
    )
    try:
        wait_until(lambda: blocked_by_other(admin_pid, queue, "h-lock"), "the claim to block")
        blocked_at = time.monotonic()
        # Its liveness mark may block first: wait for the claim loop's own step.
        wait_until(lambda: "claim loop" in get(port, "/livez")[1].get("stuck", {}), "503")
        failed_at = time.monotonic()
        status, doc = get(port, "/livez")
        assert status == 503 and doc["live"] is False, doc
        assert "claim loop stuck for" in doc["reason"] and doc["stuck"]["claim loop"] > stall
        # Within the bound: the step began before we saw it blocked, so the 503 came no
        # later than the bound after that (plus the polling's slack).
        assert failed_at - blocked_at < stall + 2.0
    finally:
        admin.execute("ROLLBACK")
    _, doc = wait_for(port, "/livez", 200)
    assert doc == {"live": True, "worker": "h-lock"}


def blocked_by_other(blocker: int, queue: Queue, worker: str) -> bool:
    # A connection of its own: the admin connection is inside the locking transaction.
    with queue.connection() as conn:
        return blocked_by(conn, blocker, worker)


def test_a_writer_blocked_on_a_row_lock_fails_livez_and_the_job_completes_after(
    queue: Queue,
    admin: psycopg.Connection[Any],
    run_worker: Callable[..., Worker],
) -> None:
    gate = threading.Event()
    running = threading.Event()

    def handler(job: Job) -> None:
        running.set()
        gate.wait(30)

    stall = 0.5
    w = run_worker(queue, handler, name="h-write", health_stall=stall, concurrency=1)
    port = port_of(w)
    job_id = queue.enqueue({"n": 1})
    assert running.wait(30)
    admin_pid = admin.info.backend_pid
    admin.execute("BEGIN")
    admin.execute(
        sql.SQL("SELECT 1 FROM {}.jobs WHERE id = %s FOR UPDATE").format(
            sql.Identifier(queue.schema)
        ),
        (job_id,),
    )
    try:
        gate.set()  # its completion now waits for our row lock
        wait_until(lambda: blocked_by_other(admin_pid, queue, "h-write"), "the write to block")
        wait_until(lambda: "writer" in get(port, "/livez")[1].get("stuck", {}), "503")
        status, doc = get(port, "/livez")
        assert status == 503 and "writer stuck for" in doc["reason"], doc
    finally:
        admin.execute("ROLLBACK")
    wait_for(port, "/livez", 200)
    wait_until(lambda: (queue.get(job_id) or pytest.fail()).status == "done", "the completion")


def test_a_database_that_refuses_is_not_ready_but_the_worker_stays_live(
    dsn: str, queue: Queue, run_worker: Callable[..., Worker]
) -> None:
    stall = 2.0
    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, open=False)
        w = run_worker(q, lambda job: None, name="h-down", health_stall=stall)
        port = port_of(w)
        wait_for(port, "/readyz", 200)
        proxy.refuse(3600)  # the server seems down: resets, then refusals
        proxy.reset()
        _, doc = wait_for(port, "/readyz", 503)
        assert doc["ready"] is False and doc["reason"].startswith("database unreachable"), doc
        # Its loops fail at once and retry: an outage is not a wedge, and restarting
        # the worker would not bring the server back.
        end = time.monotonic() + stall + 0.5
        while time.monotonic() < end:
            assert get(port, "/livez")[0] == 200
            time.sleep(0.05)
        assert get(port, "/readyz")[0] == 503
        proxy.refuse(0)
        _, doc = wait_for(port, "/readyz", 200)
        assert doc["ready"] is True
        q.close()


def test_a_stalled_connection_wedges_the_worker_until_it_flows_again(
    dsn: str, queue: Queue, run_worker: Callable[..., Worker]
) -> None:
    """The proxy holds every byte (a network that stopped answering without a reset):
    the loops' calls never return, so the worker is wedged and not ready either."""
    stall = 0.5
    with ChaosProxy(upstream_of(dsn)) as proxy:
        q = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, open=False)
        w = run_worker(q, lambda job: None, name="h-stall", health_stall=stall)
        port = port_of(w)
        wait_for(port, "/readyz", 200)
        proxy.stall(3600)
        # Every loop's next call hangs: the liveness mark's (every 0.25 s) may show first.
        wait_until(lambda: "claim loop" in get(port, "/livez")[1].get("stuck", {}), "503")
        assert get(port, "/livez")[0] == 503
        _, doc = wait_for(port, "/readyz", 503)
        assert doc["reason"] == "the database did not answer within 2s", doc
        proxy.stall(0)
        wait_for(port, "/livez", 200)
        wait_for(port, "/readyz", 200)
        q.close()


def test_an_unmigrated_or_older_schema_is_not_ready_until_migrated(
    dsn: str, schema: str, admin: psycopg.Connection[Any], run_worker: Callable[..., Worker]
) -> None:
    q = Queue(dsn, schema=schema, open=False)
    w = run_worker(q, lambda job: None, name="h-schema")
    port = port_of(w)
    _, doc = wait_for(port, "/readyz", 503)
    assert doc["reason"] == f"schema {schema!r} has no skiplock tables: run skiplock migrate"
    with Queue(dsn, schema=schema, max_size=1) as migrator:
        migrator.migrate()
    wait_for(port, "/readyz", 200)
    # A schema behind this code: its newest migration is missing.
    table = sql.SQL("{}.migrations").format(sql.Identifier(schema))
    [(newest,)] = admin.execute(sql.SQL("SELECT max(version) FROM {}").format(table)).fetchall()
    admin.execute(sql.SQL("DELETE FROM {} WHERE version = %s").format(table), (newest,))
    _, doc = wait_for(port, "/readyz", 503)
    assert doc["reason"] == (
        f"schema {schema!r} lacks migration(s) {newest} (this skiplock needs {newest}): "
        "run skiplock migrate"
    )
    assert get(port, "/livez")[0] == 200
    q.close()


def test_a_stopping_worker_is_not_ready_while_it_drains(
    queue: Queue, run_worker: Callable[..., Worker]
) -> None:
    gate = threading.Event()
    running = threading.Event()

    def handler(job: Job) -> None:
        running.set()
        gate.wait(30)

    w = run_worker(queue, handler, name="h-stop", shutdown_grace=30)
    port = port_of(w)
    queue.enqueue({"n": 1})
    assert running.wait(30)
    w.stop()
    status, doc = get(port, "/readyz")
    assert (status, doc["reason"]) == (503, "stopping")
    assert get(port, "/livez")[0] == 200  # draining is not wedged
    gate.set()
    wait_until(lambda: w.health is None, "run() to return")


def test_a_taken_port_is_one_line_and_starts_nothing(queue: Queue) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        w = Worker(queue, lambda job: None, health_port=port, name="h-taken")
        before = set(threading.enumerate())
        with pytest.raises(ConfigError, match=f"cannot serve health on 127.0.0.1:{port}"):
            w.run()
        assert set(threading.enumerate()) <= before
    with pytest.raises(ConfigError, match="health_port must be a port number"):
        Worker(queue, lambda job: None, health_port=70000)


def test_an_async_worker_whose_event_loop_is_blocked_is_not_live(queue: Queue) -> None:
    gate = threading.Event()
    running = threading.Event()

    async def blocking(job: Job) -> None:
        running.set()
        gate.wait(30)  # blocks the event loop itself, as a sync call in a handler does

    stall = 0.5
    w = AsyncWorker(
        AsyncQueue(queue.settings.dsn, schema=queue.schema),
        blocking,
        health_port=0,
        health_stall=stall,
        name="h-async",
    )
    t = threading.Thread(target=asyncio.run, args=(w.run(),), daemon=True)
    t.start()
    try:
        wait_until(lambda: w.health is not None, "the health server")
        port = port_of(w)
        wait_for(port, "/livez", 200)
        assert get(port, "/readyz")[0] == 200
        queue.enqueue({"n": 1})
        assert running.wait(30)
        # The loop's ping goes unanswered (the claim loop's step may show first: the
        # handler blocked the loop in the middle of it).
        wait_until(lambda: "event loop" in get(port, "/livez")[1].get("stuck", {}), "503")
        status, doc = get(port, "/livez")
        assert status == 503 and "event loop stuck for" in doc["reason"], doc
        gate.set()
        wait_for(port, "/livez", 200)
    finally:
        gate.set()
        w.stop()
        t.join(30)
    assert not t.is_alive() and w.health is None
    assert not [t.name for t in threading.enumerate() if "h-async-health" in t.name]
