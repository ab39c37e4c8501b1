"""``--json`` output: what JSON lacks (numeric, timestamps) comes out as a script expects."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from skiplock.cli import main
from skiplock.cli.common import echo_json


def test_decimals_are_numbers_and_times_are_iso(capsys: pytest.CaptureFixture[str]) -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    echo_json(
        {"age": Decimal("12.500000"), "count": Decimal("3"), "at": at, "took": timedelta(0, 1.5)}
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"age": 12.5, "count": 3, "at": "2030-01-02T03:04:05+00:00", "took": 1.5}
    assert isinstance(doc["count"], int)


def test_a_server_the_process_started_earlier_is_not_announced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The "keeps running" line is for a server the command itself started.  One an
    earlier call in the same process started (a test run's fixture) is not news, and
    the line landed in the middle of in-process ``--json`` output (8 tests failed so
    when the embedded run of the suite started its server in the pytest process)."""
    import skiplock._embedded as embedded

    monkeypatch.setattr(embedded, "_started_here", {tmp_path})
    sql_file = tmp_path / "claim.sql"
    sql_file.write_text("SELECT 1;\n")
    result = CliRunner().invoke(main, ["audit", str(sql_file), "--json"])
    assert "keeps running" not in result.output
    json.loads(result.output)
