"""Parse once, run the chosen rules on the one tree, verify, and hand back the result.

The engine is generic: a rule is any class with a `code`, a constructor taking the
`FileContext`, and LibCST-style `visit_<Node>` / `leave_<Node>` methods. All rules share a
single traversal (one visit per node, however many rules run), so the cost of a run grows
with the file, not with the number of rules.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import contextvars
import dataclasses
import difflib
import functools
import inspect
import io
import re
import sys
import textwrap
import threading
import tokenize
import warnings
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Set, Tuple, Union)

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider
from libcst.metadata.position_provider import PositionProvidingCodegenState

from gpumigrate.rewriter.facts import SourceFacts, char_column, statements, without_data
from gpumigrate.rewriter.lazy import matchers as m

if TYPE_CHECKING:
    from libcst.codemod import Codemod


@dataclass(frozen=True)
class Finding:
    """One thing a rule saw. `fixed`: the fix was applied (or would be, with --diff/--check).
    `review`: no safe fix exists here; a human must look."""

    code: str
    line: int
    col: int
    message: str
    fixed: bool = False
    review: bool = False
    end_line: int = 0  # last line of the flagged code
    # 0-based column just past the flagged code on end_line (LibCST's end position); 0: unknown.
    end_col: int = 0
    # In a notebook: the 1-based position of the cell among all cells; line and end_line are
    # then lines of that cell. 0: a plain file.
    cell: int = 0
    # The target (a `--to` name) this finding says was not applied to the file, and why
    # (no training to distribute, say): the summary line and the report count those files.
    not_applied: str = ""
    # Information, neither a fix nor work for a human ("already uses torch.amp"): a note.
    note: bool = False
    # Another tool's code for the same finding (TorchFix's `TOR101`), shown beside ours; "": none.
    alias: str = ""


@dataclass
class FileResult:
    path: str
    source: bytes
    new_source: Optional[bytes] = None  # None: nothing changed (or an error)
    findings: List[Finding] = field(default_factory=list)
    error: Optional[str] = None  # one user-facing line
    read_as: Any = None  # files.Stamp of the file read: a write in place checks it still holds that
    # What was done to the input before the rules ran, one line each: the opt-in conversions
    # (--py2, --reformat-notebooks; rewriter/prepare.py). Empty unless the file was rewritten.
    prepared: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.new_source is not None and self.new_source != self.source


class UserError(Exception):
    """A problem with the input, reported as one line and never as a traceback."""


@dataclass
class _Report:
    code: str
    node: Optional[cst.CSTNode]
    message: str
    fixed: bool
    review: bool
    line: int = 0
    col: int = 0
    end_line: int = 0
    through: Optional[cst.CSTNode] = None  # the finding spans up to the end of this node
    not_applied: str = ""
    note: bool = False
    alias: str = ""


_CODES = r"(?::\s*(?P<codes>[A-Z]+[0-9]*(?:[\s,]+[A-Z]+[0-9]*)*))?"
_NOQA = re.compile(r"#\s*noqa" + _CODES, re.I)
# `# gpumigrate: noqa` on a line of its own: the whole file (or those codes in it), as ruff's `# ruff: noqa`.
_FILE_NOQA = re.compile(r"^[ \t]*#\s*gpumigrate:\s*noqa" + _CODES + r"[ \t]*$", re.I | re.M)


def _noqa_codes(match: "re.Match[str]") -> Optional[List[str]]:
    """The codes a noqa names (`noqa: GM301, gm3` -> GM301, GM3); None: a bare noqa, all codes."""
    codes = match.group("codes")
    return None if codes is None else [c for c in re.split(r"[\s,]+", codes.upper()) if c]


# Another tool's codes -> ours that mean the same (`TOR101` -> GM212, GM503), so that its
# `# noqa: TOR101` is honoured. The rules' package fills it (this package knows no rules).
NOQA_ALIASES: Dict[str, Tuple[str, ...]] = {}


def set_noqa_aliases(aliases: Mapping[str, Sequence[str]]) -> None:
    """Make `# noqa: KEY` also suppress each code of `aliases[KEY]` (exact codes, upper case)."""
    NOQA_ALIASES.clear()
    NOQA_ALIASES.update({key.upper(): tuple(codes) for key, codes in aliases.items()})


def _covers(codes: Optional[Sequence[str]], code: str) -> bool:
    """Whether a noqa's codes (None: all codes) cover `code`; prefixes count (`GM1`), and an
    alias (`TOR101`) covers the codes it stands for."""
    return codes is None or any(code.startswith(c) or code in NOQA_ALIASES.get(c, ()) for c in codes)


def file_noqa(text: str) -> Tuple[bool, List[str]]:
    """(skip the whole file, codes suppressed file-wide) from `# gpumigrate: noqa[: CODES]`
    comment lines (a line that only looks like one inside a string does not count)."""
    codes: List[str] = []
    matches = list(_FILE_NOQA.finditer(text))
    if not matches:
        return False, codes
    comments = _comment_lines(text)
    for match in matches:
        if text.count("\n", 0, match.start()) + 1 not in comments:
            continue
        named = _noqa_codes(match)
        if named is None:
            return True, []
        codes += named
    return False, codes


def _comment_lines(text: str) -> Set[int]:
    try:
        return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return set()


@functools.lru_cache(maxsize=None)
def _child_fields(cls: type) -> Tuple[str, ...]:
    """The fields of a node class that hold children, in the order LibCST visits them: the
    order of the `visit_*(self, "field", ...)` calls in its `_visit_and_replace_children`."""
    owner = next(c for c in cls.__mro__ if "_visit_and_replace_children" in c.__dict__)
    tree = ast.parse(textwrap.dedent(inspect.getsource(owner._visit_and_replace_children)))
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id.startswith("visit_")), key=lambda n: (n.lineno, n.col_offset))
    fields: List[str] = []
    for call in calls:
        name = call.args[1].value if len(call.args) > 1 and isinstance(call.args[1], ast.Constant) else None
        if not isinstance(name, str):
            raise ValueError(f"{cls.__name__}: a child field not named by a constant")
        if name not in fields:
            fields.append(name)
    return tuple(fields)


@functools.lru_cache(maxsize=None)
def node_types(kind: type) -> frozenset:
    """`kind` and its subclasses: `type(n) in node_types(k)` is `isinstance(n, k)` without
    the ABC machinery LibCST's node classes pay for on every isinstance test."""
    found, todo = {kind}, [kind]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return frozenset(found)


@dataclass
class _Found:
    matcher: Any  # kept alive, so that no other matcher takes its id
    anything: bool  # no constraint: `m.Call()`
    positions: Optional[List[int]] = None  # where it matches in the file, once asked twice


def _matches_any(matcher: Any) -> bool:
    """A matcher with no constraint (`m.Call()`), which `m.matches` would still walk."""
    return dataclasses.is_dataclass(matcher) and all(
        getattr(matcher, f.name) is m.DoNotCare() for f in dataclasses.fields(matcher))


_FIELDS: Dict[type, Tuple[str, ...]] = {}  # node class -> `_child_fields`, without lru_cache's call


@functools.lru_cache(maxsize=1)
def _readable_libcst() -> bool:
    """Whether LibCST's sources can be read here (not in a zipped install, say)."""
    try:
        _child_fields(cst.Module)
        return True
    except (OSError, TypeError, ValueError):
        return False


def _fast_traversal() -> bool:
    return FAST_TRAVERSAL and _readable_libcst()


