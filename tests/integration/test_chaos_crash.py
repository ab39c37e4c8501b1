"""Chaos: the server crashed under load (immediate shutdown, SIGKILL of the postmaster).

On a scratch cluster the test starts itself.  With the default synchronous commit a
crash takes back nothing a worker was told had committed; with asynchronous commit it
may take back completions, and the checker counts those re-runs apart from double
completions (which stay at zero either way: the database holds one finish per job).
"""

from __future__ import annotations

import pytest

from skiplock.chaos import ScratchCluster

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_both_kinds_of_crash_bring_the_server_back() -> None:
    import psycopg

    with ScratchCluster() as cluster:
        with psycopg.connect(cluster.dsn, autocommit=True) as c:
            c.execute("CREATE TABLE t (x int)")
            c.execute("INSERT INTO t VALUES (1)")
        for how in ("immediate", "sigkill"):
            assert cluster.crash(how) < 30
            with psycopg.connect(cluster.dsn) as c:
                # Crash recovery ran: the committed row is there.
                assert c.execute("SELECT count(*) FROM t").fetchone() == (1,)
        with pytest.raises(ValueError, match="unknown crash"):
            cluster.crash("gently")


def test_default_synchronous_commit_loses_nothing_to_crashes() -> None:
    report = short_run(None, "crash", duration=12.0, min_faults=3)
    j = assert_sound(report)
    assert j["synchronous_commit"] is True
    assert j["crashes"] >= 3
    # Nothing acknowledged is taken back, so nothing runs again.
    assert j["completions_lost_in_crash"] == 0, j["completions_lost_in_crash_details"]
    assert j["reexecuted_after_crash"] == 0, j["duplicated_execution_causes"]


def test_asynchronous_commit_reruns_are_counted_not_doubled() -> None:
    report = short_run(None, "crash", duration=12.0, min_faults=3, synchronous_commit=False)
    j = assert_sound(report)
    assert j["synchronous_commit"] is False and j["crashes"] >= 3
    # Each completion a crash took back is a job that ran again, counted as such.
    assert j["reexecuted_after_crash"] >= j["completions_lost_in_crash"]
    assert set(j["duplicated_execution_causes"]) <= {"crash"}


def test_crash_is_refused_on_a_given_server(dsn: str) -> None:
    from skiplock import ConfigError

    with pytest.raises(ConfigError, match="scratch cluster"):
        short_run(dsn, "crash")
