"""Migrations run by several processes at once, as replicas do on a deploy."""

from __future__ import annotations

import subprocess
import sys

_MIGRATE = (
    "import sys, skiplock; q = skiplock.Queue(sys.argv[1], schema=sys.argv[2], max_size=1);"
    "print(q.migrate()); q.close()"
)


def migrate_in_processes(dsn: str, schema: str, n: int) -> list[str]:
    """Start ``n`` processes that each migrate ``schema``; what each printed, sorted.

    Each prints the versions it applied: exactly one should print them, the rest ``[]``.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MIGRATE, dsn, schema], stdout=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert all(p.returncode == 0 for p in procs)
    return outs
