"""``python -m skiplock_bench retry-failed``: finding and retrying failed jobs, beside done ones.

``python -m skiplock_bench retry-failed [--dsn DSN] [--failed N] [--done D ...]``
(defaults 5,000 and 0 100,000): what finding and retrying failed jobs costs, beside
many finished ones.  For each ``D``: a fresh schema with ``D`` done jobs and ``N``
failed ones (made through the real claim and fenced writes, then analyzed), then
``Queue.find_jobs(status="failed")`` (the first page of 50) and ``Queue.retry_failed()``
are timed once each, and the schema is dropped.  The retry should cost the same
whatever ``D`` is: each batch looks its jobs up by key, never reading the done jobs.
The DSN is ``--dsn``, else $SKIPLOCK_BENCH_DSN or the local server.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Sequence

import psycopg
from psycopg import sql

from skiplock import Queue

from .common import DEFAULT_DSN


def _fill(q: Queue, queue: str, n: int, *, fail: bool) -> None:
    for start in range(0, n, 10_000):
        size = min(10_000, n - start)
        q.enqueue_many([{}] * size, queue=queue, task=f"bench.{queue}")
        jobs = q.claim(worker="bench", queue=queue, limit=size)
        if fail:
            q.fail_many([(j, "ValueError: boom", None, False) for j in jobs])
        else:
            q.complete_many([(j, None) for j in jobs])


def run(dsn: str, failed: int, done: int) -> str:
    """One schema of ``done`` done and ``failed`` failed jobs: the line of figures."""
    schema = f"bench_retry_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=2)
    try:
        q.migrate()
        _fill(q, "bulk", done, fail=False)
        _fill(q, "ops", failed, fail=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        t0 = time.perf_counter()
        q.find_jobs(status="failed", limit=50)
        found = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = q.retry_failed()
        took = time.perf_counter() - t0
        n = len(report.retried)
        return (
            f"{done:>9,} done + {failed:,} failed: find_jobs(status=failed) "
            f"{found * 1000:.0f} ms; retry_failed {n:,} in {took:.2f} s ({n / took:,.0f} jobs/s)"
        )
    finally:
        q.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="skiplock_bench retry-failed", description=__doc__.split("\n")[0]
    )
    p.add_argument("--dsn", default=os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN))
    p.add_argument("--failed", type=int, default=5_000, help="failed jobs (5,000)")
    p.add_argument(
        "--done", type=int, nargs="+", default=[0, 100_000], help="done jobs beside them, each"
    )
    args = p.parse_args(argv)
    for d in args.done:
        print(run(args.dsn, args.failed, d), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
