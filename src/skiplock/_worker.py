"""Worker: claims in batches, runs handlers in threads, keeps leases alive, sweeps.

Threads and their one job each:

- the caller's thread runs the claim loop: claim up to free capacity, hand jobs to the
  handler pool, reap handlers past their timeout, sweep expired leases now and then;
- a writer thread per chain turns handler outcomes into fenced writes, batched (all the
  completions that piled up go in one statement), and claims the slots they free in
  the same transaction;
- the heartbeat thread extends the lease of every job this worker holds, in one
  statement, on a connection of its own: a slow or failing write never delays a
  heartbeat past the lease, and a failed heartbeat is retried at once;
- the listener thread LISTENs for enqueue notifications and wakes the claim loop;
- the handler threads run user code.

A *chain* is one claim-and-write path: a writer, its connection, its own claim cursor,
and the jobs it claimed, which it alone completes.  Its client work (Python, the
driver) and its server work run one after the other, so one chain keeps at most one
core busy at a time; with two chains, one's server time overlaps the other's Python,
and short jobs drain 1.2-1.3x faster in one process
(docs/decisions/0012-two-chains-per-worker.md).  The handler pool, heartbeats,
liveness mark, listener and upkeep stay one per worker.

Nothing here holds a transaction open while a handler runs: the claim commits, the
lease is the only claim a worker keeps, and the lease token guards every write.

Each thread that talks to the server has its own connection (a ``Lane``), which
reconnects on skiplock's schedule (at once, then a short capped backoff) rather than a
pool's, so that after a server restart the worker is back within a fraction of a
lease instead of seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from queue import Empty, SimpleQueue
from typing import Any

import psycopg
from psycopg import sql

from ._base import backoff, unavailable
from ._cursor import ClaimCursor
from ._errors import SkiplockError
from ._handlers import VANISHED, Handler, HandlerPool, Outcome, RunTime, run_handler
from ._health import DEFAULT_HOST, DEFAULT_STALL
from ._job import Attempt, Job
from ._lane import Lane
from ._ops import FenceResult
from ._periodic import Periodic, PeriodicScheduler
from ._procpool import ProcessPool
from ._queue import Queue
from ._sql import channel_name
from ._wclaims import Chain
from ._wcore import Trouble, WorkerStats, default_worker_name, one_line
from ._workerbase import WorkerBase
from ._wpool import WorkerPool

__all__ = ["Worker", "WorkerStats", "default_worker_name"]

logger = logging.getLogger("skiplock.worker")

_DB_ERRORS = (psycopg.Error, SkiplockError)


class _Chain(Chain):
    """A chain (see ``Chain``) of the threaded worker: its writer's connection and the
    outcomes it owes."""

    def __init__(self, index: int, share: int, fixed_prefetch: int | None, cursor: ClaimCursor):
        super().__init__(index, share, fixed_prefetch, cursor)
        self.wq: Queue | None = None  # fenced writes, and the claims fused with them
        # Outcomes for this chain's writer; None stops it.
        self.results: SimpleQueue[tuple[Job, Outcome] | None] = SimpleQueue()
        # Held by whoever claims for this chain (the claim loop, or its writer), from
        # counting its free slots to registering the jobs: two claims at once would
        # both count the same slots free.  ``held`` changes under _inflight_lock.
        self.lock = threading.Lock()


class Worker(WorkerBase, WorkerPool):
    """Runs handlers for jobs of one or more queues.

    Parameters
    ----------
    queue
        The Queue whose settings (DSN, schema, retry policy) the worker uses.  The
        worker opens its own few connections, named ``skiplock-worker:<name>`` in
        ``pg_stat_activity``.
    handler
        ``f(job)`` for every queue in ``queues``, or a mapping queue -> handler.
        ``async def`` handlers run in an event loop of their own and are cancelled
        at the job timeout.  Return: done.  Raise ``Retry(delay)``: again later.
        Raise ``Fail``: failed, no retry.  Raise anything else: retried with the
        queue's backoff until attempts run out.
    concurrency
        Handlers running at once; the worker claims up to the free capacity.
    prefetch
        Jobs claimed beyond ``concurrency`` so the next job is ready when a handler
        frees up.  Default: adaptive, about the jobs handlers finish during one claim
        round trip (none for slow jobs, up to ``2 * concurrency`` or 256, whichever is
        larger, for fast ones), per chain: each sizes its own on its share of the
        handlers, and a fixed number is split between them.
        Prefetched jobs hold a lease (heartbeated) and are released, attempt given
        back, at shutdown.
    lease
        Seconds a claim lasts without a heartbeat; heartbeats every ``lease / 3``.
        A dead worker's jobs run again after at most ``lease + sweep_interval``.
    job_timeout
        Seconds a handler may run; past it the attempt fails (and is retried).
    listen
        Wake on LISTEN/NOTIFY.  Turn off behind PgBouncer in transaction mode; the
        worker then polls every ``poll_interval`` seconds.
    shutdown_grace
        On stop, seconds running handlers get to finish.  Unstarted jobs are
        released at once, with their attempt given back.  Handlers still running
        after it are abandoned (``stats.abandoned``, one ERROR line): their jobs run
        again once their leases run out.
    on_event
        ``f(event, job)`` for metrics and histories, called after the fact:
        ``claimed``, ``started``, ``completed`` (the fenced write committed),
        ``retried``, ``failed``, ``released``, ``timed_out``, ``lease_lost``.
        It runs on the worker's own threads: keep it quick; exceptions are logged.
    on_measure
        ``f(name, value, queue)`` for figures that belong to no single job, same
        rules as ``on_event``: ``claim_seconds`` (one claim's round trip, per queue),
        ``swept`` (jobs a sweep returned; queue None), ``heartbeat_missed`` (jobs of
        a queue whose heartbeat failed or found the lease gone).
        ``skiplock.metrics.WorkerMetrics`` turns both hooks into metrics.
    synchronous_commit
        On by default: a completion the worker was told had committed survives a
        server crash.  ``False`` (the worker's own connections only; enqueues stay
        synchronous) returns each commit before its WAL is written, about 1.3-1.8x the
        drain rate of no-op jobs (bench/results/2026-12-03-issue-11.md), at a cost: a crash of the
        server takes back claims, heartbeats and *completions* acknowledged in the
        last few hundred milliseconds, and those jobs run again (the chaos crash
        fault: 10 re-runs in 3 crashes at 60 jobs/s; none with the default).  Never
        lost, never recorded done twice, but the handler runs twice: use it only for
        handlers that are idempotent.  A clean restart loses nothing in either mode.
    retention
        If set, delete jobs finished more than this many seconds ago, a small batch
        every ``prune_interval`` seconds (``skiplock prune`` does the same once).
    periodic
        ``Periodic`` schedules this worker enqueues, in a thread of its own.  Run the
        same list on any number of workers: each tick is enqueued once (see
        docs/periodic.md).  The jobs go to each spec's queue, served here or not.
    fuse_claims
        On by default.  The writer sends each batch of completions and a claim of the
        slots they free in one transaction, pipelined: one round trip and one commit
        flush where there are two (docs/decisions/0002-fused-complete-and-claim.md),
        about 1.1-1.2x the drain rate of short jobs.  Each statement is unchanged, so
        are the fence and the claim; the claim loop still claims when the writer has
        nothing to write.  ``False`` completes and claims in transactions of their own
        (``skiplock worker --no-fuse-claims``).
    tasks
        Claim only jobs of these task names (``App.worker`` passes the app's tasks);
        None, the default, claims every job of the queues.  A job of a task the
        worker does not know is left pending, uncharged, for a worker that knows it.
    chains
        Claim-and-write paths, each with a writer thread and a connection of its own,
        its share of the handlers and its own prefetch (at most ``concurrency``).
        Default: 2 with ``fuse_claims`` and ``concurrency`` of 4 or more, else 1.  One
        chain runs its Python and its database round trips one after the other, so it
        keeps about one core busy; a second overlaps them, about 1.2-1.3x the drain rate
        of short jobs in one process, for one more connection
        (``skiplock worker --chains``; docs/architecture.md, "Two chains in one Worker").
    health_port
        Serve ``GET /livez`` and ``GET /readyz`` on this port while ``run()`` runs (0:
        any free port, then ``worker.health.port``), on ``health_host`` (default
        127.0.0.1; ``0.0.0.0`` in a container, where the kubelet probes the pod's IP).
        /livez answers 503 when the claim loop, a writer, the heartbeat or the liveness
        mark has been in one step (a statement, a batch) for longer than
        ``health_stall`` seconds (default 60): a wedged worker.  An idle worker is live,
        and so is one whose database refuses it (its calls fail and are retried).
        /readyz answers 503 while the database cannot be reached, is read-only, or its
        schema lacks a migration this code needs, and while the worker stops.  Each
        answer is a small JSON document saying why (docs/deploy.md).
    pool
        ``"thread"`` (the default): handlers run in threads of this process; one past
        its timeout fails its attempt but cannot be stopped, and runs on.  ``"process"``:
        each handler slot runs its jobs in a child process (docs/tasks.md, "The
        process pool"), killed at the job's timeout (its attempt fails "killed after
        N s") and replaced; a child that dies fails its attempt only.  The handlers
        must be importable by qualified name (the children import them afresh;
        ConfigError otherwise).  Claims, fenced writes and heartbeats stay here.
    soft_timeout
        With ``pool="process"``: seconds after which ``SoftTimeLimitExceeded`` is
        raised inside the handler, so it can clean up before ``job_timeout`` kills it
        (``task_soft_timeouts`` per task; ``App.task(soft_timeout=)`` sets those).
    max_tasks_per_child, max_memory_per_child
        With ``pool="process"``: retire a child after this many jobs, or after a job
        that leaves it with more than this many MiB resident; its slot starts a new one.
    """

    def __init__(
        self,
        queue: Queue,
        handler: Handler | Mapping[str, Handler],
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 4,
        lease: float = 30.0,
        heartbeat_interval: float | None = None,
        name: str | None = None,
        poll_interval: float = 1.0,
        sweep_interval: float = 2.0,
        job_timeout: float | None = None,
        listen: bool = True,
        prefetch: int | None = None,
        shutdown_grace: float = 30.0,
        on_event: Callable[[str, Job], None] | None = None,
        on_measure: Callable[[str, float, str | None], None] | None = None,
        retention: float | None = None,
        prune_interval: float = 60.0,
        synchronous_commit: bool = True,
        periodic: Sequence[Periodic] = (),
        tasks: Sequence[str] | None = None,
        task_timeouts: Mapping[str, float] | None = None,
        liveness: bool = True,
        fuse_claims: bool = True,
        chains: int | None = None,
        health_port: int | None = None,
        health_host: str = DEFAULT_HOST,
        health_stall: float = DEFAULT_STALL,
        pool: str = "thread",
        soft_timeout: float | None = None,
        task_soft_timeouts: Mapping[str, float] | None = None,
        max_tasks_per_child: int | None = None,
        max_memory_per_child: float | None = None,
    ) -> None:
        super().__init__(
            queue,
            handler,
            queues=queues,
            concurrency=concurrency,
            lease=lease,
            heartbeat_interval=heartbeat_interval,
            name=name,
            poll_interval=poll_interval,
            sweep_interval=sweep_interval,
            job_timeout=job_timeout,
            listen=listen,
            shutdown_grace=shutdown_grace,
            on_event=on_event,
            on_measure=on_measure,
            retention=retention,
            prune_interval=prune_interval,
            synchronous_commit=synchronous_commit,
            periodic=periodic,
            tasks=tasks,
            task_timeouts=task_timeouts,
            liveness=liveness,
            fuse_claims=fuse_claims,
            health_port=health_port,
            health_host=health_host,
            health_stall=health_stall,
        )
        self._init_pool(
            pool, soft_timeout, task_soft_timeouts, max_tasks_per_child, max_memory_per_child
        )
        # By default the prefetch adapts (adaptive_prefetch); a number fixes it.
        self._fixed_prefetch = None if prefetch is None else max(0, prefetch)
        self._chains = [
            _Chain(i, *share)
            for i, share in enumerate(self._chain_shares(chains, self._fixed_prefetch))
        ]
        self._watch(len(self._chains), heartbeat=True)
        # The chain that claimed each job held, and writes its outcome.
        self._chain_of: dict[Attempt, _Chain] = {}
        self._q: Queue | None = None  # the claim loop's claims, sweeps, prunes, releases
        self._hq: Queue | None = None  # heartbeats
        self._uq: Queue | None = None  # the generations' upkeep
        self._upkeep_wanted = threading.Event()  # set by each sweep, and to stop
        self._lanes: list[Lane] = []
        # Reconnects and retries of the worker's own loops stay well inside a lease.
        self._retry_cap = min(0.25, self.lease / 8)
        self._beat_now = threading.Event()  # a cancel of a job we hold was announced
        self._beats_done = threading.Event()
        self._mark_now = threading.Event()  # the listener's connection broke: re-mark
        # By attempt (id, token): after a lease ran out this worker may claim the same
        # job again while its old attempt still runs.
        self._deadline: dict[Attempt, float] = {}  # when its lease ends, at the latest
        self._lapsed: set[Attempt] = set()
        # Jobs whose outcome the writer is writing: a heartbeat that finds one of them
        # no longer running may be seeing our own completion, not a lost lease.
        self._writing: set[Attempt] = set()
        self._stopping = threading.Event()
        self._hard_stop = threading.Event()
        self._give_up_writes = threading.Event()
        self._wake = threading.Event()
        self._inflight: dict[Attempt, Job] = {}  # claimed and not yet written back
        self._inflight_lock = threading.Lock()
        self._pool: HandlerPool | ProcessPool | None = None
        self._writers: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        self._running = False

    # -- run and stop ----------------------------------------------------------------------

    def run(self) -> WorkerStats:
        """Run until ``stop()``; returns the final counters."""
        if self._running:
            raise RuntimeError("worker already running")
        self._running = True
        s = self._settings
        try:
            # Fail fast with libpq's reason (bad password, no such database) rather
            # than retry a mistake forever; outages after this are ridden out.
            psycopg.connect(s.dsn, **s.connect_kwargs()).close()
        except psycopg.Error as exc:
            self._running = False
            raise unavailable(exc, s, "worker start") from None
        try:
            self._start_health()  # before any thread: a port in use stops nothing
        except BaseException:
            self._running = False
            raise
        self._q = self._lane_queue("claims")
        for chain in self._chains:
            chain.wq = self._lane_queue("writes" if chain.index == 0 else f"writes {chain.index}")
        self._hq = self._lane_queue("heartbeats")
        self._uq = self._lane_queue("upkeep")
        self._pool = self._make_pool()
        for chain in self._chains:
            self._start_writer(chain)
        self._start_thread(self._heartbeat_loop, "heartbeat")
        self._start_thread(self._upkeep_loop, "upkeep")
        if self.liveness:
            self._start_thread(self._liveness_loop, "liveness")
        if self.listen:
            self._start_thread(self._listen_loop, "listener")
        if self.periodic:
            scheduler = PeriodicScheduler(
                self._lane_queue("periodic"),
                self.periodic,
                stop=self._stopping,
                name=f"worker {self.name}",
            )
            self._start_thread(scheduler.run, "periodic")
        logger.info(
            "worker %s: queues %s, concurrency %d, lease %gs, %d chain(s)",
            self.name,
            ",".join(self.queues),
            self.concurrency,
            self.lease,
            len(self._chains),
        )
        try:
            self._claim_loop()
        finally:
            try:
                self._shutdown()
            finally:
                self._stop_health()
        return self.stats

    def start(self) -> threading.Thread:
        """Run in a background thread (tests, embedding); ``stop()`` then ``join()``."""
        t = threading.Thread(target=self.run, name=f"skiplock-worker-{self.name}", daemon=True)
        t.start()
        return t

    def stop(self, *, graceful: bool = True) -> None:
        """Stop claiming; with ``graceful``, let running handlers finish in the grace."""
        if not graceful:
            self._hard_stop.set()
        self._stopping.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _stop_asked(self) -> bool:
        return self._stopping.is_set()

    def inflight(self) -> list[Job]:
        with self._inflight_lock:
            return list(self._inflight.values())

    @property
    def reconnects(self) -> int:
        """Connections the worker made again after losing one (all its lanes)."""
        return sum(lane.reconnects for lane in self._lanes)

    def _make_pool(self) -> HandlerPool | ProcessPool:
        try:
            return self._new_pool(self._run_one, self._handler_done, self._wake.set)
        except BaseException:
            for lane in self._lanes:
                lane.close()
            self._running = False
            raise

    def _lane_queue(self, role: str) -> Queue:
        lane = Lane(self._settings, f"worker {self.name} {role}", cap=self._retry_cap)
        self._lanes.append(lane)
        return Queue.from_settings(self._settings, connections=lane)

    def _start_thread(self, target: Callable[[], None], role: str) -> None:
        t = threading.Thread(target=target, name=f"skiplock-{self.name}-{role}", daemon=True)
        self._threads.append(t)
        t.start()

    def _start_writer(self, chain: _Chain) -> None:
        role = "writer" if chain.index == 0 else f"writer-{chain.index}"
        t = threading.Thread(
            target=self._writer_loop,
            args=(chain,),
            name=f"skiplock-{self.name}-{role}",
            daemon=True,
        )
        self._writers.append(t)
        t.start()

    def _chain_list(self) -> Sequence[Chain]:
        return self._chains

    def _mean_runtime_now(self) -> float:
        return self._pool.runtime.value if self._pool is not None else RunTime.PRIOR

    # -- the claim chain -------------------------------------------------------------------

    def _claim_loop(self) -> None:
        assert self._q is not None and self._pool is not None
        self._upkeep_from(time.monotonic())
        trouble = Trouble(self.name, "claim")
        steps = self._steps
        while not self._stopping.is_set():
            # A turn's work is one step for /livez; its waits are not (steps.end).
            steps.begin(self.CLAIM_LOOP)
            now = time.monotonic()
            timed_out, vanished = self._pool.reap(now)
            killed = isinstance(self._pool, ProcessPool)
            for job in timed_out:
                self._result(job, self._timed_out(job, self.timeout_for(job), killed=killed))
            for job in vanished:
                logger.error(
                    "worker %s: the handler thread of job %s ended without an outcome; "
                    "its attempt fails and a new thread takes the slot",
                    self.name,
                    job.id,
                )
                self._result(job, VANISHED)
            if self._sweep_due(now):
                self._sweep()
            if self._prune_due(now):
                self._prune()
            try:
                for chain in self._chains:
                    if free := self._claim_due(chain):
                        self._set_more(chain, self._claim_some(free, chain))
                trouble.ok()
            except _DB_ERRORS as exc:
                failures = trouble.failed(exc)
                self.stats.add(db_errors=1)
                steps.end(self.CLAIM_LOOP)
                self._stopping.wait(backoff(failures, base=0.05, cap=self._retry_cap))
                continue
            if self._say_waiting(now):
                continue  # claim again now that producers notify us
            self._wait_for_work()
        steps.end(self.CLAIM_LOOP)

    def _say_waiting(self, now: float) -> bool:
        """Write a change of ``waiting`` to our row; True if we turned to waiting."""
        assert self._q is not None
        change = self._waiting_change(self._more, now)
        if change is None:
            return False
        try:
            self._q.worker_waiting(self.name, change)
        except _DB_ERRORS as exc:
            self._waiting_failed(exc, now)
            return False
        self._said_waiting(change, now)
        return change

    def _wait_for_work(self) -> None:
        timeout = self.poll_interval
        shortest = self.shortest_timeout
        if shortest is not None:
            timeout = min(timeout, max(shortest / 4, 0.05))
        if any(self._refill_due(chain) for chain in self._chains):
            return  # more work is waiting and a batch fits: claim again at once
        now = time.monotonic()
        self._steps.end(self.CLAIM_LOOP)
        self._wake.wait(self._until_upkeep(self._look_again_in(timeout, now), now))
        self._wake.clear()

    def _claim_some(self, free: int, chain: _Chain) -> bool:
        """Claim up to ``free`` jobs across the queues for ``chain``; True if a queue
        may hold more."""
        assert self._q is not None and self._pool is not None
        with chain.lock:
            free = min(free, self._free(chain))
            more = False
            for name in self._queue_order():
                if free <= 0 or self._stopping.is_set():
                    break
                claim = self._claim_round(name, free, chain.cursor)
                jobs = self._q.claim(**self._claim_args(claim))
                rtt = self._claim_landed(claim, jobs)
                self._claim_rtt += 0.1 * (rtt - self._claim_rtt)
                self._take(name, jobs, claim.began, rtt, chain)
                more = more or len(jobs) == free
                free -= len(jobs)
            return more

    def _take(
        self, name: str, jobs: Sequence[Job], began: float, rtt: float, chain: _Chain
    ) -> None:
        """Hold and start the jobs a claim for ``chain`` sent at ``began`` returned."""
        assert self._pool is not None
        with self._inflight_lock:
            chain.held += len(jobs)
            for job in jobs:
                self._inflight[job.attempt] = job
                self._chain_of[job.attempt] = chain
                # The lease ends at claim time + lease on the server's clock; the
                # moment we sent the claim is the earliest that can be.
                self._deadline[job.attempt] = began + self.lease
        self._claimed(name, jobs, rtt)
        for job in jobs:
            self._pool.submit(job)

    # -- handlers --------------------------------------------------------------------------

    def _run_one(self, job: Job) -> Outcome:
        self._emit("started", job)
        return run_handler(
            self._handlers[job.queue], job, self.timeout_for(job), self._settings.max_result_bytes
        )

    def _handler_done(self, job: Job, outcome: Outcome) -> None:
        # The slot frees when the writer has written the outcome (_forget), not now.
        self._result(job, outcome)

    def _result(self, job: Job, outcome: Outcome) -> None:
        """Hand an outcome to the writer of the chain that claimed the job.

        Capacity is counted on the jobs a chain holds until their outcome is written,
        not on busy handler threads: otherwise a writer that lags (a slow or
        unreachable database) lets the claims take ever more jobs whose outcomes pile
        up unwritten, in ever larger batches, until their leases run out under a live
        worker.
        """
        # A dict read is atomic: no lock on the path every job takes.
        chain = self._chain_of.get(job.attempt, self._chains[0])
        chain.results.put((job, outcome))

    # -- the writer ------------------------------------------------------------------------

    def _writer_loop(self, chain: _Chain) -> None:
        pending: list[tuple[Job, Outcome]] = []
        results = chain.results
        trouble = Trouble(self.name, "writing results")
        loop = self._writer_loop_name(chain.index)
        while True:
            failures = trouble.failures
            timeout = backoff(max(failures, 1), base=0.05, cap=self._retry_cap) if pending else 1.0
            stop = False
            try:
                item = results.get(timeout=timeout)
                while True:
                    if item is None:
                        results.put(None)  # seen again on the next round
                        stop = True
                        break
                    pending.append(item)
                    item = results.get_nowait()
            except Empty:
                pass
            if stop and not pending:
                return
            if stop:
                # Writes still owed: keep trying until the hard stop, or until the
                # shutdown gives up on them (a writer must not outlive run()).
                if self._hard_stop.is_set() or self._give_up_writes.is_set():
                    logger.warning(
                        "worker %s: %d result(s) unwritten at exit", self.name, len(pending)
                    )
                    return
                time.sleep(0.05)
            if pending:
                with self._inflight_lock:
                    self._writing.update(job.attempt for job, _ in pending)
                try:
                    # A batch written again after a failed call may have committed
                    # unseen: the retry must recheck, or it reports "lease lost".
                    with self._steps.step(loop):
                        self._write(pending, chain, recheck=failures > 0)
                    pending = []
                    trouble.ok()
                except Exception as exc:
                    # Never let the writer die: results it owes would be lost and the
                    # leases of every job held would run out.  Keep them and retry.
                    trouble.failed(exc, "keeping the results")
                    self.stats.add(db_errors=1)

    def _write(
        self, batch: list[tuple[Job, Outcome]], chain: _Chain, recheck: bool = False
    ) -> None:
        """One statement for the completions, one for the failures; each fenced per job."""
        wq = chain.wq
        assert wq is not None
        done, failed = self.split(batch)
        if done:
            if self.fuse_claims and not self._stopping.is_set():
                res = self._complete_and_claim(done, chain, recheck)
            else:
                res = wq.complete_many(done, _recheck=recheck)
            self.completed(done, res)
            self._forget([job for job, _ in done])
            batch[:] = [it for it in batch if it[1].kind != "ok"]  # a retry must not repeat them
        if failed:
            res = wq.fail_many(failed, _recheck=recheck)
            self.handed_back(failed, res)
            self._forget([j for j, *_ in failed])

    def _complete_and_claim(
        self, done: list[tuple[Job, Any]], chain: _Chain, recheck: bool
    ) -> FenceResult:
        """Complete ``done`` and claim the slots it frees for ``chain``, in one pipelined
        transaction (``Queue._complete_and_claim``; what a failure means is said there)."""
        wq = chain.wq
        assert wq is not None
        with chain.lock:
            fused = self._fused_round(wq, self._free(chain) + len(done), chain.cursor)
            if fused is None:
                return wq.complete_many(done, _recheck=recheck)
            claim, op = fused
            res, claimed = wq._complete_and_claim(done, op, recheck=recheck)
            rtt = self._claim_landed(claim, claimed)
            if self._stopping.is_set():
                # Stopped meanwhile: the handler pool may already be draining.
                self.released(claimed, wq.release_many(claimed))
                return res
            self._take(claim.queue, claimed, claim.began, rtt, chain)
            self._set_more(chain, len(claimed) == claim.limit)
        if not chain.more and self._told_waiting is not True:
            # This claim found the queue dry, not the claim loop's: the loop sleeps while
            # the row says busy (no notifications), so wake it to look and say it waits.
            self._wake.set()
        return res

    def _drop_held(self, attempt: Attempt) -> None:
        """Stop holding ``attempt`` (under ``_inflight_lock``); its chain's writer may
        still owe its outcome, so the job keeps its chain until ``_forget``."""
        if self._inflight.pop(attempt, None) is not None:
            self._chain_of[attempt].held -= 1
        self._deadline.pop(attempt, None)
        self._lapsed.discard(attempt)

    def _forget(self, jobs: Sequence[Job]) -> None:
        with self._inflight_lock:
            for job in jobs:
                self._drop_held(job.attempt)
                self._chain_of.pop(job.attempt, None)
                self._writing.discard(job.attempt)
        # Wake the claim loop only when a refill batch fits and work is known to wait;
        # new work otherwise arrives by NOTIFY or the poll.
        if any(self._refill_due(chain) for chain in self._chains):
            self._wake.set()

    # -- the heartbeat ---------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_interval``, extend the lease of every job held; a failed
        beat is tried again at once, then after a short capped backoff, until it gets
        through or the worker has written its last result."""
        trouble = Trouble(self.name, "heartbeat")
        next_beat = time.monotonic() + self.heartbeat_interval
        while not self._beats_done.is_set():
            self._beat_now.wait(max(0.0, next_beat - time.monotonic()))
            self._beat_now.clear()
            if self._beats_done.is_set():
                return
            if time.monotonic() < next_beat and not self.inflight():
                continue
            with self._steps.step(self.HEARTBEAT):
                beat = self._heartbeat(trouble)
            if beat:
                next_beat = time.monotonic() + self.heartbeat_interval
            else:
                next_beat = time.monotonic() + backoff(
                    trouble.failures, base=0.025, cap=self._retry_cap
                )

    def _heartbeat(self, trouble: Trouble) -> bool:
        """One beat for every job held; False if it did not reach the server."""
        assert self._hq is not None
        jobs = self.inflight()  # _ops.fenced puts them in id order, as every write
        if self._pool is not None and jobs:
            # A job is kept alive only while something runs it: a handler thread that
            # is gone without an outcome must not hold its job's lease (the claim loop
            # fails the attempt at its next turn).
            dead = self._pool.dead()
            jobs = [j for j in jobs if j.attempt not in dead] if dead else jobs
        if not jobs:
            return True
        sent = time.monotonic()
        with self._inflight_lock:
            writing = set(self._writing)
        try:
            res = self._hq.heartbeat_many(jobs, lease=self.lease)
        except Exception as exc:
            self.stats.add(db_errors=1)
            trouble.failed(exc, "retrying at once, then every few hundred ms")
            self._missed(jobs)
            self._note_lapsed(time.monotonic())
            return False
        trouble.ok()
        # A beat sent after a job's lease ended came too late to keep it, whatever the
        # answer: the sweeper may have taken the job (then the beat says "lost").
        self._note_lapsed(sent)
        with self._inflight_lock:
            # Not running any more because our writer finished it: the writer's own
            # fenced answer says what happened, not this beat.
            writing |= self._writing
            ours = self._ours(jobs, writing, self._inflight)
        res.lost = [j.id for j in ours if res.row(j) is None]
        lost = {job.attempt for job in self.beaten(ours, res)}
        with self._inflight_lock:
            for job in jobs:
                if job.attempt in lost:
                    self._drop_held(job.attempt)
                elif job.attempt in self._deadline:
                    self._deadline[job.attempt] = sent + self.lease
                    self._lapsed.discard(job.attempt)
        return True

    def _note_lapsed(self, now: float) -> None:
        """Count the held jobs whose lease ended before a heartbeat reached the server.

        Their handlers run on; if a sweep took the job meanwhile, the fence refuses the
        outcome (LeaseLost, counted as ``lease_lost``) and the job runs elsewhere.
        """
        with self._inflight_lock:
            new = [a for a, d in self._deadline.items() if d <= now and a not in self._lapsed]
            self._lapsed.update(new)
        if new:
            self.stats.add(leases_lapsed=len(new))
            logger.warning(
                "worker %s: lease of job(s) %s ended before a heartbeat reached the server",
                self.name,
                ", ".join(str(job_id) for job_id, _ in sorted(new, key=lambda a: a[0])[:20]),
            )

    # -- liveness and the listener ---------------------------------------------------------

    def _liveness_loop(self) -> None:
        """Keep this worker's liveness mark and give back dead workers' jobs, until the
        last result is written: the mark must outlive every write the worker owes."""
        live = self._liveness()
        trouble = Trouble(self.name, "liveness check")
        try:
            while not self._beats_done.is_set():
                try:
                    with self._steps.step(self.MARK):
                        n = live.step()
                    trouble.ok()
                except _DB_ERRORS as exc:
                    trouble.failed(exc, "trying again")
                    n = 0
                if n:
                    self.dead_swept(n)
                    self._wake.set()
                self._mark_now.wait(live.pause(trouble.failures, self.LIVENESS_INTERVAL))
                self._mark_now.clear()
        finally:
            live.close()

    def _listen_loop(self) -> None:
        wanted = set(self.queues)
        channel = sql.Identifier(channel_name(self._settings.schema))
        failures = 0
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self._settings.dsn, **self._settings.connect_kwargs()) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(channel))
                    failures = 0
                    self._wake.set()  # whatever was enqueued while we were away
                    if self.inflight():
                        self._beat_now.set()  # and any cancel announced meanwhile
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if note.payload in wanted:
                                self._wake.set()
                            elif self._holds(self.cancel_target(note.payload)):
                                self._beat_now.set()
            except psycopg.Error as exc:
                failures += 1
                self._mark_now.set()  # the liveness connection may be gone too
                if failures == 1:
                    logger.info("worker %s: listener reconnecting (%s)", self.name, one_line(exc))
                # At once the first time, then a short capped backoff, like the lanes.
                if failures > 1:
                    self._stopping.wait(backoff(failures - 1, base=0.025, cap=self._retry_cap))

    def _holds(self, job_id: int | None) -> bool:
        with self._inflight_lock:
            return any(job_id == held_id for held_id, _ in self._inflight)

    # -- upkeep ----------------------------------------------------------------------------

    def _sweep(self) -> None:
        assert self._q is not None
        start = time.monotonic()
        if self._register_due(start):
            try:
                self._q.register_worker(self.name, queues=self.queues, tasks=self.tasks)
                self._registered(start)
            except _DB_ERRORS as exc:
                self._upkeep_failed("register", exc)
        window = self._sweeps.window(start)
        try:
            n = self._q.sweep(window=window)
        except _DB_ERRORS as exc:
            self._upkeep_failed("sweep", exc)
            return
        self.swept(n, window, start)
        if n:
            self._wake.set()
        self._upkeep_wanted.set()

    def _upkeep_loop(self) -> None:
        """Run the generations' upkeep (:meth:`Queue.upkeep`) after each sweep, on a
        thread and a connection of its own.

        A step moves up to 2,000 finished jobs (10-30 ms), and after a burst a call takes
        several in a row: on the claim loop, no claim went out meanwhile (300-450 ms of
        steps were sampled inside one burst;
        bench/results/2026-12-04-held-burst-and-full-run-on-0009.md).
        """
        assert self._uq is not None
        while True:
            self._upkeep_wanted.wait()
            self._upkeep_wanted.clear()
            for _ in range(self.UPKEEP_MAX_STEPS):
                if self._stopping.is_set():
                    return
                start = time.monotonic()
                try:
                    done = self._uq.upkeep(max_steps=1)
                except _DB_ERRORS as exc:
                    self._upkeep_failed("upkeep", exc)
                    break
                if not done or "busy" in done:
                    break
                self._stopping.wait(self._upkeep_rest(time.monotonic() - start))

    def _prune(self) -> None:
        assert self._q is not None and self.retention is not None
        try:
            self._q.prune(older_than=self.retention)
        except _DB_ERRORS as exc:
            self._upkeep_failed("prune", exc)

    # -- shutdown --------------------------------------------------------------------------

    def _shutdown(self) -> None:
        assert self._q is not None and self._pool is not None
        unstarted = self._pool.drain_unstarted()
        if unstarted:
            self._release(unstarted)
        grace = 0.0 if self._hard_stop.is_set() else self.shutdown_grace
        if not self._pool.wait_idle(grace):
            left = self._pool.running_jobs()
            self.abandon(left, grace)
            self._forget(left)
        for chain in self._chains:
            chain.results.put(None)
        self._stopping.set()
        self._upkeep_wanted.set()
        end = time.monotonic() + max(grace, 1.0) + 5.0
        for writer in self._writers:
            writer.join(timeout=max(0.0, end - time.monotonic()))
        # Outcomes no write could deliver in that time are given up (logged by their
        # writer): those jobs run again once their leases run out, as for a handler
        # abandoned at the grace.  Nothing of this worker may run on after run().
        self._give_up_writes.set()
        for writer in self._writers:
            writer.join(timeout=10.0)
            if writer.is_alive():
                logger.error("worker %s: %s did not stop", self.name, writer.name)
        # Leases are kept while the writers still owed results; now they can go.
        self._beats_done.set()
        self._beat_now.set()
        self._mark_now.set()
        for t in self._threads:
            t.join(timeout=max(grace, 1.0) + 5.0)
            if t.is_alive():
                logger.error("worker %s: %s did not stop", self.name, t.name)
        self._pool.shutdown()
        try:
            self._q.unregister_worker(self.name)
        except _DB_ERRORS as exc:
            self._upkeep_failed("unregister", exc)  # the row ages out; status ignores it
        for lane in self._lanes:
            lane.close()
        self._running = False
        logger.info("worker %s stopped: %s", self.name, self.stats.snapshot())

    def _release(self, jobs: list[Job]) -> None:
        assert self._q is not None
        for attempt in range(1, 6):
            try:
                self.released(jobs, self._q.release_many(jobs))
                self._forget(jobs)
                return
            except _DB_ERRORS as exc:
                logger.warning("worker %s: release failed (%s)", self.name, one_line(exc))
                time.sleep(backoff(attempt))
        self._forget(jobs)
