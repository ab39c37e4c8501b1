"""The experiment's claim, prepared against the user's schema: its table, key and bindings.

Types come from the server (PREPARE on the scratch copy), never guessed from the text;
each placeholder nobody gave a value for gets one from where it stands and its type.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from psycopg import pq, sql

from skiplock.lab import ClaimContext, ClaimStep, Strategy

from ._claim import (
    ClaimPlan,
    ClaimStatement,
    ExperimentError,
    ParamValue,
    Placeholder,
    render,
    returning_clause,
)
from ._exp_scratch import Scratch
from ._lexer import FORMAT_PREFIX
from ._model import is_key_column

__all__ = ["Prepared", "prepare"]

Value = Callable[[ClaimContext, Sequence[int]], Any]

_LEASE = 300.0  # seconds: the lease a made-up "locked until" gets
_INTEGER_TYPES = {"smallint", "integer", "bigint"}


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    category: str
    not_null: bool
    has_default: bool
    automatic: bool  # identity or generated: never given a value
    type_oid: int


@dataclass
class Binding:
    placeholder: Placeholder
    step: int
    value: Value
    note: str
    # A value fixed for the whole run, so seeded rows can carry it (``queue = $1``).
    fixed: str | None = None


@dataclass
class Prepared:
    """The claim ready to run on any scratch made from the same DDL."""

    plan: ClaimPlan
    table: str  # as the server prints it (regclass), safe to splice
    key: str
    columns: list[Column]
    steps: list[tuple[ClaimStatement, str, str]]  # statement, PREPARE text, psycopg text
    id_columns: list[str]
    bindings: list[Binding]
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


def _binder(bindings: list[Binding]) -> Callable[[ClaimContext, Sequence[int]], Mapping[str, Any]]:
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


def prepare(
    conn: psycopg.Connection[Any], plan: ClaimPlan, params: Mapping[str, str], scratch: Scratch
) -> Prepared:
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
    prepared = Prepared(plan, table, key, columns, steps, id_columns, [], 10)
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


def _fields(plan: ClaimPlan, given: Mapping[str, str], scratch: Scratch) -> dict[str, str]:
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


def _columns(conn: psycopg.Connection[Any], oid: int) -> list[Column]:
    rows = conn.execute(
        "SELECT a.attname, format_type(a.atttypid, a.atttypmod), t.typcategory, a.attnotnull, "
        "       a.atthasdef, a.attidentity <> '' OR a.attgenerated <> '', a.atttypid "
        "FROM pg_attribute AS a JOIN pg_type AS t ON t.oid = a.atttypid "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (oid,),
    ).fetchall()
    return [Column(r[0], r[1], r[2], r[3], r[4], r[5], int(r[6])) for r in rows]


def _key(conn: psycopg.Connection[Any], oid: int, columns: list[Column], table: str) -> str:
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
) -> list[Binding]:
    out: list[Binding] = []
    used: set[str] = set()
    for index, step in enumerate(plan.statements):
        for number, ph in step.placeholders.items():
            type_name, category, oid = types[index].get(number, ("unknown", "X", 0))
            where = f"{ph.written} ({_role_text(ph)})"
            if ph.name in given:
                used.add(ph.name)
                value = given[ph.name]
                note = f"{where} = {value!r} (--param)"
                out.append(Binding(ph, index, _fixed(value), note, value))
            elif ph.written.startswith(":") and ph.name in plan.psql_vars:
                value = plan.psql_vars[ph.name]
                note = f"{where} = {value!r} (\\set in the file)"
                out.append(Binding(ph, index, _fixed(value), note, value))
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
) -> Binding:
    """What a placeholder nobody gave a value for stands for, from where it is and its type."""
    where = f"{ph.written} ({_role_text(ph)})"
    if ph.role == "limit":
        return Binding(ph, index, lambda ctx, _ids: ctx.limit, f"{where} = the claim's LIMIT")
    if ph.role == "offset":
        return Binding(ph, index, _fixed("0"), f"{where} = 0", "0")
    if ph.role in ("eq", "any", "in") and ph.column == key and index > 0:
        what = f"the keys statement {index} returned"
        if ph.role == "any":
            return Binding(ph, index, lambda _ctx, ids: list(ids), f"{where} = {what}")
        n = ph.index
        return Binding(
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
        return Binding(
            ph, index, _fixed(made), f"{where} = {made!r} (rows are seeded with it)", made
        )
    setting = ph.role == "set"
    if category == "S":
        return Binding(ph, index, lambda ctx, _ids: ctx.worker, f"{where} = the worker's name")
    if category == "D":
        if setting and type_name.startswith("timestamp"):
            zone = _zone(conn) if type_name == "timestamp without time zone" else None
            return Binding(ph, index, _lease_end(zone), f"{where} = now() + {_LEASE:.0f} s")
        # PostgreSQL's own 'now': the transaction's start, in the session's time zone, the
        # same clock as the now() that seeded the rows.
        return Binding(ph, index, _fixed("now"), f"{where} = now()", "now")
    if category == "T":
        text = f"{_LEASE:.0f} seconds"
        return Binding(ph, index, _fixed(text), f"{where} = {text!r}", text)
    if category == "N":
        text = "1" if setting else f"{_LEASE:.0f}"
        return Binding(ph, index, _fixed(text), f"{where} = {text}", text)
    if category == "B":
        return Binding(ph, index, _fixed("true"), f"{where} = true", "true")
    if type_name == "uuid":
        return Binding(ph, index, lambda _c, _i: str(uuid.uuid4()), f"{where} = a new uuid")
    if type_name in ("json", "jsonb"):
        return Binding(ph, index, _fixed("{}"), f"{where} = '{{}}'", "{}")
    if category == "E" and labels:
        avoid = {v for v in plan.filters.values() if isinstance(v, str)}
        label = next((x for x in labels if x not in avoid), labels[0])
        return Binding(ph, index, _fixed(label), f"{where} = {label!r}", label)
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


def _seed_values(
    conn: psycopg.Connection[Any], prepared: Prepared
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


# A generated row's value for a NOT NULL column without a default, by pg_type.typcategory
# (g is the row's number in generate_series), then by type name.
_FILL_BY_CATEGORY = {
    "N": "g",
    "S": "'seed-' || g",
    "B": "false",
    "D": "now()",
    "T": "interval '0'",
    "A": "'{}'",
}
_FILL_BY_TYPE = {
    "uuid": "gen_random_uuid()",
    "json": "jsonb_build_object('seed', g)",
    "jsonb": "jsonb_build_object('seed', g)",
}


def _filler(conn: psycopg.Connection[Any], col: Column) -> sql.Composable | None:
    text = _FILL_BY_CATEGORY.get(col.category) or _FILL_BY_TYPE.get(col.type)
    if text is not None:
        return sql.SQL(text)
    if col.category == "E":
        labels = _enum_labels(conn, col.type_oid)
        return sql.Literal(labels[0]) if labels else None
    return None
