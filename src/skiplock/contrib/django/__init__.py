"""skiplock as a backend of Django's Tasks framework (``django.tasks``, Django 6+).

Settings::

    INSTALLED_APPS = [..., "skiplock.contrib.django"]   # the management commands
    TASKS = {
        "default": {
            "BACKEND": "skiplock.contrib.django.SkiplockBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"schema": "skiplock", "database": "default", "max_attempts": 5},
        }
    }

Then ``python manage.py skiplock_migrate`` once and ``python manage.py skiplock_worker``.
See docs/django.md.  This package is the only part of skiplock that imports Django.
"""

from ._backend import SkiplockBackend, TaskArgumentsError

__all__ = ["SkiplockBackend", "TaskArgumentsError"]
