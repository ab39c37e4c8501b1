"""Drain N no-op jobs with one in-process ``Worker`` and print its jobs/s.

``python bench/drain_once.py MODE N C``: MODE ``default``, or ``noprep`` (no server-side
prepared statements).  To compare two versions of skiplock, run it alternately with
``PYTHONPATH=<a checkout>/src`` pointing at each: it prints which one it imported.  The
DSN is $SKIPLOCK_BENCH_DSN or the local server; a schema of its own is dropped after.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

import skiplock
from skiplock import Job, Queue, Worker
from skiplock._base import QueueSettings


class Counting:
    """A no-op handler that sets ``done`` once it has run ``n`` jobs."""

    def __init__(self, n: int) -> None:
        self.n, self.count = n, 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self, job: Job) -> None:
        with self.lock:
            self.count += 1
            if self.count >= self.n:
                self.done.set()


def timed_drain(w: Worker, counting: Counting) -> float:
    """Seconds from starting ``w`` until its handler ``counting`` has run all its jobs;
    the worker is stopped after."""
    start = time.monotonic()
    thread = w.start()
    if not counting.done.wait(600):
        raise RuntimeError(f"{counting.count} of {counting.n} done in 600 s")
    secs = time.monotonic() - start
    w.stop()
    thread.join(30)
    return secs


def main() -> None:
    mode, n, c = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if mode == "noprep":
        plain = QueueSettings.connect_kwargs

        def no_prepare(self: QueueSettings) -> dict[str, Any]:
            return {**plain(self), "prepare_threshold": None}

        QueueSettings.connect_kwargs = no_prepare  # type: ignore[method-assign]
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"drain_{uuid.uuid4().hex[:8]}"
    q = Queue(dsn, schema=schema, max_size=4)
    q.migrate()
    q.enqueue_many([{}] * n)
    counting = Counting(n)
    secs = timed_drain(Worker(q, counting, concurrency=c), counting)
    where = skiplock.__file__.split("/src/")[0]
    print(f"{mode} N={n} C={c} {n / secs:,.0f} jobs/s (skiplock from {where})")
    q.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
