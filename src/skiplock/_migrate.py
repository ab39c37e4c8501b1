"""Create and upgrade a skiplock schema from the ordered .sql migrations."""

from __future__ import annotations

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from ._errors import ConfigError
from ._sql import migrations

__all__ = ["migrate", "schema_version"]

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


def migrate(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> list[int]:
    """Apply the missing migrations to ``schema`` in one transaction; return their versions.

    Several processes may call this at once (every worker on start, say): the first
    takes a transaction-scoped advisory lock and the others wait for it, then find
    nothing left to do.  Idempotent.
    """
    try:
        return _migrate(conn, schema)
    except pgerrors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"cannot migrate schema {schema!r}: {exc.diag.message_primary or exc}; run "
            "`skiplock migrate` as the schema's owner, and start producers and workers that "
            "use the roles of `skiplock roles` with --no-migrate"
        ) from None


def _migrate(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> list[int]:
    ident = sql.Identifier(schema)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (_LOCK_KEY + schema,))
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.migrations ("
                " version integer PRIMARY KEY,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        current = schema_version(conn, schema)
        known = migrations()
        newest = known[-1].version if known else 0
        if current > newest:
            raise ConfigError(
                f"schema {schema!r} is at version {current}, newer than this skiplock "
                f"({newest}); upgrade skiplock"
            )
        # By set, not by "above the current version": a migration numbered below one
        # already applied (two branches landing in either order) is still applied.
        done = {
            int(v)  # type: ignore[call-overload]
            for (v,) in conn.execute(
                sql.SQL("SELECT version FROM {}.migrations").format(ident)
            ).fetchall()
        }
        applied: list[int] = []
        for mig in known:
            if mig.version in done:
                continue
            conn.execute(mig.render(schema))
            conn.execute(
                sql.SQL("INSERT INTO {}.migrations (version, name) VALUES (%s, %s)").format(ident),
                (mig.version, mig.name),
            )
            applied.append(mig.version)
    return applied
