"""The no-op handler `skiplock worker` runs under the bench: it tallies each execution.

The CLI worker is a process of its own, so it cannot append to the bench child's list
as the in-process handler does.  It counts into a file the bench child maps too
(``SKIPLOCK_BENCH_TALLY``): an int64 of executions, then one int32 per job number,
which is the record the exactly-once check reads.  No database round trip per job.
"""

from __future__ import annotations

import mmap
import os
import threading

from skiplock import Job

_lock = threading.Lock()
with open(os.environ["SKIPLOCK_BENCH_TALLY"], "r+b") as _f:
    _map = mmap.mmap(_f.fileno(), 0)
_total = memoryview(_map)[:8].cast("q")
_counts = memoryview(_map)[8:].cast("i")


def handler(job: Job) -> None:
    i = job.payload["n"]
    with _lock:
        if 0 <= i < len(_counts):
            _counts[i] += 1
        _total[0] += 1
