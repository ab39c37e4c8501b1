"""What moving a history costs a drain beside it, with the upkeep paced and not.

``python bench/upkeep_pace.py [HISTORY] [ROUNDS]`` (defaults 1,000,000 and 6): a schema
gets HISTORY jobs run to completion by pgbench through skiplock's own claim and
complete (no worker, so no upkeep: all of them wait in one generation to be moved to
their day, as after a migration from 0008 or a pgbench run); then, ROUNDS times, each
of three ways in turn:

- ``flat``: a ``Worker`` drains 20,000 no-op jobs on that schema while its upkeep moves
  the history flat out (``UPKEEP_SHARE = 1``: no rest, as before the pacing);
- ``paced``: the same with the default ``UPKEEP_SHARE`` (a busy worker's upkeep rests
  between steps);
- ``off``: the same with the worker's upkeep thread doing nothing (the history stays
  where it is for that drain).

Each is divided by a drain of 20,000 on a fresh schema run just before it, and the
medians of the ratios printed; ``moved`` is how many history jobs had reached their
day by then.  The DSN is $SKIPLOCK_BENCH_DSN or the local server; the schemas are
dropped after.  Single drains on two shared cores swing by a fifth: read the medians.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from typing import Any

import psycopg
from drain_once import Counting, timed_drain
from psycopg import sql
from skiplock_bench import lib_skiplock, pgbench
from skiplock_bench.common import DEFAULT_DSN, settle
from skiplock_bench.server import finish_leftovers

from skiplock import Queue, Worker

N = 20_000
HISTORY, FRESH = "pace_history", "pace_fresh"


def build_history(dsn: str, schema: str, history: int) -> None:
    """A fresh schema with ``history`` jobs run to completion by pgbench through
    skiplock's claim and complete: no worker, so no upkeep has moved or analyzed any."""
    lib_skiplock.setup(dsn, schema)
    lib_skiplock.enqueue_bulk(dsn, history, schema=schema)
    res = pgbench.run(dsn, schema, clients=8, batch=10, transactions=math.ceil(history / 80 * 1.02))
    print(
        f"history: {res.done:,} finished by pgbench, {finish_leftovers(dsn, schema)} by SQL",
        flush=True,
    )


def drop_schemas(dsn: str, *schemas: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def drain(dsn: str, schema: str, *, share: float | None) -> float:
    """Enqueue N no-op jobs and drain them with one Worker (concurrency 8); jobs/s.
    ``share``: the worker's UPKEEP_SHARE, or None for no upkeep at all."""
    q = Queue(dsn, schema=schema, max_size=4)
    q.enqueue_many([{}] * N)
    settle(dsn)
    counting = Counting(N)

    class Measured(Worker):
        UPKEEP_SHARE = Worker.UPKEEP_SHARE if share is None else share

        def _upkeep_loop(self) -> None:
            if share is not None:
                super()._upkeep_loop()

    secs = timed_drain(Measured(q, counting, concurrency=8), counting)
    q.close()
    return N / secs


def main() -> None:
    history = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
    build_history(dsn, HISTORY, history)
    ways: dict[str, float | None] = {"flat": 1.0, "paced": Worker.UPKEEP_SHARE, "off": None}
    ratios: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for rnd in range(1, rounds + 1):
            for name, share in ways.items():
                lib_skiplock.setup(dsn, FRESH)
                fresh = drain(dsn, FRESH, share=share)
                hist = drain(dsn, HISTORY, share=share)
                ratios[name].append(hist / fresh)
                moved = lib_skiplock.count_jobs(dsn, HISTORY, "part >= 1000000")  # in a day
                print(
                    f"round {rnd} {name:>5}: fresh {fresh:,.0f} jobs/s, after the history "
                    f"{hist:,.0f}, ratio {hist / fresh:.2f}; moved {moved:,}",
                    flush=True,
                )
        summary: dict[str, Any] = {
            k: (round(statistics.median(v), 3), [round(x, 2) for x in v]) for k, v in ratios.items()
        }
        for name, (med, each) in summary.items():
            print(f"{name:>5}: history / fresh median {med} of {each}")
    finally:
        drop_schemas(dsn, HISTORY, FRESH)


if __name__ == "__main__":
    main()
