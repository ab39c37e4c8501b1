"""The bench still runs end to end (skiplock only, tiny N): it is a command people rely on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_bench_runs_for_skiplock_with_tiny_n(dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skiplock_bench",
            "--tiny",
            "--libs",
            "skiplock",
            "--dsn",
            dsn,
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    [md] = tmp_path.glob("*.md")
    [png] = tmp_path.glob("*.png")
    text = md.read_text(encoding="utf-8")
    assert png.stat().st_size > 10_000
    # Every section produced figures, and every run passed the exactly-once check.
    for heading in ("## Drain", "## Enqueue", "## Pickup latency", "## Exactly-once"):
        assert heading in text
    assert "**0 run(s) not OK**" in text
    assert "| skiplock | c8: 1 process x 8 | 300 | jobs/s |" in text
    assert "| skiplock | c8: AsyncWorker, 1 process x 8 | 300 | jobs/s |" in text
    assert "| skiplock | c8: skiplock worker CLI x 8 | 300 | jobs/s, db clock |" in text
    assert "| pgbench | plain SQL: 8 clients, batch 10 | 2,000 | jobs/s |" in text
    assert "`skiplock worker` CLI / in-process Worker (db clock)" in text
    # Issue 19's targets are judged from figures of this run: each row has a median
    # ("-" would mean a figure it needs was not measured), and pgqueuer, not run here,
    # leaves only the moonshot rows unmeasured.
    assert "## Targets of issue 19" in text
    for row in (
        "| drain c8, N=300: Worker ",
        "| drain c32, N=300: `skiplock worker` CLI (db clock) ",
        "| drain c8, N=300: AsyncWorker ",
        "| pickup p50, idle workers, less the enqueue call's own (the floor): ",
        "| pickup p99, idle workers, less the enqueue call's own (the floor): ",
    ):
        [line] = [ln for ln in text.splitlines() if ln.startswith(row)]
        assert "not measured" not in line, line
    assert "not measured" in text.split("## Other ratios")[0]  # the moonshot rows


# The experiments that are subcommands of their own, each at a tiny N, and a line of
# output that says it measured something.  Their figures at such N mean nothing; that
# they run end to end on the current code is what is tested.
SUBCOMMANDS = [
    (["drains", "300", "1", "one8,chains=1,async-one8"], "async-one8: median"),
    (["versions", "SRC", "SRC", "200", "1", "one8"], "one8: new / old"),
    (["pickup-stages", "5", "1"], "pickup - floor"),
    (["pool-cost", "1", "40", "20", "2"], "start of 2 handlers, process"),
    (["held-claims", "--fresh", "12", "--held", "12", "--rate", "50"], "claim p99 held / fresh"),
    (["workflows", "30", "5", "1"], "callback ran once"),
    (["retry-failed", "--failed", "20", "--done", "0", "50"], "retry_failed 20 in"),
    (["trigger-cost", "200", "2"], "with / without per round: "),
    # The five-table prototype's claim and complete under pgbench, on a scratch cluster.
    (["proto", "perjob", "--jobs", "500", "--rounds", "1"], "| proto-sql | "),
    (["notify", "--producers", "2", "--seconds", "1", "--rounds", "1"], "| no-trigger | "),
    (
        ["sqlcmp", "--variants", "old,new", "--modes", "cc", "--rounds", "1", "--jobs", "2000"],
        "| cc (jobs/s) | new | ",
    ),
    (["perjob", "--jobs", "300"], "| heap tuples written (ins+upd+del) | "),
    (["stalls", "--seconds", "5", "--rate", "100"], "stalls by class:"),
    (
        [
            "storage",
            "--servers",
            "shared",
            "--conditions",
            "fresh,held",
            "--fresh-seconds",
            "4",
            "--held-seconds",
            "4",
            "--window",
            "2",
            "--burst",
            "500",
            "--bursts",
            "1",
            "--rate",
            "100",
        ],
        "| shared (autovacuum off) | held | ",
    ),
    (
        [
            "keys",
            "--keys",
            "5",
            "--per-key",
            "4",
            "--backlog",
            "50",
            "--overhead-n",
            "200",
            "--rounds",
            "1",
        ],
        "most jobs of one key at once: 1 (limit 1)",
    ),
]


@pytest.mark.bench
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("argv", "expect"), SUBCOMMANDS, ids=[a[0] for a, _ in SUBCOMMANDS])
def test_bench_subcommand_runs_at_tiny_n(
    dsn: str, tmp_path: Path, argv: list[str], expect: str
) -> None:
    src = str(BENCH.parent / "src")
    env = {**os.environ, "PYTHONPATH": str(BENCH), "SKIPLOCK_BENCH_DSN": dsn}
    # Those that write a report write it here, not into bench/results/.
    reports = ("sqlcmp", "perjob", "stalls", "storage", "proto")
    out = ["--out", str(tmp_path)] if argv[0] in reports else []
    proc = subprocess.run(
        [sys.executable, "-m", "skiplock_bench", *(src if a == "SRC" else a for a in argv), *out],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert expect in proc.stdout, proc.stdout[-4000:]
