"""Migration 0009: jobs in rotating generations, finished jobs by day.

What these tests hold the design to (docs/architecture.md, "Storage"):
a held xmin leaves no garbage behind once a generation is truncated; rotations, moves
and truncations during a busy drain lose nothing and hand no job out twice; a write by
id that races a move finds the job in its new place; and the migration keeps every job
of a populated 0008 schema, with an 0008 worker still running through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

import skiplock._migrate as mod
from skiplock import AsyncQueue, AsyncWorker, Job, Queue, SkiplockError, Worker
from skiplock._base import QueueBase
from skiplock._migrate import migrate_op
from skiplock._queue import run_op
from skiplock._sql import parse_named

from .test_roles import drop_roles
from .test_worker import counts, wait_until


def _sizes(admin: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """{partition: bytes on disk} of jobs' partitions."""
    rows = admin.execute(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_inherits AS i "
        "JOIN pg_class AS c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
        (f'"{schema}".jobs',),
    ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _drain(q: Queue, n: int) -> None:
    """Claim and complete ``n`` jobs, a hundred at a time: what these tests hold upkeep
    to depends on which jobs are finished, not on the batches that finished them, and
    each batch is a round trip and a commit."""
    done = 0
    while done < n:
        jobs = q.claim(worker="w", limit=100)
        assert jobs, f"only {done} of {n} jobs claimable"
        assert q.complete_many([(j, None) for j in jobs]).lost == []
        done += len(jobs)


@pytest.fixture
def rotate_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 500)
    monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)


