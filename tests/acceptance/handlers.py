"""Handlers for the acceptance tests, imported by `skiplock worker --handler handlers:...`.

Each execution is recorded in the test's own table, on its own connection, so the test
can see which process ran which attempt even after SIGKILL.
"""

from __future__ import annotations

import os
import time

import psycopg
from psycopg import sql

from skiplock import Job


def record(job: Job) -> None:
    schema = os.environ["ACCEPT_SCHEMA"]
    with psycopg.connect(os.environ["SKIPLOCK_DSN"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.executions (job_id, attempt, pid) VALUES (%s, %s, %s)").format(
                sql.Identifier(schema)
            ),
            (job.id, job.attempts, os.getpid()),
        )
    sleep = job.payload.get("sleep_first", 0) if job.attempts == 1 else 0
    sleep = sleep or job.payload.get("sleep", 0)
    if sleep:
        time.sleep(sleep)


def noop(job: Job) -> None:
    """For schedules whose jobs only need to exist (test_periodic_cli.py)."""


def wait_for_cancel(job: Job) -> None:
    """Spin until the job's cancel reaches this worker; record the wall-clock moment."""
    record(job)
    deadline = time.monotonic() + 60
    while not job.cancelled and time.monotonic() < deadline:
        time.sleep(0.002)
    schema = os.environ["ACCEPT_SCHEMA"]
    with psycopg.connect(os.environ["SKIPLOCK_DSN"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.cancel_seen (job_id, seen) VALUES (%s, %s)").format(
                sql.Identifier(schema)
            ),
            (job.id, time.time() if job.cancelled else None),
        )


def bad_invoice(job: Job) -> None:
    """Always raises, for the worker's failure log lines (test_worker_logs_cli.py)."""
    raise ValueError(f"bad invoice {job.payload['invoice']}")
