"""A newcomer's first commands (issue 18): the base install's --help, missing extras,
handlers next to the shell, enqueue's --delay and --run-at, limit's typo guard, JSON
numbers, and the embedded server's announcement.  Real processes, real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from skiplock import Queue
from skiplock.cli import main

# Runs the CLI with some top-level modules made unimportable, as on a machine where
# `pip install -e .` installed no extras: argv[1] is the comma-separated list to block.
WITHOUT = textwrap.dedent(
    """
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    # `python -c` puts the current directory first on sys.path; the console script does
    # not (its first entry is the script's own directory): be the console script.
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    sys.argv = ["skiplock", *sys.argv[2:]]
    from skiplock.cli import main

    sys.exit(main())
    """
)

DASHBOARD = "starlette,uvicorn,jinja2"


def cli_without(
    blocked: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DSN", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, blocked, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**clean, **(env or {})},
    )


def cli(
    *args: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The command as the console script runs it: not ``python -m``, which would put
    the current directory on sys.path by itself."""
    return cli_without("-", *args, cwd=cwd, env=env)


def one_line_exit_2(res: subprocess.CompletedProcess[str], expect: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [expect], res.stderr


@pytest.fixture
def env(dsn: str, schema: str) -> dict[str, str]:
    return {"SKIPLOCK_DSN": dsn, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


# -- 1. the base install --------------------------------------------------------------


def test_help_lists_every_command_without_any_extra() -> None:
    res = cli_without(f"{DASHBOARD},prometheus_client,opentelemetry,matplotlib", "--help")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    listed = {line.split()[0] for line in res.stdout.split("Commands:")[1].splitlines() if line}
    import click

    assert listed == set(main.list_commands(click.Context(main)))
    assert "dashboard" in listed


@pytest.mark.parametrize(
    ("blocked", "args", "expect"),
    [
        (
            DASHBOARD,
            ["dashboard"],
            "skiplock: error: the dashboard needs the 'dashboard' extra: "
            "pip install 'skiplock[dashboard]'",
        ),
        (
            "jinja2",
            ["dashboard", "--port", "0"],
            "skiplock: error: the dashboard needs the 'dashboard' extra: "
            "pip install 'skiplock[dashboard]'",
        ),
        (
            "prometheus_client,opentelemetry",
            ["worker", "--handler", "json:loads", "--metrics-port", "0"],
            "skiplock: error: the metrics endpoint (--metrics-port) needs the 'metrics' "
            "extra: pip install 'skiplock[metrics]'",
        ),
        (
            "matplotlib",
            ["race", "--plot", "race.png"],
            "skiplock: error: --plot needs the 'plot' extra: pip install 'skiplock[plot]'",
        ),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(
    blocked: str, args: list[str], expect: str, tmp_path: Path
) -> None:
    # No DSN: the check comes before any server is started or reached.
    res = cli_without(blocked, *args, cwd=tmp_path, env={"SKIPLOCK_DATA_DIR": str(tmp_path)})
    one_line_exit_2(res, expect)
    assert not list(tmp_path.iterdir()), "nothing may be started or written first"


def test_dashboard_help_works_without_the_extra() -> None:
    res = cli_without(DASHBOARD, "dashboard", "--help")
    assert res.returncode == 0, res.stderr
    assert "--auth" in res.stdout


# -- 2. a handler next to the shell ---------------------------------------------------


def test_worker_imports_the_handler_from_the_current_directory(
    env: dict[str, str], schema: str, queue: Queue, tmp_path: Path
) -> None:
    (tmp_path / "newcomer_jobs.py").write_text(
        "def fn(job):\n    return {'seen': job.payload['n']}\n"
    )
    job_id = queue.enqueue({"n": 7})
    args = ["worker", "--handler", "newcomer_jobs:fn", "--schema", schema, "--poll-interval", "0.1"]
    proc = subprocess.Popen(
        [sys.executable, "-c", WITHOUT, "-", *args],
        cwd=tmp_path,
        env={**os.environ, **env, "PYTHONPATH": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert queue.wait(job_id, timeout=30) == {"seen": 7}
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert "No module named" not in err, err


def test_a_missing_handler_module_says_where_it_looked(env: dict[str, str], tmp_path: Path) -> None:
    res = cli("worker", "--handler", "no_such_jobs:fn", cwd=tmp_path, env=env)
    one_line_exit_2(
        res,
        "skiplock: error: cannot import handler module 'no_such_jobs': No module named "
        f"'no_such_jobs' (looked in {tmp_path} and sys.path)",
    )


# -- 7. JSON numbers ------------------------------------------------------------------


def _strings(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [s for v in doc.values() for s in _strings(v)]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return [doc] if isinstance(doc, str) else []


def _numeric_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_json_outputs_give_numbers_as_numbers(
    env: dict[str, str], schema: str, queue: Queue
) -> None:
    queue.enqueue({"n": 1}, queue="mail")
    queue.configure_queue("mail", rate_limit=2.5)
    res = cli("status", "--json", "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["queues"]
    assert isinstance(row["oldest_pending_seconds"], float), row
    assert isinstance(row["jobs"], int)
    for args in (["status"], ["limit"], ["verify"], ["migrate"]):
        res = cli(*args, "--json", "--schema", schema, env=env)
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        assert not [s for s in _strings(doc) if _numeric_text(s)], (args, doc)


# -- 4. enqueue --delay and --run-at ----------------------------------------------------


def _run_at_minus_created(queue: Queue, job_id: int) -> float:
    with queue.connection() as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM run_at - created_at)::float8 FROM {}.jobs WHERE id = %s"
            ).format(sql.Identifier(queue.schema)),
            (job_id,),
        ).fetchone()
    assert row is not None
    return float(row[0])


def test_enqueue_delay_and_run_at(
    env: dict[str, str], schema: str, queue: Queue, tmp_path: Path
) -> None:
    res = cli("enqueue", '{"n": 1}', "--delay", "3600", "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr
    assert 3590 < _run_at_minus_created(queue, int(res.stdout)) < 3610
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"n": 10}\n{"n": 11}\n')
    res = cli("enqueue", "--file", str(lines), "--delay", "60", "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr
    for job_id in res.stdout.split():
        assert 50 < _run_at_minus_created(queue, int(job_id)) < 70
    at = "2030-01-31T09:00:00+01:00"
    res = cli("enqueue", '{"n": 2}', "--run-at", at, "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr
    job = queue.get(int(res.stdout))
    assert job is not None and job.run_at == datetime.fromisoformat(at)
    res = cli(
        "enqueue", '{"n": 3}', "--run-at", "2030-01-31T08:00:00Z", "--schema", schema, env=env
    )
    job = queue.get(int(res.stdout))
    assert job is not None and job.run_at == datetime(2030, 1, 31, 8, tzinfo=UTC)
    assert queue.claim(worker="w", limit=10) == []  # none of them is due


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (
            ["--run-at", "2030-01-31T09:00:00"],
            "skiplock: error: --run-at '2030-01-31T09:00:00' has no timezone: add one, as in "
            "2030-01-31T09:00:00Z (UTC) or 2030-01-31T09:00:00+01:00",
        ),
        (
            ["--run-at", "tomorrow"],
            "skiplock: error: --run-at 'tomorrow' is not an ISO 8601 time such as "
            "2030-01-31T09:00:00+01:00",
        ),
        (
            ["--delay", "5", "--run-at", "2030-01-31T09:00:00Z"],
            "skiplock: error: give --delay or --run-at, not both",
        ),
    ],
)
def test_enqueue_refuses_a_naive_or_double_time(
    env: dict[str, str], schema: str, queue: Queue, args: list[str], expect: str
) -> None:
    one_line_exit_2(cli("enqueue", "{}", *args, "--schema", schema, env=env), expect)
    assert queue.status() == []


# -- 6. limit and pause agree on what a queue is -------------------------------------------


def test_limit_refuses_a_typo_like_pause_and_creates_with_create(
    env: dict[str, str], schema: str, queue: Queue
) -> None:
    queue.enqueue({}, queue="mail")
    paused = cli("pause", "mial", "--schema", schema, env=env)
    limited = cli("limit", "mial", "--concurrency", "2", "--schema", schema, env=env)
    told = "skiplock: error: unknown queue 'mial': it has no jobs and no settings"
    one_line_exit_2(paused, told)
    one_line_exit_2(limited, f"{told}; pass --create to set it up before its first job")
    assert queue.queue_settings() == []
    res = cli("limit", "mail", "--concurrency", "2", "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr  # a queue with jobs needs no --create
    res = cli("limit", "reports", "--rate", "5", "--create", "--schema", schema, env=env)
    assert res.returncode == 0, res.stderr
    assert [(c.name, c.concurrency_limit, c.rate_limit) for c in queue.queue_settings()] == [
        ("mail", 2, None),
        ("reports", None, 5.0),
    ]
    assert cli("pause", "reports", "--schema", schema, env=env).returncode == 0


# -- 8. the embedded server outlives the command, and says so ---------------------------


@pytest.mark.skipif(os.environ.get("SKIPLOCK_SKIP_EMBEDDED") == "1", reason="embedded disabled")
def test_a_started_embedded_server_is_announced_and_stops_on_request(tmp_path: Path) -> None:
    env = {"SKIPLOCK_DATA_DIR": str(tmp_path / "data")}
    data = tmp_path / "data" / "pg18"
    try:
        first = cli("migrate", env=env)
        assert first.returncode == 0, first.stderr
        assert first.stderr.strip().splitlines()[-1] == (
            "skiplock: the embedded PostgreSQL keeps running for the next command "
            f"(data in {data}); stop it with: skiplock embedded stop"
        )
        assert (data / "postmaster.pid").exists()
        again = cli("status", "--json", env=env)  # reused, not started: nothing to announce
        assert again.returncode == 0, again.stderr
        assert "keeps running" not in again.stderr
    finally:
        stopped = cli("embedded", "stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"stopped the embedded PostgreSQL in {data}"
    assert not (data / "postmaster.pid").exists()
    res = cli("embedded", "stop", env=env)
    assert res.stdout.strip() == f"the embedded PostgreSQL in {data} is not running"
