"""pytest plugin for skiplock users: a real queue per test and ``run_pending`` for handlers.

Installed with skiplock and loaded by pytest through the ``pytest11`` entry point::

    from skiplock.testing import run_pending

    def test_sends_invoice(skiplock_queue):
        skiplock_queue.enqueue({"invoice": 7}, queue="emails")
        result = run_pending(send_invoice, queue=skiplock_queue)
        assert result.completed == 1

The database is ``SKIPLOCK_TEST_DSN`` when set, else the embedded PostgreSQL; every test
gets a fresh schema, dropped afterwards.  Fixture names start with ``skiplock_`` so they
do not shadow a project's own ``queue`` or ``dsn`` fixtures.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg import sql

from ._handlers import Handler, run_handler
from ._job import Job
from ._queue import Queue

__all__ = ["RunResult", "run_pending", "skiplock_dsn", "skiplock_queue"]

WORKER_NAME = "skiplock.testing"


@dataclass
class RunResult:
    """What ``run_pending`` did: counts per outcome, and each job's status after it ran."""

    completed: int = 0
    retried: int = 0
    failed: int = 0
    lease_lost: int = 0
    # job id -> status after its last attempt here ('done', 'pending', 'failed', ...)
    statuses: dict[int, str] = field(default_factory=dict)
    # job id -> the error its last failed attempt recorded (traceback or reason)
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def ran(self) -> int:
        """Attempts run, whatever their outcome."""
        return self.completed + self.retried + self.failed + self.lease_lost


def run_pending(
    handler: Handler | Mapping[str, Handler],
    *,
    queue: Queue,
    queues: Sequence[str] | None = None,
    timeout: float | None = None,
    max_jobs: int = 1000,
) -> RunResult:
    """Run due jobs now, one at a time, through the real claim and fenced writes.

    Each job is claimed (a lease token, attempts + 1), its handler called as a Worker
    would call it (return: done; ``Retry``: pending again; ``Fail``: failed; any other
    exception: retried by the queue's policy until attempts run out), and the outcome
    written with the fenced ``complete`` or ``fail``.  Jobs that become due again at
    once (``Retry(0)``) run again; jobs scheduled later are left pending.

    Parameters
    ----------
    handler
        ``f(job)``, or a mapping queue name -> handler.
    queue
        The Queue to take jobs from (the ``skiplock_queue`` fixture).
    queues
        Queue names to run; default the mapping's keys, or every queue with due jobs.
    timeout
        Seconds an ``async def`` handler may run, as ``Worker(job_timeout=)``.
    max_jobs
        Stop after this many attempts: a handler that always retries at once ends.
    """
    handlers = handler if isinstance(handler, Mapping) else None
    names = list(queues) if queues is not None else (list(handlers) if handlers else None)
    result = RunResult()
    while result.ran < max_jobs:
        job = _claim_one(queue, names)
        if job is None:
            return result
        fn = handlers.get(job.queue) if handlers is not None else handler
        if fn is None or isinstance(fn, Mapping):
            raise LookupError(f"no handler for queue {job.queue!r}")
        outcome = run_handler(fn, job, timeout)
        if outcome.kind == "ok":
            res = queue.complete_many([job])
            status = "done"
        else:
            item = (job, outcome.error, outcome.delay, outcome.kind == "retry")
            res = queue.fail_many([item])
            status = str(res.done[job.id]["status"]) if job.id in res.done else "lost"
            if outcome.error is not None:
                result.errors[job.id] = outcome.error
        if res.lost:
            result.lease_lost += 1
            status = "lost"
        elif status == "done":
            result.completed += 1
        elif status == "failed":
            result.failed += 1
        else:
            result.retried += 1
        result.statuses[job.id] = status
    return result


def _claim_one(queue: Queue, names: Sequence[str] | None) -> Job | None:
    if names is None:
        # Every queue with a due job, in the order the claim would serve them.
        with queue.connection() as conn:
            rows = conn.execute(
                sql.SQL(
                    "SELECT queue FROM {}.jobs WHERE status = 'pending' AND run_at <= now() "
                    "GROUP BY queue ORDER BY min(priority), min(run_at)"
                ).format(sql.Identifier(queue.schema))
            ).fetchall()
        names = [r[0] for r in rows]
    for name in names:
        jobs = queue.claim(worker=WORKER_NAME, queue=name, limit=1)
        if jobs:
            return jobs[0]
    return None


@pytest.fixture(scope="session")
def skiplock_dsn() -> str:
    """The test server: ``SKIPLOCK_TEST_DSN``, else the embedded PostgreSQL."""
    env = os.environ.get("SKIPLOCK_TEST_DSN")
    if env:
        return env
    from ._embedded import embedded_dsn

    return embedded_dsn()


@pytest.fixture
def skiplock_queue(skiplock_dsn: str) -> Iterator[Queue]:
    """A migrated Queue on a schema of its own, dropped after the test."""
    schema = f"skiplock_test_{uuid.uuid4().hex[:12]}"
    q = Queue(skiplock_dsn, schema=schema, application_name=f"skiplock-test:{schema}")
    try:
        q.migrate()
        yield q
    finally:
        q.close()
        with psycopg.connect(skiplock_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND application_name LIKE %s",
                (f"%{schema}%",),
            )
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