@functools.lru_cache(maxsize=1)
def _trivia() -> frozenset:
    """Whitespace, comments, punctuation and operator tokens: three fifths of a tree's nodes,
    which no rule looks up (rules read them as attributes: `aug.operator`); their subtrees
    hold nothing else."""
    kinds = (cst.BaseParenthesizableWhitespace, cst.EmptyLine, cst.TrailingWhitespace, cst.Newline, cst.Comment,
             cst.BaseBinaryOp, cst.BaseBooleanOp, cst.BaseCompOp, cst.BaseUnaryOp, cst.BaseAugOp, cst.AssignEqual,
             cst.Colon, cst.Comma, cst.Dot, cst.Semicolon, cst.LeftParen, cst.RightParen, cst.LeftSquareBracket,
             cst.RightSquareBracket, cst.LeftCurlyBrace, cst.RightCurlyBrace)
    return frozenset().union(*(node_types(kind) for kind in kinds))


class NodeIndex(cst.CSTVisitor):
    """Every node of the original tree in pre-order (but trivia: `_trivia`), with where each
    subtree ends and each node's parent.

    One visit builds it; afterwards "all calls under this statement" is a slice and an
    isinstance test instead of a matcher visitor per query (LibCST's findall visits every
    node of the subtree each time), and walking up needs no ParentNodeProvider."""

    def __init__(self) -> None:
        super().__init__()
        self.order: List[cst.CSTNode] = []
        self.start: Dict[int, int] = {}
        # by pre-order position: arrays, not dicts keyed by id(), as a large file has a
        # million nodes (a third of the index's memory)
        self._end = array("l")
        self._parent = array("l")
        self.end = _ByNode(self.start, self._end, lambda i: i)
        self.parent = _ByNode(self.start, self._parent, lambda i: self.order[i] if i >= 0 else None)
        self._stack: List[int] = []
        self._of: Dict[type, List[cst.CSTNode]] = {}

    def build(self, root: cst.CSTNode) -> "NodeIndex":
        """Index `root`'s tree without a LibCST visit: a visit rebuilds every node (LibCST's
        traversal always replaces children), which cost more than a fifth of a lint. The
        children are read in the order LibCST visits them (`_child_fields`)."""
        order, start, end, parent = self.order, self.start, self._end, self._parent
        nodes, fields_of = node_types(cst.CSTNode) - _trivia(), _FIELDS
        work: List[cst.CSTNode] = [root]
        above_of: List[int] = [-1]  # the position of each waiting node's parent
        pop, pop_above = work.pop, above_of.pop
        while work:
            node, above = pop(), pop_above()
            at = len(order)
            start[id(node)] = at
            order.append(node)
            parent.append(above)
            kind = type(node)
            fields = fields_of.get(kind)
            if fields is None:
                fields = fields_of[kind] = _child_fields(kind)
            children = []  # this runs for every node of the file: no helper call
            for name in fields:
                value = getattr(node, name)
                if type(value) in nodes:
                    children.append(value)
                elif type(value) is tuple or type(value) is list:
                    children.extend([v for v in value if type(v) in nodes])
            if children:
                children.reverse()
                work.extend(children)
                above_of.extend([at] * len(children))
        # a subtree ends where its last descendant's does: children come after their parent
        end.extend(range(1, len(order) + 1))
        for k in range(len(order) - 1, 0, -1):
            if end[k] > end[parent[k]]:
                end[parent[k]] = end[k]
        return self

    def on_visit(self, node: cst.CSTNode) -> bool:
        if type(node) in _trivia():
            return False
        at = len(self.order)
        self.start[id(node)] = at
        self.order.append(node)
        self._end.append(at)
        self._parent.append(self._stack[-1] if self._stack else -1)
        self._stack.append(at)
        return True

    def of(self, kind: type) -> List[cst.CSTNode]:
        """The nodes of exactly this (concrete) class, in order: scans for calls, one of them
        per analysis, step on nothing else."""
        found = self._of.get(kind)
        if found is None:
            found = self._of[kind] = [n for n in self.order if type(n) is kind]
        return found

    def subtree(self, root: cst.CSTNode) -> List[cst.CSTNode]:
        """`root` and every node under it, in pre-order (root must be of the indexed tree)."""
        start = self.start[id(root)]
        return self.order[start:self.end[id(root)]]

    def contains(self, outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
        i = self.start.get(id(inner))
        return i is not None and self.start[id(outer)] <= i < self.end[id(outer)]

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if type(original_node) not in _trivia():
            self._end[self._stack.pop()] = len(self.order)

    # LibCST looks up a `visit_<Node>_<field>` hook for every field of every node; no one
    # here defines such hooks, and skipping the lookups saves a tenth of a traversal.
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass


class _ByNode:
    """A read-only `{id(node): value}` over an array indexed by pre-order position."""

    def __init__(self, start: Dict[int, int], values: Any, convert: Callable[[int], Any]) -> None:
        self._start, self._values, self._convert = start, values, convert

    def __getitem__(self, key: int) -> Any:
        return self._convert(self._values[self._start[key]])

    def get(self, key: int, default: Any = None) -> Any:
        at = self._start.get(key)
        return default if at is None else self._convert(self._values[at])

    def __contains__(self, key: int) -> bool:
        return key in self._start


# Compound statements whose header a position can be read from with the body stubbed.
_HEADED = frozenset({cst.With, cst.For, cst.While, cst.If, cst.FunctionDef, cst.ClassDef})
_STUB = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=[cst.Pass()])])

# The file being processed, so that shared helpers can use its node index.
CURRENT: "contextvars.ContextVar[Optional[FileContext]]" = contextvars.ContextVar("gpumigrate_file", default=None)


