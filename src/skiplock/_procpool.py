"""The process pool: each handler slot runs its jobs in a child process it can kill.

A thread cannot be stopped, so a sync handler past its timeout (``HandlerPool``) goes
on burning CPU after its attempt failed, and its retry doubles the work the limit was
meant to cap.  Here each slot is a parent thread that owns one child process: it sends
the child a job over a pipe and waits for the outcome, and at the job's deadline it
kills the child (SIGKILL: a runaway loop or a hung C call ignores anything gentler)
and starts another.  Everything that touches the database stays in the parent worker:
the claim, the fenced writes, the heartbeats, the liveness mark.  The child only runs
the handler and sends back its ``Outcome`` (the result already encoded), so fencing is
unchanged: a late outcome of a lost lease is refused by the fence as with threads.

Children start with ``forkserver``: forking the worker itself, which runs threads
(its writers, heartbeat, listener), can copy a lock held mid-call, and the child
deadlocks on it.  The fork server is a single-threaded process started once (with
skiplock imported in it), so a new child costs a fork, not a fresh interpreter as
with ``spawn``: that matters when children are killed at their timeouts or retired.
Either way a child imports the handlers afresh, so they must be importable by
qualified name (``check_picklable``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from queue import SimpleQueue
from types import FrameType

from ._errors import ConfigError, SoftTimeLimitExceeded
from ._handlers import (
    CANCELLED,
    Handler,
    Outcome,
    RunTime,
    SlotBook,
    _trim,
    failed_outcome,
    run_handler,
)
from ._job import Attempt, Job

__all__ = ["ProcessPool", "check_picklable"]

logger = logging.getLogger("skiplock.worker")

_CONTEXT = multiprocessing.get_context("forkserver")
# A child imports skiplock, psycopg and the handlers' modules before it is ready.
START_TIMEOUT = 60.0
# An idle child asked to exit that has not within this is killed.
STOP_TIMEOUT = 5.0


def check_picklable(handlers: Mapping[str, Handler]) -> bytes:
    """The handlers as the children load them; ConfigError for one that cannot be.

    A function pickles as its module and qualified name, so this is the check that
    the child can import it: a lambda, a function defined inside another, or one whose
    name now names something else cannot run in a child process.
    """
    try:
        return pickle.dumps(dict(handlers))
    except ConfigError:
        raise
    except Exception as exc:
        names = ", ".join(sorted({getattr(h, "__qualname__", repr(h)) for h in handlers.values()}))
        raise ConfigError(
            f"pool='process' imports each handler in its child processes by qualified "
            f"name, and {names} cannot be ({exc}): define it at the top level of an "
            "importable module"
        ) from None


# -- the child ---------------------------------------------------------------------------

_soft_limit = 0.0


def _raise_soft_limit(signum: int, frame: FrameType | None) -> None:
    raise SoftTimeLimitExceeded(f"soft time limit of {_soft_limit:g}s exceeded")


def _rss_bytes() -> int:
    """The child's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _orphan_watch(parent: int) -> None:
    # A worker killed outright cannot kill its children; one whose worker is gone
    # exits rather than run its task on, unbounded by any timeout.  (Our parent
    # process is the fork server; the worker is watched through its sentinel.)
    worker = multiprocessing.parent_process()
    if worker is not None and worker.sentinel is not None:
        wait([worker.sentinel])
    else:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                break
            time.sleep(1.0)
    os._exit(70)


