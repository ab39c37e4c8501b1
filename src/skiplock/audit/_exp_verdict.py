"""The experiment's verdict: what it found, as text for people and a dict for JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from skiplock.lab import RaceResult, Timeline

from ._claim import ClaimPlan
from ._engine import AuditResult
from ._report import render_json, render_text

__all__ = ["ExperimentResult"]


@dataclass
class ExperimentResult:
    """What the experiment found; ``format()`` for people, ``to_dict()`` for JSON."""

    claim_path: str
    plan: ClaimPlan
    table: str
    key: str
    scratch: str
    server: str
    parameters: list[str]
    seed: list[str]
    static: AuditResult
    timeline: Timeline
    other_replays: list[Timeline] = field(default_factory=list)
    load: RaceResult | None = None
    load_note: str | None = None
    fail_on: str = "info"

    @property
    def raced(self) -> bool:
        """A row was claimed twice, under load or in the replay."""
        doubled = self.load is not None and self.load.double_claims > 0
        return doubled or bool(self.timeline.double_claimed)

    @property
    def exit_code(self) -> int:
        if self.static.problems:
            return 2
        return 1 if self.raced or self.static.exit_code(self.fail_on) == 1 else 0

    def _claim_text(self) -> str:
        steps = ", then ".join(f"{s.kind} at line {s.line}" for s in self.plan.statements)
        unit = f" in {self.plan.unit}" if self.plan.unit != self.plan.path else ""
        return f"{steps}{unit}, claiming rows of {self.table} (key {self.key})"

    def format(self, *, fixes: bool = True) -> str:
        lines = [f"skiplock audit experiment: {self.claim_path}"]
        lines.append(f"  claim     {self._claim_text()}")
        for i, p in enumerate(self.parameters or ["(no placeholders)"]):
            lines.append(f"  {'params' if i == 0 else '':<9} {p}")
        lines.append(f"  scratch   {self.scratch}, dropped afterwards")
        lines.append(f"  server    {self.server}")
        for i, s in enumerate(self.seed):
            lines.append(f"  {'seed' if i == 0 else '':<9} {s}")
        lines += ["", "static analysis"]
        lines += ["  " + ln for ln in render_text(self.static, fixes=fixes).splitlines()]
        lines.append("")
        if self.load is None:
            lines.append(f"load: skipped: {self.load_note}")
        else:
            lines += _load_lines(self.load)
        lines += ["", "replay: two sessions step by step; pg_blocking_pids shows who waits"]
        lines += ["  " + ln for ln in self.timeline.format().splitlines()]
        for other in self.other_replays:
            verdict = (
                f"both hold {', '.join(map(str, other.double_claimed))}"
                if other.double_claimed
                else "disjoint"
            )
            lines.append(f"  also replayed, schedule {other.schedule!r}: {verdict}")
        lines += ["", self._verdict()]
        return "\n".join(lines)

    def _verdict(self) -> str:
        if not self.raced:
            return (
                "no race observed: no row was claimed twice under load, and in the replay "
                "the two sessions hold disjoint sets"
            )
        parts = []
        if self.load is not None and self.load.double_claims:
            parts.append(
                f"{self.load.double_claims} double claims of {self.load.duplicate_jobs} rows "
                f"under load"
            )
        if self.timeline.double_claimed:
            ids = ", ".join(map(str, self.timeline.double_claimed))
            parts.append(f"in the replay A and B both hold {ids}")
        return "RACE: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "claim": {
                "path": self.claim_path,
                "unit": self.plan.unit,
                "statements": [{"line": s.line, "kind": s.kind} for s in self.plan.statements],
                "table": self.table,
                "key": self.key,
                "parameters": self.parameters,
            },
            "scratch": self.scratch,
            "seed": self.seed,
            "static": json.loads(render_json(self.static)),
            "load": self.load.to_dict() if self.load is not None else None,
            "load_skipped": self.load_note,
            "replay": self.timeline.to_dict(),
            "other_replays": [t.to_dict() for t in self.other_replays],
            "race": self.raced,
            "exit_code": self.exit_code,
        }


def _load_lines(r: RaceResult) -> list[str]:
    waits = ", ".join(f"{ev} {share:.0%}" for ev, share in r.lock_waits_by_event.items())
    sample = ", ".join(map(str, r.duplicate_ids[:10]))
    more = ", ..." if r.duplicate_jobs > 10 else ""
    rows = [
        f"load: {r.workers} workers, each with its own connection, claim until nothing is left",
        f"  rows              {r.jobs}",
        f"  claims            {r.claims} rows returned by {r.claim_calls} claim statements",
        f"  double-claimed    {r.duplicate_jobs} ids returned by more than one claim"
        + (f": {sample}{more}" if sample else ""),
        f"  duplicate rows    {r.double_claims} rows handed out again after an earlier claim",
        f"  unclaimed rows    {r.unclaimed_jobs}",
        f"  throughput        {r.throughput:,.0f} rows/s ({r.seconds:.2f} s)",
        f"  lock-wait share   {r.lock_wait_share:.0%} of worker samples waiting on a lock"
        + (f" ({waits})" if waits else ""),
    ]
    if r.reclaims:
        rows.append(
            f"  re-claims         {r.reclaims} rows a worker got back that it had claimed "
            "itself (nothing completes them here; not double claims)"
        )
    if r.deadlocks or r.serialization_retries:
        rows.append(
            f"  retried           {r.deadlocks} deadlocks, "
            f"{r.serialization_retries} serialization failures"
        )
    return rows
