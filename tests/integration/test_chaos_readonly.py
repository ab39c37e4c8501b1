"""Chaos: the server refuses writes for a while (default_transaction_read_only + reload).

On a scratch cluster only.  Workers must not spin or crash: they back off, say why
once per outage (not once per attempt), and carry on when writes come back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from skiplock import DatabaseUnavailable, Queue, Worker
from skiplock.chaos import ScratchCluster

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def cluster() -> Iterator[ScratchCluster]:
    with ScratchCluster() as c:
        yield c


def read_only(dsn: str, on: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET default_transaction_read_only = off")
        if on:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        conn.execute("SELECT pg_reload_conf()")


def test_enqueue_on_a_read_only_server_says_so_and_nothing_was_written(
    cluster: ScratchCluster,
) -> None:
    q = Queue(cluster.dsn, schema="ro_enqueue", max_size=2)
    q.migrate()
    try:
        read_only(cluster.dsn, True)
        # A fresh connection reads the reloaded setting at once.
        q.close()
        q.open()
        with pytest.raises(DatabaseUnavailable, match=r"read-only .*nothing was written"):
            q.enqueue({"x": 1})
    finally:
        read_only(cluster.dsn, False)
        q.close()


def test_worker_backs_off_logs_once_and_resumes(
    cluster: ScratchCluster, caplog: pytest.LogCaptureFixture
) -> None:
    q = Queue(cluster.dsn, schema="ro_worker", max_size=2)
    q.migrate()
    done: list[int] = []
    more = threading.Event()

    def handle(job: object) -> None:
        done.append(1)
        if len(done) == 10:
            more.set()

    w = Worker(q, handle, lease=2.0, poll_interval=0.05, sweep_interval=0.5, listen=False)
    caplog.set_level(logging.WARNING, logger="skiplock.worker")
    t = w.start()
    try:
        q.enqueue_many([{"n": i} for i in range(10)])
        assert more.wait(30)
        read_only(cluster.dsn, True)
        # Wait until the worker saw the refusal, then let it keep failing a while.
        assert _wait(lambda: w.stats.snapshot()["db_errors"] > 0, 15)
        errors_before = w.stats.snapshot()["db_errors"]
        threading.Event().wait(3.0)
        # Backoff, not a spin: a few attempts in 3 s, not thousands.
        assert w.stats.snapshot()["db_errors"] - errors_before < 40
        read_only(cluster.dsn, False)
        q.enqueue_many([{"n": i} for i in range(10, 20)])
        assert _wait(lambda: len(done) == 20, 30), len(done)
    finally:
        w.stop()
        t.join(30)
        q.close()
    assert not t.is_alive()
    claim_lines = [r.getMessage() for r in caplog.records if ": claim " in r.getMessage()]
    failed = [m for m in claim_lines if "claim failed" in m]
    assert len(failed) == 1, claim_lines
    assert "read-only" in failed[0]
    assert sum("claim works again" in m for m in claim_lines) == 1, claim_lines


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_queue_rides_out_read_only_spells_under_load() -> None:
    report = short_run(None, "readonly", min_faults=3)
    j = assert_sound(report)
    assert j["faults_injected"]["readonly"] >= 3
    assert not j["duplicated_execution_causes"], j["duplicated_execution_causes"]
