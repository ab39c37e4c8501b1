"""Chaos: pg_terminate_backend on worker and producer connections, repeatedly."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_terminated_backends_never_make_a_job_run_twice(dsn: str) -> None:
    report = short_run(dsn, "terminate", fault_interval=0.5, min_faults=5)
    j = assert_sound(report)
    assert j["faults_injected"]["terminate"] >= 5
    # A fenced write cut off with its backend is retried on a fresh connection: the job
    # neither runs again nor waits for its lease.
    assert j["duplicated_executions"] == 0, j["duplicated_execution_causes"]
    assert j["lease_lost_rejections"] == 0
