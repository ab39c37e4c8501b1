"""What a database holds of skiplock: a schema name checked, the migration it is at.

For the layers built on the core (contrib.django, a health check, a deploy script) that
must tell "not migrated" or "behind this code" apart from any other error, without
reaching into the core's private modules.
"""

from __future__ import annotations

from ._config import validate_schema
from ._migrate import schema_version
from ._sql import migrations

__all__ = ["latest_migration", "schema_version", "validate_schema"]


def latest_migration() -> int:
    """The highest migration this version of skiplock ships (what `migrate` brings to)."""
    return max(m.version for m in migrations())
