"""A small SQL scanner: split statements and rewrite driver placeholders, keeping offsets.

pglast parses PostgreSQL only, so ``%s``, ``%(name)s``, ``:name`` and ``{name}`` (psycopg's
``sql.SQL`` and ``str.format``) must become something it accepts.  Every rewrite keeps a map
from the rewritten text back to the original, so findings point at what the user wrote.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "FORMAT_PREFIX",
    "Chunk",
    "Normalized",
    "Token",
    "normalize",
    "split_statements",
    "tokenize",
]

# Identifiers stand in for {format} fields: they parse in value *and* name positions
# (``FROM {table}``), where a $n parameter would not.  The prefix marks them as opaque.
FORMAT_PREFIX = "_fmt_"

_WORD_START = re.compile(r"[A-Za-z_\u0080-\uffff]")
_WORD = re.compile(r"[A-Za-z0-9_$\u0080-\uffff]*")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\uffff][A-Za-z0-9_\u0080-\uffff]*)?\$")
_PYFORMAT = re.compile(r"%\((?P<name>[^()]*)\)[sbt]")
_PERCENT = re.compile(r"%[sbt](?![A-Za-z0-9_])")
_COLON_NAME = re.compile(r":(?P<name>[A-Za-z_][A-Za-z0-9_]*)")
_PSQL_VAR = re.compile(r":(?P<q>['\"])(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P=q)")
_FORMAT = re.compile(r"\{(?P<name>[^{}'\"\n]*)\}")
_DOLLAR_PARAM = re.compile(r"\$([0-9]+)")
_NAMED_QUERY = re.compile(r"--\s*(?::name\b|name\s*:|[A-Za-z_]\w*\s*--\s*$)")


@dataclass(frozen=True)
class Token:
    """One lexeme.  kind: word, number, string, ident, comment, param, format, meta, op, punct."""

    kind: str
    start: int
    end: int
    text: str
    # A name shared by every occurrence of the same named parameter or format field.
    name: str = ""

    @property
    def lower(self) -> str:
        return self.text.lower()


def _skip_string(text: str, i: int, backslash: bool) -> int:
    """End of the quoted literal opening at text[i] (a quote char); '' is an escaped quote."""
    quote = text[i]
    n = len(text)
    j = i + 1
    while j < n:
        c = text[j]
        if backslash and c == "\\":
            j += 2
            continue
        if c == quote:
            if j + 1 < n and text[j + 1] == quote:
                j += 2
                continue
            return j + 1
        j += 1
    return n


def _skip_block_comment(text: str, i: int) -> int:
    # PostgreSQL block comments nest, unlike C's.
    depth = 0
    n = len(text)
    j = i
    while j < n:
        if text.startswith("/*", j):
            depth += 1
            j += 2
        elif text.startswith("*/", j):
            depth -= 1
            j += 2
            if depth == 0:
                return j
        else:
            j += 1
    return n


def tokenize(text: str) -> Iterator[Token]:
    """Lex SQL text, recognising driver placeholders and psql meta-commands as tokens."""
    i = 0
    n = len(text)
    at_statement_start = True
    bracket_depth = 0
    previous: Token | None = None
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        start = i
        kind = "op"
        name = ""
        if text.startswith("--", i):
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            kind = "comment"
        elif text.startswith("/*", i):
            i = _skip_block_comment(text, i)
            kind = "comment"
        elif c == "\\" and at_statement_start:
            # A psql meta-command (\set, \i, \gexec ...) runs to the end of its line.
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            kind = "meta"
        elif c == "'":
            i = _skip_string(text, i, backslash=False)
            kind = "string"
        elif c == '"':
            i = _skip_string(text, i, backslash=False)
            kind = "ident"
        elif c == "$":
            m = _DOLLAR_PARAM.match(text, i)
            tag = _DOLLAR_TAG.match(text, i)
            if m:
                i = m.end()
                kind, name = "param", "$" + m.group(1)
            elif tag:
                close = text.find(tag.group(), tag.end())
                i = n if close < 0 else close + len(tag.group())
                kind = "string"
            else:
                i += 1
        elif c == "%":
            m = _PYFORMAT.match(text, i) or _PERCENT.match(text, i)
            if m:
                i = m.end()
                kind = "param"
                name = "%(" + m.group("name") + ")" if "name" in m.groupdict() else ""
            elif text.startswith("%%", i):
                i += 2
                kind = "percent"
            else:
                i += 1
        elif c == ":":
            m = _PSQL_VAR.match(text, i)
            if text.startswith("::", i) or text.startswith(":=", i):
                i += 2
            elif m:
                i = m.end()
                # :'var' is a value, :"var" a name: only the latter must stay an identifier.
                kind = "param" if m.group("q") == "'" else "format"
                name = ":" + m.group("name")
            elif bracket_depth == 0 and (m := _COLON_NAME.match(text, i)):
                i = m.end()
                kind, name = "param", ":" + m.group("name")
            else:
                i += 1
        elif c == "{":
            m = _FORMAT.match(text, i)
            if m:
                i = m.end()
                kind, name = "format", m.group("name").strip()
            else:
                i += 1
                kind = "punct"
        elif _WORD_START.match(c):
            if c in "eE" and i + 1 < n and text[i + 1] == "'":
                # E'...' strings are the only ones where backslash escapes a quote.
                i = _skip_string(text, i + 1, backslash=True)
                kind = "string"
            else:
                word = _WORD.match(text, i + 1)
                i = word.end() if word else i + 1
                kind = "word"
                # B'0101', X'ff', N'text': literals too, despite the leading letter.
                if i < n and text[i] == "'" and text[start:i].lower() in ("b", "x", "n"):
                    i = _skip_string(text, i, backslash=False)
                    kind = "string"
        elif c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            m = _NUMBER.match(text, i)
            i = m.end() if m else i + 1
            kind = "number"
        elif c == "?" and _is_qmark(previous, text[i + 1 : i + 2]):
            i += 1
            kind = "param"
        else:
            i += 1
            kind = "punct" if c in "(),;[]." else "op"
            if c == "[":
                bracket_depth += 1
            elif c == "]":
                bracket_depth = max(0, bracket_depth - 1)
        if kind not in ("comment", "meta"):
            at_statement_start = kind == "punct" and c == ";"
        tok = Token(kind, start, i, text[start:i], name)
        if kind not in ("comment", "meta"):
            previous = tok
        yield tok


def _is_qmark(previous: Token | None, following: str) -> bool:
    """A DB-API qmark placeholder, not jsonb's ? / ?| / ?& operator (which follows a value)."""
    if following in ("|", "&", "?"):
        return False
    if previous is None:
        return False
    return previous.text in ("=", "<", ">", "(", ",") or previous.lower in ("limit", "offset")


