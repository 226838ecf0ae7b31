"""Lose nothing: a write never replaces what the user changed meanwhile, never turns a link into
a copy or a FIFO into a file, leaves no temp files behind for good, and a file that cannot be
read or written safely is one line and exit 2, left byte for byte."""

import errno
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpumigrate.cli import main
from gpumigrate.codemods import fixed_codes, rules_for
from gpumigrate.rewriter import files, run
from gpumigrate.rewriter.run import process_path, write_result
from tests.conftest import ROOT

CUDA = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
MIGRATED = "model = torch.nn.Linear(2, 2).to(device)"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def errors(result) -> list:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def state(root: Path) -> dict:
    """Every entry below `root`: kind, bytes, inode and mtime (a rewrite with equal bytes shows too)."""
    out = {}
    for p in sorted(root.rglob("*")):
        info = p.lstat()
        out[p] = (stat.S_IFMT(info.st_mode), info.st_ino, info.st_mtime_ns,
                  p.read_bytes() if stat.S_ISREG(info.st_mode) else os.readlink(p) if p.is_symlink() else None)
    return out


def migration(path: Path):
    rules = rules_for("device")
    return process_path(str(path), rules, [r.code for r in rules if r.code in fixed_codes("device")])


@pytest.fixture
def no_hang():
    """A read of a FIFO blocks forever: fail instead."""
    def alarm(*_):
        raise TimeoutError("gpumigrate hung")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- lost updates

@pytest.mark.parametrize("edit", ["append", "same size and mtime"])
def test_a_file_changed_after_it_was_read_is_left_as_it_is(tmp_path, edit):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    result = migration(path)
    assert result.changed
    if edit == "append":
        path.write_text(CUDA + "print('mine')\n")
    else:  # only the hash can tell
        before = path.stat()
        path.write_text(CUDA.replace("2, 2", "3, 3"))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    mine = path.read_bytes()
    write_result(result)
    assert result.error == f"{path}: changed while gpumigrate was running; left as it is"
    assert path.read_bytes() == mine
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temp file left


