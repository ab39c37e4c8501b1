#!/usr/bin/env python3
"""Run Django's own ``tests/tasks`` suite against SkiplockBackend and a real worker.

Not part of CI: it downloads Django's release sdist (the tests are only there) with
pip, unpacks ``tests/tasks`` into a temporary directory, and runs it with Django's
test runner on a real PostgreSQL.  Nothing of Django's is written into the repository.

    python scripts/django_tasks_contract.py [--dsn DSN] [--django 'django>=6.1,<6.2']
                                            [--sdist PATH] [--skip-task-logs] [--keep] [-v]

Django's suite is written for its two bundled backends, so each is stood in for by a
SkiplockBackend with a role (``contract_backends.py``, written next to the tests):

- ``ImmediateBackend``: a SkiplockBackend whose aliases each have their own schema and
  their own ``manage.py skiplock_worker`` process; ``enqueue`` writes the job (Django's
  connection, autocommit) and then waits for the worker to finish it, returning what
  ``get_result`` reads then.  That is Django's immediate contract as far as a worker in
  another process can keep it.
- ``DummyBackend``: a SkiplockBackend whose schema no worker serves, so jobs stay READY
  as DummyBackend's do; ``results`` reads every job of the schema back and ``clear()``
  deletes them.

The test modules are rewritten only to import these two names from there.  Tests that
pin what cannot hold for a backend whose tasks run in another process are listed in
PINNED with the reason; the summary separates them from real failures.
``--skip-task-logs`` lets ``assertLogs("django.tasks")`` pass empty (those lines are
printed by the worker process), so that what the "logs" tests assert besides the log
lines (statuses, error classes, tracebacks) is checked too.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

# Django's tests that pin the behaviour of its bundled backends rather than a contract a
# worker-backed store can keep (docs/django.md, "What Django's own tests expect").
PINNED = {
    # The task's log lines and exceptions are the worker process's, not the enqueuer's.
    "test_immediate_backend.ImmediateBackendTestCase.test_catches_exception": "logs",
    "test_immediate_backend.ImmediateBackendTestCase.test_complex_exception": "logs",
    "test_immediate_backend.ImmediateBackendTestCase.test_complex_return_value": "logs",
    "test_immediate_backend.ImmediateBackendTestCase.test_enqueue_logs": "logs",
    "test_immediate_backend.ImmediateBackendTestCase.test_failed_logs": "logs",
    "test_immediate_backend.ImmediateBackendTestCase.test_throws_keyboard_interrupt": "logs",
    "test_tasks.TaskTestCase.test_task_error_invalid_exception": "logs",
    "test_tasks.TaskTestCase.test_task_error_unknown_module": "logs",
    # The immediate backend has no results store; skiplock's results are durable.
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_get_result": "store",
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_refresh_result": "store",
    "test_immediate_backend.ImmediateBackendTestCase.test_cannot_pass_run_after": "store",
    # Inside atomic() the job is not committed: no other process can run it yet.
    "test_immediate_backend.ImmediateBackendTransactionTestCase."
    "test_doesnt_wait_until_transaction_commit_by_default": "atomic",
    # The dummy backend hands out its stored objects; a database hands out copies.
    "test_dummy_backend.DummyBackendTestCase.test_refresh_result": "copies",
    "test_dummy_backend.DummyBackendTestCase.test_refresh_result_async": "copies",
    # A sync database read inside an async test: Django refuses it for any database-backed
    # store (SynchronousOnlyOperation); aget_result() and arefresh() are the async API.
    "test_dummy_backend.DummyBackendTestCase.test_enqueue_task_async": "async",
    "test_dummy_backend.DummyBackendTestCase.test_get_missing_result": "async",
    "test_tasks.TaskTestCase.test_enqueue_task_async": "async",
    "test_tasks.TaskTestCase.test_get_missing_result": "async",
    "test_tasks.TaskTestCase.test_refresh_result": "async",
}

BACKENDS = '''
"""SkiplockBackend in the two roles Django's task tests know (see the runner)."""

import os
import time

from django.db import connections
from psycopg import sql

from skiplock.contrib.django import SkiplockBackend

PREFIX = os.environ["CONTRACT_SCHEMA_PREFIX"]


