"""Unique jobs (issue 39, item 4): what a key means, what a conflict gets, and races.

Every interleaving here is driven by what PostgreSQL reports (``pg_blocking_pids``),
never by sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, ConfigError, DuplicateJob, Queue
from skiplock._queue import run_op

from .test_worker import running, wait_until


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[App]:
    a = App(dsn, schema=schema, application_name=f"skiplock-test:{schema}", max_size=4)
    a.migrate()
    yield a
    a.close()


def _payload(q: Queue, job_id: int) -> Any:
    job = q.get(job_id)
    assert job is not None
    return job.payload


def _count(admin: psycopg.Connection[Any], schema: str) -> int:
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone()
    assert row is not None
    return int(row[0])


def _finish(q: Queue, job_id: int, admin: psycopg.Connection[Any], ago: float = 0.0) -> None:
    """Run the job to done through the real claim and completion; then, if ``ago``,
    date its finish that many seconds back (a period passing, without a sleep)."""
    [job] = q.claim(worker="w", limit=1)
    assert job.id == job_id
    q.complete(job)
    if ago:
        admin.execute(
            sql.SQL(
                "UPDATE {}.jobs SET finished_at = finished_at - make_interval(secs => %s) "
                "WHERE id = %s"
            ).format(sql.Identifier(q.schema)),
            [ago, job_id],
        )


def _blocked_on(admin: psycopg.Connection[Any], blocker: int, app_name: str) -> Callable[[], bool]:
    def check() -> bool:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND %s = ANY(pg_blocking_pids(pid))",
            [app_name, blocker],
        ).fetchone()
        return row is not None and row[0] > 0

    return check


# -- what a key means ----------------------------------------------------------------------


def test_same_key_same_arguments_same_job_other_arguments_raise(queue: Queue, admin: Any) -> None:
    a = queue.enqueue({"customer_id": 42}, idempotency_key="charge:42:2026-12")
    assert queue.enqueue({"customer_id": 42}, idempotency_key="charge:42:2026-12") == a
    with pytest.raises(DuplicateJob) as err:
        queue.enqueue({"customer_id": 99}, idempotency_key="charge:42:2026-12")
    assert (err.value.job_id, err.value.reason, err.value.status) == (a, "arguments", "pending")
    assert str(err.value).startswith(
        f"key 'charge:42:2026-12' in queue 'default' is held by job {a} (pending) with "
        "other arguments"
    )
    # Another queue is another key space; jsonb equality ignores the keys' order.
    assert queue.enqueue({"customer_id": 99}, idempotency_key="charge:42:2026-12", queue="b") != a
    assert queue.enqueue({"b": 1, "a": 2}, idempotency_key="o") == queue.enqueue(
        {"a": 2, "b": 1}, idempotency_key="o"
    )
    assert _payload(queue, a) == {"customer_id": 42}
    assert _count(admin, queue.schema) == 3


def test_on_conflict_raise_refuses_even_the_same_arguments(queue: Queue) -> None:
    a = queue.enqueue({"n": 1}, idempotency_key="k", on_conflict="raise")
    with pytest.raises(
        DuplicateJob, match=f"held by job {a} \\(pending\\) and on_conflict='raise'"
    ):
        queue.enqueue({"n": 1}, idempotency_key="k", on_conflict="raise")


def test_replace_changes_the_arguments_until_the_job_starts(queue: Queue) -> None:
    a = queue.enqueue({"v": 1}, idempotency_key="sync:7")
    assert queue.enqueue({"v": 2}, idempotency_key="sync:7", on_conflict="replace") == a
    assert _payload(queue, a) == {"v": 2}
    [job] = queue.claim(worker="w")
    assert job.payload == {"v": 2}
    with pytest.raises(DuplicateJob) as err:
        queue.enqueue({"v": 3}, idempotency_key="sync:7", on_conflict="replace")
    assert (err.value.job_id, err.value.reason, err.value.status) == (a, "started", "running")
    # The same arguments still get the running job.
    assert queue.enqueue({"v": 2}, idempotency_key="sync:7", on_conflict="replace") == a


def test_without_a_period_a_key_holds_while_the_job_is_kept(queue: Queue, admin: Any) -> None:
    """The default is the old idempotency key: a finished job still holds it."""
    a = queue.enqueue({"n": 1}, idempotency_key="k")
    _finish(queue, a, admin, ago=30 * 86400)
    assert queue.enqueue({"n": 1}, idempotency_key="k") == a
    with pytest.raises(DuplicateJob, match=r"job \d+ \(done\) with other arguments"):
        queue.enqueue({"n": 2}, idempotency_key="k")


def test_unique_for_zero_holds_while_pending_or_running_only(queue: Queue, admin: Any) -> None:
    a = queue.enqueue({"n": 1}, idempotency_key="k", unique_for=0)
    assert queue.enqueue({"n": 1}, idempotency_key="k", unique_for=0) == a
    _finish(queue, a, admin)
    b = queue.enqueue({"n": 2}, idempotency_key="k", unique_for=0)
    assert b != a and _payload(queue, b) == {"n": 2}
    assert queue.enqueue({"n": 2}, idempotency_key="k", unique_for=0) == b
    # The old job keeps its key column; the key's row names the new holder.
    assert [j.idempotency_key for j in (queue.get(a), queue.get(b)) if j] == ["k", "k"]


def test_unique_for_a_period_after_the_finish(queue: Queue, admin: Any) -> None:
    hour = timedelta(hours=1)
    a = queue.enqueue({"n": 1}, idempotency_key="k", unique_for=hour)
    _finish(queue, a, admin, ago=59 * 60)
    assert queue.enqueue({"n": 1}, idempotency_key="k", unique_for=hour) == a
    with pytest.raises(DuplicateJob, match=r"\(done\) with other arguments"):
        queue.enqueue({"n": 2}, idempotency_key="k", unique_for=3600)
    admin.execute(
        sql.SQL("UPDATE {}.jobs SET finished_at = finished_at - interval '2 minutes'").format(
            sql.Identifier(queue.schema)
        )
    )
    b = queue.enqueue({"n": 2}, idempotency_key="k", unique_for=hour)
    assert b != a and _payload(queue, b) == {"n": 2}


def test_a_failed_or_cancelled_holder_counts_as_finished(queue: Queue, admin: Any) -> None:
    a = queue.enqueue({}, idempotency_key="k", unique_for=0)
    assert queue.cancel(a) == "cancelled"
    b = queue.enqueue({}, idempotency_key="k", unique_for=0)
    assert b != a


def test_bad_unique_options_are_refused_before_anything_is_sent(queue: Queue, admin: Any) -> None:
    with pytest.raises(ConfigError, match="on_conflict must be one of 'return', 'replace'"):
        queue.enqueue({}, idempotency_key="k", on_conflict="ignore")
    with pytest.raises(ConfigError, match="unique_for must be zero or more seconds"):
        queue.enqueue({}, idempotency_key="k", unique_for=-1)
    with pytest.raises(ConfigError, match="unique_for must be seconds or a timedelta"):
        queue.enqueue({}, idempotency_key="k", unique_for="1h")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="need an idempotency key"):
        queue.enqueue({}, unique_for=60)
    assert _count(admin, queue.schema) == 0


# -- batches ---------------------------------------------------------------------------------


def test_enqueue_many_dedups_within_the_batch_and_against_the_table(
    queue: Queue, admin: Any
) -> None:
    first = queue.enqueue({"n": 1}, idempotency_key="k1")
    ids = queue.enqueue_many(
        [{"n": 1}, {"n": 2}, {"n": 2}, {"n": 3}, {"n": 4}],
        idempotency_keys=["k1", "k2", "k2", None, "k4"],
    )
    assert ids[0] == first and ids[1] == ids[2] and len({first, ids[1], ids[3], ids[4]}) == 4
    assert _count(admin, queue.schema) == 4
    # Other arguments under a key, in the batch or against the table: nothing goes in.
    for keys in (["k9", "k9"], ["k9", "k1"]):
        with pytest.raises(DuplicateJob, match="with other arguments"):
            queue.enqueue_many([{"n": 8}, {"n": 9}], idempotency_keys=keys)
    assert _count(admin, queue.schema) == 4


def test_enqueue_many_replace_and_lapsed_keys(queue: Queue, admin: Any) -> None:
    a = queue.enqueue({"n": 0}, idempotency_key="a", unique_for=0)
    _finish(queue, a, admin)
    ids = queue.enqueue_many(
        [{"n": 1}, {"n": 2}, {"n": 3}],
        idempotency_keys=["a", "b", "b"],
        unique_for=0,
        on_conflict="replace",
    )
    # "a" lapsed: a new job.  "b" twice in the batch: the later call replaces the first.
    assert ids[0] != a and ids[1] == ids[2]
    assert _payload(queue, ids[0]) == {"n": 1} and _payload(queue, ids[1]) == {"n": 3}
    assert _count(admin, queue.schema) == 3


@pytest.mark.parametrize("on_conflict", ["return", "replace", "raise"])
def test_a_retry_after_a_lost_reply_finds_its_own_job(queue: Queue, on_conflict: str) -> None:
    """The first send committed but its reply was lost; the retry (same reserved id)
    answers with that job, even where a second enqueue would raise."""
    make = queue._enqueue_op({"n": 1}, "default", 0, None, 5, "k", on_conflict=on_conflict)
    with queue.connection() as conn:
        first = run_op(conn, make(False))
        again = run_op(conn, make(True))
    assert again == first
    many = queue._enqueue_many_op(
        [{"n": 1}, {"n": 2}], "default", 0, None, 5, ["m1", "m2"], on_conflict=on_conflict
    )
    with queue.connection() as conn:
        assert run_op(conn, many(False)) == run_op(conn, many(True))


def test_producer_ids_still_follow_its_enqueues(queue: Queue) -> None:
    ids = []
    for n in range(3):
        ids.append(queue.enqueue({"n": n}))
        ids.append(queue.enqueue({"n": n}, idempotency_key=f"k{n}", unique_for=0))
        ids.append(queue.enqueue({"n": n}))
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


# -- races -----------------------------------------------------------------------------------


@pytest.mark.parametrize("lapsed", [False, True], ids=["fresh", "lapsed"])
def test_producers_racing_one_key_make_one_job(
    queue: Queue, admin: Any, dsn: str, lapsed: bool
) -> None:
    """Eight producers on their own connections, released together: one job.  With
    ``lapsed`` the key's holder finished, so each producer tries to take the key over."""
    old = None
    if lapsed:
        old = queue.enqueue({}, idempotency_key="same", unique_for=0)
        _finish(queue, old, admin)
    ids: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def go() -> None:
        with Queue(dsn, schema=queue.schema, max_size=1) as q:
            barrier.wait()
            got = q.enqueue({}, idempotency_key="same", unique_for=0)
        with lock:
            ids.append(got)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 8 and len(set(ids)) == 1 and ids[0] != old
    assert _count(admin, queue.schema) == (2 if lapsed else 1)


