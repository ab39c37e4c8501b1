"""skiplock: a PostgreSQL job queue that never hands one job to two workers."""

from ._aqueue import AsyncQueue
from ._aworker import AsyncWorker
from ._canvas import Signature, Workflow, chain, chord, group
from ._clusters import ClusterWorkers
from ._config import RetryPolicy
from ._control import JobInfo, QueueConfig, RetryReport
from ._errors import (
    ConfigError,
    DatabaseUnavailable,
    DuplicateJob,
    Fail,
    JobCancelled,
    JobFailed,
    JobStateError,
    LeaseLost,
    PayloadError,
    Retry,
    SkiplockError,
    SoftTimeLimitExceeded,
    UnknownJob,
    UnknownQueue,
)
from ._job import Job
from ._periodic import Periodic
from ._queue import Queue
from ._tasks import App, Task
from ._worker import Worker, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "App",
    "AsyncQueue",
    "AsyncWorker",
    "ClusterWorkers",
    "ConfigError",
    "DatabaseUnavailable",
    "DuplicateJob",
    "Fail",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobInfo",
    "JobStateError",
    "LeaseLost",
    "PayloadError",
    "Periodic",
    "Queue",
    "QueueConfig",
    "Retry",
    "RetryPolicy",
    "RetryReport",
    "Signature",
    "SkiplockError",
    "SoftTimeLimitExceeded",
    "Task",
    "UnknownJob",
    "UnknownQueue",
    "Worker",
    "WorkerStats",
    "Workflow",
    "chain",
    "chord",
    "group",
]
