"""PostgreSQL's own SKIP LOCKED isolation specs, ported as tests of skiplock's claim.

The server's ``src/test/isolation/specs/skip-locked*.spec`` run two or three sessions on
a two-row queue table in chosen orders of their steps.  Here the table is skiplock's
``jobs`` (two pending jobs, ids 1 and 2), the ``FOR UPDATE SKIP LOCKED`` step is
skiplock's real claim statement, and the step driver runs each permutation, detecting a
blocked step with ``pg_blocking_pids`` as the isolation tester does.  Where a spec lists
no permutations, every interleaving runs, checked against a small model of row locks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock._sql import parse_named, statements
from skiplock.lab import Permutation, SpecStep, StepDriver, run_permutation, seed_scratch


def interleavings(*seqs: Sequence[str]) -> Iterator[list[str]]:
    """Every merge of the sequences that keeps each one's own order."""
    live = [s for s in seqs if s]
    if not live:
        yield []
        return
    for i, s in enumerate(live):
        rest = [*live[:i], s[1:], *live[i + 1 :]]
        for tail in interleavings(*rest):
            yield [s[0], *tail]


def claim_params(session: str) -> dict[str, Any]:
    return {
        "worker": session,
        "queue": "default",
        "limit": 1,
        "lease": 30.0,
        **dict.fromkeys(("from_priority", "from_run_at", "from_id", "tasks")),  # from the head
    }


def run_spec(
    dsn: str,
    schema: str,
    steps: list[SpecStep],
    order: Sequence[str],
    begin: Sequence[str],
    setup: Callable[[], None] | None = None,
) -> Permutation:
    """Fresh data and fresh sessions per permutation, as the tester's setup/teardown."""
    seed_scratch(dsn, schema, 2)
    if setup is not None:
        setup()
    with StepDriver(dsn, application_name=f"iso:{schema}") as d:
        for name in begin:
            d.session(name).run("BEGIN")  # the spec's per-session setup block
        return run_permutation(d, steps, order)


