"""A server that turns read-only without restarting (a demoted primary, a disk-full guard):
producers and workers on a multi-host read-write DSN move to the server that takes writes.

Two scratch clusters stand for the old and the new primary; only their settings change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock import AsyncQueue, Job, Queue
from skiplock.chaos import ScratchCluster

from .test_chaos_readonly import read_only
from .test_worker import wait_until
from .test_worker_logs import running

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


def _migrate_both(pair: tuple[ScratchCluster, ScratchCluster], schema: str) -> None:
    """The schema on both servers, as a deployment that may fail over has it."""
    for cluster in pair:
        with Queue(cluster.dsn, schema=schema, max_size=1) as q:
            q.migrate()


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("fuse_claims", [False, True])
def test_producers_and_workers_follow_the_server_that_takes_writes(
    pair: tuple[ScratchCluster, ScratchCluster], kind: str, fuse_claims: bool
) -> None:
    """Either worker, claiming apart or with its completions (``fuse_claims``): the
    writer's fused transaction met the refusal on a connection it then kept, so it
    wrote to the read-only server until that took writes again."""
    old, new = pair
    dsn = multi_host(old.dsn, new.dsn)
    schema = f"follow_{kind}_{'fused' if fuse_claims else 'apart'}"
    _migrate_both(pair, schema)
    seen: list[int] = []
    q = Queue(dsn, schema=schema, min_size=1, max_size=1)
    try:
        with psycopg.connect(old.dsn) as c:
            old_dir = str(c.execute("SELECT current_setting('data_directory')").fetchone()[0])  # type: ignore[index]
        assert server_of(q) == old_dir  # the first host takes writes: everyone is there
        read_only_now = False
        try:

            def note(job: Job) -> None:
                seen.append(job.payload["n"])

            async def anote(job: Job) -> None:
                note(job)

            with running(
                kind, q, note, anote, lease=30.0, poll_interval=1.0, fuse_claims=fuse_claims
            ) as w:
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
        with Queue(old.dsn, schema=schema, max_size=1) as on_old:
            assert on_old.get(second) is None  # nothing was written to the read-only server
            assert on_old.get(first) is not None
        with Queue(new.dsn, schema=schema, max_size=1) as on_new:
            moved = on_new.get(second)
            assert moved is not None and moved.status == "done"
    finally:
        q.close()


def _data_dir(dsn: str) -> str:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT current_setting('data_directory')").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refused_fused_write_closes_its_connection(
    pair: tuple[ScratchCluster, ScratchCluster], kind: str
) -> None:
    """``_complete_and_claim`` (the writer's transaction with ``fuse_claims``) refused by
    a server turned read-only closes its connection, as every other write does: the
    next write connects anew, to the server that takes writes.  It was given back to the
    pool open, and each retry of the writer went to the read-only server again."""
    old, new = pair
    dsn = multi_host(old.dsn, new.dsn)
    schema = f"fused_refused_{kind}"
    _migrate_both(pair, schema)
    old_dir, new_dir = _data_dir(old.dsn), _data_dir(new.dsn)
    show = "SELECT current_setting('transaction_read_only'), current_setting('data_directory')"

    def refused_then_where(
        complete_and_claim: Callable[[], object], server: Callable[[], tuple[str, str]]
    ) -> str:
        assert server()[1] == old_dir
        read_only(old.dsn, True)
        try:
            # A reload reaches a session at its next command: wait for the pooled one.
            wait_until(lambda: server()[0] == "on", what="the reload to reach the pool")
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                complete_and_claim()
            return server()[1]
        finally:
            read_only(old.dsn, False)

    if kind == "sync":
        with Queue(dsn, schema=schema, min_size=1, max_size=1) as q:
            q.enqueue({"n": 1})
            job = q.claim(worker="w")[0]

            def server() -> tuple[str, str]:
                with q.connection() as c:
                    row = c.execute(show).fetchone()
                assert row is not None
                return str(row[0]), str(row[1])

            now_on = refused_then_where(
                lambda: q._complete_and_claim([job], q._claim_op("w", "default", 1, 30.0)),
                server,
            )
    else:

        async def scenario() -> str:
            async with AsyncQueue(dsn, schema=schema, min_size=1, max_size=1) as aq:
                await aq.enqueue({"n": 1})
                job = (await aq.claim(worker="w"))[0]
                loop = asyncio.get_running_loop()

                async def aserver() -> tuple[str, str]:
                    async with aq.connection() as c:
                        row = await (await c.execute(show)).fetchone()
                    assert row is not None
                    return str(row[0]), str(row[1])

                def server() -> tuple[str, str]:
                    return asyncio.run_coroutine_threadsafe(aserver(), loop).result()

                def fused() -> object:
                    op = aq._claim_op("w", "default", 1, 30.0)
                    coro = aq._complete_and_claim([job], op)
                    return asyncio.run_coroutine_threadsafe(coro, loop).result()

                # The loop must run while the checks, which block, wait on it.
                return await asyncio.to_thread(refused_then_where, fused, server)

        now_on = asyncio.run(scenario())
    assert now_on == new_dir
