"""The audit checks: what makes a claim race, serialise, strand jobs or lose its fence.

The rules themselves (id, severity, fix) are listed in ``_rules``.  The checks read the
facts from _model and return hits, by rule id, at offsets of the parsed statement; the
engine turns those into file:line:col findings.  Names of columns are all the checks
know about the schema, so the name patterns below decide what a status, owner, lease or
token column is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pglast import ast, enums

from ._lexer import FORMAT_PREFIX
from ._model import (
    Dml,
    Lock,
    Rel,
    SelectFacts,
    StatementFacts,
    advisory_calls,
    column_refs,
    const_strings,
    func_name,
    is_key_column,
    is_null,
    lock_for,
    pick_of,
    resolve,
    same_table,
    walk,
)

__all__ = [
    "Hit",
    "check_statement",
    "check_unit",
    "looks_like_queue",
]

_STATUS = re.compile(r"^(status|state)$|_(status|state)$")
_OWNER = re.compile(
    r"^(worker|owner|consumer|runner|processor|hostname|pid)(_?(id|name|host|pid))?$"
    r"|^(locked|claimed|taken|leased|reserved|processed|picked|acquired)_by$"
)
_TOKEN = re.compile(
    r"(^|_)(token|receipt|nonce|fence|fencing|version|lease_id|claim_id|lock_id)(_|$)"
)
_LEASE = re.compile(
    r"^(locked_until|visible_at|visible_after|invisible_until|vt|expiry|expiration|timeout_at)$"
    r"|lease|expire|heartbeat|visibility|deadline|_until$"
)
_LOCKISH = re.compile(
    r"^(locked|claimed|taken|picked|reserved|dequeued|started|processing|in_progress|running"
    r"|acquired|leased)(_at|_on)?$|^is_(locked|claimed|processing|running|taken)$"
)
_TIMESTAMP = re.compile(r"(_at|_until|_time|_on|_ts)$")
_QUEUE_TABLE = re.compile(r"(^|_)(jobs?|tasks?|queues?|queued_\w+|outbox|work_?items?)($|_)")

_PENDING = frozenset(
    {
        "pending",
        "queued",
        "new",
        "ready",
        "available",
        "waiting",
        "scheduled",
        "todo",
        "retry",
        "retrying",
        "enqueued",
        "created",
        "idle",
        "open",
        "unclaimed",
        "free",
        "initial",
    }
)
_COMPLETED = frozenset(
    {
        "done",
        "completed",
        "complete",
        "finished",
        "succeeded",
        "success",
        "successful",
        "failed",
        "failure",
        "error",
        "errored",
        "dead",
        "discarded",
        "processed",
        "archived",
    }
)
_CANCELLED = frozenset({"cancelled", "canceled", "aborted", "expired", "skipped"})
_COMPARISONS = {"<", "<=", ">", ">="}


def is_status(col: str) -> bool:
    return bool(_STATUS.search(col))


def is_token(col: str) -> bool:
    return bool(_TOKEN.search(col))


def is_lease(col: str) -> bool:
    return not is_token(col) and bool(_LEASE.search(col))


def is_owner(col: str) -> bool:
    return bool(_OWNER.search(col))


def looks_like_queue(table: str) -> bool:
    return bool(_QUEUE_TABLE.search(table.removeprefix(FORMAT_PREFIX)))


class Located(Protocol):
    """What a rule needs from the engine's statement: keyword positions by nesting."""

    def select_keyword(self, select: Any, words: Sequence[str]) -> int: ...

    def show(self, node: Any) -> str: ...


@dataclass(frozen=True)
class Hit:
    """A rule firing at an offset of a statement; ``{related}`` in message names the other."""

    rule: str
    stmt: Located
    offset: int
    message: str
    related: tuple[tuple[Located, int, str], ...] = ()
    # The table concerned: completions are only reported for tables used as queues.
    table: str | None = None


def _quoted(cols: set[str] | list[str]) -> str:
    return ", ".join(sorted(cols))


def _loc(node: Any) -> int:
    return int(getattr(node, "location", None) or 0)


def _values(d: Dml, cols: list[str]) -> set[str]:
    found: set[str] = set()
    for c in cols:
        found |= {v.lower() for v in const_strings(d.sets[c])}
    return found


