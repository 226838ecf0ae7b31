"""What a file holds, read from the stdlib `ast` (a ninth of a LibCST parse): the identifiers,
called names, strings and node kinds. A lint run asks each rule whether it can report on
the file at all (`Rule.gate`); a file no selected rule can report on is never parsed by
LibCST. Generic Python facts: no torch API here.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, List, Optional, Set


def _every_node(tree: ast.AST) -> List[ast.AST]:
    """`ast.walk`'s nodes, in another order, at half its cost (no generators)."""
    out: List[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for name in node._fields:
            value = getattr(node, name, None)
            if type(value) is list:
                stack.extend([item for item in value if isinstance(item, ast.AST)])
            elif isinstance(value, ast.AST):
                stack.append(value)
    return out


@dataclass(frozen=True)
class SourceFacts:
    text: str
    # Every identifier: names, attributes, keyword arguments, imported names and each part of
    # a dotted import, `as` names, defined functions, classes and parameters, global names.
    ids: FrozenSet[str]
    # The last name of every called expression: `f` of `f()`, `cuda` of `x.y.cuda()`.
    calls: FrozenSet[str]
    strings: FrozenSet[str]  # every str constant, f-string parts included
    kinds: FrozenSet[str]  # the `ast` class names present: "AugAssign", "Try", "Subscript", ...

    @classmethod
    def of(cls, tree: ast.AST, text: str) -> "SourceFacts":
        ids: Set[str] = set()
        calls: Set[str] = set()
        strings: Set[str] = set()
        kinds: Set[type] = set()
        for node in _every_node(tree):
            kind = type(node)
            kinds.add(kind)
            if kind is ast.Name:
                ids.add(node.id)
            elif kind is ast.Attribute:
                ids.add(node.attr)
            elif kind is ast.Constant:
                if type(node.value) is str:
                    strings.add(node.value)
            elif kind is ast.Call:
                func = node.func
                if type(func) is ast.Name:
                    calls.add(func.id)
                elif type(func) is ast.Attribute:
                    calls.add(func.attr)
            elif kind is ast.keyword or kind is ast.arg:
                if node.arg:
                    ids.add(node.arg)
            elif kind is ast.alias:
                ids.update(node.name.split("."))
                if node.asname:
                    ids.add(node.asname)
            elif kind is ast.ImportFrom:
                if node.module:
                    ids.update(node.module.split("."))
            elif kind in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
                ids.add(node.name)
            elif kind in (ast.Global, ast.Nonlocal):
                ids.update(node.names)
            elif kind in (ast.MatchAs, ast.MatchStar):
                if node.name:
                    ids.add(node.name)
            elif kind is ast.MatchClass or kind is ast.MatchMapping:
                ids.update(getattr(node, "kwd_attrs", ()))
                rest = getattr(node, "rest", None)
                if rest:
                    ids.add(rest)
        return cls(text, frozenset(ids), frozenset(calls), frozenset(strings),
                   frozenset(k.__name__ for k in kinds))

    def any_id(self, *names: str) -> bool:
        return not self.ids.isdisjoint(names)

    def any_call(self, *names: str) -> bool:
        return not self.calls.isdisjoint(names)

    def id_containing(self, *parts: str) -> bool:
        return any(part in name for name in self.ids for part in parts)

    def has_loop(self) -> bool:
        return not self.kinds.isdisjoint(("For", "AsyncFor", "While"))


def char_column(line: str, byte: int) -> int:
    """LibCST's column (characters) of the stdlib parser's `col_offset` (UTF-8 bytes)."""
    return byte if line.isascii() else len(line.encode("utf-8")[:byte].decode("utf-8"))


def statements(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement, nested ones too, in the order LibCST lists them (pre-order; a
    compound statement's body, handlers, else, finally, match cases)."""
    for stmt in body:
        yield stmt
        for part in ("body", "handlers", "orelse", "finalbody", "cases"):
            for inner in getattr(stmt, part, ()):
                yield from statements(inner.body if isinstance(inner, (ast.ExceptHandler, ast.match_case))
                                      else [inner])


# A literal this large is data (tables of tuned kernel parameters, vocabularies), not code a
# rule reads; LibCST holds about 1.8 KB of objects per byte of source.
DATA_LITERAL_CHARS = 20_000
_CONTAINERS = {ast.Dict: "{}", ast.List: "[]", ast.Tuple: "()", ast.Set: "{}"}
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n|$)")


def _dotted(node: ast.AST) -> bool:
    while type(node) is ast.Attribute:
        node = node.value
    return type(node) is ast.Name


def _is_data(value: ast.AST) -> bool:
    """Containers of constants, and of dotted names (`torch.float16`), which are kept."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind in _CONTAINERS:
            if kind is ast.Dict and None in node.keys:  # `**other`
                return False
            stack.extend(node.keys + node.values if kind is ast.Dict else node.elts)
        elif kind in (ast.Name, ast.Attribute):
            if not _dotted(node) or node.lineno != node.end_lineno:
                return False
        elif kind is ast.UnaryOp:
            stack.append(node.operand)
        elif kind is not ast.Constant:
            return False
    return True


def _only_looked_into(tree: ast.Module, names: Set[str]) -> Set[str]:
    """Those of `names` whose every read is `NAME[k]`, `NAME.attr`, `k in NAME`, or a loop
    over it (directly or through a call such as `sorted(NAME)`): no unpacking, argument or
    alias carries their elements into the analysis."""
    reads: List[ast.Name] = []
    looked: Set[int] = set()
    for node in _every_node(tree):
        kind = type(node)
        if kind is ast.Name:
            if node.id in names and type(node.ctx) is ast.Load:
                reads.append(node)
        elif kind is ast.Subscript or kind is ast.Attribute:
            looked.add(id(node.value))
        elif kind is ast.Compare:
            looked.update(id(n) for n in (node.left, *node.comparators))
        elif kind in (ast.For, ast.AsyncFor, ast.comprehension):
            looked.add(id(node.iter))
            if type(node.iter) is ast.Call:
                looked.update(id(arg) for arg in node.iter.args)
    return names - {read.id for read in reads if id(read) not in looked}


class _Canvas:
    """Text laid out at given lines and columns (each token at its column, or just after the
    one before it on the line)."""

    def __init__(self) -> None:
        self.rows: Dict[int, List[str]] = {}
        self.at = (0, 0)

    def put(self, line: int, col: int, text: str) -> int:
        if line != self.at[0]:
            self.at = (line, 0)
        col = max(col, self.at[1])
        row = self.rows.setdefault(line, [])
        row.extend(" " * (col - len(row)))
        row.extend(text)
        self.at = (line, col + len(text))
        return col


def _pruned(value: ast.AST, lines: List[str]) -> Optional[_Canvas]:
    """The literal with only the containers around its dotted names (each dict entry keeping
    `0` for a side without one), every name at its own line and column; None where a name
    would move."""
    canvas = _Canvas()

    def col(line: int, byte: int) -> int:
        return char_column(lines[line - 1], byte)

    def has_name(node: ast.AST) -> bool:
        return any(type(n) in (ast.Name, ast.Attribute) for n in ast.walk(node))

    def emit(node: ast.AST, top: bool = False) -> bool:
        kind = type(node)
        start = col(node.lineno, node.col_offset)
        if kind in (ast.Name, ast.Attribute):
            text = lines[node.lineno - 1][start:col(node.lineno, node.end_col_offset)]
            return canvas.put(node.lineno, start, text) == start
        if kind not in _CONTAINERS or not (top or has_name(node)):
            canvas.put(node.lineno, start, "0")
            return True
        pair = "{}" if kind is ast.Dict else _CONTAINERS[kind]
        if lines[node.lineno - 1][start:start + 1] != pair[0]:
            return False  # a tuple without brackets
        canvas.put(node.lineno, start, pair[0])
        if kind is ast.Dict:
            for key, item in zip(node.keys, node.values):
                if has_name(key) or has_name(item):
                    if not emit(key):
                        return False
                    canvas.put(canvas.at[0], canvas.at[1], ":")
                    if not emit(item):
                        return False
                    canvas.put(canvas.at[0], canvas.at[1], ",")
        else:
            kept = [e for e in node.elts if has_name(e)]
            for element in kept:
                if not emit(element):
                    return False
                canvas.put(canvas.at[0], canvas.at[1], ",")
            if kind is ast.Set and not kept:
                canvas.put(canvas.at[0], canvas.at[1], "0,")  # `{}` would be a dict
        canvas.put(node.end_lineno, col(node.end_lineno, node.end_col_offset) - 1, pair[1])
        return True

    return canvas if emit(value, top=True) else None


def without_data(text: str, tree: ast.Module) -> str:
    """`text` with each large data literal bound to a plain name (`TABLE = {...}`, read only
    as `TABLE[k]`, `TABLE.get(k)`, `k in TABLE` or by a loop) pruned to the dotted names it holds, each at its own
    line and column, every line kept: everything else keeps its place. No rule reports on a
    constant, and the analysis reads such a literal's elements only for what names they
    hold, so lint finds the same at a fraction of LibCST's memory."""
    lines: List[str] = []
    spans: Dict[str, ast.AST] = {}
    for stmt in statements(tree.body):
        kind = type(stmt)
        if kind is ast.Assign and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif kind is ast.AnnAssign and stmt.value is not None:
            target, value = stmt.target, stmt.value
        else:
            continue
        if type(target) is not ast.Name or type(value) not in _CONTAINERS or value.end_lineno - value.lineno < 2:
            continue
        lines = lines or _LINE.findall(text)
        if sum(len(line) for line in lines[value.lineno - 1:value.end_lineno]) >= DATA_LITERAL_CHARS \
                and target.id not in spans and _is_data(value):
            spans[target.id] = value
    if not spans:
        return text
    kept = _only_looked_into(tree, set(spans))
    done = False
    for value in sorted((v for name, v in spans.items() if name in kept), key=lambda v: v.lineno, reverse=True):
        first, last = lines[value.lineno - 1], lines[value.end_lineno - 1]
        start, end = char_column(first, value.col_offset), char_column(last, value.end_col_offset)
        if last[end:].strip() and not last[end:].lstrip().startswith("#"):
            continue  # more code after it on its last line would move
        canvas = _pruned(value, lines)
        if canvas is None or canvas.at != (value.end_lineno, end):
            continue
        new = []
        for number in range(value.lineno, value.end_lineno + 1):
            line = lines[number - 1]
            row = "".join(canvas.rows.get(number, [])).rstrip()
            if number == value.lineno:
                row = first[:start] + row[start:]
            if number == value.end_lineno:
                row += last[end:]
            else:
                row += line[len(line.rstrip("\r\n")):]
            new.append(row)
        lines[value.lineno - 1:value.end_lineno] = ["".join(new)]
        done = True
    return "".join(lines) if done else text
