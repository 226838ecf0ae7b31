"""Run the engine over files: read, process, and write or show the result."""

from __future__ import annotations

import dataclasses
import gc
import os
import stat
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, TypeVar, Union

from gpumigrate.rewriter.engine import RECURSION_LIMIT_LOCK, FileResult, UserError, process
from gpumigrate.rewriter.files import DEFAULT_MAX_FILE_SIZE, Refused, Stamp, read, write_atomic
from gpumigrate.rewriter.names import ImportTable
from gpumigrate.rewriter.notebook import is_notebook, process_notebook
from gpumigrate.rewriter.prepare import prepare


def process_path(path: str, passes: Sequence["Pass"], options: Optional[dict] = None,
                 repairs: Optional[Sequence[type]] = None,
                 max_size: Optional[int] = DEFAULT_MAX_FILE_SIZE) -> FileResult:
    """`path` through the engine's passes; only a regular file of at most `max_size` bytes is read."""
    read_in = read_input(path, max_size)
    if isinstance(read_in, FileResult):
        return read_in
    source, stamp = read_in
    result = process_passes(source, path, passes, options, repairs)
    result.read_as = stamp
    return result


def read_input(path: str, max_size: Optional[int] = DEFAULT_MAX_FILE_SIZE) -> Union[Tuple[bytes, Stamp], FileResult]:
    """The file's bytes and stamp, or the result that says why it cannot be read."""
    try:
        return read(path, max_size)
    except Refused as exc:
        return FileResult(path=path, source=b"", error=f"{path}: {exc}")
    except OSError as exc:
        return FileResult(path=path, source=b"", error=f"{path}: cannot read: {exc.strerror or exc}")


Pass = Tuple[Sequence[type], Sequence[str]]  # the rules one pass runs, and the codes it fixes
# Rounds of every pass before a rewrite must have stopped changing (ruff's fix loop has 100;
# ours converge in two, the second confirming the first).
MAX_ROUNDS = 4


def process_source(source: bytes, path: str, rules: Sequence[type], fix: Sequence[str],
                   options: Optional[dict] = None, repairs: Optional[Sequence[type]] = None) -> FileResult:
    """`source`, named `path` in messages (stdin has no file of its own), through one pass."""
    return process_passes(source, path, [(rules, fix)], options, repairs)


def process_passes(source: bytes, path: str, passes: Sequence[Pass], options: Optional[dict] = None,
                   repairs: Optional[Sequence[type]] = None) -> FileResult:
    """`source` through each pass in order, each reading the output of the one before, and
    again until a round changes nothing: what is returned is a fixpoint, so a second run of
    the same passes never changes it. Findings are given at the original's lines: those of
    the first round, and the fixes (and new review items) of later rounds."""
    engine = process_notebook if is_notebook(path) else process
    reuse: Dict[Any, Any] = {}  # a pass over the bytes the pass before left unchanged reuses their parse
    try:
        start, prepared = prepare(source, path, options)  # --py2, --reformat-notebooks
    except UserError as exc:
        return FileResult(path=path, source=source, error=str(exc))

    inherited = getattr((options or {}).get("project"), "star_names", ())
    names = (lambda module: ImportTable(module, inherited)) if inherited else ImportTable

    def one(text: bytes, rules: Sequence[type], fix: Sequence[str]) -> FileResult:
        return run_deep(engine, text, path, rules, fix=fix, names_factory=names, options=options,
                        repairs=repairs, reuse=reuse)

    if len(passes) == 1 and not passes[0][1] and start is source:  # lint: nothing changes, one run
        return one(source, *passes[0])
    current, findings, known = start, [], set()
    settled: Dict[int, bytes] = {}  # pass -> the text it last left unchanged: run again, it would again
    for round_ in range(MAX_ROUNDS):
        changed = False
        for number, (rules, fix) in enumerate(passes):
            if settled.get(number) is current:
                continue
            result = one(current, rules, fix)
            if result.error is not None:
                return FileResult(path=path, source=source, error=result.error)
            back = _back_to(path, current, source)
            for finding in result.findings:
                moved = back(finding)
                key = (finding.code, finding.message, moved)
                if round_ == 0 or (key not in known and (finding.fixed or result.changed)):
                    findings.append(finding if moved == (finding.cell, finding.line) else dataclasses.replace(
                        finding, cell=moved[0], line=moved[1], end_line=moved[1] + finding.end_line - finding.line))
                known.add(key)
            if result.changed:
                current, changed = result.new_source, True
            else:
                settled[number] = current
        if not changed:
            out = FileResult(path=path, source=source, findings=findings)
            if current != start and current != source:  # a conversion stays only under the migration's edits
                out.new_source, out.prepared = current, prepared
            return out
    return FileResult(path=path, source=source, error=f"{path}:1: fixes dropped: the rewrite kept changing after "
                                                        f"{MAX_ROUNDS} rounds (please report it); file left unchanged")


