"""Shared plumbing: scratch databases, results bookkeeping, percentiles, machine facts."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"

# One scratch database per library: procrastinate and pgqueuer install their own schema
# (tables, types, triggers, functions) and must not see each other's notifications.
DB_PREFIX = "bench_"


def log(msg: str) -> None:
    """Progress on stderr, so a long run shows where it is."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dsn_for(dsn: str, dbname: str) -> str:
    """The same server and credentials, another database (as a URL: asyncpg wants one)."""
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return to_url(make_conninfo("", **params))


def to_url(dsn: str) -> str:
    """A libpq key=value string or URL, as a postgresql:// URL."""
    from urllib.parse import quote, urlencode

    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    user = params.pop("user", "")
    password = params.pop("password", "")
    host = params.pop("host", "")
    port = params.pop("port", "")
    dbname = params.pop("dbname", "")
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    netloc = (
        (auth + "@" if auth else "")
        + (host if host and not host.startswith("/") else "")
        + (":" + port if port else "")
    )
    if host.startswith("/"):
        params["host"] = host  # a socket directory goes in the query string
    query = "?" + urlencode(params) if params else ""
    return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"


def admin_execute(dsn: str, *statements: sql.Composed) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in statements:
            conn.execute(stmt)


def terminate_backends(dsn: str, dbname: str) -> None:
    """Stragglers (a killed child's sessions) would block DROP DATABASE."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )


def recreate_database(dsn: str, dbname: str) -> str:
    """Drop and create a scratch database; returns its DSN."""
    terminate_backends(dsn, dbname)
    ident = sql.Identifier(dbname)
    admin_execute(
        dsn,
        sql.SQL("DROP DATABASE IF EXISTS {}").format(ident),
        sql.SQL("CREATE DATABASE {}").format(ident),
    )
    return dsn_for(dsn, dbname)


def drop_database(dsn: str, dbname: str) -> None:
    terminate_backends(dsn, dbname)
    admin_execute(dsn, sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(dbname)))


def settle(dsn: str) -> None:
    """Same starting line for every timed section: fresh statistics, no dirty buffers
    left over from the previous section to be written on this one's time."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE")
        conn.execute("CHECKPOINT")


# -- statistics ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); the tail is a real sample, not a blend."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Key:
    """One figure of the table: measured once per round."""

    section: str
    lib: str
    config: str
    n: int
    metric: str


@dataclass
class Check:
    """The exactly-once verdict of one drain (or pickup) run."""

    section: str
    lib: str
    config: str
    n: int
    round: int
    executed: int
    duplicates: int
    missing: int
    db_state: str
    ok: bool


@dataclass
class Results:
    rounds: int
    values: dict[Key, dict[int, float]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, key: Key, rnd: int, value: float) -> None:
        self.values.setdefault(key, {})[rnd] = value

    def series(self, key: Key) -> dict[int, float]:
        return self.values.get(key, {})

    def median(self, key: Key) -> float:
        return median(self.series(key).values())

    def ratio(self, num: Key, den: Key) -> dict[int, float]:
        """Per-round ratios: both figures from the same round, so drift cancels."""
        a, b = self.series(num), self.series(den)
        return {r: a[r] / b[r] for r in a if b.get(r)}

    def keys(self, section: str) -> list[Key]:
        return sorted(k for k in self.values if k.section == section)


def exactly_once(seen: Iterable[int], n: int) -> tuple[int, int, int]:
    """(executions, duplicate executions, jobs never executed) for job numbers 0..n-1."""
    counts = [0] * n
    executed = 0
    for i in seen:
        executed += 1
        if 0 <= i < n:
            counts[i] += 1
    duplicates = sum(c - 1 for c in counts if c > 1)
    missing = sum(1 for c in counts if c == 0)
    return executed, duplicates, missing


# -- machine ------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def find_pgbench() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    for major in range(20, 9, -1):
        path = f"/usr/lib/postgresql/{major}/bin/pgbench"
        if os.access(path, os.X_OK):
            return path
    return None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "skiplock",
        "procrastinate",
        "pgqueuer",
        "asyncpg",
        "uvloop",
        "psycopg",
        "psycopg-pool",
        "matplotlib",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    pgbench = find_pgbench()
    if pgbench:
        res = subprocess.run([pgbench, "--version"], capture_output=True, text=True, check=False)
        out["pgbench"] = res.stdout.strip().removeprefix("pgbench (PostgreSQL) ")
    else:
        out["pgbench"] = "not found"
    return out


PG_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "max_connections",
    "fsync",
    "wal_level",
    "max_wal_size",
    "checkpoint_timeout",
    "autovacuum",
    "autovacuum_naptime",
    "work_mem",
)


def machine_info(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()
        rows = conn.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)",
            (list(PG_SETTINGS),),
        ).fetchall()
    settings = {}
    for name, setting, unit in rows:
        settings[name] = _pretty_setting(setting, unit)
    return {
        "cpus": os.cpu_count() or 0,
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "memory_gib": _memory_gib(),
        "postgres": version[0] if version else "?",
        "pg_settings": {k: settings.get(k, "?") for k in PG_SETTINGS},
        "versions": versions(),
    }


def _pretty_setting(setting: str, unit: str | None) -> str:
    # shared_buffers is reported in 8kB pages; show it the way postgresql.conf says it.
    if unit == "8kB" and setting.isdigit():
        return f"{int(setting) * 8 // 1024}MB"
    if unit == "kB" and setting.isdigit():
        kb = int(setting)
        return f"{kb // 1024}MB" if kb >= 1024 else f"{kb}kB"
    if unit == "MB" and setting.isdigit():
        return f"{setting}MB"
    if unit in ("s", "ms"):
        return f"{setting}{unit}"
    return setting


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def loadavg() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "?"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# -- CPU accounting -----------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (Linux /proc); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds over all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


@contextmanager
def timer() -> Iterator[list[float]]:
    """``with timer() as t: ...`` then ``t[0]`` is the elapsed seconds."""
    box: list[float] = []
    start = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - start)
