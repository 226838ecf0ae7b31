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
