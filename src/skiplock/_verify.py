"""`skiplock verify`: the postmortem's production checks, one exit code for cron or deploys."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql
from psycopg.rows import dict_row

from ._config import validate_schema
from ._errors import ConfigError, DatabaseUnavailable, SkiplockError, one_line
from ._sql import _read, parse_named

__all__ = ["AuditSpec", "Check", "Report", "parse_window", "verify"]

WORKER_APP_PATTERN = "skiplock-worker:%"

_WINDOW_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


@functools.cache
def _blocks() -> dict[str, str]:
    return parse_named(_read("verify.sql"))


def _stmt(name: str, **idents: sql.Composable) -> sql.Composed:
    return sql.SQL(_blocks()[name]).format(**idents)


def parse_window(text: str) -> float | None:
    """Seconds in a window such as ``7d``, ``12h``, ``30m``, ``90s`` or ``3600``.

    ``all`` means no window (None).  Anything else raises ConfigError.
    """
    if text.strip().lower() == "all":
        return None
    m = _WINDOW_RE.fullmatch(text)
    if not m or float(m[1]) <= 0:
        raise ConfigError(
            f"invalid window {text!r}: use a positive number with s, m, h, d or w, or 'all'"
        )
    return float(m[1]) * _UNITS[m[2]]


@dataclass(frozen=True)
class AuditSpec:
    """The user's own record of side effects, e.g. ``invoice_emails(job_id, created_at)``.

    ``table`` may be schema-qualified and follows SQL's rules (unquoted names fold to
    lower case); ``key_column`` and ``time_column`` are exact column names.  A
    ``window`` of None checks the whole table.
    """

    table: str
    key_column: str
    time_column: str = "created_at"
    window: float | None = 7 * 86400.0


@dataclass
class Check:
    """One check's outcome: ``ok``, ``fail``, ``warn`` (could not fully check) or ``skip``."""

    name: str
    status: str
    count: int
    summary: str
    details: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Report:
    """All checks of one run; ``exit_code`` is 1 when any check failed, else 0."""

    schema: str
    dsn: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "schema": self.schema,
            "dsn": self.dsn,
            "checks": [asdict(c) for c in self.checks],
        }

    def render(self, max_details: int = 5) -> str:
        """Human-readable report: one line per check, then a few sample rows."""
        lines = [f"skiplock verify: schema {self.schema} on {self.dsn}"]
        for c in self.checks:
            lines.append(f"{c.status.upper():<5} {c.name:<18} {c.summary}")
            for d in c.details[:max_details]:
                lines.append("        " + _detail_line(d))
            if len(c.details) > max_details:
                lines.append(f"        ... {len(c.details) - max_details} more sample(s)")
        failed = [c.name for c in self.checks if c.status == "fail"]
        lines.append(f"result: FAIL ({', '.join(failed)})" if failed else "result: OK")
        return "\n".join(lines)


def _detail_line(d: dict[str, Any]) -> str:
    parts = []
    for k, v in d.items():
        if v is None or v == "":
            continue
        if isinstance(v, float):
            v = f"{v:.1f}"
        text = str(v).strip().splitlines()
        parts.append(f"{k}={text[-1] if text else ''}")
    return " ".join(parts)


