"""The experiment's load: seed the claim's table, then W workers claim until no row is left."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from skiplock.lab import RaceResult, race_prepared

from ._claim import ExperimentError
from ._exp_prepare import Prepared
from ._exp_scratch import Scratch, Script, message

__all__ = ["run_load", "seed_table", "seed_text"]

_STALL = 2.0  # seconds without progress after which a worker's empty claims mean "done"


def seed_table(
    conn: psycopg.Connection[Any], prepared: Prepared, rows: int, script: Script | None
) -> int:
    """Fill the claim's table; returns how many rows it holds."""
    table = sql.SQL(prepared.table)
    with conn.transaction():
        if script is not None:
            script.run(conn, {"jobs": str(rows)})
        else:
            cols = [sql.Identifier(name) for name, _, _ in prepared.seed_values]
            exprs = [expr for _, expr, _ in prepared.seed_values]
            try:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {t} {cols} SELECT {exprs} "
                        "FROM generate_series(1, {n}) AS g ORDER BY g"
                    ).format(
                        t=table,
                        cols=sql.SQL("({})").format(sql.SQL(", ").join(cols))
                        if cols
                        else sql.SQL(""),
                        exprs=sql.SQL(", ").join(exprs),
                        n=sql.Literal(rows),
                    )
                )
            except psycopg.Error as exc:
                raise ExperimentError(
                    f"seeding {prepared.table} failed ({message(exc)}): give a --seed script"
                ) from None
    conn.execute(sql.SQL("ANALYZE {}").format(table))
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    count = int(row[0]) if row else 0
    if count == 0:
        raise ExperimentError(f"the seed left {prepared.table} empty: nothing to claim")
    return count


def seed_text(prepared: Prepared, seed: Script | None) -> list[str]:
    if seed is not None:
        return [f"{seed.path} (:jobs = the rows wanted)"]
    if not prepared.seed_values:
        return [f"INSERT INTO {prepared.table} DEFAULT VALUES, once per row"]
    out = [f"INSERT INTO {prepared.table}, g = 1..rows, every other column at its default:"]
    for name, expr, why in prepared.seed_values:
        out.append(f"  {name} = {expr.as_string(None)}  ({why})")
    return out


Pending = Callable[[psycopg.Connection[Any]], bool]


def progress_of() -> Callable[[list[int]], bool]:
    """Per worker: stop once its claims have handed back only rows it already had, for a
    while (a claim that gives a worker its own rows again, as delayed_job's does)."""
    seen: set[int] = set()
    state = {"since": time.monotonic()}

    def claimed(ids: list[int]) -> bool:
        now = time.monotonic()
        if not seen.issuperset(ids):
            seen.update(ids)
            state["since"] = now
            return True
        return now - state["since"] < _STALL

    return claimed


def pending_of(table: str, xmins: list[str]) -> Callable[[], Pending]:
    """Per worker: are seeded rows left that no claim has touched yet?

    A row a claim updated has a new xmin, one it deleted is gone: the rows still carrying
    a seed transaction's xmin are the ones no claim took.  If their number stops falling
    for a while, the claim cannot take them (they do not match it) and the worker stops.
    """
    query = sql.SQL("SELECT count(*) FROM {} WHERE xmin::text = ANY({})").format(
        sql.SQL(table), sql.Literal(xmins)
    )

    def make() -> Pending:
        state = {"left": -1, "since": time.monotonic()}

        def pending(conn: psycopg.Connection[Any]) -> bool:
            row = conn.execute(query).fetchone()
            left = int(row[0]) if row else 0
            now = time.monotonic()
            if left == 0:
                return False
            if state["left"] < 0 or left < state["left"]:
                state["left"], state["since"] = left, now
                return True
            return now - state["since"] < _STALL

        return pending

    return make


def run_load(
    scratch: Scratch,
    conn: psycopg.Connection[Any],
    prepared: Prepared,
    seed: Script | None,
    workers: int,
    jobs: int,
    timeout: float,
) -> RaceResult:
    """W workers, each with its own connection, claim until no seeded row is left."""
    rows = seed_table(conn, prepared, jobs, seed)
    xmins = conn.execute(
        sql.SQL("SELECT array_agg(DISTINCT xmin::text) FROM {}").format(sql.SQL(prepared.table))
    ).fetchone()
    return race_prepared(
        scratch.dsn,
        prepared.strategy(),
        jobs=rows,
        pending=pending_of(prepared.table, list(xmins[0] if xmins and xmins[0] else [])),
        claimed=progress_of,
        workers=workers,
        batch=prepared.limit,
        schema=scratch.name,
        application_name=f"{scratch.app}:w",
        timeout=timeout,
    )
