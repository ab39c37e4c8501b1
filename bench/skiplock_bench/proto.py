"""``python -m skiplock_bench.proto``: the storage design of issue 19, measured on a prototype
schema before anyone writes the migration.

The five-table design (docs/decisions/0001-generations-of-one-jobs-table.md) had two
unknowns; this module measures them on the design's tables (``sql/proto.sql``:
``job_data`` RANGE partitioned by id, ``ready`` and ``leases`` LIST partitioned by
generation, ``history`` RANGE partitioned by ``finished_at``, ``job_keys``), built in a
schema of their own on a scratch cluster (``scratch.py``: initdb on a free port,
autovacuum off; the shared server is never used):

1. ``perjob``: what one job costs the server with the candidate statements, in the
   counts of ``perjob.py`` (its ``Monitor`` and ``Phase``, imported, not copied): heap
   tuples, index entries by index, WAL bytes and full-page images, commits, statements,
   server execution time and server CPU, and jobs/s.  Subjects: ``skiplock-sql`` and
   ``plain`` (perjob's own), ``proto-sql`` (pgbench, 8 clients, batch 10, the
   prototype's claim and complete, every job in one generation) and ``proto-sql-3gen``
   (the same with the backlog spread over three generations, so the claim is a Merge
   Append over three partitions); ``proto-sql-generic`` and ``proto-sql-3gen-generic``
   the same with the clients' ``plan_cache_mode = force_generic_plan`` (otherwise the
   partitioned claim is planned afresh at every call: the cluster has
   ``pg_stat_statements.track_planning`` on, and planning is reported beside
   execution).  ``--rounds`` repeats them in alternating order; rates are given as
   medians.  The prototype's heartbeat (``proto-heartbeat``) and a rotation (TRUNCATE)
   are measured as phases of their own.
2. ``check``: the claim's exactly-once self-check: pgbench clients claim and complete a
   backlog spread over three generations while a rotator advances the generation,
   moves rows and truncates every 0.5 s; then every id must be in ``history`` exactly
   once and ``ready`` and ``leases`` empty, or the run fails (exit status 1).  A second,
   serial part moves a claimed lease and a ready row across generations and checks the
   lease still fences.
3. ``held``: a flow at a fixed offered rate (``--rate``, 1,000 jobs/s: a Python producer,
   pgbench consumers at a fixed transaction rate with 1.5x headroom) while a REPEATABLE
   READ transaction holds back xmin for the whole flow; the prototype rotates every
   ``--rotate`` seconds.  Every ``--sample`` seconds (just before a rotation, so at the
   top of the saw-tooth), per table and per index: pgstattuple's dead tuples and
   pg_relation_size, pgstatindex's leaf pages.  Claim latency is timed by a probe
   consumer (one more client running the same claim and complete, about 20 claims a
   second) per sample window.  After the flow, with the hold still on, ``--bursts``
   bursts of ``--burst`` jobs drained by pgbench (8 clients, batch 10), against the same
   bursts on a fresh schema before the flow.  The same for today's schema
   (``--schemas today``), driven the same way with skiplock's claim and complete of the
   day (``pgbench.render_script``, as perjob's ``skiplock-sql``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from skiplock.sqlfiles import parse_named

from . import lib_skiplock, perjob, pgbench, scratch
from .common import find_pgbench, loadavg, log, median, percentile
from .perjob import Monitor, Phase

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
NGENS = 3
DATA_PART = 1_000_000  # ids per job_data partition
DATA_PARTS = 8


# -- the prototype's SQL ------------------------------------------------------------------


def _named() -> dict[str, str]:
    path = resources.files("skiplock_bench").joinpath("sql", "proto.sql")
    return parse_named(path.read_text(encoding="utf-8"))


SQL = _named()


def q(name: str, schema: str, **parts: sql.Composable) -> sql.Composed:
    """A named statement of proto.sql for ``schema``; ``parts`` fill {part}, {n}..."""
    return sql.SQL(SQL[name]).format(schema=sql.Identifier(schema), **parts)


def part(schema: str, table: str, gen: int) -> sql.Identifier:
    return sql.Identifier(schema, f"{table}_g{gen}")


def setup(dsn: str, schema: str, ngens: int = NGENS) -> None:
    """A fresh prototype schema: ngens generations, job_data and history partitions."""
    s = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        conn.execute(q("create_schema", schema))
        for g in range(ngens):
            conn.execute(q("create_gen", schema, part=part(schema, "ready", g), n=sql.Literal(g)))
            conn.execute(
                q("create_lease_gen", schema, part=part(schema, "leases", g), n=sql.Literal(g))
            )
        for i in range(DATA_PARTS):
            conn.execute(
                q(
                    "create_data_part",
                    schema,
                    part=sql.Identifier(schema, f"job_data_p{i}"),
                    lo=sql.Literal(i * DATA_PART),
                    n=sql.Literal((i + 1) * DATA_PART),
                )
            )
        for day in (-1, 0, 1):
            conn.execute(
                q(
                    "create_history_day",
                    schema,
                    part=sql.Identifier(schema, f"history_d{day + 1}"),
                    lo=sql.Literal(day),
                    n=sql.Literal(day + 1),
                )
            )
        conn.execute(q("init_gen", schema), {"ngens": ngens})


def enqueue(conn: psycopg.Connection[Any], schema: str, payloads: list[dict[str, Any]]) -> None:
    conn.execute(
        q("enqueue", schema),
        {"queue": "default", "task": "noop", "payloads": [Jsonb(p) for p in payloads]},
        prepare=True,
    )


def enqueue_bulk(dsn: str, schema: str, n: int, first: int = 0, chunk: int = 20_000) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for lo in range(0, n, chunk):
            enqueue(conn, schema, [{"n": first + i} for i in range(lo, min(n, lo + chunk))])


def claim(
    conn: psycopg.Connection[Any], schema: str, limit: int, worker: str = "proto"
) -> list[tuple[Any, ...]]:
    return conn.execute(
        q("claim", schema),
        {"queue": "default", "limit": limit, "worker": worker, "lease": 30},
        prepare=True,
    ).fetchall()


def complete(conn: psycopg.Connection[Any], schema: str, rows: list[tuple[Any, ...]]) -> int:
    cur = conn.execute(
        q("complete", schema),
        {
            "ids": [r[0] for r in rows],
            "tokens": [r[1] for r in rows],
            "results": [None] * len(rows),
        },
        prepare=True,
    )
    return len(cur.fetchall())


def pgbench_script(schema: str, batch: int) -> str:
    """The prototype's claim and complete as a pgbench script (pgbench.render_script)."""
    return pgbench.render_script(
        schema,
        batch,
        claim=q("claim", schema).as_string(None),
        complete=q("complete", schema).as_string(None),
        parts=False,  # its claim returns no generation; its complete takes none
    )


