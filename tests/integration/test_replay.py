"""The two-session replay: the postmortem's psql windows, step by step, for every strategy."""

from __future__ import annotations

import json

import pytest
from psycopg import sql

from skiplock.lab import STRATEGIES, Timeline, custom_strategy, replay


def _shape(t: Timeline) -> list[tuple[str, str, str, tuple[int, ...]]]:
    return [(e.session, e.step, e.status, e.ids) for e in t.events]


def test_naive_both_sessions_hold_jobs_1_2_3(dsn: str, schema: str) -> None:
    t = replay(dsn, "naive", schema=schema)
    assert _shape(t) == [
        ("A", "BEGIN", "returned", ()),
        ("A", "claim", "returned", (1, 2, 3)),
        ("B", "BEGIN", "returned", ()),
        ("B", "claim", "blocked", ()),
        ("A", "COMMIT", "returned", ()),
        ("B", "claim", "returned", (1, 2, 3)),
        ("B", "COMMIT", "returned", ()),
    ]
    assert t.events[3].blocked_by == ("A",)
    assert t.holds == {"A": [1, 2, 3], "B": [1, 2, 3]}
    assert t.double_claimed == [1, 2, 3]
    assert t.blocked("B") and not t.blocked("A")
    text = t.format()
    assert "waiting for A" in text
    assert "DOUBLE CLAIM: both hold 1, 2, 3" in text


def test_skip_locked_disjoint_and_never_blocked(dsn: str, schema: str) -> None:
    t = replay(dsn, "skip-locked", schema=schema)
    assert _shape(t) == [
        ("A", "BEGIN", "returned", ()),
        ("A", "claim", "returned", (1, 2, 3)),
        ("B", "BEGIN", "returned", ()),
        ("B", "claim", "returned", (4, 5, 6)),
        ("A", "COMMIT", "returned", ()),
        ("B", "COMMIT", "returned", ()),
    ]
    assert t.double_claimed == []
    assert not t.blocked("B")
    assert "disjoint" in t.format()


def test_select_then_update_blocks_on_the_update_and_double_claims(dsn: str, schema: str) -> None:
    t = replay(dsn, "select-then-update", schema=schema)
    b_steps = [(e.step, e.status, e.ids) for e in t.events if e.session == "B"]
    assert b_steps == [
        ("BEGIN", "returned", ()),
        ("select", "returned", (1, 2, 3)),  # A's claim is not committed: still pending
        ("update", "blocked", ()),
        ("update", "returned", (1, 2, 3)),
        ("COMMIT", "returned", ()),
    ]
    assert t.double_claimed == [1, 2, 3]


def test_for_update_waits_then_takes_the_next_jobs(dsn: str, schema: str) -> None:
    t = replay(dsn, "for-update", schema=schema)
    assert t.blocked("B")
    assert t.holds == {"A": [1, 2, 3], "B": [4, 5, 6]}


def test_serializable_fails_then_retries(dsn: str, schema: str) -> None:
    t = replay(dsn, "serializable", schema=schema)
    assert t.events[0].step == "BEGIN"
    errors = [e for e in t.events if e.status == "error"]
    assert len(errors) == 1
    assert errors[0].session == "B"
    assert errors[0].sqlstate == "40001"
    b_steps = [(e.step, e.status) for e in t.events if e.session == "B"]
    assert b_steps == [
        ("BEGIN", "returned"),
        ("claim", "blocked"),
        ("claim", "error"),
        ("ROLLBACK", "returned"),
        ("BEGIN", "returned"),
        ("claim", "returned"),
        ("COMMIT", "returned"),
    ]
    assert t.holds == {"A": [1, 2, 3], "B": [4, 5, 6]}
    assert t.begin == "BEGIN ISOLATION LEVEL SERIALIZABLE"


@pytest.mark.parametrize("name", ["advisory", "hold-lock"])
def test_no_wait_strategies(name: str, dsn: str, schema: str) -> None:
    t = replay(dsn, name, schema=schema)
    assert not t.blocked("B")
    assert t.holds == {"A": [1, 2, 3], "B": [4, 5, 6]}


def test_hold_lock_finishes_inside_the_claim_transaction(dsn: str, schema: str) -> None:
    t = replay(dsn, "hold-lock", schema=schema)
    a_steps = [e.step for e in t.events if e.session == "A"]
    assert a_steps == ["BEGIN", "claim", "finish", "COMMIT"]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_timeline_is_json_ready(name: str, dsn: str, schema: str) -> None:
    t = replay(dsn, name, schema=schema, jobs=8, limit=2)
    doc = json.loads(json.dumps(t.to_dict()))
    assert doc["strategy"] == name
    assert doc["holds"]["A"] == [1, 2]
    assert doc["double_claimed"] == ([1, 2] if not STRATEGIES[name].safe else [])


def test_replay_of_a_raw_claim_statement(dsn: str, schema: str) -> None:
    """A user's own statement, as `skiplock audit` replays it: the postmortem's verbatim."""
    postmortem = """
        UPDATE {schema}.jobs
        SET status = 'running', started_at = now(), worker = %(worker)s,
            lease_token = gen_random_uuid(), locked_until = now() + interval '5 minutes'
        WHERE id IN (
            SELECT id FROM {schema}.jobs
            WHERE status = 'pending'
            ORDER BY id
            LIMIT %(limit)s
        )
        RETURNING id, payload
    """
    t = replay(dsn, postmortem, schema=schema)
    assert t.strategy == "custom"
    assert t.double_claimed == [1, 2, 3]
    assert t.blocked("B")

    fixed = sql.SQL(
        "WITH picked AS (SELECT id FROM {schema}.jobs WHERE status = 'pending' ORDER BY id"
        " LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
        " UPDATE {schema}.jobs j SET status = 'running', worker = %(worker)s,"
        " lease_token = gen_random_uuid(), locked_until = now() + interval '5 minutes'"
        " FROM picked WHERE j.id = picked.id RETURNING j.id"
    ).format(schema=sql.Identifier(schema))
    t2 = replay(dsn, custom_strategy(fixed, name="postmortem-fix"), schema=schema)
    assert t2.strategy == "postmortem-fix"
    assert t2.holds == {"A": [1, 2, 3], "B": [4, 5, 6]}
    assert not t2.blocked("B")


def test_unknown_strategy_name(dsn: str) -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        replay(dsn, "optimistic")
