"""The tasks the tests enqueue."""

import asyncio
from typing import Any

from django.db import connection
from django.tasks import TaskContext, task


class Boom(Exception):
    """What ``explode`` raises."""


@task
def add(a: int, b: int) -> int:
    return a + b


@task(queue_name="emails", priority=10)
def send_email(to: str, subject: str = "") -> dict[str, str]:
    return {"sent": to, "subject": subject}


@task
def explode(message: str) -> None:
    raise Boom(message)


@task(takes_context=True)
def where_am_i(context: TaskContext, tag: str) -> dict[str, Any]:
    return {
        "id": context.task_result.id,
        "attempt": context.attempt,
        "status": str(context.task_result.status),
        "tag": tag,
    }


@task
async def double_later(x: int) -> int:
    await asyncio.sleep(0.01)
    return 2 * x


@task
def ask_database() -> int:
    # Django's own connection, in a worker thread: opened here, closed after the job.
    with connection.cursor() as cur:
        cur.execute("SELECT 41 + 1")
        row = cur.fetchone()
    return int(row[0])


@task
def hang(seconds: float, started: str | None = None) -> str:
    # ``started``: a file to create once the task body runs.  The job's RUNNING status
    # is set by the claim, before a handler picks it up, so it cannot tell a test that
    # the body has begun.
    import time
    from pathlib import Path

    if started is not None:
        Path(started).touch()
    time.sleep(seconds)
    return "woke"


@task
def bye(code: int) -> None:
    # What a task must not do to a worker: end it, or wedge the thread that ran it.
    import sys

    sys.exit(code)


@task
def interrupt() -> None:
    raise KeyboardInterrupt("pressed inside the task")


@task
def unjsonable() -> object:
    return {"callback": lambda: True}


@task
def wait_for(path: str) -> str:
    # Runs until the test creates ``path``: the test decides when it ends, not a sleep.
    import time
    from pathlib import Path

    Path(path + ".started").touch()
    while not Path(path).exists():
        time.sleep(0.01)
    return "released"
