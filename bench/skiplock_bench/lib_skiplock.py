"""skiplock under the bench: its public API only (Queue, Worker), as a user would run it."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock import AsyncWorker, Job, Queue, Worker

from .procs import Channel, ChildResult, ChildSpec
from .tally import HEADER

NAME = "skiplock"
SCHEMA = "bench"
# The worker's own "completed" event fires once the fenced write has committed, so the
# bench process can stop the clock at the N-th persisted completion.
SELF_STOPPING = False
CHUNK = 100_000  # enqueue_many rows per COPY for very large loads


def available() -> bool:
    return True


def _queue(dsn: str, schema: str, name: str = "bench", size: int = 2) -> Queue:
    q = Queue(dsn, schema=schema, application_name=f"skiplock-{name}", max_size=size)
    with q.connection():  # the pool's first connection is not the enqueue's cost
        pass
    return q


def setup(dsn: str, schema: str = SCHEMA) -> None:
    """A fresh, migrated schema: the "fresh table" every drain starts from."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    with Queue(dsn, schema=schema, max_size=1) as q:
        q.migrate()


reset = setup


def count_jobs(dsn: str, schema: str, where: str) -> int:
    """Rows of the schema's ``jobs`` matching ``where``, a fixed SQL condition."""
    query = sql.SQL("SELECT count(*) FROM {}.jobs WHERE ").format(sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query + sql.SQL(where)).fetchone()
    return int(row[0]) if row else 0


def enqueue_bulk(dsn: str, n: int, schema: str = SCHEMA, first: int = 0) -> float:
    """Seconds to add n jobs through enqueue_many (one COPY per CHUNK rows)."""
    payloads = [{"n": first + i} for i in range(n)]
    with _queue(dsn, schema) as q:
        start = time.perf_counter()
        for lo in range(0, n, CHUNK):
            q.enqueue_many(payloads[lo : lo + CHUNK])
        return time.perf_counter() - start


def enqueue_single(dsn: str, m: int, schema: str = SCHEMA) -> float:
    """Seconds for m enqueue() calls, one after another from one client."""
    with _queue(dsn, schema) as q:
        start = time.perf_counter()
        for i in range(m):
            q.enqueue({"n": i})
        return time.perf_counter() - start


def db_state(dsn: str, n: int, schema: str = SCHEMA, since_id: int = 0) -> tuple[str, bool]:
    """Every job (of those after ``since_id``) done, none pending, running or failed?"""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT status, count(*) FROM {}.jobs WHERE id > %s GROUP BY 1 ORDER BY 1"
            ).format(sql.Identifier(schema)),
            (since_id,),
        ).fetchall()
    counts = {str(s): int(c) for s, c in rows}
    text = ", ".join(f"{s} {c}" for s, c in counts.items()) or "empty"
    return text, counts.get("done", 0) == n and sum(counts.values()) == n


def claim_latencies(dsn: str, schema: str, samples: int, batch: int = 10) -> list[float]:
    """Seconds per Queue.claim(limit=batch), one after another from one client."""
    out: list[float] = []
    with _queue(dsn, schema) as q:
        for _ in range(samples):
            start = time.perf_counter()
            q.claim(worker="bench-claim-probe", limit=batch, lease=600.0)
            out.append(time.perf_counter() - start)
    return out


# Options of a drain variant that choose how the bench runs it, not Worker arguments.
_BENCH_OPTIONS = ("cli", "async", "processes")


def _worker(spec: ChildSpec, on_event: Any) -> tuple[Queue, dict[str, Any]]:
    """The queue and the arguments every in-process worker of the bench gets, threaded
    or asyncio: the same lease, name and hook, and the variant's own options."""
    q = _queue(spec.dsn, spec.schema, spec.name, size=1)
    kwargs: dict[str, Any] = {
        "concurrency": spec.concurrency,
        "lease": 30.0,
        "name": spec.name,
        "on_event": on_event,
    }
    kwargs.update((k, v) for k, v in spec.options.items() if k not in _BENCH_OPTIONS)
    return q, kwargs


class _Tally:
    """What a drain child reports: each handler execution by job number (the
    exactly-once check), and each ``completed`` event (fired once the fenced write has
    committed) into the shared progress counter the bench's clock stops on.  The
    threaded and the asyncio worker are counted by the same code, so their rates
    compare."""

    def __init__(self, spec: ChildSpec, chan: Channel) -> None:
        self.seen: list[int] = []  # list.append is atomic: handler threads need no lock
        self._lock = threading.Lock()
        self._done = 0
        self._index = spec.index
        self._progress = chan.progress

    def ran(self, job: Job) -> None:
        self.seen.append(job.payload["n"])

    def on_event(self, event: str, job: Job) -> None:
        if event == "completed":
            with self._lock:
                self._done += 1
                self._progress[self._index] = self._done


def drain_child(spec: ChildSpec, chan: Channel) -> None:
    if spec.options.get("cli"):
        drain_cli_child(spec, chan)
        return
    if spec.options.get("async"):
        drain_async_child(spec, chan)
        return
    tally = _Tally(spec, chan)
    q, kwargs = _worker(spec, tally.on_event)
    worker = Worker(q, tally.ran, **kwargs)
    chan.ready[spec.index].set()
    chan.go.wait()
    thread = worker.start()
    chan.stop.wait()
    worker.stop()
    thread.join(timeout=60)
    q.close()
    chan.report(
        ChildResult(
            index=spec.index, pid=os.getpid(), seen=tally.seen, stats=worker.stats.snapshot()
        )
    )


