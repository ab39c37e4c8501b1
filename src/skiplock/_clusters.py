"""Queues over several PostgreSQL clusters: one App, one Worker per cluster.

An ``App`` may place queues on other databases (``App(dsn, queues={"reports": dsn2})``).
Each cluster is a whole skiplock of its own: its claim, fence, leases and sweep never
look at another, so exactly-once and fencing hold per cluster and nothing here adds a
protocol between them.  What this module adds is the plumbing: a worker serving queues
on several clusters (``ClusterWorkers``: one ``Worker`` each under one run/stop), and
the check that a transactional deferral's connection is on its queue's database.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from ._errors import ConfigError
from ._sql import statements
from ._wcore import WorkerStats
from ._worker import Worker
from ._wshutdown import stop_on_signals

__all__ = ["ClusterWorkers", "check_same_database"]

logger = logging.getLogger("skiplock.worker")

# (cluster's system identifier, database name)
Identity = tuple[str, str]


def server_identity(conn: Any) -> Identity:
    """Which database a psycopg connection is on.  Runs in the connection's current
    transaction, if any: a read of the control file, no lock taken."""
    row = conn.execute(statements("skiplock").server_identity).fetchone()
    return (str(row[0]), str(row[1]))


async def aserver_identity(conn: Any) -> Identity:
    cur = await conn.execute(statements("skiplock").server_identity)
    row = await cur.fetchone()
    return (str(row[0]), str(row[1]))


def check_same_database(queue: str, conn_identity: Identity, queue_identity: Identity) -> None:
    """ConfigError, one line, when a transactional deferral's connection is not on the
    database its queue lives on: the job would be committed where no worker of that
    queue looks (or the transaction would span two databases, which it cannot)."""
    if conn_identity != queue_identity:
        raise ConfigError(
            f"queue {queue!r} lives on another database ({_where(queue_identity)}) than the "
            f"connection given with conn= ({_where(conn_identity)}); a transactional defer "
            "can only join a transaction on its queue's own database"
        )


def _where(identity: Identity) -> str:
    return f"cluster {identity[0]}, database {identity[1]}"


class ClusterWorkers:
    """Workers of one app on several clusters, run and stopped as one.

    ``App.worker`` returns it when the queues it serves live on more than one cluster.
    It has a ``Worker``'s ``run()`` / ``start()`` / ``stop()`` / ``handle_signals()``:
    each Worker runs in a thread of its own; when one of them ends (stopped, or an
    error such as a cluster unreachable at start), the others are stopped too, so a
    process never goes on serving half its queues unnoticed, and ``run()`` raises the
    first error.  ``stats`` sums the workers' counters.
    """

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ConfigError("ClusterWorkers needs at least one worker")
        self.workers = list(workers)
        self.name = self.workers[0].name
        self.shutdown_grace = max(w.shutdown_grace for w in self.workers)
        self._running = False

    def __repr__(self) -> str:
        return f"<ClusterWorkers {[w.queues for w in self.workers]}>"

    @property
    def stats(self) -> WorkerStats:
        total = WorkerStats()
        for w in self.workers:
            total.add(**w.stats.snapshot())
        return total

    @property
    def stopping(self) -> bool:
        return any(w.stopping for w in self.workers)

    def stop(self, *, graceful: bool = True) -> None:
        for w in self.workers:
            w.stop(graceful=graceful)

    def run(self) -> WorkerStats:
        """Run every worker until ``stop()`` (or one of them ends); returns the summed
        counters, or raises the first worker's error once all have stopped."""
        if self._running:
            raise RuntimeError("worker already running")
        self._running = True
        ended = threading.Event()
        errors: list[BaseException] = []

        def one(w: Worker) -> None:
            try:
                w.run()
            except BaseException as exc:
                errors.append(exc)
                logger.error("worker %s (queues %s): %s", w.name, ",".join(w.queues), exc)
            finally:
                ended.set()

        threads = [
            threading.Thread(target=one, args=(w,), name=f"skiplock-cluster-{n}", daemon=True)
            for n, w in enumerate(self.workers)
        ]
        try:
            for t in threads:
                t.start()
            # A timed wait, so that the main thread runs its signal handlers promptly.
            while not ended.wait(0.5):
                pass
        finally:
            self.stop()
            for t in threads:
                t.join()
            self._running = False
        if errors:
            raise errors[0]
        return self.stats

    def start(self) -> threading.Thread:
        """Run in a background thread (tests, embedding); ``stop()`` then ``join()``."""
        t = threading.Thread(target=self.run, name=f"skiplock-worker-{self.name}", daemon=True)
        t.start()
        return t

    def handle_signals(self, what: str = "jobs") -> None:
        """As ``Worker.handle_signals``: the first SIGTERM/SIGINT stops every worker
        gracefully, a second exits at once (their leases run out; the jobs run again)."""
        stop_on_signals(self.stop, self.shutdown_grace, what)
