"""A server that turns read-only without restarting (a demoted primary, a disk-full guard):
producers and workers on a multi-host read-write DSN move to the server that takes writes.

Two scratch clusters stand for the old and the new primary; only their settings change.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock import Queue, Worker
from skiplock.chaos import ScratchCluster

from .test_chaos_readonly import read_only
from .test_worker import running, wait_until

pytestmark = pytest.mark.chaos


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ScratchCluster, ScratchCluster]]:
    with ScratchCluster() as old, ScratchCluster() as new:
        yield old, new


def multi_host(a: str, b: str) -> str:
    pa, pb = conninfo_to_dict(a), conninfo_to_dict(b)
    assert pa.get("dbname") == pb.get("dbname") and pa.get("user") == pb.get("user")
    return make_conninfo(
        host=f"{pa['host']},{pb['host']}",
        port=f"{pa.get('port', 5432)},{pb.get('port', 5432)}",
        dbname=str(pa["dbname"]),
        user=str(pa["user"]),
        target_session_attrs="read-write",
    )


def shows_read_only(q: Queue) -> bool:
    with q.connection() as c:
        row = c.execute("SHOW transaction_read_only").fetchone()
    return bool(row and row[0] == "on")


def server_of(q: Queue) -> str:
    with q.connection() as c:
        row = c.execute("SELECT current_setting('data_directory')").fetchone()
    assert row is not None
    return str(row[0])


def test_producers_and_workers_follow_the_server_that_takes_writes(
    pair: tuple[ScratchCluster, ScratchCluster],
) -> None:
    old, new = pair
    dsn = multi_host(old.dsn, new.dsn)
    for single in (old.dsn, new.dsn):
        with Queue(single, schema="follow", max_size=1) as q:
            q.migrate()
    seen: list[int] = []
    q = Queue(dsn, schema="follow", min_size=1, max_size=1)
    try:
        with psycopg.connect(old.dsn) as c:
            old_dir = str(c.execute("SELECT current_setting('data_directory')").fetchone()[0])  # type: ignore[index]
        assert server_of(q) == old_dir  # the first host takes writes: everyone is there
        read_only_now = False
        try:
            with running(Worker(q, lambda j: seen.append(j.payload["n"]), lease=30.0)) as w:
                first = q.enqueue({"n": 1})
                wait_until(lambda: w.stats.completed == 1, what="the job on the old primary")
                read_only(old.dsn, True)
                read_only_now = True
                # A reload reaches each session at its next command, not at once: wait
                # until the producer's one pooled session on the old server has it.
                wait_until(lambda: shows_read_only(q), what="the reload to reach the pool")
                # The pooled connection is on the old server; its write is refused, the
                # connection closed, and the retry connects to the new primary.  The
                # worker's lanes meet the refusal at their next write and do the same.
                second = q.enqueue({"n": 2})
                wait_until(lambda: w.stats.completed == 2, what="the worker to follow")
                assert seen == [1, 2] and w.stats.lease_lost == 0
        finally:
            # Only after the worker stopped: two writable servers are not a failover.
            if read_only_now:
                read_only(old.dsn, False)
        with Queue(old.dsn, schema="follow", max_size=1) as on_old:
            assert on_old.get(second) is None  # nothing was written to the read-only server
            assert on_old.get(first) is not None
        with Queue(new.dsn, schema="follow", max_size=1) as on_new:
            moved = on_new.get(second)
            assert moved is not None and moved.status == "done"
    finally:
        q.close()
