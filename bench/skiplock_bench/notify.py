"""``python -m skiplock_bench.notify``: what the NOTIFY on enqueue costs producers.

A transaction that called NOTIFY takes one lock for the whole database at commit and
holds it until its commit record is flushed (PreCommit_Notify, PostgreSQL's async.c),
so notifying transactions commit one at a time instead of sharing a WAL flush.
Migration 0008 notifies a queue only while one of its workers waits for it
(``workers.waiting``, docs/architecture.md); this measures what that buys.

P producer processes (spawned, each with its own connection, autocommit) call
``Queue.enqueue`` one job at a time for ``--seconds``, under three conditions, each on
a fresh schema, taking turns in a rotated order every round:

- ``notify``: a registered worker of the queue waits (``waiting = true``): every
  enqueue notifies, as every enqueue did before 0008;
- ``busy``: the queue's only worker is busy (``waiting = false``): the trigger runs
  and reads ``workers`` but sends nothing;
- ``no-trigger``: the trigger disabled: the floor, what an INSERT alone costs.

Reported per condition: enqueues/s (median and range over the rounds), the ratio to
``notify`` within each round, and the producers' wait events sampled every 10 ms
(``Lock:object`` is the NOTIFY lock; ``IO:WALSync`` / ``LWLock:WALWrite`` the flush).
No worker runs: the figure is the producers' alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from collections import Counter
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Queue

from .common import log, median

CONDITIONS = ("notify", "busy", "no-trigger")
APP = "skiplock-bench-notify"


def _producer(dsn: str, schema: str, seconds: float, start: Any, out: Any) -> None:
    q = Queue(dsn, schema=schema, max_size=1)
    n = 0
    with psycopg.connect(dsn, autocommit=True, application_name=APP) as conn:
        start.wait()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            q.enqueue({"n": n}, queue="q", conn=conn)
            n += 1
    q.close()
    out.put(n)


def _sample(dsn: str, stop: threading.Event, waits: Counter[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            for etype, event in conn.execute(
                "SELECT wait_event_type, wait_event FROM pg_stat_activity "
                "WHERE application_name = %s AND state = 'active'",
                (APP,),
            ):
                waits[f"{etype}:{event}" if etype else "CPU"] += 1
            stop.wait(0.01)


def run_one(dsn: str, condition: str, producers: int, seconds: float) -> dict[str, Any]:
    schema = f"bench_notify_{os.getpid()}_{condition.replace('-', '_')}"
    ident = sql.Identifier(schema)
    q = Queue(dsn, schema=schema, max_size=1)
    q.migrate()
    with psycopg.connect(dsn, autocommit=True) as admin:
        if condition == "no-trigger":
            admin.execute(
                sql.SQL("ALTER TABLE {}.jobs DISABLE TRIGGER jobs_notify_enqueued").format(ident)
            )
        else:
            admin.execute(
                sql.SQL(
                    "INSERT INTO {}.workers (name, queues, waiting) VALUES ('w', '{{q}}', %s)"
                ).format(ident),
                (condition == "notify",),
            )
        ctx = mp.get_context("spawn")
        start = ctx.Event()
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_producer, args=(dsn, schema, seconds, start, out))
            for _ in range(producers)
        ]
        for p in procs:
            p.start()
        time.sleep(2.0)  # every producer imported and connected before the clock
        waits: Counter[str] = Counter()
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(dsn, stop, waits), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        start.set()
        total = sum(out.get(timeout=seconds + 60) for _ in procs)
        elapsed = time.monotonic() - t0
        stop.set()
        sampler.join()
        for p in procs:
            p.join()
        q.close()
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))
    samples = sum(waits.values()) or 1
    return {
        "rate": total / elapsed,
        "waits": {k: round(v / samples, 3) for k, v in waits.most_common(5)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skiplock_bench.notify", description=__doc__)
    ap.add_argument(
        "--dsn",
        default=os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    rates: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    waits: dict[str, list[dict[str, float]]] = {c: [] for c in CONDITIONS}
    for r in range(args.rounds):
        order = CONDITIONS[r % 3 :] + CONDITIONS[: r % 3]
        for cond in order:
            res = run_one(args.dsn, cond, args.producers, args.seconds)
            rates[cond].append(res["rate"])
            waits[cond].append(res["waits"])
            log(f"round {r + 1} {cond}: {res['rate']:,.0f} enqueues/s, waits {res['waits']}")
    print(f"\n{args.producers} producers, one job per transaction, {args.seconds:g} s a run\n")
    print("| condition | enqueues/s (median) | range | / notify, per round (median) |")
    print("|---|---|---|---|")
    for cond in CONDITIONS:
        ratios = [a / b for a, b in zip(rates[cond], rates["notify"], strict=True)]
        lo, hi = min(rates[cond]), max(rates[cond])
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"| {cond} | {median(rates[cond]):,.0f} | {lo:,.0f}-{hi:,.0f}"
            f" | {each} ({median(ratios):.2f}) |"
        )
    print("\nwait events of the producers' backends (share of samples, last round):")
    for cond in CONDITIONS:
        print(f"- {cond}: {waits[cond][-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
