"""The audit's experiment: run the user's own claim concurrently on a scratch copy of their schema.

The static rules say a claim *can* hand one job to two workers; this shows whether it
does, with the user's DDL and statement on a real server, using the race lab's machinery
(``skiplock.lab``): W workers, each with its own connection, drain N seeded rows and every
key a claim returned is counted; then two sessions replay the race step by step on the
lab's step driver, which sees waits through ``pg_blocking_pids``.

Nothing of the user's is touched.  The DDL runs in a fresh schema, and every connection
(DDL, seeding, workers, replay sessions) gets ``search_path`` set to it, so unqualified
names land there; the schema is dropped afterwards.  DDL or a claim that names a schema,
creates one or an extension, or sets ``search_path`` gets a scratch database instead.

Seeding, unless ``--seed`` gives a script: rows are inserted into the claim's table with
every column at its default except (1) columns the claim tests against a value
(``status = 'pending'``, ``queue = $1``), which get that value, so the rows are
claimable; (2) NOT NULL columns without a default, which get a value made up from their
type (``'seed-' || g`` for text, ``g`` for numbers, ``now()`` for times, the first label
of an enum, ``gen_random_uuid()``, ``jsonb_build_object('seed', g)``).  Identity and
generated columns are left alone, so keys come out 1..N in order.  Rows another table
must hold first (a foreign key, the queue a join asks for) need a ``--seed`` script.

Placeholders get, unless ``--param NAME=VALUE`` or a psql ``\\set`` says otherwise: the
claim's LIMIT for a LIMIT; the keys the previous statement returned for ``id = $n``,
``id = ANY($n)`` or ``id IN ($a, $b)`` in the second statement of a two-step claim; the
worker's name for a text column it sets; now() plus a 5-minute lease for a time it sets;
and a made-up value for a column it compares (seeded rows carry the same value).  Types
come from the server (PREPARE on the scratch copy), not guessed from the text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from pglast import ast
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.connect import redact_dsn
from skiplock.lab import (
    SCHEDULES,
    ClaimContext,
    ClaimStep,
    RaceError,
    RaceResult,
    StepError,
    Strategy,
    Timeline,
    race_prepared,
    replay_prepared,
)

from ._claim import (
    ClaimPlan,
    ClaimStatement,
    ExperimentError,
    ParamValue,
    Placeholder,
    _qualified_names,
    parse_claim,
    placeholder_name,
    read_script,
    render,
    returning_clause,
    statements_of,
)
from ._engine import AuditResult, Statement, audit_paths
from ._lexer import FORMAT_PREFIX
from ._model import is_key_column
from ._report import render_json, render_text

__all__ = ["ExperimentError", "ExperimentResult", "run_experiment"]

Node = Any
Value = Callable[[ClaimContext, Sequence[int]], Any]

_LEASE = 300.0  # seconds: the lease a made-up "locked until" gets
_STALL = 2.0  # seconds without progress after which a worker's empty claims mean "done"
_INTEGER_TYPES = {"smallint", "integer", "bigint"}


# -- scripts ----------------------------------------------------------------------------------


@dataclass
class _Script:
    """A .sql file of the user's (DDL or seed): its statements, parsed and located."""

    path: str
    statements: list[tuple[Statement, Node]]

    @classmethod
    def read(cls, path: str | Path) -> _Script:
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
                raise ExperimentError(f"{self.path}:{line}: {_message(exc)}") from None


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _message(exc: BaseException) -> str:
    """One line for a database error: its primary message, never a traceback."""
    if isinstance(exc, psycopg.Error) and exc.diag.message_primary:
        return exc.diag.message_primary.strip()
    first = str(exc).strip().splitlines()
    return first[0] if first else type(exc).__name__


# -- scratch schema or database ---------------------------------------------------------------


class _Scratch:
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

    def __enter__(self) -> _Scratch:
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


# -- the claim, prepared against the user's schema --------------------------------------------


@dataclass(frozen=True)
class _Column:
    name: str
    type: str
    category: str
    not_null: bool
    has_default: bool
    automatic: bool  # identity or generated: never given a value
    type_oid: int


@dataclass
class _Binding:
    placeholder: Placeholder
    step: int
    value: Value
    note: str
    # A value fixed for the whole run, so seeded rows can carry it (``queue = $1``).
    fixed: str | None = None


