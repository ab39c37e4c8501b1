"""Workers of several chains (Worker and AsyncWorker): each job is claimed, held and
written by one chain, each chain's fused transaction completes its own batch and claims
for itself, the fence holds on every chain, and the worker's one heartbeat and one stop
cover them all."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, AsyncWorker, ConfigError, Job, Queue, Worker
from skiplock._aworker import _AChain
from skiplock._job import Attempt
from skiplock._queue import run_op
from skiplock._worker import _Chain

from .test_worker import counts, running, wait_until
from .test_worker_fused import _completions, _waiting_on
from .test_worker_logs import KINDS
from .test_worker_logs import running as either_worker


@contextmanager
def chained(
    kind: str, queue: Queue, handler: Callable[[Job], Any], **kw: Any
) -> Iterator[Worker | AsyncWorker]:
    """Either worker running ``handler``, a plain function that may block: the async
    worker runs it in a thread of its loop."""

    async def in_thread(job: Job) -> Any:
        return await asyncio.to_thread(handler, job)

    with either_worker(kind, queue, handler, in_thread, **kw) as w:
        yield w


def _holders(w: Worker | AsyncWorker) -> dict[int, int]:
    """Job id -> index of the chain holding it (read from the worker's own map)."""
    return {attempt[0]: chain.index for attempt, chain in list(w._chain_of.items())}


class TwoGated:
    """Two jobs, ``first`` then ``second``, whose handlers block until their gate opens
    (so with two chains of one handler each, the first chain holds ``first``)."""

    def __init__(self, queue: Queue) -> None:
        self.gates = {"first": threading.Event(), "second": threading.Event()}
        self.entered = {"first": threading.Event(), "second": threading.Event()}
        self.first = queue.enqueue({"which": "first"})
        self.second = queue.enqueue({"which": "second"})

    def handler(self, job: Job) -> None:
        which = job.payload["which"]
        self.entered[which].set()
        self.gates[which].wait(30)

    def both_running(self) -> bool:
        return self.entered["first"].wait(10) and self.entered["second"].wait(10)


class Routes:
    """Which chain took each attempt, and which chain's writer wrote it (the real
    methods run; the wrappers only look)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken: dict[Attempt, int] = {}
        self.written: list[tuple[Attempt, int]] = []
        self.fused_claims: dict[int, int] = {}  # chain -> jobs its writer claimed
        self.lock = threading.Lock()
        take, write, fused = Worker._take, Worker._write, Queue._complete_and_claim
        chain_of_queue: dict[int, int] = {}  # id of a chain's write Queue -> chain
        routes = self

        def _take(
            w: Worker, name: str, jobs: Sequence[Job], began: float, rtt: float, chain: _Chain
        ) -> None:
            with routes.lock:
                for job in jobs:
                    routes.taken[job.attempt] = chain.index
            take(w, name, jobs, began, rtt, chain)

        def _write(w: Worker, batch: Any, chain: _Chain, recheck: bool = False) -> None:
            with routes.lock:
                chain_of_queue[id(chain.wq)] = chain.index
                routes.written += [(job.attempt, chain.index) for job, _ in batch]
            write(w, batch, chain, recheck)

        def _complete_and_claim(q: Queue, items: Any, claim: Any, **kw: Any) -> Any:
            # What the fused transaction itself answered, on the Queue it ran on.
            res, claimed = fused(q, items, claim, **kw)
            with routes.lock:
                index = chain_of_queue.get(id(q))
                if index is not None and claimed:
                    routes.fused_claims[index] = routes.fused_claims.get(index, 0)
                    routes.fused_claims[index] += len(claimed)
            return res, claimed

        monkeypatch.setattr(Worker, "_take", _take)
        monkeypatch.setattr(Worker, "_write", _write)
        monkeypatch.setattr(Queue, "_complete_and_claim", _complete_and_claim)


def test_async_chains_write_the_jobs_they_claimed(
    queue: Queue, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: dict[Attempt, int] = {}
    written: list[tuple[Attempt, int]] = []
    take, write = AsyncWorker._take, AsyncWorker._write

    def _take(w: AsyncWorker, name: str, jobs: Sequence[Job], rtt: float, chain: _AChain) -> None:
        taken.update((job.attempt, chain.index) for job in jobs)
        take(w, name, jobs, rtt, chain)

    async def _write(w: AsyncWorker, batch: Any, chain: _AChain, recheck: bool = False) -> None:
        written.extend((job.attempt, chain.index) for job, _ in batch)
        await write(w, batch, chain, recheck)

    monkeypatch.setattr(AsyncWorker, "_take", _take)
    monkeypatch.setattr(AsyncWorker, "_write", _write)
    n = 3000
    queue.enqueue_many([{"n": i} for i in range(n)])

    async def noop(job: Job) -> None:
        return None

    with either_worker("async", queue, noop, noop, concurrency=8, lease=10) as w:
        assert w.chains == 2
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain", timeout=90)
    assert set(_completions(admin, queue.schema).values()) == {1}
    assert w.stats.completed == n and w.stats.lease_lost == 0
    assert set(taken.values()) == {0, 1} and len(written) == n
    assert all(taken[a] == c for a, c in written)
    assert all(chain.held == 0 for chain in w._chains)


def test_each_chain_writes_the_jobs_it_claimed_and_each_job_runs_once(
    queue: Queue, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = Routes(monkeypatch)
    seen: list[int] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            seen.append(job.payload["n"])

    n = 4000
    queue.enqueue_many([{"n": i} for i in range(n)])
    w = Worker(queue, handler, concurrency=8, lease=10, name="chains-drain")
    assert w.chains == 2  # the default from concurrency 4 with fused claims
    with running(w):
        wait_until(lambda: counts(queue).get("done", 0) == n, what="drain", timeout=90)
    assert sorted(seen) == list(range(n))
    assert set(_completions(admin, queue.schema).values()) == {1}
    assert w.stats.completed == n and w.stats.lease_lost == 0
    # Both chains claimed in their own fused transactions, and wrote what they took.
    assert set(routes.taken.values()) == {0, 1}
    assert all(routes.fused_claims.get(i, 0) > 0 for i in (0, 1)), routes.fused_claims
    # By attempt, not by call: a batch whose write failed (a lost reply) is written
    # again, rechecked, and that is not a second run.
    assert len({attempt for attempt, _ in routes.written}) == n
    wrong = [(a, c) for a, c in routes.written if routes.taken[a] != c]
    assert not wrong, f"{len(wrong)} job(s) written by a chain that did not claim them"
    assert all(chain.held == 0 for chain in w._chains)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_write_of_the_second_chain_changes_nothing(
    kind: str, queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """The second chain's job is taken over (lease expired, swept, claimed by another
    worker in a transaction still open); its writer's fenced completion waits on the
    row, then finds another token: LeaseLost, nothing changed.  The first chain's job,
    still running, is untouched and completes once."""
    two = TwoGated(queue)
    first, second, gates = two.first, two.second, two.gates
    name = "chains-fence"
    with (
        chained(
            kind,
            queue,
            two.handler,
            concurrency=2,
            chains=2,
            prefetch=0,
            lease=30,
            sweep_interval=3600,
            name=name,
        ) as w,
        psycopg.connect(dsn) as takeover,
    ):
        assert two.both_running()
        assert _holders(w) == {first: 0, second: 1}
        takeover.execute(
            sql.SQL("UPDATE {}.jobs SET locked_until = now() - interval '1s' WHERE id = %s").format(
                sql.Identifier(queue.schema)
            ),
            (second,),
        )
        assert len(run_op(takeover, queue._sweep_op(1000)(False))) == 1
        [theirs] = queue.claim(worker="new-owner", lease=300, conn=takeover)
        assert theirs.id == second
        gates["second"].set()
        wait_until(
            lambda: _waiting_on(admin, f"skiplock-worker:{name}", takeover.info.backend_pid),
            what="the second chain's write waiting on the takeover's row lock",
        )
        takeover.commit()
        wait_until(lambda: w.stats.lease_lost >= 1, what="lease lost")
        gates["first"].set()
        wait_until(lambda: counts(queue).get("done", 0) == 1, what="the first chain's job")
    got = queue.get(second)
    assert got is not None and got.status == "running" and got.worker == "new-owner"
    assert got.lease_token == theirs.lease_token
    done = _completions(admin, queue.schema)
    assert done == {first: 1, second: 0}
    assert w.stats.completed == 1 and w.stats.lease_lost == 1
    queue.complete(theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_one_heartbeat_keeps_every_chains_leases(
    kind: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Jobs of both chains outlive a short lease several times over: the worker's one
    heartbeat extends them all, and none is swept, lost or run twice."""
    ids = queue.enqueue_many([{"n": i} for i in range(4)])
    went: dict[int, int] = {}

    def handler(job: Job) -> None:
        threading.Event().wait(2.5)

    with chained(
        kind, queue, handler, concurrency=4, chains=2, prefetch=0, lease=0.9, sweep_interval=0.2
    ) as w:
        wait_until(lambda: len(w._chain_of) == 4, what="all four held")
        went = _holders(w)
        wait_until(lambda: counts(queue).get("done", 0) == 4, what="done", timeout=30)
    assert sorted(went) == sorted(ids) and set(went.values()) == {0, 1}
    assert set(_completions(admin, queue.schema).values()) == {1}
    attempts = admin.execute(
        sql.SQL("SELECT max(attempts) FROM {}.jobs").format(sql.Identifier(queue.schema))
    ).fetchone()
    assert attempts == (1,)
    assert w.stats.lease_lost == 0 and w.stats.sweeps_recovered == 0


