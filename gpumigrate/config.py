"""`[tool.gpumigrate]` in pyproject.toml, found by walking up from the paths given.

    [tool.gpumigrate]
    target = "ddp"                 # default for `gpumigrate PATHS` without --to
    select = ["GM1", "GM3"]        # codes, prefixes or rule names, for lint AND migrations
    ignore = ["GM204"]             # (all rules when absent; a migration without a fix it needs
                                   # says it is partial)
    exclude = ["legacy/"]          # gitignore-style, relative to this file's folder
    extend-exclude = ["*_old.py"]  # added to `exclude` (a shared config sets one, a project the other)
    max-file-size = 20_000_000     # bytes (default 10 MB); a larger file is skipped, as an error
    file-timeout = 600             # seconds a file may take (default 300); a slower one is an error
    [tool.gpumigrate.per-file-ignores]
    "notebooks/*.py" = ["GM601"]
    [tool.gpumigrate.lint]         # lint only (as ruff's `lint.select`): migrations never read it
    select = ["GM3"]               # replaces the top-level select for `lint`
    ignore = ["GM304"]             # added to the top-level ignore for `lint`
    extend-select = ["GM101"]      # added to whichever select applies
    [tool.gpumigrate.lint.per-file-ignores]
    "tests/*.py" = ["GM3"]         # added to the top-level per-file-ignores for `lint`

`gpumigrate lint --config FILE` reads FILE instead (a pyproject.toml's [tool.gpumigrate], or
a gpumigrate.toml holding those settings at its top level); `--isolated` reads none.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from gpumigrate.rewriter.files import DEFAULT_MAX_FILE_SIZE, BadPattern, Exclusions
from gpumigrate.targets import TargetError, parse_target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# Seconds one file may take (`file-timeout`): far beyond any real script (the slowest of 4 MB of
# torch's own sources takes seconds), short enough that a pathological file ends the run.
DEFAULT_FILE_TIMEOUT = 300.0


class ConfigError(Exception):
    pass


@dataclass
class Config:
    path: Optional[Path] = None
    target: Optional[str] = None
    select: List[str] = field(default_factory=list)
    ignore: List[str] = field(default_factory=list)
    exclude: List[str] = field(default_factory=list)
    extend_exclude: List[str] = field(default_factory=list)
    per_file_ignores: Dict[str, List[str]] = field(default_factory=dict)
    # [tool.gpumigrate.lint]: None where a setting is absent (the top-level one applies)
    lint_select: Optional[List[str]] = None
    lint_ignore: List[str] = field(default_factory=list)
    lint_extend_select: List[str] = field(default_factory=list)
    lint_per_file_ignores: Dict[str, List[str]] = field(default_factory=dict)
    max_file_size: int = DEFAULT_MAX_FILE_SIZE
    file_timeout: float = DEFAULT_FILE_TIMEOUT

    def exclude_spec(self, extra: Sequence[str] = ()) -> Exclusions:
        """The configured exclusions, relative to the config's folder, and `extra` (from the
        command line), relative to the working directory."""
        spec = Exclusions()
        if self.path is not None:
            try:
                spec.add(self.path.resolve().parent, [*self.exclude, *self.extend_exclude])
            except BadPattern as exc:
                raise ConfigError(f"{self.path}: [tool.gpumigrate] exclude: {exc}") from None
        return spec.add(Path.cwd(), list(extra))

    def ignored_for(self, file: str, lint: bool = False) -> List[str]:
        """Codes ignored for `file` by per-file-ignores (globs relative to the config); `lint`:
        [tool.gpumigrate.lint]'s too."""
        tables = [self.per_file_ignores, *([self.lint_per_file_ignores] if lint else [])]
        if not any(tables):
            return []
        base = self.path.parent if self.path else Path.cwd()
        try:
            rel = Path(os.path.abspath(file)).relative_to(base.resolve()).as_posix()
        except ValueError:
            rel = Path(file).as_posix()
        return [code for table in tables for pattern, codes in table.items()
                if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(Path(rel).name, pattern) for code in codes]


def _strings(table: dict, key: str, where: Path, name: str = "") -> List[str]:
    value = table.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {name or f'[tool.gpumigrate] {key}'} must be a list of strings")
    return value


# `[tool.gpumigrate]`, `[tool."gpumigrate".x]`, `tool.gpumigrate.target = ...`: what a file
# that TOML cannot read must contain for it to count as ours.
_MENTION = re.compile(r"""\btool\s*\.\s*["']?gpumigrate\b""")


def _mentions_us(raw: bytes) -> bool:
    # UTF-16 (Notepad's "Unicode") is a plausible way to break a TOML file; other encodings
    # keep the ASCII of the table name as it is.
    utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    return bool(_MENTION.search(raw.decode("utf-16" if utf16 else "latin-1", errors="replace")))


