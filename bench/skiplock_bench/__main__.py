"""``python -m skiplock_bench``: the whole bench in one command, results in bench/results/.

``python -m skiplock_bench SUBCOMMAND ...`` runs one experiment of its own instead
(``SUBCOMMANDS``; bench/README.md says what each measures).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from . import report
from .common import (
    DB_PREFIX,
    DEFAULT_DSN,
    drop_database,
    find_pgbench,
    loadavg,
    log,
    machine_info,
    recreate_database,
)
from .suite import Config, Suite, variants

ALL_LIBS = ("skiplock", "pgqueuer", "procrastinate")
SECTIONS = ("pgbench", "enqueue", "pickup", "drain", "scaling")
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"

# The experiments that are not part of the comparison run: name -> (module, what it
# measures).  Each module's ``main(argv)`` takes the rest of the command line.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "storage": ("storage", "held xmin, history and memory under a steady flow"),
    "perjob": ("perjob", "per-job counts: tuples, index entries, WAL, commits, CPU"),
    "sqlcmp": ("sqlcmp", "pgbench on versions of the claim and complete SQL"),
    "notify": ("notify", "what the NOTIFY on enqueue costs producers"),
    "stalls": ("stalls", "claims over a threshold, and what the machine did then"),
    "proto": ("proto", "the five-table storage prototype (decision 0001)"),
    "drains": ("drains", "one process's drain in several shapes, alternated"),
    "versions": ("versions", "drains alternated between two checkouts of skiplock"),
    "held-claims": ("held_claims", "a Worker's claims under a held xmin, head and position"),
    "pickup-stages": ("pickup_stages", "an idle worker's pickup, stage by stage"),
    "keys": ("keys", "per-key concurrency: the limit held, throughput, fairness"),
    "pool-cost": ("pool_cost", "the process pool's cost per job against threads"),
    "workflows": ("workflows", "a wide chord and a long chain against plain jobs"),
    "retry-failed": ("retry_failed", "finding and retrying failed jobs beside done ones"),
    "trigger-cost": ("trigger_cost", "migration 0016's status trigger, per row, server-side"),
}

# name: (sizes, rounds, pickup samples, single enqueues, pgbench jobs, claim pending small/big,
#        claim samples, scaling drain N, slow-library cap, profile N)
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "sizes": [20_000, 200_000],
        "rounds": 3,
        "pickup_samples": 200,
        "single_enqueue": 1_000,
        "pgbench_jobs": 80_000,
        "scale_small": 10_000,
        "scale_big": 1_000_000,
        "claim_samples": 200,
        "scale_drain_n": 20_000,
        "slow_max_n": 5_000,
        "profile_n": 50_000,
    },
    "quick": {
        "sizes": [5_000, 20_000],
        "rounds": 3,
        "pickup_samples": 100,
        "single_enqueue": 500,
        "pgbench_jobs": 40_000,
        "scale_small": 10_000,
        "scale_big": 100_000,
        "claim_samples": 100,
        "scale_drain_n": 5_000,
        "slow_max_n": 5_000,
        "profile_n": 20_000,
    },
    # For the smoke test: every code path, seconds not minutes.
    "tiny": {
        "sizes": [300],
        "rounds": 1,
        "pickup_samples": 10,
        "single_enqueue": 50,
        "pgbench_jobs": 2_000,
        "scale_small": 500,
        "scale_big": 3_000,
        "claim_samples": 10,
        "scale_drain_n": 300,
        "slow_max_n": 300,
        "profile_n": 300,
    },
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run",
        description="skiplock vs procrastinate vs pgqueuer vs pgbench, same Postgres, same run.",
        epilog="experiments of their own: bench/run SUBCOMMAND ... ("
        + "; ".join(f"{name}: {what}" for name, (_, what) in SUBCOMMANDS.items())
        + ")",
    )
    p.add_argument(
        "--dsn",
        default=os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN),
        help="server to use; the bench creates and drops its own databases bench_<library> "
        f"(default: $SKIPLOCK_BENCH_DSN or {DEFAULT_DSN})",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller N everywhere (minutes)")
    mode.add_argument("--tiny", action="store_true", help="smoke-test sizes (seconds)")
    p.add_argument("--libs", default=",".join(ALL_LIBS), help="comma-separated libraries")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--rounds", type=int, help="runs of every measurement (medians; default 3)")
    p.add_argument("--sizes", help="drain sizes, comma-separated (default 20000,200000)")
    p.add_argument("--concurrency", default="8,32", help="drain concurrencies (default 8,32)")
    p.add_argument(
        "--big-concurrency",
        default="8,32",
        help="concurrencies run at the largest N by skiplock's one-process Worker, "
        "AsyncWorker and CLI (default 8,32: issue 19's targets name both; the "
        "two-process variant runs at the smallest N only)",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=2,
        help="skiplock's multi-process variant: this many processes of C/procs each (1: off)",
    )
    p.add_argument(
        "--slow-max-n",
        type=int,
        help="largest drain N for procrastinate and capped pgqueuer (procrastinate runs "
        "a few hundred jobs/s here); default 5000",
    )
    p.add_argument("--pickup-samples", type=int)
    p.add_argument("--single-enqueue", type=int, help="enqueue() calls per run")
    p.add_argument("--pgbench-jobs", type=int, help="jobs claimed+completed per pgbench run")
    p.add_argument("--scale-small", type=int, help="pending jobs, small backlog (10000)")
    p.add_argument("--scale-big", type=int, help="pending, then finished, jobs (1000000)")
    p.add_argument("--profile", action="store_true", help="py-spy a skiplock drain at the end")
    p.add_argument("--profile-n", type=int)
    p.add_argument(
        "--stall",
        type=float,
        default=60.0,
        help="give up a run after this many seconds without progress",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where results go")
    p.add_argument("--keep-dbs", action="store_true", help="do not drop the scratch databases")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    preset = dict(PRESETS["tiny" if args.tiny else "quick" if args.quick else "full"])
    for name in (
        "rounds",
        "slow_max_n",
        "pickup_samples",
        "single_enqueue",
        "pgbench_jobs",
        "scale_small",
        "scale_big",
        "profile_n",
    ):
        if getattr(args, name) is not None:
            preset[name] = getattr(args, name)
    if args.sizes:
        preset["sizes"] = [int(x) for x in args.sizes.split(",")]
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    for lib in libs:
        if lib not in ALL_LIBS:
            raise SystemExit(f"unknown library {lib!r}; choose from {', '.join(ALL_LIBS)}")
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    for s in sections:
        if s not in SECTIONS:
            raise SystemExit(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    if "skiplock" not in libs:
        sections -= {"pgbench", "scaling"}
    label = "tiny" if args.tiny else "quick" if args.quick else "full"
    return Config(
        dsn=args.dsn,
        libs=libs,
        rounds=preset["rounds"],
        sizes=preset["sizes"],
        concurrency=[int(x) for x in args.concurrency.split(",")],
        big_concurrency=[int(x) for x in args.big_concurrency.split(",")],
        procs=args.procs,
        slow_max_n=preset["slow_max_n"],
        pickup_samples=preset["pickup_samples"],
        pickup_gap=(0.01, 0.03),
        single_enqueue=preset["single_enqueue"],
        pgbench_clients=8,
        pgbench_batch=10,
        pgbench_jobs=preset["pgbench_jobs"],
        scale_small=preset["scale_small"],
        scale_big=preset["scale_big"],
        claim_samples=preset["claim_samples"],
        scale_drain_n=preset["scale_drain_n"],
        sections=sections,
        profile=args.profile,
        profile_n=preset["profile_n"],
        stall=args.stall,
        out=args.out,
        label=label,
    )


def load_libs(libs: list[str]) -> dict[str, ModuleType]:
    mods = {}
    for lib in libs:
        mod = importlib.import_module(f"skiplock_bench.lib_{lib}")
        if not mod.available():
            raise SystemExit(
                f"{lib} is not installed: pip install -e '.[bench]' (or drop it with --libs)"
            )
        mods[lib] = mod
    return mods


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C: the finally blocks reap the worker processes and
    # drop the scratch databases.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"skiplock_bench.{SUBCOMMANDS[argv[0]][0]}")
        if argv[1:] in (["-h"], ["--help"]) and not hasattr(module, "argparse"):
            # A subcommand of positional arguments: its docstring is its usage.
            print(module.__doc__)
            return 0
        return int(module.main(argv[1:]) or 0)
    signal.signal(signal.SIGTERM, _terminate)
    args = parse_args(argv)
    cfg = build_config(args)
    logging.basicConfig(level=logging.WARNING)
    mods = load_libs(cfg.libs)
    if "pgbench" in cfg.sections and find_pgbench() is None:
        log("pgbench not found: skipping the ceiling and the history load")
        cfg.sections -= {"pgbench", "scaling"}
    cfg.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    started = time.time()
    info = machine_info(cfg.dsn)
    info["load_before"] = loadavg()
    log(f"bench ({cfg.label}): {', '.join(cfg.libs)}; sections {', '.join(sorted(cfg.sections))}")
    log(f"machine: {info['cpus']} x {info['cpu_model']}; {info['postgres'].split(' on ')[0]}")

    dsns = {}
    for lib in cfg.libs:
        dsns[lib] = recreate_database(cfg.dsn, DB_PREFIX + lib)
        mods[lib].setup(dsns[lib])
    suite = Suite(cfg, mods, dsns)
    profile: dict[str, Any] | None = None
    raw_profile = cfg.out / f"{stamp}-profile.txt"
    try:
        for rnd in range(1, cfg.rounds + 1):
            log(f"round {rnd}/{cfg.rounds}")
            if "pgbench" in cfg.sections:
                suite.guard(f"pgbench round {rnd}", suite.ceiling, rnd)
            if "enqueue" in cfg.sections:
                suite.guard(f"enqueue round {rnd}", suite.enqueue_single, rnd)
            if "pickup" in cfg.sections:
                suite.guard(f"pickup round {rnd}", suite.pickup, rnd)
            if "drain" in cfg.sections:
                suite.drains(rnd)
        if "scaling" in cfg.sections:
            suite.guard("scaling", suite.scaling)
        if cfg.profile and "skiplock" in cfg.libs:
            log("profile: py-spy on a skiplock worker during a drain")
            profile = suite.guard("profile", suite.profile, raw_profile)
    finally:
        if not args.keep_dbs:
            for lib in cfg.libs:
                drop_database(cfg.dsn, DB_PREFIX + lib)
    info["load_after"] = loadavg()
    elapsed = time.time() - started
    md = render(cfg, suite, info, profile, raw_profile, stamp, elapsed, argv)
    md_path = cfg.out / f"{stamp}.md"
    png_path = cfg.out / f"{stamp}.png"
    report.chart(
        suite.results,
        png_path,
        cfg.sizes,
        f"skiplock bench {stamp} ({cfg.label}); {info['cpus']} CPUs, "
        f"{info['postgres'].split(' on ')[0]}",
    )
    md_path.write_text(md.replace("CHART_PATH", png_path.name), encoding="utf-8")
    dump = {
        "config": {k: (str(v) if isinstance(v, Path | set) else v) for k, v in asdict(cfg).items()},
        "machine": info,
        "values": [
            {**asdict(k), "runs": {str(r): v for r, v in s.items()}}
            for k, s in sorted(suite.results.values.items())
        ],
        "checks": [asdict(c) for c in suite.results.checks],
        "profile": profile,
    }
    (cfg.out / f"{stamp}.json").write_text(json.dumps(dump, indent=1, default=str), "utf-8")
    print(md.replace("CHART_PATH", str(png_path)))
    log(f"wrote {md_path} and {png_path} in {elapsed / 60:.1f} min")
    bad = [c for c in suite.results.checks if not c.ok]
    return 1 if bad else 0


def render(
    cfg: Config,
    suite: Suite,
    info: dict[str, Any],
    profile: dict[str, Any] | None,
    raw_profile: Path,
    stamp: str,
    elapsed: float,
    argv: list[str] | None,
) -> str:
    res = suite.results
    v = info["versions"]
    cmd = "bench/run " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# skiplock bench {stamp}",
        "",
        f"`{cmd.strip()}` ({cfg.label} preset), {cfg.rounds} round(s), {elapsed / 60:.1f} min. "
        f"Chart: `CHART_PATH`.",
        "",
        "## Machine, server, libraries",
        "",
        f"- CPU: {info['cpus']} x {info['cpu_model']}; {info['memory_gib']} GiB; "
        f"{info['platform']}",
        f"- load average (1/5/15 min) before: {info['load_before']}, after: {info['load_after']}",
        f"- {info['postgres']}",
        "- settings: " + ", ".join(f"{k}={val}" for k, val in info["pg_settings"].items()),
        *(
            [
                "- **autovacuum is off on this server**: nothing vacuums the queue tables "
                "during the run but the libraries themselves (and the one VACUUM the history "
                "section runs on purpose)"
            ]
            if info["pg_settings"].get("autovacuum") == "off"
            else []
        ),
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        "- pgqueuer driver: "
        + (
            f"{mods_driver()} with uvloop, QueueManager defaults (batch 10)"
            if "pgqueuer" in cfg.libs
            else "not run"
        ),
        "",
    ]
    targets = report.issue19_targets(res, cfg.sizes, cfg.concurrency)
    lines += [
        "## Targets of issue 19, taken within each round",
        "",
        "Drain: jobs/s medians in the label, the ratio per round in the columns; the "
        "in-process Worker on the bench clock, the CLI on the db clock (its only one). "
        "Pickup: per round, skiplock's pickup percentile less the enqueue call's own. "
        "The verdict judges the median of the rounds.",
        "",
        *report.ratio_table(res, targets, "target"),
        "",
        report.targets_summary(targets),
        "",
        "## Other ratios and earlier issues' targets, taken within each round",
        "",
        "Kept where they still mean something; a ratio the table above judges is given "
        "here without a verdict.",
        "",
        *report.ratio_table(res, report.other_ratios(res, cfg.sizes, cfg.concurrency[0])),
    ]
    sections = (
        ("drain", "Drain: N pre-enqueued no-op jobs until all are finished (jobs/s)"),
        (
            "pgbench",
            "pgbench ceilings, no Python: skiplock's own claim + complete SQL, and the "
            "postmortem's plain SQL (issue 19's yardstick)",
        ),
        ("enqueue", "Enqueue (jobs/s): single calls from one client, and the bulk API"),
        ("pickup", "Pickup latency: idle workers, one job at a time, enqueue to handler start"),
        ("claim", "Claim latency (skiplock Queue.claim(limit=10), one client)"),
        ("history", "Drain on a table with history, and with a long transaction open"),
    )
    for sec, title in sections:
        keys = res.keys(sec)
        if keys:
            lines += ["", f"## {title}", "", *report.value_table(res, keys)]
    if "drain" in cfg.sections:
        lines += ["", "Drain configurations:", ""]
        for lib in cfg.libs:
            for var in variants(lib, cfg):
                cap = f" (N ≤ {cfg.slow_max_n:,})" if var.slow else ""
                if not var.slow and not suite.big_ok(var):
                    cap = f" (N ≤ {min(cfg.sizes):,})"
                lines.append(f"- {lib} `{var.config}`{cap}")
    if "history" in res.extra:
        h = res.extra["history"]
        lines += [
            "",
            f"History: {h['jobs']:,} jobs enqueued and finished through skiplock's claim and "
            f"complete SQL by pgbench ({h['pgbench_jobs_per_s']:,.0f} jobs/s; "
            f"{h['leftover']} left over and set done by SQL) before the drains.",
        ]
    lines += ["", "## Exactly-once: every handler execution counted", ""]
    lines += report.checks_table(res)
    bad = [c for c in res.checks if not c.ok]
    lines += ["", f"**{len(bad)} run(s) not OK** of {len(res.checks)}."]
    if profile is not None:
        lines += ["", "## Profile: one skiplock worker process during a drain", ""]
        if "error" in profile:
            lines.append(profile["error"])
        else:
            p = profile
            wall = p["wall_s"]
            lines += [
                f"N={p['n']:,}, concurrency {p['concurrency']}, "
                + (
                    f"{p['jobs_per_s']:,.0f} jobs/s"
                    if p["finished"]
                    else f"**stalled** (no completion for {cfg.stall:g} s; figures up to then)"
                )
                + f" under py-spy (`{raw_profile.name}`).",
                f"CPU over {wall:.1f} s of wall time: worker process {p['worker_cpu_s']:.1f} s "
                f"({_share(p['worker_cpu_s'], wall)} of one core), its {p['backends']} Postgres "
                f"backends {p['postgres_backends_cpu_s']:.1f} s "
                f"({_share(p['postgres_backends_cpu_s'], wall)}), whole machine busy "
                f"{p['machine_busy_s']:.1f} of {p['machine_total_s']:.1f} CPU-s.",
                "",
                *report.server_samples(p.get("server_samples", {})),
                "",
                *report.profile_summary(raw_profile, profile["name"]),
            ]
    if res.notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in res.notes]]
    lines.append("")
    return "\n".join(lines)


def mods_driver() -> str:
    from .lib_pgqueuer import driver_name

    return driver_name()


def _share(part: float, whole: float) -> str:
    if not whole or math.isnan(whole):
        return "-"
    return f"{part / whole:.0%}"


if __name__ == "__main__":
    sys.exit(main())
