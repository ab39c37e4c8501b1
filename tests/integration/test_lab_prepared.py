"""The lab on tables it did not seed itself, as ``skiplock audit`` drives it: a key column of
another name, the "B held" replay schedule, and the race over caller-seeded rows."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from skiplock.lab import (
    ClaimStep,
    Strategy,
    custom_strategy,
    race_prepared,
    replay_prepared,
    seed_scratch,
)

# The postmortem's claim on skiplock's own table (whose CHECK wants a lease on running jobs).
NAIVE = """
    UPDATE {schema}.jobs
    SET status = 'running', worker = %(worker)s, lease_token = gen_random_uuid(),
        locked_until = now() + interval '5 minutes'
    WHERE id IN (
        SELECT id FROM {schema}.jobs WHERE status = 'pending' ORDER BY id LIMIT %(limit)s
    )
"""

# advisory_on_target.sql of the audit corpus: the advisory lock keeps B off A's rows while
# A is open, so B never waits for A; the race needs A to commit while B's statement runs.
ADVISORY_ON_TARGET = NAIVE + " AND pg_try_advisory_xact_lock(id) RETURNING id"

SKIP_LOCKED = """
    WITH picked AS (
        SELECT id FROM {schema}.jobs WHERE status = 'pending' ORDER BY id
        LIMIT %(limit)s FOR UPDATE SKIP LOCKED
    )
    UPDATE {schema}.jobs AS j
    SET status = 'running', worker = %(worker)s, lease_token = gen_random_uuid(),
        locked_until = now() + interval '5 minutes'
    FROM picked WHERE j.id = picked.id
    RETURNING j.id