def _table_of(candidate: Path) -> Optional[dict]:
    """The [tool.gpumigrate] table of one pyproject.toml, None when it has none.

    As in ruff, a pyproject.toml without our table is someone else's file and the search walks
    on up. For a file TOML cannot read, whether it has our table is unknowable, so its raw text
    decides: one that names `tool.gpumigrate` is the user's broken configuration (an error: the
    run must not go on without it); any other (a parent project's broken or non-UTF-8 file, one
    we may not read) is not our business, as a valid one without our table would not be."""
    try:
        raw = candidate.read_bytes()
    except OSError:
        return None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 (byte {exc.start}); TOML files must be UTF-8"
    except tomllib.TOMLDecodeError as exc:
        problem = str(exc)
    else:
        tool = data.get("tool")
        if not isinstance(tool, dict) or "gpumigrate" not in tool:
            return None
        if not isinstance(tool["gpumigrate"], dict):
            raise ConfigError(f"{candidate}: [tool.gpumigrate] must be a table")
        return tool["gpumigrate"]
    if _mentions_us(raw):
        raise ConfigError(f"{candidate}: cannot read: {problem}")
    return None


def _find(paths: Sequence[str]) -> Optional[Tuple[Path, dict]]:
    starts = [Path(p).resolve() for p in paths] or [Path.cwd()]
    start = Path(os.path.commonpath([str(s) for s in starts]))
    if start.is_file() or not start.exists():
        start = start.parent
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            table = _table_of(candidate)
            if table is not None:
                return candidate, table
    return None


def find_config(paths: Sequence[str]) -> Optional[Path]:
    """The nearest pyproject.toml above `paths` with a [tool.gpumigrate] table."""
    found = _find(paths)
    return found[0] if found else None


def _named(path: Path) -> Tuple[Path, dict]:
    """The settings of a file given by name (`--config`): a pyproject.toml's
    [tool.gpumigrate] table, any other TOML file's top level (a gpumigrate.toml, as ruff.toml)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: not UTF-8 (byte {exc.start}); TOML files must be UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if path.name != "pyproject.toml":
        return path, data
    tool = data.get("tool")
    table = tool.get("gpumigrate") if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: no [tool.gpumigrate] table")
    return path, table


def load_config(paths: Sequence[str], config_file: Optional[str] = None, isolated: bool = False) -> Config:
    """The configuration for `paths`: the nearest pyproject.toml with our table, or
    `config_file` in its place; none when `isolated`."""
    if isolated:
        return Config()
    found = _named(Path(config_file)) if config_file is not None else _find(paths)
    if found is None:
        return Config()
    path, table = found
    known = {"target", "select", "ignore", "exclude", "extend-exclude", "per-file-ignores", "max-file-size",
             "file-timeout", "lint"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown [tool.gpumigrate] setting {unknown[0]!r}")
    lint = table.get("lint", {})
    if not isinstance(lint, dict):
        raise ConfigError(f"{path}: [tool.gpumigrate] lint must be a table")
    lint_per_file = lint.get("per-file-ignores", {})
    if not isinstance(lint_per_file, dict):
        raise ConfigError(f"{path}: [tool.gpumigrate.lint] per-file-ignores must be a table")
    unknown = sorted(set(lint) - {"select", "ignore", "extend-select", "per-file-ignores"})
    if unknown:
        raise ConfigError(f"{path}: unknown [tool.gpumigrate.lint] setting {unknown[0]!r}")
    per_file = table.get("per-file-ignores", {})
    if not isinstance(per_file, dict):
        raise ConfigError(f"{path}: [tool.gpumigrate] per-file-ignores must be a table")
    target = table.get("target")
    if target is not None and not isinstance(target, str):
        raise ConfigError(f"{path}: [tool.gpumigrate] target must be a string")
    # Checked here, for `lint` too: a broken configuration is broken whatever the command.
    if target is not None:
        try:
            target = parse_target(target)
        except TargetError as error:
            raise ConfigError(f"{path}: [tool.gpumigrate] target: {error}") from None
    max_size = table.get("max-file-size", DEFAULT_MAX_FILE_SIZE)
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size <= 0:
        raise ConfigError(f"{path}: [tool.gpumigrate] max-file-size must be a positive number of bytes")
    timeout = table.get("file-timeout", DEFAULT_FILE_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(f"{path}: [tool.gpumigrate] file-timeout must be a positive number of seconds")
    config = Config(
        path=path,
        target=target,
        max_file_size=max_size,
        file_timeout=float(timeout),
        select=_strings(table, "select", path),
        ignore=_strings(table, "ignore", path),
        exclude=_strings(table, "exclude", path),
        extend_exclude=_strings(table, "extend-exclude", path),
        per_file_ignores={k: _strings(per_file, k, path, f"[tool.gpumigrate.per-file-ignores] {k!r}")
                          for k in per_file},
        lint_select=_strings(lint, "select", path, "[tool.gpumigrate.lint] select") if "select" in lint else None,
        lint_ignore=_strings(lint, "ignore", path, "[tool.gpumigrate.lint] ignore"),
        lint_extend_select=_strings(lint, "extend-select", path, "[tool.gpumigrate.lint] extend-select"),
        lint_per_file_ignores={k: _strings(lint_per_file, k, path, f"[tool.gpumigrate.lint.per-file-ignores] {k!r}")
                               for k in lint_per_file},
    )
    config.exclude_spec()  # its patterns are read now: a bad one stops every command before any file
    return config
