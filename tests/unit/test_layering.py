"""The tools (lab, chaos, demo, audit, dashboard) use the public core, never its private modules.

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
TOOLS = ("lab", "chaos", "demo", "audit", "dashboard")


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """skiplock's modules and the skiplock modules each imports, at any depth of the file.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``: importing a sibling module through its package is not a dependency on the
    package's ``__init__``.
    """
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in paths]
                edges.update(subs or [module])
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    # A cycle forces imports into function bodies and an order nobody can see; the audit's
    # extractors had one (_extract and _python).
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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


def django_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of Django in ``source``, at any depth."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found.extend((node.lineno, n) for n in names if n.split(".")[0] == "django")
    return found


def test_only_contrib_django_imports_django() -> None:
    # Django is an optional extra (and needs Python 3.12): the rest of skiplock must
    # import, and run, without it.
    contrib = PACKAGE / "contrib" / "django"
    assert any(django_imports(p.read_text(encoding="utf-8")) for p in contrib.rglob("*.py"))
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if contrib not in path.parents
        for line, target in django_imports(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "\n".join(offenders)


def test_contrib_django_uses_the_public_core() -> None:
    contrib = PACKAGE / "contrib" / "django"
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
        for path in sorted(contrib.rglob("*.py"))
        for line, target in core_private_imports(path.read_text(encoding="utf-8"), "contrib")
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import django", ["django"]),
        ("def f():\n    from django.db import connections", ["django.db"]),
        ("from djangoish import x", []),
        ("from .django import x", []),
    ],
)
def test_the_django_check_sees_each_form(source: str, expected: list[str]) -> None:
    assert [target for _, target in django_imports(source)] == expected
