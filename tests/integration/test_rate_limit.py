"""Per-task rate limits (migration 0020): each enqueue takes its key's next slot.

The limit is applied at enqueue, not at claim: a rate-limited job's run_at becomes its
key's next free slot, so a real Worker starts the k-th of a batch no sooner than k
intervals after the enqueue, while other tasks of the same queue and delayed jobs run
when they are due.  Two producers of one key take turns on the key's row (driven with
pg_blocking_pids) and get distinct slots; a rolled-back enqueue gives its slot back.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App, ConfigError, Queue, chain

from .test_worker import running, wait_until


def _run_ats(admin: psycopg.Connection[Any], schema: str, ids: list[int]) -> list[float]:
    rows = admin.execute(
        sql.SQL(
            "SELECT extract(epoch FROM run_at)::float8, rate_key, rate_every "
            "FROM {}.jobs WHERE id = ANY(%s) ORDER BY array_position(%s, id)"
        ).format(sql.Identifier(schema)),
        (ids, ids),
    ).fetchall()
    # The insert consumes its rate columns: a row moved between generations later
    # (a DELETE and an INSERT) must not take a second slot.
    assert all(r[1] is None and r[2] is None for r in rows)
    return [float(r[0]) for r in rows]


def _blocked_by(admin: psycopg.Connection[Any], pid: int) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
        (pid,),
    ).fetchone()
    return row is not None and int(row[0]) > 0


def test_limited_jobs_follow_the_rate_and_hold_nothing_else_back(dsn: str, schema: str) -> None:
    """60 jobs of a task at 20/s under a real Worker: the k-th start is no sooner than
    k/20 s after the enqueue, every job runs once; a job of another task enqueued after
    them, and a delayed one, run long before the limited backlog is through."""
    app = App(dsn, schema=schema, max_size=4)
    app.queue.migrate()
    starts: dict[str, list[tuple[float, int]]] = {"limited": [], "other": []}
    lock = threading.Lock()
    try:

        @app.task(rate_limit="20/s")
        def limited(n: int) -> None:
            with lock:
                starts["limited"].append((time.time(), n))

        @app.task
        def other(n: int) -> None:
            with lock:
                starts["other"].append((time.time(), n))

        worker = app.worker(concurrency=4, poll_interval=0.02, lease=10)
        with running(worker):
            t0 = time.time()
            limited.defer_many([{"n": n} for n in range(60)])
            other.defer(n=1)
            other.configure(delay=0.5).defer(n=2)
            wait_until(lambda: len(starts["limited"]) >= 60 and len(starts["other"]) >= 2)
        got = sorted(starts["limited"])
        assert sorted(n for _, n in got) == list(range(60)), "every job runs exactly once"
        for k, (at, _) in enumerate(got):
            # Lag only delays a start; none is before its slot (10 ms: rounding and
            # the server's clock against ours, the same machine).
            assert at >= t0 + k * 0.05 - 0.01, f"start #{k} at +{at - t0:.3f}s"
        last = got[-1][0]
        assert last - t0 >= 59 * 0.05 - 0.01
        other_at = dict((n, at) for at, n in starts["other"])
        # Not behind the 3 s of limited jobs: at once, and the delayed one when due.
        assert other_at[1] - t0 < 1.5 and other_at[1] < last
        assert 0.5 - 0.01 <= other_at[2] - t0 < 2.0 and other_at[2] < last
    finally:
        app.close()


def test_keys_have_their_own_rates(dsn: str, schema: str, admin: psycopg.Connection[Any]) -> None:
    """One defer_many over two keys: each key's slots start now and are spaced by its
    interval, independently of the other key; a later defer continues its key's line."""
    app = App(dsn, schema=schema, max_size=4)
    app.queue.migrate()
    try:

        @app.task(rate_limit="10/s", rate_limit_key="customer:{customer_id}")
        def sync(customer_id: int, n: int = 0) -> None: ...

        before = time.time()
        ids = sync.defer_many([{"customer_id": c, "n": n} for n in range(5) for c in (1, 2)])
        one = _run_ats(admin, schema, ids[0::2])
        two = _run_ats(admin, schema, ids[1::2])
        for line in (one, two):
            assert before - 0.01 <= line[0] <= time.time() + 0.01
            assert [round(b - a, 6) for a, b in itertools.pairwise(line)] == [0.1] * 4
        assert abs(one[0] - two[0]) < 0.01
        later = sync.defer(customer_id=1)
        assert _run_ats(admin, schema, [later]) == [pytest.approx(one[-1] + 0.1, abs=1e-6)]
        rows = admin.execute(
            sql.SQL("SELECT key FROM {}.rate_limits ORDER BY key").format(sql.Identifier(schema))
        ).fetchall()
        assert [r[0] for r in rows] == ["customer:1", "customer:2"]
    finally:
        app.close()


