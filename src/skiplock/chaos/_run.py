"""One chaos run: producers, worker processes and faults together, then drain and check.

The run has phases, each written to the history so throughput can be told apart:
``before`` (no faults), ``during`` (faults fire), ``after`` (faults stopped, producers
still on), ``drain`` (producers off, workers finish the backlog).  Then the workers
stop, the jobs table is read once more, and the checker judges the whole history.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock import ConfigError, DatabaseUnavailable, Queue, SkiplockError, Worker

from ._faults import (
    FAULTS,
    PATRONI_ONLY,
    REPEATED,
    REPLICATED_ONLY,
    SCRATCH_ONLY,
    ConnectionHog,
    FaultContext,
    LongTransaction,
    ScratchCluster,
    dead_tuples,
    inject,
    vacuum,
    wait_until,
)
from ._fleet import ProcessFleet
from ._history import ALLOWED_CAUSES, CheckResult, HistoryWriter, check, load_history
from ._patroni import PatroniCluster
from ._proxy import ChaosProxy, proxied_dsn, upstream_of
from ._replicated import ReplicatedCluster

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos"]

logger = logging.getLogger("skiplock.chaos")

# kind -> (max_attempts, expected end).  `ok` jobs get many attempts so that repeated
# kills and pauses cannot use them up: a job of the mix must end as its kind says.
KINDS: dict[str, tuple[int, str]] = {
    "ok": (50, "done"),
    "flaky": (50, "done"),
    "raise": (3, "failed"),
    "hang": (2, "failed"),
}
HANDLER_MIX = {"hang": 0.01, "raise": 0.02, "flaky": 0.05}

# Workflow shapes: (steps in the order written, edges parent -> child).  "doomed" is a
# chain whose head always raises: its two steps below must end cancelled, never run.
_CHORD_MEMBERS = tuple(f"m{i}" for i in range(5))
SHAPES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "chain": (("a", "b", "c"), (("a", "b"), ("b", "c"))),
    "diamond": (("a", "b", "c", "d"), (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"))),
    "chord": ((*_CHORD_MEMBERS, "cb"), tuple((m, "cb") for m in _CHORD_MEMBERS)),
    "doomed": (("a", "b", "c"), (("a", "b"), ("b", "c"))),
}
# How often each shape is written; a doomed chain now and then checks the cascade.
SHAPE_MIX = {"chain": 0.3, "diamond": 0.3, "chord": 0.3, "doomed": 0.1}


# How long the fault phase may run past its end to reach min_faults of each fault.  A
# fault needs a target (a worker holding jobs, a replacement that has started): on a
# loaded machine a short run can end its phase one kill short, and a run that promises
# a minimum should wait for it rather than report fewer (it ends anyway after this).
MIN_FAULTS_GRACE = 30.0


@dataclass
class ChaosConfig:
    duration: float = 60.0
    workers: int = 4
    rate: float = 100.0
    faults: tuple[str, ...] = ()
    dsn: str | None = None
    lease: float = 2.0
    sweep_interval: float = 0.5
    concurrency: int = 4
    job_timeout: float = 1.0
    work_ms: float = 10.0
    fault_interval: float = 3.0
    producers: int = 2
    mix: dict[str, float] | None = None
    min_faults: int = 1
    drain_timeout: float = 90.0
    exhaust_leave: int | None = None
    max_connections: int | None = None
    seed: int | None = None
    keep_history: str | None = None
    allowed_causes: frozenset[str] = ALLOWED_CAUSES
    # None: the Worker's own default.  False: a crash may take back an acknowledged
    # completion, and the checker counts the re-run instead of failing the run.
    synchronous_commit: bool | None = None
    # Restart the server exactly this often (seconds) instead of at random intervals.
    restart_every: float | None = None
    # The share of the duration with faults on; the rest is split before and after.
    fault_share: float = 0.6
    # failover: the primary waits for the standby before acknowledging a commit.
    sync_replication: bool = True
    # Workers complete each batch and claim the slots it frees in one transaction.
    # None: the Worker's own default.
    fuse_claims: bool | None = None
    # The worker processes run AsyncWorker (the handlers in threads of its loop).
    async_workers: bool = False
    # Producers also write small workflows (SHAPES), each in one transaction, at this
    # many a second in all (None: rate / 20 when workflows is on).
    workflows: bool = False
    workflow_rate: float | None = None

    def validate(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ConfigError(
                f"unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}"
            )
        if self.duration <= 0 or self.workers < 1 or self.rate <= 0:
            raise ConfigError("duration, workers and rate must be positive")
        if not 0 < self.fault_share <= 1:
            raise ConfigError(f"fault_share must be in (0, 1], not {self.fault_share!r}")
        if self.workflow_rate is not None and not self.workflow_rate > 0:
            raise ConfigError(f"workflow_rate must be positive, not {self.workflow_rate!r}")
        if self.restart_every is not None and not self.restart_every > 0:
            raise ConfigError(f"restart_every must be positive, not {self.restart_every!r}")
        if self.needs_replicas and (self.dsn is not None or self.needs_scratch):
            raise ConfigError(
                "failover runs on a primary and standby the run starts itself: drop --dsn, "
                "and do not combine it with restart, crash, exhaust, maxconn or readonly"
            )
        if self.needs_patroni and (
            self.dsn is not None or self.needs_scratch or self.needs_replicas
        ):
            raise ConfigError(
                "patroni runs on etcd and Patroni nodes the run starts itself: drop --dsn, "
                "and do not combine it with failover, restart, crash, exhaust, maxconn or "
                "readonly"
            )
        if self.needs_scratch and self.dsn is not None:
            raise ConfigError(
                "restart, crash, exhaust, maxconn and readonly run on a scratch cluster the run "
                "starts itself (the given server is never restarted, crashed or filled); "
                "drop --dsn"
            )

    @property
    def needs_scratch(self) -> bool:
        return any(f in self.faults for f in SCRATCH_ONLY)

    @property
    def needs_patroni(self) -> bool:
        return any(f in self.faults for f in PATRONI_ONLY)

    @property
    def needs_replicas(self) -> bool:
        return any(f in self.faults for f in REPLICATED_ONLY)

    @property
    def commits_may_be_lost(self) -> bool:
        """A commit acknowledged to a worker may be gone after a fault: asynchronous
        commit and a crash, or asynchronous replication and a failover."""
        return not self.worker_synchronous_commit or (
            self.needs_replicas and not self.sync_replication
        )

    @property
    def workflows_per_second(self) -> float:
        if not self.workflows:
            return 0.0
        return self.workflow_rate if self.workflow_rate is not None else self.rate / 20

    @property
    def worker_synchronous_commit(self) -> bool:
        """The commit mode the workers run with (the Worker's default when None)."""
        if self.synchronous_commit is not None:
            return self.synchronous_commit
        default = inspect.signature(Worker).parameters["synchronous_commit"].default
        return bool(default)

    @property
    def worker_fuse_claims(self) -> bool:
        """Whether the workers fuse claims with completions (the Worker's default when
        None)."""
        if self.fuse_claims is not None:
            return self.fuse_claims
        return bool(inspect.signature(Worker).parameters["fuse_claims"].default)


@dataclass
class ChaosReport:
    config: ChaosConfig
    result: CheckResult
    run_id: str
    dsn: str
    faults_injected: dict[str, int] = field(default_factory=dict)
    worker_exits: int = 0
    worker_start_retries: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    dead_tuples: dict[str, int | None] = field(default_factory=dict)
    drained: bool = True
    history_dir: str | None = None

    @property
    def valid(self) -> bool:
        return self.result.valid and self.drained and self.worker_exits == 0

    def to_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "valid": self.valid,
            "problems": r.problems
            + ([] if self.drained else ["the queue did not drain"])
            + ([f"{self.worker_exits} worker(s) exited"] if self.worker_exits else []),
            "run_id": self.run_id,
            "dsn": self.dsn,
            "duration": self.config.duration,
            "workers": self.config.workers,
            "rate": self.config.rate,
            "lease": self.config.lease,
            "synchronous_commit": self.config.worker_synchronous_commit,
            "fuse_claims": self.config.worker_fuse_claims,
            "async_workers": self.config.async_workers,
            "replication": (
                ("synchronous" if self.config.sync_replication else "asynchronous")
                if self.config.needs_replicas
                else None
            ),
            "faults": list(self.config.faults),
            "faults_injected": self.faults_injected,
            "enqueued": r.attempted,
            "acknowledged": r.acknowledged,
            "unknown_enqueues": r.unknown,
            "failed_enqueues": r.failed_enqueues,
            "recovered": len(r.recovered),
            "completed": r.completed,
            "failed_as_expected": r.failed_as_expected,
            "executions": r.executions,
            "retries": r.retries,
            "lost": len(r.lost),
            "lost_jobs": r.lost[:50],
            "unexpected": len(r.unexpected),
            "unexpected_values": r.unexpected[:50],
            "duplicated_executions": len(r.duplicated_executions),
            "duplicated_execution_causes": r.causes(),
            "duplicated_execution_details": [
                vars(d) for d in r.duplicated_executions if not d.allowed
            ][:50],
            "back_to_claim": [None if x is None else round(x, 3) for x in r.back_to_claim],
            "back_to_claim_every_worker": [
                None if x is None else round(x, 3) for x in r.back_to_claim_all
            ],
            "back_to_enqueue": [None if x is None else round(x, 3) for x in r.back_to_enqueue],
            "worker_stats": r.worker_stats,
            "reexecuted_after_crash": r.reexecuted_after_crash,
            "completions_lost_in_crash": len(r.completions_lost_in_crash),
            "completions_lost_in_crash_details": r.completions_lost_in_crash[:50],
            "crashes": r.crashes,
            "duplicated_completions": len(r.duplicated_completions),
            "duplicated_completion_details": r.duplicated_completions[:50],
            "lease_lost_rejections": r.lease_lost_rejections,
            "lease_lost_violations": len(r.lease_lost_violations),
            "unlogged_completions": r.unlogged_completions,
            "kills": r.kills,
            "pauses": r.pauses,
            "recovery_seconds": [None if s is None else round(s, 3) for s in r.recovery_seconds],
            "throughput": r.throughput,
            "events": r.events,
            "phases": self.phases,
            "dead_tuples": self.dead_tuples,
            "worker_exits": self.worker_exits,
            "worker_start_retries": self.worker_start_retries,
            "drained": self.drained,
            "torn_history_lines": r.torn_lines,
            "cancelled_as_expected": r.cancelled_as_expected,
            "workflows": self._workflows_json(),
            "history_dir": self.history_dir,
        }

    def _workflows_json(self) -> dict[str, Any] | None:
        if not self.config.workflows:
            return None
        r = self.result
        return {
            "workflows": r.workflows,
            "shapes": r.workflow_shapes,
            "steps": r.workflow_steps,
            "steps_done": r.workflow_steps_done,
            "step_runs": r.workflow_step_runs,
            "children": r.workflow_children,
            "releases": r.workflow_releases,
            "reruns_explained": r.workflow_reruns_explained,
            "reruns_unexplained": r.workflow_reruns_unexplained,
            "starts_taken_back_by_crash": r.workflow_starts_taken_back,
            "min_start_margin": (
                None
                if r.workflow_min_start_margin is None
                else round(r.workflow_min_start_margin, 4)
            ),
            "early_starts": len(r.early_starts),
            "early_releases": len(r.early_releases),
            "early_release_details": r.early_releases[:50],
            "early_start_details": r.early_starts[:50],
            "stranded_waiting": len(r.stranded_waiting),
            "stranded_waiting_details": r.stranded_waiting[:50],
            "release_mismatches": len(r.release_mismatches),
            "release_mismatch_details": r.release_mismatches[:50],
        }