def _generations(admin: psycopg.Connection[Any], schema: str) -> int:
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.generations").format(sql.Identifier(schema))
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.usefixtures("rotate_often")
def test_a_backlog_adds_a_generation_only_once_the_current_one_has_grown_threefold(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Migration 0013: a rotation that finds every other generation full waits, and
    upkeep goes on moving and truncating, until the current one has taken three times
    ROTATE_ROWS ids; a short rotation must not add a partition at every turn."""
    queue.enqueue_many([{}] * 500)
    assert queue.upkeep().get("rotated") == 1
    queue.enqueue_many([{}] * 500)
    assert queue.upkeep().get("rotated") == 1
    queue.enqueue_many([{}] * 500)  # every generation holds pending jobs now
    gens = _generations(admin, queue.schema)
    steps = queue.upkeep()
    assert "added" not in steps and "rotated" not in steps, steps
    assert _generations(admin, queue.schema) == gens
    # The backlog of the oldest generation is claimed and finished: upkeep moves it,
    # truncates the generation and rotates into it, still adding nothing.
    _drain(queue, 500)
    steps = queue.upkeep()
    assert steps.get("truncated") == 1 and steps.get("rotated") == 1, steps
    assert "added" not in steps and _generations(admin, queue.schema) == gens
    # Full again, and the current generation grows to three times ROTATE_ROWS: added.
    queue.enqueue_many([{}] * 1000)
    assert "added" not in queue.upkeep()
    queue.enqueue_many([{}] * 500)
    steps = queue.upkeep()
    assert steps.get("added") == 1 and steps.get("rotated") == 1, steps
    assert _generations(admin, queue.schema) == gens + 1
    assert {k: v for k, v in counts(queue).items() if v} == {"pending": 2500, "done": 500}


@pytest.fixture
def rotate_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 100)
    monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)


def _fill_to_the_cap(queue: Queue, admin: psycopg.Connection[Any]) -> int:
    """Enqueue three generations' worth of jobs at a time, with an upkeep after each,
    until upkeep stops adding generations; returns the jobs enqueued."""
    sent, step = 0, 3 * QueueBase.ROTATE_ROWS
    for _ in range(14):
        queue.enqueue_many([{}] * step)
        sent += step
        queue.upkeep()
    return sent


@pytest.mark.usefixtures("rotate_tiny")
def test_a_backlog_adds_at_most_twelve_generations_and_the_surplus_goes_once_drained(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Migration 0014: past twelve generations the current one takes the backlog; once
    the backlog is claimed and finished, upkeep drops the added ones, the highest
    first, down to the first three, and the queue goes on in those."""
    sent = _fill_to_the_cap(queue, admin)
    assert _generations(admin, queue.schema) == 12
    steps = queue.upkeep()
    assert "added" not in steps and "dropped" not in steps, steps
    _drain(queue, sent)
    steps = queue.upkeep(max_steps=200)
    assert steps.get("dropped") == 9, steps
    assert _generations(admin, queue.schema) == 3
    gens = sorted(k for k in _sizes(admin, queue.schema) if "_g" in k)
    assert len(gens) == 3 and "jobs_g12" not in gens, gens
    # Nothing left to drop, and the three left rotate and take jobs as before.
    for _ in range(3):
        queue.enqueue_many([{}] * 100)
        _drain(queue, 100)
        steps = queue.upkeep()
        assert "dropped" not in steps and "added" not in steps, steps
    assert {k: v for k, v in counts(queue).items() if v} == {"done": sent + 300}
    assert admin.execute(
        sql.SQL("SELECT count(DISTINCT id), sum(completions) FROM {}.jobs").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone() == (sent + 300, sent + 300)


def _surplus_only(queue: Queue, admin: psycopg.Connection[Any]) -> None:
    """Fill to the cap and drain, then run upkeep until its moves and truncations are
    done and it has dropped one generation: what is left for it is dropping."""
    _drain(queue, _fill_to_the_cap(queue, admin))
    for _ in range(200):
        step = queue.upkeep(max_steps=1)
        assert step and "busy" not in step, step
        if "dropped" in step:
            break
    assert _generations(admin, queue.schema) == 11


@pytest.mark.usefixtures("rotate_tiny")
def test_a_drop_that_would_wait_for_jobs_gives_up_at_once(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """DROP of a partition waits for ACCESS EXCLUSIVE on jobs, and every claim queues
    behind it: upkeep waits 10 ms at most (not the 100 ms its truncations may), says
    busy, and drops at a later call."""
    _surplus_only(queue, admin)
    with psycopg.connect(dsn) as holder:
        # A transaction that read jobs (a report, an enqueue) holds a lock on it.
        holder.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(queue.schema)))
        took = []
        for _ in range(3):  # well within the holder's first second
            start = time.monotonic()
            assert queue.upkeep() == {"busy": 1}
            took.append(time.monotonic() - start)
        assert min(took) < 0.06, took
        # The failed attempt left no lock queued: a claim does not wait.
        assert queue.claim(worker="w", limit=1) == []
        holder.rollback()
    assert _generations(admin, queue.schema) == 11
    assert queue.upkeep(max_steps=200).get("dropped") == 8
    assert _generations(admin, queue.schema) == 3


@pytest.mark.usefixtures("rotate_tiny")
def test_no_drop_queues_behind_a_long_transaction(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    """Behind a transaction that has held jobs for a second, upkeep says busy without
    queueing a lock request: every sweep of every worker would otherwise stall the
    claims for 10 ms while it lasts.  Checked with pg_blocking_pids over many calls."""
    _surplus_only(queue, admin)
    with psycopg.connect(dsn) as holder:
        holder.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(queue.schema)))
        holder_pid = holder.info.backend_pid
        time.sleep(1.2)  # the holder's age, not an interleaving
        waits: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not stop.is_set():
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE %s = ANY(pg_blocking_pids(pid))",
                        (holder_pid,),
                    ).fetchone()
                    if row and row[0]:
                        waits.append(int(row[0]))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            for _ in range(30):
                assert queue.upkeep() == {"busy": 1}
        finally:
            stop.set()
            watcher.join()
        assert waits == []
        holder.rollback()
    assert queue.upkeep(max_steps=200).get("dropped") == 8
    assert _generations(admin, queue.schema) == 3


