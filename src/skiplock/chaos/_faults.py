"""The faults: what the chaos run does to workers, connections and the server.

Every injector decides by observing state, not by timing: a kill or pause picks a
worker that holds running jobs according to the jobs table, a pause lasts until the
paused worker's jobs have been swept and claimed by someone else, a terminate picks
backends from ``pg_stat_activity`` by application_name.  Each fault is written to the
history with its time and target pid, which is what lets the checker name the cause of
every duplicated execution.

A server restart is only ever done to a ``ScratchCluster`` this module started itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from psycopg import sql

from ._cluster import ScratchCluster
from ._history import HistoryWriter
from ._patroni import ACTIONS, PatroniCluster
from ._proxy import ChaosProxy
from ._replicated import ReplicatedCluster

__all__ = [
    "FAULTS",
    "ConnectionHog",
    "FaultContext",
    "LongTransaction",
    "ScratchCluster",
    "WorkerHandle",
    "dead_tuples",
    "inject",
    "wait_until",
]

# Families that fire repeatedly during the fault phase, and those that hold a condition
# for the whole phase.
REPEATED = (
    "kill",
    "pause",
    "terminate",
    "restart",
    "crash",
    "maxconn",
    "readonly",
    "proxy",
    "failover",
    "patroni",
)
HELD = ("handlers", "exhaust", "longtx")
FAULTS = REPEATED + HELD
# Faults done only to a cluster the run starts itself, never to a server it is given.
SCRATCH_ONLY = ("restart", "crash", "exhaust", "maxconn", "readonly")
# Done to a primary and standby the run starts itself (ReplicatedCluster).
REPLICATED_ONLY = ("failover",)
# Done to etcd and Patroni-managed nodes the run starts itself (PatroniCluster).
PATRONI_ONLY = ("patroni",)


def wait_until(
    cond: Callable[[], bool], timeout: float, *, interval: float = 0.02, stop: Any = None
) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` passes (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if stop is not None and stop.is_set():
            return False
        time.sleep(interval)
    return bool(cond())


class WorkerHandle(Protocol):
    """What the injector needs of a worker process (the run's fleet provides it)."""

    paused: bool
    busy: bool

    @property
    def pid(self) -> int: ...

    @property
    def name(self) -> str: ...


class Fleet(Protocol):
    def acquire(self, names: set[str]) -> WorkerHandle | None: ...

    def release(self, proc: WorkerHandle) -> None: ...

    def expect_exit(self, proc: WorkerHandle) -> None: ...

    def killed(self, proc: WorkerHandle) -> None: ...


@dataclass
class FaultContext:
    """Everything an injector touches; one per run."""

    dsn: str  # direct, never through the proxy
    schema: str
    run_id: str
    lease: float
    fleet: Fleet
    history: HistoryWriter
    proxy: ChaosProxy | None = None
    cluster: ScratchCluster | None = None
    replicated: ReplicatedCluster | None = None
    patroni: PatroniCluster | None = None
    rng: random.Random = field(default_factory=random.Random)
    stop: threading.Event = field(default_factory=threading.Event)
    markers: int = 0
    _conn: psycopg.Connection[Any] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def query(self, query: Any, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run ``query`` on the run's own admin connection, reconnecting as needed."""
        with self._lock:
            for attempt in range(100):
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = psycopg.connect(
                            self.dsn,
                            autocommit=True,
                            application_name=f"chaos-admin:{self.run_id}",
                            connect_timeout=5,
                        )
                    cur = self._conn.execute(query, params)
                    return cur.fetchall() if cur.description is not None else []
                except psycopg.OperationalError:
                    # The server restarts or is full: wait for it, the fault is ours.
                    with contextlib.suppress(Exception):
                        if self._conn is not None:
                            self._conn.close()
                    self._conn = None
                    time.sleep(min(0.05 * (attempt + 1), 0.5))
            raise psycopg.OperationalError("admin connection: server did not come back")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def record(self, kind: str, **fields: Any) -> None:
        self.history.write({"ev": "fault", "f": kind, **fields})

    # -- observations --------------------------------------------------------------------

    def jobs(self) -> sql.Composed:
        return sql.SQL("{}.jobs").format(sql.Identifier(self.schema))

    def holders(self) -> dict[str, int]:
        rows = self.query(
            sql.SQL(
                "SELECT worker, count(*) FROM {} WHERE status = 'running' GROUP BY worker"
            ).format(self.jobs())
        )
        return {str(w): int(n) for w, n in rows}

    def held_by(self, worker: str) -> list[tuple[int, str]]:
        rows = self.query(
            sql.SQL(
                "SELECT id, lease_token::text FROM {} WHERE status = 'running' AND worker = %s"
            ).format(self.jobs()),
            (worker,),
        )
        return [(int(i), str(t)) for i, t in rows]

    def reclaimed(self, held: Sequence[tuple[int, str]]) -> bool:
        """No job of ``held`` is pending or running under its old token any more: each was
        swept and claimed again (or finished)."""
        rows = self.query(
            sql.SQL(
                "SELECT count(*) FROM {} j JOIN unnest(%s::bigint[], %s::uuid[]) AS h(id, tok) "
                "ON j.id = h.id WHERE j.lease_token = h.tok "
                "AND j.status IN ('pending', 'running')"
            ).format(self.jobs()),
            ([i for i, _ in held], [t for _, t in held]),
        )
        return int(rows[0][0]) == 0


def _holder(ctx: FaultContext) -> WorkerHandle | None:
    holders = ctx.holders()
    return ctx.fleet.acquire({w for w, n in holders.items() if n > 0})


def kill(ctx: FaultContext) -> bool:
    """SIGKILL a worker process that holds running jobs; the fleet starts a replacement."""
    proc = _holder(ctx)
    if proc is None:
        return False
    held = len(ctx.held_by(proc.name))
    # Expected before it happens: the fleet's check, on another thread, must not find
    # the process dead before `killed` says so and count our kill as a crash.
    ctx.fleet.expect_exit(proc)
    t = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    ctx.record("kill", t=t, pid=proc.pid, w=proc.name, held=held)
    ctx.fleet.killed(proc)
    return True


def pause(ctx: FaultContext) -> bool:
    """SIGSTOP a worker holding jobs until they were swept and claimed again, then SIGCONT.

    When it wakes up, its heartbeats and completions for those jobs carry a dead lease
    token: each must come back as LeaseLost and change nothing.
    """
    proc = _holder(ctx)
    if proc is None:
        return False
    t = time.time()
    os.kill(proc.pid, signal.SIGSTOP)
    proc.paused = True
    try:
        held = ctx.held_by(proc.name)  # frozen now: this set cannot grow
        ctx.record("pause", t=t, pid=proc.pid, w=proc.name, held=len(held))
        if held:
            wait_until(lambda: ctx.reclaimed(held), ctx.lease * 6 + 10, interval=0.05)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.paused = False
        ctx.record("resume", pid=proc.pid, w=proc.name, paused_for=round(time.time() - t, 3))
        ctx.fleet.release(proc)
    return bool(held)


def terminate(ctx: FaultContext) -> bool:
    """pg_terminate_backend on some worker and producer connections, busy ones first."""
    rows = ctx.query(
        "SELECT pid, application_name, state FROM pg_stat_activity "
        "WHERE application_name LIKE %s OR application_name LIKE %s",
        (f"skiplock-worker:chaos-{ctx.run_id}-%", f"chaos-producer:{ctx.run_id}%"),
    )
    if not rows:
        return False
    active = [r for r in rows if r[2] == "active"]
    k = max(1, len(rows) // 3)
    picked = (
        active[:k]
        if len(active) >= k
        else active + ctx.rng.sample([r for r in rows if r not in active], k - len(active))
    )
    pids = [int(r[0]) for r in picked]
    ctx.query("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) AS p", (pids,))
    ctx.record("terminate", n=len(pids), backends=[str(r[1]) for r in picked])
    return True


def restart(ctx: FaultContext) -> bool:
    """Restart the scratch cluster (fast shutdown: every session is cut)."""
    if ctx.cluster is None:
        raise RuntimeError("restart needs a scratch cluster; the shared server is never restarted")
    t = time.time()
    with ctx._lock:
        if ctx._conn is not None:
            with contextlib.suppress(Exception):
                ctx._conn.close()
            ctx._conn = None
    down = ctx.cluster.restart()
    back = time.time()
    ctx.record("restart", t=t, down=round(down, 3), back=back)
    _markers(ctx, "restart")
    return True


def _markers(ctx: FaultContext, kind: str, n: int = 60) -> None:
    """Enqueue a backlog the moment the server is back, on a fresh connection, so the
    time to the first claim measures the workers' reconnection, not the producers'
    (whose pool reconnects on its own schedule).  Each job takes 200 ms: the backlog
    lasts about a second, so every worker finds work whenever it is back."""
    from skiplock import Queue

    ctx.markers += 1
    values = [f"{ctx.run_id}:{kind}{ctx.markers}:{i}" for i in range(n)]
    ctx.history.write({"ev": "enqueue", "ph": "invoke", "vs": values, "k": "ok", "expect": "done"})
    try:
        with Queue(ctx.dsn, schema=ctx.schema, min_size=1, max_size=1) as q:
            ids = q.enqueue_many([{"v": v, "k": "ok", "ms": 200} for v in values])
    except Exception as exc:
        # Not sent if the connection was refused; else it may have committed.
        sent = "cannot reach" not in str(exc)
        ctx.history.write(
            {"ev": "enqueue", "ph": "info" if sent else "fail", "vs": values, "error": str(exc)}
        )
        return
    ctx.history.write({"ev": "enqueue", "ph": "ok", "vs": values, "ids": ids})


def crash(ctx: FaultContext) -> bool:
    """Crash the scratch cluster (immediate shutdown or SIGKILL of the postmaster, in
    turn) under load, then start it: recovery replays WAL, and a commit acknowledged
    with synchronous_commit=off whose WAL was not yet written is gone."""
    if ctx.cluster is None:
        raise RuntimeError("crash needs a scratch cluster; the shared server is never crashed")
    how = ctx.rng.choice(("immediate", "sigkill"))
    t = time.time()
    with ctx._lock:
        if ctx._conn is not None:
            with contextlib.suppress(Exception):
                ctx._conn.close()
            ctx._conn = None
    down = ctx.cluster.crash(how)
    ctx.record("crash", t=t, how=how, down=round(down, 3), back=time.time())
    _markers(ctx, "crash")
    return True


def failover(ctx: FaultContext) -> bool:
    """Kill the primary (``pg_ctl stop -m immediate``) under load and promote the standby.

    Producers and workers hold a multi-host DSN with ``target_session_attrs=read-write``:
    their next connection skips the dead primary (and the standby until it is promoted)
    and lands on the new primary, with no restart.  Once per run: there is no second
    standby to fail over to.
    """
    if ctx.replicated is None:
        raise RuntimeError("failover needs the run's own primary and standby")
    if ctx.replicated.failed_over:
        return False
    if not ctx.holders():
        return False  # wait until jobs are running: the failover should cut them
    t = time.time()
    with ctx._lock:
        if ctx._conn is not None:
            with contextlib.suppress(Exception):
                ctx._conn.close()
            ctx._conn = None
    killed, promoted = ctx.replicated.failover()
    ctx.record(
        "failover",
        t=t,
        killed=killed,
        back=promoted,
        down=round(promoted - t, 3),
        sync=ctx.replicated.sync,
    )
    _markers(ctx, "failover")
    return True


def patroni(ctx: FaultContext) -> bool:
    """One Patroni fault under load, the next of ``ACTIONS`` each time: a planned
    switchover, a SIGKILL of the leader's postmaster, a stop of the leader's Patroni,
    a demotion that leaves the old leader up read-only.  Patroni decides the rest."""
    if ctx.patroni is None:
        raise RuntimeError("patroni needs the run's own Patroni cluster")
    if not ctx.holders():
        return False  # wait until jobs are running: the fault should cut them
    action = ACTIONS[len(ctx.patroni.done) % len(ACTIONS)]
    with ctx._lock:
        if ctx._conn is not None:
            with contextlib.suppress(Exception):
                ctx._conn.close()
            ctx._conn = None
    t, back = ctx.patroni.act(action)
    ctx.record("patroni", t=t, action=action, back=back, down=round(back - t, 3))
    _markers(ctx, "patroni")
    return True


def maxconn(ctx: FaultContext) -> bool:
    """Take every connection slot of the scratch cluster, cut a third of the workers'
    connections, and keep the slots full for a while: those workers must wait for a
    connection (the server says "too many clients"), then carry on."""
    if ctx.cluster is None:
        raise RuntimeError("maxconn needs a scratch cluster; the shared server is never filled")
    hold = ctx.rng.uniform(0.5, 1.0) * ctx.lease
    hog = ConnectionHog(ctx.dsn, leave=0, app=f"chaos-hog:{ctx.run_id}")
    # The victims are picked before the slots are taken: the admin connection may need
    # a slot of its own to ask.
    rows = ctx.query(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"skiplock-worker:chaos-{ctx.run_id}-%",),
    )
    pids = ctx.rng.sample([int(r[0]) for r in rows], max(1, len(rows) // 3)) if rows else []
    t = time.time()
    try:
        held = hog.start()
        if hog.conns:
            # Cut them from one of the hog's own connections: nothing else fits now.
            hog.conns[0].execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) p", (pids,))
            hog.conns[0].commit()
        end = time.monotonic() + hold
        while time.monotonic() < end and not ctx.stop.is_set():
            held += hog.fill()  # the slots the cut connections freed
            time.sleep(0.02)
    finally:
        hog.stop()
    ctx.record("maxconn", t=t, held=held, cut=len(pids), hold=round(hold, 3))
    return True


def readonly(ctx: FaultContext) -> bool:
    """Make the scratch cluster refuse writes for part of a lease, as a full disk or a
    demotion would: ``default_transaction_read_only = on`` and a reload, then off."""
    if ctx.cluster is None:
        raise RuntimeError("readonly needs a scratch cluster; the shared server is never changed")
    hold = ctx.rng.uniform(0.3, 0.5) * ctx.lease
    t = time.time()
    _read_only(ctx, True)
    try:
        ctx.stop.wait(hold)
    finally:
        # Written to postgresql.auto.conf: it would outlive a restart, so it must be
        # undone even if another fault cut this connection meanwhile.
        _read_only(ctx, False)
    ctx.record("readonly", t=t, hold=round(hold, 3))
    return True


def _read_only(ctx: FaultContext, on: bool) -> None:
    change = (
        "ALTER SYSTEM SET default_transaction_read_only = on"
        if on
        else "ALTER SYSTEM RESET default_transaction_read_only"
    )
    for attempt in range(200):
        try:
            with psycopg.connect(
                ctx.dsn, autocommit=True, application_name="chaos-readonly", connect_timeout=5
            ) as conn:
                # This session writes whatever the server's default.
                conn.execute("SET default_transaction_read_only = off")
                conn.execute(change)
                conn.execute("SELECT pg_reload_conf()")
                return
        except psycopg.OperationalError:
            # The server restarts, crashes or is full: wait for it.
            time.sleep(min(0.05 * (attempt + 1), 0.5))
    raise RuntimeError(f"readonly: could not run {change!r}")


def proxy(ctx: FaultContext) -> bool:
    """Reset, drop or stall the workers' connections through the proxy."""
    if ctx.proxy is None:
        return False
    action = ctx.rng.choice(("reset", "drop", "stall"))
    if action == "reset":
        n = ctx.proxy.reset(ctx.rng.uniform(0.3, 1.0))
    elif action == "drop":
        n = ctx.proxy.drop(ctx.rng.uniform(0.3, 1.0))
    else:
        # Shorter than the lease: a stall a lease long is a partition, not a hiccup.
        seconds = ctx.rng.uniform(0.1, ctx.lease * 0.3)
        n = ctx.proxy.stall(seconds)
        ctx.record("proxy", action=action, n=n, seconds=round(seconds, 3))
        return True
    ctx.record("proxy", action=action, n=n)
    return True


_INJECTORS: dict[str, Callable[[FaultContext], bool]] = {
    "kill": kill,
    "pause": pause,
    "terminate": terminate,
    "restart": restart,
    "crash": crash,
    "maxconn": maxconn,
    "readonly": readonly,
    "proxy": proxy,
    "failover": failover,
    "patroni": patroni,
}


def inject(name: str, ctx: FaultContext) -> bool:
    """Inject one fault of family ``name``; False if no target was found."""
    return _INJECTORS[name](ctx)


class ConnectionHog:
    """Other clients holding all but ``leave`` of the server's connection slots."""

    def __init__(self, dsn: str, *, leave: int, app: str = "chaos-hog") -> None:
        self.dsn, self.leave, self.app = dsn, leave, app
        self.conns: list[psycopg.Connection[Any]] = []

    def start(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            # A superuser may also take the slots reserved for superusers, so for one
            # the server is full only at max_connections.
            row = c.execute(
                "SELECT current_setting('max_connections')::int"
                " - CASE WHEN (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
                "   THEN 0 ELSE current_setting('superuser_reserved_connections')::int"
                "   + coalesce(current_setting('reserved_connections', true)::int, 0) END"
                " - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
            ).fetchone()
        free = int(row[0]) if row else 0
        # `c` above is closed by now, and its slot is free again.
        for _ in range(max(free + 1 - self.leave, 0)):
            try:
                self.conns.append(psycopg.connect(self.dsn, application_name=self.app))
            except psycopg.OperationalError:
                break
        return len(self.conns)

    def fill(self) -> int:
        """Take slots that came free (``leave=0`` only); returns how many were taken."""
        n = 0
        while True:
            try:
                self.conns.append(
                    psycopg.connect(self.dsn, application_name=self.app, connect_timeout=2)
                )
            except psycopg.OperationalError:
                return n
            n += 1

    def stop(self) -> None:
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        self.conns = []


class LongTransaction:
    """A REPEATABLE READ transaction kept open: its snapshot holds back vacuum."""

    def __init__(self, dsn: str, schema: str, *, app: str = "chaos-longtx") -> None:
        self.dsn, self.schema, self.app = dsn, schema, app
        self.conn: psycopg.Connection[Any] | None = None
        self.xmin: str | None = None

    def start(self) -> None:
        self.conn = psycopg.connect(self.dsn, autocommit=True, application_name=self.app)
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        self.conn.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(self.schema))
        )
        row = self.conn.execute("SELECT txid_current()::text").fetchone()
        self.xmin = str(row[0]) if row else None

    def stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.execute("ROLLBACK")
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None


def dead_tuples(ctx: FaultContext) -> tuple[int, int]:
    """(n_dead_tup, n_live_tup) of the run's jobs table, from pg_stat_user_tables,
    summed over its partitions (migration 0009)."""
    rows = ctx.query(
        "SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_live_tup), 0) "
        "FROM pg_stat_user_tables WHERE relid IN "
        "(SELECT relid FROM pg_partition_tree(format('%%I.jobs', %s::text)::regclass) "
        "WHERE isleaf)",
        (ctx.schema,),
    )
    return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)


def vacuum(ctx: FaultContext) -> int:
    """VACUUM the jobs table and return the dead tuples it had to leave behind."""
    ctx.query(sql.SQL("VACUUM {}").format(ctx.jobs()))
    return dead_tuples(ctx)[0]