@pytest.mark.parametrize("kind", KINDS)
def test_stop_releases_what_every_chain_prefetched(
    kind: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """A stop gives back the unstarted jobs of both chains, attempts and all, and
    lets the running ones finish: nothing stays running, nothing is charged."""
    started = threading.Semaphore(0)
    finish = threading.Event()  # set after the stop: nothing finishes before it

    def handler(job: Job) -> None:
        started.release()
        finish.wait(10)

    queue.enqueue_many([{"n": i} for i in range(200)])
    with chained(kind, queue, handler, concurrency=4, chains=2, prefetch=20, lease=10) as w:
        for _ in range(4):
            assert started.acquire(timeout=10)
        chains: Sequence[Any] = w._chains
        wait_until(lambda: all(c.held > c.share for c in chains), what="both chains prefetched")
        w.stop()
        finish.set()
    by_status = counts(queue)
    assert "running" not in by_status
    assert by_status.get("done", 0) == w.stats.completed
    assert by_status["done"] + by_status["pending"] == 200
    charged = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs WHERE status = 'pending' AND attempts > 0").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone()
    assert charged == (0,)
    # Each chain held its share and its half of the prefetch (2 + 10): what did not
    # run was given back, by both chains.
    assert w.stats.claimed == 24
    assert w.stats.released == w.stats.claimed - w.stats.completed


def test_how_many_chains(queue: Queue, dsn: str) -> None:
    def noop(job: Job) -> None: ...

    async def anoop(job: Job) -> None: ...

    assert AsyncWorker(queue, anoop, concurrency=8).chains == 2
    assert AsyncWorker(queue, anoop, concurrency=2).chains == 1
    with pytest.raises(ConfigError, match="chains must be 1 to concurrency"):
        AsyncWorker(queue, anoop, concurrency=2, chains=3)
    assert Worker(queue, noop).chains == 2
    assert Worker(queue, noop, concurrency=3).chains == 1
    assert Worker(queue, noop, concurrency=8, fuse_claims=False).chains == 1
    assert Worker(queue, noop, concurrency=8, chains=3).chains == 3
    # Shares of the handlers and of a fixed prefetch add up to the whole.
    w = Worker(queue, noop, concurrency=7, chains=3, prefetch=10)
    assert [c.share for c in w._chains] == [3, 2, 2]
    assert [c.fixed_prefetch for c in w._chains] == [4, 3, 3]
    assert w.capacity == 17
    for bad in (0, 5):
        with pytest.raises(ConfigError, match="chains must be 1 to concurrency"):
            Worker(queue, noop, concurrency=4, chains=bad)
    app = App(dsn, schema=queue.schema)

    @app.task()
    def noop_task() -> None: ...

    assert app.worker(chains=1).chains == 1


def test_the_cli_takes_chains(queue: Queue, dsn: str) -> None:
    cmd = [sys.executable, "-m", "skiplock.cli", "worker", "--dsn", dsn]
    cmd += ["--schema", queue.schema, "--no-migrate", "--handler", "json:dumps"]
    bad = subprocess.run([*cmd, "--chains", "9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "chains must be 1 to concurrency (4), not 9" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_a_heartbeat_that_crosses_another_chains_completion_loses_nothing(
    kind: str, queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """The heartbeat waits on a row lock held on the first chain's job; meanwhile the
    second chain completes its job, which the waiting beat then finds no longer
    running.  That is the worker's own completion, not a lost lease: nothing is
    reported lost, and both jobs complete once.  (The async worker reported it lost,
    and the chaos checker caught it: 27 writes reported lost had committed.)"""
    two = TwoGated(queue)
    first, second, gates = two.first, two.second, two.gates
    name = f"chains-beat-{kind}"
    kw: dict[str, Any] = {"concurrency": 2, "chains": 2, "prefetch": 0, "name": name}
    with (
        chained(kind, queue, two.handler, lease=30, heartbeat_interval=0.2, **kw) as w,
        psycopg.connect(dsn) as blocker,
    ):
        assert two.both_running()
        assert _holders(w) == {first: 0, second: 1}
        jobs = sql.Identifier(queue.schema, "jobs")
        blocker.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(jobs), (first,))
        wait_until(
            lambda: _waiting_on(admin, f"skiplock-worker:{name}", blocker.info.backend_pid),
            what="the heartbeat waiting on the first job's row",
        )
        beats = w.stats.heartbeats
        gates["second"].set()
        wait_until(lambda: w.stats.completed == 1, what="the second chain's completion")
        blocker.rollback()
        wait_until(lambda: w.stats.heartbeats > beats, what="the heartbeat's answer")
        gates["first"].set()
        wait_until(lambda: counts(queue).get("done", 0) == 2, what="both done")
    assert w.stats.lease_lost == 0
    assert _completions(admin, queue.schema) == {first: 1, second: 1}
