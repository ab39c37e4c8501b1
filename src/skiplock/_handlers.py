"""Running handlers: outcomes, the thread pool that can abandon a hung thread, loading."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Any

from ._control import DEFAULT_MAX_RESULT_BYTES, Encoded, encode_result
from ._errors import ConfigError, Fail, PayloadError, Retry
from ._job import Attempt, Job

__all__ = [
    "HandlerExit",
    "HandlerPool",
    "Outcome",
    "RunTime",
    "SlotBook",
    "contained",
    "failed_outcome",
    "load_handler",
    "load_object",
    "ok_outcome",
    "run_coroutine",
    "run_handler",
]

logger = logging.getLogger("skiplock.worker")

Handler = Callable[[Job], Any]
MAX_ERROR_CHARS = 8000


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a handler's attempt came to; the worker turns it into one fenced write."""

    kind: str  # 'ok' | 'retry' (policy or explicit delay) | 'fail' (no retry)
    error: str | None = None
    delay: float | None = None  # None: the retry policy decides
    result: Encoded | None = None  # the return value, encoded in the handler's thread
    requested: bool = False  # the handler raised Retry: logged at INFO, not as a failure


OK = Outcome("ok")
CANCELLED = Outcome("fail", "cancelled while running")


def _trim(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else "..." + text[-MAX_ERROR_CHARS:]


def run_handler(
    handler: Handler,
    job: Job,
    timeout: float | None,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
) -> Outcome:
    """Call ``handler(job)`` and classify what happened.  Never raises."""
    try:
        if inspect.iscoroutinefunction(handler):
            # A coroutine can really be cancelled, at its timeout or on a cancel of
            # the job, unlike a thread.
            value = asyncio.run(run_coroutine(handler, job, timeout))
        else:
            value = handler(job)
        return ok_outcome(job, value, max_result_bytes)
    except BaseException as exc:  # every outcome is reported, SystemExit included
        return failed_outcome(exc, job, timeout)


def ok_outcome(job: Job, value: Any, max_result_bytes: int) -> Outcome:
    """A handler returned ``value``: done, with the value encoded for the job's row."""
    if not job.store_result or value is None:
        return OK
    try:
        return Outcome("ok", result=encode_result(value, max_result_bytes))
    except PayloadError as exc:
        # The side effects happened; a retry would repeat them and fail the same way.
        return Outcome("fail", str(exc))


def failed_outcome(exc: BaseException, job: Job, timeout: float | None) -> Outcome:
    """Classify a handler's exception: Retry, Fail, a timeout, a cancel, anything else."""
    if isinstance(exc, Retry):
        return Outcome("retry", retry_reason(exc), exc.delay, requested=True)
    if isinstance(exc, Fail):
        return Outcome("fail", _trim(str(exc) or "failed by handler"))
    if isinstance(exc, asyncio.CancelledError) and job.cancelled:
        return CANCELLED
    if isinstance(exc, TimeoutError) and timeout:
        return Outcome("retry", f"timed out after {timeout:g}s")
    if isinstance(exc, HandlerExit):
        exc = exc.original
    text = "".join(traceback.format_exception(exc))
    if not isinstance(exc, Exception):
        # SystemExit, KeyboardInterrupt, GeneratorExit raised by the handler: its attempt
        # failed like any other.  The worker's own signals never raise (handle_signals
        # sets a stop instead), so nothing here can be a request to stop the worker, and
        # letting it escape would kill the handler's thread with its job still held.
        text += f"(the handler raised {type(exc).__name__}; the worker went on)\n"
    return Outcome("retry", _trim(text))


class HandlerExit(Exception):
    """A handler coroutine raised SystemExit or KeyboardInterrupt.

    asyncio lets those two escape the event loop, which would stop an AsyncWorker and
    every handler beside the one that raised; ``contained`` turns them into this
    ordinary exception, which ``failed_outcome`` reports as the original.
    """

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


async def contained(handler: Handler, job: Job) -> Any:
    """Await ``handler(job)``, turning SystemExit and KeyboardInterrupt into HandlerExit."""
    try:
        return await handler(job)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise HandlerExit(exc) from exc


def retry_reason(exc: Retry) -> str:
    """A Retry's text for ``last_error``: its reason, and the exception it came from.

    ``raise Retry(5) from exc`` (or a Retry raised while handling ``exc``) gives
    "retry requested: ValueError: boom", then that exception's traceback; without one,
    the reason alone ("retry requested by handler" when none was given).
    """
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is None:
        return _trim(exc.reason or "retry requested by handler")
    only = "".join(traceback.format_exception_only(cause)).strip().splitlines()
    head = f"{exc.reason or 'retry requested'}: {only[0] if only else type(cause).__name__}"
    return f"{head}\n{_trim(''.join(traceback.format_exception(cause)))}"


async def run_coroutine(handler: Handler, job: Job, timeout: float | None) -> Any:
    """Await ``handler(job)``; cancel it at ``timeout`` or when the job is cancelled."""
    task = asyncio.ensure_future(contained(handler, job))
    watcher = asyncio.ensure_future(_cancel_when_asked(task, job))
    try:
        return await (asyncio.wait_for(task, timeout) if timeout else task)
    finally:
        watcher.cancel()


async def _cancel_when_asked(task: asyncio.Future[Any], job: Job) -> None:
    # job.cancelled is set by the worker's heartbeat, on another thread or task: look
    # often enough that a cancel reaches the handler within a tick of arriving.
    while not task.done():
        if job.cancelled:
            task.cancel()
            return
        await asyncio.sleep(0.02)


def _import_from_cwd() -> None:
    """Let ``module:attr`` name a module in the current directory, as Celery and RQ do.

    ``python -m`` puts the current directory first on ``sys.path``; the ``skiplock``
    console script does not, so ``skiplock worker --handler jobs:send`` run next to
    ``jobs.py`` would fail with "No module named 'jobs'" unless PYTHONPATH=. was set.
    """
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def load_object(path: str, *, what: str = "object") -> Any:
    """Import ``module:attr`` (or ``module.attr``) and return the attribute.

    The module is looked up on ``sys.path`` with the current directory first, so a
    file next to where the command runs is found without PYTHONPATH.  ``attr`` may be
    dotted (``module:Class.method``).

    Parameters
    ----------
    path
        ``module:attr``, or ``module.attr`` when ``module`` has no ``:``.
    what
        What the object is, for the error message ("handler", "app").

    Returns
    -------
    Any
        The attribute.

    Raises
    ------
    ConfigError
        The path is malformed, the module cannot be imported (with the reason), or it
        lacks the attribute.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r} is not of the form module:attribute")
    _import_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        hint = ""
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            # The named module itself is missing (not something it imports): say where
            # we looked, since a wrong directory is the usual cause.
            hint = f" (looked in {os.getcwd()} and sys.path)"
        raise ConfigError(f"cannot import {what} module {module_name!r}: {exc}{hint}") from None
    except Exception as exc:
        raise ConfigError(f"cannot import {what} module {module_name!r}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}")
    return target


def load_handler(path: str) -> Handler:
    """Import ``module:function`` (or ``module.function``); ConfigError with the reason."""
    target = load_object(path, what="handler")
    if not callable(target):
        raise ConfigError(f"handler {path!r} is not callable")
    return target  # type: ignore[no-any-return]


class RunTime:
    """The handlers' run time as the adaptive prefetch reads it: a moving average that
    starts from the jobs seen, not from its prior.

    Until the first job ends the worker knows nothing and assumes slow jobs (``PRIOR``,
    1 s): it prefetches nothing, so a slow job never waits behind another.  It used to
    move from there by 5 % a job, so no-op jobs took about 200 jobs to be seen as fast,
    and a worker that started on a backlog ran its first ~100 ms at a tenth of its rate,
    claiming a chain's share at a time (bench/results/2026-12-06-cheaper-claimed-rows.md:
    the first 1,000 jobs of a drain done ~190 ms after the start, ~115 now).
    Now the first ``1 / WEIGHT`` jobs are averaged plainly (weight 1/n), and only then
    does it weigh each new job by ``WEIGHT``: the first job's own time replaces the
    prior, and a few more steady it.
    """

    PRIOR = 1.0
    WEIGHT = 0.05
    __slots__ = ("_seen", "value")

    def __init__(self, prior: float = PRIOR) -> None:
        self.value = prior
        self._seen = 0

    def add(self, seconds: float) -> None:
        self._seen += 1
        self.value += max(self.WEIGHT, 1.0 / self._seen) * (seconds - self.value)


@dataclass(slots=True)
class _Running:
    job: Job
    deadline: float | None
    thread: threading.Thread
    abandoned: bool = False


#: The outcome of a job whose handler thread ended without reporting one.
VANISHED = Outcome("retry", "the handler's thread ended without an outcome")


class SlotBook:
    """What a pool of handler slots keeps of the jobs it was given, shared by the thread
    pool and the process pool: the queue of jobs no slot has started, and the job each
    slot runs with the thread that runs it (the watchdog's view)."""

    _lock: threading.Lock
    _running: dict[Attempt, Any]  # each with .job and .thread
    _tasks: SimpleQueue[Job | None]

    def dead(self) -> set[Attempt]:
        """The attempts whose slot thread is gone without an outcome (not reaped yet):
        no heartbeat may keep their leases."""
        with self._lock:
            return {a for a, r in self._running.items() if not r.thread.is_alive()}

    def drain_unstarted(self) -> list[Job]:
        """Take back the jobs no slot has started (for release at shutdown)."""
        out: list[Job] = []
        while True:
            try:
                job = self._tasks.get_nowait()
            except Empty:
                break
            if job is not None:
                out.append(job)
        return out

    def running_jobs(self) -> list[Job]:
        with self._lock:
            return [r.job for r in self._running.values()]


class HandlerPool(SlotBook):
    """A fixed number of handler threads; a thread whose job timed out is abandoned.

    Python cannot kill a thread.  When a sync handler overruns its timeout, its job is
    failed (and retried) by the worker, the thread is marked abandoned and replaced,
    so capacity stays constant; when the hung call finally returns, the thread drops
    its result and exits.
    """

    def __init__(
        self,
        size: int,
        run: Callable[[Job], Outcome],
        on_done: Callable[[Job, Outcome], None],
        timeout: Callable[[Job], float | None],
        name: str,
    ) -> None:
        self._size = size
        self._run = run
        self._on_done = on_done
        self._timeout = timeout
        self._name = name
        self._tasks: SimpleQueue[Job | None] = SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[Attempt, _Running] = {}
        self._idle = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._serial = 0
        # The handlers' run time; the worker sizes its prefetch from it.
        self.runtime = RunTime()
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        self._serial += 1
        t = threading.Thread(target=self._loop, name=f"{self._name}-h{self._serial}", daemon=True)
        self._threads.append(t)
        t.start()

    def submit(self, job: Job) -> None:
        self._tasks.put(job)

    def _loop(self) -> None:
        while True:
            job = self._tasks.get()
            if job is None:
                return
            timeout = self._timeout(job)
            deadline = time.monotonic() + timeout if timeout else None
            me = _Running(job, deadline, threading.current_thread())
            with self._lock:
                self._running[job.attempt] = me
            began = time.monotonic()
            try:
                outcome = self._run(job)
            except BaseException as exc:
                # run_handler never raises; this is the last line that keeps a slot
                # from dying with its job held (and heartbeated) for ever.
                outcome = Outcome("retry", _trim("".join(traceback.format_exception(exc))))
            took = time.monotonic() - began
            with self._lock:
                if me.abandoned:
                    # INFO: the attempt's WARNING or ERROR line was logged at the timeout.
                    logger.info(
                        "handler for job %s returned after its timeout; result dropped", job.id
                    )
                    return
                del self._running[job.attempt]
                self.runtime.add(took)
                self._idle.notify_all()
            try:
                self._on_done(job, outcome)
            except Exception:
                # The slot lives on; the job's lease runs out and it runs again.
                logger.exception("handing over the outcome of job %s failed", job.id)

    def reap(self, now: float) -> tuple[list[Job], list[Job]]:
        """Take back the jobs whose handler is past its deadline (its thread abandoned)
        and those whose thread is gone without an outcome; each slot gets a new thread.

        Returns ``(timed_out, vanished)``.
        """
        expired: list[Job] = []
        vanished: list[Job] = []
        with self._lock:
            for attempt, r in list(self._running.items()):
                if not r.thread.is_alive():
                    vanished.append(r.job)
                elif r.deadline is not None and now >= r.deadline:
                    expired.append(r.job)
                else:
                    continue
                r.abandoned = True
                del self._running[attempt]
                if r.thread in self._threads:
                    self._threads.remove(r.thread)
                self._spawn()
            if expired or vanished:
                self._idle.notify_all()
        return expired, vanished

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
        """End the idle threads (abandoned ones end when their hung call returns)."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
