"""Shared fixtures: a real PostgreSQL (never a mock) and a fresh schema per test.

The server is SKIPLOCK_TEST_DSN when set (CI sets the machine's PostgreSQL 15), else the
embedded PostgreSQL 18 that skiplock starts by default.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue


@pytest.fixture(scope="session")
def dsn() -> str:
    env = os.environ.get("SKIPLOCK_TEST_DSN")
    if env:
        return env
    from skiplock._embedded import embedded_dsn

    return embedded_dsn()


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A schema name unique to this test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Terminate stragglers (killed workers' sessions) that could hold locks.
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() "
            "AND application_name LIKE %s",
            (f"%{name}%",),
        )
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def queue(dsn: str, schema: str) -> Iterator[Queue]:
    """A migrated Queue on a fresh schema."""
    q = Queue(dsn, schema=schema, application_name=f"skiplock-test:{schema}", max_size=20)
    q.migrate()
    yield q
    q.close()


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain autocommit connection for inspecting and poking the database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture(autouse=True)
def no_skiplock_thread_left() -> Iterator[None]:
    """Fail the test that leaves a skiplock thread running.

    A worker's threads must all end when its run() returns (issue 38): a writer that
    outlived its test went on recording batches into later tests and calling `random`
    while Hypothesis drew examples, failing tests that had nothing to do with it.
    """
    import re
    import threading
    import time

    # A Queue's connection pool threads ("<pool>-scheduler", "<pool>-worker-N") belong
    # to the Queue, which a fixture may keep open for a module or session.
    pool_thread = re.compile(r"-(scheduler|worker-\d+)$")
    before = set(threading.enumerate())
    yield
    end = time.monotonic() + 5.0
    while True:
        left = [
            t
            for t in threading.enumerate()
            if t not in before
            and t.is_alive()
            and t.name.startswith("skiplock-")
            and not pool_thread.search(t.name)
        ]
        if not left or time.monotonic() > end:
            break
        time.sleep(0.02)
    if left:
        pytest.fail(f"skiplock thread(s) still running after the test: {[t.name for t in left]}")
