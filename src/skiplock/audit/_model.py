"""What a parsed statement does to a table, in the terms the rules reason about.

pglast gives PostgreSQL's raw parse tree.  This module answers the questions behind every
rule: which table an UPDATE writes, which columns it sets, which of its conditions run on
the target row itself (the only ones PostgreSQL re-checks after waiting for a row lock),
and which conditions live in subqueries, CTEs or joined relations, with or without a lock.
No catalog is available, so names are resolved by scope the way the parser would.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pglast import ast, enums

from ._lexer import FORMAT_PREFIX

__all__ = [
    "Dml",
    "Lock",
    "Pick",
    "Rel",
    "SelectFacts",
    "Source",
    "StatementFacts",
    "advisory_calls",
    "column_refs",
    "const_strings",
    "func_name",
    "is_key_column",
    "is_null",
    "lock_for",
    "pick_of",
    "resolve",
    "same_table",
    "statement_facts",
    "walk",
]

# pglast's node attributes are loosely typed; the code checks node kinds with isinstance.
Node = Any

_LOCK_NAMES = {
    enums.LockClauseStrength.LCS_FORUPDATE: "FOR UPDATE",
    enums.LockClauseStrength.LCS_FORNOKEYUPDATE: "FOR NO KEY UPDATE",
    enums.LockClauseStrength.LCS_FORSHARE: "FOR SHARE",
    enums.LockClauseStrength.LCS_FORKEYSHARE: "FOR KEY SHARE",
}
_WAIT_NAMES = {
    enums.LockWaitPolicy.LockWaitBlock: "",
    enums.LockWaitPolicy.LockWaitSkip: "SKIP LOCKED",
    enums.LockWaitPolicy.LockWaitError: "NOWAIT",
}
_KEY_COLUMNS = {"id", "pk", "uuid", "job_id", "task_id", "msg_id", "message_id"}
_PICK_AGGREGATES = {"min", "max"}
_ADVISORY = re.compile(r"^pg_(try_)?advisory_(xact_)?lock(_shared)?$")


def children(node: Node) -> Iterator[Node]:
    """Direct child nodes, in field order."""
    slots = getattr(type(node), "__slots__", None)
    if not isinstance(slots, dict):
        return
    for name in slots:
        yield from _nodes_in(getattr(node, name, None))


def _nodes_in(value: Any) -> Iterator[Node]:
    if isinstance(value, ast.Node):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _nodes_in(v)


def walk(node: Node, *, into_sublinks: bool = True) -> Iterator[Node]:
    """Pre-order traversal; without ``into_sublinks`` a subquery's SELECT is not entered
    (its test expression, the ``id`` of ``id IN (...)``, belongs to the outer query)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if not into_sublinks and isinstance(n, ast.SubLink):
            stack.extend(_nodes_in(n.testexpr))
            continue
        stack.extend(reversed(list(children(n))))


def conjuncts(expr: Node) -> list[Node]:
    """Top-level AND terms of a condition."""
    if expr is None:
        return []
    if isinstance(expr, ast.BoolExpr) and expr.boolop == enums.BoolExprType.AND_EXPR:
        return [c for a in expr.args or () for c in conjuncts(a)]
    return [expr]


def column_refs(expr: Node) -> list[Node]:
    """ColumnRefs of an expression, not looking into subqueries (they are scopes of their own)."""
    if expr is None:
        return []
    return [n for n in walk(expr, into_sublinks=False) if isinstance(n, ast.ColumnRef)]


def sublinks(expr: Node) -> list[Node]:
    """Subqueries used directly by an expression (not those nested inside them)."""
    if expr is None:
        return []
    return [n for n in walk(expr, into_sublinks=False) if isinstance(n, ast.SubLink)]


def _names(fields: Sequence[Node] | None) -> list[str]:
    return [str(f.sval) if isinstance(f, ast.String) else "*" for f in fields or ()]


def func_name(call: Node) -> str:
    return str(_names(call.funcname)[-1]).lower()


def const_strings(expr: Node) -> set[str]:
    """String constants an expression can produce (CASE branches included)."""
    found: set[str] = set()
    for n in walk(expr, into_sublinks=False):
        if isinstance(n, ast.A_Const) and not n.isnull and isinstance(n.val, ast.String):
            found.add(str(n.val.sval))
    return found