@pytest.mark.usefixtures("rotate_often")
def test_under_a_held_xmin_truncation_takes_the_garbage(
    queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    holder = psycopg.connect(dsn)
    try:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT txid_current()")
        for _ in range(12):
            queue.enqueue_many([{}] * 500)
            _drain(queue, 500)
            steps = queue.upkeep()
            # The generation that took these jobs is retired, emptied and truncated in
            # the same upkeep: its dead versions go although the snapshot forbids a
            # vacuum to remove them.
            assert steps.get("rotated") == 1 and steps.get("truncated") == 1, steps
            gens = {k: v for k, v in _sizes(admin, queue.schema).items() if "_g" in k}
            assert sum(gens.values()) == 0, gens
        # The control: without upkeep, the same work leaves its garbage in place.
        queue.enqueue_many([{}] * 500)
        _drain(queue, 500)
        one = sum(v for k, v in _sizes(admin, queue.schema).items() if "_g" in k)
        for _ in range(3):
            queue.enqueue_many([{}] * 500)
            _drain(queue, 500)
        four = sum(v for k, v in _sizes(admin, queue.schema).items() if "_g" in k)
        assert four >= 3 * one > 0
    finally:
        holder.rollback()
        holder.close()
    days = {k: v for k, v in _sizes(admin, queue.schema).items() if "_d" in k}
    assert len(days) == 1 and admin.execute(
        sql.SQL("SELECT count(*), count(DISTINCT id) FROM {}.jobs WHERE status = 'done'").format(
            sql.Identifier(queue.schema)
        )
    ).fetchone() == (8000, 8000)


@pytest.mark.usefixtures("rotate_often")
@pytest.mark.parametrize("shape", ["steady", "bursts"])
@pytest.mark.connections(24)
def test_nothing_lost_or_doubled_while_upkeep_rotates_moves_and_truncates(
    queue: Queue,
    admin: psycopg.Connection[Any],
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
) -> None:
    """``bursts``: generations of 50 ids, and bursts of 1,200 jobs each drained before
    the next, so that upkeep adds generations up to its cap (0014) during a burst and
    drops them between, while eight claimers and the producer run."""
    total, delayed = 6000, 300
    if shape == "bursts":
        monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 50)
        monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)
    later = queue.enqueue_many(
        [{"later": i} for i in range(delayed)], run_at=datetime.now(UTC) + timedelta(hours=1)
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    claimed: list[int] = []
    lock = threading.Lock()

    steps: dict[str, int] = {}
    most = [0]

    def produce() -> None:
        for i in range(total // 200):
            queue.enqueue_many([{}] * 200)
            if shape == "steady":
                time.sleep(0.005)
            elif (i + 1) % 6 == 0:  # a burst of 1,200 sent: wait until it is drained
                while len(claimed) < (i + 1) * 200 and not stop.is_set():
                    time.sleep(0.01)
                time.sleep(0.3)  # and a moment of an idle queue

    def work(name: str) -> None:
        try:
            while not stop.is_set():
                jobs = queue.claim(worker=name, limit=10)
                if not jobs:
                    time.sleep(0.002)
                    continue
                assert queue.complete_many([(j, None) for j in jobs]).lost == []
                with lock:
                    claimed.extend(j.id for j in jobs)
        except BaseException as exc:
            errors.append(exc)

    def upkeep() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not stop.is_set():
                    for _ in range(50):  # a step at a time: the count after each
                        step = queue.upkeep(max_steps=1)
                        for k, v in step.items():
                            steps[k] = steps.get(k, 0) + v
                        most[0] = max(most[0], _generations(conn, queue.schema))
                        if not step or "busy" in step:
                            break
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(8)]
    threads += [threading.Thread(target=upkeep), threading.Thread(target=produce)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(claimed) >= total or bool(errors), timeout=120, what="drain")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert errors == []
    assert len(claimed) == len(set(claimed)) == total  # each claimed exactly once
    s = sql.Identifier(queue.schema)
    assert admin.execute(
        sql.SQL(
            "SELECT count(*) FILTER (WHERE status = 'done' AND completions = 1), "
            "count(*) FILTER (WHERE status = 'pending'), count(*), count(DISTINCT id) FROM {}.jobs"
        ).format(s)
    ).fetchone() == (total, delayed, total + delayed, total + delayed)
    # The delayed jobs were moved out of the generations that retired, intact.
    rows = admin.execute(
        sql.SQL("SELECT id, part FROM {}.jobs WHERE status = 'pending' ORDER BY id").format(s)
    ).fetchall()
    assert [r[0] for r in rows] == later
    current = admin.execute(sql.SQL("SELECT last_value FROM {}.jobs_gen").format(s)).fetchone()
    assert current is not None and {r[1] for r in rows} <= {current[0]}
    # Drained, every generation but the current one is truncated, and reused: the
    # backlog of the burst took more of them than the steady state does.
    # Counted with the upkeep thread's: on a loaded machine the drain can end before
    # that thread dropped the generations it added, and these calls drop them.
    for _ in range(3):
        for k, v in queue.upkeep().items():
            steps[k] = steps.get(k, 0) + v
    gens = {k: v for k, v in _sizes(admin, queue.schema).items() if "_g" in k}
    assert [k for k, v in gens.items() if v] == [f"jobs_g{current[0]}"], gens
    if shape == "bursts":
        # Added while a burst waited, never past the cap, and dropped again down to
        # three (the cap itself: the test above).
        assert 3 < most[0] <= 12 and steps.get("added", 0) >= 1, (most, steps)
        assert steps["dropped"] == steps["added"] and len(gens) == 3, (steps, gens)


def _blocked_on(admin: psycopg.Connection[Any], app: str, pid: int) -> bool:
    row = admin.execute(
        "SELECT %s = ANY(pg_blocking_pids(pid)) FROM pg_stat_activity "
        "WHERE application_name = %s AND state = 'active'",
        (pid, app),
    ).fetchone()
    return bool(row and row[0])


@pytest.mark.usefixtures("rotate_often")
@pytest.mark.parametrize("write", ["requeue", "delete", "wait"])
def test_a_write_by_id_that_races_a_move_finds_the_job_moved(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], write: str
) -> None:
    """The move commits while the write waits for the row: the write's statement then
    finds the version it waited for deleted and matches nothing; skiplock runs it again,
    and the new statement finds the job in its day.  Driven with pg_blocking_pids."""
    job_id = queue.enqueue({})
    _drain(queue, 1)
    queue.ROTATE_ROWS = 1
    assert queue.upkeep(max_steps=1) == {"rotated": 1}  # the move is left to the race
    mover = psycopg.connect(dsn)
    app = f"race-{queue.schema}"
    done: list[Any] = []
    with Queue(dsn, schema=queue.schema, application_name=app, max_size=1) as q2:
        try:
            # The move, uncommitted: it holds the row until we say.
            mover.execute(
                sql.SQL("SELECT * FROM {}.upkeep(500, 0, 3600, 100)").format(
                    sql.Identifier(queue.schema)
                )
            )
            pid = mover.info.backend_pid

            def run() -> None:
                try:
                    if write == "requeue":
                        q2.requeue(job_id)
                    elif write == "delete":
                        q2.delete(job_id)
                    else:
                        done.append(q2.wait(job_id, timeout=10))
                    done.append("ok")
                except BaseException as exc:
                    done.append(exc)

            t = threading.Thread(target=run)
            t.start()
            wait_until(lambda: _blocked_on(admin, app, pid), what="the write waits on the move")
            mover.commit()
            t.join(timeout=30)
        finally:
            mover.close()
    assert done and done[-1] == "ok", done
    row = admin.execute(
        sql.SQL("SELECT status, part < 1000000 FROM {}.jobs WHERE id = %s").format(
            sql.Identifier(queue.schema)
        ),
        (job_id,),
    ).fetchone()
    expect = {"requeue": ("pending", True), "delete": None, "wait": ("done", False)}
    assert row == expect[write]


