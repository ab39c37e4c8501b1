"""ReplicatedCluster: a throwaway primary and streaming standby, for the failover fault.

Both run from the machine's PostgreSQL 15 (``/usr/lib/postgresql/15/bin``; the embedded
pgserver has no ``pg_basebackup``) on free local ports, in a fresh temporary directory,
as the unprivileged ``postgres`` user when we are root (the server refuses to run as
root).  The only servers the failover fault kills or promotes: ``stop`` removes both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

__all__ = ["PG15_BIN", "ReplicatedCluster"]

PG15_BIN = Path("/usr/lib/postgresql/15/bin")
STANDBY_NAME = "skiplock_standby"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ReplicatedCluster:
    """A primary and a standby made with ``pg_basebackup -R``; ``failover`` kills the
    primary (``pg_ctl stop -m immediate``) and promotes the standby.

    ``sync``: the primary waits for the standby to flush each commit's WAL
    (``synchronous_standby_names = '*'``) before it acknowledges the commit; else the
    standby may lag, and a failover loses the WAL it had not received.
    """

    def __init__(self, *, sync: bool = True, bin_dir: Path = PG15_BIN) -> None:
        self.sync = sync
        self.bin = bin_dir
        self.ports: tuple[int, int] = (0, 0)
        self.dsn = ""
        self._dir: Path | None = None
        self.failed_over = False

    @staticmethod
    def available(bin_dir: Path = PG15_BIN) -> bool:
        return all((bin_dir / b).exists() for b in ("initdb", "pg_ctl", "pg_basebackup"))

    # -- running commands as the server's user -------------------------------------------

    def _run(self, *args: str, timeout: float = 60.0) -> None:
        user = "postgres" if os.geteuid() == 0 else None
        proc = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            user=user,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd="/",
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stderr.strip()}")

    def _data(self, name: str) -> Path:
        assert self._dir is not None
        return self._dir / name

    def _conf(self, name: str, lines: list[str]) -> None:
        with (self._data(name) / "postgresql.auto.conf").open("a") as f:
            f.write("\n".join(lines) + "\n")

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> str:
        """Start both servers; returns the multi-host DSN producers and workers use."""
        if not self.available(self.bin):
            raise RuntimeError(
                f"failover needs PostgreSQL's initdb and pg_basebackup in {self.bin}"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="skiplock-failover-"))
        if os.geteuid() == 0:
            shutil.chown(self._dir, "postgres", "postgres")
        self._dir.chmod(0o700)
        p1, p2 = _free_port(), _free_port()
        while p2 == p1:
            p2 = _free_port()
        self.ports = (p1, p2)
        primary = self._data("primary")
        self._run("initdb", "-D", str(primary), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        with (primary / "pg_hba.conf").open("w") as f:
            f.write(
                "local all all trust\nhost all all 127.0.0.1/32 trust\n"
                "local replication all trust\nhost replication all 127.0.0.1/32 trust\n"
            )
        self._conf(
            "primary",
            [
                f"port = {p1}",
                "listen_addresses = '127.0.0.1'",
                f"unix_socket_directories = '{self._dir}'",
                "wal_level = replica",
                "max_wal_senders = 5",
                "hot_standby = on",
                "max_connections = 100",
                f"synchronous_standby_names = '{'*' if self.sync else ''}'",
            ],
        )
        self._pg_ctl("primary", "start")
        self._run(
            "pg_basebackup",
            *("-h", "127.0.0.1", "-p", str(p1), "-U", "postgres"),
            *("-D", str(self._data("standby")), "-R", "-X", "stream", "-c", "fast"),
        )
        self._conf(
            "standby",
            [
                f"port = {p2}",
                # Named, so that synchronous_standby_names on the primary can match it.
                f"primary_conninfo = 'host=127.0.0.1 port={p1} user=postgres "
                f"application_name={STANDBY_NAME}'",
                # Once promoted it has no standby of its own: waiting for one would hang
                # every commit.
                "synchronous_standby_names = ''",
            ],
        )
        self._pg_ctl("standby", "start")
        self.dsn = (
            f"host=127.0.0.1,127.0.0.1 port={p1},{p2} dbname=postgres user=postgres "
            "target_session_attrs=read-write"
        )
        self._wait_streaming()
        return self.dsn

    def _pg_ctl(self, name: str, action: str, *extra: str) -> None:
        log = self._data(f"{name}.log")
        self._run("pg_ctl", "-w", "-D", str(self._data(name)), "-l", str(log), action, *extra)

    def _wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees the standby streaming (as its sync standby if sync)."""
        want = "sync" if self.sync else "async"
        end = time.monotonic() + timeout
        primary = f"host=127.0.0.1 port={self.ports[0]} dbname=postgres user=postgres"
        while time.monotonic() < end:
            with psycopg.connect(primary, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (STANDBY_NAME,),
                ).fetchone()
            if row is not None and row[0] == "streaming" and row[1] == want:
                return
            time.sleep(0.05)
        raise RuntimeError("the standby did not start streaming")

    def failover(self) -> tuple[float, float]:
        """Kill the primary, promote the standby; returns (killed, promoted) wall times."""
        self._pg_ctl("primary", "stop", "-m", "immediate")
        killed = time.time()
        self._pg_ctl("standby", "promote")
        self.failed_over = True
        return killed, time.time()

    def stop(self) -> None:
        if self._dir is None:
            return
        for name in ("standby", "primary"):
            if (self._data(name) / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    self._pg_ctl(name, "stop", "-m", "immediate")
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def __enter__(self) -> ReplicatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
