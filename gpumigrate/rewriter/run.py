"""Run the engine over files: read, process, and write or show the result."""

from __future__ import annotations

import stat
import os
from typing import Iterator, Optional, Sequence

from gpumigrate.rewriter.engine import FileResult, process
from gpumigrate.rewriter.files import read, write_atomic
from gpumigrate.rewriter.names import ImportTable
from gpumigrate.rewriter.notebook import is_notebook, process_notebook


def process_path(path: str, rules: Sequence[type], fix: Sequence[str], options: Optional[dict] = None,
                 repairs: Optional[Sequence[type]] = None) -> FileResult:
    try:
        source = read(path)
    except OSError as exc:
        return FileResult(path=path, source=b"", error=f"{path}: cannot read: {exc.strerror or exc}")
    return process_source(source, path, rules, fix, options, repairs)


def process_source(source: bytes, path: str, rules: Sequence[type], fix: Sequence[str],
                   options: Optional[dict] = None, repairs: Optional[Sequence[type]] = None) -> FileResult:
    """`source`, named `path` in messages (stdin has no file of its own)."""
    if is_notebook(path):
        return process_notebook(source, path, rules, fix=fix, names_factory=ImportTable, options=options,
                                repairs=repairs)
    return process(source, path, rules, fix=fix, names_factory=ImportTable, options=options, repairs=repairs)


def process_paths(paths: Sequence[str], rules: Sequence[type], fix: Sequence[str],
                  options: Optional[dict] = None) -> Iterator[FileResult]:
    """Each file independently: one bad file never stops the others."""
    for path in paths:
        yield process_path(path, rules, fix, options)


def write_result(result: FileResult, output: str = "") -> None:
    """Write the rewritten source in place (or to `output`). Sets `result.error` on failure.

    A new `output` file gets the source's mode bits less the umask, as `cp` gives them."""
    target = output or result.path
    data = result.new_source if result.new_source is not None else result.source
    try:
        if not output and _read_only(target):
            raise PermissionError("file is read-only")
        write_atomic(target, data, new_mode=_mode_for_copy(result.path))
    except OSError as exc:
        result.error = f"{target}: cannot write: {exc.strerror or exc}"


def _mode_for_copy(source: str) -> int:
    umask = os.umask(0)
    os.umask(umask)
    try:
        mode = stat.S_IMODE(os.stat(source).st_mode)
    except OSError:
        mode = 0o666
    return mode & ~umask


def _read_only(path: str) -> bool:
    # root may write anything; a file with no write bit is still a user's "do not touch".
    mode = os.stat(path).st_mode
    return not (mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) or not os.access(path, os.W_OK)
