"""``python -m skiplock_bench.stalls``: find what a claim stall (a claim round trip over
``--threshold-ms``) was waiting for.

A steady load runs on a scratch cluster of our own (initdb, removed after; the shared
server's settings are never touched): a producer process enqueues ``--rate`` jobs/s,
``--workers`` worker processes (``Worker``, defaults, no-op handler) serve them.  Every
claim's round trip is recorded with its wall-clock time through the worker's
``on_measure`` hook (``claim_seconds``); each is joined with what was going on then:

- in the worker process: whether the claim started from the head or the worker's
  position (ClaimCursor), the claim thread's and its backend's CPU time and run-queue
  wait over the claim (``/proc/.../schedstat``: time runnable but not running is time
  the machine had no CPU for it), a probe thread's lateness (a 10 ms sleep that wakes
  late: the GIL or the CPU), the claim thread's Python stack sampled every 10 ms, and
  the garbage collector's pauses;
- on the server: every backend's ``state`` / ``wait_event_type`` / ``wait_event`` in
  pg_stat_activity every ``--sample-ms`` (10), the checkpointer's and the WAL
  writer's included; checkpoint start and end from the log (``log_checkpoints``);
  statements slower than ``--log-min-ms`` from the log (``log_min_duration_statement``:
  its duration is the execution, not the commit's WAL flush that follows it);
  pg_stat_statements' mean and max execution and planning time per statement;
  pg_stat_wal's sync count and time;
- on the machine: PSI (``/proc/pressure/cpu`` and ``io``: time some task was stalled
  on a CPU or on IO) and dirty / writeback pages, every 100 ms;
- the producer's enqueue calls (each a commit with a NOTIFY): one that stalled at the
  same moment says the server, not the worker, was slow.

Each stall is then put in one class by what dominated it, and stalls of different
workers that overlap are grouped (the issue saw two replicas stall at once).  The
report is Markdown on stdout and in ``bench/results/stalls-<time>.md``, everything in
the matching ``.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .common import loadavg, log, percentile

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
SCHEMA = "stalls"

# What the scratch cluster logs: a line per checkpoint, per statement slower than
# --log-min-ms, per lock wait longer than deadlock_timeout, per autovacuum.
LOG_SETTINGS = {
    "log_checkpoints": "on",
    "log_autovacuum_min_duration": "0",
    "log_lock_waits": "on",
    "deadlock_timeout": "'50ms'",
    "log_line_prefix": "'%m [%p] '",
    "log_timezone": "'UTC'",
    "track_io_timing": "on",
    "track_wal_io_timing": "on",
    "pg_stat_statements.track_planning": "on",
}


# -- /proc ------------------------------------------------------------------------------


def schedstat(path: str) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of a task, or (0, 0)."""
    try:
        with open(path, encoding="ascii") as f:
            a, b, _ = f.read().split()
        return int(a), int(b)
    except (OSError, ValueError):
        return 0, 0


def _psi(kind: str) -> float:
    """Cumulative microseconds some task stalled on ``kind`` (cpu, io), or NaN."""
    try:
        with open(f"/proc/pressure/{kind}", encoding="ascii") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def _vmstat() -> tuple[int, int]:
    dirty = writeback = 0
    try:
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                if line.startswith("nr_dirty "):
                    dirty = int(line.split()[1])
                elif line.startswith("nr_writeback "):
                    writeback = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return dirty, writeback


# -- the worker process -----------------------------------------------------------------


