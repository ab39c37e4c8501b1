"""Where a drain right after an unmoved history spends its time, against a fresh table.

``python bench/history_profile.py [HISTORY] [ROUNDS]`` (defaults 1,000,000 and 4): a
schema gets HISTORY jobs run to completion by pgbench (``upkeep_pace.build_history``:
all of them left in one generation, never moved, analyzed or vacuumed); then, ROUNDS
times, a ``Worker`` (concurrency 8, its upkeep off, so the history stays where it is)
drains 20,000 no-op jobs on a fresh schema and then on the history's.  Every claim
statement the worker sends is timed from the client, by kind (a claim alone, or one
riding a completion batch: ``fused``) and by where its scan starts (the head of the
claim order, or the worker's position: ``_cursor.py``).  Last, one pick of 70 from the
head and one from the first pending job's position are EXPLAINed on each schema, with
2,000 jobs pending.  Upkeep off is ``upkeep_pace.py``'s "off"; what the upkeep's moves
cost beside a drain is measured there.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
from drain_once import Counting, timed_drain
from psycopg import sql
from skiplock_bench import lib_skiplock
from skiplock_bench.common import DEFAULT_DSN, settle
from upkeep_pace import build_history, drop_schemas

from skiplock import Queue, Worker

N = 20_000
HISTORY, FRESH = "prof_history", "prof_fresh"


class Timings:
    """Each claim statement the worker sends, as (schema, kind, seconds, jobs claimed)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, int]] = []
        self.local = threading.local()
        self.lock = threading.Lock()

    def install(self) -> None:
        """Wrap the Queue methods the worker claims through (nothing is replaced)."""
        claim_op, claim, fused = Queue._claim_op, Queue.claim, Queue._complete_and_claim
        local = self.local

        def timed_claim_op(q: Queue, *args: Any, **kw: Any) -> Any:
            local.head = kw.get("start") is None  # the op a fused claim is built from
            return claim_op(q, *args, **kw)

        def timed_claim(q: Queue, **kw: Any) -> Any:
            return self._time(q, "claim", kw.get("start") is None, lambda: claim(q, **kw))

        def timed_fused(q: Queue, items: Any, op: Any, **kw: Any) -> Any:
            head = bool(getattr(local, "head", False))
            return self._time(q, "fused", head, lambda: fused(q, items, op, **kw))

        Queue._claim_op = timed_claim_op  # type: ignore[method-assign]
        Queue.claim = timed_claim  # type: ignore[method-assign]
        Queue._complete_and_claim = timed_fused  # type: ignore[method-assign]

    def _time(self, q: Queue, kind: str, head: bool, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = call()
        secs = time.perf_counter() - start
        claimed = out[1] if kind == "fused" else out
        with self.lock:
            self.rows.append(
                (q.schema, f"{kind}, {'head' if head else 'position'}", secs, len(claimed))
            )
        return out

    def report(self, schema: str) -> None:
        kinds: dict[str, list[float]] = defaultdict(list)
        jobs: dict[str, int] = defaultdict(int)
        for where, kind, secs, n in self.rows:
            if where == schema:
                kinds[kind].append(secs)
                jobs[kind] += n
        print(f"{schema}:")
        for kind, secs in sorted(kinds.items()):
            secs.sort()
            p50, p90 = 1000 * secs[len(secs) // 2], 1000 * secs[int(len(secs) * 0.9)]
            print(
                f"  {kind:16} {len(secs):5} statements, {sum(secs):6.2f} s in all, "
                f"p50 {p50:6.2f} ms, p90 {p90:6.2f} ms, {jobs[kind]:,} jobs"
            )


def drain(dsn: str, schema: str) -> float:
    """Enqueue N no-op jobs and drain them with one Worker, its upkeep off; jobs/s."""
    q = Queue(dsn, schema=schema, max_size=4)
    q.enqueue_many([{}] * N)
    settle(dsn)
    counting = Counting(N)

    class NoUpkeep(Worker):
        def _upkeep_loop(self) -> None:
            return

    secs = timed_drain(NoUpkeep(q, counting, concurrency=8), counting)
    q.close()
    return N / secs


def explain(dsn: str, schema: str) -> None:
    """EXPLAIN one pick of 70 from the head and one from the first pending job."""
    with Queue(dsn, schema=schema, max_size=1) as q:
        q.enqueue_many([{}] * 2000)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        first = conn.execute(
            "SELECT priority, run_at, id - 1 FROM jobs WHERE status = 'pending' "
            "ORDER BY priority, run_at, id LIMIT 1"
        ).fetchone()
        for label, pos in (("head", (None, None, None)), ("position", first)):
            plan = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT * FROM claimable("
                "'default', 70, %s::integer, %s::timestamptz, %s::bigint, NULL)",
                pos,
            ).fetchall()
            print(f"{schema}, a pick from the {label}: " + "; ".join(r[0].strip() for r in plan))
        conn.rollback()


def main() -> None:
    history = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
    timings = Timings()
    timings.install()
    build_history(dsn, HISTORY, history)
    try:
        ratios = []
        for rnd in range(1, rounds + 1):
            lib_skiplock.setup(dsn, FRESH)
            fresh, hist = drain(dsn, FRESH), drain(dsn, HISTORY)
            ratios.append(hist / fresh)
            print(
                f"round {rnd}: fresh {fresh:,.0f} jobs/s, after the history {hist:,.0f}, "
                f"ratio {hist / fresh:.2f}",
                flush=True,
            )
        print(
            f"history / fresh, upkeep off: median {statistics.median(ratios):.2f} of "
            f"{[round(r, 2) for r in ratios]}"
        )
        for schema in (FRESH, HISTORY):
            timings.report(schema)
        lib_skiplock.setup(dsn, FRESH)
        for schema in (FRESH, HISTORY):
            explain(dsn, schema)
    finally:
        drop_schemas(dsn, HISTORY, FRESH)


if __name__ == "__main__":
    main()
