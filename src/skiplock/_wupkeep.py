"""Upkeep: the claim loop's sweeps and prunes, and the pace of the generations' upkeep.

A sweep gives back the jobs whose lease ran out (looking back only past the last sweep,
``SweepCursor``; docs/decisions/0015-claim-and-sweep-cursors.md) and registers the
worker; a prune deletes jobs finished longer ago than ``retention``.  Both are
scheduled with jitter, so that workers started together spread them.  After each sweep,
a loop of its own runs ``upkeep()`` (the generations), paced while the worker drains
(docs/decisions/0008-upkeep-paced-by-the-worker.md).
"""

from __future__ import annotations

import math
import random
import time

from ._cursor import SweepCursor
from ._wcore import WorkerCore, logger

__all__ = ["WorkerUpkeep"]


class WorkerUpkeep(WorkerCore):
    """When to sweep, prune and take an upkeep step, and what a sweep returned."""

    sweep_interval: float
    retention: float | None
    prune_interval: float
    _next_sweep: float
    _next_prune: float
    _sweeps: SweepCursor

    def _init_upkeep(
        self, sweep_interval: float, retention: float | None, prune_interval: float
    ) -> None:
        self.sweep_interval = sweep_interval
        self.retention = retention
        self.prune_interval = prune_interval
        # When the claim loop next sweeps and prunes (_sweep_due, _prune_due).
        self._next_sweep = 0.0
        self._next_prune = math.inf
        self._sweeps = SweepCursor()  # each sweep looks back past the last one only

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

    def swept(self, n: int, window: float | None, start: float) -> None:
        """Count a sweep that started at ``start`` (monotonic) looking back ``window``."""
        now = time.monotonic()
        self._sweeps.swept(window, start, now - start)
        if n:
            self._rewind(now)
            self.stats.add(sweeps_recovered=n)
            self._measure("swept", n, None)
            logger.info("worker %s: returned %d job(s) with expired leases", self.name, n)
