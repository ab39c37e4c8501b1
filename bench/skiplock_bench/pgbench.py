"""The ceilings: pgbench claiming and completing jobs, no Python in the loop.

Two scripts, each a claim of a batch and one completion of it:

- skiplock's own statements, rendered from ``skiplock.sqlfiles.statements(schema)``, so
  they follow whatever queries.sql says today.  Named parameters become pgbench
  variables: constants through ``\\set`` / ``-D``, and the claimed ids and tokens through
  ``\\gset`` into the complete.  The most skiplock's schema can do on this server.
- the postmortem's table and its fixed claim (``plain_*``): the plain-SQL ceiling issue 19
  measures skiplock against, since it is what PostgreSQL does for a queue with nothing
  on top (no leases, fencing, retries or history).  ``bench/run`` and ``perjob`` both run
  it from here, so the two report the same statements.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.sqlfiles import statements

from .common import find_pgbench

_PARAM = re.compile(r"%\((\w+)\)s")

# The values of the claim's parameters; the complete takes ids, tokens and results
# (none: a no-op handler's) from the claim.
CLAIM_CONSTANTS = {"queue": "default", "worker": "pgbench", "lease": "30"}
FROM_CLAIM = ("ids", "tokens", "results", "parts")
# Parameters the claim may leave NULL (its scan starts at the head of the queue).
CLAIM_NULLS = ("from_priority", "from_run_at", "from_id", "tasks")


def _text(stmt: sql.Composable | str) -> str:
    """A statement as SQL text, without its comment lines (pgbench needs none of them)."""
    text = stmt if isinstance(stmt, str) else stmt.as_string(None)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";")


def _to_pgbench(text: str, allowed: set[str], what: str) -> str:
    names = set(_PARAM.findall(text))
    unknown = names - allowed
    if unknown:
        raise RuntimeError(
            f"skiplock's {what} statement has parameters the pgbench script does not know: "
            f"{sorted(unknown)}; give them values in bench/skiplock_bench/pgbench.py"
        )
    return _PARAM.sub(
        lambda m: "NULL" if m.group(1) in CLAIM_NULLS else ":" + m.group(1), text
    ).replace("%%", "%")


def split_with(text: str) -> tuple[str | None, str]:
    """``WITH a AS (...), b AS (...) <final>`` -> ("a AS (...), b AS (...)", "<final>").

    A data-modifying CTE must sit at the top level, so a claim written as a WITH cannot
    be nested in another CTE: its own CTEs are kept at the top and only its final
    statement becomes one more CTE.  Parentheses inside quoted literals are skipped.
    """
    body = text.strip()
    if not re.match(r"(?i)with\b", body):
        return None, body
    depth, i, quote = 0, 4, ""
    last_close = -1
    while i < len(body):
        ch = body[i]
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                last_close = i
                rest = body[i + 1 :].lstrip()
                if not rest.startswith(","):
                    return body[4 : last_close + 1].strip(), rest
        i += 1
    raise ValueError("a WITH statement without a final statement")


def _claim_cte(claim: str) -> str:
    ctes, final = split_with(claim)
    head = f"WITH {ctes},\n" if ctes else "WITH "
    return f"{head}bench_claimed AS (\n{final}\n)\n"


def _fold(parts: bool) -> str:
    """Fold the claimed rows into arrays for the complete; a claim that returns one row
    with NULL columns when it took nothing (the queues LEFT JOIN) gives empty arrays.
    ``parts``: the claim returns each job's generation (``part``), as skiplock's does and
    the five-table prototype's (``proto``) does not."""
    cols = [
        "coalesce(array_agg(id) FILTER (WHERE id IS NOT NULL), '{}') AS ids",
        "coalesce(array_agg(lease_token) FILTER (WHERE id IS NOT NULL), '{}') AS tokens",
        "coalesce(array_agg(NULL::text) FILTER (WHERE id IS NOT NULL), '{}') AS results",
    ]
    if parts:
        cols.append("coalesce(array_agg(part) FILTER (WHERE id IS NOT NULL), '{}') AS parts")
    return "SELECT " + ",\n       ".join(cols) + "\nFROM bench_claimed \\gset\n"


def render_script(
    schema: str,
    batch: int,
    *,
    claim: sql.Composable | str | None = None,
    complete: sql.Composable | str | None = None,
    parts: bool = True,
) -> str:
    """One claim of ``batch`` jobs and one complete of them; ``complete=""`` claims only.

    ``claim``/``complete`` default to skiplock's statements of the day; texts given here
    (already rendered for ``schema``) let the bench compare an older or candidate SQL.
    """
    stmts = statements(schema)
    claim_sql = _to_pgbench(
        _text(stmts.claim if claim is None else claim),
        {*CLAIM_CONSTANTS, *CLAIM_NULLS, "limit"},
        "claim",
    )
    out = f"\\set limit {batch}\n" + _claim_cte(claim_sql) + _fold(parts)
    if complete != "":
        complete_sql = _to_pgbench(
            _text(stmts.complete if complete is None else complete), set(FROM_CLAIM), "complete"
        )
        out += f"{complete_sql};\n"
    return out


