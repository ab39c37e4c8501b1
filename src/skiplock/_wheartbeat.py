"""The heartbeat: every held job's lease extended in one fenced statement.

A beat goes every ``heartbeat_interval`` (a third of the lease by default) for every job
the worker holds, whatever chain claimed it, and at once when a cancel of a held job
is announced.  Its answer says which attempts are no longer ours (swept, re-claimed or
cancelled): the worker stops holding those (``beaten``), and their handlers' outcomes,
written later, are refused by the fence.  ``Worker`` beats on a thread and a
connection of its own; ``AsyncWorker`` from its first chain's writer.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from ._errors import ConfigError
from ._job import Attempt, Job
from ._ops import FenceResult
from ._wcore import WorkerCore

__all__ = ["WorkerHeartbeat"]


class WorkerHeartbeat(WorkerCore):
    """The heartbeat's interval, what its answer meant, and what it missed."""

    heartbeat_interval: float

    def _init_heartbeat(self, heartbeat_interval: float | None) -> None:
        self.heartbeat_interval = heartbeat_interval or self.lease / 3.0
        if self.heartbeat_interval >= self.lease:
            raise ConfigError("heartbeat interval must be shorter than the lease")

    @staticmethod
    def _ours(
        jobs: Sequence[Job], writing: Container[Attempt], held: Container[Attempt]
    ) -> list[Job]:
        """The beaten jobs whose answer is the beat's to give: still held, and not
        being written meanwhile (a writer's own fenced answer says what happened to
        those, and a beat finding our own completion is no lost lease)."""
        return [job for job in jobs if job.attempt not in writing and job.attempt in held]

    def beaten(self, jobs: Sequence[Job], res: FenceResult) -> list[Job]:
        """Count a heartbeat's answer; returns the attempts no longer ours."""
        self.stats.add(heartbeats=len(res.attempts))
        lost = [job for job in jobs if res.row(job) is None]
        self._missed(lost)
        for job in lost:
            self._emit("lease_lost", job)
        self._lost(lost, "the heartbeat found it swept, re-claimed or cancelled", heartbeat=True)
        return lost

    def _missed(self, jobs: Sequence[Job]) -> None:
        """Heartbeats that did not keep a lease (failed, or found it gone), per queue."""
        per_queue: dict[str, int] = {}
        for job in jobs:
            per_queue[job.queue] = per_queue.get(job.queue, 0) + 1
        for queue_name, n in per_queue.items():
            self._measure("heartbeat_missed", n, queue_name)
