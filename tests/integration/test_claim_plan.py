"""A claim reads what its batch needs, not the backlog, whatever the statistics say.

Since migration 0009 the claim reads an Append of the generations.  Estimates that make
a generation look empty (analyzed while it held nothing, or a few running jobs) and a
backlog look like one row once led the planner to read and sort every pending job for
each claim: 629 buffers for a claim of 70 from 20,000, and growing with the backlog.
Migration 0010 plans the pick with enable_sort off.  These tests stamp the statistics
the way a DBA's ANALYZE and autovacuum do, and count the buffers the pick touches
(EXPLAIN ANALYZE, rolled back): the count must not grow with the backlog.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue
from skiplock._base import QueueBase
from skiplock._sql import statements

BATCH = 70


def _claim_params(limit: int, queue: str = "default", start: Any = None) -> dict[str, Any]:
    """The claim statement's parameters, from the head or from ``start``."""
    p, r, i = start if start is not None else (None, None, None)
    params: dict[str, Any] = {"queue": queue, "limit": limit, "worker": "x", "lease": 30.0}
    return params | {"from_priority": p, "from_run_at": r, "from_id": i, "tasks": None}


def pick_buffers(
    dsn: str, schema: str, start: Any = None, limit: int = BATCH, queue: str = "default"
) -> tuple[int, str]:
    """Shared buffers the claim's pick touched, and the plan (EXPLAIN ANALYZE, each
    claim rolled back).  The pick is a PL/pgSQL function that plans its query when it
    runs, so its buffers hold that planning too: the last of three claims on one
    connection is counted, its catalogs cached by then."""
    params = _claim_params(limit, queue, start)
    with psycopg.connect(dsn) as conn:
        for _ in range(3):
            rows = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) ") + statements(schema).claim,
                params,
            ).fetchall()
            conn.rollback()
    lines = [str(r[0]) for r in rows]
    plan = "\n".join(lines)
    start_at = next(k for k, line in enumerate(lines) if line.strip() == "CTE picked")
    for line in lines[start_at + 1 :]:
        m = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", line)
        if m:
            return int(m[1]) + int(m[2] or 0), plan
    raise AssertionError(plan)


def _stamp_empty(queue: Queue, admin: psycopg.Connection[Any], schema: str) -> None:
    """A DBA's ANALYZE while every generation is empty."""
    admin.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))


def _stamp_few_running(queue: Queue, admin: psycopg.Connection[Any], schema: str) -> None:
    """Autovacuum's: the generation that took the last jobs holds five still running
    when it is analyzed; the backlog then arrives in the next generation."""
    queue.enqueue_many([{"early": i} for i in range(5)])
    assert len(queue.claim(worker="w", limit=5)) == 5
    (part,) = admin.execute(
        sql.SQL("SELECT DISTINCT part FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone() or (None,)
    admin.execute(
        sql.SQL("ANALYZE {}.{}").format(sql.Identifier(schema), sql.Identifier(f"jobs_g{part}"))
    )
    for _ in range(3):
        queue.upkeep()
    row = admin.execute(
        sql.SQL("SELECT last_value FROM {}.jobs_gen").format(sql.Identifier(schema))
    ).fetchone()
    assert row is not None and row[0] != part, "the generation did not rotate"


@pytest.mark.parametrize("stamp", [_stamp_empty, _stamp_few_running], ids=["empty", "running"])
def test_a_claim_does_not_read_the_backlog_when_estimates_say_it_is_tiny(
    queue: Queue,
    admin: psycopg.Connection[Any],
    dsn: str,
    schema: str,
    stamp: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 1)
    monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)
    stamp(queue, admin, schema)
    queue.enqueue_many([{"i": i} for i in range(2_000)])
    small, _ = pick_buffers(dsn, schema)
    queue.enqueue_many([{"i": i} for i in range(30_000)])
    large, plan = pick_buffers(dsn, schema)
    # Ordered, the pick reads about BATCH index entries and their heap rows whatever
    # the backlog; sorted, it read every pending job: 629 buffers for 20,000.
    assert large <= 1.3 * small + 20, plan
    assert large < 3 * BATCH, plan
    assert "Sort Method" not in plan


def test_the_pick_skips_locked_rows_and_honours_position_and_tasks(queue: Queue) -> None:
    """The function keeps the pick's filters: a row another transaction holds is
    skipped, the scan starts at the position, unknown tasks stay pending."""
    ids = queue.enqueue_many([{"i": i} for i in range(6)], task="known")
    queue.enqueue({"t": 1}, task="other")
    first = queue.claim(worker="a", limit=2)
    assert [j.id for j in first] == ids[:2]
    start = (first[-1].priority, first[-1].run_at, first[-1].id)
    with queue.connection() as held, held.transaction():
        held.execute(
            sql.SQL("SELECT 1 FROM {}.jobs WHERE id = %s FOR UPDATE").format(
                sql.Identifier(queue.schema)
            ),
            (ids[2],),
        )
        got = queue.claim(worker="b", limit=2, start=start, tasks=["known"])
        assert [j.id for j in got] == ids[3:5]
    rest = queue.claim(worker="c", limit=10, tasks=["known"])
    assert [j.id for j in rest] == [ids[2], ids[5]]


def _complete_plan(dsn: str, schema: str, jobs: list[Any]) -> str:
    params = {"ids": [j.id for j in jobs], "tokens": [j.lease_token for j in jobs]}
    params["results"] = [None] * len(jobs)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) ") + statements(schema).complete,
            params,
        ).fetchall()
        conn.rollback()
    return "\n".join(str(r[0]) for r in rows)


