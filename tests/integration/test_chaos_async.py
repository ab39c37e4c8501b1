"""Chaos with AsyncWorker processes: kills, pauses, terminated sessions and a proxy that
drops and stalls connections, with the async worker's two chains (its default)."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_async_workers_lose_nothing_and_report_no_committed_write_lost(dsn: str) -> None:
    # A chain's completion crossing the other chain's heartbeat was once reported as
    # a lost lease although it had committed (lease_lost_violations): the proxy's
    # stalls make such crossings common.
    report = short_run(
        dsn, "kill", "pause", "terminate", "proxy", async_workers=True, duration=12.0
    )
    j = assert_sound(report)
    assert j["async_workers"] is True
    assert set(j["duplicated_execution_causes"]) <= {"killed", "paused"}