class _Producer(threading.Thread):
    """Enqueues ``rate`` jobs a second, alternating COPY batches and single inserts."""

    def __init__(self, n: int, run: _Run, rate: float) -> None:
        super().__init__(name=f"chaos-producer-{n}", daemon=True)
        self.n, self.run_, self.rate = n, run, rate
        self.stop_evt = threading.Event()
        self.seq = 0
        self.wseq = 0
        self.rng = random.Random(run.rng.random())

    def run(self) -> None:
        cfg, run = self.run_.cfg, self.run_
        q = Queue(
            run.dsn,
            schema=run.schema,
            application_name=f"chaos-producer:{run.run_id}:{self.n}",
            max_size=2,
        )
        hist = run.history
        mix = cfg.mix if cfg.mix is not None else (HANDLER_MIX if "handlers" in cfg.faults else {})
        tick, owed, batch_turn = 0.05, 0.0, True
        wf_rate, wf_owed = cfg.workflows_per_second / cfg.producers, 0.0
        next_t = time.monotonic()
        try:
            while not self.stop_evt.is_set():
                wf_owed += wf_rate * tick
                while wf_owed >= 1.0:
                    wf_owed -= 1.0
                    shape = self.rng.choices(list(SHAPE_MIX), weights=list(SHAPE_MIX.values()))
                    self._workflow(q, hist, shape[0])
                owed += self.rate * tick
                count, owed = int(owed), owed - int(owed)
                if count:
                    by_kind: dict[str, list[dict[str, Any]]] = {}
                    for _ in range(count):
                        kind = self._kind(mix)
                        v = f"{run.run_id}:{self.n}:{self.seq}"
                        self.seq += 1
                        ms = round(self.rng.uniform(0, 2 * cfg.work_ms), 1)
                        by_kind.setdefault(kind, []).append({"v": v, "k": kind, "ms": ms})
                    for kind, payloads in by_kind.items():
                        self._enqueue(q, hist, kind, payloads, batch=batch_turn)
                    batch_turn = not batch_turn
                next_t += tick
                self.stop_evt.wait(max(next_t - time.monotonic(), 0.0))
        finally:
            q.close()

    def _kind(self, mix: dict[str, float]) -> str:
        x = self.rng.random()
        for kind, share in mix.items():
            if x < share:
                return kind
            x -= share
        return "ok"

    def _workflow(self, q: Queue, hist: HistoryWriter, shape: str) -> None:
        """Write one workflow of ``shape`` in one transaction through ``after=``; its
        enqueue line names every step and edge, so the checker can hold each child to
        its parents."""
        cfg, run = self.run_.cfg, self.run_
        wf = f"{run.run_id}:{self.n}:w{self.wseq}"
        self.wseq += 1
        steps, edges = SHAPES[shape]
        value = {step: f"{wf}:{step}" for step in steps}
        parents: dict[str, list[str]] = {step: [] for step in steps}
        for parent, child in edges:
            parents[child].append(parent)
        head_raises = shape == "doomed"
        expects = {
            value[step]: ("failed" if not parents[step] else "cancelled")
            for step in steps
            if head_raises
        }
        values = [value[step] for step in steps]
        hist.write(
            {
                "ev": "enqueue",
                "ph": "invoke",
                "vs": values,
                "k": "ok",
                "expect": "done",
                "expects": expects,
                "wf": wf,
                "shape": shape,
                "edges": [[value[p], value[c]] for p, c in edges],
            }
        )

        def payload(step: str) -> dict[str, Any]:
            kind = "raise" if head_raises and not parents[step] else "ok"
            ms = round(self.rng.uniform(0, 2 * cfg.work_ms), 1)
            return {"v": value[step], "k": kind, "ms": ms, "wf": wf}

        ids: dict[str, int] = {}
        try:
            with q.connection() as conn, conn.transaction():
                roots = [step for step in steps if not parents[step]]
                attempts = KINDS["raise" if head_raises else "ok"][0]
                # The roots in one statement (a chord's members), then each step below
                # once its parents have ids.
                root_ids = q.enqueue_many(
                    [payload(step) for step in roots], max_attempts=attempts, conn=conn
                )
                ids.update(zip(roots, root_ids, strict=True))
                for step in steps:
                    if parents[step]:
                        ids[step] = q.enqueue(
                            payload(step),
                            after=[ids[p] for p in parents[step]],
                            max_attempts=KINDS["ok"][0],
                            conn=conn,
                        )
        except Exception as exc:
            hist.write({"ev": "enqueue", "ph": _outcome(exc), "vs": values, "error": str(exc)})
            return
        hist.write(
            {
                "ev": "enqueue",
                "ph": "ok",
                "vs": values,
                "ids": [ids[step] for step in steps],
                "p": self.n,
            }
        )

    def _enqueue(
        self, q: Queue, hist: HistoryWriter, kind: str, payloads: list[dict[str, Any]], batch: bool
    ) -> None:
        attempts, expect = KINDS[kind]
        values = [p["v"] for p in payloads]
        hist.write({"ev": "enqueue", "ph": "invoke", "vs": values, "k": kind, "expect": expect})
        try:
            if batch or len(payloads) > 1:
                ids = q.enqueue_many(payloads, max_attempts=attempts)
            else:
                ids = [q.enqueue(payloads[0], max_attempts=attempts)]
        except Exception as exc:
            hist.write({"ev": "enqueue", "ph": _outcome(exc), "vs": values, "error": str(exc)})
            return
        hist.write({"ev": "enqueue", "ph": "ok", "vs": values, "ids": ids, "p": self.n})