def test_a_file_deleted_after_it_was_read_is_not_recreated(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    result = migration(path)
    path.unlink()
    write_result(result)
    assert "changed while gpumigrate was running" in result.error
    assert list(tmp_path.iterdir()) == []


def test_the_cli_reports_a_lost_update_and_writes_the_other_files(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text(CUDA)
    (tmp_path / "b.py").write_text(CUDA)
    real = run.write_result

    def edited_meanwhile(result, *args, **kwargs):  # in the parent, whatever the workers
        if result.path.endswith("a.py"):
            with open(result.path, "a") as handle:
                handle.write("# edited in the editor\n")
        real(result, *args, **kwargs)

    monkeypatch.setattr(run, "write_result", edited_meanwhile)
    result = cli(tmp_path)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {tmp_path / 'a.py'}: changed while gpumigrate was running; left as it is"]
    assert (tmp_path / "a.py").read_text() == CUDA + "# edited in the editor\n"
    assert MIGRATED in (tmp_path / "b.py").read_text()


def test_an_unchanged_file_is_written(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    result = migration(path)
    write_result(result)
    assert result.error is None and MIGRATED in path.read_text()


# ---------------------------------------------------------------- dry runs write nothing

@pytest.mark.parametrize("args", [["--check"], ["--diff"], ["--to", "ddp", "--check"], ["--to", "ddp", "--diff"],
                                  ["--diff", "--vendor-runtime", "vendored"], ["--check", "--report", "r.md"]],
                         ids=str)
def test_check_and_diff_never_write_a_user_file(tmp_path, monkeypatch, args):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(CUDA + "for x in loader:\n    loss = model(x.cuda())\n")
    (tmp_path / "src" / "nb.ipynb").write_text(
        '{"cells": [{"cell_type": "code", "metadata": {}, "source": ["import torch\\n", "x.cuda()\\n"], '
        '"outputs": [], "execution_count": null}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    monkeypatch.chdir(tmp_path)
    before = state(tmp_path)
    result = cli("src", *args)
    assert result.exit_code == (1 if "--check" in args else 0), result.output
    after = state(tmp_path)
    if "--report" in args:  # the report, and only the report, is written
        assert after.pop(tmp_path / "r.md")
    assert after == before


@pytest.mark.parametrize("args", [["lint"], ["lint", "--fix", "--diff"]])
def test_lint_without_fix_or_with_diff_never_writes(tmp_path, args):
    (tmp_path / "train.py").write_text(CUDA + "import torch.nn.functional as F\nprint(F.nll_loss(o, y).data[0])\n")
    before = state(tmp_path)
    result = cli(args[0], tmp_path, *args[1:])
    assert result.exit_code == (0 if "--fix" in args else 1) and ".cuda()" in result.stdout
    assert state(tmp_path) == before


def test_a_report_onto_a_link_to_an_input_is_refused(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    (tmp_path / "report.md").symlink_to(path)
    before = state(tmp_path)
    result = cli(path, "--report", tmp_path / "report.md")
    assert result.exit_code == 2 and "one of the inputs" in result.output
    assert state(tmp_path) == before


# ---------------------------------------------------------------- -o onto what is there

@pytest.mark.parametrize("make, why", [
    (lambda out: os.mkfifo(out), "not a regular file (a FIFO)"),
    (lambda out: out.symlink_to("missing/new.py"), "a symbolic link to a missing file"),
])
def test_output_onto_a_fifo_or_a_link_to_nothing_is_refused(tmp_path, make, why):
    (tmp_path / "t.py").write_text(CUDA)
    make(tmp_path / "out.py")
    before = state(tmp_path)
    result = cli(tmp_path / "t.py", "-o", tmp_path / "out.py")
    assert result.exit_code == 2
    assert errors(result) == [f"error: {tmp_path / 'out.py'}: cannot write: {why}"]
    assert state(tmp_path) == before


def test_output_onto_a_device_is_refused(tmp_path):
    (tmp_path / "t.py").write_text(CUDA)
    (tmp_path / "out.py").symlink_to("/dev/null")
    result = cli(tmp_path / "t.py", "-o", tmp_path / "out.py")
    assert result.exit_code == 2
    assert errors(result) == [f"error: {tmp_path / 'out.py'}: cannot write: not a regular file (a character device)"]
    assert os.readlink(tmp_path / "out.py") == "/dev/null" and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_output_onto_a_read_only_file_is_refused_as_in_place(tmp_path):
    (tmp_path / "t.py").write_text(CUDA)
    out = tmp_path / "out.py"
    out.write_text("keep me\n")
    out.chmod(0o444)
    result = cli(tmp_path / "t.py", "-o", out)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {out}: cannot write: file is read-only"]
    assert out.read_text() == "keep me\n" and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_output_onto_a_link_writes_through_to_its_target(tmp_path):
    (tmp_path / "t.py").write_text(CUDA)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "out.py").write_text("old\n")
    (tmp_path / "real" / "out.py").chmod(0o640)
    (tmp_path / "out.py").symlink_to("real/out.py")
    result = cli(tmp_path / "t.py", "-o", tmp_path / "out.py")
    assert result.exit_code == 0, result.output
    assert os.readlink(tmp_path / "out.py") == "real/out.py"
    assert MIGRATED in (tmp_path / "real" / "out.py").read_text()
    assert stat.S_IMODE((tmp_path / "real" / "out.py").stat().st_mode) == 0o640  # an existing file keeps its mode
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["out.py"]
    assert (tmp_path / "t.py").read_text() == CUDA


def test_output_onto_the_input_itself_checks_for_lost_updates(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    result = migration(path)
    path.write_text("mine\n")
    write_result(result, str(path))
    assert "changed while gpumigrate was running" in result.error and path.read_text() == "mine\n"


# ---------------------------------------------------------------- links in place

def test_a_symlinked_script_is_migrated_through_the_link(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "shared.py").write_text(CUDA)
    (tmp_path / "proj" / "train.py").symlink_to("../shared.py")
    result = cli(tmp_path / "proj" / "train.py")
    assert result.exit_code == 0, result.output
    assert os.readlink(tmp_path / "proj" / "train.py") == "../shared.py"
    assert MIGRATED in (tmp_path / "shared.py").read_text()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["proj", "shared.py", "train.py"]


def test_a_hard_linked_script_keeps_its_links(tmp_path):
    path, other = tmp_path / "train.py", tmp_path / "copy.py"
    path.write_text(CUDA)
    path.chmod(0o755)
    os.link(path, other)
    inode = path.stat().st_ino
    result = cli(path)
    assert result.exit_code == 0, result.output
    assert path.stat().st_ino == inode and path.stat().st_nlink == 2
    assert MIGRATED in other.read_text() and other.read_text() == path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.py", "train.py"]


def test_a_hard_link_write_that_fails_keeps_the_rewrite_in_the_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    os.link(path, tmp_path / "copy.py")
    result = migration(path)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    write_result(result)
    monkeypatch.undo()
    (tmp,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert result.error == f"{path}: cannot write: No space left on device; the rewrite is in {tmp}"
    assert tmp.read_bytes() == result.new_source
    assert path.read_text() == CUDA  # the failed write never reached it


# ---------------------------------------------------------------- temp files

def test_stale_temp_files_of_the_written_file_are_removed(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    old = time.time() - 3600
    names = {
        ".train.py.abcd_123.tmp": False,   # a killed run's: removed
        ".train.py.fresh123.tmp": True,    # maybe a running one's
        ".train.py.abc.tmp": True,         # not mkstemp's name
        ".other.py.abcd1234.tmp": True,    # another file's
        "train.py.abcd1234.tmp": True,
        ".train.py.abcd1234.tmp.bak": True,
    }
    for name in names:
        (tmp_path / name).write_text("x")
        if name != ".train.py.fresh123.tmp":
            os.utime(tmp_path / name, (old, old))
    (tmp_path / ".train.py.linkxxxx.tmp").symlink_to(path)  # not a regular file: kept
    os.utime(tmp_path / ".train.py.linkxxxx.tmp", (old, old), follow_symlinks=False)
    assert cli(path).exit_code == 0
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([n for n, keep in names.items() if keep] + ["train.py", ".train.py.linkxxxx.tmp"])


def test_the_temp_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(CUDA)
    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        fsync(fd)

    def record_replace(a, b):
        events.append("replace")
        replace(a, b)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    files.write_atomic(str(path), b"x = 1\n")
    assert events == ["fsync file", "replace", "fsync dir"]
    assert path.read_bytes() == b"x = 1\n"


# ---------------------------------------------------------------- what is read

def test_a_fifo_named_on_the_command_line_is_an_error_not_a_hang(tmp_path, no_hang):
    os.mkfifo(tmp_path / "train.py")
    result = cli(tmp_path / "train.py")
    assert result.exit_code == 2
    assert errors(result) == [f"error: {tmp_path / 'train.py'}: skipped: not a regular file (a FIFO)"]
    assert stat.S_ISFIFO(os.lstat(tmp_path / "train.py").st_mode)


def _capped_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("command", [[], ["lint"]])
def test_a_link_to_dev_zero_is_not_read(tmp_path, command):
    (tmp_path / "train.py").symlink_to("/dev/zero")
    # In a process of its own with capped memory: reading /dev/zero is one C call that no
    # alarm interrupts, and it takes all the memory there is.
    done = subprocess.run([sys.executable, "-m", "gpumigrate", *command, str(tmp_path / "train.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_capped_memory,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2, done.stderr[-500:]
    assert done.stderr.splitlines()[0] == \
        f"error: {tmp_path / 'train.py'}: skipped: not a regular file (a character device)"


def test_directories_pass_over_fifos(tmp_path, no_hang):
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "train.py").write_text(CUDA)
    result = cli(tmp_path)
    assert result.exit_code == 0, result.output
    assert MIGRATED in (tmp_path / "train.py").read_text()
    assert "pipe.py" not in result.output


def test_a_file_over_the_default_limit_is_skipped(tmp_path):
    path = tmp_path / "big.py"
    path.write_bytes(CUDA.encode() + b"x = 1\n" * 2_050_000)  # 12.3 MB
    before = state(tmp_path)
    result = cli(path)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {path}: skipped: 12.3 MB is over the 10 MB limit (max-file-size)"]
    assert state(tmp_path) == before


@pytest.mark.parametrize("command", [[], ["lint", "--fix"]])
def test_max_file_size_is_configurable(tmp_path, command):
    (tmp_path / "pyproject.toml").write_text("[tool.gpumigrate]\nmax-file-size = 2_000\n")
    (tmp_path / "small.py").write_text(CUDA)
    (tmp_path / "big.py").write_text(CUDA + "x = 1\n" * 600)
    before = (tmp_path / "big.py").read_bytes()
    result = cli(*command, tmp_path)
    assert result.exit_code == 2
    assert errors(result) == [f"error: {tmp_path / 'big.py'}: skipped: 3.6 KB is over the 2 KB limit (max-file-size)"]
    assert (tmp_path / "big.py").read_bytes() == before
    assert MIGRATED in (tmp_path / "small.py").read_text()


@pytest.mark.parametrize("value", ['"10MB"', "0", "-1", "true", "1.5"])
def test_a_bad_max_file_size_is_one_line(tmp_path, value):
    (tmp_path / "pyproject.toml").write_text(f"[tool.gpumigrate]\nmax-file-size = {value}\n")
    (tmp_path / "t.py").write_text(CUDA)
    result = cli(tmp_path / "t.py")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'pyproject.toml'}: [tool.gpumigrate] max-file-size must be a positive number of bytes"]
    assert (tmp_path / "t.py").read_text() == CUDA
