"""The chaos run's worker processes: spawned in slots, paused, killed and replaced."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._history import HistoryWriter
from ._proc import worker_name

__all__ = ["ProcessFleet", "WorkerProcess"]

logger = logging.getLogger("skiplock.chaos")


@dataclass(eq=False)
class WorkerProcess:
    slot: int
    popen: subprocess.Popen[bytes]
    name: str
    paused: bool = False
    busy: bool = False
    expected_exit: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid


class ProcessFleet:
    """The worker processes; a killed or crashed one is replaced in its slot."""

    def __init__(self, spec: dict[str, Any], history_dir: Path, history: HistoryWriter) -> None:
        self.spec = spec
        self.dir = history_dir
        self.history = history
        self.procs: dict[int, WorkerProcess] = {}
        self.lock = threading.Lock()
        self.exits = 0

    def spawn(self, slot: int) -> WorkerProcess:
        cfg = json.dumps({**self.spec, "slot": slot})
        log = (self.dir / f"worker-slot{slot}.log").open("ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "skiplock.chaos._proc", cfg],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        proc = WorkerProcess(slot, popen, worker_name(self.spec["run_id"], slot, popen.pid))
        self.procs[slot] = proc
        self.history.write({"ev": "fault", "f": "spawn", "pid": proc.pid, "w": proc.name})
        return proc

    def names(self) -> list[str]:
        with self.lock:
            return [p.name for p in self.procs.values()]

    def acquire(self, names: set[str]) -> WorkerProcess | None:
        with self.lock:
            free = [p for p in self.procs.values() if p.name in names and not p.busy]
            if not free:
                return None
            proc = random.choice(free)
            proc.busy = True
            return proc

    def release(self, proc: Any) -> None:
        with self.lock:
            proc.busy = False

    def expect_exit(self, proc: Any) -> None:
        """Say, before a fault kills ``proc``, that its exit is not a crash."""
        with self.lock:
            proc.expected_exit = True

    def killed(self, proc: Any) -> None:
        with self.lock:
            proc.expected_exit = True
            proc.popen.wait()
            self.spawn(proc.slot)

    def check(self) -> None:
        """Replace any worker that exited on its own: that is a crash, and it is counted."""
        with self.lock:
            for slot, p in list(self.procs.items()):
                code = p.popen.poll()
                if code is not None and not p.expected_exit:
                    self.exits += 1
                    self.history.write({"ev": "fault", "f": "exit", "pid": p.pid, "code": code})
                    logger.warning("worker %s exited with %s; replacing it", p.name, code)
                    self.spawn(slot)

    def stop(self, timeout: float = 15.0) -> None:
        with self.lock:
            procs = list(self.procs.values())
            for p in procs:
                p.expected_exit = True
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGCONT)
                    p.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
