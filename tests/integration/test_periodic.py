"""Periodic schedules against a real server: exactly-once ticks under racing schedulers,
catch-up across restarts, a tick and its job together or not at all, pruning, Worker."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Job, Periodic, Queue, Worker
from skiplock._migrate import migrate_op
from skiplock._periodic import PeriodicScheduler
from skiplock._queue import run_op

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def ticks(admin: psycopg.Connection[Any], schema: str) -> list[tuple[str, datetime, int]]:
    return admin.execute(  # type: ignore[return-value]
        sql.SQL("SELECT name, scheduled_at, job_id FROM {}.periodic_ticks ORDER BY 1, 2").format(
            sql.Identifier(schema)
        )
    ).fetchall()


def jobs(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return admin.execute(
        sql.SQL("SELECT id, queue, run_at, payload FROM {}.jobs ORDER BY run_at, id").format(
            sql.Identifier(schema)
        )
    ).fetchall()


def test_a_round_enqueues_due_ticks_once(queue: Queue, admin: Any) -> None:
    spec = Periodic("every10s", "*/10 * * * * *", queue="reports", catch_up="all")
    s = PeriodicScheduler(queue, [spec])
    first = s.run_once(T0)
    assert [t.scheduled_at for t in first.enqueued] == [T0]  # no history: the newest tick
    assert first.next_at == T0 + timedelta(seconds=10)
    later = s.run_once(T0 + timedelta(seconds=35))
    assert [t.scheduled_at for t in later.enqueued] == [
        T0 + timedelta(seconds=n) for n in (10, 20, 30)
    ]
    assert s.run_once(T0 + timedelta(seconds=35)).enqueued == []  # again: nothing
    rows = jobs(admin, queue.schema)
    assert [(r[1], r[2]) for r in rows] == [
        ("reports", T0 + timedelta(seconds=n)) for n in (0, 10, 20, 30)
    ]
    assert rows[0][3] == {"periodic": "every10s", "scheduled_at": T0.isoformat()}
    assert [(n, at, j) for n, at, j in ticks(admin, queue.schema)] == [
        ("every10s", r[2], r[0]) for r in rows
    ]


@pytest.mark.connections(24)
def test_racing_schedulers_enqueue_each_tick_exactly_once(
    dsn: str, queue: Queue, admin: Any
) -> None:
    """8 threads, each its own pool, run the same rounds on the same clock readings at
    once; every tick, catch-up included, ends with exactly one job."""
    specs = [
        Periodic("sec", "* * * * * *", catch_up="all"),
        Periodic("five", "*/5 * * * * *", queue="other", catch_up="latest", grace=3),
    ]
    clocks = [T0 + timedelta(seconds=s) for s in (0, 1, 2, 40, 41, 300)]
    n = 8
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    enqueued: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            with Queue(dsn, schema=queue.schema, max_size=2) as q:
                s = PeriodicScheduler(q, specs)
                for now in clocks:
                    barrier.wait(timeout=30)
                    got = s.run_once(now).enqueued
                    with lock:
                        enqueued.extend(t.job_id for t in got)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    got = ticks(admin, queue.schema)
    sec = [at for name, at, _ in got if name == "sec"]
    # 0..2, then 3..40 caught up and 41, then 42..300 caught up: every second once.
    assert sec == [T0 + timedelta(seconds=s) for s in range(301)]
    five = [at for name, at, _ in got if name == "five"]
    # latest: 0 (t=0..2), 40 (at t=40, newest within grace), 300 (newest after a gap)
    assert five == [T0, T0 + timedelta(seconds=40), T0 + timedelta(seconds=300)]
    rows = jobs(admin, queue.schema)
    assert len(rows) == len(got) == len(set(enqueued))
    assert sorted(enqueued) == sorted(r[0] for r in rows) == sorted(j for *_, j in got)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("skip", [0, 29, 30]),  # 1..28 are more than 60 s late at t=30 min
        ("latest", [0, 29, 30]),  # ticks within grace exist, so as skip
        ("all", list(range(31))),
    ],
)
def test_catch_up_after_downtime_reads_the_last_tick_from_the_database(
    dsn: str, queue: Queue, admin: Any, policy: str, expected: list[int]
) -> None:
    spec = Periodic("minutely", "* * * * *", catch_up=policy, grace=90)  # type: ignore[arg-type]
    PeriodicScheduler(queue, [spec]).run_once(T0)
    # A new process (fresh pool, nothing in memory) comes back 30 minutes later.
    with Queue(dsn, schema=queue.schema, max_size=1) as q:
        PeriodicScheduler(q, [spec]).run_once(T0 + timedelta(minutes=30, seconds=10))
    got = [at for _, at, _ in ticks(admin, queue.schema)]
    assert got == [T0 + timedelta(minutes=m) for m in expected]


def test_latest_after_downtime_beyond_grace_enqueues_one(queue: Queue, admin: Any) -> None:
    spec = Periodic("hourly", "0 * * * *", catch_up="latest")
    s = PeriodicScheduler(queue, [spec])
    s.run_once(T0)
    s.run_once(T0 + timedelta(hours=5, minutes=30))
    got = [at for _, at, _ in ticks(admin, queue.schema)]
    assert got == [T0, T0 + timedelta(hours=5)]


def test_a_tick_and_its_job_commit_together_or_not_at_all(queue: Queue, admin: Any) -> None:
    """The job insert fails (a trigger refuses it): the tick is not recorded either, and
    the next round enqueues it."""
    ident = sql.Identifier(queue.schema)
    admin.execute(
        sql.SQL(
            "CREATE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused by test'; END $$;"
            "CREATE TRIGGER refuse BEFORE INSERT ON {s}.jobs "
            "FOR EACH ROW EXECUTE FUNCTION {s}.refuse()"
        ).format(s=ident)
    )
    s = PeriodicScheduler(queue, [Periodic("p", "* * * * * *")])
    with pytest.raises(psycopg.errors.RaiseException):
        s.run_once(T0)
    assert ticks(admin, queue.schema) == [] and jobs(admin, queue.schema) == []
    admin.execute(sql.SQL("DROP TRIGGER refuse ON {}.jobs").format(ident))
    assert [t.scheduled_at for t in s.run_once(T0).enqueued] == [T0]
    assert len(ticks(admin, queue.schema)) == len(jobs(admin, queue.schema)) == 1


def test_prune_keeps_the_latest_tick_so_catch_up_still_works(queue: Queue, admin: Any) -> None:
    spec = Periodic("p", "* * * * *", catch_up="all")
    s = PeriodicScheduler(queue, [spec])
    s.run_once(T0)  # T0 is long ago on the database's clock
    s.run_once(T0 + timedelta(minutes=3))
    assert len(ticks(admin, queue.schema)) == 4
    s.keep_ticks = 60.0
    s.prune()
    assert [at for _, at, _ in ticks(admin, queue.schema)] == [T0 + timedelta(minutes=3)]
    # An older tick cannot come back: the guard refuses ticks at or before the latest.
    s2 = PeriodicScheduler(queue, [Periodic("p", "* * * * *", catch_up="all")])
    assert s2.run_once(T0 + timedelta(minutes=3)).enqueued == []
    assert len(jobs(admin, queue.schema)) == 4


@pytest.mark.connections(24)
def test_worker_runs_the_scheduler_and_its_jobs(queue: Queue, admin: Any) -> None:
    """Two workers with the same schedule, the database's clock: each tick once, and
    the jobs are handled."""
    seen: list[Job] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            seen.append(job)

    spec = Periodic("tick", "* * * * * *", queue="ticks")
    workers = [
        Worker(queue, handler, queues=["ticks"], periodic=[spec], lease=5, shutdown_grace=2)
        for _ in range(2)
    ]
    threads = [w.start() for w in workers]
    time.sleep(3.5)
    for w in workers:
        w.stop()
    for t in threads:
        t.join(timeout=20)
    got = ticks(admin, queue.schema)
    assert 3 <= len(got) <= 5, got
    assert len({at for _, at, _ in got}) == len(got)
    assert len(jobs(admin, queue.schema)) == len(got)
    handled = {j.id for j in seen}
    # Every tick's job but perhaps the last (enqueued as the workers stopped) ran.
    assert len(handled - {j for *_, j in got}) == 0
    assert len(handled) >= len(got) - 1


def test_migrations_apply_a_version_below_the_current_one(
    admin: Any, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema migrated past a gap (a version another branch had not landed yet) still
    gets that version when a later skiplock ships it."""
    import skiplock._migrate as mod

    real = mod.migrations()
    # 0009 rebuilds jobs with 0004's columns, so it waits with 0004 here, and every
    # later migration builds on 0009's generations.
    early = tuple(m for m in real if m.version != 4 and m.version < 9)
    monkeypatch.setattr(mod, "migrations", lambda: early)
    applied = run_op(admin, migrate_op(schema))
    assert 4 not in applied and 5 in applied
    monkeypatch.setattr(mod, "migrations", lambda: real)
    assert run_op(admin, migrate_op(schema)) == [4] + [m.version for m in real if m.version >= 9]
    assert run_op(admin, migrate_op(schema)) == []
    admin.execute(sql.SQL("SELECT * FROM {}.queues").format(sql.Identifier(schema)))
