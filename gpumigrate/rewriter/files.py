"""Finding, reading and writing source files. Writes are atomic and keep the file's mode."""

from __future__ import annotations

import fnmatch
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence, Tuple

SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "venv", "env", "build", "dist"}


def _excluded(path: Path, patterns: Sequence[str]) -> bool:
    text = path.as_posix()
    return any(
        fnmatch.fnmatch(text, pat) or fnmatch.fnmatch(path.name, pat) or fnmatch.fnmatch(text, f"*/{pat}")
        or fnmatch.fnmatch(text, f"{pat}/*") or fnmatch.fnmatch(text, f"*/{pat}/*")
        for pat in patterns
    )


def _is_virtualenv(path: Path) -> bool:
    return (path / "pyvenv.cfg").exists()


def discover(paths: Iterable[str], exclude: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """Files to process and one-line errors for paths that do not exist.

    Directories are searched for `*.py`, skipping hidden directories, virtualenvs and
    caches. Files named explicitly are taken whatever their suffix (like black)."""
    found: List[str] = []
    errors: List[str] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            errors.append(f"{raw}: no such file or directory")
        elif path.is_dir():
            found.extend(str(p) for p in _walk(path, exclude))
        elif not _excluded(path, exclude):
            found.append(str(path))
    seen = set()
    unique = [p for p in found if not (p in seen or seen.add(p))]
    return unique, errors


def _walk(root: Path, exclude: Sequence[str]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d not in SKIP_DIRS and not _is_virtualenv(here / d)
            and not _excluded(here / d, exclude)
        )
        for name in sorted(filenames):
            candidate = here / name
            if name.endswith(".py") and not _excluded(candidate, exclude):
                yield candidate


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def write_atomic(path: str, data: bytes) -> None:
    """Write via a temp file in the same directory and `os.replace`, keeping the mode bits.

    A reader never sees a half-written file, and a failure leaves the original intact."""
    target = Path(path)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    fd, tmp = tempfile.mkstemp(dir=str(target.parent) or ".", prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
