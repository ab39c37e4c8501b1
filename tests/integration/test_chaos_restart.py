"""Chaos: PostgreSQL restarted mid-run, on a scratch cluster the test starts itself."""

from __future__ import annotations

import pytest

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def test_workers_ride_out_server_restarts_without_exiting(dsn: str) -> None:
    # dsn=None: restart runs only on a scratch cluster, never on the given server.
    # Restarts are spaced at least four leases apart: each one is ridden out on its own.
    report = short_run(None, "restart", min_faults=1)
    j = assert_sound(report)
    assert j["faults_injected"]["restart"] >= 1
    assert j["worker_exits"] == 0
    # Reconnection is prompt: work goes on between restarts instead of stalling for a
    # pool timeout (10 s) after each one.
    assert j["throughput"]["during"] >= 0.5 * 60.0, j["throughput"]


def test_restart_is_refused_on_a_given_server(dsn: str) -> None:
    from skiplock import ConfigError

    with pytest.raises(ConfigError, match="scratch cluster"):
        short_run(dsn, "restart")
