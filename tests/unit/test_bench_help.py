"""Every bench subcommand answers ``--help`` with its usage, without a database.

Half of them take positional arguments and parsed ``--help`` as a number (a
traceback); the dispatcher now prints their docstring, which is their usage.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from skiplock_bench.__main__ import SUBCOMMANDS  # noqa: E402


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_prints_its_usage(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "skiplock_bench", name, "--help"],
        env={"PYTHONPATH": str(BENCH), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert name in proc.stdout or SUBCOMMANDS[name][0] in proc.stdout, proc.stdout[:500]
