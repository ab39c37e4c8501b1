"""What Django's Tasks framework promises of every backend, kept by SkiplockBackend.

Read from Django 6.1's own ``tests/tasks`` (scripts/django_tasks_contract.py runs that
suite itself against SkiplockBackend); written here anew, against real PostgreSQL and a
real skiplock Worker (``django_worker``, what ``manage.py skiplock_worker`` runs, in
threads of this process so that Django's signals and log records can be observed).
docs/django.md lists what Django's suite expects that a worker-backed store cannot keep.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

pytest.importorskip("django.tasks", reason="Django 6 is not installed (it needs Python 3.12+)")

PROJECT = Path(__file__).parents[1] / "django_project"
if str(PROJECT) not in sys.path:
    sys.path.insert(0, str(PROJECT))

from djsetup import configure, using_schema  # noqa: E402

from skiplock import ConfigError, Queue  # noqa: E402

from .test_worker import running, wait_until  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def django_project(dsn: str) -> None:
    configure(dsn)


@pytest.fixture
def backend(queue: Queue) -> Iterator[Any]:
    from django.tasks import task_backends

    with using_schema(queue.schema):
        yield task_backends["default"]


@pytest.fixture
def other_queue(dsn: str) -> Iterator[Queue]:
    """A second migrated schema, for a second TASKS alias."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    q = Queue(dsn, schema=name, application_name=f"skiplock-test:{name}", max_size=4)
    q.migrate()
    try:
        yield q
    finally:
        q.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


class Signals:
    """The task_enqueued / task_finished signals sent (by any thread) during a block."""

    def __init__(self) -> None:
        self.enqueued: list[Any] = []
        self.finished: list[tuple[str, str, Any, type[BaseException] | None]] = []
        self._lock = threading.Lock()

    def on_enqueued(self, sender: Any, task_result: Any, **kwargs: Any) -> None:
        with self._lock:
            self.enqueued.append(task_result)

    def on_finished(self, sender: Any, task_result: Any, **kwargs: Any) -> None:
        with self._lock:
            self.finished.append(
                (
                    task_result.id,
                    str(task_result.status),
                    task_result.finished_at,
                    sys.exc_info()[0],
                )
            )

    def finished_of(self, result_id: str) -> list[tuple[str, Any, type[BaseException] | None]]:
        with self._lock:
            return [(s, at, exc) for i, s, at, exc in self.finished if i == result_id]


@pytest.fixture
def signals() -> Iterator[Signals]:
    from django.tasks.signals import task_enqueued, task_finished

    seen = Signals()
    task_enqueued.connect(seen.on_enqueued)
    task_finished.connect(seen.on_finished)
    try:
        yield seen
    finally:
        task_enqueued.disconnect(seen.on_enqueued)
        task_finished.disconnect(seen.on_finished)


def finished(result: Any) -> bool:
    result.refresh()
    return bool(result.is_finished)


# -- A, B: the result enqueue() returns is the one get_result() reads -----------------------


def test_enqueue_returns_what_get_result_reads_and_refresh_changes_nothing(
    backend: Any, signals: Signals
) -> None:
    from testproj.tasks import add

    later = datetime.now(UTC) + timedelta(hours=1)
    plain = add.enqueue(1, 2)
    deferred = add.using(run_after=later, priority=7).enqueue(3, b=4)
    for result in (plain, deferred):
        assert result.enqueued_at is not None
        # Dataclass equality: the task as enqueued (no invented run_after), the times,
        # status, arguments, errors and workers.
        assert backend.get_result(result.id) == result
        before = dataclasses.asdict(result)
        result.refresh()
        assert dataclasses.asdict(result) == before
    assert backend.get_result(plain.id).task.run_after is None
    assert backend.get_result(deferred.id).task.run_after == later
    # The signal carries the same time as the row.
    assert [r.enqueued_at for r in signals.enqueued] == [plain.enqueued_at, deferred.enqueued_at]


def test_a_retry_moves_the_jobs_run_at_not_the_tasks_run_after(backend: Any, queue: Queue) -> None:
    from testproj.tasks import add

    asked = datetime.now(UTC) - timedelta(minutes=1)  # due now, so a claim takes it
    result = add.using(run_after=asked).enqueue(1, 1)
    [job] = queue.claim(worker="w1", queue="default")
    queue.fail(job, "transient", retry=True)
    again = backend.get_result(result.id)
    assert (again.status, again.attempts) == ("READY", 1)
    assert again.task.run_after == asked
    assert queue.get(job.id).run_at > asked  # type: ignore[union-attr]


# -- C: arguments that are not JSON ---------------------------------------------------------


