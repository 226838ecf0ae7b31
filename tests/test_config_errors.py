"""A broken [tool.gpumigrate] is one line on stderr naming the file, exit 2, and nothing read or
written; a pyproject.toml that is not ours (valid or not) is skipped and the search walks on up."""

import os
from pathlib import Path
from typing import Dict, List

import pytest
from click.testing import CliRunner, Result

from gpumigrate.cli import main

SCRIPT = b"import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"


def _project(tmp_path: Path, inner: bytes, outer: bytes = b"") -> Dict[Path, bytes]:
    """tmp/pyproject.toml (outer, if any) > tmp/proj/pyproject.toml (inner) > tmp/proj/src/train.py;
    returns every file with its bytes, to check that none was touched."""
    files = {tmp_path / "proj" / "pyproject.toml": inner, tmp_path / "proj" / "src" / "train.py": SCRIPT}
    if outer:
        files[tmp_path / "pyproject.toml"] = outer
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _invoke(args: List[str]) -> Result:
    return CliRunner().invoke(main, args)


def _assert_one_line_error(result: Result, where: Path, *words: str) -> None:
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {where}: "), lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert result.stdout == ""


BROKEN = {
    "not-utf8": (b"# caf\xe9\n[tool.gpumigrate]\ntarget = 'ddp'\n", ["not UTF-8"]),
    "utf16": ('[tool.gpumigrate]\ntarget = "ddp"\n'.encode("utf-16"), ["not UTF-8"]),
    "bad-toml": (b'[tool.gpumigrate]\nselect = ["GM1"\n', ["cannot read"]),
    "bad-toml-dotted-key": (b'tool.gpumigrate.select = [\n', ["cannot read"]),
    "not-a-table": (b"[tool]\ngpumigrate = 5\n", ["[tool.gpumigrate] must be a table"]),
    "select-int": (b"[tool.gpumigrate]\nselect = 5\n", ["select must be a list of strings"]),
    "ignore-ints": (b"[tool.gpumigrate]\nignore = [1, 2]\n", ["ignore must be a list of strings"]),
    "exclude-table": (b"[tool.gpumigrate]\nexclude = {a = 1}\n", ["exclude must be a list of strings"]),
    "extend-exclude-int": (b"[tool.gpumigrate]\nextend-exclude = 5\n", ["extend-exclude must be a list"]),
    "target-int": (b"[tool.gpumigrate]\ntarget = 3\n", ["target must be a string"]),
    "target-unknown": (b'[tool.gpumigrate]\ntarget = "cuda"\n', ["unknown target 'cuda'", "device, ddp"]),
    "unknown-key": (b"[tool.gpumigrate]\ncolour = 1\n", ["unknown [tool.gpumigrate] setting 'colour'"]),
    "unknown-code": (b'[tool.gpumigrate]\nselect = ["GM1", "XX9"]\n', ["select: no rule matches 'XX9'"]),
    "per-file-ignores-int": (b"[tool.gpumigrate]\nper-file-ignores = 3\n", ["per-file-ignores must be a table"]),
    "exclude-bad-range": (b'[tool.gpumigrate]\nexclude = ["[z-a].py"]\n',
                          ["exclude: '[z-a].py': not a valid pattern (bad character range z-a)"]),
    "file-timeout-zero": (b"[tool.gpumigrate]\nfile-timeout = 0\n", ["file-timeout must be a positive number"]),
    "file-timeout-string": (b'[tool.gpumigrate]\nfile-timeout = "5m"\n', ["file-timeout must be a positive"]),
    "per-file-ignores-entry": (b'[tool.gpumigrate.per-file-ignores]\n"a.py" = 3\n',
                               ["[tool.gpumigrate.per-file-ignores] 'a.py' must be a list of strings"]),
    # an unknown code for files that are not even in the run: still found before anything is done
    "per-file-ignores-code": (b'[tool.gpumigrate.per-file-ignores]\n"nothing_*.py" = ["XX9"]\n',
                              ["'nothing_*.py': no rule matches 'XX9'"]),
}

COMMANDS = {
    "lint": ["lint"],
    "lint-fix": ["lint", "--fix"],
    "migrate": ["--to", "ddp"],
    "migrate-default-target": [],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BROKEN)
def test_broken_config_is_one_line_and_nothing_changes(tmp_path, case, command):
    inner, words = BROKEN[case]
    files = _project(tmp_path, inner, outer=b'[tool.gpumigrate]\nignore = ["GM101"]\n')
    args = COMMANDS[command]
    target = str(tmp_path / "proj" / "src")
    result = _invoke([*args[:1], target, *args[1:]] if args[:1] == ["lint"] else [target, *args])
    _assert_one_line_error(result, tmp_path / "proj" / "pyproject.toml", *words)
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(p.name for p in (tmp_path / "proj" / "src").iterdir()) == ["train.py"]


def test_broken_config_named_by_stdin_filename(tmp_path):
    _project(tmp_path, b"[tool.gpumigrate]\nselect = 5\n")
    result = CliRunner().invoke(main, ["-", "--stdin-filename", str(tmp_path / "proj" / "src" / "train.py")],
                                input=SCRIPT)
    _assert_one_line_error(result, tmp_path / "proj" / "pyproject.toml", "select")