class ClaimRecorder:
    """Wraps the worker's ClaimCursor: what each claim was (head or position, jobs) and
    what its thread and its backend did meanwhile (CPU, run-queue wait)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.cursor = worker._cursor
        self._start = self.cursor.start
        self._claimed = self.cursor.claimed
        self.cursor.start = self.start
        self.cursor.claimed = self.claimed
        self.claim_thread: int | None = None  # threading ident, for the stack sampler
        self.last: dict[str, Any] | None = None
        self._before: tuple[float, tuple[int, int], tuple[int, int], int] | None = None

    def _backend_pid(self) -> int:
        lanes = getattr(self.worker, "_lanes", [])
        conn = getattr(lanes[0], "_conn", None) if lanes else None
        try:
            return int(conn.info.backend_pid) if conn is not None and not conn.closed else 0
        except Exception:
            return 0

    def start(self, queue: str, now: float) -> Any:
        self.claim_thread = threading.get_ident()
        pid = self._backend_pid()
        tid = threading.get_native_id()
        self._before = (
            time.time(),
            schedstat(f"/proc/self/task/{tid}/schedstat"),
            schedstat(f"/proc/{pid}/schedstat") if pid else (0, 0),
            pid,
        )
        return self._start(queue, now)

    def claimed(self, queue: str, start: Any, jobs: Any, seconds: float, now: float) -> None:
        self._claimed(queue, start, jobs, seconds, now)
        if self._before is None:
            return
        t0, c0, b0, pid0 = self._before
        pid = self._backend_pid() or pid0
        tid = threading.get_native_id()
        c1 = schedstat(f"/proc/self/task/{tid}/schedstat")
        b1 = schedstat(f"/proc/{pid}/schedstat") if pid == pid0 and pid else b0
        self.last = {
            "t0": t0,
            "head": start is None,
            "jobs": len(jobs),
            "pid": pid,
            "client_cpu_ms": (c1[0] - c0[0]) / 1e6,
            "client_rq_ms": (c1[1] - c0[1]) / 1e6,
            "backend_cpu_ms": (b1[0] - b0[0]) / 1e6,
            "backend_rq_ms": (b1[1] - b0[1]) / 1e6,
        }


def child(spec: dict[str, Any]) -> None:
    """One worker process: serve until stdin closes, then write what was recorded."""
    from skiplock import Job, Queue, Worker

    job_s = float(spec.get("job_ms", 0.0)) / 1000.0

    def handler(job: Job) -> None:
        if job_s:
            time.sleep(job_s)

    claims: list[dict[str, Any]] = []
    recorder: ClaimRecorder | None = None

    def on_measure(name: str, value: float, queue: str | None) -> None:
        if name != "claim_seconds":
            return
        rec = {"t1": time.time(), "seconds": value}
        if recorder is not None and recorder.last is not None:
            rec.update(recorder.last)
            recorder.last = None
        claims.append(rec)  # the claim loop's thread only: no lock needed

    gcs: list[tuple[float, float, int]] = []
    gc_began: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_began[:] = [time.perf_counter(), time.time()]
        elif gc_began:
            secs = time.perf_counter() - gc_began[0]
            if secs > 0.001:
                gcs.append((gc_began[1], secs, int(info.get("generation", -1))))

    gc.callbacks.append(on_gc)
    q = Queue(spec["dsn"], schema=SCHEMA, max_size=1)
    w = Worker(
        q,
        handler,
        concurrency=spec["concurrency"],
        name=spec["name"],
        on_measure=on_measure,
    )
    recorder = ClaimRecorder(w)
    halt = threading.Event()
    late: list[tuple[float, float, float]] = []  # (wall time, ms late, of which run queue)
    stacks: list[tuple[float, str]] = []

    lane_pids: dict[str, int] = {}

    def probe() -> None:
        """Sleep 10 ms at a time; waking late means no GIL or no CPU for this thread.
        Also takes the claim thread's stack (a timestamped py-spy of one thread), and
        notes which backend serves which of the worker's connections."""
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        k = 0
        while not halt.is_set():
            k += 1
            if k % 50 == 1:
                for lane in list(getattr(w, "_lanes", [])):
                    conn = getattr(lane, "_conn", None)
                    if conn is not None and not conn.closed:
                        lane_pids[lane.role.split()[-1]] = conn.info.backend_pid
            s0 = schedstat(path)
            t = time.perf_counter()
            time.sleep(0.01)
            over = time.perf_counter() - t - 0.01
            now = time.time()
            if over > 0.005:
                late.append((now, over * 1000, (schedstat(path)[1] - s0[1]) / 1e6))
            tid = recorder.claim_thread if recorder is not None else None
            frame = sys._current_frames().get(tid) if tid is not None else None
            names: list[str] = []
            while frame is not None and len(names) < 4:
                names.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")
                frame = frame.f_back
            stacks.append((now, " < ".join(names)))
            if len(stacks) > 200_000:
                del stacks[:100_000]

    threading.Thread(target=probe, daemon=True).start()
    t = w.start()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()  # until the parent closes it
    w.stop()
    t.join(timeout=30)
    halt.set()
    q.close()
    # Keep the stacks sampled during the slow claims only.
    slow = [
        (c["t1"] - c["seconds"], c["t1"])
        for c in claims
        if c["seconds"] * 1000 >= spec["threshold_ms"]
    ]
    kept = [s for s in stacks if any(a <= s[0] <= b for a, b in slow)]
    out = {
        "name": spec["name"],
        "pid": os.getpid(),
        "claims": claims,
        "late": late,
        "gc": gcs,
        "stacks": kept,
        "lane_pids": lane_pids,
        "stats": w.stats.snapshot(),
    }
    Path(spec["out"]).write_text(json.dumps(out), encoding="utf-8")


