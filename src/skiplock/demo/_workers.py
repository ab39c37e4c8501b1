"""The email worker processes: skiplock's Worker, or the postmortem's original poll loop.

Each worker is its own process (spawned, so a SIGKILL takes down exactly one of them,
with its connections and its leases unreleased, as a crashed pod would).  With the
``skip-locked`` strategy a worker is skiplock's :class:`~skiplock.Worker`: claims,
heartbeats, fenced completions, the sweeper.  With any other strategy it is the
postmortem's own system: poll on a fixed tick, claim a batch with that strategy's
statements, send each email, mark the batch done.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import errors as pgerrors

from skiplock import Job, Queue, Worker
from skiplock.lab import ClaimContext, Strategy, get_strategy, lab_statement, run_steps

from ._invoices import QUEUE, InvoiceMailer

__all__ = ["Signals", "WorkerSpec", "worker_main"]


class _Barrier(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...

    def abort(self) -> None: ...


class _Value(Protocol):
    value: float


class _Int(Protocol):
    value: int


class _Counter(_Int, Protocol):
    def get_lock(self) -> AbstractContextManager[Any]: ...


class _Flags(Protocol):
    def __getitem__(self, index: int) -> int: ...

    def __setitem__(self, index: int, value: int) -> None: ...


@dataclass(frozen=True)
class Signals:
    """The shared memory the coordinator and its workers talk through.

    ``ready``: every worker has connected (the coordinator is the last party); used only
    before the start, when no worker has been killed yet.  ``epoch``: 0 until the
    coordinator fixes the moment (``time.monotonic``, which is system-wide) at which
    every worker starts, so that all replicas begin at once; negative means "do not
    start".  ``stop``: finish the work in hand and exit.  ``first_claimed[i]``: the
    statements of worker ``i``'s first claim have returned (its partner stops waiting
    for it then).  ``sent``: jobs whose handler has returned, across all workers.
    ``park_at``: 0, or the value of ``sent`` at which that job's handler parks instead of
    returning (``--kill-worker``).  ``parked``: 0 until then, then the parked worker's
    index plus one.

    After the start everything is a lock-free flag, polled: a worker SIGKILLed while
    waiting on a multiprocessing Event or Condition leaves it unusable (``set()`` then
    waits forever for the dead sleeper to acknowledge), and killing workers is the point.
    The one lock, ``sent``'s, is safe: the only worker killed is the parked one, and it
    parks after releasing it.
    """

    ready: _Barrier
    epoch: _Value
    stop: _Value
    first_claimed: _Flags
    sent: _Counter
    park_at: _Int
    parked: _Int


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs; picklable for the spawn start method."""

    index: int
    name: str
    dsn: str
    schema: str
    provider_url: str
    strategy: str
    idempotency: bool
    lease: float
    concurrency: int
    batch: int
    tick: float
    first_offset: float
    partner: int | None
    sweep_interval: float
    collide_wait: float
    application_name: str
    start_timeout: float


def worker_main(spec: WorkerSpec, signals: Signals) -> None:
    """Process entry point: set up, wait for the common start, work until told to stop."""
    # Ctrl-C reaches the whole process group; the coordinator decides how workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        db = Queue(
            spec.dsn,
            schema=spec.schema,
            application_name=f"{spec.application_name}:handler",
            min_size=1,
            max_size=spec.concurrency if spec.strategy == "skip-locked" else 2,
        )
    except BaseException:
        signals.ready.abort()
        raise
    try:
        mailer = _ParkOnce(
            InvoiceMailer(db, spec.provider_url, spec.name, idempotency=spec.idempotency),
            spec.index,
            signals,
        )
        if spec.strategy == "skip-locked":
            _run_worker(spec, signals, db, mailer)
        else:
            _run_poll_loop(spec, signals, db, mailer, get_strategy(spec.strategy))
    except _Abandoned:
        pass
    finally:
        db.close()


class _Abandoned(Exception):
    """The coordinator gave up before the start."""


