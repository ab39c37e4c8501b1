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
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue

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
}


INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == INTEGRATION and item.path.stem not in ONE_SERVER:
            item.add_marker(pytest.mark.server)


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
