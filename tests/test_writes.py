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
    return process_path(str(path), [(rules, [r.code for r in rules if r.code in fixed_codes("device")])])


class Hung(BaseException):
    """Not an OSError (as TimeoutError is): no `except OSError` of the code under test takes it
    for a file that cannot be read."""


@pytest.fixture
def no_hang():
    """A read of a FIFO blocks forever: fail instead."""
    def alarm(*_):
        raise Hung("gpumigrate hung")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(10)
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
    assert result.exit_code == 1 and ".cuda()" in result.stdout  # findings; with --diff, fixes pending
    assert state(tmp_path) == before


def test_a_report_onto_a_link_to_an_input_is_refused(tmp_path):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    (tmp_path / "report.md").symlink_to(path)
    before = state(tmp_path)
    result = cli(path, "--report", tmp_path / "report.md")
    assert result.exit_code == 2 and "one of the inputs" in result.output
    assert state(tmp_path) == before


@pytest.mark.parametrize("args", [[], ["--check"], ["--diff"]])
def test_a_report_onto_a_hard_link_of_an_input_is_refused(tmp_path, args):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    os.link(path, tmp_path / "report.md")
    before = state(tmp_path)
    result = cli(path, *args, "--report", tmp_path / "report.md")
    assert result.exit_code == 2 and f"--report {tmp_path / 'report.md'}: that is one of the inputs" in result.output
    assert state(tmp_path) == before


def test_a_report_onto_a_fifo_is_refused_not_waited_on(tmp_path, no_hang):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    os.mkfifo(tmp_path / "report.md")
    before = state(tmp_path)
    result = cli(path, "--report", tmp_path / "report.md")
    assert result.exit_code == 2 and "not a regular file (a FIFO)" in result.output
    assert state(tmp_path) == before


def test_the_report_is_written_whole_through_a_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "t.py"
    path.write_text(CUDA)
    report = tmp_path / "report.md"
    report.write_text("an older report\n")
    report.chmod(0o640)
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(str(b)), real(a, b))[1])
    assert cli(path, "--report", report).exit_code == 0
    assert str(report) in replaced and report.read_text().startswith("# gpumigrate --to device")
    assert stat.S_IMODE(report.stat().st_mode) == 0o640


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


def test_an_in_place_write_that_fails_puts_the_original_back(tmp_path, monkeypatch):
    """The in-place writer's own logic, in this process, with a disk that fills half-way
    through the write (wherever no small disk can be mounted, this is the full-disk test)."""
    path, tmp = tmp_path / "train.py", tmp_path / ".train.py.x.tmp"
    path.write_bytes(b"old " * 5000)
    tmp.write_bytes(b"new " * 8000)
    real, failed = os.pwrite, []

    def fills_up(fd, data, offset):  # once: the restore that follows finds room again
        if offset >= 12_000 and not failed:
            failed.append(offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bytes(data[:4096]), offset)

    monkeypatch.setattr(os, "pwrite", fills_up)
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: None, raising=False)  # the reservation "worked"
    monkeypatch.setattr(sys, "argv", ["-c", str(path), str(tmp)])
    with pytest.raises(SystemExit) as exited:
        exec(files._WRITE_IN_PLACE, {"__name__": "__main__"})
    assert exited.value.code == "No space left on device" and failed
    assert path.read_bytes() == b"old " * 5000 and tmp.read_bytes() == b"new " * 8000


# ---------------------------------------------------------------- a full disk, SIGKILL

@pytest.fixture
def small_disk(tmp_path):
    """A 512 KB tmpfs, where this user may mount one (root, as in CI); else skip."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (the in-process full-disk test covers the logic)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def big_script(lines: int) -> str:
    return "import torch\n" + "".join(f"x{i} = torch.zeros(3).cuda()\n" for i in range(lines))


def fill(disk: Path, leave: int) -> None:
    """Take the disk's free space down to about `leave` bytes."""
    info = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * max(0, info.f_bavail * info.f_frsize - leave))