@dataclass
class _Prepared:
    """The claim ready to run on any scratch made from the same DDL."""

    plan: ClaimPlan
    table: str  # as the server prints it (regclass), safe to splice
    key: str
    columns: list[_Column]
    steps: list[tuple[ClaimStatement, str, str]]  # statement, PREPARE text, psycopg text
    id_columns: list[str]
    bindings: list[_Binding]
    limit: int
    seed_values: list[tuple[str, sql.Composable, str]] = field(default_factory=list)

    def strategy(self) -> Strategy:
        steps = []
        for index, (_stmt, _dollar, named) in enumerate(self.steps):
            mine = [b for b in self.bindings if b.step == index]
            steps.append(
                ClaimStep(
                    "claim" if len(self.steps) == 1 else f"claim {index + 1}",
                    _constant(named),
                    _binder(mine),
                    self.id_columns[index],
                )
            )
        return Strategy(
            Path(self.plan.path).name,
            "the user's claim",
            tuple(steps),
            retry_serialization=True,  # a server whose default isolation is SERIALIZABLE
            safe=False,
        )


def _constant(query: str) -> Callable[[str], str]:
    # The scratch schema is on the search_path: the statement is the same for any schema.
    # A str, not a psycopg.sql template, so the user's braces ('{}'::jsonb) stay as written.
    return lambda _schema: query


def _binder(bindings: list[_Binding]) -> Callable[[ClaimContext, Sequence[int]], Mapping[str, Any]]:
    def bind(ctx: ClaimContext, ids: Sequence[int]) -> Mapping[str, Any]:
        return {f"p{b.placeholder.number}": b.value(ctx, ids) for b in bindings}

    return bind


def _fixed(value: str) -> Value:
    return lambda _ctx, _ids: value


def _param_key(name: str) -> str:
    """--param accepts a placeholder as written ($1, :name, %(name)s) or by its bare name."""
    name = name.strip()
    if name.startswith("%(") and name.endswith(")s"):
        return name[2:-2]
    return name.lstrip("$:").strip("'\"{}")


def _prepare(
    conn: psycopg.Connection[Any], plan: ClaimPlan, params: Mapping[str, str], scratch: _Scratch
) -> _Prepared:
    given = {_param_key(k): v for k, v in params.items()}
    fields = _fields(plan, given, scratch)
    table_name = fields.get(plan.table, plan.table)
    if plan.table.startswith(FORMAT_PREFIX):
        qualified = table_name
    else:
        parts = [p for p in (plan.table_schema, plan.table) if p]
        qualified = sql.Identifier(*parts).as_string(conn)
    row = conn.execute("SELECT to_regclass(%s)::oid", (qualified,)).fetchone()
    if not row or row[0] is None:
        raise ExperimentError(
            f"{plan.path}: the claim's table {table_name} does not exist after running the schema"
        )
    oid = int(row[0])
    named = conn.execute("SELECT %s::oid::regclass::text", (oid,)).fetchone()
    table = str(named[0]) if named else table_name
    columns = _columns(conn, oid)
    key = _key(conn, oid, columns, table)
    steps = []
    id_columns = []
    types: list[dict[int, tuple[str, str, int]]] = []
    for step in plan.statements:
        dollar, named = render(step.text + returning_clause(step, key), fields)
        param_types, outputs = _describe(conn, dollar, plan.path, step.line)
        types.append(param_types)
        id_columns.append(_id_column(outputs, key, plan.path, step.line))
        steps.append((step, dollar, named))
    prepared = _Prepared(plan, table, key, columns, steps, id_columns, [], 10)
    prepared.bindings = _bindings(conn, plan, given, types, key)
    limit = plan.limit()
    if isinstance(limit, int):
        prepared.limit = limit
    elif isinstance(limit, Placeholder):
        chosen = given.get(limit.name) or plan.psql_vars.get(limit.name)
        if chosen is not None:
            try:
                prepared.limit = int(chosen)
            except ValueError:
                raise ExperimentError(
                    f"--param {limit.name}={chosen}: a LIMIT is a number"
                ) from None
    prepared.seed_values = _seed_values(conn, prepared)
    return prepared


def _fields(plan: ClaimPlan, given: Mapping[str, str], scratch: _Scratch) -> dict[str, str]:
    """Text for each {field} of the claim: --param, else the scratch schema for {schema}."""
    out: dict[str, str] = {}
    for step in plan.statements:
        for repl, name in step.fields.items():
            if name in given:
                out[repl] = given[name]
            elif name in plan.psql_vars:
                out[repl] = '"' + plan.psql_vars[name].replace('"', '""') + '"'
            elif name == "schema" and not scratch.database:
                out[repl] = '"' + scratch.name + '"'
            else:
                raise ExperimentError(
                    f"{plan.path}:{step.line}: the claim is composed at run time ({{{name}}}): "
                    f"give its text with --param {name}=TEXT"
                )
    return out


