"""Handlers for the process pool's tests: importable by name, as its children need.

Each job's payload says what to do (``do``) and, where the test watches, a directory
to leave files in: the child's pid when it starts, a marker from its cleanup.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from skiplock import App, Job, SoftTimeLimitExceeded


def _note(job: Job, name: str, text: str) -> None:
    with open(Path(job.payload["dir"]) / name, "a") as f:
        f.write(text + "\n")


def handle(job: Job) -> Any:
    do = job.payload["do"]
    if do == "pid":
        return os.getpid()
    if do == "burn":
        # CPU-bound and deaf to everything but a signal that kills.
        _note(job, "pids", str(os.getpid()))
        while True:
            pass
    if do == "soft":
        try:
            while True:
                pass
        except SoftTimeLimitExceeded:
            _note(job, "cleanup", f"cleaned up in {os.getpid()}")
            raise
    if do == "sys.exit":
        sys.exit(3)
    if do == "os._exit":
        os._exit(7)
    if do == "gated":
        # Runs until the test creates the gate file; tells the test its pid first.
        _note(job, "pids", str(os.getpid()))
        gate = Path(job.payload["dir"]) / "gate"
        while not gate.exists():
            time.sleep(0.01)
        return "late"
    if do == "grow":
        # Keeps 64 MiB alive in the child (module state), as a leaky task would.
        _leak.append(bytearray(64 << 20))
        return os.getpid()
    raise AssertionError(f"unknown action {do!r}")


_leak: list[bytearray] = []


# An app at module level, as a process pool's children find it (App.import_path); the
# tests give its worker their own queue (``using=``), so it needs no DSN of its own.
app = App()


@app.task(name="pp.double")
def double(n: int) -> dict[str, int]:
    return {"value": 2 * n, "pid": os.getpid()}


@app.task(name="pp.adouble")
async def adouble(n: int) -> dict[str, int]:
    await asyncio.sleep(0)
    return {"value": 2 * n, "pid": os.getpid()}


@app.task(name="pp.add")
def add(a: int, b: int) -> int:
    return a + b
