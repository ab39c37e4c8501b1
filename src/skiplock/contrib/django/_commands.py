"""What the management commands share: finding the skiplock backend among TASKS."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.tasks import task_backends

from ._backend import SkiplockBackend

__all__ = ["skiplock_backend"]


def skiplock_backend(alias: str | None) -> SkiplockBackend:
    """The TASKS backend ``alias``, or the only skiplock one; CommandError otherwise."""
    if alias is not None:
        try:
            backend = task_backends[alias]
        except Exception as exc:
            raise CommandError(f"TASKS has no usable backend {alias!r}: {exc}") from None
        if not isinstance(backend, SkiplockBackend):
            raise CommandError(f"TASKS[{alias!r}] is {type(backend).__name__}, not skiplock's")
    else:
        backend = _the_only_one()
    problem = backend.options_problem()
    if problem is not None:
        raise CommandError(problem)
    problem = backend.database_problem()
    if problem is not None:
        raise CommandError(f"task backend {backend.alias!r}: {problem}")
    return backend


def _the_only_one() -> SkiplockBackend:
    ours = [b for b in task_backends.all() if isinstance(b, SkiplockBackend)]
    if len(ours) != 1:
        names = sorted(b.alias for b in ours)
        raise CommandError(
            "no TASKS backend is skiplock.contrib.django.SkiplockBackend"
            if not ours
            else f"several skiplock backends {names}: choose one with --backend"
        )
    return ours[0]