def test_a_delayed_job_keeps_its_own_later_time(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """run_at = greatest(its own run_at, its slot): a job delayed past its slot keeps its
    delay, and the job after it is not pushed behind that delay."""
    far = queue.enqueue(
        {}, rate_key="k", rate_every=1.0, run_at=_db_now(admin) + timedelta(hours=1)
    )
    nxt = queue.enqueue({}, rate_key="k", rate_every=1.0)
    far_at, nxt_at = _run_ats(admin, queue.schema, [far, nxt])
    assert far_at - time.time() > 3500
    assert 0.5 < nxt_at - time.time() < 1.5  # the slot after the delayed job's: now + 1 s


def _db_now(admin: psycopg.Connection[Any]) -> Any:
    row = admin.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_two_producers_of_one_key_get_distinct_slots(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], outcome: str
) -> None:
    """Producer A enqueues in an open transaction; B's enqueue of the same key waits on
    A's lock of the key's row (pg_blocking_pids).  A commits: B's slot is one interval
    after A's.  A rolls back: A's slot is given back and B takes it."""
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        # Neither autocommits: each enqueue stays in its producer's open transaction.
        a_id = queue.enqueue({"p": "a"}, rate_key="shared", rate_every=5.0, conn=a)
        got: list[int] = []
        t = threading.Thread(
            target=lambda: got.append(
                queue.enqueue({"p": "b"}, rate_key="shared", rate_every=5.0, conn=b)
            )
        )
        t.start()
        wait_until(lambda: _blocked_by(admin, a.info.backend_pid), what="B waiting on A")
        assert not got
        if outcome == "commit":
            a.commit()
        else:
            a.rollback()
        t.join(timeout=10)
        b.commit()
    assert not t.is_alive() and len(got) == 1
    now = time.time()
    if outcome == "commit":
        a_at, b_at = _run_ats(admin, queue.schema, [a_id, got[0]])
        assert a_at <= now + 0.01 and b_at == pytest.approx(a_at + 5.0, abs=1e-6)
    else:
        assert queue.get(a_id) is None
        (b_at,) = _run_ats(admin, queue.schema, [got[0]])
        assert b_at <= now + 0.01  # A's slot, given back by its rollback


def test_rate_limit_options_are_checked(dsn: str, schema: str, queue: Queue) -> None:
    app = App(dsn, schema=schema, max_size=2)
    try:
        with pytest.raises(ConfigError, match='rate_limit must be "N/s", "N/m" or "N/h"'):

            @app.task(rate_limit="10/week")
            def bad_unit() -> None: ...

        with pytest.raises(ConfigError, match="rate_limit_key needs a rate_limit"):

            @app.task(rate_limit_key="{x}")
            def no_rate(x: int) -> None: ...

        with pytest.raises(ConfigError, match="names 'customer', not an argument"):

            @app.task(rate_limit="1/s", rate_limit_key="{customer}")
            def bad_key(customer_id: int) -> None: ...

        with pytest.raises(ConfigError, match="rate_limit cannot be combined with key"):

            @app.task(rate_limit="1/s", key="{x}")
            def unique(x: int) -> None: ...

        @app.task(rate_limit="100/h")
        def ok(x: int) -> None: ...

        assert ok.rate_every == 36.0
        with pytest.raises(ConfigError, match="cannot be a canvas step"):
            chain(ok.s(x=1), ok.s(x=2)).defer()
    finally:
        app.close()
    with pytest.raises(ValueError, match="rate_every needs a rate_key"):
        queue.enqueue({}, rate_every=1.0)
    with pytest.raises(ValueError, match=r"rate_every .* must be a positive number"):
        queue.enqueue({}, rate_key="k", rate_every=0)
    with pytest.raises(ValueError, match="rate limit cannot be combined with an idempotency"):
        queue.enqueue({}, rate_key="k", rate_every=1.0, idempotency_key="i")
    parent = queue.enqueue({})
    with pytest.raises(ValueError, match="after cannot be combined with a rate limit"):
        queue.enqueue({}, rate_key="k", rate_every=1.0, after=[parent])
    assert [j["id"] for j in queue.list_jobs()] == [parent]


def test_rate_and_concurrency_key_together(queue: Queue, admin: psycopg.Connection[Any]) -> None:
    """A job with both waits for its slot and for admission: the second job of the key
    is throttled, and admitted by the first's completion keeps its later slot."""
    first, second = (
        queue.enqueue({"n": n}, concurrency_key="c", concurrency=1, rate_key="r", rate_every=30.0)
        for n in range(2)
    )
    assert [j.status for j in (queue.get(first), queue.get(second)) if j] == [
        "pending",
        "throttled",
    ]
    (job,) = queue.claim(worker="w", limit=5, lease=30)
    assert job.id == first
    queue.complete(job)
    admitted = queue.get(second)
    assert admitted is not None and admitted.status == "pending"
    first_at, second_at = _run_ats(admin, queue.schema, [first, second])
    assert second_at == pytest.approx(first_at + 30.0, abs=1e-6)
    assert queue.claim(worker="w", limit=5, lease=30) == []  # not before its slot


def test_async_deferrals_take_slots_too(
    dsn: str, schema: str, admin: psycopg.Connection[Any]
) -> None:
    app = App(dsn, schema=schema, max_size=2)
    app.queue.migrate()
    try:

        @app.task(rate_limit="2/s")
        def ping(n: int) -> None: ...

        async def main() -> list[int]:
            one = await ping.defer_async(n=0)
            rest = await ping.defer_many_async([{"n": 1}, {"n": 2}])
            await app.aclose()
            return [one, *rest]

        ids = asyncio.run(main())
        ats = _run_ats(admin, schema, ids)
        assert [round(b - a, 6) for a, b in itertools.pairwise(ats)] == [0.5, 0.5]
    finally:
        app.close()
