"""What Worker and AsyncWorker share: settings, counters, events, and what a write meant.

The two workers differ only in how they wait (threads or tasks).  Everything that
decides something lives here once: checking the arguments, how handler outcomes become
fenced writes, and what each statement's answer means for the counters, the events and
the jobs still held.  The statements themselves are the queue's (``_aqueue.py``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

from ._base import MakeOp, QueueBase, QueueSettings, _clamp_delay
from ._config import validate_queue
from ._control import error_line
from ._cursor import ClaimCursor, SweepCursor
from ._errors import ConfigError, SkiplockError, one_line
from ._handlers import CANCELLED, Handler, Outcome
from ._health import DEFAULT_HOST, DEFAULT_STALL, HealthServer, Steps
from ._job import Attempt, Job
from ._liveness import Liveness
from ._ops import ClaimPosition, FenceResult
from ._periodic import Periodic, check_periodic

__all__ = [
    "ClaimRound",
    "Trouble",
    "WorkerBase",
    "WorkerStats",
    "default_worker_name",
    "error_summary",
    "log_job",
    "one_line",
    "stop_on_signals",
]

logger = logging.getLogger("skiplock.worker")

Event = Callable[[str, Job], None]
Measure = Callable[[str, float, str | None], None]


@dataclass
class WorkerStats:
    """Counters of one worker's life; read them while it runs or after."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    released: int = 0
    timed_out: int = 0
    lease_lost: int = 0
    heartbeats: int = 0
    # Held jobs whose lease ended before a heartbeat reached the server (an outage
    # longer than what was left of the lease): their outcome may then be refused.
    leases_lapsed: int = 0
    sweeps_recovered: int = 0
    db_errors: int = 0
    # Handlers still running when the shutdown grace ended: their outcomes are never
    # written, so those jobs run again once their leases run out.
    abandoned: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


def stop_on_signals(stop: Callable[[], None], grace: float, what: str = "jobs") -> None:
    """Call ``stop`` on the first SIGTERM or SIGINT; exit the process on a second.

    The worker's own signals never raise in a handler (no KeyboardInterrupt), so any
    that a handler sees is the handler's (``failed_outcome``).
    """
    count = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal count
        count += 1
        if count == 1:
            logger.info(
                "%s: finishing running %s (up to %gs); signal again to exit now",
                signal.Signals(signum).name,
                what,
                grace,
            )
            stop()
        else:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def error_summary(error: str | None) -> str | None:
    """The line of a handler's error text a log line has room for (``error_line``)."""
    return error_line(error)


def _seconds(delay: float) -> str:
    return f"{delay:.2g}s" if delay < 10 else f"{delay:.0f}s"


def log_job(
    worker: str,
    level: int,
    event: str,
    job: Job,
    text: str,
    *,
    error: str | None = None,
    delay: float | None = None,
) -> None:
    """Log one line about one attempt of a job, the same from both workers.

    The fields go on the record too (``extra``), so a JSON formatter can emit them
    without parsing the message.  The error's full text (a traceback) goes only to a
    second line at DEBUG: at WARNING and ERROR a line per failed attempt must stay one
    line, or a failing queue buries everything else in the log.
    """
    task = job.task  # the task layer's name for the job; None for handler-per-queue
    where = f"queue {job.queue}, task {task}" if task else f"queue {job.queue}"
    fields: dict[str, object] = {
        "worker": worker,
        "event": event,
        "job_id": job.id,
        "queue": job.queue,
        "task": task,
        "attempt": job.attempts,
        "max_attempts": job.max_attempts,
        "error": error_summary(error),
    }
    if delay is not None:
        fields["delay"] = round(delay, 3)
    logger.log(
        level,
        "worker %s: job %d (%s) attempt %d/%d %s",
        worker,
        job.id,
        where,
        job.attempts,
        job.max_attempts,
        text,
        extra=fields,
    )
    if error and "\n" in error.strip() and logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "worker %s: job %d attempt %d/%d error:\n%s",
            worker,
            job.id,
            job.attempts,
            job.max_attempts,
            error,
            extra={**fields, "event": "traceback"},
        )


class ClaimArgs(TypedDict):
    """A worker's claim, as the keyword arguments of ``claim`` and ``_claim_op``."""

    worker: str
    queue: str
    limit: int
    lease: float
    start: ClaimPosition | None
    tasks: Sequence[str] | None


@dataclass(frozen=True, slots=True)
class ClaimRound:
    """One claim statement a worker sends: of which queue, how many jobs at most, when
    it was sent (monotonic) and where in claim order it starts (``ClaimCursor``)."""

    queue: str
    limit: int
    began: float
    start: ClaimPosition | None
    cursor: ClaimCursor  # whose position it started from, and moves on landing


