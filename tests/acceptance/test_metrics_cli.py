"""`skiplock worker --metrics-port`: scraped over HTTP after a SIGKILLed worker's job is
swept back and a stale write is rejected."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from skiplock import Queue

HERE = Path(__file__).parent


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def start_worker(
    dsn: str, schema: str, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Path]]]:
    procs: list[subprocess.Popen[bytes]] = []
    env = {
        **os.environ,
        "SKIPLOCK_DSN": dsn,
        "ACCEPT_SCHEMA": schema,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }

    def start(name: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            p = subprocess.Popen(
                [
                    *(sys.executable, "-m", "skiplock.cli", "worker", "--schema", schema),
                    *("--handler", "metrics_handlers:work", "--name", f"{schema}-{name}"),
                    *extra,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(p)
        return p, log

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def samples(port: int) -> dict[tuple[str, str], float]:
    """(metric sample name, queue label or '') -> value, from a real scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels.get("queue", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_after_a_killed_worker_and_a_stale_write(
    queue: Queue, start_worker: Callable[..., tuple[subprocess.Popen[bytes], Path]]
) -> None:
    hung = queue.enqueue({"kind": "hang"}, queue="slow")
    victim, _ = start_worker("victim", "--queue", "slow", "--lease", "1", "--no-migrate")
    wait_until(lambda: (queue.get(hung) or pytest.fail()).status == "running", what="claim")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)

    ids = [
        queue.enqueue({"kind": "ok"}, queue="emails"),
        queue.enqueue({"kind": "fail"}, queue="emails"),
        queue.enqueue({"kind": "crash"}, queue="emails", max_attempts=1),
        queue.enqueue({"kind": "retry_once"}, queue="emails"),
        queue.enqueue({"kind": "stale", "linger": 0.8}, queue="emails"),
        hung,
    ]
    queue.enqueue({"kind": "ok"}, queue="idle")  # nobody works it: a pending gauge
    worker, log = start_worker(
        "observed",
        *("--queue", "emails", "--queue", "slow", "--lease", "1.5", "--sweep-interval", "0.2"),
        *("--metrics-port", "0", "--metrics-interval", "0.2", "--no-migrate"),
    )
    port_line: list[str] = []

    def port_logged() -> bool:
        port_line[:] = re.findall(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", log.read_text())
        assert worker.poll() is None, log.read_text()
        return bool(port_line)

    wait_until(port_logged, what="the metrics port in the log")
    port = int(port_line[0])
    wait_until(
        lambda: all((queue.get(i) or pytest.fail()).status in ("done", "failed") for i in ids),
        what="every job to finish",
    )
    # The stale attempt's rejected completion lands after its linger.
    wait_until(lambda: samples(port).get(("skiplock_lease_lost_total", "emails"), 0) >= 1)
    wait_until(lambda: samples(port).get(("skiplock_jobs_pending", "idle"), 0) == 1)
    got = samples(port)

    assert got[("skiplock_jobs_swept_total", "")] >= 1  # the killed worker's job
    assert got[("skiplock_jobs_completed_total", "slow")] == 1
    assert got[("skiplock_lease_lost_total", "emails")] >= 1
    assert got[("skiplock_heartbeats_missed_total", "emails")] >= 1
    assert got[("skiplock_jobs_completed_total", "emails")] == 3  # ok, retry_once, stale
    assert got[("skiplock_jobs_retried_total", "emails")] == 1
    assert got[("skiplock_jobs_failed_total", "emails")] == 2
    assert got[("skiplock_jobs_dead_total", "emails")] == 1
    assert got[("skiplock_claim_seconds_count", "emails")] >= 1
    assert got[("skiplock_pickup_seconds_count", "slow")] == 1
    # Swept at about the lease's end: its pickup (due -> start) is over the lease.
    assert got[("skiplock_pickup_seconds_sum", "slow")] >= 1.0
    assert got[("skiplock_oldest_pending_seconds", "idle")] > 0

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0, log.read_text()
