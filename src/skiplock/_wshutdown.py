"""Shutdown: stopping on a signal, and what the grace could not save.

``stop()`` (each worker's own: a thread's event or the loop's) stops the claims; the
worker then releases the jobs it holds but never started, waits up to
``shutdown_grace`` for running handlers, and has every writer write what it owes
before the heartbeat and the mark end.  Handlers still running after the grace are
abandoned (``abandon``): their jobs run again once their leases run out.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence

from ._job import Job
from ._wcore import WorkerCore, logger

__all__ = ["WorkerShutdown", "stop_on_signals"]


def stop_on_signals(stop: Callable[[], None], grace: float, what: str = "jobs") -> None:
    """Call ``stop`` on the first SIGTERM or SIGINT; exit the process on a second.

    The handler only counts the signal and writes its number to a pipe; a thread of its
    own reads it, logs the line and calls ``stop``.  Python runs a handler in the main
    thread between two bytecodes, maybe while that thread holds a lock that ``stop`` or
    the log line takes (an Event's, a logging handler's), and taking it again there hangs
    the process for good: a SIGTERM that came as the claim loop cleared its wake event
    left a worker saying "finishing running jobs" and never exiting.

    The worker's own signals never raise in a handler (no KeyboardInterrupt), so any
    that a handler sees is the handler's (``failed_outcome``).
    """
    read_fd, write_fd = os.pipe()
    count = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal count
        count += 1
        if count > 1:
            os._exit(128 + signum)
        os.write(write_fd, bytes([signum]))

    def on_first_signal() -> None:
        signum = os.read(read_fd, 1)[0]
        os.close(read_fd)
        logger.info(
            "%s: finishing running %s (up to %gs); signal again to exit now",
            signal.Signals(signum).name,
            what,
            grace,
        )
        stop()

    threading.Thread(target=on_first_signal, name="skiplock-signals", daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


class WorkerShutdown(WorkerCore):
    """``stop``, signals, and the handlers abandoned at the end of the grace."""

    shutdown_grace: float

    def stop(self, *, graceful: bool = True) -> None:
        raise NotImplementedError

    def _stop_asked(self) -> bool:
        raise NotImplementedError

    def handle_signals(self, what: str = "jobs") -> None:
        """Stop gracefully on the first SIGTERM or SIGINT, exit at once on a second.

        Call it in the main thread before ``run()``, as ``skiplock worker`` does.  At the
        second signal the process exits without writing the outcomes it owes: the
        leases of the jobs still held run out (or its session's mark goes with it) and
        another worker runs them again.
        """
        stop_on_signals(self.stop, self.shutdown_grace, what)

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
