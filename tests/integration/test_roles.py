"""`skiplock roles`: skiplock works as the producer and the worker role, and nothing more.

The postmortem's security note: the worker role needs UPDATE on jobs only, not on the
business tables.  Each test creates LOGIN roles of its own (trust authentication: the
DSN only changes ``user=``) and drops them afterwards.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import make_conninfo

from skiplock import ConfigError, DuplicateJob, Job, LeaseLost, Queue, Retry, Worker
from skiplock._roles import default_role_names, ensure_roles, roles_script
from skiplock.cli import main


@dataclass
class Roles:
    producer: str
    worker: str
    producer_dsn: str
    worker_dsn: str


def drop_roles(admin: psycopg.Connection[Any], *names: str) -> None:
    for name in names:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        exists = admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone()
        if exists:
            # DROP OWNED revokes the grants in this database, so DROP ROLE can succeed.
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture
def roles(dsn: str, queue: Queue, admin: psycopg.Connection[Any]) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    producer, worker = f"t_{tag}_producer", f"t_{tag}_worker"
    try:
        assert ensure_roles(admin, queue.schema, producer=producer, worker=worker, login=True) == (
            producer,
            worker,
        )
        yield Roles(
            producer,
            worker,
            make_conninfo(dsn, user=producer),
            make_conninfo(dsn, user=worker),
        )
    finally:
        drop_roles(admin, producer, worker)


@pytest.fixture
def pq(roles: Roles, queue: Queue) -> Iterator[Queue]:
    with Queue(roles.producer_dsn, schema=queue.schema, max_size=2) as q:
        yield q


@pytest.fixture
def wq(roles: Roles, queue: Queue) -> Iterator[Queue]:
    with Queue(roles.worker_dsn, schema=queue.schema, max_size=4) as q:
        yield q


def ident(schema: str) -> sql.Identifier:
    return sql.Identifier(schema)


def count_jobs(admin: psycopg.Connection[Any], schema: str) -> int:
    row = admin.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(ident(schema))).fetchone()
    assert row is not None
    return int(row[0])  # type: ignore[call-overload]


def denied(dsn: str, statement: sql.Composable) -> str:
    """Run ``statement`` as the role of ``dsn``; return the server's refusal."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
            conn.execute(statement)
        return str(err.value)


# -- the role definitions ----------------------------------------------------------------


def test_roles_are_idempotent_and_the_sequence_name_holds(
    queue: Queue, roles: Roles, admin: psycopg.Connection[Any]
) -> None:
    for _ in range(2):  # re-running changes nothing and raises nothing
        ensure_roles(admin, queue.schema, producer=roles.producer, worker=roles.worker)
    seq = admin.execute(
        "SELECT pg_get_serial_sequence(format('%%I.jobs', %s::text), 'id')", (queue.schema,)
    ).fetchone()
    # roles.sql names the identity sequence statically so that --print-sql needs no server.
    assert seq == (f"{queue.schema}.jobs_id_seq",)
    rows = admin.execute(
        "SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb "
        "FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname",
        ([roles.producer, roles.worker],),
    ).fetchall()
    assert rows == [
        (roles.producer, True, False, False, False),
        (roles.worker, True, False, False, False),
    ]


def test_default_names_follow_the_schema() -> None:
    assert default_role_names() == ("skiplock_producer", "skiplock_worker")
    assert default_role_names("billing") == ("billing_producer", "billing_worker")


