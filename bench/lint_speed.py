"""Lint cost against a bare LibCST parse, measured in one run (the ARCHITECTURE target:
lint at most 1.5x a parse). Prints ratios; asserts nothing.

    python bench/lint_speed.py [FILES_OR_DIRS...]   (default: the fixtures, and torch's own nn/ sources)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import libcst as cst

from gpumigrate.codemods import fixed_codes, rules_for, select
from gpumigrate.rewriter.engine import process
from gpumigrate.rewriter.files import discover
from gpumigrate.rewriter.names import ImportTable


def _time(label: str, sources, fn) -> float:
    start = time.perf_counter()
    for path, data in sources:
        fn(path, data)
    elapsed = time.perf_counter() - start
    print(f"{label:<28} {elapsed:7.2f} s")
    return elapsed


def main() -> None:
    paths = sys.argv[1:]
    if not paths:
        import torch.nn
        paths = ["fixtures/scripts", str(Path(torch.nn.__file__).parent)]
    files, _ = discover(paths)
    sources = []
    for path in files:
        data = Path(path).read_bytes()
        try:
            cst.parse_module(data)
        except Exception:
            continue  # only files LibCST parses as they are: the comparison is per parse
        sources.append((path, data))
    print(f"{len(sources)} files, {sum(len(d) for _, d in sources) / 1e6:.1f} MB")
    lint_rules = select([], [])
    parse = _time("LibCST parse", sources, lambda p, d: cst.parse_module(d))
    lint = _time("gpumigrate lint (all rules)", sources,
                 lambda p, d: process(d, p, lint_rules, names_factory=ImportTable))
    migrate = _time("gpumigrate --to ddp", sources,
                    lambda p, d: process(d, p, rules_for("ddp"), fix=fixed_codes("ddp"), names_factory=ImportTable))
    print(f"lint / parse    = {lint / parse:.2f}x   (target <= 1.5x)")
    print(f"migrate / parse = {migrate / parse:.2f}x")


if __name__ == "__main__":
    main()
