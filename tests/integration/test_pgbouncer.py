"""skiplock through a real PgBouncer (Debian's, installed by the set-up if missing).

Transaction mode hands each transaction to whichever server connection is free, so
nothing may rely on session state: no server-side prepared statements, no LISTEN, no
session advisory locks, no `options` startup parameter.  ``Queue(pooler=True)`` is
the mode for it.  Session mode is checked to keep LISTEN working.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock import Job, LeaseLost, Queue, Worker

HERE = Path(__file__).parent
ACCEPTANCE = HERE.parent / "acceptance"


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def pgbouncer_binary() -> str:
    """The pgbouncer executable, installed with apt-get when missing (as root)."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("pgbouncer is not installed and cannot be: needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Several test runs may install at once: wait for the dpkg lock instead of failing.
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-q", "pgbouncer"]
    r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-q"],
            env=env,
            capture_output=True,
            timeout=600,
        )
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if not found:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"apt-get could not install pgbouncer: {last}")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bouncer:
    """One pgbouncer process in front of the test server, in the given pool mode."""

    def __init__(self, server_dsn: str, mode: str, pool_size: int = 2) -> None:
        params = conninfo_to_dict(server_dsn)
        self.user = str(params.get("user") or pwd.getpwuid(os.geteuid()).pw_name)
        self.dbname = str(params.get("dbname") or self.user)
        backend = {
            "host": params.get("host") or "127.0.0.1",
            "port": params.get("port") or 5432,
            "dbname": self.dbname,
            "user": self.user,
        }
        if params.get("password"):
            backend["password"] = params["password"]
        self.port = free_port()
        # pgbouncer refuses to run as root: it drops to a user that can read its files
        # and reach the server, the owner of the socket directory for a Unix socket
        # (the embedded server keeps its socket in its private data directory).
        host = str(backend["host"])
        self.run_as = "postgres"
        if host.startswith("/"):
            self.run_as = pwd.getpwuid(Path(host).stat().st_uid).pw_name
        self.dir = Path(tempfile.mkdtemp(prefix="skiplock-pgbouncer-"))
        self.dir.chmod(0o755)
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"{self.dbname} = {make_conninfo(**backend)}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = {mode}\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 200\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        for f in self.dir.iterdir():
            f.chmod(0o644)
        if os.geteuid() == 0:
            shutil.chown(self.dir, self.run_as)
        cmd = [pgbouncer_binary(), str(ini)]
        if os.geteuid() == 0:
            cmd[1:1] = ["-u", self.run_as]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.dsn = make_conninfo(server_dsn, host="127.0.0.1", port=self.port)
        self.last_error = ""
        try:
            wait_until(self._answers, timeout=20, what=f"pgbouncer on port {self.port}")
        except AssertionError as exc:
            log = self.log()
            self.stop()
            raise AssertionError(f"{exc}: {self.last_error}\n{log}") from None

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            out = self.proc.stdout.read().decode() if self.proc.stdout else ""
            raise AssertionError(f"pgbouncer exited: {out}{self.log()}")
        try:
            psycopg.connect(self.dsn, connect_timeout=2).close()
        except psycopg.OperationalError as exc:
            self.last_error = str(exc)
            return False
        return True

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text() if path.exists() else ""

    def version(self) -> str:
        out = subprocess.run([pgbouncer_binary(), "--version"], capture_output=True, text=True)
        return out.stdout.splitlines()[0] if out.stdout else "?"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def bouncer(dsn: str) -> Iterator[Bouncer]:
    b = Bouncer(dsn, "transaction")
    yield b
    b.stop()


@pytest.fixture
def pooled(bouncer: Bouncer, schema: str) -> Iterator[Queue]:
    """A migrated Queue through PgBouncer in transaction mode (the migration goes
    through it too: its advisory lock is transaction-scoped)."""
    q = Queue(
        bouncer.dsn,
        schema=schema,
        application_name=f"skiplock-test:{schema}",
        max_size=4,
        pooler=True,
    )
    q.migrate()
    yield q
    q.close()


def test_debian_pgbouncer_is_what_the_docs_describe(bouncer: Bouncer) -> None:
    # docs/pgbouncer.md is written for Debian 12's 1.18: no protocol-level prepared
    # statements (1.21+).  A newer one changes nothing for skiplock, which prepares none.
    assert bouncer.version().startswith("PgBouncer 1.")


def test_operations_through_a_transaction_pooler(
    pooled: Queue, admin: psycopg.Connection[Any]
) -> None:
    s = sql.Identifier(pooled.schema)
    # Enough rounds that psycopg would prepare statements server-side (after 5 runs)
    # on each of the pool's connections if the pooler flag did not turn that off.
    for n in range(12):
        job_id = pooled.enqueue({"n": n}, queue="emails")
        [job] = pooled.claim(worker="w1", queue="emails", lease=30)
        assert job.id == job_id and job.attempts == 1
        assert pooled.heartbeat(job, lease=30) > job.locked_until  # type: ignore[operator]
        pooled.complete(job)
        with pytest.raises(LeaseLost):
            pooled.complete(job)  # a repeat is a stale write: fenced out
    key_id = pooled.enqueue({"k": 1}, idempotency_key="inv-7")
    assert pooled.enqueue({"k": 1}, idempotency_key="inv-7") == key_id
    ids = pooled.enqueue_many([{"m": i} for i in range(50)], queue="bulk")  # COPY
    assert len(ids) == 50

    # fail/retry: back to pending while attempts remain, failed after the last one
    pooled.enqueue({"r": 1}, queue="flaky", max_attempts=2)
    [job] = pooled.claim(worker="w1", queue="flaky")
    assert pooled.fail(job, "boom", delay=0) == "pending"
    [job] = pooled.claim(worker="w1", queue="flaky")
    assert job.attempts == 2
    assert pooled.fail(job, "boom again") == "failed"

    # sweep: a lease that ran out goes back to pending, and the old holder is fenced out
    pooled.enqueue({"s": 1}, queue="swept")
    [held] = pooled.claim(worker="dead-worker", queue="swept", lease=30)
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET locked_until = now() - interval '1 second' WHERE id = %s"
        ).format(s),
        (held.id,),
    )
    assert pooled.sweep() == 1
    with pytest.raises(LeaseLost):
        pooled.heartbeat(held)
    [again] = pooled.claim(worker="w2", queue="swept")
    assert again.id == held.id and again.attempts == 2
    pooled.complete(again)

    counts = {(r["queue"], r["status"]): r["jobs"] for r in pooled.status()}
    assert counts[("emails", "done")] == 12
    assert counts[("bulk", "pending")] == 50
    assert counts[("flaky", "failed")] == 1
    assert counts[("swept", "done")] == 1


