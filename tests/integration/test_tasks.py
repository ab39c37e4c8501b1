"""The task API: defer with checked arguments, run by the one claim loop, results back."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import (
    App,
    ConfigError,
    DatabaseUnavailable,
    Fail,
    Job,
    JobFailed,
    PayloadError,
    Queue,
    RetryPolicy,
    Worker,
)

from .test_worker import running, wait_until


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[App]:
    a = App(dsn, schema=schema, application_name=f"skiplock-test:{schema}", max_size=4)
    a.migrate()
    yield a
    a.close()


def rows(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL(
            "SELECT id, queue, task, status, attempts, payload FROM {}.jobs ORDER BY id"
        ).format(sql.Identifier(schema))
    ).fetchall()


@dataclasses.dataclass
class Address:
    street: str
    city: str


def test_defer_runs_and_returns(app: App, admin: Any) -> None:
    seen: list[Job] = []

    @app.task(name="billing.send_invoice", queue="emails", max_attempts=3)
    def send_invoice(invoice_id: int, to: Address, job: Job) -> dict[str, Any]:
        seen.append(job)
        return {"invoice": invoice_id, "city": to.city}

    @app.task(name="billing.notify", queue="emails")
    async def notify(user: str, *, loud: bool = False) -> str:
        await asyncio.sleep(0)
        return user.upper() if loud else user

    a = send_invoice.defer(invoice_id=7, to=Address("Main St 1", "Berlin"))
    b = notify.defer("ann", loud=True)  # positional arguments bind by name
    assert isinstance(a, int) and isinstance(b, int)
    stored = {r[0]: r for r in rows(admin, app.schema)}
    assert stored[a][2] == "billing.send_invoice" and stored[a][1] == "emails"
    assert stored[a][5] == {"invoice_id": 7, "to": {"street": "Main St 1", "city": "Berlin"}}
    assert stored[b][5] == {"user": "ann", "loud": True}
    with running(app.worker(concurrency=2)):
        assert app.wait(a, timeout=20) == {"invoice": 7, "city": "Berlin"}
        assert app.wait(b, timeout=20) == "ANN"
    # The Job asked for by annotation is the claimed job: attempt and key included.
    assert [j.id for j in seen] == [a] and seen[0].attempts == 1
    assert seen[0].task == "billing.send_invoice"
    assert seen[0].idempotency_key == f"skiplock:emails:{a}"
    # Calling the task calls the function, here and now.
    assert asyncio.run(notify("bo")) == "bo"


def test_async_worker_runs_sync_and_async_tasks(app: App) -> None:
    @app.task(name="t.sync_add")
    def add(a: int, b: int) -> int:
        return a + b

    @app.task(name="t.async_mul")
    async def mul(a: int, b: int) -> int:
        return a * b

    ids = [add.defer(a=2, b=3), mul.defer(a=4, b=5)]

    async def main() -> list[Any]:
        w = app.async_worker(concurrency=4)
        runner = asyncio.create_task(w.run())
        try:
            ids.append(await add.defer_async(a=1, b=1))
            ids.extend(await mul.configure(priority=-1).defer_many_async([{"a": 3, "b": 3}]))
            with pytest.raises(TypeError, match="missing a required argument: 'b'"):
                await mul.defer_async(a=1)
            return [await app.wait_async(i, timeout=20) for i in ids]
        finally:
            w.stop()
            await runner
            await app.aclose()

    assert asyncio.run(main()) == [5, 20, 2, 9]


def test_trace_context_travels_from_defer_to_the_task(app: App) -> None:
    """With OpenTelemetry, the task's span continues the trace of the deferring call."""
    trace = pytest.importorskip("opentelemetry.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    seen: list[int] = []

    @app.task(name="t.traced")
    def traced() -> None:
        seen.append(trace.get_current_span().get_span_context().trace_id)

    # The global provider can be set once per process: patch the lookups instead.
    original = trace.get_tracer
    trace.get_tracer = lambda *a, **k: provider.get_tracer(*a, **k)  # type: ignore[assignment]
    try:
        with tracer.start_as_current_span("request") as request:
            job_id = traced.defer()
            want = request.get_span_context().trace_id
        with running(app.worker()):
            app.wait(job_id, timeout=20)
    finally:
        trace.get_tracer = original  # type: ignore[assignment]
    assert seen == [want]
    [span] = [s for s in exporter.get_finished_spans() if s.name == "skiplock.task t.traced"]
    assert span.kind is trace.SpanKind.CONSUMER
    assert span.parent is not None and span.parent.span_id == request.get_span_context().span_id
    assert span.attributes is not None and span.attributes["messaging.message.id"] == str(job_id)


def test_bad_calls_fail_in_the_producer_and_write_nothing(app: App, admin: Any) -> None:
    @app.task(name="t.send")
    def send(invoice_id: int, note: str = "") -> None: ...

    @app.task(name="t.free")
    def free(value, **extra) -> None:  # type: ignore[no-untyped-def]
        ...

    with pytest.raises(
        TypeError, match=r"t.send.defer\(\): missing a required argument: 'invoice_id'"
    ):
        send.defer(note="x")
    with pytest.raises(
        TypeError, match=r"unexpected argument 'invoice' \(did you mean 'invoice_id'\?\)"
    ):
        send.defer(invoice=7)
    with pytest.raises(
        TypeError, match=r"unexpected argument 'notes' \(did you mean 'note'\?\); it takes"
    ):
        send.defer(invoice_id=7, notes="x")
    with pytest.raises(TypeError, match=r"unexpected argument 'invoce_id' \(did you mean"):
        send.defer(invoce_id=7)
    with pytest.raises(TypeError, match="argument 'invoice_id'"):
        send.defer(invoice_id="seven")
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        free.defer(value={1, 2})
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        free.defer(value=1, other=object())
    with pytest.raises(ConfigError, match=r"unknown task 't\.nope' .*t\.free, t\.send"):
        app.defer("t.nope", invoice_id=1)
    with pytest.raises(ConfigError, match="defined twice"):

        @app.task(name="t.send")
        def send_again(invoice_id: int) -> None: ...

    with pytest.raises(ConfigError, match=r"\*args cannot be deferred"):

        @app.task(name="t.varargs")
        def varargs(*args: int) -> None: ...

    with pytest.raises(ConfigError, match="give delay or run_at"):
        send.configure(delay=1, run_at=datetime.now(UTC))
    with pytest.raises(TypeError, match="call #1"):
        send.defer_many([{"invoice_id": 1}, {"invoice": 2}])
    assert rows(admin, app.schema) == []
    # By name, the same checks.
    assert isinstance(app.defer("t.send", invoice_id=1), int)


def test_configure_options(app: App, admin: Any, dsn: str) -> None:
    @app.task(name="t.report", queue="reports", priority=5)
    def report(day: str) -> None: ...

    later = report.configure(delay=timedelta(hours=1)).defer(day="mon")
    at = datetime(2030, 1, 1, tzinfo=UTC)
    fixed = report.configure(run_at=at, priority=-3, queue="urgent", max_attempts=9).defer(
        day="tue"
    )
    k1 = report.configure(key="report:wed").defer(day="wed")
    k2 = report.configure(key="report:wed").defer(day="wed")
    assert k1 == k2
    # In the caller's transaction: rolled back, nothing; committed, the job.
    with psycopg.connect(dsn) as conn:
        report.configure(conn=conn).defer(day="thu")
        conn.rollback()
        committed = report.configure(conn=conn).defer(day="fri")
        conn.commit()
    ids = report.defer_many([{"day": "sat"}, {"day": "sun"}], priority=1)
    got = {
        r[0]: r
        for r in admin.execute(
            sql.SQL("SELECT id, queue, priority, run_at, max_attempts, task FROM {}.jobs").format(
                sql.Identifier(app.schema)
            )
        ).fetchall()
    }
    assert set(got) == {later, fixed, k1, committed, *ids}
    assert got[later][3] > datetime.now(UTC) + timedelta(minutes=59)
    assert got[fixed][1:5] == ("urgent", -3, at, 9)
    assert got[k1][2] == 5  # the task's default priority
    assert [got[i][2] for i in ids] == [1, 1] and all(got[i][5] == "t.report" for i in ids)


def test_typed_arguments_convert_both_ways(app: App) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Line(pydantic.BaseModel):
        sku: str
        qty: int

    got: list[Any] = []

    @app.task(name="t.typed")
    def typed(lines: list[Line], due: datetime, to: Address | None = None) -> None:
        got.append((lines, due, to))

    due = datetime(2030, 5, 1, 12, tzinfo=UTC)
    job_id = typed.defer(lines=[{"sku": "A", "qty": "2"}], due=due, to=Address("s", "c"))
    with pytest.raises(TypeError, match="argument 'lines'"):
        typed.defer(lines=[{"sku": "A"}], due=due)
    with running(app.worker()):
        app.wait(job_id, timeout=20)
    [(lines, when, to)] = got
    assert lines == [Line(sku="A", qty=2)] and when == due and to == Address("s", "c")


def test_task_retry_policy_and_final_failure(app: App, admin: Any) -> None:
    calls: list[int] = []

    @app.task(name="t.flaky", max_attempts=3, retry=RetryPolicy(base=0.05, jitter=0))
    def flaky(n: int) -> None:
        calls.append(n)
        raise ValueError(f"bad invoice {n}")

    @app.task(name="t.refuse")
    def refuse() -> None:
        raise Fail("not ours")

    a, b = flaky.defer(n=1), refuse.defer()
    with running(app.worker(concurrency=2)):
        with pytest.raises(JobFailed, match="ValueError: bad invoice 1"):
            app.wait(a, timeout=20)
        with pytest.raises(JobFailed, match="not ours"):
            app.wait(b, timeout=20)
    assert calls == [1, 1, 1]
    assert {r[0]: r[4] for r in rows(admin, app.schema)} == {a: 3, b: 1}


def test_retry_on_and_no_retry_on_choose_what_is_retried(app: App, admin: Any) -> None:
    """An exception outside ``retry_on``, or inside ``no_retry_on`` (which wins), ends
    the job failed on its first attempt with the exception recorded; the others are
    retried as before."""
    calls: list[str] = []

    class Permanent(ValueError):
        pass

    @app.task(
        name="t.sel",
        max_attempts=3,
        retry=RetryPolicy(base=0.01, jitter=0),
        retry_on=(ConnectionError, ValueError),
        no_retry_on=Permanent,
    )
    def sel(kind: str) -> None:
        calls.append(kind)
        raise {"conn": ConnectionError, "perm": Permanent, "key": KeyError}[kind](kind)

    ids = {k: sel.defer(kind=k) for k in ("conn", "perm", "key")}
    with running(app.worker(concurrency=3)):
        with pytest.raises(JobFailed, match="ConnectionError: conn"):
            app.wait(ids["conn"], timeout=20)
        with pytest.raises(JobFailed, match="Permanent: perm"):
            app.wait(ids["perm"], timeout=20)
        with pytest.raises(JobFailed, match="KeyError: 'key'"):
            app.wait(ids["key"], timeout=20)
    attempts = {r[0]: r[4] for r in rows(admin, app.schema)}
    assert attempts == {ids["conn"]: 3, ids["perm"]: 1, ids["key"]: 1}
    assert sorted(calls) == ["conn", "conn", "conn", "key", "perm"]
    error = admin.execute(
        sql.SQL("SELECT last_error FROM {}.jobs WHERE id = %s").format(sql.Identifier(app.schema)),
        [ids["perm"]],
    ).fetchone()[0]
    assert error.startswith("Permanent is not retried (task t.sel)") and "Traceback" in error


def test_retry_on_rejects_what_is_not_an_exception_class(app: App) -> None:
    with pytest.raises(ConfigError, match="retry_on takes Exception classes, not 5"):
        app.task(retry_on=5)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="no_retry_on takes Exception classes"):
        app.task(no_retry_on=(ValueError, "KeyError"))  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="cannot name Fail"):
        app.task(no_retry_on=(Fail,))