# -- rotation -----------------------------------------------------------------------------


@dataclass
class Rotation:
    """What the rotator did: counts, for the report."""

    advances: int = 0
    truncated: int = 0
    blocked: int = 0  # a TRUNCATE that hit lock_timeout (tried again later)
    not_empty: int = 0  # a partition found with rows when its turn to be truncated came
    moved: int = 0  # rows moved to the current generation
    seconds: list[float] = field(default_factory=list)  # wall time of each rotation pass


def _rows(conn: psycopg.Connection[Any], schema: str, p: sql.Identifier, limit: int = 1) -> int:
    row = conn.execute(q("gen_rows", schema, part=p), {"limit": limit}).fetchone()
    return int(row[0]) if row else 0


def _size(conn: psycopg.Connection[Any], p: sql.Identifier) -> int:
    row = conn.execute("SELECT pg_relation_size(%s::regclass)", (p.as_string(None),)).fetchone()
    return int(row[0]) if row else 0


def _try_truncate(
    conn: psycopg.Connection[Any], schema: str, p: sql.Identifier, rot: Rotation, timeout_ms: int
) -> bool:
    """LOCK (lock_timeout), count, TRUNCATE if empty, in one transaction."""
    try:
        with conn.transaction():
            conn.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{timeout_ms}ms"))
            )
            conn.execute(q("lock_part", schema, part=p))
            if _rows(conn, schema, p):
                rot.not_empty += 1
                return False
            conn.execute(q("truncate_part", schema, part=p))
    except psycopg.errors.LockNotAvailable:
        rot.blocked += 1
        return False
    rot.truncated += 1
    return True


def rotate(
    conn: psycopg.Connection[Any],
    schema: str,
    rot: Rotation,
    *,
    timeout_ms: int = 100,
    batch: int = 500,
    retries: int = 5,
    drain_wait: float = 2.0,
) -> None:
    """One rotation pass (autocommit connection):

    1. advance the current generation (``advance``);
    2. every non-current partition of ready and leases that has pages (a truncated one
       has none) and no live row is truncated, under ``lock_timeout``, tried up to
       ``retries`` times; the one just retired is given up to ``drain_wait`` seconds
       to empty first;
    3. a partition that still has live rows and is older than the one just retired
       (it has had a whole period to drain) has them moved to the current generation in
       batches of ``batch``, then is truncated as in 2.
    """
    t0 = time.perf_counter()
    row = conn.execute(q("advance", schema)).fetchone()
    assert row is not None
    cur, ngens = int(row[0]), int(row[1])
    rot.advances += 1
    retired = (cur - 1) % ngens
    for g in range(ngens):
        if g == cur:
            continue
        for table, mover in (("ready", "move_ready"), ("leases", "move_leases")):
            p = part(schema, table, g)
            if _size(conn, p) == 0:
                continue
            if g == retired:
                # the generation just retired drains by itself in well under a second
                # (claims of its last rows, leases of jobs running now): wait for that
                # rather than leave its dead tuples for one more period
                t_wait = time.perf_counter() + drain_wait
                while _rows(conn, schema, p) and time.perf_counter() < t_wait:
                    time.sleep(0.05)
            elif _rows(conn, schema, p):
                while True:
                    cur_ = conn.execute(q(mover, schema, part=p), {"limit": batch})
                    if not cur_.rowcount:
                        break
                    rot.moved += cur_.rowcount
            if _rows(conn, schema, p):
                rot.not_empty += 1
                continue
            for i in range(retries):
                if _try_truncate(conn, schema, p, rot, timeout_ms):
                    break
                time.sleep(0.01 * (i + 1))
    rot.seconds.append(time.perf_counter() - t0)