class FileContext:
    """What rules share about one file: the tree, its imports, and the edits they ask for."""

    def __init__(self, module: cst.Module, path: str, text: str, names: Any,
                 options: Optional[Dict[str, Any]] = None) -> None:
        self.module = module
        self.options: Dict[str, Any] = dict(options or {})  # e.g. {"sync_bn": True} from the CLI
        self.path = path
        self.text = text
        self.names = names
        self.reports: List[_Report] = []
        self.imports_to_add: List[Tuple[str, Optional[str], Optional[str]]] = []
        self.imports_to_remove: List[Tuple[str, Optional[str], Optional[str]]] = []
        self.finishers: List[Callable[[cst.Module], cst.Module]] = []
        self.fixing: Set[str] = set()
        self._cache: Dict[Any, Any] = {}
        self._positions = None
        # Lint: where each statement starts (line, column or None) and ends, from the stdlib parser
        self.statement_lines: Optional[List[Tuple[int, Optional[int], int]]] = None
        self._partial: Dict[Tuple[int, bool], Any] = {}
        self._found: Dict[int, _Found] = {}  # id(matcher) -> what `find` knows of it
        self.ancestors: List[cst.CSTNode] = []  # kept by the traversal: outermost first
        self._removed: Dict[int, cst.CSTNode] = {}
        self._emptied: Dict[int, cst.CSTNode] = {}  # `pass` standing for a block all of whose statements went
        self._index: Optional[NodeIndex] = None
        self._tree_facts: Dict[Any, Any] = {}  # shared(..., tree=True)
        # original statement of a block -> what the traversal made of it (a node, several, none)
        self._results: Dict[int, List[cst.CSTNode]] = {}

    @property
    def index(self) -> NodeIndex:
        """The original tree's node index, built on first use."""
        if self._index is None:
            self._index = NodeIndex()
            if _fast_traversal():
                self._index.build(self.module)
            else:
                self.module.visit(self._index)
        return self._index

    def find(self, root: cst.CSTNode, matcher: Any) -> List[cst.CSTNode]:
        """`libcst.matchers.findall(root, matcher)`, fast for subtrees of the original tree."""
        index = self.index
        start = index.start.get(id(root))
        if start is None or index.order[start] is not root:
            return m.findall(root, matcher)  # a node the fixes built
        kind = getattr(cst, type(matcher).__name__, None)
        end = index.end[id(root)]
        if not (isinstance(kind, type) and issubclass(kind, cst.CSTNode)):
            return [n for n in index.order[start:end] if m.matches(n, matcher)]
        kinds = node_types(kind)
        seen = self._found.get(id(matcher))
        if seen is None:  # first use; the matcher is kept, so its id stays its own
            seen = self._found[id(matcher)] = _Found(matcher, _matches_any(matcher))
        elif seen.positions is None and not seen.anything:  # asked again (a rule's constant matcher,
            seen.positions = [i for i, n in enumerate(index.order)  # block after block): match the file once
                              if type(n) in kinds and m.matches(n, matcher)]
        if seen.anything:  # `m.Call()`: every node of its kind
            return [n for n in index.order[start:end] if type(n) in kinds]
        if seen.positions is None:
            return [n for n in index.order[start:end] if type(n) in kinds and m.matches(n, matcher)]
        found = seen.positions
        return [index.order[i] for i in found[bisect.bisect_left(found, start):bisect.bisect_left(found, end)]]

    def shared(self, key: Any, build: Callable[["FileContext"], Any], tree: bool = False) -> Any:
        """A per-file analysis, built once however many rules ask for it. `tree`: it is a
        fact of the tree alone (not of the codes fixed or the options), so a later run over
        the same bytes (the next pass of a migration) takes it as it is."""
        cache = self._tree_facts if tree else self._cache
        if key not in cache:
            cache[key] = build(self)
        return cache[key]

    def position(self, node: cst.CSTNode) -> Tuple[int, int]:
        """1-based line, 0-based column of a node of the original tree."""
        return self.span(node)[:2]

    def span(self, node: cst.CSTNode) -> Tuple[int, int, int]:
        """Start line, start column and end line of a node of the original tree.

        Position metadata costs a full extra pass, so it is computed only for files that
        have something to report."""
        return self.extent(node)[:3]

    def extent(self, node: cst.CSTNode) -> Tuple[int, int, int, int]:
        """`span` and the 0-based column just past the node on its end line (from the same
        position metadata: no extra cost)."""
        pos = self._statement_positions(node) if self.statement_lines is not None else None
        if pos is None:
            if self._positions is None:
                wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
                self._positions = wrapper.resolve(PositionProvider)
            pos = self._positions.get(node)
        if pos is None:
            return (0, 0, 0, 0)
        return (pos.start.line, pos.start.column, pos.end.line, pos.end.column)

    def _statement_positions(self, node: cst.CSTNode) -> Optional[CodeRange]:
        """The position of `node` from printing only the statement that holds it, which starts
        on the line the stdlib parser gave (`statement_lines`): a file's positions cost a
        print of the whole file (more than its parse); a finding needs one statement. None
        where this does not apply (the caller prints the whole file)."""
        index, simple, compound = self.index, node_types(cst.SimpleStatementLine), node_types(cst.BaseCompoundStatement)
        stmt: Optional[cst.CSTNode] = node
        while stmt is not None and type(stmt) not in simple and type(stmt) not in compound:
            stmt = index.parent.get(id(stmt))
        while stmt is not None and type(stmt) is cst.If and type(index.parent.get(id(stmt))) is cst.If:
            stmt = index.parent.get(id(stmt))  # an `elif` prints only as part of its `if`
        if stmt is None:
            return None  # the module itself, or a node the fixes built
        if stmt is node and type(stmt) in compound and type(index.parent.get(id(stmt))) is not cst.If:
            where = (self._statement_starts() or {}).get(id(stmt))
            if where is not None and where[1] is not None:  # a block's span is the stdlib parser's
                return CodeRange(CodePosition(where[0], where[1]), CodePosition(where[2], 0))
        printed = stmt
        if type(stmt) in _HEADED and stmt is not node:
            child = node
            while index.parent.get(id(child)) is not stmt:
                child = index.parent.get(id(child))
            if child is not stmt.body and child is not getattr(stmt, "orelse", None):
                # in the header (`with f(x):`, `def g(a):`): print it over a stub of a body
                printed = stmt.with_changes(body=_STUB, **({"orelse": None} if hasattr(stmt, "orelse") else {}))
        key = (id(stmt), printed is stmt)
        done = self._partial.get(key)
        if done is None:
            starts = self._statement_starts()
            first = stmt.body[0] if type(stmt) in simple else stmt
            if starts is None or id(first) not in starts:
                return None
            line, col, _ = starts[id(first)]
            indents, parent = [], index.parent.get(id(stmt))
            while parent is not None:
                if type(parent) is cst.IndentedBlock:
                    indents.append(self.module.default_indent if parent.indent is None else parent.indent)
                parent = index.parent.get(id(parent))
            provider = PositionProvider()
            state = PositionProvidingCodegenState(default_indent=self.module.default_indent,
                                                  default_newline=self.module.default_newline, provider=provider)
            state.indent_tokens = indents[::-1]
            state.line = line - len(stmt.leading_lines)
            printed._codegen(state)
            done = self._partial[key] = provider._computed
            got = done.get(printed)
            if got is None or got.start.line != line or col is not None and got.start.column != col:
                self.statement_lines = None  # the two parsers disagree: print the whole file instead
                return None
        return done.get(node)

    def _statement_starts(self) -> Optional[Dict[int, Tuple[int, Optional[int], int]]]:
        """Where each LibCST statement (small or compound) starts and ends, from
        `statement_lines`: both parsers list a file's statements in the same order."""
        if "statements" not in self._cache:
            kinds = node_types(cst.BaseSmallStatement) | node_types(cst.BaseCompoundStatement)
            ours = [n for n in self.index.order if type(n) in kinds]
            lines = self.statement_lines or []
            self._cache["statements"] = ({id(n): where for n, where in zip(ours, lines)}
                                         if len(ours) == len(lines) else None)
        return self._cache["statements"]

    def suppressed(self, code: str, line: int, end_line: int = 0) -> bool:
        """`# noqa`, `# noqa: GM301,GM302` or `# noqa: GM3` on any line from `line` to
        `end_line` (a flagged expression may span several lines)."""
        lines = self._lines()
        for number in range(max(line, 1), min(max(end_line, line), len(lines)) + 1):
            if "noqa" not in lines[number - 1].lower():
                continue
            match = _NOQA.search(lines[number - 1])
            if match is not None and _covers(_noqa_codes(match), code):
                return True
        return False

    def noqa_lines(self, node: cst.CSTNode) -> Tuple[int, int]:
        """The lines where a `# noqa` covers a finding at `node`: every line of the statement
        that holds it (a flagged expression may span several), but of a block statement
        (`for`, `with`, `def`) only its header, since its body holds other statements."""
        stmt: Optional[cst.CSTNode] = node
        while stmt is not None and not isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            stmt = self.index.parent.get(id(stmt))
        if stmt is None:
            line = self.span(node)[0]
            return line, line
        line, _, end = self.span(stmt)
        if isinstance(stmt, cst.BaseCompoundStatement):
            body = getattr(stmt, "body", None)
            inner = getattr(body, "body", None)
            end = max(line, self.span(inner[0])[0] - 1) if isinstance(body, cst.IndentedBlock) and inner else line
        return line, end

    def _lines(self) -> List[str]:
        if "lines" not in self._cache:
            self._cache["lines"] = self.text.splitlines()
        return self._cache["lines"]

    def has_noqa(self) -> bool:
        return "noqa" in self.text.lower()

    def report(self, code: str, node: cst.CSTNode, message: str, *, fixed: bool, review: bool,
               through: Optional[cst.CSTNode] = None, not_applied: str = "", note: bool = False,
               alias: str = "") -> None:
        """Record a finding at `node` (a node of the original tree), spanning to the end of
        `through` when a fix covers several statements. `not_applied`: the target this
        finding says the file did not get. `note`: information only. `alias`: another
        tool's code for it."""
        self.reports.append(_Report(code, node, message, fixed, review, through=through, not_applied=not_applied,
                                    note=note, alias=alias))

    def add_import(self, module: str, name: Optional[str] = None, asname: Optional[str] = None) -> None:
        if (module, name, asname) not in self.imports_to_add:
            self.imports_to_add.append((module, name, asname))

    def remove_import(self, module: str, name: Optional[str] = None, asname: Optional[str] = None) -> None:
        if (module, name, asname) not in self.imports_to_remove:
            self.imports_to_remove.append((module, name, asname))

    def remove_statement(self, stmt: cst.BaseStatement) -> cst.SimpleStatementLine:
        """Remove a statement but keep the blank lines and comments above it: it becomes a
        placeholder that the traversal drops when it leaves the enclosing block."""
        placeholder = cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=stmt.leading_lines)
        self._removed[id(placeholder)] = placeholder  # held, so that its id is never reused
        return placeholder

    def drop_removed(self, body: Sequence[cst.BaseStatement],
                     trailing: Optional[List[cst.EmptyLine]] = None) -> Optional[List[cst.BaseStatement]]:
        """The block without its removed statements. Their comments move to the next
        statement; the blank lines around a removed one count once (one blank line above
        it and one below leave one, as before it was written); the comments of removed
        last statements go to `trailing` (for the block's footer)."""
        if not self._removed or not any(id(s) in self._removed for s in body):
            return None
        out, carried = _without(body, lambda stmt: id(stmt) in self._removed, _joined)
        if not out:
            emptied = cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=carried)
            self._emptied[id(emptied)] = emptied
            out.append(emptied)
        elif trailing is not None:
            trailing.extend(e for e in carried if e.comment is not None)
        return out

    def rewritten(self, original: cst.CSTNode) -> List[cst.CSTNode]:
        """What the rules made of a statement of a block, once they left it: its replacement,
        the statements inserted around it, or nothing if it was removed."""
        return self._results.get(id(original), [original])

    def span_of(self, originals: Sequence[cst.CSTNode], body: Sequence[cst.CSTNode]) -> Optional[Tuple[int, int]]:
        """Where the rewritten forms of consecutive original statements lie in a rewritten
        block body: (first index, last index + 1), or None if they are not all there."""
        positions = {id(node): i for i, node in enumerate(body)}
        found = [positions[id(n)] for o in originals for n in self.rewritten(o) if id(n) in positions]
        if not found:
            return None
        return min(found), max(found) + 1

    def add_finisher(self, key: Any, finisher: Callable[[cst.Module], cst.Module]) -> None:
        """A module-level edit run once after the traversal (e.g. inserting a definition)."""
        if ("finisher", key) not in self._cache:
            self._cache[("finisher", key)] = True
            self.finishers.append(finisher)


