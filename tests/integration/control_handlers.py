"""Handlers for the control tests, run by `skiplock worker --handler control_handlers:...`.

Each records when it ran (wall clock, one host) by appending one line to the file named
by CONTROL_LOG; a line is written with one os.write, so lines of processes do not mix.
``noop`` records nothing.
"""

from __future__ import annotations

import os
import time

from skiplock import Job


def interval(job: Job) -> dict[str, int]:
    began = time.time()
    time.sleep(float(job.payload.get("sleep", 0.05)))
    ended = time.time()
    line = f"{job.id} {began:.6f} {ended:.6f} {os.getpid()}\n".encode()
    fd = os.open(os.environ["CONTROL_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return {"pid": os.getpid()}


def noop(job: Job) -> None:
    """Does nothing: for tests of what the worker itself writes."""
