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


@pytest.mark.parametrize("finished", [50_000])
def test_claim_uses_the_partial_index(
    queue: Queue, admin: psycopg.Connection[Any], finished: int
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
    params |= dict.fromkeys(("from_priority", "from_run_at", "from_id"))  # from the head
    plan = _plan(admin, statements(queue.schema).claim, params)
    assert "jobs_claimable_idx" in plan
    assert '"Seq Scan"' not in plan
    sweep_plan = _plan(admin, statements(queue.schema).sweep, {"limit": 100})
    assert "jobs_leases_idx" in sweep_plan
    assert '"Seq Scan"' not in sweep_plan