def verify(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    dsn_shown: str = "",
    grace: float = 60.0,
    attempts_alert: int = 3,
    lock_waits_alert: int = 2,
    samples: int = 5,
    sample_interval: float = 0.2,
    workers: str = WORKER_APP_PATTERN,
    audit: AuditSpec | None = None,
    limit: int = 20,
) -> Report:
    """Run the production checks of the postmortem against one skiplock schema.

    Parameters
    ----------
    conn
        An autocommit connection; any role that may SELECT from the jobs table (the
        worker role of `skiplock roles` will do), plus SELECT on the audit table.
        Seeing other roles' wait events needs ``pg_read_all_stats``.
    schema
        The skiplock schema.
    dsn_shown
        The (redacted) DSN to print in the report.
    grace
        Seconds a running job may be past its lease before it counts: the sweeper's
        slack.  Workers sweep every couple of seconds.
    attempts_alert
        Live jobs (pending, running) with at least this many attempts fail the check.
    lock_waits_alert
        Fail when this many worker sessions wait on a heavyweight lock in one sample.
    samples, sample_interval
        How many ``pg_stat_activity`` samples to take, and how far apart (seconds).
    workers
        LIKE pattern of the worker sessions' ``application_name``; every skiplock
        worker is ``skiplock-worker:<name>``, so ``skiplock-worker:billing-%`` picks
        one service's workers.
    audit
        The user's audit table, checked for keys recorded more than once.
    limit
        Sample rows kept per check.

    Returns
    -------
    Report
        ``report.exit_code`` is 0 when every check passed (or was skipped or could
        only warn), 1 otherwise.

    Raises
    ------
    ConfigError
        The schema is not migrated, the audit table or a column does not exist, or a
        privilege is missing.
    DatabaseUnavailable
        The connection failed.
    """
    validate_schema(schema)
    if grace < 0 or attempts_alert < 1 or lock_waits_alert < 1 or samples < 1 or limit < 1:
        raise ConfigError(
            "grace must be >= 0; attempts-alert, lock-waits-alert, samples and limit >= 1"
        )
    ident = sql.Identifier(schema)
    checks: list[Check] = []
    step = "schema"
    try:
        cur = conn.cursor(row_factory=dict_row)
        shape = cur.execute(_stmt("jobs_table"), {"schema": schema}).fetchone()
        if not shape or not shape["migrated"]:
            raise ConfigError(f"skiplock schema {schema!r} is missing or not migrated")
        runs: list[tuple[str, Callable[[], Check]]] = [
            ("expired_leases", lambda: _expired(cur, ident, grace, limit)),
            ("high_attempts", lambda: _attempts(cur, ident, attempts_alert, limit)),
            (
                "completed_twice",
                lambda: _twice(cur, ident, limit, bool(shape["has_completions"])),
            ),
            ("stranded_waiting", lambda: _stranded(cur, ident, limit, bool(shape["has_deps"]))),
            (
                "lock_waits",
                lambda: _lock_waits(cur, workers, lock_waits_alert, samples, sample_interval),
            ),
            ("audit_duplicates", lambda: _audit(cur, audit, limit)),
        ]
        for name, run in runs:
            step = name  # named in the error if this check's statement fails
            checks.append(run())
    except pgerrors.InsufficientPrivilege as exc:
        raise ConfigError(f"verify {step}: {exc.diag.message_primary or exc}") from None
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"verify {step}: {one_line(exc)}") from None
    except psycopg.Error as exc:
        raise SkiplockError(f"verify {step}: {one_line(exc)}") from None
    return Report(schema=schema, dsn=dsn_shown, checks=checks)


def _rows(
    cur: psycopg.Cursor[Any], stmt: sql.Composed, params: dict[str, Any]
) -> tuple[int, list[dict[str, Any]]]:
    rows = cur.execute(stmt, params).fetchall()
    total = int(rows[0]["total"]) if rows else 0
    for r in rows:
        r.pop("total", None)
    return total, rows


def _expired(cur: psycopg.Cursor[Any], ident: sql.Identifier, grace: float, limit: int) -> Check:
    n, rows = _rows(
        cur, _stmt("expired_leases", schema=ident), {"grace": float(grace), "limit": limit}
    )
    if not n:
        return Check(
            "expired_leases", "ok", 0, f"no running job is past its lease by more than {grace:g}s"
        )
    return Check(
        "expired_leases",
        "fail",
        n,
        f"{n} running job(s) past their lease by more than {grace:g}s: no worker is sweeping",
        rows,
    )


def _attempts(cur: psycopg.Cursor[Any], ident: sql.Identifier, alert: int, limit: int) -> Check:
    n, rows = _rows(
        cur, _stmt("high_attempts", schema=ident), {"attempts_alert": alert, "limit": limit}
    )
    if not n:
        return Check("high_attempts", "ok", 0, f"no live job has {alert} or more attempts")
    return Check("high_attempts", "fail", n, f"{n} live job(s) with {alert} or more attempts", rows)


def _twice(cur: psycopg.Cursor[Any], ident: sql.Identifier, limit: int, recorded: bool) -> Check:
    if not recorded:
        return Check(
            "completed_twice",
            "warn",
            0,
            "not recorded: the schema predates migration 2; run `skiplock migrate`",
        )
    n, rows = _rows(cur, _stmt("completed_twice", schema=ident), {"limit": limit})
    if not n:
        return Check("completed_twice", "ok", 0, "no job was completed more than once")
    return Check(
        "completed_twice",
        "fail",
        n,
        f"{n} job(s) completed more than once (a finished job was moved back and rerun)",
        rows,
    )


