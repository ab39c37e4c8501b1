"""``python manage.py skiplock_migrate``: create or upgrade skiplock's schema."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from skiplock import Queue

from ..._commands import skiplock_backend


class Command(BaseCommand):  # type: ignore[misc]  # django is untyped
    help = "Create or upgrade skiplock's tables in the task backend's schema (idempotent)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backend", default=None, help="The TASKS alias (default: the one).")

    def handle(self, *args: Any, **options: Any) -> None:
        backend = skiplock_backend(options["backend"])
        with Queue(backend.worker_dsn(), schema=backend.schema, max_size=1) as q:
            applied = q.migrate()
        done = ", ".join(map(str, applied)) if applied else "none (up to date)"
        self.stdout.write(f"schema {backend.schema}: migrations applied: {done}")
