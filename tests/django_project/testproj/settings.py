"""Settings from the environment: the tests pass the server's DSN and a fresh schema.

SKIPLOCK_DJANGO_DSN (else SKIPLOCK_TEST_DSN, else the local server) becomes
DATABASES["default"] field by field, so a DSN whose host is a socket directory (the
embedded server) works too.  SKIPLOCK_DJANGO_SCHEMA names skiplock's schema.
"""

import os

from psycopg.conninfo import conninfo_to_dict

DSN = os.environ.get("SKIPLOCK_DJANGO_DSN") or os.environ.get(
    "SKIPLOCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"
)


def database(dsn: str) -> dict[str, object]:
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params.pop("dbname", "postgres"),
        "USER": params.pop("user", ""),
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
    }


SECRET_KEY = "skiplock-tests-only"
# SKIPLOCK_DJANGO_DEBUG=1: Django's LOGGING then prints django.* lines on its own console.
DEBUG = os.environ.get("SKIPLOCK_DJANGO_DEBUG") == "1"
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["skiplock.contrib.django"]
DATABASES = {
    "default": database(DSN),
    # Not PostgreSQL: the backend's check must refuse it (never connected to).
    "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
TASKS = {
    "default": {
        "BACKEND": "skiplock.contrib.django.SkiplockBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {
            "schema": os.environ.get("SKIPLOCK_DJANGO_SCHEMA", "skiplock"),
            "max_attempts": int(os.environ.get("SKIPLOCK_DJANGO_MAX_ATTEMPTS", "2")),
        },
    }
}
