"""`skiplock verify`: every check shown passing on healthy data and failing on planted faults."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skiplock import ConfigError, LeaseLost, Queue
from skiplock._roles import ensure_roles
from skiplock._verify import AuditSpec, Check, Report, parse_window, verify
from skiplock.cli import main


def run(queue: Queue, **kwargs: Any) -> Report:
    kwargs.setdefault("samples", 1)
    # Only this test's planted sessions: other tests may run workers on the same server.
    kwargs.setdefault("workers", f"skiplock-worker:none-{queue.schema}")
    with queue.connection() as conn:
        return verify(conn, queue.schema, **kwargs)


def check(report: Report, name: str) -> Check:
    [c] = [c for c in report.checks if c.name == name]
    return c


def jobs_sql(queue: Queue, text: str) -> sql.Composed:
    return sql.SQL(text).format(sql.Identifier(queue.schema))


def test_a_healthy_queue_passes_every_check(queue: Queue) -> None:
    queue.enqueue_many([{"n": i} for i in range(5)])
    jobs = queue.claim(worker="w", limit=3)
    queue.complete(jobs[0])
    queue.fail(jobs[1], "once", delay=0)
    report = run(queue)
    assert [(c.name, c.status) for c in report.checks] == [
        ("expired_leases", "ok"),
        ("high_attempts", "ok"),
        ("completed_twice", "ok"),
        ("stranded_waiting", "ok"),
        ("lock_waits", "ok"),
        ("audit_duplicates", "skip"),
    ]
    assert report.ok and report.exit_code == 0
    assert report.render().endswith("result: OK")


# -- expired leases ----------------------------------------------------------------------


def test_expired_leases_pass_within_grace_and_fail_beyond(queue: Queue, admin: Any) -> None:
    _, b = queue.enqueue_many([{}, {}])
    queue.claim(worker="stuck-host-1", limit=2)
    admin.execute(
        jobs_sql(queue, "UPDATE {}.jobs SET locked_until = now() - interval '30 seconds'")
    )
    assert check(run(queue, grace=60), "expired_leases").status == "ok"
    admin.execute(
        jobs_sql(
            queue, "UPDATE {}.jobs SET locked_until = now() - interval '5 minutes' WHERE id = %s"
        ),
        (b,),
    )
    report = run(queue, grace=60)
    c = check(report, "expired_leases")
    assert (c.status, c.count) == ("fail", 1) and report.exit_code == 1
    assert c.details[0]["id"] == b and c.details[0]["worker"] == "stuck-host-1"
    assert c.details[0]["overdue_seconds"] > 290
    assert check(run(queue, grace=0), "expired_leases").count == 2
    # The sweeper is the cure: after it, the check passes again.
    queue.sweep()
    assert check(run(queue, grace=0), "expired_leases").status == "ok"


# -- attempts ----------------------------------------------------------------------------


def test_high_attempts_counts_live_jobs_only(queue: Queue, admin: Any) -> None:
    live, finished, young = queue.enqueue_many([{}, {}, {}], max_attempts=10)
    admin.execute(jobs_sql(queue, "UPDATE {}.jobs SET attempts = 2 WHERE id = %s"), (young,))
    admin.execute(
        jobs_sql(
            queue,
            "UPDATE {}.jobs SET attempts = 7, status = 'done', finished_at = now() WHERE id = %s",
        ),
        (finished,),
    )
    assert check(run(queue), "high_attempts").status == "ok"
    admin.execute(
        jobs_sql(
            queue,
            "UPDATE {}.jobs SET attempts = 3, last_error = 'Traceback...\nTimeoutError: smtp'"
            " WHERE id = %s",
        ),
        (live,),
    )
    c = check(run(queue), "high_attempts")
    assert (c.status, c.count) == ("fail", 1)
    assert c.details[0]["id"] == live and c.details[0]["attempts"] == 3
    assert check(run(queue, attempts_alert=2), "high_attempts").count == 2
    assert check(run(queue, attempts_alert=4), "high_attempts").status == "ok"


# -- double completion -------------------------------------------------------------------


def test_completed_twice_finds_a_rerun_finished_job(queue: Queue, admin: Any) -> None:
    job_id = queue.enqueue({"invoice": 4815162})
    [job] = queue.claim(worker="a")
    queue.complete(job)
    with contextlib.suppress(LeaseLost):
        queue.complete(job)  # a repeated (retried) completion is not a second completion
    assert check(run(queue), "completed_twice").status == "ok"
    # Plant what the check exists for: a finished job moved back to pending (a manual
    # requeue, a replayed backup, a tool writing to the table), then run to completion
    # again through the normal path.
    admin.execute(
        jobs_sql(queue, "UPDATE {}.jobs SET status = 'pending', finished_at = NULL WHERE id = %s"),
        (job_id,),
    )
    [again] = queue.claim(worker="b")
    queue.complete(again)
    c = check(run(queue), "completed_twice")
    assert (c.status, c.count) == ("fail", 1)
    assert c.details[0]["id"] == job_id and c.details[0]["completions"] == 2


def test_stranded_waiting_finds_a_child_whose_release_was_lost(queue: Queue, admin: Any) -> None:
    parent = queue.enqueue({"n": 1})
    child = queue.enqueue({"n": 2}, after=[parent])
    assert check(run(queue), "stranded_waiting").status == "ok"  # its parent may finish
    [job] = queue.claim(worker="a")
    queue.complete(job)
    assert check(run(queue), "stranded_waiting").status == "ok"  # released
    # Plant what the check exists for: a child put back to waiting with its edge settled,
    # as a release that was lost would leave it.
    admin.execute(
        jobs_sql(queue, "UPDATE {}.jobs SET status = 'waiting', deps_left = 1 WHERE id = %s"),
        (child,),
    )
    c = check(run(queue), "stranded_waiting")
    assert (c.status, c.count) == ("fail", 1) and c.details[0]["id"] == child


def test_completed_twice_warns_on_a_schema_without_the_record(queue: Queue, admin: Any) -> None:
    admin.execute(jobs_sql(queue, "ALTER TABLE {}.jobs DROP COLUMN completions"))
    c = check(run(queue), "completed_twice")
    assert c.status == "warn" and "skiplock migrate" in c.summary
    assert run(queue).exit_code == 0


# -- lock waits --------------------------------------------------------------------------


@contextmanager
def waiting_workers(
    dsn: str, queue: Queue, admin: Any, n: int, tag: str
) -> Iterator[list[psycopg.Connection[Any]]]:
    """``n`` sessions named like workers, blocked behind a row lock the admin holds: what
    the postmortem saw with a plain FOR UPDATE claim."""
    job_id = queue.enqueue({})
    holder = psycopg.connect(dsn)
    holder.execute(jobs_sql(queue, "SELECT id FROM {}.jobs WHERE id = %s FOR UPDATE"), (job_id,))
    conns = [
        psycopg.connect(dsn, autocommit=True, application_name=f"skiplock-worker:{tag}-{i}")
        for i in range(n)
    ]
    threads = [
        threading.Thread(
            target=c.execute,
            args=(jobs_sql(queue, "SELECT id FROM {}.jobs WHERE id = %s FOR UPDATE"), (job_id,)),
        )
        for c in conns
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s"
                " AND wait_event_type = 'Lock'",
                (f"skiplock-worker:{tag}-%",),
            ).fetchone()
            if row[0] == n:
                break
            time.sleep(0.02)
        yield conns
    finally:
        holder.rollback()
        holder.close()
        for t in threads:
            t.join(timeout=10)
        for c in conns:
            c.close()


def test_lock_waits_pass_for_idle_workers_and_fail_for_a_serialising_claim(
    dsn: str, queue: Queue, admin: Any
) -> None:
    tag = f"lw-{uuid.uuid4().hex[:8]}"
    pattern = f"skiplock-worker:{tag}-%"
    idle = [
        psycopg.connect(dsn, autocommit=True, application_name=f"skiplock-worker:{tag}-idle{i}")
        for i in range(3)
    ]
    try:
        c = check(run(queue, workers=pattern, samples=3, sample_interval=0.05), "lock_waits")
        assert c.status == "ok" and "3 worker session(s)" in c.summary
    finally:
        for conn in idle:
            conn.close()
    with waiting_workers(dsn, queue, admin, 3, tag):
        report = run(queue, workers=pattern, samples=2, sample_interval=0.05)
        c = check(report, "lock_waits")
        assert (c.status, c.count) == ("fail", 3) and report.exit_code == 1
        assert "serialising" in c.summary
        locks = {(d["wait_event_type"], d["wait_event"]) for d in c.details}
        assert {t for t, _ in locks} == {"Lock"}
        assert locks <= {("Lock", "transactionid"), ("Lock", "tuple")}
        # Below the alert threshold it is reported, not failed.
        assert check(run(queue, workers=pattern, lock_waits_alert=4), "lock_waits").status == "ok"


def test_lock_waits_warn_when_the_role_cannot_see_other_sessions(
    dsn: str, queue: Queue, admin: Any
) -> None:
    tag = f"lw-{uuid.uuid4().hex[:8]}"
    p, w = f"t_{tag.replace('-', '_')}_p", f"t_{tag.replace('-', '_')}_w"
    ensure_roles(admin, queue.schema, producer=p, worker=w, login=True)
    try:
        with (
            waiting_workers(dsn, queue, admin, 2, tag),
            Queue(make_conninfo(dsn, user=w), schema=queue.schema, max_size=1) as as_worker,
        ):
            # The worker role may run verify (it reads jobs), but without
            # pg_read_all_stats the superuser's sessions hide their wait events.
            c = check(run(as_worker, workers=f"skiplock-worker:{tag}-%"), "lock_waits")
            assert c.status == "warn" and "pg_read_all_stats" in c.summary
    finally:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)",
            ([p, w],),
        )
        for role in (p, w):
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


# -- the user's audit table --------------------------------------------------------------


@pytest.fixture
def audit_table(queue: Queue, admin: Any) -> str:
    admin.execute(
        jobs_sql(
            queue,
            'CREATE TABLE {}."Invoice_Emails" (job_id bigint NOT NULL,'
            " sent_to text, created_at timestamptz NOT NULL DEFAULT now())",
        )
    )
    admin.execute(
        jobs_sql(
            queue,
            "INSERT INTO {}.\"Invoice_Emails\" (job_id, sent_to) SELECT g, 'a@b.c'"
            " FROM generate_series(1, 50) g",
        )
    )
    return f'{queue.schema}."Invoice_Emails"'


def test_audit_duplicates_pass_then_fail_on_a_duplicate_side_effect(
    queue: Queue, admin: Any, audit_table: str
) -> None:
    spec = AuditSpec(audit_table, "job_id")
    c = check(run(queue, audit=spec), "audit_duplicates")
    assert c.status == "ok" and "7d" in c.summary
    # The postmortem's symptom: the same invoice email recorded twice, seconds apart.
    admin.execute(
        jobs_sql(queue, 'INSERT INTO {}."Invoice_Emails" (job_id) VALUES (17), (17), (23)')
    )
    report = run(queue, audit=spec)
    c = check(report, "audit_duplicates")
    assert (c.status, c.count) == ("fail", 2) and report.exit_code == 1
    assert c.details == [{"key": "17", "copies": 3}, {"key": "23", "copies": 2}]


def test_audit_window_limits_the_search(queue: Queue, admin: Any, audit_table: str) -> None:
    admin.execute(
        jobs_sql(
            queue,
            'INSERT INTO {}."Invoice_Emails" (job_id, created_at)'
            " VALUES (5, now() - interval '30 days')",
        )
    )
    week = AuditSpec(audit_table, "job_id", window=parse_window("7d"))
    assert check(run(queue, audit=week), "audit_duplicates").status == "ok"
    ever = check(
        run(queue, audit=AuditSpec(audit_table, "job_id", window=None)), "audit_duplicates"
    )
    assert (ever.status, ever.details) == ("fail", [{"key": "5", "copies": 2}])
    assert "ever" in ever.summary


@pytest.mark.parametrize(
    ("table", "key", "time_column", "match"),
    [
        ("no_such_table", "job_id", "created_at", "not found"),
        ("x; DROP TABLE jobs; --", "job_id", "created_at", "not found"),
        ("pg_catalog.pg_class; SELECT 1", "oid", "created_at", "not found"),
        ("{schema}.invoice_emails", "job_id", "created_at", "not found"),  # case folds
        ('{schema}."Invoice_Emails"', "job_id; DROP TABLE x", "created_at", "no key column"),
        ('{schema}."Invoice_Emails"', "JOB_ID", "created_at", "no key column"),
        ('{schema}."Invoice_Emails"', "job_id", "sent_at", "--window all"),
        ("{schema}.jobs_id_seq", "id", "created_at", "not a table"),
    ],
)
def test_audit_bad_names_are_clear_errors_and_harmless(
    queue: Queue, admin: Any, audit_table: str, table: str, key: str, time_column: str, match: str
) -> None:
    spec = AuditSpec(table.replace("{schema}", queue.schema), key, time_column)
    with pytest.raises(ConfigError, match=match):
        run(queue, audit=spec)
    row = admin.execute(jobs_sql(queue, 'SELECT count(*) FROM {}."Invoice_Emails"')).fetchone()
    assert row == (50,)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7d", 7 * 86400.0),
        ("12h", 43200.0),
        ("30m", 1800.0),
        ("90s", 90.0),
        ("3600", 3600.0),
        ("2w", 14 * 86400.0),
        ("1.5h", 5400.0),
        ("all", None),
        (" ALL ", None),
    ],
)
def test_windows_parse(text: str, seconds: float | None) -> None:
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "7x", "-1d", "0", "7 days; DROP", "d", "1e9"])
def test_bad_windows_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid window"):
        parse_window(text)


# -- the command -------------------------------------------------------------------------


def test_cli_exit_codes_and_json(dsn: str, queue: Queue, admin: Any, audit_table: str) -> None:
    base = [
        "verify",
        "--dsn",
        dsn,
        "--schema",
        queue.schema,
        "--samples",
        "1",
        "--workers",
        f"skiplock-worker:none-{queue.schema}",
    ]
    audit = ["--audit-table", audit_table, "--key-column", "job_id"]
    res = CliRunner().invoke(main, [*base, *audit, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] is True and doc["exit_code"] == 0
    assert [c["status"] for c in doc["checks"]] == ["ok"] * 6
    admin.execute(jobs_sql(queue, 'INSERT INTO {}."Invoice_Emails" (job_id) VALUES (9), (9)'))
    queue.enqueue({})
    queue.claim(worker="gone")
    admin.execute(jobs_sql(queue, "UPDATE {}.jobs SET locked_until = now() - interval '1 hour'"))
    res = CliRunner().invoke(main, [*base, *audit, "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    failed = {c["name"] for c in doc["checks"] if c["status"] == "fail"}
    assert failed == {"expired_leases", "audit_duplicates"}
    res = CliRunner().invoke(main, [*base, *audit])
    assert res.exit_code == 1
    assert res.output.splitlines()[-1] == "result: FAIL (expired_leases, audit_duplicates)"
    assert "FAIL  expired_leases" in res.output and "key=9 copies=3" in res.output
    # Errors are exit 2 with one line: a missing schema, a missing audit table.
    res = CliRunner().invoke(main, ["verify", "--dsn", dsn, "--schema", f"never_{queue.schema}"])
    assert res.exit_code == 2 and "not migrated" in res.output
    res = CliRunner().invoke(main, [*base, "--audit-table", "nope", "--key-column", "id"])
    assert res.exit_code == 2 and res.output.count("\n") == 1
    res = CliRunner().invoke(main, [*base, "--audit-table", "nope"])
    assert res.exit_code == 2 and "go together" in res.output
