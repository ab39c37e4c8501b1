"""``python -m skiplock_bench.storage``: skiplock under a held xmin, after a long history, and
a worker's memory over a long run; with autovacuum off (the shared server) and on (a
scratch cluster of our own, see scratch.py).

One measurement is a *flow*: a worker process (``Worker``, concurrency 8, its defaults)
serves jobs that the bench enqueues at a fixed rate for ``--seconds``; then, with the
same state still in place, a *burst* of ``--burst`` jobs is enqueued at once and timed
until the worker has completed them all (its throughput when it is the bottleneck),
``--bursts`` times; the median is reported.  Conditions, each on its own fresh schema unless said:

- ``fresh``: nothing else going on;
- ``held``: a REPEATABLE READ transaction opened at the start stays idle in transaction
  to the end of the burst, so no row version the flow kills can be removed;
- ``history``: the schema has ``--history`` jobs run to completion first (by pgbench with
  skiplock's claim and complete, no vacuum in between unless autovacuum runs).

Reported per condition: the rate the worker kept up with in the flow's last window,
claim latency p50/p99 (the worker's own ``claim_seconds``) over the flow and in its last
window, the burst's jobs/s, dead tuples (``pg_stat_user_tables.n_dead_tup`` and
pgstattuple's exact count), the size and leaf density of each index (pgstatindex), and the
worker's RSS at the start and the end of the flow.  Ratios are to ``fresh`` on the same
server in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from . import lib_skiplock, pgbench
from .common import (
    DEFAULT_DSN,
    drop_database,
    loadavg,
    log,
    median,
    percentile,
    recreate_database,
    settle,
)

DB = "bench_storage"
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


# -- the worker process -----------------------------------------------------------------


def child(spec: dict[str, Any]) -> None:
    """A Worker in a process of its own; one JSON line per second on stdout."""
    from skiplock import Job, Queue, Worker

    lock = threading.Lock()
    claims: list[float] = []
    done = 0

    def handler(job: Job) -> None:
        return None

    def on_event(event: str, job: Job) -> None:
        nonlocal done
        if event == "completed":
            with lock:
                done += 1

    def on_measure(name: str, value: float, queue: str | None) -> None:
        if name == "claim_seconds":
            with lock:
                claims.append(value)

    q = Queue(spec["dsn"], schema=spec["schema"], max_size=1)
    w = Worker(
        q,
        handler,
        concurrency=spec["concurrency"],
        name="storage-bench",
        on_event=on_event,
        on_measure=on_measure,
    )
    t = w.start()
    print(json.dumps({"ready": True}), flush=True)
    try:
        while t.is_alive():
            time.sleep(1.0)
            with lock:
                line = {"t": time.monotonic(), "completed": done, "claims": claims[:]}
                claims.clear()
            print(json.dumps(line), flush=True)
            if sys.stdin.closed:
                break
    finally:
        w.stop()
        t.join(timeout=30)
        q.close()


class WorkerProc:
    """The parent's handle on the child: its completions, claim latencies and RSS."""

    def __init__(self, dsn: str, schema: str, concurrency: int) -> None:
        spec = json.dumps({"dsn": dsn, "schema": schema, "concurrency": concurrency})
        env = dict(os.environ)
        env["PYTHONPATH"] = (
            str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skiplock_bench.storage", "--child", spec],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.completed = 0
        self.claims: list[tuple[float, float]] = []  # (monotonic time, seconds)
        self._lock = threading.Lock()
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first or not json.loads(first).get("ready"):
            raise RuntimeError("worker child did not start")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            d = json.loads(line)
            with self._lock:
                self.completed = int(d["completed"])
                self.claims.extend((float(d["t"]), float(x)) for x in d["claims"])

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return float("nan")

    def done(self) -> int:
        with self._lock:
            return self.completed

    def claim_window(self, since: float) -> list[float]:
        with self._lock:
            return [s for t, s in self.claims if t >= since]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- server-side figures ----------------------------------------------------------------


# The leaf partitions of jobs (the table itself before migration 0009 partitioned it).
_LEAVES = sql.SQL("SELECT relid FROM pg_partition_tree(%s::regclass) WHERE isleaf")


def dead_tuples(conn: psycopg.Connection[Any], schema: str) -> int:
    """n_dead_tup summed over the partitions of jobs (cheap: from the statistics)."""
    row = conn.execute(
        sql.SQL(
            "SELECT coalesce(sum(s.n_dead_tup), 0) FROM pg_stat_user_tables AS s "
            "WHERE s.relid IN ({})"
        ).format(_LEAVES),
        (f'"{schema}".jobs',),
    ).fetchone()
    return int(row[0]) if row else 0


def storage_state(dsn: str, schema: str) -> dict[str, Any]:
    """Dead tuples and index shape of the schema's jobs table, summed over its partitions
    (from migration 0009 on, jobs is partitioned)."""
    out: dict[str, Any] = {}
    jobs = f'"{schema}".jobs'
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT sum(n_live_tup), sum(n_dead_tup), sum(n_tup_upd), sum(n_tup_hot_upd), "
                "sum(autovacuum_count), sum(vacuum_count), count(*) "
                "FROM pg_stat_user_tables WHERE relid IN ({})"
            ).format(_LEAVES),
            (jobs,),
        ).fetchone()
        if row and row[0] is not None:
            keys = (
                "n_live_tup",
                "n_dead_tup",
                "n_tup_upd",
                "n_tup_hot_upd",
                "autovacuums",
                "vacuums",
                "partitions",
            )
            out.update(dict(zip(keys, (int(x) for x in row), strict=True)))
        r2 = conn.execute(
            sql.SQL("SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM ({}) AS t").format(
                _LEAVES
            ),
            (jobs,),
        ).fetchone()
        out["table_mb"] = int(r2[0]) / 1048576.0 if r2 else float("nan")
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            r = conn.execute(
                sql.SQL(
                    "SELECT sum((p).tuple_count), sum((p).dead_tuple_count) FROM "
                    "(SELECT pgstattuple(relid) AS p FROM ({}) AS t) AS x"
                ).format(_LEAVES),
                (jobs,),
            ).fetchone()
            if r and r[0] is not None:
                out["pgstattuple_live"], out["pgstattuple_dead"] = int(r[0]), int(r[1])
            idx: dict[str, Any] = {}
            # Each partition's index, under the name of the partitioned index it belongs
            # to (its root); summed.
            for name, mb, leaf_pages, density in conn.execute(
                sql.SQL(
                    "SELECT coalesce(pr.relname, c.relname), "
                    "  sum(pg_relation_size(i.indexrelid)) / 1048576.0, "
                    "  sum((pgstatindex(i.indexrelid)).leaf_pages), "
                    "  avg((pgstatindex(i.indexrelid)).avg_leaf_density) "
                    "FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid "
                    "LEFT JOIN pg_class AS pr ON pr.oid = pg_partition_root(i.indexrelid) "
                    "WHERE i.indrelid IN ({}) GROUP BY 1 ORDER BY 1"
                ).format(_LEAVES),
                (jobs,),
            ).fetchall():
                idx[name] = {
                    "mb": float(mb),
                    "leaf_density": float(density) if density == density else None,
                    "leaf_pages": int(leaf_pages) if leaf_pages is not None else None,
                }
            out["indexes"] = idx
        except psycopg.Error as exc:
            out["pgstattuple_error"] = str(exc).splitlines()[0]
    return out