def advisory_calls(conds: Sequence[Node]) -> list[Node]:
    """Calls that take an advisory lock (pg_try_advisory_xact_lock, ...) in conditions."""
    return [
        n
        for cond in conds
        for n in walk(cond, into_sublinks=False)
        if isinstance(n, ast.FuncCall) and _ADVISORY.match(func_name(n))
    ]


def is_null(expr: Node) -> bool:
    return isinstance(expr, ast.A_Const) and bool(expr.isnull)


def is_value_param(expr: Node) -> bool:
    """A value fixed by the caller: parameter, literal, placeholder, or an array of them."""
    if isinstance(expr, ast.TypeCast):
        return is_value_param(expr.arg)
    if isinstance(expr, ast.ParamRef | ast.A_Const):
        return True
    if isinstance(expr, ast.A_ArrayExpr):
        return all(is_value_param(e) for e in expr.elements or ())
    if isinstance(expr, ast.ColumnRef):
        names = _names(expr.fields)
        return len(names) == 1 and names[0].startswith(FORMAT_PREFIX)
    return False


def is_key_column(column: str, relname: str | None) -> bool:
    if column in _KEY_COLUMNS:
        return True
    if relname:
        base = re.sub(r"^" + re.escape(FORMAT_PREFIX), "", relname)
        return column in (f"{base}_id", f"{base.rstrip('s')}_id")
    return False


@dataclass(eq=False)
class Rel:
    """One entry of a FROM list (or the UPDATE/DELETE target)."""

    refname: str
    kind: str  # table, cte, subquery, function, values, other
    node: Node
    relname: str | None = None
    schemaname: str | None = None
    query: Node = None
    cte_name: str | None = None
    materialized: bool = False

    @property
    def location(self) -> int:
        return int(getattr(self.node, "location", None) or 0)

    @property
    def display(self) -> str:
        return self.relname or self.refname


def _rel_of(item: Node, ctes: Mapping[str, Node]) -> Rel:
    alias = item.alias.aliasname if getattr(item, "alias", None) else None
    if isinstance(item, ast.RangeVar):
        relname = str(item.relname or "")
        if item.schemaname is None and relname in ctes:
            cte = ctes[relname]
            always = cte.ctematerialized == enums.CTEMaterialize.CTEMaterializeAlways
            return Rel(
                alias or relname,
                "cte",
                item,
                query=cte.ctequery,
                cte_name=cte.ctename,
                materialized=always,
            )
        return Rel(alias or relname, "table", item, relname, item.schemaname)
    if isinstance(item, ast.RangeSubselect):
        kind = "values" if getattr(item.subquery, "valuesLists", None) else "subquery"
        return Rel(alias or "", kind, item, query=item.subquery)
    if isinstance(item, ast.RangeFunction):
        return Rel(alias or "", "function", item)
    return Rel(alias or "", "other", item)


def range_entries(
    items: Sequence[Node] | None, ctes: Mapping[str, Node]
) -> tuple[list[Rel], list[Node]]:
    """FROM entries, flattening joins; also the join conditions (ON ...)."""
    rels: list[Rel] = []
    quals: list[Node] = []
    for item in items or ():
        if isinstance(item, ast.JoinExpr):
            r, q = range_entries([item.larg, item.rarg], ctes)
            rels.extend(r)
            quals.extend(q)
            quals.extend(conjuncts(item.quals))
        else:
            rels.append(_rel_of(item, ctes))
    return rels, quals


def same_table(rel: Rel, target: Rel) -> bool:
    if rel.kind != "table" or rel.relname != target.relname:
        return False
    return (
        rel.schemaname is None or target.schemaname is None or rel.schemaname == target.schemaname
    )