def test_without_the_flag_prepared_statements_collide(bouncer: Bouncer) -> None:
    """Why ``pooler=True`` exists: psycopg prepares a statement it has run 5 times, under
    a name every client uses (_pg3_0), on whatever server connection the transaction got.
    Two clients taking turns through the pooler then share one server connection."""
    query = "SELECT 1 + %s"
    with (
        psycopg.connect(bouncer.dsn, autocommit=True) as a,
        psycopg.connect(bouncer.dsn, autocommit=True) as b,
        pytest.raises(psycopg.errors.DuplicatePreparedStatement),
    ):
        for i in range(10):
            a.execute(query, (i,))
            b.execute(query, (i,))
    # The same turns with prepare_threshold=None (what pooler=True sets) run fine.
    with (
        psycopg.connect(bouncer.dsn, autocommit=True, prepare_threshold=None) as a,
        psycopg.connect(bouncer.dsn, autocommit=True, prepare_threshold=None) as b,
    ):
        for i in range(10):
            assert a.execute(query, (i,)).fetchone() == (1 + i,)
            assert b.execute(query, (i,)).fetchone() == (1 + i,)


def test_worker_in_pooler_mode_polls_and_heartbeats(pooled: Queue) -> None:
    ran: list[int] = []

    def handler(job: Job) -> None:
        time.sleep(job.payload["sleep"])  # outlasts the lease: only heartbeats keep it
        ran.append(job.id)

    ids = [pooled.enqueue({"sleep": 1.2 if i == 0 else 0}) for i in range(20)]
    w = Worker(pooled, handler, concurrency=4, lease=0.6, poll_interval=0.05, sweep_interval=0.2)
    assert w.listen is False  # LISTEN needs a session of its own
    assert w.liveness is False  # so does a liveness mark: the lease alone decides here
    t = w.start()
    wait_until(lambda: len(ran) == 20, what="every job to run")
    with pooled.connection() as c:
        marks = c.execute(
            sql.SQL("SELECT mark_pid FROM {}.workers").format(sql.Identifier(pooled.schema))
        ).fetchall()
    assert marks == [(None,)]  # registered (status sees it), never marked
    w.stop()
    t.join(30)
    assert sorted(ran) == ids
    assert w.stats.lease_lost == 0 and w.stats.heartbeats >= 1 and w.stats.completed == 20
    assert all((pooled.get(i) or pytest.fail()).status == "done" for i in ids)


def test_cli_worker_with_pooler_flag(bouncer: Bouncer, pooled: Queue, schema: str) -> None:
    ids = [pooled.enqueue({"kind": "ok"}) for _ in range(5)]
    env = {
        **os.environ,
        "SKIPLOCK_DSN": bouncer.dsn,
        "PYTHONPATH": os.pathsep.join([str(ACCEPTANCE), os.environ.get("PYTHONPATH", "")]),
    }
    p = subprocess.Popen(
        [
            *(sys.executable, "-m", "skiplock.cli", "worker", "--schema", schema),
            *("--handler", "metrics_handlers:work", "--transaction-pooler"),
            *("--poll-interval", "0.1"),
            *("--name", f"{schema}-pooled"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(
            lambda: (
                p.poll() is None
                and all((pooled.get(i) or pytest.fail()).status == "done" for i in ids)
            ),
            what="the CLI worker to finish the jobs",
        )
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=30)[0].decode()
        assert p.returncode == 0, out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_session_mode_keeps_listen(dsn: str, schema: str) -> None:
    """In session mode a client keeps its server connection: LISTEN works, so a worker
    that polls only every 30 s still picks a new job up at once.

    PgBouncer 1.18 refuses the `options` startup parameter in any mode, which the
    worker's default (synchronous_commit off) sends; hence synchronous_commit=True.
    """
    b = Bouncer(dsn, "session", pool_size=8)
    try:
        q = Queue(b.dsn, schema=schema, application_name=f"skiplock-test:{schema}")
        q.migrate()
        done: list[int] = []
        w = Worker(
            q,
            lambda job: done.append(job.id),
            poll_interval=30,
            lease=5,
            synchronous_commit=True,
        )
        t = w.start()
        wait_until(lambda: w.listen and len(w.inflight()) == 0 and _listening(dsn, w.name))
        job_id = q.enqueue({"hello": 1})
        wait_until(lambda: done == [job_id], timeout=10, what="the NOTIFY to wake the worker")
        w.stop()
        t.join(30)
        q.close()
    finally:
        b.stop()


def _listening(dsn: str, name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%' "
            "AND application_name = %s",
            (f"skiplock-worker:{name}",),
        ).fetchone()
    return bool(row and row[0])
