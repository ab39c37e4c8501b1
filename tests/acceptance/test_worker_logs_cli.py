"""`skiplock worker`'s failure lines as a log pipeline reads them, and its exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from psycopg import sql

from skiplock import Queue

from .test_cli import HERE, wait_until


def start(dsn: str, schema: str, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "SKIPLOCK_DSN": dsn,
        "ACCEPT_SCHEMA": schema,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "skiplock.cli", "worker", "--schema", schema, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(p: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM, then the exit status and everything it wrote on stderr."""
    p.send_signal(signal.SIGTERM)
    try:
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


def test_json_log_lines_of_a_failing_job(queue: Queue, dsn: str, schema: str) -> None:
    job_id = queue.enqueue({"invoice": 7}, queue="billing", max_attempts=2)
    args = ["--handler", "handlers:bad_invoice", "--queue", "billing", "--log-format", "json"]
    p = start(dsn, schema, *args)
    try:
        wait_until(lambda: (queue.get(job_id) or _never()).status == "failed", what="failure")
    finally:
        code, err = stop(p)
    assert code == 0, err
    # Every line is one JSON object, the worker's start and stop lines too.
    records = [json.loads(line) for line in err.splitlines()]
    assert records and all(
        {"ts", "level", "logger", "message"} <= set(r) and r["ts"].endswith("Z") for r in records
    )
    mine = [r for r in records if r.get("job_id") == job_id]
    for r in mine:
        print(json.dumps(r))
    assert [(r["level"], r["event"], r["attempt"], r["max_attempts"]) for r in mine] == [
        ("WARNING", "retried", 1, 2),
        ("ERROR", "failed", 2, 2),
    ]
    for r in mine:
        assert r["logger"] == "skiplock.worker" and r["queue"] == "billing"
        assert r["error"] == "ValueError: bad invoice 7" and "Traceback" not in r["message"]


def test_handlers_still_running_after_the_grace_make_the_exit_non_zero(
    queue: Queue, dsn: str, schema: str, admin: Any
) -> None:
    table = sql.Identifier(schema, "executions")
    admin.execute(
        sql.SQL(
            "CREATE TABLE {} (job_id bigint, attempt int, pid int,"
            " at timestamptz DEFAULT clock_timestamp())"
        ).format(table)
    )

    def started() -> bool:
        return bool(admin.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0])

    job_id = queue.enqueue({"sleep": 120})
    p = start(dsn, schema, "--handler", "handlers:record", "--lease", "30", "--grace", "0.5")
    try:
        wait_until(started, what="the handler to start")
    finally:
        code, err = stop(p)
    assert code == 3, err
    [line] = [line for line in err.splitlines() if "job(s) abandoned" in line]
    assert " ERROR skiplock.worker: " in line
    assert "1 job(s) abandoned" in line and f"(job ids: {job_id})" in line
    assert "retried once their lease (30s) runs out" in line
    job = queue.get(job_id)
    assert job is not None and job.status == "running"  # until the lease runs out


def _never() -> Any:
    raise AssertionError("job vanished")