class ImmediateBackend(SkiplockBackend):
    def __init__(self, alias, params):
        super().__init__(alias, params)
        # OPTIONS left as given: Django's tests compare them with {}.
        self.schema = f"{PREFIX}_immediate_{alias}"
        self.max_attempts = 1

    def enqueue(self, task, args, kwargs):
        result = super().enqueue(task, args, kwargs)
        if connections[self.database].in_atomic_block:
            return result  # uncommitted: no worker can see it before the commit
        deadline = time.monotonic() + 60
        while not result.is_finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {result.id} did not finish in 60 s")
            time.sleep(0.02)
            result.refresh()
        return result


class DummyBackend(SkiplockBackend):
    def __init__(self, alias, params):
        super().__init__(alias, params)
        self.schema = f"{PREFIX}_dummy_{alias}"

    def _ids(self):
        with self._connection().cursor() as cur:
            cur.execute(
                sql.SQL("SELECT id FROM {}.jobs ORDER BY id").format(sql.Identifier(self.schema))
            )
            return [str(row[0]) for row in cur.fetchall()]

    @property
    def results(self):
        return [self.get_result(i) for i in self._ids()]

    def clear(self):
        with self._connection().cursor() as cur:
            cur.execute(sql.SQL("DELETE FROM {}.jobs").format(sql.Identifier(self.schema)))
'''

SETTINGS = '''
"""Settings of the contract run: the test process's and the workers'."""

import os

from psycopg.conninfo import conninfo_to_dict

_params = {k: str(v) for k, v in conninfo_to_dict(os.environ["CONTRACT_DSN"]).items()}
SECRET_KEY = "contract-run-only"
USE_TZ = True
INSTALLED_APPS = ["skiplock.contrib.django"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _params.pop("dbname", "postgres"),
        "USER": _params.pop("user", ""),
        "PASSWORD": _params.pop("password", ""),
        "HOST": _params.pop("host", ""),
        "PORT": _params.pop("port", ""),
        "OPTIONS": _params,
    }
}
# What the workers serve: the aliases the suite gives an immediate backend.
TASKS = {
    alias: {"BACKEND": "contract_backends.ImmediateBackend", "QUEUES": []}
    for alias in ("default", "immediate")
}
TEST_RUNNER = "contract_runner.Runner"
'''

RUNNER = '''
"""Django's test runner on the real database, and a record of each test's outcome."""

import json
import os
import unittest

from django.test import SimpleTestCase
from django.test.runner import DiscoverRunner


class Result(unittest.TextTestResult):
    outcomes = {}

    def _note(self, test, ok):
        name = test.id().split(" ")[0]
        if ok:
            self.outcomes.setdefault(name, "pass")
        else:
            self.outcomes[name] = "fail"

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, True)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, False)

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, False)

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._note(test, False)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[test.id()] = "skip"


class _NoLogs:
    """What assertLogs("django.tasks") gives when its lines are the worker's to print."""

    output = []
    records = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_assert_logs = unittest.TestCase.assertLogs


def _assert_logs_here_only(self, logger=None, level=None):
    # At DEBUG the tests count task_enqueued's line too, which is this process's.
    if logger == "django.tasks" and level not in ("DEBUG", 10):
        return _NoLogs()
    return _assert_logs(self, logger, level)


class Runner(DiscoverRunner):
    def get_resultclass(self):
        return Result

    def setup_test_environment(self, **kwargs):
        super().setup_test_environment(**kwargs)
        if os.environ.get("CONTRACT_SKIP_TASK_LOGS") == "1":
            unittest.TestCase.assertLogs = _assert_logs_here_only

    def setup_databases(self, **kwargs):
        # The tests run on the real database: its skiplock schemas are the runner's,
        # and SimpleTestCase may query it (every enqueue writes a row).
        SimpleTestCase.databases = {"default"}
        return None

    def teardown_databases(self, old_config, **kwargs):
        pass

    def suite_result(self, suite, result, **kwargs):
        with open(os.environ["CONTRACT_OUTCOMES"], "w") as f:
            json.dump(Result.outcomes, f)
        return super().suite_result(suite, result, **kwargs)
