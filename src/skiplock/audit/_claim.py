"""The user's claim file read for the experiment: which statements claim, on which table, with what.

The experiment must run exactly what the user wrote, so this reads the file with the
audit's own parser (pglast via ``_engine.Statement``), picks the claim out of it (a
completion or sweeper next to it is not part of the claim), works out what each
placeholder stands for, and renders each statement for psycopg with named parameters.
Nothing here touches a database; ``_experiment`` asks the server for types and keys.

Which statements are the claim:

* the first UPDATE or DELETE (a data-modifying CTE counts) that does not name its rows
  by key: a claim picks rows, a completion is told which;
* or the first SELECT that picks rows (LIMIT, min()/max()) or row-locks them, followed,
  if the next statement is an UPDATE or DELETE of that table by key, by that statement
  (the two-step claim; or the end of a hold-lock job, which runs in the same
  transaction).  The keys the SELECT returned are bound to that statement.

Transaction control (BEGIN, COMMIT) is left out: the lab opens and commits the claim's
transaction itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pglast import ast, enums

from skiplock import SkiplockError

from ._engine import Statement
from ._extract import extract_file
from ._lexer import FORMAT_PREFIX, split_statements, tokenize
from ._model import SelectFacts, StatementFacts, pick_of, statement_facts, walk
from ._source import Extracted, SqlText

__all__ = [
    "ClaimPlan",
    "ClaimStatement",
    "ExperimentError",
    "ParamValue",
    "Placeholder",
    "parse_claim",
    "placeholder_name",
    "read_script",
    "render",
    "returning_clause",
    "statements_of",
]

Node = Any


class ExperimentError(SkiplockError):
    """The experiment cannot run: unreadable input, or a claim it cannot make sense of."""


@dataclass
class Placeholder:
    """One placeholder of a statement, as the parser numbered it (``$n``).

    ``role`` is where it stands: ``limit`` / ``offset`` (of a SELECT), ``eq`` (compared
    with ``column``), ``any`` (``column = ANY($n)``), ``in`` (item ``index`` of
    ``column IN (...)``), ``set`` (assigned to ``column``) or ``other``.
    """

    number: int
    name: str
    written: str
    role: str = "other"
    column: str | None = None
    index: int = 0


@dataclass
class ClaimStatement:
    """One statement of the claim, parsed."""

    stmt: Statement
    tree: Node
    facts: StatementFacts
    line: int
    placeholders: dict[int, Placeholder]
    # Format-field stand-ins (``_fmt_table``) and the field names the user wrote.
    fields: dict[str, str]
    writes: bool
    # An UPDATE/DELETE without RETURNING: the experiment appends one to see its rows.
    target: ast.RangeVar | None = None

    @property
    def text(self) -> str:
        return self.stmt.norm.text

    @property
    def kind(self) -> str:
        return type(self.tree).__name__.removesuffix("Stmt").upper()


@dataclass
class ClaimPlan:
    """The claim's statements, the table it claims from, and what its conditions ask for."""

    path: str
    unit: str
    statements: list[ClaimStatement]
    table: str
    table_schema: str | None
    # psql ``\\set name value`` lines of the file: values for ``:name`` placeholders.
    psql_vars: dict[str, str] = field(default_factory=dict)
    # column -> a constant the claim compares it with (``status = 'pending'``) or a
    # placeholder number (``queue = $1``): what a seeded row needs to be claimable.
    filters: dict[str, object] = field(default_factory=dict)

    @property
    def read_only(self) -> bool:
        """The claim writes nothing: it holds its rows only while its transaction is open."""
        return not any(s.writes for s in self.statements)

    @property
    def qualified(self) -> bool:
        """The claim names a schema, so it cannot be pointed at a scratch schema."""
        return any(_qualified_names(s.tree) for s in self.statements)

    def limit(self) -> int | Placeholder | None:
        """The first statement's LIMIT: a number, the placeholder standing for it, or None."""
        first = self.statements[0]
        for node in walk(first.tree):
            if isinstance(node, ast.SelectStmt) and node.limitCount is not None:
                count = _unwrap(node.limitCount)
                if isinstance(count, ast.A_Const) and isinstance(count.val, ast.Integer):
                    return int(count.val.ival or 0)
                if isinstance(count, ast.ParamRef):
                    return first.placeholders.get(int(count.number or 0))
        return None


