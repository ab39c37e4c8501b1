"""The fused transaction's driver (``run_together`` / ``arun_together``): the first
statements of two operations commit as one transaction, on an autocommit connection
(the pipeline's implicit transaction, as the pool and the lanes use) and on one that is
not (an explicit one); a failure in either statement leaves nothing of the other; and
the connection is idle afterwards, its transaction over, not left open."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus

from skiplock._aqueue import arun_together
from skiplock._ops import Execute
from skiplock._queue import run_together

Op = Generator[Execute, list[dict[str, Any]], list[dict[str, Any]]]


def _insert(table: sql.Identifier, x: int) -> Op:
    rows = yield Execute(
        sql.SQL("INSERT INTO {} VALUES (%(x)s) RETURNING x, txid_current() AS tx").format(table),
        {"x": x},
    )
    return rows


@pytest.fixture
def table(admin: psycopg.Connection[Any], schema: str) -> sql.Identifier:
    admin.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    ident = sql.Identifier(schema, "t")
    admin.execute(sql.SQL("CREATE TABLE {} (x int PRIMARY KEY)").format(ident))
    return ident


def _rows(admin: psycopg.Connection[Any], table: sql.Identifier) -> list[int]:
    return [r[0] for r in admin.execute(sql.SQL("SELECT x FROM {} ORDER BY x").format(table))]


def _together(dsn: str, autocommit: bool, kind: str, first: Op, second: Op) -> Any:
    """Run the two ops together on a fresh connection; return the results and the
    connection's transaction status after."""
    if kind == "sync":
        with psycopg.connect(dsn, autocommit=autocommit) as conn:
            try:
                return run_together(conn, first, second), conn.info.transaction_status  # type: ignore[arg-type]
            finally:
                conn.rollback()

    async def go() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
            try:
                out = await arun_together(conn, first, second)  # type: ignore[arg-type]
                return out, conn.info.transaction_status
            finally:
                await conn.rollback()

    return asyncio.run(go())


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "not-autocommit"])
def test_both_statements_commit_as_one_transaction(
    dsn: str, admin: psycopg.Connection[Any], table: sql.Identifier, kind: str, autocommit: bool
) -> None:
    (a, b), status = _together(dsn, autocommit, kind, _insert(table, 1), _insert(table, 2))
    assert a[0]["tx"] == b[0]["tx"], "two transactions"
    assert status == TransactionStatus.IDLE, "the transaction was left open"
    assert _rows(admin, table) == [1, 2]  # committed, seen from another session


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "not-autocommit"])
@pytest.mark.parametrize("failing", ["first", "second"])
def test_a_failing_statement_leaves_nothing_of_the_other(
    dsn: str,
    admin: psycopg.Connection[Any],
    table: sql.Identifier,
    kind: str,
    autocommit: bool,
    failing: str,
) -> None:
    admin.execute(sql.SQL("INSERT INTO {} VALUES (5)").format(table))
    good, bad = _insert(table, 1), _insert(table, 5)  # 5: a duplicate key
    ops = (bad, good) if failing == "first" else (good, bad)
    with pytest.raises(psycopg.errors.UniqueViolation):
        _together(dsn, autocommit, kind, *ops)
    assert _rows(admin, table) == [5]