class _Chain:
    """A FlattenSentinel built around the node itself, so that later rules keep working on
    that node while the inserted statements stay in place."""

    def __init__(self, sentinel: cst.FlattenSentinel, inner: cst.CSTNode) -> None:
        self.nodes = list(sentinel.nodes)
        self.position = next(i for i, n in enumerate(self.nodes) if n is inner)
        self.inner = inner

    def replace_inner(self, out: Any) -> "_Chain":
        if isinstance(out, cst.FlattenSentinel):
            nodes = list(out.nodes)
            inner = next((n for n in nodes if n is self.inner), None)
            self.nodes[self.position:self.position + 1] = nodes
            if inner is not None:
                self.position = self.position + nodes.index(inner)
            self.inner = inner
        else:
            self.nodes[self.position] = out
            self.inner = out
        return self

    def resolve(self) -> Any:
        nodes = [n for n in self.nodes if not isinstance(n, cst.RemovalSentinel)]
        return cst.FlattenSentinel(nodes) if len(nodes) != 1 else nodes[0]


# Index and lint without LibCST visits (tests compare both ways; False: LibCST's visits)
FAST_TRAVERSAL = True


class _Edits(Exception):
    """A rule whose fixes are applied asked to edit a node (see `_Dispatch.observe`)."""


