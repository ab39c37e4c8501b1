"""The two claim statements (one-statement `claim`, locked `claim_limited`) set a job's
claim identically: the SET list is written twice in queries.sql, and this keeps it one."""

from __future__ import annotations

import re
from typing import Any

from pglast import ast, parse_sql
from pglast.stream import RawStream

from skiplock.sqlfiles import statements


def _claim_update(name: str) -> Any:
    text = getattr(statements("s"), name).as_string(None)
    text = re.sub(r"%\(\w+\)s", "$1", text).replace("%%", "%")
    [raw] = parse_sql(text)
    for cte in raw.stmt.withClause.ctes:
        if cte.ctename == "claimed":
            assert isinstance(cte.ctequery, ast.UpdateStmt)
            return cte.ctequery
    raise AssertionError(f"{name} has no `claimed` CTE")


def _set_list(update: Any) -> dict[str, str]:
    return {t.name: RawStream()(t.val) for t in update.targetList}


def test_both_claims_set_the_same_columns_the_same_way_but_the_clock() -> None:
    plain, limited = _set_list(_claim_update("claim")), _set_list(_claim_update("claim_limited"))
    assert plain.keys() == limited.keys()
    # claim_limited keeps its times by statement_timestamp(): now() is its transaction's
    # start, before the wait for the queue row.
    same = {k: v.replace("statement_timestamp()", "now()") for k, v in limited.items()}
    assert same == plain


def test_both_claims_recheck_status_on_the_target_row() -> None:
    for name in ("claim", "claim_limited"):
        where = RawStream()(_claim_update(name).whereClause)
        assert "status = 'pending'" in where, name