'''


def log(msg: str) -> None:
    print(f"[contract] {msg}", file=sys.stderr, flush=True)


def fetch_tests(spec: str, sdist: Path | None, into: Path) -> str:
    """Unpack Django's ``tests/tasks`` into ``into / "tasks"``; returns the sdist's name."""
    if sdist is None:
        dl = into / "sdist"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                spec,
                "--no-binary",
                ":all:",
                "--no-deps",
                "-q",
                "-d",
                str(dl),
            ],
            check=True,
        )
        [sdist] = dl.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if re.match(r"[^/]+/tests/tasks/[^/]+\.py$", m.name)]
        if not members:
            raise SystemExit(f"{sdist} has no tests/tasks")
        (into / "tasks").mkdir()
        for m in members:
            data = tar.extractfile(m)
            assert data is not None
            (into / "tasks" / Path(m.name).name).write_bytes(data.read())
    return sdist.name


def rewrite(tests: Path) -> None:
    """Point the suite's two bundled backends at the SkiplockBackend stand-ins."""
    for path in tests.glob("test_*.py"):
        text = path.read_text()
        for kind, cls in (("immediate", "ImmediateBackend"), ("dummy", "DummyBackend")):
            text = text.replace(
                f"from django.tasks.backends.{kind} import {cls}",
                f"from contract_backends import {cls}",
            )
            text = text.replace(f"django.tasks.backends.{kind}.{cls}", f"contract_backends.{cls}")
        path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dsn",
        default=os.environ.get("SKIPLOCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
    )
    parser.add_argument("--django", default="django>=6.1,<6.2", help="pip spec of the sdist")
    parser.add_argument("--sdist", type=Path, default=None, help="a downloaded sdist")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--skip-task-logs",
        action="store_true",
        help="let assertLogs('django.tasks') pass without lines (they are the worker's), "
        "to check what those tests assert besides the log",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="skiplock-contract-"))
    name = fetch_tests(args.django, args.sdist, root)
    rewrite(root / "tasks")
    (root / "contract_backends.py").write_text(BACKENDS)
    (root / "contract_settings.py").write_text(SETTINGS)
    (root / "contract_runner.py").write_text(RUNNER)

    prefix = f"dj_{uuid.uuid4().hex[:8]}"
    schemas = [f"{prefix}_{role}" for role in ("immediate_default", "immediate_immediate")]
    schemas.append(f"{prefix}_dummy_default")
    env = {
        **os.environ,
        "CONTRACT_DSN": args.dsn,
        "CONTRACT_SCHEMA_PREFIX": prefix,
        "CONTRACT_OUTCOMES": str(root / "outcomes.json"),
        "DJANGO_SETTINGS_MODULE": "contract_settings",
        "CONTRACT_SKIP_TASK_LOGS": "1" if args.skip_task_logs else "0",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    from skiplock import Queue

    for schema in schemas:
        with Queue(args.dsn, schema=schema, max_size=1) as q:
            q.migrate()
    workers = []
    try:
        for alias in ("default", "immediate"):
            out = (root / f"worker-{alias}.log").open("w")
            workers.append(
                (
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "django",
                            "skiplock_worker",
                            "--backend",
                            alias,
                            "--queue",
                            "default",
                            "--concurrency",
                            "2",
                            "--lease",
                            "10",
                        ],
                        cwd=root,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    root / f"worker-{alias}.log",
                )
            )
        for proc, path in workers:
            deadline = time.monotonic() + 30
            while "concurrency" not in path.read_text() and proc.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"worker did not start:\n{path.read_text()}")
                time.sleep(0.1)
            if proc.poll() is not None:
                raise SystemExit(f"worker exited:\n{path.read_text()}")
        log(f"{name}: tests/tasks in {root}, schemas {prefix}_*, workers up")
        run = subprocess.run(
            [sys.executable, "-m", "django", "test", "tasks", "-v", "2" if args.verbose else "1"],
            cwd=root,
            env=env,
        )
    finally:
        for proc, _ in workers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            for schema in schemas:
                drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                conn.execute(drop.format(sql.Identifier(schema)))
    import json

    outcomes: dict[str, str] = json.loads((root / "outcomes.json").read_text())
    short = {re.sub(r"^tasks\.", "", k): v for k, v in outcomes.items()}
    passed = sorted(k for k, v in short.items() if v == "pass")
    failed = sorted(k for k, v in short.items() if v != "pass")
    pinned = [k for k in failed if k in PINNED]
    real = [k for k in failed if k not in PINNED]
    print(f"{name}: {len(passed)} of {len(short)} tests/tasks tests pass against SkiplockBackend")
    print(f"  failing, pinned to Django's bundled backends: {len(pinned)}")
    for k in pinned:
        print(f"    {k} ({PINNED[k]})")
    print(f"  failing otherwise: {len(real)}")
    for k in real:
        print(f"    {k}")
    unexpected_passes = sorted(k for k in PINNED if short.get(k) == "pass")
    for k in unexpected_passes:
        print(f"  listed as pinned but passes: {k}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    else:
        log(f"kept {root}")
    return 0 if not real and run.returncode in (0, 1) else 1


if __name__ == "__main__":
    sys.exit(main())
