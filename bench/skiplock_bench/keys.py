"""``python -m skiplock_bench keys``: per-key concurrency (migration 0018), measured.

Two experiments, each on a schema of its own (dropped after), with several ``Worker``s
in this process (``--workers`` of ``--concurrency`` handlers each; default 4 x 2 = 8
handlers running at once) whose handler sleeps ``--work`` ms and records when it
started and ended (time.monotonic):

- ``limit``: ``--keys`` keys (100) of ``--per-key`` jobs each (40), limit 1 per key,
  drained; then the same jobs without a key.  Reported: the largest number of jobs of
  one key seen running at once (from the handlers' own intervals; must be 1), the
  throughput of each drain (jobs over first start to last end) and their ratio, and
  that every job ran exactly once.
- ``overhead``: ``--overhead-n`` (20,000) jobs *without* a key enqueued (COPY), then
  claimed and completed in batches of 100 from one connection, on a schema with 0018's
  triggers and indexes and on one where they were dropped, alternated for
  ``--rounds`` (5): what per-key concurrency costs jobs that do not use it.
- ``rows``: the same per row, server side: one INSERT ... SELECT, one claim-like and
  one complete-like UPDATE of ``--overhead-n`` rows without a key, on both schemas,
  alternated for ``--rounds``; the median statement time a row.
- ``fairness``: tenant A enqueues ``--backlog`` jobs (10,000), then tenant B one job,
  while the workers run: B's wait (its enqueue to its handler's start), first with no
  key (plain FIFO: B waits behind A's backlog), then with a key per tenant and limit
  ``--tenant-limit`` (4: A keeps half the handlers busy).

The DSN is ``--dsn``, else $SKIPLOCK_BENCH_DSN or the local server.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker

from .common import DEFAULT_DSN

Span = tuple[float, float, int]  # start, end, job id


def say(msg: str) -> None:
    """A figure, on stdout (as the other experiments print theirs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _most_at_once(spans: Sequence[Span]) -> int:
    """The largest number of the intervals open at one instant (an end before a start
    at the same instant: back to back is not at once)."""
    events = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


class _Run:
    """A fresh schema, its Queue and the handlers' records."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.schema = f"bench_keys_{uuid.uuid4().hex[:8]}"
        self.queue = Queue(dsn, schema=self.schema, max_size=4)
        self.queue.migrate()
        self.spans: dict[str, list[Span]] = defaultdict(list)
        self.started: dict[int, float] = {}
        self.lock = threading.Lock()

    def handler(self, work: float) -> Callable[[Job], None]:
        def run(job: Job) -> None:
            start = time.monotonic()
            with self.lock:
                self.started[job.id] = start
            time.sleep(work)
            with self.lock:
                self.spans[str(job.payload.get("k"))].append((start, time.monotonic(), job.id))

        return run

    def done(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.spans.values())

    def close(self) -> None:
        self.queue.close()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema))
            )


def _workers(run: _Run, args: argparse.Namespace, stack: ExitStack) -> None:
    for i in range(args.workers):
        w = Worker(
            run.queue,
            run.handler(args.work / 1000),
            concurrency=args.concurrency,
            lease=30,
            poll_interval=0.05,
            name=f"bench-keys-{i}",
        )
        t = w.start()
        stack.callback(t.join, 30)
        stack.callback(w.stop)


def _wait(cond: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit("timed out")
        time.sleep(0.005)


def _drain(args: argparse.Namespace, keyed: bool) -> dict[str, Any]:
    run = _Run(args.dsn)
    try:
        n = args.keys * args.per_key
        # Interleaved by key, as tenants' jobs arrive: key i's jobs are not adjacent.
        payloads = [{"k": f"k{i}", "n": j} for j in range(args.per_key) for i in range(args.keys)]
        if keyed:
            for i in range(args.keys):
                run.queue.enqueue_many(
                    [p for p in payloads if p["k"] == f"k{i}"],
                    concurrency_key=f"k{i}",
                    concurrency=1,
                )
        else:
            run.queue.enqueue_many(payloads)
        with ExitStack() as stack:
            _workers(run, args, stack)
            _wait(lambda: run.done() >= n, 600)
        spans = [s for v in run.spans.values() for s in v]
        ids = [jid for _, _, jid in spans]
        first = min(s for s, _, _ in spans)
        last = max(e for _, e, _ in spans)
        return {
            "jobs": n,
            "ran": len(ids),
            "distinct": len(set(ids)),
            "most_at_once_per_key": max(_most_at_once(v) for v in run.spans.values()),
            "most_at_once": _most_at_once(spans),
            "seconds": last - first,
            "jobs_per_s": n / (last - first),
        }
    finally:
        run.close()


def _fairness(args: argparse.Namespace, keyed: bool) -> dict[str, Any]:
    run = _Run(args.dsn)
    try:
        extra: dict[str, Any] = {}
        with ExitStack() as stack:
            _workers(run, args, stack)
            if keyed:
                extra = {"concurrency_key": "tenant:a", "concurrency": args.tenant_limit}
            run.queue.enqueue_many([{"k": "a", "n": n} for n in range(args.backlog)], **extra)
            if keyed:
                extra = {"concurrency_key": "tenant:b", "concurrency": args.tenant_limit}
            at = time.monotonic()
            b = run.queue.enqueue({"k": "b"}, **extra)
            _wait(lambda: b in run.started, 600)
            wait = run.started[b] - at
            ahead = sum(1 for s in run.started.values() if s < run.started[b])
        return {"b_wait_ms": wait * 1000, "a_jobs_started_before_b": ahead}
    finally:
        run.close()


_WITHOUT = [
    "DROP TRIGGER jobs_key_hold ON {s}.jobs",
    "DROP TRIGGER jobs_key_admit_inserted ON {s}.jobs",
    "DROP TRIGGER jobs_key_admit_updated ON {s}.jobs",
    "DROP TRIGGER jobs_key_admit_deleted ON {s}.jobs",
    "DROP INDEX {s}.jobs_key_admitted_idx",
    "DROP INDEX {s}.jobs_key_waiting_idx",
]


def _overhead_once(args: argparse.Namespace, with_keys: bool) -> float:
    """Seconds to enqueue ``--overhead-n`` jobs without a key (COPY) and claim and
    complete them in batches of 100 from one connection: what 0018's triggers and
    indexes cost jobs that have no key (``with_keys`` False: both dropped first)."""
    run = _Run(args.dsn)
    try:
        if not with_keys:
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                for stmt in _WITHOUT:
                    conn.execute(sql.SQL(stmt).format(s=sql.Identifier(run.schema)))
        q = run.queue
        start = time.perf_counter()
        q.enqueue_many([{"n": n} for n in range(args.overhead_n)])
        mid = time.perf_counter()
        while jobs := q.claim(worker="w", limit=100, lease=60):
            q.complete_many([(j, None) for j in jobs])
        end = time.perf_counter()
        say(
            f"  {'with' if with_keys else 'without'}: "
            f"enqueue {mid - start:.2f} s, drain {end - mid:.2f} s"
        )
        return end - start
    finally:
        run.close()


_ROW_STEPS = {
    "insert": "INSERT INTO {s}.jobs (queue, payload) SELECT 'default', '{{}}' "
    "FROM generate_series(1, %(n)s)",
    "claim": "UPDATE {s}.jobs SET status = 'running', worker = 'w', "
    "lease_token = gen_random_uuid(), locked_until = now() + interval '1 minute', "
    "attempts = attempts + 1 WHERE status = 'pending'",
    "complete": "UPDATE {s}.jobs SET status = 'done', finished_at = now(), "
    "locked_until = NULL WHERE status = 'running'",
}


def _rows(args: argparse.Namespace) -> None:
    """The per-row price, server side: the same set-wise insert, claim-like and
    complete-like UPDATE of ``--overhead-n`` rows without a key, on a schema with 0018's
    triggers and indexes and on one without, alternated; median statement times."""
    runs = {True: _Run(args.dsn), False: _Run(args.dsn)}
    try:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            for stmt in _WITHOUT:
                conn.execute(sql.SQL(stmt).format(s=sql.Identifier(runs[False].schema)))
            took: dict[tuple[bool, str], list[float]] = defaultdict(list)
            for r in range(args.rounds):
                for w in [True, False] if r % 2 == 0 else [False, True]:
                    s = sql.Identifier(runs[w].schema)
                    for step, text in _ROW_STEPS.items():
                        start = time.perf_counter()
                        conn.execute(sql.SQL(text).format(s=s), {"n": args.overhead_n})
                        took[(w, step)].append(time.perf_counter() - start)
                    conn.execute(sql.SQL("TRUNCATE {}.jobs").format(s))
        for step in _ROW_STEPS:
            a = sorted(took[(True, step)])[args.rounds // 2]
            b = sorted(took[(False, step)])[args.rounds // 2]
            say(
                f"rows: {step} of {args.overhead_n} rows without a key, median of "
                f"{args.rounds}: {a * 1e6 / args.overhead_n:.2f} us a row with 0018's "
                f"triggers and indexes, {b * 1e6 / args.overhead_n:.2f} without ({a / b:.3f}x)"
            )
    finally:
        for run in runs.values():
            run.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="skiplock_bench keys", description=__doc__.split("\n")[0])
    p.add_argument("--dsn", default=os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--work", type=float, default=2.0, help="handler sleep, ms")
    p.add_argument("--keys", type=int, default=100)
    p.add_argument("--per-key", type=int, default=40)
    p.add_argument("--backlog", type=int, default=10_000)
    p.add_argument("--tenant-limit", type=int, default=4)
    p.add_argument("--overhead-n", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the overhead A/B")
    p.add_argument("--only", choices=["limit", "fairness", "overhead", "rows"], default=None)
    args = p.parse_args(argv)
    slots = args.workers * args.concurrency
    say(f"keys: {args.workers} x {args.concurrency} = {slots} handlers, {args.work} ms each")
    if args.only in (None, "limit"):
        keyed = _drain(args, keyed=True)
        plain = _drain(args, keyed=False)
        say(f"limit 1 over {args.keys} keys x {args.per_key} jobs: {keyed}")
        say(f"the same jobs without a key: {plain}")
        say(
            f"most jobs of one key at once: {keyed['most_at_once_per_key']} (limit 1); "
            f"throughput {keyed['jobs_per_s']:.0f} vs {plain['jobs_per_s']:.0f} jobs/s "
            f"({keyed['jobs_per_s'] / plain['jobs_per_s']:.2f}x); exactly once: "
            f"{keyed['ran'] == keyed['distinct'] == keyed['jobs']}"
        )
    if args.only in (None, "fairness"):
        plain = _fairness(args, keyed=False)
        keyed = _fairness(args, keyed=True)
        say(
            f"fairness, A's backlog {args.backlog} then B's one job: B waited "
            f"{plain['b_wait_ms']:.0f} ms behind {plain['a_jobs_started_before_b']} of A's jobs "
            f"without keys, {keyed['b_wait_ms']:.1f} ms behind "
            f"{keyed['a_jobs_started_before_b']} with a key per tenant "
            f"(limit {args.tenant_limit})"
        )
    if args.only in (None, "overhead"):
        ratios = []
        for r in range(args.rounds):
            order = [True, False] if r % 2 == 0 else [False, True]
            took = {w: _overhead_once(args, w) for w in order}
            ratios.append(took[True] / took[False])
            say(
                f"overhead round {r + 1}: {args.overhead_n} jobs without a key, enqueue + "
                f"claim + complete: {took[True]:.2f} s with 0018's triggers and indexes, "
                f"{took[False]:.2f} s without ({ratios[-1]:.3f}x)"
            )
        ratios.sort()
        say(f"overhead: with / without, median of {args.rounds}: {ratios[len(ratios) // 2]:.3f}x")
    if args.only in (None, "rows"):
        _rows(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