class Rotator:
    """A thread that runs ``rotate`` every ``period`` seconds until stopped; ``before``
    (if given) runs just before each pass (the held-xmin sampler)."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        period: float,
        before: Callable[[float], None] | None = None,
        rotating: bool = True,
    ) -> None:
        self.dsn, self.schema, self.period, self.before = dsn, schema, period, before
        self.rotating = rotating
        self.rot = Rotation()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Rotator:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=60)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name="proto-rotator") as c:
            t0 = time.monotonic()
            k = 1
            while not self._stop.wait(max(0.0, t0 + k * self.period - time.monotonic())):
                try:
                    if self.before is not None:
                        self.before(time.monotonic() - t0)
                    if self.rotating:
                        rotate(c, self.schema, self.rot)
                except psycopg.Error as exc:
                    self.errors.append(str(exc).splitlines()[0])
                k += 1


# -- 1. per-job costs ---------------------------------------------------------------------


def _finished(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.history").format(sql.Identifier(schema))
        ).fetchone()
    return int(row[0]) if row else 0


def _spread(dsn: str, schema: str, n: int, gens: int) -> None:
    """n jobs enqueued over ``gens`` generations (advance between the parts; nothing is
    moved or truncated), so the claim meets ``gens`` populated partitions."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        per = -(-n // gens)
        for g in range(gens):
            lo, hi = g * per, min(n, (g + 1) * per)
            for a in range(lo, hi, 20_000):
                enqueue(conn, schema, [{"n": i} for i in range(a, min(hi, a + 20_000))])
            if g < gens - 1:
                conn.execute(q("advance", schema))