def test_racing_producers_with_other_arguments_one_wins_the_rest_are_told(
    queue: Queue, dsn: str
) -> None:
    won: list[int] = []
    told: list[DuplicateJob] = []
    lock = threading.Lock()
    barrier = threading.Barrier(6)

    def go(n: int) -> None:
        with Queue(dsn, schema=queue.schema, max_size=1) as q:
            barrier.wait()
            try:
                got = q.enqueue({"n": n}, idempotency_key="same")
            except DuplicateJob as exc:
                with lock:
                    told.append(exc)
                return
        with lock:
            won.append(got)

    threads = [threading.Thread(target=go, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(told) == 5
    assert {e.job_id for e in told} == set(won)


def test_replace_waits_for_an_uncommitted_enqueue_and_replaces_it(
    queue: Queue, admin: Any, dsn: str
) -> None:
    """A holds the key uncommitted; B (replace, other arguments) waits on A's key, and
    once A commits finds its job pending and replaces the arguments: one job, B's."""
    name = f"skiplock-test:{queue.schema}:b"
    with psycopg.connect(dsn) as a_conn:
        a = queue.enqueue({"v": "a"}, idempotency_key="k", conn=a_conn)
        a_pid = a_conn.info.backend_pid
        out: list[Any] = []

        def b() -> None:
            with Queue(dsn, schema=queue.schema, max_size=1, application_name=name) as q:
                out.append(q.enqueue({"v": "b"}, idempotency_key="k", on_conflict="replace"))

        t = threading.Thread(target=b)
        t.start()
        wait_until(_blocked_on(admin, a_pid, name), what="B waiting on A's key")
        a_conn.commit()
        t.join(20)
    assert out == [a]
    assert _payload(queue, a) == {"v": "b"} and _count(admin, queue.schema) == 1


def test_replace_that_loses_to_a_claim_raises(queue: Queue, admin: Any, dsn: str) -> None:
    """B (replace) reaches the pending job while a claim holds its row; the claim
    commits first, so B finds it started and raises, and the job keeps its arguments."""
    a = queue.enqueue({"v": "a"}, idempotency_key="k")
    name = f"skiplock-test:{queue.schema}:b"
    with psycopg.connect(dsn) as claimer:
        # The real claim, in a transaction held open: the job's row stays locked.
        claim = queue._claim_op("w", "default", 1, 30.0, own_transaction=False)
        [job] = run_op(claimer, claim(False))
        assert job.id == a
        pid = claimer.info.backend_pid
        out: list[Any] = []

        def b() -> None:
            with Queue(dsn, schema=queue.schema, max_size=1, application_name=name) as q:
                try:
                    out.append(q.enqueue({"v": "b"}, idempotency_key="k", on_conflict="replace"))
                except DuplicateJob as exc:
                    out.append(exc)

        t = threading.Thread(target=b)
        t.start()
        wait_until(_blocked_on(admin, pid, name), what="B waiting on the claimed row")
        claimer.commit()
        t.join(20)
    [err] = out
    assert isinstance(err, DuplicateJob)
    assert (err.job_id, err.reason, err.status) == (a, "started", "running")
    assert _payload(queue, a) == {"v": "a"}


def test_replace_finds_a_job_that_upkeep_moved_while_it_waited(
    queue: Queue, admin: Any, dsn: str
) -> None:
    """Upkeep moves a delayed job by deleting it and inserting it again in one
    statement; a replace that waited on the deleted version looks the job up again and
    replaces it, instead of calling it started."""
    a = queue.enqueue({"v": "a"}, idempotency_key="k")
    name = f"skiplock-test:{queue.schema}:b"
    with psycopg.connect(dsn) as mover:
        mover.execute(
            sql.SQL(
                "WITH moved AS (DELETE FROM {0}.jobs WHERE id = %s RETURNING *) "
                "INSERT INTO {0}.jobs SELECT * FROM moved"
            ).format(sql.Identifier(queue.schema)),
            [a],
        )
        out: list[Any] = []

        def b() -> None:
            with Queue(dsn, schema=queue.schema, max_size=1, application_name=name) as q:
                out.append(q.enqueue({"v": "b"}, idempotency_key="k", on_conflict="replace"))

        t = threading.Thread(target=b)
        t.start()
        wait_until(_blocked_on(admin, mover.info.backend_pid, name), what="B waiting on the move")
        mover.commit()
        t.join(20)
    assert out == [a] and _payload(queue, a) == {"v": "b"}


def test_taking_over_a_lapsed_key_waits_for_the_other_taker(
    queue: Queue, admin: Any, dsn: str
) -> None:
    """A takes a lapsed key over, uncommitted; B waits on the key's row, then finds A's
    new job live: the same arguments get A's job, other ones raise naming it."""
    old = queue.enqueue({"n": 1}, idempotency_key="k", unique_for=0)
    _finish(queue, old, admin)
    name = f"skiplock-test:{queue.schema}:b"
    for args, expect_same in (({"n": 1}, True), ({"n": 2}, False)):
        with psycopg.connect(dsn) as a_conn:
            a = queue.enqueue({"n": 1}, idempotency_key="k", unique_for=0, conn=a_conn)
            out: list[Any] = []

            def b(args: dict[str, int] = args, out: list[Any] = out) -> None:
                with Queue(dsn, schema=queue.schema, max_size=1, application_name=name) as q:
                    try:
                        out.append(q.enqueue(args, idempotency_key="k", unique_for=0))
                    except DuplicateJob as exc:
                        out.append(exc)

            t = threading.Thread(target=b)
            t.start()
            wait_until(_blocked_on(admin, a_conn.info.backend_pid, name), what="B waiting")
            a_conn.commit()
            t.join(20)
        if expect_same:
            assert out == [a]
        else:
            [err] = out
            assert isinstance(err, DuplicateJob) and err.job_id == a
        _finish(queue, a, admin)
    assert _count(admin, queue.schema) == 3


# -- tasks -----------------------------------------------------------------------------------


def test_task_keys_end_to_end(app: App, admin: Any) -> None:
    @app.task(name="t.charge", key="charge:{customer_id}:{month}", unique_for=timedelta(hours=1))
    def charge(customer_id: int, month: str) -> str:
        return f"charged {customer_id} for {month}"

    @app.task(name="t.sync")
    def sync(customer_id: int) -> None: ...

    a = charge.defer(customer_id=42, month="2026-12")
    assert charge.defer(42, "2026-12") == a
    assert charge.defer(customer_id=43, month="2026-12") != a
    # The case: an explicit key reused with other arguments.
    s = sync.configure(key="sync:42").defer(customer_id=42)
    with pytest.raises(DuplicateJob, match=f"held by job {s} .*other arguments"):
        sync.configure(key="sync:42").defer(customer_id=99)
    assert sync.configure(key="sync:42", on_conflict="replace").defer(customer_id=99) == s
    # defer_many: the template keys each call, within the batch and against the table.
    ids = charge.defer_many(
        [
            {"customer_id": 42, "month": "2026-12"},
            {"customer_id": 44, "month": "2026-12"},
            {"customer_id": 44, "month": "2026-12"},
        ]
    )
    assert ids[0] == a and ids[1] == ids[2] and ids[1] not in (a, s)
    with running(app.worker()):
        assert app.wait(a, timeout=20) == "charged 42 for 2026-12"
    # Finished within the hour: still the same job.
    assert charge.defer(customer_id=42, month="2026-12") == a
    # While live only: a new one.
    again = charge.configure(unique_for=0).defer(customer_id=42, month="2026-12")
    assert again != a
    with pytest.raises(ConfigError, match="need a key"):
        sync.configure(unique_for=60)
    with pytest.raises(ConfigError, match="defer_many takes no key"):
        sync.configure(key="x").defer_many([{"customer_id": 1}])
    with pytest.raises(TypeError, match=r"key 'charge:.*KeyError"):
        app.task(name="t.bad", key="charge:{nope}")(lambda customer_id: None).defer(customer_id=1)
