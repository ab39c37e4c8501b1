"""The demo's coordinator: seed the backlog, start the workers, watch it drain, count emails.

The numbers come from the two places the postmortem trusted: the email provider (which
counts every email it accepted, per invoice) and the audit table (which counts the
unique violations it caught).  Progress and the killed worker's recovery are read from
skiplock's ``jobs`` table, read-only.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime
from multiprocessing.process import BaseProcess
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Queue, SkiplockError
from skiplock.lab import DEFAULT_STRATEGY, get_strategy

from ._invoices import QUEUE, create_tables, drop_schema, seed_invoices
from ._provider import FakeEmailProvider
from ._workers import Signals, WorkerSpec, worker_main

__all__ = ["DemoConfig", "DemoError", "DemoResult", "KilledWorker", "run_demo"]

FINISHED = ("done", "failed", "cancelled")

_HELD_BY = """
SELECT id, (payload ->> 'invoice_id')::bigint FROM {schema}.jobs
WHERE status = 'running' AND worker = %(worker)s
"""

_JOBS_STATE = """
SELECT id, status, worker, run_at, started_at FROM {schema}.jobs WHERE id = ANY(%(ids)s)
"""

_LAST_FINISH = "SELECT max(finished_at) FROM {schema}.jobs WHERE queue = %(queue)s"

_AUDIT_COUNTS = """
SELECT (SELECT count(*) FROM {schema}.invoice_emails),
       (SELECT count(*) FROM {schema}.invoice_email_conflicts),
       (SELECT min(error) FROM {schema}.invoice_email_conflicts)
