"""The measurements: one function per section, each adding per-round figures to Results."""

from __future__ import annotations

import math
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from . import lib_skiplock, pgbench
from .common import (
    Check,
    Key,
    Results,
    exactly_once,
    log,
    machine_busy_seconds,
    median,
    percentile,
    proc_cpu_seconds,
    settle,
)
from .procs import ChildSpec, Fleet
from .report import (
    DB_CLOCK,
    OWN_SQL,
    PLAIN_SQL,
    async_config,
    ceiling_config,
    cli_config,
    cli_procs_config,
    worker_config,
)
from .server import (
    StatementSampler,
    backend_pids,
    db_clock_rate,
    dead_tuples,
    finish_leftovers,
    hold_back_vacuum,
    max_id,
    requeue_running,
    vacuum_analyze,
)


@dataclass
class Config:
    dsn: str
    libs: list[str]
    rounds: int
    sizes: list[int]
    concurrency: list[int]
    big_concurrency: list[int]
    procs: int
    slow_max_n: int
    pickup_samples: int
    pickup_gap: tuple[float, float]
    single_enqueue: int
    pgbench_clients: int
    pgbench_batch: int
    pgbench_jobs: int
    scale_small: int
    scale_big: int
    claim_samples: int
    scale_drain_n: int
    sections: set[str]
    profile: bool
    profile_n: int
    stall: float
    out: Path
    label: str


@dataclass(frozen=True)
class Variant:
    """One way of running a library's workers for a drain."""

    lib: str
    config: str
    procs: int
    concurrency: int  # per process
    nominal: int | None  # the C of the table; None for pgqueuer's uncapped defaults
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    slow: bool = False  # capped at --slow-max-n jobs


