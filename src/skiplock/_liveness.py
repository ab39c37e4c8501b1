"""Liveness: a mark PostgreSQL clears when a worker's session ends, and the sweep reading it.

The lease tells a crashed worker from a live one only when it runs out: 30 s by default,
and a shorter lease robs slow live workers.  A session-level advisory lock is a better
witness.  The worker holds one on a connection kept for nothing else, and PostgreSQL
releases it the moment that session ends: the process was killed (SIGKILL, the OOM
killer) and the kernel closed its socket, or its host reset the connection.  Every
worker's liveness thread both keeps its own mark and runs ``sweep_dead``, which gives
back the jobs of workers whose mark has been gone for longer than a short grace.  A
stopped but live worker (SIGSTOP, a GC pause, a frozen VM) keeps its session and its
mark, so only its lease can expire; a worker whose connection dropped and came back
within the grace marks again and keeps its jobs.

A worker counts as dead only when its mark is gone *and* none of its sessions is left
(``pg_stat_activity``, by the application name every connection of the worker
carries): a dead process takes all its sessions with it, while a live worker whose
liveness connection alone was cut keeps the others and so keeps its jobs.

Behind a transaction pooler (``pooler=True``) consecutive transactions may run on
different server sessions, so a session lock would mark the pooler's connection, not
the worker: no mark is taken there and the lease alone decides.  A host that vanishes
without resetting its connections (a network partition, a power cut) leaves its
sessions open on the server until TCP gives up on them; the lease decides there too,
as it must for a partition: the worker may still be running.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from ._base import QueueSettings, backoff
from ._lane import Lane
from ._sql import statements

__all__ = ["DEFAULT_GRACE", "Liveness", "mark_keys"]

logger = logging.getLogger("skiplock.worker")

# Seconds a mark may be gone before the jobs go back: longer than a lane takes to
# reconnect (at once, then at most 0.25 s apart), shorter than anyone waits for a crash.
DEFAULT_GRACE = 1.0


def _int32(text: str) -> int:
    n = zlib.crc32(text.encode("utf-8"))
    return n - (1 << 32) if n >= 1 << 31 else n


def mark_keys(schema: str, worker: str) -> tuple[int, int]:
    """The two int4 keys of a worker's advisory lock: its schema's, and its name's."""
    return _int32(f"skiplock:{schema}"), _int32(worker)


class Liveness:
    """One worker's mark and its share of ``sweep_dead``; ``step`` runs on a thread."""

    def __init__(
        self,
        settings: QueueSettings,
        name: str,
        *,
        queues: Sequence[str],
        tasks: Sequence[str] | None,
        grace: float = DEFAULT_GRACE,
        cap: float = 0.25,
    ) -> None:
        self.name = name
        self.grace = grace
        self.marked = False
        self._queues = list(queues)
        self._tasks = None if tasks is None else list(tasks)
        self._stmts = statements(settings.schema)
        self._keys = mark_keys(settings.schema, name)
        self._lane = Lane(settings, f"worker {name} liveness", cap=cap)
        self._marked_on: psycopg.Connection[Any] | None = None

    def step(self) -> int:
        """Mark (again, on a new connection) and sweep; the number of jobs given back.

        Raises the driver's error when the server cannot be reached; the caller retries
        at its next turn (the lane reconnects at once, then on a short backoff).
        """
        with self._lane.connection() as conn:
            try:
                if conn is not self._marked_on:
                    self._mark(conn)
                cur = conn.cursor(row_factory=dict_row)
                rows = cur.execute(
                    self._stmts.sweep_dead, {"grace": self.grace, "limit": 1000}
                ).fetchall()
            except pgerrors.ReadOnlySqlTransaction:
                # A demoted primary: a new connection finds the one that takes writes
                # (target_session_attrs=read-write), and marks there.
                conn.close()
                raise
        return len(rows)

    @staticmethod
    def pause(failures: int, interval: float) -> float:
        """Seconds until the next ``step``: about ``interval``, or, after ``failures``
        failed steps in a row, a short backoff from 25 ms up to ``interval``.

        The grace counts from the moment the old session ended, not from when this
        worker noticed: a worker whose connections were all reset has only the grace to
        mark again before it is taken for dead and its jobs run elsewhere.  Waiting a
        whole interval after each failed step spent a quarter of it every time (chaos
        runs behind a resetting proxy saw marks back after 1.4 s, past the 1 s grace).
        The lane spaces its own reconnects, so retrying at once cannot spin on a server
        that is down.  The workers also step at once when their listener finds its
        connection broken, which is how a reset of every connection is noticed first.
        """
        if failures:
            return backoff(failures, base=0.025, cap=interval)
        return interval * random.uniform(0.8, 1.2)

    def _mark(self, conn: psycopg.Connection[Any]) -> None:
        key1, key2 = self._keys
        row = conn.execute(
            self._stmts.worker_mark,
            {
                "name": self.name,
                "queues": self._queues,
                "tasks": self._tasks,
                "key1": key1,
                "key2": key2,
            },
        ).fetchone()
        marked = bool(row and row[0])
        if not marked:
            # Another session holds this worker's lock: a second worker of the same
            # name, or a hash collision.  Correct either way, only slower to recover.
            logger.warning(
                "worker %s: could not take its liveness mark (is another worker named "
                "so?); a crash of this worker is found by its lease only",
                self.name,
            )
        self.marked = marked
        self._marked_on = conn

    def close(self) -> None:
        """Drop the connection, and with it the mark (call after the last write)."""
        self._lane.close()
