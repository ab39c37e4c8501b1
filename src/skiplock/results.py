"""How a handler's return value is stored on its job: JSON, within a size bound.

Public for the layers that run tasks their own way (contrib.django's runner checks a
task's return value before it reports success, so that a value the row cannot hold is
the task's error, not a failed write after the fact; the dashboard shows a failed
job's exception line, ``error_line``, as ``skiplock jobs`` does).
"""

from __future__ import annotations

from ._control import DEFAULT_MAX_RESULT_BYTES, Encoded, encode_result, error_line

__all__ = ["DEFAULT_MAX_RESULT_BYTES", "Encoded", "encode_result", "error_line"]