def takes_rows(d: Dml) -> bool:
    """The UPDATE marks rows as taken (not finished, cancelled or handed back)."""
    status_cols = [c for c in d.sets if is_status(c)]
    values = _values(d, status_cols)
    if values:
        return bool(values - _PENDING - _COMPLETED - _CANCELLED)
    # No literal status (none set, or a bound parameter as ORMs write it): judge by owner,
    # lock and lease columns being filled in.
    return any(
        (is_owner(c) or _LOCKISH.search(c) or is_lease(c)) and not is_null(v)
        for c, v in d.sets.items()
    )


def _comparisons(conj: Any) -> list[Any]:
    """Ordering comparisons (<, <=, >, >=) anywhere in a condition, ORs included."""
    found = []
    for n in walk(conj, into_sublinks=False):
        is_op = isinstance(n, ast.A_Expr) and n.kind == enums.A_Expr_Kind.AEXPR_OP
        if is_op and n.name and n.name[-1].sval in _COMPARISONS:
            found.append(n)
    return found


def _accepts_expired(d: Dml) -> bool:
    """The claim itself takes rows whose lock timestamp is old: an implicit lease."""

    def timed(col: str) -> bool:
        return col in d.sets and bool(_TIMESTAMP.search(col) or is_lease(col))

    scopes = [[d.target, *d.from_rels]]
    for conj in d.own_conds:
        for cmp in _comparisons(conj):
            for ref in column_refs(cmp):
                owner, col = resolve(ref, scopes, prefer=d.target)
                if owner is d.target and timed(col):
                    return True
    for s in d.sources:
        for col, ref, conj in s.conditions:
            if timed(col) and any(r is ref for c in _comparisons(conj) for r in column_refs(c)):
                return True
    return False


def _claim_race(stmt: Located, d: Dml) -> list[Hit]:
    """SL001 (no lock, no re-check) and SL009 (no lock, re-checked)."""
    if d.keyed is not None or not (d.is_claim or d.returning):
        return []
    if any(s.locked for s in d.sources):
        return []
    if d.kind == "delete":
        for s in d.sources:
            if s.pick is not None and not s.advisory:
                msg = (
                    f"Candidate rows of {d.target.display} are picked in the {s.via} without a "
                    "row lock: the DELETE skips rows another worker already deleted, so no job "
                    "is taken twice, but concurrent workers pick the same rows, wait for the "
                    "first one to commit and come back empty."
                )
                return [Hit("SL009", stmt, s.rel.location, msg)]
        return []
    # A re-check that fences: a column the claim overwrites (not a counter such as
    # attempts = attempts + 1, still true after the first claim), or the very column the
    # subquery tested.
    own = set(d.own_conditions)
    for s in d.sources:
        checked = [(c, ref, conj) for c, ref, conj in s.conditions if c in d.sets]
        if not checked:
            continue
        cols = {c for c, _, _ in checked}
        rechecked = own & (d.state_columns | cols)
        if rechecked:
            if s.pick is None or s.advisory:
                continue
            msg = (
                f"Candidate rows of {d.target.display} are picked in the {s.via} without a row "
                f"lock: re-checking {_quoted(rechecked)} on the target stops double claims, but "
                "concurrent workers pick the same rows, wait for the first one to commit and "
                "come back empty."
            )
            return [Hit("SL009", stmt, s.rel.location, msg)]
        col, ref, conj = checked[0]
        lock = (
            "locks rows only FOR KEY SHARE (no conflict with the claiming UPDATE)"
            if s.lock is not None
            else "takes no row lock"
        )
        cond = stmt.show(conj) or col
        msg = (
            f"The claim condition {cond} is checked only in the {s.via}, which {lock}, and the "
            f"UPDATE's own WHERE does not re-check {_quoted(cols)}. Under READ COMMITTED a worker "
            "that waited for another's row lock re-checks only the UPDATE's own WHERE, so both "
            "workers claim the row."
        )
        return [Hit("SL001", stmt, _loc(ref), msg)]
    return []


def _lease(stmt: Located, d: Dml) -> list[Hit]:
    """SL005."""
    if d.kind != "update" or not d.is_claim or not takes_rows(d):
        return []
    if any(is_lease(c) and not is_null(v) for c, v in d.sets.items()) or _accepts_expired(d):
        return []
    first = min(d.set_locations.values(), default=d.target.location)
    msg = (
        f"This claim sets {_quoted(list(d.sets))} but no lease or expiry: if the worker dies "
        "after claiming, the job stays taken forever and no worker will pick it up again."
    )
    return [Hit("SL005", stmt, first, msg, table=d.target.relname)]


