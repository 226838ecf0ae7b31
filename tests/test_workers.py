"""Worker processes end with the run that started them, however it ends, and a file that takes
longer than the per-file limit is that file's error while the others go on."""

import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from gpumigrate import cli
from gpumigrate.codemods import fixed_codes, rules_for
from gpumigrate.rewriter.workers import Task, one_pass, process_tasks
from tests.conftest import ROOT

CUDA = "import torch\nmodel = torch.nn.Linear(2, 2).cuda()\n"
SLOW = "SLOW = (\n"  # CPython refuses it, so the repairs run on it: Sleeper's is the slow one


class Sleeper:
    """A test-only repair (repairs run on files CPython refuses) that never finishes on a
    file that says SLOW: a pathological file. Sent to the workers by name."""

    code = "GM999"

    @classmethod
    def repair(cls, text):
        if "SLOW" in text:
            time.sleep(600)
        return None


@pytest.mark.slow
def test_a_file_over_the_time_limit_is_its_error_and_the_others_go_on():
    rules, fix = tuple(rules_for("device")), tuple(fixed_codes("device"))
    sources = [CUDA, SLOW, CUDA, CUDA]
    tasks = [Task(f"f{i}.py", one_pass(rules, fix), repairs=(Sleeper,), source=s.encode()) for i, s in enumerate(sources)]
    start = time.monotonic()
    results = list(process_tasks(tasks, jobs=2, timeout=2))
    assert time.monotonic() - start < 60
    assert [r.path for r in results] == ["f0.py", "f1.py", "f2.py", "f3.py"]
    assert results[1].error == "f1.py: skipped: took longer than 2 s (file-timeout); file left unchanged"
    assert all(r.error is None and r.changed for i, r in enumerate(results) if i != 1)


@pytest.mark.slow
def test_file_timeout_is_configurable_and_the_cli_goes_on(tmp_path, monkeypatch):
    real = cli._repairs
    monkeypatch.setattr(cli, "_repairs", lambda: [*real(), Sleeper])
    (tmp_path / "pyproject.toml").write_text("[tool.gpumigrate]\nfile-timeout = 1.5\n")
    for name, text in (("a.py", CUDA), ("slow.py", SLOW), ("b.py", CUDA)):
        (tmp_path / name).write_text(text)
    run = CliRunner().invoke(cli.main, [str(tmp_path), "--to", "device", "--no-cache"])
    assert run.exit_code == 2
    slow = tmp_path / "slow.py"
    assert f"error: {slow}: skipped: took longer than 1.5 s (file-timeout); file left unchanged" in run.output
    assert slow.read_text() == SLOW
    assert ".to(device)" in (tmp_path / "a.py").read_text() and ".to(device)" in (tmp_path / "b.py").read_text()
    assert "2 files changed" in run.output and "1 error" in run.output


# A run whose workers are busy for ten minutes; the test kills the run, not them.
BUSY_RUN = """\
import sys, time
sys.path.insert(0, sys.argv[1])
from gpumigrate.rewriter.workers import Task, one_pass, process_tasks

class Sleeper:
    code = "GM999"

    @classmethod
    def repair(cls, text):
        time.sleep(600)

tasks = [Task("f{}.py".format(i), (((), ()),), repairs=(Sleeper,), source=b"SLOW = (\\n") for i in range(2)]
list(process_tasks(tasks, jobs=2))
"""


def _children(pid: int) -> list:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the workers in /proc")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_workers_end_when_their_parent_is_killed(tmp_path, how):
    script = tmp_path / "busy_run.py"
    script.write_text(BUSY_RUN)
    parent = subprocess.Popen([sys.executable, str(script), str(ROOT)], start_new_session=True)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while len(_children(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(parent.pid)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(0.5)  # both are in their ten-minute file
        parent.send_signal(how)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_running, workers)), "orphaned workers run on"
    finally:
        for pid in [*workers, *_children(parent.pid), parent.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
