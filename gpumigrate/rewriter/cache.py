"""Results of earlier runs, so that a re-run over unchanged files (pre-commit, CI) costs a
read and a hash per file.

An entry is keyed by everything a result depends on: the file's bytes and kind (`.py` or
`.ipynb`), the rules run and the codes fixed, the options, gpumigrate's own code (its source
files, not just its version: an edited checkout never reuses results of other code), LibCST's
version and the Python that runs it (a file 3.12 compiles, 3.11 may refuse).

A cached result is data we wrote, never data we trust: a results cache that a repository
could bring along would let its files write code into the user's scripts or hide findings.
So the cache lives in the user's cache folder, never in a project (as mypy's and ruff's are
ignored by git); each entry carries a keyed hash (HMAC-SHA256) of its key and content, with a
secret made when the cache was created and readable by this user alone; and an entry that
verifies still passes the checks a fresh result passes: a rewrite compiles and its codes are
the rules'. That a rewrite is idempotent is checked against the entry of the rewrite itself
(`Cache.confirms`). Anything else, or anything odd (not a regular file, too large), is a miss.
Errors are never cached (they name paths, and a broken file is rare). The folder is safe to
delete at any time.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Collection, Optional, Sequence, Tuple

from gpumigrate import __version__
from gpumigrate.rewriter.engine import FileResult, Finding, compiles

_FORMAT = 2  # bump when the entry layout changes
_SECRET = "secret"
_SECRET_BYTES = 32
# No entry of ours is near this: the largest is a rewrite of a 10 MB file in base64.
MAX_ENTRY_BYTES = 64 * 1024 * 1024
_FINDING_FIELDS = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(Finding)}


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of gpumigrate's own source files (~50 files, a millisecond or two), of the
    LibCST that parses and prints, and of the Python that compiles."""
    import libcst

    root = Path(__file__).resolve().parent.parent
    libcst_version = getattr(libcst, "LIBCST_VERSION", None) or getattr(
        getattr(libcst, "_version", None), "__version__", "?")
    digest = hashlib.sha256(f"{__version__}:{_FORMAT}:{libcst_version}:{sys.version}:"
                            f"{sys.implementation.cache_tag}".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_key(passes: Sequence[Tuple[Sequence[type], Sequence[str]]], options: Optional[dict],
            repairs: Optional[Sequence[type]]) -> str:
    """What a file's result depends on apart from its bytes and kind."""
    parts = {"code": code_fingerprint(), "passes": [([r.code for r in rules], sorted(fix)) for rules, fix in passes],
             "options": sorted((k, repr(v)) for k, v in (options or {}).items()),
             "repairs": None if repairs is None else [r.code for r in repairs]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class Cache:
    """Entries under `directory`, one small file each: the HMAC of key and content, a
    newline, and the content as JSON."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.broken = False  # a folder we cannot use: carry on without caching
        self._secret: Optional[bytes] = None

    def key(self, run: str, path: str, content_sha256: bytes) -> str:
        kind = Path(path).suffix.lower()
        return hashlib.sha256(f"{run}:{kind}:".encode() + content_sha256).hexdigest()

    def _entry(self, key: str) -> Path:
        return self.directory / key[:2] / key[2:]

    def get(self, key: str, path: str, source: bytes, codes: Collection[str]) -> Optional[FileResult]:
        """The result stored under `key`, if it verifies and passes a fresh result's checks:
        only `codes` may be found, and a rewrite must compile. None: compute it."""
        secret = self._key_secret(create=False)
        raw = _read_regular(self._entry(key), MAX_ENTRY_BYTES) if secret is not None else None
        if raw is None:
            return None
        mac, _, payload = raw.partition(b"\n")
        if not hmac.compare_digest(mac, _mac(secret, key, payload)):
            return None
        try:
            data = json.loads(payload)
            findings = [_finding(f, codes) for f in data["findings"]]
            new = data["new_source"]
            new_source = base64.b64decode(new, validate=True) if new is not None else None
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError):
            return None  # ours, from another version of the layout: recompute
        if new_source is not None and not compiles(new_source, path):
            return None
        return FileResult(path=path, source=source, findings=findings, new_source=new_source)

    def confirms(self, run: str, result: FileResult, codes: Collection[str]) -> Optional[bool]:
        """Whether the cache shows `result`'s rewrite to be idempotent: the entry of the
        rewritten bytes says a run changes nothing there. None: no such entry yet."""
        assert result.new_source is not None
        again = self.get(self.key(run, result.path, hashlib.sha256(result.new_source).digest()),
                         result.path, result.new_source, codes)
        return None if again is None else not again.changed

    def put(self, key: str, result: FileResult) -> None:
        if self.broken or result.error is not None or result.prepared:  # opt-in conversions: rare, not kept
            return
        entry = {"findings": [dataclasses.asdict(f) for f in result.findings],
                 "new_source": None if result.new_source is None else base64.b64encode(result.new_source).decode()}
        target = self._entry(key)
        try:
            secret = self._key_secret(create=True)
            if secret is None:
                self.broken = True
                return
            payload = json.dumps(entry).encode()
            _prepare(self.directory, target.parent)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(_mac(secret, key, payload) + b"\n" + payload)
                os.replace(tmp, target)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            self.broken = True

    def _key_secret(self, create: bool) -> Optional[bytes]:
        """The cache's secret: a file of this user's alone (not a link, mode 0600). Made
        once, atomically (linked into place: two runs that race agree on the first)."""
        if self._secret is not None:
            return self._secret
        path = self.directory / _SECRET
        found = _read_regular(path, _SECRET_BYTES, private=True)
        if found is None and create and not os.path.lexists(path):
            _prepare(self.directory, self.directory)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp")  # mode 0600
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(secrets.token_bytes(_SECRET_BYTES))
                    handle.flush()
                    os.fsync(handle.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            finally:
                os.unlink(tmp)
            found = _read_regular(path, _SECRET_BYTES, private=True)
        if found is not None and len(found) == _SECRET_BYTES:
            self._secret = found
        return self._secret


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()


def _finding(fields: dict, codes: Collection[str]) -> Finding:
    """A finding as stored, if every field has its type and the code is one of `codes`."""
    if set(fields) != set(_FINDING_FIELDS) or fields["code"] not in codes:
        raise ValueError("not a finding of these rules")
    for name, kind in _FINDING_FIELDS.items():
        if type(fields[name]).__name__ != kind:
            raise TypeError(name)
    return Finding(**fields)


def _read_regular(path: Path, limit: int, private: bool = False) -> Optional[bytes]:
    """The bytes of `path` if it is a regular file (not a link, FIFO or device) of at most
    `limit` bytes, and, `private`, this user's with no access for anyone else; else None.
    O_NONBLOCK: opening a FIFO must not wait for a writer."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        if private and (info.st_uid != os.getuid() or info.st_mode & 0o077):
            return None
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _prepare(root: Path, folder: Path) -> None:
    """`folder` in the cache `root`, each made private (0700) if new; a new root gets the
    markers that tell git and backup tools to leave it alone, as ruff and pytest write them."""
    if folder.is_dir():
        return
    if not root.is_dir():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (root / ".gitignore").write_text("# created by gpumigrate\n*\n")
        (root / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n"
                                           "# gpumigrate's cache: safe to delete\n")
    folder.mkdir(mode=0o700, exist_ok=True)


def user_cache_root() -> Path:
    """Where this user's caches go: $XDG_CACHE_HOME, else the platform's folder."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"])
    return Path.home() / ".cache"


def cache_dir() -> str:
    """`GPUMIGRATE_CACHE_DIR`, else `gpumigrate` in the user's cache folder: never a folder
    inside a project, which a checkout could bring along."""
    return os.environ.get("GPUMIGRATE_CACHE_DIR") or str(user_cache_root() / "gpumigrate")
