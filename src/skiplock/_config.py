"""Settings: where the DSN comes from, how it is shown, which names are allowed."""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ._errors import ConfigError

__all__ = [
    "DEFAULT_SCHEMA",
    "RetryPolicy",
    "check_dsn",
    "redact_dsn",
    "resolve_dsn",
    "validate_queue",
    "validate_schema",
]

DEFAULT_SCHEMA = "skiplock"

# Schema names become quoted identifiers, so any text would be safe in SQL; the
# restriction is for humans and for the LISTEN channel derived from it (63 bytes max).
_SCHEMA_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,47}$")
# Queue names are values, never identifiers; still, a typo like a trailing space or a
# control character is a bug we would rather report than store.
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/@-]{0,127}$")


# libpq's refusal, text libpq cannot be given (a lone surrogate has no UTF-8) and
# values it hands back that are not UTF-8 (a percent-escape such as %80).
_UNPARSABLE = (psycopg.ProgrammingError, UnicodeError)


def resolve_dsn(dsn: str | None) -> str | None:
    """Return the DSN to use: the argument, else SKIPLOCK_DSN, else DATABASE_URL.

    None means "start the embedded server".  An empty string counts as unset.
    """
    for candidate in (dsn, os.environ.get("SKIPLOCK_DSN"), os.environ.get("DATABASE_URL")):
        if candidate:
            return candidate
    return None


def check_dsn(dsn: str) -> str:
    """Parse ``dsn`` (URL or key=value form) and return it, or raise ConfigError."""
    try:
        conninfo_to_dict(dsn)
    except _UNPARSABLE:
        # libpq's message can quote the DSN back, password included: do not relay it, not
        # even as the chained cause, which every traceback and logger.exception prints.
        raise ConfigError(
            f"malformed DSN {redact_dsn(dsn)!r}: not a libpq URL or key=value string"
        ) from None
    return dsn


_KV_PASSWORD = re.compile(r"(password\s*=\s*)('[^']*'|.*?(?=\s+\w+\s*=|\Z))", re.I | re.S)


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``***``, safe for logs and errors."""
    try:
        params = conninfo_to_dict(dsn)
    except _UNPARSABLE:
        # Unparsable: mask anything that looks like a password in either form.
        # A URL's password runs to its last "@" (it may hold "/", "?" or "@" unescaped).
        masked = re.sub(r"(://[^:/@]*:).*@", r"\1***@", dsn, flags=re.S)
        # An unquoted key=value password runs to the next " key=" or the end: libpq
        # splits at any whitespace (a "\r" too), but what follows it in a DSN it cannot
        # parse may still be the password's tail.
        return _KV_PASSWORD.sub(r"\1***", masked)
    if "password" in params:
        params["password"] = "***"
    return make_conninfo("", **{k: str(v) for k, v in params.items() if v is not None})


def validate_schema(schema: str) -> str:
    if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
        raise ConfigError(
            f"invalid schema name {schema!r}: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 48 characters"
        )
    return schema


def validate_queue(queue: str) -> str:
    if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue):
        raise ConfigError(
            f"invalid queue name {queue!r}: use 1-128 letters, digits or _ . : / @ -, "
            "starting with a letter, digit or underscore"
        )
    return queue


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for failed attempts.

    The n-th failed attempt waits ``base * factor ** (n - 1)`` seconds, capped at
    ``max_delay``, then scaled by a random factor in ``[1 - jitter, 1 + jitter]`` so
    that jobs failing together (a provider outage) do not retry in lockstep.
    """

    base: float = 1.0
    factor: float = 2.0
    max_delay: float = 600.0
    jitter: float = 0.2

    def delay(self, attempts: int) -> float:
        raw = min(self.max_delay, self.base * self.factor ** max(attempts - 1, 0))
        if self.jitter:
            raw *= random.uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return max(raw, 0.0)