def _back_to(path: str, current: bytes, original: bytes) -> Callable[[Any], Tuple[int, int]]:
    """Finding in `current` -> (cell, line) of the original it stands for."""
    if current is original:
        return lambda f: (f.cell, f.line)
    from gpumigrate.rewriter.report import position_map  # difflib and the notebook layer, only when rewritten

    return position_map(path, current, original)


def tune_gc() -> None:
    """Collect cycles less often, as mypy does: parsing allocates millions of small objects
    that live until the file is done, and at Python's default threshold the collector
    rescans them again and again (two thirds of a stdlib parse, two fifths of LibCST's)."""
    gc.set_threshold(200_000, 30, 30)


# LibCST's trees are as deep as the code is nested and its visitors recurse, some ten frames
# a level: a chain of 340 `+` terms, 70 nested `if`s or the long implicit string
# concatenations of pydoc's topics.py overrun Python's default limit of 1,000 frames. A
# file's work runs in a thread whose stack holds a limit that covers all the nesting
# CPython compiles (~3,000 levels; the engine refuses deeper files before LibCST sees them).
# The stack is address space: only the pages a deep file touches are ever used.
DEEP_STACK = 512 * 1024 * 1024
DEEP_RECURSION_LIMIT = 60_000
_deep_lock = threading.Lock()  # the recursion limit is the process's: one deep run at a time

T = TypeVar("T")


def run_deep(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a thread with a big stack and a high recursion limit (or
    here, as it is, where no such thread can be made); its exception is raised here."""
    out: Dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            out["error"] = exc

    with _deep_lock:
        limit = sys.getrecursionlimit()
        try:
            size = threading.stack_size(DEEP_STACK)
        except (ValueError, RuntimeError):
            return fn(*args, **kwargs)
        thread = threading.Thread(target=target, name="gpumigrate-file", daemon=True)
        with RECURSION_LIMIT_LOCK:
            sys.setrecursionlimit(max(limit, DEEP_RECURSION_LIMIT))
        try:
            thread.start()
        except RuntimeError:  # no memory for the stack
            with RECURSION_LIMIT_LOCK:
                sys.setrecursionlimit(limit)
            return fn(*args, **kwargs)
        finally:
            threading.stack_size(size)
        try:
            thread.join()
        finally:
            with RECURSION_LIMIT_LOCK:
                sys.setrecursionlimit(limit)
    if "error" in out:
        raise out["error"]
    return out["value"]


def process_paths(paths: Sequence[str], rules: Sequence[type], fix: Sequence[str],
                  options: Optional[dict] = None, jobs: Optional[int] = None) -> Iterator[FileResult]:
    """Each file independently, in worker processes `jobs` at a time (default: one per CPU):
    one bad file never stops the others, even one that crashes its worker. Input order."""
    from gpumigrate.rewriter.workers import Task, one_pass, process_tasks  # workers imports this module

    yield from process_tasks([Task(path, one_pass(rules, fix), options) for path in paths], jobs)


def write_result(result: FileResult, output: str = "") -> None:
    """Write the rewritten source in place (or to `output`). Sets `result.error` on failure.

    In place, a file that changed since it was read is left as it is. An existing `output`
    is written as a file in place is: through a symbolic link, never a FIFO or device, never
    a read-only file. A new one gets the source's mode bits less the umask, as `cp` gives them."""
    target = output or result.path
    data = result.new_source if result.new_source is not None else result.source
    in_place = not output or _same_file(output, result.path)
    try:
        if os.path.exists(target) and _read_only(target):
            raise PermissionError("file is read-only")
        write_atomic(target, data, new_mode=_mode_for_copy(result.path), expected=result.read_as if in_place else None)
    except Refused as exc:
        result.error = f"{target}: {exc}"
    except OSError as exc:
        result.error = f"{target}: cannot write: {exc.strerror or exc}"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


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
