"""The tools (lab, chaos, demo, audit) use the core's public surface, never its private modules.

The core is ``skiplock/_*.py``; the tools may import ``skiplock``, ``skiplock.connect``,
``skiplock.sqlfiles``, ``skiplock.cli.common`` and their own package's modules.  A private
import would tie a tool to the core's internals and let a core refactor break it silently.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import skiplock

PACKAGE = Path(skiplock.__file__).parent
TOOLS = ("lab", "chaos", "demo", "audit")


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def core_private_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of each import in a module of ``skiplock.<package>`` that reaches
    into a private module of the core, absolute (``skiplock._x``) or relative (``.._x``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                targets = [node.module or ""]
            elif node.level == 1:
                continue  # the tool's own package
            else:
                # ``from .. import _x`` names the module in the alias; ``from .._x`` in module.
                parent = "skiplock" if node.level == 2 else "<above skiplock>"
                base = f"{parent}.{node.module}" if node.module else parent
                targets = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] != "skiplock" or len(parts) < 2:
                continue
            if parts[1] == package:
                continue  # its own package, by absolute name
            if parts[1] in TOOLS:
                continue  # another tool (audit builds on the lab) through any of its modules
            if _is_private(".".join(parts[1:])) or target.startswith("<"):
                found.append((node.lineno, target))
    return found


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_import_no_private_core_module(tool: str) -> None:
    files = sorted((PACKAGE / tool).rglob("*.py"))
    assert files, f"no sources under {PACKAGE / tool}"
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
        for path in files
        for line, target in core_private_imports(path.read_text(encoding="utf-8"), tool)
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from skiplock._config import redact_dsn", ["skiplock._config"]),
        ("import skiplock._sql", ["skiplock._sql"]),
        ("def f():\n    from skiplock._embedded import embedded_dsn", ["skiplock._embedded"]),
        ("from .._errors import SkiplockError", ["skiplock._errors"]),
        ("from .. import _config", ["skiplock._config"]),
        ("from skiplock.cli._main import main", ["skiplock.cli._main"]),
        ("from skiplock import SkiplockError", []),
        ("from skiplock.connect import server_dsn", []),
        ("from skiplock.cli.common import user_errors", []),
        ("from skiplock.lab import race_prepared", []),
        ("from ._steps import Query", []),
        ("from skiplock.lab._steps import Query", []),
    ],
)
def test_the_check_sees_each_form(source: str, expected: list[str]) -> None:
    assert [target for _, target in core_private_imports(source, "audit")] == expected
