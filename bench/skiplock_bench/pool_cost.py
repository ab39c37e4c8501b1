"""``python -m skiplock_bench pool-cost``: the process pool's cost per job against threads.

``python -m skiplock_bench pool-cost [ROUNDS] [N_NOOP] [N_SLEEP] [C]`` (defaults 3,
2000, 400, 4).
Each round drains, in alternation, N_NOOP no-op jobs and N_SLEEP jobs that sleep 10 ms,
with ``pool="thread"`` and with ``pool="process"``, one Worker of concurrency C each.
The worker starts on an empty queue and is timed from the moment its handlers are
ready and one COPY has enqueued the jobs until the last is done (the status query
polls every 20 ms, alike for both), so a child's start is not in the drain; it is
printed apart (``start``).  Prints each round's figures, then the medians and the
process pool's extra cost per job.  The DSN is $SKIPLOCK_BENCH_DSN or the local
server; each drain has a schema of its own, dropped after.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker

from .common import DEFAULT_DSN

# Module-level, so that the process pool's children import them by name.


def noop(job: Job) -> None:
    return None


def sleep10(job: Job) -> None:
    time.sleep(0.010)


def drain(
    dsn: str, pool: str, handler: Callable[[Job], None], n: int, c: int
) -> tuple[float, float]:
    """(seconds to start the worker's handlers, seconds to drain ``n`` jobs)."""
    schema = f"poolcost_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=2)
    try:
        q.migrate()
        w = Worker(q, handler, pool=pool, concurrency=c, poll_interval=0.05)
        began = time.monotonic()
        thread = w.start()
        while w._pool is None:  # built in run() once every child is ready
            time.sleep(0.005)
        started = time.monotonic() - began
        t0 = time.monotonic()
        q.enqueue_many([{}] * n)
        while sum(r["jobs"] for r in q.status() if r["status"] == "done") < n:
            time.sleep(0.02)
        secs = time.monotonic() - t0
        w.stop()
        thread.join(60)
        return started, secs
    finally:
        q.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def main(argv: list[str] | None = None) -> int:
    args = [int(a) for a in (sys.argv[1:] if argv is None else argv)]
    if len(args) > 4:
        raise SystemExit(__doc__)
    rounds, n_noop, n_sleep, c = (args + [3, 2000, 400, 4][len(args) :])[:4]
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
    kinds: dict[str, tuple[Callable[[Job], None], int]] = {
        "noop": (noop, n_noop),
        "10ms": (sleep10, n_sleep),
    }
    figures: dict[tuple[str, str], list[float]] = {}
    starts: dict[str, list[float]] = {}
    for r in range(rounds):
        for kind, (handler, n) in kinds.items():
            # Alternate which pool goes first, so a drift of the machine's load
            # weighs on both alike.
            order = ["thread", "process"] if r % 2 == 0 else ["process", "thread"]
            for pool in order:
                started, secs = drain(dsn, pool, handler, n, c)
                figures.setdefault((kind, pool), []).append(secs)
                starts.setdefault(pool, []).append(started)
                print(
                    f"round {r + 1} {kind:5} {pool:7} N={n} C={c}: {secs:.3f} s, "
                    f"{n / secs:,.0f} jobs/s (start {started:.3f} s)",
                    flush=True,
                )
    print(f"\nmedians of {rounds} rounds, concurrency {c}:")
    for kind, (_, n) in kinds.items():
        t = statistics.median(figures[(kind, "thread")])
        p = statistics.median(figures[(kind, "process")])
        extra_us = (p - t) / n * c * 1e6
        print(
            f"  {kind:5} N={n}: threads {n / t:,.0f} jobs/s, processes {n / p:,.0f} jobs/s "
            f"({p / t:.2f}x the time; {extra_us:,.0f} us more per job per slot)"
        )
    for pool, s in starts.items():
        print(f"  start of {c} handlers, {pool}: median {statistics.median(s):.3f} s")
    return 0
