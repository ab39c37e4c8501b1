"""The pickup on a disk whose WAL flush is slow.

``python bench/pickup_slow_flush.py [FLUSH_US ...]`` (default: 0 1000): for each delay, a
scratch cluster of the machine's PostgreSQL (``skiplock_bench.scratch``) whose server
preloads a small library that sleeps that many microseconds in every ``fdatasync``
(PostgreSQL's WAL flush with the default ``wal_sync_method``) before doing it; 0 runs
without the library.  A network volume in a cloud flushes in about 0.5-2 ms; this
machine's disk in about 0.13 ms, so here the claim's own flush is a small part of a
pickup, and there it is most of it.  On each cluster, ``pickup_stages.py`` (200
samples, 4 rounds) prints every stage.

Needs a C compiler (``cc``) to build the library; it is built in a temporary directory
and removed after.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pickup_stages
from skiplock_bench import scratch

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    const char *s = getenv("SKIPLOCK_SLOW_FLUSH_US");
    long ns = s ? atol(s) * 1000L : 0L;
    struct timespec t = {ns / 1000000000L, ns % 1000000000L};
    if (ns > 0) nanosleep(&t, NULL);
    return real(fd);
}
"""


def build_shim(where: Path) -> Path:
    src, lib = where / "slow_flush.c", where / "slow_flush.so"
    src.write_text(SHIM, encoding="utf-8")
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True)
    where.chmod(0o755)  # the server runs as postgres
    lib.chmod(0o755)
    return lib


def main() -> None:
    delays = [int(x) for x in sys.argv[1:]] or [0, 1000]
    tmp = Path(tempfile.mkdtemp(prefix="skiplock-slow-flush-"))
    try:
        lib = build_shim(tmp)
        for us in delays:
            env = {} if us == 0 else {"LD_PRELOAD": str(lib), "SKIPLOCK_SLOW_FLUSH_US": str(us)}
            print(f"== WAL flush + {us} us")
            with scratch.cluster(env=env) as dsn:
                pickup_stages.run(dsn, samples=200, rounds=4)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