def _outcome(exc: BaseException) -> str:
    """``fail`` only when skiplock says nothing was sent; anything else may have committed."""
    if isinstance(exc, DatabaseUnavailable) and (
        "cannot reach" in str(exc) or "nothing was written" in str(exc)
    ):
        return "fail"
    if isinstance(exc, SkiplockError) and not isinstance(exc, DatabaseUnavailable):
        return "fail"  # refused before any I/O: a bad payload or setting
    return "info"


class _Run:
    def __init__(self, cfg: ChaosConfig, progress: Any) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda _msg: None)
        self.rng = random.Random(cfg.seed)
        self.run_id = uuid.uuid4().hex[:8]
        self.schema = f"chaos_{self.run_id}"
        self.dsn = ""
        self.history: HistoryWriter
        self.samples: list[tuple[float, int]] = []

    def phase(self, name: str) -> float:
        self.history.write({"ev": "phase", "name": name})
        self.progress(f"phase {name}")
        return time.monotonic()


def run_chaos(cfg: ChaosConfig, progress: Any = None) -> ChaosReport:
    """Run producers, workers and the faults of ``cfg``, then drain and check."""
    cfg.validate()
    run = _Run(cfg, progress)
    from skiplock.connect import redact_dsn, server_dsn

    cluster: ScratchCluster | None = None
    replicated: ReplicatedCluster | None = None
    patroni: PatroniCluster | None = None
    tmp = Path(cfg.keep_history or tempfile.mkdtemp(prefix="skiplock-chaos-history-"))
    tmp.mkdir(parents=True, exist_ok=True)
    hist_dir = tmp / run.run_id if cfg.keep_history else tmp
    hist_dir.mkdir(parents=True, exist_ok=True)
    run.history = HistoryWriter(hist_dir / "driver.jsonl")
    proxy: ChaosProxy | None = None
    fleet: ProcessFleet | None = None
    ctx: FaultContext | None = None
    try:
        if cfg.needs_patroni:
            patroni = PatroniCluster()
            run.progress("starting etcd and two Patroni nodes (synchronous_mode)")
            run.dsn = patroni.start()
        elif cfg.needs_replicas:
            replicated = ReplicatedCluster(sync=cfg.sync_replication)
            mode = "synchronous" if cfg.sync_replication else "asynchronous"
            run.progress(f"starting a primary and a standby ({mode} replication)")
            run.dsn = replicated.start()
        elif cfg.needs_scratch:
            # Room for every worker's few connections, the producers and the hog's victims.
            filled = "exhaust" in cfg.faults or "maxconn" in cfg.faults
            default_max = cfg.workers * 5 + 20 if filled else None
            max_conn = cfg.max_connections or default_max
            cluster = ScratchCluster(max_connections=max_conn)
            run.progress("starting a scratch cluster")
            run.dsn = cluster.start()
        else:
            run.dsn = server_dsn(cfg.dsn)
        admin = Queue(run.dsn, schema=run.schema, application_name=f"chaos-admin:{run.run_id}")
        admin.migrate()
        admin.close()
        if cfg.workflows:
            _log_releases(run.dsn, run.schema)
        worker_dsn = run.dsn
        if "proxy" in cfg.faults:
            proxy = ChaosProxy(upstream_of(run.dsn))
            worker_dsn = proxied_dsn(run.dsn, proxy.start())
        spec = {
            "dsn": worker_dsn,
            "schema": run.schema,
            "run_id": run.run_id,
            "history_dir": str(hist_dir),
            "lease": cfg.lease,
            "sweep_interval": cfg.sweep_interval,
            "concurrency": cfg.concurrency,
            "job_timeout": cfg.job_timeout,
            "synchronous_commit": cfg.synchronous_commit,
            "fuse_claims": cfg.fuse_claims,
            "async_workers": cfg.async_workers,
        }
        fleet = ProcessFleet(spec, hist_dir, run.history)
        ctx = FaultContext(
            dsn=run.dsn,
            schema=run.schema,
            run_id=run.run_id,
            lease=cfg.lease,
            fleet=fleet,
            history=run.history,
            proxy=proxy,
            cluster=cluster,
            replicated=replicated,
            patroni=patroni,
            rng=random.Random(run.rng.random()),
        )
        report = _drive(run, fleet, ctx)
        report.dsn = redact_dsn(run.dsn)
        report.history_dir = str(hist_dir) if cfg.keep_history else None
        return report
    finally:
        if fleet is not None:
            fleet.stop()
        if ctx is not None:
            ctx.close()
        if proxy is not None:
            proxy.stop()
        run.history.close()
        if run.dsn:
            _drop_schema(run.dsn, run.schema, run.run_id)
        if cluster is not None:
            cluster.stop()
        if replicated is not None:
            replicated.stop()
        if patroni is not None:
            patroni.stop()
        if not cfg.keep_history:
            shutil.rmtree(tmp, ignore_errors=True)


