"""Results of earlier runs, so that a re-run over unchanged files (pre-commit, CI) costs a
read and a hash per file. An entry is keyed by everything a result depends on: the file's
bytes and kind (`.py` or `.ipynb`), the rules run and the codes fixed, the options, and
gpumigrate's own code (its source files, not just its version: an edited checkout never
reuses results of other code). Errors are never cached (they name paths, and a broken file is
rare). The directory is safe to delete at any time; a damaged entry is ignored.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

from gpumigrate import __version__
from gpumigrate.rewriter.engine import Finding, FileResult

CACHE_DIR_NAME = ".gpumigrate_cache"
_FORMAT = 1  # bump when the entry layout changes


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of gpumigrate's own source files (~50 files, a millisecond or two)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(f"{__version__}:{_FORMAT}".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_key(rules: Sequence[type], fix: Sequence[str], options: Optional[dict],
            repairs: Optional[Sequence[type]]) -> str:
    """What a file's result depends on apart from its bytes and kind."""
    parts = {"code": code_fingerprint(), "rules": [r.code for r in rules], "fix": sorted(fix),
             "options": sorted((k, repr(v)) for k, v in (options or {}).items()),
             "repairs": None if repairs is None else [r.code for r in repairs]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class Cache:
    """Entries under `directory`, one small JSON file each."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.broken = False  # a directory we cannot write: carry on without caching

    def key(self, run: str, path: str, content_sha256: bytes) -> str:
        kind = Path(path).suffix.lower()
        return hashlib.sha256(f"{run}:{kind}:".encode() + content_sha256).hexdigest()

    def _entry(self, key: str) -> Path:
        return self.directory / key[:2] / key[2:]

    def get(self, key: str, path: str, source: bytes) -> Optional[FileResult]:
        try:
            data = json.loads(self._entry(key).read_text(encoding="utf-8"))
            findings = [Finding(**f) for f in data["findings"]]
            new = data["new_source"]
            new_source = base64.b64decode(new) if new is not None else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, or damaged: recompute
        return FileResult(path=path, source=source, findings=findings, new_source=new_source)

    def put(self, key: str, result: FileResult) -> None:
        if self.broken or result.error is not None:
            return
        entry = {"findings": [dataclasses.asdict(f) for f in result.findings],
                 "new_source": None if result.new_source is None else base64.b64encode(result.new_source).decode()}
        target = self._entry(key)
        try:
            self._prepare(target.parent)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(entry, handle)
            os.replace(tmp, target)
        except OSError:
            self.broken = True

    def _prepare(self, folder: Path) -> None:
        if folder.is_dir():
            return
        first = not self.directory.exists()
        folder.mkdir(parents=True, exist_ok=True)
        if first:  # as ruff and pytest do: git ignores it, backup tools may skip it
            (self.directory / ".gitignore").write_text("# created by gpumigrate\n*\n")
            (self.directory / "CACHEDIR.TAG").write_text(
                "Signature: 8a477f597d28d172789f06886806bc55\n# gpumigrate's cache: safe to delete\n")


def cache_dir(config_path: Optional[str]) -> str:
    """`GPUMIGRATE_CACHE_DIR`, else `.gpumigrate_cache` next to the pyproject.toml that
    configures the run, else in the current directory."""
    chosen = os.environ.get("GPUMIGRATE_CACHE_DIR")
    if chosen:
        return chosen
    base = os.path.dirname(os.path.abspath(config_path)) if config_path else os.getcwd()
    return os.path.join(base, CACHE_DIR_NAME)