def _child_main(conn: Connection, handlers_blob: bytes, log_level: int, parent: int) -> None:
    """A child's life: load the handlers, then run one job per message until told to stop."""
    global _soft_limit
    # The worker decides when its handlers stop (its grace); a Ctrl-C sent to the whole
    # process group must not cut a task short in the child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _raise_soft_limit)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[child]: %(message)s"
    )
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    try:
        handlers: dict[str, Handler] = pickle.loads(handlers_blob)
    except BaseException as exc:
        conn.send(("error", "".join(traceback.format_exception_only(exc)).strip()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job, timeout, soft, max_result_bytes, measure = message
        outcome: Outcome | None = None
        try:
            if soft:
                _soft_limit = soft
                signal.setitimer(signal.ITIMER_REAL, soft)
            outcome = run_handler(handlers[job.queue], job, timeout, max_result_bytes)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except SoftTimeLimitExceeded as exc:
            # The alarm rang between the handler's return and the disarm: its outcome
            # stands; or outside it altogether.
            signal.setitimer(signal.ITIMER_REAL, 0)
            if outcome is None:
                outcome = failed_outcome(exc, job, timeout)
        conn.send((outcome, _rss_bytes() if measure else 0))


# -- the parent --------------------------------------------------------------------------


class ChildStartError(Exception):
    """A child process could not load the handlers (the reason is the message)."""


class _Child:
    """One child process and the parent's end of its pipe."""

    def __init__(self, blob: bytes, name: str) -> None:
        parent_end, child_end = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(
            target=_child_main,
            args=(child_end, blob, logging.getLogger().getEffectiveLevel(), os.getpid()),
            name=name,
        )
        self.process.start()
        self._pid = self.process.pid  # still known once the process object is closed
        child_end.close()
        self.conn = parent_end
        self.tasks = 0
        self.killed = False
        self.gone = False  # its pipe broke: it died, or is dying
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self._pid

    def ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait for the child to load the handlers; ChildStartError if it cannot."""
        try:
            if not self.conn.poll(timeout):
                raise ChildStartError(f"not ready after {timeout:g}s")
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise ChildStartError(f"exited at start ({self.exit_text()})") from None
        if kind != "ready":
            self.close()
            raise ChildStartError(str(detail))

    def kill(self) -> None:
        """SIGKILL (idempotent): the CPU it uses stops now, whatever it is doing."""
        self.killed = True
        if self.closed:
            return
        pid = self._pid
        if pid is not None and self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def exit_text(self) -> str:
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not; reap it (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if not self.killed and self.process.exitcode is None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(STOP_TIMEOUT)
        if self.process.exitcode is None:
            self.kill()
            self.process.join(STOP_TIMEOUT)
        self.conn.close()
        self.process.close()


@dataclass(slots=True)
class _Running:
    job: Job
    deadline: float | None
    thread: threading.Thread
    child: _Child
    abandoned: bool = False


class ProcessPool(SlotBook):
    """``size`` slots, each a thread of the parent with a child process of its own.

    The same surface as ``HandlerPool`` (``submit``, ``reap``, ``dead``,
    ``drain_unstarted``, ``running_jobs``, ``wait_idle``, ``shutdown``, ``runtime``), so
    the worker's slot accounting, deadlines and watchdog are the same for both.  A job
    past its deadline: its child is killed at the deadline by its slot's thread (and by
    ``reap`` if that comes first), ``reap`` reports it timed out, and the slot starts a
    new child.  A child that dies on its own (a segfault, an OOM kill, ``os._exit``)
    fails its attempt only.  ``max_tasks`` and ``max_memory`` (bytes of resident
    memory, read by the child after each job) retire a child after a job; its slot
    starts another.
    """

    def __init__(
        self,
        size: int,
        handlers: Mapping[str, Handler],
        on_start: Callable[[Job], None],
        on_done: Callable[[Job, Outcome], None],
        timeout: Callable[[Job], float | None],
        soft_timeout: Callable[[Job], float | None],
        name: str,
        *,
        max_result_bytes: int,
        max_tasks: int | None = None,
        max_memory: int | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._blob = check_picklable(handlers)
        # Imported once in the fork server, not in each child.  Set here, not at import,
        # so that importing skiplock changes nothing for an application's own fork
        # server; it counts only until the server starts, which the first child does.
        _CONTEXT.set_forkserver_preload(["skiplock", "skiplock._procpool"])
        self._on_start = on_start
        self._on_done = on_done
        self._timeout = timeout
        self._soft_timeout = soft_timeout
        self._name = name
        self._max_result_bytes = max_result_bytes
        self._max_tasks = max_tasks
        self._max_memory = max_memory
        self._wake = wake
        self._tasks: SimpleQueue[Job | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[Attempt, _Running] = {}
        self._idle = threading.Condition(self._lock)
        self._closing = False
        self._serial = 0
        self.runtime = RunTime()
        #: Children started (the first ones included) and children that died by
        #: themselves: for tests and the log.
        self.started = 0
        self.died = 0
        # Start every child at once and wait for all: a handler module that does not
        # import fails the worker's start, in one line, not each job.
        children: list[_Child] = []
        try:
            for _ in range(size):
                children.append(self._new_child())
            for child in children:
                child.ready()
        except ChildStartError as exc:
            for child in children:
                child.kill()
                child.close()
            raise ConfigError(f"a handler process could not start: {exc}") from None
        self._threads = [
            threading.Thread(target=self._loop, args=(child,), name=f"{name}-p{i + 1}", daemon=True)
            for i, child in enumerate(children)
        ]
        for t in self._threads:
            t.start()

    def _new_child(self) -> _Child:
        self._serial += 1
        self.started += 1
        return _Child(self._blob, f"{self._name}-child{self._serial}")

    def _fresh_child(self) -> _Child | None:
        """A new, ready child for this slot; None (logged) if it would not start."""
        child = self._new_child()
        try:
            child.ready()
        except ChildStartError as exc:
            logger.error("%s: a handler process could not start: %s", self._name, exc)
            return None
        return child

    def submit(self, job: Job) -> None:
        self._tasks.put(job)

    def _loop(self, child: _Child | None) -> None:
        try:
            while True:
                job = self._tasks.get()
                if job is None:
                    return
                if child is None:
                    child = self._fresh_child()
                    if child is None:
                        # Fail the attempt rather than hold the job while no child can
                        # run it; its retry's backoff paces the next try.
                        self._on_done(job, Outcome("retry", "no handler process would start"))
                        continue
                child = self._run(child, job)
        finally:
            if child is not None:
                child.close()

    def _run(self, child: _Child, job: Job) -> _Child | None:
        """Run ``job`` in ``child``; the child to use next (None: start a new one)."""
        timeout = self._timeout(job)
        deadline = time.monotonic() + timeout if timeout else None
        me = _Running(job, deadline, threading.current_thread(), child)
        with self._lock:
            self._running[job.attempt] = me
        self._on_start(job)
        began = time.monotonic()
        rss = 0
        try:
            soft = self._soft_timeout(job)
            measure = self._max_memory is not None
            child.conn.send((job, timeout, soft, self._max_result_bytes, measure))
            outcome, rss = self._await(child, me)
        except (EOFError, OSError):
            outcome = self._died(child, job)
            child.gone = True
        except BaseException as exc:
            # A result that will not unpickle, say: the slot must live on.
            outcome = Outcome("retry", _trim("".join(traceback.format_exception(exc))))
        took = time.monotonic() - began
        with self._lock:
            if me.abandoned:
                # Reaped: timed out (its write is the worker's) or dropped at shutdown.
                child.kill()
                child.close()
                return None
            del self._running[job.attempt]
            self.runtime.add(took)
            self._idle.notify_all()
        try:
            self._on_done(job, outcome)
        except Exception:
            logger.exception("handing over the outcome of job %s failed", job.id)
        child.tasks += 1
        if child.killed or child.gone:  # one that answered is alive: no need to ask
            child.close()
            return None
        why = ""
        if self._max_tasks is not None and child.tasks >= self._max_tasks:
            why = f"after {child.tasks} job(s)"
        elif self._max_memory is not None and rss > self._max_memory:
            why = f"at {rss / 2**20:.0f} MiB resident"
        if why:
            logger.info("%s: handler process %s retired %s", self._name, child.pid, why)
            child.close()
            return self._fresh_child()
        return child

    def _await(self, child: _Child, me: _Running) -> tuple[Outcome, int]:
        """The child's (outcome, rss); at the deadline kill it and wait to be reaped."""
        while True:
            wait = None if me.deadline is None else max(0.0, me.deadline - time.monotonic())
            if child.conn.poll(wait):
                outcome, rss = child.conn.recv()
                return outcome, rss
            if not child.killed:
                child.kill()
                self._wake()  # the claim loop reaps it and writes the timeout now
            with self._lock:
                while not me.abandoned and not self._closing:
                    self._idle.wait(1.0)
            return Outcome("retry", "killed at its deadline"), 0

    def _died(self, child: _Child, job: Job) -> Outcome:
        if job.cancelled:
            return CANCELLED
        if child.killed:
            return Outcome("retry", "killed at its deadline")
        how = child.exit_text()
        self.died += 1
        logger.error(
            "%s: handler process %s running job %s died (%s); a new one takes the slot",
            self._name,
            child.pid,
            job.id,
            how,
        )
        return Outcome("retry", f"the handler process died ({how})")

    def reap(self, now: float) -> tuple[list[Job], list[Job]]:
        """Take back the jobs past their deadline (their child killed) and those whose
        slot thread is gone without an outcome; kill the children of cancelled jobs.

        Returns ``(timed_out, vanished)``, as ``HandlerPool.reap``.
        """
        expired: list[Job] = []
        vanished: list[Job] = []
        with self._lock:
            for attempt, r in list(self._running.items()):
                if r.job.cancelled and not r.child.killed:
                    # Its slot reports CANCELLED when it sees the child gone.
                    r.child.kill()
                    continue
                if not r.thread.is_alive():
                    vanished.append(r.job)
                elif r.deadline is not None and now >= r.deadline:
                    expired.append(r.job)
                else:
                    continue
                r.abandoned = True
                r.child.kill()
                del self._running[attempt]
                if not r.thread.is_alive():
                    self._replace(r.thread)
            if expired or vanished:
                self._idle.notify_all()
        return expired, vanished

    def _replace(self, gone: threading.Thread) -> None:
        # Under _lock.  Not expected (the slot thread catches everything); the slot
        # lives on in a new thread, which starts its child when it takes a job.
        if gone in self._threads:
            self._threads.remove(gone)
        t = threading.Thread(target=self._loop, args=(None,), name=gone.name, daemon=True)
        self._threads.append(t)
        t.start()

    def child_pids(self) -> list[int]:
        """The pids of the children now running a job (for tests and tools)."""
        with self._lock:
            return [r.child.pid for r in self._running.values() if r.child.pid is not None]

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no handler runs (queued ones are not counted); False on timeout."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stop every child: idle ones exit, those still running a job (abandoned by the
        worker at the end of its grace) are killed, so nothing runs on after the worker."""
        with self._lock:
            self._closing = True
            threads = list(self._threads)
            for r in self._running.values():
                r.abandoned = True
                r.child.kill()
            self._idle.notify_all()
        for _ in threads:
            self._tasks.put(None)
        end = time.monotonic() + max(timeout, STOP_TIMEOUT + 1.0)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
