"""``python -m skiplock_bench pickup-stages``: where an idle worker's pickup time goes.

``python -m skiplock_bench pickup-stages [SAMPLES] [ROUNDS]`` (defaults 300, 1): one ``Worker``
(concurrency 8, LISTEN on) in this process, idle; one job at a time is enqueued 10-30 ms
after the previous one started, as ``bench/run``'s pickup section does.  Each round
starts a new worker.  For each job, on this process's one monotonic clock:

- ``enqueue call``: the producer's ``enqueue()`` (its commit is the floor of the pickup);
- ``notify``: when a second listener on the same channel, a connection of its own in a
  thread of its own, got the NOTIFY, from the enqueue call's return (negative: before);
- ``claim sent`` and ``claim``: when the worker's claim that took the job went out, from
  the enqueue call's return, and how long it took (the worker's ``claim_seconds``);
- ``to handler``: from the claim's return to the handler's first line;
- ``pickup - floor``: from the enqueue call's return to the handler's first line, the
  figure issue 19 bounds at 0.5 ms (p50) and 2 ms (p99);
- ``pickup``: from the enqueue call to the handler's first line.

With more than one round, the medians of the rounds' p50s follow.
The figures on a disk whose flush was made slower (a preloaded library that slept in
every ``fdatasync``) are in bench/results/2026-12-05-pickup-on-slow-and-fast-flushes.md.

The DSN is $SKIPLOCK_BENCH_DSN or the local server; a schema of its own is dropped after.
Percentiles are the bench's nearest-rank ones (``skiplock_bench.common.percentile``).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time
import uuid

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker
from skiplock._sql import channel_name

from .common import DEFAULT_DSN, percentile


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 2:
        raise SystemExit(__doc__)
    samples = int(args[0]) if args else 300
    rounds = int(args[1]) if len(args) > 1 else 1
    run(os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN), samples, rounds)
    return 0


def run(dsn: str, samples: int, rounds: int) -> None:
    """Print every stage of ``rounds`` rounds of ``samples`` pickups on ``dsn``."""
    schema = f"pickup_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=2)
    q.migrate()
    p50s: list[dict[str, float]] = []
    try:
        for rnd in range(rounds):
            rows = one_round(q, dsn, schema, samples)
            print(f"round {rnd + 1}: {len(rows)} samples, ms (p50 / p99 / mean)")
            p50s.append({})
            for key in rows[0]:
                xs = [r[key] * 1000 for r in rows if r[key] == r[key]]
                p50, p99, mean = percentile(xs, 50), percentile(xs, 99), statistics.fmean(xs)
                p50s[-1][key] = p50
                print(f"  {key:<15} {p50:6.2f} / {p99:6.2f} / {mean:6.2f}")
    finally:
        q.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    if rounds > 1:
        print("medians of the rounds' p50s, ms")
        for key in p50s[0]:
            print(f"  {key:<15} {statistics.median(r[key] for r in p50s):6.2f}")


def one_round(q: Queue, dsn: str, schema: str, samples: int) -> list[dict[str, float]]:
    lock = threading.Lock()
    notified: list[float] = []
    claims: list[tuple[float, float]] = []  # (when it returned, seconds)
    started: dict[int, float] = {}
    got = threading.Event()
    stop = threading.Event()

    def listen() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(schema))))
            listening.set()
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.2):
                    t = time.monotonic()
                    with lock:
                        notified.append(t)

    def handler(job: Job) -> None:
        t = time.monotonic()
        with lock:
            started[int(job.payload["n"])] = t
        got.set()

    def on_measure(name: str, value: float, queue: str | None) -> None:
        if name == "claim_seconds":
            t = time.monotonic()
            with lock:
                claims.append((t, value))

    listening = threading.Event()
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    listening.wait(10)
    w = Worker(q, handler, concurrency=8, on_measure=on_measure)
    thread = w.start()
    time.sleep(1.0)  # registered, listening, idle
    rows: list[dict[str, float]] = []
    for i in range(samples):
        got.clear()
        with lock:
            notified.clear()
            claims.clear()
        t0 = time.monotonic()
        q.enqueue({"n": i})
        t1 = time.monotonic()
        if not got.wait(10):
            print(f"job {i} not picked up in 10 s", file=sys.stderr)
            continue
        with lock:
            th = started[i]
            note = notified[0] if notified else float("nan")
            # The claim that took the job: the last one to return before the handler.
            took = [c for c in claims if c[0] <= th]
        landed, secs = took[-1] if took else (float("nan"), float("nan"))
        rows.append(
            {
                "enqueue call": t1 - t0,
                "notify": note - t1,
                "claim sent": landed - secs - t1,
                "claim": secs,
                "to handler": th - landed,
                "pickup - floor": th - t1,
                "pickup": th - t0,
            }
        )
        time.sleep(random.uniform(0.01, 0.03))
    w.stop()
    thread.join(30)
    stop.set()
    listener.join(5)  # before the caller drops the schema or stops its server
    return rows


if __name__ == "__main__":
    sys.exit(main())
