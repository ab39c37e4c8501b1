"""``python -m skiplock_bench workflows``: what a wide chord and a long chain cost.

``python -m skiplock_bench workflows MEMBERS STEPS ROUNDS``: every round, on a schema of
its own (dropped after), one in-process ``Worker`` of concurrency 8 runs:

- **wide**: a ``group`` of MEMBERS no-op tasks, and the same group with a ``chord``
  callback, the two taking turns going first.  For each, the time to write it
  (``defer``) and to run it: from the worker's start until the last member ran (the
  group) or the callback ran (the chord).  The callback must have run exactly once,
  with MEMBERS results; the bench fails otherwise.  A group without a callback has no
  edges, so the difference is what the dependency (migration 0016) costs.
- **chain**: a ``chain`` of STEPS no-op steps (``s()``: each takes its parent's
  result).  Per step, from the parent's handler returning to the child's handler being
  called: the parent's fenced completion (which releases the child), the child's claim
  and the read of its parent's result.  Against a plain job's pickup on an idle worker:
  STEPS jobs deferred one at a time, each after the previous ran, from ``defer``
  returning (its commit) to the handler's call.  The server's clock cannot tell: the
  worker completes a job and claims the next in one transaction, one ``now()``.

Medians over the rounds; each round's figures are printed as they come.  The DSN is
$SKIPLOCK_BENCH_DSN or the local server.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from skiplock import App, chain, chord, group

from .common import DEFAULT_DSN, percentile

DSN = os.environ.get("SKIPLOCK_BENCH_DSN", DEFAULT_DSN)
CONCURRENCY = 8


class Tally:
    """Calls of the member task, and of the callback with the size of what it got."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.members = 0
        self.calls: list[tuple[float, float]] = []  # each member's call and return
        self.callbacks: list[int] = []
        self.target = 0
        self.reached = threading.Event()

    def expect(self, members: int, callback: bool = False) -> None:
        """Set ``reached`` at the callback's call, else at the ``members``-th member's."""
        with self.lock:
            self.members, self.callbacks, self.calls = 0, [], []
            self.target = -1 if callback else members
            self.reached.clear()

    def member(self, called: float) -> None:
        with self.lock:
            self.members += 1
            self.calls.append((called, time.monotonic()))
            if self.members == self.target:
                self.reached.set()

    def callback(self, n: int) -> None:
        with self.lock:
            self.callbacks.append(n)
            self.reached.set()


def build(schema: str, tally: Tally) -> App:
    app = App(DSN, schema=schema, max_size=6)

    @app.task(name="bench.noop")
    def noop(prev: Any = None) -> None:
        tally.member(time.monotonic())

    @app.task(name="bench.gather")
    def gather(results: list[Any]) -> int:
        tally.callback(len(results))
        return len(results)

    return app


def run_until(app: App, reached: threading.Event, what: str) -> float:
    """Seconds from a fresh Worker's start until ``reached``; the worker is stopped."""
    worker = app.worker(concurrency=CONCURRENCY)
    start = time.monotonic()
    thread = worker.start()
    try:
        if not reached.wait(900):
            raise RuntimeError(f"{what}: not done in 900 s")
        return time.monotonic() - start
    finally:
        worker.stop()
        thread.join(60)


def wide(app: App, tally: Tally, members: int, with_callback: bool) -> tuple[float, float]:
    """(seconds to defer, seconds to run) a group of ``members``, with a chord callback
    or without."""
    noop, gather = app.tasks["bench.noop"], app.tasks["bench.gather"]
    members_canvas = group(noop.si() for _ in range(members))
    canvas = chord(members_canvas, gather.s()) if with_callback else members_canvas
    tally.expect(members, callback=with_callback)
    t0 = time.monotonic()
    wf = canvas.defer()
    written = time.monotonic() - t0
    ran = run_until(app, tally.reached, "chord" if with_callback else "group")
    with psycopg.connect(DSN, autocommit=True) as conn:
        done, twice = conn.execute(
            sql.SQL(
                "SELECT count(*) FILTER (WHERE status = 'done'), "
                "count(*) FILTER (WHERE attempts > 1 OR completions > 1) "
                "FROM {}.jobs WHERE id = ANY (%s)"
            ).format(sql.Identifier(app.schema)),
            (list(wf.jobs),),
        ).fetchone() or (0, 0)
    expected = members + (1 if with_callback else 0)
    if with_callback and tally.callbacks != [members]:
        raise RuntimeError(f"chord: the callback ran {tally.callbacks} (want once, {members})")
    if tally.members != members or twice or done < members:
        raise RuntimeError(
            f"{'chord' if with_callback else 'group'}: {tally.members} member runs, "
            f"{done} of {expected} done, {twice} run more than once"
        )
    return written, ran


