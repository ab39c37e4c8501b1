"""PatroniCluster: etcd and Patroni-managed PostgreSQL 15 nodes, for the patroni fault.

Teams fail over with Patroni, not ``pg_ctl promote``: Patroni decides when, fences the
old leader, demotes it to a replica that stays up read-only, and runs planned
switchovers.  This starts etcd and ``nodes`` Patroni nodes from Debian's packages
(``etcd-server``, ``patroni``; PostgreSQL from ``/usr/lib/postgresql/15/bin``) on free
local ports, in a fresh temporary directory, as the tests' own processes (never system
services), with ``synchronous_mode: true``; ``stop`` removes them all.

Clients use a multi-host DSN with ``target_session_attrs=read-write``: libpq tries the
hosts in turn and keeps the one that accepts writes.  That needs nothing but libpq, and
a demoted leader left running is skipped because it answers read-only.  Patroni's REST
API (``GET /primary``) would find the leader without trying each host, but a client
would then need a second, HTTP, dependency and its own retry loop; the DSN's answer is
checked by the server itself, at connect time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["ACTIONS", "PatroniCluster"]

PG15_BIN = Path("/usr/lib/postgresql/15/bin")
# The faults, in the order the chaos fault takes them (one each time it fires).
ACTIONS = ("switchover", "kill_postgres", "stop_patroni", "demote")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Node:
    name: str
    pg_port: int
    api_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None


# Kept short so that a test's failover takes seconds: the leader key lives `ttl` s,
# Patroni's loop runs every `loop_wait` s.  A team starts from 30/10/10 (docs/failover.md).
_TTL, _LOOP_WAIT, _RETRY_TIMEOUT = 8, 1, 3


class PatroniCluster:
    """etcd and ``nodes`` Patroni nodes; the methods below are the faults."""

    def __init__(self, nodes: int = 2) -> None:
        self.count = nodes
        self.nodes: list[_Node] = []
        self.dsn = ""
        self._dir: Path | None = None
        self._etcd: subprocess.Popen[bytes] | None = None
        self._etcd_port = 0
        self.done: list[str] = []

    @staticmethod
    def available() -> str | None:
        """Why the cluster cannot start here, or None."""
        for tool in ("etcd", "patroni", "patronictl"):
            if shutil.which(tool) is None:
                return f"{tool} not found (apt-get install patroni etcd-server)"
        if not (PG15_BIN / "initdb").exists():
            return f"PostgreSQL 15 not found in {PG15_BIN}"
        if os.geteuid() == 0:
            try:
                import pwd

                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root needs a 'postgres' user to run the servers as"
        return None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> str:
        """Start etcd and the nodes; returns the multi-host DSN once a leader writes and
        every replica streams synchronously."""
        why = self.available()
        if why is not None:
            raise RuntimeError(f"patroni cluster: {why}")
        self._dir = Path(tempfile.mkdtemp(prefix="skiplock-patroni-"))
        self._dir.chmod(0o755)
        self._start_etcd()
        for i in range(self.count):
            node = _Node(f"n{i}", _free_port(), _free_port(), self._dir / f"n{i}")
            node.dir.mkdir()
            if os.geteuid() == 0:
                shutil.chown(node.dir, "postgres", "postgres")
            (node.dir / "patroni.yml").write_text(self._config(node))
            self.nodes.append(node)
            self._spawn(node)
        hosts = ",".join("127.0.0.1" for _ in self.nodes)
        ports = ",".join(str(n.pg_port) for n in self.nodes)
        self.dsn = (
            f"host={hosts} port={ports} dbname=postgres user=postgres "
            "target_session_attrs=read-write connect_timeout=3"
        )
        self.wait_healthy(timeout)
        return self.dsn

    def _start_etcd(self) -> None:
        assert self._dir is not None
        client, peer = _free_port(), _free_port()
        self._etcd_port = client
        log = (self._dir / "etcd.log").open("wb")
        self._etcd = subprocess.Popen(
            [
                "etcd",
                *("--name", "e0", "--data-dir", str(self._dir / "etcd")),
                *("--listen-client-urls", f"http://127.0.0.1:{client}"),
                *("--advertise-client-urls", f"http://127.0.0.1:{client}"),
                *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-cluster", f"e0=http://127.0.0.1:{peer}"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _config(self, node: _Node) -> str:
        # JSON is YAML: no YAML writer needed.
        cfg: dict[str, Any] = {
            "scope": f"skiplock-{os.getpid()}",
            "name": node.name,
            "restapi": {
                "listen": f"127.0.0.1:{node.api_port}",
                "connect_address": f"127.0.0.1:{node.api_port}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{self._etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": _TTL,
                    "loop_wait": _LOOP_WAIT,
                    "retry_timeout": _RETRY_TIMEOUT,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.dir / "data"),
                "bin_dir": str(PG15_BIN),
                "pgpass": str(node.dir / "pgpass"),
                "authentication": {
                    "replication": {"username": "postgres"},
                    "superuser": {"username": "postgres"},
                },
                "parameters": {
                    "unix_socket_directories": str(node.dir),
                    "max_connections": 100,
                },
            },
        }
        return json.dumps(cfg, indent=1)

    def _spawn(self, node: _Node) -> None:
        log = (node.dir / "patroni.log").open("ab")
        node.proc = subprocess.Popen(
            ["patroni", str(node.dir / "patroni.yml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=node.dir,
            env={**os.environ, "HOME": str(node.dir)},
            user="postgres" if os.geteuid() == 0 else None,
            start_new_session=True,
        )

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
                node.proc.wait(10)
            self._kill_postmaster(node)
        if self._etcd is not None and self._etcd.poll() is None:
            self._etcd.kill()
            self._etcd.wait(10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PatroniCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reading the cluster -------------------------------------------------------------

    def role(self, node: _Node) -> str | None:
        """The node's role by its REST API ("primary", "replica"), None if it is down."""
        url = f"http://127.0.0.1:{node.api_port}/patroni"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                state = json.load(r)
        except (OSError, ValueError, urllib.error.URLError):
            return None
        role = state.get("role")
        if state.get("state") != "running":
            return None
        return "primary" if role == "master" else str(role)

    def leader(self) -> _Node | None:
        return next((n for n in self.nodes if self.role(n) == "primary" and self._writes(n)), None)

    def _writes(self, node: _Node) -> bool:
        try:
            with psycopg.connect(
                f"host=127.0.0.1 port={node.pg_port} dbname=postgres user=postgres",
                connect_timeout=2,
                autocommit=True,
            ) as conn:
                row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
                return bool(row and row[0])
        except psycopg.Error:
            return False

    def wait_leader(self, *, other_than: _Node | None = None, timeout: float = 60.0) -> _Node:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            leader = self.leader()
            if leader is not None and leader is not other_than:
                return leader
            time.sleep(0.1)
        raise RuntimeError(f"no new leader within {timeout:g}s")

    def wait_healthy(self, timeout: float = 120.0) -> _Node:
        """Until a leader writes and every other node is a replica that streams
        synchronously (Patroni's synchronous_mode picked it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            leader = self.leader()
            if leader is not None and self._all_sync(leader):
                return leader
            time.sleep(0.2)
        raise RuntimeError(f"the Patroni cluster was not healthy within {timeout:g}s")

    def _all_sync(self, leader: _Node) -> bool:
        """Every other node is the synchronous standby in Patroni's own view (the
        ``/sync`` key, shown by ``GET /cluster``), not only in pg_stat_replication: in
        synchronous_mode Patroni promotes only a node it has recorded as sync, and right
        after a switchover the demoted node streams before it is recorded."""
        url = f"http://127.0.0.1:{leader.api_port}/cluster"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                members = json.load(r).get("members", [])
        except (OSError, ValueError, urllib.error.URLError):
            return False
        others = [m for m in members if m.get("name") != leader.name]
        return len(others) == len(self.nodes) - 1 and all(
            m.get("role") == "sync_standby" and m.get("state") in ("streaming", "running")
            for m in others
        )

    # -- the faults: each returns (fault time, new leader writable time), wall clock -----

    def act(self, action: str) -> tuple[float, float]:
        return {
            "switchover": self.switchover,
            "kill_postgres": self.kill_postgres,
            "stop_patroni": self.stop_patroni,
            "demote": self.demote,
        }[action]()

    def switchover(self) -> tuple[float, float]:
        """A planned ``patronictl switchover`` to a replica."""
        old = self.wait_healthy()
        target = next(n for n in self.nodes if n is not old)
        t = time.time()
        self._patronictl(
            old, "switchover", "--leader", old.name, "--candidate", target.name, "--force"
        )
        self.wait_leader(other_than=old)
        self.done.append("switchover")
        return t, time.time()

    def kill_postgres(self) -> tuple[float, float]:
        """SIGKILL the leader's postmaster: Patroni restarts it or fails over (its
        choice, as in production); either way a writable leader comes back."""
        old = self.wait_healthy()
        t = time.time()
        self._kill_postmaster(old)
        back = self._wait_writable()
        self.done.append("kill_postgres")
        return t, back

    def stop_patroni(self) -> tuple[float, float]:
        """Stop the leader's Patroni (SIGTERM: it stops its PostgreSQL and gives up the
        leader key), then start it again: it rejoins as a replica."""
        old = self.wait_healthy()
        assert old.proc is not None
        t = time.time()
        old.proc.terminate()
        old.proc.wait(60)
        self.wait_leader(other_than=old)
        back = time.time()
        self._spawn(old)
        self.done.append("stop_patroni")
        return t, back

    def demote(self) -> tuple[float, float]:
        """Fail over away from the leader and leave it running read-only: a switchover
        demotes it to a replica that stays up, answers connections, and refuses writes
        (target_session_attrs=read-write makes clients skip it)."""
        old = self.wait_healthy()
        t, back = self.switchover()
        self.done[-1] = "demote"
        end = time.monotonic() + 60
        while self.role(old) != "replica" and time.monotonic() < end:
            time.sleep(0.1)
        return t, back

    def _wait_writable(self, timeout: float = 60.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(self.dsn, autocommit=True) as conn,
            ):
                conn.execute("SELECT 1")
                return time.time()
            time.sleep(0.05)
        raise RuntimeError("no writable leader")

    def _patronictl(self, node: _Node, *args: str) -> None:
        proc = subprocess.run(
            ["patronictl", "-c", str(node.dir / "patroni.yml"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            user="postgres" if os.geteuid() == 0 else None,
            cwd=node.dir,
            env={**os.environ, "HOME": str(node.dir)},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"patronictl {args[0]} failed: {proc.stderr.strip()}")

    def _kill_postmaster(self, node: _Node) -> None:
        pidfile = node.dir / "data" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            pid = int(pidfile.read_text().splitlines()[0])
            os.kill(pid, signal.SIGKILL)
