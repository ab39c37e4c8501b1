"""Alternate ``chains_ab.py`` drains between two checkouts of skiplock.

``python bench/versions_ab.py OLD_SRC NEW_SRC N ROUNDS SHAPE[,SHAPE...]``: each round
runs ``bench/chains_ab.py N 1 SHAPES`` once with ``PYTHONPATH=OLD_SRC`` and once with
``NEW_SRC`` (old first in odd rounds, new first in even ones), each in a fresh
interpreter, then prints per shape the new / old ratio of every round, their median,
and the medians of both sides' rates and process CPU a job.  For an A/B of one commit:

    git worktree add /tmp/before <commit>~1
    python bench/versions_ab.py /tmp/before/src src 100000 6 one8,async-one8

Both sides run this checkout's ``chains_ab.py``; only the imported ``skiplock`` differs.
The DSN is $SKIPLOCK_BENCH_DSN or the local server, as for ``chains_ab.py``.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUND = re.compile(r"round 1 (\S+): ([\d,]+) jobs/s, process CPU ([\d.]+) us a job")


def drain(src: str, n: int, shapes: str) -> dict[str, tuple[float, float]]:
    """One round of ``chains_ab.py`` with ``src`` first on the path: shape -> (jobs/s,
    process CPU µs a job)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(src).resolve()), str(HERE)])}
    run = subprocess.run(
        [sys.executable, str(HERE / "chains_ab.py"), str(n), "1", shapes],
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise SystemExit(f"chains_ab.py with {src} exited {run.returncode}:\n{run.stderr}")
    out = run.stdout
    found = {m[1]: (float(m[2].replace(",", "")), float(m[3])) for m in ROUND.finditer(out)}
    if set(found) != set(shapes.split(",")):
        raise SystemExit(f"unexpected output from chains_ab.py:\n{out}")
    return found


def main() -> None:
    if len(sys.argv) != 6:
        raise SystemExit(__doc__)
    old, new, n, rounds, shapes = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
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


if __name__ == "__main__":
    main()