def statements_reset(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        return True
    except psycopg.Error:
        return False


def top_statements(dsn: str, n: int = 20) -> list[dict[str, Any]]:
    """Where the server's time went since the reset (pg_stat_statements), by statement."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time, shared_blks_hit + shared_blks_read "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) ORDER BY total_exec_time DESC LIMIT %s",
            (n,),
        ).fetchall()
    merged: dict[str, list[float]] = {}
    for query, calls, ms, blks in rows:
        text = " ".join(
            line for line in str(query).splitlines() if not line.strip().startswith("--")
        )
        # The same statement with NULL or typed parameters is two entries: one name.
        m = merged.setdefault(_name(text), [0.0, 0.0, 0.0])
        m[0] += int(calls)
        m[1] += float(ms)
        m[2] += float(blks)
    out: list[dict[str, Any]] = [
        {
            "statement": name,
            "calls": int(c),
            "total_s": ms / 1000.0,
            "mean_ms": ms / max(c, 1.0),
            "buffers_per_call": blks / max(c, 1.0),
        }
        for name, (c, ms, blks) in merged.items()
    ]
    out.sort(key=lambda d: -float(d["total_s"]))
    return out


def _name(text: str) -> str:
    t = " ".join(text.split())
    for key, name in (
        ("gen_random_uuid", "claim"),
        ("completions", "complete"),
        ("expired AS", "sweep"),
        ("j.locked_until, j.cancel_requested", "heartbeat"),
        ("handback_token = f.token", "fail/release"),
        ("COPY", "enqueue (COPY)"),
        ("nextval", "reserve_ids"),
        ("LISTEN", "listen"),
    ):
        if key in t:
            return name
    return t[:60]


def _mb(conn: psycopg.Connection[Any], reg: str) -> float:
    row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (reg,)).fetchone()
    return int(row[0]) / 1048576.0 if row else float("nan")


def hold_xmin(dsn: str) -> psycopg.Connection[Any]:
    """Idle in transaction with a snapshot: the oldest xmin stays put while it lives."""
    conn = psycopg.connect(dsn, application_name="bench-held-xmin")
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT txid_current()")
    return conn


def load_history(dsn: str, schema: str, n: int) -> dict[str, float]:
    """n jobs through skiplock's claim and complete (pgbench), nothing vacuumed by us."""
    t0 = time.monotonic()
    lib_skiplock.setup(dsn, schema)
    for lo in range(0, n, 200_000):
        lib_skiplock.enqueue_bulk(dsn, min(200_000, n - lo), schema=schema, first=lo)
    clients, batch = 8, 10
    per_client = math.ceil(n / (clients * batch) * 1.02)
    res = pgbench.run(
        dsn,
        schema,
        clients=clients,
        batch=batch,
        transactions=per_client,
        synchronous_commit=False,
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.jobs WHERE status <> 'done'").format(
                sql.Identifier(schema)
            )
        ).fetchone()
    log(
        f"  history: {res.done:,} jobs finished by pgbench at {res.jobs_per_s:,.0f} jobs/s; "
        f"{left[0] if left else '?'} not done; {time.monotonic() - t0:.0f}s in all"
    )
    return {"pgbench_jobs_per_s": res.jobs_per_s, "done": res.done}