def read_script(path: str | Path) -> Extracted:
    """A .sql (or .py) file as the audit reads it; unreadable input is an ExperimentError."""
    p = Path(path)
    if not p.is_file():
        raise ExperimentError(f"{path}: no such file")
    extracted = extract_file(p, str(path))
    if extracted.problems:
        prob = extracted.problems[0]
        raise ExperimentError(f"{prob.path}:{prob.line}:{prob.column}: {prob.message}")
    return extracted


def statements_of(sql: SqlText) -> Iterator[tuple[Statement, Node]]:
    """Every statement of a text, parsed; the first that does not parse is an error."""
    for chunk in split_statements(sql.text):
        stmt = Statement(sql, chunk)
        if stmt.error is not None:
            offset, message = stmt.error
            line, column = stmt.position(offset)
            raise ExperimentError(f"{sql.path}:{line}:{column}: could not parse SQL: {message}")
        for tree in stmt.trees:
            yield stmt, tree


def parse_claim(path: str | Path) -> ClaimPlan:
    """Find the claim in a .sql or .py file.

    Raises
    ------
    ExperimentError
        Unreadable or unparsable input, or no statement that claims rows.
    """
    extracted = read_script(path)
    for unit in extracted.units:
        parsed = [
            (stmt, tree)
            for sql in unit.texts
            for stmt, tree in statements_of(sql)
            if not isinstance(tree, ast.TransactionStmt)
        ]
        plan = _claim_in(str(path), unit.name, parsed)
        if plan is not None:
            plan.psql_vars = _psql_vars(unit.texts)
            return plan
    raise ExperimentError(
        f"{path}: no claim found: no UPDATE or DELETE that picks its rows, and no SELECT "
        "with LIMIT or FOR UPDATE"
    )


def _claim_in(path: str, unit: str, parsed: list[tuple[Statement, Node]]) -> ClaimPlan | None:
    for i, (stmt, tree) in enumerate(parsed):
        facts = statement_facts(tree)
        writes = [d for d in facts.dmls if d.keyed is None]
        if writes:
            rel = writes[0].target
            steps = [_statement(stmt, tree, facts)]
            return _plan(path, unit, steps, rel.relname or "", rel.schemaname)
        table = _picked_table(tree, facts)
        if table is None:
            continue
        steps = [_statement(stmt, tree, facts)]
        if i + 1 < len(parsed):
            nxt_stmt, nxt_tree = parsed[i + 1]
            nxt_facts = statement_facts(nxt_tree)
            if any(
                d.keyed is not None and d.target.relname == table.relname for d in nxt_facts.dmls
            ):
                steps.append(_statement(nxt_stmt, nxt_tree, nxt_facts))
        return _plan(path, unit, steps, str(table.relname), table.schemaname)
    return None


def _picked_table(tree: Node, facts: StatementFacts) -> ast.RangeVar | None:
    """The table a plain SELECT takes candidates from, when it picks or row-locks some."""
    top = facts.top_select
    if not isinstance(tree, ast.SelectStmt) or top is None or top.keyed() is not None:
        return None
    picks = any(
        pick_of(sf.node, sf.rels) is not None or bool(sf.node.lockingClause) for sf in facts.selects
    )
    if not picks:
        return None  # a count or a report, not a claim
    for sf in facts.selects:  # the statement itself first, then its CTEs and subqueries
        for rel in sf.rels:
            if rel.kind == "table" and isinstance(rel.node, ast.RangeVar):
                return rel.node
    return None


def _plan(
    path: str, unit: str, steps: list[ClaimStatement], table: str, schema: str | None
) -> ClaimPlan:
    plan = ClaimPlan(path, unit, steps, table, schema)
    for index, step in enumerate(steps):
        for column, value in _filters(step, table).items():
            if isinstance(value, ParamValue):
                value = ParamValue(index, value.number)
            plan.filters.setdefault(column, value)
    return plan


def _statement(stmt: Statement, tree: Node, facts: StatementFacts) -> ClaimStatement:
    line, _ = stmt.position(stmt.first_offset())
    target = None
    if isinstance(tree, ast.UpdateStmt | ast.DeleteStmt) and tree.returningClause is None:
        target = tree.relation
    return ClaimStatement(
        stmt=stmt,
        tree=tree,
        facts=facts,
        line=line,
        placeholders=_placeholders(stmt, tree),
        fields={
            repl: placeholder_name(orig)
            for repl, orig in stmt.norm.replaced
            if repl.startswith(FORMAT_PREFIX)
        },
        writes=bool(facts.dmls) or isinstance(tree, ast.InsertStmt),
        target=target,
    )