def test_a_non_json_argument_is_djangos_type_error_and_skiplocks_payload_error(
    backend: Any, signals: Signals
) -> None:
    from testproj.tasks import add

    from skiplock import PayloadError
    from skiplock.contrib.django import TaskArgumentsError

    with pytest.raises(TypeError, match="Unsupported type") as info:
        add.enqueue(datetime.now(), 1)  # Django's own example: normalize_json refuses it
    assert isinstance(info.value, TaskArgumentsError)
    assert isinstance(info.value, PayloadError)
    assert signals.enqueued == []


# -- D, E: outcomes a task must not be able to hide -----------------------------------------


def test_a_task_that_exits_fails_and_the_next_job_still_runs(
    backend: Any, queue: Queue, signals: Signals
) -> None:
    from testproj.tasks import add, bye, interrupt

    from skiplock.contrib.django._runner import django_worker

    exits = bye.enqueue(3)
    interrupted = interrupt.enqueue()
    after = add.enqueue(2, 2)
    # One thread: a task that killed it, or left its job held, would stop `after`.
    with running(django_worker(backend, queue, concurrency=1)):
        wait_until(lambda: finished(after), what="the job after the exits")
    assert after.return_value == 4
    for result, cls, message in (
        (exits, SystemExit, "3"),
        (interrupted, KeyboardInterrupt, "pressed inside the task"),
    ):
        result.refresh()
        # FAILED at once (max_attempts is 2): the task asked to stop; exit() again helps nobody.
        assert (result.status, result.attempts) == ("FAILED", 1)
        [error] = result.errors
        assert error.exception_class is cls
        assert error.traceback.endswith(f"{cls.__name__}: {message}\n"), error.traceback
        [(status, finished_at, exc)] = signals.finished_of(result.id)
        assert (status, exc) == ("FAILED", cls)
        assert finished_at is not None
    assert [s for s, _, _ in signals.finished_of(after.id)] == ["SUCCESSFUL"]


def test_a_return_value_that_is_not_json_is_recorded_as_django_records_it(
    backend: Any, queue: Queue, signals: Signals, caplog: pytest.LogCaptureFixture
) -> None:
    from testproj.tasks import unjsonable

    from skiplock.contrib.django._runner import django_worker

    result = unjsonable.enqueue()
    with (
        caplog.at_level(logging.INFO, logger="django.tasks"),
        running(django_worker(backend, queue, concurrency=1)),
    ):
        wait_until(lambda: finished(result), what="unjsonable to fail")
    # No retry: the task ran, its side effects happened.
    assert (result.status, result.attempts) == ("FAILED", 1)
    [error] = result.errors
    assert error.exception_class is TypeError
    assert "Unsupported type" in error.traceback and "Traceback" in error.traceback
    assert [(s, exc) for s, _, exc in signals.finished_of(result.id)] == [("FAILED", TypeError)]
    [line] = [
        r
        for r in caplog.records
        if r.name == "django.tasks" and result.id in r.getMessage() and "FAILED" in r.getMessage()
    ]
    assert line.levelno == logging.ERROR
    assert line.exc_info is not None and line.exc_info[0] is TypeError


# -- F: two skiplock aliases, and tasks that are gone ---------------------------------------


def test_task_using_another_skiplock_alias_runs_and_reads_on_that_alias(
    queue: Queue, other_queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.db import connections
    from django.tasks import task_backends
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.test import override_settings
    from testproj.tasks import add

    from skiplock.contrib.django._runner import django_worker

    def alias(schema: str) -> dict[str, Any]:
        return {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"schema": schema, "max_attempts": 2},
        }

    tasks = {"default": alias(queue.schema), "other": alias(other_queue.schema)}
    try:
        with override_settings(TASKS=tasks):
            result = add.using(backend="other").enqueue(20, 22)
            assert result.backend == "other" and result.task.backend == "other"
            count = sql.SQL("SELECT count(*) FROM {}.jobs")
            for schema, n in ((queue.schema, 0), (other_queue.schema, 1)):
                row = admin.execute(count.format(sql.Identifier(schema))).fetchone()
                assert row is not None and row[0] == n
            # Each alias has its own worker; the other alias's runs the job.
            worker = django_worker(task_backends["other"], other_queue, concurrency=1)
            with running(worker):
                wait_until(lambda: finished(result), what="the job on 'other'")
            assert (result.status, result.return_value) == ("SUCCESSFUL", 42)
            again = add.using(backend="other").get_result(result.id)
            assert again == result
            with pytest.raises(TaskResultDoesNotExist):
                add.get_result(result.id)  # not a job of 'default'
    finally:
        connections.close_all()


def test_a_job_whose_task_no_longer_imports_does_not_exist(backend: Any, queue: Queue) -> None:
    from django.tasks.exceptions import TaskResultDoesNotExist

    gone = queue.enqueue({"args": [], "kwargs": {}}, task="testproj.removed_in_deploy.task")
    with pytest.raises(TaskResultDoesNotExist, match="cannot import task"):
        backend.get_result(str(gone))


