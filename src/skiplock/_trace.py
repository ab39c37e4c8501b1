"""OpenTelemetry trace context from the call that defers a job to the handler that runs it.

Optional: with ``opentelemetry-api`` installed (the ``otel`` extra), a deferral stores
the caller's W3C trace context in the job's ``meta`` and the worker runs the task in a
CONSUMER span whose parent is that context, so a request and the jobs it caused are one
trace.  Without it both ends are no-ops costing one failed import, once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from ._job import Job

__all__ = ["inject", "span"]


@functools.cache
def _otel() -> Any:
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return None
    return propagate, trace


def inject() -> dict[str, Any] | None:
    """The current trace context as job meta (``{"trace": {...}}``), or None."""
    otel = _otel()
    if otel is None:
        return None
    carrier: dict[str, str] = {}
    otel[0].inject(carrier)
    return {"trace": carrier} if carrier else None


@contextlib.contextmanager
def span(task: str, job: Job) -> Iterator[None]:
    """Run a job's task inside a span continuing the deferring call's trace."""
    otel = _otel()
    if otel is None:
        yield
        return
    propagate, trace = otel
    meta = job.meta if isinstance(job.meta, dict) else {}
    carrier = meta.get("trace")
    parent = propagate.extract(carrier) if isinstance(carrier, dict) else None
    tracer = trace.get_tracer("skiplock")
    with tracer.start_as_current_span(
        f"skiplock.task {task}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "messaging.system": "skiplock",
            "messaging.destination.name": job.queue,
            "messaging.message.id": str(job.id),
            "skiplock.task": task,
            "skiplock.attempt": job.attempts,
        },
    ):
        yield