class Chain:
    """One claim-and-write path of a worker: its claim cursor, its share of the handlers
    and of a fixed prefetch, and how many jobs it holds (claimed by it, not yet written
    back).  Each worker adds the writer's side: a queue of outcomes and a claim lock.

    A job is written by the chain that claimed it, so each chain's fused transaction
    completes its own batch and claims the slots that batch frees, and the chains never
    wait for each other.  A chain is sized as a worker of its share would be (its own
    adaptive prefetch): half-sized batches cost the server more per job
    (docs/architecture.md, "Two chains in one Worker").
    """

    def __init__(self, index: int, share: int, fixed_prefetch: int | None, cursor: ClaimCursor):
        self.index = index
        self.share = share  # handlers this chain's jobs are counted against
        self.fixed_prefetch = fixed_prefetch
        self.cursor = cursor
        self.held = 0  # changed only with the jobs it counts (the worker's lock, or loop)
        self.more = False  # its last claim came back full: more work may wait


def split(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` as evenly as integers allow."""
    return total // parts + (1 if index < total % parts else 0)


class Trouble:
    """The log of one activity that keeps failing (claims, writes, heartbeats): a line
    when it starts failing or the reason changes, one when it works again; never a
    line per attempt, however long the outage (a read-only or full server)."""

    def __init__(self, worker: str, what: str) -> None:
        self.worker, self.what = worker, what
        self.failures = 0
        self._since = 0.0
        self._kind = ""

    def failed(self, exc: BaseException, retry: str = "backing off") -> int:
        """Count a failure (log it if it is news); returns the failures in a row."""
        self.failures += 1
        # The class says why, except for skiplock's own wrapper: then its cause does.
        cause = exc.__cause__ if isinstance(exc, SkiplockError) and exc.__cause__ else exc
        kind = type(cause).__name__
        if self.failures == 1 or kind != self._kind:
            if self.failures == 1:
                self._since = time.monotonic()
            logger.warning(
                "worker %s: %s failed (%s); %s, logged again when it works",
                self.worker,
                self.what,
                one_line(exc),
                retry,
            )
        self._kind = kind
        return self.failures

    def ok(self) -> None:
        if self.failures:
            logger.warning(
                "worker %s: %s works again after %d failure(s) over %.1fs",
                self.worker,
                self.what,
                self.failures,
                time.monotonic() - self._since,
            )
            self.failures, self._kind = 0, ""


class WorkerBase:
    """Arguments, counters and the meaning of fenced writes, for both workers."""

    def __init__(
        self,
        queue: QueueBase,
        handler: Handler | Mapping[str, Handler],
        *,
        queues: Sequence[str] | None,
        concurrency: int,
        lease: float,
        heartbeat_interval: float | None,
        name: str | None,
        poll_interval: float,
        sweep_interval: float,
        job_timeout: float | None,
        listen: bool,
        shutdown_grace: float,
        on_event: Event | None,
        on_measure: Measure | None,
        retention: float | None,
        prune_interval: float,
        synchronous_commit: bool,
        periodic: Sequence[Periodic] = (),
        tasks: Sequence[str] | None = None,
        task_timeouts: Mapping[str, float] | None = None,
        liveness: bool = True,
        fuse_claims: bool = True,
        health_port: int | None = None,
        health_host: str = DEFAULT_HOST,
        health_stall: float = DEFAULT_STALL,
    ) -> None:
        if isinstance(handler, Mapping):
            self._handlers: dict[str, Handler] = dict(handler)
            names = list(queues) if queues is not None else list(self._handlers)
        else:
            names = list(queues) if queues is not None else ["default"]
            self._handlers = dict.fromkeys(names, handler)
        if not names:
            raise ConfigError("a worker needs at least one queue")
        for q in names:
            validate_queue(q)
            if q not in self._handlers:
                raise ConfigError(f"no handler for queue {q!r}")
        if concurrency < 1:
            raise ConfigError("concurrency must be at least 1")
        if not lease > 0:
            raise ConfigError("lease must be positive")
        self.heartbeat_interval = heartbeat_interval or lease / 3.0
        if self.heartbeat_interval >= lease:
            raise ConfigError("heartbeat interval must be shorter than the lease")
        if job_timeout is not None and not job_timeout > 0:
            raise ConfigError(f"job timeout must be positive, not {job_timeout!r}")
        if health_port is not None and not (
            isinstance(health_port, int) and 0 <= health_port <= 65535
        ):
            raise ConfigError(f"health_port must be a port number (0-65535), not {health_port!r}")
        if not health_stall > 0:
            raise ConfigError(f"health_stall must be positive, not {health_stall!r}")
        self.health_port = health_port
        self.health_host = health_host
        self.health_stall = float(health_stall)
        # A socket already listening to serve health on (a --processes child's, made by
        # the supervisor), instead of binding health_host:health_port.
        self._health_socket: socket.socket | None = None
        self.health: HealthServer | None = None  # while run() runs with a health_port
        # The step each loop is in, for /livez; each worker names its loops (_watch).
        self._steps = Steps(())
        self.periodic = check_periodic(periodic)
        # The tasks this worker can run (None: every job of its queues).  Its claims take
        # only those, so a job of a task it does not know waits for a worker that does.
        self.tasks: list[str] | None = None if tasks is None else sorted(set(tasks))
        if self.tasks is not None and not self.tasks:
            raise ConfigError("a worker of tasks needs at least one task")
        self._registered_at: float | None = None
        # What this worker last wrote to its row's `waiting` (None: nothing yet, or the
        # row may be new), since when its claims come back full, and when to look again
        # after saying it waits (_waiting_change).
        self._told_waiting: bool | None = None
        self._more = False  # the last claim came back full: more work may wait
        self._busy_since: float | None = None
        self._look_again_at: float | None = None
        self._rotation = 0
        # When the claim loop next sweeps and prunes (_sweep_due, _prune_due).
        self._next_sweep = 0.0
        self._next_prune = math.inf
        self.queues = names
        self.concurrency = concurrency
        self.lease = float(lease)
        self.name = name or default_worker_name()
        self.poll_interval = poll_interval
        self.sweep_interval = sweep_interval
        self.job_timeout = job_timeout
        self._task_timeouts = dict(task_timeouts or {})
        for task_name, t in self._task_timeouts.items():
            if not t > 0:
                raise ConfigError(f"task {task_name!r}: timeout must be positive, not {t!r}")
        # The shortest timeout any job here may have: how often to look for overruns.
        every = [t for t in (job_timeout, *self._task_timeouts.values()) if t]
        self.shortest_timeout: float | None = min(every) if every else None
        self.listen = listen and not queue.settings.pooler  # LISTEN needs a session
        # A session-level mark needs a session of its own: not behind a pooler.
        self.liveness = liveness and not queue.settings.pooler
        self.shutdown_grace = shutdown_grace
        # The writer completes a batch and claims the slots it frees in one transaction
        # (``_fused_round``, the queue's ``_complete_and_claim``).
        self.fuse_claims = fuse_claims
        self.stats = WorkerStats()
        # Each claim starts past the last one (see ClaimCursor: a held xmin or a long
        # unvacuumed history would otherwise cost every claim a visit per dead entry).
        self._cursor = ClaimCursor()
        self._cursors = [self._cursor]  # and each further chain's (_chain_shares)
        self._claim_rtt = 0.002
        self._sweeps = SweepCursor()  # and each sweep looks back past the last one only
        self._on_event = on_event
        self._on_measure = on_measure
        # Attempts this worker timed out, until their hand-back says how they ended: that
        # line then says "timed out" (one line per attempt, not one per step).
        self._timeouts: set[Attempt] = set()
        # Attempts whose handler raised Retry: logged as asked for, not as a failure.
        self._requested: set[Attempt] = set()
        # Attempts a heartbeat already logged as lost: their write, refused later by the
        # fence, must not log them again.  Written by two threads in Worker.
        self._lost_logged: dict[Attempt, None] = {}
        self._log_lock = threading.Lock()
        self.retention = retention
        self.prune_interval = prune_interval
        self._settings: QueueSettings = replace(
            queue.settings,
            application_name=f"skiplock-worker:{self.name}",
            op_retries=2,
            synchronous_commit=synchronous_commit,
        )

    def stop(self, *, graceful: bool = True) -> None:
        raise NotImplementedError

    def handle_signals(self, what: str = "jobs") -> None:
        """Stop gracefully on the first SIGTERM or SIGINT, exit at once on a second.

        Call it in the main thread before ``run()``, as ``skiplock worker`` does.  At the
        second signal the process exits without writing the outcomes it owes: the
        leases of the jobs still held run out (or its session's mark goes with it) and
        another worker runs them again.
        """
        stop_on_signals(self.stop, self.shutdown_grace, what)

    # -- health: /livez and /readyz (_health.py) ----------------------------------------

    CLAIM_LOOP, HEARTBEAT, MARK = "claim loop", "heartbeat", "liveness mark"

    @staticmethod
    def _writer_loop_name(index: int) -> str:
        return "writer" if index == 0 else f"writer {index}"

    def _watch(self, chains: int, heartbeat: bool) -> None:
        """Name the loops whose steps /livez watches: the claim loop, a writer per chain,
        the heartbeat (its own loop in Worker, the first writer's in AsyncWorker) and
        the liveness mark."""
        loops = [self.CLAIM_LOOP, *(self._writer_loop_name(i) for i in range(chains))]
        if heartbeat:
            loops.append(self.HEARTBEAT)
        self._steps = Steps([*loops, self.MARK])

    def _stuck(self, now: float) -> dict[str, float]:
        """The loops stuck in one step for longer than ``health_stall``: their step's age."""
        return self._steps.stuck(now, self.health_stall)

    def _stop_asked(self) -> bool:
        raise NotImplementedError

    def _start_health(self) -> HealthServer | None:
        """Serve /livez and /readyz if asked to (ConfigError when the port is taken)."""
        if self.health_port is None:
            return None
        self.health = HealthServer(
            name=self.name,
            settings=self._settings,
            stuck=self._stuck,
            stopping=self._stop_asked,
            host=self.health_host,
            port=self.health_port,
            stall=self.health_stall,
            sock=self._health_socket,
        )
        return self.health

    def _stop_health(self) -> None:
        if self.health is not None:
            self.health.close()
            self.health = None

    # -- events --------------------------------------------------------------------------

    def _emit(self, event: str, job: Job) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event, job)
        except Exception:
            logger.exception("on_event hook failed for %s of job %s", event, job.id)

    def _measure(self, name: str, value: float, queue: str | None) -> None:
        if self._on_measure is None:
            return
        try:
            self._on_measure(name, value, queue)
        except Exception:
            logger.exception("on_measure hook failed for %s", name)

    def _missed(self, jobs: Sequence[Job]) -> None:
        """Heartbeats that did not keep a lease (failed, or found it gone), per queue."""
        per_queue: dict[str, int] = {}
        for job in jobs:
            per_queue[job.queue] = per_queue.get(job.queue, 0) + 1
        for queue_name, n in per_queue.items():
            self._measure("heartbeat_missed", n, queue_name)

    # -- claims and upkeep, what both loops share --------------------------------------

    def _queue_order(self) -> list[str]:
        """This round's order of the queues: it rotates, so no queue starves another."""
        n = len(self.queues)
        order = [self.queues[(self._rotation + i) % n] for i in range(n)]
        self._rotation = (self._rotation + 1) % n
        return order

    def _claim_round(self, name: str, limit: int, cursor: ClaimCursor | None = None) -> ClaimRound:
        """A claim of up to ``limit`` jobs of queue ``name``, about to be sent, from
        ``cursor``'s position (a chain's own, in a Worker of several; else the worker's)."""
        began = time.monotonic()
        cursor = self._cursor if cursor is None else cursor
        return ClaimRound(name, limit, began, cursor.start(name, began), cursor)

    def _claim_args(self, claim: ClaimRound) -> ClaimArgs:
        """The statement's arguments: the same for the claim loop's claims and the
        writer's fused ones."""
        return ClaimArgs(
            worker=self.name,
            queue=claim.queue,
            limit=claim.limit,
            lease=self.lease,
            start=claim.start,
            tasks=self.tasks,
        )

    def _claim_landed(self, claim: ClaimRound, jobs: Sequence[Job]) -> float:
        """Move the claim cursor past what ``claim`` returned; returns its round trip."""
        rtt = time.monotonic() - claim.began
        claim.cursor.claimed(claim.queue, claim.start, jobs, rtt, claim.began + rtt)
        return rtt

    def _fused_round(
        self, q: QueueBase, free: int, cursor: ClaimCursor | None = None
    ) -> tuple[ClaimRound, MakeOp] | None:
        """The claim a completion batch carries with ``fuse_claims``, for ``free`` slots
        (counting those the batch frees); None if the worker is full: complete alone.

        The claim is the claim loop's own statement, for the first queue of this
        round's order, so the rotation goes on across both kinds of claim.
        """
        if free <= 0:
            return None
        claim = self._claim_round(self._queue_order()[0], free, cursor)
        return claim, q._claim_op(own_transaction=True, **self._claim_args(claim))

    def _claimed(self, name: str, jobs: Sequence[Job], rtt: float) -> None:
        """Count and report one claim statement's answer (before the jobs start)."""
        self._measure("claim_seconds", rtt, name)
        if jobs:
            self.stats.add(claimed=len(jobs))
            for job in jobs:
                self._emit("claimed", job)

    def timeout_for(self, job: Job) -> float | None:
        """Seconds this job's attempt may run: its task's timeout, else the worker's."""
        if job.task is not None and job.task in self._task_timeouts:
            return self._task_timeouts[job.task]
        return self.job_timeout

    # How often the liveness thread refreshes its mark and runs sweep_dead: with the
    # grace, a dead worker's jobs are back within about grace + 2 * this.
    LIVENESS_INTERVAL = 0.25

    def _liveness(self) -> Liveness:
        return Liveness(
            self._settings,
            self.name,
            queues=self.queues,
            tasks=self.tasks,
            cap=min(0.25, self.lease / 8),
        )

    def _rewind(self, now: float) -> None:
        """Send every claim cursor back to the head: swept jobs keep their place."""
        for cursor in self._cursors:
            cursor.rewind(now)

    def dead_swept(self, n: int) -> None:
        """Count jobs a ``sweep_dead`` gave back (their worker's session had ended)."""
        self._rewind(time.monotonic())  # swept jobs keep their place: look back
        self.stats.add(sweeps_recovered=n)
        self._measure("swept", n, None)
        logger.info("worker %s: returned %d job(s) of workers whose session ended", self.name, n)

    # A worker refreshes its row in `workers` this often: `status` counts a worker as
    # gone after 30 s without a refresh (Queue.unserved's default).
    REGISTER_INTERVAL = 10.0

    # -- chains: the claim-and-write paths -----------------------------------------------

    def _chain_shares(
        self, chains: int | None, prefetch: int | None
    ) -> list[tuple[int, int | None, ClaimCursor]]:
        """Each chain's share of the handlers, of a fixed ``prefetch`` and its cursor
        (the first chain's is the worker's own); ``chains`` None: the default."""
        if chains is None:
            chains = 2 if self.fuse_claims and self.concurrency >= 4 else 1
        if not 1 <= chains <= self.concurrency:
            raise ConfigError(
                f"chains must be 1 to concurrency ({self.concurrency}), not {chains!r}"
            )
        shared = self._cursor.positions
        self._cursors = [self._cursor] + [ClaimCursor(positions=shared) for _ in range(chains - 1)]
        return [
            (
                split(self.concurrency, chains, i),
                None if prefetch is None else split(prefetch, chains, i),
                self._cursors[i],
            )
            for i in range(chains)
        ]

    def _chain_list(self) -> Sequence[Chain]:
        raise NotImplementedError

    @property
    def chains(self) -> int:
        """Claim-and-write paths this worker runs (see the workers' ``chains``)."""
        return len(self._chain_list())

    def _mean_runtime_now(self) -> float:
        """The handlers' moving average run time, which sizes the adaptive prefetch."""
        raise NotImplementedError

    def _prefetch_of(self, chain: Chain) -> int:
        return self.adaptive_prefetch(
            chain.fixed_prefetch, self._mean_runtime_now(), self._claim_rtt, chain.share
        )

    @property
    def prefetch(self) -> int:
        """Jobs claimed beyond ``concurrency`` right now, all chains together (see
        adaptive_prefetch)."""
        return sum(self._prefetch_of(chain) for chain in self._chain_list())

    @property
    def capacity(self) -> int:
        """Jobs this worker holds at most: running, prefetched, or awaiting their write."""
        return self.concurrency + self.prefetch

    def _free(self, chain: Chain) -> int:
        """Jobs ``chain`` may claim now: its share and prefetch, less what it holds."""
        return chain.share + self._prefetch_of(chain) - chain.held

    def _refill(self, chain: Chain) -> int:
        # Once a claim came back full (more work waiting), refill in batches of at
        # least half the chain: one claim per finished job would be a round trip per job.
        return max(1, (chain.share + self._prefetch_of(chain)) // 2)

    def _refill_due(self, chain: Chain) -> bool:
        """More work is known to wait for ``chain`` and a refill batch fits."""
        return chain.more and self._free(chain) >= self._refill(chain)

    def _claim_due(self, chain: Chain) -> int:
        """Jobs the claim loop should claim for ``chain`` now (0: none)."""
        free = self._free(chain)
        return free if free > 0 and (not chain.more or free >= self._refill(chain)) else 0

    def _set_more(self, chain: Chain, more: bool) -> None:
        chain.more = more
        self._more = any(c.more for c in self._chain_list())

    # Adaptive prefetch never goes past the larger of 2 x concurrency and this: a batch
    # of short jobs is claimed and completed for about the cost of one job.  Measured:
    # 20,000 no-op jobs at concurrency 8 drained 1.4x faster with 64 than with 16; once
    # migration 0012 stopped the claim from planning at every call, 40,000 drained
    # 1.3x faster with 256 than with 64 (bench/results/2026-12-05-pick-plan-kept.md),
    # and no faster with 512.  At concurrency 8 only jobs shorter
    # than a 32nd of a claim's round trip go that deep (see adaptive_prefetch).
    PREFETCH_BATCH = 256

    def adaptive_prefetch(
        self,
        fixed: int | None,
        mean_runtime: float,
        claim_rtt: float,
        concurrency: int | None = None,
    ) -> int:
        """Jobs to claim beyond ``concurrency``: ``fixed`` if given, else about as many
        as the handlers finish during one claim round trip, up to the larger of
        2 x concurrency and PREFETCH_BATCH.

        Prefetch keeps handlers fed while the next claim is in flight, and lets short
        jobs be claimed and completed in batches, but a prefetched job waits behind
        running ones (holding a lease another worker could have used): zero for slow
        jobs, deep for no-op ones.  Since the depth is what the handlers finish in one
        claim round trip, a prefetched job waits about that long, however deep.

        ``concurrency``: the handlers this prefetch feeds (one chain's share in a
        Worker of several chains), by default all of them.
        """
        if fixed is not None:
            return fixed
        share = self.concurrency if concurrency is None else concurrency
        wanted = share * claim_rtt / max(mean_runtime, 1e-6)
        return min(max(2 * share, self.PREFETCH_BATCH), int(wanted))

    def _register_due(self, now: float) -> bool:
        return self._registered_at is None or now - self._registered_at >= self.REGISTER_INTERVAL

    def _registered(self, now: float) -> None:
        self._registered_at = now
        # Registering may have created the row afresh (waiting NULL): say it again.
        self._told_waiting = None

    # -- waiting for notifications (migration 0008) ------------------------------------
    # Claims must come back full for this long before the worker says it is busy: a
    # worker near its capacity would otherwise write its row at every other claim.
    BUSY_AFTER = 1.0
    # After saying it waits, the worker claims at once and again this soon after: a
    # producer whose trigger still read it as busy may commit just after that claim.
    LOOK_AGAIN = 0.02

    def _waiting_change(self, busy: bool, now: float) -> bool | None:
        """The ``waiting`` to write to this worker's row now, or None if it stands.

        ``busy``: the worker will claim again without a notification (its last claim
        came back full, or a finishing job wakes it).  Producers notify a queue only
        while one of its workers waits (or has not said), so turning idle must be said
        at once; turning busy may wait, since a stale "waiting" costs a notification
        nobody needed and nothing else.
        """
        if not self.listen:
            want = False  # it polls: a notification would go unheard
        elif not busy:
            self._busy_since = None
            want = True
        else:
            if self._busy_since is None:
                self._busy_since = now
            if now - self._busy_since < self.BUSY_AFTER:
                return None
            want = False
        return None if want is self._told_waiting else want

    def _waiting_failed(self, exc: BaseException, now: float) -> None:
        # Tried again at the next round, and a due "busy" not before BUSY_AFTER more.
        self._upkeep_failed("waiting", exc)
        if self._busy_since is not None:
            self._busy_since = now

    def _said_waiting(self, waiting: bool, now: float) -> None:
        self._told_waiting = waiting
        self._look_again_at = now + self.LOOK_AGAIN if waiting else None

    def _look_again_in(self, timeout: float, now: float) -> float:
        """``timeout``, shortened to the look-again after saying it waits (once), or to
        when busy is due to be said (a saturated worker may otherwise sleep a whole
        poll interval first)."""
        if self._look_again_at is not None:
            timeout = max(0.0, min(timeout, self._look_again_at - now))
            self._look_again_at = None
        elif self._busy_since is not None and self._told_waiting is not False:
            timeout = max(0.0, min(timeout, self._busy_since + self.BUSY_AFTER - now))
        return timeout

    # -- upkeep: the claim loop's sweeps and prunes --------------------------------------
    # The generations' upkeep (``Worker._upkeep_loop``) takes at most this many steps
    # after a sweep and, while this worker's claims come back full, rests after each
    # step for (1 / UPKEEP_SHARE - 1) times what the step took.  Moving finished jobs to
    # their day can wait, the jobs cannot: a step (up to 2,000 jobs moved, 10-30 ms)
    # holds a server process and adds its WAL to the flush every commit waits for: a
    # million-job backlog moved flat out held a drain beside it to 0.74-0.78 of a fresh
    # table's pace, 0.81-0.87 paced (bench/results/2026-12-05-upkeep-paced.md).  At a quarter
    # a busy worker still moves at least about 16,000 jobs a second (2,000 a step of at
    # most 30 ms, one every 120 ms), more than one process finishes; an idle worker
    # moves flat out.
    UPKEEP_SHARE = 0.25
    UPKEEP_MAX_STEPS = 50

    def _upkeep_rest(self, step: float) -> float:
        """Seconds the upkeep waits after a step that took ``step``: none while the
        worker waits for work (its last claim came back short), more while it drains."""
        return step * (1.0 / self.UPKEEP_SHARE - 1.0) if self._more else 0.0

    def _upkeep_from(self, now: float) -> None:
        """Schedule upkeep for a claim loop starting at ``now``.

        The first sweep (which also registers the worker) is due at once: the worker's
        row must exist before it says whether it waits, or that first word updates no
        row and an idle worker stays unsaid until its next sweep.  Prunes start at a
        random point of their interval so that workers started together spread them.
        """
        self._next_sweep = now
        if self.retention is None:
            self._next_prune = math.inf  # this worker does not prune
        else:
            self._next_prune = now + random.uniform(0, self.prune_interval)

    def _sweep_due(self, now: float) -> bool:
        """True if a sweep is due at ``now``; the next one is then scheduled."""
        if now < self._next_sweep:
            return False
        self._next_sweep = now + self.sweep_interval * random.uniform(0.75, 1.25)
        return True

    def _prune_due(self, now: float) -> bool:
        """True if a prune is due (never without retention); the next one is then
        scheduled."""
        if now < self._next_prune:
            return False
        self._next_prune = now + self.prune_interval * random.uniform(0.75, 1.25)
        return True

    def _until_upkeep(self, timeout: float, now: float) -> float:
        """``timeout``, cut short to the next sweep or prune.

        An idle worker waits for a notification or its poll; with a poll interval
        longer than the sweep interval it would otherwise sweep, refresh its row (and
        so count as alive in ``status``) and recover expired leases once per poll.
        """
        return max(0.0, min(timeout, self._next_sweep - now, self._next_prune - now))

    def _upkeep_failed(self, what: str, exc: BaseException) -> None:
        # A sweep or prune that fails is retried at its next turn; any worker may do it.
        self.stats.add(db_errors=1)
        logger.debug("worker %s: %s failed: %s", self.name, what, one_line(exc))

    # -- what the writes meant -------------------------------------------------------------

    def split(
        self,
        batch: Sequence[tuple[Job, Outcome]],
    ) -> tuple[
        list[tuple[Job, Any]],
        list[tuple[Job, str | None, float | None, bool]],
    ]:
        """Handler outcomes as the two fenced writes: completions and hand-backs.

        A retry's delay is drawn here from the retry policy (not by the statement) so
        that the log line of the retry can say when the job runs again.
        """
        policy = self._settings.retry_policy
        requested = [job.attempt for job, o in batch if o.requested]
        if requested:
            with self._log_lock:
                self._requested.update(requested)
        done = [(job, o.result) for job, o in batch if o.kind == "ok"]
        failed: list[tuple[Job, str | None, float | None, bool]] = [
            (
                job,
                o.error,
                _clamp_delay(policy.delay(job.attempts) if o.delay is None else float(o.delay)),
                o.kind == "retry",
            )
            for job, o in batch
            if o.kind != "ok"
        ]
        return done, failed

    def _timed_out(self, job: Job, timeout: float | None, *, killed: bool = False) -> Outcome:
        """Count a handler past its timeout; returns the outcome to write for it
        (``killed``: its process was, by the process pool)."""
        self.stats.add(timed_out=1)
        self._emit("timed_out", job)
        with self._log_lock:
            self._timeouts.add(job.attempt)
        if killed:
            return Outcome("retry", f"killed after {timeout or 0.0:g}s (its timeout)")
        return Outcome("retry", f"timed out after {timeout or 0.0:g}s")

    def completed(self, items: Sequence[tuple[Job, Any]], res: FenceResult) -> None:
        """Count and report a completion statement's answer."""
        cancelled = 0
        lost: list[Job] = []
        for job, _ in items:
            row = res.row(job)
            if row is None:
                lost.append(job)
                self._emit("lease_lost", job)
            elif row["status"] == "cancelled":
                cancelled += 1
                self._emit("cancelled", job)
                log_job(self.name, logging.WARNING, "cancelled", job, "cancelled while running")
            else:
                self._emit("completed", job)
        self.stats.add(completed=len(res.attempts) - cancelled, cancelled=cancelled)
        self._lost(lost, "the write changed nothing")

    def handed_back(
        self, items: Sequence[tuple[Job, str | None, float | None, bool]], res: FenceResult
    ) -> None:
        """Count and report a fail/retry statement's answer, and log each job's line."""
        by_status = {"pending": 0, "failed": 0, "cancelled": 0}
        lost: list[Job] = []
        for job, error, delay, retry in items:
            with self._log_lock:
                timed_out = job.attempt in self._timeouts
                self._timeouts.discard(job.attempt)
                requested = job.attempt in self._requested
                self._requested.discard(job.attempt)
            row = res.row(job)
            if row is None:
                lost.append(job)
                self._emit("lease_lost", job)
                continue
            status = str(row["status"])
            by_status[status] = by_status.get(status, 0) + 1
            event = {"pending": "retried", "failed": "failed"}.get(status, status)
            self._emit(event, job)
            self._log_hand_back(job, event, error, delay, retry, timed_out, requested)
        self.stats.add(
            retried=by_status["pending"],
            failed=by_status["failed"],
            cancelled=by_status["cancelled"],
        )
        self._lost(lost, "the write changed nothing")

    def _log_hand_back(
        self,
        job: Job,
        event: str,
        error: str | None,
        delay: float | None,
        retry: bool,
        timed_out: bool,
        requested: bool = False,
    ) -> None:
        # The row's status after the fenced write decides, not the outcome we asked
        # for: the statement knows the attempts left and whether a cancel came first.
        what = error_summary(error) if timed_out else f"failed: {error_summary(error)}"
        if event == "failed":
            why = "no attempts left" if retry else "not retried"
            log_job(self.name, logging.ERROR, event, job, f"{what}; {why}, job failed", error=error)
        elif event == "cancelled":
            summary = error_summary(error)
            text = "cancelled while running"
            if summary and summary != CANCELLED.error:
                text += f" ({summary})"  # what the handler raised on its way out
            log_job(self.name, logging.WARNING, event, job, text, error=error)
        else:
            # 'retried'; or the row has moved on already (a retry after a lost reply
            # found our hand-back committed and the job claimed again): it runs again.
            when = f"retrying in {_seconds(delay)}" if delay is not None else "retrying"
            if requested:
                # The handler asked for it (Retry): news, not a failure.  Its reason,
                # with the exception it was raised from, is the line's first part.
                what = error_summary(error) or "retry requested"
            log_job(
                self.name,
                logging.INFO if requested else logging.WARNING,
                event,
                job,
                f"{what}; {when}",
                error=error,
                delay=delay,
            )

    def released(self, jobs: Sequence[Job], res: FenceResult) -> None:
        self.stats.add(released=len(res.attempts))
        lost = [job for job in jobs if res.row(job) is None]
        gone = {job.attempt for job in lost}
        for job in jobs:
            self._emit("lease_lost" if job.attempt in gone else "released", job)
        self._lost(lost, "the release changed nothing")

    def beaten(self, jobs: Sequence[Job], res: FenceResult) -> list[Job]:
        """Count a heartbeat's answer; returns the attempts no longer ours."""
        self.stats.add(heartbeats=len(res.attempts))
        lost = [job for job in jobs if res.row(job) is None]
        self._missed(lost)
        for job in lost:
            self._emit("lease_lost", job)
        self._lost(lost, "the heartbeat found it swept, re-claimed or cancelled", heartbeat=True)
        return lost

    def abandon(self, jobs: Sequence[Job], grace: float) -> None:
        """Count and log the handlers still running when the shutdown grace ended.

        One ERROR line, not one per job: the worker stops here, and what an operator
        needs is that work was cut off and that it is not lost.
        """
        if not jobs:
            return
        self.stats.add(abandoned=len(jobs))
        ids = sorted(job.id for job in jobs)
        shown = ", ".join(map(str, ids[:20])) + (", ..." if len(ids) > 20 else "")
        logger.error(
            "worker %s: %d job(s) abandoned, their handlers still running after the %gs "
            "grace (job ids: %s); they will be retried once their lease (%gs) runs out",
            self.name,
            len(jobs),
            grace,
            shown,
            self.lease,
            extra={"worker": self.name, "event": "abandoned", "count": len(jobs), "job_ids": ids},
        )

    def swept(self, n: int, window: float | None, start: float) -> None:
        """Count a sweep that started at ``start`` (monotonic) looking back ``window``."""
        now = time.monotonic()
        self._sweeps.swept(window, start, now - start)
        if n:
            self._rewind(now)
            self.stats.add(sweeps_recovered=n)
            self._measure("swept", n, None)
            logger.info("worker %s: returned %d job(s) with expired leases", self.name, n)

    def _lost(self, jobs: Sequence[Job], what: str, *, heartbeat: bool = False) -> None:
        """Count attempts the fence refused; one line each, once per attempt.

        A heartbeat that finds an attempt lost logs it; the handler's outcome, written
        later and refused too, is counted again (a stale write) but not logged again.
        """
        if not jobs:
            return
        self.stats.add(lease_lost=len(jobs))
        for job in jobs:
            with self._log_lock:
                if heartbeat:
                    self._lost_logged[job.attempt] = None
                    # An attempt whose handler never returns would stay here forever.
                    if len(self._lost_logged) > 10_000:
                        del self._lost_logged[next(iter(self._lost_logged))]
                elif job.attempt in self._lost_logged:
                    del self._lost_logged[job.attempt]
                    continue
            log_job(self.name, logging.WARNING, "lease_lost", job, f"lease lost: {what}")

    @staticmethod
    def cancel_target(payload: str) -> int | None:
        """The job id of a ``cancel:<id>`` notification, else None."""
        kind, _, rest = payload.partition(":")
        if kind != "cancel" or not rest.isdigit():
            return None
        return int(rest)
