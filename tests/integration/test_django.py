"""skiplock.contrib.django in-process: real Django 6, real PostgreSQL.

The worker's side as a user runs it (a real ``manage.py skiplock_worker``) is
tests/acceptance/test_django_worker.py.  Jobs are moved through their states here with
skiplock's own Queue (claim, complete, fail, cancel), so the mapping to Django's
TaskResult is checked on every status; the workers restricted to some tasks run here in
threads (``django_worker``, what the command builds).
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Iterator
from contextlib import nullcontext
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

from skiplock import ConfigError, JobCancelled, PayloadError, Queue  # noqa: E402

from .test_worker import running, wait_until  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def django_project(dsn: str) -> None:
    configure(dsn)


@pytest.fixture
def backend(queue: Queue) -> Iterator[Any]:
    """The project's TASKS default backend on this test's fresh (migrated) schema."""
    from django.tasks import task_backends

    with using_schema(queue.schema):
        yield task_backends["default"]


def jobs(admin: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """The jobs table as another connection sees it (committed rows only)."""
    from psycopg.rows import dict_row

    with admin.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL(
                "SELECT id, queue, task, payload, priority, run_at, max_attempts "
                "FROM {}.jobs ORDER BY id"
            ).format(sql.Identifier(schema))
        )
        return cur.fetchall()


def test_a_rolled_back_atomic_block_leaves_no_job(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.db import transaction
    from django.tasks.exceptions import TaskResultDoesNotExist
    from testproj.tasks import add

    with pytest.raises(RuntimeError, match="request failed"), transaction.atomic():
        result = add.enqueue(1, 2)
        # Same connection, same transaction: the job is there for this request...
        assert add.get_result(result.id).status == "READY"
        raise RuntimeError("request failed")
    # ...and gone with the transaction.
    assert jobs(admin, queue.schema) == []
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result(result.id)


def test_a_committed_atomic_block_leaves_one_job(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.db import connection, transaction
    from testproj.tasks import add

    with transaction.atomic():
        result = add.enqueue(1, b=2)
        assert jobs(admin, queue.schema) == []  # not committed yet: invisible elsewhere
    [job] = jobs(admin, queue.schema)
    assert str(job["id"]) == result.id
    assert job["task"] == "testproj.tasks.add"
    assert job["payload"] == {"args": [1], "kwargs": {"b": 2}}
    assert (job["queue"], job["priority"], job["max_attempts"]) == ("default", 0, 2)
    # The insert ran on Django's own connection: no pool of skiplock's was opened.
    assert backend.queue()._pool is None
    assert connection.connection is not None


def test_outside_atomic_the_enqueue_commits_at_once(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from testproj.tasks import add

    result = add.enqueue(3, 4)
    assert [str(j["id"]) for j in jobs(admin, queue.schema)] == [result.id]
    assert (result.status, result.args, result.kwargs, result.backend) == (
        "READY",
        [3, 4],
        {},
        "default",
    )


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((object(), 1), "Unsupported type"),
        ((float("nan"), 1), "not JSON"),
        (({1j: 2}, 1), "Unsupported type"),
    ],
)
def test_a_non_json_argument_raises_and_writes_nothing(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any], args: tuple[Any, ...], why: str
) -> None:
    from django.db import transaction
    from testproj.tasks import add

    # Django's contract is a TypeError; skiplock's callers catch PayloadError: both hold.
    with pytest.raises(TypeError, match=why) as info:
        add.enqueue(*args)
    assert isinstance(info.value, PayloadError)
    assert "testproj.tasks.add" in str(info.value)
    # Nothing written, and Django's transaction (had there been one) is still usable.
    with transaction.atomic():
        with pytest.raises(PayloadError):
            add.enqueue(*args)
        add.enqueue(1, 1)  # the transaction is still usable
    assert [j["payload"] for j in jobs(admin, queue.schema)] == [{"args": [1, 1], "kwargs": {}}]


def test_an_enqueue_in_a_broken_transaction_is_refused_as_the_orm_would(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.db import DatabaseError, connection, transaction
    from testproj.tasks import add

    with transaction.atomic():
        try:
            with transaction.atomic(savepoint=False), connection.cursor() as cur:
                cur.execute("SELECT 1/0")
        except DatabaseError:
            pass  # no savepoint to go back to: Django marks the transaction for rollback
        with pytest.raises(transaction.TransactionManagementError):
            add.enqueue(1, 2)
        transaction.set_rollback(True)
    assert jobs(admin, queue.schema) == []


def test_a_pending_result_then_done_then_refreshed(backend: Any, queue: Queue) -> None:
    from testproj.tasks import add

    result = add.enqueue(2, 3)
    fetched = add.get_result(result.id)
    assert fetched.status == "READY"
    assert (fetched.attempts, fetched.worker_ids, fetched.errors) == (0, [], [])
    assert (fetched.args, fetched.kwargs) == ([2, 3], {})
    assert fetched.enqueued_at is not None and fetched.started_at is None
    assert not fetched.is_finished
    with pytest.raises(ValueError, match="not finished"):
        _ = fetched.return_value

    [job] = queue.claim(worker="w1", queue="default")
    result.refresh()
    assert (result.status, result.attempts, result.worker_ids) == ("RUNNING", 1, ["w1"])
    assert result.started_at is not None and result.last_attempted_at == result.started_at

    queue.complete(job, 5)
    result.refresh()
    assert (result.status, result.return_value, result.is_finished) == ("SUCCESSFUL", 5, True)
    assert result.finished_at is not None and result.finished_at >= result.started_at

    async def again() -> Any:
        return await add.aget_result(result.id)

    assert asyncio.run(again()).return_value == 5


def test_a_failed_job_reports_the_exception_class_and_traceback(backend: Any, queue: Queue) -> None:
    from testproj.tasks import Boom, explode

    result = explode.enqueue("kaboom")
    [job] = queue.claim(worker="w1", queue="default")
    try:
        raise Boom("kaboom")
    except Boom as exc:
        import traceback

        text = "".join(traceback.format_exception(exc))
    queue.fail(job, text, retry=False)
    result.refresh()
    assert result.status == "FAILED"
    [error] = result.errors
    assert error.exception_class_path == "testproj.tasks.Boom"
    assert error.exception_class is Boom
    assert "kaboom" in error.traceback
    with pytest.raises(ValueError, match="failed"):
        _ = result.return_value


def test_a_cancelled_job_is_failed_with_job_cancelled(backend: Any, queue: Queue) -> None:
    from testproj.tasks import add

    result = add.enqueue(1, 1)
    assert queue.cancel(int(result.id)) == "cancelled"
    result.refresh()
    assert result.status == "FAILED"
    assert [e.exception_class for e in result.errors] == [JobCancelled]


def test_unknown_ids_do_not_exist(backend: Any, queue: Queue) -> None:
    from django.tasks.exceptions import TaskResultDoesNotExist

    plain = queue.enqueue({"not": "a django task"})  # a skiplock job with no task
    for result_id in ("999999", "abc", "-1", str(2**70), str(plain)):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(result_id)


def test_priority_queue_and_run_after_are_mapped(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from testproj.tasks import add, send_email

    later = datetime.now(UTC) + timedelta(hours=1)
    low = add.using(priority=-50).enqueue(0, 0)
    high = add.using(priority=100).enqueue(0, 1)
    deferred = add.using(run_after=later).enqueue(0, 2)
    email = send_email.enqueue("a@example.com")  # queue_name="emails", priority=10
    rows = {str(j["id"]): j for j in jobs(admin, queue.schema)}
    assert rows[low.id]["priority"] == 50  # Django's higher-first as skiplock's lower-first
    assert rows[high.id]["priority"] == -100
    assert rows[deferred.id]["run_at"] == later
    assert (rows[email.id]["queue"], rows[email.id]["priority"]) == ("emails", -10)
    # The claim order agrees: Django's highest priority first, the deferred job not yet.
    claimed = queue.claim(worker="w", queue="default", limit=10)
    assert [str(j.id) for j in claimed] == [high.id, low.id]
    fetched = backend.get_result(high.id)
    assert (fetched.task.priority, fetched.task.queue_name) == (100, "default")
    assert backend.get_result(deferred.id).task.run_after == later
    assert backend.get_result(email.id).task.queue_name == "emails"


def test_a_naive_run_after_without_use_tz_is_read_in_time_zone(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """skiplock refuses a naive run_at; Django, with USE_TZ off, means TIME_ZONE by one.
    The backend says so to skiplock, rather than fail the enqueue."""
    from django.test import override_settings
    from testproj.tasks import add

    naive = datetime(2030, 1, 31, 9, 0)
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        deferred = add.using(run_after=naive).enqueue(0, 2)
    rows = {str(j["id"]): j for j in jobs(admin, queue.schema)}
    assert rows[deferred.id]["run_at"] == datetime(2030, 1, 31, 14, 0, tzinfo=UTC)


def test_aenqueue_writes_the_job(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from testproj.tasks import double_later

    async def enqueue() -> Any:
        return await double_later.aenqueue(21)

    result = asyncio.run(enqueue())
    [job] = jobs(admin, queue.schema)
    assert (str(job["id"]), job["task"]) == (result.id, "testproj.tasks.double_later")


def test_a_database_that_is_not_postgresql_fails_the_check_and_the_enqueue(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.core.checks import run_checks
    from django.core.exceptions import ImproperlyConfigured
    from django.tasks import task_backends
    from testproj.tasks import add

    with using_schema(queue.schema, database="lite"):
        errors = [e for e in run_checks() if e.id == "skiplock.E001"]
        assert len(errors) == 1
        assert "sqlite" in errors[0].msg and "PostgreSQL" in errors[0].msg
        with pytest.raises(ImproperlyConfigured, match="needs PostgreSQL"):
            add.enqueue(1, 2)
        assert task_backends["default"].check()[0].id == "skiplock.E001"
    assert jobs(admin, queue.schema) == []


def test_the_check_passes_on_postgresql(backend: Any) -> None:
    assert backend.check() == []


def test_an_unknown_option_is_refused(queue: Queue) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.tasks import task_backends

    with (
        using_schema(queue.schema, shema="typo"),
        pytest.raises(ImproperlyConfigured, match="shema"),
    ):
        task_backends["default"]


def test_task_errors_are_parsed_from_what_skiplock_keeps() -> None:
    from skiplock.contrib.django._backend import task_error

    def formatted(exc: BaseException) -> str:
        import traceback

        try:
            raise exc
        except BaseException as e:
            return "".join(traceback.format_exception(e))

    noted = KeyError("k")
    noted.add_note("a note\nover two lines")
    assert task_error(formatted(noted)).exception_class_path == "builtins.KeyError"
    chained = formatted(ValueError("outer\nsecond line"))
    assert task_error(chained).exception_class_path == "builtins.ValueError"
    assert task_error("retry requested by handler").exception_class_path == "skiplock.JobFailed"
    assert task_error("timed out after 5s").exception_class_path == "builtins.TimeoutError"


# -- the tasks a worker runs ---------------------------------------------------------------

_NAMES = (
    "add send_email explode where_am_i double_later ask_database hang bye interrupt unjsonable "
    "wait_for"
)
TESTPROJ_TASKS = {f"testproj.tasks.{name}" for name in _NAMES.split()}


def test_a_module_path_stands_for_the_tasks_it_holds(backend: Any) -> None:
    tasks = backend.worker_tasks(["testproj.tasks", "testproj.tasks.add"])
    assert set(tasks) == TESTPROJ_TASKS
    assert all(task.module_path == path for path, task in tasks.items())


@pytest.mark.parametrize(
    ("paths", "why"),
    [
        (["testproj.tasks.nope"], "cannot import task 'testproj.tasks.nope'"),
        (["testproj.tasks.Boom"], "is type, not a django.tasks Task"),
        (["testproj.settings"], "module 'testproj.settings' holds no django.tasks Task"),
        (["no_such_package.tasks"], "cannot import 'no_such_package.tasks'"),
        (["testproj/tasks.py"], "not dotted paths"),
        ("testproj.tasks", "must be a list of dotted paths"),
        ([], "is empty"),
    ],
)
def test_a_task_path_that_does_not_load_is_refused_at_the_start(
    backend: Any, paths: Any, why: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(why)):
        backend.worker_tasks(paths)


@pytest.mark.parametrize("tasks", ["testproj.tasks", [], ["testproj.tasks", 3]])
def test_a_malformed_tasks_option_fails_the_check(queue: Queue, tasks: object) -> None:
    from django.tasks import task_backends

    with using_schema(queue.schema, tasks=tasks):
        [error] = task_backends["default"].check()
    assert error.id == "skiplock.E003"


# -- workers restricted to some tasks ------------------------------------------------------


def job_row(admin: psycopg.Connection[Any], schema: str, job_id: str) -> tuple[Any, ...]:
    """(status, attempts, worker) of a job, as another connection sees it."""
    row = admin.execute(
        sql.SQL("SELECT status, attempts, worker FROM {}.jobs WHERE id = %s").format(
            sql.Identifier(schema)
        ),
        [int(job_id)],
    ).fetchone()
    assert row is not None
    return tuple(row)


def status_of(task: Any, result_id: str) -> str:
    return str(task.get_result(result_id).status)


def test_a_worker_of_task_a_leaves_task_b_pending_for_a_worker_that_knows_it(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from testproj.tasks import add, where_am_i

    from skiplock.contrib.django._runner import django_worker

    # B first: an unrestricted claim, oldest first, would take it before A.
    b = where_am_i.enqueue("new in this deploy")
    a = add.enqueue(2, 3)
    old = django_worker(backend, queue, tasks=["testproj.tasks.add"], concurrency=2)
    with running(old):
        wait_until(lambda: status_of(add, a.id) == "SUCCESSFUL", what="task A's job")
        # The worker's row says what it claims (skiplock status, the dashboard).
        [known] = admin.execute(
            sql.SQL("SELECT tasks FROM {}.workers WHERE name = %s").format(
                sql.Identifier(queue.schema)
            ),
            [old.name],
        ).fetchone() or [None]
        assert known == ["testproj.tasks.add"]
        # Claimed after A would have been (it is older): untouched, not charged.
        assert job_row(admin, queue.schema, b.id) == ("pending", 0, None)
    assert add.get_result(a.id).return_value == 5
    assert old.stats.snapshot()["claimed"] == 1

    # A worker whose code has B (here: the module's tasks) runs it, on its first attempt.
    with running(django_worker(backend, queue, tasks=["testproj.tasks"], concurrency=2)):
        wait_until(lambda: status_of(where_am_i, b.id) == "SUCCESSFUL", what="task B's job")
    done = where_am_i.get_result(b.id)
    assert (done.return_value["attempt"], done.return_value["tag"]) == (1, "new in this deploy")


def test_options_tasks_restrict_the_worker_and_an_explicit_list_wins(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    from django.tasks import task_backends
    from testproj.tasks import add, send_email

    from skiplock.contrib.django._runner import django_worker

    with using_schema(queue.schema, tasks=["testproj.tasks.add"]):
        backend = task_backends["default"]
        assert backend.check() == []
        mail = send_email.enqueue("ada@example.com")
        a = add.enqueue(1, 1)
        with running(django_worker(backend, queue)) as w:
            assert w.tasks == ["testproj.tasks.add"]
            wait_until(lambda: status_of(add, a.id) == "SUCCESSFUL", what="task A's job")
            assert job_row(admin, queue.schema, mail.id) == ("pending", 0, None)
        # --task (the command's) replaces OPTIONS: this worker runs send_email only.
        with running(django_worker(backend, queue, tasks=["testproj.tasks.send_email"])) as w:
            assert w.tasks == ["testproj.tasks.send_email"]
            wait_until(lambda: status_of(send_email, mail.id) == "SUCCESSFUL", what="B's job")


def test_without_tasks_listed_the_worker_claims_every_task(backend: Any, queue: Queue) -> None:
    from skiplock.contrib.django._runner import django_worker

    assert backend.worker_tasks() is None
    assert django_worker(backend, queue).tasks is None


def test_the_worker_command_refuses_a_bad_task_or_queue_before_connecting(queue: Queue) -> None:
    from django.core.management import CommandError, call_command

    # Nothing listens there: a connection attempt would be the error reported.
    nowhere = "host=127.0.0.1 port=1 dbname=none connect_timeout=2"
    with using_schema(queue.schema, dsn=nowhere):
        with pytest.raises(CommandError, match=r"cannot import task 'testproj\.tasks\.nope'"):
            call_command("skiplock_worker", "--task", "testproj.tasks.nope")
        with pytest.raises(CommandError, match=r"queue\(s\) \['nope'\] are not in TASKS"):
            call_command("skiplock_worker", "--queue", "nope")


@pytest.mark.parametrize("outcome", ["rolled back", "committed"])
def test_a_chain_deferred_in_a_view_commits_or_rolls_back_with_its_atomic_block(
    backend: Any, queue: Queue, admin: psycopg.Connection[Any], outcome: str
) -> None:
    """Issue 39: a workflow enqueued from a view inside ``atomic()`` is written on
    Django's own connection, in its transaction: all of its steps or none."""
    from django.db import connection, transaction

    from skiplock import App, chain

    app = App(queue.settings.dsn, schema=queue.schema)

    @app.task(name="dj.add")
    def add(a: int, b: int) -> int:
        return a + b

    try:
        expect = pytest.raises(RuntimeError) if outcome == "rolled back" else nullcontext()
        with expect, transaction.atomic():
            flow = chain(add.s(1, 2), add.s(3), add.s(4)).defer(conn=connection.connection)
            # Not committed: another connection sees none of it yet.
            assert jobs(admin, queue.schema) == []
            if outcome == "rolled back":
                raise RuntimeError("the view failed")
        rows = jobs(admin, queue.schema)
        if outcome == "rolled back":
            assert rows == []
            assert queue.workflow(flow.id) is None
        else:
            assert [r["task"] for r in rows] == ["dj.add"] * 3
            steps = queue.workflow(flow.id)
            assert steps is not None
            assert [s["status"] for s in steps["steps"]] == ["pending", "waiting", "waiting"]
    finally:
        app.close()
