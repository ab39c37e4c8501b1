"""The throughput chart: finished jobs per time bucket as an inline SVG, drawn server-side."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

__all__ = ["RANGES", "ChartRange", "throughput_svg"]

# Final statuses, bottom to top, with their colours (also the legend's order).
SERIES = (("done", "#2e7d32"), ("failed", "#c62828"), ("cancelled", "#8d8d8d"))


@dataclass(frozen=True)
class ChartRange:
    """A window of time shown, cut into buckets (the query's ``window`` and ``bucket``)."""

    key: str
    label: str
    window: float
    bucket: float

    @property
    def buckets(self) -> int:
        return math.ceil(self.window / self.bucket)


RANGES = {
    r.key: r
    for r in (
        ChartRange("15m", "15 minutes", 900.0, 15.0),
        ChartRange("1h", "1 hour", 3600.0, 60.0),
        ChartRange("24h", "24 hours", 86400.0, 1800.0),
    )
}

WIDTH, HEIGHT = 760, 190
LEFT, RIGHT, TOP, BOTTOM = 44, 10, 12, 26


def _span(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def bucket_counts(
    rows: Iterable[Mapping[str, Any]], rng: ChartRange, now: float
) -> list[dict[str, int]]:
    """Jobs per bucket and final status, oldest bucket first, every queue summed.

    The query labels each bucket by its start, ``floor(epoch / bucket) * bucket``; the
    last bucket here is the one holding ``now``, the dashboard host's clock (a host
    whose clock is off by more than a bucket from the server's shifts the bars by one).
    """
    last = math.floor(now / rng.bucket) * rng.bucket
    first = last - (rng.buckets - 1) * rng.bucket
    counts = [dict.fromkeys((s for s, _ in SERIES), 0) for _ in range(rng.buckets)]
    for row in rows:
        at = row["at"]
        start = at.timestamp() if isinstance(at, datetime) else float(at)
        i = round((start - first) / rng.bucket)
        if 0 <= i < rng.buckets and row["status"] in counts[i]:
            counts[i][row["status"]] += int(row["jobs"])
    return counts


def throughput_svg(rows: Iterable[Mapping[str, Any]], rng: ChartRange, now: float) -> str:
    """A stacked bar chart of finished jobs, as SVG markup with every text escaped."""
    counts = bucket_counts(rows, rng, now)
    totals = {s: sum(c[s] for c in counts) for s, _ in SERIES}
    peak = max((sum(c.values()) for c in counts), default=0)
    top = max(peak, 1)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(counts)
    bar_w = max(slot - 1.0, 1.0)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="throughput-chart" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" data-total="{sum(totals.values())}" '
        f'aria-label="jobs finished per {escape(_span(rng.bucket))} over the last '
        f'{escape(rng.label)}">'
    ]
    # Grid lines and y labels at 0, half and the peak.
    for frac in (0.0, 0.5, 1.0):
        y = TOP + plot_h * (1 - frac)
        label = f"{top * frac:g}" if frac in (0.0, 1.0) or top >= 2 else ""
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">{label}</text>'
        )
    for i, c in enumerate(counts):
        x = LEFT + i * slot
        base = float(TOP + plot_h)
        ago = _span((len(counts) - 1 - i) * rng.bucket) if i < len(counts) - 1 else "now"
        for status, colour in SERIES:
            n = c[status]
            if not n:
                continue
            h = plot_h * n / top
            base -= h
            out.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                f'fill="{colour}" class="bar bar-{status}"><title>{n} {status}, '
                f"{escape(ago)}{'' if ago == 'now' else ' ago'}</title></rect>"
            )
    for frac, text in ((0.0, f"-{_span(rng.window)}"), (0.5, f"-{_span(rng.window / 2)}")):
        x = LEFT + plot_w * frac
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - 8}" class="axis">{escape(text)}</text>')
    out.append(
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 8}" text-anchor="end" class="axis">now</text>'
    )
    out.append("</svg>")
    return "".join(out)


def legend(rows: Iterable[Mapping[str, Any]], rng: ChartRange, now: float) -> list[dict[str, Any]]:
    """The chart's legend: each final status, its colour and its total in the window."""
    counts = bucket_counts(rows, rng, now)
    return [
        {"status": s, "colour": colour, "jobs": sum(c[s] for c in counts)} for s, colour in SERIES
    ]
