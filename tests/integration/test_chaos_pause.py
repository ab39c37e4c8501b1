"""Chaos: a worker frozen (SIGSTOP) past its lease wakes up to LeaseLost, changing nothing."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_paused_worker_late_writes_are_rejected_as_lease_lost(dsn: str) -> None:
    # Handlers take ~50 ms so that a paused worker is caught holding jobs in hand.
    report = short_run(dsn, "pause", work_ms=50.0, min_faults=2)
    j = assert_sound(report)
    assert j["pauses"] >= 2
    # Each pause lasted until the frozen worker's jobs were swept and claimed again, so
    # its heartbeat or completion for them came back LeaseLost.
    assert j["lease_lost_rejections"] >= 1
    assert j["events"].get("lease_lost", 0) == j["lease_lost_rejections"]
    assert j["duplicated_executions"] >= 1
    assert set(j["duplicated_execution_causes"]) == {"paused"}
