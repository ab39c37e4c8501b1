"""Failover under Patroni: nothing acknowledged is lost, nothing completes twice.

Each case starts its own etcd and two Patroni-managed PostgreSQL 15 nodes
(``synchronous_mode: true``), runs a producer and a worker over the multi-host DSN
(``target_session_attrs=read-write``), does one fault, and checks, once the queue has
drained on the new leader, that every acknowledged enqueue ran and completed exactly
once.  Marked ``patroni``: the README's test command leaves them out, CI's `.ci/run`
runs the shortest one after it, and `python -m pytest -m patroni` runs them all.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Job, Queue, Worker
from skiplock.chaos._patroni import ACTIONS, PatroniCluster

from .test_worker import running, wait_until

pytestmark = [
    pytest.mark.patroni,
    pytest.mark.skipif(
        PatroniCluster.available() is not None,
        reason=f"{PatroniCluster.available()}",
    ),
    pytest.mark.timeout(600),
]


class Producer(threading.Thread):
    """Enqueues one job at a time; records each acknowledged id with the time."""

    def __init__(self, q: Queue) -> None:
        super().__init__(name="patroni-producer", daemon=True)
        self.q = q
        self.acked: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                job_id = self.q.enqueue({"n": n})
            except Exception:
                self.errors += 1
                time.sleep(0.05)
                continue
            self.acked.append((time.time(), job_id))
            time.sleep(0.01)


@pytest.mark.parametrize("action", ACTIONS)
def test_failover_loses_no_acknowledged_job_and_completes_none_twice(action: str) -> None:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    cluster = PatroniCluster()
    dsn = cluster.start()
    claims: list[float] = []
    runs: dict[int, int] = {}
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            claims.append(time.time())
            runs[job.id] = runs.get(job.id, 0) + 1
        time.sleep(0.02)

    q = Queue(dsn, schema=schema, max_size=2, connect_timeout=3)
    wq = Queue(dsn, schema=schema, max_size=2, connect_timeout=3)
    try:
        q.migrate()
        producer = Producer(q)
        producer.start()
        worker = Worker(wq, handler, concurrency=4, lease=5, poll_interval=0.1)
        with running(worker):
            wait_until(lambda: len(claims) >= 20, timeout=60, what="work before the fault")
            t_fault, t_back = cluster.act(action)
            wait_until(lambda: any(t > t_back for t in claims), timeout=120, what="a claim after")
            wait_until(
                lambda: any(t > t_back for t, _ in producer.acked),
                timeout=120,
                what="an enqueue after",
            )
            producer.stop.set()
            producer.join(30)
            acked = {job_id for _, job_id in producer.acked}
            wait_until(
                lambda: acked <= {j for j, n in runs.items() if n >= 1},
                timeout=120,
                what="every acknowledged job run",
            )
            wait_until(lambda: worker.inflight() == [], timeout=60, what="writes done")
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows: list[Any] = conn.execute(
                sql.SQL("SELECT id, status, completions FROM {}.jobs").format(
                    sql.Identifier(schema)
                )
            ).fetchall()
        state = {r[0]: (r[1], r[2]) for r in rows}
        lost = [j for j in acked if state.get(j, ("missing", 0))[0] != "done"]
        twice = [j for j, (_, c) in state.items() if c > 1]
        assert lost == [], f"{action}: acknowledged jobs not done: {lost[:10]}"
        assert twice == [], f"{action}: jobs completed more than once: {twice[:10]}"
        print(
            f"\npatroni {action}: {len(acked)} acknowledged, 0 lost, 0 completed twice; "
            f"new leader writable {t_back - t_fault:.2f}s after the fault; "
            f"longest pause of claims {_gap(claims, t_fault):.2f}s, "
            f"of acknowledged enqueues {_gap([t for t, _ in producer.acked], t_fault):.2f}s"
        )
    finally:
        q.close()
        wq.close()
        cluster.stop()


def _gap(times: list[float], since: float) -> float:
    """The longest time without an event, from the fault to the first event after the
    longest pause: what the fault cost clients, whatever the action's own length."""
    after = sorted([since, *(t for t in times if t >= since)])
    return max((b - a for a, b in itertools.pairwise(after)), default=0.0)