def long_chain(app: App, tally: Tally, steps: int) -> tuple[float, float, list[float]]:
    """(seconds to defer, seconds to run, per-step latencies in ms) of a chain: from a
    step's handler returning to the next step's handler being called."""
    noop = app.tasks["bench.noop"]
    canvas = chain(*(noop.s() for _ in range(steps)))
    tally.expect(steps)
    t0 = time.monotonic()
    canvas.defer()
    written = time.monotonic() - t0
    ran = run_until(app, tally.reached, "chain")
    calls = tally.calls
    if len(calls) != steps:
        raise RuntimeError(f"chain: {len(calls)} runs of {steps} steps")
    # One step at a time: the calls are in the chain's order, none overlaps the next.
    gaps = [(nxt[0] - prev[1]) * 1000 for prev, nxt in itertools.pairwise(calls)]
    if min(gaps) < 0:
        raise RuntimeError("chain: a step started before its parent returned")
    return written, ran, gaps


def pickups(app: App, tally: Tally, n: int) -> list[float]:
    """Plain jobs deferred one at a time to an idle worker: from ``defer`` returning
    (its commit) to the handler's call, ms."""
    noop = app.tasks["bench.noop"]
    worker = app.worker(concurrency=CONCURRENCY)
    thread = worker.start()
    lat = []
    try:
        time.sleep(0.5)  # the worker has started and waits
        for _ in range(n):
            tally.expect(1)
            noop.defer()
            t0 = time.monotonic()
            if not tally.reached.wait(60):
                raise RuntimeError("a plain job was not picked up in 60 s")
            lat.append((tally.calls[0][0] - t0) * 1000)
    finally:
        worker.stop()
        thread.join(60)
    return lat


def one_round(r: int, members: int, steps: int) -> dict[str, float]:
    schema = f"wf_{uuid.uuid4().hex[:8]}"
    tally = Tally()
    app = build(schema, tally)
    app.queue.migrate()
    out: dict[str, float] = {}
    try:
        for with_callback in (False, True) if r % 2 == 0 else (True, False):
            name = "chord" if with_callback else "group"
            written, ran = wide(app, tally, members, with_callback)
            out[f"{name}_write"], out[f"{name}_run"] = written, ran
            print(
                f"round {r + 1} {name} of {members:,}: written in {written:.2f} s, "
                f"ran in {ran:.2f} s ({members / ran:,.0f} members/s)",
                flush=True,
            )
        written, ran, gaps = long_chain(app, tally, steps)
        plain = pickups(app, tally, steps)
        out |= {
            "chain_write": written,
            "chain_run": ran,
            "step_p50": percentile(gaps, 50),
            "step_p99": percentile(gaps, 99),
            "pickup_p50": percentile(plain, 50),
            "pickup_p99": percentile(plain, 99),
        }
        print(
            f"round {r + 1} chain of {steps:,}: written in {written:.2f} s, ran in "
            f"{ran:.2f} s; parent returned -> child called p50 {out['step_p50']:.2f} ms, "
            f"p99 {out['step_p99']:.2f} ms; plain pickup p50 {out['pickup_p50']:.2f} ms, "
            f"p99 {out['pickup_p99']:.2f} ms",
            flush=True,
        )
    finally:
        app.queue.close()
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit(__doc__)
    members, steps, rounds = (int(a) for a in args)
    if members < 1 or steps < 2 or rounds < 1:
        raise SystemExit("workflows: MEMBERS >= 1, STEPS >= 2, ROUNDS >= 1")
    results = [one_round(r, members, steps) for r in range(rounds)]

    def med(key: str) -> float:
        return statistics.median(x[key] for x in results)

    print(
        f"medians of {rounds} round(s), Worker of {CONCURRENCY}: "
        f"group of {members:,} ran in {med('group_run'):.2f} s "
        f"({members / med('group_run'):,.0f}/s), "
        f"chord {med('chord_run'):.2f} s ({members / med('chord_run'):,.0f}/s), "
        f"chord / group {statistics.median(x['chord_run'] / x['group_run'] for x in results):.2f}; "
        f"written in {med('group_write'):.2f} / {med('chord_write'):.2f} s; callback ran once"
    )
    print(
        f"medians: chain of {steps:,} ran in {med('chain_run'):.2f} s "
        f"({med('chain_run') / steps * 1000:.2f} ms a step); "
        f"step latency p50 {med('step_p50'):.2f} ms, p99 {med('step_p99'):.2f} ms; "
        f"plain pickup p50 {med('pickup_p50'):.2f} ms, p99 {med('pickup_p99'):.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
