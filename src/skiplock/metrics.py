"""Worker metrics for Prometheus and OpenTelemetry, fed by the Worker's two hooks."""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError
from ._job import Job

if TYPE_CHECKING:
    from ._queue import Queue

__all__ = ["COUNTERS", "QueueGauges", "WorkerMetrics"]

logger = logging.getLogger("skiplock.metrics")

# Counter name (without the skiplock_ prefix and _total suffix) -> help text.  Every one
# is labelled by queue, except `jobs_swept`: a sweep returns expired leases of every queue.
COUNTERS: dict[str, str] = {
    "jobs_claimed": "Jobs claimed by this worker.",
    "jobs_completed": "Jobs whose fenced completion committed.",
    "jobs_retried": "Failed attempts put back to pending for another try.",
    "jobs_failed": "Jobs that ended failed (Fail raised, or no attempts left).",
    "jobs_dead": "Jobs that ended failed on their last attempt.",
    "jobs_cancelled": "Jobs the worker saw cancelled.",
    "jobs_timed_out": "Attempts that ran past the job timeout.",
    "lease_lost": "Stale fenced writes rejected (LeaseLost): the write changed nothing.",
    "heartbeats_missed": "Held jobs whose heartbeat failed or found the lease gone.",
    "jobs_swept": "Jobs this worker's sweeps returned from expired leases (any queue).",
}

# Event of Worker(on_event=) -> counters it adds one to.
_EVENT_COUNTERS: dict[str, tuple[str, ...]] = {
    "claimed": ("jobs_claimed",),
    "completed": ("jobs_completed",),
    "retried": ("jobs_retried",),
    "failed": ("jobs_failed",),
    "cancelled": ("jobs_cancelled",),
    "timed_out": ("jobs_timed_out",),
    "lease_lost": ("lease_lost",),
}
# Events after which a job will not start under this claim.
_DONE_EVENTS = frozenset({"completed", "retried", "failed", "lease_lost", "released", "cancelled"})

CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PICKUP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """One queue's depth, from the last status query."""

    pending: int = 0
    running: int = 0
    oldest_pending_seconds: float = 0.0


