"""``python -m skiplock_bench.sqlcmp``: pgbench on several versions of the claim and complete.

Each variant is a (claim, complete) pair: ``old`` (bench/skiplock_bench/sql/baseline.sql,
the statements before the queues lookup, results and finish NOTIFY), ``new`` (skiplock's
statements of the day) and any candidate in ``sql/candidates.sql`` named
``claim_<variant>`` / ``complete_<variant>`` (a missing half is today's).  All run in the
same process, each round in a rotated order, on fresh schemas with the same backlog, so
the ratios compare SQL with SQL on a machine whose speed drifts.

Modes: ``cc`` claim + complete (batch jobs per transaction pair), ``claim`` claim only
over a backlog, ``empty`` a claim that finds nothing (what idle workers pay per poll).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock._sql import channel_name
from skiplock.sqlfiles import parse_named

from . import lib_skiplock, pgbench
from .common import (
    DEFAULT_DSN,
    drop_database,
    loadavg,
    log,
    median,
    recreate_database,
    settle,
)

DB = "bench_sqlcmp"
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def _read(name: str) -> dict[str, str]:
    path = resources.files("skiplock_bench").joinpath("sql", name)
    return parse_named(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _render(text: str, schema: str) -> str:
    return (
        sql.SQL(text)
        .format(schema=sql.Identifier(schema), channel=sql.Literal(channel_name(schema)))
        .as_string(None)
    )


def variants(names: list[str]) -> dict[str, tuple[str | None, str | None]]:
    """{variant: (claim text or None for today's, complete text or None)}."""
    base = _read("baseline.sql")
    cand = _read("candidates.sql")
    out: dict[str, tuple[str | None, str | None]] = {}
    for name in names:
        if name == "new":
            out[name] = (None, None)
        elif name == "old":
            out[name] = (base["claim"], base["complete"])
        else:
            claim, complete = cand.get(f"claim_{name}"), cand.get(f"complete_{name}")
            if claim is None and complete is None and f"setup_{name}" not in cand:
                raise SystemExit(f"no claim_, complete_ or setup_{name} in sql/candidates.sql")
            out[name] = (claim, complete)
    return out


def _setup(dsn: str, schema: str, jobs: int, setup_sql: str | None) -> None:
    lib_skiplock.setup(dsn, schema)
    if setup_sql:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(_render(setup_sql, schema).encode())
    if jobs:
        lib_skiplock.enqueue_bulk(dsn, jobs, schema=schema)
    settle(dsn)


def one(
    dsn: str, variant: str, pair: tuple[str | None, str | None], mode: str, a: argparse.Namespace
) -> dict[str, Any]:
    schema = f"cmp_{variant}"
    setup_sql = _read("candidates.sql").get(f"setup_{variant}")
    per_client = max(1, a.jobs // (a.clients * a.batch))
    jobs = 0 if mode == "empty" else per_client * a.clients * a.batch
    _setup(dsn, schema, jobs, setup_sql)
    claim, complete = pair
    script = pgbench.render_script(
        schema,
        a.batch,
        claim=None if claim is None else _render(claim, schema),
        complete="" if mode != "cc" else (None if complete is None else _render(complete, schema)),
    )
    tx = a.empty_tx if mode == "empty" else per_client
    stats = _stats_reset(dsn) if a.stats else False
    holder = None
    if a.hold:
        from .storage import hold_xmin

        holder = hold_xmin(dsn)
    try:
        res = pgbench.run(
            dsn,
            schema,
            clients=a.clients,
            batch=a.batch,
            transactions=tx,
            script=script,
            synchronous_commit=a.sync,
        )
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FILTER (WHERE status = 'running'), "
                "count(*) FILTER (WHERE status = 'done') FROM {}.jobs"
            ).format(sql.Identifier(schema))
        ).fetchone()
    running, done = (int(row[0]), int(row[1])) if row else (0, 0)
    taken = done if mode == "cc" else running
    rate = taken / res.seconds if mode != "empty" else res.tps
    out: dict[str, Any] = {"rate": rate, "tps": res.tps, "latency_ms": res.latency_ms}
    out["jobs"] = taken
    if stats:
        out["per_job"] = _stats_read(dsn, max(taken, 1) if mode != "empty" else res.transactions)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd, pg_table_size(relid) FROM pg_stat_user_tables "
                "WHERE schemaname = %s AND relname = 'jobs'",
                (schema,),
            ).fetchone()
        if row:
            out["per_job"]["table"] = {
                "hot_ratio": row[1] / row[0] if row[0] else float("nan"),
                "mb": row[2] / 1048576.0,
            }
    return out


