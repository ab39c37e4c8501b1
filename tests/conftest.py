"""Shared fixtures: a real PostgreSQL (never a mock) and a fresh schema per test.

The server is SKIPLOCK_TEST_DSN when set (CI sets the machine's PostgreSQL 15), else the
embedded PostgreSQL 18 that skiplock starts by default.

Which tests run on both servers: scripts/test runs the suite on the first and, on the
embedded server, only the tests marked ``server`` (``-m server``): those whose outcome the
server's version can change.  That is every test under tests/integration (they run
skiplock's SQL: the claim, the fences, upkeep, migrations, plans, grants, the catalog
queries of verify), except the modules in ONE_SERVER below.  tests/unit touches no
database and tests/acceptance drives the CLI as processes, whose SQL the integration
tests already run on both servers; they run once.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from connection_share import DEFAULT, WHOLE, Count, Ledger
from skiplock import Queue
from skiplock._sql import migrations

# tests/integration modules whose outcome does not depend on the server's version, with
# why; they run on the first server only (on the embedded one when it is the only one).
ONE_SERVER: dict[str, str] = {
    "test_embedded": "starts its own embedded server in a temporary directory, whichever runs",
    "test_race_cli": "`skiplock race`'s output; the races are run on both by lab and replay",
    "test_dashboard": "the web app's pages over Queue's API, tested on both",
    "test_django": "Django's side of the backend; its statements are Queue's, tested on both",
    "test_fastapi_example": "the example app's endpoints over Queue's API",
    "test_testing_plugin": "the pytest plugin's fixture and run_pending, by pytester",
    "test_metrics": "counters fed by the Worker's events",
    "test_worker_logs": "the log line each failed attempt leaves",
    "test_connection_share": "the test harness's count of its own TCP connections",
}


# Modules whose assertions time short intervals on a live worker, with what they time.
# scripts/test runs the rest in several pytest processes at once (pytest-xdist) and
# these after them, alone (marker ``alone``): beside three other test processes on two
# cores, a 0.2 s bound measures the machine, not skiplock.
ALONE: dict[str, str] = {
    "test_liveness": "a reset worker's mark is back within 0.2 s (median) and the grace",
    "test_process_pool": "a killed child's CPU time stops growing within a few seconds",
    "test_process_pool_cli": "a timed-out task's process burns no more CPU after the kill",
    "test_health": "a stalled connection is noticed within --health-stall",
}

INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == INTEGRATION and item.path.stem not in ONE_SERVER:
            item.add_marker(pytest.mark.server)
        if item.path.stem in ALONE:
            item.add_marker(pytest.mark.alone)


@pytest.fixture(scope="session")
def dsn() -> str:
    env = os.environ.get("SKIPLOCK_TEST_DSN")
    if env:
        return env
    from skiplock._embedded import embedded_dsn

    return embedded_dsn()


def _new_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


class Schemas:
    """Migrates the next test's schema while this one runs, and drops it behind.

    A fresh ``migrate`` (fifteen migrations) and ``DROP SCHEMA ... CASCADE`` were a fifth
    of an integration test's time on average, spent while the test waited.  One thread
    of its own runs them in order, one migration ahead: the test that asks for ``queue``
    gets a schema migrated by the same ``Queue.migrate``, moments old, that no other
    test has touched; a failure there falls back to migrating in the test, as before.
    A drop that fails fails the session at its end.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.versions = [m.version for m in migrations()]
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="test-schemas")
        self.next: Future[str] | None = None
        self.drops: list[Future[None]] = []

    def _migrate(self) -> str:
        name = _new_name()
        with Queue(
            self.dsn, schema=name, application_name="skiplock-test-schemas", max_size=1
        ) as q:
            applied = q.migrate()
        # A test that runs meanwhile may have narrowed skiplock._migrate.migrations (to
        # stage an upgrade): such a schema is not the fresh one the next test expects.
        if applied != self.versions:
            self._drop(name)
            raise RuntimeError(f"migrated {applied}, not {self.versions}")
        return name

    def take(self) -> str | None:
        """A migrated schema, or None if making it failed (the test migrates then)."""
        ready = self.next or self.worker.submit(self._migrate)
        self.next = self.worker.submit(self._migrate)
        try:
            return ready.result()
        except Exception:
            return None

    def _drop(self, name: str) -> None:
        with psycopg.connect(
            self.dsn, autocommit=True, application_name="skiplock-test-schemas"
        ) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))

    def drop(self, name: str) -> None:
        self.drops.append(self.worker.submit(self._drop, name))

    def close(self) -> None:
        if self.next is not None and self.next.exception() is None:
            self.drop(self.next.result())
        self.worker.shutdown(wait=True)
        for done in self.drops:
            done.result()


