"""The `skiplock` command given bad input: one line on stderr, exit 2, no traceback, no secret,
and nothing written.  Real processes against a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skiplock import Queue
from skiplock._roles import ensure_roles

SECRET = "Cli-S3cret-pw"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DSN", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "skiplock.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
    )


def assert_clean_failure(res: subprocess.CompletedProcess[str], expect: str) -> None:
    """Exit 2, one line naming the problem, no traceback, no password anywhere."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("skiplock: error: "), res.stderr
    assert expect in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert SECRET not in res.stderr and SECRET not in res.stdout
    assert res.stdout == ""


def state(admin: psycopg.Connection[Any], schema: str, argv: list[str]) -> dict[str, Any]:
    """Jobs in the test's schema, and which names from the command line (or the default
    role names) exist as schemas or roles.  Other tests create and drop schemas and roles
    on the same server at the same time, so only these names are compared."""
    jobs = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone()
    names = [*argv, f"{schema}_producer", f"{schema}_worker", "public", "postgres"]
    found = admin.execute(
        "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%(n)s)"
        " UNION ALL SELECT rolname FROM pg_roles WHERE rolname = ANY(%(n)s)",
        {"n": names},
    ).fetchall()
    assert jobs is not None
    return {"jobs": int(jobs[0]), "names": sorted(r[0] for r in found)}


@pytest.fixture
def seeded(queue: Queue) -> Queue:
    queue.enqueue({"already": "there"})
    return queue


def _files(tmp: Path) -> dict[str, str]:
    bad_line = tmp / "bad_line.jsonl"
    bad_line.write_text('{"n": 1}\n{"n": 2}\n{"n": 3\n{"n": 4}\n')
    big_line = tmp / "big_line.jsonl"
    big_line.write_text('{"n": 1}\n"' + "x" * 100 + '"\n{"n": 3}\n')
    nul_line = tmp / "nul_line.jsonl"
    nul_line.write_text('{"n": 1}\n{"s": "a\\u0000b"}\n')
    return {"bad_line": str(bad_line), "big_line": str(big_line), "nul_line": str(nul_line)}


CASES: list[tuple[str, list[str], str]] = [
    ("not-json", ["enqueue", "not json"], "payload is not valid JSON"),
    ("trailing-garbage", ["enqueue", '{"a": 1} x'], "payload is not valid JSON"),
    ("nul", ["enqueue", '{"a": "\\u0000"}'], "NUL"),
    (
        "too-big",
        ["enqueue", "--max-payload-bytes", "16", '"' + "x" * 20 + '"'],
        "over the limit of 16",
    ),
    ("zero-limit", ["enqueue", "--max-payload-bytes", "0", "{}"], "max_payload_bytes"),
    ("file-bad-line", ["enqueue", "--file", "{bad_line}"], "line 3 is not valid JSON"),
    (
        "file-big-line",
        ["enqueue", "--max-payload-bytes", "50", "--file", "{big_line}"],
        "payload #1",
    ),
    ("file-nul-line", ["enqueue", "--file", "{nul_line}"], "payload #1: payload contains a NUL"),
    (
        "queue-injection",
        ["enqueue", "--queue", "x'; DROP TABLE jobs; --", "{}"],
        "invalid queue name",
    ),
    ("queue-space", ["enqueue", "--queue", "emails ", "{}"], "invalid queue name"),
    (
        "worker-queue",
        ["worker", "--handler", "os:getcwd", "--queue", "q'; DROP TABLE jobs; --"],
        "invalid queue name",
    ),
    (
        "worker-queue-fresh-schema",
        ["worker", "--handler", "os:getcwd", "--queue", "a b", "--schema", "fresh_never_x"],
        "invalid queue name",
    ),
    (
        "schema-injection",
        ["enqueue", "--schema", 'x"; DROP SCHEMA public CASCADE; --', "{}"],
        "invalid schema name",
    ),
    ("priority-range", ["enqueue", "--priority", "99999999999", "{}"], "priority must be"),
    ("attempts-zero", ["enqueue", "--max-attempts", "0", "{}"], "max_attempts"),
    ("attempts-range", ["enqueue", "--max-attempts", "3000000000", "{}"], "max_attempts"),
    ("long-key", ["enqueue", "--key", "k" * 600, "{}"], "idempotency key"),
    ("unmigrated-status", ["status", "--schema", "never_migrated_x"], "skiplock migrate"),
    ("unmigrated-enqueue", ["enqueue", "--schema", "never_migrated_x", "{}"], "skiplock migrate"),
    (
        "audit-injection",
        ["verify", "--audit-table", "jobs; DROP TABLE x", "--key-column", "id"],
        "not found",
    ),
    (
        "audit-column",
        ["verify", "--audit-table", "{schema}.jobs", "--key-column", "id; --"],
        "no key column",
    ),
    (
        "bad-window",
        ["verify", "--audit-table", "x", "--key-column", "y", "--window", "7x"],
        "invalid window",
    ),
    ("role-injection", ["roles", "--producer", 'x"; DROP ROLE postgres; --'], "invalid role name"),
    ("role-reserved", ["roles", "--worker", "pg_monitor"], "reserved"),
    (
        "password-env-unset",
        ["roles", "--login", "--password-env", "NO_SUCH_VAR_X"],
        "NO_SUCH_VAR_X",
    ),
]


