"""The `skiplock` command as a user runs it: real processes, real signals, real Postgres."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue
from skiplock._sql import migrations

HERE = Path(__file__).parent


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def env(dsn: str, schema: str) -> dict[str, str]:
    return {
        "SKIPLOCK_DSN": dsn,
        "ACCEPT_SCHEMA": schema,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.fixture
def executions(
    queue: Queue, admin: psycopg.Connection[Any]
) -> Callable[[], list[tuple[int, int, int]]]:
    s = sql.Identifier(queue.schema)
    admin.execute(
        sql.SQL(
            "CREATE TABLE {}.executions (job_id bigint, attempt int, pid int,"
            " at timestamptz DEFAULT clock_timestamp())"
        ).format(s)
    )

    def rows() -> list[tuple[int, int, int]]:
        q = sql.SQL("SELECT job_id, attempt, pid FROM {}.executions ORDER BY at").format(s)
        return admin.execute(q).fetchall()  # type: ignore[return-value]

    return rows


@pytest.fixture
def workers(env: dict[str, str], schema: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*extra: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "skiplock.cli",
                "worker",
                "--schema",
                schema,
                "--handler",
                "handlers:record",
                *extra,
            ],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A group of its own: the cleanup kills a --processes supervisor's children
            # with it, not the supervisor alone (its children would be left running).
            start_new_session=True,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def test_migrate_enqueue_status_sweep(env: dict[str, str], schema: str) -> None:
    r = cli("migrate", "--schema", schema, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["applied"] == [m.version for m in migrations()]
    assert "***" not in r.stdout or "password" not in env["SKIPLOCK_DSN"]
    assert cli("migrate", "--schema", schema, env=env).stdout.strip().endswith("up to date")
    r = cli("enqueue", '{"invoice": 7}', "--queue", "emails", "--schema", schema, "--json", env=env)
    assert r.returncode == 0, r.stderr
    [job_id] = json.loads(r.stdout)["ids"]
    keyed = ("enqueue", '{"invoice": 7}', "--queue", "emails", "--key", "inv-7", "--schema", schema)
    r = cli(*keyed, env=env)
    r2 = cli(*keyed, env=env)
    assert r.stdout == r2.stdout and int(r.stdout) != job_id
    r = cli("status", "--schema", schema, "--json", env=env)
    [row] = json.loads(r.stdout)["queues"]
    assert (row["queue"], row["status"], row["jobs"]) == ("emails", "pending", 2)
    assert "pending" in cli("status", "--schema", schema, env=env).stdout
    r = cli("sweep", "--schema", schema, "--json", env=env)
    assert json.loads(r.stdout) == {"swept": 0}


def test_enqueue_from_file(env: dict[str, str], schema: str, tmp_path: Path) -> None:
    cli("migrate", "--schema", schema, env=env)
    f = tmp_path / "jobs.jsonl"
    f.write_text("\n".join(json.dumps({"n": i}) for i in range(50)) + "\n")
    r = cli("enqueue", "--file", str(f), "--schema", schema, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["ids"]) == 50


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["enqueue", "{not json"], "not valid JSON"),
        (["enqueue", "{}", "--queue", "bad queue"], "invalid queue name"),
        (["status", "--schema", "x;drop"], "invalid schema name"),
        (["worker", "--handler", "no_such_module:fn"], "cannot import handler module"),
        (["worker", "--handler", "handlers:nope"], "has no attribute"),
        (["status", "--dsn", "postgresql://bob:SECRET@127.0.0.1:1/x"], "cannot reach PostgreSQL"),
        (["status", "--dsn", "host=x port=notaport = ="], "malformed DSN"),
    ],
)
def test_user_errors_are_one_line_exit_2(
    env: dict[str, str], schema: str, args: list[str], message: str
) -> None:
    cli("migrate", "--schema", schema, env=env)
    if "--schema" not in args:
        args = [*args, "--schema", schema]
    r = cli(*args, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert "SECRET" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    status = json.loads(cli("status", "--schema", schema, "--json", env=env).stdout)
    assert status["queues"] == []  # nothing half-written


def test_sigkill_mid_job_runs_again_after_the_lease(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],
    executions: Callable[[], list[tuple[int, int, int]]],
) -> None:
    job_id = queue.enqueue({"sleep_first": 120})
    a = workers("--lease", "2", "--sweep-interval", "0.25", "--name", "a")
    wait_until(lambda: len(executions()) == 1, what="worker a to start the job")
    b = workers("--lease", "2", "--sweep-interval", "0.25", "--name", "b")
    wait_until(
        lambda: b.poll() is None and _app_connected(queue, "skiplock-worker:b"), what="worker b up"
    )
    a.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    a.wait(10)
    wait_until(lambda: len(executions()) == 2, timeout=30, what="the job to run again")
    recovery = time.monotonic() - killed_at
    wait_until(lambda: (queue.get(job_id) or _never()).status == "done", what="done")
    runs = executions()
    assert [(r[0], r[1]) for r in runs] == [(job_id, 1), (job_id, 2)]
    assert runs[0][2] == a.pid and runs[1][2] == b.pid
    done = queue.get(job_id)
    assert done is not None and done.attempts == 2 and done.worker == "b"
    print(f"\nSIGKILL -> job running again: {recovery:.2f}s (lease 2s, sweep every 0.25s)")
    assert recovery < 2 + 0.25 + 3


def test_sigterm_finishes_running_and_releases_unstarted(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],
    executions: Callable[[], list[tuple[int, int, int]]],
) -> None:
    ids = queue.enqueue_many([{"sleep": 1.5}, {"sleep": 1.5}, {"sleep": 1.5}])
    w = workers("--concurrency", "1", "--prefetch", "2", "--lease", "30", "--grace", "20")
    wait_until(lambda: len(executions()) == 1 and _count(queue, "running") == 3, what="claims")
    w.send_signal(signal.SIGTERM)
    assert w.wait(20) == 0
    states = {i: queue.get(i) for i in ids}
    started = executions()[0][0]
    for job_id, job in states.items():
        assert job is not None
        if job_id == started:
            assert (job.status, job.attempts) == ("done", 1)
        else:
            assert (job.status, job.attempts) == ("pending", 0)  # attempt given back


def test_second_signal_exits_at_once(
    queue: Queue,
    workers: Callable[..., subprocess.Popen[str]],
    executions: Callable[[], list[tuple[int, int, int]]],
) -> None:
    job_id = queue.enqueue({"sleep": 60})
    w = workers("--lease", "30", "--grace", "60")
    wait_until(lambda: len(executions()) == 1, what="start")
    w.send_signal(signal.SIGTERM)
    wait_until(
        lambda: "signal again" in (w.stderr.readline() if w.stderr else ""),
        what="first signal seen",
    )
    w.send_signal(signal.SIGTERM)
    assert w.wait(10) == 128 + signal.SIGTERM
    job = queue.get(job_id)
    assert (
        job is not None and job.status == "running"
    )  # the lease will expire; the sweeper recovers it


def _count(q: Queue, status: str) -> int:
    return sum(r["jobs"] for r in q.status() if r["status"] == status)


def _app_connected(q: Queue, name: str) -> bool:
    with q.connection() as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    return bool(row and row[0])


def _never() -> Any:
    raise AssertionError("job vanished")


def test_skiplock_cancel_reaches_a_running_cli_workers_handler(
    queue: Queue,
    admin: psycopg.Connection[Any],
    env: dict[str, str],
    executions: Callable[[], list[tuple[int, int, int]]],
    workers: Callable[..., subprocess.Popen[str]],
) -> None:
    """From `skiplock cancel ID` (a new process) to the handler seeing job.cancelled."""
    s = sql.Identifier(queue.schema)
    admin.execute(sql.SQL("CREATE TABLE {}.cancel_seen (job_id bigint, seen float8)").format(s))
    job_id = queue.enqueue({})
    workers("--handler", "handlers:wait_for_cancel", "--lease", "30")
    wait_until(lambda: len(executions()) == 1, what="handler start")
    began = time.time()
    proc = cli("cancel", str(job_id), "--schema", queue.schema, env=env)
    returned = time.time()
    assert proc.returncode == 0, proc.stderr
    wait_until(
        lambda: (
            admin.execute(sql.SQL("SELECT count(*) FROM {}.cancel_seen").format(s)).fetchone()
            == (1,)
        ),
        what="handler to see the cancel",
    )
    row = admin.execute(sql.SQL("SELECT seen FROM {}.cancel_seen").format(s)).fetchone()
    assert row is not None and row[0] is not None, "the handler never saw the cancel"
    print(
        f"\nskiplock cancel -> handler saw it: {row[0] - began:.3f}s from the command's start "
        f"(the command itself took {returned - began:.3f}s); heartbeat interval 10s"
    )
    assert row[0] - began < 5.0  # far under the 10 s heartbeat: the NOTIFY woke it
    wait_until(lambda: _count(queue, "cancelled") == 1, what="job cancelled")
    assert _count(queue, "done") == 0