class _Dispatch(cst.CSTTransformer):
    """One traversal that calls every rule's visit_/leave_ methods for each node."""

    def __init__(self, ctx: FileContext, rules: Sequence[Any]) -> None:
        super().__init__()
        self.ctx = ctx
        self.visits: Dict[str, List[Callable]] = defaultdict(list)
        self.leaves: Dict[str, List[Tuple[Any, Callable]]] = defaultdict(list)
        for rule in rules:
            for attr in dir(type(rule)):
                if attr.startswith("visit_") and attr.count("_") == 1:
                    self.visits[attr[6:]].append(getattr(rule, attr))
                elif attr.startswith("leave_") and attr.count("_") == 1:
                    self.leaves[attr[6:]].append((rule, getattr(rule, attr)))

    def observe(self, index: NodeIndex) -> bool:
        """The rules' visit_ and leave_ calls of a traversal, over the index (lint: no rule's
        output is used, so no node needs rebuilding); a leave gets the node as `updated` too.
        Only nodes a rule handles are stepped on; `ctx.ancestors` is brought to each one's
        path from the one before, so the rules see what the traversal would show them.
        Returns whether a rule whose fixes are applied asked to edit a node: if none did, the
        transform would rebuild the tree as it is."""
        order, end, parent = index.order, index._end, index._parent
        names = set(self.visits) | set(self.leaves)
        handled = {kind for kind in node_types(cst.CSTNode) if kind.__name__ in names}
        visits = {kind: self.visits.get(kind.__name__, []) for kind in handled}
        fixing = self.ctx.fixing

        def watched(leave: Callable) -> Callable:
            def run(original: cst.CSTNode, updated: cst.CSTNode) -> None:
                try:
                    out = leave(original, updated)
                except Exception:  # it expected its own edits below: it edits
                    raise _Edits from None
                if out is not None:
                    raise _Edits
            return run

        leaves = {kind: [watched(leave) if rule.code in fixing else leave
                         for rule, leave in self.leaves.get(kind.__name__, ())] for kind in handled}
        try:
            self._walk(order, end, parent, handled, visits, leaves)
        except _Edits:
            return True
        return False

    def _walk(self, order, end, parent, handled, visits, leaves) -> None:
        ancestors, at = self.ctx.ancestors, []  # the path's nodes and their positions

        def move_to(i: int) -> None:  # make the path the one from the root to position i
            while at and not (at[-1] <= i < end[at[-1]]):
                at.pop()
                ancestors.pop()
            top, down = at[-1] if at else -1, []
            while i != top:
                down.append(i)
                i = parent[i]
            for p in reversed(down):
                at.append(p)
                ancestors.append(order[p])

        open_: List[int] = []
        for i in [i for i, node in enumerate(order) if type(node) in handled]:
            while open_ and end[open_[-1]] <= i:
                j = open_.pop()
                move_to(parent[j])
                for leave in leaves[type(order[j])]:
                    leave(order[j], order[j])
            move_to(i)
            for visit in visits[type(order[i])]:
                visit(order[i])
            open_.append(i)
        while open_:
            j = open_.pop()
            move_to(parent[j])
            for leave in leaves[type(order[j])]:
                leave(order[j], order[j])
        move_to(-1)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass  # no rule has field hooks: see NodeIndex

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.ctx.ancestors.append(node)
        for visit in self.visits.get(type(node).__name__, ()):
            visit(node)
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        self.ctx.ancestors.pop()
        chain: Optional[_Chain] = None
        current: Any = updated
        for rule, leave in self.leaves.get(type(original).__name__, ()):
            out = leave(original, current)
            if out is None or rule.code not in self.ctx.fixing:
                continue
            if self.ctx.has_noqa() and self.ctx.suppressed(rule.code, *self.ctx.noqa_lines(original)):
                continue
            if isinstance(out, cst.FlattenSentinel) and any(n is current for n in out.nodes):
                # statements inserted around this node: later rules still see the node
                chain = _Chain(out, current) if chain is None else chain.replace_inner(out)
                current = chain.inner
                continue
            if chain is not None:
                chain.replace_inner(out)
            current = out
            if not isinstance(current, type(original)):
                break  # replaced by another kind of node, or removed
        result = chain.resolve() if chain is not None else current
        if isinstance(result, cst.If) and not (self.ctx.ancestors and isinstance(self.ctx.ancestors[-1], cst.If)):
            result = self._settle_if(original, result)  # (not an `elif`: it cannot go as a statement does)
        if isinstance(original, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            self.ctx._results[id(original)] = (list(result.nodes) if isinstance(result, cst.FlattenSentinel)
                                               else [] if isinstance(result, cst.RemovalSentinel) else [result])
        if isinstance(result, (cst.IndentedBlock, cst.Module)):
            trailing: List[cst.EmptyLine] = []
            body = self.ctx.drop_removed(result.body, trailing)
            if body is not None:  # the comments of removed last statements stay, at the block's end
                result = result.with_changes(body=body, footer=[*trailing, *result.footer])
        return result

    def _settle_if(self, original: cst.If, node: cst.If) -> Any:
        """An `else:` (or a whole `if` with a test that only reads names) all of whose
        statements the rules removed goes, rather than staying as `else: pass`; a comment
        there keeps it. The fixes that emptied it are reported over all of it."""
        def emptied(suite: cst.BaseSuite) -> bool:
            return isinstance(suite, cst.IndentedBlock) and len(suite.body) == 1 and \
                id(suite.body[0]) in self.ctx._emptied and not suite.footer and \
                suite.header.comment is None and not any(e.comment for e in suite.body[0].leading_lines)

        if isinstance(node.orelse, cst.Else) and emptied(node.orelse.body) and not any(
                e.comment for e in node.orelse.leading_lines):
            node = node.with_changes(orelse=None)
            self._widen(original.orelse)
        if node.orelse is None and emptied(node.body) and not _may_act(node.test):
            self._widen(original)
            return self.ctx.remove_statement(node)
        return node

    def _widen(self, part: cst.CSTNode) -> None:
        """The fixes reported inside `part` (an original block now gone whole) cover it."""
        inside: Set[int] = set()
        stack = [part]
        while stack:
            n = stack.pop()
            inside.add(id(n))
            stack.extend(n.children)
        for rep in self.ctx.reports:
            if rep.fixed and rep.node is not None and id(rep.node) in inside:
                rep.node, rep.through = part, None


def _without(body: Sequence[cst.BaseStatement], gone: Callable[[cst.BaseStatement], bool],
             join: Callable[[List[cst.EmptyLine], List[cst.EmptyLine]], List[cst.EmptyLine]],
             ) -> Tuple[List[cst.BaseStatement], List[cst.EmptyLine]]:
    """The statements of a block but the `gone` ones, whose leading lines (comments, blank
    lines) move onto the next statement kept (`join`: lines above, lines below -> both);
    and the lines of gone statements after the last one kept."""
    out: List[cst.BaseStatement] = []
    carried: List[cst.EmptyLine] = []
    for stmt in body:
        if gone(stmt):
            carried = join(carried, list(stmt.leading_lines))
            continue
        if carried:
            stmt = stmt.with_changes(leading_lines=join(carried, list(stmt.leading_lines)))
            carried = []
        out.append(stmt)
    return out, carried


def _joined(above: List[cst.EmptyLine], below: List[cst.EmptyLine]) -> List[cst.EmptyLine]:
    """Lines above a removed statement, then those below it: the blank run where they meet
    counts once (the longer of the two)."""
    tail = next((i for i, e in enumerate(reversed(above)) if e.comment is not None), len(above))
    head = next((i for i, e in enumerate(below) if e.comment is not None), len(below))
    blanks = above[len(above) - tail:] if tail >= head else below[:head]
    return [*above[:len(above) - tail], *blanks, *below[head:]]


def _may_act(test: cst.BaseExpression) -> bool:
    """Could evaluating this test do something (a call, an await, an assignment)?"""
    return bool(m.findall(test, m.Call() | m.Await() | m.NamedExpr() | m.Yield()))


def _decode(source: bytes, path: str) -> str:
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    except SyntaxError as exc:
        if "encoding" not in str(exc) or "declaration" not in str(exc):
            raise UserError(f"{path}:1: cannot read: {exc}") from None
        encoding = "utf-8"  # undecodable bytes in the first two lines: say where below
    try:
        return source.decode(encoding)
    except UnicodeDecodeError as exc:
        line = source[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}:{line}: cannot decode as {encoding} (byte 0x{source[exc.start]:02x});"
            " add a PEP 263 coding cookie naming the file's encoding"
        ) from None


_PY2_HINTS = (
    "Missing parentheses in call to",
    "multiple exception types must be parenthesized",
    "leading zeros in decimal integer literals",
)
_PY2_LINE = re.compile(r"^\s*(print\s+[^\s(=]|exec\s+[\"']|raise\s+\w+\s*,|except\s+[\w.]+\s*,\s*\w+\s*:)|`|<>")


# CPython judges every input before LibCST sees it, as `python script.py` would compile it:
# LibCST's native parser overflows its stack on nesting CPython refuses (a segfault takes
# the run down), and accepts code CPython's compiler refuses (`break` outside a loop, a
# NUL byte), which rewritten would be output that does not compile. Full compile() costs
# about 7% of a LibCST parse (ast-only costs more: building the Python AST objects).
#
# Up to 3.11 how deep CPython's compiler nests follows the recursion limit, which the
# workers raise for LibCST's deep trees (run.py); the judge compiles under Python's own.
_PYTHON_RECURSION_LIMIT = 1000
_TOO_DEEP = "too deeply nested for Python's parser"
_NESTING_WORDS = {"not", "lambda", "if", "else", "and", "or", "await", "in", "is"}


def _compile_error(source: bytes, path: str) -> Optional[SyntaxError]:
    """Why CPython refuses `source` (None: it compiles). A full compile, not a parse alone:
    `def f(a, a)`, `return` outside a function and `break` outside a loop are compiler errors."""
    return _judge(source, path, None)


def compiles(source: bytes, path: str) -> bool:
    """CPython compiles `source`, as every output of ours must."""
    return _judge(source, path, None) is None


def _python_tree(source: bytes, path: str) -> Optional[ast.Module]:
    """The stdlib tree of a file CPython compiles, judged as `_compile_error` judges it
    (None where it refuses: `_compile_error` then says why)."""
    tree: List[ast.Module] = []
    try:
        return tree[0] if _judge(source, path, tree) is None else None
    except SystemError as exc:
        if _AST_DEPTH_BUG not in str(exc):
            raise
        return None  # judged again without Python AST objects, and read without the gates


