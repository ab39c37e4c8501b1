"""Least-privilege producer and worker roles, so a compromised host can do only its job."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from ._config import DEFAULT_SCHEMA, validate_schema
from ._errors import ConfigError
from ._sql import _read, parse_named

__all__ = [
    "RolePlan",
    "default_role_names",
    "ensure_roles",
    "plan_roles",
    "roles_script",
    "validate_role",
]

# Role names become quoted identifiers, so any text would be safe in SQL; the rule is for
# the humans who type them into DSNs, and NAMEDATALEN (63 bytes) is the server's limit.
_ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# Shown by --print-sql instead of the verifier: even a hash should not land in a log.
_PASSWORD_SHOWN = "'***'"


@functools.cache
def _blocks() -> dict[str, str]:
    return parse_named(_read("roles.sql"))


def validate_role(name: str) -> str:
    """Return ``name`` if it is an acceptable role name, else raise ConfigError."""
    if not isinstance(name, str) or not _ROLE_RE.fullmatch(name):
        raise ConfigError(
            f"invalid role name {name!r}: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters"
        )
    if name.lower().startswith("pg_"):
        raise ConfigError(f"invalid role name {name!r}: names starting with pg_ are reserved")
    return name


def default_role_names(schema: str = DEFAULT_SCHEMA) -> tuple[str, str]:
    """``(producer, worker)`` role names for ``schema``.

    ``skiplock_producer`` and ``skiplock_worker`` for the default schema; another
    schema's roles carry its name instead (``billing_producer``), so that two skiplock
    schemas in one database never share credentials.
    """
    validate_schema(schema)
    return f"{schema}_producer", f"{schema}_worker"


@dataclass(frozen=True)
class RolePlan:
    """The statements ``ensure_roles`` runs, in order, each as (title, statement)."""

    statements: tuple[tuple[str, sql.Composed], ...]

    def render(self, conn: psycopg.Connection[Any] | None = None) -> str:
        """The plan as one SQL script, for ``--print-sql`` or a DBA's review."""
        out = []
        for title, stmt in self.statements:
            out.append(f"-- {title}\n{stmt.as_string(conn)};\n")
        return "\n".join(out)


def plan_roles(
    schema: str = DEFAULT_SCHEMA,
    *,
    producer: str | None = None,
    worker: str | None = None,
    login: bool = False,
    passwords: dict[str, str] | None = None,
) -> RolePlan:
    """Build the SQL that creates and grants the producer and worker roles.

    Parameters
    ----------
    schema
        The skiplock schema the roles work on; it must be migrated before the plan runs.
    producer, worker
        Role names; default from :func:`default_role_names`.
    login
        Let the roles log in (``ALTER ROLE ... LOGIN``).  Without it existing roles keep
        their LOGIN attribute and new ones are NOLOGIN (grant them to login roles).
    passwords
        ``{role: verifier}``: a SCRAM verifier (from :func:`ensure_roles`), or a
        placeholder when the plan is only printed.

    Returns
    -------
    RolePlan
        The statements, all idempotent.
    """
    validate_schema(schema)
    default_producer, default_worker = default_role_names(schema)
    producer = validate_role(default_producer if producer is None else producer)
    worker = validate_role(default_worker if worker is None else worker)
    if producer == worker:
        raise ConfigError("the producer and worker roles must differ")
    blocks = _blocks()
    ident = sql.Identifier(schema)
    steps: list[tuple[str, sql.Composed]] = [
        ("one run at a time", sql.SQL(blocks["serialise"]).format()),
    ]
    for kind, role in (("producer", producer), ("worker", worker)):
        r = sql.Identifier(role)
        steps.append((f"{kind} role {role}", sql.SQL(blocks["create_role"]).format(role=r)))
        if login:
            steps.append((f"{role} may log in", sql.SQL(blocks["login"]).format(role=r)))
        if passwords and role in passwords:
            pw = passwords[role]
            literal: sql.Composable = (
                sql.SQL(_PASSWORD_SHOWN) if pw == _PASSWORD_SHOWN else sql.Literal(pw)
            )
            steps.append(
                (f"{role} password", sql.SQL(blocks["password"]).format(role=r, password=literal))
            )
        steps.append(
            (f"{kind} privileges", sql.SQL(blocks[f"grant_{kind}"]).format(schema=ident, role=r))
        )
    return RolePlan(tuple(steps))