def _drive(run: _Run, fleet: ProcessFleet, ctx: FaultContext) -> ChaosReport:
    cfg = run.cfg
    with fleet.lock:
        for slot in range(cfg.workers):
            fleet.spawn(slot)
    names = set(fleet.names())
    run.progress(f"starting {cfg.workers} worker processes")
    wait_until(lambda: _connected(ctx) >= len(names), 60, interval=0.1)

    sampler_stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(run, ctx, sampler_stop), daemon=True)
    sampler.start()
    producers = [_Producer(i, run, cfg.rate / cfg.producers) for i in range(cfg.producers)]
    calm = cfg.duration * (1.0 - cfg.fault_share) / 2
    before_s, during_s, after_s = calm, cfg.duration * cfg.fault_share, calm
    marks: dict[str, float] = {}
    dead: dict[str, int | None] = {}

    t0 = run.phase("before")
    for p in producers:
        p.start()
    _hold(fleet, before_s)
    dead["before"] = dead_tuples(ctx)[0]

    marks["before"] = time.monotonic() - t0
    t1 = run.phase("during")
    injected: Counter[str] = Counter()
    stop_faults = threading.Event()
    ctx.stop = stop_faults
    hog = _start_held(run, ctx, injected)
    threads = [
        threading.Thread(
            target=_fault_loop, args=(name, run, ctx, stop_faults, injected), daemon=True
        )
        for name in cfg.faults
        if name in REPEATED
    ]
    for t in threads:
        t.start()
    end = t1 + during_s
    wanted = [n for n in cfg.faults if n in REPEATED]
    while True:
        fleet.check()
        now = time.monotonic()
        enough = all(injected[n] >= cfg.min_faults for n in wanted)
        if now >= end and (enough or now >= end + max(during_s, MIN_FAULTS_GRACE)):
            break
        time.sleep(0.1)
    stop_faults.set()
    for t in threads:
        t.join(timeout=cfg.lease * 8 + 30)
    dead["during"] = max((d for t, d in run.samples if t >= t1), default=dead_tuples(ctx)[0])
    longtx = hog.get("longtx")
    if isinstance(longtx, LongTransaction):
        dead["vacuum_with_long_tx"] = vacuum(ctx)
        longtx.stop()
    if isinstance(hog.get("exhaust"), ConnectionHog):
        hog["exhaust"].stop()

    marks["during"] = time.monotonic() - t1
    t2 = run.phase("after")
    _hold(fleet, after_s)
    dead["after"] = dead_tuples(ctx)[0]
    if isinstance(longtx, LongTransaction):
        dead["vacuum_after_long_tx"] = vacuum(ctx)

    marks["after"] = time.monotonic() - t2
    t3 = run.phase("drain")
    for p in producers:
        p.stop_evt.set()
    for p in producers:
        p.join(timeout=60)

    def finished() -> bool:
        fleet.check()
        return _unfinished(ctx) == 0

    drained = wait_until(finished, cfg.drain_timeout, interval=0.2)
    marks["drain"] = time.monotonic() - t3
    run.phase("end")
    sampler_stop.set()
    sampler.join(timeout=5)
    fleet.stop()
    rows = _final_rows(ctx, releases=cfg.workflows)
    records, torn = load_history(fleet.dir)
    result = check(
        records,
        rows,
        # Across a failover that lost the WAL tail the fence cannot help: a completion
        # the old primary acknowledged is gone and the job runs again.
        allowed_causes=cfg.allowed_causes
        | (frozenset({"failover"}) if cfg.commits_may_be_lost else frozenset()),
        torn_lines=torn,
        crash_loses_commits=cfg.commits_may_be_lost,
    )
    retries = sum(1 for r in records if r.get("ev") == "proc" and r.get("what") == "start-retry")
    return ChaosReport(
        config=cfg,
        result=result,
        run_id=run.run_id,
        dsn="",
        faults_injected=dict(injected),
        worker_exits=fleet.exits,
        worker_start_retries=retries,
        phases={k: round(v, 2) for k, v in marks.items()},
        dead_tuples=dead,
        drained=drained,
    )


