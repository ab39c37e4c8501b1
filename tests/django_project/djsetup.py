"""Setting the test project up inside pytest's process (both Django test modules use it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROJECT = Path(__file__).parent


def configure(dsn: str) -> None:
    """Point the project at ``dsn`` and set Django up (once per process)."""
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ["SKIPLOCK_DJANGO_DSN"] = dsn  # read when the settings module loads
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproj.settings")
        django.setup()


def tasks_setting(schema: str, **options: object) -> dict[str, object]:
    return {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"schema": schema, "max_attempts": 2, **options},
        }
    }


@contextmanager
def using_schema(schema: str, **options: object) -> Iterator[None]:
    """TASKS on skiplock schema ``schema`` for the block; Django's connections closed
    after it (so the schema can be dropped)."""
    from django.db import connections
    from django.test import override_settings

    try:
        with override_settings(TASKS=tasks_setting(schema, **options)):
            yield
    finally:
        connections.close_all()


def project_env(dsn: str, schema: str) -> dict[str, str]:
    """The environment of a ``manage.py`` subprocess on ``schema``."""
    return {
        **os.environ,
        "SKIPLOCK_DJANGO_DSN": dsn,
        "SKIPLOCK_DJANGO_SCHEMA": schema,
        "SKIPLOCK_DJANGO_MAX_ATTEMPTS": "2",
        "DJANGO_SETTINGS_MODULE": "testproj.settings",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