class _ParkOnce:
    """The handler, except that the one job whose send makes ``sent`` reach ``park_at``
    never returns: its email has gone out and its audit row is written, but the job is
    not completed, until the coordinator SIGKILLs this worker.

    This is how ``--kill-worker`` kills a worker *mid-job* on every run: choosing a
    victim by what it holds at some instant can pick one that holds nothing (a fast
    machine drains a small backlog between two looks), and then there is nothing to
    recover.  Its other handler threads go on working until the kill, its heartbeats go
    on renewing the parked job's lease; only the SIGKILL stops both.
    """

    def __init__(self, handler: Callable[[Job], None], index: int, signals: Signals) -> None:
        self.handler = handler
        self.index = index
        self.signals = signals

    def __call__(self, job: Job) -> None:
        self.handler(job)
        signals = self.signals
        with signals.sent.get_lock():
            signals.sent.value += 1
            park = signals.sent.value == signals.park_at.value
        if park:
            signals.parked.value = self.index + 1
            while not _stopped(signals):  # SIGKILLed long before this
                time.sleep(0.05)


def _stopped(signals: Signals) -> bool:
    return bool(signals.stop.value)


def _sleep_until(signals: Signals, when: float) -> bool:
    """Sleep until ``when`` (monotonic) in short slices; False if told to stop meanwhile."""
    while not _stopped(signals):
        left = when - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.01))
    return False


def _wait_for_start(spec: WorkerSpec, signals: Signals) -> float:
    """Join the start barrier, then sleep until the common epoch; returns the epoch."""
    signals.ready.wait(spec.start_timeout)
    deadline = time.monotonic() + spec.start_timeout
    while signals.epoch.value == 0:
        if time.monotonic() > deadline:
            raise _Abandoned
        time.sleep(0.001)  # the coordinator sets the epoch right after the barrier
    t0 = float(signals.epoch.value)
    if t0 < 0 or not _sleep_until(signals, t0):  # the agreed start, not a guess at one
        raise _Abandoned
    return t0


# -- skiplock's Worker -------------------------------------------------------------------


def _run_worker(
    spec: WorkerSpec, signals: Signals, db: Queue, mailer: Callable[[Job], None]
) -> None:
    # The Worker opens its own connections from these settings; no pool of its own.
    settings = Queue(spec.dsn, schema=spec.schema, open=False)
    worker = Worker(
        settings,
        mailer,
        queues=[QUEUE],
        concurrency=spec.concurrency,
        prefetch=0,
        lease=spec.lease,
        name=spec.name,
        poll_interval=0.25,
        sweep_interval=spec.sweep_interval,
        shutdown_grace=10.0,
    )
    try:
        _wait_for_start(spec, signals)
    except BaseException:
        signals.ready.abort()
        raise

    def stop_when_told() -> None:
        while not _stopped(signals):
            time.sleep(0.05)
        worker.stop()

    threading.Thread(target=stop_when_told, name="demo-stop", daemon=True).start()
    worker.run()


# -- the postmortem's poll loop ----------------------------------------------------------

