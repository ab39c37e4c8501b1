"""Static audit of job-queue SQL: finds claims that can hand one job to two workers.

``skiplock audit`` is the command line; these are the same checks as a library.
"""

from ._engine import AuditResult, Finding, Related, audit_paths, audit_python, audit_sql
from ._report import render
from ._rules import RULES, Rule
from ._source import Problem

__all__ = [
    "RULES",
    "AuditResult",
    "Finding",
    "Problem",
    "Related",
    "Rule",
    "audit_paths",
    "audit_python",
    "audit_sql",
    "render",
]