def resolve(
    ref: Node, scopes: Sequence[Sequence[Rel]], prefer: Rel | None = None
) -> tuple[Rel | None, str]:
    """The relation a column reference belongs to, and the column name."""
    names = _names(ref.fields)
    column = names[-1]
    if len(names) == 1:
        for scope in scopes:
            if prefer is not None and prefer in scope:
                return prefer, column
            if len(scope) == 1:
                return scope[0], column
            tables = [r for r in scope if r.kind == "table"]
            if prefer is not None:
                same = [r for r in tables if same_table(r, prefer)]
                if same:
                    return same[0], column
            if len(tables) == 1:
                return tables[0], column
            if scope:
                return None, column
        return None, column
    qualifier = names[-2]
    for scope in scopes:
        for rel in scope:
            if rel.refname == qualifier or (rel.kind == "table" and rel.relname == qualifier):
                return rel, column
    return None, column


@dataclass(frozen=True)
class Lock:
    """A row-locking clause that covers a relation."""

    strength: str  # "FOR UPDATE", "FOR NO KEY UPDATE", "FOR SHARE", "FOR KEY SHARE"
    wait: str  # "", "SKIP LOCKED", "NOWAIT"

    @property
    def exclusive(self) -> bool:
        return self.strength in ("FOR UPDATE", "FOR NO KEY UPDATE")

    @property
    def excludes_claimers(self) -> bool:
        # FOR KEY SHARE does not conflict with an UPDATE that leaves keys alone, so the
        # SELECT neither waits for a concurrent claim nor re-checks the row after it.
        return self.strength != "FOR KEY SHARE"


def lock_for(select: Node, rel: Rel) -> Lock | None:
    for clause in select.lockingClause or ():
        covered = not clause.lockedRels or any(r.relname == rel.refname for r in clause.lockedRels)
        if covered:
            return Lock(_LOCK_NAMES[clause.strength], _WAIT_NAMES[clause.waitPolicy])
    return None


@dataclass(frozen=True)
class Pick:
    """How a query chooses a subset of candidates: a LIMIT (or FETCH) or min()/max()."""

    select: Node
    kind: str  # "limit" or "aggregate"
    ordered: bool


def pick_of(select: Node, rels: Sequence[Rel] | None = None) -> Pick | None:
    """The pick made by one SELECT level; ``rels`` are its FROM entries, if already known."""
    if rels is None:
        rels = range_entries(select.fromClause, {})[0]
    # ORDER BY in a lone FROM subquery fenced by OFFSET/LIMIT, or a CTE, orders this level.
    inner = rels[0].query if len(rels) == 1 and rels[0].kind in ("subquery", "cte") else None
    ordered = bool(select.sortClause) or bool(
        isinstance(inner, ast.SelectStmt) and inner.sortClause
    )
    count = select.limitCount
    if count is not None and not is_null(count):
        return Pick(select, "limit", ordered)
    for target in select.targetList or ():
        val = target.val
        if isinstance(val, ast.FuncCall) and func_name(val) in _PICK_AGGREGATES:
            return Pick(select, "aggregate", True)
    return None


@dataclass
class SelectFacts:
    """A SELECT level: its relations (with CTE references resolved) and conditions."""

    node: Node
    rels: list[Rel]
    conds: list[Node]
    scopes: list[list[Rel]]

    def refs_to(self, rel: Rel) -> list[tuple[str, Node, Node]]:
        """(column, ColumnRef, conjunct) for every condition column of ``rel``."""
        out = []
        for conj in self.conds:
            for ref in column_refs(conj):
                owner, col = resolve(ref, self.scopes, prefer=rel)
                if owner is rel:
                    out.append((col, ref, conj))
        return out

    def keyed(self) -> Node | None:
        """The condition pinning this query to caller-given ids, if any."""
        for rel in self.rels:
            if rel.kind == "table":
                hit = keyed_condition(self.conds, rel, self.scopes)
                if hit is not None:
                    return hit
        return None


def select_facts(
    select: Node, ctes: Mapping[str, Node], outer: Sequence[list[Rel]] = ()
) -> SelectFacts:
    rels, quals = range_entries(select.fromClause, ctes)
    conds = conjuncts(select.whereClause) + quals
    return SelectFacts(select, rels, conds, [rels, *outer])


