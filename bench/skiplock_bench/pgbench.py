"""The ceiling: pgbench running skiplock's own claim and complete statements, no Python.

The script is rendered from ``skiplock.sqlfiles.statements(schema)``, so it follows whatever
queries.sql says today.  Named parameters become pgbench variables: constants through
``\\set`` / ``-D``, and the claimed ids and tokens through ``\\gset`` into the complete.
"""

from __future__ import annotations

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

# The values of the claim's parameters; the complete takes ids and tokens from the claim.
CLAIM_CONSTANTS = {"queue": "default", "worker": "pgbench", "lease": "30"}
FROM_CLAIM = ("ids", "tokens")


def _text(stmt: sql.Composable) -> str:
    """A statement as SQL text, without its comment lines (pgbench needs none of them)."""
    lines = [ln for ln in stmt.as_string(None).splitlines() if not ln.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";")


def _to_pgbench(text: str, allowed: set[str], what: str) -> str:
    names = set(_PARAM.findall(text))
    unknown = names - allowed
    if unknown:
        raise RuntimeError(
            f"skiplock's {what} statement has parameters the pgbench script does not know: "
            f"{sorted(unknown)}; give them values in bench/skiplock_bench/pgbench.py"
        )
    return _PARAM.sub(lambda m: ":" + m.group(1), text).replace("%%", "%")


def render_script(schema: str, batch: int) -> str:
    stmts = statements(schema)
    claim = _to_pgbench(_text(stmts.claim), {*CLAIM_CONSTANTS, "limit"}, "claim")
    complete = _to_pgbench(_text(stmts.complete), set(FROM_CLAIM), "complete")
    # The claim stays verbatim inside a CTE; only its result is folded into two arrays.
    return (
        f"\\set limit {batch}\n"
        "WITH claimed AS (\n"
        f"{claim}\n"
        ")\n"
        "SELECT coalesce(array_agg(id), '{}') AS ids,\n"
        "       coalesce(array_agg(lease_token), '{}') AS tokens\n"
        "FROM claimed \\gset\n"
        f"{complete};\n"
    )


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
    dsn: str, schema: str, *, clients: int, batch: int, transactions: int, threads: int = 2
) -> PgbenchResult:
    """Claim+complete ``clients * transactions`` batches; the jobs must be enqueued already."""
    exe = find_pgbench()
    if exe is None:
        raise RuntimeError("pgbench not found (PATH or /usr/lib/postgresql/*/bin)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _done(conn, schema)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "claim_complete.sql"
        script.write_text(render_script(schema, batch), encoding="utf-8")
        cmd = [
            exe,
            "--no-vacuum",
            "--protocol=prepared",  # skiplock's driver prepares its statements too
            f"--client={clients}",
            f"--jobs={min(threads, clients)}",
            f"--transactions={transactions}",
            f"--file={script}",
        ]
        for name, value in CLAIM_CONSTANTS.items():
            cmd.append(f"--define={name}={value}")
        cmd.append(dsn)
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
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
