"""The no-op handler `skiplock worker` runs under the bench: it tallies each execution.

The CLI worker is a process of its own, so it cannot append to the bench child's list
as the in-process handler does.  It counts into a file the bench child maps too
(``SKIPLOCK_BENCH_TALLY``): an int64 of processes that opened it, then one int64 of
executions per process (``skiplock worker --processes N`` runs the handler in N of
them, and one shared counter would lose increments), then one int32 per job number,
which is the record the exactly-once check reads.  No database round trip per job.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

from skiplock import Job
from skiplock_bench.tally import HEADER, SLOTS

_lock = threading.Lock()
with open(os.environ["SKIPLOCK_BENCH_TALLY"], "r+b") as _f:
    _map = mmap.mmap(_f.fileno(), 0)
    fcntl.flock(_f.fileno(), fcntl.LOCK_EX)  # one process at a time takes a slot
    _opened = memoryview(_map)[:8].cast("q")
    _slot = 1 + _opened[0] % SLOTS
    _opened[0] += 1
    fcntl.flock(_f.fileno(), fcntl.LOCK_UN)
_total = memoryview(_map)[:HEADER].cast("q")
_counts = memoryview(_map)[HEADER:].cast("i")


def handler(job: Job) -> None:
    i = job.payload["n"]
    with _lock:
        if 0 <= i < len(_counts):
            _counts[i] += 1  # a job number is one process's unless it ran twice
        _total[_slot] += 1
