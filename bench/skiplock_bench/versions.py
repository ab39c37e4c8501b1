"""``python -m skiplock_bench versions``: ``drains`` alternated between two checkouts.

``python -m skiplock_bench versions OLD_SRC NEW_SRC N ROUNDS SHAPE[,SHAPE...]``: each
round runs ``drains N 1 SHAPES`` once with ``OLD_SRC`` first on ``PYTHONPATH`` and once
with ``NEW_SRC`` (old first in odd rounds, new first in even ones), each in a fresh
interpreter, then prints per shape the new / old ratio of every round, their median,
and the medians of both sides' rates and process CPU a job.  For an A/B of one commit:

    git worktree add /tmp/before <commit>~1
    bench/run versions /tmp/before/src src 100000 6 one8,async-one8

Both sides run this checkout's ``drains``; only the imported ``skiplock`` differs.
The DSN is $SKIPLOCK_BENCH_DSN or the local server, as for ``drains``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/, which holds skiplock_bench
ROUND = re.compile(r"round 1 (\S+): ([\d,]+) jobs/s, process CPU ([\d.]+) us a job")


def drain(src: str, n: int, shapes: str) -> dict[str, tuple[float, float]]:
    """One round of ``drains`` with ``src`` first on the path: shape -> (jobs/s,
    process CPU µs a job)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), str(BENCH)])}
    # The module itself, not ``python -m skiplock_bench``: the suite's modules would be
    # imported too, and an older skiplock may lack what they use.
    run = subprocess.run(
        [sys.executable, "-m", "skiplock_bench.drains", str(n), "1", shapes],
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise SystemExit(f"drains with {src} exited {run.returncode}:\n{run.stderr}")
    out = run.stdout
    found = {m[1]: (float(m[2].replace(",", "")), float(m[3])) for m in ROUND.finditer(out)}
    if set(found) != set(shapes.split(",")):
        raise SystemExit(f"unexpected output from drains:\n{out}")
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5:
        raise SystemExit(__doc__)
    old, new, n, rounds, shapes = args[0], args[1], int(args[2]), int(args[3]), args[4]
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {"old": [], "new": []}
    for rnd in range(1, rounds + 1):
        order = ("old", "new") if rnd % 2 else ("new", "old")
        for side in order:
            runs[side].append(drain(old if side == "old" else new, n, shapes))
            got = ", ".join(
                f"{s} {r:,.0f} jobs/s {c:.1f} us" for s, (r, c) in runs[side][-1].items()
            )
            print(f"round {rnd} {side}: {got}", flush=True)
    for shape in shapes.split(","):
        ratios = [b[shape][0] / a[shape][0] for a, b in zip(runs["old"], runs["new"], strict=True)]
        print(
            f"{shape}: new / old {statistics.median(ratios):.2f} "
            f"(per round {', '.join(f'{r:.2f}' for r in ratios)}); "
            + "; ".join(
                f"{side} {statistics.median(r[shape][0] for r in runs[side]):,.0f} jobs/s, "
                f"{statistics.median(r[shape][1] for r in runs[side]):.1f} us CPU a job"
                for side in ("old", "new")
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
