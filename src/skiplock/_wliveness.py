"""Liveness: how a worker is seen alive, and how it is told there is work.

Three signals, each cheap: its row in ``workers`` (registered at each sweep, refreshed
every ``REGISTER_INTERVAL``; what ``skiplock status`` counts), the ``waiting`` flag on
that row (producers notify a queue only while one of its workers waits;
docs/decisions/0004-notify-only-waiting-workers.md), and the session mark (an advisory
lock its own connection holds, ``_liveness.py``): when a worker's session ends, any
worker's ``sweep_dead`` gives its jobs back at once instead of at lease expiry
(docs/decisions/0016-liveness-mark.md).
"""

from __future__ import annotations

import time

from ._liveness import Liveness
from ._wcore import WorkerCore, logger

__all__ = ["WorkerLiveness"]


class WorkerLiveness(WorkerCore):
    """Registration, the ``waiting`` flag, the session mark and its dead sweeps."""

    listen: bool  # wake on LISTEN/NOTIFY (never behind a pooler: it needs a session)
    liveness: bool  # keep a session mark (never behind a pooler: the same)
    poll_interval: float
    _registered_at: float | None
    _told_waiting: bool | None
    _busy_since: float | None
    _look_again_at: float | None

    def _init_liveness(self, listen: bool, liveness: bool, pooler: bool) -> None:
        self.listen = listen and not pooler
        self.liveness = liveness and not pooler
        self._registered_at = None
        # What this worker last wrote to its row's `waiting` (None: nothing yet, or the
        # row may be new), since when its claims come back full, and when to look again
        # after saying it waits (_waiting_change).
        self._told_waiting = None
        self._busy_since = None
        self._look_again_at = None

    # A worker refreshes its row in `workers` this often: `status` counts a worker as
    # gone after 30 s without a refresh (Queue.unserved's default).
    REGISTER_INTERVAL = 10.0

    def _register_due(self, now: float) -> bool:
        return self._registered_at is None or now - self._registered_at >= self.REGISTER_INTERVAL

    def _registered(self, now: float) -> None:
        self._registered_at = now
        # Registering may have created the row afresh (waiting NULL): say it again.
        self._told_waiting = None

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

    def dead_swept(self, n: int) -> None:
        """Count jobs a ``sweep_dead`` gave back (their worker's session had ended)."""
        self._rewind(time.monotonic())  # swept jobs keep their place: look back
        self.stats.add(sweeps_recovered=n)
        self._measure("swept", n, None)
        logger.info("worker %s: returned %d job(s) of workers whose session ended", self.name, n)

    @staticmethod
    def cancel_target(payload: str) -> int | None:
        """The job id of a ``cancel:<id>`` notification, else None."""
        kind, _, rest = payload.partition(":")
        if kind != "cancel" or not rest.isdigit():
            return None
        return int(rest)
