"""Each test's share of the server's connections, taken before it runs and checked.

scripts/test runs three test processes at once against one server, and all of them
share its ``max_connections`` (100 by default).  Most tests hold a few connections; a
few start eight worker processes and hold sixty.  Two of those at once, beside a third
test, ran the shared server out of slots: ``FATAL: sorry, too many clients already``
failed whichever test asked next (CI, December 2026).  So a test takes its share from
a ledger that every test process on the machine reads, before it starts, and waits
while the server cannot spare it; the shares held at once never pass the server's
``max_connections`` less RESERVE.  A narrow test that fits may go before a wide one
that waits, but not once that one has waited PATIENCE seconds: the wide test is not
starved, and the other processes are not idled each time a wide test comes up.

A test's share is DEFAULT, or ``n`` when marked ``@pytest.mark.connections(n)``; the
chaos, slow, bench and Patroni tests take the whole server (they run alone by design).
Shares are upper bounds with room (a quarter or more above the peak sampled on this
machine): a share too small fails the test, one too large makes others wait.  DEFAULT
and RESERVE let the demo's tests (60) run beside two others (60 + 2 x 18 = 100 - 4);
with 20 and 5 they ran beside one, and the parallel part took 346 s instead of 273.
The share is checked, not trusted: while the test runs, a thread counts the TCP
connections to the server that this process and its children hold (from /proc), and a
test that held more than its share fails with the figure to mark it with.  It samples
once a second (reading /proc/net/tcp costs ~10 ms beside a thousand TIME_WAIT sockets),
so it can miss a short peak and errs towards passing; the wide tests hold theirs for
seconds.  On a Unix socket (the embedded server) and off Linux it counts nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

DEFAULT = 18
RESERVE = 4  # for the server's other clients (psql, a dashboard)
PATIENCE = 2.0
WHOLE = ("chaos", "slow", "bench", "patroni")
WAIT = 240.0  # seconds a test waits for its share before it fails (pytest's timeout: 300)


class Ledger:
    """The shares held on one server, in a JSON file under a file lock.

    ``{"held": {pid: n}, "waiting": {pid: since}}``, waiters in the order they came: one
    entry per test process (a process runs one test at a time); entries of processes
    that are gone are dropped, so a test process killed mid-test frees its share.
    """

    def __init__(self, dsn: str, limit: int | None = None, patience: float = PATIENCE) -> None:
        self.patience = patience
        params = conninfo_to_dict(dsn)
        where = f"{params.get('host', '')}:{params.get('port', '5432')}"
        digest = hashlib.sha256(where.encode()).hexdigest()[:16]
        self.path = Path(tempfile.gettempdir()) / f"skiplock-test-connections-{digest}.json"
        self.limit = _limit(dsn) if limit is None else limit

    @contextlib.contextmanager
    def _open(self) -> Iterator[dict[str, Any]]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self.path.read_text())
            except (FileNotFoundError, ValueError):
                state = {}
            # A file of another shape (an older suite's, a torn write) counts as empty.
            held, waiting = (
                (state.get("held"), state.get("waiting")) if isinstance(state, dict) else ({}, {})
            )
            held = {p: n for p, n in _pairs(held) if _alive(int(p))}
            waiting = {p: t for p, t in _pairs(waiting) if _alive(int(p))}
            state = {"held": held, "waiting": waiting}
            yield state
            tmp = self.path.with_suffix(f".{os.getpid()}")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.path)

    def take(self, share: int, wait: float = WAIT) -> None:
        """Wait until ``share`` connections are free and it is this process's turn."""
        share = min(share, self.limit)
        me = str(os.getpid())
        deadline = time.monotonic() + wait
        while True:
            with self._open() as state:
                state["held"].pop(me, None)
                waiting = state["waiting"]
                waiting.setdefault(me, time.time())
                first, since = next(iter(waiting.items()))
                turn = first == me or time.time() - since < self.patience
                taken = turn and sum(state["held"].values()) + share <= self.limit
                late = not taken and time.monotonic() > deadline
                if taken or late:
                    del waiting[me]
                if taken:
                    state["held"][me] = share
                holders = dict(state["held"])
            if taken:
                return
            if late:
                raise TimeoutError(
                    f"waited {wait:.0f} s for {share} of {self.limit} connections; "
                    f"held by test processes {holders} ({self.path})"
                )
            time.sleep(0.05)

    def give_back(self) -> None:
        with self._open() as state:
            state["held"].pop(str(os.getpid()), None)


def _pairs(entries: object) -> list[tuple[str, Any]]:
    if not isinstance(entries, dict):
        return []
    return [(p, v) for p, v in entries.items() if p.isdigit() and isinstance(v, int | float)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _limit(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT current_setting('max_connections')::int").fetchone()
    assert row is not None
    return max(int(row[0]) - RESERVE, 1)


class Count:
    """The most TCP connections to ``port`` that this process and its descendants held
    at once, sampled every ``every`` seconds while the block runs."""

    def __init__(self, dsn: str, every: float = 1.0) -> None:
        params = conninfo_to_dict(dsn)
        host = str(params.get("host") or "")
        self.port = int(params.get("port") or 5432)
        self.every = every
        self.able = Path("/proc/net/tcp").exists() and bool(host) and not host.startswith("/")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-connection-count")

    def __enter__(self) -> Count:
        if self.able:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.able:
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, self.now())
            if self._stop.wait(self.every):
                return

    def now(self) -> int:
        """Connections to the port, established, held by a socket of the process tree."""
        mine = _socket_inodes(_tree(os.getpid()))
        port = f":{self.port:04X} 01 "  # the remote port, then the state: established
        held = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError), open(table) as f:
                lines = f.read().splitlines()[1:]
            # Most lines are other sockets (TIME_WAIT by the thousand): a substring test
            # skips them before any split.
            for line in lines:
                if port in line and line.split()[9] in mine:
                    held += 1
        return held


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return pids


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    return inodes
