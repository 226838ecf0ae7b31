"""The pre-commit hooks of `.pre-commit-hooks.yaml`, run by the real `pre-commit` in throwaway
git repositories, from the environment pre-commit builds for them (never the dev checkout).

The hooks come from a snapshot of this working tree: tracked and untracked files as they are
on disk, committed to a temporary repository. `pre-commit try-repo` snapshots uncommitted
changes itself, but only of files git already tracks (`git add -u`), so a new module or the
hooks file not yet added would be missing from what it installs.

`try-repo` installs the hook into a store of its own on every call (about 5 s, whatever
PRE_COMMIT_HOME says), so one test uses it; the others point a `.pre-commit-config.yaml` at the
snapshot and share one PRE_COMMIT_HOME, where the hook environment is built once for the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent

BAD = """\
import torch

x = torch.zeros(3)
y = x.cuda()
print(y)
"""

CLEAN = """\
import torch


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2
"""

TRAIN = """\
import torch
from torch import nn

model = nn.Linear(4, 2).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x = torch.randn(8, 4).cuda()
    loss = model(x).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

NOTEBOOK = json.dumps({"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                                  "source": ["import torch\n", "x = torch.zeros(3).cuda()\n"]}],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1) + "\n"

# Repository-locating variables would point git at another repository (they are set while a
# git hook runs); the rest (certificates, ssh, proxies) are kept.
_GIT_KEEP = {"GIT_EXEC_PATH", "GIT_SSH", "GIT_SSH_COMMAND", "GIT_SSL_CAINFO", "GIT_SSL_NO_VERIFY",
             "GIT_ASKPASS", "GIT_HTTP_PROXY_AUTHMETHOD", "GIT_ALLOW_PROTOCOL"}


def _isolated_env(pre_commit_home: Path) -> Dict[str, str]:
    """The environment a user's `git commit` would give pre-commit, minus what leaks the dev setup.

    No PYTHON* (PYTHONPATH would let the hook import the dev checkout), no active virtualenv and
    its bin directory off PATH, so `gpumigrate` resolves only inside the hook's environment. Pip
    settings stay: installing the hook may need the machine's index and certificates."""
    dev_bin = Path(sys.executable).parent
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "PRE_COMMIT", "VIRTUAL_ENV", "CONDA"))
           and not (key.startswith("GIT_") and key not in _GIT_KEEP) and key != "SKIP"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != dev_bin)
    env.update(PRE_COMMIT_HOME=str(pre_commit_home), PRE_COMMIT_COLOR="never",
               # A user's global git config (signing, templates with hooks) must not reach these repos.
               GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return env


def _git(cwd: Path, env: Dict[str, str], *args: str) -> str:
    return subprocess.run(["git", *args], cwd=str(cwd), env=env, check=True, capture_output=True,
                          text=True).stdout


def _init_repo(path: Path, env: Dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _git(path, env, "init", "-q")
    _git(path, env, "config", "user.name", "gpumigrate tests")
    _git(path, env, "config", "user.email", "tests@gpumigrate.invalid")
    return path


@dataclass
class HookRepo:
    path: Path
    rev: str
    env: Dict[str, str]


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory: pytest.TempPathFactory) -> HookRepo:
    """This working tree committed to a scratch repository, its hooks installed once."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the hooks are installed from the working tree's files")
    env = _isolated_env(tmp_path_factory.mktemp("pre-commit-home"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=str(ROOT), env=env, check=True, capture_output=True).stdout
    snapshot = _init_repo(tmp_path_factory.mktemp("checkout"), env)
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file() or source.is_symlink():  # a tracked file deleted on disk is left out
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, snapshot / name, follow_symlinks=False)
    assert (snapshot / ".pre-commit-hooks.yaml").is_file()
    _git(snapshot, env, "add", "-A")
    _git(snapshot, env, "commit", "-q", "--no-verify", "-m", "working tree snapshot")
    repo = HookRepo(snapshot, _git(snapshot, env, "rev-parse", "HEAD").strip(), env)
    # Build the hook environment here, once, so that an install failure shows as one error.
    seed = _project(tmp_path_factory.mktemp("seed"), repo)
    installed = _pre_commit(seed, repo, "install-hooks", timeout=900)
    assert installed.returncode == 0, installed.stdout
    return repo


def _project(path: Path, repo: HookRepo, hooks: Optional[List[dict]] = None) -> Path:
    """A user's repository whose .pre-commit-config.yaml uses both hooks (JSON is YAML)."""
    _init_repo(path, repo.env)
    config = {"repos": [{"repo": str(repo.path), "rev": repo.rev,
                         "hooks": hooks or [{"id": "gpumigrate-lint"}, {"id": "gpumigrate"}]}]}
    (path / ".pre-commit-config.yaml").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _pre_commit(cwd: Path, repo: HookRepo, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # pre-commit prints the hook's stdout and stderr together; one stream keeps their order.
    return subprocess.run([sys.executable, "-m", "pre_commit", *args], cwd=str(cwd), env=repo.env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture
def project(tmp_path: Path, hook_repo: HookRepo) -> Path:
    return _project(tmp_path / "project", hook_repo)


def _write(project: Path, name: str, text: str, env: Dict[str, str]) -> Path:
    """Write and stage a file: pre-commit sees a hook's edits as a diff against the index."""
    path = project / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _git(project, env, "add", name)
    return path


def _migrated(tmp_path: Path, source: str, target: str, name: str = "script.py") -> str:
    """What `gpumigrate --to TARGET` run from this checkout writes for `source`."""
    scratch = tmp_path / f"expected-{target}"
    scratch.mkdir()
    script = scratch / name
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout, the source the hooks were installed from
    done = subprocess.run([sys.executable, "-m", "gpumigrate", "migrate", "--to", target, str(script)],
                          cwd=str(scratch), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return script.read_text()


def _hook_line(output: str, name: str) -> str:
    """pre-commit's status line for the hook: `gpumigrate lint......Passed`."""
    lines = [line for line in output.splitlines() if line.startswith(name + ".")]
    assert len(lines) == 1, output
    return lines[0]


def test_try_repo_lint_hook_fails_with_the_finding(project: Path, hook_repo: HookRepo) -> None:
    _write(project, "bad.py", BAD, env=hook_repo.env)
    run = _pre_commit(project, hook_repo, "try-repo", str(hook_repo.path), "gpumigrate-lint",
                      "--files", "bad.py", timeout=900)
    assert run.returncode == 1, run.stdout
    assert _hook_line(run.stdout, "gpumigrate lint").endswith("Failed")
    assert "- hook id: gpumigrate-lint" in run.stdout and "- exit code: 1" in run.stdout
    assert re.search(r"^bad\.py:4:\d+: GM101 ", run.stdout, re.M), run.stdout


def test_lint_hook_passes_a_clean_file(project: Path, hook_repo: HookRepo) -> None:
    _write(project, "clean.py", CLEAN, env=hook_repo.env)
    _write(project, "bad.py", BAD, env=hook_repo.env)
    clean = _pre_commit(project, hook_repo, "run", "gpumigrate-lint", "--files", "clean.py")
    assert clean.returncode == 0, clean.stdout
    assert _hook_line(clean.stdout, "gpumigrate lint").endswith("Passed")
    # The same hook in the same repository does fail, once given the bad file too.
    both = _pre_commit(project, hook_repo, "run", "gpumigrate-lint", "--files", "clean.py", "bad.py")
    assert both.returncode == 1, both.stdout
    assert re.search(r"^bad\.py:4:\d+: GM101 ", both.stdout, re.M), both.stdout
    assert "clean.py:" not in both.stdout


def test_fixing_hook_rewrites_then_passes(project: Path, hook_repo: HookRepo, tmp_path: Path) -> None:
    script = _write(project, "bad.py", BAD, env=hook_repo.env)
    first = _pre_commit(project, hook_repo, "run", "gpumigrate", "--files", "bad.py")
    assert first.returncode == 1, first.stdout
    assert _hook_line(first.stdout, "gpumigrate migrate").endswith("Failed")
    assert "- files were modified by this hook" in first.stdout
    migrated = script.read_text()
    assert ".cuda()" not in migrated and "x.to(device)" in migrated
    assert migrated == _migrated(tmp_path, BAD, "device")
    # The rewrite adds a runtime dependency: the hook says so, and names the way around it.
    assert "from gpumigrate.runtime import get_device" in migrated
    assert re.search(r"^next: runtime: bad\.py now imports `gpumigrate\.runtime`: .*gpumigrate\[torch\].*"
                     r"--vendor-runtime DIR", first.stdout, re.M), first.stdout
    # The user stages the rewrite; the next commit's run finds nothing to change.
    _git(project, hook_repo.env, "add", "bad.py")
    second = _pre_commit(project, hook_repo, "run", "gpumigrate", "--files", "bad.py")
    assert second.returncode == 0, second.stdout
    assert _hook_line(second.stdout, "gpumigrate migrate").endswith("Passed")
    assert script.read_text() == migrated


def test_both_hooks_let_a_migrated_script_pass(tmp_path: Path, hook_repo: HookRepo) -> None:
    # The fixing hook first, as ruff's fixer goes before its checks: lint sees the rewrite.
    project = _project(tmp_path / "both", hook_repo, [{"id": "gpumigrate"}, {"id": "gpumigrate-lint"}])
    script = _write(project, "train.py", TRAIN, env=hook_repo.env)
    first = _pre_commit(project, hook_repo, "run", "--files", "train.py")
    assert first.returncode == 1 and "- files were modified by this hook" in first.stdout, first.stdout
    assert _hook_line(first.stdout, "gpumigrate migrate").endswith("Failed")
    assert _hook_line(first.stdout, "gpumigrate lint").endswith("Passed"), first.stdout
    _git(project, hook_repo.env, "add", "train.py")
    second = _pre_commit(project, hook_repo, "run", "--files", "train.py")
    assert second.returncode == 0, second.stdout
    assert _hook_line(second.stdout, "gpumigrate migrate").endswith("Passed")
    assert "get_device()" in script.read_text()


def test_fixing_hook_with_a_vendored_runtime_needs_only_torch(tmp_path: Path, hook_repo: HookRepo) -> None:
    # The documented alternative to the package import: `args: [--vendor-runtime, .]`.
    project = _project(tmp_path / "vendored", hook_repo,
                       [{"id": "gpumigrate", "args": ["--vendor-runtime", "."]}, {"id": "gpumigrate-lint"}])
    script = _write(project, "bad.py", BAD, env=hook_repo.env)
    first = _pre_commit(project, hook_repo, "run", "--files", "bad.py")
    assert first.returncode == 1 and "- files were modified by this hook" in first.stdout, first.stdout
    assert "wrote ./gpumigrate_runtime.py" in first.stdout and "gpumigrate.runtime" not in first.stdout
    migrated = script.read_text()
    assert "from gpumigrate_runtime import get_device" in migrated and "gpumigrate.runtime" not in migrated
    # The user adds the runtime with the rewrite; both hooks then pass on both files.
    _git(project, hook_repo.env, "add", "bad.py", "gpumigrate_runtime.py")
    second = _pre_commit(project, hook_repo, "run", "--files", "bad.py", "gpumigrate_runtime.py")
    assert second.returncode == 0, second.stdout
    assert script.read_text() == migrated
    # It runs where gpumigrate cannot be imported at all.
    blocked = "import runpy, sys; sys.modules['gpumigrate'] = None; sys.path.insert(0, '.'); runpy.run_path('bad.py')"
    ran = subprocess.run([sys.executable, "-c", blocked], cwd=str(project), capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0 and "tensor([0., 0., 0.])" in ran.stdout, ran.stderr


def test_fixing_hook_migrates_to_the_configured_target(project: Path, hook_repo: HookRepo,
                                                       tmp_path: Path) -> None:
    (project / "pyproject.toml").write_text('[tool.gpumigrate]\ntarget = "ddp"\n')
    script = _write(project, "src/train.py", TRAIN, env=hook_repo.env)
    run = _pre_commit(project, hook_repo, "run", "gpumigrate", "--files", "src/train.py")
    assert run.returncode == 1, run.stdout
    assert "- files were modified by this hook" in run.stdout
    ddp = _migrated(tmp_path, TRAIN, "ddp")
    assert ddp != _migrated(tmp_path, TRAIN, "device")  # else this test could not tell them apart
    assert script.read_text() == ddp


def test_lint_hook_honours_the_projects_config(project: Path, hook_repo: HookRepo) -> None:
    # In a subdirectory: the configuration is found by walking up from the file.
    _write(project, "src/bad.py", BAD, env=hook_repo.env)
    before = _pre_commit(project, hook_repo, "run", "gpumigrate-lint", "--files", "src/bad.py")
    assert before.returncode == 1, before.stdout
    assert re.search(r"^src/bad\.py:4:\d+: GM101 ", before.stdout, re.M), before.stdout
    (project / "pyproject.toml").write_text('[tool.gpumigrate]\nignore = ["GM101"]\n')
    after = _pre_commit(project, hook_repo, "run", "gpumigrate-lint", "--files", "src/bad.py")
    assert after.returncode == 0, after.stdout
    assert "GM101" not in after.stdout


def test_lint_hook_reports_findings_in_notebooks(project: Path, hook_repo: HookRepo) -> None:
    _write(project, "explore.ipynb", NOTEBOOK, env=hook_repo.env)
    run = _pre_commit(project, hook_repo, "run", "gpumigrate-lint", "--files", "explore.ipynb")
    assert run.returncode == 1, run.stdout
    assert re.search(r"^explore\.ipynb:cell 1:2:\d+: GM101 ", run.stdout, re.M), run.stdout


def test_fixing_hook_migrates_notebooks(project: Path, hook_repo: HookRepo, tmp_path: Path) -> None:
    notebook = _write(project, "explore.ipynb", NOTEBOOK, env=hook_repo.env)
    first = _pre_commit(project, hook_repo, "run", "gpumigrate", "--files", "explore.ipynb")
    assert first.returncode == 1 and "- files were modified by this hook" in first.stdout, first.stdout
    migrated = notebook.read_text()
    assert ".cuda()" not in migrated and migrated == _migrated(tmp_path, NOTEBOOK, "device", "explore.ipynb")
    _git(project, hook_repo.env, "add", "explore.ipynb")
    second = _pre_commit(project, hook_repo, "run", "gpumigrate", "--files", "explore.ipynb")
    assert second.returncode == 0, second.stdout
    assert notebook.read_text() == migrated


def test_hook_environment_is_its_own_install_without_torch(hook_repo: HookRepo) -> None:
    pythons = sorted(Path(hook_repo.env["PRE_COMMIT_HOME"]).glob("repo*/py_env-*/bin/python"))
    assert pythons, "pre-commit built no python environment"
    probe = ("import importlib.util, gpumigrate; "
             "print(gpumigrate.__file__); print(importlib.util.find_spec('torch') is not None)")
    for python in pythons:
        # Run from the env's own folder: `python -c` puts the working directory on sys.path.
        shown = subprocess.run([str(python), "-c", probe], cwd=str(python.parent), env=hook_repo.env,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        module, has_torch = Path(shown[0]), shown[1]
        assert python.parent.parent in module.parents, f"the hook imports {module}, not its own install"
        assert has_torch == "False", f"{python.parent.parent} has torch installed"


def test_base_dependencies_leave_torch_out() -> None:
    # `language: python` installs the package with its base dependencies, no extras.
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[\s<>=!~;\[]", dependency, maxsplit=1)[0].lower() for dependency in dependencies]
    assert "libcst" in names and "torch" not in names


def test_the_readme_config_works_from_a_clone(tmp_path: Path, hook_repo: HookRepo) -> None:
    """The README's .pre-commit-config.yaml, with its placeholders filled in as a user would
    (the clone's path and a commit of it), runs both hooks: no release needed."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## pre-commit"):]
    block = section[section.index("```yaml\n") + len("```yaml\n"):]
    config = block[:block.index("```")]
    assert "repo: /path/to/your/clone/of/gpumigrate" in config and "rev: main" in config
    config = config.replace("/path/to/your/clone/of/gpumigrate", str(hook_repo.path)).replace(
        "rev: main", f"rev: {hook_repo.rev}")
    project = _init_repo(tmp_path / "readme", hook_repo.env)
    (project / ".pre-commit-config.yaml").write_text(config)
    _write(project, "train.py", TRAIN, env=hook_repo.env)
    first = _pre_commit(project, hook_repo, "run", "--files", "train.py")
    assert _hook_line(first.stdout, "gpumigrate migrate").endswith("Failed"), first.stdout
    assert "now imports `gpumigrate.runtime`" in first.stdout
    _git(project, hook_repo.env, "add", "train.py")
    second = _pre_commit(project, hook_repo, "run", "--files", "train.py")
    assert second.returncode == 0, second.stdout
