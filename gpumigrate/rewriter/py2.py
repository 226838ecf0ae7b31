"""`--py2`: a Python 2 script converted to Python 3 before the migration, by `fissix`.

2to3's lib2to3 left the standard library in Python 3.13; fissix is its maintained fork (the
same fixers, its own grammar, so it runs on every Python we support). The alternatives do not
fit: pyupgrade and ruff read Python 3 only (a `print x` does not parse), python-modernize and
futurize write 2-and-3 code through `six`/`future` imports, and futurize still needs lib2to3.

Only a file CPython refuses is converted (a Python 3 file run through 2to3 would get
`list(d.keys())` and the like for nothing), and the conversion is kept only if its output
compiles. It runs 2to3's default fixers, as `2to3 -w` would, less `import`: that one rewrites
`import models` into `from . import models` when a models.py sits next to the file, which is
right in a package and breaks a script (`python train.py` has no parent package), and it
reads the file system. `/` is left as it is (2to3 has no fixer for it: which operands are
integers is not known), so the lines that divide are named for a look.
"""

from __future__ import annotations

import io
import tokenize
from functools import lru_cache
from typing import Any, List, Optional, Set, Tuple

from gpumigrate.rewriter.engine import UserError, _compile_error, _is_python2, _line

FLAG = "--py2"
INSTALL = "pip install 'gpumigrate[py2]'"  # fissix is an optional dependency
# 2to3's default fixers that --py2 does not run (see the module's docstring).
SKIPPED = frozenset({"import"})


def available() -> bool:
    try:
        import fissix  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """A one-line UserError where fissix is not installed."""
    if not available():
        raise UserError(f"{FLAG} needs the fissix package: {INSTALL}")


def converted(source: bytes, path: str) -> Optional[Tuple[bytes, str]]:
    """A Python 2 `source` as Python 3, and a one-line account of the conversion (the fixers
    that changed something, the lines that divide); None for a file CPython compiles, or one
    the conversion does not make compile and that shows no sign of Python 2 (`.cuda(async=True)`:
    the engine's repairs and messages take it from there). UserError where a Python 2 file
    cannot be converted."""
    err = _compile_error(source, path)
    if err is None:
        return None
    require()
    from fissix.pgen2.parse import ParseError
    from fissix.pgen2.tokenize import TokenError

    try:
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
        text = source.decode(encoding)
    except (SyntaxError, UnicodeDecodeError):
        return None  # the engine's reading of the file says what is wrong
    bom = text.startswith("\ufeff")
    body = text[1:] if bom else text
    tool, used = _tool()
    used.clear()
    try:
        tree = tool.refactor_string(body if body.endswith("\n") else body + "\n", path)
    except (ParseError, TokenError, IndentationError, SyntaxError) as exc:
        raise UserError(f"{path}: {FLAG}: fissix cannot read it either ({_first_line(exc)}); file left unchanged") \
            from None
    new = str(tree)
    if not body.endswith("\n"):
        new = new[:-1] if new.endswith("\n") else new
    try:
        out = (("\ufeff" if bom else "") + new).encode(encoding)
    except UnicodeEncodeError:
        return None
    still = _compile_error(out, path)
    if still is not None:
        if not _is_python2(err.msg, _line(text, err.lineno)):
            return None
        raise UserError(f"{path}:{still.lineno or 1}: {FLAG}: the converted file does not compile either "
                        f"({still.msg}); file left unchanged")
    fixers = sorted(used)
    note = f"converted from Python 2 ({FLAG}): {len(fixers)} fixer{'' if len(fixers) == 1 else 's'}: " \
           f"{', '.join(fixers) or 'none'}"
    divides = _divisions(source, "division" in getattr(tree, "future_features", ()))
    if divides:
        shown = ", ".join(map(str, divides[:10])) + (", ..." if len(divides) > 10 else "")
        note += f"; `/` left as it is: on two integers it now gives a float (check original " \
                f"line{'s' if len(divides) > 1 else ''} {shown})"
    return out, note


@lru_cache(maxsize=1)
def _tool() -> Tuple[Any, Set[str]]:
    """The refactoring tool (compiling the fixers' patterns costs ~0.3 s: once per process)
    and the set its fixers record their names in."""
    from fissix import refactor

    names = [n for n in refactor.get_fixers_from_package("fissix.fixes") if n.rsplit(".fix_", 1)[1] not in SKIPPED]
    tool = refactor.RefactoringTool(names)
    used: Set[str] = set()
    for fixer in tool.pre_order + tool.post_order:
        _record(fixer, used)
    return tool, used


def _record(fixer: Any, used: Set[str]) -> None:
    """Count `fixer` as used when a transform of it changes the tree (it returns a new
    node, or edits the matched one in place)."""
    transform = fixer.transform
    name = type(fixer).__module__.rsplit(".fix_", 1)[-1]

    def recorded(node: Any, results: Any) -> Any:
        before = str(node)
        new = transform(node, results)
        if new is not None and str(new) != before or new is None and str(node) != before:
            used.add(name)
        return new

    fixer.transform = recorded


def _divisions(source: bytes, future_division: bool) -> List[int]:
    """Lines of the original with a division (`/`, `/=`; Python 3's tokenizer reads Python 2's
    tokens too), up to what it cannot read; none where the file had `from __future__ import
    division` (it already divided as Python 3 does)."""
    if future_division:
        return []
    lines: List[int] = []
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type == tokenize.OP and tok.string in ("/", "/=") and tok.start[0] not in lines:
                lines.append(tok.start[0])
    except (tokenize.TokenError, SyntaxError):
        return lines
    return lines


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