# -- placeholders -----------------------------------------------------------------------------


def placeholder_name(written: str, number: int = 0) -> str:
    """What --param calls a placeholder: its name, or its number when it has none."""
    if written.startswith("%(") and written.endswith(")s"):
        return written[2:-2]
    if written.startswith(":"):
        return written.strip(":'\"")
    if written.startswith("{") and written.endswith("}"):
        return written[1:-1].strip()
    return str(number)


def _unwrap(node: Node) -> Node:
    while isinstance(node, ast.TypeCast):
        node = node.arg
    return node


def _param(node: Node) -> int | None:
    node = _unwrap(node)
    return int(node.number or 0) if isinstance(node, ast.ParamRef) else None


def _column(node: Node) -> str | None:
    node = _unwrap(node)
    if isinstance(node, ast.ColumnRef) and node.fields and isinstance(node.fields[-1], ast.String):
        return str(node.fields[-1].sval)
    return None


def _op(node: ast.A_Expr) -> str:
    names = node.name or ()
    last = names[-1] if names else None
    return str(last.sval) if isinstance(last, ast.String) else ""


def _placeholders(stmt: Statement, tree: Node) -> dict[int, Placeholder]:
    written = {int(r[1:]): orig for r, orig in stmt.norm.replaced if r.startswith("$")}
    found: dict[int, Placeholder] = {}

    def note(node: Node, role: str, column: str | None = None, index: int = 0) -> None:
        n = _param(node)
        if n is not None and n not in found:
            text = written.get(n, f"${n}")
            found[n] = Placeholder(n, placeholder_name(text, n), text, role, column, index)

    for node in walk(tree):
        if isinstance(node, ast.SelectStmt):
            note(node.limitCount, "limit")
            note(node.limitOffset, "offset")
        elif isinstance(node, ast.UpdateStmt):
            for target in node.targetList or ():
                if isinstance(target, ast.ResTarget):
                    note(target.val, "set", target.name)
        elif isinstance(node, ast.A_Expr) and _op(node) == "=":
            if node.kind == enums.A_Expr_Kind.AEXPR_OP:
                for col_side, other in ((node.lexpr, node.rexpr), (node.rexpr, node.lexpr)):
                    column = _column(col_side)
                    if column is not None:
                        note(other, "eq", column)
            elif node.kind == enums.A_Expr_Kind.AEXPR_OP_ANY:
                column = _column(node.lexpr)
                if column is not None:
                    note(node.rexpr, "any", column)
            elif node.kind == enums.A_Expr_Kind.AEXPR_IN and isinstance(node.rexpr, tuple | list):
                column = _column(node.lexpr)
                if column is not None:
                    for i, item in enumerate(node.rexpr):
                        note(item, "in", column, i)
    for node in walk(tree):
        if isinstance(node, ast.ParamRef):
            note(node, "other")
    return dict(sorted(found.items()))


def _psql_vars(texts: list[SqlText]) -> dict[str, str]:
    r"""psql ``\set name value`` lines: psql substitutes them for ``:name`` and ``:'name'``."""
    out: dict[str, str] = {}
    for sql in texts:
        for tok in tokenize(sql.text):
            if tok.kind != "meta":
                continue
            parts = tok.text.split(None, 2)
            if len(parts) >= 2 and parts[0] == "\\set":
                value = parts[2].strip() if len(parts) == 3 else ""
                if len(value) >= 2 and value[0] == value[-1] == "'":
                    value = value[1:-1].replace("''", "'")
                out[parts[1]] = value
    return out


# -- what a seeded row must look like ---------------------------------------------------------


def _filters(step: ClaimStatement, table: str) -> dict[str, object]:
    """Columns of ``table`` the claim tests against a value: what makes a row claimable."""
    out: dict[str, object] = {}
    conditions: list[tuple[str, Node, Node]] = []
    for sf in step.facts.selects:
        for rel in sf.rels:
            if rel.kind == "table" and rel.relname == table:
                conditions += sf.refs_to(rel)
    for d in step.facts.dmls:
        rels = [d.target, *d.from_rels]
        own = SelectFacts(d.node, rels, d.own_conds, [rels])
        for rel in rels:
            # The target, or a joined copy of it (UPDATE jobs ... FROM jobs AS candidate).
            if rel.kind == "table" and rel.relname == table:
                conditions += own.refs_to(rel)
    for column, ref, conj in conditions:
        value = _required(conj, ref)
        if value is not None:
            out.setdefault(column, value)
    return out