# -- status: RUNNING means the task runs ----------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 0], ids=["prefetch", "default"])
def test_a_job_waiting_for_a_thread_is_ready_not_running(
    backend: Any, queue: Queue, tmp_path: Path, prefetch: int | None
) -> None:
    from testproj.tasks import add, wait_for

    from skiplock.contrib.django._runner import django_worker

    gate = tmp_path / "gate"
    first = wait_for.enqueue(str(gate))
    second = add.enqueue(1, 1)
    options = {} if prefetch == 0 else {"prefetch": prefetch}  # 0: django_worker's default
    with running(django_worker(backend, queue, concurrency=1, **options)):
        try:
            wait_until((tmp_path / "gate.started").exists, what="the first task to start")
            assert str(wait_for.get_result(first.id).status) == "RUNNING"
            if prefetch:
                # Claimed ahead of a free thread, it reads RUNNING with an attempt and a
                # started_at though its task has not begun: why the default is 0.
                wait_until(
                    lambda: add.get_result(second.id).attempts == 1, what="the prefetch claim"
                )
                assert str(add.get_result(second.id).status) == "RUNNING"
            else:
                waiting = add.get_result(second.id)
                # The only thread is busy: nothing claimed the second job to wait on it.
                assert (waiting.status, waiting.started_at, waiting.attempts) == ("READY", None, 0)
        finally:
            gate.touch()  # the worker's stop waits for the task
        wait_until(lambda: finished(second), what="the second job")
    assert second.return_value == 2


# -- QUEUES, migrations, OPTIONS: what a user is told ----------------------------------------


def test_empty_queues_serve_every_queue_the_database_knows(queue: Queue) -> None:
    from django.db import connections
    from django.tasks import task_backends
    from django.test import override_settings
    from testproj.tasks import add, send_email

    from skiplock.contrib.django._runner import django_worker

    tasks = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "QUEUES": [],  # Django's "any queue"
            "OPTIONS": {"schema": queue.schema},
        }
    }
    try:
        with override_settings(TASKS=tasks):
            results = [
                add.enqueue(1, 1),
                send_email.enqueue("a@example.com"),  # queue "emails"
                add.using(queue_name="reports").enqueue(2, 2),
            ]
            worker = django_worker(task_backends["default"], queue)
            assert worker.queues == ["default", "emails", "reports"]
            with running(worker):
                for r in results:
                    wait_until(lambda r=r: finished(r), what=f"job {r.id}")
            assert [str(r.status) for r in results] == ["SUCCESSFUL"] * 3
    finally:
        connections.close_all()


def test_before_migrating_the_error_says_what_to_run_and_atomic_goes_on(dsn: str) -> None:
    from django.db import connection, transaction
    from testproj.tasks import add

    unmigrated = f"t_{uuid.uuid4().hex[:12]}"  # never created
    advice = re.escape("run `python manage.py skiplock_migrate`")
    with using_schema(unmigrated), transaction.atomic():
        with pytest.raises(ConfigError, match=advice):
            add.get_result("1")
        with pytest.raises(ConfigError, match=advice):
            add.enqueue(1, 2)
        # Nothing failed inside the transaction: the request can go on with it.
        with connection.cursor() as cur:
            cur.execute("SELECT 41 + 1")
            assert cur.fetchone() == (42,)


@pytest.mark.parametrize(
    ("option", "value"),
    [("schema", "not a schema"), ("max_attempts", 0), ("max_attempts", "3")],
)
def test_a_bad_option_is_reported_by_the_setting_that_holds_it(
    queue: Queue, admin: psycopg.Connection[Any], option: str, value: object
) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.tasks import task_backends
    from testproj.tasks import add

    setting = f"TASKS['default']['OPTIONS']['{option}']"
    options: dict[str, Any] = {option: value}
    with using_schema(str(options.pop("schema", queue.schema)), **options):
        [error] = task_backends["default"].check()
        assert error.id == "skiplock.E002" and setting in error.msg
        with pytest.raises(ImproperlyConfigured, match=re.escape(setting)):
            add.enqueue(1, 2)
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(queue.schema))
    ).fetchone()
    assert row == (0,)


def test_a_tasks_option_that_does_not_import_names_the_setting(queue: Queue) -> None:
    from django.tasks import task_backends

    from skiplock.contrib.django._runner import django_worker

    with using_schema(queue.schema, tasks=["no_such_package.tasks"]):
        with pytest.raises(ConfigError, match=re.escape("TASKS['default']['OPTIONS']['tasks']")):
            django_worker(task_backends["default"], queue)
        # --task names itself instead.
        with pytest.raises(ConfigError, match=re.escape("--task: cannot import 'nope_pkg.tasks'")):
            django_worker(task_backends["default"], queue, tasks=["nope_pkg.tasks"])