def _columns(conn: psycopg.Connection[Any], oid: int) -> list[_Column]:
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typcategory, a.attnotnull, "
        "       a.atthasdef, a.attidentity <> '' OR a.attgenerated <> '', a.atttypid "
        "FROM pg_attribute AS a JOIN pg_type AS t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (oid,),
    ).fetchall()
    return [_Column(r[0], r[1], r[2], r[3], r[4], r[5], int(r[6])) for r in rows]


def _key(conn: psycopg.Connection[Any], oid: int, columns: list[_Column], table: str) -> str:
    """The column that names a job: the primary key, or failing a single-column one, a
    single-column unique index, a key-like column of a composite primary key, or id."""
    rows = conn.execute(
        "SELECT i.indisprimary, i.indnkeyatts, a.attname FROM pg_index AS i "
        "JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL "
        "ORDER BY i.indisprimary DESC, i.indnkeyatts, a.attnum",
        (oid,),
    ).fetchall()
    by_name = {c.name: c for c in columns}
    single = [str(r[2]) for r in rows if r[1] == 1]
    composite = [str(r[2]) for r in rows if r[0] and r[1] > 1]
    relname = table.rsplit(".", 1)[-1].strip('"')
    keyish = [c for c in composite if is_key_column(c, relname)]
    choices = single + keyish + (["id"] if "id" in by_name else [])
    if not choices:
        raise ExperimentError(
            f"{table} has no single-column primary key or unique index (nor an id column): "
            "the experiment counts claims by key"
        )
    name = choices[0]
    if by_name[name].type not in _INTEGER_TYPES:
        raise ExperimentError(
            f"{table}.{name} is {by_name[name].type}: the experiment counts integer keys only"
        )
    return name


def _describe(
    conn: psycopg.Connection[Any], text: str, path: str, line: int
) -> tuple[dict[int, tuple[str, str, int]], list[str]]:
    """Ask the server what the statement's parameters are and which columns it returns."""
    res = conn.pgconn.prepare(b"", text.encode())
    if res.status != pq.ExecStatus.COMMAND_OK:
        message = res.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or res.error_message
        raise ExperimentError(
            f"{path}:{line}: the claim does not run on the schema: "
            f"{message.decode('utf-8', 'replace').strip()}"
        )
    desc = conn.pgconn.describe_prepared(b"")
    oids = [desc.param_type(i) for i in range(desc.nparams)]
    outputs = [(desc.fname(i) or b"").decode() for i in range(desc.nfields)]
    rows = conn.execute(
        "SELECT oid, format_type(oid, NULL), typcategory FROM pg_type WHERE oid = ANY(%s)",
        (oids,),
    ).fetchall()
    by_oid = {int(r[0]): (str(r[1]), str(r[2])) for r in rows}
    types = {n + 1: (*by_oid.get(o, ("unknown", "X")), o) for n, o in enumerate(oids)}
    return types, outputs


def _id_column(outputs: list[str], key: str, path: str, line: int) -> str:
    if key in outputs:
        return key
    if len(outputs) == 1:
        return outputs[0]  # RETURNING j.id AS job_id: the only column is the key
    raise ExperimentError(
        f"{path}:{line}: the claim must return the job's key ({key}), e.g. RETURNING {key}"
        + (f"; it returns {', '.join(outputs)}" if outputs else "; it returns nothing")
    )


def _bindings(
    conn: psycopg.Connection[Any],
    plan: ClaimPlan,
    given: Mapping[str, str],
    types: list[dict[int, tuple[str, str, int]]],
    key: str,
) -> list[_Binding]:
    out: list[_Binding] = []
    used: set[str] = set()
    for index, step in enumerate(plan.statements):
        for number, ph in step.placeholders.items():
            type_name, category, oid = types[index].get(number, ("unknown", "X", 0))
            where = f"{ph.written} ({_role_text(ph)})"
            if ph.name in given:
                used.add(ph.name)
                value = given[ph.name]
                note = f"{where} = {value!r} (--param)"
                out.append(_Binding(ph, index, _fixed(value), note, value))
            elif ph.written.startswith(":") and ph.name in plan.psql_vars:
                value = plan.psql_vars[ph.name]
                note = f"{where} = {value!r} (\\set in the file)"
                out.append(_Binding(ph, index, _fixed(value), note, value))
            else:
                out.append(_default(conn, plan, index, ph, key, type_name, category, oid))
    unknown = sorted(set(given) - used - _field_names(plan))
    if unknown:
        known = sorted({ph.name for s in plan.statements for ph in s.placeholders.values()})
        raise ExperimentError(
            f"--param {unknown[0]}: the claim has no such placeholder"
            + (f" (it has {', '.join(known)})" if known else " (it has none)")
        )
    return out