@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.parametrize("room", ["none", "for the temp file only"])
@pytest.mark.slow
def test_a_full_disk_leaves_the_original_and_says_where_the_rewrite_is(small_disk, linked, room):
    path = small_disk / "train.py"
    path.write_text(big_script(3000))  # 89 KB; the rewrite, 101 KB
    original = path.read_bytes()
    if linked:
        os.link(path, small_disk / "copy.py")
    fill(small_disk, 8192 if room == "none" else 101_000 + 12_288)
    result = cli(path, "--no-cache")
    temps = [p for p in small_disk.iterdir() if p.name.endswith(".tmp")]
    if not linked and room != "none":  # the temp file is renamed over it: the rewrite fits
        assert result.exit_code == 0 and b".to(device)" in path.read_bytes() and not temps
        return
    assert result.exit_code == 2, result.output
    assert path.read_bytes() == original and "Traceback" not in result.output
    (error,) = errors(result)
    if room != "none":  # the temp file was written; the linked file itself had no room to grow
        (tmp,) = temps
        assert error == f"error: {path}: cannot write: No space left on device; left as it was, the rewrite is in {tmp}"
        assert b".to(device)" in tmp.read_bytes() and (small_disk / "copy.py").read_bytes() == original
    else:  # not even the temp file could be written
        assert error == f"error: {path}: cannot write: No space left on device" and not temps


# A parent whose os.write is slow: where gpumigrate itself wrote into the file, SIGKILL
# half-way left it torn. The in-place write now runs in a process of its own.
SLOW_WRITES = """\
import os, sys, time
real = os.write
def slow(fd, data):
    time.sleep(0.002)
    return real(fd, bytes(data[:256]))
os.write = slow
from gpumigrate.cli import main
sys.argv[0] = "gpumigrate"
main()
"""


def _writers_of(path: Path) -> list:
    """Processes whose command line names `path` (the in-place writer)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if str(path).encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _killed_run(path: Path, when) -> None:
    """`gpumigrate PATH` with slow writes, SIGKILLed when `when(elapsed, bytes now)` says so,
    or at its end; then wait for any writer it left to finish."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITES, str(path), "--no-cache", "-j", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    start = time.monotonic()
    while proc.poll() is None and not when(time.monotonic() - start, path.read_bytes()):
        time.sleep(0.0005)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while _writers_of(path) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def torn(tmp_path):
    """(path, original, rewrite, check): a script, and the check that it is byte for byte one
    of the two after a killed run (and its hard link, if any, too)."""
    path = tmp_path / "train.py"
    original = big_script(600).encode()
    path.write_bytes(original)
    rewrite_path = tmp_path / "expected.out"
    assert cli(path, "--no-cache", "-o", rewrite_path).exit_code == 0
    rewrite = rewrite_path.read_bytes()
    rewrite_path.unlink()

    def check(what: str) -> None:
        now = path.read_bytes()
        assert now in (original, rewrite), f"{what}: a torn file ({len(now)} bytes)"
        if (tmp_path / "copy.py").exists():
            assert (tmp_path / "copy.py").read_bytes() == now
        path.write_bytes(original)

    return path, original, rewrite, check


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the writer process in /proc")
@pytest.mark.slow
def test_sigkill_as_a_hard_linked_file_starts_to_change_leaves_it_whole(torn):
    path, original, _, check = torn
    os.link(path, path.parent / "copy.py")
    for attempt in range(3):
        _killed_run(path, lambda _, now: now != original)
        check(f"attempt {attempt}")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the writer process in /proc")
@pytest.mark.parametrize("linked", [False, True])
@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_the_original_or_the_rewrite(torn, linked):
    import random

    path, original, _, check = torn
    if linked:
        os.link(path, path.parent / "copy.py")
    start = time.monotonic()
    _killed_run(path, lambda elapsed, now: False)  # how long a whole run takes
    whole = time.monotonic() - start
    check("a whole run")
    seed = random.randrange(10**6)
    moments = random.Random(seed).sample(range(1000), 8)
    for moment in moments:
        at = whole * moment / 1000
        _killed_run(path, lambda elapsed, now: elapsed >= at)
        check(f"killed at {at:.3f} s of {whole:.3f} s (seed {seed})")


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
