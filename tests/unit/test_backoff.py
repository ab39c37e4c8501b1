"""Retry delays stay bounded however long an outage lasts.

The worker's loops count consecutive failures for as long as the server is away; the
delay was ``base * 2 ** (failures - 1)``, which raises OverflowError from about 1,025
failures on (a float times 2 ** 1024).  A worker whose server was down for about three
minutes lost its listener thread to it, and its claim lane would have raised it into
the claim loop.
"""

from __future__ import annotations

import pytest

from skiplock._base import QueueSettings, backoff
from skiplock._lane import Lane


@pytest.mark.parametrize("attempt", [0, 1, 2, 10, 1_024, 1_025, 1_100, 10**6])
def test_backoff_is_bounded_by_its_cap(attempt: int) -> None:
    for _ in range(20):
        assert 0.0 <= backoff(attempt, base=0.025, cap=0.25) <= 0.25


def test_backoff_still_grows_from_its_base() -> None:
    assert max(backoff(1, base=0.01, cap=10.0) for _ in range(200)) <= 0.01
    assert max(backoff(4, base=0.01, cap=10.0) for _ in range(200)) > 0.01


@pytest.mark.parametrize("failures", [1, 2, 1_025, 1_100, 10**6])
def test_lane_delay_is_bounded_by_its_cap(failures: int) -> None:
    lane = Lane(QueueSettings(dsn="postgresql://nowhere/x"), "test", cap=0.25)
    for _ in range(20):
        assert 0.0 <= lane.delay(failures) <= 0.25
