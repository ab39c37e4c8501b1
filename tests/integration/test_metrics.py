"""skiplock.metrics fed by a real Worker: counters, histograms, gauges, OpenTelemetry."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from skiplock import Fail, Job, Queue, Retry, Worker
from skiplock.metrics import WorkerMetrics


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def handler(job: Job) -> None:
    kind = job.payload["kind"]
    if kind == "fail":
        raise Fail("bad input")
    if kind == "crash":
        raise RuntimeError("provider down")
    if kind == "retry_once" and job.attempts == 1:
        raise Retry(0)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def otel_points(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, Any] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def test_worker_events_become_metrics(queue: Queue) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = WorkerMetrics(queue, meter_provider=provider, status_interval=60)
    port = metrics.serve(0)
    try:
        jobs = {
            kind: queue.enqueue({"kind": kind}, queue="emails", max_attempts=attempts)
            for kind, attempts in [
                ("ok", 5),
                ("fail", 5),
                ("crash", 1),
                ("retry_once", 5),
            ]
        }
        queue.enqueue({"kind": "ok"}, queue="later")
        w = Worker(
            queue,
            handler,
            queues=["emails"],
            concurrency=2,
            lease=5,
            poll_interval=0.05,
            on_event=metrics.on_event,
            on_measure=metrics.on_measure,
        )
        t = w.start()
        wait_until(
            lambda: all(queue.get(i).status in ("done", "failed") for i in jobs.values()),  # type: ignore[union-attr]
            what="the jobs to finish",
        )
        w.stop()
        t.join(30)
        gauges = metrics.refresh_status()
        assert gauges["later"].pending == 1 and gauges["later"].oldest_pending_seconds >= 0
        assert gauges["emails"].pending == 0 and gauges["emails"].running == 0

        got = scrape(port)
        q = (("queue", "emails"),)
        assert got[("skiplock_jobs_claimed_total", q)] == 5  # retry_once ran twice
        assert got[("skiplock_jobs_completed_total", q)] == 2
        assert got[("skiplock_jobs_retried_total", q)] == 1
        assert got[("skiplock_jobs_failed_total", q)] == 2  # Fail, and crash out of attempts
        assert got[("skiplock_jobs_dead_total", q)] == 1  # only crash had no attempt left
        assert got[("skiplock_pickup_seconds_count", q)] == 5
        assert got[("skiplock_claim_seconds_count", q)] >= 2
        assert got[("skiplock_jobs_pending", (("queue", "later"),))] == 1
        assert ("skiplock_jobs_claimed_total", (("queue", "later"),)) not in got
        assert all("job" not in dict(labels) for _, labels in got)

        points = otel_points(reader)
        assert sum(p.value for p in points["skiplock.jobs.completed"]) == 2
        assert sum(p.value for p in points["skiplock.jobs.dead"]) == 1
        assert sum(p.count for p in points["skiplock.pickup.duration"]) == 5
        pending = {p.attributes["queue"]: p.value for p in points["skiplock.jobs.pending"]}
        assert pending["later"] == 1
    finally:
        metrics.close()
        provider.shutdown()


def test_swept_and_missed_heartbeats_from_the_hook(queue: Queue) -> None:
    metrics = WorkerMetrics(queue, otel=False)
    metrics.on_measure("swept", 3, None)
    metrics.on_measure("heartbeat_missed", 2, "emails")
    metrics.on_measure("something_new", 1, None)  # unknown figures are ignored
    reg = metrics.registry
    assert reg.get_sample_value("skiplock_jobs_swept_total") == 3
    assert reg.get_sample_value("skiplock_heartbeats_missed_total", {"queue": "emails"}) == 2


def test_bad_interval_and_port_are_one_line_errors(queue: Queue) -> None:
    from skiplock import ConfigError

    with pytest.raises(ConfigError, match="status_interval"):
        WorkerMetrics(queue, status_interval=0)
    m = WorkerMetrics(queue, otel=False)
    port = m.serve(0)
    try:
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            WorkerMetrics(queue, otel=False).serve(port)
    finally:
        m.close()