def producer(spec: dict[str, Any]) -> None:
    """Enqueue ``rate`` jobs/s (``batch`` per call) until stdin closes; time every call."""
    from skiplock import Queue

    rate, batch = float(spec["rate"]), int(spec["batch"])
    calls: list[tuple[float, float]] = []
    halt = threading.Event()

    def stop_on_eof() -> None:
        sys.stdin.read()
        halt.set()

    threading.Thread(target=stop_on_eof, daemon=True).start()
    with Queue(spec["dsn"], schema=SCHEMA, max_size=1) as q:
        print(json.dumps({"ready": True}), flush=True)
        t0 = time.monotonic()
        n = 0
        while not halt.is_set():
            began, wall = time.perf_counter(), time.time()
            if batch == 1:
                q.enqueue({"n": n})
            else:
                q.enqueue_many([{"n": n + i} for i in range(batch)])
            calls.append((wall, time.perf_counter() - began))
            n += batch
            wait = t0 + n / rate - time.monotonic()
            if wait > 0:
                halt.wait(wait)
    Path(spec["out"]).write_text(json.dumps({"calls": calls, "jobs": n}), encoding="utf-8")


class Child:
    """A child process of this module, started in ``mode`` with ``spec``."""

    def __init__(self, mode: str, spec: dict[str, Any]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")) if p
        )
        self.out = Path(spec["out"])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skiplock_bench.stalls", f"--{mode}", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first or not json.loads(first).get("ready"):
            raise RuntimeError(f"{mode} child did not start")

    def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        data: dict[str, Any] = json.loads(self.out.read_text(encoding="utf-8"))
        self.out.unlink()
        return data


# -- the server sampler -----------------------------------------------------------------

# Wait events a background process shows when it has nothing to do.
_IDLE_WAITS = {
    "CheckpointerMain",
    "WalWriterMain",
    "BgWriterMain",
    "BgWriterHibernate",
    "AutoVacuumMain",
    "LogicalLauncherMain",
    "ArchiverMain",
    "SysLoggerMain",
    "CheckpointWriteDelay",
}


class Sampler:
    """pg_stat_activity every ``interval`` s (non-idle backends), /proc every 100 ms."""

    def __init__(self, dsn: str, interval: float) -> None:
        self.dsn = dsn
        self.interval = interval
        self.ticks: list[float] = []
        self.rows: list[tuple[float, int, str, str, str, str, str]] = []
        self.machine: list[tuple[float, float, float, int, int]] = []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        query = (
            "SELECT extract(epoch FROM clock_timestamp())::float8, pid, backend_type, "
            "coalesce(state, ''), coalesce(wait_event_type, ''), coalesce(wait_event, ''), "
            "left(query, 400) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        )
        with psycopg.connect(self.dsn, autocommit=True, application_name="stalls-sampler") as conn:
            next_t = time.monotonic()
            next_machine = next_t
            while not self._halt.is_set():
                rows = conn.execute(query, prepare=True).fetchall()
                if rows:
                    self.ticks.append(float(rows[0][0]))
                for t, pid, btype, state, wtype, wait, q in rows:
                    if btype == "client backend":
                        if state in ("idle", ""):
                            continue
                    elif wait in _IDLE_WAITS or not wait:
                        continue
                    self.rows.append((float(t), int(pid), str(btype), state, wtype, wait, q))
                now = time.monotonic()
                if now >= next_machine:
                    d, wb = _vmstat()
                    self.machine.append((time.time(), _psi("cpu"), _psi("io"), d, wb))
                    next_machine += 0.1
                next_t += self.interval
                self._halt.wait(max(0.0, next_t - time.monotonic()))


# -- the server log ---------------------------------------------------------------------

_PREFIX = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) UTC \[(\d+)\] (\w+):  (.*)$")
_CKPT = re.compile(r"write=([\d.]+) s, sync=([\d.]+) s, total=([\d.]+) s.*longest=([\d.]+) s")
_DURATION = re.compile(r"duration: ([\d.]+) ms  (?:(\w+)[^:]*: )?(.*)")


@dataclass
class ServerLog:
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    slow: list[dict[str, Any]] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()


