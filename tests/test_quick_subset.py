"""The quick subset (`-m "not slow"`, README "Set-up") leaves out every test that runs a script
or torchrun, whatever marks it carries by hand."""

import subprocess
import sys

from tests.conftest import ROOT


def _collected(*args: str) -> list:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-o", "addopts=",
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_the_quick_subset_runs_no_script_and_no_torchrun():
    e2e = set(_collected("-m", "e2e or ddp", "tests/test_ddp_e2e.py", "tests/test_fixtures.py"))
    quick = set(_collected("-m", "not slow", "tests/test_ddp_e2e.py", "tests/test_fixtures.py"))
    assert e2e and quick, "nothing collected"
    assert not e2e & quick
    assert not any("test_migrated_script_runs" in t for t in quick)
