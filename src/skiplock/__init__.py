"""skiplock: a PostgreSQL job queue that never hands one job to two workers."""

from ._aqueue import AsyncQueue
from ._config import RetryPolicy
from ._errors import (
    ConfigError,
    DatabaseUnavailable,
    Fail,
    LeaseLost,
    PayloadError,
    Retry,
    SkiplockError,
)
from ._job import Job
from ._periodic import Periodic
from ._queue import Queue
from ._worker import Worker, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "AsyncQueue",
    "ConfigError",
    "DatabaseUnavailable",
    "Fail",
    "Job",
    "LeaseLost",
    "PayloadError",
    "Periodic",
    "Queue",
    "Retry",
    "RetryPolicy",
    "SkiplockError",
    "Worker",
    "WorkerStats",
]