def _fence(stmt: Located, d: Dml) -> list[Hit]:
    """SL006."""
    if d.kind != "update" or d.keyed is None:
        return []
    status_cols = [c for c in d.sets if is_status(c)]
    done = sorted(_values(d, status_cols) & _COMPLETED)
    if not done:
        return []
    fences = [
        c
        for c in d.own_conditions
        if not is_key_column(c, d.target.relname)
        and (is_status(c) or is_owner(c) or is_token(c) or is_lease(c))
    ]
    if fences:
        return []
    key = stmt.show(d.keyed) or "id"
    msg = (
        f"This completion sets {status_cols[0]} = '{done[0]}' with only {key} to identify the "
        "job: a worker whose lease ran out, and whose job was swept or claimed by another "
        "worker, still overwrites it."
    )
    return [Hit("SL006", stmt, _loc(d.keyed), msg, table=d.target.relname)]


def _fenced(rel: Rel) -> bool:
    """A subquery or CTE the planner will not merge into the outer query, so the outer
    LIMIT stops calling the advisory-lock function once it has enough rows."""
    query = rel.query
    if rel.kind in ("subquery", "cte") and query is not None:
        limited = query.limitCount is not None or query.limitOffset is not None
        return limited or rel.materialized
    return rel.kind in ("function", "values")


def _advisory(
    stmt: Located,
    conds: list[Any],
    scopes: list[list[Rel]],
    where: str = "the WHERE of a query with LIMIT",
) -> list[Hit]:
    """SL004 on the conditions of a query with LIMIT."""
    hits = []
    for call in advisory_calls(conds):
        owners = [resolve(ref, scopes)[0] for ref in column_refs(call)]
        if owners and all(o is not None and _fenced(o) for o in owners):
            continue
        name = func_name(call)
        session = (
            ""
            if "xact" in name
            else "; session-level locks stay held until unlocked or disconnected"
        )
        msg = (
            f"{name}() runs in {where}: the planner may call it on more "
            f"rows than the LIMIT returns (all matching rows, before a sort), locking jobs nobody "
            f"claims{session}."
        )
        hits.append(Hit("SL004", stmt, _loc(call), msg))
    return hits


def _table_lock(sf: SelectFacts) -> tuple[Rel, Lock] | None:
    for rel in sf.rels:
        lock = lock_for(sf.node, rel) if rel.kind == "table" else None
        if lock is not None:
            return rel, lock
    return None


def _claimy(table: str | None, cols: set[str], written: set[str]) -> bool:
    """Looks like taking jobs from a queue, not locking a row of some other table: a queue
    table, or candidates filtered on state, lease, owner or lock columns (or on what the
    statement itself writes)."""
    if table and looks_like_queue(table):
        return True
    return any(
        c in written or is_status(c) or is_lease(c) or is_owner(c) or _LOCKISH.search(c)
        for c in cols
    )


def _locked_pick(stmt: Located, sf: SelectFacts, unordered: dict[int, Any]) -> list[Hit]:
    """SL003 and SL008 on a SELECT that locks some rows of a table and LIMITs them."""
    pick = pick_of(sf.node, sf.rels)
    locked = _table_lock(sf)
    if pick is None or pick.kind != "limit" or locked is None or sf.keyed() is not None:
        return []
    rel, lock = locked
    if not _claimy(rel.relname, {c for c, _, _ in sf.refs_to(rel)}, set()):
        return []
    at = stmt.select_keyword(sf.node, ("for",))
    if not pick.ordered:
        unordered[id(sf.node)] = sf.node
    if lock.exclusive and not lock.wait:
        msg = (
            f"{lock.strength} without SKIP LOCKED in a claim on {rel.display}: every worker "
            "wants the same first candidates, so the others wait for the lock holder to commit "
            "and claims run one at a time."
        )
        return [Hit("SL003", stmt, at, msg)]
    if not lock.exclusive:
        why = (
            "every worker can share-lock the same candidate rows, and their UPDATEs then wait "
            "on each other and deadlock"
            if lock.strength == "FOR SHARE"
            else "it does not conflict with an UPDATE that leaves the key alone, so concurrent "
            "workers lock, and claim, the same rows"
        )
        return [Hit("SL008", stmt, at, f"{lock.strength} does not keep claimers apart: {why}.")]
    return []


