"""Chaos: reconnection bounded by the lease.

The server (a scratch cluster) restarts every 5 s with a 2 s lease: a live worker must
be back, claiming and heartbeating, well inside what is left of its leases, so that no
job it holds is swept from under it.  When an outage does outlast a lease, the worker
counts the lapse and the fence refuses the late outcome.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import psycopg
import pytest

from skiplock import Job, Queue, Worker
from skiplock._lane import Lane
from skiplock.chaos import ChaosProxy, proxied_dsn, upstream_of

from .chaos_util import assert_sound, short_run

pytestmark = pytest.mark.chaos


def restarts_every_5s(fault_seconds: float) -> dict[str, Any]:
    report = short_run(
        None,
        "restart",
        duration=fault_seconds + 10.0,
        fault_share=fault_seconds / (fault_seconds + 10.0),
        restart_every=5.0,
        lease=2.0,
        min_faults=1,
    )
    j = assert_sound(report)
    assert j["faults_injected"]["restart"] >= int(fault_seconds / 5.0) - 1
    # No job a live worker held was swept: nothing ran twice, no lease ran out unseen.
    assert not j["duplicated_execution_causes"], j["duplicated_execution_causes"]
    assert j["worker_stats"]["leases_lapsed"] == 0, j["worker_stats"]
    firsts = j["back_to_claim"]
    assert firsts and None not in firsts, firsts
    # Back within a fraction of the lease (the lanes retry every <= 0.25 s).
    assert max(firsts) < 1.0, firsts
    # Producers too: their pools reconnect on the same schedule (psycopg_pool's own
    # would wait 1, 2, 4 s), and an enqueue cut mid-statement is retried, not failed.
    enqueues = j["back_to_enqueue"]
    assert enqueues and None not in enqueues, enqueues
    assert max(enqueues) < 1.0, enqueues
    return j


def test_restart_every_5s_for_30s_nothing_held_is_swept() -> None:
    restarts_every_5s(30.0)


@pytest.mark.slow
def test_restart_every_5s_for_2_minutes_nothing_held_is_swept() -> None:
    j = restarts_every_5s(120.0)
    assert j["faults_injected"]["restart"] >= 20


def test_a_lane_retries_at_once_then_backs_off_briefly() -> None:
    from skiplock._base import QueueSettings

    # Nothing listens on port 1: every connect is refused at once.
    lane = Lane(QueueSettings.build("postgresql://nobody@127.0.0.1:1/none"), "test", cap=0.1)
    assert lane.delay(0) == 0.0
    assert all(0 < lane.delay(n) <= 0.1 for n in range(1, 30))
    times = []
    for _ in range(8):
        with pytest.raises(psycopg.OperationalError), lane.connection():
            pass
        times.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Short and capped: never the pool's 1 s, 2 s, 4 s.
    assert max(gaps) < 0.1 + 0.05, gaps
    lane.close()


def test_an_outage_longer_than_the_lease_is_counted_and_the_late_outcome_refused(
    dsn: str, queue: Queue
) -> None:
    release = threading.Event()
    started = threading.Event()

    def handle(job: Job) -> None:
        started.set()
        release.wait(30)

    job_id = queue.enqueue({"n": 1})
    with ChaosProxy(upstream_of(dsn)) as proxy:
        wq = Queue(proxied_dsn(dsn, proxy.port), schema=queue.schema, max_size=2)
        w = Worker(wq, handle, lease=1.0, sweep_interval=60.0, listen=False, poll_interval=0.1)
        t = w.start()
        try:
            assert started.wait(30)
            # Every connection of the worker cut, new ones refused for 3 leases.
            proxy.refuse(3.0)
            proxy.reset()
            # The lease runs out; the job is swept (by us, directly) from under it.
            end = time.monotonic() + 10
            while queue.sweep() == 0:
                assert time.monotonic() < end, "the lease never ran out"
                time.sleep(0.1)
            # Another worker has it now (so the outage's end cannot hand it back to w).
            (other,) = queue.claim(worker="other", lease=60)
            release.set()
            end = time.monotonic() + 20
            while w.stats.snapshot()["lease_lost"] == 0 and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            release.set()
            w.stop()
            t.join(30)
            wq.close()
    stats = w.stats.snapshot()
    assert stats["leases_lapsed"] >= 1, stats
    # The handler's outcome, written after the sweep, changed nothing.
    assert stats["lease_lost"] >= 1 and stats["completed"] == 0, stats
    job = queue.get(job_id)
    assert job is not None and job.status == "running" and job.worker == "other"
    assert job.lease_token == other.lease_token
