"""Jobs that wait for other jobs (migration 0016): released once, cancelled in a cascade.

Every release is logged by a trigger the tests add (waiting -> pending, one row each),
so "released exactly once" is counted, not inferred from the final status.  The
interleavings are driven with pg_blocking_pids on real connections, never sleeps.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Job, JobStateError, LeaseLost, Queue, UnknownJob, Worker
from skiplock._base import QueueBase
from skiplock._sql import statements

from .test_worker import running, wait_until


def _log_releases(admin: psycopg.Connection[Any], schema: str) -> None:
    """A row in released_log for every waiting -> pending transition of a job."""
    s = sql.Identifier(schema)
    admin.execute(sql.SQL("CREATE TABLE {}.released_log (id bigint)").format(s))
    admin.execute(
        sql.SQL(
            "CREATE FUNCTION {s}.log_release() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN INSERT INTO {s}.released_log VALUES (NEW.id); RETURN NULL; END $$"
        ).format(s=s)
    )
    admin.execute(
        sql.SQL(
            "CREATE TRIGGER log_release AFTER UPDATE ON {s}.jobs FOR EACH ROW "
            "WHEN (OLD.status = 'waiting' AND NEW.status = 'pending') "
            "EXECUTE FUNCTION {s}.log_release()"
        ).format(s=s)
    )


def _releases(admin: psycopg.Connection[Any], schema: str) -> Counter[int]:
    rows = admin.execute(
        sql.SQL("SELECT id FROM {}.released_log").format(sql.Identifier(schema))
    ).fetchall()
    return Counter(int(r[0]) for r in rows)


def _state(admin: psycopg.Connection[Any], schema: str, job_id: int) -> tuple[str, int | None]:
    row = admin.execute(
        sql.SQL("SELECT status, deps_left FROM {}.jobs WHERE id = %s").format(
            sql.Identifier(schema)
        ),
        (job_id,),
    ).fetchone()
    assert row is not None
    return str(row[0]), row[1]


def _blocked_by(admin: psycopg.Connection[Any], pid: int) -> bool:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (pid,)
    ).fetchone()
    return row is not None and int(row[0]) > 0


def _claim(queue: Queue, ids: list[int]) -> dict[int, Job]:
    jobs = {j.id: j for j in queue.claim(worker="w", limit=100, lease=60)}
    assert sorted(jobs) == sorted(ids)
    return jobs


def _complete_on(conn: psycopg.Connection[Any], schema: str, job: Job) -> int:
    """The fenced `complete` statement on a connection of the test's own (its
    transaction stays open until the test commits it)."""
    cur = conn.execute(
        statements(schema).complete,
        {"ids": [job.id], "tokens": [job.lease_token], "results": ["1"]},
    )
    return len(cur.fetchall())


def test_a_child_waits_for_every_parent_and_reads_their_results(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    _log_releases(admin, schema)
    a, b = queue.enqueue({"n": "a"}), queue.enqueue({"n": "b"})
    child = queue.enqueue({"n": "child"}, after=[b, a])
    assert _state(admin, schema, child) == ("waiting", 2)
    jobs = _claim(queue, [a, b])  # the waiting child is never claimed
    queue.complete(jobs[a], {"from": "a"})
    assert _state(admin, schema, child) == ("waiting", 1)
    assert queue.claim(worker="w", limit=10) == []
    queue.complete(jobs[b], {"from": "b"})
    assert _state(admin, schema, child) == ("pending", 0)
    [claimed] = queue.claim(worker="w", limit=10)
    assert claimed.id == child
    parents = queue.parent_results(child)
    assert [(p["id"], p["status"], p["result"]) for p in parents] == [
        (b, "done", {"from": "b"}),
        (a, "done", {"from": "a"}),
    ]
    assert _releases(admin, schema) == {child: 1}


def test_two_parents_finishing_at_once_release_the_child_once(
    queue: Queue, admin: psycopg.Connection[Any], schema: str, dsn: str
) -> None:
    """Both completions update the child's row: the second waits for the first's row
    lock and counts down from the first's result, so exactly one reaches zero."""
    _log_releases(admin, schema)
    a, b = queue.enqueue({"n": "a"}), queue.enqueue({"n": "b"})
    child = queue.enqueue({"n": "child"}, after=[a, b])
    jobs = _claim(queue, [a, b])
    outcome: list[int] = []
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        assert _complete_on(first, schema, jobs[a]) == 1  # holds the child's row lock

        def complete_b() -> None:
            outcome.append(_complete_on(second, schema, jobs[b]))
            second.commit()

        t = threading.Thread(target=complete_b, daemon=True)
        t.start()
        wait_until(
            lambda: _blocked_by(admin, first.info.backend_pid),
            what="the second completion waiting on the child's row",
        )
        # Neither has committed: the child still waits.
        assert _state(admin, schema, child) == ("waiting", 2)
        first.commit()
        t.join(10)
        assert not t.is_alive()
    assert outcome == [1]
    assert _state(admin, schema, child) == ("pending", 0)
    assert _releases(admin, schema) == {child: 1}


