"""fuse_claims, for Worker and AsyncWorker alike: completions and the next claim in one
transaction keep the exactly-once and fencing properties of the two statements run
apart, and a batch with its claim commits once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, AsyncQueue, Job, Queue
from skiplock._queue import run_op
from skiplock._workerbase import WorkerBase

from .test_worker import counts, wait_until
from .test_worker_logs import KINDS
from .test_worker_logs import running as either_worker

HERE = Path(__file__).parent


@contextmanager
def fused(kind: str, queue: Queue, handler: Callable[[Job], Any], **kw: Any) -> Iterator[Any]:
    """A worker of ``kind`` with ``fuse_claims=True`` running ``handler``, a plain function
    that may block: the async worker runs it in a thread of its loop."""

    async def in_thread(job: Job) -> Any:
        return await asyncio.to_thread(handler, job)

    if kind == "async":
        kw.pop("prefetch", None)  # the async worker has none
    with either_worker(kind, queue, handler, in_thread, fuse_claims=True, **kw) as w:
        yield w


@dataclass
class Writes:
    """What the workers' writers sent: per worker name, each fused batch as (completed
    ids, claimed ids), and each batch of completions sent without a claim."""

    fused: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    alone: list[tuple[str, list[int]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, q: Any, items: Any, claimed: list[Job] | None) -> None:
        app = str(q.settings.application_name or "")
        if not app.startswith("skiplock-worker:"):
            return  # the test's own writes
        name = app.removeprefix("skiplock-worker:")
        ids = [(it if isinstance(it, Job) else it[0]).id for it in items]
        with self.lock:
            if claimed is None:
                self.alone.append((name, ids))
            else:
                self.fused.append((name, ids, [j.id for j in claimed]))


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Writes:
    """Records the real writes of both drivers as they pass (nothing is replaced)."""
    seen = Writes()
    sync_fused, sync_alone = Queue._complete_and_claim, Queue.complete_many
    async_fused, async_alone = AsyncQueue._complete_and_claim, AsyncQueue.complete_many

    def fused_sync(self: Queue, items: Any, claim: Any, **kw: Any) -> Any:
        res, claimed = sync_fused(self, items, claim, **kw)
        seen.add(self, items, claimed)
        return res, claimed

    def alone_sync(self: Queue, items: Any, **kw: Any) -> Any:
        res = sync_alone(self, items, **kw)
        seen.add(self, items, None)
        return res

    async def fused_async(self: AsyncQueue, items: Any, claim: Any, **kw: Any) -> Any:
        res, claimed = await async_fused(self, items, claim, **kw)
        seen.add(self, items, claimed)
        return res, claimed

    async def alone_async(self: AsyncQueue, items: Any, **kw: Any) -> Any:
        res = await async_alone(self, items, **kw)
        seen.add(self, items, None)
        return res

    monkeypatch.setattr(Queue, "_complete_and_claim", fused_sync)
    monkeypatch.setattr(Queue, "complete_many", alone_sync)
    monkeypatch.setattr(AsyncQueue, "_complete_and_claim", fused_async)
    monkeypatch.setattr(AsyncQueue, "complete_many", alone_async)
    return seen


def _completions(admin: psycopg.Connection[Any], schema: str) -> dict[int, int]:
    rows = admin.execute(
        sql.SQL("SELECT id, completions FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


def _stamps(
    admin: psycopg.Connection[Any], schema: str
) -> tuple[dict[int, datetime], dict[int, datetime]]:
    """Each job's started_at (its claim's now()) and finished_at (its completion's):
    now() is the transaction's start, so two statements of one transaction share a
    stamp.  Two transactions on two connections may share one too (one microsecond;
    a Worker runs two chains), so counting transactions takes ``_writers``."""
    rows = admin.execute(
        sql.SQL("SELECT id, started_at, finished_at FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchall()
    return {int(r[0]): r[1] for r in rows}, {int(r[0]): r[2] for r in rows if r[2] is not None}


def _writers(admin: psycopg.Connection[Any], schema: str) -> dict[int, int]:
    """The transaction that last wrote each finished job (its row's xmin): the one that
    completed it, as nothing here moves a finished row (no rotation in 1,000 jobs)."""
    rows = admin.execute(
        sql.SQL("SELECT id, xmin::text FROM {}.jobs WHERE finished_at IS NOT NULL").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    return {int(r[0]): int(r[1]) for r in rows}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.connections(36)
def test_concurrent_fused_workers_run_and_complete_each_job_once(
    kind: str, queue: Queue, admin: psycopg.Connection[Any], writes: Writes
) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            seen.append(job.payload["n"])

    n = 3000
    queue.enqueue_many([{"n": i} for i in range(n)])
    with ExitStack() as stack:
        workers: list[WorkerBase] = [
            stack.enter_context(
                fused(kind, queue, handler, concurrency=8, lease=10, name=f"fused-{kind}-{i}")
            )
            for i in range(3)
        ]
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain", timeout=90)
    assert sorted(seen) == list(range(n))
    assert sum(w.stats.completed for w in workers) == n
    assert [w.stats.lease_lost for w in workers] == [0, 0, 0]
    assert set(_completions(admin, queue.schema).values()) == {1}
    for w in workers:
        took = sum(len(claimed) for name, _, claimed in writes.fused if name == w.name)
        assert took > 0, f"{w.name}: no claim rode a completion"


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_and_the_claim_it_carries_commit_once(
    kind: str, queue: Queue, admin: psycopg.Connection[Any], writes: Writes
) -> None:
    n = 1000
    queue.enqueue_many([{"n": i} for i in range(n)])
    with fused(kind, queue, lambda job: None, concurrency=8, lease=10, name=f"once-{kind}"):
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain", timeout=60)
    started, finished = _stamps(admin, queue.schema)
    assert len(finished) == n
    carried = [(done, claimed) for _, done, claimed in writes.fused if claimed]
    assert carried, "no claim rode a completion"
    for done, claimed in carried:
        stamps = {finished[i] for i in done} | {started[i] for i in claimed}
        assert len(stamps) == 1, f"batch {done[:3]}... and its claim are {len(stamps)} commits"
    # Every job was completed by a recorded batch, and each batch was one transaction:
    # as many completion transactions as batches sent.
    batches = [done for _, done, _ in writes.fused] + [done for _, done in writes.alone]
    assert sorted(i for done in batches for i in done) == sorted(finished)
    writer = _writers(admin, queue.schema)
    assert all(len({writer[i] for i in done}) == 1 for done in batches)
    assert len(set(writer.values())) == len(batches)


def _waiting_on(admin: psycopg.Connection[Any], app: str, holder: int) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = %s AND %s = ANY(pg_blocking_pids(pid))",
        (app, holder),
    ).fetchone()
    return row is not None and int(row[0]) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_fused_completion_changes_nothing_and_its_claim_still_counts(
    kind: str, queue: Queue, admin: psycopg.Connection[Any], dsn: str, writes: Writes
) -> None:
    """The takeover (sweep and re-claim, in one open transaction) holds the slow job's
    row while the worker's fused transaction tries to complete it with the old token:
    the completion waits on the row, re-reads it after the takeover commits, finds
    another token and changes nothing; the claim in the same transaction goes on."""
    gate = threading.Event()
    entered = threading.Event()
    events: list[tuple[str, int]] = []

    def handler(job: Job) -> None:
        if job.payload.get("slow"):
            entered.set()
            gate.wait(30)

    slow_id = queue.enqueue({"slow": True})
    name = f"fence-{kind}"
    # No listener and a long poll: after its first claim, the claim loop sleeps, so
    # jobs enqueued below can only be taken by the fused claim of the slow job's write.
    with (
        fused(
            kind,
            queue,
            handler,
            concurrency=2,
            lease=30,
            sweep_interval=3600,
            listen=False,
            poll_interval=60,
            prefetch=0,
            name=name,
            on_event=lambda event, job: events.append((event, job.id)),
        ) as w,
        psycopg.connect(dsn) as takeover,
    ):
        assert entered.wait(10)
        takeover.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (slow_id,),
        )
        assert len(run_op(takeover, queue._sweep_op(1000)(False))) == 1
        [theirs] = queue.claim(worker="new-owner", lease=300, conn=takeover)
        assert theirs.id == slow_id
        others = queue.enqueue_many([{"n": i} for i in range(3)])
        gate.set()
        wait_until(
            lambda: _waiting_on(admin, f"skiplock-worker:{name}", takeover.info.backend_pid),
            what="the fused transaction waiting on the takeover's row lock",
        )
        # One transaction: the claim behind the waiting completion has not run either.
        assert counts(queue).get("pending", 0) == 3
        takeover.commit()
        wait_until(lambda: w.stats.lease_lost >= 1, what="lease lost")
        wait_until(lambda: counts(queue).get("done", 0) == 3, what="fused claims", timeout=20)
    assert ("lease_lost", slow_id) in events and ("completed", slow_id) not in events
    # The stale write changed nothing: the new owner's token and lease stand.
    got = queue.get(slow_id)
    assert got is not None and got.status == "running" and got.worker == "new-owner"
    assert got.lease_token == theirs.lease_token
    assert _completions(admin, queue.schema)[slow_id] == 0
    # The stale batch carried a claim, and every other job was claimed by such a claim.
    first = writes.fused[0]
    assert first[:2] == (name, [slow_id]) and first[2] and set(first[2]) <= set(others)
    assert sorted(i for _, _, claimed in writes.fused for i in claimed) == sorted(others)
    queue.complete(theirs)
    assert set(_completions(admin, queue.schema).values()) == {1}


@pytest.mark.parametrize(
    ("args", "flag"), [([], True), (["--fuse-claims"], True), (["--no-fuse-claims"], False)]
)
def test_the_cli_flag_reaches_the_worker(
    args: list[str], flag: bool, queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """``skiplock worker`` (``--fuse-claims`` by default): completions and claims share
    transactions (a job's start stamp is another's finish stamp); with
    ``--no-fuse-claims``, never."""
    n = 300
    queue.enqueue_many([{"n": i} for i in range(n)])
    env = {
        **os.environ,
        "SKIPLOCK_DSN": dsn,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "skiplock.cli", "worker", "--schema", queue.schema]
    cmd += ["--handler", "control_handlers:noop", "--concurrency", "4", "--no-migrate"]
    cmd += ["--name", f"cli-{flag}", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    drained = True
    try:
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain", timeout=60)
    except AssertionError:
        drained = False
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    # The worker's own log says why, if it did not drain.
    assert drained, f"{counts(queue)} after 60 s; the worker said:\n{err.decode()[-4000:]}"
    assert proc.returncode == 0, err.decode()
    started, finished = _stamps(admin, queue.schema)
    shared = set(started.values()) & set(finished.values())
    assert bool(shared) == flag


def test_the_apps_workers_take_the_option(dsn: str) -> None:
    app = App(dsn, schema="skiplock_fused_unused")

    @app.task()
    async def noop() -> None: ...

    # On by default, as in Worker and AsyncWorker; off when asked.
    assert app.worker().fuse_claims and app.async_worker().fuse_claims
    assert not app.worker(fuse_claims=False).fuse_claims
    assert not app.async_worker(fuse_claims=False).fuse_claims