@dataclass(frozen=True)
class Chunk:
    """One statement's span in a text, without its terminating semicolon."""

    start: int
    end: int
    # Offset of the statement's first significant token: where "the statement" is reported.
    first: int


def split_statements(text: str) -> list[Chunk]:
    """Split on top-level semicolons, dropping spans with only comments or meta-commands.

    Two more rules: a named-query header comment (``-- name: x`` as aiosql, yesql and
    skiplock's own queries.sql write it, ``-- :name x`` for HugSQL, ``-- x --`` for
    procrastinate) starts a statement, as such files often leave out semicolons; and a
    ``BEGIN ATOMIC ... END`` function body is not split.
    """
    chunks: list[Chunk] = []
    start = 0
    first = -1
    atomic = cases = 0
    previous = ""
    for tok in tokenize(text):
        if tok.kind == "comment" and _NAMED_QUERY.match(tok.text) and atomic == 0:
            if first >= 0:
                chunks.append(Chunk(start, tok.start, first))
            start, first = tok.start, -1
            continue
        if tok.kind == "word":
            word = tok.lower
            if word == "atomic" and previous == "begin":
                atomic += 1
            elif atomic and word == "case":
                cases += 1
            elif atomic and word == "end":
                if cases:
                    cases -= 1
                else:
                    atomic -= 1
        if tok.kind not in ("comment", "meta"):
            previous = tok.lower
        if tok.kind == "punct" and tok.text == ";" and atomic == 0:
            if first >= 0:
                chunks.append(Chunk(start, tok.start, first))
            start, first = tok.end, -1
        elif tok.kind not in ("comment", "meta") and first < 0:
            first = tok.start
    if first >= 0:
        chunks.append(Chunk(start, len(text), first))
    return chunks


@dataclass(frozen=True)
class Normalized:
    """Text pglast can parse, plus the offset in the original text of each of its chars."""

    text: str
    origin: tuple[int, ...]
    # What each stand-in replaced ("$3" -> ":status_1", "_fmt_table" -> "{table}").
    replaced: tuple[tuple[str, str], ...] = ()

    def original(self, index: int) -> int:
        if not self.origin:
            return 0
        return self.origin[max(0, min(index, len(self.origin) - 1))]

    def restore(self, text: str) -> str:
        """Put the user's placeholders back into text printed from the parse tree."""
        names = dict(self.replaced)
        pattern = r"\$[0-9]+|" + re.escape(FORMAT_PREFIX) + r"\w*"
        return re.sub(pattern, lambda m: names.get(m.group(), m.group()), text)


def _format_ident(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_").lower()
    return (FORMAT_PREFIX + (cleaned or "0"))[:63]


def normalize(text: str) -> Normalized:
    """Rewrite placeholders to $n / identifiers and blank out psql meta-commands."""
    toks = list(tokenize(text))
    numbered = [int(t.name[1:]) for t in toks if t.kind == "param" and t.name.startswith("$")]
    next_number = max(numbered, default=0) + 1
    by_name: dict[str, str] = {}
    replaced: dict[str, str] = {}
    out: list[str] = []
    origin: list[int] = []
    pos = 0

    def emit(s: str, src: int) -> None:
        out.append(s)
        origin.extend([src] * len(s))

    for tok in toks:
        if tok.kind not in ("param", "format", "meta", "percent"):
            continue
        if tok.kind == "param" and tok.name.startswith("$"):
            continue
        for k in range(pos, tok.start):
            origin.append(k)
        out.append(text[pos : tok.start])
        if tok.kind == "param":
            if tok.name and tok.name in by_name:
                repl = by_name[tok.name]
            else:
                repl = f"${next_number}"
                next_number += 1
                if tok.name:
                    by_name[tok.name] = repl
        elif tok.kind == "format":
            repl = _format_ident(tok.name)
        elif tok.kind == "percent":
            repl = "%"
        else:
            repl = " " * (tok.end - tok.start)
        emit(repl, tok.start)
        if tok.kind in ("param", "format"):
            replaced.setdefault(repl, tok.text)
        pos = tok.end
    for k in range(pos, len(text) + 1):
        origin.append(k)
    out.append(text[pos:])
    return Normalized("".join(out), tuple(origin), tuple(replaced.items()))
