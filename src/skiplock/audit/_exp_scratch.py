"""The experiment's set-up: the user's scripts, and the scratch schema (or database) they run in."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from pglast import ast
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ._claim import (
    ExperimentError,
    _qualified_names,
    placeholder_name,
    read_script,
    render,
    statements_of,
)
from ._engine import Statement
from ._lexer import FORMAT_PREFIX

__all__ = ["Scratch", "Script", "message", "scratch_with"]

Node = Any


# -- scripts ----------------------------------------------------------------------------------


@dataclass
class Script:
    """A .sql file of the user's (DDL or seed): its statements, parsed and located."""

    path: str
    statements: list[tuple[Statement, Node]]

    @classmethod
    def read(cls, path: str | Path) -> Script:
        extracted = read_script(path)
        return cls(str(path), [st for text in extracted.texts for st in statements_of(text)])

    def needs_database(self) -> str | None:
        """Why this script cannot run in a scratch schema (it reaches outside one), if so."""
        for stmt, tree in self.statements:
            line = stmt.position(stmt.first_offset())[0]
            where = f"{self.path}:{line}"
            if isinstance(tree, ast.CreateSchemaStmt):
                return f"{where} creates a schema"
            if isinstance(tree, ast.CreateExtensionStmt):
                return f"{where} creates an extension"
            if isinstance(tree, ast.VariableSetStmt) and tree.name == "search_path":
                return f"{where} sets search_path"
            names = _qualified_names(tree)
            if names:
                return f"{where} names {names[0]}"
        return None

    def run(self, conn: psycopg.Connection[Any], values: Mapping[str, str] | None = None) -> None:
        """Execute the statements in order (transaction control is the caller's).

        ``values`` fill named placeholders, as literals: a seed's ``:jobs`` is a count.
        """
        for stmt, tree in self.statements:
            if isinstance(tree, ast.TransactionStmt):
                continue
            line = stmt.position(stmt.first_offset())[0]
            spliced: dict[str, str] = {}
            for repl, written in stmt.norm.replaced:
                name = placeholder_name(written)
                if values is None or name not in values:
                    known = f" (only {', '.join(values)} here)" if values else ""
                    raise ExperimentError(f"{self.path}:{line}: {written} has no value{known}")
                value = values[name]
                spliced[repl] = value if repl.startswith(FORMAT_PREFIX) else _literal(value)
            text, _ = render(stmt.norm.text, spliced)
            try:
                conn.execute(text.encode())
            except psycopg.Error as exc:
                raise ExperimentError(f"{self.path}:{line}: {message(exc)}") from None


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def message(exc: BaseException) -> str:
    """One line for a database error: its primary message, never a traceback."""
    if isinstance(exc, psycopg.Error) and exc.diag.message_primary:
        return exc.diag.message_primary.strip()
    first = str(exc).strip().splitlines()
    return first[0] if first else type(exc).__name__


# -- scratch schema or database ---------------------------------------------------------------


class Scratch:
    """A fresh schema (or database) for one run of the user's DDL; dropped on exit."""

    def __init__(self, dsn: str, database: bool) -> None:
        self.admin_dsn = dsn
        self.database = database
        self.name = f"skiplock_audit_{uuid.uuid4().hex[:10]}"
        self.app = f"skiplock-audit:{self.name}"
        params = conninfo_to_dict(dsn)
        if database:
            params["dbname"] = self.name
        else:
            options = str(params.get("options") or "")
            # Every connection of the run resolves unqualified names in the scratch schema.
            params["options"] = f"{options} -c search_path={self.name}".strip()
        self.dsn = make_conninfo("", **{k: str(v) for k, v in params.items() if v is not None})

    def connect(self, suffix: str = "setup") -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, application_name=f"{self.app}:{suffix}")

    def __enter__(self) -> Scratch:
        with psycopg.connect(self.admin_dsn, autocommit=True, application_name=self.app) as conn:
            what = "DATABASE" if self.database else "SCHEMA"
            conn.execute(sql.SQL(f"CREATE {what} {{}}").format(sql.Identifier(self.name)))
        return self

    def __exit__(self, *exc: object) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True, application_name=self.app) as conn:
            # Sessions of a run that failed half-way must not keep locks on what we drop.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND starts_with(application_name, %s)",
                (self.app + ":",),
            )
            if self.database:
                # FORCE (PostgreSQL 13+) ends sessions the termination above has not yet.
                force = " WITH (FORCE)" if conn.info.server_version >= 130000 else ""
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {}" + force).format(sql.Identifier(self.name))
                )
            else:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.name))
                )


@contextmanager
def scratch_with(
    dsn: str, database: bool, ddl: Script
) -> Iterator[tuple[Scratch, psycopg.Connection[Any]]]:
    with Scratch(dsn, database) as scratch, scratch.connect() as conn:
        ddl.run(conn)
        yield scratch, conn
