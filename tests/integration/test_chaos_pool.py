"""Chaos: the server's connections exhausted by other clients; a long transaction."""

from __future__ import annotations

import psycopg
import pytest

from skiplock.chaos import ConnectionHog, ScratchCluster

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_connection_hog_leaves_only_the_slots_asked_for() -> None:
    with ScratchCluster(max_connections=30) as cluster:
        hog = ConnectionHog(cluster.dsn, leave=2)
        try:
            held = hog.start()
            assert held > 10
            # Two slots are left: the third client is turned away.
            extra = [psycopg.connect(cluster.dsn) for _ in range(2)]
            with pytest.raises(psycopg.OperationalError, match=r"too many|reserved"):
                psycopg.connect(cluster.dsn)
            for c in extra:
                c.close()
        finally:
            hog.stop()


def test_queue_keeps_working_with_the_server_nearly_full() -> None:
    # Other clients hold all but a few slots while workers are also killed, so the
    # replacements and reconnections have to fight for what is left.
    report = short_run(None, "exhaust", "kill", exhaust_leave=6, min_faults=2)
    j = assert_sound(report)
    assert j["faults_injected"]["exhaust"] == 1 and j["kills"] >= 2


def test_long_transaction_holds_back_vacuum_while_the_queue_runs(dsn: str) -> None:
    report = short_run(dsn, "longtx", duration=10.0)
    j = assert_sound(report)
    dead = j["dead_tuples"]
    # While the transaction is open, VACUUM cannot remove what the queue left dead;
    # once it ends, it can.
    assert dead["vacuum_with_long_tx"] > 100, dead
    assert dead["vacuum_after_long_tx"] < dead["vacuum_with_long_tx"] / 2, dead
    assert j["throughput"]["during"] >= 0.8 * 60.0, j["throughput"]


def test_workers_wait_out_a_full_server_and_lose_nothing() -> None:
    # Every slot taken (superuser ones too) and a third of the workers' connections cut,
    # again and again: those workers cannot reconnect until the slots come free.
    report = short_run(None, "maxconn", min_faults=3)
    j = assert_sound(report)
    assert j["faults_injected"]["maxconn"] >= 3
    assert not j["duplicated_execution_causes"], j["duplicated_execution_causes"]