def parse_log(path: Path, namer: Namer) -> ServerLog:
    out = ServerLog()
    started: float | None = None
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _PREFIX.match(line)
        if not m:
            continue
        t, pid, msg = _epoch(m.group(1)), int(m.group(2)), m.group(4)
        if msg.startswith("checkpoint starting"):
            started = t
        elif msg.startswith("checkpoint complete"):
            c = _CKPT.search(msg)
            ck: dict[str, Any] = {"start": started if started is not None else t, "end": t}
            if c:
                ck.update(
                    write_s=float(c.group(1)),
                    sync_s=float(c.group(2)),
                    total_s=float(c.group(3)),
                    longest_sync_s=float(c.group(4)),
                )
            ck["line"] = msg[:300]
            out.checkpoints.append(ck)
            started = None
        elif (d := _DURATION.match(msg)) is not None:
            body = d.group(3)
            j = i + 1
            while j < len(lines) and not _PREFIX.match(lines[j]) and len(body) < 600:
                body += " " + lines[j].strip()
                j += 1
            ms = float(d.group(1))
            out.slow.append(
                {
                    "end": t,
                    "ms": ms,
                    "pid": pid,
                    "phase": d.group(2) or "statement",
                    "statement": namer.name(body),
                }
            )
        elif "automatic" in msg or "still waiting" in msg:
            out.other.append({"t": t, "pid": pid, "msg": msg[:300]})
    if started is not None:
        # Still running when the run ended (its write phase is spread over
        # checkpoint_completion_target x checkpoint_timeout): no sync phase seen yet.
        out.checkpoints.append({"start": started, "end": float("inf"), "line": "unfinished"})
    return out


class Namer:
    """skiplock's statement name for a query text (pg_stat_activity, the log, pgss)."""

    def __init__(self, schema: str) -> None:
        from skiplock.sqlfiles import statements

        from .server import _head

        self._head = _head
        stmts = statements(schema)
        self._heads = {n: _head(getattr(stmts, n).as_string(None)) for n in stmts.names()}
        # pg_stat_activity shows the first 1 kB of the text as sent, comment header and
        # all: the claim's header alone is longer than that.
        self._raw = {
            n: " ".join(getattr(stmts, n).as_string(None).split())[:120] for n in stmts.names()
        }

    def name(self, query: str) -> str:
        raw = " ".join(query.split())
        for name, r in self._raw.items():
            if r.startswith("--") and raw.startswith(r):
                return name
        head = self._head(query)
        if head.startswith("LISTEN"):
            return "listen"
        for name, h in self._heads.items():
            if h and head.startswith(h[:60]):
                return name
        return head[:40] or "?"


# -- analysis ---------------------------------------------------------------------------


def _label(state: str, wtype: str, wait: str) -> str:
    if state == "idle in transaction":
        return "idle in transaction"
    return f"{wtype}:{wait}" if wait else "on CPU (no wait event)"


