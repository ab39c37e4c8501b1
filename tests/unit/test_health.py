"""The pure parts of the health endpoints: which steps count as stuck, and the schema's
reason (the endpoints themselves: tests/integration/test_health.py)."""

from __future__ import annotations

import time

from skiplock._health import Steps, schema_problem
from skiplock._sql import migrations


def test_only_a_step_in_progress_past_the_bound_is_stuck() -> None:
    steps = Steps(["claim loop", "writer", "heartbeat"])
    now = time.monotonic()
    assert steps.stuck(now + 1000, 1.0) == {}  # nothing in a step: idle, however long
    steps.begin("claim loop")
    with steps.step("writer"):
        assert steps.stuck(time.monotonic(), 1.0) == {}
        stuck = steps.stuck(time.monotonic() + 5, 1.0)
        assert set(stuck) == {"claim loop", "writer"} and all(v > 4.9 for v in stuck.values())
    assert set(steps.stuck(time.monotonic() + 5, 1.0)) == {"claim loop"}
    steps.end("claim loop")
    assert steps.stuck(time.monotonic() + 5, 1.0) == {}


def test_the_schema_reason_names_what_is_missing() -> None:
    known = {m.version for m in migrations()}
    newest = max(known)
    assert schema_problem("s", known) is None
    assert schema_problem("s", known | {newest + 1}) is None  # newer: a rolling deploy
    assert schema_problem("s", set()) == "schema 's' has no skiplock tables: run skiplock migrate"
    assert schema_problem("s", known - {3, newest}) == (
        f"schema 's' lacks migration(s) 3, {newest} (this skiplock needs {newest}): "
        "run skiplock migrate"
    )