def _field_names(plan: ClaimPlan) -> set[str]:
    return {name for s in plan.statements for name in s.fields.values()}


def _default(
    conn: psycopg.Connection[Any],
    plan: ClaimPlan,
    index: int,
    ph: Placeholder,
    key: str,
    type_name: str,
    category: str,
    oid: int,
) -> _Binding:
    """What a placeholder nobody gave a value for stands for, from where it is and its type."""
    where = f"{ph.written} ({_role_text(ph)})"
    if ph.role == "limit":
        return _Binding(ph, index, lambda ctx, _ids: ctx.limit, f"{where} = the claim's LIMIT")
    if ph.role == "offset":
        return _Binding(ph, index, _fixed("0"), f"{where} = 0", "0")
    if ph.role in ("eq", "any", "in") and ph.column == key and index > 0:
        what = f"the keys statement {index} returned"
        if ph.role == "any":
            return _Binding(ph, index, lambda _ctx, ids: list(ids), f"{where} = {what}")
        n = ph.index
        return _Binding(
            ph,
            index,
            lambda _ctx, ids: ids[n] if n < len(ids) else None,
            f"{where} = " + (f"key #{n + 1} of " if ph.role == "in" else "the first of ") + what,
        )
    if category == "X" or type_name in ("unknown", "text", "character varying", "name"):
        category = "S"
    labels = _enum_labels(conn, oid) if category == "E" else []
    if ph.role == "eq":
        # A value rows must match: made up once, and the seeded rows carry it too.
        made = _made_up(category, type_name, labels)
        if made is None:
            raise _needs_value(plan, index, ph, type_name)
        return _Binding(
            ph, index, _fixed(made), f"{where} = {made!r} (rows are seeded with it)", made
        )
    setting = ph.role == "set"
    if category == "S":
        return _Binding(ph, index, lambda ctx, _ids: ctx.worker, f"{where} = the worker's name")
    if category == "D":
        if setting and type_name.startswith("timestamp"):
            zone = _zone(conn) if type_name == "timestamp without time zone" else None
            return _Binding(ph, index, _lease_end(zone), f"{where} = now() + {_LEASE:.0f} s")
        # PostgreSQL's own 'now': the transaction's start, in the session's time zone, the
        # same clock as the now() that seeded the rows.
        return _Binding(ph, index, _fixed("now"), f"{where} = now()", "now")
    if category == "T":
        text = f"{_LEASE:.0f} seconds"
        return _Binding(ph, index, _fixed(text), f"{where} = {text!r}", text)
    if category == "N":
        text = "1" if setting else f"{_LEASE:.0f}"
        return _Binding(ph, index, _fixed(text), f"{where} = {text}", text)
    if category == "B":
        return _Binding(ph, index, _fixed("true"), f"{where} = true", "true")
    if type_name == "uuid":
        return _Binding(ph, index, lambda _c, _i: str(uuid.uuid4()), f"{where} = a new uuid")
    if type_name in ("json", "jsonb"):
        return _Binding(ph, index, _fixed("{}"), f"{where} = '{{}}'", "{}")
    if category == "E" and labels:
        avoid = {v for v in plan.filters.values() if isinstance(v, str)}
        label = next((x for x in labels if x not in avoid), labels[0])
        return _Binding(ph, index, _fixed(label), f"{where} = {label!r}", label)
    raise _needs_value(plan, index, ph, type_name)


def _needs_value(plan: ClaimPlan, index: int, ph: Placeholder, type_name: str) -> ExperimentError:
    line = plan.statements[index].line
    return ExperimentError(
        f"{plan.path}:{line}: no default for placeholder {ph.written} ({type_name}): "
        f"give one with --param {ph.name}=VALUE"
    )


def _role_text(ph: Placeholder) -> str:
    return {
        "limit": "LIMIT",
        "offset": "OFFSET",
        "eq": f"{ph.column} =",
        "any": f"{ph.column} = ANY",
        "in": f"{ph.column} IN",
        "set": f"SET {ph.column}",
    }.get(ph.role, "in an expression")


def _made_up(category: str, type_name: str, labels: list[str]) -> str | None:
    if category == "S":
        return "default"
    if category == "N":
        return "1"
    if category == "B":
        return "true"
    if category == "D":
        return "2000-01-01"  # read in the session's time zone, for rows and claims alike
    if type_name == "uuid":
        return str(uuid.UUID(int=1))
    if category == "E" and labels:
        return labels[0]
    return None


def _zone(conn: psycopg.Connection[Any]) -> tzinfo:
    """The session's time zone: a timestamp without time zone is wall time there."""
    row = conn.execute("SELECT current_setting('TimeZone')").fetchone()
    try:
        return ZoneInfo(str(row[0])) if row else UTC
    except (ZoneInfoNotFoundError, ValueError):
        return UTC


