"""Migration 0007 (tasks) on a populated schema: every pending and running job is kept."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock._migrate as mod
from skiplock import App, Queue, Worker
from skiplock._migrate import migrate_op
from skiplock._queue import run_op

from .test_worker import running, wait_until


def test_0007_keeps_pending_and_running_jobs_and_their_leases(
    admin: psycopg.Connection[Any], dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mod.migrations()
    monkeypatch.setattr(mod, "migrations", lambda: tuple(m for m in real if m.version < 7))
    assert run_op(admin, migrate_op(schema)) == [1, 2, 3, 4, 5, 6]
    # A queue at schema 6, populated by the handler-per-queue API: the enqueue of a
    # version-6 skiplock, written out here since today's names the new columns.
    s = sql.Identifier(schema)
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.jobs (queue, payload, run_at) "
            "SELECT 'old', jsonb_build_object('n', g), now() - interval '1 s' "
            "FROM generate_series(1, 6) AS g"
        ).format(s)
    )
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET status = 'running', worker = 'w6', attempts = 1, "
            "lease_token = gen_random_uuid(), locked_until = now() + interval '1 hour' "
            "WHERE id <= 2"
        ).format(s)
    )
    cols = sql.SQL(
        "SELECT id, queue, status, payload, attempts, worker, lease_token, locked_until "
        "FROM {}.jobs ORDER BY id"
    ).format(s)
    before = admin.execute(cols).fetchall()

    monkeypatch.setattr(mod, "migrations", lambda: real)
    # 0007 and every later migration: the jobs must survive all of them.
    assert run_op(admin, migrate_op(schema)) == [m.version for m in real if m.version >= 7]
    assert admin.execute(cols).fetchall() == before
    assert admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs WHERE task IS NOT NULL OR meta IS NOT NULL").format(s)
    ).fetchone() == (0,)

    with Queue(dsn, schema=schema, max_size=2) as q:
        # The running jobs' holder completes with the token it had before the migration.
        for job_id, _q, _s, _p, _a, _w, token, _until in before[:2]:
            job = q.get(job_id)
            assert job is not None and job.status == "running" and job.lease_token == token
            q.complete(job, {"finished": "after migration"})
        # The pending ones run under handler-per-queue, as before; an app's worker
        # does not take them (they name no task).
        app = App(dsn, schema=schema, max_size=2)

        @app.task(name="t.new", queue="old")
        def new(n: int) -> int:
            return n

        new_id = new.defer(n=9)
        with running(app.worker(sweep_interval=0.05)):
            assert app.wait(new_id, timeout=20) == 9
        seen: list[int] = []
        with running(Worker(q, lambda j: seen.append(j.payload["n"]), queues=["old"])):
            wait_until(lambda: len(seen) == 4, what="the four old pending jobs")
        app.close()
    assert sorted(seen) == [3, 4, 5, 6]
    assert admin.execute(
        sql.SQL("SELECT status, count(*) FROM {}.jobs GROUP BY status").format(s)
    ).fetchall() == [("done", 7)]
