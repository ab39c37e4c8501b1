"""Migrations (idempotent, concurrent) and the claim's plan on the partial index."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue
from skiplock._sql import migrations, statements

from .migrate_util import migrate_in_processes
from .test_claim_plan import pick_buffers


def test_migrate_is_idempotent(dsn: str, schema: str) -> None:
    with Queue(dsn, schema=schema, max_size=1) as q:
        assert q.migrate() == [m.version for m in migrations()]
        assert q.migrate() == []
        with q.connection() as c:
            rows = c.execute(
                sql.SQL("SELECT version, name FROM {}.migrations ORDER BY version").format(
                    sql.Identifier(schema)
                )
            ).fetchall()
    assert rows == [(m.version, m.name) for m in migrations()]


def test_concurrent_migrate_from_processes(dsn: str, schema: str) -> None:
    outs = migrate_in_processes(dsn, schema, 6)
    # Exactly one process applied the migrations; the others found nothing to do.
    assert outs == sorted(["[]"] * 5 + [str([m.version for m in migrations()])])


def test_schema_name_is_quoted(dsn: str) -> None:
    odd = "Mixed_Case_Schema"
    with Queue(dsn, schema=odd, max_size=1) as q:
        try:
            q.migrate()
            q.enqueue({"ok": True})
            assert len(q.claim(worker="w")) == 1
        finally:
            with q.connection() as c:
                c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(odd)))


def _plan(conn: psycopg.Connection[Any], query: sql.Composed, params: dict[str, Any]) -> str:
    cur = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + query, params)
    row = cur.fetchone()
    assert row is not None
    return json.dumps(row[0])


def _seq_scans(plan: str) -> set[str]:
    """The relations a plan reads by sequential scan."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("Node Type") == "Seq Scan":
                found.add(str(node.get("Relation Name")))
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(json.loads(plan))
    return found


@pytest.mark.parametrize("finished", [50_000])
def test_claim_uses_the_partial_index(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, finished: int
) -> None:
    """Finished rows are outside the claim's index, so they cannot slow the claim down."""
    s = sql.Identifier(queue.schema)
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.jobs (queue, status, payload, finished_at) "
            "SELECT 'q', 'done', '{{}}', now() FROM generate_series(1, %s)"
        ).format(s),
        (finished,),
    )
    queue.enqueue_many([{}] * 200, queue="q")
    admin.execute(sql.SQL("ANALYZE {}.jobs").format(s))
    params = {"queue": "q", "limit": 10, "worker": "w", "lease": 30.0}
    params |= dict.fromkeys(("from_priority", "from_run_at", "from_id", "tasks"))  # from the head
    # The pick (the function `claimable`, migration 0010) reads each generation's
    # jobs_gN_claimable_idx: a claim of 10 touches tens of buffers (27 measured), where
    # a scan of the current generation would read its thousand pages of finished jobs.
    buffers, explained = pick_buffers(dsn, queue.schema, limit=10, queue="q")
    assert buffers < 60, explained
    # The UPDATE finds the picked rows by TID.  The planner may scan an empty generation
    # whole (it is free); never the current one, which holds every row here.
    plan = _plan(admin, statements(queue.schema).claim, params)
    assert "jobs_g2" not in _seq_scans(plan)
    for window in (5.0, None):  # a worker's windowed sweep, and a full one
        sweep_plan = _plan(admin, statements(queue.schema).sweep, {"limit": 100, "window": window})
        assert "_running_leases_idx" in sweep_plan, window
        assert "jobs_g2" not in _seq_scans(sweep_plan), window


def test_fenced_writes_find_their_rows_by_id_never_through_the_leases_index(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Migration 0006: a fenced write's WHERE must not imply the leases index's predicate.

    Statistics that say nothing runs (the truth, most of the time) made the planner read
    the whole partial index on running rows for each complete; while an xmin is held that
    index holds every lease ever written.  Seq scans are turned off here so that the only
    choice left is between the primary key and that index.
    """
    queue.enqueue_many([{}] * 2000, queue="q")
    admin.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(queue.schema)))
    jobs = queue.claim(worker="w", queue="q", limit=10)
    ids, tokens = [j.id for j in jobs], [j.lease_token for j in jobs]
    stmts = statements(queue.schema)
    cases = {
        "complete": (stmts.complete, {"results": [None] * len(ids)}),
        "heartbeat": (stmts.heartbeat, {"lease": 30.0}),
        "release": (stmts.release, {}),
        "fail": (
            stmts.fail,
            {
                "errors": [None] * len(ids),
                "delays": [0.0] * len(ids),
                "retries": [True] * len(ids),
            },
        ),
    }
    with admin.transaction():
        admin.execute("SET LOCAL enable_seqscan = off")
        for name, (stmt, extra) in cases.items():
            plan = _plan(admin, stmt, {"ids": ids, "tokens": tokens} | extra)
            assert "_pkey" in plan, name
            assert "leases_idx" not in plan, name