def test_task_timeout(app: App) -> None:
    release = threading.Event()

    @app.task(name="t.slow", timeout=0.3, max_attempts=1)
    def slow() -> None:
        release.wait(10)

    @app.task(name="t.slow_async", timeout=0.3, max_attempts=1)
    async def slow_async() -> None:
        await asyncio.sleep(10)

    ids = [slow.defer(), slow_async.defer()]
    try:
        with running(app.worker(concurrency=2)) as w:
            for i in ids:
                with pytest.raises(JobFailed, match=r"timed out after 0\.3s"):
                    app.wait(i, timeout=20)
            assert w.stats.timed_out >= 1
    finally:
        release.set()


def test_worker_claims_only_the_tasks_it_knows(app: App, admin: Any, dsn: str) -> None:
    """A rolling deploy: producers on v2 defer a task the v1 workers do not know.  The
    job waits, uncharged, listed as unserved, until a worker that knows it starts."""

    @app.task(name="shop.v1_task")
    def old(n: int) -> int:
        return n

    new_app = App(dsn, schema=app.schema, max_size=2)

    @new_app.task(name="shop.v1_task")
    def old_again(n: int) -> int:
        return n

    @new_app.task(name="shop.v2_task")
    def new(n: int) -> int:
        return n * 10

    legacy = app.queue.enqueue({"raw": True})  # a handler-per-queue job: task NULL
    fresh = new.defer(n=4)
    known = old_again.defer(n=1)
    try:
        with running(app.worker(sweep_interval=0.05)) as v1:
            assert app.wait(known, timeout=20) == 1
            wait_until(lambda: bool(app.queue.unserved()), what="the v1 worker's registration")
            assert v1.tasks == ["shop.v1_task"]
            unserved = app.queue.unserved()
            assert [(u["queue"], u["task"], u["jobs"]) for u in unserved] == [
                ("default", "shop.v2_task", 1)
            ]
            state = {r[0]: (r[3], r[4]) for r in rows(admin, app.schema)}
            # Not claimed, not failed, not charged; the legacy job is not an App's either.
            assert state[fresh] == ("pending", 0) and state[legacy] == ("pending", 0)
        with running(new_app.worker(sweep_interval=0.05)):
            assert new_app.wait(fresh, timeout=20) == 40
            wait_until(lambda: not new_app.queue.unserved(), what="no unserved task")
        state = {r[0]: (r[3], r[4]) for r in rows(admin, app.schema)}
        assert state[fresh] == ("done", 1) and state[legacy] == ("pending", 0)
        # A stopped worker removes its own row: status knows it is gone at once.
        assert admin.execute(
            sql.SQL("SELECT count(*) FROM {}.workers").format(sql.Identifier(app.schema))
        ).fetchone() == (0,)
    finally:
        new_app.close()