def _lease_end(zone: tzinfo | None) -> Value:
    def value(ctx: ClaimContext, _ids: Sequence[int]) -> str:
        end = datetime.now(zone or UTC) + timedelta(seconds=ctx.lease)
        return (end.replace(tzinfo=None) if zone is not None else end).isoformat()

    return value


def _enum_labels(conn: psycopg.Connection[Any], oid: int) -> list[str]:
    rows = conn.execute(
        "SELECT enumlabel FROM pg_enum WHERE enumtypid = %s ORDER BY enumsortorder", (oid,)
    ).fetchall()
    return [str(r[0]) for r in rows]


# -- seeding ----------------------------------------------------------------------------------


def _seed_values(
    conn: psycopg.Connection[Any], prepared: _Prepared
) -> list[tuple[str, sql.Composable, str]]:
    """(column, expression over g, why) for the columns a generated row must set."""
    plan = prepared.plan
    out: list[tuple[str, sql.Composable, str]] = []
    for col in prepared.columns:
        if col.automatic:
            continue
        cast = sql.SQL(col.type)  # format_type()'s output: the server's own spelling
        wanted = plan.filters.get(col.name) if col.name != prepared.key else None
        if isinstance(wanted, ParamValue):
            binding = next(
                (
                    b
                    for b in prepared.bindings
                    if b.step == wanted.step and b.placeholder.number == wanted.number
                ),
                None,
            )
            wanted = binding.fixed if binding is not None else None
        if wanted is not None:
            literal = sql.Literal(str(wanted).lower() if isinstance(wanted, bool) else wanted)
            out.append((col.name, sql.SQL("{}::{}").format(literal, cast), "the claim's condition"))
        elif col.not_null and not col.has_default:
            expr = _filler(conn, col)
            if expr is None:
                raise ExperimentError(
                    f"cannot make up a value for {prepared.table}.{col.name} ({col.type}, "
                    "NOT NULL without a default): give a --seed script"
                )
            out.append((col.name, sql.SQL("({})::{}").format(expr, cast), "NOT NULL, no default"))
    return out


def _filler(conn: psycopg.Connection[Any], col: _Column) -> sql.Composable | None:
    if col.category == "N":
        return sql.SQL("g")
    if col.category == "S":
        return sql.SQL("'seed-' || g")
    if col.category == "B":
        return sql.SQL("false")
    if col.category == "D":
        return sql.SQL("now()")
    if col.category == "T":
        return sql.SQL("interval '0'")
    if col.category == "A":
        return sql.SQL("'{}'")
    if col.type == "uuid":
        return sql.SQL("gen_random_uuid()")
    if col.type in ("json", "jsonb"):
        return sql.SQL("jsonb_build_object('seed', g)")
    if col.category == "E":
        labels = _enum_labels(conn, col.type_oid)
        return sql.Literal(labels[0]) if labels else None
    return None


def _seed(
    conn: psycopg.Connection[Any], prepared: _Prepared, rows: int, script: _Script | None
) -> int:
    """Fill the claim's table; returns how many rows it holds."""
    table = sql.SQL(prepared.table)
    with conn.transaction():
        if script is not None:
            script.run(conn, {"jobs": str(rows)})
        else:
            cols = [sql.Identifier(name) for name, _, _ in prepared.seed_values]
            exprs = [expr for _, expr, _ in prepared.seed_values]
            try:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {t} {cols} SELECT {exprs} "
                        "FROM generate_series(1, {n}) AS g ORDER BY g"
                    ).format(
                        t=table,
                        cols=sql.SQL("({})").format(sql.SQL(", ").join(cols))
                        if cols
                        else sql.SQL(""),
                        exprs=sql.SQL(", ").join(exprs),
                        n=sql.Literal(rows),
                    )
                )
            except psycopg.Error as exc:
                raise ExperimentError(
                    f"seeding {prepared.table} failed ({_message(exc)}): give a --seed script"
                ) from None
    conn.execute(sql.SQL("ANALYZE {}").format(table))
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    count = int(row[0]) if row else 0
    if count == 0:
        raise ExperimentError(f"the seed left {prepared.table} empty: nothing to claim")
    return count


# -- the runs ---------------------------------------------------------------------------------


