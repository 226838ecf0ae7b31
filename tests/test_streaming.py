"""Results stream: each file's lines come as it is done, in input order, and a terminal shows a
status line under them (issue 20: a 126-file run printed nothing for 157 s, then everything)."""

import os
import pty
import subprocess
import sys
import time

from gpumigrate.codemods import fixed_codes, rules_for
from gpumigrate.rewriter.workers import Task, one_pass, process_tasks
from tests.conftest import ROOT
from tests.test_workers import CUDA, SLOW, Sleeper


def test_the_first_file_is_reported_while_larger_later_files_still_run():
    """Two large files that never finish follow a small one: with 2 workers, the small one's
    result comes at once (largest-first scheduling started the two large ones first, and
    the first line waited for their time limit)."""
    rules, fix = tuple(rules_for("device")), tuple(fixed_codes("device"))
    big_slow = SLOW + "#" * 20_000 + "\n"
    sources = [CUDA, big_slow, big_slow, CUDA]
    tasks = [Task(f"f{i}.py", one_pass(rules, fix), repairs=(Sleeper,), source=s.encode()) for i, s in enumerate(sources)]
    start = time.monotonic()
    results = process_tasks(tasks, jobs=2, timeout=30)
    try:
        first = next(results)
        waited = time.monotonic() - start
    finally:
        results.close()  # kills the sleeping workers
    assert first.path == "f0.py" and first.error is None and first.changed
    assert waited < 15, f"the first result took {waited:.1f} s: it waited for the slow files"


def _run_on_a_terminal(args, cwd):
    """Run the CLI with its standard error on a pseudo-terminal; (stdout, what the terminal got)."""
    primary, secondary = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "gpumigrate", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=secondary, stdin=subprocess.DEVNULL)
    os.close(secondary)
    got = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        got += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(primary)
    return proc.returncode, out.decode(), got.decode()


def test_a_terminal_gets_a_status_line_erased_before_each_result(tmp_path):
    for i in range(3):
        (tmp_path / f"s{i}.py").write_text(CUDA)
    code, out, tty = _run_on_a_terminal(["lint", ".", "--no-cache", "--select", "GM101", "-j", "1"], tmp_path)
    assert code == 1
    assert "linting 0/3" in tty and "linting 3/3" in tty
    assert tty.rstrip("\r\n").endswith("\x1b[K") or "findings" in tty.split("\x1b[K")[-1]
    # the findings themselves (on stdout, not a terminal) carry no status-line bytes
    assert "\x1b" not in out and out.count("GM101") == 3
    assert [line.split(":")[0] for line in out.splitlines()] == ["s0.py", "s1.py", "s2.py"]


def test_no_status_line_without_a_terminal(tmp_path):
    for i in range(3):
        (tmp_path / f"s{i}.py").write_text(CUDA)
    run = subprocess.run([sys.executable, "-m", "gpumigrate", "lint", ".", "--no-cache", "--select", "GM101"],
                         cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "\x1b" not in run.stderr and "linting" not in run.stderr
    assert run.stdout.count("GM101") == 3