def keyed_condition(
    conds: Sequence[Node], rel: Rel, scopes: Sequence[Sequence[Rel]]
) -> Node | None:
    """A condition `key = value`, `key = ANY(array)`, `key IN (...)` or a join to unnest()."""
    for cond in conds:
        if not isinstance(cond, ast.A_Expr):
            continue
        sides = [(cond.lexpr, cond.rexpr), (cond.rexpr, cond.lexpr)]
        for col_side, other in sides:
            if not isinstance(col_side, ast.ColumnRef):
                continue
            owner, col = resolve(col_side, scopes, prefer=rel)
            if owner is not rel or not is_key_column(col, rel.relname):
                continue
            if cond.kind == enums.A_Expr_Kind.AEXPR_IN and isinstance(other, tuple | list):
                if all(is_value_param(v) for v in other):
                    return col_side
            elif cond.kind in (enums.A_Expr_Kind.AEXPR_OP, enums.A_Expr_Kind.AEXPR_OP_ANY):
                if is_value_param(other):
                    return col_side
                if isinstance(other, ast.ColumnRef):
                    source, _ = resolve(other, scopes)
                    if source is not None and source.kind in ("function", "values"):
                        return col_side
    return None


@dataclass
class Source:
    """A read of the target table outside the target row: subquery, CTE or joined relation."""

    rel: Rel
    # (column, ColumnRef, conjunct) of every condition on this read of the target table.
    conditions: list[tuple[str, Node, Node]]
    lock: Lock | None
    pick: Pick | None
    via: str
    # An advisory try-lock filters the candidates on the way: workers skip each other's.
    advisory: bool = False

    @property
    def locked(self) -> bool:
        return self.lock is not None and self.lock.excludes_claimers


@dataclass
class Dml:
    """An UPDATE or DELETE, anywhere in a statement (data-modifying CTEs included)."""

    kind: str  # "update" or "delete"
    node: Node
    target: Rel
    sets: dict[str, Node]
    set_locations: dict[str, int]
    # Target columns the statement's own WHERE tests: re-checked on the locked row.
    own_conditions: dict[str, Node]
    own_conds: list[Node]
    keyed: Node | None
    sources: list[Source]
    returning: bool
    from_rels: list[Rel] = field(default_factory=list)

    @property
    def state_columns(self) -> set[str]:
        """Set columns whose new value does not derive from the old one (not counters)."""
        out = set()
        for col, val in self.sets.items():
            refs = [_names(r.fields)[-1] for r in column_refs(val)]
            if col not in refs:
                out.add(col)
        return out

    @property
    def is_claim(self) -> bool:
        """Takes some of the available rows (not rows the caller names by id)."""
        if self.keyed is not None:
            return False
        if self.kind == "delete" and not self.returning:
            return False
        return any(s.pick is not None or s.lock is not None for s in self.sources)


_SUBLINK_VIA = {
    enums.SubLinkType.EXISTS_SUBLINK: "EXISTS (subquery)",
    enums.SubLinkType.ANY_SUBLINK: "IN (subquery)",
    enums.SubLinkType.ALL_SUBLINK: "ALL (subquery)",
    enums.SubLinkType.EXPR_SUBLINK: "scalar subquery",
    enums.SubLinkType.ARRAY_SUBLINK: "= ANY(ARRAY(subquery))",
}


class _SourceFinder:
    """Follows subqueries, FROM subqueries and CTEs from a DML down to reads of its target."""

    def __init__(self, target: Rel, ctes: Mapping[str, Node]) -> None:
        self.target = target
        self.ctes = ctes
        self.found: list[Source] = []

    def select(
        self,
        select: Node,
        via: str,
        inherited: Lock | None,
        pick: Pick | None,
        outer: Sequence[list[Rel]],
        seen: frozenset[str] = frozenset(),
        advisory: bool = False,
    ) -> None:
        ctes = dict(self.ctes)
        if select.withClause is not None:
            ctes.update({c.ctename: c for c in select.withClause.ctes})
        if select.op != enums.SetOperation.SETOP_NONE:
            pick = pick or pick_of(select, [])
            for part in (select.larg, select.rarg):
                self.select(part, via, inherited, pick, outer, seen, advisory)
            return
        facts = select_facts(select, ctes, outer)
        pick = pick or pick_of(select, facts.rels)
        advisory = advisory or bool(advisory_calls(facts.conds))
        for rel in facts.rels:
            lock = lock_for(select, rel) or inherited
            if rel.kind == "table" and same_table(rel, self.target):
                conds = facts.refs_to(rel)
                self.found.append(Source(rel, conds, lock, pick, via, advisory))
            elif rel.kind == "subquery":
                self.select(rel.query, via, lock, pick, facts.scopes, seen, advisory)
            elif (
                rel.kind == "cte"
                and rel.cte_name not in seen
                and isinstance(rel.query, ast.SelectStmt)
            ):
                name = f"CTE {rel.cte_name}"
                seen_here = seen | {rel.cte_name or ""}
                self.select(rel.query, name, None, pick, [], seen_here, advisory)


