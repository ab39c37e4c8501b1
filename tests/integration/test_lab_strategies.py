"""Each claim strategy's shape, with contention forced by the step driver instead of hoped for."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock.lab import (
    STRATEGIES,
    ClaimContext,
    ClaimOutcome,
    StepDriver,
    claim_transaction,
    get_strategy,
    race_strategy,
    run_steps,
    seed_scratch,
)

# What session B gets when it claims 3 jobs while A holds an uncommitted claim of jobs
# 1, 2, 3 and then commits: whether B is seen waiting on A, which ids B ends up with,
# and how many serialization failures B's claim retried through.
EXPECTED = {
    "naive": {"blocked": True, "ids": [1, 2, 3], "retries": 0},
    "select-then-update": {"blocked": True, "ids": [1, 2, 3], "retries": 0},
    "for-update": {"blocked": True, "ids": [4, 5, 6], "retries": 0},
    "skip-locked": {"blocked": False, "ids": [4, 5, 6], "retries": 0},
    "serializable": {"blocked": True, "ids": [4, 5, 6], "retries": 1},
    "advisory": {"blocked": False, "ids": [4, 5, 6], "retries": 0},
    "hold-lock": {"blocked": False, "ids": [4, 5, 6], "retries": 0},
}


def test_every_strategy_is_covered() -> None:
    assert set(STRATEGIES) == set(EXPECTED)
    assert {n for n, s in STRATEGIES.items() if not s.safe} == {"naive", "select-then-update"}
    with pytest.raises(ValueError, match="choose from"):
        get_strategy("optimistic")


def _rows(admin: psycopg.Connection[Any], schema: str) -> dict[int, tuple[Any, ...]]:
    query = sql.SQL("SELECT id, status, worker, attempts FROM {}.jobs ORDER BY id").format(
        sql.Identifier(schema)
    )
    return {r[0]: r[1:] for r in admin.execute(query).fetchall()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_two_claimers_under_forced_contention(
    name: str, dsn: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    strategy = get_strategy(name)
    expected = EXPECTED[name]
    seed_scratch(dsn, schema, 10)
    with StepDriver(dsn, application_name=f"lab:{schema}") as d:
        a, b = d.session("A"), d.session("B")
        a.run(strategy.begin_sql())
        held = a.call(
            lambda c: ClaimOutcome(
                run_steps(c, strategy.steps, schema, ClaimContext("A", limit=3))
            ),
            label="claim",
        ).result()
        assert held.ids == [1, 2, 3]

        # B runs the whole claim transaction the race's workers run, retries included.
        hb = b.call(
            lambda c: claim_transaction(c, strategy, schema, ClaimContext("B", limit=3)),
            label="claim",
        )
        if expected["blocked"]:
            assert d.wait_blocked(hb) == ["A"]
            a.run("COMMIT")
            got = hb.result()
        else:
            assert d.settle(hb) == "done"
            got = hb.result()
            a.run("COMMIT")
        outcome: ClaimOutcome = got.value
        assert got.blocked is expected["blocked"]
        assert outcome.ids == expected["ids"]
        assert outcome.retries == expected["retries"]

    rows = _rows(admin, schema)
    if strategy.safe:
        # Every claimed job was claimed once: one attempt each, and B's are B's.
        assert all(rows[i][2] == 1 for i in outcome.ids)
    else:
        # The double claim is visible in the table itself: B overwrote A's claim.
        assert [rows[i][1:] for i in (1, 2, 3)] == [("B", 2)] * 3


def test_for_update_waits_show_in_pg_stat_activity(
    dsn: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    """The lock wait the race samples is the one the step driver sees."""
    strategy = get_strategy("for-update")
    claim = strategy.steps[0].render(schema)
    seed_scratch(dsn, schema, 10)
    with StepDriver(dsn, application_name=f"lab:{schema}") as d:
        a, b = d.session("A"), d.session("B")
        a.run("BEGIN")
        assert a.run(claim, ClaimContext("A", limit=3).params()).ids == [1, 2, 3]
        b.run("BEGIN")
        hb = b.start(claim, ClaimContext("B", limit=3).params())
        assert d.wait_blocked(b) == ["A"]
        assert d.is_blocked(b)
        wait = admin.execute(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (b.pid,)
        ).fetchone()
        assert wait == ("Lock", "transactionid")
        a.run("COMMIT")
        assert hb.result().ids == [4, 5, 6]
        b.run("COMMIT")
        assert [e.status for e in d.events if e.session == "B" and e.step == hb.label] == [
            "blocked",
            "returned",
        ]


def test_serializable_retry_limit_surfaces_the_error(dsn: str, schema: str) -> None:
    strategy = get_strategy("serializable")
    seed_scratch(dsn, schema, 10)
    with StepDriver(dsn, application_name=f"lab:{schema}") as d:
        a, b = d.session("A"), d.session("B")
        a.run(strategy.begin_sql())
        a.call(lambda c: run_steps(c, strategy.steps, schema, ClaimContext("A", limit=3))).result()
        hb = b.call(
            lambda c: claim_transaction(
                c, strategy, schema, ClaimContext("B", limit=3), max_retries=0
            )
        )
        d.wait_blocked(hb)
        a.run("COMMIT")
        with pytest.raises(psycopg.errors.SerializationFailure):
            hb.result()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_small_race_shape(name: str, dsn: str, schema: str) -> None:
    """Every strategy drains the queue; the safe ones never claim a job twice."""
    r = race_strategy(dsn, name, workers=4, jobs=200, batch=5, schema=schema, timeout=60)
    assert r.jobs == 200
    assert r.jobs_done == 200
    assert r.unclaimed_jobs == 0
    assert r.claims == 200 + r.double_claims
    assert r.duplicate_jobs <= r.double_claims
    assert 0.0 <= r.lock_wait_share <= 1.0
    assert r.throughput > 0
    assert r.latency_p50_ms <= r.latency_p99_ms
    if STRATEGIES[name].safe:
        assert r.double_claims == 0
        assert r.duplicate_jobs == 0
    if not STRATEGIES[name].retry_serialization:
        assert r.serialization_retries == 0


def test_hold_lock_keeps_the_transaction_open_while_working(dsn: str, schema: str) -> None:
    """A hold-lock job's work runs inside its claim transaction; others skip its rows."""
    strategy = get_strategy("hold-lock")
    seed_scratch(dsn, schema, 6)
    seen: dict[str, Any] = {}

    with StepDriver(dsn, application_name=f"lab:{schema}") as d:
        a, b = d.session("A"), d.session("B")

        def work(ids: list[int]) -> None:
            seen["in_transaction"] = a.conn.info.transaction_status.name
            # While A works, B's claim neither waits nor takes A's jobs.
            seen["b"] = b.call(
                lambda c: claim_transaction(c, strategy, schema, ClaimContext("B", limit=3))
            ).result()

        out = a.call(
            lambda c: claim_transaction(c, strategy, schema, ClaimContext("A", limit=3), work=work)
        ).result()
        assert out.value.ids == [1, 2, 3]
        assert seen["in_transaction"] == "INTRANS"
        assert seen["b"].value.ids == [4, 5, 6]
        assert not seen["b"].blocked