def variants(lib: str, cfg: Config) -> list[Variant]:
    out: list[Variant] = []
    if lib == "skiplock":
        for c in cfg.concurrency:
            out.append(Variant(lib, worker_config(c), 1, c, c))
            # Right after the threaded one, so the two run minutes apart at most: issue
            # 19 wants the asyncio worker within 20% of it.
            out.append(Variant(lib, async_config(c), 1, c, c, {"async": True}))
            p = cfg.procs
            if p > 1 and c % p == 0:
                out.append(Variant(lib, f"c{c}: {p} processes x {c // p}", p, c // p, c))
            # The command users deploy, with its own defaults (issue 14: it ran at half
            # the library's rate, unseen, while only the library was measured).
            out.append(Variant(lib, cli_config(c), 1, c, c, {"cli": True}))
            if p > 1 and c % p == 0:
                # The same command over the host's cores: `--processes`.
                opts = {"cli": True, "processes": p}
                out.append(Variant(lib, cli_procs_config(c, p), 1, c // p, c, opts))
    elif lib == "pgqueuer":
        out.append(Variant(lib, "defaults: batch 10, no cap", 1, 0, None))
        for c in cfg.concurrency:
            b = min(10, c // 2)  # pgqueuer requires max_concurrent_tasks >= 2 * batch_size
            opts = {"batch_size": b, "max_concurrent_tasks": c}
            out.append(Variant(lib, f"c{c}: cap {c}, batch {b}", 1, c, c, opts, slow=True))
    elif lib == "procrastinate":
        for c in cfg.concurrency:
            out.append(Variant(lib, f"c{c}: concurrency {c}", 1, c, c, slow=True))
    return out


class Suite:
    def __init__(self, cfg: Config, mods: dict[str, ModuleType], dsns: dict[str, str]) -> None:
        self.cfg = cfg
        self.mods = mods
        self.dsns = dsns
        self.results = Results(rounds=cfg.rounds)
        self._bulk: dict[tuple[str, int, int], list[float]] = defaultdict(list)

    def guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One failed measurement is a note in the report, not the end of a long run."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            log(f"  {what} FAILED: {type(exc).__name__}: {text[-1] if text else ''}")
            self.results.notes.append(f"{what} failed: {type(exc).__name__}: {exc}")
            return None

    def big_ok(self, v: Variant) -> bool:
        """Runs at every N: one process at --big-concurrency (Worker, AsyncWorker and the
        CLI, which issue 19's targets name at 200,000 jobs), and pgqueuer's defaults (the
        moonshot's yardstick).  Two processes, capped pgqueuer and procrastinate stay at
        the smallest N: that keeps the full run near half an hour on 2 cores."""
        return v.nominal is None or (v.procs == 1 and v.nominal in self.cfg.big_concurrency)

    def libs_for_round(self, rnd: int) -> list[str]:
        """Rotate the order each round: drift of the machine then hits every library."""
        libs = list(self.cfg.libs)
        k = (rnd - 1) % len(libs)
        return libs[k:] + libs[:k]

    # -- drain ---------------------------------------------------------------------------

    def drain_once(
        self,
        v: Variant,
        n: int,
        rnd: int,
        *,
        key: Key | None = None,
        schema: str | None = None,
        fresh: bool = True,
        hold_back: bool = False,
    ) -> float:
        """Enqueue n jobs, start the workers, time until all n are finished; returns jobs/s."""
        mod = self.mods[v.lib]
        dsn = self.dsns[v.lib]
        kw: dict[str, Any] = {"schema": schema} if schema is not None else {}
        if fresh:
            mod.reset(dsn, **kw)
        since = max_id(dsn, schema) if v.lib == "skiplock" and not fresh else 0
        secs = mod.enqueue_bulk(dsn, n, **kw)
        if key is None:  # the main drains double as the bulk-enqueue measurement
            self._bulk[(v.lib, n, rnd)].append(n / secs)
        settle(dsn)
        holder = hold_back_vacuum(dsn, schema or lib_skiplock.SCHEMA) if hold_back else None
        specs = [
            ChildSpec(
                lib=v.lib,
                mode="drain",
                dsn=dsn,
                schema=schema or lib_skiplock.SCHEMA,
                n=n,
                concurrency=v.concurrency,
                index=i,
                name=f"{v.lib}-bench-{i}",
                options=v.options,
            )
            for i in range(v.procs)
        ]
        fleet = Fleet(specs)
        finished = False
        try:
            fleet.start()
            t0 = fleet.go()
            if mod.SELF_STOPPING:
                finished = fleet.wait_results(timeout=max(600.0, n / 20), stall=self.cfg.stall)
                children = fleet.finish()
                ends = [c.t_end for c in children if c.t_end is not None]
                t_end = max(ends) if ends and finished else float("nan")
            else:
                finished, t_end = _wait_persisted(fleet, n, self.cfg.stall)
                children = fleet.finish()
        finally:
            fleet.kill()
        dead = dead_tuples(dsn, schema) if v.lib == "skiplock" and schema else None
        if holder is not None:
            holder.rollback()
            holder.close()
        seen = [i for c in children for i in c.seen]
        executed, dups, missing = exactly_once(seen, n)
        if v.lib == "skiplock":
            state, db_ok = lib_skiplock.db_state(dsn, n, schema or lib_skiplock.SCHEMA, since)
        else:
            state, db_ok = mod.db_state(dsn, n)
        errors = [c.error for c in children if c.error]
        if not finished:
            state = f"UNFINISHED (stalled or timed out; missing = not run by then); {state}"
        rate = n / (t_end - t0) if finished and not math.isnan(t_end) else float("nan")
        ok = finished and not errors and dups == 0 and missing == 0 and db_ok
        k = key or Key("drain", v.lib, v.config, n, "jobs/s")
        db_rate = float("nan")
        if v.lib == "skiplock" and k.section == "drain":
            db_rate = db_clock_rate(dsn, schema, since, n) if finished else db_rate
            self.results.add(Key(k.section, k.lib, k.config, n, DB_CLOCK), rnd, db_rate)
        if v.options.get("cli"):
            # Its process starts after "go": the bench clock would count its start-up.
            rate = db_rate
        else:
            self.results.add(k, rnd, rate)
        if dead is not None:
            self.results.add(Key(k.section, k.lib, k.config, n, "dead tuples after"), rnd, dead)
        self.results.checks.append(
            Check(k.section, v.lib, k.config, n, rnd, executed, dups, missing, state, ok)
        )
        extra = f" dead tuples {dead:,.0f}" if dead is not None else ""
        clock = ""
        if db_rate == db_rate:  # not NaN: a skiplock drain
            clock = " (db clock)" if v.options.get("cli") else f" ({db_rate:,.0f} on the db clock)"
        log(
            f"  {k.section} {v.lib} [{k.config}] N={n:,}: {rate:,.0f} jobs/s{clock}; "
            f"executed {executed:,}, dup {dups}, missing {missing}; db: {state}{extra}"
            + ("" if ok else "  << NOT OK")
        )
        for e in errors:
            log(f"  worker error: {e.strip().splitlines()[-1]}")
            self.results.notes.append(f"{v.lib} [{v.config}] N={n}: worker error: {e.strip()}")
        return rate

    def drains(self, rnd: int) -> None:
        for n in self.cfg.sizes:
            for lib in self.libs_for_round(rnd):
                # Configurations of a library take turns too (ABAB, BABA): drift of the
                # machine must not favour the one that always runs first.
                vs = variants(lib, self.cfg)
                for v in vs if rnd % 2 else vs[::-1]:
                    if v.slow:
                        # Once per round, at the smallest N or the cap if that is smaller.
                        if n != min(self.cfg.sizes):
                            continue
                        size = min(n, self.cfg.slow_max_n)
                    elif n > min(self.cfg.sizes) and not self.big_ok(v):
                        continue
                    else:
                        size = n
                    self.guard(
                        f"drain {lib} [{v.config}] N={size} round {rnd}",
                        self.drain_once,
                        v,
                        size,
                        rnd,
                    )
        for (lib, n, r), rates in self._bulk.items():
            if r == rnd:
                self.results.add(Key("enqueue", lib, "bulk", n, "jobs/s"), r, median(rates))

    # -- enqueue -------------------------------------------------------------------------

    def enqueue_single(self, rnd: int) -> None:
        m = self.cfg.single_enqueue
        for lib in self.libs_for_round(rnd):
            mod = self.mods[lib]
            dsn = self.dsns[lib]
            mod.reset(dsn)
            settle(dsn)
            secs = mod.enqueue_single(dsn, m)
            self.results.add(Key("enqueue", lib, "single", m, "jobs/s"), rnd, m / secs)
            log(f"  enqueue {lib} single x{m}: {m / secs:,.0f} jobs/s")

    # -- pickup latency ------------------------------------------------------------------

    def pickup(self, rnd: int) -> None:
        samples = self.cfg.pickup_samples
        for lib in self.libs_for_round(rnd):
            mod = self.mods[lib]
            dsn = self.dsns[lib]
            mod.reset(dsn)
            settle(dsn)
            spec = ChildSpec(
                lib=lib,
                mode="pickup",
                dsn=dsn,
                schema=lib_skiplock.SCHEMA,
                n=samples,
                concurrency=8,
                index=0,
                name=f"{lib}-pickup",
            )
            fleet = Fleet([spec])
            try:
                fleet.start()
                got = mod.pickup_producer(dsn, fleet.chan, samples, self.cfg.pickup_gap)
                child = fleet.finish()[0]
            finally:
                fleet.kill()
            # skiplock's producer also times each enqueue call: its commit is the floor
            # under the pickup (the job cannot be seen before it commits).
            timeouts, floors = got if isinstance(got, tuple) else (got, [])
            lat_ms = [x * 1000.0 for x in child.latencies]
            config = "idle, concurrency 8" if lib != "pgqueuer" else "idle, defaults"
            if floors:
                f_ms = [x * 1000.0 for x in floors]
                for q in (50, 99):
                    k = Key("pickup", lib, "enqueue call (floor)", samples, f"p{q} ms")
                    self.results.add(k, rnd, _p(f_ms, q))
            self.results.add(Key("pickup", lib, config, samples, "p50 ms"), rnd, _p(lat_ms, 50))
            self.results.add(Key("pickup", lib, config, samples, "p99 ms"), rnd, _p(lat_ms, 99))
            executed, dups, missing = exactly_once(child.seen, samples)
            ok = not child.error and dups == 0 and missing == 0 and timeouts == 0
            self.results.checks.append(
                Check(
                    "pickup",
                    lib,
                    config,
                    samples,
                    rnd,
                    executed,
                    dups,
                    missing,
                    f"{timeouts} waits timed out",
                    ok,
                )
            )
            floor = ""
            if floors:
                f_ms = [x * 1000.0 for x in floors]
                floor = f"; enqueue call p50 {_p(f_ms, 50):.2f} ms, p99 {_p(f_ms, 99):.2f} ms"
            log(
                f"  pickup {lib}: p50 {_p(lat_ms, 50):.2f} ms, p99 {_p(lat_ms, 99):.2f} ms{floor} "
                f"({len(lat_ms)} samples, {timeouts} timeouts)"
                + ("" if ok else f"  << NOT OK {child.error or ''}")
            )

    # -- pgbench ceiling -----------------------------------------------------------------

    def ceiling(self, rnd: int) -> None:
        """Both ceilings, skiplock's SQL and the plain SQL, in turns (ABAB, BABA)."""
        both = [(OWN_SQL, self._ceiling_own), (PLAIN_SQL, self._ceiling_plain)]
        for what, fn in both if rnd % 2 else both[::-1]:
            self.guard(f"pgbench {what} round {rnd}", fn, rnd)

    def _ceiling_jobs(self) -> tuple[int, int]:
        """(transactions per client, jobs): every client claims full batches to the end."""
        cfg = self.cfg
        per_client = max(1, cfg.pgbench_jobs // (cfg.pgbench_clients * cfg.pgbench_batch))
        return per_client, per_client * cfg.pgbench_clients * cfg.pgbench_batch

    def _ceiling_own(self, rnd: int) -> None:
        dsn = self.dsns["skiplock"]
        schema = "ceiling"
        per_client, jobs = self._ceiling_jobs()
        lib_skiplock.setup(dsn, schema)
        lib_skiplock.enqueue_bulk(dsn, jobs, schema=schema)
        self._ceiling_run(rnd, OWN_SQL, schema, per_client, jobs, None)

    def _ceiling_plain(self, rnd: int) -> None:
        dsn = self.dsns["skiplock"]
        schema = "ceiling_plain"
        per_client, jobs = self._ceiling_jobs()
        pgbench.plain_setup(dsn, schema)
        pgbench.plain_enqueue(dsn, schema, jobs)
        script = pgbench.plain_script(schema, self.cfg.pgbench_batch)
        self._ceiling_run(rnd, PLAIN_SQL, schema, per_client, jobs, script)

    def _ceiling_run(
        self, rnd: int, what: str, schema: str, per_client: int, jobs: int, script: str | None
    ) -> None:
        cfg = self.cfg
        dsn = self.dsns["skiplock"]
        settle(dsn)
        res = pgbench.run(
            dsn,
            schema,
            clients=cfg.pgbench_clients,
            batch=cfg.pgbench_batch,
            transactions=per_client,
            script=script,
        )
        config = ceiling_config(what, cfg.pgbench_clients, cfg.pgbench_batch)
        self.results.add(Key("pgbench", "pgbench", config, jobs, "jobs/s"), rnd, res.jobs_per_s)
        self.results.add(Key("pgbench", "pgbench", config, jobs, "latency ms"), rnd, res.latency_ms)
        log(
            f"  pgbench {config}: {res.jobs_per_s:,.0f} jobs/s ({res.tps:,.0f} claim+complete/s, "
            f"{res.latency_ms:.2f} ms each, {res.done:,}/{jobs:,} done, {res.failed} failed)"
        )

    # -- scaling (skiplock) --------------------------------------------------------------

    def scaling(self) -> None:
        cfg = self.cfg
        dsn = self.dsns["skiplock"]
        small, big = cfg.scale_small, cfg.scale_big
        log(f"scaling: loading {small:,} and {big:,} pending jobs")
        for schema, n in (("scale_small", small), ("scale_big", big)):
            lib_skiplock.setup(dsn, schema)
            secs = lib_skiplock.enqueue_bulk(dsn, n, schema=schema)
            log(f"  {schema}: {n:,} jobs enqueued in {secs:.1f}s ({n / secs:,.0f} jobs/s)")
            vacuum_analyze(dsn, schema)
        settle(dsn)
        for rnd in range(1, cfg.rounds + 1):
            for schema, n in (("scale_small", small), ("scale_big", big)):
                lat = [
                    x * 1000 for x in lib_skiplock.claim_latencies(dsn, schema, cfg.claim_samples)
                ]
                config = f"claim 10, {n:,} pending"
                self.results.add(Key("claim", "skiplock", config, n, "p50 ms"), rnd, _p(lat, 50))
                self.results.add(Key("claim", "skiplock", config, n, "p99 ms"), rnd, _p(lat, 99))
                log(f"  claim at {n:,} pending: p50 {_p(lat, 50):.2f} ms, p99 {_p(lat, 99):.2f} ms")
        # History: the big table's jobs all run to completion, through skiplock's own
        # claim and complete SQL (pgbench does a million in a minute; workers would not).
        requeue_running(dsn, "scale_big")
        per_client = math.ceil(big / (cfg.pgbench_clients * cfg.pgbench_batch) * 1.02)
        log(f"scaling: finishing {big:,} jobs with pgbench (skiplock's claim+complete SQL)")
        res = pgbench.run(
            dsn,
            "scale_big",
            clients=cfg.pgbench_clients,
            batch=cfg.pgbench_batch,
            transactions=per_client,
        )
        leftover = finish_leftovers(dsn, "scale_big")
        log(
            f"  {res.done:,} finished by pgbench at {res.jobs_per_s:,.0f} jobs/s"
            f"; {leftover} left over and marked done by SQL"
        )
        self.results.extra["history"] = {
            "jobs": big,
            "pgbench_jobs_per_s": res.jobs_per_s,
            "leftover": leftover,
        }
        n = cfg.scale_drain_n
        c = cfg.concurrency[0]
        v = Variant("skiplock", f"1 process x {c}", 1, c, c)

        def key(config: str) -> Key:
            return Key("history", "skiplock", config, n, "jobs/s")

        # First as the server leaves it (autovacuum may be off: it is on this CI image),
        # then after a VACUUM, the state autovacuum would keep a production table in.
        for rnd in range(1, cfg.rounds + 1):
            self.drain_once(v, n, rnd, key=key("fresh table"), schema="scale_fresh")
            self.drain_once(
                v,
                n,
                rnd,
                key=key(f"after {big:,} finished, not vacuumed"),
                schema="scale_big",
                fresh=False,
            )
            self.drain_once(
                v, n, rnd, key=key("long transaction open"), schema="scale_longtx", hold_back=True
            )
        log("scaling: VACUUM (ANALYZE) of the history table")
        vacuum_analyze(dsn, "scale_big")
        for rnd in range(1, cfg.rounds + 1):
            self.drain_once(v, n, rnd, key=key("fresh table, second set"), schema="scale_fresh")
            self.drain_once(
                v,
                n,
                rnd,
                key=key(f"after {big:,} finished, vacuumed"),
                schema="scale_big",
                fresh=False,
            )

    # -- profile -------------------------------------------------------------------------

    def profile(self, out_raw: Path) -> dict[str, Any]:
        """One skiplock drain with py-spy sampling the worker process."""
        import shutil

        cfg = self.cfg
        dsn = self.dsns["skiplock"]
        n = cfg.profile_n
        c = cfg.concurrency[0]
        import sys

        here = Path(sys.executable).parent / "py-spy"
        pyspy = str(here) if here.exists() else shutil.which("py-spy")
        if pyspy is None:
            return {"error": "py-spy not installed (pip install py-spy)"}
        lib_skiplock.reset(dsn)
        lib_skiplock.enqueue_bulk(dsn, n)
        settle(dsn)
        spec = ChildSpec("skiplock", "drain", dsn, lib_skiplock.SCHEMA, n, c, 0, "skiplock-prof")
        fleet = Fleet([spec])
        try:
            fleet.start()
            pid = fleet.pids[0]
            spy = subprocess.Popen(
                [
                    pyspy,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--output",
                    str(out_raw),
                    "--nonblocking",
                    "--threads",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(1.5)  # py-spy attached before the clock starts
            busy0, total0 = machine_busy_seconds()
            cpu0 = proc_cpu_seconds(pid)
            sampler = StatementSampler(dsn, lib_skiplock.SCHEMA)
            t0 = fleet.go()
            sampler.start()
            time.sleep(0.5)
            backends = backend_pids(dsn)
            finished, t_end = _wait_persisted(fleet, n, cfg.stall)
            t_stop = time.monotonic()  # a stalled drain is profiled up to the give-up
            sampler.stop()
            cpu1 = proc_cpu_seconds(pid)
            pg_cpu = sum(proc_cpu_seconds(b) for b in backends)
            busy1, total1 = machine_busy_seconds()
            fleet.finish()
        finally:
            fleet.kill()
        try:
            _, err = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        wall = (t_end if finished else t_stop) - t0
        return {
            "n": n,
            "name": spec.name,
            "concurrency": c,
            "finished": finished,
            "wall_s": wall,
            "jobs_per_s": n / wall if finished else float("nan"),
            "worker_cpu_s": cpu1 - cpu0,
            "postgres_backends_cpu_s": pg_cpu,
            "backends": len(backends),
            "machine_busy_s": busy1 - busy0,
            "machine_total_s": total1 - total0,
            "raw": str(out_raw),
            "server_samples": dict(sampler.counts.most_common()),
            "server_sample_rounds": sampler.rounds,
            "pyspy_stderr": (err or "").strip()[-500:],
        }


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def _wait_persisted(fleet: Fleet, n: int, stall: float) -> tuple[bool, float]:
    """Poll the children's persisted-completion counters until they add up to n."""
    last, last_change = 0, time.monotonic()
    while True:
        cur = fleet.progress()
        now = time.monotonic()
        if cur >= n:
            return True, now
        if cur != last:
            last, last_change = cur, now
        elif now - last_change > stall:
            log(f"  stalled at {cur:,}/{n:,} persisted completions")
            return False, float("nan")
        time.sleep(0.001)
