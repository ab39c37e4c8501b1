"""The experiment's replay: two sessions claim step by step, on the lab's step driver."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from skiplock.lab import Timeline, replay_prepared

from ._exp_load import seed_table
from ._exp_prepare import Prepared
from ._exp_scratch import Scratch, Script

__all__ = ["run_replay"]


def run_replay(
    scratch: Scratch,
    conn: psycopg.Connection[Any],
    prepared: Prepared,
    seed: Script | None,
    schedule: str,
) -> Timeline:
    """Two sessions claim step by step on freshly seeded rows (see skiplock.lab.replay)."""
    rows = seed_table(conn, prepared, max(10, 3 * prepared.limit), seed)
    return replay_prepared(
        scratch.dsn,
        prepared.strategy(),
        schema=scratch.name,
        jobs=rows,
        limit=prepared.limit,
        application_name=f"{scratch.app}:replay",
        hold=_hold(conn, prepared) if schedule == "B held" else None,
        released_at_commit=prepared.plan.read_only,
    )


def _hold(conn: psycopg.Connection[Any], prepared: Prepared) -> sql.Composed:
    """H's statement in the held schedule: a row lock on the first seeded row."""
    key = sql.Identifier(prepared.key)
    row = conn.execute(
        sql.SQL("SELECT min({}) FROM {}").format(key, sql.SQL(prepared.table))
    ).fetchone()
    first = row[0] if row else None
    return sql.SQL("SELECT {k} FROM {t} WHERE {k} = {v} FOR UPDATE").format(
        k=key, t=sql.SQL(prepared.table), v=sql.Literal(first)
    )