@dataclass
class ExperimentResult:
    """What the experiment found; ``format()`` for people, ``to_dict()`` for JSON."""

    claim_path: str
    plan: ClaimPlan
    table: str
    key: str
    scratch: str
    server: str
    parameters: list[str]
    seed: list[str]
    static: AuditResult
    timeline: Timeline
    other_replays: list[Timeline] = field(default_factory=list)
    load: RaceResult | None = None
    load_note: str | None = None
    fail_on: str = "info"

    @property
    def raced(self) -> bool:
        """A row was claimed twice, under load or in the replay."""
        doubled = self.load is not None and self.load.double_claims > 0
        return doubled or bool(self.timeline.double_claimed)

    @property
    def exit_code(self) -> int:
        if self.static.problems:
            return 2
        return 1 if self.raced or self.static.exit_code(self.fail_on) == 1 else 0

    def _claim_text(self) -> str:
        steps = ", then ".join(f"{s.kind} at line {s.line}" for s in self.plan.statements)
        unit = f" in {self.plan.unit}" if self.plan.unit != self.plan.path else ""
        return f"{steps}{unit}, claiming rows of {self.table} (key {self.key})"

    def format(self, *, fixes: bool = True) -> str:
        lines = [f"skiplock audit experiment: {self.claim_path}"]
        lines.append(f"  claim     {self._claim_text()}")
        for i, p in enumerate(self.parameters or ["(no placeholders)"]):
            lines.append(f"  {'params' if i == 0 else '':<9} {p}")
        lines.append(f"  scratch   {self.scratch}, dropped afterwards")
        lines.append(f"  server    {self.server}")
        for i, s in enumerate(self.seed):
            lines.append(f"  {'seed' if i == 0 else '':<9} {s}")
        lines += ["", "static analysis"]
        lines += ["  " + ln for ln in render_text(self.static, fixes=fixes).splitlines()]
        lines.append("")
        if self.load is None:
            lines.append(f"load: skipped: {self.load_note}")
        else:
            lines += _load_lines(self.load)
        lines += ["", "replay: two sessions step by step; pg_blocking_pids shows who waits"]
        lines += ["  " + ln for ln in self.timeline.format().splitlines()]
        for other in self.other_replays:
            verdict = (
                f"both hold {', '.join(map(str, other.double_claimed))}"
                if other.double_claimed
                else "disjoint"
            )
            lines.append(f"  also replayed, schedule {other.schedule!r}: {verdict}")
        lines += ["", self._verdict()]
        return "\n".join(lines)

    def _verdict(self) -> str:
        if not self.raced:
            return (
                "no race observed: no row was claimed twice under load, and in the replay "
                "the two sessions hold disjoint sets"
            )
        parts = []
        if self.load is not None and self.load.double_claims:
            parts.append(
                f"{self.load.double_claims} double claims of {self.load.duplicate_jobs} rows "
                f"under load"
            )
        if self.timeline.double_claimed:
            ids = ", ".join(map(str, self.timeline.double_claimed))
            parts.append(f"in the replay A and B both hold {ids}")
        return "RACE: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "claim": {
                "path": self.claim_path,
                "unit": self.plan.unit,
                "statements": [{"line": s.line, "kind": s.kind} for s in self.plan.statements],
                "table": self.table,
                "key": self.key,
                "parameters": self.parameters,
            },
            "scratch": self.scratch,
            "seed": self.seed,
            "static": json.loads(render_json(self.static)),
            "load": self.load.to_dict() if self.load is not None else None,
            "load_skipped": self.load_note,
            "replay": self.timeline.to_dict(),
            "other_replays": [t.to_dict() for t in self.other_replays],
            "race": self.raced,
            "exit_code": self.exit_code,
        }


def _load_lines(r: RaceResult) -> list[str]:
    waits = ", ".join(f"{ev} {share:.0%}" for ev, share in r.lock_waits_by_event.items())
    sample = ", ".join(map(str, r.duplicate_ids[:10]))
    more = ", ..." if r.duplicate_jobs > 10 else ""
    rows = [
        f"load: {r.workers} workers, each with its own connection, claim until nothing is left",
        f"  rows              {r.jobs}",
        f"  claims            {r.claims} rows returned by {r.claim_calls} claim statements",
        f"  double-claimed    {r.duplicate_jobs} ids returned by more than one claim"
        + (f": {sample}{more}" if sample else ""),
        f"  duplicate rows    {r.double_claims} rows handed out again after an earlier claim",
        f"  unclaimed rows    {r.unclaimed_jobs}",
        f"  throughput        {r.throughput:,.0f} rows/s ({r.seconds:.2f} s)",
        f"  lock-wait share   {r.lock_wait_share:.0%} of worker samples waiting on a lock"
        + (f" ({waits})" if waits else ""),
    ]
    if r.reclaims:
        rows.append(
            f"  re-claims         {r.reclaims} rows a worker got back that it had claimed "
            "itself (nothing completes them here; not double claims)"
        )
    if r.deadlocks or r.serialization_retries:
        rows.append(
            f"  retried           {r.deadlocks} deadlocks, "
            f"{r.serialization_retries} serialization failures"
        )
    return rows


