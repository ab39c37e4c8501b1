"""What the suite asks the server: which statements run, ids, vacuum, dead tuples, backends."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from . import lib_skiplock

__all__ = [
    "StatementSampler",
    "backend_pids",
    "dead_tuples",
    "finish_leftovers",
    "hold_back_vacuum",
    "max_id",
    "requeue_running",
    "vacuum_analyze",
]


class StatementSampler:
    """Which of skiplock's statements the worker's backends are running, sampled from
    pg_stat_activity every 20 ms: where the server's time goes, by statement."""

    def __init__(self, dsn: str, schema: str) -> None:
        import threading
        from collections import Counter

        from skiplock.sqlfiles import statements

        self.dsn = dsn
        self.counts: Counter[str] = Counter()
        self.rounds = 0
        stmts = statements(schema)
        self._heads = {name: _head(getattr(stmts, name).as_string(None)) for name in stmts.names()}
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=5)

    def _name(self, query: str) -> str:
        head = _head(query)
        for name, h in self._heads.items():
            if h and head.startswith(h):
                return name
        return head[:40] or "?"

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._halt.wait(0.02):
                rows = conn.execute(
                    "SELECT query, wait_event_type FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'active' "
                    "AND application_name LIKE 'skiplock-worker:%'"
                ).fetchall()
                self.rounds += 1
                for query, wait in rows:
                    name = self._name(str(query))
                    self.counts[name + (f" (waiting: {wait})" if wait else "")] += 1


def _head(text: str) -> str:
    """A statement's first 80 characters without comments or runs of whitespace."""
    import re

    body = " ".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))
    body = re.sub(r"%\(\w+\)s|\$\d+", "?", body)  # client placeholders vs the server's
    return re.sub(r"\s+", " ", body).strip()[:80]


def max_id(dsn: str, schema: str | None) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(id), 0) FROM {}.jobs").format(
                sql.Identifier(schema or lib_skiplock.SCHEMA)
            )
        ).fetchone()
    return int(row[0]) if row else 0


def vacuum_analyze(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM (ANALYZE) {}.jobs").format(sql.Identifier(schema)))


def requeue_running(dsn: str, schema: str) -> None:
    """Jobs the claim-latency probe took go back to pending, so pgbench finishes them too."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET status = 'pending', worker = NULL, lease_token = NULL, "
                "locked_until = NULL, started_at = NULL WHERE status = 'running'"
            ).format(sql.Identifier(schema))
        )


def finish_leftovers(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            sql.SQL(
                "UPDATE {}.jobs SET status = 'done', finished_at = now(), locked_until = NULL "
                "WHERE status IN ('pending', 'running')"
            ).format(sql.Identifier(schema))
        )
        return cur.rowcount


def hold_back_vacuum(dsn: str, schema: str) -> psycopg.Connection[Any]:
    """An open REPEATABLE READ transaction with a snapshot: no row version that it might
    see can be vacuumed away until it ends."""
    conn = psycopg.connect(dsn, application_name="bench-long-transaction")
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT txid_current()")
    conn.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema)))
    return conn


def dead_tuples(dsn: str, schema: str) -> float:
    """Dead row versions in the jobs table, counted by pgstattuple (exact) if it is there."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            row = conn.execute(
                sql.SQL("SELECT dead_tuple_count FROM pgstattuple({})").format(
                    sql.Literal(f'"{schema}".jobs')
                )
            ).fetchone()
        except psycopg.Error:
            row = conn.execute(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s "
                "AND relname = 'jobs'",
                (schema,),
            ).fetchone()
    return float(row[0]) if row else float("nan")


def backend_pids(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()
    return [int(r[0]) for r in rows]


def db_clock_rate(dsn: str, schema: str | None, since: int, n: int) -> float:
    """n / (last finished_at - first started_at) of the drained jobs, server timestamps."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM max(finished_at) - min(started_at)) "
                "FROM {}.jobs WHERE id > %s AND status = 'done'"
            ).format(sql.Identifier(schema or lib_skiplock.SCHEMA)),
            (since,),
        ).fetchone()
    secs = float(row[0]) if row and row[0] is not None else 0.0
    return n / secs if secs > 0 else float("nan")
