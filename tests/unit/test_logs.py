"""The one-line summary of a handler's error, and the JSON log formatter."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from skiplock._logs import JsonFormatter
from skiplock._wcore import error_summary


@pytest.mark.parametrize(
    ("error", "summary"),
    [
        (None, None),
        ("", None),
        ("timed out after 0.3s", "timed out after 0.3s"),
        ("invoice was deleted\nsecond line", "invoice was deleted"),
        (
            "Traceback (most recent call last):\n"
            '  File "x.py", line 3, in handler\n'
            "    raise ValueError('bad\\nnews')\n"
            "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            "ValueError: bad\n"
            "news\n",
            "ValueError: bad",
        ),
        # Trimmed at the front (_handlers.MAX_ERROR_CHARS): the end still has the line.
        ('...x\n  File "y.py", line 1, in f\n    g()\nKeyError: 7', "KeyError: 7"),
        ("E" * 400, "E" * 297 + "..."),
    ],
)
def test_error_summary(error: str | None, summary: str | None) -> None:
    assert error_summary(error) == summary


def test_json_lines_carry_the_extra_fields_and_the_exception() -> None:
    record = logging.LogRecord(
        "skiplock.worker", logging.ERROR, __file__, 1, "job %d failed", (7,), None
    )
    record.__dict__.update({"job_id": 7, "task": None, "event": "failed"})
    line = JsonFormatter().format(record)
    out = json.loads(line)
    assert "\n" not in line
    assert out["ts"].endswith("Z") and out["ts"][:4].isdigit()
    assert {k: out[k] for k in ("level", "logger", "message", "job_id", "task", "event")} == {
        "level": "ERROR",
        "logger": "skiplock.worker",
        "message": "job 7 failed",
        "job_id": 7,
        "task": None,
        "event": "failed",
    }
    assert "exc_info" not in out and "args" not in out and "msg" not in out
    try:
        raise ValueError("bad invoice")
    except ValueError:
        failing = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", None, sys.exc_info())
    got = json.loads(JsonFormatter().format(failing))
    assert got["exc_info"].startswith("Traceback") and "ValueError: bad invoice" in got["exc_info"]
