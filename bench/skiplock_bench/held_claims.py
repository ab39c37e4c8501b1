"""``python -m skiplock_bench held-claims``: where a Worker's claim time goes under a held
xmin: claims from the head against claims from the position, fused against the claim
loop's, and the index entries each reads.

``python -m skiplock_bench held-claims [--fresh S] [--held S] [--rate R] [--src SRC]
[--json F]``

A ``Worker`` of 8 (its defaults: two chains, fused claims) runs in a child process
with ``SRC`` first on its path (default: the installed skiplock), so two checkouts can
be compared.  The parent enqueues ``R`` no-op jobs a second for ``--fresh`` seconds,
then opens a REPEATABLE READ transaction that holds back xmin and goes on for
``--held`` seconds.  The child wraps ``ClaimCursor.claimed`` to record every claim:
when it landed, whether it started from the head, its round trip, its jobs, whether
the writer sent it fused with a completion, and how far its position was behind the
newest id the worker had claimed.  The parent snapshots the schema's index and heap
counters (``pg_stat_user_indexes``, ``pg_statio_user_tables``) at each phase's edges,
10 s in, so that the claims' reads can be put per claim.

Printed per phase: claims, the share and latency (p50/p99) of claims from the head and
from the position, of fused and loop claims, the position's lag, and each claimable
index's entries read per claim.  The storage bench (``skiplock_bench.storage``) gives
the issue's figures; this says which claims make them.  The DSN is
$SKIPLOCK_BENCH_DSN or the local server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .common import DEFAULT_DSN, percentile

DSN = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)

# One claim: landed (monotonic), from the head, seconds, jobs, fused, position lag in ids.
Claim = tuple[float, bool, float, int, bool, int]


def child(schema: str, out: str) -> None:
    """The worker: record every claim until SIGTERM, then write them to ``out``."""
    from skiplock import Job, Queue, Worker
    from skiplock._cursor import ClaimCursor

    records: list[Claim] = []
    newest = [0]
    claimed = ClaimCursor.claimed

    def recorded(
        self: ClaimCursor, queue: str, start: Any, jobs: Any, seconds: float, now: float
    ) -> None:
        lag = -1 if start is None else newest[0] - start[2]
        if jobs:
            newest[0] = max(newest[0], max(j.id for j in jobs))
        fused = "writer" in threading.current_thread().name
        records.append((now, start is None, seconds, len(jobs), fused, lag))
        claimed(self, queue, start, jobs, seconds, now)

    ClaimCursor.claimed = recorded  # type: ignore[method-assign]

    def handler(job: Job) -> None:
        return None

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    q = Queue(DSN, schema=schema, max_size=1)
    w = Worker(q, handler, concurrency=8, name="held-claims")
    t = w.start()
    stop.wait()
    w.stop()
    t.join(30)
    q.close()
    Path(out).write_text(json.dumps(records))


def counters(conn: psycopg.Connection[Any], schema: str) -> dict[str, float]:
    """Entries read from each claimable index, and heap blocks touched, so far."""
    rows = conn.execute(
        "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes"
        " WHERE schemaname = %s AND indexrelname LIKE '%%claimable_idx'",
        (schema,),
    ).fetchall()
    out = {str(name): float(n) for name, n in rows}
    heap = conn.execute(
        "SELECT coalesce(sum(heap_blks_hit + coalesce(heap_blks_read, 0)), 0)"
        " FROM pg_statio_user_tables WHERE schemaname = %s",
        (schema,),
    ).fetchone()
    out["heap blocks"] = float(heap[0]) if heap else 0.0
    return out


def summary(records: list[Claim], a: float, b: float) -> dict[str, Any]:
    rs = [r for r in records if a <= r[0] < b]
    ms = [r[2] * 1000 for r in rs]

    def part(sel: list[Claim]) -> dict[str, Any]:
        xs = [r[2] * 1000 for r in sel]
        return {"n": len(sel), "p50_ms": percentile(xs, 50), "p99_ms": percentile(xs, 99)}

    top = sorted(rs, key=lambda r: -r[2])[: max(1, len(rs) // 100)]
    lags = [float(r[5]) for r in rs if r[5] >= 0]
    return {
        "claims": len(rs),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "head": part([r for r in rs if r[1]]),
        "position": part([r for r in rs if not r[1]]),
        "fused": part([r for r in rs if r[4]]),
        "loop": part([r for r in rs if not r[4]]),
        "slowest_1pct_from_head": sum(1 for r in top if r[1]),
        "slowest_1pct": len(top),
        "lag_p90": percentile(lags, 90),
        "lag_max": max(lags, default=float("nan")),
    }


BENCH = Path(__file__).resolve().parent.parent  # bench/, which holds skiplock_bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/run held-claims", description=(__doc__ or "").split("\n\n")[0]
    )
    ap.add_argument("--fresh", type=float, default=60.0)
    ap.add_argument("--held", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--src", help="a checkout's src/ to import skiplock from")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args(argv)
    if args.fresh <= 11 or args.held <= 11:
        # Each phase's first 10 s are not measured (the worker settles, the hold begins).
        raise SystemExit("--fresh and --held must be over 11 seconds each")
    env = dict(os.environ)
    path = [str(Path(args.src).resolve())] if args.src else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(BENCH), env.get("PYTHONPATH", "")])
    schema = "held_claims_" + uuid.uuid4().hex[:8]
    out = f"/tmp/{schema}.json"
    admin = psycopg.connect(DSN, autocommit=True)
    # Migrated by the child's own skiplock, so each side gets its own schema version.
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from skiplock import Queue; Queue({DSN!r}, schema={schema!r}).migrate()",
        ],
        env=env,
        check=True,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "skiplock_bench.held_claims", "--child", schema, out], env=env
    )
    # Enqueued by this checkout's skiplock: the two sides must share a schema version.
    from skiplock import Queue

    q = Queue(DSN, schema=schema, max_size=1)
    time.sleep(3.0)  # the worker's start is not measured
    t0 = time.monotonic()
    edges = {"fresh": (10.0, args.fresh), "held": (args.fresh + 10.0, args.fresh + args.held)}
    snaps: dict[str, dict[str, float]] = {}
    stamps: dict[str, float] = {}
    holder: psycopg.Connection[Any] | None = None
    sent = 0
    try:
        while (now := time.monotonic() - t0) < args.fresh + args.held:
            for phase, (a, b) in edges.items():
                for tag, at in ((f"{phase}0", a), (f"{phase}1", b - 1.0)):
                    if tag not in snaps and now >= at:
                        stamps[tag] = time.monotonic()
                        snaps[tag] = counters(admin, schema)
            if holder is None and now >= args.fresh:
                holder = psycopg.connect(DSN)
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM pg_class")  # takes the snapshot
            due = int(now * args.rate) - sent
            if due > 0:
                q.enqueue_many([{"n": sent + i} for i in range(due)])
                sent += due
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if holder is not None:
            holder.rollback()
            holder.close()
        q.close()
    records: list[Claim] = [
        (float(t), bool(h), float(sec), int(n), bool(f), int(lag))
        for t, h, sec, n, f, lag in json.loads(Path(out).read_text())
    ]
    Path(out).unlink()
    result: dict[str, Any] = {"rate": args.rate, "sent": sent, "src": args.src}
    for phase in edges:
        a, b = stamps[f"{phase}0"], stamps[f"{phase}1"]
        s = summary(records, a, b)
        before, after = snaps[f"{phase}0"], snaps[f"{phase}1"]
        n = max(1, s["claims"])
        s["read_per_claim"] = {k: round((after[k] - before.get(k, 0.0)) / n, 2) for k in after}
        result[phase] = s
        h, p, f, lp = s["head"], s["position"], s["fused"], s["loop"]
        print(
            f"{phase:5s} claims {s['claims']:6d}  p50 {s['p50_ms']:.2f} p99 {s['p99_ms']:.2f} ms"
            f" | head {100 * h['n'] / n:.1f}% p50 {h['p50_ms']:.2f} p99 {h['p99_ms']:.2f}"
            f" | position p50 {p['p50_ms']:.2f} p99 {p['p99_ms']:.2f}"
            f" | fused p50 {f['p50_ms']:.2f} p99 {f['p99_ms']:.2f}"
            f" | loop p50 {lp['p50_ms']:.2f} p99 {lp['p99_ms']:.2f}"
            f" | slowest 1% from the head {s['slowest_1pct_from_head']}/{s['slowest_1pct']}"
            f" | position lag p90 {s['lag_p90']:.0f} max {s['lag_max']:.0f} ids"
        )
        reads = ", ".join(f"{k} {v:.1f}" for k, v in s["read_per_claim"].items())
        print(f"      per claim: {reads}")
    ratio = result["held"]["p99_ms"] / result["fresh"]["p99_ms"]
    print(f"claim p99 held / fresh: {ratio:.2f}")
    result["p99_held_over_fresh"] = ratio
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    admin.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