def _dml(node: Node, ctes: Mapping[str, Node]) -> Dml:
    is_update = isinstance(node, ast.UpdateStmt)
    rv = node.relation
    target = Rel(
        rv.alias.aliasname if rv.alias else rv.relname, "table", rv, rv.relname, rv.schemaname
    )
    from_items = node.fromClause if is_update else node.usingClause
    from_rels, quals = range_entries(from_items, ctes)
    scopes = [[target, *from_rels]]
    own_conds = conjuncts(node.whereClause) + quals
    own: dict[str, Node] = {}
    for conj in own_conds:
        for ref in column_refs(conj):
            owner, col = resolve(ref, scopes, prefer=target)
            if owner is target:
                own.setdefault(col, ref)
    sets: dict[str, Node] = {}
    set_locations: dict[str, int] = {}
    if is_update:
        for t in node.targetList or ():
            sets[t.name] = t.val.source if isinstance(t.val, ast.MultiAssignRef) else t.val
            set_locations[t.name] = int(t.location or 0)
    finder = _SourceFinder(target, ctes)
    for rel in from_rels:
        if rel.kind == "table" and same_table(rel, target):
            facts = SelectFacts(node, [target, *from_rels], own_conds, scopes)
            conds = facts.refs_to(rel)
            finder.found.append(Source(rel, conds, None, None, "joined relation"))
        elif rel.kind == "subquery":
            finder.select(rel.query, "FROM subquery", None, None, scopes)
        elif rel.kind == "cte" and isinstance(rel.query, ast.SelectStmt):
            finder.select(
                rel.query, f"CTE {rel.cte_name}", None, None, [], frozenset({rel.cte_name or ""})
            )
    for link in sublinks(node.whereClause):
        if isinstance(link.subselect, ast.SelectStmt):
            finder.select(
                link.subselect, _SUBLINK_VIA.get(link.subLinkType, "subquery"), None, None, scopes
            )
    return Dml(
        kind="update" if is_update else "delete",
        node=node,
        target=target,
        sets=sets,
        set_locations=set_locations,
        own_conditions=own,
        own_conds=own_conds,
        keyed=keyed_condition(own_conds, target, scopes),
        sources=finder.found,
        returning=node.returningClause is not None,
        from_rels=from_rels,
    )


@dataclass
class StatementFacts:
    """Everything the rules need from one parsed statement."""

    dmls: list[Dml] = field(default_factory=list)
    # Every SELECT level with the CTEs visible to it.
    selects: list[SelectFacts] = field(default_factory=list)
    # The statement itself when it is a plain SELECT (a candidate for the two-step rule).
    top_select: SelectFacts | None = None


def statement_facts(stmt: Node) -> StatementFacts:
    facts = StatementFacts()

    def visit(node: Node, ctes: Mapping[str, Node]) -> None:
        with_clause = getattr(node, "withClause", None)
        if isinstance(with_clause, ast.WithClause):
            ctes = {**ctes, **{c.ctename: c for c in with_clause.ctes or ()}}
        if isinstance(node, ast.UpdateStmt | ast.DeleteStmt):
            facts.dmls.append(_dml(node, ctes))
        elif isinstance(node, ast.SelectStmt) and node.op == enums.SetOperation.SETOP_NONE:
            sf = select_facts(node, ctes)
            facts.selects.append(sf)
            if node is stmt:
                facts.top_select = sf
        for child in children(node):
            visit(child, ctes)

    visit(stmt, {})
    return facts