# -- the migration ----------------------------------------------------------------------


def _legacy(schema: str, role: str = "") -> dict[str, sql.Composed]:
    text = (Path(__file__).parent / "legacy_0008.sql").read_text(encoding="utf-8")
    names = {
        "schema": sql.Identifier(schema),
        "channel": sql.Literal(f"skiplock_{schema}"),
        "role": sql.Identifier(role or "-"),
    }
    return {
        name: sql.SQL(body).format(**names)  # type: ignore[arg-type]
        for name, body in parse_named(text).items()
    }


def test_0009_gives_the_roles_of_0008_what_they_need(
    admin: psycopg.Connection[Any], dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roles made by an 0008 `skiplock roles` keep working after 0009 without running
    it again: the producer enqueues with keys, the worker claims, completes and runs
    upkeep, and retention stays the owner's."""
    real = mod.migrations()
    monkeypatch.setattr(mod, "migrations", lambda: tuple(m for m in real if m.version < 9))
    run_op(admin, migrate_op(schema))
    tag = uuid.uuid4().hex[:8]
    producer, worker = f"t_{tag}_producer", f"t_{tag}_worker"
    try:
        for role, block in ((producer, "grant_producer"), (worker, "grant_worker")):
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
            admin.execute(_legacy(schema, role)[block])
        monkeypatch.setattr(mod, "migrations", lambda: real)
        assert run_op(admin, migrate_op(schema)) == [m.version for m in real if m.version >= 9]
        with (
            Queue(make_conninfo(dsn, user=producer), schema=schema, max_size=2) as pq,
            Queue(make_conninfo(dsn, user=worker), schema=schema, max_size=2) as wq,
        ):
            first = pq.enqueue({}, idempotency_key="k")
            assert pq.enqueue({}, idempotency_key="k") == first
            pq.enqueue_many([{}] * 3, idempotency_keys=["a", "b", "k"])
            pq.enqueue({"unkeyed": True})
            jobs = wq.claim(worker="w", limit=10)
            assert len(jobs) == 4  # k, a, b (the second k is the first), unkeyed
            assert wq.complete_many([(j, None) for j in jobs]).lost == []
            wq.ROTATE_ROWS, wq.ROTATE_AFTER = 1, 0.0
            steps = wq.upkeep()
            assert steps.get("rotated") == 1 and steps.get("truncated") == 1, steps
            with pytest.raises(SkiplockError, match="permission denied for function"):
                wq.prune(older_than=0)
    finally:
        drop_roles(admin, producer, worker)


def test_0009_keeps_every_job_with_an_0008_worker_running_through_it(
    admin: psycopg.Connection[Any], dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mod.migrations()
    monkeypatch.setattr(mod, "migrations", lambda: tuple(m for m in real if m.version < 9))
    run_op(admin, migrate_op(schema))
    s = sql.Identifier(schema)
    old = _legacy(schema)
    # A populated 0008 schema: pending (due and delayed, some keyed), running with
    # tokens, and done, failed and cancelled history.
    admin.execute(
        sql.SQL(
            "INSERT INTO {}.jobs (queue, payload, run_at, idempotency_key) "
            "SELECT 'q', jsonb_build_object('n', g), now() + CASE WHEN g % 10 = 0 "
            "THEN interval '1 hour' ELSE interval '0' END, "
            "CASE WHEN g % 7 = 0 THEN 'key-' || g END FROM generate_series(1, 3000) AS g"
        ).format(s)
    )
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET status = (ARRAY['done', 'failed', 'cancelled'])[id % 3 + 1], "
            "finished_at = now() - (id % 5) * interval '1 day', completions = "
            "(id % 3 = 0)::int WHERE id > 2500 AND run_at <= now()"
        ).format(s)
    )
    with admin.cursor(row_factory=dict_row) as cur:
        held = [
            Job.from_row(r)
            for r in cur.execute(
                old["claim"],
                {
                    "queue": "q",
                    "limit": 20,
                    "worker": "old-1",
                    "lease": 3600.0,
                    "tasks": None,
                    **dict.fromkeys(("from_priority", "from_run_at", "from_id")),
                },
            ).fetchall()
            if r["id"] is not None
        ]
    assert len(held) == 20
    cols = sql.SQL(
        "SELECT id, queue, status, payload, attempts, worker, lease_token, locked_until, "
        "finished_at, idempotency_key, completions FROM {}.jobs ORDER BY id"
    ).format(s)
    before = admin.execute(cols).fetchall()

    # The 0008 worker keeps claiming and completing with its own statements while
    # 0009 runs (it waits for the migration's lock, then goes on against the new table).
    stop = threading.Event()
    old_done: list[int] = []
    errors: list[BaseException] = []
    replanned: list[str] = []

    def old_worker() -> None:
        try:
            while not stop.is_set():
                with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as c:
                    while not stop.is_set():
                        try:
                            got = _old_round(c)
                        except psycopg.errors.FeatureNotSupported as exc:
                            # The claim, prepared by psycopg before 0009 (after its
                            # fifth run), returns `j.*`, and the row type gained `part`:
                            # PostgreSQL refuses that prepared statement from now on.
                            # Nothing was written.  A new connection (a restart, or
                            # today's skiplock, which drops the connection on this
                            # error) prepares it anew.
                            replanned.append(str(exc))
                            break
                        if got is None:
                            time.sleep(0.01)
                        else:
                            old_done.extend(got)
        except BaseException as exc:
            errors.append(exc)

    def _old_round(c: psycopg.Connection[Any]) -> list[int] | None:
        rows = c.execute(
            old["claim"],
            {
                "queue": "q",
                "limit": 5,
                "worker": "old-2",
                "lease": 60.0,
                "tasks": None,
                **dict.fromkeys(("from_priority", "from_run_at", "from_id")),
            },
        ).fetchall()
        rows = [r for r in rows if r["id"] is not None]
        if not rows:
            return None
        ids = [r["id"] for r in rows]
        c.execute(
            old["heartbeat"],
            {"ids": ids, "tokens": [r["lease_token"] for r in rows], "lease": 60.0},
        )
        out = c.execute(
            old["complete"],
            {
                "ids": ids,
                "tokens": [r["lease_token"] for r in rows],
                "results": [None] * len(ids),
            },
        ).fetchall()
        assert len(out) == len(ids)
        return ids

    t = threading.Thread(target=old_worker)
    t.start()
    wait_until(lambda: len(old_done) >= 50 or bool(errors), what="the old worker at work")
    monkeypatch.setattr(mod, "migrations", lambda: real)
    assert run_op(admin, migrate_op(schema)) == [m.version for m in real if m.version >= 9]
    n = len(old_done)
    wait_until(
        lambda: len(old_done) >= n + 50 or bool(errors) or len(replanned) > 5,
        what="the old worker after 0009",
    )
    stop.set()
    t.join(timeout=30)
    assert errors == []
    assert replanned in ([], ["cached plan must not change result type"]), replanned

    # Every job is still there once, as it was, but for what the old worker did.
    after = {r[0]: r for r in admin.execute(cols).fetchall()}
    assert len(after) == len(before)
    for row in before:
        now = after[row[0]]
        if row[0] in old_done:
            assert now[2] == "done" and now[10] == 1
        else:
            assert now == row
    with Queue(dsn, schema=schema, max_size=4) as q:
        # The first worker's tokens from before the migration still fence: its writes
        # succeed with them, and fail with any other.
        assert q.complete_many([(held[0], {"after": 9})]).lost == []
        forged = dataclasses.replace(held[1], lease_token=held[0].lease_token)
        assert q.complete_many([(forged, None)]).lost == [forged.id]
        assert q.heartbeat_many([held[1]]).lost == []
        # Keys taken before the migration still dedup, in job_keys.
        keyed = admin.execute(
            sql.SQL(
                "SELECT id, idempotency_key, payload FROM {}.jobs "
                "WHERE idempotency_key IS NOT NULL ORDER BY id LIMIT 1"
            ).format(s)
        ).fetchone()
        assert keyed is not None
        assert q.enqueue(keyed[2], queue="q", idempotency_key=keyed[1]) == keyed[0]
        # An 0008 producer cannot enqueue any more: its ON CONFLICT names a unique index
        # that a partitioned jobs cannot have.  It is told so; nothing is written.
        with pytest.raises(psycopg.errors.InvalidColumnReference):
            admin.execute(
                old["enqueue"],
                {
                    "queue": "q",
                    "payload": "{}",
                    "priority": 0,
                    "run_at": None,
                    "max_attempts": 5,
                    "idempotency_key": None,
                    "task": None,
                    "meta": None,
                },
            )
        # The rest runs on today's worker: the 0008 jobs still pending are claimed
        # from generation 1; then upkeep retires it, sends its history to its days and
        # its delayed jobs to the current generation, and truncates it.
        while left := q.claim(worker="new", queue="q", limit=500):
            q.complete_many([(j, None) for j in left])
        q.complete_many([(j, None) for j in held[1:]])
        q.ROTATE_ROWS, q.ROTATE_AFTER = 1, 0.0
        for _ in range(5):
            q.upkeep()
    left_in_g1 = admin.execute(
        sql.SQL("SELECT status, count(*) FROM {}.jobs_g1 GROUP BY 1").format(s)
    ).fetchall()
    assert left_in_g1 == [] and _sizes(admin, schema)["jobs_g1"] == 0, left_in_g1
    placed = admin.execute(
        sql.SQL(
            "SELECT status = 'pending', part >= 1000000, count(*) FROM {}.jobs GROUP BY 1, 2 "
            "ORDER BY 1, 2"
        ).format(s)
    ).fetchall()
    delayed = sum(1 for r in before if r[2] == "pending" and r[0] % 10 == 0)
    # Every finished job in a day; the delayed ones pending in a generation.
    assert placed == [(False, True, len(before) - delayed), (True, False, delayed)]


