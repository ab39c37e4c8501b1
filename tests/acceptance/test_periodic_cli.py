"""`skiplock worker --periodic` as real processes: 8 workers, one tick per second, each tick
enqueued exactly once; bad schedules exit 2 with nothing written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

HERE = Path(__file__).parent


def worker_cmd(schema: str, dsn: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "skiplock.cli",
        "worker",
        "--dsn",
        dsn,
        "--schema",
        schema,
        "--queue",
        "ticks",
        "--handler",
        "handlers:noop",
        "--concurrency",
        "1",
        "--grace",
        "2",
        *extra,
    ]


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DSN", "DATABASE_URL")}
    return {**clean, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def tick_rows(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL(
            "SELECT t.scheduled_at, t.job_id, j.id, j.status FROM {s}.periodic_ticks AS t "
            "LEFT JOIN {s}.jobs AS j ON j.id = t.job_id ORDER BY t.scheduled_at"
        ).format(s=sql.Identifier(schema))
    ).fetchall()


def run_workers(
    dsn: str, schema: str, admin: psycopg.Connection[Any], seconds: int, tmp_path: Path, n: int = 8
) -> list[tuple[Any, ...]]:
    """``n`` worker processes with the same per-second schedule for ``seconds`` seconds,
    counted from the first tick in the database; then SIGTERM and the ticks."""
    logs = [(tmp_path / f"worker{i}.log").open("w") for i in range(n)]
    procs = [
        subprocess.Popen(
            worker_cmd(schema, dsn, "--periodic", "tick=* * * * * *", "--name", f"w{i}"),
            env=env(),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    try:
        deadline = time.monotonic() + 120
        while True:
            assert all(p.poll() is None for p in procs), "a worker exited early"
            exists = admin.execute(
                "SELECT to_regclass(format('%%I.periodic_ticks', %s::text))", (schema,)
            ).fetchone()
            if exists and exists[0] and tick_rows(admin, schema):
                break
            assert time.monotonic() < deadline, "no tick within 120 s"
            time.sleep(0.05)
        # Let every process get past its start-up (imports, migrate) before the clock runs.
        time.sleep(seconds)
        assert all(p.poll() is None for p in procs), "a worker died"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()
    assert [p.returncode for p in procs] == [0] * n, [
        (tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(n)
    ]
    return tick_rows(admin, schema)


def check_each_tick_once(rows: list[tuple[Any, ...]], seconds: int) -> None:
    times = [r[0] for r in rows]
    # Every second from the first tick to the last, each exactly once, none missing.
    assert times == [times[0] + timedelta(seconds=s) for s in range(len(times))], times
    # The clock ran `seconds` after the first tick; the edges may add one.
    assert seconds <= len(times) <= seconds + 2, len(times)
    # One job per tick, and every job exists.
    assert all(r[2] == r[1] for r in rows), rows
    assert len({r[1] for r in rows}) == len(rows)


@pytest.mark.connections(72)
def test_eight_worker_processes_enqueue_each_tick_once(
    dsn: str, schema: str, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    rows = run_workers(dsn, schema, admin, 8, tmp_path)
    check_each_tick_once(rows, 8)
    total = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone()
    assert total is not None and total[0] == len(rows)


@pytest.mark.slow
def test_eight_worker_processes_sixty_seconds(
    dsn: str, schema: str, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """The issue's figure: 8 workers, one tick per second for 60 s, each tick once."""
    rows = run_workers(dsn, schema, admin, 60, tmp_path)
    check_each_tick_once(rows, 60)
    done = sum(1 for r in rows if r[3] == "done")
    print(f"\nperiodic: {len(rows)} ticks in 60 s from 8 workers, 0 duplicates, {done} done")


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--periodic", "x=61 * * * *"], "invalid cron expression '61 * * * *'"),
        (["--periodic", "x=* * * * * * *"], "invalid cron expression '* * * * * * *'"),
        (["--periodic", "no-equals-sign"], "--periodic expects NAME=CRON, not 'no-equals-sign'"),
        (["--periodic", "x=* * * * *", "--timezone", "Mars/Base"], "unknown timezone 'Mars/Base'"),
        (["--periodic", "x=* * * * *", "--catch-up", "most"], "not 'most'"),
        (["--periodic", "x=* * * * *", "--periodic-grace", "0"], "grace must be a positive"),
        (["--periodic", "x=* * * * *", "--periodic", "x=0 * * * *"], "duplicate periodic name 'x'"),
        (["--periodic", "x=* * * * *", "--periodic-queue", "a b"], "invalid queue name 'a b'"),
    ],
)
def test_bad_schedules_exit_2_and_write_nothing(
    dsn: str, schema: str, admin: psycopg.Connection[Any], args: list[str], expect: str
) -> None:
    res = subprocess.run(
        worker_cmd(schema, dsn, *args), capture_output=True, text=True, timeout=60, env=env()
    )
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert [ln for ln in lines if ln.startswith("skiplock: error: ")] == lines[-1:], res.stderr
    assert expect in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    # Nothing changed: not even the schema was created (migrate comes after the check).
    found = admin.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    assert found is None