def _count(labels: list[str]) -> str:
    counts: dict[str, int] = {}
    for x in labels:
        counts[x] = counts.get(x, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def analyse(
    workers: list[dict[str, Any]],
    prod: dict[str, Any],
    sampler: Sampler,
    slog: ServerLog,
    namer: Namer,
    threshold_ms: float,
) -> dict[str, Any]:
    import bisect

    rows = sorted(sampler.rows)
    row_t = [r[0] for r in rows]
    ticks = sorted(sampler.ticks)
    pid_role: dict[int, str] = {}
    for w in workers:
        for role, pid in w["lane_pids"].items():
            if pid:
                pid_role[int(pid)] = f"{w['name']} {role}"
    stalls = []
    for w in workers:
        for c in w["claims"]:
            if c["seconds"] * 1000 < threshold_ms:
                continue
            t1 = c["t1"]
            t0 = t1 - c["seconds"]
            lo, hi = bisect.bisect_left(row_t, t0), bisect.bisect_right(row_t, t1)
            inside = rows[lo:hi]
            n_ticks = bisect.bisect_right(ticks, t1) - bisect.bisect_left(ticks, t0)
            pid = int(c.get("pid") or 0)
            mine = [_label(r[3], r[4], r[5]) for r in inside if r[1] == pid]
            idle = n_ticks - len(mine)
            others = [
                f"{pid_role.get(r[1], r[2] if r[2] != 'client backend' else 'client')} "
                f"{namer.name(r[6]) if r[2] == 'client backend' else ''}: "
                f"{_label(r[3], r[4], r[5])}"
                for r in inside
                if r[1] != pid
            ]
            ck = [k for k in slog.checkpoints if k["start"] - 0.05 <= t1 and t0 <= k["end"] + 0.05]
            in_sync = [
                k for k in ck if t1 >= k["end"] - k.get("sync_s", 0.0) - 0.05 and t0 <= k["end"]
            ]
            slow = [
                f"{s['statement']} {s['phase']} {s['ms']:.0f} ms (pid {s['pid']})"
                for s in slog.slow
                if s["end"] - s["ms"] / 1000 <= t1 and t0 <= s["end"]
            ]
            enq = [d for t, d in prod["calls"] if t <= t1 and t0 <= t + d]
            other_claims = [
                (o["name"], oc["seconds"])
                for o in workers
                if o is not w
                for oc in o["claims"]
                if oc["t1"] - oc["seconds"] <= t1 and t0 <= oc["t1"]
            ]
            late = [(ms, rq) for t, ms, rq in w["late"] if t0 <= t <= t1 + 0.01]
            gcs = [(s, g) for t, s, g in w["gc"] if t <= t1 and t0 <= t + s]
            mach = [m for m in sampler.machine if t0 - 0.1 <= m[0] <= t1 + 0.1]
            psi_cpu = psi_io = float("nan")
            if len(mach) >= 2:
                span = mach[-1][0] - mach[0][0]
                psi_cpu = (mach[-1][1] - mach[0][1]) / 1e6 / span if span > 0 else psi_cpu
                psi_io = (mach[-1][2] - mach[0][2]) / 1e6 / span if span > 0 else psi_io
            stacks = _count([s.split(" < ")[0] for t, s in w["stacks"] if t0 <= t <= t1 and s])
            dur_ms = c["seconds"] * 1000
            s = {
                "worker": w["name"],
                "t0": t0,
                "ms": dur_ms,
                "head": c.get("head"),
                "jobs": c.get("jobs"),
                "client_rq_ms": c.get("client_rq_ms", float("nan")),
                "client_cpu_ms": c.get("client_cpu_ms", float("nan")),
                "backend_rq_ms": c.get("backend_rq_ms", float("nan")),
                "backend_cpu_ms": c.get("backend_cpu_ms", float("nan")),
                "samples": n_ticks,
                "backend": ", ".join(
                    x for x in (_count(mine), f"idle x{idle}" if idle > 0 else "") if x
                ),
                "backend_labels": mine,
                "backend_idle": idle,
                "others": _count(others),
                "checkpoint": bool(ck),
                "checkpoint_sync": bool(in_sync),
                "slow_log": slow,
                "enqueue_max_ms": max(enq) * 1000 if enq else 0.0,
                "other_claims_max_ms": max((x[1] for x in other_claims), default=0.0) * 1000,
                "probe_late_max_ms": max((x[0] for x in late), default=0.0),
                "probe_late_rq_ms": max((x[1] for x in late), default=0.0),
                "gc_ms": sum(x[0] for x in gcs) * 1000,
                "psi_cpu": psi_cpu,
                "psi_io": psi_io,
                "dirty_kb": max((m[3] for m in mach), default=0) * 4,
                "writeback_kb": max((m[4] for m in mach), default=0) * 4,
                "stack": stacks,
            }
            s["class"] = classify(s)
            stalls.append(s)
    stalls.sort(key=lambda s: s["t0"])
    # Stalls of different workers that overlap: one episode.
    episodes: list[list[dict[str, Any]]] = []
    for s in stalls:
        if episodes and s["t0"] <= max(x["t0"] + x["ms"] / 1000 for x in episodes[-1]):
            episodes[-1].append(s)
        else:
            episodes.append([s])
    # The whole run: where the client backends waited, by role or statement (a lock wait
    # on NOTIFY's commit lock would show as Lock:object; never seen is evidence too).
    waits: dict[str, int] = {}
    for r in rows:
        if r[2] != "client backend":
            key = f"{r[2]}: {_label(r[3], r[4], r[5])}"
        else:
            who = pid_role.get(r[1], "other")
            key = f"{who.split(' ', 1)[-1]} {namer.name(r[6])}: {_label(r[3], r[4], r[5])}"
        waits[key] = waits.get(key, 0) + 1
    return {"stalls": stalls, "episodes": episodes, "waits": waits}


def classify(s: dict[str, Any]) -> str:
    ms = s["ms"]
    labels = s["backend_labels"]
    n = max(1, s["samples"])
    wal = sum(1 for x in labels if x.startswith(("IO:WAL", "LWLock:WAL")))
    lock = sum(1 for x in labels if x.startswith(("Lock:", "LWLock:")) and "WAL" not in x)
    cpu = sum(1 for x in labels if x.startswith("on CPU"))
    if s["client_rq_ms"] >= 0.4 * ms:
        return "worker thread waited for a CPU (run queue)"
    if s["backend_rq_ms"] >= 0.4 * ms:
        return "backend waited for a CPU (run queue)"
    if wal >= 0.4 * n:
        return "commit waited for the WAL flush" + (
            " (checkpoint sync)" if s["checkpoint_sync"] else ""
        )
    if lock >= 0.4 * n:
        return "lock wait"
    if s["gc_ms"] >= 0.4 * ms:
        return "Python garbage collection"
    if cpu >= 0.4 * n and s["backend_cpu_ms"] >= 0.3 * ms:
        return "statement ran long on the server (CPU)"
    if s["backend_idle"] >= 0.5 * n and s["probe_late_max_ms"] >= 0.3 * ms:
        return "worker process: no GIL / no CPU after the server answered"
    if s["backend_idle"] >= 0.5 * n:
        return "server idle, worker busy elsewhere"
    return "mixed / unexplained"


def statements_report(dsn: str, namer: Namer) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, mean_exec_time, max_exec_time, stddev_exec_time, "
            "mean_plan_time, max_plan_time, wal_bytes FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC LIMIT 30"
        ).fetchall()
    out = []
    for q, calls, mean, mx, sd, pmean, pmax, wal in rows:
        out.append(
            {
                "statement": namer.name(str(q)),
                "calls": int(calls),
                "mean_ms": float(mean),
                "max_ms": float(mx),
                "stddev_ms": float(sd),
                "plan_mean_ms": float(pmean),
                "plan_max_ms": float(pmax),
                "wal_bytes_per_call": float(wal) / max(1, int(calls)),
            }
        )
    return out