def _stats_reset(dsn: str) -> bool:
    """pg_stat_statements, if the server preloads it (the scratch cluster does)."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        return True
    except psycopg.Error:
        return False


def _stats_read(dsn: str, per: int) -> dict[str, dict[str, float]]:
    """Server cost per job (per claim in empty mode) of the claim and the complete:
    execution ms, shared buffers touched, WAL records and bytes.  Buffers and WAL are
    counts, not times: they do not drift with the machine's load."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time, shared_blks_hit + shared_blks_read, "
            "shared_blks_dirtied, wal_records, wal_bytes FROM pg_stat_statements "
            "WHERE query ILIKE '%%jobs%%' AND calls > 10 AND dbid = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    out: dict[str, dict[str, float]] = {}
    for query, calls, ms, blks, dirtied, walr, walb in rows:
        q = str(query)
        name = "claim" if "gen_random_uuid" in q else "complete" if "completions" in q else None
        if name is None:
            continue
        out[name] = {
            "calls": float(calls),
            "exec_ms": float(ms) / per,
            "buffers": float(blks) / per,
            "dirtied": float(dirtied) / per,
            "wal_records": float(walr) / per,
            "wal_bytes": float(walb) / per,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.sqlcmp", description=__doc__)
    p.add_argument("--dsn", default=DEFAULT_DSN)
    p.add_argument("--variants", default="old,new")
    p.add_argument("--modes", default="cc,claim,empty")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=40_000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--empty-tx", type=int, default=2_000, help="claims per client, empty mode")
    p.add_argument("--sync", action="store_true", help="synchronous_commit=on (default off)")
    p.add_argument("--hold", action="store_true", help="hold back xmin during each run")
    p.add_argument("--stats", action="store_true", help="pg_stat_statements cost per job")
    p.add_argument(
        "--scratch",
        action="store_true",
        help="run on a scratch cluster (autovacuum on, pg_stat_statements)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = p.parse_args(argv)
    names = [x.strip() for x in a.variants.split(",") if x.strip()]
    pairs = variants(names)
    modes = [x.strip() for x in a.modes.split(",") if x.strip()]
    if a.scratch:
        from . import scratch

        with scratch.cluster() as sdsn:
            a.dsn = sdsn
            return _main(a, names, pairs, modes)
    return _main(a, names, pairs, modes)


def _main(
    a: argparse.Namespace,
    names: list[str],
    pairs: dict[str, tuple[str | None, str | None]],
    modes: list[str],
) -> int:
    dsn = recreate_database(a.dsn, DB)
    load0 = loadavg()
    costs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {v: [] for v in names} for m in modes}
    figures: dict[str, dict[str, list[float]]] = {m: {v: [] for v in names} for m in modes}
    ratios: dict[str, dict[str, list[float]]] = {m: {v: [] for v in names} for m in modes}
    try:
        for rnd in range(1, a.rounds + 1):
            k = (rnd - 1) % len(names)
            order = names[k:] + names[:k]
            for mode in modes:
                got: dict[str, float] = {}
                for v in order:
                    r = one(dsn, v, pairs[v], mode, a)
                    got[v] = r["rate"]
                    figures[mode][v].append(r["rate"])
                    if "per_job" in r:
                        costs[mode][v].append(r["per_job"])
                    log(
                        f"round {rnd} {mode} {v}: {r['rate']:,.0f}/s "
                        f"({r['latency_ms']:.2f} ms per transaction, {r['jobs']:,} jobs)"
                    )
                ref = got[names[0]]
                for v in names:
                    ratios[mode][v].append(got[v] / ref if ref else float("nan"))
    finally:
        drop_database(a.dsn, DB)
    load1 = loadavg()
    unit = {"cc": "jobs/s", "claim": "jobs/s", "empty": "claims/s"}
    lines = [
        f"sqlcmp: {a.clients} clients, batch {a.batch}, {a.jobs:,} jobs, "
        f"synchronous_commit {'on' if a.sync else 'off'}, {a.rounds} rounds"
        f"{', xmin held' if a.hold else ''}{', scratch cluster' if a.scratch else ''}; "
        f"load before {load0}, after {load1}",
        "",
        f"| mode | variant | rounds | median | ratio to {names[0]} (median of per-round) |",
        "|---|---|---|---|---|",
    ]
    for mode in modes:
        for v in names:
            rs = ", ".join(f"{x:,.0f}" for x in figures[mode][v])
            lines.append(
                f"| {mode} ({unit[mode]}) | {v} | {rs} | {median(figures[mode][v]):,.0f} "
                f"| {median(ratios[mode][v]):.3f} |"
            )
    if any(costs[m][v] for m in modes for v in names):
        lines += [
            "",
            "Server cost per job (per claim in empty mode), pg_stat_statements, median of rounds:",
            "",
            "| mode | variant | statement | exec ms | buffers | dirtied | WAL records "
            "| WAL bytes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mode in modes:
            for v in names:
                tables = [c["table"] for c in costs[mode][v] if "table" in c]
                if tables:
                    hot = median([t["hot_ratio"] for t in tables])
                    mb = median([t["mb"] for t in tables])
                    lines.append(
                        f"| {mode} | {v} | table: HOT {hot:.2f} of updates, {mb:.1f} MB | | | | | |"
                    )
                for st in ("claim", "complete"):
                    per = [c[st] for c in costs[mode][v] if st in c]
                    if not per:
                        continue
                    cells = " | ".join(
                        f"{median([g[k] for g in per]):.4g}"
                        for k in ("exec_ms", "buffers", "dirtied", "wal_records", "wal_bytes")
                    )
                    lines.append(f"| {mode} | {v} | {st} | {cells} |")
    text = "\n".join(lines)
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    data: dict[str, Any] = {
        "args": vars(a) | {"out": str(a.out)},
        "figures": figures,
        "costs": costs,
    }
    (a.out / f"sqlcmp-{stamp}.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    (a.out / f"sqlcmp-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