# The postmortem's table after its fix, and its fixed claim, as the article has them.
PLAIN_SCHEMA = """
CREATE TABLE {s}.jobs (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status       text NOT NULL DEFAULT 'pending',
    payload      jsonb NOT NULL,
    worker       text,
    started_at   timestamptz,
    locked_until timestamptz,
    attempts     int NOT NULL DEFAULT 0
);
CREATE INDEX jobs_claimable_idx ON {s}.jobs (id) WHERE status = 'pending';
"""

# Its claim, and its completion batched (the article completes one job per statement;
# the ceiling completes the batch in one, as skiplock does).  Two statements,
# each its own transaction, as the article's worker and skiplock's Worker run them.
PLAIN_SCRIPT = """\\set limit {batch}
WITH picked AS (
    SELECT id FROM {s}.jobs
    WHERE status = 'pending'
    ORDER BY id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {s}.jobs j
    SET status = 'running',
        started_at = now(),
        locked_until = now() + interval '5 minutes',
        attempts = j.attempts + 1,
        worker = :worker
    FROM picked
    WHERE j.id = picked.id
    RETURNING j.id
)
SELECT coalesce(array_agg(id), '{{}}') AS ids FROM claimed \\gset
UPDATE {s}.jobs SET status = 'done', locked_until = NULL
WHERE id = ANY(:ids::bigint[]) AND worker = :worker;
"""


def plain_setup(dsn: str, schema: str) -> None:
    """A fresh schema holding the postmortem's table, empty."""
    s = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        conn.execute(sql.SQL(PLAIN_SCHEMA).format(s=s))


def plain_enqueue(dsn: str, schema: str, n: int) -> None:
    """n pending jobs in one INSERT (the table has no COPY path of its own to measure)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.jobs (payload) "
                "SELECT jsonb_build_object('n', g) FROM generate_series(1, %s) g"
            ).format(sql.Identifier(schema)),
            (n,),
        )


def plain_script(schema: str, batch: int) -> str:
    """The plain claim of ``batch`` jobs and the completion of them, for ``run(script=)``."""
    return PLAIN_SCRIPT.format(batch=batch, s=sql.Identifier(schema).as_string(None))


@dataclass
class PgbenchResult:
    tps: float
    latency_ms: float
    transactions: int
    seconds: float
    done: int
    jobs_per_s: float
    failed: int
    output: str


def run(
    dsn: str,
    schema: str,
    *,
    clients: int,
    batch: int,
    transactions: int,
    threads: int = 2,
    script: str | None = None,
    synchronous_commit: bool = True,
) -> PgbenchResult:
    """Claim+complete ``clients * transactions`` batches; the jobs must be enqueued already.

    ``script`` replaces the rendered claim+complete; ``synchronous_commit=False`` runs the
    clients as skiplock's workers run (Worker(synchronous_commit=False), the default).
    """
    exe = find_pgbench()
    if exe is None:
        raise RuntimeError("pgbench not found (PATH or /usr/lib/postgresql/*/bin)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _done(conn, schema)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "claim_complete.sql"
        path.write_text(script or render_script(schema, batch), encoding="utf-8")
        cmd = [
            exe,
            "--no-vacuum",
            "--protocol=prepared",  # skiplock's driver prepares its statements too
            f"--client={clients}",
            f"--jobs={min(threads, clients)}",
            f"--transactions={transactions}",
            f"--file={path}",
        ]
        for name, value in CLAIM_CONSTANTS.items():
            cmd.append(f"--define={name}={value}")
        cmd.append(dsn)
        env = dict(os.environ)
        if not synchronous_commit:
            env["PGOPTIONS"] = (env.get("PGOPTIONS", "") + " -c synchronous_commit=off").strip()
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"pgbench failed ({res.returncode}):\n{out[-2000:]}")
    tps = _grab(r"tps = ([\d.]+) \(without initial connection time\)", out)
    latency = _grab(r"latency average = ([\d.]+) ms", out)
    failed = int(_grab(r"number of failed transactions: (\d+)", out, default=0.0))
    total = clients * transactions
    seconds = total / tps if tps else float("nan")
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = _done(conn, schema) - before
    return PgbenchResult(
        tps=tps,
        latency_ms=latency,
        transactions=total,
        seconds=seconds,
        done=done,
        jobs_per_s=done / seconds if seconds else float("nan"),
        failed=failed,
        output=out,
    )


def _done(conn: psycopg.Connection[tuple[Any, ...]], schema: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs WHERE status = 'done'").format(sql.Identifier(schema))
    ).fetchone()
    return int(row[0]) if row else 0


def _grab(pattern: str, text: str, default: float | None = None) -> float:
    m = re.search(pattern, text)
    if m:
        return float(m.group(1))
    if default is not None:
        return default
    raise RuntimeError(f"pgbench output lacks {pattern!r}:\n{text[-2000:]}")
