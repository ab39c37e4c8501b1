"""The suite's check on each test's connections (tests/connection_share.py) counts what
this test process and its children hold on the server: the figure the check trusts."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

from connection_share import Count

CHILD = """
import sys, time, psycopg
held = [psycopg.connect(sys.argv[1]) for _ in range(3)]
print("connected", flush=True)
time.sleep(60)
"""


def test_the_count_is_this_process_and_its_children(dsn: str, schemas: Any) -> None:
    count = Count(dsn)
    if not count.able:
        pytest.skip("counts TCP connections; this server is on a Unix socket")
    # The schema thread migrates the next test's schema meanwhile: let it finish.
    for made in [schemas.next, *schemas.drops]:
        if made is not None:
            made.exception()
    # Earlier tests in this process may have left connections for the collector.
    gc.collect()
    before = count.now()
    child = subprocess.Popen([sys.executable, "-c", CHILD, dsn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "connected\n"
        with psycopg.connect(dsn):
            assert count.now() == before + 4
            with Count(dsn, every=0.02) as sampled:
                time.sleep(0.2)
            assert sampled.peak == before + 4
    finally:
        child.kill()
        child.wait()
    assert count.now() == before
