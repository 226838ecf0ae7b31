"""`[tool.gpumigrate]` in pyproject.toml, found by walking up from the paths given.

    [tool.gpumigrate]
    target = "ddp"                 # default for `gpumigrate PATHS` without --to
    select = ["GM1", "GM3"]        # codes or prefixes; all rules when absent
    ignore = ["GM204"]
    exclude = ["legacy/"]          # gitignore-style, relative to this file's folder
    extend-exclude = ["*_old.py"]  # added to `exclude` (a shared config sets one, a project the other)
    [tool.gpumigrate.per-file-ignores]
    "notebooks/*.py" = ["GM601"]
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from gpumigrate.rewriter.files import Exclusions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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

    def exclude_spec(self, extra: Sequence[str] = ()) -> Exclusions:
        """The configured exclusions, relative to the config's folder, and `extra` (from the
        command line), relative to the working directory."""
        spec = Exclusions()
        if self.path is not None:
            spec.add(self.path.parent, [*self.exclude, *self.extend_exclude])
        return spec.add(Path.cwd(), list(extra))

    def ignored_for(self, file: str) -> List[str]:
        """Codes ignored for `file` by per-file-ignores (globs relative to the config)."""
        if not self.per_file_ignores:
            return []
        base = self.path.parent if self.path else Path.cwd()
        try:
            rel = Path(os.path.abspath(file)).relative_to(base.resolve()).as_posix()
        except ValueError:
            rel = Path(file).as_posix()
        return [code for pattern, codes in self.per_file_ignores.items()
                if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(Path(rel).name, pattern) for code in codes]


def _strings(table: dict, key: str, where: Path) -> List[str]:
    value = table.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: [tool.gpumigrate] {key} must be a list of strings")
    return value


def find_config(paths: Sequence[str]) -> Optional[Path]:
    starts = [Path(p).resolve() for p in paths] or [Path.cwd()]
    start = Path(os.path.commonpath([str(s) for s in starts]))
    if start.is_file() or not start.exists():
        start = start.parent
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                with open(candidate, "rb") as handle:
                    data = tomllib.load(handle)
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"{candidate}: cannot read: {exc}") from None
            if "gpumigrate" in data.get("tool", {}):
                return candidate
    return None


def load_config(paths: Sequence[str]) -> Config:
    path = find_config(paths)
    if path is None:
        return Config()
    with open(path, "rb") as handle:
        table = tomllib.load(handle)["tool"]["gpumigrate"]
    known = {"target", "select", "ignore", "exclude", "extend-exclude", "per-file-ignores"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown [tool.gpumigrate] setting {unknown[0]!r}")
    per_file = table.get("per-file-ignores", {})
    if not isinstance(per_file, dict):
        raise ConfigError(f"{path}: [tool.gpumigrate] per-file-ignores must be a table")
    target = table.get("target")
    if target is not None and not isinstance(target, str):
        raise ConfigError(f"{path}: [tool.gpumigrate] target must be a string")
    return Config(
        path=path,
        target=target,
        select=_strings(table, "select", path),
        ignore=_strings(table, "ignore", path),
        exclude=_strings(table, "exclude", path),
        extend_exclude=_strings(table, "extend-exclude", path),
        per_file_ignores={k: _strings(per_file, k, path) for k in per_file},
    )
