"""Drain throughput of one Worker with synchronous and asynchronous commit, alternated.

Usage: python bench/commit_modes.py [DSN] [--jobs N] [--rounds R]; no DSN: a scratch cluster.
The figures behind Worker(synchronous_commit=)'s default (see its docstring).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

import psycopg
from psycopg import sql

from skiplock import Queue, Worker


def drain(dsn: str, jobs: int, sync: bool, concurrency: int) -> float:
    schema = f"bench_commit_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema)
    try:
        q.migrate()
        for start in range(0, jobs, 5000):
            q.enqueue_many([{"n": i} for i in range(start, min(jobs, start + 5000))])
        done = threading.Event()
        count = [0]
        lock = threading.Lock()

        def handle(_job: object) -> None:
            with lock:
                count[0] += 1
                if count[0] == jobs:
                    done.set()

        w = Worker(
            q, handle, concurrency=concurrency, lease=30, synchronous_commit=sync, listen=False
        )
        t0 = time.monotonic()
        th = w.start()
        done.wait(600)
        # The last completions are written after the handlers return: wait for them.
        while w.stats.snapshot()["completed"] < jobs and time.monotonic() - t0 < 600:
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        w.stop()
        th.join()
        return jobs / elapsed
    finally:
        q.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dsn", nargs="?")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    cluster = None
    dsn = args.dsn
    if dsn is None:
        from skiplock.chaos import ScratchCluster

        cluster = ScratchCluster()
        dsn = cluster.start()
    try:
        with psycopg.connect(dsn) as c:
            row = c.execute("SELECT current_setting('fsync'), version()").fetchone()
        print(f"fsync={row[0] if row else '?'}; {row[1].split(' on ')[0] if row else ''}")
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for sync in (True, False):
                rate = drain(dsn, args.jobs, sync, args.concurrency)
                rates[sync].append(rate)
                print(f"round {r + 1} synchronous_commit={sync}: {rate:.0f} jobs/s")
        for sync, xs in rates.items():
            print(f"synchronous_commit={sync}: median {statistics.median(xs):.0f} jobs/s {xs}")
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
