"""Create and upgrade a skiplock schema from the ordered .sql migrations."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from ._errors import ConfigError
from ._ops import Execute, Op
from ._sql import migrations

__all__ = ["applied_versions", "migrate_op", "schema_version"]

_LOCK_KEY = "skiplock.migrate:"


def schema_version(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    """The highest applied migration in ``schema``, 0 when it has none."""
    table = conn.execute(
        "SELECT to_regclass(format('%%I.migrations', %s::text))", (schema,)
    ).fetchone()
    if table is None or table[0] is None:
        return 0
    row = conn.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}.migrations").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    return int(row[0]) if row else 0  # type: ignore[call-overload]


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> set[int]:
    """The migrations applied to ``schema``, none when it has no migrations table.

    By set, as ``migrate`` applies them: a schema at 15 that lacks 14 is not current.
    """
    table = conn.execute(
        "SELECT to_regclass(format('%%I.migrations', %s::text))", (schema,)
    ).fetchone()
    if table is None or table[0] is None:
        return set()
    rows = conn.execute(
        sql.SQL("SELECT version FROM {}.migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {int(r[0]) for r in rows}


def migrate_op(schema: str) -> Op[list[int]]:
    """Apply the missing migrations to ``schema`` in one transaction; return their versions.

    Several processes may run this at once (every worker on start, say): the first
    takes a transaction-scoped advisory lock and the others wait for it, then find
    nothing left to do.  Idempotent.  An I/O-free operation, so that both drivers run
    it; on error the pool rolls the open transaction back.
    """
    ident = sql.Identifier(schema)
    # A failed statement leaves the transaction aborted; the connection goes back to
    # the pool, which rolls it back.
    yield Execute(sql.SQL("BEGIN"))
    applied = yield from _apply(schema, ident)
    yield Execute(sql.SQL("COMMIT"))
    return applied


def _apply(schema: str, ident: sql.Identifier) -> Op[list[int]]:
    yield Execute(
        sql.SQL("SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0))"),
        {"key": _LOCK_KEY + schema},
    )
    yield Execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
    yield Execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(ident)
    )
    rows = yield Execute(sql.SQL("SELECT version FROM {}.migrations").format(ident))
    done = {int(r["version"]) for r in rows}
    known = migrations()
    newest = known[-1].version if known else 0
    if done and max(done) > newest:
        raise ConfigError(
            f"schema {schema!r} is at version {max(done)}, newer than this skiplock "
            f"({newest}); upgrade skiplock"
        )
    # By set, not by "above the current version": a migration numbered below one
    # already applied (two branches landing in either order) is still applied.
    applied: list[int] = []
    for mig in known:
        if mig.version in done:
            continue
        yield Execute(mig.render(schema))
        yield Execute(
            sql.SQL("INSERT INTO {}.migrations (version, name) VALUES (%(v)s, %(n)s)").format(
                ident
            ),
            {"v": mig.version, "n": mig.name},
        )
        applied.append(mig.version)
    return applied
