"""``--json`` output: what JSON lacks (numeric, timestamps) comes out as a script expects."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from skiplock.cli.common import echo_json


def test_decimals_are_numbers_and_times_are_iso(capsys: pytest.CaptureFixture[str]) -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    echo_json(
        {"age": Decimal("12.500000"), "count": Decimal("3"), "at": at, "took": timedelta(0, 1.5)}
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"age": 12.5, "count": 3, "at": "2030-01-02T03:04:05+00:00", "took": 1.5}
    assert isinstance(doc["count"], int)
