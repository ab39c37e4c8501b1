"""``python -m skiplock_bench.scaleout``: jobs/s against worker processes on one primary.

Each run drains ``--n`` no-op jobs with P worker processes (``Worker``, concurrency
``--concurrency`` each, its defaults otherwise; fresh processes, started before the
clock as in the drain section of ``bench/run``), for P in ``--procs`` (1, 2, 4, 8),
every ``--rounds`` times in a rotated order; the table gives the median and the range.
Processes on one machine stand in for hosts: they share its CPUs with the server, which
separate hosts would not (the report says how much CPU each side used).

What bounds a run is read off the same run:

- CPU seconds of the server (its postmaster and every child: backends, WAL writer,
  checkpointer...) and of
  the worker processes, per wall second: cores used; and the machine's busy share;
- the worker backends' ``wait_event`` in pg_stat_activity every 10 ms, by statement
  (``IO:WALSync`` at a commit is the WAL flush; ``Lock:*`` / ``LWLock:*`` contention;
  no wait event while active: running or runnable on a CPU);
- ``pg_stat_wal``: WAL flushes (syncs) per job: group commit shows as fewer than one
  flush per commit;
- with ``--commit on,off``, the same with ``Worker(synchronous_commit=False)``: if
  the knee moves, the flush bounds it;
- ``--pgbench-clients``: pgbench running skiplock's claim+complete with no Python at
  those client counts (batch 10): the server's own knee on this machine.

By default a scratch cluster of our own (initdb, production defaults: autovacuum on,
synchronous_commit on, pg_stat_statements loaded) is used and removed at the end;
``--dsn`` runs on another server instead (its statistics are then not reset).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from . import lib_skiplock, pgbench
from .common import (
    exactly_once,
    loadavg,
    log,
    machine_busy_seconds,
    median,
    proc_cpu_seconds,
    settle,
)
from .procs import ChildSpec, Fleet
from .server import db_clock_rate

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
SCHEMA = "scaleout"


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _server_pids(postmaster: int) -> list[int]:
    """The postmaster and its children: this server's backends and helpers only (the
    machine may run other servers as the same OS user)."""
    out = [postmaster]
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _ppid(int(d.name)) == postmaster:
            out.append(int(d.name))
    return out


class CpuWatch:
    """Per-pid CPU over a run, read every 200 ms, so processes that come and go count."""

    def __init__(self, postmaster: int) -> None:
        self.postmaster = postmaster
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._halt = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        for p in _server_pids(self.postmaster):
            c = proc_cpu_seconds(p)
            self.first.setdefault(p, c)
            self.last[p] = c

    def _run(self) -> None:
        while not self._halt.wait(0.2):
            self._read()

    def start(self) -> None:
        self._read()
        self._t.start()

    def stop(self) -> float:
        self._halt.set()
        self._t.join(timeout=5)
        self._read()
        return sum(self.last[p] - self.first[p] for p in self.last)


class WaitSampler:
    """The worker backends' state every 10 ms: counts of "statement: wait event"."""

    def __init__(self, dsn: str) -> None:
        from .stalls import Namer

        self.dsn = dsn
        self.namer = Namer(SCHEMA)
        self.counts: dict[str, int] = {}
        self.rounds = 0
        self.active = 0
        self._halt = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        q = (
            "SELECT coalesce(wait_event_type, ''), coalesce(wait_event, ''), left(query, 400) "
            "FROM pg_stat_activity WHERE state = 'active' "
            "AND application_name LIKE 'skiplock-worker:%%'"
        )
        with psycopg.connect(self.dsn, autocommit=True, application_name="scaleout-sampler") as c:
            while not self._halt.wait(0.01):
                rows = c.execute(q, prepare=True).fetchall()
                self.rounds += 1
                for wtype, wait, query in rows:
                    name = self.namer.name(str(query))
                    if name == "listen":
                        continue
                    self.active += 1
                    key = f"{name}: {wtype + ':' + wait if wait else 'CPU'}"
                    self.counts[key] = self.counts.get(key, 0) + 1

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._halt.set()
        self._t.join(timeout=5)