def test_plain_worker_still_runs_every_job_of_its_queue(app: App, queue: Queue) -> None:
    """Worker(q, handler) keeps its meaning: every job of the queue, task or not."""
    app2 = App(queue.settings.dsn, schema=queue.schema, max_size=2)
    app2.migrate()

    @app2.task(name="t.any")
    def any_task(n: int) -> None: ...

    task_job, raw_job = any_task.defer(n=1), queue.enqueue({"raw": 1})
    seen: dict[int, tuple[str | None, Any]] = {}
    with running(Worker(queue, lambda j: seen.update({j.id: (j.task, j.payload)}))):
        wait_until(lambda: len(seen) == 2, what="both jobs")
    assert seen == {task_job: ("t.any", {"n": 1}), raw_job: (None, {"raw": 1})}
    app2.close()


def test_periodic_task(app: App, admin: Any) -> None:
    ran: list[str] = []

    @app.periodic("* * * * * *", kwargs={"what": "tick"})
    @app.task(name="t.every_second", queue="cron")
    def every_second(what: str) -> None:
        ran.append(what)

    with pytest.raises(TypeError, match="missing a required argument"):

        @app.periodic("* * * * * *")
        @app.task(name="t.needs_args")
        def needs_args(what: str) -> None: ...

    with running(app.worker()):
        wait_until(lambda: len(ran) >= 1, what="a periodic run")
    assert ran[0] == "tick"
    tasks = {r[2] for r in rows(admin, app.schema)}
    assert tasks == {"t.every_second"}


def test_app_connects_lazily_and_names_default_to_qualname(dsn: str) -> None:
    a = App("postgresql://nobody@127.0.0.1:1/none")

    @a.task
    def plain(x: int) -> int:
        return x

    assert (
        plain.name
        == f"{__name__}.test_app_connects_lazily_and_names_default_to_qualname.<locals>.plain"
    )
    assert plain(2) == 2  # no connection was needed for any of this
    with pytest.raises(DatabaseUnavailable, match=r"cannot reach PostgreSQL at .*127\.0\.0\.1"):
        plain.defer(x=1)
    a.close()