# Is anyone waiting on a lock this transaction holds?  pg_locks is read afresh on every
# call (pg_stat_activity would be a snapshot frozen for the transaction).
_SOMEONE_WAITS_ON_US = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE NOT granted AND pg_backend_pid() = ANY(pg_blocking_pids(pid))
)
"""


def _run_poll_loop(
    spec: WorkerSpec,
    signals: Signals,
    db: Queue,
    mailer: Callable[[Job], None],
    strategy: Strategy,
) -> None:
    ctx = ClaimContext(worker=spec.name, limit=spec.batch, queue=QUEUE, lease=spec.lease)
    complete = lab_statement("complete", spec.schema)
    partner = spec.partner

    def partner_claimed() -> bool:
        return partner is None or bool(signals.first_claimed[partner])

    def first_poll(conn: psycopg.Connection[Any], ids: list[int]) -> None:
        # Set before waiting: two claims that do not block each other (SKIP LOCKED,
        # advisory locks) would otherwise wait for one another until the timeout.
        signals.first_claimed[spec.index] = 1
        if ids and partner is not None:
            _await_company(conn, done=partner_claimed, timeout=spec.collide_wait)

    def work(ids: list[int]) -> list[int]:
        done = []
        for job_id in ids:
            job = db.get(job_id)
            if job is None:
                continue
            try:
                mailer(job)
            except Exception as exc:
                # Left running: its lease runs out and the sweep gives it back.
                print(f"{spec.name}: job {job_id}: {exc}", file=sys.stderr)
                continue
            done.append(job_id)
        return done

    with psycopg.connect(
        spec.dsn, autocommit=True, application_name=f"{spec.application_name}:claim"
    ) as conn:
        try:
            t0 = _wait_for_start(spec, signals)
        except BaseException:
            signals.ready.abort()
            raise
        # After the first poll each worker keeps a phase of its own on the tick grid, as
        # replicas started at different moments do: later collisions are left to chance.
        phase = random.uniform(0.0, spec.tick)
        next_claim = t0 + spec.first_offset
        next_sweep = t0 + spec.sweep_interval
        first = True
        while _sleep_until(signals, next_claim):
            if time.monotonic() >= next_sweep:
                # The postmortem's fix added a lease and a sweeper; without one, a killed
                # worker's jobs would stay running forever.
                db.sweep()
                next_sweep = time.monotonic() + spec.sweep_interval
            # The first poll is the one the postmortem's replicas shared: the two workers
            # of a pair claim at the same instant, and the claim that wins keeps its
            # transaction open until its partner's claim is seen waiting on its rows (or
            # has returned without waiting: a claim that skips locked rows never waits),
            # then commits.  The interleaving the postmortem forced with two psql
            # windows, certain instead of lucky.
            ids, done = _claim(
                conn, strategy, spec.schema, ctx, first_poll if first else None, work
            )
            first = False
            if ids and not strategy.holds_lock:
                done = work(ids)
                if done:
                    conn.execute(complete, {"ids": done})
            # The postmortem's workers polled "every second": the next claim is at this
            # worker's next tick, not as soon as the batch is done.
            k = math.ceil((time.monotonic() - t0 - phase) / spec.tick)
            next_claim = t0 + phase + k * spec.tick


def _claim(
    conn: psycopg.Connection[Any],
    strategy: Strategy,
    schema: str,
    ctx: ClaimContext,
    hold: Callable[[psycopg.Connection[Any], list[int]], None] | None,
    work: Callable[[list[int]], list[int]],
) -> tuple[list[int], list[int]]:
    """One committed claim transaction of ``strategy``: (claimed ids, ids worked in it).

    Like the lab's ``claim_transaction``, with one addition: ``hold(conn, ids)`` runs
    after its statements, before the commit.  Only a hold-lock strategy works inside
    the transaction (and finishes what it worked); for the others the caller works
    after the commit, outside any transaction, and the second list is empty.
    """
    deadlocks = 0
    while True:
        done: list[int] = []
        try:
            conn.isolation_level = strategy.isolation
            with conn.transaction():
                ids = run_steps(conn, strategy.steps, schema, ctx)
                if hold is not None:
                    hold(conn, ids)
                if ids and strategy.holds_lock:
                    done = work(ids)
                    if done:
                        run_steps(conn, strategy.finish, schema, ctx, done)
            return ids, done
        except pgerrors.SerializationFailure:
            if not strategy.retry_serialization:
                raise
        except pgerrors.DeadlockDetected:
            # Naive claims update overlapping rows in different orders; the server broke
            # the cycle by aborting us, and a real worker would simply claim again.
            deadlocks += 1
            if deadlocks > 100:
                raise
        finally:
            conn.isolation_level = None


def _await_company(
    conn: psycopg.Connection[Any], *, done: Callable[[], bool], timeout: float
) -> None:
    """Return once a session waits on this transaction's locks, or ``done()`` is true.

    ``timeout`` only bounds a partner that never turns up (one that died, say).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done():
        row = conn.execute(_SOMEONE_WAITS_ON_US).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(0.0005)  # the interval between checks, not a stand-in for one
