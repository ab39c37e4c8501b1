"""What each generation a backlog left behind costs every claim afterwards.

``python bench/surplus_generations.py [--jobs N] [--concurrency C] [--extra 0,6,12]
[--rounds R]``

A generation (migration 0009) is a partition of ``jobs`` with four indexes.  Every
statement that reads the generations plans and locks each of them and its indexes, and
the claim's pick merges every generation's claimable index, empty or not.  Before
migration 0014 a generation that a backlog added stayed for good.  This drains ``N``
no-op jobs with one in-process ``Worker`` of ``C`` in a fresh schema to which ``E``
empty generations were added first, for each ``E`` in ``--extra``, rounds alternated,
and prints jobs/s, the median over rounds and its ratio to the first ``E``; and the
relation locks one claim's pick takes, with how many missed the backend's fast-path
slots (16 on PostgreSQL 15-17) and went to the shared lock table.

``--backlog S`` measures instead how many generations a backlog makes: a ``Worker`` of
8 whose handler sleeps 4 ms (about 1,600 jobs/s here) runs while ``--rate`` jobs a
second (default 3,000) are enqueued for ``S`` seconds; the generations and the pending
jobs are printed every 10 s, through the drain that follows and for ``--after``
seconds of an idle queue (default 30), in which upkeep goes on at every sweep.

``--drops`` measures what dropping the surplus costs the claims beside it (migration
0014): with 9 empty generations added and a backlog of 200,000 jobs in the current
one, four threads claim and complete 10 at a time for 3 s, then one ``upkeep()`` call
(rotation held off, so that dropping is all it has to do) drops the nine back to back
while they go on, and they run 3 s more; printed: the call's steps and time, and the
claims' latency before, during and after it.

The DSN is $SKIPLOCK_BENCH_DSN or the local server; each schema is dropped after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid

import psycopg
from drain_once import Counting, timed_drain  # bench/ is on the path
from psycopg import sql
from skiplock_bench.common import percentile

from skiplock import Job, Queue, Worker

DSN = os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def add_generations(schema: str, extra: int) -> None:
    """Add ``extra`` empty generations after the three a schema starts with, as a
    backlog would have (``upkeep()``'s own ``add_partition`` and ``generations`` row);
    no rotation moves the current one."""
    s = sql.Identifier(schema)
    with psycopg.connect(DSN, autocommit=True) as conn:
        for part in range(4, 4 + extra):
            conn.execute(
                sql.SQL("SELECT {}.add_partition(%s, %s)").format(s), (f"jobs_g{part}", part)
            )
            conn.execute(
                sql.SQL("INSERT INTO {}.generations (part, first_id) VALUES (%s, -1)").format(s),
                (part,),
            )


def claim_locks(schema: str) -> tuple[int, int]:
    """Relation locks one pick takes in a transaction: (all, outside the fast path)."""
    s = sql.Identifier(schema)
    with psycopg.connect(DSN) as conn:
        conn.execute(
            sql.SQL("SELECT * FROM {}.claimable('default', 10, NULL, NULL, NULL, NULL)").format(s)
        ).fetchall()
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE NOT fastpath) FROM pg_locks"
            " WHERE pid = pg_backend_pid() AND locktype = 'relation'"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def drain(extra: int, jobs: int, concurrency: int) -> tuple[float, tuple[int, int]]:
    """One drain in a schema of its own with ``extra`` surplus generations."""
    schema = f"surplus_{uuid.uuid4().hex[:8]}"
    q = Queue(DSN, schema=schema, max_size=4)
    try:
        q.migrate()
        add_generations(schema, extra)
        q.enqueue_many([{}] * jobs)
        locks = claim_locks(schema)
        counting = Counting(jobs)
        secs = timed_drain(Worker(q, counting, concurrency=concurrency), counting)
        return jobs / secs, locks
    finally:
        q.close()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def backlog(seconds: float, rate: int, after: float) -> None:
    """Enqueue ``rate`` jobs/s for ``seconds`` against a slower worker, then drain and
    idle for ``after`` seconds; print the generations every 10 s."""
    schema = f"surplus_{uuid.uuid4().hex[:8]}"
    s = sql.Identifier(schema)
    q = Queue(DSN, schema=schema, max_size=4)
    stop = threading.Event()

    def handler(job: Job) -> None:
        time.sleep(0.004)

    def enqueue() -> None:
        start = time.monotonic()
        sent = 0
        while not stop.is_set() and (elapsed := time.monotonic() - start) < seconds:
            due = int(rate * elapsed) - sent
            if due > 0:
                q.enqueue_many([{}] * due)
                sent += due
            time.sleep(0.05)

    try:
        q.migrate()
        w = Worker(q, handler, concurrency=8, name="surplus")
        worker = w.start()
        producer = threading.Thread(target=enqueue)
        producer.start()
        start = time.monotonic()
        idle_since: float | None = None
        peak = 0
        with psycopg.connect(DSN, autocommit=True) as conn:
            while True:
                time.sleep(10)
                row = conn.execute(
                    sql.SQL(
                        "SELECT (SELECT count(*) FROM {}.generations),"
                        " (SELECT count(*) FROM {}.jobs WHERE status = 'pending')"
                    ).format(s, s)
                ).fetchone()
                assert row is not None
                gens, pending = int(row[0]), int(row[1])
                peak = max(peak, gens)
                now = time.monotonic() - start
                print(f"{now:6.0f} s  generations {gens:3}  pending {pending:7,}", flush=True)
                if now > seconds and pending == 0 and idle_since is None:
                    idle_since = now
                if idle_since is not None and now - idle_since >= after:
                    break
        print(f"peak {peak} generations; {gens} after {after:.0f} s idle")
        stop.set()
        producer.join()
        w.stop()
        worker.join(30)
    finally:
        stop.set()
        q.close()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))


def drops() -> None:
    """Claim latency while one upkeep call drops nine surplus generations."""
    schema = f"surplus_{uuid.uuid4().hex[:8]}"
    q = Queue(DSN, schema=schema, max_size=1)
    stop = threading.Event()
    claims: list[tuple[float, float]] = []  # (sent, seconds)

    def claimer(name: str) -> None:
        cq = Queue(DSN, schema=schema, max_size=1)
        try:
            while not stop.is_set():
                sent = time.perf_counter()
                jobs = cq.claim(worker=name, limit=10)
                claims.append((sent, time.perf_counter() - sent))
                cq.complete_many([(j, None) for j in jobs])
        finally:
            cq.close()

    try:
        q.migrate()
        add_generations(schema, 9)
        q.enqueue_many([{}] * 200_000)
        q.ROTATE_ROWS = 10**12  # no rotation: dropping is all upkeep has left
        print("before the claimers:", q.upkeep(max_steps=1))  # the one ANALYZE
        threads = [threading.Thread(target=claimer, args=(f"c{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)
        t0 = time.perf_counter()
        steps = q.upkeep(max_steps=50)
        t1 = time.perf_counter()
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join()
        print(f"upkeep {steps} in {(t1 - t0) * 1000:.0f} ms")
        for name, lo, hi in (("before", t0 - 2.5, t0), ("during", t0, t1), ("after", t1, t1 + 3)):
            secs = sorted(d for sent, d in claims if lo <= sent < hi)
            p50, p99 = percentile(secs, 50) * 1000, percentile(secs, 99) * 1000
            print(
                f"{name:6}  claims {len(secs):5}  {len(secs) / (hi - lo):6.0f}/s"
                f"  p50 {p50:5.2f}  p99 {p99:5.2f}  max {secs[-1] * 1000:5.2f} ms"
            )
    finally:
        stop.set()
        q.close()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--extra", default="0,6,12")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backlog", type=float, default=0.0)
    ap.add_argument("--rate", type=int, default=3_000)
    ap.add_argument("--after", type=float, default=30.0)
    ap.add_argument("--drops", action="store_true")
    args = ap.parse_args()
    if args.drops:
        drops()
        return
    if args.backlog:
        backlog(args.backlog, args.rate, args.after)
        return
    extras = [int(e) for e in args.extra.split(",")]
    rates: dict[int, list[float]] = {e: [] for e in extras}
    locks: dict[int, tuple[int, int]] = {}
    for r in range(args.rounds):
        for e in extras if r % 2 == 0 else reversed(extras):
            rate, locks[e] = drain(e, args.jobs, args.concurrency)
            rates[e].append(rate)
            print(f"round {r + 1}: {3 + e} generations {rate:,.0f} jobs/s", flush=True)
    base = statistics.median(rates[extras[0]])
    print("generations  jobs/s (median)  ratio  pick's relation locks (shared table)")
    for e in extras:
        med = statistics.median(rates[e])
        total, shared = locks[e]
        print(f"{3 + e:11}  {med:15,.0f}  {med / base:5.2f}  {total} ({shared})")


if __name__ == "__main__":
    main()
