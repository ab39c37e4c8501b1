"""``python -m skiplock_bench.perjob``: what one job costs the server, in counts.

Heap tuples, index entries, WAL bytes and records, statements (round trips), commits
that wrote WAL (each a synchronous flush), server execution time and server CPU, per job,
for a drain of N no-op jobs through:

- ``skiplock``: skiplock's ``Worker`` (concurrency 8, the bench's defaults, in-process);
  ``skiplock-fused`` the same with ``fuse_claims=True`` (the default since it was made
  one), ``skiplock-apart`` with ``fuse_claims=False`` (the default before);
- ``skiplock-sql``: pgbench running skiplock's own claim and complete (batch 10, 8
  clients), the ceiling of skiplock's schema with no Python in the loop;
- ``plain``: pgbench running the postmortem's fixed claim and its completion, batched
  (batch 10, 8 clients) on the postmortem's table: the plain-SQL ceiling of issue 19,
  the same statements ``bench/run``'s pgbench section times (``pgbench.plain_*``).

Each subject also reports its enqueue of the N jobs (bulk) and the ``VACUUM`` that
cleans up after the drain: the cost a drain defers to vacuum, which is what rotating or
partitioned tables truncated instead of vacuumed would remove.

Counts, not timings: they do not swing with the machine's load, so they are valid on a
shared machine.  They are taken on a scratch cluster of our own (``scratch.py``; the
shared server's settings are never touched) with autovacuum off, so that nothing but
the phase writes WAL in its window; pg_stat_statements and pg_walinspect are loaded
there.  Where each figure comes from:

- heap tuples: ``pg_stat_user_tables`` n_tup_ins / n_tup_upd / n_tup_hot_upd /
  n_tup_del deltas over the subject's schema (every backend of the phase has exited, so
  its counters are flushed);
- index entries: ``pg_walinspect`` records of the phase, by relation: every B-tree
  leaf insertion is one ``Btree/INSERT_LEAF`` (or ``INSERT_POST``, into a posting
  list) record naming the index; a page split is counted apart;
- heap WAL by kind (``Heap/UPDATE``, ``HOT_UPDATE``, ``LOCK``, ``INSERT``...): the same
  records by table; ``Heap/LOCK`` is the row lock of ``FOR UPDATE``, written to WAL;
- WAL bytes: ``pg_current_wal_lsn()`` difference (everything written, full-page images
  included; the FPI share is given apart);
- commits: ``Transaction/COMMIT`` records, i.e. transactions that wrote WAL, each a
  flush with synchronous commit on;
- round trips: ``pg_stat_statements`` calls of the phase (the bench's own monitoring
  statements excluded); a statement is one round trip for skiplock's drivers and for
  pgbench alike;
- server time: pg_stat_statements ``total_exec_time`` (execution only, no parse, plan
  or commit); server CPU: user + system seconds of every server process (backends,
  WAL writer, checkpointer...) from /proc, including backends that exited (the
  postmaster's reaped-children times).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Job, Queue, Worker

from . import lib_skiplock, pgbench, scratch
from .common import CLK_TCK, DEFAULT_DSN, find_pgbench, loadavg, log

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

# The bench's own statements carry this comment (pg_stat_statements keeps it in the
# query text) and are left out of the round-trip count.
TAG = "/* perjob-monitor */ "
_BRACKETS = {"BEGIN", "COMMIT", "ROLLBACK"}


# -- server CPU ---------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def server_cpu(postmaster: int) -> float:
    """CPU seconds of the whole server: the postmaster, its live children, and the
    children it has reaped (cutime/cstime), so backends that exited still count."""
    pm = _stat(postmaster)
    if pm is None:
        return float("nan")
    total = sum(int(x) for x in pm[11:15])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None and st[1] == str(postmaster):
            total += int(st[11]) + int(st[12])
    return total / CLK_TCK


# -- one phase ----------------------------------------------------------------------------


@dataclass
class Phase:
    """What one phase of one subject wrote and ran, in totals; ``per`` divides."""

    subject: str
    phase: str
    jobs: int
    heap: dict[str, int] = field(default_factory=dict)  # ins, upd, hot_upd, del
    wal_bytes: int = 0
    wal_fpi_bytes: int = 0
    wal_records: int = 0
    commits: int = 0
    records: dict[str, int] = field(default_factory=dict)  # "rel rmgr/type" -> count
    record_bytes: dict[str, int] = field(default_factory=dict)  # the same -> bytes, FPIs too
    statements: dict[str, dict[str, float]] = field(default_factory=dict)
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    seconds: float = 0.0
    # Start of the drain to its N-th completion (Worker subjects only): the jobs/s row.
    drain_seconds: float = 0.0

    def per(self, total: float) -> float:
        return total / self.jobs if self.jobs else float("nan")

    @property
    def calls(self) -> int:
        """Statements, less BEGIN and COMMIT: those travel with the statements they
        bracket (pgbench's script, psycopg's pipeline), so they add no round trip."""
        return int(sum(s["calls"] for q, s in self.statements.items() if q not in _BRACKETS))

    @property
    def exec_ms(self) -> float:
        return sum(s["exec_ms"] for s in self.statements.values())

    def count(self, rmgr_type: str, rel: str | None = None) -> int:
        return sum(
            n
            for k, n in self.records.items()
            if k.split(" ", 1)[1] == rmgr_type and (rel is None or k.split(" ", 1)[0] == rel)
        )

    def bytes_of(self, rmgrs: tuple[str, ...]) -> int:
        """WAL bytes (with FPIs) of the records of these resource managers (Heap: Heap2 too)."""
        return sum(b for k, b in self.record_bytes.items() if k.split(" ", 1)[1].startswith(rmgrs))

    def index_entries(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, n in self.records.items():
            rel, kind = k.split(" ", 1)
            if kind in ("Btree/INSERT_LEAF", "Btree/INSERT_POST"):
                out[rel] = out.get(rel, 0) + n
        return out


class Monitor:
    """The bench's own session on the scratch server: snapshots before and after."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)
        for ext in ("pg_stat_statements", "pg_walinspect", "pgstattuple"):
            self.conn.execute(
                sql.SQL("CREATE EXTENSION IF NOT EXISTS {}").format(sql.Identifier(ext))
            )
        pid = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        st = _stat(int(pid[0])) if pid else None
        assert st is not None
        self.postmaster = int(st[1])

    def close(self) -> None:
        self.conn.close()

    def q(self, query: Any, params: Any = None) -> psycopg.Cursor[Any]:
        """Run one of the bench's own statements, tagged so the count leaves it out."""
        stmt = sql.SQL(TAG) + (sql.SQL(query) if isinstance(query, str) else query)
        return self.conn.execute(stmt, params)

    def _tables(self, schema: str) -> dict[str, int]:
        row = self.q(
            "SELECT coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0), "
            "coalesce(sum(n_tup_hot_upd), 0), coalesce(sum(n_tup_del), 0) "
            "FROM pg_stat_user_tables WHERE schemaname = %s",
            (schema,),
        ).fetchone()
        assert row is not None
        return dict(zip(("ins", "upd", "hot_upd", "del"), (int(x) for x in row), strict=True))

    def measure(
        self, subject: str, phase: str, schema: str, jobs: int, run: Callable[[], object]
    ) -> Phase:
        self.q("CHECKPOINT")  # every phase starts with the same full-page-image debt
        self.q("SELECT pg_stat_clear_snapshot()")
        before = self._tables(schema)
        self.q("SELECT pg_stat_statements_reset()")
        lsn0 = self.q("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        cpu0 = server_cpu(self.postmaster)
        ru0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        time.sleep(0.5)  # the phase's backends have exited: let their stats land
        cpu1 = server_cpu(self.postmaster)
        lsn1 = self.q("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        self.q("SELECT pg_stat_force_next_flush()")
        self.q("SELECT pg_stat_clear_snapshot()")
        after = self._tables(schema)
        out = Phase(subject, phase, jobs, seconds=seconds)
        out.heap = {k: after[k] - before[k] for k in before}
        out.server_cpu_s = cpu1 - cpu0
        out.client_cpu_s = sum(
            (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)
            for a, b in zip(ru0, ru1, strict=True)
        )
        row = self.q(
            "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (lsn1, lsn0)
        ).fetchone()
        out.wal_bytes = int(row[0]) if row else 0
        rows = self.q(
            """
            SELECT coalesce(cl.relname, r.rel, '-') AS rel,
                   r.resource_manager || '/' || r.record_type AS kind,
                   count(*), sum(r.fpi_length), sum(r.record_length)
            FROM (SELECT w.resource_manager, w.record_type, w.fpi_length, w.record_length,
                         substring(w.block_ref FROM 'rel \\d+/\\d+/(\\d+)') AS rel
                  FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) AS w) AS r
            LEFT JOIN pg_class AS cl ON cl.relfilenode::text = r.rel
            GROUP BY 1, 2
            """,
            (lsn0, lsn1),
        ).fetchall()
        for rel, kind, n, fpi, size in rows:
            out.records[f"{rel} {kind}"] = int(n)
            out.record_bytes[f"{rel} {kind}"] = int(size or 0)
            out.wal_records += int(n)
            out.wal_fpi_bytes += int(fpi or 0)
        out.commits = out.count("Transaction/COMMIT")
        for query, calls, rows_, ms, plan_ms in self.q(
            "SELECT query, calls, rows, total_exec_time, total_plan_time FROM pg_stat_statements"
        ).fetchall():
            if TAG.strip() in query:
                continue
            # The statement without its comments (skiplock's carry long ones), short.
            body = " ".join(ln for ln in query.splitlines() if not ln.lstrip().startswith("--"))
            key = " ".join(body.split())[:90]
            s = out.statements.setdefault(
                key, {"calls": 0, "rows": 0, "exec_ms": 0.0, "plan_ms": 0.0}
            )
            s["calls"] += int(calls)
            s["rows"] += int(rows_)
            s["exec_ms"] += float(ms)
            # zero unless the server sets pg_stat_statements.track_planning (proto.py does)
            s["plan_ms"] += float(plan_ms)
        return out


# -- subjects -----------------------------------------------------------------------------


def _vacuum(dsn: str, schema: str) -> Callable[[], None]:
    def run() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("VACUUM {}.jobs").format(sql.Identifier(schema)))

    return run


def _drain_worker(
    dsn: str, schema: str, n: int, concurrency: int, options: dict[str, Any], took: list[float]
) -> Callable[[], None]:
    def run() -> None:
        done = 0
        lock = threading.Lock()
        finished = threading.Event()

        def on_event(event: str, job: Job) -> None:
            nonlocal done
            if event == "completed":
                with lock:
                    done += 1
                    if done >= n:
                        finished.set()

        q = Queue(dsn, schema=schema, max_size=1)
        w = Worker(
            q,
            lambda job: None,
            concurrency=concurrency,
            lease=30.0,
            name="perjob",
            on_event=on_event,
            **options,
        )
        t0 = time.perf_counter()
        t = w.start()
        if not finished.wait(timeout=max(120.0, n / 200)):
            log(f"drain stalled at {done} of {n}")
        took[0] = time.perf_counter() - t0
        w.stop()
        t.join(timeout=60)
        q.close()

    return run


def _pgbench(dsn: str, script: str, n: int, clients: int, batch: int) -> Callable[[], None]:
    def run() -> None:
        exe = find_pgbench()
        if exe is None:
            raise RuntimeError("pgbench not found")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "perjob.sql"
            path.write_text(script, encoding="utf-8")
            cmd = [
                exe,
                "--no-vacuum",
                "--protocol=prepared",
                f"--client={clients}",
                f"--jobs={min(2, clients)}",
                f"--transactions={max(1, n // (clients * batch))}",
                f"--file={path}",
                *(f"--define={k}={v}" for k, v in pgbench.CLAIM_CONSTANTS.items()),
                *(f"--define={k}={{}}" for k in pgbench.FROM_CLAIM),
                dsn,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"pgbench failed:\n{(res.stdout + res.stderr)[-2000:]}")

    return run


def subject_skiplock(
    mon: Monitor, name: str, n: int, concurrency: int, options: dict[str, Any] | None = None
) -> list[Phase]:
    schema = name.replace("-", "_")
    lib_skiplock.setup(mon.dsn, schema)
    enq = mon.measure(
        name, "enqueue (COPY)", schema, n, lambda: lib_skiplock.enqueue_bulk(mon.dsn, n, schema)
    )
    mon.q(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
    took = [0.0]
    drain = mon.measure(
        name,
        "drain",
        schema,
        n,
        _drain_worker(mon.dsn, schema, n, concurrency, options or {}, took),
    )
    drain.drain_seconds = took[0]
    drain.jobs = lib_skiplock.count_jobs(mon.dsn, schema, "status = 'done'")
    vac = mon.measure(name, "vacuum", schema, drain.jobs, _vacuum(mon.dsn, schema))
    return [enq, drain, vac]


def fused_script(schema: str, batch: int) -> str:
    """Each transaction completes the batch the client claimed in its previous one, then
    claims the next: one commit (one flush) per batch, as a complete fused with the next
    claim (or the two pipelined in one transaction) would cost.  pgbench variables
    persist across a client's transactions; the first completes nothing (``--define``
    starts them empty) and each client's last batch stays running."""
    script = pgbench.render_script(schema, batch)
    claim, complete = script.split("\\gset\n", 1)
    head, claim = claim.split("\n", 1)  # "\\set limit N"
    return f"{head}\nBEGIN;\n{complete}{claim}\\gset\nCOMMIT;\n"


def subject_skiplock_sql(
    mon: Monitor, n: int, clients: int, batch: int, *, fused: bool = False
) -> list[Phase]:
    """skiplock's claim and complete under pgbench, each its own transaction; ``fused``:
    complete-then-claim in one transaction (``fused_script``)."""
    name = "skiplock-sql-fused" if fused else "skiplock-sql"
    schema = name.replace("-", "_")
    lib_skiplock.setup(mon.dsn, schema)
    lib_skiplock.enqueue_bulk(mon.dsn, n, schema)
    mon.q(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
    script = fused_script(schema, batch) if fused else pgbench.render_script(schema, batch)
    drain = mon.measure(name, "drain", schema, n, _pgbench(mon.dsn, script, n, clients, batch))
    drain.jobs = lib_skiplock.count_jobs(mon.dsn, schema, "status = 'done'")
    vac = mon.measure(name, "vacuum", schema, drain.jobs, _vacuum(mon.dsn, schema))
    return [drain, vac]


def subject_plain(mon: Monitor, n: int, clients: int, batch: int) -> list[Phase]:
    """The plain-SQL ceiling's table and statements, as ``bench/run``'s pgbench section
    runs them (``pgbench.plain_*``), counted per job."""
    name, schema = "plain", "plain"
    pgbench.plain_setup(mon.dsn, schema)

    def enqueue() -> None:
        pgbench.plain_enqueue(mon.dsn, schema, n)

    enq = mon.measure(name, "enqueue (one INSERT)", schema, n, enqueue)
    mon.q(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
    script = pgbench.plain_script(schema, batch)
    drain = mon.measure(name, "drain", schema, n, _pgbench(mon.dsn, script, n, clients, batch))
    drain.jobs = lib_skiplock.count_jobs(mon.dsn, schema, "status = 'done'")
    vac = mon.measure(name, "vacuum", schema, drain.jobs, _vacuum(mon.dsn, schema))
    return [enq, drain, vac]


# -- report -------------------------------------------------------------------------------


def _heap_written(p: Phase) -> int:
    return p.heap["ins"] + p.heap["upd"] + p.heap["del"]


def table(phases: list[Phase]) -> str:
    cols = [f"{p.subject} {p.phase}" for p in phases]
    lines = [
        "| per job | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]

    def row(label: str, fn: Callable[[Phase], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(p) for p in phases) + " |")

    def f2(x: float) -> str:
        return f"{x:.2f}"

    row("jobs", lambda p: f"{p.jobs:,}")
    row("heap tuples written (ins+upd+del)", lambda p: f2(p.per(_heap_written(p))))
    row(
        "  of which updates / HOT",
        lambda p: f"{p.per(p.heap['upd']):.2f} / {p.per(p.heap['hot_upd']):.2f}",
    )
    row(
        "HOT ratio",
        lambda p: f"{p.heap['hot_upd'] / p.heap['upd']:.2f}" if p.heap["upd"] else "-",
    )
    row(
        "heap WAL records: UPDATE / HOT_UPDATE / LOCK / INSERT",
        lambda p: " / ".join(
            f2(p.per(p.count(f"Heap/{k}") + p.count(f"Heap/{k}+INIT")))
            for k in ("UPDATE", "HOT_UPDATE", "LOCK", "INSERT")
        ),
    )
    row("heap prune records (Heap2/PRUNE)", lambda p: f2(p.per(p.count("Heap2/PRUNE"))))
    row(
        "index entries written (B-tree leaf inserts)",
        lambda p: f2(p.per(sum(p.index_entries().values()))),
    )
    row(
        "  by index",
        lambda p: (
            ", ".join(
                f"{k.replace('jobs_', '')} {p.per(v):.2f}"
                for k, v in sorted(p.index_entries().items())
            )
            or "-"
        ),
    )
    row(
        "B-tree page splits",
        lambda p: f2(p.per(p.count("Btree/SPLIT_L") + p.count("Btree/SPLIT_R"))),
    )
    row("WAL bytes", lambda p: f"{p.per(p.wal_bytes):,.0f}")
    row("  of which full-page images", lambda p: f"{p.per(p.wal_fpi_bytes):,.0f}")
    row("WAL records", lambda p: f2(p.per(p.wal_records)))
    row(
        "  WAL bytes in heap / index / commit records",
        lambda p: " / ".join(
            f"{p.per(p.bytes_of(prefix)):,.0f}"
            for prefix in (("Heap",), ("Btree",), ("Transaction",))
        ),
    )
    row("commits that wrote WAL (flushes)", lambda p: f"{p.per(p.commits):.3f}")
    row("statements (BEGIN/COMMIT not counted)", lambda p: f"{p.per(p.calls):.3f}")
    row("server exec time, µs (pg_stat_statements)", lambda p: f"{1000 * p.per(p.exec_ms):.1f}")
    row("server CPU, µs (all server processes)", lambda p: f"{1e6 * p.per(p.server_cpu_s):.0f}")
    row("client CPU, µs (worker or pgbench)", lambda p: f"{1e6 * p.per(p.client_cpu_s):.0f}")
    row("wall seconds (noisy; not a throughput figure)", lambda p: f"{p.seconds:.1f}")
    row(
        "Worker jobs/s, start to N-th completion (noisy)",
        lambda p: f"{p.jobs / p.drain_seconds:,.0f}" if p.drain_seconds else "-",
    )
    return "\n".join(lines)


def statements_table(p: Phase) -> str:
    lines = [
        f"{p.subject} {p.phase}: statements per 1,000 jobs",
        "| calls | rows | exec ms | statement |",
        "|---|---|---|---|",
    ]
    for q, s in sorted(p.statements.items(), key=lambda kv: -kv[1]["calls"]):
        lines.append(
            f"| {1000 * p.per(s['calls']):.1f} | {1000 * p.per(s['rows']):.0f} | "
            f"{1000 * p.per(s['exec_ms']):.1f} | `{q}` |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.perjob", description=__doc__)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--clients", type=int, default=8, help="pgbench clients")
    p.add_argument("--batch", type=int, default=10, help="pgbench claim batch")
    p.add_argument(
        "--subjects",
        default="skiplock,skiplock-sql,plain",
        help="comma list of skiplock, skiplock-fused, skiplock-apart, skiplock-sql, "
        "skiplock-sql-fused, plain",
    )
    p.add_argument(
        "--dsn",
        default=None,
        help="use this server instead of a scratch cluster (it must preload "
        "pg_stat_statements and allow pg_walinspect; autovacuum should be off); "
        f"never the shared one ({DEFAULT_DSN})",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    subjects = [s for s in args.subjects.split(",") if s]
    if args.dsn is None:
        with scratch.cluster({"autovacuum": "off"}) as dsn:
            phases = _run(dsn, subjects, args)
    else:
        phases = _run(args.dsn, subjects, args)
    text = (
        f"per-job costs, {args.jobs:,} no-op jobs, Worker concurrency {args.concurrency}, "
        f"pgbench {args.clients} clients x batch {args.batch}; load average {loadavg()}\n\n"
        + table(phases)
        + "\n\n"
        + "\n\n".join(statements_table(ph) for ph in phases if ph.phase == "drain")
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"perjob-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    (args.out / f"perjob-{stamp}.json").write_text(
        json.dumps([ph.__dict__ for ph in phases], indent=1, default=str), encoding="utf-8"
    )
    return 0


def _run(dsn: str, subjects: list[str], args: argparse.Namespace) -> list[Phase]:
    mon = Monitor(dsn)
    phases: list[Phase] = []
    try:
        for s in subjects:
            log(f"perjob: {s}")
            if s == "skiplock":
                phases += subject_skiplock(mon, s, args.jobs, args.concurrency)
            elif s == "skiplock-fused":
                phases += subject_skiplock(
                    mon, s, args.jobs, args.concurrency, {"fuse_claims": True}
                )
            elif s == "skiplock-apart":
                phases += subject_skiplock(
                    mon, s, args.jobs, args.concurrency, {"fuse_claims": False}
                )
            elif s == "skiplock-sql":
                phases += subject_skiplock_sql(mon, args.jobs, args.clients, args.batch)
            elif s == "skiplock-sql-fused":
                phases += subject_skiplock_sql(mon, args.jobs, args.clients, args.batch, fused=True)
            elif s == "plain":
                phases += subject_plain(mon, args.jobs, args.clients, args.batch)
            else:
                raise SystemExit(f"unknown subject {s}")
    finally:
        mon.close()
    return phases


if __name__ == "__main__":
    raise SystemExit(main())