class WorkerMetrics:
    """Counters, histograms and gauges of one worker process.

    Pass its hooks to the worker: ``Worker(q, handler, on_event=m.on_event,
    on_measure=m.on_measure)``.  Counters and histograms are updated per event; the
    per-queue gauges come from one status query every ``status_interval`` seconds
    (``start()``), never per job.  Labels are the queue name only.

    Parameters
    ----------
    queue
        Where the status query for the gauges runs; None: no gauges.
    registry
        A ``prometheus_client.CollectorRegistry``; default a new one of this object's
        own (``serve`` exposes it).  None of it is needed if prometheus_client is not
        installed: then only OpenTelemetry gets the figures.
    otel
        Also record to the OpenTelemetry meter ``skiplock`` when ``opentelemetry-api``
        is importable (a no-op until the application configures a MeterProvider).
    meter_provider
        The OpenTelemetry MeterProvider to use; default the global one.
    status_interval
        Seconds between status queries for the gauges.
    """

    def __init__(
        self,
        queue: Queue | None = None,
        *,
        registry: Any = None,
        otel: bool = True,
        meter_provider: Any = None,
        status_interval: float = 5.0,
    ) -> None:
        if not status_interval > 0:
            raise ConfigError(f"status_interval must be positive, not {status_interval!r}")
        self._queue = queue
        self.status_interval = status_interval
        self._lock = threading.Lock()
        self._gauges: dict[str, QueueGauges] = {}
        self._claimed_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._prom = _PromSink(registry) if _importable("prometheus_client") else None
        if self._prom is not None:
            self._prom.add_gauges(self)
        self._otel = (
            _OtelSink(self, meter_provider)
            if otel and _importable("opentelemetry.metrics")
            else None
        )
        if self._prom is None and self._otel is None:
            raise ConfigError(
                "metrics need prometheus_client or opentelemetry-api: "
                "pip install 'skiplock[metrics]' or 'skiplock[otel]'"
            )

    # -- the worker's hooks --------------------------------------------------------------

    def on_event(self, event: str, job: Job) -> None:
        """``Worker(on_event=)``: count the event; time the pickup at ``started``."""
        for name in _EVENT_COUNTERS.get(event, ()):
            self._count(name, 1, job.queue)
        if event == "failed" and job.attempts >= job.max_attempts:
            self._count("jobs_dead", 1, job.queue)
        if event == "claimed":
            with self._lock:
                self._claimed_at[job.id] = time.monotonic()
        elif event == "started":
            with self._lock:
                claimed_at = self._claimed_at.pop(job.id, None)
            self._observe("pickup_seconds", _pickup(job, claimed_at), job.queue)
        elif event in _DONE_EVENTS:
            with self._lock:
                self._claimed_at.pop(job.id, None)

    def on_measure(self, name: str, value: float, queue: str | None) -> None:
        """``Worker(on_measure=)``: claim round trips, sweeps, missed heartbeats."""
        if name == "claim_seconds" and queue is not None:
            self._observe("claim_seconds", value, queue)
        elif name == "swept":
            self._count("jobs_swept", value, None)
        elif name == "heartbeat_missed" and queue is not None:
            self._count("heartbeats_missed", value, queue)

    def _count(self, name: str, n: float, queue: str | None) -> None:
        if self._prom is not None:
            self._prom.count(name, n, queue)
        if self._otel is not None:
            self._otel.count(name, n, queue)

    def _observe(self, name: str, seconds: float, queue: str) -> None:
        if self._prom is not None:
            self._prom.observe(name, seconds, queue)
        if self._otel is not None:
            self._otel.observe(name, seconds, queue)

    # -- gauges --------------------------------------------------------------------------

    def refresh_status(self) -> dict[str, QueueGauges]:
        """Run the status query now and keep its per-queue figures for the gauges."""
        if self._queue is None:
            return {}
        per_queue: dict[str, dict[str, float]] = {}
        for row in self._queue.status():
            g = per_queue.setdefault(row["queue"], {"pending": 0, "running": 0, "oldest": 0.0})
            if row["status"] in ("pending", "running"):
                g[row["status"]] = int(row["jobs"])
            if row["oldest_pending_seconds"] is not None:
                g["oldest"] = max(g["oldest"], float(row["oldest_pending_seconds"]))
        gauges = {
            q: QueueGauges(int(g["pending"]), int(g["running"]), g["oldest"])
            for q, g in per_queue.items()
        }
        with self._lock:
            self._gauges = gauges
        return gauges

    def gauges(self) -> dict[str, QueueGauges]:
        with self._lock:
            return dict(self._gauges)

    def start(self) -> None:
        """Refresh the gauges every ``status_interval`` seconds in a daemon thread."""
        if self._thread is not None or self._queue is None:
            return
        self._thread = threading.Thread(target=self._status_loop, name="skiplock-metrics")
        self._thread.daemon = True
        self._thread.start()

    def _status_loop(self) -> None:
        while True:
            try:
                self.refresh_status()
            except Exception as exc:  # a metrics thread must outlive a database outage
                logger.debug("status query for metrics failed: %s", exc)
            if self._stop.wait(self.status_interval):
                return

    # -- exposition ----------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve Prometheus text at ``http://addr:port/metrics``; returns the port bound."""
        if self._prom is None:
            raise ConfigError(
                "--metrics-port needs prometheus_client: pip install 'skiplock[metrics]'"
            )
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(port, addr=addr, registry=self._prom.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from None
        self._server = server
        return int(server.server_address[1])

    @property
    def registry(self) -> Any:
        """The prometheus_client registry holding these metrics (None without it)."""
        return None if self._prom is None else self._prom.registry

    def close(self) -> None:
        """Stop the status thread and the HTTP server."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _pickup(job: Job, claimed_at: float | None) -> float:
    """Seconds from due (enqueue, or run_at) to handler start.

    The database part (due -> claim) uses the server's clock on both ends and the local
    part (claim -> start) the worker's monotonic clock, so clock skew between the two
    hosts does not enter.
    """
    due_to_claim = 0.0
    if job.started_at is not None:
        due_to_claim = max(0.0, (job.started_at - job.run_at).total_seconds())
    local = time.monotonic() - claimed_at if claimed_at is not None else 0.0
    return due_to_claim + local


class _PromSink:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.counters: dict[str, Any] = {
            name: Counter(
                f"skiplock_{name}",
                text,
                [] if name == "jobs_swept" else ["queue"],
                registry=self.registry,
            )
            for name, text in COUNTERS.items()
        }
        self.histograms: dict[str, Any] = {
            "claim_seconds": Histogram(
                "skiplock_claim_seconds",
                "Round trip of one claim statement.",
                ["queue"],
                buckets=CLAIM_BUCKETS,
                registry=self.registry,
            ),
            "pickup_seconds": Histogram(
                "skiplock_pickup_seconds",
                "From a job being due (enqueued, or its run_at) to its handler starting.",
                ["queue"],
                buckets=PICKUP_BUCKETS,
                registry=self.registry,
            ),
        }

    def count(self, name: str, n: float, queue: str | None) -> None:
        c = self.counters[name]
        (c if queue is None else c.labels(queue=queue)).inc(n)

    def observe(self, name: str, seconds: float, queue: str) -> None:
        self.histograms[name].labels(queue=queue).observe(seconds)

    def add_gauges(self, metrics: WorkerMetrics) -> None:
        self.registry.register(_GaugeCollector(metrics))


class _GaugeCollector:
    """Yields the gauges from the last status query at scrape time: a queue that is gone
    from the table drops out instead of keeping a stale value."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        gauges = self._metrics.gauges()
        families = [
            ("skiplock_jobs_pending", "Pending jobs (due or scheduled).", "pending"),
            ("skiplock_jobs_running", "Running jobs (claimed, lease held).", "running"),
            (
                "skiplock_oldest_pending_seconds",
                "Age of the oldest due pending job.",
                "oldest_pending_seconds",
            ),
        ]
        for name, text, attr in families:
            family = GaugeMetricFamily(name, text, labels=["queue"])
            for queue, g in sorted(gauges.items()):
                family.add_metric([queue], float(getattr(g, attr)))
            yield family


class _OtelSink:
    def __init__(self, metrics: WorkerMetrics, provider: Any) -> None:
        from opentelemetry import metrics as otel

        meter = otel.get_meter("skiplock", meter_provider=provider)
        self.counters: dict[str, Any] = {
            name: meter.create_counter(
                f"skiplock.{name.replace('_', '.')}", unit="{job}", description=text
            )
            for name, text in COUNTERS.items()
        }
        self.histograms: dict[str, Any] = {
            "claim_seconds": meter.create_histogram(
                "skiplock.claim.duration", unit="s", description="Round trip of one claim."
            ),
            "pickup_seconds": meter.create_histogram(
                "skiplock.pickup.duration", unit="s", description="Due to handler start."
            ),
        }

        def observe(attr: str) -> Any:
            def callback(_options: Any) -> list[Any]:
                return [
                    otel.Observation(float(getattr(g, attr)), {"queue": q})
                    for q, g in metrics.gauges().items()
                ]

            return callback

        for name, attr in [
            ("skiplock.jobs.pending", "pending"),
            ("skiplock.jobs.running", "running"),
            ("skiplock.oldest_pending.age", "oldest_pending_seconds"),
        ]:
            meter.create_observable_gauge(name, callbacks=[observe(attr)])

    def count(self, name: str, n: float, queue: str | None) -> None:
        self.counters[name].add(n, {} if queue is None else {"queue": queue})

    def observe(self, name: str, seconds: float, queue: str) -> None:
        self.histograms[name].record(seconds, {"queue": queue})
