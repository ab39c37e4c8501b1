"""``skiplock race`` end to end on a real server: the JSON fields, the plot, processes, replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from click.testing import CliRunner

from skiplock.cli import main

FIELDS = {
    "jobs",
    "claims",
    "double_claims",
    "duplicate_jobs",
    "throughput",
    "latency_p50_ms",
    "latency_p99_ms",
    "lock_wait_share",
    "serialization_retries",
}


def _scratch_schemas(admin: psycopg.Connection[Any]) -> set[str]:
    rows = admin.execute(
        "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, 'skiplock_race_')"
    ).fetchall()
    return {r[0] for r in rows}


def test_race_json_and_plot(dsn: str, admin: psycopg.Connection[Any], tmp_path: Path) -> None:
    before = _scratch_schemas(admin)
    png = tmp_path / "race.png"
    args = [
        "race", "--strategy", "naive,skip-locked,serializable", "--workers", "4",
        "--jobs", "300", "--batch", "5", "--json", "--dsn", dsn, "--plot", str(png),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {"naive", "skip-locked", "serializable"}
    for name, r in doc.items():
        assert set(r) >= FIELDS, name
        assert r["jobs"] == 300
        assert r["jobs_done"] == 300
        assert r["claims"] == 300 + r["double_claims"]
        assert r["workers"] == 4
        assert r["processes"] is False
    assert doc["skip-locked"]["double_claims"] == 0
    assert doc["skip-locked"]["serialization_retries"] == 0
    assert doc["serializable"]["double_claims"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _scratch_schemas(admin) == before  # every scratch schema dropped


def test_race_table(dsn: str) -> None:
    args = ["race", "--strategy", "skip-locked,hold-lock", "--workers", "2", "--jobs", "50"]
    result = CliRunner().invoke(main, [*args, "--dsn", dsn])
    assert result.exit_code == 0, result.output
    for text in ("skip-locked", "hold-lock", "double claims", "lock-wait share", "jobs/s"):
        assert text in result.stdout


def test_race_with_processes(dsn: str) -> None:
    """Workers as spawned processes, through the real console entry point."""
    cmd = [
        sys.executable, "-m", "skiplock.cli", "race", "--strategy", "skip-locked,for-update",
        "--workers", "3", "--jobs", "300", "--batch", "5", "--processes", "--json",
        "--dsn", dsn,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for r in doc.values():
        assert r["processes"] is True
        assert r["workers"] == 3
        assert r["double_claims"] == 0
        assert r["jobs_done"] == 300


def test_race_replay_json(dsn: str) -> None:
    args = ["race", "--replay", "--strategy", "naive,skip-locked", "--json", "--dsn", dsn]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["naive"]["double_claimed"] == [1, 2, 3]
    assert doc["naive"]["blocked"] == {"A": False, "B": True}
    assert doc["skip-locked"]["holds"] == {"A": [1, 2, 3], "B": [4, 5, 6]}
    assert doc["skip-locked"]["blocked"] == {"A": False, "B": False}


def test_race_replay_text(dsn: str) -> None:
    result = CliRunner().invoke(main, ["race", "--replay", "--strategy", "naive", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert "blocked   waiting for A" in result.stdout
    assert "DOUBLE CLAIM: both hold 1, 2, 3" in result.stdout


def test_race_rejects_unknown_strategy(dsn: str) -> None:
    result = CliRunner().invoke(main, ["race", "--strategy", "naive,optimistic", "--dsn", dsn])
    assert result.exit_code == 2
    assert "unknown strategy optimistic" in result.output
