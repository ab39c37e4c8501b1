"""The audit rules' catalogue: each rule's stable id (SLnnn), name, severity, summary and fix.

The checks that fire them are in ``_checks``; the engine turns a check's hit on a rule id
into a finding that carries the rule from here.  Ids are never reused or renumbered:
reports, ``skiplock: ignore[SL005]`` comments and CI settings name them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PARSE_ERROR", "RULES", "Rule", "Severity"]

Severity = str  # "error", "warning" or "info"


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    severity: Severity
    summary: str
    fix: str


_RULE_LIST = (
    Rule(
        "SL000",
        "unparsable-sql",
        "error",
        "SQL that PostgreSQL's parser rejects, so it could not be audited.",
        "Fix the syntax; placeholders $1, %s, %(name)s, :name and {name} are accepted.",
    ),
    Rule(
        "SL001",
        "claim-condition-not-rechecked",
        "error",
        "The claim condition lives only in a subquery, CTE or joined relation that takes no "
        "row lock, and the UPDATE's own WHERE does not re-check it: two workers claim one row.",
        "Lock the candidates with FOR UPDATE SKIP LOCKED where they are picked, and repeat the "
        "claim condition on the target row in the UPDATE's own WHERE.",
    ),
    Rule(
        "SL002",
        "two-step-claim",
        "error",
        "Candidate rows are SELECTed without a row lock and then UPDATEd by id without "
        "re-checking them: two workers read the same rows and both claim them.",
        "Claim in one statement (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) AND "
        "status = 'pending' RETURNING ...), or add FOR UPDATE SKIP LOCKED to the SELECT and "
        "run both in one transaction.",
    ),
    Rule(
        "SL003",
        "claim-lock-waits",
        "warning",
        "FOR UPDATE without SKIP LOCKED in a claim: correct, but concurrent workers queue "
        "behind one another on the same candidate rows.",
        "Add SKIP LOCKED so concurrent workers take disjoint rows (or NOWAIT to fail fast).",
    ),
    Rule(
        "SL004",
        "advisory-lock-with-limit",
        "warning",
        "An advisory-lock function in the WHERE of a query with LIMIT may lock rows the LIMIT "
        "then discards.",
        "Use FOR UPDATE SKIP LOCKED instead, or take the advisory lock in an outer query over "
        "rows already limited (a MATERIALIZED CTE), preferring pg_try_advisory_xact_lock.",
    ),
    Rule(
        "SL005",
        "claim-without-lease",
        "warning",
        "The claim sets no lease or expiry, so a worker that crashes after claiming strands "
        "the job.",
        "Set a lease in the claim (e.g. locked_until = now() + interval '5 minutes', extended by "
        "heartbeats) and let a sweeper return expired rows to pending.  If crashed workers' jobs "
        "are recovered another way, say so with -- skiplock: ignore[SL005].",
    ),
    Rule(
        "SL006",
        "completion-not-fenced",
        "warning",
        "A completion is fenced only by the job id, not by the claimant or a lease token.",
        "Add the claimant to the WHERE (AND worker = $2, or a lease token set by the claim) "
        "and AND status = 'running'; treat 0 rows updated as a lost lease.",
    ),
    Rule(
        "SL007",
        "claim-without-order",
        "info",
        "The claim's LIMIT has no ORDER BY, so which jobs are taken depends on the plan.",
        "Add ORDER BY (e.g. priority, run_at, id) backed by an index on the claimable rows.",
    ),
    Rule(
        "SL008",
        "claim-shared-lock",
        "warning",
        "A shared row lock (FOR SHARE / FOR KEY SHARE) in a claim does not keep concurrent "
        "claimers apart.",
        "Use FOR UPDATE SKIP LOCKED (or FOR NO KEY UPDATE SKIP LOCKED).",
    ),
    Rule(
        "SL009",
        "claim-candidates-unlocked",
        "warning",
        "Candidates are picked without a row lock; a re-check prevents the double claim, but "
        "concurrent workers collide on the same rows and come back empty.",
        "Add FOR UPDATE SKIP LOCKED to the query that picks the candidates.",
    ),
)
RULES: dict[str, Rule] = {r.id: r for r in _RULE_LIST}
PARSE_ERROR = RULES["SL000"]
