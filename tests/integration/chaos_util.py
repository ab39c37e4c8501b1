"""What every chaos test asserts of a run, and a short run's settings."""

from __future__ import annotations

from typing import Any

from skiplock.chaos import ChaosConfig, ChaosReport, run_chaos


def short_run(dsn: str | None, *faults: str, **overrides: Any) -> ChaosReport:
    """A run of a few seconds: 3 workers, 60 jobs/s, faults about every second."""
    settings: dict[str, Any] = {
        "dsn": dsn,
        "faults": faults,
        "duration": 8.0,
        "workers": 3,
        "rate": 60.0,
        "fault_interval": 1.0,
        "min_faults": 2,
        "seed": 7,
        "drain_timeout": 60.0,
    }
    settings.update(overrides)
    return run_chaos(ChaosConfig(**settings))


def assert_sound(report: ChaosReport) -> dict[str, Any]:
    """Nothing lost, nothing unexpected, nothing completed twice, no crash, drained."""
    j = report.to_json()
    keys = ("problems", "faults_injected", "duplicated_execution_causes")
    summary = {k: j[k] for k in keys}
    # Which worker ran a job again after which: a failure in CI says what to look for.
    summary["duplicated_execution_details"] = j["duplicated_execution_details"][:5]
    assert j["enqueued"] > 0 and j["completed"] > 0, summary
    assert j["lost"] == 0, j["lost_jobs"]
    assert j["unexpected"] == 0, j["unexpected_values"]
    assert j["duplicated_completions"] == 0, j["duplicated_completion_details"]
    assert j["lease_lost_violations"] == 0, summary
    assert j["worker_exits"] == 0 and j["drained"], summary
    assert report.valid, summary
    return j