def _wal(dsn: str) -> tuple[float, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT wal_sync, wal_bytes::float8 FROM pg_stat_wal").fetchone()
    return (float(row[0]), float(row[1])) if row else (float("nan"), float("nan"))


def _postmaster(dsn: str) -> int:
    """The server's postmaster pid: the parent of our backend (same machine)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return _ppid(int(row[0])) if row else -1


def drain(dsn: str, procs: int, a: argparse.Namespace, commit: str, rnd: int) -> dict[str, Any]:
    n = a.n
    lib_skiplock.setup(dsn, SCHEMA)
    lib_skiplock.enqueue_bulk(dsn, n, schema=SCHEMA)
    settle(dsn)
    options: dict[str, Any] = {} if commit == "on" else {"synchronous_commit": False}
    specs = [
        ChildSpec(
            lib="skiplock",
            mode="drain",
            dsn=dsn,
            schema=SCHEMA,
            n=n,
            concurrency=a.concurrency,
            index=i,
            name=f"scaleout-{i}",
            options=options,
        )
        for i in range(procs)
    ]
    fleet = Fleet(specs)
    uid = _postmaster(dsn)
    from .suite import _wait_persisted

    try:
        fleet.start()
        syncs0, wal0 = _wal(dsn)
        watch = CpuWatch(uid)
        watch.start()
        sampler = WaitSampler(dsn)
        wcpu0 = sum(proc_cpu_seconds(p) for p in fleet.pids)
        busy0, total0 = machine_busy_seconds()
        t0 = fleet.go()
        sampler.start()
        finished, t_end = _wait_persisted(fleet, n, a.stall)
        sampler.stop()
        busy1, total1 = machine_busy_seconds()
        wcpu1 = sum(proc_cpu_seconds(p) for p in fleet.pids)
        pg_cpu = watch.stop()
        syncs1, wal1 = _wal(dsn)
        children = fleet.finish()
    finally:
        fleet.kill()
    wall = t_end - t0
    seen = [i for c in children for i in c.seen]
    executed, dups, missing = exactly_once(seen, n)
    state, db_ok = lib_skiplock.db_state(dsn, n, SCHEMA)
    errors = [c.error for c in children if c.error]
    ok = finished and not errors and dups == 0 and missing == 0 and db_ok
    rate = n / wall if finished else float("nan")
    cpus = os.cpu_count() or 1
    r = {
        "procs": procs,
        "commit": commit,
        "round": rnd,
        "jobs_per_s": rate,
        "db_clock_jobs_per_s": db_clock_rate(dsn, SCHEMA, 0, n) if finished else float("nan"),
        "wall_s": wall,
        "server_cores": pg_cpu / wall,
        "worker_cores": (wcpu1 - wcpu0) / wall,
        "machine_busy": (busy1 - busy0) / (total1 - total0) if total1 > total0 else float("nan"),
        "cpus": cpus,
        "wal_syncs_per_job": (syncs1 - syncs0) / n,
        "wal_bytes_per_job": (wal1 - wal0) / n,
        "waits": dict(sorted(sampler.counts.items(), key=lambda kv: -kv[1])),
        "active_per_sample": sampler.active / max(1, sampler.rounds),
        "ok": ok,
        "check": f"executed {executed}, dup {dups}, missing {missing}; db: {state}",
        "errors": errors,
    }
    top = ", ".join(
        f"{k} {v / max(1, sampler.active):.0%}" for k, v in list(r["waits"].items())[:4]
    )
    log(
        f"  P={procs} commit {commit} r{rnd}: {rate:,.0f} jobs/s; server {r['server_cores']:.2f} "
        f"cores, workers {r['worker_cores']:.2f}, machine {r['machine_busy']:.0%} busy; "
        f"{r['wal_syncs_per_job']:.3f} WAL syncs/job; active backends "
        f"{r['active_per_sample']:.1f}: {top}" + ("" if ok else f"  << NOT OK {r['check']}")
    )
    return r


def ceiling(dsn: str, clients: int, a: argparse.Namespace, rnd: int) -> dict[str, Any]:
    batch = 10
    per_client = max(1, a.n // (clients * batch))
    jobs = per_client * clients * batch
    lib_skiplock.setup(dsn, SCHEMA)
    lib_skiplock.enqueue_bulk(dsn, jobs, schema=SCHEMA)
    settle(dsn)
    uid = _postmaster(dsn)
    watch = CpuWatch(uid)
    watch.start()
    busy0, total0 = machine_busy_seconds()
    res = pgbench.run(dsn, SCHEMA, clients=clients, batch=batch, transactions=per_client, threads=2)
    busy1, total1 = machine_busy_seconds()
    pg_cpu = watch.stop()
    r = {
        "clients": clients,
        "round": rnd,
        "jobs_per_s": res.jobs_per_s,
        "latency_ms": res.latency_ms,
        "server_cores": pg_cpu / res.seconds if res.seconds else float("nan"),
        "machine_busy": (busy1 - busy0) / (total1 - total0) if total1 > total0 else float("nan"),
    }
    log(
        f"  pgbench {clients} clients r{rnd}: {res.jobs_per_s:,.0f} jobs/s, "
        f"server {r['server_cores']:.2f} cores, machine {r['machine_busy']:.0%} busy"
    )
    return r


def summary(runs: list[dict[str, Any]], pgb: list[dict[str, Any]], a: argparse.Namespace) -> str:
    lines = [
        "| worker processes (x concurrency) | commit | jobs/s, median (range) | per process "
        "| server cores | worker cores | machine busy | WAL syncs / job | active worker "
        "backends | where the active worker backends were (sampled every 10 ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["commit"], r["procs"]) for r in runs})
    for commit, p in keys:
        rs = [r for r in runs if r["procs"] == p and r["commit"] == commit]
        rates = [r["jobs_per_s"] for r in rs]

        def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return median(float(r[k]) for r in rs)

        waits: dict[str, int] = {}
        for r in rs:
            for k, v in r["waits"].items():
                waits[k] = waits.get(k, 0) + v
        total = sum(waits.values()) or 1
        top = ", ".join(
            f"{k} {v / total:.0%}" for k, v in sorted(waits.items(), key=lambda kv: -kv[1])[:5]
        )
        m = median(rates)
        lines.append(
            f"| {p} (x {a.concurrency}) | {commit} "
            f"| {m:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
            f"| {m / p:,.0f} | {med('server_cores'):.2f} | {med('worker_cores'):.2f} "
            f"| {med('machine_busy'):.0%} | {med('wal_syncs_per_job'):.3f} "
            f"| {med('active_per_sample'):.1f} | {top} |"
        )
    if pgb:
        lines += [
            "",
            "| pgbench clients (claim 10 + complete, no Python) | jobs/s, median (range) "
            "| latency ms | server cores | machine busy |",
            "|---|---|---|---|---|",
        ]
        for c in sorted({r["clients"] for r in pgb}):
            rs = [r for r in pgb if r["clients"] == c]
            rates = [r["jobs_per_s"] for r in rs]
            lines.append(
                f"| {c} | {median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
                f"| {median(r['latency_ms'] for r in rs):.2f} "
                f"| {median(r['server_cores'] for r in rs):.2f} "
                f"| {median(r['machine_busy'] for r in rs):.0%} |"
            )
    bad = [r for r in runs if not r["ok"]]
    lines.append(
        f"\nexactly once: {len(runs) - len(bad)} of {len(runs)} runs passed"
        + "".join(f"\n- NOT OK: P={r['procs']} r{r['round']}: {r['check']}" for r in bad)
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.scaleout", description=__doc__)
    p.add_argument("--dsn", help="use this server, not a scratch cluster")
    p.add_argument("--procs", default="1,2,4,8")
    p.add_argument("--concurrency", type=int, default=8, help="per worker process")
    p.add_argument("--n", type=int, default=40_000, help="jobs per drain")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--commit", default="on", help="on, off or on,off (synchronous_commit)")
    p.add_argument("--pgbench-clients", default="1,2,4,8,16", help="'' to skip")
    p.add_argument("--stall", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = p.parse_args(argv)
    procs = [int(x) for x in a.procs.split(",") if x.strip()]
    commits = [x.strip() for x in a.commit.split(",") if x.strip()]
    clients = [int(x) for x in a.pgbench_clients.split(",") if x.strip()]

    def body(dsn: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        runs: list[dict[str, Any]] = []
        pgb: list[dict[str, Any]] = []
        grid = [(c, p) for c in commits for p in procs]
        for rnd in range(1, a.rounds + 1):
            for commit, n in grid if rnd % 2 else grid[::-1]:
                runs.append(drain(dsn, n, a, commit, rnd))
            for c in clients if rnd % 2 else clients[::-1]:
                pgb.append(ceiling(dsn, c, a, rnd))
        return runs, pgb

    load0 = loadavg()
    if a.dsn:
        runs, pgb = body(a.dsn)
        where = "the given server"
    else:
        from . import scratch

        with scratch.cluster({"max_connections": "200"}) as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT version()").fetchone()
            where = f"a scratch cluster ({str(row[0]).split(',')[0] if row else '?'}, defaults)"
            runs, pgb = body(dsn)
    text = (
        f"scaleout: {a.n:,} no-op jobs per drain, {a.rounds} rounds, on {where}; "
        f"{os.cpu_count()} CPUs shared by server and workers; load {load0} -> {loadavg()}\n\n"
        + summary(runs, pgb, a)
    )
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (a.out / f"scaleout-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    (a.out / f"scaleout-{stamp}.json").write_text(
        json.dumps({"args": vars(a) | {"out": str(a.out)}, "runs": runs, "pgbench": pgb}),
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
