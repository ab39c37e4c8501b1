"""Chaos: worker processes SIGKILLed while they hold jobs, and replaced, under load."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_killed_workers_lose_nothing_and_their_jobs_run_again_within_a_lease(dsn: str) -> None:
    report = short_run(dsn, "kill", min_faults=3)
    j = assert_sound(report)
    assert j["kills"] >= 3
    # Every kill picked a worker holding jobs (the jobs table said so at that moment).
    recovery = j["recovery_seconds"]
    assert len(recovery) == j["kills"]
    measured = [s for s in recovery if s is not None]
    assert measured, recovery
    # Lease (2 s) plus a sweep interval (0.5 s) plus scheduling slack.
    assert max(measured) < 2.0 + 0.5 + 2.0, recovery
    # Re-runs happen, and only because of the kills.
    assert set(j["duplicated_execution_causes"]) <= {"killed"}
