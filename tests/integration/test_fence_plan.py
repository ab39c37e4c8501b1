"""A fenced write looks its jobs up one by one, in the order sent, whatever the planner
knows of the batch or the generation (migration 0015).

From a custom plan (a connection's first executions of a statement) the planner knows a
batch's length, and for a few hundred ids against a generation whose rows are running
it chose a hash join over a sequential scan of every generation: 8.7 ms for a heartbeat
of 256 against 20,000 jobs where lookups take about 1, and locks taken in the
generation's physical order instead of the id order `_ops.fenced` sends.  These tests
EXPLAIN each fenced statement as skiplock sends it, with the batch's values bound (a
custom plan), against such a generation, and hold the plan to a nested loop whose
outer side is the batch.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue
from skiplock._sql import statements

BACKLOG, BATCH = 20_000, 256


@pytest.fixture
def running(queue: Queue, admin: psycopg.Connection[Any]) -> list[Any]:
    """A generation of 20,000 jobs analyzed while 2,000 of them run (the statistics a
    drain leaves), and those 2,000."""
    queue.enqueue_many([{}] * BACKLOG)
    jobs = queue.claim(worker="w", limit=2000)
    admin.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(queue.schema)))
    return sorted(jobs, key=lambda j: j.id)


def _params(name: str, jobs: list[Any]) -> dict[str, Any]:
    ids, tokens = [j.id for j in jobs], [j.lease_token for j in jobs]
    extra: dict[str, Any] = {
        "complete": {"results": [json.dumps(None)] * len(jobs)},
        "fail": {
            "errors": ["boom"] * len(jobs),
            "delays": [1.0] * len(jobs),
            "retries": [True] * len(jobs),
        },
        "heartbeat": {"lease": 30.0},
    }.get(name, {})
    return {"ids": ids, "tokens": tokens} | extra


@pytest.mark.parametrize("name", ["complete", "fail", "heartbeat", "release", "fence_outcome"])
def test_a_fenced_write_of_a_big_batch_looks_its_jobs_up_by_key(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str, running: list[Any], name: str
) -> None:
    stmt = getattr(statements(queue.schema), name)
    with psycopg.connect(dsn) as conn:
        plan = "\n".join(
            str(r[0])
            for r in conn.execute(
                sql.SQL("EXPLAIN ") + stmt, _params(name, running[:BATCH])
            ).fetchall()
        )
        conn.rollback()
    (part,) = admin.execute(
        sql.SQL("SELECT DISTINCT part FROM {}.jobs").format(sql.Identifier(queue.schema))
    ).fetchone() or (None,)
    # The generations left empty may be scanned whole: there is nothing in them.
    assert f"Seq Scan on jobs_g{part} " not in plan, plan
    assert "Hash Join" not in plan and "Merge Join" not in plan, plan
    loop = plan.index("Nested Loop")
    # The batch is the loop's outer side: its rows, in the order sent, lead the lookups.
    assert plan.index("Function Scan", loop) < plan.index("Index Scan", loop), plan
