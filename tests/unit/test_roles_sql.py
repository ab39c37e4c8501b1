"""roles.sql grants exactly the columns queries.sql writes and reads, parsed, not eyeballed.

The producer and worker grants are column lists; a statement that starts to set or read
a new column must change the grant too, or the restricted roles break in production.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from pglast import ast, parse_sql
from pglast.enums import ObjectType

from skiplock._roles import plan_roles, roles_script
from skiplock._sql import statements

# Who runs each named statement of queries.sql.  A new statement must be placed here.
PRODUCER = {
    "enqueue_keyed",
    "enqueue_plain",
    "enqueue_plain_limited",
    "enqueued_ids",
    "enqueue_one",
    "enqueue_one_limited",
    "reserve_ids",
    "copy_jobs",
    "copy_jobs_at",
    "copy_jobs_concurrency",
    "copy_jobs_concurrency_at",
    "copy_jobs_rate",
    "copy_jobs_rate_at",
    "watch",
    "job_state",
    # jobs with `after` (migration 0016), a SECURITY DEFINER function
    "enqueue_graph",
    # a workflow's output and steps: `wait` and `skiplock workflow`
    "workflow",
    # which database a transactional defer's connection is on (several clusters)
    "server_identity",
}
WORKER = {
    "claim",
    "lock_queue",
    "claim_limited",
    "complete",
    "fail",
    "heartbeat",
    "release",
    "sweep",
    "fence_outcome",
    "get",
    "cancel",
    "status",
    # the worker's own row in `workers`, and status's unserved tasks
    "worker_seen",
    "worker_gone",
    "worker_waiting",
    "unserved",
    # the liveness mark, and the sweep of workers whose mark is gone
    "worker_mark",
    "sweep_dead",
    # the generations' upkeep (migration 0009), a SECURITY DEFINER function
    "upkeep",
    # a child reads its parents' outcomes (migration 0016)
    "parents",
}
# Retention deletes, and queue settings (pause, limits) are an operator's: the owner.
OWNER = {
    "prune",
    "configure_queue",
    "set_paused",
    "queue_settings",
    "list_jobs",
    "requeue",
    "delete_job",
    "find_jobs",
    "failed_ids",
    "retry_jobs",
    "throughput",
}


def parsed(name: str) -> Any:
    text = getattr(statements("s"), name).as_string(None)
    text = re.sub(r"%\(\w+\)s", "$1", text).replace("%%", "%")
    [raw] = parse_sql(text)
    return raw.stmt


def walk(node: Any) -> Iterator[Any]:
    if isinstance(node, list | tuple):
        for item in node:
            yield from walk(item)
    elif isinstance(node, ast.Node):
        yield node
        for attr in node:
            yield from walk(getattr(node, attr))


def _returning(stmt: Any) -> Any:
    # pglast 8 (PostgreSQL 17's parser) wraps RETURNING in a clause; pglast 7 has a list.
    return getattr(stmt, "returningClause", None) or getattr(stmt, "returningList", None)


def grants(table: str = "jobs") -> dict[tuple[str, str], set[str]]:
    """{(role kind, privilege): columns} of the grants on ``table``; '*' for all."""
    out: dict[tuple[str, str], set[str]] = {}
    for title, stmt in plan_roles("s", producer="p", worker="w").statements:
        for raw in parse_sql(stmt.as_string(None)):
            g = raw.stmt
            if not isinstance(g, ast.GrantStmt) or g.objtype != ObjectType.OBJECT_TABLE:
                continue
            if {o.relname for o in g.objects} != {table}:
                continue
            kind = "producer" if "producer" in title else "worker"
            for priv in g.privileges:
                cols = {c.sval for c in priv.cols} if priv.cols else {"*"}
                out.setdefault((kind, priv.priv_name), set()).update(cols)
    return out


def _targets(stmt: Any) -> Iterator[tuple[str, set[str]]]:
    """(table, columns set) of every UPDATE in a statement, data-modifying CTEs too."""
    for node in walk(stmt):
        if isinstance(node, ast.UpdateStmt):
            yield node.relation.relname, {t.name for t in node.targetList}


def test_every_statement_has_an_owner() -> None:
    assert set(statements("s").names()) == PRODUCER | WORKER | OWNER


def test_worker_update_grant_is_exactly_what_the_worker_sets() -> None:
    sets: dict[str, set[str]] = {"jobs": set(), "queues": set(), "workers": set()}
    for name in WORKER:
        for table, cols in _targets(parsed(name)):
            sets[table] |= cols
    assert grants()[("worker", "update")] == sets["jobs"]
    assert grants()[("worker", "select")] == {"*"}  # a claim returns the whole row
    assert set(grants()) == {("worker", "update"), ("worker", "select"), *producer_keys()}
    assert grants("queues") == {("worker", "select"): {"*"}, ("worker", "update"): sets["queues"]}
    # A worker writes only its own row of `workers`, but needs all four to do so.
    # The producer reads which workers wait for a notification: the enqueue trigger of
    # migration 0008 runs as the inserting role and reads exactly these two columns.
    assert grants("workers") == {
        **{("worker", p): {"*"} for p in ("select", "insert", "update", "delete")},
        ("producer", "select"): {"queues", "waiting"},
    }


def test_producer_update_grant_is_exactly_what_wait_sets() -> None:
    sets: set[str] = set()
    for name in PRODUCER:
        for _table, cols in _targets(parsed(name)):
            sets |= cols
    assert grants()[("producer", "update")] == sets == {"notify_finish"}


def producer_keys() -> set[tuple[str, str]]:
    return {("producer", "insert"), ("producer", "select"), ("producer", "update")}


def test_producer_insert_grant_is_exactly_what_enqueue_writes() -> None:
    cols: set[str] = set()
    for name in PRODUCER:
        stmt = parsed(name)
        if isinstance(stmt, ast.InsertStmt):
            cols |= {t.name for t in stmt.cols}
        elif isinstance(stmt, ast.CopyStmt):
            cols |= {a.sval for a in stmt.attlist}
    assert grants()[("producer", "insert")] == cols
    # Not the columns that make a job look claimed or finished.
    assert not cols & {"status", "worker", "lease_token", "locked_until", "attempts"}


def test_producer_select_grant_is_exactly_what_enqueue_reads() -> None:
    read: set[str] = set()
    for name in PRODUCER:
        stmt = parsed(name)
        if isinstance(stmt, ast.InsertStmt):
            read |= {
                n.fields[-1].sval for n in walk(_returning(stmt)) if isinstance(n, ast.ColumnRef)
            }
            if stmt.onConflictClause is not None:
                read |= {e.name for e in stmt.onConflictClause.infer.indexElems}
        elif isinstance(stmt, ast.UpdateStmt):  # watch: its RETURNING
            read |= {
                n.fields[-1].sval for n in walk(_returning(stmt)) if isinstance(n, ast.ColumnRef)
            }
        elif isinstance(stmt, ast.SelectStmt) and name == "job_state":
            read |= {
                n.fields[-1].sval
                for n in walk(stmt)
                if isinstance(n, ast.ColumnRef) and isinstance(n.fields[-1], ast.String)
            }
    assert grants()[("producer", "select")] == read
    assert "payload" not in read


def test_producer_reaches_keys_only_through_enqueue_keyed() -> None:
    """Dedup lives in job_keys (migration 0009) and is decided by enqueue_keyed
    (migration 0017), a SECURITY DEFINER function: the producer may execute it and has
    no grant on job_keys itself; a worker never touches either."""
    tables = {r.relname for r in walk(parsed("enqueue_keyed")) if isinstance(r, ast.RangeVar)}
    assert tables == set()  # a function call, no table of its own
    assert grants("job_keys") == {}
    executes = [
        (title, stmt.as_string(None))
        for title, stmt in plan_roles("s", producer="p", worker="w").statements
        if "enqueue_keyed" in stmt.as_string(None)
    ]
    assert [("producer" in t, "GRANT EXECUTE" in x) for t, x in executes] == [(True, True)]


@pytest.mark.parametrize("schema", ["skiplock", "Mixed_Case"])
def test_script_quotes_every_name(schema: str) -> None:
    text = roles_script(schema, producer="Odd_Producer", worker="w")
    assert f'"{schema}".jobs' in text and '"Odd_Producer"' in text
    assert "PASSWORD" not in text  # no --password-env, no password statement
