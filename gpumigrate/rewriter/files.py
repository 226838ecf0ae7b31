"""Finding, reading and writing source files. Writes are atomic and keep the file's mode."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import pathspec

# Never user code: caches and installed packages. Virtual environments are found by their
# marker files, not by a name such as `env` or `build` that a project may use for its own code.
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
SUFFIXES = (".py", ".ipynb")


class BadPattern(ValueError):
    """An exclusion pattern that cannot be read; the message names it."""


class Exclusions:
    """gitignore-style patterns, each set relative to its own base directory (the config
    file's folder for `exclude` in pyproject.toml, the working directory for `--exclude`)."""

    def __init__(self) -> None:
        self._specs: List[Tuple[Path, pathspec.PathSpec, bool]] = []

    def add(self, base: Path, patterns: Sequence[str], scoped: bool = False) -> "Exclusions":
        """`scoped`: the patterns apply only below `base`, as a `.gitignore` file's do, and a
        pattern that cannot be read is skipped, as git matches nothing with it. Else such a
        pattern (`[z-a]`) is the user's mistake: BadPattern."""
        if patterns:
            self._specs.append((base.resolve(), _spec(patterns, lenient=scoped), scoped))
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


def _spec(patterns: Sequence[str], lenient: bool) -> pathspec.PathSpec:
    try:
        return pathspec.GitIgnoreSpec.from_lines(patterns)
    except re.error:
        pass
    readable = []
    for pattern in patterns:
        try:
            pathspec.GitIgnoreSpec.from_lines([pattern])
        except re.error as exc:
            if not lenient:
                raise BadPattern(f"{pattern!r}: not a valid pattern ({exc.msg})") from None
            continue
        readable.append(pattern)
    return pathspec.GitIgnoreSpec.from_lines(readable)


def _is_virtualenv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() or (path / "conda-meta").is_dir()


def discover(paths: Iterable[str], exclude: Optional[Exclusions] = None) -> Tuple[List[str], List[str]]:
    """Files to process and one-line errors for paths that do not exist.

    Directories are searched for Python files and notebooks, skipping hidden directories,
    virtual environments, caches, and what git ignores (inside a git work tree git itself is
    asked, so nested `.gitignore` files, `.git/info/exclude` and `core.excludesFile` count as
    in `git status`). Files named explicitly are taken whatever their suffix (like black),
    unless excluded by --exclude/`exclude`, never by git's ignores (as ruff and black): a
    pre-commit hook passes every staged file by name."""
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
            found.append(str(path) if str(path) != "-" else os.path.join(os.curdir, "-"))  # `-` alone is stdin
    seen = set()
    unique = [p for p in found if not (p in seen or seen.add(p))]
    return unique, errors


def _walk(root: Path, exclude: Exclusions) -> Iterator[Path]:
    """The scripts below `root`: what git lists there (tracked, and untracked but not ignored)
    inside a work tree, else a walk of the folder; hidden folders, caches, virtual
    environments and `exclude` left out either way."""
    listed = _git_files(root)
    if listed is None:
        yield from _walk_folder(root, exclude)
        return
    kept: dict = {}  # folder below root -> whether its files are searched

    def searched(folder: Path) -> bool:
        if folder == root or folder == folder.parent:
            return True
        if folder not in kept:
            name = folder.name
            kept[folder] = searched(folder.parent) and not _skipped_dir(folder, exclude)
        return kept[folder]

    for rel in sorted(listed, key=_walk_order):
        candidate = root.joinpath(*rel)
        if not searched(candidate.parent):
            continue
        if _script(candidate, exclude) and os.path.lexists(candidate):  # a tracked file deleted on disk is not one
            yield candidate
        elif not rel[-1].startswith(".") and rel[-1] not in SKIP_DIRS and os.path.isdir(candidate) \
                and not os.path.islink(candidate) and searched(candidate):
            # a submodule, or a repository of its own that git does not list into: its own git decides
            yield from _walk(candidate, exclude)


def _walk_order(rel: Tuple[str, ...]) -> Tuple[Tuple[int, str], ...]:
    """os.walk's order, as `_walk_folder` yields: a folder's files, sorted, then its folders."""
    return tuple((1, part) for part in rel[:-1]) + ((0, rel[-1]),)


# Variables that would point git at another repository than the folder's own (a git hook,
# such as pre-commit's, runs with them set).
_GIT_LOCATORS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_PREFIX", "GIT_COMMON_DIR")


def _git_files(root: Path) -> Optional[List[Tuple[str, ...]]]:
    """The files below `root` that git sees (tracked, and untracked ones no ignore rule of
    git's covers: nested .gitignore files, .git/info/exclude, core.excludesFile), as path
    parts relative to `root`; None where git is missing or `root` is in no work tree."""
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATORS}
    try:
        done = subprocess.run(["git", "-c", "core.quotePath=false", "ls-files", "--cached", "--others",
                               "--exclude-standard", "-z", "--", "."],
                              cwd=str(root), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None  # not a work tree (or a repository git refuses: `safe.directory`): the walk decides
    names = {os.fsdecode(n).rstrip("/") for n in done.stdout.split(b"\0")} - {"", "."}
    return [tuple(n.split("/")) for n in names]


def _walk_folder(root: Path, exclude: Exclusions) -> Iterator[Path]:
    """Without git: os.walk, reading `.gitignore` files by hand inside a work tree."""
    ignored = _GitIgnores(root)
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        ignored.enter(here)
        dirnames[:] = sorted(d for d in dirnames
                             if not _skipped_dir(here / d, exclude) and not ignored.matches(here / d, is_dir=True))
        for name in sorted(filenames):
            candidate = here / name
            if _script(candidate, exclude) and not ignored.matches(candidate):
                yield candidate


def _skipped_dir(folder: Path, exclude: Exclusions) -> bool:
    """A folder never searched: hidden, a cache, a virtual environment, or excluded."""
    name = folder.name
    return name.startswith(".") or name in SKIP_DIRS or _is_virtualenv(folder) or exclude.matches(folder, is_dir=True)


def _script(path: Path, exclude: Exclusions) -> bool:
    """A file a directory search takes: named like a script or notebook, not excluded, and
    not a FIFO, device or socket."""
    return path.name.endswith(SUFFIXES) and not exclude.matches(path) and not _special(path)


def _special(path: Path) -> bool:
    """A FIFO, device or socket named like a script (reading one blocks or never ends). A
    dangling link is not special: reading it reports it."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


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


DEFAULT_MAX_FILE_SIZE = 10_000_000  # bytes; `max-file-size` in [tool.gpumigrate]


class Refused(Exception):
    """A file we will not read or write; the message is one line, to follow the file's name."""


@dataclass(frozen=True)
class Stamp:
    """What `read` read: a write in place first checks that the file still holds it."""

    size: int
    mtime_ns: int
    sha256: bytes


def read(path: str, max_size: Optional[int] = None) -> Tuple[bytes, Stamp]:
    """The bytes of a regular file (a link is followed) and their stamp. Refused: anything
    else (a FIFO would block, /dev/zero never ends) and files over `max_size` bytes."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"skipped: not a regular file ({kind_of(info.st_mode)})")
    if max_size is not None and info.st_size > max_size:
        raise Refused(f"skipped: {_sizes(info.st_size, max_size)} limit (max-file-size)")
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())  # before the read: a write during it shows as a change
        data = handle.read()
    return data, Stamp(info.st_size, info.st_mtime_ns, hashlib.sha256(data).digest())


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is: `a FIFO`, `a directory`, ..."""
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")]
    return next((name for test, name in kinds if test(mode)), "a special file")


def _sizes(size: int, limit: int) -> str:
    """`12.3 MB is over the 10 MB`: both in the limit's unit."""
    for unit, scale in (("MB", 1_000_000), ("KB", 1_000)):
        if limit >= scale:
            return f"{size / scale:.1f} {unit} is over the {limit / scale:g} {unit}"
    return f"{size} bytes is over the {limit} bytes"


def write_atomic(path: str, data: bytes, new_mode: Optional[int] = None, expected: Optional[Stamp] = None) -> None:
    """Write `data` to `path` (a symbolic link: to its target, and the link stays a link),
    keeping the mode bits (`new_mode` for a file that does not exist yet).

    Via a temp file in the same directory, fsynced, and `os.replace`: a reader never sees a
    half-written file, and a failure leaves the original intact. A file with other hard links
    is written in place from the temp file instead (`_overwrite`), whole or not at all.
    `expected`: what was read
    from `path`; a file that no longer holds it is left as it is (Refused). Refused too:
    anything but a regular file, and a link to nothing."""
    target = Path(os.path.realpath(path))
    try:
        info: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        info = None
        if os.path.islink(path):
            raise Refused("cannot write: a symbolic link to a missing file") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise Refused(f"cannot write: not a regular file ({kind_of(info.st_mode)})")
    mode = stat.S_IMODE(info.st_mode) if info is not None else new_mode
    fd, tmp = tempfile.mkstemp(dir=str(target.parent), prefix=f".{target.name}.", suffix=".tmp")
    keep = False
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        if expected is not None and not _holds(target, expected):
            raise Refused("changed while gpumigrate was running; left as it is")
        if info is not None and info.st_nlink > 1:
            keep = True
            _overwrite(target, tmp)
        else:
            os.replace(tmp, target)
            _fsync_dir(target.parent)
    except BaseException:
        if not keep and os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _remove_stale_temps(target)


def _holds(path: Path, expected: Stamp) -> bool:
    try:
        info = os.stat(path)
        if (info.st_size, info.st_mtime_ns) != (expected.size, expected.mtime_ns):
            return False
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).digest() == expected.sha256
    except FileNotFoundError:
        return False