def drain_async_child(spec: ChildSpec, chan: Channel) -> None:
    """The drain with ``AsyncWorker`` and an ``async def`` no-op handler, as
    ``drain_child`` runs ``Worker``: built before the clock, started on "go" (its event
    loop and its pool then open on the clock, as the threaded worker's threads and
    pool do), stopped when the bench has seen N completions.  The default asyncio loop,
    not uvloop: what ``asyncio.run`` gives a user who installs nothing else."""
    tally = _Tally(spec, chan)

    async def handler(job: Job) -> None:
        tally.ran(job)

    q, kwargs = _worker(spec, tally.on_event)
    worker = AsyncWorker(q, handler, **kwargs)
    chan.ready[spec.index].set()
    chan.go.wait()
    error = asyncio.run(_run_until_stopped(worker, chan))
    q.close()
    chan.report(
        ChildResult(
            index=spec.index,
            pid=os.getpid(),
            seen=tally.seen,
            stats=worker.stats.snapshot(),
            error=error,
        )
    )


async def _run_until_stopped(worker: AsyncWorker, chan: Channel) -> str | None:
    """Run the worker until the bench says stop; a worker that ends on its own (an
    error) ends the wait too, and its traceback is returned for the report."""
    run = asyncio.create_task(worker.run())
    stop = asyncio.create_task(asyncio.to_thread(chan.stop.wait))
    await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
    worker.stop()
    try:
        await run
    except Exception:
        return traceback.format_exc()
    finally:
        # The bench sets "stop" in any case (Fleet.finish); until then the thread waits.
        await stop
    return None


def cli_command(spec: ChildSpec) -> list[str]:
    """`skiplock worker` as a user deploys it: its defaults, only the essentials given."""
    return [
        sys.executable,
        "-m",
        "skiplock.cli",
        "worker",
        "--dsn",
        spec.dsn,
        "--schema",
        spec.schema,
        "--concurrency",
        str(spec.concurrency),
        "--name",
        spec.name,
        "--handler",
        "skiplock_bench.cli_handler:handler",
        *(["--processes", str(spec.options["processes"])] if "processes" in spec.options else []),
    ]


def drain_cli_child(spec: ChildSpec, chan: Channel) -> None:
    """The drain with `skiplock worker` in a process of its own, started on "go".

    Its start (interpreter, imports, connections, migrate check) falls inside the bench
    clock, so this configuration is compared on the database's clock only.  Progress
    comes from the handler's tally; once every job ran, the database is asked (a few
    times, a few ms apart) until no job is left unfinished: polling it during the
    drain would load the server the in-process configuration does not load.
    """
    fd, tally = tempfile.mkstemp(prefix="skiplock-bench-tally-")
    os.ftruncate(fd, HEADER + 4 * spec.n)
    mapped = mmap.mmap(fd, 0)
    os.close(fd)
    totals = memoryview(mapped)[8:HEADER].cast("q")  # one per handler process
    counts = memoryview(mapped)[HEADER:].cast("i")
    bench_dir = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "SKIPLOCK_BENCH_TALLY": tally,
        "PYTHONPATH": os.pathsep.join(p for p in (bench_dir, os.environ.get("PYTHONPATH")) if p),
    }
    unfinished = sql.SQL("SELECT count(*) FROM {}.jobs WHERE status <> 'done'").format(
        sql.Identifier(spec.schema)
    )
    error = None
    with tempfile.TemporaryFile("w+") as stderr, psycopg.connect(spec.dsn, autocommit=True) as db:
        chan.ready[spec.index].set()
        chan.go.wait()
        proc = subprocess.Popen(
            cli_command(spec), env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
        try:
            while not chan.stop.is_set() and proc.poll() is None:
                ran = sum(totals)
                if ran >= spec.n:
                    row = db.execute(unfinished).fetchone()
                    if row is not None and row[0] == 0:
                        chan.progress[spec.index] = spec.n
                        break
                    time.sleep(0.005)
                else:
                    # Coarse: the db clock does not depend on when the end is seen, and a
                    # busy poll would take CPU the in-process configuration keeps.
                    chan.progress[spec.index] = ran
                    time.sleep(0.02)
            chan.stop.wait()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            stderr.seek(0)
            error = f"skiplock worker exited {proc.returncode}:\n" + stderr.read()[-4000:]
    seen = [i for i, c in enumerate(counts) for _ in range(c)]
    del totals, counts
    mapped.close()
    os.unlink(tally)
    chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, error=error))


def pickup_child(spec: ChildSpec, chan: Channel) -> None:
    latencies: list[float] = []
    seen: list[int] = []

    def handler(job: Job) -> None:
        t = time.monotonic()
        latencies.append(t - job.payload["t0"])
        seen.append(job.payload["n"])
        chan.got.set()

    q, kwargs = _worker(spec, None)
    worker = Worker(q, handler, **kwargs)
    thread = worker.start()
    time.sleep(0.5)  # connected, listening and idle before the first job
    chan.ready[spec.index].set()
    chan.stop.wait()
    worker.stop()
    thread.join(timeout=60)
    q.close()
    chan.report(ChildResult(index=spec.index, pid=os.getpid(), seen=seen, latencies=latencies))


def pickup_producer(
    dsn: str, chan: Channel, samples: int, gap: tuple[float, float]
) -> tuple[int, list[float]]:
    """Enqueue one job at a time, each after the previous one started; returns timeouts
    and the seconds each enqueue call took: its commit is the floor of the pickup."""
    import random

    timeouts = 0
    floors: list[float] = []
    with _queue(dsn, SCHEMA) as q:
        for i in range(samples):
            chan.got.clear()
            t0 = time.monotonic()
            q.enqueue({"n": i, "t0": t0})
            floors.append(time.monotonic() - t0)
            if not chan.got.wait(10.0):
                timeouts += 1
            time.sleep(random.uniform(*gap))
    return timeouts, floors