class WaitSampler:
    """What the database's active backends wait on, sampled every 10 ms until stopped
    (pg_stat_activity; 'CPU' when a backend is active and waits on nothing)."""

    def __init__(self, dsn: str) -> None:
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for (what,) in self._conn.execute(
                "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND state = 'active' AND pid <> pg_backend_pid()"
            ).fetchall():
                self.counts[what] = self.counts.get(what, 0) + 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._conn.close()
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1]))


def explain_claim(dsn: str, schema: str, limit: int = 70) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) skiplock's claim of ``limit`` jobs from the head of
    the queue, in a transaction rolled back: what one claim reads, partition by partition.

    The pick runs inside a function (migration 0010), which EXPLAIN shows as one
    Function Scan; where the server has auto_explain (and we may LOAD it), the pick's
    own plan follows, as auto_explain reports nested statements.
    """
    from skiplock.sqlfiles import statements

    params: dict[str, Any] = {k: None for k in pgbench.CLAIM_NULLS}
    params.update(queue="default", worker="explain", lease=30, limit=limit)
    nested: list[str] = []
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute("LOAD 'auto_explain'")
            for name, value in (
                ("log_min_duration", "0"),
                ("log_nested_statements", "on"),
                ("log_analyze", "on"),
                ("log_buffers", "on"),
                ("log_level", "notice"),
            ):
                conn.execute("SELECT set_config(%s, %s, true)", (f"auto_explain.{name}", value))
            conn.add_notice_handler(lambda d: nested.append(d.message_primary or ""))
        except psycopg.Error:
            conn.rollback()
        rows = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS) {}").format(statements(schema).claim), params
        ).fetchall()
        conn.rollback()
    picks = [n for n in nested if "j.ctid, j.part" in n]  # the pick's own query
    out = "\n".join(str(r[0]) for r in rows)
    return out + ("\n-- the pick, inside claimable():\n" + picks[0] if picks else "")


# -- one flow ---------------------------------------------------------------------------


def flow(
    dsn: str,
    schema: str,
    *,
    rate: float,
    seconds: float,
    burst: int,
    bursts: int = 1,
    explain: bool = False,
    hold: bool,
    fresh: bool,
    window: float,
    concurrency: int,
    tag: str,
) -> dict[str, Any]:
    if fresh:
        lib_skiplock.setup(dsn, schema)
    settle(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(id), 0) FROM {}.jobs").format(sql.Identifier(schema))
        ).fetchone()
    first = int(row[0]) if row else 0
    w = WorkerProc(dsn, schema, concurrency)
    has_pss = statements_reset(dsn)
    holder = hold_xmin(dsn) if hold else None
    q = lib_skiplock._queue(dsn, schema)
    stat_conn = psycopg.connect(dsn, autocommit=True)
    out: dict[str, Any] = {"tag": tag, "rate": rate, "seconds": seconds, "hold": hold}
    samples: list[dict[str, float]] = []
    try:
        time.sleep(1.0)
        rss0 = w.rss_mb()
        tick = 0.02
        per_tick = rate * tick
        owed = 0.0
        n = 0
        t0 = time.monotonic()
        next_sample = t0 + window
        done0 = w.done()
        while True:
            now = time.monotonic()
            if now - t0 >= seconds:
                break
            owed += per_tick
            k = int(owed)
            if k:
                q.enqueue_many([{"n": n + i} for i in range(k)])
                n += k
                owed -= k
            if now >= next_sample:
                lat = [x * 1000 for x in w.claim_window(now - window)]
                samples.append(
                    {
                        "t": now - t0,
                        "done": w.done() - done0,
                        "enqueued": n,
                        "claim_p99_ms": percentile(lat, 99) if lat else float("nan"),
                        "rss_mb": w.rss_mb(),
                        "dead": dead_tuples(stat_conn, schema),
                    }
                )
                log(
                    f"  [{tag}] t={now - t0:,.0f}s enqueued {n:,} done {w.done() - done0:,} "
                    f"claim p99 {samples[-1]['claim_p99_ms']:.2f} ms rss {w.rss_mb():.1f} MB "
                    f"dead {samples[-1]['dead']:,}"
                )
                next_sample += window
            time.sleep(max(0.0, t0 + (n / rate if rate else 0) + tick - time.monotonic()))
        t_end = time.monotonic()
        lat = [x * 1000 for x in w.claim_window(t_end - window)]
        samples.append(
            {
                "t": t_end - t0,
                "done": w.done() - done0,
                "enqueued": n,
                "claim_p99_ms": percentile(lat, 99) if lat else float("nan"),
                "rss_mb": w.rss_mb(),
            }
        )
        # Let the flow's backlog finish before the burst: a worker that fell behind shows
        # here as a long catch-up and a low kept-up rate.
        while w.done() - done0 < n and time.monotonic() - t_end < 120:
            time.sleep(0.01)
        catch_up = time.monotonic() - t_end
        rss1 = w.rss_mb()
        all_lat = [x * 1000 for _, x in w.claims]
        last = [x * 1000 for x in w.claim_window(t_end - window)]
        last_rate = float("nan")
        if len(samples) >= 2:
            a, b = samples[-2], samples[-1]
            last_rate = (b["done"] - a["done"]) / (b["t"] - a["t"])
        out.update(
            enqueued=n,
            completed_in_flow=w.done() - done0,
            catch_up_s=catch_up,
            last_window_rate=last_rate,
            claim_p50_ms=percentile(all_lat, 50),
            claim_p99_ms=percentile(all_lat, 99),
            claim_p99_last_ms=percentile(last, 99) if last else float("nan"),
            rss_start_mb=rss0,
            rss_end_mb=rss1,
            samples=samples,
        )
        # The burst: the worker is the bottleneck now.  Repeated ``bursts`` times, a few
        # seconds apart, with the same state (and the same held snapshot): one burst of
        # 20,000 lasts 2-4 s, short enough for a checkpoint or an upkeep step to swing it.
        each: list[dict[str, Any]] = []
        for k in range(bursts):
            if k:
                time.sleep(5.0)
            d0 = w.done()
            q.enqueue_many([{"n": n + i} for i in range(burst)])
            n += burst
            tb = time.monotonic()
            plan = explain_claim(dsn, schema) if explain else None
            sampler = WaitSampler(dsn)
            while w.done() - d0 < burst and time.monotonic() - tb < 300:
                time.sleep(0.002)
            secs = time.monotonic() - tb
            waits = sampler.stop()
            lat = [x * 1000 for x in w.claim_window(tb)]
            each.append(
                {
                    "jobs_per_s": burst / secs if w.done() - d0 >= burst else float("nan"),
                    "claim_p50_ms": percentile(lat, 50) if lat else float("nan"),
                    "claim_p99_ms": percentile(lat, 99) if lat else float("nan"),
                    "claims": len(lat),
                    "waits": waits,
                }
            )
            if plan is not None:
                each[-1]["plan"] = plan
            log(
                f"  [{tag}] burst {k + 1}: {each[-1]['jobs_per_s']:,.0f} jobs/s, "
                f"{len(lat)} claims p50 {each[-1]['claim_p50_ms']:.2f} ms, waits {waits}"
            )
        out["bursts"] = each
        out["burst_jobs_per_s"] = median([float(b["jobs_per_s"]) for b in each])
        out["storage"] = storage_state(dsn, schema)
        if has_pss:
            out["statements"] = top_statements(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT count(*) FILTER (WHERE status = 'done'), count(*), "
                    "count(*) FILTER (WHERE completions > 1) FROM {}.jobs WHERE id > %s"
                ).format(sql.Identifier(schema)),
                (first,),
            ).fetchone()
        assert row is not None
        out["exactly_once"] = {"done": int(row[0]), "rows": int(row[1]), "twice": int(row[2])}
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
        stat_conn.close()
        q.close()
        w.stop()
    st = out.get("storage", {})
    log(
        f"  [{tag}] kept {out.get('last_window_rate', float('nan')):,.0f}/s of {rate:,.0f}, "
        f"claim p99 {out.get('claim_p99_ms', float('nan')):.2f} ms "
        f"(last window {out.get('claim_p99_last_ms', float('nan')):.2f}), burst "
        f"{out.get('burst_jobs_per_s', float('nan')):,.0f} jobs/s, dead {st.get('n_dead_tup')} "
        f"(pgstattuple {st.get('pgstattuple_dead')}), rss {out.get('rss_start_mb', 0):.1f}"
        f"->{out.get('rss_end_mb', 0):.1f} MB; {out.get('exactly_once')}"
    )
    return out


# -- the whole run ----------------------------------------------------------------------


def run_server(label: str, dsn: str, a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"label": label}
    common = {
        "rate": a.rate,
        "burst": a.burst,
        "bursts": a.bursts,
        "explain": a.explain,
        "window": a.window,
        "concurrency": a.concurrency,
    }
    conds = [c.strip() for c in a.conditions.split(",") if c.strip()]
    for rnd in range(1, a.rounds + 1):
        order = conds if rnd % 2 else conds[::-1]
        for cond in order:
            tag = f"{label} {cond} r{rnd}"
            if cond == "fresh":
                r = flow(
                    dsn,
                    "st_fresh",
                    seconds=a.fresh_seconds,
                    hold=False,
                    fresh=True,
                    tag=tag,
                    **common,
                )
            elif cond == "held":
                r = flow(
                    dsn, "st_held", seconds=a.held_seconds, hold=True, fresh=True, tag=tag, **common
                )
            elif cond == "history":
                h = load_history(dsn, "st_hist", a.history)
                r = flow(
                    dsn,
                    "st_hist",
                    seconds=a.fresh_seconds,
                    hold=False,
                    fresh=False,
                    tag=tag,
                    **common,
                )
                r["history"] = h
            else:
                raise SystemExit(f"unknown condition {cond!r}")
            res.setdefault(cond, []).append(r)
    return res


def dead_peak(
    samples: list[dict[str, Any]], at: float, span: float = 60.0, after: float = 0.0
) -> str:
    """The most dead tuples sampled in the ``span`` seconds up to ``at`` seconds into the
    flow ('-' when the flow was shorter): a rotating table's dead tuples rise and fall
    with each generation, so one sample would say more about its phase than its size.
    Samples land a little after each whole 30 s; ``after`` (1.0 for windows that tile
    the flow) keeps the one at a window's start out of it, so no sample is in two."""
    lo, hi = at - span + after, at + 1.0
    seen = [int(x["dead"]) for x in samples if "dead" in x and lo < x["t"] <= hi]
    return f"{max(seen):,}" if seen else "-"