@pytest.mark.parametrize(("args", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    dsn: str,
    seeded: Queue,
    admin: psycopg.Connection[Any],
    tmp_path: Path,
    args: list[str],
    expect: str,
) -> None:
    subs = {**_files(tmp_path), "schema": seeded.schema}
    argv = list(args)
    for key, value in subs.items():
        argv = [a.replace("{" + key + "}", value) for a in argv]
    if "--schema" not in argv:
        argv += ["--schema", seeded.schema]
    before = state(admin, seeded.schema, argv)
    assert_clean_failure(cli(*argv, "--dsn", with_password(dsn)), expect)
    assert state(admin, seeded.schema, argv) == before


def with_password(dsn: str) -> str:
    return make_conninfo(dsn, password=SECRET)


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["status"], "cannot reach PostgreSQL"),
        (["migrate"], "cannot reach PostgreSQL"),
        (["enqueue", "{}"], "cannot reach PostgreSQL"),
        (["verify"], "cannot reach PostgreSQL"),
        (["roles"], "cannot reach PostgreSQL"),
        (["worker", "--handler", "os:getcwd"], "cannot reach PostgreSQL"),
    ],
)
def test_unreachable_server_never_shows_the_password(args: list[str], expect: str) -> None:
    res = cli(*args, "--dsn", f"postgresql://u:{SECRET}@127.0.0.1:1/x")
    assert_clean_failure(res, expect)
    assert "u:***@127.0.0.1:1" in res.stderr or "password=***" in res.stderr


@pytest.mark.parametrize(
    "bad_dsn",
    [
        f"postgresql://u:{SECRET}@[bad/x",
        f"host=db password={SECRET} = = bogus",
        f"postgresql://u:{SECRET}@host/db?x",
    ],
)
def test_malformed_dsn_never_shows_the_password(bad_dsn: str) -> None:
    assert_clean_failure(cli("status", "--dsn", bad_dsn), "malformed DSN")


@pytest.mark.parametrize(("key", "value"), [("dbname", "no_such_db_x"), ("user", "no_such_user_x")])
def test_unknown_database_or_role(dsn: str, key: str, value: str) -> None:
    res = cli("status", "--dsn", make_conninfo(with_password(dsn), **{key: value}))
    assert_clean_failure(res, f'"{value}" does not exist')


@pytest.fixture
def worker_role(dsn: str, queue: Queue, admin: psycopg.Connection[Any]) -> Iterator[str]:
    tag = uuid.uuid4().hex[:8]
    p, w = f"t_{tag}_p", f"t_{tag}_w"
    ensure_roles(admin, queue.schema, producer=p, worker=w, login=True)
    try:
        yield make_conninfo(dsn, user=w, password=SECRET)
    finally:
        for role in (p, w):
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        # An unkeyed enqueue first reserves its id (retry safety): the sequence refuses.
        (["enqueue", "{}"], "permission denied for sequence jobs_id_seq"),
        (["prune", "--older-than", "0"], "permission denied for function drop_finished"),
        (["migrate"], "--no-migrate"),
        (["worker", "--handler", "os:getcwd"], "--no-migrate"),
        (["roles"], "cannot set up roles"),
    ],
)
def test_the_worker_role_is_refused_clearly(
    seeded: Queue, worker_role: str, admin: psycopg.Connection[Any], args: list[str], expect: str
) -> None:
    before = state(admin, seeded.schema, args)
    res = cli(*args, "--dsn", worker_role, "--schema", seeded.schema)
    assert_clean_failure(res, expect)
    assert state(admin, seeded.schema, args) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pause", "nope"], "unknown queue 'nope'"),
        (["resume", "nope"], "unknown queue 'nope'"),
        (
            ["limit", "nope", "--concurrency", "2"],
            "skiplock: error: unknown queue 'nope': it has no jobs and no settings; "
            "pass --create to set it up before its first job",
        ),
        (["limit", "mail", "--concurrency", "0"], "not 0"),
        (["limit", "mail", "--concurrency", "-4"], "not -4"),
        (["limit", "mail", "--rate", "-2"], "not -2.0"),
        (["limit", "mail", "--rate", "nan"], "not nan"),
        (["cancel", "99999"], "no job with id 99999"),
        (["result", "99999", "--timeout", "1"], "no job with id 99999"),
    ],
)
def test_control_commands_refuse_bad_input_with_exit_2_and_change_nothing(
    queue: Queue, args: list[str], message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "skiplock.cli", *args, "--schema", queue.schema],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SKIPLOCK_DSN": queue.settings.dsn},
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert queue.queue_settings() == []