# Held while the recursion limit is changed and while CPython builds AST objects: 3.11's
# AST constructor counts its depth in interpreter-wide state, from the limit, so two threads
# in it at once (a collection in one runs Python code, and the other gets the GIL: a
# timed-out file's thread still judging) made `ast.parse` raise "AST constructor recursion
# depth mismatch" (CPython gh-106905).
RECURSION_LIMIT_LOCK = threading.RLock()


# CPython 3.11's AST constructor can miscount its depth and refuse a tree it built
# (gh-106905); seen in CI inside the test suite's process, after hundreds of earlier files
_AST_DEPTH_BUG = "AST constructor recursion depth mismatch"


def parse_python(source: Union[str, bytes], path: str = "<unknown>") -> ast.Module:
    """`ast.parse`, one thread at a time (see RECURSION_LIMIT_LOCK); where 3.11 miscounts
    the AST constructor's depth, again in a thread of its own (a fresh recursion count)."""
    with RECURSION_LIMIT_LOCK:
        try:
            return ast.parse(source, path)
        except SystemError as exc:
            if _AST_DEPTH_BUG not in str(exc):
                raise
        out: Dict[str, Any] = {}

        def parse() -> None:
            try:
                out["tree"] = ast.parse(source, path)
            except BaseException as exc:  # handed to the caller's thread
                out["error"] = exc

        thread = threading.Thread(target=parse, name="gpumigrate-ast")
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["tree"]


def _judge(source: bytes, path: str, tree: Optional[List[ast.Module]]) -> Optional[SyntaxError]:
    with RECURSION_LIMIT_LOCK:
        return _judge_locked(source, path, tree)


def _judge_locked(source: bytes, path: str, tree: Optional[List[ast.Module]]) -> Optional[SyntaxError]:
    saved = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(_PYTHON_RECURSION_LIMIT + _depth())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings are not ours to print (nor, with -W error, errors)
            if tree is None:
                compile(source, path, "exec", dont_inherit=True)
            else:  # the same judgement, keeping the parser's tree
                tree.append(ast.parse(source, path))
                compile(tree[0], path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes, in some versions
        err = exc if isinstance(exc, SyntaxError) else SyntaxError(str(exc))
        if not err.lineno and b"\0" in source:  # no line given for a NUL byte: find it
            err.lineno = source.count(b"\n", 0, source.find(b"\0")) + 1
        return err
    except (MemoryError, RecursionError):  # the parser's or the compiler's depth limit; no line given
        err = SyntaxError(_TOO_DEEP)
        err.lineno = _deepest_line(source)
        return err
    finally:
        sys.setrecursionlimit(saved)
    return None


def _depth() -> int:
    """Frames on this thread's stack: how much of the recursion limit is spent already."""
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def _deepest_line(source: bytes) -> int:
    """Where the nesting is deepest, as CPython does not say: the logical line with the most
    operators and nesting keywords."""
    best, best_line, score, start = 0, 1, 0, 0
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                if score > best:
                    best, best_line = score, start
                score, start = 0, 0
            elif tok.type == tokenize.OP and tok.string not in ",:;=)]}" or (
                    tok.type == tokenize.NAME and tok.string in _NESTING_WORDS):
                score += 1
                start = start or tok.start[0]
    except (tokenize.TokenError, SyntaxError):
        if score > best:
            best_line = start
    return best_line


def _line(text: str, number: Optional[int]) -> str:
    lines = text.splitlines()
    return lines[number - 1] if number and 0 < number <= len(lines) else ""


def _is_python2(message: str, line: str) -> bool:
    return any(hint in message for hint in _PY2_HINTS) or bool(_PY2_LINE.search(line))


def _parse_error(text: str, path: str, err: SyntaxError) -> UserError:
    line = err.lineno or 1
    if _is_python2(err.msg, _line(text, line)):
        return UserError(f"{path}:{line}: cannot parse: Python 2 syntax ({err.msg}); "
                         "--py2 converts it first (2to3's fixers)")
    version = "{}.{}".format(*sys.version_info[:2])
    return UserError(f"{path}:{line}: cannot parse: {err.msg} (Python {version})")


def _libcst_parse(source: bytes, path: str) -> cst.Module:
    """LibCST's tree of a file that CPython compiles: a failure here is LibCST's limit, not
    the file's fault, and the message says so."""
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        detail = re.sub(r"^parser error: (error at \d+:\d+: )?", "", exc.message.splitlines()[0])
        if len(detail) > 80:
            detail = detail[:80].rsplit(",", 1)[0] + ", ..."
        raise UserError(f"{path}:{exc.raw_line}: LibCST cannot parse this (Python can): {detail}; "
                        "file left unchanged") from None
    except RecursionError:
        raise UserError(f"{path}:{_deepest_line(source)}: LibCST cannot parse this (Python can): "
                        "nesting too deep; file left unchanged") from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":  # a Rust panic in LibCST's native parser
            raise
        raise UserError(f"{path}:1: LibCST cannot parse this (Python can): its parser failed "
                        f"({str(exc).splitlines()[0] if str(exc) else 'panic'}); file left unchanged") from None


def _parse(source: bytes, path: str, repairs: Sequence[type],
           judged: bool = False) -> Tuple[cst.Module, bytes, List[_Report]]:
    """`judged`: CPython compiled `source` already."""
    text = _decode(source, path)
    err = None if judged else _compile_error(source, path)
    if err is None:
        return _libcst_parse(source, path), source, []
    # Some old scripts only compile under an older grammar (`.cuda(async=True)`); rules may
    # know a lexical repair. Its result is judged as the input is.
    for rule in repairs:
        repair = getattr(rule, "repair", None)
        fixed = repair(text) if repair else None
        if fixed is None:
            continue
        new_text, spots = fixed
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
        repaired = new_text.encode(encoding)
        still = _compile_error(repaired, path)
        if still is not None:
            err = still  # the repair keeps lines: what is left is the file's real problem
            continue
        reports = [_Report(rule.code, None, msg, True, False, line, col) for line, col, msg in spots]
        return _libcst_parse(repaired, path), repaired, reports
    raise _parse_error(text, path, err)


def _edit_imports(ctx: FileContext, module: cst.Module) -> cst.Module:
    # These visitors are costly (RemoveImportsVisitor needs scope analysis): only on files
    # whose fixes asked for an import edit. Imported here: libcst.codemod pulls in
    # libcst.matchers, which most runs never need (lazy.py).
    from libcst.codemod import CodemodContext
    from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

    if ctx.imports_to_remove:
        codemod_ctx = CodemodContext()
        for mod, name, asname in ctx.imports_to_remove:
            RemoveImportsVisitor.remove_unused_import(codemod_ctx, mod, name, asname)
        module = _transform_in_place(_import_remover()(codemod_ctx), module)
    if ctx.imports_to_add:
        codemod_ctx = CodemodContext()
        for mod, name, asname in ctx.imports_to_add:
            AddImportsVisitor.add_needed_import(codemod_ctx, mod, name, asname)
        module = _transform_in_place(AddImportsVisitor(codemod_ctx), module)
        added: Dict[str, Set[str]] = defaultdict(set)
        for mod, name, asname in ctx.imports_to_add:
            if name:
                added[mod].add(f"{name} as {asname}" if asname else name)
        module = module.visit(_SortedImports(added))
    return module


@functools.lru_cache(maxsize=None)
def _import_remover() -> type:
    """RemoveImportsVisitor drops an emptied import line with the comments above it (a
    license header above `from torch.autograd import Variable`, data loss). This one keeps
    them, as the engine keeps a removed statement's: they move onto the next statement, or
    to the block's end after its last one. Made on first use: libcst.codemod is imported
    lazily."""
    from libcst.codemod.visitors import RemoveImportsVisitor

    class KeepingComments(RemoveImportsVisitor):
        def __init__(self, context: Any) -> None:
            super().__init__(context)
            self.emptied: Dict[int, cst.SimpleStatementLine] = {}  # held: ids stay unique

        def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine,
                                      updated: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
            if updated.body or all(line.comment is None for line in updated.leading_lines):
                return updated  # kept, or gone with nothing but blank lines above it
            placeholder = updated.with_changes(body=[cst.Pass()])
            self.emptied[id(placeholder)] = placeholder
            return placeholder

        def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> cst.IndentedBlock:
            return self._settled(updated)

        def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
            return self._settled(updated)

        def _settled(self, block: Any) -> Any:
            if not any(id(stmt) in self.emptied for stmt in block.body):
                return block
            body, carried = _without(block.body, lambda stmt: id(stmt) in self.emptied, lambda a, b: [*a, *b])
            if not body:  # the block held only imports that went: it keeps a `pass` under the comments
                return block.with_changes(body=[cst.SimpleStatementLine([cst.Pass()], leading_lines=carried)])
            return block.with_changes(body=body, footer=[*carried, *block.footer])

    return KeepingComments


class _SortedImports(cst.CSTTransformer):
    """AddImportsVisitor appends names to an existing `from m import a, c`: where those were
    in order, the merged list is put in order too (`a, b, c`), as one run adding all of them
    at once would write it."""

    def __init__(self, added: Dict[str, Set[str]]) -> None:
        self.added = added  # module -> the names added to it

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # AddImportsVisitor edits module-level imports only

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        code = cst.Module(body=[]).code_for_node
        added = self.added.get(code(updated.module)) if updated.module is not None else None
        if not added or isinstance(updated.names, cst.ImportStar):
            return updated
        names = list(updated.names)
        key = [code(alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)).strip() for alias in names]
        earlier = [k for k in key if k not in added]
        if key == sorted(key) or earlier != sorted(earlier) or len(earlier) == len(key):
            return updated
        order = sorted(range(len(names)), key=key.__getitem__)
        commas = [alias.comma for alias in names]
        return updated.with_changes(names=[names[i].with_changes(comma=commas[n]) for n, i in enumerate(order)])


