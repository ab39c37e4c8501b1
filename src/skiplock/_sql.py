"""Named statements from sql/queries.sql and the ordered migrations in sql/migrations."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from psycopg import sql

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


class Statements:
    """The named statements rendered for one schema; attribute access by name."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        ident = sql.Identifier(schema)
        channel = sql.Literal(channel_name(schema))
        self._by_name: dict[str, sql.Composed] = {
            name: sql.SQL(text).format(schema=ident, channel=channel)
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
