"""What upkeep's move of finished jobs to their day costs, per job (migration 0009).

``python bench/move_cost.py N``: N no-op jobs enqueued, claimed and completed (batches
of 100), the generation rotated, then upkeep run to the end: it moves the N finished
jobs to their day and truncates the generation.  Prints WAL bytes (pg_current_wal_lsn,
so only on a server nothing else writes to) and server-side time per job, and the
same for the drain before it, for scale.  The DSN is $SKIPLOCK_BENCH_DSN or the local
server; the schema is dropped after.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import psycopg
from psycopg import sql

from skiplock import Queue


def lsn(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::text").fetchone()
    assert row is not None
    return int(str(row[0]))


def main() -> None:
    n = int(sys.argv[1])
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"move_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=2)
    q.migrate()
    q.ROTATE_ROWS, q.ROTATE_AFTER = 1, 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        q.enqueue_many([{}] * n)
        w0, t0 = lsn(conn), time.perf_counter()
        while jobs := q.claim(worker="w", limit=100):
            q.complete_many([(j, None) for j in jobs])
        w1, t1 = lsn(conn), time.perf_counter()
        steps: dict[str, int] = {}
        while True:
            done = q.upkeep()
            for k, v in done.items():
                steps[k] = steps.get(k, 0) + v
            if not done:
                break
        w2, t2 = lsn(conn), time.perf_counter()
        print(
            f"{n:,} jobs. drain (claim + complete, batches of 100): "
            f"{(w1 - w0) / n:,.0f} WAL bytes, {(t1 - t0) / n * 1e6:,.0f} us a job; "
            f"upkeep {steps}: {(w2 - w1) / n:,.0f} WAL bytes, {(t2 - t1) / n * 1e6:,.0f} us a job"
        )
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    q.close()


if __name__ == "__main__":
    main()