def _stranded(cur: psycopg.Cursor[Any], ident: sql.Identifier, limit: int, has: bool) -> Check:
    if not has:
        return Check("stranded_waiting", "ok", 0, "no dependencies: the schema predates 16")
    n, rows = _rows(cur, _stmt("stranded_waiting", schema=ident), {"limit": limit})
    if not n:
        return Check("stranded_waiting", "ok", 0, "every waiting job has a parent to wait for")
    return Check(
        "stranded_waiting",
        "fail",
        n,
        f"{n} waiting job(s) whose parents have all finished: a release was lost",
        rows,
    )


def _lock_waits(
    cur: psycopg.Cursor[Any], pattern: str, alert: int, samples: int, interval: float
) -> Check:
    by_event: dict[tuple[str, str], int] = {}
    sessions = hidden = waiting = 0
    for i in range(samples):
        if i:
            time.sleep(interval)
        rows = cur.execute(_stmt("worker_sessions"), {"pattern": pattern}).fetchall()
        counts: dict[tuple[str, str], int] = {}
        for r in rows:
            key = (r["wait_event_type"] or "-", r["wait_event"] or "-")
            counts[key] = counts.get(key, 0) + 1
        for key, c in counts.items():
            by_event[key] = max(by_event.get(key, 0), c)
        sessions = max(sessions, len(rows))
        hidden = max(hidden, sum(1 for r in rows if r["hidden"]))
        waiting = max(waiting, sum(1 for r in rows if r["wait_event_type"] == "Lock"))
    details = [
        {"wait_event_type": t, "wait_event": e, "max_sessions": c}
        for (t, e), c in sorted(by_event.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    seen = f"{sessions} worker session(s) in {samples} sample(s)"
    if waiting >= alert:
        return Check(
            "lock_waits",
            "fail",
            waiting,
            f"{seen}; up to {waiting} waiting on a lock at once: claims are serialising",
            details,
        )
    if hidden:
        return Check(
            "lock_waits",
            "warn",
            waiting,
            f"{seen}; {hidden} belong to other roles and hide their wait events "
            "(grant pg_read_all_stats to the role running verify)",
            details,
        )
    return Check(
        "lock_waits",
        "ok",
        waiting,
        f"{seen}; "
        + (f"up to {waiting} waiting on a lock" if waiting else "none waiting on a lock"),
        details,
    )


def _resolve(cur: psycopg.Cursor[Any], table: str) -> tuple[int, str, str]:
    try:
        row = cur.execute(_stmt("audit_relation"), {"table": table}).fetchone()
    except (pgerrors.InvalidName, pgerrors.SyntaxError, pgerrors.InvalidTextRepresentation):
        row = None  # older servers raise on a name they cannot parse; newer return NULL
    if not row or row["relkind"] not in ("r", "p", "v", "m", "f"):
        raise ConfigError(f"audit table {table!r} not found (or not a table or view)")
    return int(row["oid"]), str(row["nspname"]), str(row["relname"])


def _audit(cur: psycopg.Cursor[Any], spec: AuditSpec | None, limit: int) -> Check:
    if spec is None:
        return Check("audit_duplicates", "skip", 0, "no --audit-table given")
    oid, nsp, rel = _resolve(cur, spec.table)
    columns = {r["attname"] for r in cur.execute(_stmt("audit_columns"), {"oid": oid}).fetchall()}
    for col, what in ((spec.key_column, "key"), (spec.time_column, "time")):
        if what == "time" and spec.window is None:
            continue
        if col not in columns:
            raise ConfigError(
                f"audit table {nsp}.{rel} has no {what} column {col!r} "
                f"(columns: {', '.join(sorted(columns))})"
                + ("; pass --time-column or --window all" if what == "time" else "")
            )
    where: sql.Composable = sql.SQL("")
    if spec.window is not None:
        where = _stmt("audit_window", time=sql.Identifier(spec.time_column))
    stmt = _stmt(
        "audit_duplicates",
        key=sql.Identifier(spec.key_column),
        table=sql.Identifier(nsp, rel),
        where=where,
    )
    n, rows = _rows(cur, stmt, {"limit": limit, "window": spec.window})
    span = "ever" if spec.window is None else f"in the last {_human(spec.window)}"
    if not n:
        return Check(
            "audit_duplicates",
            "ok",
            0,
            f"no {spec.key_column} recorded twice in {nsp}.{rel} {span}",
        )
    return Check(
        "audit_duplicates",
        "fail",
        n,
        f"{n} {spec.key_column} value(s) recorded more than once in {nsp}.{rel} {span}: "
        "a side effect ran twice",
        rows,
    )


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