def explain_claim(dsn: str, schema: str, batch: int) -> list[str]:
    """EXPLAIN ANALYZE of one claim of ``batch`` jobs, rolled back."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) ") + q("claim", schema),
            {"queue": "default", "limit": batch, "worker": "explain", "lease": 30},
        ).fetchall()
        conn.rollback()
    return [str(r[0]) for r in rows]


@contextlib.contextmanager
def _pgoptions(options: str) -> Iterator[None]:
    """Server options for the pgbench clients started meanwhile (they inherit it)."""
    old = os.environ.get("PGOPTIONS")
    os.environ["PGOPTIONS"] = f"{old or ''} {options}".strip()
    try:
        yield
    finally:
        if old is None:
            del os.environ["PGOPTIONS"]
        else:
            os.environ["PGOPTIONS"] = old


def subject_proto(
    mon: Monitor,
    n: int,
    clients: int,
    batch: int,
    gens: int,
    explains: dict[str, list[str]],
    generic: bool = False,
) -> list[Phase]:
    """The prototype's enqueue, its claim+complete under pgbench, and the rotation that
    truncates the drained generation.  ``generic``: the clients run with
    plan_cache_mode = force_generic_plan (planned once per connection, not per call)."""
    name = "proto-sql" if gens == 1 else f"proto-sql-{gens}gen"
    name += "-generic" if generic else ""
    schema = name.replace("-", "_")
    setup(mon.dsn, schema)
    phases: list[Phase] = []
    if gens == 1 and not generic:
        phases.append(
            mon.measure(
                name, "enqueue (one INSERT)", schema, n, lambda: enqueue_bulk(mon.dsn, schema, n)
            )
        )
    else:
        _spread(mon.dsn, schema, n, gens)
    mon.q(sql.SQL("ANALYZE {}.ready, {}.leases, {}.job_data").format(*[sql.Identifier(schema)] * 3))
    explains[name] = explain_claim(mon.dsn, schema, batch)
    with _pgoptions("-c plan_cache_mode=force_generic_plan" if generic else ""):
        drain = mon.measure(
            name,
            "drain",
            schema,
            n,
            perjob._pgbench(mon.dsn, pgbench_script(schema, batch), n, clients, batch),
        )
    drain.jobs = _finished(mon.dsn, schema)
    phases.append(drain)
    if gens == 1 and not generic:
        rot = Rotation()

        def run() -> None:
            with psycopg.connect(mon.dsn, autocommit=True) as conn:
                rotate(conn, schema, rot)

        phases.append(mon.measure(name, "rotate (TRUNCATE)", schema, drain.jobs, run))
        if rot.truncated < 2:
            log(f"  rotation truncated {rot.truncated} partitions, expected 2: {rot}")
    return phases


def subject_heartbeat(mon: Monitor, n: int, batch: int) -> list[Phase]:
    """n leases, each beaten twice (batches of ``batch``): HOT or not."""
    schema = "proto_hb"
    setup(mon.dsn, schema)
    enqueue_bulk(mon.dsn, schema, n)
    with psycopg.connect(mon.dsn, autocommit=True) as conn:
        held: list[tuple[Any, ...]] = []
        while len(held) < n:
            got = claim(conn, schema, 1000)
            if not got:
                break
            held += got
    mon.q(sql.SQL("ANALYZE {}.leases").format(sql.Identifier(schema)))
    phases = []
    for k in (1, 2):

        def beat() -> None:
            with psycopg.connect(mon.dsn, autocommit=True) as conn:
                for i in range(0, len(held), batch):
                    part_ = held[i : i + batch]
                    conn.execute(
                        q("heartbeat", schema),
                        {
                            "lease": 30,
                            "ids": [r[0] for r in part_],
                            "tokens": [r[1] for r in part_],
                        },
                        prepare=True,
                    )

        phases.append(mon.measure("proto-heartbeat", f"beat {k}", schema, len(held), beat))
    return phases


def _split_exec(p: Phase, what: str = "exec_ms") -> tuple[float, float]:
    """Server execution (or planning) ms of the claim and of the complete statements."""
    claim_ms = complete_ms = 0.0
    for key, s in p.statements.items():
        if key in {"BEGIN", "COMMIT", "ROLLBACK"}:
            continue
        if key.startswith("UPDATE") or key.startswith("WITH done"):
            complete_ms += s.get(what, 0.0)
        else:
            claim_ms += s.get(what, 0.0)
    return claim_ms, complete_ms


def run_perjob(dsn: str, a: argparse.Namespace) -> str:
    subjects = [s for s in a.subjects.split(",") if s]
    mon = Monitor(dsn)
    rounds: list[list[Phase]] = []
    explains: dict[str, list[str]] = {}
    try:
        for r in range(a.rounds):
            order = subjects if r % 2 == 0 else subjects[::-1]
            got: list[Phase] = []
            for s in order:
                log(f"proto perjob round {r + 1}: {s}")
                if s == "skiplock-sql":
                    got += perjob.subject_skiplock_sql(mon, a.jobs, a.clients, a.batch)
                elif s == "plain":
                    got += perjob.subject_plain(mon, a.jobs, a.clients, a.batch)
                elif s == "proto-sql":
                    got += subject_proto(mon, a.jobs, a.clients, a.batch, 1, explains)
                elif s in ("proto-sql-3gen", "proto-sql-generic", "proto-sql-3gen-generic"):
                    gens = 3 if "3gen" in s else 1
                    got += subject_proto(
                        mon, a.jobs, a.clients, a.batch, gens, explains, "generic" in s
                    )
                elif s == "proto-heartbeat":
                    got += subject_heartbeat(mon, a.jobs, a.batch)
                else:
                    raise SystemExit(f"unknown subject {s}")
            rounds.append(got)
    finally:
        mon.close()
    first = rounds[0]  # in the order given
    drains: dict[str, list[Phase]] = {}
    for got in rounds:
        for p in got:
            if p.phase == "drain":
                drains.setdefault(p.subject, []).append(p)
    lines = [
        "| subject | jobs/s (rounds) | median jobs/s | server exec µs/job: claim + complete "
        "(median) | planning µs/job: claim + complete (median) | server CPU µs/job (median) |",
        "|---|---|---|---|---|---|",
    ]
    for s, ps in drains.items():
        rates = [p.jobs / p.seconds for p in ps]
        cl = median([1000 * p.per(_split_exec(p)[0]) for p in ps])
        co = median([1000 * p.per(_split_exec(p)[1]) for p in ps])
        pl = median([1000 * p.per(_split_exec(p, "plan_ms")[0]) for p in ps])
        pc = median([1000 * p.per(_split_exec(p, "plan_ms")[1]) for p in ps])
        cpu = median([1e6 * p.per(p.server_cpu_s) for p in ps])
        lines.append(
            f"| {s} | {', '.join(f'{x:,.0f}' for x in rates)} | {median(rates):,.0f} "
            f"| {cl:.1f} + {co:.1f} | {pl:.1f} + {pc:.1f} | {cpu:.0f} |"
        )
    text = (
        f"proto perjob: {a.jobs:,} no-op jobs, pgbench {a.clients} clients x batch {a.batch}, "
        f"{a.rounds} round(s) in alternating order; load average {loadavg()}\n\n"
        "Counts, round 1:\n\n"
        + perjob.table(first)
        + "\n\nRates and server time by round (jobs/s: wall time of the pgbench run, "
        "connections included):\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n\n".join(perjob.statements_table(p) for p in first if p.phase == "drain")
        + "\n\n"
        + "\n\n".join(
            f"EXPLAIN of one claim, {k}:\n\n```\n" + "\n".join(v) + "\n```"
            for k, v in explains.items()
        )
    )
    _save(a.out, "proto-perjob", text, [[p.__dict__ for p in got] for got in rounds])
    return text


def _save(out: Path, stem: str, text: str, data: Any) -> None:
    """Write a report to ``out`` (``--out``: bench/results/ by default)."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{stem}-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    (out / f"{stem}-{stamp}.json").write_text(
        json.dumps(data, indent=1, default=str), encoding="utf-8"
    )


# -- 2. the exactly-once self-check -------------------------------------------------------


