"""`skiplock demo` end to end: real worker processes, a real provider, a real SIGKILL.

The incident must reproduce on every run, not most runs: the demo forces the first claims
of each pair of workers to overlap (see skiplock.demo._workers), so `naive` double-claims
at least one batch per pair whatever the machine's timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg
import pytest

INVOICES = 300
WORKERS = 4
BATCH = 10  # the poll loop's claim size (DemoConfig.batch)


def demo(dsn: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock.cli", "demo", "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ},
    )


def run_json(dsn: str, *args: str) -> dict[str, Any]:
    r = demo(dsn, "--invoices", str(INVOICES), "--workers", str(WORKERS), "--json", *args)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def assert_schema_dropped(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NULL", (schema,)).fetchone()
        assert row == (True,), f"scratch schema {schema} left behind"


def assert_every_job_ran(out: dict[str, Any]) -> None:
    assert out["invoices"] == INVOICES
    assert out["jobs_done"] == INVOICES
    assert out["jobs_failed"] == 0
    assert out["audit_rows"] == INVOICES
    assert out["drain_seconds"] > 0
    assert set(out["jobs_per_worker"]) == {f"w{i}" for i in range(WORKERS)}
    assert sum(out["jobs_per_worker"].values()) == out["provider_requests"]


@pytest.mark.connections(60)
def test_default_emails_every_invoice_exactly_once(dsn: str) -> None:
    out = run_json(dsn)
    assert out["strategy"] == "skip-locked"
    assert out["idempotency"] is True
    assert out["emails_accepted"] == INVOICES
    assert out["duplicate_emails"] == 0
    assert out["invoices_emailed_more_than_once"] == 0
    assert out["audit_duplicates"] == 0
    assert out["audit_error"] is None
    assert out["killed_worker"] is None
    assert_every_job_ran(out)
    # Every worker process took part: the jobs were shared, not drained by one.
    assert all(n > 0 for n in out["jobs_per_worker"].values())
    assert_schema_dropped(dsn, out["schema"])


def test_naive_without_idempotency_is_the_incident(dsn: str) -> None:
    out = run_json(dsn, "--strategy", "naive", "--no-idempotency")
    # Each pair of workers shares at least its first batch, so at least one batch per pair
    # goes out twice.
    assert out["duplicate_emails"] >= BATCH * (WORKERS // 2)
    assert out["emails_accepted"] == INVOICES + out["duplicate_emails"]
    assert out["suppressed_by_idempotency"] == 0
    # The audit table catches every second email, after it went out, with the
    # postmortem's own error.
    assert out["audit_duplicates"] == out["duplicate_emails"]
    assert "invoice_emails_job_id_key" in out["audit_error"]
    assert "duplicate key value violates unique constraint" in out["audit_error"]
    assert_every_job_ran(out)
    assert_schema_dropped(dsn, out["schema"])


def test_naive_with_idempotency_keys_double_claims_but_never_double_sends(dsn: str) -> None:
    out = run_json(dsn, "--strategy", "naive")
    assert out["duplicate_emails"] == 0
    assert out["emails_accepted"] == INVOICES
    # The double claims still happened; the provider absorbed them.
    assert out["suppressed_by_idempotency"] >= BATCH * (WORKERS // 2)
    assert out["provider_requests"] == INVOICES + out["suppressed_by_idempotency"]
    assert out["audit_duplicates"] == 0
    assert_every_job_ran(out)


@pytest.mark.connections(60)
def test_kill_worker_recovers_its_jobs_without_a_second_email(dsn: str) -> None:
    out = run_json(dsn, "--kill-worker")
    killed = out["killed_worker"]
    assert killed is not None
    assert killed["name"] in out["jobs_per_worker"]
    assert killed["pid"] > 0
    # One of its handlers parked mid-job (email sent, job not completed) until the kill,
    # so every run has at least that job to recover and one repeat to suppress.
    assert killed["jobs_held"] >= 1
    assert killed["already_emailed"] >= 1
    # Every job it held ran again elsewhere, after its lease (2 s, heartbeated every
    # 2/3 s) ran out and a sweep gave it back.
    assert killed["jobs_recovered"] == killed["jobs_held"]
    assert 1.0 < killed["ran_again_after_seconds"] < 15
    # Emails it had sent before dying were repeated by the re-runs, and the provider
    # suppressed each repeat by its key.
    assert out["suppressed_by_idempotency"] >= killed["already_emailed"]
    assert out["duplicate_emails"] == 0
    assert out["emails_accepted"] == INVOICES
    assert out["audit_duplicates"] == 0
    assert out["jobs_done"] == INVOICES
    assert_schema_dropped(dsn, out["schema"])


def test_terminal_summary_and_progress(dsn: str) -> None:
    r = demo(dsn, "--invoices", "100", "--workers", "2", "--strategy", "naive", "--no-idempotency")
    assert r.returncode == 0, r.stderr
    assert "duplicate emails" in r.stdout
    assert "customers received the same invoice email more than once" in r.stdout
    text = " ".join(r.stdout.split())  # rich wraps lines to the terminal's width
    assert 'ERROR: duplicate key value violates unique constraint "invoice_emails_job_id_key"' in (
        text
    )
    assert "starting 2 worker processes" in r.stderr  # progress goes to stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kill-worker", "--workers", "1"), "--kill-worker needs at least 2 workers"),
        (("--invoices", "0"), "--invoices"),
        (("--strategy", "optimistic"), "--strategy"),
    ],
)
def test_bad_options_fail_in_one_line(dsn: str, args: tuple[str, ...], message: str) -> None:
    r = demo(dsn, *args, timeout=30)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_database_is_one_line() -> None:
    r = demo("postgresql://nobody@127.0.0.1:1/none", "--invoices", "10", timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("skiplock: error:")
    assert len(r.stderr.strip().splitlines()) == 1
