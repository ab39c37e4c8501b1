"""One JSON object per log line, for log pipelines that want fields, not prose."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

__all__ = ["JsonFormatter"]

# What every LogRecord carries; anything else on a record came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ts, level, logger, message, its extra fields.

    The worker's job lines put ``job_id``, ``queue``, ``task``, ``attempt``,
    ``max_attempts``, ``event`` and ``error`` on the record (``extra=``), so a log
    pipeline can filter and count them without parsing the message.  Standard library
    only: the worker must not need a logging dependency to say what failed.
    """

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        # default=str: an extra field that is not JSON (a datetime, a UUID) still
        # yields a line rather than an exception inside the logging machinery.
        return json.dumps(out, default=str, ensure_ascii=False)