@pytest.fixture(scope="session")
def schemas(dsn: str) -> Iterator[Schemas]:
    made = Schemas(dsn)
    yield made
    made.close()


@pytest.fixture
def schema(dsn: str, schemas: Schemas, request: pytest.FixtureRequest) -> Iterator[str]:
    """A schema name unique to this test, dropped afterwards: already migrated when the
    test also asks for ``queue``, else a name nothing has created yet."""
    name = (schemas.take() if "queue" in request.fixturenames else None) or _new_name()
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Terminate stragglers (killed workers' sessions) that could hold locks, now: the
        # next test must not meet them.  The drop itself can wait.
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND datname = current_database() "
            "AND application_name LIKE %s",
            (f"%{name}%",),
        )
    schemas.drop(name)


@pytest.fixture
def queue(dsn: str, schema: str) -> Iterator[Queue]:
    """A migrated Queue on a fresh schema."""
    q = Queue(dsn, schema=schema, application_name=f"skiplock-test:{schema}", max_size=20)
    q.migrate()  # a no-op when Schemas made it; the test's own migration otherwise
    yield q
    q.close()


@pytest.fixture
def admin(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain autocommit connection for inspecting and poking the database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    waits = [
        float(value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for key, value in getattr(report, "user_properties", ())
        if key == "connection_wait"
    ]
    if waits:
        slow = sum(1 for w in waits if w > 0.5)
        terminalreporter.write_line(
            f"connection shares: {len(waits)} tests took theirs, {slow} waited over 0.5 s, "
            f"{sum(waits):.0f} s of waiting in all (tests/connection_share.py)"
        )


@pytest.fixture(scope="session")
def connection_ledger(dsn: str) -> Ledger:
    return Ledger(dsn)


@pytest.fixture(autouse=True)
def connection_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """Hold this test's share of the server's connections while it runs, and fail it
    if it held more (tests/connection_share.py says why); tests that ask for no
    database (no ``dsn``) take none."""
    callspec = getattr(request.node, "callspec", None)
    if "dsn" not in request.fixturenames or "dsn" in getattr(callspec, "params", {}):
        yield  # no database, or a test whose own argument is called dsn
        return
    dsn: str = request.getfixturevalue("dsn")
    ledger: Ledger = request.getfixturevalue("connection_ledger")
    marked = request.node.get_closest_marker("connections")
    if marked is not None:
        share = int(marked.args[0])
    elif any(request.node.get_closest_marker(m) for m in WHOLE):
        share = ledger.limit
    else:
        share = DEFAULT
    asked = time.monotonic()
    ledger.take(share)
    # What the ledger costs the suite: pytest_terminal_summary sums these.
    request.node.user_properties.append(("connection_wait", time.monotonic() - asked))
    try:
        with Count(dsn) as count:
            yield
    finally:
        ledger.give_back()
    if count.peak > share:
        pytest.fail(
            f"held {count.peak} connections to the server at once, its share is {share}: "
            f"mark it @pytest.mark.connections({count.peak + count.peak // 4})"
        )


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
