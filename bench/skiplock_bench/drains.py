"""``python -m skiplock_bench drains``: drains of one process in several shapes, alternated.

``python -m skiplock_bench drains N ROUNDS SHAPE[,SHAPE...]``: every round drains N
no-op jobs once per shape, the order reversed every other round, each on a schema of
its own (dropped after), and checks every job ran exactly once.  What bounds one
process (docs/decisions/0012-two-chains-per-worker.md):

- ``one8``: one ``Worker`` of concurrency 8 (the reference: put it first);
- ``two4`` / ``two8``: two ``Worker``s of 4 / of 8 on one ``Queue``, one interpreter:
  two claim-and-write chains in one process;
- ``async-one8`` / ``async-two4``: the same with ``AsyncWorker``s on one event loop;
- ``nofin`` / ``nofin-norun``: one ``Worker`` of 8 with ``jobs_finished_idx`` (and
  ``jobs_running_leases_idx``) dropped after the migration: what the index entries cost;
- ``share=X``: one ``Worker`` of 8 whose ``UPKEEP_SHARE`` is X (shipped: 0.25);
- ``chains=K`` / ``async-chains=K``: one ``Worker`` / ``AsyncWorker`` of 8 running K
  claim-and-write chains (``one8`` / ``async-one8`` run the default, 2 since
  December 2026);
- ``composed-SHAPE``: SHAPE with psycopg rendering each named statement on every
  execute, as before the statements kept their bytes (``skiplock._sql._Rendered``).

Each drain also prints the process's CPU time per job and its CPU over wall time (1.0:
one core busy all along): a chain that waits for the server leaves the process idle.

The DSN is $SKIPLOCK_BENCH_DSN or the local server.  ``versions`` runs this module
under two checkouts of skiplock.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import sys
import threading
import time
import uuid

import psycopg
from psycopg import sql

from skiplock import AsyncWorker, Job, Queue, Worker

from .common import DEFAULT_DSN

DSN = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
THREADED = {"one8": (1, 8), "two4": (2, 4), "two8": (2, 8)}
ASYNC = {"async-one8": (1, 8), "async-two4": (2, 4)}
DROPS = {
    "nofin": ["jobs_finished_idx"],
    "nofin-norun": ["jobs_finished_idx", "jobs_running_leases_idx"],
}


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


def threaded(
    q: Queue, n: int, k: int, c: int, share: float | None = None, chains: int | None = None
) -> float:
    """Seconds for ``k`` Workers of concurrency ``c`` to run ``n`` jobs together."""
    counting = Counting(n)
    workers = [
        Worker(q, counting, concurrency=c, name=f"chain-{i}", chains=chains) for i in range(k)
    ]
    for w in workers:
        if share is not None:
            w.UPKEEP_SHARE = share
    start = time.monotonic()
    threads = [w.start() for w in workers]
    if not counting.done.wait(600):
        raise RuntimeError(f"{counting.count} of {n} done in 600 s")
    secs = time.monotonic() - start
    for w in workers:
        w.stop()
    for t in threads:
        t.join(30)
    return secs


async def on_one_loop(q: Queue, n: int, k: int, c: int, chains: int | None = None) -> float:
    """Seconds for ``k`` AsyncWorkers of concurrency ``c`` on this loop to run ``n`` jobs."""
    done, count = asyncio.Event(), [0]

    async def handler(job: Job) -> None:
        count[0] += 1
        if count[0] >= n:
            done.set()

    workers = [
        AsyncWorker(q, handler, concurrency=c, name=f"chain-{i}", chains=chains) for i in range(k)
    ]
    start = time.monotonic()
    tasks = [asyncio.create_task(w.run()) for w in workers]
    await asyncio.wait_for(done.wait(), 600)
    secs = time.monotonic() - start
    for w in workers:
        w.stop()
    await asyncio.gather(*tasks)
    return secs


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def drain(shape: str, n: int) -> tuple[float, float]:
    """Jobs/s of one drain of ``n`` no-op jobs in ``shape``, and the process's CPU
    seconds over the drain's."""
    if shape.startswith("composed-"):
        # Imported here: ``versions`` runs the other shapes on checkouts without it.
        from skiplock._sql import _Rendered

        kept = _Rendered.as_bytes
        _Rendered.as_bytes = sql.Composed.as_bytes  # type: ignore[method-assign]
        try:
            return drain(shape.removeprefix("composed-"), n)
        finally:
            _Rendered.as_bytes = kept  # type: ignore[method-assign]
    schema = f"chains_{uuid.uuid4().hex[:8]}"
    q = Queue(DSN, schema=schema, max_size=6)
    q.migrate()
    try:
        with psycopg.connect(DSN, autocommit=True) as conn:
            for index in DROPS.get(shape, []):
                conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(schema, index)))
        q.enqueue_many([{}] * n)
        cpu = _cpu()
        if shape in ASYNC:
            secs = asyncio.run(on_one_loop(q, n, *ASYNC[shape]))
        elif shape.startswith("share="):
            secs = threaded(q, n, 1, 8, share=float(shape.removeprefix("share=")))
        elif shape.startswith("async-chains="):
            chains = int(shape.removeprefix("async-chains="))
            secs = asyncio.run(on_one_loop(q, n, 1, 8, chains))
        elif shape.startswith("chains="):
            secs = threaded(q, n, 1, 8, chains=int(shape.removeprefix("chains=")))
        else:
            secs = threaded(q, n, *THREADED.get(shape, (1, 8)))
        cpu = _cpu() - cpu
        with psycopg.connect(DSN, autocommit=True) as conn:
            # Every job done once: a job run twice would reach N handler calls early.
            done, twice = conn.execute(
                sql.SQL(
                    "SELECT count(*) FILTER (WHERE status = 'done'), "
                    "count(*) FILTER (WHERE attempts > 1 OR completions > 1) FROM {}.jobs"
                ).format(sql.Identifier(schema))
            ).fetchone() or (0, 0)
        if done != n or twice:
            raise RuntimeError(f"{shape}: {done} of {n} done, {twice} run more than once")
    finally:
        q.close()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return n / secs, cpu / secs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit(__doc__)
    n, rounds, shapes = int(args[0]), int(args[1]), args[2].split(",")
    known = {*THREADED, *ASYNC, *DROPS}
    for shape in shapes:
        base = shape.removeprefix("composed-")
        if base not in known and not base.startswith(("share=", "chains=", "async-chains=")):
            raise SystemExit(
                f"unknown shape {shape!r}: one of {sorted(known)}, share=X, "
                "chains=K or async-chains=K, each also as composed-SHAPE"
            )
    rates: dict[str, list[float]] = {s: [] for s in shapes}
    for r in range(rounds):
        for shape in shapes if r % 2 == 0 else shapes[::-1]:
            rate, busy = drain(shape, n)
            rates[shape].append(rate)
            print(
                f"round {r + 1} {shape}: {rate:,.0f} jobs/s, "
                f"process CPU {busy / rate * 1e6:.1f} us a job, CPU / wall {busy:.2f}",
                flush=True,
            )
    first = statistics.median(rates[shapes[0]])
    for shape in shapes:
        med = statistics.median(rates[shape])
        per_round = ", ".join(
            f"{a / b:.2f}" for a, b in zip(rates[shape], rates[shapes[0]], strict=True)
        )
        ratio = f"{med / first:.2f} x {shapes[0]}"
        print(f"{shape}: median {med:,.0f} jobs/s, {ratio} (per round {per_round})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