def _transform_in_place(codemod: Codemod, module: cst.Module) -> cst.Module:
    """`codemod.transform_module` without the deep copy its MetadataWrapper makes: on a large
    file that copy was the peak of the whole run. LibCST copies so that no node object sits
    in two places; where ours may (a reused `device` name), the scope analysis sees one more
    access, which only ever keeps an import."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    with codemod.resolve(wrapper):
        codemod.context = dataclasses.replace(codemod.context, wrapper=wrapper)
        return codemod.transform_module_impl(wrapper.module)


def _applies(rule: type, text: str) -> bool:
    triggers = getattr(rule, "triggers", None)
    return not triggers or any(t in text for t in triggers)


def _wanted(rule: type, options: Dict[str, Any]) -> bool:
    """A rule whose text triggers are absent may still apply because of the file's options
    (its project: a script that drives another module's training)."""
    wanted = getattr(rule, "wanted", None)
    return wanted is not None and wanted(options)


def _statement_lines(tree: ast.Module, text: str) -> List[Tuple[int, Optional[int], int]]:
    """Each statement's first line and column (None after a decorator) and last line, in
    LibCST's order."""
    lines = None if text.isascii() else re.split(r"\r\n|\r|\n", text)
    out: List[Tuple[int, Optional[int], int]] = []
    for stmt in statements(tree.body):
        decorators = getattr(stmt, "decorator_list", None)
        if decorators:
            out.append((decorators[0].lineno, None, stmt.end_lineno))
        else:
            column = stmt.col_offset if lines is None else char_column(lines[stmt.lineno - 1], stmt.col_offset)
            out.append((stmt.lineno, column, stmt.end_lineno))
    return out


def _gate(rule: type, facts: SourceFacts) -> bool:
    gate = getattr(rule, "gate", None)
    return gate(facts) if gate is not None else _applies(rule, facts.text)


# Lint asks each rule's gate, on the stdlib tree, whether it can report on a file; the tests
# turn this off to show the findings are the same without.
GATES = True


class _Front:
    """A source as the engine reads it before any rule runs: CPython's judgement, with the
    facts the gates read and the statements' positions from its stdlib tree, then (on
    demand: only if a gate passes) LibCST's tree. The same bytes read again (the next pass
    of a migration, when the one before changed nothing) reuse it all, with the facts the
    first run's analyses established about the tree (`FileContext.shared(..., tree=True)`)."""

    def __init__(self, source: bytes, path: str, repairs: Sequence[type], light_ok: bool) -> None:
        self.source, self.path, self.repairs = source, path, repairs
        tree = _python_tree(source, path) if GATES else None
        self.judged, self.read = tree is not None, source
        self.facts: Optional[SourceFacts] = None
        self.statement_lines: Optional[List[Tuple[int, Optional[int], int]]] = None
        self.whole: Optional[str] = None
        if tree is not None:
            self.whole = _decode(source, path)
            self.facts = SourceFacts.of(tree, self.whole)
            if light_ok:  # lint may parse the file with large data literals pruned (a rewrite may not)
                light = without_data(self.whole, tree)
                if light is not self.whole:
                    self.read = light.encode(tokenize.detect_encoding(io.BytesIO(source).readline)[0])
            if _fast_traversal():
                self.statement_lines = _statement_lines(tree, self.whole)
        self.module: Optional[cst.Module] = None
        self.names: Any = None
        self.index: Optional[NodeIndex] = None
        self.tree_facts: Dict[Any, Any] = {}

    def parse(self) -> None:
        if self.module is not None:
            return
        self.module, self.parsed_source, self.early = _parse(self.read, self.path, self.repairs, judged=self.judged)
        self.text = self.whole if self.whole is not None and self.parsed_source is self.source else \
            _decode(self.parsed_source, self.path)
        self.whole = self.whole if self.whole is not None else self.text  # rules read the whole text
        if not self.judged and GATES and _fast_traversal():
            tree = _python_tree(self.parsed_source, self.path)  # repaired (`async=`): its statements
            if tree is not None:
                self.statement_lines = _statement_lines(tree, self.text)


def process(
    source: bytes,
    path: str,
    rules: Sequence[type],
    *,
    fix: Iterable[str] = (),
    names_factory: Callable[[cst.Module], Any],
    options: Optional[Dict[str, Any]] = None,
    repairs: Optional[Sequence[type]] = None,
    reuse: Optional[Dict[Any, _Front]] = None,
) -> FileResult:
    """Run `rules` over one source unit. `fix`: codes whose fixes are applied. `repairs`:
    rules whose lexical repairs may make an old file parse (default: `rules`); they are
    applied whatever is selected, as a file must parse to be checked at all. `reuse`: a
    dict kept across runs over the same file (the passes of a migration): a run over the
    bytes of the run before takes their parse and tree facts from it.

    Only the rules whose gate passes run (a gate is a necessary condition of any finding, so
    of any fix), and a file no gate passes is not parsed by LibCST. A file marked
    `# gpumigrate: noqa` is left alone; `# gpumigrate: noqa: CODES` turns those codes off in
    it. Never raises for bad input: the problem comes back as `FileResult.error`."""
    result = FileResult(path=path, source=source)
    with reported_as_error(result, f"{path}:1"):
        repairs = rules if repairs is None else repairs
        fix = list(fix)
        key = (bool(fix), tuple(repairs))
        front = reuse.get(key) if reuse is not None else None
        if front is None or front.source is not source and front.source != source:
            front = _Front(source, path, repairs, light_ok=not fix)
            if reuse is not None:
                reuse.clear()  # only the newest bytes are read again
                reuse[key] = front
        if front.facts is not None and not fix:  # lint: only the rules that can report here
            rules = [rule for rule in rules if _gate(rule, front.facts)]
            if not rules:
                return result
        front.parse()
        module, parsed_source, whole = front.module, front.parsed_source, front.whole
        skip, off = file_noqa(whole) if "gpumigrate" in whole else (False, [])
        if skip:
            return result
        if off:
            rules = [r for r in rules if not _covers(off, r.code)]
            fix = [c for c in fix if not _covers(off, c)]
        if front.names is None:
            front.names = names_factory(module)

        def context() -> FileContext:
            ctx = FileContext(module, path, whole, front.names, options)
            ctx.fixing = set(fix)
            ctx.statement_lines = front.statement_lines
            ctx._index, ctx._tree_facts = front.index, front.tree_facts
            # A repair is reported under its own code only if that rule is selected; when the
            # file is rewritten the repair is part of the output either way, and counts as a fix.
            codes = {r.code for r in rules}
            ctx.reports.extend(rep for rep in front.early if rep.code in codes or ctx.fixing)
            return ctx

        def applying(ctx: FileContext) -> List[Any]:
            """The rules that apply, made for `ctx` (they keep state; some analyse the file as
            they are made, through CURRENT's index)."""
            return [rule(ctx) for rule in rules if _applies(rule, whole) or _wanted(rule, ctx.options)]

        ctx = context()
        token = CURRENT.set(ctx)
        active = applying(ctx)
        if active and ctx.fixing and _fast_traversal():
            # Most files a migration reads need no edit: look first, over the index, and
            # rebuild the tree (LibCST's transform, most of a run's time) only where a fix asks
            # to, in a fresh run.
            if not (_Dispatch(ctx, active).observe(ctx.index) or ctx.finishers or ctx.imports_to_add
                    or ctx.imports_to_remove or ctx._removed):
                active = []
            else:
                front.index = ctx._index
                CURRENT.reset(token)
                ctx = context()
                token = CURRENT.set(ctx)
                active = applying(ctx)
        if not active:
            new_module = module
        elif ctx.fixing or not _fast_traversal():
            new_module = module.visit(_Dispatch(ctx, active))
        else:  # nothing to rewrite: walk the index, rebuild nothing
            _Dispatch(ctx, active).observe(ctx.index)
            new_module = module
        if ctx.fixing:
            for finish in ctx.finishers:
                new_module = finish(new_module)
            new_module = _edit_imports(ctx, new_module)
        CURRENT.reset(token)
        front.index = ctx._index
        result.findings = _findings(ctx)
        new_source = new_module.bytes if ctx.fixing and new_module is not module else parsed_source
        if new_source != source and ctx.fixing:
            if new_module is module or not any(f.fixed for f in result.findings):
                return result  # nothing was fixed: whatever differs is not ours to change
            new_source = _keep_untouched(module, parsed_source, new_source, path)
            _verify(new_source, path)
            result.new_source = new_source
    return result


@contextlib.contextmanager
def reported_as_error(result: FileResult, where: str, unit: str = "file") -> Iterator[None]:
    """Bad input, and any bug of ours, becomes `result.error`: it must not cost the user a
    file or a traceback. `where`: the location a too-deep nesting is reported at."""
    try:
        yield
    except UserError as exc:
        result.error = str(exc)
        result.findings = []
    except RecursionError:
        result.error = f"{where}: cannot process: nesting too deep"
    except Exception as exc:
        result.error = f"{result.path}: internal error, {unit} left unchanged ({type(exc).__name__}: {exc})"
        result.findings = []


def _findings(ctx: FileContext) -> List[Finding]:
    out = []
    for rep in ctx.reports:
        line, col, end, end_col = (rep.line, rep.col, rep.line, 0) if rep.node is None else ctx.extent(rep.node)
        if rep.through is not None:
            through = ctx.extent(rep.through)
            if through[2] >= end:
                end, end_col = through[2], through[3]
        if not end_col and end > 0:  # a block's span (the stdlib parser's) has no end column: its last line's end
            lines = ctx._lines()
            end_col = len(lines[end - 1].rstrip()) if end <= len(lines) else 0
        if ctx.has_noqa() and ctx.suppressed(rep.code, *(ctx.noqa_lines(rep.node) if rep.node is not None
                                                           else (line, line))):
            continue
        fixed = rep.fixed and (rep.code in ctx.fixing or (rep.node is None and bool(ctx.fixing)))
        out.append(Finding(rep.code, line, col, rep.message, fixed=fixed, review=rep.review, end_line=end,
                           end_col=end_col, not_applied=rep.not_applied, note=rep.note,
                           alias=rep.alias))
    out.sort(key=lambda f: (f.line, f.col, f.code))
    return out


def _keep_untouched(module: cst.Module, source: bytes, new_source: bytes, path: str) -> bytes:
    """The promise that untouched code keeps its bytes rests on LibCST printing an unedited
    tree back exactly. Where it does not (`except E :`, a final lone CR), our edits are
    carried onto the original lines instead; only an edit on such a line is given up."""
    printed = module.bytes
    if printed == source:
        return new_source
    merged = _carry_over(source, printed, new_source)
    if merged is not None:
        return merged
    old, new = source.splitlines(), printed.splitlines()
    line = next((i + 1 for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)) + 1)
    raise UserError(f"{path}:{line}: cannot rewrite without changing untouched code here (LibCST does not "
                    "reproduce this line exactly); file left unchanged")