def _required(conj: Node, ref: Node) -> object | None:
    """The value ``conj`` asks of the column ``ref``: a constant, a placeholder, a boolean."""
    if conj is ref:
        return True  # WHERE ready
    if isinstance(conj, ast.BoolExpr) and conj.boolop == enums.BoolExprType.NOT_EXPR:
        args = conj.args or ()
        return False if len(args) == 1 and args[0] is ref else None
    if not isinstance(conj, ast.A_Expr) or _op(conj) != "=":
        return None
    if conj.kind == enums.A_Expr_Kind.AEXPR_OP:
        if _unwrap(conj.lexpr) is ref:
            return _value(conj.rexpr)
        if _unwrap(conj.rexpr) is ref:
            return _value(conj.lexpr)
    if conj.kind == enums.A_Expr_Kind.AEXPR_IN and _unwrap(conj.lexpr) is ref:
        items = conj.rexpr if isinstance(conj.rexpr, tuple | list) else ()
        return _value(items[0]) if items else None
    return None


@dataclass(frozen=True)
class ParamValue:
    """A filter compared with a placeholder: the row must carry the value bound to it.

    ``step`` is the claim statement's index, ``number`` the placeholder's ``$n`` there.
    """

    step: int
    number: int


def _value(node: Node) -> object | None:
    node = _unwrap(node)
    if isinstance(node, ast.ParamRef):
        return ParamValue(0, int(node.number or 0))
    if not isinstance(node, ast.A_Const) or node.isnull:
        return None
    val = node.val
    if isinstance(val, ast.String):
        return str(val.sval)
    if isinstance(val, ast.Integer):
        return int(val.ival or 0)
    if isinstance(val, ast.Float):
        return str(val.fval)
    if isinstance(val, ast.Boolean):
        return bool(val.boolval)
    return None


def _qualified_names(tree: Node) -> list[str]:
    """Schema-qualified relations a statement names (format fields like {schema} excepted)."""
    return [
        f"{n.schemaname}.{n.relname}"
        for n in walk(tree)
        if isinstance(n, ast.RangeVar)
        and n.schemaname
        and not str(n.schemaname).startswith(FORMAT_PREFIX)
    ]


# -- rendering --------------------------------------------------------------------------------


def _quote(name: str) -> str:
    if name.startswith(FORMAT_PREFIX):
        return name  # a {field}: substituted by render, as the user's code would
    return '"' + name.replace('"', '""') + '"'


def returning_clause(step: ClaimStatement, key: str) -> str:
    """``RETURNING <target>.<key>`` for a write that returns nothing, else ''."""
    if step.target is None:
        return ""
    rv = step.target
    ref = rv.alias.aliasname if rv.alias else rv.relname
    return f"\nRETURNING {_quote(str(ref))}.{_quote(key)}"


def render(text: str, fields: Mapping[str, str]) -> tuple[str, str]:
    """The statement for PREPARE (``$n``) and for psycopg (``%(pn)s``, ``%`` doubled).

    ``fields`` maps format-field stand-ins (``_fmt_table``), or placeholders (``$1``) to
    be spliced in as they are, to the text they become.
    """
    dollar: list[str] = []
    named: list[str] = []
    pos = 0
    for tok in tokenize(text):
        gap = text[pos : tok.start]
        dollar.append(gap)
        named.append(gap.replace("%", "%%"))
        if tok.kind in ("word", "param") and tok.text in fields:
            dollar.append(fields[tok.text])
            named.append(fields[tok.text].replace("%", "%%"))
        elif tok.kind == "param" and tok.name.startswith("$"):
            dollar.append(tok.text)
            named.append(f"%(p{tok.name[1:]})s")
        else:
            dollar.append(tok.text)
            named.append(tok.text.replace("%", "%%"))
        pos = tok.end
    dollar.append(text[pos:])
    named.append(text[pos:].replace("%", "%%"))
    return "".join(dollar), "".join(named)