"""


def _render(template: str) -> Any:
    return lambda schema: sql.SQL(template).format(schema=sql.Identifier(schema))


def _hold(schema: str) -> sql.Composed:
    return sql.SQL("SELECT id FROM {}.jobs WHERE id = 1 FOR UPDATE").format(sql.Identifier(schema))


def test_a_key_column_of_another_name(dsn: str, schema: str) -> None:
    seed_scratch(dsn, schema, 10)
    returning = NAIVE + " RETURNING payload, id AS job_key"
    named = Strategy(
        "naive-aliased", "", (ClaimStep("claim", _render(returning), id_column="job_key"),)
    )
    t = replay_prepared(dsn, named, schema=schema, jobs=10, application_name=f"t:{schema}")
    assert t.holds == {"A": [1, 2, 3], "B": [1, 2, 3]}
    assert [e.ids for e in t.events if e.step == "claim" and e.status == "returned"] == [
        (1, 2, 3),
        (1, 2, 3),
    ]
    # Without it the first column (payload, not an integer) is read: no ids at all.
    seed_scratch(dsn, schema, 10)
    plain = Strategy("naive-aliased", "", (ClaimStep("claim", _render(returning)),))
    t2 = replay_prepared(dsn, plain, schema=schema, jobs=10, application_name=f"t:{schema}")
    assert t2.holds == {"A": [], "B": []}


def test_held_schedule_shows_a_race_in_which_b_never_waits_for_a(dsn: str, schema: str) -> None:
    claim = custom_strategy(ADVISORY_ON_TARGET, name="advisory-on-target")
    seed_scratch(dsn, schema, 10)
    first = replay_prepared(dsn, claim, schema=schema, jobs=10, application_name=f"t:{schema}")
    assert first.schedule == "A first"
    assert first.holds == {"A": [1, 2, 3], "B": []}  # B skips A's advisory locks
    assert not first.blocked("B")

    seed_scratch(dsn, schema, 10)
    held = replay_prepared(
        dsn, claim, schema=schema, jobs=10, hold=_hold(schema), application_name=f"t:{schema}"
    )
    assert held.schedule == "B held"
    assert [(e.session, e.step, e.status, e.ids) for e in held.events] == [
        ("H", "BEGIN", "returned", ()),
        ("H", "hold", "returned", (1,)),
        ("B", "BEGIN", "returned", ()),
        ("B", "claim", "blocked", ()),  # B took its snapshot and the advisory lock on 1
        ("A", "BEGIN", "returned", ()),
        ("A", "claim", "returned", (2, 3)),  # A skips 1, whose advisory lock B holds
        ("A", "COMMIT", "returned", ()),
        ("H", "COMMIT", "returned", ()),
        ("B", "claim", "returned", (1, 2, 3)),  # 2 and 3 re-checked after A's commit
        ("B", "COMMIT", "returned", ()),
    ]
    assert held.events[3].blocked_by == ("H",)
    assert held.double_claimed == [2, 3]
    text = held.format()
    assert "schedule: H row-locks one job" in text
    assert "B waited for H" in text
    assert held.to_dict()["schedule"] == "B held"


def test_held_schedule_with_skip_locked_stays_disjoint(dsn: str, schema: str) -> None:
    seed_scratch(dsn, schema, 10)
    claim = custom_strategy(SKIP_LOCKED, name="skip-locked-custom")
    t = replay_prepared(
        dsn, claim, schema=schema, jobs=10, hold=_hold(schema), application_name=f"t:{schema}"
    )
    assert not t.blocked("B")
    assert t.holds["B"] == [2, 3, 4]  # job 1 is H's: skipped, not waited for
    assert t.double_claimed == []


def test_race_prepared_on_rows_the_caller_seeded(dsn: str, schema: str) -> None:
    seed_scratch(dsn, schema, 300)
    pending = sql.SQL("SELECT EXISTS (SELECT FROM {}.jobs WHERE status = 'pending')").format(
        sql.Identifier(schema)
    )

    def make() -> Any:
        def check(conn: psycopg.Connection[Any]) -> bool:
            row = conn.execute(pending).fetchone()
            return bool(row and row[0])

        return check

    r = race_prepared(
        dsn,
        custom_strategy(SKIP_LOCKED, name="mine"),
        jobs=300,
        pending=make,
        workers=4,
        batch=7,
        schema=schema,
        application_name=f"t:{schema}:",
        timeout=60,
    )
    assert r.strategy == "mine"
    assert (r.claims, r.double_claims, r.duplicate_jobs, r.unclaimed_jobs) == (300, 0, 0, 0)
    assert r.jobs_done == 300  # claimed at least once: nothing is completed here
    assert r.duplicate_ids == [] and r.reclaims == 0
    assert r.to_dict()["batch"] == 7


def test_a_claim_that_writes_nothing_holds_rows_only_until_commit(dsn: str, schema: str) -> None:
    # orders_claim.sql's shape: a plain SELECT ... FOR UPDATE.  B waits for A's row locks
    # and gets the same rows once A's COMMIT releases them: one after the other, not both.
    claim = custom_strategy(
        "SELECT id FROM {schema}.jobs WHERE status = 'pending' ORDER BY id "
        "LIMIT %(limit)s FOR UPDATE",
        name="select-for-update",
    )
    seed_scratch(dsn, schema, 10)
    t = replay_prepared(
        dsn, claim, schema=schema, jobs=10, released_at_commit=True, application_name=f"t:{schema}"
    )
    assert t.holds == {"A": [1, 2, 3], "B": [1, 2, 3]}
    assert t.blocked("B")
    assert t.double_claimed == []
    assert "not held at the same time" in t.format()
    seed_scratch(dsn, schema, 10)
    t2 = replay_prepared(dsn, claim, schema=schema, jobs=10, application_name=f"t:{schema}")
    assert t2.double_claimed == [1, 2, 3]  # a claim that writes would have raced


def test_race_prepared_tells_re_claims_from_double_claims(dsn: str, schema: str) -> None:
    # A claim that never takes rows out of reach: every claim of every worker returns
    # jobs 1, 2, 3.  Each worker stops after five claims (its `claimed` check).
    seed_scratch(dsn, schema, 10)
    touch = custom_strategy(
        "UPDATE {schema}.jobs SET attempts = attempts + 1 WHERE id IN ("
        " SELECT id FROM {schema}.jobs WHERE status = 'pending' ORDER BY id LIMIT %(limit)s)"
        " RETURNING id",
        name="touch",
    )

    def five() -> Any:
        calls = [0]

        def claimed(ids: list[int]) -> bool:
            calls[0] += 1
            return calls[0] < 5

        return claimed

    r = race_prepared(
        dsn,
        touch,
        jobs=10,
        pending=lambda: lambda _conn: False,
        claimed=five,
        workers=2,
        batch=3,
        schema=schema,
        application_name=f"t:{schema}:",
        timeout=60,
    )
    assert r.claims == 2 * 5 * 3
    assert r.reclaims == 2 * 4 * 3  # a worker's own rows again: not double claims
    assert (r.double_claims, r.duplicate_jobs, r.duplicate_ids) == (3, 3, [1, 2, 3])
