"""Opt-in conversions of an input before the rules see it: what makes a file the engine
would refuse one it can migrate. Each is asked for by an option, never applied on its own:

- `py2` (--py2): a Python 2 script converted to Python 3 by fissix (py2.py);
- `reformat_notebooks` (--reformat-notebooks): a notebook whose JSON cannot be written back
  byte for byte written the way nbformat writes it (notebook.py).

A conversion is kept only where the migration then edits the file (a file with nothing to
migrate stays byte for byte), and is reported in `FileResult.prepared`.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

PY2 = "py2"
REFORMAT_NOTEBOOKS = "reformat_notebooks"


def prepare(source: bytes, path: str, options: Optional[dict]) -> Tuple[bytes, List[str]]:
    """`source` as the rules should read it, and what was done to it (one line each).
    Raises UserError where an asked-for conversion cannot be made."""
    if not options or not (options.get(PY2) or options.get(REFORMAT_NOTEBOOKS)):
        return source, []
    from gpumigrate.rewriter.notebook import is_notebook, reformatted

    if is_notebook(path):
        made = reformatted(source, path) if options.get(REFORMAT_NOTEBOOKS) else None
    else:
        from gpumigrate.rewriter.py2 import converted

        made = converted(source, path) if options.get(PY2) else None
    return (source, []) if made is None else (made[0], [made[1]])
