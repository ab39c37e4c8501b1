"""`skiplock jobs` and `skiplock retry` as an operator runs them, after a real worker
failed real tasks: find the failed jobs, see why, run them again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock import App

from .test_cli import cli, wait_until

SCRIPT = str(Path(sys.executable).with_name("skiplock"))

SHOP = """
import os
from skiplock import App, Retry

app = App(schema=os.environ["ACCEPT_SCHEMA"])

@app.task(name="shop.charge", queue="payments", max_attempts=1)
def charge(order: int) -> None:
    raise ValueError(f"card declined for order {order}")

@app.task(name="shop.mail", queue="mail", max_attempts=1)
def mail(order: int) -> None:
    try:
        raise ConnectionError("smtp down")
    except ConnectionError as exc:
        raise Retry(0) from exc

@app.task(name="shop.ok", queue="mail")
def ok(order: int) -> int:
    return order
"""


def _statuses(admin: psycopg.Connection[Any], schema: str) -> dict[int, tuple[str, int]]:
    q = sql.SQL("SELECT id, status, attempts FROM {}.jobs").format(sql.Identifier(schema))
    return {r[0]: (r[1], r[2]) for r in admin.execute(q).fetchall()}


def test_jobs_and_retry_find_the_failed_jobs_and_run_them_again(
    dsn: str, schema: str, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    (tmp_path / "shop.py").write_text(textwrap.dedent(SHOP))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"SKIPLOCK_DSN": dsn, "ACCEPT_SCHEMA": schema}
    producer = App(dsn, schema=schema, max_size=2)
    producer.migrate()
    # The producer's declaration decides max_attempts (it is the job's, set at defer).
    once = {"max_attempts": 1}
    charge = producer.task(name="shop.charge", queue="payments", **once)(lambda order: order)
    mail = producer.task(name="shop.mail", queue="mail", **once)(lambda order: order)
    ok = producer.task(name="shop.ok", queue="mail")(lambda order: order)
    try:
        charges = [charge.defer(order=n) for n in (1, 2)]
        [mailed] = [mail.defer(order=3)]
        [done] = [ok.defer(order=4)]
        worker = subprocess.Popen(
            [SCRIPT, "worker", "--app", "shop:app"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(
                lambda: all(
                    _statuses(admin, schema)[i][0] in ("failed", "done")
                    for i in (*charges, mailed, done)
                ),
                what="the worker to fail the jobs",
            )
        finally:
            worker.send_signal(signal.SIGTERM)
            _, log = worker.communicate(timeout=60)
        assert worker.returncode == 0, log
        assert "retry requested: ConnectionError: smtp down" in log
        assert _statuses(admin, schema)[done] == ("done", 1)

        run_env = {"SKIPLOCK_DSN": dsn}
        table = cli("jobs", "--status", "failed", "--schema", schema, env=run_env)
        assert table.returncode == 0, table.stderr
        print(table.stdout)
        for text in ("shop.charge", "ValueError: card declined for order 1", "shop.mail"):
            assert text in table.stdout
        assert 'File "' not in table.stdout

        out = cli("jobs", "--task", "shop.charge", "--json", "--schema", schema, env=run_env)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)["jobs"]
        assert [r["id"] for r in rows] == sorted(charges, reverse=True)
        assert rows[0]["error"] == "ValueError: card declined for order 2"
        assert rows[0]["last_error"].startswith("Traceback (most recent call last)")
        assert (rows[0]["status"], rows[0]["attempts"], rows[0]["queue"]) == (
            "failed",
            1,
            "payments",
        )
        out = cli("jobs", "--error", "SMTP", "--since", "1h", "--json", "--schema", schema,
                  env=run_env)  # fmt: skip
        [row] = json.loads(out.stdout)["jobs"]
        assert (row["id"], row["error"]) == (mailed, "retry requested: ConnectionError: smtp down")

        # By id: the done job is refused (exit 1), the failed one goes back to pending.
        out = cli("retry", str(mailed), str(done), "--schema", schema, env=run_env)
        print(out.stdout)
        assert out.returncode == 1, out.stderr
        assert out.stdout.splitlines() == [
            f"retried 1 job(s): {mailed}",
            f"refused job {done}: done: it succeeded; enqueue a new job to run it again",
        ]
        out = cli("retry", "--failed", "--task", "shop.charge", "--schema", schema, env=run_env)
        print(out.stdout)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"retried 2 job(s): {charges[0]}, {charges[1]}"
        out = cli("retry", "--failed", "--json", "--schema", schema, env=run_env)
        assert json.loads(out.stdout) == {"retried": [], "refused": []}
        after = _statuses(admin, schema)
        assert [after[i] for i in (*charges, mailed, done)] == [
            ("pending", 0),
            ("pending", 0),
            ("pending", 0),
            ("done", 1),
        ]
        assert len(after) == 4  # no job was made
    finally:
        producer.close()