def _start_held(run: _Run, ctx: FaultContext, injected: Counter[str]) -> dict[str, Any]:
    """Start the faults that hold for the whole phase: a connection hog, a long tx."""
    out: dict[str, Any] = {}
    if "exhaust" in run.cfg.faults:
        leave = run.cfg.exhaust_leave or run.cfg.workers + 2
        hog = ConnectionHog(ctx.dsn, leave=leave, app=f"chaos-hog:{run.run_id}")
        n = hog.start()
        ctx.record("exhaust", held=n, leave=leave)
        out["exhaust"] = hog
        injected["exhaust"] += 1
    if "longtx" in run.cfg.faults:
        tx = LongTransaction(ctx.dsn, run.schema, app=f"chaos-longtx:{run.run_id}")
        tx.start()
        ctx.record("longtx", xid=tx.xmin)
        out["longtx"] = tx
        injected["longtx"] += 1
    if "handlers" in run.cfg.faults:
        injected["handlers"] += 1
    return out


def _fault_loop(
    name: str, run: _Run, ctx: FaultContext, stop: threading.Event, injected: Counter[str]
) -> None:
    rng = random.Random(run.rng.random())
    interval = run.cfg.fault_interval
    if name == "restart":
        # Each restart an event of its own that workers must ride out, not a storm
        # faster than a pool can reconnect and heartbeat within one lease.
        interval = max(3 * interval, 4 * run.cfg.lease)
    elif name == "crash":
        # A crash is over in a few hundred milliseconds (recovery replays little WAL):
        # two leases apart lets each one's re-runs be told from the next one's.
        interval = max(2 * interval, 2 * run.cfg.lease)
    fixed = run.cfg.restart_every if name == "restart" else None
    delay = rng.uniform(0.2, 1.0) * interval if fixed is None else fixed
    while not stop.wait(delay):
        try:
            began = time.monotonic()
            if inject(name, ctx):
                injected[name] += 1
                if fixed is not None:
                    delay = max(fixed - (time.monotonic() - began), 0.0)
                    continue
                delay = min(max(rng.expovariate(1.0 / interval), 0.3 * interval), 2 * interval)
            else:
                delay = 0.1  # no target yet (nobody holds a job): look again soon
        except Exception as exc:
            logger.warning("fault %s failed: %s", name, exc)
            ctx.record("error", fault=name, error=str(exc))
            delay = interval


