"""``manage.py skiplock_worker --health-port``: the same probes as ``skiplock worker``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

pytest.importorskip("django.tasks", reason="Django 6 is not installed (it needs Python 3.12+)")

PROJECT = Path(__file__).parents[1] / "django_project"
if str(PROJECT) not in sys.path:
    sys.path.insert(0, str(PROJECT))

from djsetup import project_env  # noqa: E402

from skiplock import Queue  # noqa: E402

from .test_cli import wait_until  # noqa: E402


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_django_worker_answers_probes_and_a_lock_wedges_it(
    dsn: str, queue: Queue, admin: psycopg.Connection[Any], tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "manage.py", "skiplock_worker", "--name", "dj-h"),
                *("--health-port", "0", "--health-stall", "1"),
            ],
            cwd=PROJECT,
            env=project_env(dsn, queue.schema),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        found: list[int] = []

        def logged() -> bool:
            text = log.read_text()
            assert proc.poll() is None, text
            m = re.search(r"dj-h: health at http://127\.0\.0\.1:(\d+)/livez", text)
            found.extend([int(m.group(1))] if m else [])
            return bool(m)

        wait_until(logged, what="the health line")
        port = found[0]
        assert get(port, "/livez") == (200, {"live": True, "worker": "dj-h"})
        wait_until(lambda: get(port, "/readyz")[0] == 200, what="ready")
        admin.execute("BEGIN")
        admin.execute(
            sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier(queue.schema)
            )
        )
        try:
            wait_until(lambda: "claim loop" in get(port, "/livez")[1].get("stuck", {}))
            assert get(port, "/livez")[0] == 503
        finally:
            admin.execute("ROLLBACK")
        wait_until(lambda: get(port, "/livez")[0] == 200, what="live again")
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