def run_check(dsn: str, a: argparse.Namespace) -> tuple[bool, str]:
    schema = "proto_check"
    setup(dsn, schema)
    n, extra = a.jobs, a.jobs // 4
    _spread(dsn, schema, n, NGENS)  # three generations populated: Merge Append, moves
    stop = threading.Event()

    def producer() -> None:  # more jobs while claims and rotations run
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(0, extra, 50):
                enqueue(conn, schema, [{"late": i + k} for k in range(50)])
                if stop.wait(0.005):
                    return

    prod = threading.Thread(target=producer, daemon=True)
    with Rotator(dsn, schema, a.check_rotate) as rotator:
        prod.start()
        perjob._pgbench(
            dsn, pgbench_script(schema, a.batch), (n + extra) * 3 // 2, a.clients, a.batch
        )()
        prod.join()
        # whatever the pgbench clients left (they stop after a fixed count)
        with psycopg.connect(dsn, autocommit=True) as conn:
            while rows := claim(conn, schema, 500):
                complete(conn, schema, rows)
    stop.set()
    rot = rotator.rot
    with psycopg.connect(dsn, autocommit=True) as conn:
        # serial part: a lease moved across generations still fences; a stale token does not
        enqueue(conn, schema, [{"serial": i} for i in range(5)])
        held = claim(conn, schema, 5)
        r2 = Rotation()
        rotate(conn, schema, r2)
        rotate(conn, schema, r2)  # the lease's generation is old now: moved
        gens = conn.execute(
            sql.SQL("SELECT DISTINCT gen FROM {}.leases").format(sql.Identifier(schema))
        ).fetchall()
        import uuid

        stale = complete(conn, schema, [(held[0][0], uuid.uuid4())])
        fenced = complete(conn, schema, held)
        row = conn.execute(q("check_once", schema)).fetchone()
    assert row is not None
    keys = (
        "enqueued",
        "finished_ids",
        "history_rows",
        "twice",
        "never",
        "ready_left",
        "leases_left",
    )
    res = dict(zip(keys, (int(x) for x in row), strict=True))
    ok = (
        res["enqueued"] == n + extra + 5
        and res["finished_ids"] == res["enqueued"] == res["history_rows"]
        and res["twice"] == res["never"] == res["ready_left"] == res["leases_left"] == 0
        and r2.moved >= 5
        and stale == 0
        and fenced == 5
        and not rotator.errors
    )
    text = (
        f"proto check: {n:,} jobs over {NGENS} generations + {extra:,} enqueued during the "
        f"drain, pgbench {a.clients} clients x batch {a.batch}, rotation every "
        f"{a.check_rotate} s: {res}; rotation {rot.advances} advances, {rot.truncated} "
        f"truncates, {rot.blocked} blocked by lock_timeout, {rot.moved:,} rows moved, "
        f"{rot.not_empty} found not empty, errors {rotator.errors[:3]}; serial part: lease "
        f"generations after two rotations {[g[0] for g in gens]}, moved {r2.moved}, stale "
        f"token matched {stale}, moved leases completed {fenced} of 5 -> "
        + ("OK" if ok else "FAILED")
    )
    return ok, text


# -- 3. held xmin -------------------------------------------------------------------------


class Kind:
    """How one schema is driven: its setup, enqueue, claim+complete, script, counts."""

    def __init__(self, name: str, dsn: str, schema: str) -> None:
        self.name, self.dsn, self.schema = name, dsn, schema
        self.proto = name == "proto"

    def setup(self) -> None:
        if self.proto:
            setup(self.dsn, self.schema)
        else:
            lib_skiplock.setup(self.dsn, self.schema)

    def script(self, batch: int) -> str:
        if self.proto:
            return pgbench_script(self.schema, batch)
        return pgbench.render_script(self.schema, batch)

    def producer_conn(self) -> Any:
        if self.proto:
            return psycopg.connect(self.dsn, autocommit=True, application_name="proto-producer")
        return lib_skiplock._queue(self.dsn, self.schema)

    def enqueue(self, conn: Any, payloads: list[dict[str, Any]]) -> None:
        if self.proto:
            enqueue(conn, self.schema, payloads)
        else:
            conn.enqueue_many(payloads)

    def finished(self) -> int:
        if self.proto:
            return _finished(self.dsn, self.schema)
        return lib_skiplock.count_jobs(self.dsn, self.schema, "status = 'done'")

    def backlog(self, conn: psycopg.Connection[Any]) -> int:
        s = sql.Identifier(self.schema)
        stmt = (
            sql.SQL("SELECT count(*) FROM {}.ready").format(s)
            if self.proto
            else sql.SQL("SELECT count(*) FROM {}.jobs WHERE status = 'pending'").format(s)
        )
        row = conn.execute(stmt).fetchone()
        return int(row[0]) if row else 0

    def claim_complete(self, conn: psycopg.Connection[Any], batch: int) -> tuple[float, int]:
        """One claim (timed) and the complete of what it took: (claim seconds, jobs)."""
        if self.proto:
            t0 = time.perf_counter()
            rows = claim(conn, self.schema, batch, "probe")
            took = time.perf_counter() - t0
            if rows:
                complete(conn, self.schema, rows)
            return took, len(rows)
        from skiplock.sqlfiles import statements

        st = statements(self.schema)
        params = {
            "queue": "default",
            "limit": batch,
            "worker": "probe",
            "lease": 30,
            "from_priority": None,
            "from_run_at": None,
            "from_id": None,
            "tasks": None,
        }
        t0 = time.perf_counter()
        cur = conn.execute(st.claim, params, prepare=True)
        got = cur.fetchall()
        took = time.perf_counter() - t0
        cols = [d.name for d in cur.description or []]
        got = [r for r in got if r[cols.index("id")] is not None]
        if got:
            conn.execute(
                st.complete,
                {
                    "ids": [r[cols.index("id")] for r in got],
                    "tokens": [r[cols.index("lease_token")] for r in got],
                    "results": [None] * len(got),
                },
                prepare=True,
            )
        return took, len(got)


