"""Lane: one connection of a worker's own, for one role, reconnected on skiplock's schedule.

A worker's claims, writes and heartbeats each run on a lane instead of a shared pool.
psycopg_pool retries a failed connect after 1 s, then 2, 4, 8 s: after a server
restart a worker could sit without a connection for longer than a short lease while
the server was back, and its jobs were swept and run twice.  A lane tries again at
once when its connection breaks, then after a short capped backoff with jitter
(25 ms doubling, at most ``cap``), so it is back within ``cap`` of the server.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg

from ._base import QueueSettings

__all__ = ["Lane"]

logger = logging.getLogger("skiplock.worker")


class Lane:
    """A connection source with the pool's ``connection()``/``close()``, one connection deep.

    The lock makes a second thread wait for the first to return the connection; each
    role has its own lane, so that only happens at shutdown.
    """

    def __init__(self, settings: QueueSettings, role: str, *, cap: float = 0.25) -> None:
        self.settings = settings
        self.role = role
        self.cap = cap
        self.reconnects = 0  # connections made after the first
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._failures = 0
        self._next_try = 0.0
        self._closed = False
        self._opened = False

    def delay(self, failures: int) -> float:
        """Seconds before connect attempt ``failures + 1`` (0 for the first retry)."""
        if failures <= 0:
            return 0.0
        # Bounded exponent: failures keep counting through a long outage, and a float
        # times 2 ** 1024 raises OverflowError (see _base.backoff).
        return float(min(self.cap, 0.025 * 2.0 ** min(failures - 1, 60)) * random.uniform(0.5, 1.0))

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Lend the lane's connection, (re)connecting first if it is gone.

        A failed connect raises the driver's OperationalError at once (the caller's
        retry policy decides what next); the lane only spaces its attempts.
        """
        with self._lock:
            conn = self._ensure(timeout)
            try:
                yield conn
            finally:
                if conn.broken or conn.closed:
                    # Dropped now, reconnected on the next use: the first retry is at once.
                    self._drop()

    def _ensure(self, timeout: float | None) -> psycopg.Connection[Any]:
        if self._closed:
            raise psycopg.OperationalError(f"{self.role}: connection closed")
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self._drop()
        wait = self._next_try - time.monotonic()
        if wait > 0:
            time.sleep(wait if timeout is None else min(wait, timeout))
        s = self.settings
        try:
            conn = psycopg.Connection.connect(s.dsn, **s.connect_kwargs())
        except psycopg.Error:
            self._failures += 1
            self._next_try = time.monotonic() + self.delay(self._failures)
            raise
        if self._opened:
            self.reconnects += 1
        self._opened = True
        self._failures, self._next_try = 0, 0.0
        self._conn = conn
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            with suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
