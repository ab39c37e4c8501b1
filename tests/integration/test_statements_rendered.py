"""A named statement keeps the bytes of its first rendering on a connection, and sends
exactly what psycopg would have rendered, on sync and async connections alike; a
rendering it cannot vouch for (no connection, a non-ASCII schema name) is not kept."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from psycopg import sql

from skiplock import Queue
from skiplock._sql import Statements


def _fresh(name: str) -> Any:
    """A statement of a Statements built here, so no other test has rendered it."""
    return Statements(name).get


def test_kept_after_the_first_rendering_and_equal_to_psycopgs(
    queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    stmt = _fresh(queue.schema)
    assert isinstance(stmt, sql.Composed)
    plain = sql.Composed(list(stmt)).as_bytes(admin)
    assert stmt._bytes is None
    assert stmt.as_bytes(admin) == plain
    assert stmt._bytes == plain
    job_id = queue.enqueue({"n": 1})
    for _ in range(2):  # rendered, then sent as kept
        row = admin.execute(stmt, {"id": job_id}).fetchone()
        assert row is not None and row[0] == job_id
    # Still a Composed for every public use: joined, and read as text.
    explain = sql.SQL("EXPLAIN ") + stmt
    assert admin.execute(explain, {"id": job_id}).fetchall()
    assert stmt.as_string(admin) == plain.decode()


def test_kept_on_an_async_connection_too(queue: Queue, dsn: str) -> None:
    stmt = _fresh(queue.schema)
    job_id = queue.enqueue({"n": 2})

    async def go() -> list[Any]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            out = []
            for _ in range(2):
                cur = await conn.execute(stmt, {"id": job_id})
                out.append(await cur.fetchone())
            return out

    rows = asyncio.run(go())
    assert [r[0] for r in rows] == [job_id, job_id]
    assert stmt._bytes is not None


def test_not_kept_without_a_connection_or_when_not_ascii(admin: psycopg.Connection[Any]) -> None:
    stmt = _fresh("plain")
    stmt.as_bytes(None)
    assert stmt._bytes is None  # no connection to go by
    accented = _fresh("fäkt")
    text = accented.as_bytes(admin)
    assert '"fäkt"'.encode() in text
    assert accented._bytes is None  # depends on the encoding: rendered every time
