"""Worker processes for the timed sections: each library runs in fresh processes of its own.

The bench process itself only enqueues, starts the clock and watches.  Workers start
(import, connect, register) before the clock; a shared event starts them all at once.
Clocks: time.monotonic() is CLOCK_MONOTONIC, one clock for every process on the machine,
so a child's timestamp and the parent's can be subtracted.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import SynchronizedArray
from queue import Empty
from typing import Any

CTX = mp.get_context("spawn")  # no inherited threads, sockets or pools


@dataclass(frozen=True)
class ChildSpec:
    lib: str
    mode: str  # "drain" or "pickup"
    dsn: str
    schema: str
    n: int
    concurrency: int
    index: int
    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChildResult:
    index: int
    pid: int
    seen: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    t_end: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Channel:
    """What a child shares with the bench process."""

    ready: Any  # mp.Event per child
    go: Any
    stop: Any
    got: Any  # pickup: set by the handler of each job
    progress: Any  # RawArray('q'): per child, jobs persisted (skiplock) or run (peers)
    results: Any  # mp.Queue of ChildResult

    def report(self, result: ChildResult) -> None:
        self.results.put(result)


class _ShortFormatter(logging.Formatter):
    """Workers may log thousands of job ids in one warning; the bench log keeps the gist."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if len(text) <= 400 else f"{text[:400]}... ({len(text):,} chars)"


def child_main(spec: ChildSpec, chan: Channel) -> None:
    """Entry point of every worker process: the library module does the rest."""
    import os

    handler = logging.StreamHandler()
    handler.setFormatter(_ShortFormatter(f"  [{spec.name}] %(name)s %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    try:
        mod = importlib.import_module(f"skiplock_bench.lib_{spec.lib}")
        fn = getattr(mod, f"{spec.mode}_child")
        fn(spec, chan)
    except BaseException:
        chan.ready[spec.index].set()  # do not leave the parent waiting
        chan.report(ChildResult(index=spec.index, pid=os.getpid(), error=traceback.format_exc()))


class Fleet:
    """The worker processes of one timed run."""

    def __init__(self, specs: list[ChildSpec]) -> None:
        self.specs = specs
        self.chan = Channel(
            ready=[CTX.Event() for _ in specs],
            go=CTX.Event(),
            stop=CTX.Event(),
            got=CTX.Event(),
            progress=CTX.RawArray("q", len(specs)),
            results=CTX.Queue(),
        )
        self.procs = [
            CTX.Process(target=child_main, args=(s, self.chan), name=f"bench-{s.name}", daemon=True)
            for s in specs
        ]
        self.results: dict[int, ChildResult] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def start(self, timeout: float = 120.0) -> None:
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + timeout
        for i, ev in enumerate(self.chan.ready):
            while not ev.wait(0.1):
                if not self.procs[i].is_alive():
                    raise RuntimeError(f"worker process {self.specs[i].name} died during start")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker process {self.specs[i].name} not ready in time")
        self._drain_results(0.0)
        errors = [r.error for r in self.results.values() if r.error]
        if errors:
            self.kill()
            raise RuntimeError("worker process failed to start:\n" + errors[0])

    def go(self) -> float:
        t0 = time.monotonic()
        self.chan.go.set()
        return t0

    def progress(self) -> int:
        arr: SynchronizedArray[int] = self.chan.progress
        return sum(arr[:])

    def stop(self) -> None:
        self.chan.stop.set()

    def _drain_results(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            try:
                r: ChildResult = self.chan.results.get(timeout=max(left, 0.0) or 0.01)
            except Empty:
                return
            self.results[r.index] = r
            if len(self.results) == len(self.specs) or time.monotonic() > end:
                return

    def wait_results(self, timeout: float, stall: float | None = None) -> bool:
        """Wait for every child's result; False if a child stalls (no progress for
        ``stall`` seconds) or the timeout passes."""
        end = time.monotonic() + timeout
        last, last_change = self.progress(), time.monotonic()
        while len(self.results) < len(self.specs):
            self._drain_results(0.2)
            now = time.monotonic()
            cur = self.progress()
            if cur != last:
                last, last_change = cur, now
            if now > end or (stall is not None and now - last_change > stall):
                return False
            if len(self.results) < len(self.specs) and not any(p.is_alive() for p in self.procs):
                self._drain_results(1.0)
                return len(self.results) == len(self.specs)
        return True

    def finish(self, timeout: float = 60.0) -> list[ChildResult]:
        """Stop the children, collect what they report, and reap them."""
        self.stop()
        self.wait_results(timeout)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()
        out = []
        for i, s in enumerate(self.specs):
            out.append(
                self.results.get(i)
                or ChildResult(index=i, pid=0, error=f"{s.name}: no result (killed or hung)")
            )
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
