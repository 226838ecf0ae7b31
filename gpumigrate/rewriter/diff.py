"""Unified diffs of a rewrite, coloured on a terminal."""

from __future__ import annotations

import difflib
import io
import tokenize

import click


def _text(source: bytes) -> str:
    try:
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
        return source.decode(encoding)
    except (SyntaxError, UnicodeDecodeError):
        return source.decode("utf-8", "replace")


def unified_diff(path: str, old: bytes, new: bytes) -> str:
    lines = difflib.unified_diff(
        _text(old).splitlines(keepends=True),
        _text(new).splitlines(keepends=True),
        fromfile=f"{path}\t(original)",
        tofile=f"{path}\t(migrated)",
    )
    out = []
    for line in lines:
        out.append(line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def file_diff(path: str, old: bytes, new: bytes) -> str:
    """The diff of a rewrite: one unified diff for a file; for a notebook, one per changed
    cell, headed `path:cell N` (cells counted as in findings), since a diff of the JSON
    would show escaped strings."""
    from gpumigrate.rewriter.notebook import changed_cells, is_notebook, reformat_diff  # loads libcst: not for --help

    cells = changed_cells(old, new) if is_notebook(path) else None
    if cells is None:
        return unified_diff(path, old, new)
    out = [reformat_diff(path, old)]  # --reformat-notebooks: the JSON's own changes come first
    for number, before, after in cells:
        # A cell's last line has no newline in Jupyter; that is not a change worth a marker.
        before, after = (t if t.endswith("\n") or not t else t + "\n" for t in (before, after))
        out.extend(difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True),
            fromfile=f"{path}:cell {number}\t(original)", tofile=f"{path}:cell {number}\t(migrated)",
        ))
    return "".join(out)


def colourize(diff: str) -> str:
    out = []
    for line in diff.splitlines(keepends=True):
        if line.startswith(("+++", "---")):
            out.append(click.style(line, bold=True))
        elif line.startswith("@@"):
            out.append(click.style(line, fg="cyan"))
        elif line.startswith("+"):
            out.append(click.style(line, fg="green"))
        elif line.startswith("-"):
            out.append(click.style(line, fg="red"))
        else:
            out.append(line)
    return "".join(out)