def test_a_done_parent_counts_down_one_child_or_several_once_each(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    """Migration 0019 counts a done parent's only child down in the statement that
    flips its edge, and several children by 0016's path: both count each edge once,
    and a child with another parent left keeps waiting."""
    _log_releases(admin, schema)
    solo, fan, other = queue.enqueue({}), queue.enqueue({}), queue.enqueue({})
    only = queue.enqueue({"n": "only"}, after=[solo])
    both = queue.enqueue({"n": "both"}, after=[solo, other])
    kids = queue.enqueue_many([{"n": i} for i in range(3)], after=[fan])
    jobs = _claim(queue, [solo, fan, other])
    # solo has two children (only, both): the path for several; fan's three likewise.
    queue.complete(jobs[solo], None)
    assert _state(admin, schema, only) == ("pending", 0)
    assert _state(admin, schema, both) == ("waiting", 1)
    queue.complete(jobs[fan], None)
    assert [_state(admin, schema, k) for k in kids] == [("pending", 0)] * 3
    # other has one child left to count (both): the one-statement path.
    queue.complete(jobs[other], None)
    assert _state(admin, schema, both) == ("pending", 0)
    assert _releases(admin, schema) == {only: 1, both: 1, **{k: 1 for k in kids}}


def test_a_parent_that_runs_twice_releases_its_child_once(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    """A lost lease: the first run's completion is refused by the fence, the second
    run's completes and releases.  An operator's requeue and a third run find the edge
    settled and count nothing down again."""
    _log_releases(admin, schema)
    a, b = queue.enqueue({"n": "a"}), queue.enqueue({"n": "b"})
    child = queue.enqueue({"n": "child"}, after=[a, b])
    first = queue.claim(worker="w1", limit=1, lease=0.05)
    assert [j.id for j in first] == [a]
    wait_until(lambda: queue.sweep() == 1, what="the lease to expire and be swept")
    again = {j.id: j for j in queue.claim(worker="w2", limit=10, lease=60)}
    second, jb = again[a], again[b]
    with pytest.raises(LeaseLost):
        queue.complete(first[0], "late")
    queue.complete(second, "ok")
    assert _state(admin, schema, child) == ("waiting", 1)
    queue.requeue(a)
    [third] = [j for j in queue.claim(worker="w3", limit=10, lease=60) if j.id == a]
    queue.complete(third, "again")
    assert _state(admin, schema, child) == ("waiting", 1)  # not counted twice
    queue.complete(jb, "ok")
    assert _state(admin, schema, child) == ("pending", 0)
    assert _releases(admin, schema) == {child: 1}


def test_a_failed_parent_cancels_its_waiting_descendants_transitively(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    root = queue.enqueue({"n": "root"}, max_attempts=1)
    step = [queue.enqueue({"n": 1}, after=[root])]
    for n in range(2, 40):  # a chain: one statement cancels it, not 40 nested triggers
        step.append(queue.enqueue({"n": n}, after=[step[-1]]))
    runs = queue.enqueue({"n": "runs"}, after=[step[0]], on_parent_failure="run")
    after_runs = queue.enqueue({"n": "after runs"}, after=[runs])
    [job] = queue.claim(worker="w", limit=10)
    assert queue.fail(job, "boom", retry=True) == "failed"  # no attempt left
    first = queue.get(step[0])
    assert first is not None and first.status == "cancelled"
    assert first.last_error == f"cancelled: parent job {root} failed"
    last = queue.get(step[-1])
    assert last is not None and last.status == "cancelled"
    assert last.last_error == (
        f"cancelled: parent job {step[-2]} was cancelled after job {root} failed"
    )
    # "run": its parent's cancellation counted it down; it runs, and its own child waits.
    assert _state(admin, schema, runs) == ("pending", 0)
    assert _state(admin, schema, after_runs) == ("waiting", 1)
    assert [p["status"] for p in queue.parent_results(runs)] == ["cancelled"]


@pytest.mark.parametrize("how", ["cancel", "sweep", "cancel_running"])
def test_every_terminal_end_of_a_parent_settles_its_children(
    how: str, queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    parent = queue.enqueue({"n": "p"}, max_attempts=1)
    child = queue.enqueue({"n": "c"}, after=[parent])
    runner = queue.enqueue({"n": "r"}, after=[parent], on_parent_failure="run")
    if how == "cancel":
        assert queue.cancel(parent) == "cancelled"
        reason = f"cancelled: parent job {parent} cancelled"
    elif how == "sweep":
        queue.claim(worker="w", limit=1, lease=0.05)
        wait_until(lambda: queue.sweep() == 1, what="the sweep")
        reason = f"cancelled: parent job {parent} failed"
    else:
        [job] = queue.claim(worker="w", limit=1, lease=60)
        assert queue.cancel(parent) == "running"
        queue.complete(job, "done anyway")  # a cancel asked: it ends cancelled
        reason = f"cancelled: parent job {parent} cancelled"
    got = queue.get(child)
    assert got is not None and (got.status, got.last_error) == ("cancelled", reason)
    assert _state(admin, schema, runner) == ("pending", 0)


def test_cancelling_a_waiting_job_cancels_its_descendants(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    a = queue.enqueue({})
    b = queue.enqueue({}, after=[a])
    c = queue.enqueue({}, after=[b])
    assert queue.cancel(b) == "cancelled"
    assert _state(admin, schema, c)[0] == "cancelled"
    with pytest.raises(JobStateError):
        queue.cancel(c)
    [job] = queue.claim(worker="w", limit=10)
    queue.complete(job, None)  # a's completion finds nothing left to release
    assert _state(admin, schema, b)[0] == "cancelled"


def test_a_child_of_finished_parents_is_settled_at_once(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    ok, bad = queue.enqueue({}), queue.enqueue({}, max_attempts=1)
    jobs = _claim(queue, [ok, bad])
    queue.complete(jobs[ok], 7)
    queue.fail(jobs[bad], "no", retry=False)
    assert _state(admin, schema, queue.enqueue({}, after=[ok])) == ("pending", 0)
    late = queue.enqueue({}, after=[ok, bad])
    got = queue.get(late)
    assert got is not None and got.status == "cancelled"
    assert got.last_error == f"cancelled: parent job {bad} failed"
    runs = queue.enqueue({}, after=[ok, bad], on_parent_failure="run")
    assert _state(admin, schema, runs) == ("pending", 0)
    many = queue.enqueue_many([{}, {}], after=[ok])
    assert [_state(admin, schema, i)[0] for i in many] == ["pending", "pending"]


@pytest.mark.parametrize("first", ["completion", "enqueue"])
def test_a_child_enqueued_while_its_parent_completes_is_released(
    first: str, queue: Queue, admin: psycopg.Connection[Any], schema: str, dsn: str
) -> None:
    """Whichever of the two holds the parent's row first, the child is released: an
    enqueue that waited reads the finished parent (its lock returns the current row);
    a completion that waited finds the committed edge."""
    _log_releases(admin, schema)
    parent = queue.enqueue({})
    [job] = queue.claim(worker="w", limit=1, lease=60)
    made: list[int] = []
    with psycopg.connect(dsn) as holder:
        other_done = threading.Event()
        if first == "completion":
            assert _complete_on(holder, schema, job) == 1

            def second() -> None:
                made.append(queue.enqueue({"n": "child"}, after=[parent]))
                other_done.set()
        else:
            made.append(queue.enqueue({"n": "child"}, after=[parent], conn=holder))

            def second() -> None:
                assert _complete_on(other, schema, job) == 1
                other.commit()
                other_done.set()

        with psycopg.connect(dsn) as other:
            t = threading.Thread(target=second, daemon=True)
            t.start()
            wait_until(
                lambda: _blocked_by(admin, holder.info.backend_pid),
                what="the second party waiting on the parent's row",
            )
            assert not other_done.is_set()
            holder.commit()
            t.join(10)
            assert not t.is_alive()
    [child] = made
    assert _state(admin, schema, child) == ("pending", 0)
    assert _releases(admin, schema) == {child: 1}


def test_after_names_unknown_or_repeated_jobs_clearly(queue: Queue) -> None:
    a = queue.enqueue({})
    with pytest.raises(UnknownJob, match="no job with id 987654"):
        queue.enqueue({}, after=[a, 987654])
    with pytest.raises(ValueError, match="twice"):
        queue.enqueue({}, after=[a, a])
    with pytest.raises(ValueError, match="on_parent_failure"):
        queue.enqueue({}, after=[a], on_parent_failure="ignore")
    with pytest.raises(ValueError, match="idempotency_key"):
        queue.enqueue({}, after=[a], idempotency_key="k")
    assert [r["status"] for r in queue.status()] == ["pending"]  # nothing else went in


def test_a_delayed_parent_moved_by_upkeep_still_releases(
    queue: Queue, admin: psycopg.Connection[Any], schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(QueueBase, "ROTATE_ROWS", 1)
    monkeypatch.setattr(QueueBase, "ROTATE_AFTER", 0.0)
    s = sql.Identifier(schema)
    parent = queue.enqueue({}, run_at=datetime.now(UTC) + timedelta(hours=1))
    child = queue.enqueue({}, after=[parent])
    part = admin.execute(sql.SQL("SELECT part FROM {}.jobs WHERE id = %s").format(s), (parent,))
    before = part.fetchone()
    assert queue.upkeep().get("jobs_moved") == 1
    row = admin.execute(
        sql.SQL("SELECT part, has_children FROM {}.jobs WHERE id = %s").format(s), (parent,)
    ).fetchone()
    assert row is not None and before is not None and row[0] != before[0] and row[1] is True
    admin.execute(sql.SQL("UPDATE {}.jobs SET run_at = now() WHERE id = %s").format(s), (parent,))
    [job] = queue.claim(worker="w", limit=10)
    queue.complete(job, None)
    assert _state(admin, schema, child) == ("pending", 0)


@pytest.mark.connections(30)
def test_concurrent_workers_run_diamonds_each_step_once(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    """top -> (left, right) -> bottom, 40 times, under two Workers of 4: every job runs
    once, and every bottom runs after both of its parents are done, released once."""
    _log_releases(admin, schema)
    ran: Counter[int] = Counter()
    lock = threading.Lock()
    bad: list[str] = []

    def handler(job: Job) -> Any:
        with lock:
            ran[job.id] += 1
        if job.payload["step"] == "bottom":
            statuses = [p["status"] for p in queue.parent_results(job.id)]
            if statuses != ["done", "done"]:
                bad.append(f"{job.id}: parents {statuses}")
        return job.payload["step"]

    bottoms = []
    everything = []
    for _ in range(40):
        top = queue.enqueue({"step": "top"})
        left, right = queue.enqueue_many([{"step": "left"}, {"step": "right"}], after=[top])
        bottom = queue.enqueue({"step": "bottom"}, after=[left, right])
        bottoms.append(bottom)
        everything += [top, left, right, bottom]
    w1 = Worker(queue, handler, concurrency=4, lease=10, poll_interval=0.05, name="d1")
    w2 = Worker(queue, handler, concurrency=4, lease=10, poll_interval=0.05, name="d2")
    with running(w1), running(w2):
        wait_until(
            lambda: sum(r["jobs"] for r in queue.status() if r["status"] == "done") == 160,
            what="every diamond to finish",
        )
    assert bad == []
    assert ran == Counter({i: 1 for i in everything})
    tops = set(everything[0::4])
    assert _releases(admin, schema) == Counter({i: 1 for i in everything if i not in tops})


def test_every_partition_has_the_trigger_including_one_added_later(
    queue: Queue, admin: psycopg.Connection[Any], schema: str
) -> None:
    """PostgreSQL clones a partitioned table's row trigger to each partition, and to a
    partition attached later (upkeep's add_partition: CREATE TABLE ... LIKE, ATTACH)."""
    s = sql.Identifier(schema)
    admin.execute(sql.SQL("SELECT {}.add_partition('jobs_g9', 9)").format(s))
    rows = admin.execute(
        "SELECT c.relname FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE t.tgname = 'jobs_settle' AND n.nspname = %s ORDER BY 1",
        (schema,),
    ).fetchall()
    assert [r[0] for r in rows] == ["jobs", "jobs_g1", "jobs_g2", "jobs_g3", "jobs_g9"]
    # A parent in the added partition releases its child.
    admin.execute(sql.SQL("INSERT INTO {}.generations (part) VALUES (9)").format(s))
    admin.execute(
        sql.SQL("SELECT setval(format('%%I.jobs_gen', %s::text)::regclass, 9)").format(),
        (schema,),
    )
    parent = queue.enqueue({})
    child = queue.enqueue({}, after=[parent])
    part = admin.execute(sql.SQL("SELECT part FROM {}.jobs WHERE id = %s").format(s), (parent,))
    assert part.fetchone() == (9,)
    [job] = queue.claim(worker="w", limit=10)
    queue.complete(job, None)
    assert _state(admin, schema, child) == ("pending", 0)
