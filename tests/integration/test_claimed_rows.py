"""A claim's rows become Jobs straight from the column values (``claimed_rows``): the
Jobs equal what ``Queue.get`` builds from the same rows by name, on the one-statement
claim and on a limited queue's locked path, with a cancel request carried over."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import Queue


@pytest.mark.parametrize("limited", [False, True], ids=["claim", "claim_limited"])
def test_claimed_jobs_equal_the_rows_read_by_name(
    queue: Queue, admin: psycopg.Connection[Any], limited: bool
) -> None:
    name = "limited" if limited else "plain"
    if limited:
        queue.configure_queue(name, concurrency_limit=2)
    ids = [
        queue.enqueue({"n": 1}, queue=name, priority=3),
        queue.enqueue({"n": 2}, queue=name, idempotency_key="k-2", task="t", meta={"m": 1}),
        queue.enqueue({"n": 3}, queue=name),
    ]
    claimed = queue.claim(worker="w", queue=name, limit=10)
    assert len(claimed) == (2 if limited else 3)  # a limited queue's claim stops at 2
    for job in claimed:
        assert job == queue.get(job.id), job.id
        assert job.status == "running" and job.lease_token is not None
        assert not job.cancelled
    # In claim order: priority first (the job of priority 3 last, if taken).
    assert [j.id for j in claimed] == [ids[1], ids[2], ids[0]][: len(claimed)]
    assert ids[1] in {j.id for j in claimed}
    keyed = next(j for j in claimed if j.id == ids[1])
    assert (keyed.key, keyed.task, keyed.meta, keyed.payload) == ("k-2", "t", {"m": 1}, {"n": 2})


def test_a_cancel_requested_before_the_claim_reaches_the_job(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    job_id = queue.enqueue({"n": 1})
    # A request left on a pending row (as a cancel racing the claim may leave it).
    admin.execute(
        sql.SQL("UPDATE {}.jobs SET cancel_requested = true WHERE id = %s").format(
            sql.Identifier(queue.schema)
        ),
        (job_id,),
    )
    [job] = queue.claim(worker="w", limit=1)
    assert job.id == job_id and job.cancelled


def test_skiplock_connections_read_jsonb_with_the_payload_loader(queue: Queue) -> None:
    """Connections skiplock opens read ``jsonb`` with ``PayloadLoader``; psycopg's global
    adapters, which the application's own connections use, are left as they were."""
    from psycopg.pq import Format

    from skiplock._job import PayloadLoader

    jsonb = psycopg.adapters.types["jsonb"].oid
    with queue.connection() as conn:
        assert conn.adapters.get_loader(jsonb, Format.TEXT) is PayloadLoader
    assert psycopg.adapters.get_loader(jsonb, Format.TEXT) is not PayloadLoader
    with psycopg.connect(queue.settings.dsn) as own:
        assert own.adapters.get_loader(jsonb, Format.TEXT) is not PayloadLoader
    payload = {"é": ["ü", 1.5, None, True, {"deep": [1, "\u2603"]}], "n": 10**20}
    queue.enqueue(payload)
    [job] = queue.claim(worker="w", limit=1)
    assert job.payload == payload
