"""Named statements from sql/queries.sql and the ordered migrations in sql/migrations."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from psycopg import sql
from psycopg.abc import AdaptContext

__all__ = ["Migration", "Statements", "channel_name", "migrations", "statements"]

_HEADER = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.M)
_MIGRATION = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


def _read(name: str) -> str:
    return resources.files("skiplock").joinpath("sql", name).read_text(encoding="utf-8")


def parse_named(text: str) -> dict[str, str]:
    """Split a file of ``-- name: x`` blocks into {name: statement}."""
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in out:
            raise ValueError(f"statement {name!r} defined twice")
        out[name] = body.strip().rstrip(";")
    return out


def channel_name(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a skiplock schema."""
    return f"skiplock_{schema}"


class _Rendered(sql.Composed):
    """A named statement that keeps the bytes of its first rendering on a connection.

    psycopg renders a ``Composed`` query on every execute: it joins its parts and
    escapes the schema's identifier through libpq each time, about 30 us a statement
    here, as much CPU as the rest of a single ``enqueue()`` on the client takes once
    the round trip is removed.  A statement's text depends only on the schema and the
    channel, fixed for the object, and on the connection's encoding, which cannot
    change an all-ASCII text (every client encoding PostgreSQL offers agrees with ASCII
    below 0x80): so an ASCII rendering is kept and sent as it is afterwards.  A
    rendering with no connection to go by, or with other characters, is not kept.
    """

    def __init__(self, composed: sql.Composed) -> None:
        super().__init__(list(composed))
        self._bytes: bytes | None = None

    def as_bytes(self, context: AdaptContext | None = None) -> bytes:
        rendered = self._bytes
        if rendered is None:
            rendered = super().as_bytes(context)
            if context is not None and rendered.isascii():
                self._bytes = rendered
        return rendered


class Statements:
    """The named statements rendered for one schema; attribute access by name."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        ident = sql.Identifier(schema)
        channel = sql.Literal(channel_name(schema))
        self._by_name: dict[str, sql.Composed] = {
            name: _Rendered(sql.SQL(text).format(schema=ident, channel=channel))
            for name, text in parse_named(_read("queries.sql")).items()
        }

    def __getattr__(self, name: str) -> sql.Composed:
        try:
            return self._by_name[name]
        except KeyError:
            raise AttributeError(name) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)


@functools.lru_cache(maxsize=64)
def statements(schema: str) -> Statements:
    return Statements(schema)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    def render(self, schema: str) -> sql.Composed:
        return sql.SQL(self.text).format(
            schema=sql.Identifier(schema),
            channel=sql.Literal(channel_name(schema)),
            schema_name=sql.Literal(schema),
        )


@functools.cache
def migrations() -> tuple[Migration, ...]:
    """All migrations shipped with the package, in version order."""
    found: list[Migration] = []
    for entry in resources.files("skiplock").joinpath("sql", "migrations").iterdir():
        m = _MIGRATION.match(entry.name)
        if m:
            found.append(Migration(int(m["version"]), m["name"], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    # Gaps are allowed (branches reserve numbers and land in any order); _migrate
    # applies whichever known version a schema lacks.  Duplicates are a packaging bug.
    if len(set(versions)) != len(versions) or (versions and versions[0] < 1):
        raise RuntimeError(f"migrations are not numbered uniquely from 1: {versions}")
    return tuple(found)
