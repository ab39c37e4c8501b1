"""Chaos with workflows: chains, diamonds and chords written through ``after=`` while
workers are killed, paused and cut off; every child runs after its parents, once
released, and none is left waiting."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_workflow_steps_run_after_their_parents_and_are_released_once_through_faults(
    dsn: str,
) -> None:
    # Handlers take ~20 ms so that kills and pauses catch workflow steps in hand.
    report = short_run(
        dsn,
        "kill",
        "pause",
        "proxy",
        workflows=True,
        workflow_rate=8.0,
        work_ms=20.0,
        min_faults=1,
    )
    j = assert_sound(report)
    wf = j["workflows"]
    assert wf is not None
    summary = {k: wf[k] for k in ("early_start_details", "stranded_waiting_details")}
    assert wf["workflows"] >= 20, wf
    assert set(wf["shapes"]) >= {"chain", "diamond", "chord"}, wf["shapes"]
    assert wf["early_starts"] == 0 and wf["early_releases"] == 0, summary
    assert wf["stranded_waiting"] == 0, summary
    assert wf["release_mismatches"] == 0, wf["release_mismatch_details"]
    assert wf["reruns_unexplained"] == 0, j["duplicated_execution_details"]
    # Every step ends as its shape says: done, or (below a failing head) cancelled; and
    # every child that ran was released by the trigger exactly once.
    assert wf["steps_done"] + j["cancelled_as_expected"] + _failed_heads(wf) == wf["steps"]
    assert wf["releases"] == wf["children"] - j["cancelled_as_expected"]
    assert wf["step_runs"] >= wf["steps_done"]
    for fault in ("kill", "pause", "proxy"):
        assert j["faults_injected"].get(fault, 0) >= 1, j["faults_injected"]


def _failed_heads(wf: dict[str, object]) -> int:
    shapes = wf["shapes"]
    assert isinstance(shapes, dict)
    return int(shapes.get("doomed", 0))