@contextmanager
def _scratch_with(
    dsn: str, database: bool, ddl: _Script
) -> Iterator[tuple[_Scratch, psycopg.Connection[Any]]]:
    with _Scratch(dsn, database) as scratch, scratch.connect() as conn:
        ddl.run(conn)
        yield scratch, conn


Pending = Callable[[psycopg.Connection[Any]], bool]


def _progress() -> Callable[[list[int]], bool]:
    """Per worker: stop once its claims have handed back only rows it already had, for a
    while (a claim that gives a worker its own rows again, as delayed_job's does)."""
    seen: set[int] = set()
    state = {"since": time.monotonic()}

    def claimed(ids: list[int]) -> bool:
        now = time.monotonic()
        if not seen.issuperset(ids):
            seen.update(ids)
            state["since"] = now
            return True
        return now - state["since"] < _STALL

    return claimed


def _pending(table: str, xmins: list[str]) -> Callable[[], Pending]:
    """Per worker: are seeded rows left that no claim has touched yet?

    A row a claim updated has a new xmin, one it deleted is gone: the rows still carrying
    a seed transaction's xmin are the ones no claim took.  If their number stops falling
    for a while, the claim cannot take them (they do not match it) and the worker stops.
    """
    query = sql.SQL("SELECT count(*) FROM {} WHERE xmin::text = ANY({})").format(
        sql.SQL(table), sql.Literal(xmins)
    )

    def make() -> Pending:
        state = {"left": -1, "since": time.monotonic()}

        def pending(conn: psycopg.Connection[Any]) -> bool:
            row = conn.execute(query).fetchone()
            left = int(row[0]) if row else 0
            now = time.monotonic()
            if left == 0:
                return False
            if state["left"] < 0 or left < state["left"]:
                state["left"], state["since"] = left, now
                return True
            return now - state["since"] < _STALL

        return pending

    return make


def run_experiment(
    dsn: str,
    schema_path: str | Path,
    claim_path: str | Path,
    *,
    seed_path: str | Path | None = None,
    workers: int = 8,
    jobs: int = 5000,
    params: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    load: bool = True,
    fail_on: str = "info",
    progress: Callable[[str], None] | None = None,
) -> ExperimentResult:
    """Run the user's claim concurrently against their schema, in scratch space.

    Parameters
    ----------
    dsn
        The server.  A scratch schema (or database) is created there and dropped.
    schema_path
        The user's DDL.
    claim_path
        The claim: a .sql file or a Python file, read as ``skiplock audit`` reads them.
    seed_path
        A script that fills the tables instead of the generated rows; ``:jobs`` in it is
        the number of rows wanted.
    workers, jobs
        The load: concurrent workers (threads, each with its own connection) and rows.
    params
        Values for placeholders, by name (``worker``) or number (``1``).
    timeout
        Seconds the load may take before it is called off.
    load
        Run the load (else only the replays).
    fail_on
        Lowest severity of a static finding that makes the exit code 1.
    progress
        Called with a line now and then (the command prints them on stderr).

    Returns
    -------
    ExperimentResult

    Raises
    ------
    ExperimentError
        Input that cannot be run, or a server that cannot be reached: one line.
    """
    say = progress or (lambda _line: None)
    ddl = _Script.read(schema_path)
    plan = parse_claim(claim_path)
    seed = _Script.read(seed_path) if seed_path is not None else None
    static = audit_paths([claim_path])
    reason = ddl.needs_database() or (seed.needs_database() if seed else None)
    if reason is None and plan.qualified:
        reason = f"{claim_path} names {_qualified_names(plan.statements[0].tree)[0]}"
    try:
        return _run(
            dsn, ddl, plan, seed, static, reason, workers, jobs, params or {}, timeout, load,
            fail_on, say,
        )  # fmt: skip
    except psycopg.OperationalError as exc:
        raise ExperimentError(f"cannot use {redact_dsn(dsn)}: {_message(exc)}") from None
    except psycopg.Error as exc:
        raise ExperimentError(_message(exc)) from None
    except (RaceError, StepError) as exc:
        raise ExperimentError(str(exc)) from None


