"""ClaimCursor and SweepCursor: where a claim starts, how far back a sweep looks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from skiplock._cursor import ClaimCursor, SweepCursor
from skiplock._job import Job

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def job(i: int, priority: int = 0, dt: float = 0.0) -> Job:
    row: dict[str, Any] = dict.fromkeys(
        (
            "worker",
            "lease_token",
            "locked_until",
            "created_at",
            "started_at",
            "finished_at",
            "last_error",
            "idempotency_key",
        )
    )
    row |= {
        "id": i,
        "queue": "q",
        "payload": {},
        "status": "running",
        "priority": priority,
        "run_at": T0 + timedelta(seconds=dt),
        "attempts": 1,
        "max_attempts": 5,
    }
    return Job.from_row(row)


def test_first_claim_is_from_the_head_and_the_next_starts_past_it() -> None:
    c = ClaimCursor()
    assert c.start("q", 0.0) is None
    c.claimed("q", None, [job(3, dt=2), job(1), job(2, dt=1)], 0.001, 0.001)
    assert c.start("q", 0.01) == (0, T0 + timedelta(seconds=2), 3)
    assert c.start("other", 0.01) is None  # each queue on its own


def test_a_claim_from_the_head_is_due_again_after_factor_times_its_cost() -> None:
    c = ClaimCursor(floor=0.05, cap=1.0, factor=20.0)
    c.claimed("q", None, [job(1)], 0.010, 0.0)  # took 10 ms: next head claim 200 ms on
    assert c.start("q", 0.19) is not None
    assert c.start("q", 0.21) is None
    c.claimed("q", None, [job(2)], 0.001, 1.0)  # cheap: the floor
    assert c.start("q", 1.04) is not None
    assert c.start("q", 1.06) is None
    c.claimed("q", None, [job(3)], 0.5, 2.0)  # expensive: at most the cap
    assert c.start("q", 2.99) is not None
    assert c.start("q", 3.01) is None


def test_a_claim_past_the_position_does_not_push_the_head_claim_back() -> None:
    c = ClaimCursor(floor=0.05, cap=1.0, factor=20.0)
    c.claimed("q", None, [job(1)], 0.001, 0.0)
    start = c.start("q", 0.01)
    assert start is not None
    c.claimed("q", start, [job(2)], 0.001, 0.02)
    assert c.start("q", 0.06) is None


def test_an_empty_claim_keeps_the_position_and_a_head_claim_may_move_it_back() -> None:
    c = ClaimCursor()
    c.claimed("q", None, [job(5, dt=5)], 0.001, 0.0)
    start = c.start("q", 0.01)
    c.claimed("q", start, [], 0.001, 0.01)
    assert c.start("q", 0.02) == (0, T0 + timedelta(seconds=5), 5)
    # A head claim found a job before the position (say a swept lease): continue there.
    c.claimed("q", None, [job(2, priority=-1)], 0.001, 10.0)
    assert c.start("q", 10.01) == (-1, T0, 2)


def test_a_costly_claim_from_the_head_also_waits_for_rare_claims_from_the_position() -> None:
    c = ClaimCursor(floor=0.05, cap=10.0, factor=20.0, costly=4.0, costly_min=0.01, rare=5)
    c.claimed("q", None, [job(1)], 0.002, 0.0)
    for i in range(3):  # claims from the position take 2 ms
        start = c.start("q", 0.01 + i * 0.01)
        assert start is not None
        c.claimed("q", start, [job(2 + i)], 0.002, 0.01 + i * 0.01)
    # 60 ms from the head (a held xmin): by time alone due again 1.2 s later ...
    c.claimed("q", None, [job(9)], 0.060, 1.0)
    for i in range(4):
        start = c.start("q", 2.5 + i)  # ... but 5 claims from the position come first
        assert start is not None
        c.claimed("q", start, [job(10 + i)], 0.002, 2.5 + i)
    assert c.start("q", 6.0) is not None
    c.claimed("q", c.start("q", 6.0), [job(20)], 0.002, 6.0)
    assert c.start("q", 6.01) is None  # the fifth is done, and 1.2 s have passed


def test_a_costly_claim_from_the_head_is_still_due_after_the_cap() -> None:
    c = ClaimCursor(floor=0.05, cap=10.0, factor=20.0, costly=4.0, costly_min=0.01, rare=200)
    c.claimed("q", None, [job(1)], 0.002, 0.0)
    c.claimed("q", c.start("q", 0.01), [job(2)], 0.002, 0.01)
    c.claimed("q", None, [job(3)], 0.060, 1.0)
    assert c.start("q", 10.9) is not None  # a quiet queue: few claims from the position
    assert c.start("q", 11.0) is None


def test_a_claim_from_the_head_is_not_costly_if_it_costs_what_a_clean_table_does() -> None:
    c = ClaimCursor(floor=0.05, cap=10.0, factor=20.0, costly=4.0, costly_min=0.01, rare=200)
    c.claimed("q", None, [job(1)], 0.0005, 0.0)
    c.claimed("q", c.start("q", 0.01), [job(2)], 0.0005, 0.01)
    c.claimed("q", None, [job(3)], 0.005, 1.0)  # 10x a claim from the position, but 5 ms
    assert c.start("q", 1.09) is not None
    assert c.start("q", 1.11) is None  # the factor rule alone: 100 ms


def test_a_sweep_that_gave_leases_back_makes_the_next_claim_start_at_the_head() -> None:
    c = ClaimCursor(floor=0.05, cap=10.0, factor=20.0, rare=200)
    c.claimed("q", None, [job(1)], 0.002, 0.0)
    c.claimed("q", c.start("q", 0.01), [job(2)], 0.002, 0.01)
    c.claimed("q", None, [job(3)], 0.060, 1.0)
    assert c.start("q", 1.5) is not None
    c.rewind(1.5)
    assert c.start("q", 1.6) is None
    assert c.start("other", 1.6) is None
    # A claim from the head that began before the sweep ended may have missed its jobs.
    c.claimed("q", None, [], 0.2, 1.6)  # began at 1.4
    assert c.start("q", 1.7) is None
    c.claimed("q", None, [], 0.001, 1.8)  # began after: the rewind is done
    assert c.start("q", 1.81) is not None


def test_sweep_looks_all_the_way_back_first_then_only_past_the_last_sweep() -> None:
    s = SweepCursor(margin=2.0, full_every=30.0, factor=20.0)
    assert s.window(100.0) is None  # nothing swept yet: every lease in the past
    s.swept(None, start=100.0, seconds=0.1)
    assert s.window(102.5) == 2.5 + 2.0  # since the last sweep started, plus the margin
    s.swept(4.5, start=102.5, seconds=0.01)
    assert s.window(105.0) == 2.5 + 2.0
    assert s.window(130.1) is None  # a full sweep again every 30 s


def test_a_failed_sweep_moves_nothing_and_a_slow_full_sweep_comes_less_often() -> None:
    s = SweepCursor(margin=2.0, full_every=30.0, factor=20.0)
    s.swept(None, start=0.0, seconds=3.0)  # a full sweep that took 3 s
    # A sweep at 5 s failed (not recorded): the one at 10 s looks back to the last success.
    assert s.window(10.0) == 10.0 + 2.0
    assert s.window(62.9) is not None  # 3 s + 20 * 3 s: its cost stays a 20th of the time
    assert s.window(63.0) is None


def test_chains_share_one_position_so_a_dry_chain_does_not_fall_behind() -> None:
    """Two chains' cursors: one took the jobs, the other's claims found the queue dry.
    The dry one starts where the worker's latest claim ended, not where its own last
    claim did (under a held xmin, every entry between costs each claim a heap visit)."""
    a = ClaimCursor()
    b = ClaimCursor(positions=a.positions)
    a.claimed("q", None, [job(1)], 0.001, 0.0)
    b.claimed("q", None, [job(2, dt=1)], 0.001, 0.0)
    start = b.start("q", 0.01)
    assert start == (0, T0 + timedelta(seconds=1), 2)
    b.claimed("q", start, [], 0.001, 0.01)  # dry: chain a took them
    a.claimed("q", a.start("q", 0.01), [job(9, dt=9)], 0.001, 0.02)
    assert b.start("q", 0.03) == (0, T0 + timedelta(seconds=9), 9)
    # A claim from a position that lands behind the shared one (it began first) does
    # not move it back; a claim from the head that found an earlier job does.
    b.claimed("q", start, [job(3, dt=2)], 0.001, 0.03)
    assert a.positions["q"] == (0, T0 + timedelta(seconds=9), 9)
    a.claimed("q", None, [job(0, priority=-1)], 0.001, 0.04)
    assert b.start("q", 0.045) == (-1, T0, 0)
    # Each chain still times its own claims from the head: b's (at 0.0) is due again
    # after the 50 ms floor, a's (at 0.04) not yet.
    assert b.start("q", 0.06) is None
    assert a.start("q", 0.06) == (-1, T0, 0)
