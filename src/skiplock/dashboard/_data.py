"""What the pages show, gathered from the public Queue API and shaped for templates and JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from skiplock import Queue, QueueConfig

from ._chart import ChartRange, legend, throughput_svg

__all__ = ["STATUSES", "Overview", "QueueSummary", "age", "overview", "pretty_json", "when"]

# waiting: a workflow step whose parents have not all finished; throttled: a job whose
# concurrency key is at its limit.  Neither is claimable yet.
STATUSES = ("pending", "running", "done", "failed", "cancelled", "waiting", "throttled")


@dataclass
class QueueSummary:
    """One queue's row on the overview: counts, its oldest pending job, its settings."""

    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    oldest_pending_seconds: float | None = None
    expired_leases: int = 0
    paused: bool = False
    concurrency_limit: int | None = None
    rate_limit: float | None = None
    rate_burst: float | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        d["oldest_pending"] = age(self.oldest_pending_seconds)
        return d


@dataclass
class Overview:
    queues: list[QueueSummary]
    chart_svg: str
    legend: list[dict[str, Any]]
    generated_at: float
    # Due jobs whose task no live worker knows (a rolling deploy): queue, task, jobs,
    # oldest_seconds.  Not lost, not charged; waiting for a worker with that task.
    unserved: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "queues": [q.to_json() for q in self.queues],
            "unserved": self.unserved,
            "totals": {s: sum(q.counts[s] for q in self.queues) for s in STATUSES},
            "chart_svg": self.chart_svg,
            "legend": self.legend,
            "generated_at": self.generated_at,
        }


def overview(queue: Queue, rng: ChartRange) -> Overview:
    """Every queue with jobs or settings, and the throughput chart over ``rng``."""
    summaries: dict[str, QueueSummary] = {}
    for row in queue.status():
        s = summaries.setdefault(row["queue"], QueueSummary(row["queue"]))
        s.counts[row["status"]] = int(row["jobs"])
        s.expired_leases += int(row["expired_leases"])
        if row["status"] == "pending" and row["oldest_pending_seconds"] is not None:
            s.oldest_pending_seconds = float(row["oldest_pending_seconds"])
    cfg: QueueConfig
    for cfg in queue.queue_settings():
        s = summaries.setdefault(cfg.name, QueueSummary(cfg.name))
        s.paused = cfg.paused
        s.concurrency_limit = cfg.concurrency_limit
        s.rate_limit = cfg.rate_limit
        s.rate_burst = cfg.rate_burst
    rows = queue.throughput(window=rng.window, bucket=rng.bucket)
    now = time.time()
    return Overview(
        queues=[summaries[k] for k in sorted(summaries)],
        chart_svg=throughput_svg(rows, rng, now),
        legend=legend(rows, rng, now),
        generated_at=now,
        unserved=queue.unserved(),
    )


def age(seconds: float | None) -> str:
    """A duration the way an operator reads it: 4.2s, 3m 10s, 2h 5m, 3d 4h."""
    if seconds is None:
        return "-"
    s = max(seconds, 0.0)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m {sec}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"


def when(value: datetime | None) -> str:
    """A timestamp in UTC, to the second, with how long ago (or ahead) it is."""
    if value is None:
        return "-"
    utc = value.astimezone(UTC)
    delta = time.time() - utc.timestamp()
    rel = f"{age(delta)} ago" if delta >= 0 else f"in {age(-delta)}"
    return f"{utc:%Y-%m-%d %H:%M:%S}Z ({rel})"


def pretty_json(value: Any) -> str:
    """A payload or result as indented JSON (what was stored, not a Python repr)."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
