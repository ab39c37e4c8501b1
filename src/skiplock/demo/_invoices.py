"""The postmortem's invoicing system: invoices, one email job each, and the audit table.

Everything lives in one scratch schema: skiplock's own tables (migrated by the core) plus
``invoices``, ``invoice_emails`` (the audit table, UNIQUE on ``job_id`` exactly as in the
postmortem) and ``invoice_email_conflicts``, where a worker writes down the unique
violation it hit instead of crashing on it.  A job's payload is the invoice id and
nothing else, as the postmortem's security note asks: the handler reads the customer's
details from ``invoices`` when it runs.
"""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from skiplock import Fail, Job, Queue

from ._provider import KEY_HEADER, WORKER_HEADER

__all__ = ["QUEUE", "InvoiceMailer", "create_tables", "drop_schema", "seed_invoices"]

QUEUE = "invoice-emails"

_TABLES = (
    """
    CREATE TABLE {schema}.invoices (
        id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        customer_email text   NOT NULL,
        amount_cents   bigint NOT NULL CHECK (amount_cents > 0),
        created_at     timestamptz NOT NULL DEFAULT now()
    )
    """,
    # The postmortem's audit table.  The inline UNIQUE gets the constraint name from its
    # error message, invoice_emails_job_id_key.
    """
    CREATE TABLE {schema}.invoice_emails (
        id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        job_id     bigint NOT NULL UNIQUE,
        invoice_id bigint NOT NULL REFERENCES {schema}.invoices (id),
        message_id text   NOT NULL,
        worker     text   NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
    """,
    # What the audit table refused: one row per second email it caught, after the fact.
    """
    CREATE TABLE {schema}.invoice_email_conflicts (
        job_id     bigint NOT NULL,
        invoice_id bigint NOT NULL,
        message_id text   NOT NULL,
        worker     text   NOT NULL,
        error      text   NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
    """,
)

# Amounts vary so the emails are not all alike; deterministic so runs compare.
_SEED = """
INSERT INTO {schema}.invoices (customer_email, amount_cents)
SELECT format('customer-%%s@example.com', g), 500 + (g * 7919) %% 250000
FROM generate_series(1, %(n)s) AS g
ORDER BY g
RETURNING id
"""

_LOAD = "SELECT customer_email, amount_cents FROM {schema}.invoices WHERE id = %(id)s"

_AUDIT = """
INSERT INTO {schema}.invoice_emails (job_id, invoice_id, message_id, worker)
VALUES (%(job_id)s, %(invoice_id)s, %(message_id)s, %(worker)s)
"""

_AUDITED = "SELECT message_id FROM {schema}.invoice_emails WHERE job_id = %(job_id)s"

_CONFLICT = """
INSERT INTO {schema}.invoice_email_conflicts (job_id, invoice_id, message_id, worker, error)
VALUES (%(job_id)s, %(invoice_id)s, %(message_id)s, %(worker)s, %(error)s)
"""


def _q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


def create_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    """Add the invoicing tables to ``schema`` (which the core has already migrated)."""
    with conn.transaction():
        for ddl in _TABLES:
            conn.execute(_q(ddl, schema))


def seed_invoices(conn: psycopg.Connection[Any], schema: str, n: int) -> list[int]:
    """Insert ``n`` invoices; returns their ids in order."""
    rows = conn.execute(_q(_SEED, schema), {"n": n}).fetchall()
    return [int(r[0]) for r in rows]


def drop_schema(conn: psycopg.Connection[Any], schema: str, app_marker: str) -> None:
    """Drop the scratch schema, first ending any session of this run still holding locks."""
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE pid <> pg_backend_pid() AND strpos(application_name, %s) > 0",
        (app_marker,),
    )
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


class InvoiceMailer:
    """The email worker's handler: one invoice email per job, through the provider.

    Parameters
    ----------
    db
        A queue on the demo's schema, used only for its connection pool: the handler
        reads the invoice and writes the audit row on connections of its own.
    provider_url
        The fake provider's base URL.
    worker
        This worker's name, sent to the provider (its logs name the sender, as the
        postmortem's provider logs did) and written to the audit row.
    idempotency
        Send ``Idempotency-Key: <job.idempotency_key>``.  Without it, a job that runs
        twice emails the customer twice.
    """

    def __init__(self, db: Queue, provider_url: str, worker: str, *, idempotency: bool) -> None:
        self.db = db
        self.schema = db.schema
        self.worker = worker
        self.idempotency = idempotency
        parts = urlsplit(provider_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"provider URL needs a host and a port: {provider_url!r}")
        self._host, self._port = parts.hostname, parts.port
        self._local = threading.local()
        self._load = _q(_LOAD, self.schema)
        self._audit = _q(_AUDIT, self.schema)
        self._audited = _q(_AUDITED, self.schema)
        self._conflict = _q(_CONFLICT, self.schema)

    def __call__(self, job: Job) -> None:
        invoice_id = int(job.payload["invoice_id"])
        with self.db.connection() as conn:
            row = conn.execute(self._load, {"id": invoice_id}).fetchone()
        if row is None:
            raise Fail(f"invoice {invoice_id} does not exist")
        email, amount = row
        message_id = self._send(
            {
                "invoice_id": invoice_id,
                "to": email,
                "subject": f"Your invoice #{invoice_id}",
                "amount_cents": amount,
            },
            job.idempotency_key if self.idempotency else None,
        )
        self._record(job.id, invoice_id, message_id)

    def _send(self, body: dict[str, Any], key: str | None) -> str:
        headers = {"Content-Type": "application/json", WORKER_HEADER: self.worker}
        if key is not None:
            headers[KEY_HEADER] = key
        conn = self._connection()
        try:
            conn.request("POST", "/emails", json.dumps(body), headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            # The send may or may not have gone out; the queue runs the job again, and
            # only the idempotency key can make that repeat harmless.
            self._local.conn = None
            conn.close()
            raise
        if resp.status != 200:
            raise RuntimeError(f"provider answered {resp.status}: {data[:200]!r}")
        # A replay (Idempotent-Replayed: true) carries the first send's message id, so
        # the audit row can tell a repeat of one email from a second email.
        return str(json.loads(data)["id"])

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=30)
            self._local.conn = conn
        return conn

    def _record(self, job_id: int, invoice_id: int, message_id: str) -> None:
        params = {
            "job_id": job_id,
            "invoice_id": invoice_id,
            "message_id": message_id,
            "worker": self.worker,
        }
        with self.db.connection() as conn:
            try:
                conn.execute(self._audit, params)
                return
            except pgerrors.UniqueViolation as exc:
                error = str(exc).strip().splitlines()[0]
            row = conn.execute(self._audited, {"job_id": job_id}).fetchone()
            if row is not None and row[0] == message_id:
                # The same email, already recorded: an earlier attempt of this job (or a
                # second claimer) got the provider's replay of it.  Nothing was sent twice.
                return
            # A second, distinct email for this job.  It has already gone out; all the
            # audit table can do is say so, as it did in the postmortem.
            conn.execute(self._conflict, {**params, "error": error})