def server_counters(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        wal = conn.execute(
            "SELECT wal_records, wal_fpi, wal_bytes::float8, wal_write, wal_sync, "
            "wal_write_time, wal_sync_time FROM pg_stat_wal"
        ).fetchone()
        bg = conn.execute(
            "SELECT checkpoints_timed, checkpoints_req, checkpoint_write_time, "
            "checkpoint_sync_time, buffers_checkpoint, buffers_backend_fsync "
            "FROM pg_stat_bgwriter"
        ).fetchone()
    keys_w = ("records", "fpi", "bytes", "writes", "syncs", "write_ms", "sync_ms")
    keys_b = ("timed", "requested", "write_ms", "sync_ms", "buffers", "backend_fsyncs")
    return {
        "wal": dict(zip(keys_w, [float(x) for x in wal or ()], strict=False)),
        "checkpoints": dict(zip(keys_b, [float(x) for x in bg or ()], strict=False)),
    }


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_reset_shared('wal')")
        conn.execute("SELECT pg_stat_reset_shared('bgwriter')")


# -- the run ----------------------------------------------------------------------------


def run(dsn: str, log_path: Path | None, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from skiplock import Queue

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name = ANY(%s)",
                (
                    [
                        "checkpoint_timeout",
                        "checkpoint_completion_target",
                        "max_wal_size",
                        "synchronous_commit",
                        "wal_sync_method",
                        "shared_buffers",
                        "autovacuum",
                        "full_page_writes",
                        "wal_compression",
                        "server_version",
                    ],
                ),
            ).fetchall()
        )
    with Queue(dsn, schema=SCHEMA, max_size=1) as q:
        q.migrate()
    namer = Namer(SCHEMA)
    _reset(dsn)
    spec = {
        "dsn": dsn,
        "concurrency": a.concurrency,
        "threshold_ms": a.threshold_ms,
        "job_ms": a.job_ms,
    }
    workers = [
        Child("child", spec | {"name": f"stalls-{i}", "out": str(tmp / f"w{i}.json")})
        for i in range(a.workers)
    ]
    sampler = Sampler(dsn, a.sample_ms / 1000.0)
    sampler.start()
    prod = Child(
        "producer",
        {"dsn": dsn, "rate": a.rate, "batch": a.batch, "out": str(tmp / "producer.json")},
    )
    began = time.time()
    log(f"stalls: {a.seconds:.0f} s of {a.rate:,.0f} jobs/s, {a.workers} worker processes")
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
        log(f"  t={time.time() - began:,.0f}s load {loadavg()}")
    produced = prod.finish()
    # Let the workers finish what is queued, then stop them.
    time.sleep(2.0)
    results = [w.finish() for w in workers]
    sampler.stop()
    ended = time.time()
    stmts = statements_report(dsn, namer)
    counters = server_counters(dsn)
    slog = parse_log(log_path, namer) if log_path is not None else ServerLog()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*), count(*) FILTER (WHERE status = 'done'), "
                "count(*) FILTER (WHERE completions > 1) FROM {}.jobs"
            ).format(sql.Identifier(SCHEMA))
        ).fetchone()
    an = analyse(results, produced, sampler, slog, namer, a.threshold_ms)
    return {
        "began": began,
        "ended": ended,
        "settings": settings,
        "workers": results,
        "producer": produced,
        "statements": stmts,
        "counters": counters,
        "log": {"checkpoints": slog.checkpoints, "slow": slog.slow, "other": slog.other},
        "samples": len(sampler.ticks),
        "sample_gaps_ms": _gaps(sampler.ticks),
        "jobs": {"rows": row[0], "done": row[1], "twice": row[2]} if row else {},
        **an,
    }


