"""`skiplock worker --health-port` as a kubelet sees it: real processes, real HTTP.

A worker is wedged on purpose by an ACCESS EXCLUSIVE lock on its jobs table (seen
waiting with pg_blocking_pids) and, under ``--processes``, one child is frozen with
SIGSTOP: the supervisor's one port answers for all its children.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql

from skiplock import Queue

from .test_cli import wait_until

HERE = Path(__file__).parent


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_for(port: int, path: str, status: int, timeout: float = 30.0) -> tuple[int, Any]:
    """Poll until ``path`` answers ``status``; returns it and the body."""
    found: list[dict[str, Any]] = []

    def answered() -> bool:
        got, doc = get(port, path)
        found.append(doc)
        return got == status

    try:
        wait_until(answered, timeout=timeout, what=f"{path} {status}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its last answer: {found[-1:]}") from None
    return status, found[-1]


class Proc:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def health_port(self, who: str = "worker") -> int:
        """The port the process logged it serves health on (``--health-port 0``)."""
        pattern = re.compile(rf"{who}[^\n]*: health at http://[^:]+:(\d+)/livez")
        found: list[int] = []

        def logged() -> bool:
            assert self.proc.poll() is None, self.output()
            m = pattern.search(self.output())
            if m:
                found.append(int(m.group(1)))
            return bool(m)

        wait_until(logged, what="the health line")
        return found[0]


@pytest.fixture
def start(dsn: str, schema: str, tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []
    env = {
        **os.environ,
        "SKIPLOCK_DSN": dsn,
        "ACCEPT_SCHEMA": schema,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }

    def run(*extra: str) -> Proc:
        log = tmp_path / f"worker{len(procs)}.log"
        with log.open("wb") as out:
            p = subprocess.Popen(
                [
                    *(sys.executable, "-m", "skiplock.cli", "worker", "--schema", schema),
                    *("--handler", "handlers:record", "--health-port", "0", *extra),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(Proc(p, log))
        return procs[-1]

    yield run
    for p in procs:
        if p.proc.poll() is None:
            # A supervisor's children run in sessions of their own: a SIGKILL of the
            # supervisor alone would leave them running, holding connections.
            for child in psutil.Process(p.proc.pid).children():
                child.kill()
            p.proc.kill()
        p.proc.wait(10)


def blocked(queue: Queue, blocker: int, prefix: str) -> int:
    """Sessions of workers named ``prefix``... waiting for a lock ``blocker`` holds."""
    with queue.connection() as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name LIKE %s AND %s = ANY(pg_blocking_pids(pid))",
            (f"skiplock-worker:{prefix}%", blocker),
        ).fetchone()
    return int(row[0]) if row else 0


def lock_jobs(admin: psycopg.Connection[Any], schema: str) -> None:
    admin.execute("BEGIN")
    admin.execute(
        sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(schema))
    )


def test_a_worker_command_answers_probes_and_a_lock_wedges_it(
    queue: Queue, admin: psycopg.Connection[Any], start: Callable[..., Proc]
) -> None:
    w = start("--name", "hc", "--health-stall", "1")
    port = w.health_port()
    assert get(port, "/livez") == (200, {"live": True, "worker": "hc"})
    _, doc = wait_for(port, "/readyz", 200)
    assert doc["ready"] is True and doc["schema"] == queue.schema
    lock_jobs(admin, queue.schema)
    try:
        wait_until(lambda: blocked(queue, admin.info.backend_pid, "hc") > 0, what="a block")
        # Its liveness mark (every 0.25 s) may block before its claim loop (every 1 s).
        wait_until(lambda: "claim loop" in get(port, "/livez")[1].get("stuck", {}), what="503")
        status, doc = get(port, "/livez")
        assert status == 503 and "claim loop stuck for" in doc["reason"], doc
    finally:
        admin.execute("ROLLBACK")
    wait_for(port, "/livez", 200)
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(30) == 0, w.output()
    with pytest.raises(OSError):
        get(port, "/livez")


def test_a_worker_on_an_unmigrated_schema_is_not_ready(
    schema: str, start: Callable[..., Proc]
) -> None:
    w = start("--no-migrate", "--name", "hu")
    port = w.health_port()
    _, doc = wait_for(port, "/readyz", 503)
    assert doc["reason"] == f"schema {schema!r} has no skiplock tables: run skiplock migrate"
    assert get(port, "/livez")[0] == 200


@pytest.mark.connections(30)
def test_processes_answer_on_one_port_for_every_child(
    queue: Queue, admin: psycopg.Connection[Any], start: Callable[..., Proc]
) -> None:
    sup = start("--processes", "2", "--name", "hp", "--health-stall", "1")
    port = sup.health_port("supervisor")
    _, doc = wait_for(port, "/readyz", 200)
    assert [c["process"] for c in doc["processes"]] == [1, 2]
    assert {c["worker"] for c in doc["processes"]} == {"hp-1", "hp-2"}
    _, doc = wait_for(port, "/livez", 200)
    assert all(c["live"] for c in doc["processes"])
    # Both children wedged on a lock: one answer names both.
    lock_jobs(admin, queue.schema)
    try:
        wait_until(lambda: blocked(queue, admin.info.backend_pid, "hp-") >= 2, what="blocks")
        wait_until(
            lambda: all(
                "claim loop" in c.get("stuck", {}) for c in get(port, "/livez")[1]["processes"]
            ),
            what="both children stuck",
        )
        status, doc = get(port, "/livez")
        assert status == 503 and doc["reason"].startswith("process 1: claim loop stuck"), doc
    finally:
        admin.execute("ROLLBACK")
    wait_for(port, "/livez", 200)
    # A frozen child does not answer at all: the supervisor's probe of it times out.
    child = min(psutil.Process(sup.proc.pid).children(), key=lambda p: p.pid)
    child.send_signal(signal.SIGSTOP)
    try:
        _, doc = wait_for(port, "/livez", 503)
        frozen = [c for c in doc["processes"] if c.get("pid") == child.pid]
        assert frozen and frozen[0]["reason"].startswith("did not answer"), doc
    finally:
        child.send_signal(signal.SIGCONT)
    _, doc = wait_for(port, "/livez", 200)
    [slot] = [c["process"] for c in doc["processes"] if c["pid"] == child.pid]
    # A dead child is not ready until the supervisor has started it again (1 s later).
    # Seen once the supervisor has reaped it: a probe sent before that may wait in the
    # slot's socket and be answered by the new child.
    child.kill()
    wait_until(lambda: f"(pid {child.pid}) exited with -9" in sup.output(), what="reaped")
    _, doc = wait_for(port, "/readyz", 503)
    [gone] = [c for c in doc["processes"] if c["process"] == slot]
    assert (gone["ready"], gone["reason"]) == (False, "being started again"), doc
    _, doc = wait_for(port, "/readyz", 200)
    assert child.pid not in {c["pid"] for c in doc["processes"]}
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.proc.wait(30) == 0, sup.output()
    with pytest.raises(OSError):
        get(port, "/livez")