# Windows longer than a rotation cycle (about two minutes at 1,000 jobs/s): a peak per
# window compares the saw's height, where a minute's peak can catch either phase.
# (The held run of 5 December 2026 on the shared server: minute 2 / minute 10 1.35,
# windows 1-3 / 8-10 also 1.35, 4-7 / 8-10 1.04: its first cycle, from an empty table,
# peaked lower.)
DEAD_WINDOWS = ((0.0, 180.0), (180.0, 420.0), (420.0, 600.0))


def summary(results: list[dict[str, Any]]) -> str:
    lines = [
        "| server | condition | flow s | kept jobs/s (of offered) | claim p50 ms | claim p99 ms "
        "| p99 last window | burst jobs/s | burst / fresh | dead tuples (stat / pgstattuple) "
        "| dead at min 2 / min 10 (peak over the minute before) "
        "| dead, peaks of min 1-3 / 4-7 / 8-10 "
        "| table MB | claimable idx MB | RSS start->end MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for srv in results:
        fresh = srv.get("fresh", [])
        for cond in ("fresh", "held", "history"):
            runs = srv.get(cond, [])
            if not runs:
                continue
            ratios = []
            for i, r in enumerate(runs):
                if i < len(fresh):
                    ratios.append(r["burst_jobs_per_s"] / fresh[i]["burst_jobs_per_s"])

            def med(key: str, rs: list[dict[str, Any]] = runs) -> float:
                return median([float(r.get(key, float("nan"))) for r in rs])

            st = runs[-1].get("storage", {})
            idx = st.get("indexes", {}).get("jobs_claimable_idx", {})
            samples = runs[-1].get("samples", [])
            mins = " / ".join(dead_peak(samples, m * 60.0) for m in (2, 10))
            windows = " / ".join(dead_peak(samples, b, b - a, after=1.0) for a, b in DEAD_WINDOWS)
            lines.append(
                f"| {srv['label']} | {cond} | {runs[0]['seconds']:.0f} "
                f"| {med('last_window_rate'):,.0f} ({runs[0]['rate']:,.0f}) "
                f"| {med('claim_p50_ms'):.2f} | {med('claim_p99_ms'):.2f} "
                f"| {med('claim_p99_last_ms'):.2f} | {med('burst_jobs_per_s'):,.0f} "
                f"| {median(ratios) if ratios else float('nan'):.2f} "
                f"| {st.get('n_dead_tup', '?'):,} / {st.get('pgstattuple_dead', '?'):,} "
                f"| {mins} | {windows} "
                f"| {st.get('table_mb', float('nan')):.0f} | {idx.get('mb', float('nan')):.1f} "
                f"| {med('rss_start_mb'):.1f} -> {med('rss_end_mb'):.1f} |"
            )
    notes = []
    for srv in results:
        for cond in ("fresh", "held", "history"):
            for r in srv.get(cond, [])[-1:]:
                st = r.get("storage", {})
                upd = st.get("n_tup_upd") or 0
                hot = f"HOT {st.get('n_tup_hot_upd', 0) / upd:.2f} of updates; " if upd else ""
                tops = r.get("statements") or []
                where = "; ".join(
                    f"{t['statement']} {t['total_s']:.1f} s ({t['calls']:,} calls, "
                    f"{t['mean_ms']:.2f} ms, {t['buffers_per_call']:.0f} buffers)"
                    for t in tops[:5]
                )
                where = where or "no pg_stat_statements"
                notes.append(f"- {srv['label']} {cond}: {hot}{where}")
    if notes:
        lines += ["", "Server time by statement over the flow and burst (pg_stat_statements):", ""]
        lines += notes
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.storage", description=__doc__)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dsn", default=DEFAULT_DSN)
    p.add_argument(
        "--servers",
        default="shared,scratch",
        help="shared (the --dsn server, autovacuum as it is) and/or scratch "
        "(initdb'd cluster, autovacuum on)",
    )
    p.add_argument("--conditions", default="fresh,held,history")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rate", type=float, default=1000.0, help="jobs/s offered in the flow")
    p.add_argument("--held-seconds", type=float, default=600.0, help="the issue asks 10 min")
    p.add_argument(
        "--fresh-seconds",
        type=float,
        default=600.0,
        help="as long as the hold by default, so that the hold is all that differs",
    )
    p.add_argument("--window", type=float, default=30.0, help="seconds per sample")
    p.add_argument("--burst", type=int, default=20_000)
    p.add_argument(
        "--bursts", type=int, default=3, help="bursts after the flow (the median is reported)"
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="EXPLAIN (ANALYZE, BUFFERS) a claim from the head as each burst starts "
        "(rolled back; the plan goes into the JSON)",
    )
    p.add_argument("--history", type=int, default=1_000_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--db", default=DB, help="scratch database on the shared server")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = p.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    from . import scratch

    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    load0 = loadavg()
    results: list[dict[str, Any]] = []
    for srv in servers:
        if srv == "shared":
            dsn = recreate_database(a.dsn, a.db)
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    av = conn.execute("SHOW autovacuum").fetchone()
                label = f"shared (autovacuum {av[0] if av else '?'})"
                results.append(run_server(label, dsn, a))
            finally:
                drop_database(a.dsn, a.db)
        elif srv == "scratch":
            with scratch.cluster() as sdsn:
                results.append(run_server("scratch (autovacuum on)", sdsn, a))
        else:
            raise SystemExit(f"unknown server {srv!r}")
    load1 = loadavg()
    # The raw results first: a report that fails to render must not lose a long run.
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (a.out / f"storage-{stamp}.json").write_text(
        json.dumps(
            {"args": vars(a) | {"out": str(a.out)}, "results": results}, indent=1, default=str
        ),
        encoding="utf-8",
    )
    text = (
        f"storage: offered {a.rate:,.0f} jobs/s, held {a.held_seconds:.0f}s, fresh/history "
        f"{a.fresh_seconds:.0f}s, burst {a.burst:,}, history {a.history:,}, worker concurrency "
        f"{a.concurrency}, {a.rounds} round(s); load before {load0}, after {load1}\n\n"
        + summary(results)
    )
    print(text)
    (a.out / f"storage-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
