#!/usr/bin/env python3
"""Generate skiplock's sync driver from its async source, with an AST transform.

Each operation is written once, in the async source; this script writes the sync copy
(``async def`` -> ``def``, ``await x`` -> ``x``, ``async with`` -> ``with``, async names
-> sync names).  Code under ``if ASYNC:`` is dropped and its ``else:`` branch kept, so a
genuine difference is written side by side in one place.  Comments do not survive the
AST round trip; the generated file says where the commented source is.

    scripts/async_to_sync.py           write the generated files
    scripts/async_to_sync.py --check   exit 1 if a generated file is out of date (CI)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "skiplock"

# source -> generated
FILES = {"_aqueue.py": "_queue.py"}

# Async names and their sync twins: identifiers, attributes, imported names, and the
# exact strings of __all__.
NAMES = {
    "AsyncQueue": "Queue",
    "arun_op": "run_op",
    "arun_together": "run_together",
    "_areconnecting": "_reconnecting",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncConnection": "Connection",
    "AsyncIterator": "Iterator",
    "asynccontextmanager": "contextmanager",
    "AsyncCursor": "Cursor",
    "asyncio": "time",
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
}


class AsyncToSync(ast.NodeTransformer):
    def __init__(self, source: str) -> None:
        self.source = source

    # -- async syntax ----------------------------------------------------------------

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        self.generic_visit(node)
        new = ast.FunctionDef(**{f: getattr(node, f) for f in node._fields})
        new.name = NAMES.get(node.name, node.name)
        return ast.copy_location(new, node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        self.generic_visit(node)
        node.name = NAMES.get(node.name, node.name)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        self.generic_visit(node)
        node.name = NAMES.get(node.name, node.name)
        return node

    def visit_Await(self, node: ast.Await) -> ast.AST:
        return self.visit(node.value)

    def visit_AsyncWith(self, node: ast.AsyncWith) -> ast.AST:
        self.generic_visit(node)
        return ast.copy_location(ast.With(items=node.items, body=node.body), node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> ast.AST:
        self.generic_visit(node)
        new = ast.For(target=node.target, iter=node.iter, body=node.body, orelse=node.orelse)
        return ast.copy_location(new, node)

    # -- the ASYNC switch ----------------------------------------------------------------

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        if isinstance(node.test, ast.Name) and node.test.id == "ASYNC":
            body = [self.visit(stmt) for stmt in node.orelse]
            return [s for s in body if s is not None] or [ast.Pass()]
        self.generic_visit(node)
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        if isinstance(node.op, ast.Not) and _is_async_flag(node.operand):
            return ast.copy_location(ast.Constant(True), node)
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        if _is_async_flag(node.target):
            return None
        self.generic_visit(node)
        return node

    # -- names -------------------------------------------------------------------------

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id == "ASYNC":
            raise SystemExit(f"line {node.lineno}: use ASYNC only as `if ASYNC:` or `not ASYNC`")
        node.id = NAMES.get(node.id, node.id)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        node.attr = NAMES.get(node.attr, node.attr)
        return node

    def visit_alias(self, node: ast.alias) -> ast.AST:
        node.name = NAMES.get(node.name, node.name)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        self.generic_visit(node)
        node.names = [a for a in node.names if a.name != "Final"]
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and node.value in NAMES:
            node.value = NAMES[node.value]
        return node


def _is_async_flag(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "ASYNC"


def convert(source_path: Path, target_name: str) -> str:
    tree = ast.parse(source_path.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    first = doc.splitlines()[0] if doc else ""
    tree = AsyncToSync(source_path.name).visit(tree)
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    first = first.replace("AsyncQueue: the asyncio driver", "Queue: the sync driver")
    header = (
        f'"""{first}\n\n'
        f"GENERATED from {source_path.name} by scripts/async_to_sync.py: do not edit.\n"
        f"Read and change {source_path.name}, the commented source, then regenerate.\n"
        '"""\n\n'
    )
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    text = header + ast.unparse(module) + "\n"
    return _ruff(text, target_name)


def _ruff(text: str, name: str) -> str:
    fake = str(PKG / name)
    fixed = subprocess.run(
        ["ruff", "check", "--select", "I,F401", "--fix", "--quiet", "--stdin-filename", fake, "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    # ruff check exits 1 when it reports issues it could not fix; the output is still
    # the fixed text, and the final `ruff check` of CI reports the rest.
    text = fixed.stdout or text
    formatted = subprocess.run(
        ["ruff", "format", "--quiet", "--stdin-filename", fake, "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return formatted.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args()
    stale = []
    for src, dst in FILES.items():
        text = convert(PKG / src, dst)
        target = PKG / dst
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if current == text:
            continue
        if args.check:
            stale.append(dst)
        else:
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run scripts/async_to_sync.py and commit",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