"""


class DemoError(SkiplockError):
    """The demo could not run to the end (a worker died, or the drain timed out)."""


@dataclass(frozen=True)
class DemoConfig:
    """How to run the demo.

    ``invoices``, ``workers``, ``strategy``, ``idempotency`` and ``kill_worker`` are
    the command's options; the rest are the system's shape: handler threads per worker
    (``concurrency``, skiplock's Worker only), jobs per claim (``batch``, the poll
    loop's ``LIMIT``), the lease (short, so a killed worker's jobs come back within
    seconds), the poll tick of the postmortem's loop, the provider's latency per send,
    and the share of the invoices sent before one handler parks mid-job, its email sent
    and its job not completed, and its worker is SIGKILLed.
    """

    invoices: int = 2000
    workers: int = 8
    strategy: str = DEFAULT_STRATEGY
    idempotency: bool = True
    kill_worker: bool = False
    dsn: str | None = None
    concurrency: int = 4
    batch: int = 10
    lease: float = 2.0
    sweep_interval: float = 0.5
    tick: float = 0.1
    collide_wait: float = 10.0
    latency: tuple[float, float] = (0.001, 0.005)
    kill_after: float = 0.25
    timeout: float = 900.0
    start_timeout: float = 120.0

    def check(self) -> None:
        get_strategy(self.strategy)  # ValueError naming the known ones
        if self.invoices < 1:
            raise ValueError("--invoices must be at least 1")
        if self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if self.kill_worker and self.workers < 2:
            raise ValueError("--kill-worker needs at least 2 workers: one to kill, one to recover")
        if self.concurrency < 1 or self.batch < 1:
            raise ValueError("concurrency and batch must be at least 1")
        if self.lease <= 0 or self.tick <= 0:
            raise ValueError("lease and tick must be positive")


@dataclass
class KilledWorker:
    """The worker ``--kill-worker`` SIGKILLed, and what became of the jobs it held.

    ``jobs_held``: jobs it had claimed and not finished when it died (a completion it
    had already sent and that committed after the kill does not count).
    ``already_emailed``: held jobs whose email the provider had accepted from it before
    it died (their re-runs are what an idempotency key suppresses).
    ``ran_again_after_seconds``: from the kill until another worker had claimed the
    last of them: the lease, plus up to one sweep interval (the sweep keeps a job's
    place in the queue, so it does not wait behind the backlog).
    """

    name: str
    pid: int
    at_jobs_finished: int
    jobs_held: int
    already_emailed: int
    jobs_recovered: int
    ran_again_after_seconds: float | None


@dataclass
class DemoResult:
    """The summary; ``to_dict`` is what ``skiplock demo --json`` prints."""

    invoices: int
    workers: int
    strategy: str
    idempotency: bool
    emails_accepted: int
    duplicate_emails: int
    invoices_emailed_more_than_once: int
    suppressed_by_idempotency: int
    audit_rows: int
    audit_duplicates: int
    audit_error: str | None
    provider_requests: int
    provider_rejected: int
    drain_seconds: float
    jobs_done: int
    jobs_failed: int
    jobs_per_worker: dict[str, int]
    killed_worker: KilledWorker | None = None
    dsn: str = ""
    schema: str = ""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def invoices_per_second(self) -> float:
        return self.invoices / self.drain_seconds if self.drain_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["invoices_per_second"] = round(self.invoices_per_second, 1)
        return out


ProgressFn = Callable[[int, int], None]
PhaseFn = Callable[[str], None]


def _sql(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


def run_demo(
    config: DemoConfig,
    *,
    on_progress: ProgressFn | None = None,
    on_phase: PhaseFn | None = None,
) -> DemoResult:
    """Run the invoicing system once, on a scratch schema that is dropped afterwards.

    Parameters
    ----------
    config
        What to run.
    on_progress
        Called with (jobs finished, jobs total) while the backlog drains.
    on_phase
        Called with a short line as the run moves on (seeding, starting workers, ...).

    Raises
    ------
    ValueError
        A bad option.
    DemoError
        A worker process died unexpectedly, or the drain timed out.
    skiplock.DatabaseUnavailable
        PostgreSQL cannot be reached.
    """
    config.check()
    phase = on_phase or (lambda _text: None)
    token = uuid.uuid4().hex[:8]
    schema = f"skiplock_demo_{token}"
    # Every session of this run carries the marker in its application_name, so the final
    # cleanup can end the sessions of a killed (or stuck) worker before dropping the schema.
    marker = f"demo-{token}"
    q = Queue(config.dsn, schema=schema, application_name=f"skiplock-{marker}", max_size=2)
    try:
        dsn = q.settings.dsn
        phase(f"seeding {config.invoices:,} invoices on {q.settings.display_dsn}")
        with psycopg.connect(dsn, autocommit=True, application_name=f"skiplock-{marker}") as conn:
            try:
                q.migrate()
                create_tables(conn, schema)
                invoice_ids = seed_invoices(conn, schema, config.invoices)
                # The payload is the invoice id and nothing else (the postmortem's
                # security note): a worker host that leaks its queue leaks no customers.
                q.enqueue_many([{"invoice_id": i} for i in invoice_ids], queue=QUEUE)
                with FakeEmailProvider(latency=config.latency) as provider:
                    result = _drain(config, q, conn, provider, schema, marker, phase, on_progress)
            finally:
                # Worker sessions only (names "...{marker}-w<i>..."): this process's own
                # pool must survive to be closed cleanly.
                drop_schema(conn, schema, f"{marker}-w")
        result.dsn = q.settings.display_dsn
        return result
    finally:
        q.close()


@dataclass
class _Kill:
    name: str
    pid: int
    at_jobs_finished: int
    at_db: datetime
    held: dict[int, int]  # job id -> invoice id


def _drain(
    config: DemoConfig,
    q: Queue,
    conn: psycopg.Connection[Any],
    provider: FakeEmailProvider,
    schema: str,
    marker: str,
    phase: PhaseFn,
    on_progress: ProgressFn | None,
) -> DemoResult:
    n = config.invoices
    # spawn, not fork: a forked child would inherit this process's threads' locks (the
    # provider's, the pool's) in whatever state they were in.
    mp = multiprocessing.get_context("spawn")
    signals = Signals(
        ready=mp.Barrier(config.workers + 1),
        epoch=mp.RawValue("d", 0.0),
        stop=mp.RawValue("b", 0),
        first_claimed=mp.RawArray("b", config.workers),
        sent=mp.Value("q", 0),
        # The send after kill_after of the invoices parks its handler (see _ParkOnce);
        # some handler makes that send, since every invoice is sent at least once.
        park_at=mp.RawValue("q", int(config.kill_after * n) + 1 if config.kill_worker else 0),
        parked=mp.RawValue("q", 0),
    )
    names = [f"{marker}-w{i}" for i in range(config.workers)]
    pairs = (config.workers + 1) // 2
    specs = [
        WorkerSpec(
            index=i,
            name=names[i],
            dsn=q.settings.dsn,
            schema=schema,
            provider_url=provider.url,
            strategy=config.strategy,
            idempotency=config.idempotency,
            lease=config.lease,
            concurrency=config.concurrency,
            batch=config.batch,
            tick=config.tick,
            # Pairs of workers share a first poll; the pairs' first polls are spread
            # over one tick so that only partners meet.
            first_offset=(i // 2) * config.tick / pairs,
            partner=(i ^ 1) if (i ^ 1) < config.workers else None,
            sweep_interval=config.sweep_interval,
            collide_wait=config.collide_wait,
            application_name=f"skiplock-{names[i]}",
            start_timeout=config.start_timeout,
        )
        for i in range(config.workers)
    ]
    mode = "skiplock Worker" if config.strategy == "skip-locked" else "poll loop"
    phase(
        f"starting {config.workers} worker processes ({mode}, strategy {config.strategy}, "
        f"idempotency keys {'on' if config.idempotency else 'off'})"
    )
    procs = [mp.Process(target=worker_main, args=(s, signals), name=s.name) for s in specs]
    for p in procs:
        p.start()
    kill: _Kill | None = None
    try:
        try:
            signals.ready.wait(config.start_timeout)
        except threading.BrokenBarrierError:
            raise DemoError(_start_failure(procs)) from None
        t0 = time.monotonic() + 0.05
        signals.epoch.value = t0
        time.sleep(max(0.0, t0 - time.monotonic()))  # the workers' common start
        started_db = _db_now(conn)
        deadline = t0 + config.timeout
        finished = 0
        while True:
            finished, failed = _finished(q)
            if on_progress is not None:
                on_progress(finished, n)
            if kill is None and signals.parked.value:
                kill = _kill_one(conn, schema, procs[signals.parked.value - 1], finished)
            if finished >= n:
                break
            for i, p in enumerate(procs):
                if p.exitcode is not None and (kill is None or p.pid != kill.pid):
                    raise DemoError(f"worker w{i} exited with code {p.exitcode} mid-run")
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the backlog did not drain in {config.timeout:.0f}s ({finished:,} of {n:,})"
                )
            time.sleep(0.05)
        phase("backlog drained; stopping workers")
    finally:
        _stop(procs, signals)
    row = conn.execute(_sql(_LAST_FINISH, schema), {"queue": QUEUE}).fetchone()
    last = row[0] if row else None
    drain = max((last - started_db).total_seconds(), 0.0) if last is not None else 0.0
    audit = conn.execute(_sql(_AUDIT_COUNTS, schema)).fetchone()
    assert audit is not None
    stats = provider.stats()
    per_worker = {f"w{i}": stats.per_worker.get(names[i], 0) for i in range(config.workers)}
    return DemoResult(
        invoices=n,
        workers=config.workers,
        strategy=config.strategy,
        idempotency=config.idempotency,
        emails_accepted=stats.accepted,
        duplicate_emails=stats.duplicate_emails,
        invoices_emailed_more_than_once=stats.invoices_emailed_twice,
        suppressed_by_idempotency=stats.suppressed,
        audit_rows=int(audit[0]),
        audit_duplicates=int(audit[1]),
        audit_error=audit[2],
        provider_requests=stats.requests,
        provider_rejected=stats.rejected,
        drain_seconds=round(drain, 3),
        jobs_done=finished - failed,
        jobs_failed=failed,
        jobs_per_worker=per_worker,
        killed_worker=_killed_summary(conn, schema, kill, stats.senders, names) if kill else None,
        schema=schema,
        settings={
            "concurrency": config.concurrency if config.strategy == "skip-locked" else 1,
            "batch": config.batch,
            "lease_seconds": config.lease,
            "tick_seconds": None if config.strategy == "skip-locked" else config.tick,
            "provider_latency_ms": [x * 1000 for x in config.latency],
        },
    )


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def _finished(q: Queue) -> tuple[int, int]:
    """(jobs finished, of which failed) in the demo's queue."""
    finished = failed = 0
    for r in q.status():
        if r["queue"] == QUEUE and r["status"] in FINISHED:
            finished += int(r["jobs"])
            if r["status"] != "done":
                failed += int(r["jobs"])
    return finished, failed