def _carry_over(original: bytes, printed: bytes, edited: bytes) -> Optional[bytes]:
    """`printed` is `original` with LibCST's losses, `edited` is `printed` with our edits:
    apply each printed->edited hunk to `original`, if every line it replaces (or sits
    beside) came through LibCST unchanged. None when an edit touches a lost line."""
    orig, base, new = (s.splitlines(keepends=True) for s in (original, printed, edited))
    same: Dict[int, int] = {}  # line of `printed` -> the identical line of `original`
    for tag, i1, i2, j1, _ in difflib.SequenceMatcher(None, base, orig, autojunk=False).get_opcodes():
        if tag == "equal":
            same.update((i1 + k, j1 + k) for k in range(i2 - i1))
    out: List[bytes] = []
    at = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if i1 < i2:
            if any(k not in same for k in range(i1, i2)) or same[i2 - 1] - same[i1] != i2 - i1 - 1:
                return None
            start, end = same[i1], same[i2 - 1] + 1
        elif i1 in same:
            start = end = same[i1]
        elif i1 - 1 in same:
            start = end = same[i1 - 1] + 1
        elif i1 == 0:
            start = end = 0
        else:
            return None
        if start < at:
            return None
        out += orig[at:start] + new[j1:j2]
        at = end
    return b"".join(out + orig[at:])


def _verify(new_source: bytes, path: str) -> None:
    """The promise: output always compiles (to bytecode: some errors, such as a repeated
    keyword argument, only the compiler sees), as the input did: `_parse` let nothing else
    through."""
    err = _compile_error(new_source, path)
    if err is None:
        return
    raise UserError(f"{path}:{err.lineno or 1}: fixes dropped: the rewritten file would not compile ({err.msg})")
