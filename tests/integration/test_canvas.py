"""Celery's canvas on tasks: chain, group, chord, nested, written as one graph.

Real workers run every workflow; the write is checked for atomicity (a rolled-back
transaction leaves nothing) and for its round trips (two, whatever the size)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from skiplock import App, Fail, JobFailed, UnknownJob, Worker, Workflow, chain, chord, group

from .test_worker import running


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[App]:
    a = App(dsn, schema=schema, max_size=4)

    @a.task(name="add")
    def add(x: int, y: int) -> int:
        return x + y

    @a.task(name="mul")
    def mul(x: int, y: int) -> int:
        return x * y

    @a.task(name="tsum")
    def tsum(xs: list[int]) -> int:
        return sum(xs)

    @a.task(name="boom", max_attempts=1)
    def boom(x: int) -> int:
        raise Fail(f"boom at {x}")

    @a.task(name="ping")
    def ping() -> str:
        return "pong"

    a.migrate()
    yield a
    a.close()


@pytest.fixture
def worker(app: App) -> Iterator[Worker]:
    with running(app.worker(concurrency=4, poll_interval=0.05, lease=10)) as w:
        yield w


def t(app: App, name: str) -> Any:
    return app.get_task(name)


def test_a_chain_feeds_each_result_to_the_next_step(app: App, worker: Worker) -> None:
    add, mul = t(app, "add"), t(app, "mul")
    wf = chain(add.s(1, 2), add.s(3), mul.s(10)).defer()
    assert app.wait(wf, timeout=30) == 60  # (1 + 2 + 3) * 10
    assert app.wait(wf.id, timeout=30) == 60  # by id too
    assert len(wf.jobs) == 3 and wf.id == wf.jobs[0]


def test_a_group_returns_its_members_results_in_order(app: App, worker: Worker) -> None:
    add = t(app, "add")
    wf = group(add.s(i, i) for i in range(30)).defer()
    assert wf.wait(timeout=30) == [2 * i for i in range(30)]


def test_a_chord_gives_its_callback_the_list(app: App, worker: Worker) -> None:
    add, tsum = t(app, "add"), t(app, "tsum")
    wf = chord(group(add.s(i, 1) for i in range(10)), tsum.s()).defer()
    assert app.wait(wf, timeout=30) == sum(i + 1 for i in range(10))


def test_nested_canvases_arrange_results_as_they_nest(app: App, worker: Worker) -> None:
    add, mul, tsum = t(app, "add"), t(app, "mul"), t(app, "tsum")
    # 1 + 1 = 2; a group of (2 + 1, 2 + 2) = [3, 4]; their sum 7; times 2.
    wf = chain(add.s(1, 1), group(add.s(1), add.s(2)), tsum.s(), mul.s(2)).defer()
    assert app.wait(wf, timeout=30) == 14
    # A chord whose header holds a chain: [(1 + 1) + 1, 5 + 5] summed.
    inner = chord(group(chain(add.s(1, 1), add.s(1)), add.s(5, 5)), tsum.s())
    assert app.wait(inner.defer(), timeout=30) == 13
    # A group of groups keeps its nesting.
    nested = group(group(add.s(1, 1), add.s(2, 2)), add.s(3, 3)).defer()
    assert app.wait(nested, timeout=30) == [[2, 4], 6]


def test_an_immutable_signature_waits_but_takes_nothing(app: App, worker: Worker) -> None:
    add, ping = t(app, "add"), t(app, "ping")
    wf = chain(add.s(1, 1), ping.si(), add.si(5, 5)).defer()
    assert app.wait(wf, timeout=30) == 10
    first, second, third = (app.queue.get(i) for i in wf.jobs)
    assert first and second and third
    assert first.finished_at and second.started_at and second.finished_at and third.started_at
    assert first.finished_at <= second.started_at and second.finished_at <= third.started_at


def test_a_failed_step_is_named_and_the_rest_is_cancelled(app: App, worker: Worker) -> None:
    add, boom = t(app, "add"), t(app, "boom")
    wf = chain(add.s(1, 1), boom.s(), add.s(1)).defer()
    with pytest.raises(JobFailed) as err:
        app.wait(wf, timeout=30)
    assert err.value.job_id == wf.jobs[1] and err.value.workflow_id == wf.id
    assert str(err.value) == f"workflow {wf.id}: step boom (job {wf.jobs[1]}) failed: boom at 2"
    last = app.queue.get(wf.jobs[2])
    assert last is not None and last.status == "cancelled"
    assert last.last_error == f"cancelled: parent job {wf.jobs[1]} failed"
    # A failed member of a chord's group: the callback never runs.
    tsum = t(app, "tsum")
    wf = chord(group(add.s(1, 1), boom.s(7)), tsum.s()).defer()
    with pytest.raises(JobFailed, match=r"step boom .* failed: boom at 7"):
        app.wait(wf, timeout=30)


def test_the_whole_graph_is_written_in_the_callers_transaction(app: App, dsn: str) -> None:
    add, tsum = t(app, "add"), t(app, "tsum")
    canvas = chord(group(add.s(i, i) for i in range(500)), tsum.s())
    sent: list[str] = []

    class Counting(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
            sent.append(str(query)[:40])
            return super().execute(query, params, **kw)

    with psycopg.connect(dsn, cursor_factory=Counting) as conn:
        wf = canvas.defer(conn=conn)
        conn.rollback()
    assert len(sent) == 2  # the ids, then the jobs, edges and workflow: not per step
    assert app.queue.status() == [] and app.queue.workflow(wf.id) is None
    with psycopg.connect(dsn) as conn:
        wf = canvas.defer(conn=conn)
    steps = app.queue.workflow(wf.id)
    assert steps is not None and len(steps["steps"]) == 501
    assert {s["status"] for s in steps["steps"][:500]} == {"pending"}
    assert steps["steps"][500]["status"] == "waiting"


def test_arguments_are_checked_at_defer_and_nothing_is_written(app: App) -> None:
    add, ping = t(app, "add"), t(app, "ping")
    with pytest.raises(TypeError, match="unexpected argument 'z'; it takes x, y"):
        chain(add.s(1, 2), add.s(z=3)).defer()
    with pytest.raises(TypeError, match="takes the previous step's result"):
        chain(add.s(1, 2), add.s(x=3)).defer()
    with pytest.raises(TypeError, match=r"no first positional parameter .* ping.si"):
        chain(add.s(1, 2), ping.s()).defer()
    with pytest.raises(TypeError, match="missing a required argument"):
        chain(add.s(1)).defer()  # first: nothing to take from a parent
    with pytest.raises(TypeError, match=r"task\.s\(\.\.\.\)"):
        chain(add.s(1, 2), add).defer()
    with pytest.raises(ValueError, match="at least one step"):
        chain()
    assert app.queue.status() == []
    with pytest.raises(UnknownJob):
        app.wait(Workflow(123456, (), app), timeout=1)


def test_defer_and_defer_many_take_after(app: App) -> None:
    add = t(app, "add")
    parent = add.defer(1, 2)
    kids = add.configure(after=[parent]).defer_many([{"x": i, "y": i} for i in range(3)])
    one = add.configure(after=[parent], on_parent_failure="run").defer(5, 5)
    q = app.queue

    def states() -> list[str]:
        return [str(j.status) for j in (q.get(i) for i in [*kids, one]) if j is not None]

    assert states() == ["waiting"] * 4
    [job] = q.claim(worker="w", limit=10)
    q.complete(job, 3)
    assert states() == ["pending"] * 4
    with pytest.raises(ValueError, match="idempotency_key"):
        add.configure(after=[parent], key="k").defer(1, 1)


def test_async_defer_and_the_async_worker_pass_results(app: App) -> None:
    """defer_async writes through the AsyncQueue; the AsyncWorker fills a step's
    argument from its parents, for a sync task (in a thread) and an async one."""

    @app.task(name="amul")
    async def amul(x: int, y: int) -> int:
        return x * y

    add, tsum = t(app, "add"), t(app, "tsum")

    async def main() -> Any:
        w = app.async_worker(concurrency=4, poll_interval=0.05)
        runner = asyncio.create_task(w.run())
        try:
            wf = await chord(group(add.s(1, 1), amul.s(2, 3)), tsum.s()).defer_async()
            second = await chain(add.s(2, 2), amul.s(10)).defer_async()
            return await asyncio.to_thread(
                lambda: (app.wait(wf, timeout=30), app.wait(second, timeout=30))
            )
        finally:
            w.stop()
            await runner
            await app.aclose()

    assert asyncio.run(main()) == (8, 40)
