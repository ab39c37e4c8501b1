"""RetryPolicy's defaults and schedule, as README's "Retries" table documents them."""

from __future__ import annotations

import pytest

from skiplock import RetryPolicy


def test_defaults_are_the_documented_ones() -> None:
    p = RetryPolicy()
    assert (p.base, p.factor, p.max_delay, p.jitter) == (1.0, 2.0, 600.0, 0.2)


def test_schedule_doubles_from_one_second_and_stops_at_max_delay() -> None:
    exact = RetryPolicy(jitter=0)
    assert [exact.delay(n) for n in range(1, 5)] == [1.0, 2.0, 4.0, 8.0]  # README's example
    assert exact.delay(30) == 600.0
    example = RetryPolicy(base=5, factor=3, max_delay=3600, jitter=0)
    assert [example.delay(n) for n in (1, 2, 3)] == [5.0, 15.0, 45.0]


@pytest.mark.parametrize("attempt", [1, 4, 20])
def test_jitter_stays_within_its_band(attempt: int) -> None:
    p = RetryPolicy()
    centre = RetryPolicy(jitter=0).delay(attempt)
    for _ in range(200):
        assert centre * 0.8 <= p.delay(attempt) <= centre * 1.2