def _kill_one(
    conn: psycopg.Connection[Any], schema: str, proc: BaseProcess, finished: int
) -> _Kill:
    """SIGKILL the worker whose handler parked mid-job, and note what it held."""
    proc.kill()  # SIGKILL: no shutdown, no release, no last write
    proc.join(5)
    at = _db_now(conn)
    # The dead worker's sessions are gone or going; a statement it had already sent may
    # still commit, which _killed_summary tells apart from a recovery.  The parked job is
    # among the held ones: its completion was never sent.
    held = dict(conn.execute(_sql(_HELD_BY, schema), {"worker": proc.name}).fetchall())
    assert proc.pid is not None
    return _Kill(proc.name, proc.pid, finished, at, held)


def _killed_summary(
    conn: psycopg.Connection[Any],
    schema: str,
    kill: _Kill,
    senders: dict[int, list[str]],
    names: list[str],
) -> KilledWorker:
    ran_again: list[float] = []
    stranded: list[int] = []
    rows = conn.execute(_sql(_JOBS_STATE, schema), {"ids": list(kill.held)}).fetchall()
    for job_id, status, worker, _run_at, started_at in rows:
        if worker == kill.name and status in FINISHED:
            continue  # a completion the worker had sent before it died, committed after
        stranded.append(job_id)
        if worker != kill.name and started_at is not None:
            ran_again.append((started_at - kill.at_db).total_seconds())
    senders_of = {job_id: senders.get(kill.held[job_id], []) for job_id in stranded}
    emailed = sum(1 for who in senders_of.values() if kill.name in who)
    return KilledWorker(
        name=f"w{names.index(kill.name)}",
        pid=kill.pid,
        at_jobs_finished=kill.at_jobs_finished,
        jobs_held=len(stranded),
        already_emailed=emailed,
        jobs_recovered=len(ran_again),
        ran_again_after_seconds=round(max(ran_again), 3) if ran_again else None,
    )


def _start_failure(procs: Sequence[BaseProcess]) -> str:
    dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
    if dead:
        i, code = dead[0]
        return f"worker w{i} failed to start (exit code {code}; its error is above)"
    return "worker processes did not start in time"


def _stop(procs: Sequence[BaseProcess], signals: Signals) -> None:
    """Let every worker finish the work in hand and exit; kill what does not."""
    signals.stop.value = 1
    if signals.epoch.value == 0:
        # Never started, so no worker was killed yet and the barrier is safe to break:
        # a worker still waiting at it must not wait out the start timeout.
        signals.epoch.value = -1
        with suppress(Exception):
            signals.ready.abort()
    deadline = time.monotonic() + 30
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