def _stalled_upkeep(
    monkeypatch: pytest.MonkeyPatch, cls: Any, *, is_async: bool
) -> tuple[threading.Event, threading.Event, list[str]]:
    """Make ``cls.upkeep`` stop at its first call until released: (entered, release,
    the names of the threads that called it).  The real upkeep runs once released."""
    entered, release, callers = threading.Event(), threading.Event(), []
    real = cls.upkeep

    if is_async:

        async def upkeep(self: Any, **kw: Any) -> dict[str, int]:
            callers.append(threading.current_thread().name)
            entered.set()
            end = time.monotonic() + 30
            while not release.is_set() and time.monotonic() < end:
                await asyncio.sleep(0.01)
            return dict(await real(self, **kw))

    else:

        def upkeep(self: Any, **kw: Any) -> dict[str, int]:  # type: ignore[misc]
            callers.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
            return dict(real(self, **kw))

    monkeypatch.setattr(cls, "upkeep", upkeep)
    return entered, release, callers


def test_a_slow_upkeep_holds_back_no_claim(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upkeep runs on a thread of its own: while one of its calls is stuck, the worker
    goes on claiming and completing (on the claim loop, it stopped every claim)."""
    entered, release, callers = _stalled_upkeep(monkeypatch, Queue, is_async=False)
    w = Worker(queue, lambda job: None, concurrency=4, sweep_interval=0.05, poll_interval=0.05)
    t = w.start()
    try:
        assert entered.wait(20), "no upkeep call"
        queue.enqueue_many([{"n": i} for i in range(200)])
        wait_until(lambda: w.stats.completed == 200, what="the drain while upkeep is stuck")
        assert not release.is_set()
    finally:
        release.set()
        w.stop()
        t.join(30)
    assert not t.is_alive()
    assert callers and all(name.endswith("-upkeep") for name in callers), callers


def test_a_slow_upkeep_holds_back_no_claim_of_the_async_worker(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release, _ = _stalled_upkeep(monkeypatch, AsyncQueue, is_async=True)
    done = 0

    async def handler(job: Job) -> None:
        nonlocal done
        done += 1

    async def main() -> None:
        w = AsyncWorker(queue, handler, concurrency=4, sweep_interval=0.05, poll_interval=0.05)
        runner = asyncio.create_task(w.run())
        try:
            end = time.monotonic() + 20
            while not entered.is_set():
                assert time.monotonic() < end, "no upkeep call"
                await asyncio.sleep(0.01)
            await asyncio.to_thread(queue.enqueue_many, [{"n": i} for i in range(200)])
            end = time.monotonic() + 20
            while w.stats.completed < 200:
                assert time.monotonic() < end, f"{done} of 200 done while upkeep is stuck"
                await asyncio.sleep(0.01)
        finally:
            release.set()
            w.stop()
            await asyncio.wait_for(runner, 30)

    asyncio.run(main())


Call = tuple[float, float, dict[str, int]]  # (start, end, what the step did)


def _judge_pace(calls: list[Call], busy: bool) -> None:
    """The steps were real, and the upkeep rested 9 x each step (UPKEEP_SHARE 0.1) while
    busy, and hardly at all while idle."""
    steps = [c for c in calls if c[2]]
    assert {"rotated", "moved", "truncated"} <= {k for c in steps for k in c[2]}, steps
    took = sum(end - start for start, end, _ in steps)
    rested = sum(nxt[0] - cur[1] for cur, nxt in itertools.pairwise(calls))
    if busy:
        assert rested >= 0.8 * 9 * took, (rested, took)
    else:
        assert rested < 3 * took, (rested, took)


@pytest.mark.usefixtures("rotate_often")
@pytest.mark.parametrize("busy", [True, False], ids=["busy", "idle"])
def test_a_busy_worker_paces_its_upkeep_and_an_idle_one_does_not(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    """While the worker's claims come back full, its upkeep rests between steps for
    (1 / UPKEEP_SHARE - 1) times each step, so that moving a backlog does not compete
    with the drain flat out; a worker waiting for work moves at once.  The steps are
    real: a rotation, the move of 1,000 finished jobs, the truncation."""
    queue.enqueue_many([{}] * 1000)
    _drain(queue, 1000)
    calls: list[Call] = []
    real = queue.upkeep

    def timed(**kw: Any) -> dict[str, int]:
        start = time.monotonic()
        done = real(**kw)
        calls.append((start, time.monotonic(), done))
        return done

    monkeypatch.setattr(queue, "upkeep", timed)
    monkeypatch.setattr(Worker, "UPKEEP_SHARE", 0.1)  # rest 9 x the step
    w = Worker(queue, lambda job: None, concurrency=2)
    w._uq, w._more = queue, busy
    w._upkeep_wanted.set()
    t = threading.Thread(target=w._upkeep_loop)
    t.start()
    try:
        wait_until(lambda: bool(calls) and not calls[-1][2], timeout=60, what="upkeep done")
    finally:
        w._stopping.set()
        w._upkeep_wanted.set()
        t.join(30)
    _judge_pace(calls, busy)


@pytest.mark.usefixtures("rotate_often")
@pytest.mark.parametrize("busy", [True, False], ids=["busy", "idle"])
def test_a_busy_async_worker_paces_its_upkeep_and_an_idle_one_does_not(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    queue.enqueue_many([{}] * 1000)
    _drain(queue, 1000)
    calls: list[Call] = []
    real = AsyncQueue.upkeep

    async def timed(self: AsyncQueue, **kw: Any) -> dict[str, int]:
        start = time.monotonic()
        done = await real(self, **kw)
        calls.append((start, time.monotonic(), done))
        return done

    monkeypatch.setattr(AsyncQueue, "upkeep", timed)
    monkeypatch.setattr(AsyncWorker, "UPKEEP_SHARE", 0.1)

    async def handler(job: Job) -> None:
        pass

    async def main() -> None:
        async with AsyncQueue(queue.settings.dsn, schema=queue.schema) as aq:
            w = AsyncWorker(aq, handler, concurrency=2)
            w._q, w._more, w._upkeep_wanted = aq, busy, asyncio.Event()
            w._upkeep_wanted.set()
            task = asyncio.create_task(w._upkeep_loop())
            try:
                end = time.monotonic() + 60
                while not (calls and not calls[-1][2]):
                    assert time.monotonic() < end, "upkeep not done"
                    await asyncio.sleep(0.01)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    asyncio.run(main())
    _judge_pace(calls, busy)
