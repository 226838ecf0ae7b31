import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import pytest

from gpumigrate.codemods import fixed_codes, passes_for, rules_for
from gpumigrate.rewriter.engine import FileResult, process
from gpumigrate.rewriter.names import ImportTable
from gpumigrate.rewriter.run import process_passes

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# The CLI's results cache goes to the user's cache folder: the tests must not fill the home of
# whoever runs them. One scratch folder per session instead (tests/test_cache.py sets its own).
if "GPUMIGRATE_CACHE_DIR" not in os.environ:
    os.environ["GPUMIGRATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpumigrate-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GPUMIGRATE_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items) -> None:
    """A test that runs scripts (`e2e`) or torchrun (`ddp`) is `slow` too, so the quick subset,
    `python -m pytest -q -m "not slow"`, is one marker. Others carry `slow` by hand (measured)."""
    for item in items:
        if item.get_closest_marker("e2e") or item.get_closest_marker("ddp"):
            item.add_marker(pytest.mark.slow)


def migrate(source: bytes, target: str = "device", path: str = "script.py", options: Optional[dict] = None) -> FileResult:
    """As `gpumigrate --to TARGET` migrates: its passes, in order, to a fixpoint."""
    return process_passes(source, path, passes_for(target, rules_for(target)), options)


def lint(source: bytes, rules: Sequence[type], path: str = "script.py", options: Optional[dict] = None) -> FileResult:
    return process(source, path, rules, fix=(), names_factory=ImportTable, options=options)


def run_script(path: Path, args: List[str] = (), cwd: Path = None, timeout: int = 60) -> subprocess.CompletedProcess:
    """Run a script in a fresh interpreter the way a user would."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                          cwd=str(cwd or path.parent), env=env, timeout=timeout)


@pytest.fixture
def tmp_script(tmp_path):
    def make(source, name="train.py"):
        path = tmp_path / name
        path.write_bytes(source if isinstance(source, bytes) else source.encode())
        return path
    return make


@pytest.fixture(scope="session")
def vendored_runtime(tmp_path_factory):
    """The one-module runtime that `--vendor-runtime` writes, imported as `gpumigrate_runtime`."""
    import importlib.util

    from gpumigrate.rewriter.vendor import VENDORED_MODULE, write_runtime

    path, _ = write_runtime(str(tmp_path_factory.mktemp("vendored")))
    spec = importlib.util.spec_from_file_location(VENDORED_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[VENDORED_MODULE] = module  # as a script's import would: typing and pickle look it up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(VENDORED_MODULE, None)
