"""Directory discovery asks git what it ignores, inside a work tree (issue 20, item 8):
nested .gitignore files, .git/info/exclude and core.excludesFile, as `git status` sees them;
outside a work tree, or without git, the folder is walked and .gitignore files read by hand."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.rewriter import files
from gpumigrate.rewriter.files import discover

CUDA = "import torch\nx = torch.zeros(1).cuda()\n"


def git(cwd: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", *args], cwd=str(cwd), env=env, check=True, capture_output=True)


def tree(root: Path, layout: Dict[str, str]) -> Path:
    for name, text in layout.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def found(root: Path, *paths: str) -> set:
    names, errors = discover([str(root / p) for p in paths] or [str(root)])
    assert not errors
    return {Path(n).relative_to(root).as_posix() for n in names}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    return root


def test_core_excludes_file_and_info_exclude_are_honoured(repo: Path, tmp_path: Path) -> None:
    personal = tmp_path / "my-ignores"
    personal.write_text("*_scratch.py\n")
    git(repo, "config", "core.excludesFile", str(personal))  # a user's global ignores, set for this repo
    tree(repo, {".git/info/exclude": "local/\n", "train.py": CUDA, "try_scratch.py": CUDA,
                "local/notes.py": CUDA, "src/model_scratch.py": CUDA, "src/model.py": CUDA})
    assert found(repo) == {"train.py", "src/model.py"}


def test_tracked_files_are_scripts_even_where_a_pattern_matches(repo: Path) -> None:
    # git ignores untracked files only: a committed file under an ignore pattern is the project's
    tree(repo, {"vendor/kept.py": CUDA, "vendor/new.py": CUDA, "train.py": CUDA})
    git(repo, "add", "vendor/kept.py")
    (repo / ".gitignore").write_text("vendor/\n")
    assert found(repo) == {"train.py", "vendor/kept.py"}


def test_nested_gitignore_negation_and_hidden_folders(repo: Path) -> None:
    tree(repo, {".gitignore": "*_tmp.py\nbuild/\n", "src/.gitignore": "!keep_tmp.py\n",
                "src/a_tmp.py": CUDA, "src/keep_tmp.py": CUDA, "build/x.py": CUDA, ".hidden/x.py": CUDA,
                "venv/pyvenv.cfg": "home = /usr\n", "venv/lib/x.py": CUDA, "__pycache__/x.py": CUDA,
                "nb.ipynb": "{}", "notes.txt": "x"})
    assert found(repo) == {"src/keep_tmp.py", "nb.ipynb"}
    assert found(repo, "src") == {"src/keep_tmp.py"}  # from a subfolder, the .gitignore above counts


def test_a_file_named_explicitly_is_never_excluded_by_git(repo: Path) -> None:
    tree(repo, {".gitignore": "ignored.py\n", "ignored.py": CUDA})
    assert found(repo) == set()
    assert found(repo, "ignored.py") == {"ignored.py"}  # as ruff and black: a pre-commit hook names files
    result = CliRunner().invoke(main, ["lint", str(repo / "ignored.py")])
    assert result.exit_code == 1 and "GM101" in result.stdout


def test_a_repository_inside_the_folder_is_asked_too(repo: Path) -> None:
    inner = repo / "third_party" / "lib"
    inner.mkdir(parents=True)
    git(inner, "init", "-q")
    tree(inner, {".gitignore": "gen.py\n", "gen.py": CUDA, "lib.py": CUDA})
    tree(repo, {"train.py": CUDA})
    assert found(repo) == {"train.py", "third_party/lib/lib.py"}


def test_the_order_is_the_walks(repo: Path, tmp_path: Path) -> None:
    layout = {"b.py": CUDA, "a/z.py": CUDA, "a/b/c.py": CUDA, "a/a.py": CUDA, "z.py": CUDA, "A.py": CUDA}
    tree(repo, layout)
    plain = tree(tmp_path / "plain", layout)
    by_git = [Path(p).relative_to(repo).as_posix() for p in discover([str(repo)])[0]]
    walked = [Path(p).relative_to(plain).as_posix() for p in discover([str(plain)])[0]]
    assert by_git == walked == ["A.py", "b.py", "z.py", "a/a.py", "a/z.py", "a/b/c.py"]


def test_without_git_the_gitignore_files_are_read_by_hand(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree(repo, {".gitignore": "gen/\n", "gen/x.py": CUDA, "train.py": CUDA})
    monkeypatch.setenv("PATH", "")  # no git on PATH
    assert files._git_files(repo) is None
    assert found(repo) == {"train.py"}


def test_git_is_asked_for_the_folders_own_repository(repo: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A git hook runs with GIT_DIR/GIT_INDEX_FILE set for its own repository.
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    tree(repo, {".gitignore": "gen.py\n", "gen.py": CUDA, "train.py": CUDA})
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(other / ".git" / "index"))
    assert found(repo) == {"train.py"}
