"""``python -m skiplock_bench trigger-cost``: the per-row cost of migration 0016's status trigger.

``python -m skiplock_bench trigger-cost N ROUNDS``: that cost server-side, on its own.
Two identical partitioned tables of N rows, one with an ``AFTER UPDATE OF status`` row
trigger whose ``WHEN`` clause is 0016's (``NEW.has_children`` false on every row, so it
never fires), one without.  Each round refills both and updates every row twice
(pending -> running -> done, as a claim and a completion do), the two tables taking
turns going first; it prints the µs per row update of each (medians) and the ratio per
round.  The DSN is $SKIPLOCK_BENCH_DSN or the local server; the tables are in a schema
of their own, ``trigger_cost_<hex>``, dropped after.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

import psycopg
from psycopg import sql

from .common import DEFAULT_DSN


def q(text: str, schema: str, table: str, **parts: sql.Composable) -> sql.Composed:
    """``text`` with {t} the table and {p} its partition, quoted by psycopg.sql."""
    return sql.SQL(text).format(
        t=sql.Identifier(schema, table),
        p=sql.Identifier(schema, f"{table}_1"),
        **parts,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit(__doc__)
    n, rounds = (int(a) for a in args)
    if n < 1 or rounds < 1:
        raise SystemExit("trigger-cost: N >= 1, ROUNDS >= 1")
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
    schema = f"trigger_cost_{uuid.uuid4().hex[:8]}"
    s = sql.Identifier(schema)
    tables = ("with_trigger", "without")
    with psycopg.connect(dsn, autocommit=True) as c:
        try:
            c.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            for t in tables:
                c.execute(
                    q(
                        "CREATE TABLE {t} (id bigint, part int, status text, "
                        "has_children bool NOT NULL DEFAULT false, locked_until timestamptz, "
                        "pad text, PRIMARY KEY (id, part)) PARTITION BY LIST (part)",
                        schema,
                        t,
                    )
                )
                c.execute(
                    q(
                        "CREATE TABLE {p} PARTITION OF {t} FOR VALUES IN (1) "
                        "WITH (fillfactor = 80)",
                        schema,
                        t,
                    )
                )
                c.execute(q("CREATE INDEX ON {t} (id) WHERE status = 'pending'", schema, t))
            c.execute(
                sql.SQL(
                    "CREATE FUNCTION {}.f() RETURNS trigger LANGUAGE plpgsql "
                    "AS $$ BEGIN RETURN NULL; END $$"
                ).format(s)
            )
            c.execute(
                sql.SQL(
                    "CREATE TRIGGER tr AFTER UPDATE OF status ON {} "
                    "FOR EACH ROW WHEN (NEW.has_children "
                    "AND NEW.status IN ('done', 'failed', 'cancelled') "
                    "AND OLD.status NOT IN ('done', 'failed', 'cancelled')) "
                    "EXECUTE FUNCTION {}.f()"
                ).format(sql.Identifier(schema, "with_trigger"), s)
            )
            per_row: dict[str, list[float]] = {t: [] for t in tables}
            for r in range(rounds):
                for t in tables if r % 2 == 0 else tables[::-1]:
                    c.execute(q("TRUNCATE {t}", schema, t))
                    c.execute(
                        q(
                            "INSERT INTO {t} SELECT g, 1, 'pending', false, NULL, "
                            "repeat('x', 150) FROM generate_series(1, {n}) AS g",
                            schema,
                            t,
                            n=sql.Literal(n),
                        )
                    )
                    c.execute(q("VACUUM ANALYZE {t}", schema, t))
                    start = time.perf_counter()
                    c.execute(
                        q(
                            "UPDATE {t} SET status = 'running', locked_until = now() "
                            "WHERE status = 'pending'",
                            schema,
                            t,
                        )
                    )
                    c.execute(q("UPDATE {t} SET status = 'done', locked_until = NULL", schema, t))
                    per_row[t].append((time.perf_counter() - start) / n / 2 * 1e6)
        finally:
            c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    for t, times in per_row.items():
        print(f"{t}: {statistics.median(times):.2f} µs a row update (median of {rounds})")
    ratios = [a / b for a, b in zip(per_row["with_trigger"], per_row["without"], strict=True)]
    print("with / without per round:", ", ".join(f"{x:.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
