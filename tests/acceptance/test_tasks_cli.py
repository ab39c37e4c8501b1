"""`skiplock worker --app`: a rolling deploy with two versions of an app, as processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock import App

from .test_cli import cli, wait_until

SCRIPT = str(Path(sys.executable).with_name("skiplock"))

V1 = """
import os
from skiplock import App, Job

app = App(schema=os.environ["ACCEPT_SCHEMA"])

@app.task(name="shop.charge", queue="payments")
def charge(order: int) -> int:
    return order * 100
"""

V2 = (
    V1
    + """
@app.task(name="shop.refund", queue="payments")
def refund(order: int, job: Job) -> dict:
    return {"refunded": order, "attempt": job.attempts}
"""
)


@pytest.fixture
def versions(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, text in (("v1", V1), ("v2", V2)):
        d = tmp_path / name
        d.mkdir()
        (d / "shop.py").write_text(textwrap.dedent(text))
        out[name] = d
    return out


@pytest.fixture
def start(
    dsn: str, schema: str
) -> Iterator[Callable[[Path, tuple[str, ...]], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"SKIPLOCK_DSN": dsn, "ACCEPT_SCHEMA": schema}

    def run(cwd: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        # The console script, not `python -m` (which would put the directory on
        # sys.path itself), and no PYTHONPATH: the CLI looks in the current directory.
        p = subprocess.Popen(
            [SCRIPT, "worker", "--app", "shop:app", *extra],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        return p

    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def jobs(admin: psycopg.Connection[Any], schema: str) -> dict[int, tuple[str, str, int]]:
    q = sql.SQL("SELECT id, task, status, attempts FROM {}.jobs").format(sql.Identifier(schema))
    return {r[0]: (r[1], r[2], r[3]) for r in admin.execute(q).fetchall()}


@pytest.mark.connections(30)
def test_rolling_deploy_loses_nothing(
    dsn: str,
    schema: str,
    admin: psycopg.Connection[Any],
    versions: dict[str, Path],
    start: Callable[..., subprocess.Popen[str]],
) -> None:
    producer = App(dsn, schema=schema, max_size=2)
    producer.migrate()
    charge = producer.task(name="shop.charge", queue="payments")(lambda order: order)
    refund = producer.task(name="shop.refund", queue="payments")(lambda order: order)
    env = {"SKIPLOCK_DSN": dsn}
    try:
        old = start(versions["v1"], ("--sweep-interval", "0.1"))
        first = charge.defer(order=1)
        assert producer.wait(first, timeout=30) == 100  # the v1 worker runs
        # The producers are on v2 now; the v1 worker does not know shop.refund.
        waiting = refund.defer(order=2)
        also = charge.defer(order=3)
        assert producer.wait(also, timeout=30) == 300  # claimed past the unknown job

        def unserved() -> list[dict[str, Any]]:
            out = cli("status", "--schema", schema, "--json", env=env)
            assert out.returncode == 0, out.stderr
            return list(json.loads(out.stdout)["unserved"])

        wait_until(lambda: bool(unserved()), what="status to list the waiting job")
        [row] = unserved()
        assert (row["queue"], row["task"], row["jobs"]) == ("payments", "shop.refund", 1)
        assert isinstance(row["oldest_seconds"], float)
        assert jobs(admin, schema)[waiting] == ("shop.refund", "pending", 0)
        text = cli("status", "--schema", schema, env=env)
        assert "waiting for a worker that knows the task" in text.stdout

        new = start(versions["v2"], ("--sweep-interval", "0.1"))
        assert producer.wait(waiting, timeout=30) == {"refunded": 2, "attempt": 1}
        wait_until(lambda: not unserved(), what="nothing unserved")
        for p in (old, new):
            p.send_signal(signal.SIGTERM)
        for p in (old, new):
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
        assert jobs(admin, schema) == {
            first: ("shop.charge", "done", 1),
            waiting: ("shop.refund", "done", 1),
            also: ("shop.charge", "done", 1),
        }
    finally:
        producer.close()


def test_app_option_errors(versions: dict[str, Path], dsn: str, schema: str) -> None:
    env = {"SKIPLOCK_DSN": dsn, "ACCEPT_SCHEMA": schema}
    cwd = os.getcwd()
    os.chdir(versions["v1"])
    try:
        for args, message in (
            (("--app", "shop:nothing"), "module 'shop' has no attribute 'nothing'"),
            (("--app", "shop:os"), "not a skiplock.App"),
            (("--app", "nomodule:app"), "cannot import app module 'nomodule'"),
            (("--app", "shop:app", "--handler", "shop:charge"), "give --app"),
            ((), "give --app"),
            (("--app", "shop:app", "--queue", "nope"), "no task of this app uses queue(s) nope"),
        ):
            out = cli("worker", *args, env=env)
            assert out.returncode == 2, (args, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and message in lines[0], (args, out.stderr)
    finally:
        os.chdir(cwd)