def _overwrite(target: Path, tmp: str) -> None:
    """Write the rewrite in `tmp` into `target` itself, the same inode: a rename would give
    `target` a new inode and leave its other hard links with the old text.

    That write cannot be atomic, so it is made whole another way. It runs in a process of its
    own session, which finishes it even if gpumigrate is killed meanwhile (SIGKILL, Ctrl-C);
    it reserves the space first (a full disk fails before a byte changes); and on any failure
    it writes the original bytes back. A failure leaves the file as it was, and the message
    says where the rewrite is."""
    helper = subprocess.run([sys.executable, "-I", "-S", "-c", _WRITE_IN_PLACE, str(target), tmp],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    if helper.returncode != 0:
        reason = helper.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {helper.returncode}"]
        raise Refused(f"cannot write: {reason[0]}; left as it was, the rewrite is in {tmp}")


# The in-place write (`python -I -S -c` this, TARGET, TMP): standard library only, no site,
# so that it starts in milliseconds. On success it removes TMP; on failure it prints one
# line (the reason, and whether the original could be put back) and exits 1.
_WRITE_IN_PLACE = r"""
import errno, os, sys

def write_all(fd, data):
    view, at = memoryview(data), 0
    while at < len(view):
        at += os.pwrite(fd, view[at:], at)
    os.ftruncate(fd, len(data))
    os.fsync(fd)

def read_all(fd):
    chunks = []
    while True:
        chunk = os.pread(fd, 1 << 20, sum(map(len, chunks)))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)

target, tmp = sys.argv[1], sys.argv[2]
try:
    with open(tmp, "rb") as handle:
        new = handle.read()
    fd = os.open(target, os.O_RDWR)
except OSError as exc:
    sys.exit(exc.strerror or str(exc))
try:
    old = read_all(fd)
    if len(new) > len(old) and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, len(new))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", 0), errno.ENOSYS):
                os.ftruncate(fd, len(old))  # a failed reservation may have grown it
                raise
    try:
        write_all(fd, new)
    except BaseException as exc:
        try:
            write_all(fd, old)
        except OSError as again:
            sys.exit(f"{exc.strerror or exc}; putting the original back failed too ({again.strerror or again})")
        raise
except OSError as exc:
    sys.exit(exc.strerror or str(exc))
finally:
    os.close(fd)
os.unlink(tmp)
"""


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable, as git and editors do (not every system can open a
    directory: then the rename is as durable as the system makes it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_STALE_AFTER = 60.0  # seconds: older than any write of ours takes, so never a running one's


def _remove_stale_temps(target: Path) -> None:
    """Temp files of `target` that a killed run left (exactly mkstemp's names for it), if
    they are regular files of ours and a minute old."""
    pattern = re.compile(re.escape(f".{target.name}.") + r"[a-z0-9_]{8}\.tmp")
    try:
        names = [n for n in os.listdir(target.parent) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        candidate = target.parent / name
        try:
            info = os.lstat(candidate)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() \
                    and time.time() - info.st_mtime > _STALE_AFTER:
                os.unlink(candidate)
        except OSError:
            pass
