"""Jepsen-style queue history: what every process saw, and a checker that can say no.

Each job carries a unique value (``payload["v"]``).  Producers record each enqueue as
invoked, then acknowledged (``ok``), definitely not done (``fail``) or of unknown outcome
(``info``: the connection broke mid-statement).  Workers record the life of each attempt
through ``Worker(on_event=...)``: claimed, started, completed, retried, failed,
timed_out, released, lease_lost, each with the worker, its pid, the lease token and the
attempt.  The fault injector records what it did to whom and when.  Every process
appends JSON lines to a file of its own with one ``write(2)`` per line, so a SIGKILL
loses at most the line being written.

The checker reads all of it plus a final read of the jobs table (the drain), which is
authoritative for what the database holds: a worker killed between the commit of its
completion and the history line still shows up, as an unlogged completion.

Workflows: a producer that writes a small DAG in one transaction records, on its
enqueue line, the workflow's id, its shape and its edges (parent value, child value).
The checker then holds every child to the dependency contract: no attempt of it
started before each parent's completion committed (the row's ``finished`` time, taken
in that transaction, so earlier than any claim it made possible; this compares the
server's clock with the workers', one host in a chaos run), none released before a
parent's completion (both on the server's clock), none stranded
``waiting`` once its parents finished, and, when the run logged the releases (a
trigger on waiting -> pending), each child released once if its parents all completed
and never if one of them failed.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from skiplock import Job

__all__ = [
    "ALLOWED_CAUSES",
    "CheckResult",
    "DuplicateExecution",
    "HistoryWriter",
    "check",
    "load_history",
]

Record = dict[str, Any]

# A job whose holder was killed or frozen past its lease runs again: that is the lease
# doing its work, not a bug.  So does a job whose claim, heartbeat or completion a
# server crash took back (counted apart as ``reexecuted_after_crash``).  Anything else
# that runs a job twice is reported as invalid.
# "unwritten": the holder had its attempt's outcome (a timeout, say) but an outage kept
# it from writing it until the lease ran out, so the job ran again: the documented
# at-least-once rerun of an outcome that never reached the database.
ALLOWED_CAUSES = frozenset({"killed", "paused", "crash", "unwritten"})

# Attempt endings that hand the job back through a committed fenced write: the next
# attempt is a retry, not a duplicate.
_HANDED_BACK = frozenset({"retried"})
_ENDINGS = frozenset({"completed", "retried", "failed", "released", "timed_out", "lease_lost"})
# Faults that take the database or the path to it away from a living worker.
_OUTAGES = (
    "failover",
    "patroni",
    "crash",
    "restart",
    "maxconn",
    "readonly",
    "exhaust",
    "proxy",
    "terminate",
)


class HistoryWriter:
    """Appends one JSON object per line to ``path``; safe to share between threads."""

    def __init__(self, path: str | Path, *, process: str | None = None) -> None:
        self.path = Path(path)
        self.process = process or f"pid-{os.getpid()}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        rec = {"t": time.time(), **record}
        line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
        # One unbuffered write per line: nothing sits in a userspace buffer when the
        # process is killed, so a SIGKILL costs at most this line.
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line)

    def job_event(self, event: str, job: Job, *, worker: str) -> None:
        """The ``Worker(on_event=...)`` hook: one line per event of an attempt."""
        payload = job.payload if isinstance(job.payload, dict) else {}
        self.write(
            {
                "ev": event,
                "v": payload.get("v"),
                "id": job.id,
                "tok": str(job.lease_token) if job.lease_token else None,
                "att": job.attempts,
                "w": worker,
                "pid": os.getpid(),
            }
        )

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def load_history(directory: str | Path) -> tuple[list[Record], int]:
    """All records of every ``*.jsonl`` file in ``directory``, sorted by time.

    Returns the records and how many lines could not be parsed (the torn last line of
    a process killed mid-write).
    """
    records: list[Record] = []
    torn = 0
    for path in sorted(Path(directory).glob("*.jsonl")):
        with path.open("rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    torn += 1
                    continue
                if isinstance(rec, dict):
                    records.append(rec)
                else:
                    torn += 1
    records.sort(key=lambda r: float(r.get("t", 0.0)))
    return records, torn


@dataclass(frozen=True)
class DuplicateExecution:
    """A job started again while its previous attempt had not handed it back."""

    value: str
    job_id: int | None
    cause: str  # killed | paused | crash | restart | proxy | terminate | exhaust | none
    prev_worker: str | None
    prev_pid: int | None
    next_worker: str | None
    allowed: bool


@dataclass
class CheckResult:
    attempted: int = 0
    acknowledged: int = 0
    unknown: int = 0
    failed_enqueues: int = 0
    completed: int = 0
    failed_as_expected: int = 0
    executions: int = 0
    retries: int = 0
    unlogged_completions: int = 0
    torn_lines: int = 0
    lost: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    duplicated_executions: list[DuplicateExecution] = field(default_factory=list)
    duplicated_completions: list[dict[str, Any]] = field(default_factory=list)
    # Acknowledged completions a server crash took back (asynchronous commit): the
    # job ran again.  Not a double completion: the database holds one finish.
    completions_lost_in_crash: list[dict[str, Any]] = field(default_factory=list)
    reexecuted_after_crash: int = 0
    crashes: int = 0
    # Per restart or crash: seconds from the server being back to the first claim by
    # any worker, and to the moment every worker that was claiming before had claimed.
    back_to_claim: list[float | None] = field(default_factory=list)
    back_to_claim_all: list[float | None] = field(default_factory=list)
    # Per restart, crash or failover: seconds from the server being back (the standby
    # promoted) to the first enqueue a producer saw acknowledged.
    back_to_enqueue: list[float | None] = field(default_factory=list)
    # Summed counters of the workers that exited cleanly (killed ones write none).
    worker_stats: dict[str, int] = field(default_factory=dict)
    lease_lost_rejections: int = 0
    lease_lost_violations: list[dict[str, Any]] = field(default_factory=list)
    # Jobs expected to end cancelled (a workflow step below a failing one) that did.
    cancelled_as_expected: int = 0
    # Workflows that committed, by shape; their steps, the runs of those steps, and the
    # steps that end done.
    workflows: int = 0
    workflow_shapes: dict[str, int] = field(default_factory=dict)
    workflow_steps: int = 0
    workflow_step_runs: int = 0
    workflow_steps_done: int = 0
    # Steps with parents; releases logged for them (None: the run logged none).
    workflow_children: int = 0
    workflow_releases: int | None = None
    # Re-runs of workflow steps: explained by an allowed cause, or not.
    workflow_reruns_explained: int = 0
    workflow_reruns_unexplained: int = 0
    # Child starts whose parent's completion a crash took back (asynchronous commit).
    workflow_starts_taken_back: int = 0
    # The smallest margin seen between a parent's completion (its transaction's start)
    # and a child's start: how tight the early-start check was in this run.
    workflow_min_start_margin: float | None = None
    # A child attempt that started before a parent's completion (or with the parent
    # never completed); a child still waiting with every parent finished; a child
    # released other than once (or released although a parent failed).
    early_starts: list[dict[str, Any]] = field(default_factory=list)
    stranded_waiting: list[dict[str, Any]] = field(default_factory=list)
    early_releases: list[dict[str, Any]] = field(default_factory=list)
    release_mismatches: list[dict[str, Any]] = field(default_factory=list)
    kills: int = 0
    pauses: int = 0
    recovery_seconds: list[float | None] = field(default_factory=list)
    throughput: dict[str, float] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def causes(self) -> dict[str, int]:
        return dict(Counter(d.cause for d in self.duplicated_executions))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["valid"] = self.valid
        out["duplicated_execution_causes"] = self.causes()
        return out


@dataclass
class _Attempt:
    token: str
    value: str
    job_id: int | None
    att: int
    pid: int | None = None
    worker: str | None = None
    first_t: float = float("inf")
    start_t: float | None = None
    events: list[tuple[float, str]] = field(default_factory=list)

    def ended_before(self, t: float) -> bool:
        return any(ev in _ENDINGS and et <= t for et, ev in self.events)

    def has(self, *names: str) -> bool:
        return any(ev in names for _, ev in self.events)


def check(
    records: Iterable[Record],
    final_rows: Iterable[Mapping[str, Any]],
    *,
    allowed_causes: frozenset[str] = ALLOWED_CAUSES,
    torn_lines: int = 0,
    crash_loses_commits: bool = False,
) -> CheckResult:
    """Check a history against the final state of the jobs table.

    ``final_rows`` has one mapping per row: ``v`` (the value), ``id``, ``status``,
    ``token`` (the lease token kept on the row) and optionally ``last_error``.
    ``crash_loses_commits``: workers committed asynchronously, so a finish reported
    before a server crash may be gone after it (and the job run again); such a finish
    is counted in ``completions_lost_in_crash``, not as a double completion.  With
    synchronous commit the same history is a double completion: a durable finish
    cannot vanish.
    """
    res = CheckResult(torn_lines=torn_lines)
    recs = sorted(records, key=lambda r: float(r.get("t", 0.0)))
    enq = _enqueues(recs)
    expected: dict[str, str] = enq["expected"]
    acked: set[str] = enq["ok"]
    unknown: set[str] = enq["info"] - acked
    failed: set[str] = enq["fail"] - acked - unknown
    res.attempted = len(enq["invoked"])
    res.acknowledged, res.unknown, res.failed_enqueues = len(acked), len(unknown), len(failed)

    attempts: dict[str, _Attempt] = {}
    by_value: dict[str, list[_Attempt]] = defaultdict(list)
    faults: list[Record] = []
    phases: list[tuple[float, str]] = []
    completions: dict[str, list[tuple[str, str, float | None]]] = defaultdict(list)
    lease_lost: list[tuple[str, str]] = []
    claims: list[tuple[float, str]] = []
    produced: list[float] = []  # producers' acknowledged enqueues (not the markers)
    for r in recs:
        ev, t = r.get("ev"), float(r.get("t", 0.0))
        if ev == "claimed":
            claims.append((t, str(r.get("w"))))
        if ev == "enqueue" and r.get("ph") == "ok" and r.get("p") is not None:
            produced.append(t)
        if ev == "proc" and r.get("what") == "stats":
            for k, n in {**r.get("stats", {}), "reconnects": r.get("reconnects", 0)}.items():
                res.worker_stats[k] = res.worker_stats.get(k, 0) + int(n)
        if ev == "fault":
            faults.append(r)
        elif ev == "phase":
            phases.append((t, str(r.get("name"))))
        elif isinstance(ev, str) and r.get("tok") and r.get("v") is not None:
            v, tok = str(r["v"]), str(r["tok"])
            a = attempts.get(tok)
            if a is None:
                a = attempts[tok] = _Attempt(tok, v, r.get("id"), int(r.get("att") or 0))
                by_value[v].append(a)
            a.pid, a.worker = r.get("pid", a.pid), r.get("w", a.worker)
            a.first_t = min(a.first_t, t)
            a.events.append((t, ev))
            res.events[ev] = res.events.get(ev, 0) + 1
            if ev == "started" and a.start_t is None:
                a.start_t = t
                res.executions += 1
            elif ev in ("completed", "failed"):
                # One write reported twice is still one finish; two tokens are two.
                if not any(c[0] == tok and c[1] == ev for c in completions[v]):
                    completions[v].append((tok, ev, t))
            elif ev == "retried":
                res.retries += 1
            elif ev == "lease_lost":
                lease_lost.append((v, tok))
    res.lease_lost_rejections = len(lease_lost)

    # The final read: a row done or failed under a token no history line finished is a
    # completion whose line died with its process (or a sweep that ran out of attempts).
    rows: dict[str, Mapping[str, Any]] = {}
    for row in final_rows:
        if row.get("v") is None:
            continue
        v = str(row["v"])
        rows[v] = row
        status, tok = row.get("status"), str(row.get("token"))
        if status in ("done", "failed") and not any(c[0] == tok for c in completions[v]):
            kind = "completed" if status == "done" else "failed"
            completions[v].append((tok, kind, None))
            if kind == "completed":
                res.unlogged_completions += 1

    # A crash spans its record's time (just before the shutdown) to the server's return;
    # a failover, the primary's kill to the standby's promotion.  Either can take back
    # commits already acknowledged (asynchronous commit; asynchronous replication).
    crashes = sorted(
        (float(f["t"]), float(f["t"]) + float(f.get("down") or 0.0))
        for f in faults
        if f.get("f") in ("crash", "failover")
    )
    res.crashes = sum(1 for f in faults if f.get("f") == "crash")
    seen_values = set(by_value) | set(rows) | set(completions)
    for v in sorted(seen_values):
        done = [c for c in completions[v] if c[1] == "completed"]
        never = v not in enq["invoked"] or v in failed
        if never and (done or v in by_value or v in rows):
            res.unexpected.append(v)
        if done and v in unknown:
            res.recovered.append(v)
        finishes = completions[v]
        if len(finishes) > 1:
            detail = {"value": v, "finishes": [{"token": c[0], "kind": c[1]} for c in finishes]}
            if crash_loses_commits and _taken_back(finishes, rows.get(v), crashes):
                res.completions_lost_in_crash.append(detail)
            else:
                res.duplicated_completions.append(detail)
    for v in sorted(acked):
        kinds = {c[1] for c in completions[v]}
        want = expected.get(v, "done")
        if "completed" in kinds:
            res.completed += 1
        elif want == "failed" and "failed" in kinds:
            res.failed_as_expected += 1
        elif want == "cancelled" and rows.get(v, {}).get("status") == "cancelled":
            res.cancelled_as_expected += 1
        else:
            row = rows.get(v, {})
            res.lost.append(
                {
                    "value": v,
                    "id": row.get("id"),
                    "status": row.get("status"),
                    "last_error": row.get("last_error"),
                }
            )
    res.completed += len([v for v in res.recovered if v not in acked])

    kills = [f for f in faults if f.get("f") == "kill"]
    pauses = [f for f in faults if f.get("f") == "pause"]
    res.kills, res.pauses = len(kills), len(pauses)
    res.duplicated_executions = _duplicates(by_value, faults, allowed_causes)
    res.reexecuted_after_crash = sum(
        1 for d in res.duplicated_executions if d.cause in ("crash", "failover")
    )
    res.recovery_seconds = [_recovery(k, attempts, by_value) for k in kills]
    res.throughput = _throughput(phases, completions)
    for f in faults:
        if f.get("f") in ("restart", "crash", "failover", "patroni"):
            first, every = _back_to_claim(f, claims)
            res.back_to_claim.append(first)
            res.back_to_claim_all.append(every)
            back = _back(f)
            res.back_to_enqueue.append(min((t - back for t in produced if t >= back), default=None))

    if enq["workflows"]:
        committed = acked | set(res.recovered) | set(rows)
        lossy = crashes if crash_loses_commits else []
        _check_workflows(res, enq["workflows"], committed, by_value, rows, completions, lossy)

    for v, tok in lease_lost:
        # A rejected write must change nothing: the attempt that was told "lease lost"
        # cannot also be the one whose completion the database holds.
        if any(c[0] == tok and c[1] == "completed" for c in completions[v]):
            res.lease_lost_violations.append({"value": v, "token": tok})

    _verdict(res)
    return res


_FINAL = frozenset({"done", "failed", "cancelled"})


def _check_workflows(
    res: CheckResult,
    workflows: dict[str, dict[str, Any]],
    committed: set[str],
    by_value: dict[str, list[_Attempt]],
    rows: dict[str, Mapping[str, Any]],
    completions: dict[str, list[tuple[str, str, float | None]]],
    lossy: list[tuple[float, float]],
) -> None:
    """Hold every committed workflow's children to the dependency contract.

    ``lossy``: the crashes (down, back) that could take back acknowledged commits.  A
    child started before one of them may have had its parent's completion (and its own
    release and claim, later in the WAL) taken back, the parent then completing again
    later: that start is counted apart, not as early.
    """
    shapes: Counter[str] = Counter()
    steps: set[str] = set()
    for wf_id, wf in sorted(workflows.items()):
        values: list[str] = wf["values"]
        # Written in one transaction: any step seen acknowledged or in the table means
        # the whole graph committed; none seen means none of it did.
        if not any(v in committed for v in values):
            continue
        res.workflows += 1
        shapes[wf["shape"]] += 1
        parents_of: dict[str, list[str]] = defaultdict(list)
        for p, c in wf["edges"]:
            parents_of[c].append(p)
        for v in values:
            steps.add(v)
            res.workflow_steps += 1
            row = rows.get(v, {})
            starts = sorted(a.start_t for a in by_value.get(v, []) if a.start_t is not None)
            res.workflow_step_runs += len(starts)
            if row.get("status") == "done":
                res.workflow_steps_done += 1
            parents = parents_of.get(v)
            if not parents:
                continue
            res.workflow_children += 1
            statuses = {p: rows.get(p, {}).get("status") for p in parents}
            if row.get("status") == "waiting" and all(s in _FINAL for s in statuses.values()):
                res.stranded_waiting.append(
                    {"workflow": wf_id, "value": v, "id": row.get("id"), "parents": statuses}
                )
            releases = row.get("releases")
            if releases is not None:
                # Both times on the server's clock: a release before a parent's
                # completion began is early whatever the hosts' clocks say.
                for p in parents:
                    finished = rows.get(p, {}).get("finished")
                    for at in releases:
                        if finished is not None and float(at) < float(finished):
                            res.early_releases.append(
                                {"workflow": wf_id, "value": v, "parent": p, "released": at}
                            )
                n = len(releases)
                res.workflow_releases = (res.workflow_releases or 0) + n
                # Released once when every parent completed; never when one did not (the
                # child is cancelled, or still waits for a parent the drain left behind).
                want = 1 if all(s == "done" for s in statuses.values()) else 0
                if n != want:
                    res.release_mismatches.append(
                        {"workflow": wf_id, "value": v, "releases": n, "parents": statuses}
                    )
            for p in parents:
                done_t = _done_time(rows.get(p, {}), completions[p])
                for started in starts:
                    if done_t is not None and started >= done_t:
                        margin = started - done_t
                        best = res.workflow_min_start_margin
                        res.workflow_min_start_margin = (
                            margin if best is None else min(best, margin)
                        )
                        continue
                    if done_t is not None and any(
                        started <= up and down <= done_t for down, up in lossy
                    ):
                        res.workflow_starts_taken_back += 1
                        continue
                    res.early_starts.append(
                        {
                            "workflow": wf_id,
                            "value": v,
                            "parent": p,
                            "started": started,
                            "parent_done": done_t,
                        }
                    )
    res.workflow_shapes = dict(sorted(shapes.items()))
    for d in res.duplicated_executions:
        if d.value in steps:
            if d.allowed:
                res.workflow_reruns_explained += 1
            else:
                res.workflow_reruns_unexplained += 1


def _done_time(
    row: Mapping[str, Any], finishes: list[tuple[str, str, float | None]]
) -> float | None:
    """When the parent's completion committed, at the latest: the row's ``finished``
    (the completing transaction's start), else the first completion a worker logged
    (written after the commit, so later than it: it can only make a child look early).
    None: the parent never completed."""
    if row.get("status") not in (None, "done"):
        return None
    if row.get("finished") is not None:
        return float(row["finished"])
    logged = [t for _, kind, t in finishes if kind == "completed" and t is not None]
    return min(logged, default=None)


def _taken_back(
    finishes: list[tuple[str, str, float | None]],
    row: Mapping[str, Any] | None,
    crashes: list[tuple[float, float]],
) -> bool:
    """Every finish but the one the database holds was reported before a crash that
    came before the next finish: the crash took it back, nothing finished twice."""
    held = str(row.get("token")) if row is not None else None
    if held is None or not any(c[0] == held for c in finishes):
        return False
    timed = sorted(finishes, key=lambda c: float("inf") if c[2] is None else c[2])
    for earlier, later in itertools.pairwise(timed):
        t0, t1 = earlier[2], later[2]
        if earlier[0] == held or t0 is None:
            return False
        end = float("inf") if t1 is None else t1
        if not any(t0 <= up and down <= end for down, up in crashes):
            return False
    return timed[-1][0] == held


def _enqueues(recs: list[Record]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "invoked": set(),
        "ok": set(),
        "info": set(),
        "fail": set(),
        "expected": {},
        "workflows": {},
    }
    for r in recs:
        if r.get("ev") != "enqueue":
            continue
        values = [str(x) for x in r.get("vs") or ([r["v"]] if "v" in r else [])]
        phase = r.get("ph")
        if phase == "invoke":
            out["invoked"].update(values)
            # A workflow's steps may end differently (below a failing step: cancelled).
            expects = r.get("expects") or {}
            for v in values:
                out["expected"][v] = str(expects.get(v, r.get("expect", "done")))
            if r.get("wf") is not None:
                out["workflows"][str(r["wf"])] = {
                    "shape": str(r.get("shape", "?")),
                    "values": values,
                    "edges": [(str(p), str(c)) for p, c in r.get("edges") or ()],
                }
        elif phase in ("ok", "info", "fail"):
            out[phase].update(values)
    return out


def _duplicates(
    by_value: dict[str, list[_Attempt]], faults: list[Record], allowed: frozenset[str]
) -> list[DuplicateExecution]:
    out: list[DuplicateExecution] = []
    for v, atts in by_value.items():
        started = sorted(
            (a for a in atts if a.start_t is not None), key=lambda a: (a.att, a.first_t)
        )
        for prev, nxt in itertools.pairwise(started):
            if prev.has(*_HANDED_BACK):
                continue
            assert nxt.start_t is not None
            cause = _cause(prev, nxt.start_t, faults)
            out.append(
                DuplicateExecution(
                    value=v,
                    job_id=nxt.job_id,
                    cause=cause,
                    prev_worker=prev.worker,
                    prev_pid=prev.pid,
                    next_worker=nxt.worker,
                    allowed=cause in allowed,
                )
            )
    out.sort(key=lambda d: d.value)
    return out


def _cause(prev: _Attempt, before: float, faults: list[Record]) -> str:
    """Why ``prev`` did not hand its job back before the next attempt started.

    A kill or pause of the holder's process before the next start explains it.  Its
    claim may have been read only after the pause (the reply sat in the socket), so
    the window is not bounded below by the holder's own first line.  Failing that, an
    outage between the holder's claim (less one lease, roughly) and the next start is
    named, so that a report says which fault the lease could not ride out.
    """
    for f in faults:
        if f.get("pid") == prev.pid and float(f["t"]) <= before:
            if f.get("f") == "kill":
                return "killed"
            if f.get("f") == "pause":
                return "paused"
    lo = prev.first_t - 10.0
    seen = {str(f["f"]) for f in faults if f.get("f") in _OUTAGES and lo <= float(f["t"]) <= before}
    # The biggest outage in the window is named when several overlap.
    name = next((name for name in _OUTAGES if name in seen), "none")
    # The holder had its attempt's outcome and no hand-back committed: it ended the
    # attempt itself (its timeout is recorded), or its fenced write of the outcome was
    # refused later because the lease had run out meanwhile (lease_lost: the worker
    # was alive and writing).  An outage in the window kept its heartbeats and that
    # write from the server until the lease ran out: the documented rerun.  A crash or
    # failover keeps its own name: it may have taken a commit back, counted apart.
    owed = prev.has("timed_out") or prev.has("lease_lost")
    if owed and name not in ("none", "crash", "failover") and not prev.has(*_HANDED_BACK):
        return "unwritten"
    return name


def _recovery(
    kill: Record, attempts: dict[str, _Attempt], by_value: dict[str, list[_Attempt]]
) -> float | None:
    """Seconds from a kill until every job its process held was running again."""
    t_kill = float(kill["t"])
    held = [
        a
        for a in attempts.values()
        if a.pid == kill.get("pid")
        and a.start_t is not None
        and a.start_t <= t_kill
        and not a.ended_before(t_kill)
    ]
    worst: float | None = None
    for a in held:
        later = [
            b.start_t
            for b in by_value[a.value]
            if b is not a and b.start_t is not None and b.start_t > t_kill
        ]
        if not later:
            continue  # its completion had committed before the kill: nothing to recover
        delta = min(later) - t_kill
        worst = delta if worst is None else max(worst, delta)
    return worst


def _back_to_claim(
    fault: Record, claims: list[tuple[float, str]]
) -> tuple[float | None, float | None]:
    """Seconds from the server's return to the first claim, and to the last worker's
    first claim (among workers that claimed in the 10 s before the fault)."""
    t0 = float(fault["t"])
    back = _back(fault)
    before = {w for t, w in claims if t0 - 10.0 <= t < t0}
    firsts: dict[str, float] = {}
    for t, w in claims:
        if t >= back and w not in firsts:
            firsts[w] = t - back
    first = min(firsts.values(), default=None)
    waited = [firsts.get(w) for w in before]
    every = None if not waited or None in waited else max(x for x in waited if x is not None)
    return first, every


def _back(fault: Record) -> float:
    """When the server was back (a restart's or crash's return, a standby's promotion)."""
    t0 = float(fault["t"])
    return float(fault.get("back") or t0 + float(fault.get("down") or 0.0))


def _throughput(
    phases: list[tuple[float, str]], completions: dict[str, list[tuple[str, str, float | None]]]
) -> dict[str, float]:
    """Completions per second in each phase (between a phase line and the next)."""
    if not phases:
        return {}
    times = sorted(t for cs in completions.values() for _, kind, t in cs if t is not None)
    out: dict[str, float] = {}
    bounds = sorted(phases)
    for (t0, name), (t1, _) in itertools.pairwise(bounds):
        if name == "end" or t1 <= t0:
            continue
        n = sum(1 for t in times if t0 <= t < t1)
        out[name] = round(n / (t1 - t0), 1)
    return out


def _verdict(res: CheckResult) -> None:
    if res.lost:
        res.problems.append(f"{len(res.lost)} acknowledged job(s) never completed")
    if res.unexpected:
        res.problems.append(f"{len(res.unexpected)} job(s) seen that were never enqueued")
    if res.duplicated_completions:
        res.problems.append(f"{len(res.duplicated_completions)} job(s) finished more than once")
    bad = [d for d in res.duplicated_executions if not d.allowed]
    if bad:
        causes = Counter(d.cause for d in bad)
        res.problems.append(
            f"{len(bad)} duplicated execution(s) not explained by a kill or pause: "
            + ", ".join(f"{c} {n}" for c, n in sorted(causes.items()))
        )
    if res.early_starts:
        n = len({e["value"] for e in res.early_starts})
        res.problems.append(f"{n} workflow step(s) started before a parent completed")
    if res.early_releases:
        n = len({e["value"] for e in res.early_releases})
        res.problems.append(f"{n} workflow step(s) released before a parent completed")
    if res.stranded_waiting:
        res.problems.append(
            f"{len(res.stranded_waiting)} workflow step(s) stranded waiting after their "
            "parents finished"
        )
    if res.release_mismatches:
        res.problems.append(
            f"{len(res.release_mismatches)} workflow step(s) released other than once"
        )
    if res.lease_lost_violations:
        res.problems.append(
            f"{len(res.lease_lost_violations)} write(s) reported as lease lost had committed"
        )