NOT_OURS = {
    "tool-int": b"tool = 5\n",
    "tool-string": b'tool = "gpumigrate"\n',
    "no-tool": b'[project]\nname = "x"\n',
    "other-tool": b"[tool.ruff]\nline-length = 100\n",
    "bad-toml": b"[tool.ruff]\nselect = [1\n",
    "not-utf8": b"[project]\nname = 'caf\xe9'\n",
    "utf16": '[project]\nname = "x"\n'.encode("utf-16"),
    # mentions gpumigrate, but not as the table: a dependency of a broken parent project
    "bad-toml-dependency": b'[project]\ndependencies = ["gpumigrate"\n',
}


@pytest.mark.parametrize("case", NOT_OURS)
def test_pyproject_without_our_table_is_skipped_and_the_search_walks_up(tmp_path, case):
    _project(tmp_path, NOT_OURS[case], outer=b'[tool.gpumigrate]\nignore = ["GM101"]\n')
    result = _invoke(["lint", str(tmp_path / "proj" / "src")])
    assert result.exit_code == 0, result.output  # the outer configuration ignores the one finding
    assert result.stderr == "no findings in 1 file\n"


@pytest.mark.parametrize("case", ["tool-int", "bad-toml", "not-utf8"])
def test_pyproject_without_our_table_and_no_config_above(tmp_path, case):
    """The run goes on with the defaults (a pyproject.toml higher up on this machine could
    interfere: none is expected above the temporary directory)."""
    _project(tmp_path, NOT_OURS[case])
    result = _invoke(["lint", str(tmp_path / "proj" / "src")])
    assert result.exit_code == 1, result.output
    assert "GM101" in result.stdout and "Traceback" not in result.output


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_pyproject_is_skipped(tmp_path):
    """Whether a file we may not read is ours is unknowable; a parent folder's is usually not."""
    files = _project(tmp_path, b"[tool.gpumigrate]\nselect = 5\n", outer=b'[tool.gpumigrate]\nignore = ["GM101"]\n')
    inner = tmp_path / "proj" / "pyproject.toml"
    inner.chmod(0)
    try:
        result = _invoke(["lint", str(tmp_path / "proj" / "src")])
    finally:
        inner.chmod(0o644)
    assert result.exit_code == 0 and result.stderr == "no findings in 1 file\n", result.output
    assert inner.read_bytes() == files[inner]


def test_nearest_config_wins_over_a_broken_one_above(tmp_path):
    """The search stops at the first [tool.gpumigrate]: a broken one higher up is never read."""
    _project(tmp_path, b'[tool.gpumigrate]\nignore = ["GM101"]\n', outer=b"[tool.gpumigrate]\nselect = 5\n")
    result = _invoke(["lint", str(tmp_path / "proj" / "src")])
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- bad input on the command line

def _one_line(result: Result, *words: str) -> None:
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") or "Error: " in result.stderr, result.stderr
    assert all(w in result.stderr for w in words), result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [["lint"], ["--to", "ddp"], ["--check"]])
def test_a_bad_exclude_pattern_is_a_usage_error(tmp_path, command):
    files = _project(tmp_path, b"[tool.gpumigrate]\n")
    result = _invoke([*command, str(tmp_path / "proj"), "--exclude", "[z-a]"])
    _one_line(result, "--exclude '[z-a]': not a valid pattern (bad character range z-a)")
    assert all(path.read_bytes() == data for path, data in files.items())


def test_a_gitignore_with_a_bad_pattern_is_read_as_git_reads_it(tmp_path):
    files = _project(tmp_path, b"[tool.gpumigrate]\n")
    (tmp_path / "proj" / ".git").mkdir()
    (tmp_path / "proj" / ".gitignore").write_text("[z-a]\nsrc/ignored.py\n")
    (tmp_path / "proj" / "src" / "ignored.py").write_bytes(SCRIPT)
    result = _invoke(["lint", str(tmp_path / "proj")])
    assert result.exit_code == 1 and "train.py" in result.stdout and "ignored.py" not in result.stdout, result.output


def test_stdin_that_never_ends_is_one_line(tmp_path):
    import subprocess
    import sys

    with open("/dev/zero", "rb") as zero:
        run = subprocess.run([sys.executable, "-m", "gpumigrate", "-", "--stdin-filename", "t.py"], stdin=zero,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == ["error: standard input is over the 10,000,000 bytes limit (max-file-size); "
                                       "nothing was changed"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["-o", "-"], ["--diff"], ["lint"], ["lint", "--format", "json"], ["rules"]])
def test_standard_output_on_a_full_device_is_one_line(tmp_path, args):
    import subprocess
    import sys

    files = _project(tmp_path, b"[tool.gpumigrate]\n")
    script = tmp_path / "proj" / "src" / "train.py"
    command = [*args[:1], str(script), *args[1:]] if args[0] == "lint" else args if args == ["rules"] \
        else [str(script), *args]
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "gpumigrate", *command], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "error: cannot write to standard output: No space left on device" in run.stderr.splitlines()
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
    assert all(path.read_bytes() == data for path, data in files.items())


def test_a_file_named_dash_is_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_bytes(SCRIPT)
    result = CliRunner().invoke(main, ["./-", "--to", "device"], input="this is stdin, not a script\n")
    assert result.exit_code == 0, result.output
    assert b".to(device)" in (tmp_path / "-").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-"]  # no file named <stdin>
    assert "rewrote ./-" in result.stderr
    lint = CliRunner().invoke(main, ["lint", "./-"], input="x = 1\n")
    assert lint.exit_code == 0 and "no findings in 1 file" in lint.stderr
