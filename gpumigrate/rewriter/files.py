"""Finding, reading and writing source files. Writes are atomic and keep the file's mode."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import pathspec

# Never user code: caches and installed packages. Virtual environments are found by their
# marker files, not by a name such as `env` or `build` that a project may use for its own code.
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
SUFFIXES = (".py", ".ipynb")


class Exclusions:
    """gitignore-style patterns, each set relative to its own base directory (the config
    file's folder for `exclude` in pyproject.toml, the working directory for `--exclude`)."""

    def __init__(self) -> None:
        self._specs: List[Tuple[Path, pathspec.PathSpec, bool]] = []

    def add(self, base: Path, patterns: Sequence[str], scoped: bool = False) -> "Exclusions":
        """`scoped`: the patterns apply only below `base`, as a `.gitignore` file's do."""
        if patterns:
            self._specs.append((base.resolve(), pathspec.GitIgnoreSpec.from_lines(patterns), scoped))
        return self

    def __bool__(self) -> bool:
        return bool(self._specs)

    def matches(self, path: Path, is_dir: bool = False) -> bool:
        """Any set of patterns excludes `path`."""
        return any(self._check(spec, base, scoped, path, is_dir) for base, spec, scoped in self._specs)

    def decides(self, path: Path, is_dir: bool = False) -> bool:
        """As git reads `.gitignore` files: the deepest file with a pattern that matches
        decides, so a `!keep.py` below re-includes what a file above ignores."""
        for base, spec, scoped in sorted(self._specs, key=lambda s: len(s[0].parts), reverse=True):
            verdict = self._check(spec, base, scoped, path, is_dir)
            if verdict is not None:
                return verdict
        return False

    @staticmethod
    def _check(spec: pathspec.PathSpec, base: Path, scoped: bool, path: Path, is_dir: bool) -> Optional[bool]:
        absolute = Path(os.path.abspath(path))
        try:
            rel = absolute.relative_to(base).as_posix()
        except ValueError:
            if scoped:
                return None
            rel = absolute.as_posix().lstrip("/")  # only unanchored patterns (`legacy`) can match
        return spec.check_file(rel + ("/" if is_dir else "")).include


def _is_virtualenv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() or (path / "conda-meta").is_dir()


def discover(paths: Iterable[str], exclude: Optional[Exclusions] = None) -> Tuple[List[str], List[str]]:
    """Files to process and one-line errors for paths that do not exist.

    Directories are searched for Python files and notebooks, skipping hidden directories,
    virtual environments, caches, and what git ignores (`.gitignore` files inside a git work
    tree). Files named explicitly are taken whatever their suffix (like black), unless
    excluded: a pre-commit hook passes every staged file by name."""
    exclude = exclude or Exclusions()
    found: List[str] = []
    errors: List[str] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            errors.append(f"{raw}: no such file or directory")
        elif path.is_dir():
            found.extend(str(p) for p in _walk(path, exclude))
        elif not exclude.matches(path):
            found.append(str(path))
    seen = set()
    unique = [p for p in found if not (p in seen or seen.add(p))]
    return unique, errors


def _walk(root: Path, exclude: Exclusions) -> Iterator[Path]:
    ignored = _GitIgnores(root)
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        ignored.enter(here)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d not in SKIP_DIRS and not _is_virtualenv(here / d)
            and not exclude.matches(here / d, is_dir=True) and not ignored.matches(here / d, is_dir=True)
        )
        for name in sorted(filenames):
            candidate = here / name
            if name.endswith(SUFFIXES) and not exclude.matches(candidate) and not ignored.matches(candidate):
                yield candidate


class _GitIgnores:
    """The `.gitignore` files that apply below `root`, as git reads them: only inside a work
    tree, each relative to its own folder, plus `.git/info/exclude`."""

    def __init__(self, root: Path) -> None:
        self.top = _work_tree(root.resolve())
        self.rules = Exclusions()
        if self.top is None:
            return
        self.rules.add(self.top, _lines(self.top / ".git" / "info" / "exclude"), scoped=True)
        # the folders above root down to it: their .gitignore files apply too
        chain = [root.resolve(), *root.resolve().parents]
        for folder in reversed(chain[: chain.index(self.top) + 1][1:]):
            self.rules.add(folder, _lines(folder / ".gitignore"), scoped=True)

    def enter(self, folder: Path) -> None:
        if self.top is not None:
            self.rules.add(folder, _lines(folder / ".gitignore"), scoped=True)

    def matches(self, path: Path, is_dir: bool = False) -> bool:
        return bool(self.rules) and self.rules.decides(path, is_dir)


def _work_tree(folder: Path) -> Optional[Path]:
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists():
            return candidate
    return None


def _lines(path: Path) -> List[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def write_atomic(path: str, data: bytes, new_mode: Optional[int] = None) -> None:
    """Write via a temp file in the same directory and `os.replace`, keeping the mode bits
    (`new_mode` for a file that does not exist yet; else mkstemp's 0600).

    A reader never sees a half-written file, and a failure leaves the original intact."""
    target = Path(path)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else new_mode
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