def _hold(fleet: ProcessFleet, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fleet.check()
        time.sleep(min(0.1, max(end - time.monotonic(), 0)))


def _sample(run: _Run, ctx: FaultContext, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        with contextlib.suppress(psycopg.Error):
            d, live = dead_tuples(ctx)
            run.samples.append((time.monotonic(), d))
            run.history.write({"ev": "sample", "dead": d, "live": live})


def _connected(ctx: FaultContext) -> int:
    rows = ctx.query(
        "SELECT count(DISTINCT application_name) FROM pg_stat_activity "
        "WHERE application_name LIKE %s",
        (f"skiplock-worker:chaos-{ctx.run_id}-%",),
    )
    return int(rows[0][0])


def _unfinished(ctx: FaultContext) -> int:
    rows = ctx.query(
        sql.SQL("SELECT count(*) FROM {} WHERE status IN ('pending', 'running')").format(ctx.jobs())
    )
    return int(rows[0][0])


def _final_rows(ctx: FaultContext, *, releases: bool = False) -> list[dict[str, Any]]:
    rows = ctx.query(
        sql.SQL(
            "SELECT id, payload->>'v', status, lease_token::text, attempts, last_error, "
            "extract(epoch FROM finished_at)::float8 FROM {}"
        ).format(ctx.jobs())
    )
    keys = ("id", "v", "status", "token", "attempts", "last_error", "finished")
    out = [dict(zip(keys, r, strict=True)) for r in rows]
    if releases:
        logged: dict[int, list[float]] = {}
        for job_id, at in ctx.query(
            sql.SQL("SELECT id, extract(epoch FROM at)::float8 FROM {}.{} ORDER BY at").format(
                sql.Identifier(ctx.schema), sql.Identifier(_RELEASES)
            )
        ):
            logged.setdefault(int(job_id), []).append(float(at))
        for row in out:
            row["releases"] = logged.get(int(row["id"]), [])
    return out


# The run's own log of releases (waiting -> pending), one row per transition: "released
# once" is counted, not inferred from a final status.  It lives in the run's scratch
# schema, which is dropped after the run.
_RELEASES = "chaos_releases"


def _log_releases(dsn: str, schema: str) -> None:
    s, log = sql.Identifier(schema), sql.Identifier(_RELEASES)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(
            sql.SQL("CREATE TABLE {}.{} (id bigint NOT NULL, at timestamptz NOT NULL)").format(
                s, log
            )
        )
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {s}.chaos_log_release() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN INSERT INTO {s}.{log} VALUES (NEW.id, clock_timestamp()); "
                "RETURN NULL; END $$"
            ).format(s=s, log=log)
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER chaos_log_release AFTER UPDATE OF status ON {s}.jobs "
                "FOR EACH ROW WHEN (OLD.status = 'waiting' AND NEW.status = 'pending') "
                "EXECUTE FUNCTION {s}.chaos_log_release()"
            ).format(s=s)
        )


def _drop_schema(dsn: str, schema: str, run_id: str) -> None:
    with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND application_name LIKE %s",
            (f"%{run_id}%",),
        )
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
