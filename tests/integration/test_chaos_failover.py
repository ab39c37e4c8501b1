"""Chaos: the primary is killed under load and its streaming standby promoted.

Producers and workers hold a multi-host DSN with ``target_session_attrs=read-write``;
they must follow the new primary without a restart.  With synchronous replication
nothing acknowledged is lost and nothing completes twice; with asynchronous replication
the run must finish, and the report counts what the lost WAL tail took back.
"""

from __future__ import annotations

from typing import Any

import pytest

from skiplock.chaos._replicated import PG15_BIN, ReplicatedCluster

from .chaos_util import short_run

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(
        not ReplicatedCluster.available(),
        reason=f"failover needs PostgreSQL 15's initdb and pg_basebackup in {PG15_BIN}",
    ),
]


def _failover_run(sync: bool) -> dict[str, Any]:
    # The run starts and removes both clusters itself, in a finally (also on failure).
    report = short_run(
        None, "failover", duration=10.0, lease=2.0, min_faults=1, sync_replication=sync
    )
    j = report.to_json()
    print(
        "failover",
        "sync" if sync else "async",
        {
            k: j[k]
            for k in (
                "acknowledged",
                "completed",
                "lost",
                "duplicated_executions",
                "duplicated_completions",
                "completions_lost_in_crash",
                "back_to_claim",
                "back_to_enqueue",
            )
        },
    )
    assert j["faults_injected"].get("failover") == 1, j["faults_injected"]
    return j


def test_failover_with_synchronous_replication_loses_nothing() -> None:
    j = _failover_run(sync=True)
    assert j["replication"] == "synchronous"
    # Nothing lost or unexpected, nothing completed twice, every job done, no worker
    # crashed: assert_sound's checks, and no acknowledged commit taken back.
    assert j["lost"] == 0, j["lost_jobs"]
    assert j["unexpected"] == 0 and j["lease_lost_violations"] == 0, j["problems"]
    assert j["duplicated_completions"] == 0, j["duplicated_completion_details"]
    assert j["completions_lost_in_crash"] == 0, j["completions_lost_in_crash_details"]
    assert j["valid"] and j["drained"] and j["worker_exits"] == 0, j["problems"]
    # Everyone followed the new primary, within a fraction of the lease.
    assert None not in j["back_to_claim"] and None not in j["back_to_enqueue"], j
    assert max(j["back_to_claim"]) < 1.5 and max(j["back_to_enqueue"]) < 1.5, j


def test_failover_with_asynchronous_replication_finishes_and_counts_the_loss() -> None:
    j = _failover_run(sync=False)
    assert j["replication"] == "asynchronous"
    assert j["drained"] and j["worker_exits"] == 0, j["problems"]
    # No assertion of zero loss: an acknowledged enqueue or completion whose WAL the
    # standby had not received is gone (counted in lost / completions_lost_in_crash).
    assert j["duplicated_completions"] == 0, j["duplicated_completion_details"]