def test_upkeep_analyzes_a_generation_once_so_completions_use_the_primary_key(
    queue: Queue,
    admin: psycopg.Connection[Any],
    dsn: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never analyzed, a generation of 20,000 jobs was read whole by every completion
    (a hash join over a sequential scan, 436 buffers for 24 jobs); upkeep analyzes it
    once it has taken 1,000 ids, and completions then look their rows up by key."""
    # 20,000 ids are past ROTATE_ROWS: were the enqueue slower than ROTATE_AFTER (a
    # loaded machine), upkeep would rotate instead of analyzing.  Age never rotates here.
    monkeypatch.setattr(queue, "ROTATE_AFTER", 3600.0)
    queue.enqueue_many([{"i": i} for i in range(20_000)])
    (part,) = admin.execute(
        sql.SQL("SELECT DISTINCT part FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone() or (None,)
    steps = queue.upkeep()
    assert steps.get("analyzed") == 1, steps
    assert "analyzed" not in queue.upkeep()  # once: the statistics are there now
    jobs = queue.claim(worker="w", limit=24)
    plan = _complete_plan(dsn, schema, jobs)
    assert f"Index Scan using jobs_g{part}_pkey" in plan, plan
    assert f"Seq Scan on jobs_g{part} " not in plan, plan
    # The statistics outlive a TRUNCATE: the generation, emptied and filled again,
    # is not analyzed again and its completions still use the key.
    g = sql.Identifier(f"jobs_g{part}")
    admin.execute(sql.SQL("TRUNCATE {}.{}").format(sql.Identifier(schema), g))
    queue.enqueue_many([{"i": i} for i in range(20_000)])
    assert "analyzed" not in queue.upkeep()
    plan = _complete_plan(dsn, schema, queue.claim(worker="w", limit=24))
    assert f"Index Scan using jobs_g{part}_pkey" in plan, plan


def test_the_pick_is_planned_once_per_session_not_at_every_claim(
    queue: Queue, dsn: str, schema: str
) -> None:
    """PL/pgSQL plans the pick for each call's values (a custom plan) five times, then
    keeps doing so while the plan for any values looks dearer: the pick was planned
    anew at every claim, 21% of the server's CPU under pgbench.  Migration 0012 keeps
    one plan per session.  auto_explain shows which plan ran: a kept (generic) plan
    reads its values as parameters ($1), a custom one as constants."""
    queue.enqueue_many([{"i": i} for i in range(2_000)])
    # Upkeep analyzes the generation (0011): with statistics, a plan for an unknown
    # LIMIT looks far dearer than one for LIMIT 10, which is when PL/pgSQL kept
    # planning for each call's values.
    assert queue.upkeep().get("analyzed") == 1
    params = _claim_params(10)
    picks: list[str] = []
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute("LOAD 'auto_explain'")
        except psycopg.Error as exc:
            pytest.skip(f"this server cannot load auto_explain: {exc}")
        for name, value in [
            ("log_min_duration", "0"),
            ("log_nested_statements", "on"),
            ("log_level", "notice"),
        ]:
            conn.execute("SELECT set_config(%s, %s, false)", (f"auto_explain.{name}", value))
        conn.commit()
        # The pick's own plan, not the claim's around it.
        conn.add_notice_handler(
            lambda d: (
                picks.append(d.message_primary or "")
                if "Query Text: SELECT j.id, j.ctid" in (d.message_primary or "")
                else None
            )
        )
        for _ in range(8):
            conn.execute(statements(schema).claim, params)
            conn.rollback()
    assert len(picks) == 8, picks
    for plan in picks:
        assert "Merge Append" in plan and "Sort Method" not in plan, plan
    # Past the five custom plans PL/pgSQL always makes first, the pick must run the kept
    # plan ("queue = $1"), not one made for this call ("queue = 'default'::text").
    for plan in picks[5:]:
        assert "queue = $1" in plan, plan
