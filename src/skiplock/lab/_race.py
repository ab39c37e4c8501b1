"""The race: W workers drain N seeded jobs with one claim strategy, and the claims are counted.

Each worker owns one connection (a thread, or a process with ``processes=True``) and
loops: claim a batch, "work" (sleep ``work_ms`` per job), complete, until no job is
pending.  Every id a claim returned is recorded, so double claims are counted exactly,
not inferred.  A separate connection samples ``pg_stat_activity`` for the workers'
sessions (by application_name) to measure how much of their time goes to lock waits.

``race_prepared`` runs the same workers on a table the caller created and seeded (a
user's own queue table, for ``skiplock audit``): the caller says how to claim and how a
worker tells that nothing is left, and the lab neither seeds, completes nor drops.
"""

from __future__ import annotations

import math
import multiprocessing
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import psycopg

from skiplock import SkiplockError

from ._strategies import (
    QUEUE,
    ClaimContext,
    Strategy,
    claim_transaction,
    drop_scratch,
    get_strategy,
    lab_statement,
    seed_scratch,
)

__all__ = ["Drain", "RaceError", "RaceResult", "race_prepared", "race_strategy", "run_race"]


class RaceError(SkiplockError):
    """A race could not run to the end (a worker failed or the run timed out)."""


class _Barrier(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs; picklable, so a spawned process can take it."""

    index: int
    dsn: str
    schema: str
    strategy: str
    batch: int
    poll_ms: float
    work_ms: float
    application_name: str
    timeout: float


def _always(_ids: list[int]) -> bool:
    return True


@dataclass(frozen=True)
class Drain:
    """How a worker claims from a table the lab did not seed, and when it stops.

    ``pending(conn)`` is asked after every claim that came back empty: True means rows
    remain (locked by others, say) and the worker claims again.  ``claimed(ids)`` is told
    every non-empty claim: False stops the worker (a claim that keeps handing back the
    same rows never comes back empty).  Nothing is completed: the claim itself must move
    rows out of reach.  Threads only (not picklable).
    """

    strategy: Strategy
    pending: Callable[[psycopg.Connection[Any]], bool]
    claimed: Callable[[list[int]], bool] = _always


@dataclass
class WorkerReport:
    """What one worker saw: every id its claims returned, and what the claims cost."""

    index: int
    ids: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    retries: int = 0
    deadlocks: int = 0
    empty_claims: int = 0
    started: float = 0.0
    finished: float = 0.0
    timed_out: bool = False
    error: str | None = None


def _work(work_ms: float) -> Callable[[list[int]], None]:
    per_job = work_ms / 1000.0

    def work(ids: list[int]) -> None:
        if per_job > 0:
            time.sleep(per_job * len(ids))  # the simulated job itself, not synchronisation

    return work


def run_worker(spec: WorkerSpec, start: _Barrier, drain: Drain | None = None) -> WorkerReport:
    """Drain the scratch queue with ``spec.strategy`` until nothing is pending.

    ``start`` is a barrier shared with the other workers and the coordinator: every
    worker connects first, then all begin at once, as replicas polling together do.
    With ``drain``, its strategy claims and its ``pending`` decides when to stop, and
    claimed jobs are not completed (the table is not skiplock's).
    """
    report = WorkerReport(spec.index)
    try:
        conn = psycopg.connect(spec.dsn, autocommit=True, application_name=spec.application_name)
    except psycopg.Error as exc:
        start.abort()
        report.error = f"connect: {exc}"
        return report
    with conn:
        strategy = drain.strategy if drain is not None else get_strategy(spec.strategy)
        ctx = ClaimContext(worker=f"w{spec.index}", limit=spec.batch)
        pending = lab_statement("pending_exists", spec.schema)
        complete = lab_statement("complete", spec.schema)
        work = _work(spec.work_ms)
        period = spec.poll_ms / 1000.0
        try:
            start.wait(spec.timeout)
            report.started = time.monotonic()
            deadline = report.started + spec.timeout
            # Independently started replicas poll at independent phases; aligned polls
            # would make every claim collide, which no real deployment sees.
            next_claim = report.started + random.uniform(0.0, period)
            while True:
                now = time.monotonic()
                if now > deadline:
                    report.timed_out = True
                    break
                if period > 0:
                    # A worker that polls every P ms, like the postmortem's workers that
                    # ran the claim once a second.
                    if next_claim > now:
                        time.sleep(next_claim - now)
                    next_claim = max(next_claim + period, time.monotonic())
                outcome = claim_transaction(conn, strategy, spec.schema, ctx, work=work)
                report.latencies.append(outcome.latency)
                report.retries += outcome.retries
                report.deadlocks += outcome.deadlocks
                if outcome.ids:
                    report.ids.extend(outcome.ids)
                    if not strategy.holds_lock:
                        work(outcome.ids)
                        if drain is None:
                            report.deadlocks += _complete(conn, complete, outcome.ids)
                    if drain is not None and not drain.claimed(outcome.ids):
                        break
                    continue
                report.empty_claims += 1
                if drain is not None:
                    if not drain.pending(conn):
                        break
                else:
                    row = conn.execute(pending, {"queue": QUEUE}).fetchone()
                    if not row or not row[0]:
                        break
                if period <= 0:
                    # Pending rows we could not take are held by someone about to commit;
                    # yield the CPU rather than spin on the same locked rows.
                    time.sleep(0.001)
        except Exception as exc:
            report.error = f"{type(exc).__name__}: {exc}"
        report.finished = time.monotonic()
    return report


def _complete(conn: psycopg.Connection[Any], statement: Any, ids: list[int]) -> int:
    """Mark ``ids`` done; returns how many deadlocks it had to retry through."""
    deadlocks = 0
    while True:
        try:
            conn.execute(statement, {"ids": ids})
            return deadlocks
        except psycopg.errors.DeadlockDetected:
            # A double-claimed job is completed by two workers, in no common order.
            deadlocks += 1
            if deadlocks > 1000:
                raise


def _process_main(spec: WorkerSpec, start: _Barrier, results: Any) -> None:
    results.put(run_worker(spec, start))


class _Sampler(threading.Thread):
    """Samples the workers' sessions in pg_stat_activity until stopped."""

    def __init__(self, dsn: str, schema: str, prefix: str, interval: float) -> None:
        super().__init__(name="skiplock-race-sampler", daemon=True)
        self.dsn, self.prefix, self.interval = dsn, prefix, interval
        self.statement = lab_statement("lock_wait_sample", schema)
        self.stop = threading.Event()
        self.samples = 0
        self.sessions = 0
        self.waiting = 0
        self.by_event: Counter[str] = Counter()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(
                self.dsn, autocommit=True, application_name="skiplock-race-sampler"
            ) as conn:
                while not self.stop.wait(self.interval):
                    rows = conn.execute(self.statement, {"prefix": self.prefix}).fetchall()
                    if not rows:
                        continue
                    self.samples += 1
                    for kind, event, n in rows:
                        self.sessions += int(n)
                        if kind == "Lock":
                            self.waiting += int(n)
                            self.by_event[str(event)] += int(n)
        except psycopg.Error as exc:
            self.error = str(exc)

    @property
    def share(self) -> float:
        return self.waiting / self.sessions if self.sessions else 0.0


@dataclass
class RaceResult:
    """One strategy's numbers; ``to_dict`` is the JSON form ``skiplock race --json`` prints."""

    strategy: str
    workers: int
    jobs: int
    claims: int
    double_claims: int
    duplicate_jobs: int
    throughput: float
    latency_p50_ms: float
    latency_p99_ms: float
    lock_wait_share: float
    lock_waits_by_event: dict[str, float]
    serialization_retries: int
    deadlocks: int
    seconds: float
    claim_calls: int
    empty_claims: int
    unclaimed_jobs: int
    jobs_done: int
    lock_wait_samples: int
    batch: int
    poll_ms: float
    work_ms: float
    processes: bool
    # The smallest ids claimed more than once (at most 20): which jobs to look at.
    duplicate_ids: list[int] = field(default_factory=list)
    # race_prepared only: rows a worker got back that it had claimed itself before.  The
    # lab completes nothing there, so these are not double claims (see race_prepared).
    reclaims: int = 0

    @property
    def serialization_retry_rate(self) -> float:
        """Retries per claim transaction attempted."""
        attempts = self.claim_calls + self.serialization_retries
        return self.serialization_retries / attempts if attempts else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["serialization_retry_rate"] = round(self.serialization_retry_rate, 4)
        return out


def _percentile_ms(values: Sequence[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))  # nearest rank
    return round(ordered[rank - 1] * 1000.0, 3)


def _run_workers(
    specs: list[WorkerSpec],
    processes: bool,
    timeout: float,
    on_start: Callable[[], None],
    drains: Sequence[Drain] | None = None,
) -> list[WorkerReport]:
    """Run one worker per spec; ``on_start`` is called the moment they all begin."""
    n = len(specs)
    if not processes:
        # The coordinator is the barrier's last party, so it knows when the race starts.
        barrier: Any = threading.Barrier(n + 1)
        reports: list[WorkerReport | None] = [None] * n

        def target(i: int) -> None:
            reports[i] = run_worker(specs[i], barrier, drains[i] if drains else None)

        threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        _start(barrier, timeout, on_start)
        for t in threads:
            t.join(timeout + 30)
        return [r if r is not None else WorkerReport(i, error="worker thread did not finish")
                for i, r in enumerate(reports)]  # fmt: skip
    # spawn, not fork: a forked child would inherit the parent's threads' locks mid-state.
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(n + 1)
    results = mp.Queue()
    procs = [mp.Process(target=_process_main, args=(s, barrier, results)) for s in specs]
    for p in procs:
        p.start()
    _start(barrier, timeout, on_start)
    got: list[WorkerReport] = []
    try:
        for _ in specs:
            got.append(results.get(timeout=timeout + 60))
    except Exception:
        got_ids = {r.index for r in got}
        got += [WorkerReport(s.index, error="worker process gave no report")
                for s in specs if s.index not in got_ids]  # fmt: skip
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    return sorted(got, key=lambda r: r.index)


def _start(barrier: Any, timeout: float, on_start: Callable[[], None]) -> None:
    try:
        barrier.wait(timeout)
    except threading.BrokenBarrierError:
        return  # a worker could not connect; its report says why
    on_start()


def race_strategy(
    dsn: str,
    strategy: str = "skip-locked",
    *,
    workers: int = 8,
    jobs: int = 20000,
    batch: int = 10,
    poll_ms: float = 0.0,
    work_ms: float = 0.0,
    processes: bool = False,
    schema: str | None = None,
    timeout: float = 600.0,
    sample_ms: float = 10.0,
    keep_schema: bool = False,
) -> RaceResult:
    """Seed ``jobs`` jobs in a scratch schema and drain them with ``workers`` workers.

    Parameters
    ----------
    dsn
        The server.
    strategy
        A strategy name (see ``STRATEGIES``).
    workers
        Concurrent workers, each with its own connection.
    jobs
        Jobs seeded (ids 1..jobs).
    batch
        Jobs per claim (the claim's ``LIMIT``).
    poll_ms
        A worker starts a claim at most every ``poll_ms`` milliseconds (0: back to back),
        each worker at a random phase of that period.
    work_ms
        Simulated work per job, in milliseconds.
    processes
        One process per worker instead of one thread.
    schema
        Scratch schema name (re-created, then dropped); default random.
    timeout
        Seconds the drain may take before workers give up.
    sample_ms
        Interval of the ``pg_stat_activity`` sampler.
    keep_schema
        Leave the scratch schema in place for inspection.

    Returns
    -------
    RaceResult

    Raises
    ------
    RaceError
        A worker failed or the drain timed out.
    """
    get_strategy(strategy)  # fail on a bad name before seeding anything
    if workers < 1 or jobs < 0 or batch < 1:
        raise ValueError("workers and batch must be at least 1, jobs at least 0")
    name = schema or f"skiplock_race_{uuid.uuid4().hex[:10]}"
    prefix = f"skiplock-race:{name}:"
    seed_scratch(dsn, name, jobs, application_name=f"skiplock-race-seed:{name}"[:63])
    specs = [
        WorkerSpec(i, dsn, name, strategy, batch, poll_ms, work_ms, f"{prefix}w{i}"[:63], timeout)
        for i in range(workers)
    ]
    sampler = _Sampler(dsn, name, prefix, sample_ms / 1000.0)
    try:
        reports = _sampled(specs, processes, timeout, sampler)
        with psycopg.connect(dsn, autocommit=True, application_name="skiplock-race") as conn:
            counts: dict[str, int] = dict(
                conn.execute(lab_statement("status_counts", name)).fetchall()
            )
    finally:
        if not keep_schema:
            drop_scratch(dsn, name, terminate_prefix=prefix)
    return _summary(strategy, specs, reports, sampler, jobs, int(counts.get("done", 0)), processes)


def race_prepared(
    dsn: str,
    strategy: Strategy,
    *,
    jobs: int,
    pending: Callable[[], Callable[[psycopg.Connection[Any]], bool]],
    claimed: Callable[[], Callable[[list[int]], bool]] | None = None,
    workers: int = 8,
    batch: int = 10,
    schema: str = "public",
    application_name: str = "skiplock-race",
    poll_ms: float = 0.0,
    work_ms: float = 0.0,
    timeout: float = 600.0,
    sample_ms: float = 10.0,
) -> RaceResult:
    """Race ``strategy`` over rows the caller seeded; nothing is seeded, completed or dropped.

    Parameters
    ----------
    dsn
        The server, as the workers connect to it (a ``search_path`` in its options
        applies to every worker).
    strategy
        The claim, any :class:`Strategy` (a user's statement via ``custom_strategy``).
    jobs
        Rows the caller seeded: the throughput is jobs per second of the drain.
    pending
        Called once per worker for its own "is anything left?" check (see :class:`Drain`),
        so a check may keep per-worker state.
    claimed
        Likewise, for the worker's check after each non-empty claim (default: go on).
    workers, batch, poll_ms, work_ms, timeout, sample_ms
        As in :func:`race_strategy`; threads only.
    schema
        Passed to the strategy's ``render``.
    application_name
        Prefix of the workers' ``application_name``: ``<prefix>w<i>``.

    Returns
    -------
    RaceResult
        ``jobs_done`` counts the rows claimed at least once (nothing is completed).  A
        double claim is a row claimed by two workers; a worker getting back a row it
        claimed itself is counted in ``reclaims`` instead: it would have finished that
        job first, had the lab completed anything.

    Raises
    ------
    RaceError
        A worker failed or the drain timed out.
    """
    if workers < 1 or jobs < 0 or batch < 1:
        raise ValueError("workers and batch must be at least 1, jobs at least 0")
    specs = [
        WorkerSpec(
            i,
            dsn,
            schema,
            strategy.name,
            batch,
            poll_ms,
            work_ms,
            f"{application_name}w{i}"[:63],
            timeout,
        )
        for i in range(workers)
    ]
    drains = [Drain(strategy, pending(), claimed() if claimed else _always) for _ in specs]
    sampler = _Sampler(dsn, schema, application_name, sample_ms / 1000.0)
    reports = _sampled(specs, False, timeout, sampler, drains)
    taken = len({i for r in reports for i in r.ids})
    return _summary(strategy.name, specs, reports, sampler, jobs, taken, False, per_worker=True)


def _sampled(
    specs: list[WorkerSpec],
    processes: bool,
    timeout: float,
    sampler: _Sampler,
    drains: Sequence[Drain] | None = None,
) -> list[WorkerReport]:
    """Run the workers with the lock-wait sampler going from the moment they start."""
    try:
        return _run_workers(specs, processes, timeout, sampler.start, drains)
    finally:
        sampler.stop.set()
        if sampler.is_alive():
            sampler.join()


def _summary(
    strategy: str,
    specs: list[WorkerSpec],
    reports: list[WorkerReport],
    sampler: _Sampler,
    jobs: int,
    jobs_done: int,
    processes: bool,
    *,
    per_worker: bool = False,
) -> RaceResult:
    """The numbers of one drain; the first failed worker's reason as a RaceError.

    ``per_worker``: a row counts once per worker that claimed it (see race_prepared).
    """
    failed = [r for r in reports if r.error or r.timed_out]
    if failed:
        r = failed[0]
        why = r.error or f"timed out after {specs[0].timeout:.0f}s"
        raise RaceError(f"race {strategy}: worker {r.index}: {why}")
    claims = sum(len(r.ids) for r in reports)
    ids = Counter(i for r in reports for i in (set(r.ids) if per_worker else r.ids))
    reclaims = claims - sum(ids.values())
    started = min(r.started for r in reports)
    seconds = max(max(r.finished for r in reports) - started, 1e-9)
    latencies = [x for r in reports for x in r.latencies]
    spec = specs[0]
    return RaceResult(
        strategy=strategy,
        workers=len(specs),
        jobs=jobs,
        claims=claims,
        double_claims=sum(ids.values()) - len(ids),
        duplicate_jobs=sum(1 for n in ids.values() if n > 1),
        throughput=round(jobs / seconds, 1),
        latency_p50_ms=_percentile_ms(latencies, 50),
        latency_p99_ms=_percentile_ms(latencies, 99),
        lock_wait_share=round(sampler.share, 4),
        lock_waits_by_event={
            ev: round(n / sampler.sessions, 4) for ev, n in sampler.by_event.most_common()
        },
        serialization_retries=sum(r.retries for r in reports),
        deadlocks=sum(r.deadlocks for r in reports),
        seconds=round(seconds, 3),
        claim_calls=len(latencies),
        empty_claims=sum(r.empty_claims for r in reports),
        unclaimed_jobs=jobs - len(ids),
        jobs_done=jobs_done,
        lock_wait_samples=sampler.samples,
        batch=spec.batch,
        poll_ms=spec.poll_ms,
        work_ms=spec.work_ms,
        processes=processes,
        duplicate_ids=sorted(i for i, n in ids.items() if n > 1)[:20],
        reclaims=reclaims,
    )


def run_race(
    dsn: str,
    strategies: Sequence[str],
    *,
    on_result: Callable[[RaceResult], None] | None = None,
    **options: Any,
) -> dict[str, RaceResult]:
    """Run :func:`race_strategy` for each strategy in turn, each on a freshly seeded schema.

    ``options`` are passed to :func:`race_strategy`; ``on_result`` is called after each strategy
    (for progress output).  Returns the results keyed by strategy name, in order.
    """
    for s in strategies:
        get_strategy(s)
    out: dict[str, RaceResult] = {}
    for s in strategies:
        out[s] = race_strategy(dsn, s, **options)
        if on_result is not None:
            on_result(out[s])
    return out