def test_concurrent_role_setup_does_not_collide(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Two deploys running `skiplock roles` at once: CREATE ROLE has no IF NOT EXISTS."""
    tag = uuid.uuid4().hex[:8]
    names = (f"t_{tag}_p", f"t_{tag}_w")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                ensure_roles(conn, queue.schema, producer=names[0], worker=names[1])
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
    finally:
        drop_roles(admin, *names)


def test_superuser_targets_and_unprivileged_runners_are_refused(
    dsn: str, queue: Queue, roles: Roles, admin: psycopg.Connection[Any]
) -> None:
    user = admin.execute("SELECT current_user").fetchone()
    assert user is not None
    with pytest.raises(ConfigError, match="superuser"):
        ensure_roles(admin, queue.schema, producer=str(user[0]), worker=roles.worker)
    # A role that may not create roles.
    with (
        psycopg.connect(roles.worker_dsn, autocommit=True) as conn,
        pytest.raises(ConfigError, match="cannot set up roles: permission denied"),
    ):
        ensure_roles(conn, queue.schema, producer=roles.producer, worker=roles.worker)
    # A role that may create roles and holds both roles' privileges, but not their grant
    # options: the server refuses its GRANTs with a mere WARNING, which must not pass for
    # success.
    deputy = f"{roles.worker}_deputy"
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE").format(sql.Identifier(deputy)))
    try:
        admin.execute(
            sql.SQL("GRANT {}, {} TO {}").format(
                sql.Identifier(roles.producer),
                sql.Identifier(roles.worker),
                sql.Identifier(deputy),
            )
        )
        with (
            psycopg.connect(make_conninfo(dsn, user=deputy), autocommit=True) as conn,
            pytest.raises(ConfigError, match="no privileges were granted"),
        ):
            ensure_roles(conn, queue.schema, producer=roles.producer, worker=roles.worker)
    finally:
        drop_roles(admin, deputy)


def test_unmigrated_schema_is_a_clear_error(admin: psycopg.Connection[Any]) -> None:
    tag = uuid.uuid4().hex[:8]
    try:
        with pytest.raises(ConfigError, match="skiplock migrate"):
            ensure_roles(admin, f"never_{tag}", producer=f"t_{tag}_p", worker=f"t_{tag}_w")
        # Nothing was left behind: the whole setup is one transaction.
        assert (
            admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (f"t_{tag}_p",)).fetchone()
            is None
        )
    finally:
        drop_roles(admin, f"t_{tag}_p", f"t_{tag}_w")


@pytest.mark.parametrize(
    "name", ['x"; DROP ROLE postgres; --', "pg_monitor", "a b", "", "a" * 64, "1x", "r\x00"]
)
def test_hostile_role_names_are_refused(admin: psycopg.Connection[Any], name: str) -> None:
    before = admin.execute("SELECT count(*) FROM pg_roles").fetchone()
    with pytest.raises(ConfigError, match="role name"):
        ensure_roles(admin, "skiplock", producer=name)
    with pytest.raises(ConfigError, match="role name"):
        roles_script("skiplock", worker=name)
    assert admin.execute("SELECT count(*) FROM pg_roles").fetchone() == before


def _scram_matches(verifier: str, password: str) -> bool:
    """Check a SCRAM-SHA-256 verifier against a password (RFC 5802, RFC 7677)."""
    method, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$")
    iterations, salt = iterations_salt.split(":")
    stored_key, server_key = (base64.b64decode(k) for k in keys.split(":"))
    salted = hashlib.pbkdf2_hmac(
        "sha256", password.encode(), base64.b64decode(salt), int(iterations)
    )
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    return (
        method == "SCRAM-SHA-256"
        and hashlib.sha256(client_key).digest() == stored_key
        and hmac.new(salted, b"Server Key", "sha256").digest() == server_key
    )


def test_passwords_are_hashed_on_the_client(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    tag = uuid.uuid4().hex[:8]
    p, w = f"t_{tag}_p", f"t_{tag}_w"
    seen: list[str] = []
    # A statement log would show what the server received: catch it on the wire instead.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: seen.append(d.message_primary or ""))
        original = conn.execute

        def spy(query: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(query.as_string(conn) if hasattr(query, "as_string") else str(query))
            return original(query, *args, **kwargs)

        conn.execute = spy  # type: ignore[method-assign]
        try:
            ensure_roles(
                conn,
                queue.schema,
                producer=p,
                worker=w,
                login=True,
                passwords={p: "pr0ducer-secret", w: "w0rker-secret"},
            )
            rows = dict(
                admin.execute(
                    "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = ANY(%s)", ([p, w],)
                ).fetchall()
            )
            assert _scram_matches(rows[p], "pr0ducer-secret")
            assert _scram_matches(rows[w], "w0rker-secret")
            assert rows[p] != rows[w]
            sent = "\n".join(seen)
            assert "SCRAM-SHA-256$" in sent
            assert "pr0ducer-secret" not in sent and "w0rker-secret" not in sent
        finally:
            drop_roles(admin, p, w)


# -- the producer --------------------------------------------------------------------------


def test_producer_enqueues_every_way_and_notifies(
    pq: Queue, roles: Roles, queue: Queue, admin: psycopg.Connection[Any], dsn: str
) -> None:
    s = ident(queue.schema)
    # The trigger function runs as the producer; EXECUTE on it is checked only when the
    # trigger is created, so the producer notifies even with EXECUTE revoked from PUBLIC.
    admin.execute(sql.SQL("REVOKE EXECUTE ON FUNCTION {}.notify_enqueued() FROM PUBLIC").format(s))
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"skiplock_{queue.schema}")))
        one = pq.enqueue({"n": 1}, queue="mail")
        note = next(listener.notifies(timeout=5, stop_after=1))
        assert note.payload == "mail"
    keyed = pq.enqueue({"n": 2}, idempotency_key="k1")
    assert pq.enqueue({"n": 2}, idempotency_key="k1") == keyed  # dedup reads id and key
    many = pq.enqueue_many([{"n": i} for i in range(3, 6)])
    # Unique jobs (migration 0017): the holder's payload is compared, replaced, and a
    # lapsed key passed on, all through enqueue_keyed, which the producer may execute.
    with pytest.raises(DuplicateJob, match=f"held by job {keyed}"):
        pq.enqueue({"n": 3}, idempotency_key="k1")
    assert pq.enqueue({"n": 6}, idempotency_key="k1", on_conflict="replace") == keyed
    keyed_many = pq.enqueue_many([{"n": 6}, {"n": 7}], idempotency_keys=["k1", "k2"])
    assert keyed_many[0] == keyed
    later = pq.enqueue_many([{"n": 8}], run_at=datetime.now(UTC) + timedelta(hours=1))
    with psycopg.connect(roles.producer_dsn) as app:  # in the caller's transaction
        pq.enqueue({"n": 9}, conn=app)
    ids = {one, keyed, *many, *keyed_many, *later}
    assert count_jobs(admin, queue.schema) == len(ids) + 1


def test_producer_cannot_claim_read_payloads_or_plant_jobs(
    pq: Queue, roles: Roles, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    s = ident(queue.schema)
    job_id = pq.enqueue({"secret": "customer data"})
    with pytest.raises(ConfigError, match="permission denied"):
        pq.claim(worker="p")
    with pytest.raises(ConfigError, match="permission denied"):
        pq.get(job_id)
    with pytest.raises(ConfigError, match="permission denied"):
        pq.prune(older_than=0)
    denied(roles.producer_dsn, sql.SQL("SELECT payload FROM {}.jobs").format(s))
    denied(roles.producer_dsn, sql.SQL("UPDATE {}.jobs SET status = 'done'").format(s))
    denied(roles.producer_dsn, sql.SQL("DELETE FROM {}.jobs").format(s))
    # A producer cannot plant a job that looks claimed or finished.
    denied(
        roles.producer_dsn,
        sql.SQL(
            "INSERT INTO {}.jobs (payload, status, worker, lease_token, locked_until) "
            "VALUES ('{{}}', 'running', 'x', gen_random_uuid(), now() + interval '1 day')"
        ).format(s),
    )
    job = queue.get(job_id)
    assert job is not None and job.status == "pending" and count_jobs(admin, queue.schema) == 1


# -- the worker ----------------------------------------------------------------------------


def test_worker_role_runs_every_consumer_operation(
    wq: Queue, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    s = ident(queue.schema)
    queue.enqueue_many([{"n": i} for i in range(5)])
    jobs = wq.claim(worker="w", limit=5, lease=30)
    assert len(jobs) == 5
    a, b, c, d, e = jobs
    assert wq.heartbeat(a, lease=60) > datetime.now(UTC)
    wq.complete(a)
    assert wq.fail(b, "boom", delay=0) == "pending"
    assert wq.fail(c, "fatal", retry=False) == "failed"
    wq.release(d)
    with pytest.raises(LeaseLost):
        wq.complete(d)  # fenced: released, so its token is stale
    # An expired lease goes back through the sweeper, run as the worker.
    admin.execute(
        sql.SQL(
            "UPDATE {}.jobs SET locked_until = now() - interval '1 minute' WHERE id = %s"
        ).format(s),
        (e.id,),
    )
    assert wq.sweep() == 1
    assert wq.cancel(e.id)
    got = wq.get(a.id)
    assert got is not None and got.status == "done"
    assert {r["status"]: r["jobs"] for r in wq.status()} == {
        "cancelled": 1,
        "done": 1,
        "failed": 1,
        "pending": 2,
    }


@pytest.mark.connections(24)
def test_worker_runs_end_to_end_as_the_worker_role(
    wq: Queue, pq: Queue, queue: Queue, admin: psycopg.Connection[Any], roles: Roles
) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def handler(job: Job) -> None:
        with lock:
            seen.append(job.payload["n"])
        if job.payload["n"] % 10 == 0 and job.attempts == 1:
            raise Retry(delay=0)

    pq.enqueue_many([{"n": i} for i in range(100)])
    w = Worker(wq, handler, concurrency=4, lease=5, poll_interval=0.05, sweep_interval=0.2)
    t = w.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if {r["status"]: r["jobs"] for r in queue.status()} == {"done": 100}:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"not drained: {queue.status()}")
    finally:
        w.stop()
        t.join(timeout=30)
    assert sorted(set(seen)) == list(range(100)) and len(seen) == 110
    assert w.stats.db_errors == 0 and w.stats.completed == 100
    users = admin.execute(
        "SELECT DISTINCT usename FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"skiplock-worker:{w.name}%",),
    ).fetchall()
    assert set(users) <= {(roles.worker,)}


def test_worker_role_cannot_touch_business_tables_or_delete_or_insert(
    wq: Queue, roles: Roles, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    s = ident(queue.schema)
    # A business table in the very schema the worker may use: USAGE on a schema grants
    # nothing on its tables.
    admin.execute(sql.SQL("CREATE TABLE {}.invoices (id int, customer text)").format(s))
    admin.execute(sql.SQL("INSERT INTO {}.invoices VALUES (1, 'ACME')").format(s))
    queue.enqueue_many([{"n": 1}, {"n": 2}])
    for statement in (
        sql.SQL("SELECT * FROM {}.invoices").format(s),
        sql.SQL("UPDATE {}.invoices SET customer = 'x'").format(s),
        sql.SQL("DELETE FROM {}.jobs").format(s),
        sql.SQL("TRUNCATE {}.jobs").format(s),
        sql.SQL("INSERT INTO {}.jobs (payload) VALUES ('{{}}')").format(s),
        # Nor rewrite the work handed to the other workers.
        sql.SQL("UPDATE {}.jobs SET payload = '{{\"evil\": 1}}'").format(s),
        sql.SQL("UPDATE {}.jobs SET max_attempts = 1000").format(s),
        sql.SQL("SELECT * FROM {}.migrations").format(s),
        sql.SQL("CREATE TABLE {}.mine (x int)").format(s),
    ):
        assert "permission denied" in denied(roles.worker_dsn, statement)
    with pytest.raises(ConfigError, match="permission denied"):
        wq.enqueue({})
    with pytest.raises(ConfigError, match="permission denied"):
        wq.enqueue_many([{}, {}])
    with pytest.raises(ConfigError, match="permission denied"):
        wq.prune(older_than=0)
    with pytest.raises(ConfigError, match="--no-migrate"):
        wq.migrate()
    assert count_jobs(admin, queue.schema) == 2
    assert admin.execute(sql.SQL("SELECT * FROM {}.invoices").format(s)).fetchall() == [(1, "ACME")]


# -- the command ---------------------------------------------------------------------------


def test_cli_creates_login_roles_with_passwords_from_the_environment(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    tag = uuid.uuid4().hex[:8]
    p, w = f"t_{tag}_p", f"t_{tag}_w"
    args = ["roles", "--dsn", dsn, "--schema", queue.schema, "--producer", p, "--worker", w]
    try:
        res = CliRunner().invoke(
            main,
            [*args, "--login", "--password-env", "T_ROLE_PW", "--json"],
            env={"T_ROLE_PW": "from-env-secret"},
        )
        assert res.exit_code == 0, res.output
        assert "from-env-secret" not in res.output
        assert '"producer": "' + p in res.output
        hashes = admin.execute(
            "SELECT rolpassword FROM pg_authid WHERE rolname = ANY(%s)", ([p, w],)
        ).fetchall()
        assert len(hashes) == 2 and all(_scram_matches(h[0], "from-env-secret") for h in hashes)
        # Missing variable: exit 2, one line, nothing changed.
        res = CliRunner().invoke(main, [*args, "--login", "--password-env", "T_UNSET_PW"], env={})
        assert res.exit_code == 2 and "T_UNSET_PW" in res.output
    finally:
        drop_roles(admin, p, w)


def test_cli_print_sql_needs_no_server_and_shows_no_password() -> None:
    res = CliRunner().invoke(
        main,
        [
            "roles",
            "--print-sql",
            "--dsn",
            "postgresql://nobody:pw@127.0.0.1:1/none",
            "--schema",
            "billing",
            "--login",
            "--password-env",
            "T_ROLE_PW",
        ],
        env={"T_ROLE_PW": "printed-secret"},
    )
    assert res.exit_code == 0, res.output
    assert "printed-secret" not in res.output and "PASSWORD '***'" in res.output
    assert 'GRANT SELECT ON "billing".jobs TO "billing_worker"' in res.output
    assert res.output.count('CREATE ROLE "billing_') == 2
    assert (
        roles_script("billing", login=True, password_roles=("billing_producer", "billing_worker"))
        in res.output
    )


def test_keyed_jobs_run_under_the_least_privilege_roles(
    pq: Queue, wq: Queue, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Per-key concurrency (migration 0018) as the roles: the producer writes the key
    and its limit, its insert's trigger admits one job; the worker's completion admits
    the next (key_admit runs as the schema's owner, so neither role needs more)."""
    first, second = (
        pq.enqueue({"n": n}, concurrency_key="customer:1", concurrency=1) for n in range(2)
    )
    pq.enqueue_many([{"n": 2}], concurrency_key="customer:1", concurrency=1)
    (job,) = wq.claim(worker="w", limit=5, lease=30)
    assert job.id == first
    wq.complete(job)
    (job,) = wq.claim(worker="w", limit=5, lease=30)
    assert job.id == second
    rows = admin.execute(
        sql.SQL("SELECT status, count(*) FROM {}.jobs GROUP BY status").format(ident(queue.schema))
    ).fetchall()
    assert dict(rows) == {"done": 1, "running": 1, "throttled": 1}


def test_rate_limited_jobs_enqueue_under_the_producer_role(
    pq: Queue, queue: Queue, admin: psycopg.Connection[Any]
) -> None:
    """Rate limits (migration 0020) as the producer: it writes the two rate columns, and
    its insert's trigger (rate_slot, run as the schema's owner) takes the key's slots in
    rate_limits, which the role cannot write itself."""
    one = pq.enqueue({"n": 0}, rate_key="api", rate_every=2.0)
    two, three = pq.enqueue_many([{"n": 1}, {"n": 2}], rate_key="api", rate_every=2.0)
    rows = admin.execute(
        sql.SQL(
            "SELECT extract(epoch FROM run_at - min(run_at) OVER ())::float8 FROM {}.jobs "
            "WHERE id = ANY(%s) ORDER BY id"
        ).format(ident(queue.schema)),
        ([one, two, three],),
    ).fetchall()
    assert [r[0] for r in rows] == [0.0, 2.0, 4.0]


def test_dependent_jobs_work_under_the_least_privilege_roles(
    pq: Queue, wq: Queue, queue: Queue, admin: psycopg.Connection[Any], roles: Roles
) -> None:
    """A producer enqueues with `after` (through migration 0016's SECURITY DEFINER
    function, without UPDATE on jobs); a worker's completion releases the child (the
    trigger's function runs as the owner) and the child reads its parent."""
    s = ident(queue.schema)
    parent = pq.enqueue({"n": 1})
    child = pq.enqueue({"n": 2}, after=[parent])
    denied(
        roles.producer_dsn,
        sql.SQL("UPDATE {}.jobs SET has_children = true").format(s),
    )
    [job] = wq.claim(worker="w", limit=5, lease=30)
    wq.complete(job, {"sum": 3})
    [released] = wq.claim(worker="w", limit=5, lease=30)
    assert released.id == child
    assert [p["result"] for p in wq.parent_results(child)] == [{"sum": 3}]
    # Only the producer may call the enqueue function; the worker may not plant jobs.
    denied(
        roles.worker_dsn,
        sql.SQL(
            "SELECT {}.enqueue_graph('{{1}}', '{{q}}', '{{\"{{}}\"}}', '{{0}}', '{{NULL}}', "
            "'{{1}}', '{{NULL}}', '{{NULL}}', '{{}}', '{{}}', '{{}}', '{{}}', NULL, 'c')"
        ).format(s),
    )
