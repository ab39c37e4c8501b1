"""The pytest plugin users get (skiplock.testing), run on a user's test file by pytester."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import pathlib
from skiplock import Fail, Retry
from skiplock.testing import run_pending

SEEN = []

def send(job):
    SEEN.append((job.payload["n"], job.attempts))
    kind = job.payload["kind"]
    if kind == "fail":
        raise Fail("no such customer")
    if kind == "retry_once" and job.attempts == 1:
        raise Retry(0)
    if kind == "crash":
        raise RuntimeError("provider down")
    if kind == "later":
        raise Retry(3600)

def test_outcomes(skiplock_queue):
    q = skiplock_queue
    ok = q.enqueue({"n": 1, "kind": "ok"}, queue="emails")
    bad = q.enqueue({"n": 2, "kind": "fail"}, queue="emails")
    again = q.enqueue({"n": 3, "kind": "retry_once"}, queue="emails")
    dead = q.enqueue({"n": 4, "kind": "crash"}, queue="emails", max_attempts=1)
    later = q.enqueue({"n": 5, "kind": "later"}, queue="emails")
    r = run_pending(send, queue=q)
    assert r.statuses == {ok: "done", bad: "failed", again: "done", dead: "failed",
                          later: "pending"}
    assert (r.completed, r.failed, r.retried, r.lease_lost) == (2, 2, 2, 0)
    assert "RuntimeError: provider down" in r.errors[dead]
    assert q.get(later).attempts == 1 and q.get(later).status == "pending"
    assert (3, 2) in SEEN
    # Nothing due is left: a second call runs nothing.
    assert run_pending(send, queue=q).ran == 0
    pathlib.Path("schema.txt").write_text(q.schema)

def test_fresh_schema_per_test(skiplock_queue):
    assert skiplock_queue.status() == []

def test_mapping_and_queue_filter(skiplock_queue):
    q = skiplock_queue
    q.enqueue({"n": 1, "kind": "ok"}, queue="a")
    q.enqueue({"n": 2, "kind": "ok"}, queue="b")
    r = run_pending({"a": send}, queue=q)
    assert r.completed == 1
    assert {row["queue"]: row["status"] for row in q.status()} == {"a": "done", "b": "pending"}
"""


def test_user_test_file_runs_against_a_real_queue(
    pytester: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKIPLOCK_TEST_DSN", dsn)
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    schema = (Path(pytester.path) / "schema.txt").read_text()
    assert schema.startswith("skiplock_test_")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row: Any = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)
        ).fetchone()
    assert row[0] == 0, "the fixture's schema was not dropped"


def test_a_failing_user_test_fails(
    pytester: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_pending reports what happened; a handler bug shows up in the user's test."""
    monkeypatch.setenv("SKIPLOCK_TEST_DSN", dsn)
    pytester.makepyfile(
        test_user="""
from skiplock.testing import run_pending

def handler(job):
    raise KeyError("invoice")

def test_it(skiplock_queue):
    skiplock_queue.enqueue({"invoice": 7})
    assert run_pending(handler, queue=skiplock_queue).completed == 1
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
