"""bench/robustness.py on a CI-sized sample: lint and both migration targets over ~300 real
files of the standard library and torch, in-process (the CLI-in-children pass is the full
bench's). Files over 30 kB are left out of the sample to keep it near 30 s: the full bench
covers them. Not marked `e2e`: nothing here runs a migrated script."""

import importlib.util
import os
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parent.parent
# ~30 s over ~300 files: in the full suite, not in the quick subset (-m "not slow")
pytestmark = pytest.mark.slow
PER_ROOT = 150
MAX_SIZE = 30_000
# Broken or odd on purpose (Python 2, bad encodings, a BOM, CRLF, bad __future__ imports):
# the parse-error check needs files that must fail, and a sample of good code has few.
EDGE_CASES = ("lib2to3/tests/data/*.py", "test/tokenizedata/*.py", "test/test_future_stmt/badsyntax_*.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_robustness", ROOT / "bench" / "robustness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _sample(bench) -> List[str]:
    roots = bench.default_paths()
    chosen = []
    for root in roots.values():
        files = [f for f in bench.python_files(root) if os.path.getsize(f) <= MAX_SIZE]
        chosen += bench.sample(files, PER_ROOT)
    chosen += sorted(str(p) for pattern in EDGE_CASES for p in Path(roots["stdlib"]).glob(pattern))
    return sorted(set(chosen))


@pytest.fixture(scope="module")
def report():
    bench = _bench()
    paths = _sample(bench)
    assert len(paths) >= 2 * PER_ROOT
    result, _ = bench.check_files(paths, bench.MODES)
    return result


def _show(problems) -> str:
    return "\n".join(f"[{p.mode}] {p.path}: {p.message}\n{p.detail}" for p in problems)


def test_no_crash(report):
    assert not report.crashes, _show(report.crashes)


def test_every_output_compiles(report):
    assert not report.not_compiling, _show(report.not_compiling)


def test_second_run_changes_nothing(report):
    assert not report.second_run, _show(report.second_run)


def test_nothing_changed_without_an_edit(report):
    assert not report.changed_without_edit, _show(report.changed_without_edit)


def test_parse_errors_are_genuine(report):
    """Every file we cannot parse is one CPython's compile() rejects too; and the edge cases
    did produce parse errors, so the check has something to check."""
    assert not report.false_parse_errors, "\n".join(f"{p}: {report.parse_errors[p][0]}"
                                                    for p in report.false_parse_errors)
    assert len(report.parse_errors) >= 5, report.parse_errors


def test_the_migrations_did_something(report):
    """A sample in which nothing changes checks nothing about outputs."""
    assert report.changed.get("device", 0) > 0 and report.changed.get("ddp", 0) > 0, report.changed