def check_statement(stmt: Located, facts: StatementFacts) -> list[Hit]:
    """Rules that need only one statement."""
    hits: list[Hit] = []
    unordered: dict[int, Any] = {}
    for d in facts.dmls:
        hits += _claim_race(stmt, d)
        hits += _lease(stmt, d)
        if d.is_claim:
            for s in d.sources:
                if s.pick is None or s.pick.kind != "limit" or s.pick.ordered:
                    continue
                if _claimy(d.target.relname, {c for c, _, _ in s.conditions}, set(d.sets)):
                    unordered[id(s.pick.select)] = s.pick.select
            if any(s.pick is not None for s in d.sources):
                where = "the WHERE of a claim whose candidates come from a LIMIT"
                hits += _advisory(stmt, d.own_conds, [[d.target, *d.from_rels]], where)
    for sf in facts.selects:
        hits += _locked_pick(stmt, sf, unordered)
        pick = pick_of(sf.node, sf.rels)
        if pick is not None and pick.kind == "limit":
            hits += _advisory(stmt, sf.conds, sf.scopes)
    hits += [_unordered(stmt, select) for select in unordered.values()]
    return hits


def _unordered(stmt: Located, select: Any) -> Hit:
    """SL007."""
    at = stmt.select_keyword(select, ("limit", "fetch"))
    msg = (
        "This claim's LIMIT has no ORDER BY, so which rows it takes depends on the plan: no "
        "FIFO or priority order, and an unlucky job can wait indefinitely."
    )
    return Hit("SL007", stmt, at, msg)


def _selects_key(sf: SelectFacts, rel: Rel) -> bool:
    for target in sf.node.targetList or ():
        if not isinstance(target.val, ast.ColumnRef):
            continue
        fields = target.val.fields or ()
        if fields and isinstance(fields[-1], ast.A_Star):
            return True
        owner, col = resolve(target.val, sf.scopes, prefer=rel)
        if owner is rel and is_key_column(col, rel.relname):
            return True
    return False


def check_unit(items: Sequence[tuple[Located, StatementFacts]]) -> list[Hit]:
    """Rules over statements run together (one .sql file, one Python function).

    SL002: a SELECT of candidates, then an UPDATE claiming them by id.  SL006: a completion
    fenced only by id, unless an earlier SELECT ... FOR UPDATE of that table holds the row
    lock (the "keep the lock for the whole job" pattern: the lock is the fence).
    """
    hits: list[Hit] = []
    held: set[str | None] = set()
    for stmt, facts in items:
        for d in facts.dmls:
            if d.target.relname not in held:
                hits += _fence(stmt, d)
        sf = facts.top_select
        if sf is not None:
            held |= {
                r.relname
                for r in sf.rels
                if r.kind == "table" and (lock := lock_for(sf.node, r)) and lock.exclusive
            }
    for i, (stmt, facts) in enumerate(items):
        sf = facts.top_select
        if sf is None or sf.keyed() is not None:
            continue
        for rel in sf.rels:
            lock = lock_for(sf.node, rel) if rel.kind == "table" else None
            if rel.kind != "table" or (lock is not None and lock.excludes_claimers):
                continue
            if not _selects_key(sf, rel):
                continue
            conds = sf.refs_to(rel)
            hit = _two_step(stmt, rel, conds, items[i + 1 :])
            if hit is not None:
                hits.append(hit)
                pick = pick_of(sf.node, sf.rels)
                if pick is not None and pick.kind == "limit" and not pick.ordered:
                    hits.append(_unordered(stmt, sf.node))
                break
    return hits


def _two_step(
    stmt: Located,
    rel: Rel,
    conds: list[tuple[str, Any, Any]],
    later: Sequence[tuple[Located, StatementFacts]],
) -> Hit | None:
    cols = {c for c, _, _ in conds}
    for other, facts in later:
        for d in facts.dmls:
            if d.kind != "update" or d.keyed is None or not same_table(rel, d.target):
                continue
            written = cols & set(d.sets)
            if not written or not takes_rows(d):
                continue
            if set(d.own_conditions) & (d.state_columns | cols):
                continue
            col, ref, conj = next(c for c in conds if c[0] in written)
            msg = (
                f"This SELECT picks candidate rows of {rel.display} ({stmt.show(conj) or col}) "
                "without a row lock, and the UPDATE at {related} then claims them by id without "
                f"re-checking {_quoted(written)}: two workers can read the same rows and both "
                "claim them."
            )
            related = ((other, d.target.location, "the UPDATE that claims the selected rows"),)
            return Hit("SL002", stmt, _loc(ref), msg, related, table=rel.relname)
    return None
