"""A throwaway PostgreSQL cluster (initdb + pg_ctl) for settings the shared server lacks.

The shared server runs with ``autovacuum = off``, and a table's ``autovacuum_enabled``
cannot turn it on there: the launcher does not run at all.  So the "autovacuum on"
figures come from a cluster of our own, built from the same PostgreSQL binaries, with
the server defaults a production install has (autovacuum on) plus pg_stat_statements.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .common import log

BIN_GLOB = "/usr/lib/postgresql/*/bin"


def _bindir() -> Path:
    found = sorted(Path("/").glob(BIN_GLOB.lstrip("/")))
    for d in reversed(found):
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    raise RuntimeError(f"no initdb/pg_ctl in {BIN_GLOB}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb refuses to run as root: run it as the postgres account if we are root."""
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@contextlib.contextmanager
def cluster(
    settings: dict[str, str] | None = None,
    info: dict[str, Path] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start a fresh cluster on a free port; yields its DSN; stops and removes it after.

    ``info``, if given, is filled with the cluster's ``root``, ``data`` and server
    ``log`` paths (the stalls harness reads the log: checkpoints, slow statements).
    ``env``: more environment for the server (a preloaded library that makes each WAL
    flush slower, as the retired ``pickup_slow_flush.py`` did)."""
    bindir = _bindir()
    root = Path(tempfile.mkdtemp(prefix="skiplock-bench-scratch-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = _free_port()
    if info is not None:
        info.update(root=root, data=data, log=root / "log")
    conf = {
        "autovacuum": "on",
        "shared_preload_libraries": "'pg_stat_statements'",
        "listen_addresses": "'127.0.0.1'",
        "port": str(port),
        "unix_socket_directories": f"'{root}'",
        "max_connections": "100",
        "fsync": "on",
    } | (settings or {})
    try:
        subprocess.run(
            _as_postgres(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
        )
        with (data / "postgresql.auto.conf").open("a", encoding="utf-8") as f:
            for k, v in conf.items():
                f.write(f"{k} = {v}\n")
        subprocess.run(
            _as_postgres(
                [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "start"]
            ),
            check=True,
            capture_output=True,
            env=None if env is None else os.environ | env,
        )
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        log(f"scratch cluster {bindir.parent.name} on port {port} ({root})")
        yield dsn
    finally:
        subprocess.run(
            _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)
