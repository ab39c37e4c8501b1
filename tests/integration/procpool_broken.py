"""A handler module that imports in the worker but not in a process pool's child."""

from __future__ import annotations

import multiprocessing

from skiplock import Job

if multiprocessing.parent_process() is not None:
    raise RuntimeError("this module refuses to load in a child")


def handler(job: Job) -> None:
    return None