def _pgbench_proc(dsn: str, script: str, args: list[str]) -> tuple[subprocess.Popen[str], Path]:
    exe = find_pgbench()
    if exe is None:
        raise RuntimeError("pgbench not found")
    path = Path(tempfile.mkdtemp(prefix="proto-")) / "flow.sql"
    path.write_text(script, encoding="utf-8")
    cmd = [
        exe,
        "--no-vacuum",
        "--protocol=prepared",
        *args,
        f"--file={path}",
        *(f"--define={k}={v}" for k, v in pgbench.CLAIM_CONSTANTS.items()),
        dsn,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), path


def sample_relations(conn: psycopg.Connection[Any], schema: str) -> dict[str, dict[str, float]]:
    """Per table (leaf partitions) and index of the schema: pgstattuple's live and dead
    tuples, pgstatindex's leaf pages, and pg_relation_size."""
    out: dict[str, dict[str, float]] = {}
    rels = conn.execute(
        "SELECT c.oid, c.relname, c.relkind FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'i') ORDER BY c.relname",
        (schema,),
    ).fetchall()
    for oid, name, kind in rels:
        size = conn.execute("SELECT pg_relation_size(%s::oid::regclass)", (oid,)).fetchone()
        d: dict[str, float] = {"bytes": float(size[0]) if size else 0.0}
        if kind == "r":
            row = conn.execute(
                "SELECT tuple_count, dead_tuple_count FROM pgstattuple(%s::oid::regclass)", (oid,)
            ).fetchone()
            if row:
                d["live"], d["dead"] = float(row[0]), float(row[1])
        else:
            row = conn.execute(
                "SELECT leaf_pages, avg_leaf_density FROM pgstatindex(%s::oid::regclass)", (oid,)
            ).fetchone()
            if row:
                d["leaf_pages"] = float(row[0])
                d["density"] = float(row[1]) if row[1] == row[1] else float("nan")
        out[str(name)] = d
    return out


def hold_xmin(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, application_name="proto-held-xmin")
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT txid_current()")
    return conn


