"""Jupyter notebooks (`.ipynb`, nbformat 4) as one source unit for the engine.

The code cells run top to bottom as one script, so they are joined into one Python source
that the engine analyses and rewrites like a file; findings are mapped back to
(cell, line, column) and the rewritten source is split back into the cells.

- Cell numbers count every cell of the notebook from 1 (markdown cells too), as ruff does:
  "cell 5" is the fifth cell from the top in Jupyter.
- IPython syntax (`%magic`, `!shell`, `x = !cmd`, `?obj`, `obj?`) is replaced by a
  placeholder statement for the engine and put back byte for byte afterwards. A cell whose
  cell magic runs its body as Python (`%%time`, `%%capture`, ...) keeps the magic line out
  of the analysis; any other cell magic (`%%bash`, `%%writefile`, ...) is skipped entirely.
- Cells are separated by a marker statement, so a statement a fix inserts before a cell's
  first statement stays in that cell, and imports added at the top go into the first code
  cell. Cells whose text did not change keep their JSON value as it was.
- The notebook is written back with the layout it was read with (indent, separators,
  `ensure_ascii`, line endings, final newline); a notebook whose layout cannot be reproduced
  exactly is linted but not rewritten, unless the user opts in (`--reformat-notebooks`) to
  its JSON being written the way nbformat (and so Jupyter) writes it: `reformatted`.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import re
import tokenize
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from gpumigrate.rewriter.engine import FileResult, Finding, UserError, process, reported_as_error

SUFFIX = ".ipynb"

# Cell magics whose body IPython runs as Python in the notebook's namespace.
PYTHON_CELL_MAGICS = frozenset({"time", "timeit", "capture", "prun", "debug"})

_PREFIX = "__gpumigrate_"  # reserved: a notebook using it is not rewritten
_MARKER = re.compile(r"^__gpumigrate_cell_(\d+)__\r?\n?$")
_MAGIC = re.compile(r"^([ \t]*)import (__gpumigrate_magic_\d+__)(\r?\n)?$")
# IPython's escapes: a logical line starting with one of these is not Python.
_ESCAPES = ("%", "!", "?", "/", ",", ";")
_HELP_END = re.compile(r"^[ \t]*%{0,2}[A-Za-z_*][\w*]*(?:\.[A-Za-z_*][\w*]*)*[ \t]*\?{1,2}[ \t]*\r?\n?$")
_ASSIGN_MAGIC = re.compile(r"^[ \t]*[A-Za-z_][\w.]*(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*[ \t]*=[ \t]*[!%]")
_CELL_MAGIC = re.compile(r"%%([\w.!]*)")


def is_notebook(path: str) -> bool:
    return path.lower().endswith(SUFFIX)


# -- reading and writing the JSON -----------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """How the file was serialised: enough to write it back byte for byte."""

    indent: Optional[str]
    separators: Tuple[str, str]
    ensure_ascii: bool
    newline: str
    trailer: str  # whitespace after the closing brace
    bom: bool
    sort_keys: bool = False  # the keys' order is the file's own (as read) unless sorted

    def dumps(self, data: Any) -> bytes:
        text = json.dumps(data, indent=self.indent, separators=self.separators, ensure_ascii=self.ensure_ascii,
                          sort_keys=self.sort_keys)
        text += self.trailer
        if self.newline != "\n":
            text = text.replace("\n", self.newline)  # JSON strings hold no raw newlines
        return ("\ufeff" if self.bom else "").encode("utf-8") + text.encode("utf-8")


# How nbformat writes a notebook (nbformat/v4/nbjson.py, JSONWriter.writes, and
# nbformat.write's final newline): Jupyter saves files this way. Only the layout is taken;
# nbformat's content changes (sources split into lines, transient metadata dropped) are not.
NBFORMAT_LAYOUT = Layout(indent=" ", separators=(",", ": "), ensure_ascii=False, newline="\n", trailer="\n",
                         bom=False, sort_keys=True)
REFORMAT_FLAG = "--reformat-notebooks"


@dataclass
class Notebook:
    data: Dict[str, Any]
    layout: Optional[Layout]
    layout_problem: str = ""


def load(source: bytes, path: str) -> Notebook:
    """Parse and check a notebook; a bad one raises a one-line UserError."""
    try:
        text = source.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a notebook: not UTF-8 (byte 0x{source[exc.start]:02x} at offset {exc.start})") from None
    bom = text.startswith("\ufeff")
    body = text[1:] if bom else text
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a notebook: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})") from None
    except RecursionError:
        raise UserError(f"{path}: not a notebook: JSON nested too deep") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a notebook: the JSON is not an object")
    version = data.get("nbformat")
    if not isinstance(version, int) or isinstance(version, bool):
        raise UserError(f"{path}: not a notebook: no nbformat version")
    if version != 4:
        raise UserError(f"{path}: unsupported notebook format {version} (nbformat 4 is needed; "
                        "`jupyter nbconvert --to notebook --nbformat 4` converts it)")
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise UserError(f"{path}: not a notebook: no list of cells")
    for number, cell in enumerate(cells, 1):
        if not isinstance(cell, dict) or not isinstance(cell.get("cell_type"), str):
            raise UserError(f"{path}:cell {number}: not a notebook cell")
        src = cell.get("source", "")
        if not (isinstance(src, str) or (isinstance(src, list) and all(isinstance(s, str) for s in src))):
            raise UserError(f"{path}:cell {number}: the cell's source is neither a string nor a list of strings")
    layout, problem = _detect_layout(source, body, data, bom)
    return Notebook(data, layout, problem)


def _detect_layout(source: bytes, text: str, data: Any, bom: bool) -> Tuple[Optional[Layout], str]:
    """The layout that writes `data` back as exactly `source`, or None and why not."""
    newline = "\r\n" if "\r\n" in text else "\n"
    core = text.replace("\r\n", "\n") if newline != "\n" else text
    stripped = core.rstrip(" \t\n\r")
    trailer, core = core[len(stripped):], stripped
    match = re.match(r"\{\n([ \t]*)", core)
    indent = match.group(1) if match else None
    # A pure-ASCII file either has no other characters or escapes them all.
    ensure_ascii = core.isascii()
    candidates = [(",", ": "), (",", ":")] if indent is not None else [(", ", ": "), (",", ":")]
    for separators in candidates:
        layout = Layout(indent, separators, ensure_ascii, newline, trailer, bom)
        if json.dumps(data, indent=indent, separators=separators, ensure_ascii=ensure_ascii) == core:
            if layout.dumps(data) == source:
                return layout, ""
            return None, "writing it back would change its line endings (they are mixed)"
    # Say where: the first line that writing it back would change.
    attempt = json.dumps(data, indent=indent, separators=candidates[0], ensure_ascii=ensure_ascii).split("\n")
    original = core.split("\n")
    line = next((i + 1 for i, (a, b) in enumerate(zip(original, attempt)) if a != b), min(len(original), len(attempt)))
    return None, f"writing it back would change its JSON layout (from line {line} on: number format, escaping or spacing)"


def _cell_text(cell: Dict[str, Any]) -> str:
    src = cell.get("source", "")
    return src if isinstance(src, str) else "".join(src)


def _lines(text: str) -> List[str]:
    """Lines with their ends, split at "\\n" only (as Jupyter splits a cell's source)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _source_value(text: str, original: Any) -> Any:
    """`text` in the form the cell stored its source: a list of lines or one string."""
    return _lines(text) if isinstance(original, list) else text


# -- IPython syntax -------------------------------------------------------------------------

def _scan(line: str, quote: Optional[str], depth: int) -> Tuple[Optional[str], int, bool]:
    """Python's lexical state after `line`: open string quote, bracket depth, and whether
    the logical line goes on (a backslash at the end). Enough to tell where a logical line
    starts, which is the only place where IPython looks for its escapes."""
    i, n = 0, len(line)
    while i < n:
        ch = line[i]
        if quote is not None:
            if ch == "\\":
                i += 2
            elif line.startswith(quote, i):
                i += len(quote)
                quote = None
            else:
                i += 1
            continue
        if ch == "#":
            return None, depth, False
        if ch in "\"'":
            quote = line[i:i + 3] if line[i:i + 3] in ('"""', "'''") else ch
            i += len(quote)
            continue
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        i += 1
    body = line.rstrip("\r\n")
    continued = body.endswith("\\")
    if quote is not None and len(quote) == 1 and not continued:
        quote = None  # an unterminated one-line string: Python's error to report, not ours
    return quote, depth, continued


def _is_magic(line: str) -> bool:
    stripped = line.lstrip(" \t")
    if not stripped.strip():
        return False
    return stripped.startswith(_ESCAPES) or bool(_HELP_END.match(line)) or bool(_ASSIGN_MAGIC.match(line))


def _mask(lines: Sequence[str], counter: List[int], magics: Dict[str, str]) -> Tuple[List[str], List[int]]:
    """Replace each IPython line (with its backslash continuations) by a placeholder
    statement at the same indentation. Returns the masked lines and, for each, the index of
    the original line it stands for.

    The placeholder is an import of a name no one uses: it does nothing the analysis could
    act on, and `%matplotlib inline` or `!pip install` above a cell's imports stays part of
    the import block, so imports a fix adds go after the user's, not above the magics."""
    out: List[str] = []
    origin: List[int] = []
    quote: Optional[str] = None
    depth, continued, i = 0, False, 0
    while i < len(lines):
        line = lines[i]
        if quote is None and depth == 0 and not continued and _is_magic(line):
            j = i
            while j + 1 < len(lines) and lines[j].rstrip("\r\n").endswith("\\"):
                j += 1
            original = "".join(lines[i:j + 1])
            ending = original[len(original.rstrip("\r\n")):]
            name = f"{_PREFIX}magic_{counter[0]}__"
            counter[0] += 1
            magics[name] = original[:len(original) - len(ending)].lstrip(" \t")
            indent = line[:len(line) - len(line.lstrip(" \t"))]
            out.append(f"{indent}import {name}{ending}")
            origin.append(i)
            i = j + 1
            continue
        quote, depth, continued = _scan(line, quote, depth)
        out.append(line)
        origin.append(i)
        i += 1
    return out, origin


def _split_cell_magic(text: str) -> Tuple[str, str, Optional[str]]:
    """(header, body, magic name): a cell magic on the first non-blank line is the header."""
    lines = _lines(text)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        match = _CELL_MAGIC.match(line)
        if match is None:
            break
        return "".join(lines[:i + 1]), "".join(lines[i + 1:]), match.group(1)
    return "", text, None


# -- joining the cells, and splitting them again --------------------------------------------

@dataclass
class _Code:
    number: int  # 1-based position among all cells
    cell: Dict[str, Any]
    text: str  # the cell's whole source
    header: str  # a Python cell magic's line, kept out of the analysis
    body: str
    magics: Dict[str, str] = field(default_factory=dict)


@dataclass
class Joined:
    """The code cells as one script: its text, and for each of its lines (1-based, index 0
    unused) the cell number and line in that cell (0, 0 for separators)."""

    text: str
    where: List[Tuple[int, int]]
    codes: List[_Code]

    def locate(self, line: int) -> Tuple[int, int]:
        """(cell, line in cell) of a line of the joined script; a separator line counts as
        the end of the cell before it."""
        line = min(max(line, 1), len(self.where) - 1)
        while line > 1 and self.where[line][0] == 0:
            line -= 1
        return self.where[line] if self.where[line][0] else (self.codes[0].number, 1)


def _is_python(data: Dict[str, Any]) -> bool:
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    info = meta.get("language_info") if isinstance(meta.get("language_info"), dict) else {}
    spec = meta.get("kernelspec") if isinstance(meta.get("kernelspec"), dict) else {}
    language = info.get("name") or spec.get("language") or "python"
    return str(language).lower() == "python"


def join(nb: Notebook, path: str) -> Optional[Joined]:
    """The Python code cells as one script, or None if the notebook has none."""
    if not _is_python(nb.data):
        return None
    codes: List[_Code] = []
    counter = [0]
    parts: List[str] = []
    where: List[Tuple[int, int]] = [(0, 0)]
    for number, cell in enumerate(nb.data["cells"], 1):
        if cell.get("cell_type") != "code":
            continue
        text = _cell_text(cell)
        header, body, magic = _split_cell_magic(text)
        if magic is not None and magic not in PYTHON_CELL_MAGICS:
            continue  # %%bash, %%writefile, ...: not Python run in this notebook
        if _PREFIX in text:
            raise UserError(f"{path}:cell {number}: uses the reserved name prefix {_PREFIX!r}; notebook left unchanged")
        if not body.strip():
            continue  # nothing to analyse, and no place for what a fix inserts
        code = _Code(number, cell, text, header, body)
        if codes:
            parts.append(f"{_PREFIX}cell_{number}__\n")
            where.append((0, 0))
        masked, origin = _mask(_lines(body), counter, code.magics)
        if masked and not masked[-1].endswith("\n"):
            masked[-1] += "\n"
        offset = header.count("\n") + 1
        parts.extend(masked)
        where.extend((number, offset + i) for i in origin)
        codes.append(code)
    if not codes:
        return None
    return Joined("".join(parts), where, codes)


def _split(new_text: str, joined: Joined, path: str) -> Dict[int, str]:
    """The rewritten script cut at the separators, IPython lines put back: cell number ->
    new cell text. Text before the first separator belongs to the first code cell."""
    numbers = [c.number for c in joined.codes]
    bodies: Dict[int, List[str]] = {numbers[0]: []}
    current = numbers[0]
    magics = {name: text for c in joined.codes for name, text in c.magics.items()}
    seen = set()
    for line in _lines(new_text):
        if _PREFIX not in line:
            bodies[current].append(line)
            continue
        marker = _MARKER.match(line)
        if marker is not None and int(marker.group(1)) not in bodies:
            current = int(marker.group(1))
            bodies[current] = []
            continue
        magic = _MAGIC.match(line)
        if magic is None or magic.group(2) not in magics or magic.group(2) in seen:
            raise UserError(f"{path}: cannot split the rewrite back into cells (a fix moved a cell boundary "
                            "or an IPython line); notebook left unchanged")
        seen.add(magic.group(2))
        bodies[current].append(magic.group(1) + magics[magic.group(2)] + (magic.group(3) or ""))
    if list(bodies) != numbers or len(seen) != len(magics):
        raise UserError(f"{path}: cannot split the rewrite back into cells (a fix removed a cell boundary "
                        "or an IPython line); notebook left unchanged")
    out = {}
    for code in joined.codes:
        body = "".join(bodies[code.number])
        if body.endswith("\n") and not code.body.endswith("\n"):
            body = body[:-1]  # Jupyter keeps no newline after a cell's last line
        out[code.number] = code.header + body
    return out


# -- the engine on a notebook ---------------------------------------------------------------

def _encoding(text: str) -> str:
    """The engine reads a coding cookie in the first two lines; a cell may carry one."""
    head = "".join(_lines(text)[:2]).encode("utf-8", "replace")
    try:
        return tokenize.detect_encoding(io.BytesIO(head).readline)[0]
    except SyntaxError:
        return "utf-8"


def _remap_error(message: str, path: str, joined: Joined) -> str:
    match = re.match(re.escape(path) + r":(\d+):(.*)$", message, re.S)
    if match is None:
        return message
    cell, line = joined.locate(int(match.group(1)))
    return f"{path}:cell {cell}:{line}:{match.group(2)}"


def _remap(finding: Finding, joined: Joined) -> Finding:
    cell, line = joined.locate(finding.line)
    end_cell, end = joined.locate(finding.end_line or finding.line)
    return replace(finding, cell=cell, line=line, end_line=end if end_cell == cell else line)


def process_notebook(source: bytes, path: str, rules: Sequence[type], *, fix: Sequence[str] = (),
                     names_factory: Callable[[Any], Any], options: Optional[Dict[str, Any]] = None,
                     **engine_options: Any) -> FileResult:
    """`engine.process` for a notebook: findings carry their cell, `new_source` is the
    whole rewritten notebook. Never raises for bad input."""
    result = FileResult(path=path, source=source)
    with reported_as_error(result, path, "notebook"):
        nb = load(source, path)
        joined = join(nb, path)
        if joined is None:
            return result
        encoding = _encoding(joined.text)
        try:
            script = joined.text.encode(encoding)
        except UnicodeEncodeError:
            raise UserError(f"{path}:cell {joined.codes[0].number}:1: the coding cookie ({encoding}) cannot "
                            "encode the notebook's code") from None
        inner = process(script, path, rules, fix=fix, names_factory=names_factory, options=options, **engine_options)
        if inner.error:
            result.error = _remap_error(inner.error, path, joined)
            return result
        result.findings = [_remap(f, joined) for f in inner.findings]
        if inner.new_source is None or not inner.changed:
            return result
        texts = _split(inner.new_source.decode(encoding), joined, path)
        changed = [c for c in joined.codes if texts[c.number] != c.text]
        if not changed:
            return result
        if nb.layout is None:
            raise UserError(f"{path}: cannot rewrite: {nb.layout_problem}; notebook left unchanged "
                            f"({REFORMAT_FLAG} writes its JSON as nbformat does)")
        for code in changed:
            code.cell["source"] = _source_value(texts[code.number], code.cell.get("source", ""))
        result.new_source = nb.layout.dumps(nb.data)
    return result


# -- --reformat-notebooks ----------------------------------------------------------------------

def reformatted(source: bytes, path: str) -> Optional[Tuple[bytes, str]]:
    """A notebook whose JSON cannot be written back byte for byte, written as nbformat
    writes it (same data), and a one-line account of what that changed; None where the
    layout is reproduced (nothing to do) or the file is no notebook (the engine says why)."""
    try:
        nb = load(source, path)
    except UserError:
        return None
    if nb.layout is not None:
        return None
    new = NBFORMAT_LAYOUT.dumps(nb.data)
    changes = json_changes(source, new)
    shown = "; ".join(f"line {n}: {a.strip()} -> {b.strip()}" for n, a, b in changes[:2]) or \
        "line endings, byte order mark or final newline only"
    more = f"; ... {len(changes) - 2} more" if len(changes) > 2 else ""
    return new, (f"JSON written as nbformat writes it ({REFORMAT_FLAG}): "
                 f"{len(changes)} line{'' if len(changes) == 1 else 's'} of layout changed ({shown}{more})")


def json_changes(old: bytes, new: bytes) -> List[Tuple[int, str, str]]:
    """(line of `old`, old text, new text) of each line pair a re-serialisation changed;
    a line that went or came pairs with an empty text."""
    a = old.decode("utf-8-sig").splitlines()
    b = new.decode("utf-8").splitlines()
    out: List[Tuple[int, str, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            for k in range(max(i2 - i1, j2 - j1)):
                out.append((i1 + min(k, max(i2 - i1 - 1, 0)) + 1, a[i1 + k] if i1 + k < i2 else "",
                            b[j1 + k] if j1 + k < j2 else ""))
    return out


def reformat_diff(path: str, old: bytes) -> str:
    """The unified diff of the JSON re-serialisation `--reformat-notebooks` makes of `old`
    before the migration ("" if its layout is reproduced): the changes a cell diff hides."""
    made = reformatted(old, path)
    if made is None:
        return ""
    return "".join(difflib.unified_diff(old.decode("utf-8-sig").splitlines(keepends=True),
                                        made[0].decode("utf-8").splitlines(keepends=True),
                                        fromfile=f"{path}\t(original JSON)", tofile=f"{path}\t(as nbformat writes it)"))


# -- for diffs and reports ------------------------------------------------------------------

def changed_cells(old: bytes, new: bytes) -> Optional[List[Tuple[int, str, str]]]:
    """(cell number, old text, new text) of each cell whose source differs; None if the two
    are not the same notebook with edited sources (then a plain diff is the honest view)."""
    try:
        before, after = json.loads(old.decode("utf-8-sig")), json.loads(new.decode("utf-8-sig"))
        cells_before, cells_after = before["cells"], after["cells"]
    except (ValueError, KeyError, TypeError):
        return None
    if len(cells_before) != len(cells_after):
        return None
    return [(n, _cell_text(a), _cell_text(b)) for n, (a, b) in enumerate(zip(cells_before, cells_after), 1)
            if _cell_text(a) != _cell_text(b)]


def file_position(path: str, cell: int, line: int, col: int) -> Optional[Tuple[int, int]]:
    """Where a cell position lies in the notebook file itself: (1-based line, 0-based column)
    of the JSON text, for formats whose consumers show the raw file (SARIF, GitHub
    annotations). None if the file cannot be read as a notebook."""
    try:
        stat = os.stat(path)
        offsets = _source_offsets(path, stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if offsets is None or cell not in offsets:
        return None
    text, strings = offsets[cell]
    # the character offset of (line, col) in the cell's text
    lines = _lines("".join(s for _, s in strings))
    if not 0 < line <= len(lines) + 1:
        return None
    target = sum(len(x) for x in lines[:line - 1]) + col
    for start, value in strings:
        if target < len(value) or (start, value) == strings[-1]:
            prefix = value[:max(target, 0)]
            raw = start + 1 + len(json.dumps(prefix, ensure_ascii=text.isascii())) - 2
            row = text.count("\n", 0, raw) + 1
            return row, raw - (text.rfind("\n", 0, raw) + 1)
        target -= len(value)
    return None


@lru_cache(maxsize=64)
def _source_offsets(path: str, mtime: int, size: int) -> Optional[Dict[int, Tuple[str, List[Tuple[int, str]]]]]:
    """For each cell number: the file's text and (offset of the opening quote, value) of each
    string of the cell's source, found by walking the JSON (Python's json gives no positions)."""
    with open(path, "rb") as handle:
        text = handle.read().decode("utf-8-sig")
    decoder = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")

    def skip(i: int) -> int:
        return ws.match(text, i).end()

    def members(i: int) -> Iterator[Tuple[str, int]]:  # (key, offset of its value) in the object at i
        i = skip(i + 1)
        while text[i] != "}":
            key, i = json.decoder.scanstring(text, i + 1)
            i = skip(skip(i) + 1)
            yield key, i
            i = skip(decoder.raw_decode(text, i)[1])
            if text[i] == ",":
                i = skip(i + 1)

    def elements(i: int) -> Iterator[int]:  # offset of each element of the array at i
        i = skip(i + 1)
        while text[i] != "]":
            yield i
            i = skip(decoder.raw_decode(text, i)[1])
            if text[i] == ",":
                i = skip(i + 1)

    out: Dict[int, Tuple[str, List[Tuple[int, str]]]] = {}
    for key, value in members(skip(0)):
        if key != "cells":
            continue
        for number, start in enumerate(elements(value), 1):
            for cell_key, src in members(start):
                if cell_key == "source":
                    starts = [src] if text[src] == '"' else list(elements(src))
                    out[number] = (text, [(s, decoder.raw_decode(text, s)[0]) for s in starts])
    return out
