"""SQL embedded in Python: string literals handed to execute-like calls or named *_SQL.

Found with ``ast``, never regexes, so comments, docstrings and unrelated strings are left
alone.  Literals are decoded by hand next to the AST so every SQL character keeps the line
and column of the source character it came from, escapes and f-string fields included.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from ._lexer import tokenize as sql_tokens
from ._source import Extracted, PositionTable, Problem, SqlText, Unit, suppressed_ids

__all__ = ["EXECUTE_LIKE", "extract_python"]

# Callables whose SQL argument we audit: DB-API and psycopg (execute*), asyncpg (fetch*,
# prepare), SQLAlchemy (text, exec_driver_sql), Django (raw), psycopg.sql (SQL), pandas.
EXECUTE_LIKE = frozenset(
    {
        "execute",
        "executemany",
        "executescript",
        "execute_values",
        "execute_batch",
        "exec_driver_sql",
        "fetch",
        "fetchrow",
        "fetchval",
        "prepare",
        "text",
        "raw",
        "SQL",
        "query",
        "mogrify",
        "copy",
        "copy_expert",
        "read_sql",
        "read_sql_query",
    }
)
_MAYBE_SQL = re.compile(
    r"\b(" + "|".join(sorted(EXECUTE_LIKE)) + r")\s*\(|(?i:sql|query)\w*\s*(:[^=\n]*)?=[^=]"
)
_SQL_KWARGS = ("sql", "query", "statement", "operation", "stmt", "command")
# str methods that only trim whitespace or fill {fields} at run time: audit the receiver.
_METHODS = frozenset({"strip", "lstrip", "rstrip", "format"})
_FORMAT_FIELD = re.compile(r"\{[^{}'\"\n]*\}")
_SQL_FIRST_WORDS = frozenset(
    {
        "select",
        "insert",
        "update",
        "delete",
        "with",
        "merge",
        "values",
        "table",
        "copy",
        "lock",
        "create",
        "alter",
        "drop",
        "truncate",
        "explain",
        "begin",
        "start",
        "commit",
        "rollback",
        "call",
        "do",
        "listen",
        "notify",
        "prepare",
        "declare",
        "savepoint",
        "refresh",
        "vacuum",
        "analyze",
    }
)
_PREFIX_QUOTE = re.compile(r"([rRbBuUfF]{0,2})('''|\"\"\"|'|\")")
_SIMPLE_ESCAPES = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
}

Pos = tuple[int, int]
FuncNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class _Piece:
    text: str
    positions: list[Pos]
    dynamic: bool


def _callee_name(call: ast.Call) -> str:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return ""


def _is_sql_name(name: str) -> bool:
    return name.upper().endswith(("SQL", "QUERY"))


def _assigned_names(node: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    names = []
    for t in targets:
        if isinstance(t, ast.Name):
            names.append(t.id)
        elif isinstance(t, ast.Attribute):
            names.append(t.attr)
    return names


def _scope_nodes(root: ast.AST) -> Iterator[ast.AST]:
    """Nodes of one scope: nested functions are yielded but not entered (own units)."""
    stack = list(reversed(list(ast.iter_child_nodes(root))))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, FuncNode | ast.Lambda):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _escape(seg: str, j: int) -> tuple[str, int]:
    """Decode the backslash escape at seg[j]: (produced text, source length)."""
    nxt = seg[j + 1] if j + 1 < len(seg) else ""
    if nxt == "\n":
        return "", 2
    if nxt in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[nxt], 2
    hex_len = {"x": 2, "u": 4, "U": 8}.get(nxt)
    if hex_len:
        return chr(int(seg[j + 2 : j + 2 + hex_len], 16)), 2 + hex_len
    if nxt == "N" and j + 2 < len(seg) and seg[j + 2] == "{":
        close = seg.index("}", j + 2)
        return unicodedata.lookup(seg[j + 3 : close]), close - j + 1
    octal = re.match(r"[0-7]{1,3}", seg[j + 1 : j + 4])
    if octal:
        return chr(int(octal.group(), 8)), 1 + len(octal.group())
    return "\\", 1


def _field_end(seg: str, j: int) -> int:
    """Index after the '}' closing the f-string field opened at seg[j]."""
    depth = 0
    k = j
    while k < len(seg):
        ch = seg[k]
        if ch in "'\"":
            close = seg.find(ch, k + 1)
            if close < 0:
                return -1
            k = close
        elif ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return -1


def _walk_literals(seg: str, where: list[Pos]) -> tuple[str, list[Pos], str] | None:
    """Decode the (implicitly concatenated) literals of ``seg``.

    Returns the text, the source position of each char, and the text of the literal parts
    alone (f-string fields left out), which the caller checks against the AST.
    """
    out: list[str] = []
    pos: list[Pos] = []
    literal: list[str] = []

    def emit(s: str, at: int, is_literal: bool = True) -> None:
        out.append(s)
        pos.extend([where[at]] * len(s))
        if is_literal:
            literal.append(s)

    i, n = 0, len(seg)
    while i < n:
        c = seg[i]
        if c.isspace() or c in "()\\":
            i += 1
            continue
        if c == "#":
            nl = seg.find("\n", i)
            i = n if nl < 0 else nl
            continue
        m = _PREFIX_QUOTE.match(seg, i)
        if not m or "b" in m.group(1).lower():
            return None
        raw, fmt, quote = "r" in m.group(1).lower(), "f" in m.group(1).lower(), m.group(2)
        j = m.end()
        while True:
            if j >= n:
                return None
            if seg.startswith(quote, j):
                j += len(quote)
                break
            ch = seg[j]
            if fmt and ch in "{}" and seg.startswith(ch * 2, j):
                emit(ch, j)
                j += 2
            elif fmt and ch == "{":
                end = _field_end(seg, j)
                if end < 0:
                    return None
                expr = re.split(r"[!:=]", seg[j + 1 : end - 1], maxsplit=1)[0]
                emit("{" + re.sub(r"\W+", "_", expr).strip("_") + "}", j, is_literal=False)
                j = end
            elif ch == "\\" and raw:
                step = 2 if j + 1 < n and seg[j + 1] in "\\'\"" else 1
                for k in range(j, j + step):
                    emit(seg[k], k)
                j += step
            elif ch == "\\":
                decoded, length = _escape(seg, j)
                emit(decoded, j)
                j += length
            else:
                emit(ch, j)
                j += 1
        i = j
    return "".join(out), pos, "".join(literal)


class _Module:
    """One Python file being searched for SQL."""

    def __init__(self, text: str, path: str, tree: ast.Module) -> None:
        self.text = text
        self.path = path
        self.tree = tree
        # Lines as the tokenizer counts them (str.splitlines also splits on \f, \x1c ...).
        self.lines = io.StringIO(text, newline="").readlines()
        # Module and class level string assignments, by name: resolved from any function.
        self.globals: dict[str, ast.expr] = {}
        for node in _scope_nodes(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                for name in _assigned_names(node):
                    self.globals[name] = node.value
        # self.CLAIM_SQL = "..." in a method is read back as self.CLAIM_SQL elsewhere.
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) for t in node.targets
            ):
                for name in _assigned_names(node):
                    self.globals.setdefault(name, node.value)
        self.comments = self._comments()
        self.texts: dict[int, SqlText | None] = {}
        self.composed: set[int] = set()

    def _comments(self) -> dict[int, frozenset[str]]:
        found: dict[int, frozenset[str]] = {}
        if "skiplock:" not in self.text:
            return found
        try:
            for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
                if tok.type == tokenize.COMMENT and (ids := suppressed_ids(tok.string)):
                    found[tok.start[0]] = ids
        except (tokenize.TokenError, SyntaxError):
            pass
        return found

    def _segment(self, node: ast.expr) -> str:
        """The source text of a node (ast.get_source_segment re-splits the whole file)."""
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        if last >= len(self.lines) or node.end_col_offset is None:
            return ""
        if first == last:
            return self.lines[first].encode()[node.col_offset : node.end_col_offset].decode()
        head = self.lines[first].encode()[node.col_offset :].decode()
        tail = self.lines[last].encode()[: node.end_col_offset].decode()
        return head + "".join(self.lines[first + 1 : last]) + tail

    def _start(self, node: ast.expr) -> Pos:
        line = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else ""
        col = len(line.encode()[: node.col_offset].decode(errors="replace"))
        return node.lineno, col + 1

    def _literal(self, node: ast.Constant | ast.JoinedStr) -> _Piece:
        start = self._start(node)
        seg = self._segment(node)
        where: list[Pos] = []
        line, col = start
        for ch in seg:
            where.append((line, col))
            line, col = (line + 1, 1) if ch == "\n" else (line, col + 1)
        decoded = _walk_literals(seg, where) if seg else None
        if isinstance(node, ast.Constant):
            expected = str(node.value)
        else:
            expected = "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
        dynamic = bool(_FORMAT_FIELD.search(expected)) or (
            isinstance(node, ast.JoinedStr)
            and any(isinstance(v, ast.FormattedValue) for v in node.values)
        )
        if decoded is not None and decoded[2] == expected:
            return _Piece(decoded[0], decoded[1], dynamic)
        # Unusual source (e.g. a literal we cannot re-lex): point everything at its start.
        if isinstance(node, ast.JoinedStr):
            expected = "".join(
                str(v.value) if isinstance(v, ast.Constant) else "{f}" for v in node.values
            )
        return _Piece(expected, [start] * len(expected), dynamic)

    def core(
        self, expr: ast.expr, local: dict[str, list[ast.stmt]], before: int
    ) -> ast.expr | None:
        """The expression holding the SQL text, through names and wrapper calls.

        Text reached through psycopg's SQL() or through a name that is later extended
        with += may be a fragment of a composed statement: it is marked as composed.
        """
        composed = False
        for _ in range(20):
            if isinstance(expr, ast.Call):
                name = _callee_name(expr)
                if name in _METHODS and isinstance(expr.func, ast.Attribute):
                    # "...".strip(), "...{x}".format(...): the receiver holds the SQL.
                    expr = expr.func.value
                    continue
                if name == "dedent" or name in EXECUTE_LIKE:
                    composed = composed or name == "SQL"
                    arg = _sql_argument(expr)
                    if arg is None:
                        return None
                    expr = arg
                    continue
                return None
            if isinstance(expr, ast.Name):
                assigns = local.get(expr.id, [])
                composed = composed or any(isinstance(n, ast.AugAssign) for n in assigns)
                value = _last_assignment(assigns, before)
                value = value if value is not None else self.globals.get(expr.id)
                if value is None:
                    return None
                expr = value
                continue
            if isinstance(expr, ast.Attribute):
                found = self.globals.get(expr.attr)
                if found is None:
                    return None
                expr = found
                continue
            if isinstance(expr, ast.Constant) and not isinstance(expr.value, str):
                return None
            if isinstance(expr, ast.Constant | ast.JoinedStr | ast.BinOp):
                if composed:
                    self.composed.add(id(expr))
                return expr
            return None
        return None

    def piece(self, expr: ast.expr, local: dict[str, list[ast.stmt]]) -> _Piece | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return self._literal(expr)
        if isinstance(expr, ast.JoinedStr):
            return self._literal(expr)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod):
            left = self.core(expr.left, local, expr.lineno)
            inner = self.piece(left, local) if left is not None else None
            return _Piece(inner.text, inner.positions, True) if inner else None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            parts: list[_Piece] = []
            for side in (expr.left, expr.right):
                c = self.core(side, local, expr.lineno)
                p = self.piece(c, local) if c is not None else None
                if p is None:
                    # A value spliced in at run time: a named placeholder, like an f-field.
                    src = self._segment(side) or "expr"
                    name = "{" + re.sub(r"\W+", "_", src).strip("_") + "}"
                    p = _Piece(name, [self._start(side)] * len(name), True)
                parts.append(p)
            if all(p.dynamic and p.text.startswith("{") for p in parts):
                return None
            return _Piece(
                "".join(p.text for p in parts),
                [w for p in parts for w in p.positions],
                True,
            )
        return None

    def sql_text(self, core: ast.expr, local: dict[str, list[ast.stmt]]) -> SqlText | None:
        if id(core) in self.texts:
            return self.texts[id(core)]
        piece = self.piece(core, local)
        result: SqlText | None = None
        if piece is not None and _looks_like_sql(piece.text):
            end = piece.positions[-1] if piece.positions else self._start(core)
            first = getattr(core, "lineno", 1)
            last = getattr(core, "end_lineno", first) or first
            suppressed: set[str] = set()
            for line in range(first - 1, last + 1):
                suppressed |= self.comments.get(line, frozenset())
            result = SqlText(
                self.path,
                piece.text,
                PositionTable(piece.positions, end),
                dynamic=piece.dynamic or id(core) in self.composed,
                suppressed=frozenset(suppressed),
            )
        self.texts[id(core)] = result
        return result


def _sql_argument(call: ast.Call) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg in _SQL_KWARGS:
            return kw.value
    # psycopg2.extras.execute_values(cur, sql, ...) takes the cursor first.
    skip = 1 if _callee_name(call) in ("execute_values", "execute_batch") else 0
    args = [a for a in call.args if not isinstance(a, ast.Starred)]
    return args[skip] if len(args) > skip else None


def _last_assignment(assigns: list[ast.stmt], before: int) -> ast.expr | None:
    value: ast.expr | None = None
    for node in assigns:
        if node.lineno <= before and isinstance(node, ast.Assign | ast.AnnAssign):
            value = node.value
    return value


def _looks_like_sql(text: str) -> bool:
    for tok in sql_tokens(text):
        if tok.kind in ("comment",) or tok.text == "(":
            continue
        return tok.kind == "word" and tok.lower in _SQL_FIRST_WORDS
    return False


def _scan_scope(
    mod: _Module, root: ast.AST, used_elsewhere: set[int]
) -> tuple[list[tuple[Pos, ast.expr]], dict[str, list[ast.stmt]], list[FuncNode]]:
    """Events (position, SQL core expression) of one scope, in source order."""
    local: dict[str, list[ast.stmt]] = {}
    nested: list[FuncNode] = []
    nodes = list(_scope_nodes(root))
    for node in nodes:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for name in _assigned_names(node):
                local.setdefault(name, []).append(node)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            local.setdefault(node.target.id, []).append(node)
        elif isinstance(node, FuncNode):
            nested.append(node)
    events: list[tuple[Pos, ast.expr]] = []
    for node in nodes:
        if isinstance(node, ast.Call) and _callee_name(node) in EXECUTE_LIKE:
            core = mod.core(node, local, node.lineno)
            if core is not None:
                events.append(((node.lineno, node.col_offset), core))
                if not isinstance(root, ast.Module):
                    used_elsewhere.add(id(core))
        elif (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and node.value is not None
            and any(_is_sql_name(n) for n in _assigned_names(node))
        ):
            core = mod.core(node.value, local, node.lineno)
            if core is not None:
                events.append(((node.lineno, node.col_offset), core))
    events.sort(key=lambda e: e[0])
    return events, local, nested


def extract_python(text: str, path: str) -> Extracted:
    """SQL from one Python file: one unit per function, plus one for module-level code."""
    if not _MAYBE_SQL.search(text):
        # Most files in a tree run no SQL at all: skip them before the costly AST walk.
        return Extracted()
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        return Extracted(
            problems=[
                Problem(path, exc.lineno or 1, exc.offset or 1, f"cannot parse Python: {exc.msg}")
            ]
        )
    except (ValueError, UnicodeEncodeError) as exc:
        # Text no Python file can hold (a lone surrogate): say so, like a syntax error.
        return Extracted(problems=[Problem(path, 1, 1, f"cannot parse Python: {exc}")])
    mod = _Module(text, path, tree)
    used_in_functions: set[int] = set()
    scopes: list[tuple[str, list[tuple[Pos, ast.expr]], dict[str, list[ast.stmt]]]] = []
    module_events, module_local, pending = _scan_scope(mod, tree, used_in_functions)
    while pending:
        fn = pending.pop(0)
        events, local, nested = _scan_scope(mod, fn, used_in_functions)
        scopes.append((f"{fn.name}()", events, local))
        pending.extend(nested)
    # A module-level constant used by a function belongs to that function's sequence; only
    # SQL never used by a function is left to the module-level unit.
    module_events = [e for e in module_events if id(e[1]) not in used_in_functions]
    scopes.insert(0, ("<module>", module_events, module_local))

    result = Extracted()
    seen: set[int] = set()
    for name, events, local in scopes:
        unit = Unit(path, name)
        in_unit: set[int] = set()
        for _, core in events:
            sql = mod.sql_text(core, local)
            if sql is None or id(sql) in in_unit:
                continue
            in_unit.add(id(sql))
            unit.texts.append(sql)
            if id(sql) not in seen:
                seen.add(id(sql))
                result.texts.append(sql)
        if unit.texts:
            result.units.append(unit)
    result.texts.sort(key=lambda s: s.locator.position(0))
    return result