def _gaps(ticks: list[float]) -> dict[str, float]:
    d = [(b - a) * 1000 for a, b in itertools.pairwise(ticks)]
    if not d:
        return {}
    return {"p50": percentile(d, 50), "p99": percentile(d, 99), "max": max(d)}


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def report(r: dict[str, Any], a: argparse.Namespace) -> str:
    out = []
    secs = r["ended"] - r["began"]
    out.append(
        f"stalls: {secs:.0f} s, {a.rate:,.0f} jobs/s offered ({a.batch} per enqueue call), "
        f"{a.workers} worker processes x concurrency {a.concurrency}, stall = claim over "
        f"{a.threshold_ms:.0f} ms; server samples every {a.sample_ms:.0f} ms "
        f"({r['samples']:,} taken, gaps {r['sample_gaps_ms']})"
    )
    out.append(f"server: {r['settings']}; load {loadavg()}")
    out.append(f"jobs: {r['jobs']}")
    out.append("")
    out.append("| worker | claims | p50 ms | p99 ms | p99.9 ms | max ms | stalls | from head |")
    out.append("|---|---|---|---|---|---|---|---|")
    for w in r["workers"]:
        ms = [c["seconds"] * 1000 for c in w["claims"]]
        heads = sum(1 for c in w["claims"] if c.get("head"))
        n_st = sum(1 for x in ms if x >= a.threshold_ms)
        out.append(
            f"| {w['name']} | {len(ms):,} | {percentile(ms, 50):.2f} | {percentile(ms, 99):.2f} "
            f"| {percentile(ms, 99.9):.2f} | {max(ms, default=0):.1f} | {n_st} | {heads:,} |"
        )
    enq = [d * 1000 for _, d in r["producer"]["calls"]]
    out.append(
        f"\nenqueue calls: {len(enq):,}, p50 {percentile(enq, 50):.2f} ms, p99 "
        f"{percentile(enq, 99):.2f} ms, max {max(enq, default=0):.1f} ms, over threshold "
        f"{sum(1 for x in enq if x >= a.threshold_ms)}"
    )
    classes: dict[str, int] = {}
    for s in r["stalls"]:
        classes[s["class"]] = classes.get(s["class"], 0) + 1
    out.append(f"\nstalls by class: {classes or 'none'}")
    out.append(
        f"episodes (overlapping stalls of different workers count once): {len(r['episodes'])}, "
        f"of them with more than one worker: {sum(1 for e in r['episodes'] if len(e) > 1)}"
    )
    cks = r["log"]["checkpoints"]
    ck_time = sum(min(k["end"], r["ended"]) - k["start"] for k in cks)
    in_ck = sum(1 for s in r["stalls"] if s["checkpoint"])
    out.append(
        f"checkpoints: {len(cks)} ({ck_time:.0f} s of {secs:.0f} s); stalls during one: "
        f"{in_ck} of {len(r['stalls'])}; in a sync phase: "
        f"{sum(1 for s in r['stalls'] if s['checkpoint_sync'])}"
    )
    for k in cks:
        end = _clock(k["end"]) if k["end"] != float("inf") else "after the run"
        out.append(f"- {_clock(k['start'])} to {end}: {k.get('line', '')}")
    out.append("")
    out.append(
        "| at (UTC) | worker | ms | head | jobs | class | worker thread run-queue / CPU ms "
        "| backend run-queue / CPU ms | its backend, sampled | other backends, sampled "
        "| other claims / enqueue max ms | probe late ms | GC ms | PSI cpu / io | checkpoint "
        "| slow statements logged | claim thread's stack |"
    )
    out.append("|" + "---|" * 17)
    for s in r["stalls"][: a.max_rows]:
        out.append(
            f"| {_clock(s['t0'])} | {s['worker']} | {s['ms']:.0f} | {'yes' if s['head'] else 'no'} "
            f"| {s['jobs']} | {s['class']} | {s['client_rq_ms']:.0f} / {s['client_cpu_ms']:.0f} "
            f"| {s['backend_rq_ms']:.0f} / {s['backend_cpu_ms']:.0f} | {s['backend']} "
            f"| {s['others'][:200]} | {s['other_claims_max_ms']:.0f} / {s['enqueue_max_ms']:.0f} "
            f"| {s['probe_late_max_ms']:.0f} (rq {s['probe_late_rq_ms']:.0f}) | {s['gc_ms']:.0f} "
            f"| {s['psi_cpu']:.2f} / {s['psi_io']:.2f} "
            f"| {'sync' if s['checkpoint_sync'] else 'yes' if s['checkpoint'] else 'no'} "
            f"| {'; '.join(s['slow_log'])[:160]} | {s['stack'][:120]} |"
        )
    waits = sorted(r["waits"].items(), key=lambda kv: -kv[1])
    out.append(
        f"\nnon-idle samples over the whole run ({r['samples']:,} rounds), by role and "
        "statement: " + "; ".join(f"{k} x{v:,}" for k, v in waits[:25])
    )
    out.append("\npg_stat_statements (over the run):\n")
    out.append("| statement | calls | mean ms | max ms | stddev ms | plan max ms | WAL B/call |")
    out.append("|---|---|---|---|---|---|---|")
    for st in r["statements"][:12]:
        out.append(
            f"| {st['statement']} | {st['calls']:,} | {st['mean_ms']:.3f} | {st['max_ms']:.1f} "
            f"| {st['stddev_ms']:.2f} | {st['plan_max_ms']:.1f} | {st['wal_bytes_per_call']:,.0f} |"
        )
    w = r["counters"]["wal"]
    if w.get("syncs"):
        out.append(
            f"\npg_stat_wal: {w['syncs']:,.0f} syncs, {w['sync_ms'] / w['syncs']:.2f} ms mean "
            f"sync, {w['write_ms']:.0f} ms writing, {w['bytes'] / 1e6:,.0f} MB, "
            f"{w['fpi']:,.0f} full-page images; checkpoints: {r['counters']['checkpoints']}"
        )
    slow = r["log"]["slow"]
    if slow:
        by: dict[str, list[float]] = {}
        for x in slow:
            by.setdefault(f"{x['statement']} ({x['phase']})", []).append(x["ms"])
        out.append(
            "\nlogged over --log-min-ms: "
            + "; ".join(
                f"{k}: {len(v)}, max {max(v):.0f} ms, median {statistics.median(v):.0f}"
                for k, v in sorted(by.items(), key=lambda kv: -len(kv[1]))
            )
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skiplock_bench.stalls", description=__doc__)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--producer", help=argparse.SUPPRESS)
    p.add_argument(
        "--dsn",
        help="run on this server instead of a scratch cluster (no server log then: no "
        "checkpoint or slow-statement lines)",
    )
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--rate", type=float, default=500.0, help="jobs/s enqueued")
    p.add_argument("--batch", type=int, default=1, help="jobs per enqueue call (1: enqueue())")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--job-ms", type=float, default=0.0, help="handler sleep per job")
    p.add_argument("--threshold-ms", type=float, default=100.0, help="a stall: a claim over this")
    p.add_argument("--sample-ms", type=float, default=10.0, help="pg_stat_activity interval")
    p.add_argument("--log-min-ms", type=int, default=20, help="log_min_duration_statement")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the scratch cluster (e.g. checkpoint_timeout=30s); repeatable",
    )
    p.add_argument("--max-rows", type=int, default=60, help="stalls listed in the table")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    a = p.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    if a.producer:
        producer(json.loads(a.producer))
        return 0
    import tempfile

    from . import scratch

    extra = dict(LOG_SETTINGS)
    extra["log_min_duration_statement"] = str(a.log_min_ms)
    for item in a.set:
        k, _, v = item.partition("=")
        extra[k.strip()] = v.strip() if v.strip().replace(".", "").isdigit() else f"'{v.strip()}'"
    with tempfile.TemporaryDirectory(prefix="skiplock-stalls-") as tmpdir:
        if a.dsn:
            r = run(a.dsn, None, a, Path(tmpdir))
        else:
            info: dict[str, Path] = {}
            with scratch.cluster(extra, info=info) as dsn:
                r = run(dsn, info["log"], a, Path(tmpdir))
    r["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    text = report(r, a)
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (a.out / f"stalls-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    for w in r["workers"]:  # the JSON keeps the stalls' detail, not 100,000 claims each
        w["claims"] = [c for c in w["claims"] if c["seconds"] * 1000 >= a.threshold_ms / 2]
    r["producer"]["calls"] = [c for c in r["producer"]["calls"] if c[1] * 1000 >= 20]
    (a.out / f"stalls-{stamp}.json").write_text(json.dumps(r, default=str), encoding="utf-8")
    log(f"written {a.out}/stalls-{stamp}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