def _table(schema: str, text: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


# -- skip-locked.spec: two claimers, two claims each, all 20 interleavings -----------------

SPEC1 = (["s1a", "s1b", "s1c"], ["s2a", "s2b", "s2c"])


def spec1_steps(schema: str) -> list[SpecStep]:
    claim = statements(schema).claim
    return [
        SpecStep("s1a", "s1", claim, claim_params("s1")),
        SpecStep("s1b", "s1", claim, claim_params("s1")),
        SpecStep("s1c", "s1", "COMMIT"),
        SpecStep("s2a", "s2", claim, claim_params("s2")),
        SpecStep("s2b", "s2", claim, claim_params("s2")),
        SpecStep("s2c", "s2", "COMMIT"),
    ]


def spec1_model(order: Sequence[str]) -> dict[str, list[int]]:
    """A claim takes the lowest job that is pending for it and not locked by the other."""
    running: set[int] = set()
    mine: dict[str, set[int]] = {"s1": set(), "s2": set()}
    out: dict[str, list[int]] = {}
    for step in order:
        s = step[:2]
        other = "s2" if s == "s1" else "s1"
        if step.endswith("c"):
            running |= mine[s]
            mine[s] = set()
            continue
        free = [j for j in (1, 2) if j not in running | mine[s] | mine[other]]
        out[step] = free[:1]
        mine[s] |= set(free[:1])
    return out


@pytest.mark.parametrize("order", list(interleavings(*SPEC1)), ids="-".join)
def test_skip_locked_spec(order: list[str], dsn: str, schema: str) -> None:
    perm = run_spec(dsn, schema, spec1_steps(schema), order, begin=["s1", "s2"])
    assert perm.blocked == []  # SKIP LOCKED never waits
    got = {name: perm.ids(name) for name in order if not name.endswith("c")}
    assert got == spec1_model(order)
    s1 = perm.ids("s1a") + perm.ids("s1b")
    s2 = perm.ids("s2a") + perm.ids("s2b")
    assert not set(s1) & set(s2)
    assert sorted(s1 + s2) == [1, 2]  # two jobs, each claimed exactly once


# -- skip-locked-2.spec: FOR SHARE locks (a multixact) against the claim -------------------

SPEC2 = (["s1a", "s1b"], ["s2a", "s2b", "s2c"])


def spec2_steps(schema: str) -> list[SpecStep]:
    share = _table(schema, "SELECT id FROM {schema}.jobs ORDER BY id FOR SHARE SKIP LOCKED LIMIT 1")
    return [
        SpecStep("s1a", "s1", share),
        SpecStep("s1b", "s1", "COMMIT"),
        SpecStep("s2a", "s2", share),
        SpecStep("s2b", "s2", statements(schema).claim, claim_params("s2")),
        SpecStep("s2c", "s2", "COMMIT"),
    ]


def spec2_model(order: Sequence[str]) -> dict[str, list[int]]:
    """Share locks coexist; the claim skips any row the other session locks at all."""
    locks: dict[int, dict[str, str]] = {1: {}, 2: {}}
    running: set[int] = set()
    mine: dict[str, set[int]] = {"s1": set(), "s2": set()}
    out: dict[str, list[int]] = {}
    for step in order:
        s = step[:2]
        other = "s2" if s == "s1" else "s1"
        if step in ("s1b", "s2c"):
            for held in locks.values():
                held.pop(s, None)
            running |= mine[s]
            mine[s] = set()
        elif step in ("s1a", "s2a"):
            got = [j for j in (1, 2) if locks[j].get(other) != "update"][:1]
            for j in got:
                locks[j].setdefault(s, "share")
            out[step] = got
        else:
            free = [j for j in (1, 2) if j not in running | mine[s] and other not in locks[j]]
            got = free[:1]
            for j in got:
                locks[j][s] = "update"
                mine[s].add(j)
            out[step] = got
    return out


@pytest.mark.parametrize("order", list(interleavings(*SPEC2)), ids="-".join)
def test_skip_locked_2_spec(order: list[str], dsn: str, schema: str) -> None:
    perm = run_spec(dsn, schema, spec2_steps(schema), order, begin=["s1", "s2"])
    assert perm.blocked == []
    got = {name: perm.ids(name) for name in ("s1a", "s2a", "s2b")}
    assert got == spec2_model(order)


@pytest.mark.parametrize(
    ("order", "claimed", "s1_shared"),
    [
        # s1 and s2 share job 1 (a multixact); s2's claim cannot take it and skips to 2.
        ("s1a s2a s2b s1b s2c", [2], [1]),
        # the same with the share locks taken in the other order.
        ("s2a s1a s2b s1b s2c", [2], [1]),
        # s2 shares then claims job 1; s1's share lock skips the claimed row.
        ("s2a s2b s1a s1b s2c", [1], [2]),
    ],
)
def test_skip_locked_2_listed_permutations(
    order: str, claimed: list[int], s1_shared: list[int], dsn: str, schema: str
) -> None:
    perm = run_spec(dsn, schema, spec2_steps(schema), order.split(), begin=["s1", "s2"])
    assert perm.ids("s2b") == claimed
    assert perm.ids("s1a") == s1_shared


# -- skip-locked-3.spec: a tuple lock held by a waiter ---------------------------------------


def test_skip_locked_3_spec(dsn: str, schema: str) -> None:
    lock_first = _table(schema, "SELECT id FROM {schema}.jobs ORDER BY id FOR UPDATE LIMIT 1")
    steps = [
        SpecStep("s1a", "s1", lock_first),
        SpecStep("s1b", "s1", "COMMIT"),
        SpecStep("s2a", "s2", lock_first),
        SpecStep("s2b", "s2", "COMMIT"),
        SpecStep("s3a", "s3", statements(schema).claim, claim_params("s3")),
        SpecStep("s3b", "s3", "COMMIT"),
    ]
    order = ["s1a", "s2a", "s3a", "s1b", "s2b", "s3b"]
    perm = run_spec(dsn, schema, steps, order, begin=["s1", "s2", "s3"])
    # s1 holds job 1's row lock; s2 waits for it holding the tuple lock; the claim in s3
    # cannot get either and skips to job 2 instead of queueing behind them.
    assert perm.blocked == ["s2a"]
    assert perm.waiting_after["s3a"] == ["s2a"]
    assert perm.ids("s3a") == [2]
    assert perm.waiting_after["s1b"] == []
    assert perm.ids("s2a") == [1]
    assert perm.results["s2a"].blocked


# -- skip-locked-4.spec: a row updated after the claim's snapshot, then locked ---------------


def _hooked(text: str, schema: str) -> sql.Composed:
    """The claim with a wait injected after its snapshot is taken, as River injects hooks.

    The candidate scan calls ``pg_advisory_lock`` on each row it considers, so the claim
    stops mid-scan, holding a snapshot in which job 1 is still the old row version.
    """
    anchor = "WHERE status = 'pending'"
    assert text.count(anchor) == 1
    hooked = text.replace(anchor, anchor + " AND pg_advisory_lock(%(hook)s::bigint) IS NOT NULL")
    return sql.SQL(hooked).format(schema=sql.Identifier(schema))


def _hook_the_pick(dsn: str, schema: str, hook: int) -> None:
    """The same wait injected into skiplock's claim, whose candidate scan is the function
    ``claimable`` (migration 0010): its definition as the server holds it, replaced by
    one that calls ``pg_advisory_lock`` on each row it considers.  The claim statement
    that calls it is the real one, unchanged."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        sig = sql.SQL("{}.claimable(text, bigint, integer, timestamptz, bigint, text[])").format(
            sql.Identifier(schema)
        )
        row = conn.execute(
            sql.SQL("SELECT pg_get_functiondef({}::regprocedure)").format(
                sql.Literal(sig.as_string(conn))
            )
        ).fetchone()
        assert row is not None
        text = str(row[0])
        anchor = "WHERE j.status = 'pending'"
        assert text.count(anchor) == 1
        before, after = text.split(anchor)
        hooked = sql.SQL("").join(
            [
                sql.SQL(before + anchor + " AND pg_advisory_lock("),
                sql.Literal(hook),
                sql.SQL("::bigint) IS NOT NULL" + after),
            ]
        )
        conn.execute(hooked)


def _lab_for_update_text() -> str:
    lab = resources.files("skiplock.lab").joinpath("sql", "strategies.sql").read_text("utf-8")
    return parse_named(lab)["for_update_claim"]


def spec4_steps(schema: str, claim: sql.Composed, hook: int) -> list[SpecStep]:
    touch = _table(schema, "UPDATE {schema}.jobs SET payload = payload WHERE id = 1")
    return [
        SpecStep("s1a", "s1", claim, {**claim_params("s1"), "hook": hook}),
        SpecStep("s1b", "s1", "COMMIT"),
        SpecStep("s2a", "s2", "SELECT pg_advisory_lock(%(hook)s::bigint)", {"hook": hook}),
        SpecStep("s2b", "s2", touch),
        SpecStep("s2c", "s2", "BEGIN"),
        SpecStep("s2d", "s2", touch),
        SpecStep("s2e", "s2", "SELECT pg_advisory_unlock(%(hook)s::bigint)", {"hook": hook}),
        SpecStep("s2f", "s2", "COMMIT"),
    ]


def test_skip_locked_4_spec(dsn: str, schema: str) -> None:
    hook = random.getrandbits(62)
    steps = spec4_steps(schema, statements(schema).claim, hook)
    order = ["s2a", "s1a", "s2b", "s2c", "s2d", "s2e", "s1b", "s2f"]
    perm = run_spec(
        dsn, schema, steps, order, begin=["s1"], setup=lambda: _hook_the_pick(dsn, schema, hook)
    )
    assert perm.blocked == ["s1a"]  # on the hook, by s2
    assert perm.waiting_after["s2d"] == ["s1a"]
    # Released, the claim follows job 1's update chain to a version s2 holds locked,
    # skips it instead of waiting, and takes job 2, before s2 commits.
    assert perm.waiting_after["s2e"] == []
    assert perm.ids("s1a") == [2]


def test_skip_locked_4_control_plain_for_update_waits(dsn: str, schema: str) -> None:
    """The same permutation with the lab's plain FOR UPDATE claim: it must wait for s2."""
    hook = random.getrandbits(62)
    steps = spec4_steps(schema, _hooked(_lab_for_update_text(), schema), hook)
    order = ["s2a", "s1a", "s2b", "s2c", "s2d", "s2e", "s2f", "s1b"]
    perm = run_spec(dsn, schema, steps, order, begin=["s1"])
    assert perm.waiting_after["s2e"] == ["s1a"]  # now waiting on s2's row lock
    assert perm.waiting_after["s2f"] == []
    assert perm.ids("s1a") == [1]  # job 1 is still pending once s2 commits
