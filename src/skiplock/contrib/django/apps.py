"""The app config that lets ``manage.py`` find skiplock's commands."""

from __future__ import annotations

from django.apps import AppConfig


class SkiplockConfig(AppConfig):  # type: ignore[misc]  # django is untyped
    name = "skiplock.contrib.django"
    label = "skiplock"
    verbose_name = "skiplock"
