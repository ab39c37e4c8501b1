"""AsyncWorker: ``async def`` handlers on one event loop, with Worker's guarantees.

Tasks and their one job each:

- ``run`` claims up to free capacity, starts a task per job, sweeps and prunes;
- a writer per chain batches the outcomes of the jobs its chain claimed into fenced
  writes, and claims the slots they free in the same transaction; the first also
  heartbeats every held job, in one statement (the same statements and accounting as
  ``Worker``: the parts ``_workerbase`` composes).  With two chains (the default
  from concurrency 4), one chain's handlers run while the other's transaction is on
  the server;
- the listener LISTENs for enqueues (wakes the claim) and for cancels of held jobs
  (beats at once, so a cancelled handler's task is cancelled within a round trip);
- one task per handler, and nothing else per job: a done callback hands its outcome
  to the writer, a timer (only with a timeout) cancels it at ``job_timeout``, and the
  heartbeat cancels the task of a job whose cancel it brought back.  A handler past its
  timeout has its attempt failed at once; if it swallows the cancellation it is
  abandoned, not awaited, so a stuck coroutine cannot hold the worker (one that blocks
  the loop itself can: keep blocking calls in ``asyncio.to_thread``).

Nothing holds a transaction while a handler runs; the lease token guards every write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from ._aqueue import AsyncQueue
from ._base import QueueBase, backoff
from ._cursor import ClaimCursor
from ._errors import ConfigError, SkiplockError
from ._handlers import Handler, Outcome, RunTime, contained, failed_outcome, ok_outcome
from ._health import DEFAULT_HOST, DEFAULT_STALL
from ._job import Attempt, Job
from ._ops import FenceResult
from ._periodic import Periodic, PeriodicScheduler
from ._queue import Queue
from ._sql import channel_name
from ._wclaims import Chain
from ._wcore import Trouble, WorkerStats, one_line
from ._workerbase import WorkerBase

__all__ = ["AsyncWorker"]

logger = logging.getLogger("skiplock.worker")

_DB_ERRORS = (psycopg.Error, SkiplockError)


class AsyncWorker(WorkerBase):
    """Runs ``async def`` handlers for jobs of one or more queues, on one event loop.

    The arguments and their meaning are ``Worker``'s (see there), except that
    handlers must be coroutine functions.  ``prefetch`` works as there: by default
    about as many jobs beyond ``concurrency`` as the handlers finish during one claim
    round trip (up to 2 x concurrency or 256, whichever is larger), so short jobs are
    claimed and completed in batches instead of a few at a time.  Run it with
    ``await worker.run()``; ``worker.stop()`` (from the loop, a signal handler or
    another thread) ends it gracefully.  ``fuse_claims`` (on by default, as in
    ``Worker``) sends each batch of completions and the claim of the slots it frees in
    one pipelined transaction, on one pooled connection (psycopg's async pipeline);
    ``fuse_claims=False`` completes and claims in transactions of their own.
    ``chains`` as in ``Worker``: default 2 with ``fuse_claims`` from concurrency 4,
    each writing on a pooled connection of its own (docs/architecture.md, "Two chains in
    one Worker").  ``health_port``, ``health_host`` and ``health_stall`` as in
    ``Worker``; /livez also fails when the event loop has not run a callback for
    ``health_stall`` seconds (a handler that blocks it).
    """

    def __init__(
        self,
        queue: QueueBase,
        handler: Handler | Mapping[str, Handler],
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 16,
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
        for queue_name, fn in self._handlers.items():
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(
                    f"AsyncWorker needs async def handlers; the one for {queue_name!r} is "
                    "not (use Worker for plain functions)"
                )
        self._q: AsyncQueue | None = None
        self._fixed_prefetch = None if prefetch is None else max(0, prefetch)
        self._runtime = RunTime()
        self._chains = [
            _AChain(i, *share)
            for i, share in enumerate(self._chain_shares(chains, self._fixed_prefetch))
        ]
        # The first writer heartbeats: no loop of its own to watch.
        self._watch(len(self._chains), heartbeat=False)
        # When the health thread asked the event loop to run a callback it has not run
        # yet (_stuck): a handler that blocks the loop stops every step at once.
        self._ping_sent: float | None = None
        # The chain that claimed each job held, and writes its outcome.
        self._chain_of: dict[Attempt, _AChain] = {}
        # Jobs a writer is writing: a heartbeat (the first chain's writer) that finds
        # one no longer running may be seeing another chain's completion, not a loss.
        self._writing: set[Attempt] = set()
        self._held: dict[Attempt, Job] = {}  # claimed and not yet written back
        self._unstarted: deque[Job] = deque()  # held, waiting for a free handler slot
        # The running handlers' tasks; a task leaves when its outcome is handed to the
        # writer (or it is abandoned), so its done callback then finds it gone.
        self._tasks: dict[Attempt, asyncio.Task[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._upkeep_wanted: asyncio.Event | None = None  # set by each sweep
        self._beat_now: asyncio.Event | None = None
        self._mark_now: asyncio.Event | None = None  # the listener's connection broke
        self._stop_requested = False
        self._hard = False
        self._give_up_writes = False

    # -- run and stop ----------------------------------------------------------------------

    async def run(self) -> WorkerStats:
        """Run until ``stop()``; returns the final counters."""
        if self._loop is not None:
            raise RuntimeError("worker already running")
        self._loop = asyncio.get_running_loop()
        self._stopping, self._wake, self._beat_now, self._upkeep_wanted, self._mark_now = (
            asyncio.Event(),
            asyncio.Event(),
            asyncio.Event(),
            asyncio.Event(),
            asyncio.Event(),
        )
        for chain in self._chains:
            chain.outcomes, chain.lock = asyncio.Queue(), asyncio.Lock()
        if self._stop_requested:
            self._stopping.set()
        # Claims, each writer and the upkeep task hold one at a time; one spare.
        size = 3 + len(self._chains)
        self._q = AsyncQueue.from_settings(self._settings, min_size=1, max_size=size)
        await self._q.open()
        try:
            self._start_health()
        except BaseException:
            await self._q.close()
            self._loop = None
            raise
        helpers = [
            asyncio.create_task(
                self._writer(chain), name=f"skiplock-{self.name}-writer-{chain.index}"
            )
            for chain in self._chains
        ]
        helpers.append(
            asyncio.create_task(self._upkeep_loop(), name=f"skiplock-{self.name}-upkeep")
        )
        if self.listen:
            helpers.append(
                asyncio.create_task(self._listener(), name=f"skiplock-{self.name}-listen")
            )
        periodic_stop = threading.Event()
        if self.periodic:
            helpers.append(asyncio.create_task(self._periodic(periodic_stop)))
        if self.liveness:
            # Cancelled with the other helpers, after the writer: the mark outlives
            # every write this worker owes.
            helpers.append(asyncio.create_task(self._keep_liveness()))
        logger.info(
            "async worker %s: queues %s, concurrency %d, lease %gs, %d chain(s)",
            self.name,
            ",".join(self.queues),
            self.concurrency,
            self.lease,
            len(self._chains),
        )
        try:
            await self._claim_loop()
        finally:
            periodic_stop.set()
            try:
                await self._shutdown(helpers)
            finally:
                await asyncio.to_thread(self._stop_health)
                self._ping_sent = None
        return self.stats

    def stop(self, *, graceful: bool = True) -> None:
        """Stop claiming; with ``graceful``, running handlers get ``shutdown_grace``.

        Safe from any thread or a signal handler.
        """
        self._stop_requested = True
        self._hard = self._hard or not graceful
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._signal_stop)

    def _signal_stop(self) -> None:
        assert self._stopping is not None and self._wake is not None
        self._stopping.set()
        self._wake.set()

    def _stop_asked(self) -> bool:
        return self._stop_requested

    def inflight(self) -> list[Job]:
        return list(self._held.values())

    async def _periodic(self, stop: threading.Event) -> None:
        # Periodic rounds are rare (at most one per tick): the sync scheduler, with its
        # own small pool, in a thread keeps one copy of that logic.
        q = Queue.from_settings(self._settings, min_size=1, max_size=1)
        try:
            scheduler = PeriodicScheduler(q, self.periodic, stop=stop, name=f"worker {self.name}")
            await asyncio.to_thread(scheduler.run)
        finally:
            q.close()

    def _stuck(self, now: float) -> dict[str, float]:
        stuck = super()._stuck(now)
        loop, sent = self._loop, self._ping_sent
        if sent is not None and now - sent > self.health_stall:
            stuck["event loop"] = now - sent
        elif sent is None and loop is not None:
            self._ping_sent = now
            try:
                loop.call_soon_threadsafe(self._pong)
            except RuntimeError:  # the loop closed meanwhile
                self._ping_sent = None
        return stuck

    def _pong(self) -> None:
        self._ping_sent = None

    def _chain_list(self) -> Sequence[Chain]:
        return self._chains

    def _mean_runtime_now(self) -> float:
        return self._runtime.value

    # -- the claim chain -------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        assert self._stopping is not None and self._wake is not None
        self._upkeep_from(time.monotonic())
        failures = 0
        steps = self._steps
        while not self._stopping.is_set():
            # A turn's work is one step for /livez; its waits are not (steps.end).
            steps.begin(self.CLAIM_LOOP)
            now = time.monotonic()
            if self._sweep_due(now):
                await self._sweep()
            if self._prune_due(now):
                await self._prune()
            try:
                for chain in self._chains:
                    if free := self._claim_due(chain):
                        self._set_more(chain, await self._claim_some(free, chain))
                failures = 0
            except _DB_ERRORS as exc:
                failures += 1
                self.stats.add(db_errors=1)
                if failures == 1 or failures % 20 == 0:
                    logger.warning(
                        "worker %s: claim failed (%s); retrying", self.name, one_line(exc)
                    )
                steps.end(self.CLAIM_LOOP)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._stopping.wait(), backoff(failures, base=0.05, cap=5.0)
                    )
                continue
            if any(self._refill_due(chain) for chain in self._chains):
                continue  # more work is waiting and a batch fits: claim again at once
            # Full, a finishing job wakes us; after a full claim we claim again at once.
            busy = self._more or all(self._free(chain) <= 0 for chain in self._chains)
            if await self._say_waiting(busy, now):
                continue  # claim again now that producers notify us
            now = time.monotonic()
            timeout = self._until_upkeep(self._look_again_in(self.poll_interval, now), now)
            steps.end(self.CLAIM_LOOP)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
        steps.end(self.CLAIM_LOOP)

    async def _say_waiting(self, busy: bool, now: float) -> bool:
        """Write a change of ``waiting`` to our row; True if we turned to waiting."""
        assert self._q is not None
        change = self._waiting_change(busy, now)
        if change is None:
            return False
        try:
            await self._q.worker_waiting(self.name, change)
        except _DB_ERRORS as exc:
            self._waiting_failed(exc, now)
            return False
        self._said_waiting(change, now)
        return change

    async def _claim_some(self, free: int, chain: _AChain) -> bool:
        """Claim up to ``free`` jobs across the queues for ``chain``; True if a queue
        may hold more."""
        assert self._q is not None and self._stopping is not None
        assert chain.lock is not None
        more = False
        async with chain.lock:
            free = min(free, self._free(chain))
            for name in self._queue_order():
                if free <= 0 or self._stopping.is_set():
                    break
                claim = self._claim_round(name, free, chain.cursor)
                jobs = await self._q.claim(**self._claim_args(claim))
                rtt = self._claim_landed(claim, jobs)
                self._claim_rtt += 0.1 * (rtt - self._claim_rtt)
                self._take(name, jobs, rtt, chain)
                more = more or len(jobs) == free
                free -= len(jobs)
        return more

    def _take(self, name: str, jobs: Sequence[Job], rtt: float, chain: _AChain) -> None:
        """Hold the jobs a claim for ``chain`` returned and start as many as handler
        slots allow."""
        chain.held += len(jobs)
        for job in jobs:
            self._held[job.attempt] = job
            self._chain_of[job.attempt] = chain
        self._claimed(name, jobs, rtt)
        self._unstarted.extend(jobs)
        self._start_unstarted()

    # -- handlers --------------------------------------------------------------------------

    def _start_unstarted(self) -> None:
        """Start held jobs while a handler slot is free (not once stopping: the
        shutdown releases those still waiting)."""
        assert self._stopping is not None
        while self._unstarted and len(self._tasks) < self.concurrency:
            if self._stopping.is_set():
                return
            self._start(self._unstarted.popleft())

    def _start(self, job: Job) -> None:
        assert self._loop is not None
        self._emit("started", job)
        timeout = self.timeout_for(job)
        task = self._loop.create_task(
            contained(self._handlers[job.queue], job), name=f"skiplock-job-{job.id}"
        )
        self._tasks[job.attempt] = task
        timer = (
            self._loop.call_later(timeout, self._time_out, job, task, timeout) if timeout else None
        )
        task.add_done_callback(
            functools.partial(self._handler_done, job, timer, timeout, time.monotonic())
        )
        if job.cancelled:
            task.cancel()  # cancelled before it started

    def _handler_done(
        self,
        job: Job,
        timer: asyncio.TimerHandle | None,
        timeout: float | None,
        began: float,
        task: asyncio.Task[Any],
    ) -> None:
        """The handler's task ended: classify it and hand the outcome to the writer."""
        if timer is not None:
            timer.cancel()
        if self._tasks.get(job.attempt) is not task:
            return  # timed out (reported then) or abandoned at shutdown
        del self._tasks[job.attempt]
        self._runtime.add(time.monotonic() - began)
        if task.cancelled():
            if job.cancelled:
                outcome = failed_outcome(asyncio.CancelledError(), job, timeout)
            else:  # cancelled by the handler itself or a stranger: try again later
                outcome = Outcome("retry", "the handler's task was cancelled")
        elif (exc := task.exception()) is not None:
            outcome = failed_outcome(exc, job, timeout)
        else:
            outcome = ok_outcome(job, task.result(), self._settings.max_result_bytes)
        self._hand_over(job, outcome)

    def _time_out(self, job: Job, task: asyncio.Task[Any], timeout: float) -> None:
        """Past its timeout: cancel the handler and report now.  One that ignores the
        cancellation is abandoned, like a hung thread in Worker."""
        if self._tasks.get(job.attempt) is not task:
            return
        del self._tasks[job.attempt]
        task.cancel()
        task.add_done_callback(_log_abandoned)
        self._hand_over(job, self._timed_out(job, timeout))

    def _hand_over(self, job: Job, outcome: Outcome) -> None:
        """To the writer of the chain that claimed the job."""
        outcomes = self._chain_of.get(job.attempt, self._chains[0]).outcomes
        assert outcomes is not None
        outcomes.put_nowait((job, outcome))
        self._start_unstarted()  # its slot is free

    def _cancel_requested(self) -> None:
        """Cancel the handlers of jobs a heartbeat found cancelled."""
        for attempt, task in list(self._tasks.items()):
            job = self._held.get(attempt)
            if job is not None and job.cancelled and not task.done():
                task.cancel()

    # -- the writer ------------------------------------------------------------------------

    async def _writer(self, chain: _AChain) -> None:
        """Write ``chain``'s outcomes; the first chain's writer also heartbeats every
        job the worker holds, whatever chain claimed it."""
        outcomes = chain.outcomes
        assert outcomes is not None and self._beat_now is not None
        beats = chain.index == 0
        loop = self._writer_loop_name(chain.index)
        pending: list[tuple[Job, Outcome]] = []
        next_beat = time.monotonic() + self.heartbeat_interval if beats else math.inf
        failures = 0
        stop = False
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            if pending:
                timeout = min(timeout, backoff(max(failures, 1), base=0.05, cap=2.0))
            if not stop:
                getter = asyncio.ensure_future(outcomes.get())
                waits: set[asyncio.Future[Any]] = {getter}
                if beats:
                    waits.add(asyncio.ensure_future(self._beat_now.wait()))
                await asyncio.wait(
                    waits,
                    timeout=None if math.isinf(timeout) else timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for waiting in waits - {getter}:
                    waiting.cancel()
                if getter.done():
                    stop = await self._gather_outcomes(getter.result(), pending, outcomes)
                else:
                    getter.cancel()
                if beats and self._beat_now.is_set():
                    self._beat_now.clear()
                    next_beat = time.monotonic()
            if stop and not pending:
                return
            if pending:
                try:
                    with self._steps.step(loop):
                        await self._write(pending, chain, recheck=failures > 0)
                    pending = []
                    failures = 0
                except Exception as exc:
                    failures += 1
                    self.stats.add(db_errors=1)
                    if failures == 1 or failures % 20 == 0:
                        logger.warning(
                            "worker %s: writing %d result(s) failed (%s); will retry",
                            self.name,
                            len(pending),
                            one_line(exc),
                        )
                    if stop:
                        if self._hard or self._give_up_writes:
                            logger.warning(
                                "worker %s: %d result(s) unwritten at exit",
                                self.name,
                                len(pending),
                            )
                            return
                        await asyncio.sleep(backoff(failures, base=0.05, cap=2.0))
            if time.monotonic() >= next_beat:
                with self._steps.step(loop):
                    await self._heartbeat()
                next_beat = time.monotonic() + self.heartbeat_interval

    async def _gather_outcomes(
        self,
        first: tuple[Job, Outcome] | None,
        pending: list[tuple[Job, Outcome]],
        outcomes: asyncio.Queue[tuple[Job, Outcome] | None],
    ) -> bool:
        """Add ``first`` and the outcomes queued after it to ``pending``, letting
        handlers that are ready to run finish first; True if the end-of-work marker
        (None) came.

        Woken by the first outcome, the writer wrote no-op jobs in batches about half
        the threaded worker's (39 against 68 at concurrency 8), one round trip each: a
        finished handler starts the next held job, which runs one pass of the loop
        later and hands its outcome over one pass after that.  So this yields to the
        loop until two passes in a row bring nothing: a slow handler holds the write
        back by two passes, not by its run time.
        """
        got: list[tuple[Job, Outcome] | None] = [first]
        idle = 0
        while True:
            for item in got:
                if item is None:
                    return True
                pending.append(item)
            idle = 0 if got else idle + 1
            if idle >= 2:
                return False
            await asyncio.sleep(0)
            got = []
            while not outcomes.empty():
                got.append(outcomes.get_nowait())

    async def _write(
        self, batch: list[tuple[Job, Outcome]], chain: _AChain, recheck: bool = False
    ) -> None:
        assert self._q is not None and self._stopping is not None
        self._writing.update(job.attempt for job, _ in batch)
        done, failed = self.split(batch)
        if done:
            if self.fuse_claims and not self._stopping.is_set():
                res = await self._complete_and_claim(done, chain, recheck)
            else:
                res = await self._q.complete_many(done, _recheck=recheck)
            self.completed(done, res)
            self._forget([job for job, _ in done])
            batch[:] = [it for it in batch if it[1].kind != "ok"]  # a retry must not repeat them
        if failed:
            res = await self._q.fail_many(failed, _recheck=recheck)
            self.handed_back(failed, res)
            self._forget([j for j, *_ in failed])

    async def _complete_and_claim(
        self, done: list[tuple[Job, Any]], chain: _AChain, recheck: bool
    ) -> FenceResult:
        """Complete ``done`` and claim the slots it frees, in one pipelined transaction
        (``AsyncQueue._complete_and_claim``; what a failure means is said there)."""
        assert self._q is not None and chain.lock is not None
        assert self._stopping is not None
        q = self._q
        if chain.lock.locked():
            # The claim loop is claiming: it claims the slots freed here next (_forget
            # wakes it).  Waiting for its claim would hold back the heartbeats, which
            # this task sends too.
            return await q.complete_many(done, _recheck=recheck)
        async with chain.lock:
            fused = self._fused_round(q, self._free(chain) + len(done), chain.cursor)
            if fused is None:
                return await q.complete_many(done, _recheck=recheck)
            claim, op = fused
            res, claimed = await q._complete_and_claim(done, op, recheck=recheck)
            rtt = self._claim_landed(claim, claimed)
            if self._stopping.is_set():
                # Stopped meanwhile: the shutdown may already be waiting on the tasks
                # it saw; these would start behind its back.
                self.released(claimed, await q.release_many(claimed))
                return res
            self._take(claim.queue, claimed, rtt, chain)
        return res

    def _drop_held(self, attempt: Attempt) -> None:
        """Stop holding ``attempt``; its chain's writer may still owe its outcome, so
        the job keeps its chain until ``_forget``."""
        if self._held.pop(attempt, None) is not None:
            self._chain_of[attempt].held -= 1

    def _forget(self, jobs: Sequence[Job]) -> None:
        for job in jobs:
            self._drop_held(job.attempt)
            self._chain_of.pop(job.attempt, None)
            self._writing.discard(job.attempt)
        if self._wake is not None:
            self._wake.set()  # a slot is free

    # -- the heartbeat ---------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        assert self._q is not None
        jobs = self.inflight()
        if not jobs:
            return
        writing = set(self._writing)
        try:
            res = await self._q.heartbeat_many(jobs, lease=self.lease)
        except Exception as exc:
            self.stats.add(db_errors=1)
            self._missed(jobs)
            logger.warning("worker %s: heartbeat failed (%s)", self.name, one_line(exc))
            return
        # Another chain's writer may have completed some of them meanwhile: its own
        # fenced answer says what happened to those, not this beat.
        writing |= self._writing
        ours = self._ours(jobs, writing, self._held)
        for job in self.beaten(ours, res):
            self._drop_held(job.attempt)
        self._cancel_requested()

    # -- liveness and the listener ---------------------------------------------------------

    async def _keep_liveness(self) -> None:
        """The liveness mark and sweep_dead (see _liveness.py), on a thread: one small
        statement every quarter second, on a connection of its own."""
        assert self._wake is not None and self._mark_now is not None
        live = self._liveness()
        trouble = Trouble(self.name, "liveness check")
        try:
            while True:
                try:
                    with self._steps.step(self.MARK):
                        n = await asyncio.to_thread(live.step)
                    trouble.ok()
                except _DB_ERRORS as exc:
                    trouble.failed(exc, "trying again")
                    n = 0
                if n:
                    self.dead_swept(n)
                    self._wake.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._mark_now.wait(), live.pause(trouble.failures, self.LIVENESS_INTERVAL)
                    )
                self._mark_now.clear()
        finally:
            # A step still running in its thread holds the lane: close waits for it.
            await asyncio.to_thread(live.close)

    async def _listener(self) -> None:
        assert self._stopping is not None and self._wake is not None
        assert self._beat_now is not None and self._mark_now is not None
        wanted = set(self.queues)
        channel = sql.Identifier(channel_name(self._settings.schema))
        failures = 0
        while not self._stopping.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self._settings.dsn, **self._settings.connect_kwargs()
                )
                async with conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                    failures = 0
                    self._wake.set()  # whatever was enqueued while we were away
                    if self._held:
                        self._beat_now.set()  # and any cancel announced meanwhile
                    while not self._stopping.is_set():
                        async for note in conn.notifies(timeout=0.5):
                            if note.payload in wanted:
                                self._wake.set()
                            else:
                                target = self.cancel_target(note.payload)
                                if any(target == job_id for job_id, _ in self._held):
                                    self._beat_now.set()
            except psycopg.Error as exc:
                failures += 1
                self._mark_now.set()  # the liveness connection may be gone too
                if failures == 1:
                    logger.info("worker %s: listener reconnecting (%s)", self.name, one_line(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._stopping.wait(), backoff(failures, base=0.1, cap=5.0)
                    )

    # -- upkeep ----------------------------------------------------------------------------

    async def _sweep(self) -> None:
        assert self._q is not None and self._wake is not None
        start = time.monotonic()
        if self._register_due(start):
            try:
                await self._q.register_worker(self.name, queues=self.queues, tasks=self.tasks)
                self._registered(start)
            except _DB_ERRORS as exc:
                self._upkeep_failed("register", exc)
        window = self._sweeps.window(start)
        try:
            n = await self._q.sweep(window=window)
        except _DB_ERRORS as exc:
            self._upkeep_failed("sweep", exc)
            return
        self.swept(n, window, start)
        if n:
            self._wake.set()
        assert self._upkeep_wanted is not None
        self._upkeep_wanted.set()

    async def _upkeep_loop(self) -> None:
        """Run the generations' upkeep after each sweep, in a task of its own (on a
        connection of the pool), so that its steps never hold back a claim: see
        ``Worker._upkeep_loop``.  Cancelled at shutdown with the other helpers."""
        assert self._q is not None and self._upkeep_wanted is not None
        while True:
            await self._upkeep_wanted.wait()
            self._upkeep_wanted.clear()
            for _ in range(self.UPKEEP_MAX_STEPS):
                start = time.monotonic()
                try:
                    done = await self._q.upkeep(max_steps=1)
                except _DB_ERRORS as exc:
                    self._upkeep_failed("upkeep", exc)
                    break
                if not done or "busy" in done:
                    break
                await asyncio.sleep(self._upkeep_rest(time.monotonic() - start))

    async def _prune(self) -> None:
        assert self._q is not None and self.retention is not None
        try:
            await self._q.prune(older_than=self.retention)
        except _DB_ERRORS as exc:
            self._upkeep_failed("prune", exc)

    # -- shutdown --------------------------------------------------------------------------

    async def _shutdown(self, helpers: list[asyncio.Task[None]]) -> None:
        assert self._q is not None
        grace = 0.0 if self._hard else self.shutdown_grace
        unstarted = list(self._unstarted)
        self._unstarted.clear()
        if unstarted:
            await self._release(unstarted)
        running = list(self._tasks.values())
        if running:
            _, late = await asyncio.wait(running, timeout=grace) if grace > 0 else (set(), running)
            if late:
                cut = {a: t for a, t in self._tasks.items() if t in late}
                left = [self._held[a] for a in cut if a in self._held]
                self.abandon(left, grace)
                for attempt, task in cut.items():
                    del self._tasks[attempt]  # its done callback must not report it
                    task.cancel()
                # Their outcomes are not written: the jobs run again after the lease.
                self._forget(left)
        writers, others = helpers[: len(self._chains)], helpers[len(self._chains) :]
        for chain in self._chains:
            assert chain.outcomes is not None
            chain.outcomes.put_nowait(None)
        _, late_writers = await asyncio.wait(writers, timeout=max(grace, 1.0) + 5.0)
        if late_writers:
            # Outcomes no write could deliver in that time are given up (each writer
            # logs how many): those jobs run again once their leases run out.  Nothing
            # of this worker may run on after run() returns.
            self._give_up_writes = True
            _, stuck = await asyncio.wait(late_writers, timeout=5.0)
            for task in stuck:
                logger.warning("worker %s: %s cancelled at exit", self.name, task.get_name())
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        try:
            await self._q.unregister_worker(self.name)
        except _DB_ERRORS as exc:
            self._upkeep_failed("unregister", exc)  # the row ages out; status ignores it
        await self._q.close()
        self._loop = None
        logger.info("async worker %s stopped: %s", self.name, self.stats.snapshot())

    async def _release(self, jobs: list[Job]) -> None:
        """Give back held jobs no handler started (a stop): released, not failed."""
        assert self._q is not None
        for attempt in range(1, 6):
            try:
                self.released(jobs, await self._q.release_many(jobs))
                break
            except _DB_ERRORS as exc:
                logger.warning("worker %s: release failed (%s)", self.name, one_line(exc))
                await asyncio.sleep(backoff(attempt))
        self._forget(jobs)


class _AChain(Chain):
    """A chain (see ``Chain``) of the async worker: the outcomes its writer owes, and
    the lock its claims take (both made on the worker's loop, in ``run``)."""

    def __init__(self, index: int, share: int, fixed_prefetch: int | None, cursor: ClaimCursor):
        super().__init__(index, share, fixed_prefetch, cursor)
        self.outcomes: asyncio.Queue[tuple[Job, Outcome] | None] | None = None
        # Held by whoever claims for this chain (the claim loop, or its writer), from
        # counting its free slots to holding the jobs: two claims awaited at once would
        # both count the same slots free.
        self.lock: asyncio.Lock | None = None


def _log_abandoned(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        # INFO: the attempt's WARNING or ERROR line was logged at the timeout.
        logger.info("an abandoned handler returned after its timeout; result dropped")