def bursts(kind: Kind, a: argparse.Namespace) -> list[float]:
    """--bursts bursts of --burst jobs, each drained by pgbench: jobs/s of each."""
    out = []
    per = max(1, a.burst // (a.clients * a.batch))
    for _ in range(a.bursts):
        conn = kind.producer_conn()
        try:
            for lo in range(0, a.burst, 20_000):
                kind.enqueue(conn, [{"b": i} for i in range(lo, min(a.burst, lo + 20_000))])
        finally:
            conn.close()
        d0 = kind.finished()
        t0 = time.perf_counter()
        perjob._pgbench(
            kind.dsn, kind.script(a.batch), per * a.clients * a.batch, a.clients, a.batch
        )()
        secs = time.perf_counter() - t0
        out.append((kind.finished() - d0) / secs)
    return out


def flow(kind: Kind, a: argparse.Namespace, seconds: float, hold: bool) -> dict[str, Any]:
    """The fixed-rate flow: producer, pgbench consumers, probe, rotator and sampler."""
    res: dict[str, Any] = {"seconds": seconds, "hold": hold, "samples": []}
    stop = threading.Event()
    probe: list[tuple[float, float]] = []  # (monotonic, claim seconds)
    enq = [0]

    def producer() -> None:
        conn = kind.producer_conn()
        tick, owed, t0 = 0.02, 0.0, time.monotonic()
        try:
            while not stop.is_set():
                owed += a.rate * tick
                k = int(owed)
                if k:
                    kind.enqueue(conn, [{"n": enq[0] + i} for i in range(k)])
                    enq[0] += k
                    owed -= k
                time.sleep(max(0.0, t0 + enq[0] / a.rate - time.monotonic()))
        finally:
            conn.close()

    def prober() -> None:
        with psycopg.connect(kind.dsn, autocommit=True, application_name="proto-probe") as c:
            while not stop.wait(0.05):
                took, _ = kind.claim_complete(c, a.batch)
                probe.append((time.monotonic(), took))

    mon = psycopg.connect(kind.dsn, autocommit=True, application_name="proto-sampler")
    t_start = time.monotonic()
    last = [t_start]

    sampling = threading.Lock()

    def sample(t: float) -> None:
        with sampling:
            _sample()

    def _sample() -> None:
        now = time.monotonic()
        lat = [s * 1000 for (tt, s) in probe[:] if last[0] <= tt < now]
        last[0] = now
        t1 = time.perf_counter()
        rels = sample_relations(mon, kind.schema)
        s = {
            "t": now - t_start,
            "enqueued": enq[0],
            "backlog": kind.backlog(mon),
            "claim_p50_ms": percentile(lat, 50),
            "claim_p99_ms": percentile(lat, 99),
            "claims": len(lat),
            "relations": rels,
            "sample_s": time.perf_counter() - t1,
        }
        res["samples"].append(s)
        dead = sum(r.get("dead", 0) for r in rels.values())
        log(
            f"  [{kind.name}{' held' if hold else ''}] t={s['t']:.0f}s enqueued {enq[0]:,} "
            f"backlog {s['backlog']:,} claim p50/p99 {s['claim_p50_ms']:.2f}/"
            f"{s['claim_p99_ms']:.2f} ms ({len(lat)}) dead tuples {dead:,.0f}"
        )

    next_sample = [a.sample]

    def before(t: float) -> None:
        if t >= next_sample[0] - 0.5:
            sample(t)
            next_sample[0] += a.sample

    holder = hold_xmin(kind.dsn) if hold else None
    rotator = Rotator(kind.dsn, kind.schema, a.rotate, before, rotating=kind.proto)
    threads = [threading.Thread(target=f, daemon=True) for f in (producer, prober)]
    tx_rate = a.rate * 1.5 / a.batch
    pg, path = _pgbench_proc(
        kind.dsn,
        kind.script(a.batch),
        [f"--client={a.clients}", "--jobs=2", f"--rate={tx_rate}", f"--time={int(seconds)}"],
    )
    try:
        with rotator:
            for t in threads:
                t.start()
            out, _ = pg.communicate()
            stop.set()
            for t in threads:
                t.join()
            res["pgbench"] = out[-1500:]
            if pg.returncode != 0:
                raise RuntimeError(f"pgbench failed:\n{out[-2000:]}")
            next_sample[0] = float("inf")  # the rotator samples no more
            sample(time.monotonic() - t_start)  # the flow's last, partial window
            res["finished_in_flow"] = kind.finished()
            res["enqueued"] = enq[0]
            # bursts with the rotator still running, and the hold still on if held
            res["bursts"] = bursts(kind, a)
        res["rotation"] = rotator.rot.__dict__ | {"errors": rotator.errors}
        res["after_bursts"] = sample_relations(mon, kind.schema)
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
        mon.close()
        path.unlink(missing_ok=True)
    return res


_PARTITION = re.compile(r"_(?:g|p|d)\d+(?=_|$)|_default(?=_|$)")


def by_table(rels: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per-partition figures summed per table or index of the design (``ready_g0``,
    ``ready_g1``... -> ``ready``; ``ready_g0_pkey`` -> ``ready_pkey``)."""
    out: dict[str, dict[str, float]] = {}
    for name, d in rels.items():
        g = out.setdefault(_PARTITION.sub("", name), {})
        for k in ("bytes", "live", "dead"):
            if k in d:
                g[k] = g.get(k, 0.0) + d[k]
    return out


def _near(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    return min(samples, key=lambda s: abs(float(s["t"]) - t))


def held_report(
    name: str, fresh: dict[str, Any], held: dict[str, Any], a: argparse.Namespace
) -> str:
    """min 2 against the last full sample, per relation; claim latency; bursts."""
    full = held["samples"][:-1] or held["samples"]  # the last one is the flow's partial window
    s2, sl = _near(full, 120.0), full[-1]
    lines = [
        f"{name}: held {held['seconds'] / 60:.0f} min, offered {a.rate:,.0f} jobs/s, "
        + (f"rotation every {a.rotate:g} s, " if name == "proto" else "")
        + f"samples every {a.sample:g} s (just before a rotation); "
        f"t={s2['t']:.0f}s against t={sl['t']:.0f}s",
        "",
        "| table or index (all its partitions) | dead tuples, t2 / last / max "
        "| size MB, t2 / last / max | last / t2 (dead; size for an index) |",
        "|---|---|---|---|",
    ]
    tables = [by_table(s["relations"]) for s in full]
    t2, tl = by_table(s2["relations"]), by_table(sl["relations"])
    names = sorted({k for t in tables for k in t})
    for rel in names:

        def get(t: dict[str, Any], key: str, rel: str = rel) -> float:
            return float(t.get(rel, {}).get(key, 0.0))

        mx_dead = max(get(t, "dead") for t in tables)
        mx_mb = max(get(t, "bytes") for t in tables) / 1048576
        if mx_mb <= 16384 / 1048576:  # empty, or an empty index's metapage and root
            continue
        is_table = any("dead" in t.get(rel, {}) for t in tables)
        d2, dl = get(t2, "dead"), get(tl, "dead")
        b2, bl = get(t2, "bytes") / 1048576, get(tl, "bytes") / 1048576
        base, last = (d2, dl) if is_table else (b2, bl)
        ratio = f"{last / base:.2f}" if base else ("-" if not last else "new")
        dead = f"{d2:,.0f} / {dl:,.0f} / {mx_dead:,.0f}" if is_table else "(index)"
        lines.append(f"| {rel} | {dead} | {b2:.1f} / {bl:.1f} / {mx_mb:.1f} | {ratio} |")
    tot2 = sum(float(r.get("dead", 0)) for r in s2["relations"].values())
    totl = sum(float(r.get("dead", 0)) for r in sl["relations"].values())
    lines.append(
        f"| all tables | {tot2:,.0f} / {totl:,.0f} | "
        f"| {totl / tot2 if tot2 else float('nan'):.2f} |"
    )
    first = held["samples"][0]
    fb, hb = median(fresh["bursts"]), median(held["bursts"])
    fs = fresh["samples"]
    fresh_p99 = median([float(s["claim_p99_ms"]) for s in fs])
    lines += [
        "",
        "| claim latency (probe, ms) | p50 | p99 |",
        "|---|---|---|",
        f"| fresh flow, no hold ({fresh['seconds']:.0f} s; median of windows) "
        f"| {median([float(s['claim_p50_ms']) for s in fs]):.2f} | {fresh_p99:.2f} |",
        f"| held, first window (t={first['t']:.0f}s) | {first['claim_p50_ms']:.2f} "
        f"| {first['claim_p99_ms']:.2f} |",
        f"| held, t={s2['t']:.0f}s | {s2['claim_p50_ms']:.2f} | {s2['claim_p99_ms']:.2f} |",
        f"| held, last window (t={sl['t']:.0f}s) | {sl['claim_p50_ms']:.2f} "
        f"| {sl['claim_p99_ms']:.2f} |",
        f"| held, worst window | {max(float(s['claim_p50_ms']) for s in full):.2f} "
        f"| {max(float(s['claim_p99_ms']) for s in full):.2f} |",
        "",
        f"bursts of {a.burst:,} (pgbench {a.clients} x {a.batch}), jobs/s: fresh "
        f"{', '.join(f'{x:,.0f}' for x in fresh['bursts'])} (median {fb:,.0f}); after the "
        f"hold, still held {', '.join(f'{x:,.0f}' for x in held['bursts'])} (median {hb:,.0f}); "
        f"held / fresh {hb / fb:.2f}",
        f"backlog at the samples: {[int(s['backlog']) for s in full]}; enqueued "
        f"{held['enqueued']:,}, finished in the flow {held['finished_in_flow']:,}",
    ]
    if name == "proto":
        r = held["rotation"]
        secs = r["seconds"] or [float("nan")]
        lines.append(
            f"rotation: {r['advances']} advances, {r['truncated']} truncates, {r['blocked']} "
            f"hit lock_timeout, {r['moved']:,} rows moved, {r['not_empty']} found not empty, "
            f"pass p50/max {1000 * median(secs):.0f}/{1000 * max(secs):.0f} ms, "
            f"errors {r['errors'][:3]}"
        )
    return "\n".join(lines)


def run_held(dsn: str, a: argparse.Namespace) -> str:
    out, texts = {}, []
    for name in [s for s in a.schemas.split(",") if s]:
        if name not in ("proto", "today"):
            raise SystemExit(f"unknown schema kind {name}")
        fresh_k = Kind(name, dsn, f"{name}_fresh")
        fresh_k.setup()
        log(f"proto held: {name}, fresh flow {a.fresh_seconds:.0f} s")
        fresh = flow(fresh_k, a, a.fresh_seconds, hold=False)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(fresh_k.schema)))
        held_k = Kind(name, dsn, f"{name}_held")
        held_k.setup()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
        log(f"proto held: {name}, held flow {a.minutes:g} min")
        held = flow(held_k, a, a.minutes * 60, hold=True)
        out[name] = {"fresh": fresh, "held": held}
        _save(a.out, f"proto-held-{name}-raw", "", out[name])  # kept even if the report fails
        texts.append(held_report(name, fresh, held, a))
    text = (
        f"proto held xmin: {a.minutes:g} min at {a.rate:,.0f} jobs/s, autovacuum off; load "
        f"average {loadavg()}\n\n" + "\n\n".join(texts)
    )
    _save(a.out, "proto-held", text, out)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.proto", description=__doc__)
    p.add_argument(
        "what", nargs="?", default="check,perjob", help="check, perjob, held (comma list)"
    )
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="perjob rounds, alternating order")
    p.add_argument(
        "--subjects",
        default="skiplock-sql,plain,proto-sql,proto-sql-generic,proto-sql-3gen,"
        "proto-sql-3gen-generic,proto-heartbeat",
    )
    p.add_argument("--check-rotate", type=float, default=0.5, help="check: rotation period, s")
    p.add_argument("--schemas", default="proto,today", help="held: proto and/or today")
    p.add_argument("--minutes", type=float, default=10.0, help="held: length of the hold")
    p.add_argument("--fresh-seconds", type=float, default=60.0, help="held: the fresh flow")
    p.add_argument("--rate", type=float, default=1000.0, help="held: jobs/s offered")
    p.add_argument("--rotate", type=float, default=30.0, help="held: rotation period, s")
    p.add_argument("--sample", type=float, default=60.0, help="held: sample period, s")
    p.add_argument("--burst", type=int, default=20_000)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--dsn", default=None, help="a server of your own (never the shared one)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the reports go")
    a = p.parse_args(argv)
    if a.sample % a.rotate:
        raise SystemExit("--sample must be a multiple of --rotate (samples precede rotations)")
    what = [w for w in a.what.split(",") if w]
    ok = True
    with contextlib.ExitStack() as stack:
        # track_planning: the claim over partitions is planned at every execution
        settings = {"autovacuum": "off", "pg_stat_statements.track_planning": "on"}
        dsn = a.dsn or stack.enter_context(scratch.cluster(settings))
        Monitor(dsn).close()  # the extensions
        for w in what:
            if w == "check":
                good, text = run_check(dsn, a)
                ok = ok and good
                _save(a.out, "proto-check", text, {"ok": good})
            elif w == "perjob":
                text = run_perjob(dsn, a)
            elif w == "held":
                text = run_held(dsn, a)
            else:
                raise SystemExit(f"unknown {w}")
            print(text, flush=True)
    if not ok:
        print("proto check FAILED: a job claimed twice, never, or left behind", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
