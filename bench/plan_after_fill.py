"""A claim prepared while the current generation was empty, run after it filled.

``python bench/plan_after_fill.py THRESHOLD`` (psycopg's prepare_threshold, or ``none``):
rotates to an empty generation, runs the claim 8 times (PostgreSQL's plan cache turns
to a generic plan after 5), enqueues 20,000 jobs into that generation (nothing
invalidates the plan) and times 50 claims of 10.  A plan frozen with the generation
empty would scan it whole for every claimed row.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from skiplock import Queue
from skiplock._sql import statements


def main() -> None:
    threshold = None if sys.argv[1] == "none" else int(sys.argv[1])
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"plan_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=2)
    q.migrate()
    q.ROTATE_ROWS, q.ROTATE_AFTER = 1, 0.0
    claim = statements(schema).claim
    params: dict[str, Any] = {"queue": "default", "limit": 10, "worker": "w", "lease": 30.0}
    params |= dict.fromkeys(("from_priority", "from_run_at", "from_id", "tasks"))
    with psycopg.connect(
        dsn, autocommit=True, prepare_threshold=threshold, row_factory=dict_row
    ) as conn:
        q.enqueue_many([{}] * 20)
        q.upkeep(max_steps=1)  # the current generation is now an empty one
        for _ in range(8):
            conn.execute(claim, params).fetchall()
        q.enqueue_many([{}] * 20_000)
        times = []
        for _ in range(50):
            t = time.perf_counter()
            conn.execute(claim, params).fetchall()
            times.append(time.perf_counter() - t)
        plans = conn.execute(
            "SELECT sum(generic_plans) AS generic, sum(custom_plans) AS custom "
            "FROM pg_prepared_statements"
        ).fetchone()
    print(
        f"prepare_threshold={threshold}: claim of 10 p50 {statistics.median(times) * 1000:.2f} "
        f"ms, max {max(times) * 1000:.2f} ms; plans {plans}"
    )
    q.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
