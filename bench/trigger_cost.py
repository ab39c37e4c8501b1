"""The per-row cost of migration 0016's status trigger, server-side, on its own.

``python bench/trigger_cost.py N ROUNDS``: two identical partitioned tables of N rows,
one with an ``AFTER UPDATE OF status`` row trigger whose ``WHEN`` clause is 0016's
(``NEW.has_children`` false on every row, so it never fires), one without.  Each round
refills both and updates every row twice (pending -> running -> done, as a claim and a
completion do), the two tables taking turns going first; it prints the µs per row
update of each (medians) and the ratio per round.  The DSN is $SKIPLOCK_BENCH_DSN or
the local server; its schema `trigger_cost` is dropped after.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import psycopg
from psycopg import sql


def q(text: str, table: str, **parts: sql.Composable) -> sql.Composed:
    """``text`` with {t} the table and {p} its partition, quoted by psycopg.sql."""
    return sql.SQL(text).format(
        t=sql.Identifier("trigger_cost", table),
        p=sql.Identifier("trigger_cost", f"{table}_1"),
        **parts,
    )


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    dsn = os.environ.get("SKIPLOCK_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    tables = ("with_trigger", "without")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA IF EXISTS trigger_cost CASCADE")
        c.execute("CREATE SCHEMA trigger_cost")
        for t in tables:
            c.execute(
                q(
                    "CREATE TABLE {t} (id bigint, part int, status text, "
                    "has_children bool NOT NULL DEFAULT false, locked_until timestamptz, "
                    "pad text, PRIMARY KEY (id, part)) PARTITION BY LIST (part)",
                    t,
                )
            )
            c.execute(
                q("CREATE TABLE {p} PARTITION OF {t} FOR VALUES IN (1) WITH (fillfactor = 80)", t)
            )
            c.execute(q("CREATE INDEX ON {t} (id) WHERE status = 'pending'", t))
        c.execute(
            "CREATE FUNCTION trigger_cost.f() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN RETURN NULL; END $$"
        )
        c.execute(
            "CREATE TRIGGER tr AFTER UPDATE OF status ON trigger_cost.with_trigger "
            "FOR EACH ROW WHEN (NEW.has_children "
            "AND NEW.status IN ('done', 'failed', 'cancelled') "
            "AND OLD.status NOT IN ('done', 'failed', 'cancelled')) "
            "EXECUTE FUNCTION trigger_cost.f()"
        )
        per_row: dict[str, list[float]] = {t: [] for t in tables}
        for r in range(rounds):
            for t in tables if r % 2 == 0 else tables[::-1]:
                c.execute(q("TRUNCATE {t}", t))
                c.execute(
                    q(
                        "INSERT INTO {t} SELECT g, 1, 'pending', false, NULL, "
                        "repeat('x', 150) FROM generate_series(1, {n}) AS g",
                        t,
                        n=sql.Literal(n),
                    )
                )
                c.execute(q("VACUUM ANALYZE {t}", t))
                start = time.perf_counter()
                c.execute(
                    q(
                        "UPDATE {t} SET status = 'running', locked_until = now() "
                        "WHERE status = 'pending'",
                        t,
                    )
                )
                c.execute(q("UPDATE {t} SET status = 'done', locked_until = NULL", t))
                per_row[t].append((time.perf_counter() - start) / n / 2 * 1e6)
        for t, times in per_row.items():
            print(f"{t}: {statistics.median(times):.2f} µs a row update (median of {rounds})")
        ratios = [a / b for a, b in zip(per_row["with_trigger"], per_row["without"], strict=True)]
        print("with / without per round:", ", ".join(f"{x:.2f}" for x in ratios))
        c.execute("DROP SCHEMA trigger_cost CASCADE")


if __name__ == "__main__":
    main()