def _run(
    dsn: str,
    ddl: _Script,
    plan: ClaimPlan,
    seed: _Script | None,
    static: AuditResult,
    reason: str | None,
    workers: int,
    jobs: int,
    params: Mapping[str, str],
    timeout: float,
    load: bool,
    fail_on: str,
    say: Callable[[str], None],
) -> ExperimentResult:
    database = reason is not None
    result: RaceResult | None = None
    note: str | None = None
    timelines: list[Timeline] = []
    with _scratch_with(dsn, database, ddl) as (scratch, conn):
        first_scratch = scratch.name
        prepared = _prepare(conn, plan, params, scratch)
        if plan.read_only:
            note = (
                "the claim writes nothing, so a committed claim leaves its rows claimable "
                "(a hold-lock claim needs the statement that ends the job in the same file)"
            )
        elif not load:
            note = "not asked for"
        else:
            say(f"load: {workers} workers on {jobs} rows of {prepared.table}")
            result = _load(scratch, conn, prepared, seed, workers, jobs, timeout)
        if result is None:
            # Nothing ran in this scratch copy yet: the first replay can use it.
            say("replay: schedule 'A first'")
            timelines.append(_replay(scratch, conn, prepared, seed, "A first"))
    for schedule in SCHEDULES:
        if any(t.double_claimed for t in timelines) or any(
            t.schedule == schedule for t in timelines
        ):
            continue
        say(f"replay: schedule {schedule!r}")
        with _scratch_with(dsn, database, ddl) as (scratch, conn):
            timelines.append(_replay(scratch, conn, prepared, seed, schedule))
    shown = next((t for t in timelines if t.double_claimed), timelines[0])
    where = (
        f"database {first_scratch} (because {reason})"
        if database
        else f"schema {first_scratch} (search_path set to it on every connection)"
    )
    return ExperimentResult(
        claim_path=plan.path,
        plan=plan,
        table=prepared.table,
        key=prepared.key,
        scratch=where,
        server=redact_dsn(dsn),
        parameters=[b.note for b in prepared.bindings],
        seed=_seed_text(prepared, seed),
        static=static,
        timeline=shown,
        other_replays=[t for t in timelines if t is not shown],
        load=result,
        load_note=note,
        fail_on=fail_on,
    )


def _load(
    scratch: _Scratch,
    conn: psycopg.Connection[Any],
    prepared: _Prepared,
    seed: _Script | None,
    workers: int,
    jobs: int,
    timeout: float,
) -> RaceResult:
    """W workers, each with its own connection, claim until no seeded row is left."""
    rows = _seed(conn, prepared, jobs, seed)
    xmins = conn.execute(
        sql.SQL("SELECT array_agg(DISTINCT xmin::text) FROM {}").format(sql.SQL(prepared.table))
    ).fetchone()
    return race_prepared(
        scratch.dsn,
        prepared.strategy(),
        jobs=rows,
        pending=_pending(prepared.table, list(xmins[0] if xmins and xmins[0] else [])),
        claimed=_progress,
        workers=workers,
        batch=prepared.limit,
        schema=scratch.name,
        application_name=f"{scratch.app}:w",
        timeout=timeout,
    )


def _replay(
    scratch: _Scratch,
    conn: psycopg.Connection[Any],
    prepared: _Prepared,
    seed: _Script | None,
    schedule: str,
) -> Timeline:
    """Two sessions claim step by step on freshly seeded rows (see skiplock.lab.replay)."""
    rows = _seed(conn, prepared, max(10, 3 * prepared.limit), seed)
    return replay_prepared(
        scratch.dsn,
        prepared.strategy(),
        schema=scratch.name,
        jobs=rows,
        limit=prepared.limit,
        application_name=f"{scratch.app}:replay",
        hold=_hold(conn, prepared) if schedule == "B held" else None,
        released_at_commit=prepared.plan.read_only,
    )


def _hold(conn: psycopg.Connection[Any], prepared: _Prepared) -> sql.Composed:
    """H's statement in the held schedule: a row lock on the first seeded row."""
    key = sql.Identifier(prepared.key)
    row = conn.execute(
        sql.SQL("SELECT min({}) FROM {}").format(key, sql.SQL(prepared.table))
    ).fetchone()
    first = row[0] if row else None
    return sql.SQL("SELECT {k} FROM {t} WHERE {k} = {v} FOR UPDATE").format(
        k=key, t=sql.SQL(prepared.table), v=sql.Literal(first)
    )


def _seed_text(prepared: _Prepared, seed: _Script | None) -> list[str]:
    if seed is not None:
        return [f"{seed.path} (:jobs = the rows wanted)"]
    if not prepared.seed_values:
        return [f"INSERT INTO {prepared.table} DEFAULT VALUES, once per row"]
    out = [f"INSERT INTO {prepared.table}, g = 1..rows, every other column at its default:"]
    for name, expr, why in prepared.seed_values:
        out.append(f"  {name} = {expr.as_string(None)}  ({why})")
    return out