def roles_script(
    schema: str = DEFAULT_SCHEMA,
    *,
    producer: str | None = None,
    worker: str | None = None,
    login: bool = False,
    password_roles: tuple[str, ...] = (),
) -> str:
    """The SQL ``ensure_roles`` would run, as a script, with passwords masked.

    Needs no connection: ``skiplock roles --print-sql`` hands it to a DBA.
    """
    masked = dict.fromkeys(password_roles, _PASSWORD_SHOWN)
    plan = plan_roles(schema, producer=producer, worker=worker, login=login, passwords=masked)
    return plan.render()


def ensure_roles(
    conn: psycopg.Connection[Any],
    schema: str = DEFAULT_SCHEMA,
    *,
    producer: str | None = None,
    worker: str | None = None,
    login: bool = False,
    passwords: dict[str, str] | None = None,
) -> tuple[str, str]:
    """Create (idempotently) the producer and worker roles of ``schema`` and grant them.

    Runs in one transaction on ``conn``, as a role that owns the schema (or a superuser)
    and may create roles.  Clear-text ``passwords`` (``{role: password}``) are turned
    into SCRAM-SHA-256 verifiers by libpq on this side, so the server, its statement
    log and ``pg_stat_activity`` only ever see the verifier.

    Parameters
    ----------
    conn
        An open connection, not inside a transaction of the caller's.
    schema, producer, worker, login
        As for :func:`plan_roles`.
    passwords
        Clear-text passwords by role name.

    Returns
    -------
    tuple of str
        The ``(producer, worker)`` role names.

    Raises
    ------
    ConfigError
        Bad names, an unmigrated schema, a superuser as target, or a missing privilege
        (CREATEROLE, ownership of the schema's objects).
    """
    default_producer, default_worker = default_role_names(schema)
    producer = validate_role(default_producer if producer is None else producer)
    worker = validate_role(default_worker if worker is None else worker)
    for role, pw in (passwords or {}).items():
        if role not in (producer, worker):
            raise ConfigError(
                f"password given for {role!r}, which is neither {producer!r} nor {worker!r}"
            )
        if not pw:
            raise ConfigError(f"empty password for role {role!r}")
    verifiers = {
        role: conn.pgconn.encrypt_password(
            pw.encode("utf-8"), role.encode("utf-8"), b"scram-sha-256"
        ).decode("ascii")
        for role, pw in (passwords or {}).items()
    }
    plan = plan_roles(schema, producer=producer, worker=worker, login=login, passwords=verifiers)
    # A GRANT by a role that lacks the grant option is not an error, only a WARNING
    # ("no privileges were granted"); collected here so it fails the whole run.
    refused: list[str] = []

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        if diag.sqlstate in _NOT_GRANTED:
            refused.append(diag.message_primary or "privilege not granted")

    conn.add_notice_handler(on_notice)
    try:
        with conn.transaction():
            for title, stmt in plan.statements:
                conn.execute(stmt)
                if refused:
                    raise _Refused(f"{title}: {refused[0]}")
            rows = conn.execute(
                sql.SQL(_blocks()["superusers"]), {"roles": [producer, worker]}
            ).fetchall()
            if rows:
                raise _Refused(f"role {rows[0][0]} is a superuser; grants cannot restrict it")
    except _Refused as exc:
        raise ConfigError(f"cannot set up roles: {exc}") from None
    except (pgerrors.UndefinedTable, pgerrors.InvalidSchemaName, pgerrors.UndefinedObject):
        raise ConfigError(
            f"skiplock schema {schema!r} is missing or not migrated; run `skiplock migrate` "
            "before `skiplock roles`"
        ) from None
    except (pgerrors.UndefinedFunction, pgerrors.UndefinedColumn):
        raise ConfigError(
            f"skiplock schema {schema!r} is not at the latest version; run `skiplock migrate`"
        ) from None
    except pgerrors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"cannot set up roles: {exc.diag.message_primary or exc}; run `skiplock roles` as "
            "the schema's owner (or a superuser) with the CREATEROLE attribute"
        ) from None
    finally:
        conn.remove_notice_handler(on_notice)
    return producer, worker


class _Refused(Exception):
    pass


# SQLSTATE 01007 privilege_not_granted, 01006 privilege_not_revoked.
_NOT_GRANTED = frozenset({"01007", "01006"})
