"""A runtime that never hangs a job: when one rank fails, every rank exits within a bound.

Each run sets GPUMIGRATE_DIST_TIMEOUT to a few seconds and waits at most HARD_TIMEOUT for
its processes (a rank still running then was hanging): without the runtime's failure handling
these runs hang until then. See `_Watch` in gpumigrate/runtime/distributed.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests import test_runtime
from tests.test_runtime import internals, launch_ranks, rt, torchrun  # noqa: F401 (rt: a fixture)

HARD_TIMEOUT = 40  # instead of test_runtime's 120 s: no run here takes more than ~10 s

# The failing rank raises in the middle of an epoch, while the other waits in DDP's all-reduce;
# `writer`, a non-daemon thread that never ends (a logger, a prefetcher), keeps the failed
# process alive: Python waits for it before exit handlers run.
SCRIPT = """\
import sys, threading, time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from gpumigrate.runtime import distributed_sampler, get_rank, setup_distributed, wrap_model

mode, failing = sys.argv[1], int(sys.argv[2])
setup_distributed()
rank = get_rank()
model = wrap_model(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(800, 4))
loader = DataLoader(data, batch_size=8, sampler=distributed_sampler(data))
if mode == "thread" or (mode == "late" and rank == 2):
    threading.Thread(target=time.sleep, args=(1000,), name="writer").start()
for step, (x,) in enumerate(loader):
    if mode == "thread" and step == 5 and rank == failing:
        print("failing at", time.time(), file=sys.stderr, flush=True)
        raise RuntimeError("boom on rank {}".format(rank))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if mode == "late" and rank > 0:
    time.sleep(3)  # still working, without collectives, long after rank 0 has ended
    if rank == 2:
        raise RuntimeError("late failure on rank 2")
if mode == "teardown":
    dist.destroy_process_group = lambda *args, **kwargs: time.sleep(1000)  # a teardown that blocks
sys.stdout.write(f"rank {rank} done\\n")  # one write: two ranks share the pipe
sys.stdout.flush()
"""

# What a rank killed by a signal or a C++ abort leaves in its output (torchrun's summary of a
# rank it stopped with SIGTERM says "exitcode : -15", which is expected here).
ABORT_SIGNS = re.compile(r"terminate called|Fatal Python error|SIGABRT|SIGSEGV")
# What torch prints for a store call after the store's host has gone.
STORE_GONE = re.compile(r"TCPStore|recvValue failed|sendBytes failed|Connection was likely closed")


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Runs SCRIPT with GPUMIGRATE_DIST_TIMEOUT, through test_runtime's `launch_ranks` or
    `torchrun`; `run.ended` holds when each process had ended (time.time(), as the script's
    "failing at"), in the order they were waited for: launch_ranks waits for rank 0 first."""
    ended = []

    def communicate(proc):
        """test_runtime._communicate, with this module's hard timeout, and SIGTERM before
        SIGKILL: torchrun's agent then stops its workers, which run in sessions of their own
        (SIGKILLed, it leaves them running and holding the pipes, and the test hangs)."""
        code = None
        try:
            out, err = proc.communicate(timeout=HARD_TIMEOUT)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        ended.append(time.time())
        return code, out, err

    monkeypatch.setattr(test_runtime, "_communicate", communicate)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def launch(how, mode, failing=1, timeout="5", nproc=2):
        monkeypatch.setenv("GPUMIGRATE_DIST_TIMEOUT", timeout)
        ended.clear()
        start = time.time()
        if how == "ranks":
            results = launch_ranks(script, mode, str(failing), nproc=nproc)
        else:
            results = torchrun(script, mode, str(failing))
        launch.elapsed = time.time() - start
        return results

    launch.ended = ended
    return launch


def details(results) -> str:
    return "\n".join(f"--- rank {r}: exit {c}\n{err[-2000:]}" for r, (c, _, err) in enumerate(results))


def failing_at(stderr: str) -> float:
    return float(re.search(r"failing at ([\d.]+)", stderr).group(1))


@pytest.mark.e2e
@pytest.mark.ddp
def test_torchrun_stops_the_other_rank_when_a_failed_rank_is_kept_alive_by_a_thread(run):
    """The other rank stops on the announcement; torchrun's agent then sees a failure and
    stops the failed one."""
    code, _, stderr = run("torchrun", "thread")
    assert code is not None, f"torchrun hung (killed after {HARD_TIMEOUT} s)\n{stderr[-3000:]}"
    assert code == 1 and run.elapsed < 25, stderr[-3000:]
    assert "RuntimeError: boom on rank 1" in stderr  # the failed rank's traceback, as before
    assert stderr.count("gpumigrate.runtime:") == 1, stderr[-3000:]
    assert "gpumigrate.runtime: rank 1 failed (RuntimeError: boom on rank 1); stopping rank 0" in stderr
    assert not ABORT_SIGNS.search(stderr), stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("failing", [1, 0])  # rank 0's process also holds the store under srun
def test_without_an_agent_the_announcement_stops_the_others_and_the_failed_rank_ends_itself(run, failing):
    results = run("ranks", "thread", failing)
    codes = [code for code, _, _ in results]
    assert None not in codes, f"a rank hung (killed after {HARD_TIMEOUT} s)\n{details(results)}"
    assert codes == [1, 1], details(results)
    other = 1 - failing
    failed_stderr, other_stderr = results[failing][2], results[other][2]
    assert f"RuntimeError: boom on rank {failing}" in failed_stderr, details(results)
    assert other_stderr.rstrip().endswith(
        f"gpumigrate.runtime: rank {failing} failed (RuntimeError: boom on rank {failing}); stopping rank {other}"
    ), details(results)
    assert failed_stderr.rstrip().endswith(
        f"gpumigrate.runtime: rank {failing} failed; exiting after 5 s although non-daemon threads are still "
        "running (writer)"), details(results)
    failed_at = failing_at(failed_stderr)
    # The other rank stops on the announcement (a look a second, then 2 s for an error of its
    # own), well before the failed rank's 5 s are up; launch_ranks waits for rank 0 first, so
    # rank 1's time is only known to be no earlier than rank 0's.
    if other == 0:
        assert run.ended[0] - failed_at < 4.5, details(results)
    assert 5 <= run.ended[failing] - failed_at < 12, details(results)
    for _, _, stderr in results:
        assert not ABORT_SIGNS.search(stderr), details(results)


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_teardown_that_blocks_ends_within_the_timeout(run):
    results = run("ranks", "teardown", timeout="3")
    codes = [code for code, _, _ in results]
    assert None not in codes, f"a rank hung (killed after {HARD_TIMEOUT} s)\n{details(results)}"
    assert codes == [1, 1] and run.elapsed < 20, details(results)
    for rank, (_, stdout, stderr) in enumerate(results):
        assert stdout == f"rank {rank} done\n", details(results)
        assert stderr.rstrip().endswith(
            f"gpumigrate.runtime: rank {rank} could not leave the process group within 3 s; "
            "exiting without waiting longer"), details(results)


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_rank_that_ended_normally_is_never_stopped(run):
    """Rank 0 ends (and under srun its store with it) while ranks 1 and 2 work on for longer
    than the timeout: none is stopped, nor talks to the store once it has gone; rank 2 then
    fails, with a thread that keeps it alive, and ends itself. (Rank 1 alone would pass
    without any failure handling: it guards against a watchdog that stops healthy ranks.)"""
    results = run("ranks", "late", timeout="2", nproc=3)
    codes = [code for code, _, _ in results]
    assert None not in codes, f"a rank hung (killed after {HARD_TIMEOUT} s)\n{details(results)}"
    assert codes == [0, 0, 1], details(results)
    for rank, (_, stdout, stderr) in enumerate(results):
        assert stdout == (f"rank {rank} done\n" if rank < 2 else ""), details(results)
        assert not STORE_GONE.search(stderr) and not ABORT_SIGNS.search(stderr), details(results)
        assert ("gpumigrate.runtime" in stderr) == (rank == 2), details(results)
    assert "RuntimeError: late failure on rank 2" in results[2][2], details(results)
    assert results[2][2].rstrip().endswith(
        "gpumigrate.runtime: rank 2 failed; exiting after 2 s although non-daemon threads are still "
        "running (writer)"), details(results)


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_bad_timeout_is_one_clear_error_on_every_rank(run):
    results = run("ranks", "thread", timeout="soon")
    assert [code for code, _, _ in results] == [1, 1], details(results)
    for _, _, stderr in results:
        assert stderr.rstrip().splitlines()[-1] == (
            "ValueError: GPUMIGRATE_DIST_TIMEOUT='soon': use a positive number of seconds (the default is 60)")


@pytest.mark.parametrize("value, seconds", [(None, 60.0), ("", 60.0), ("5", 5.0), (" 0.5 ", 0.5)])
def test_the_timeout_is_read_from_the_environment(monkeypatch, rt, value, seconds):
    monkeypatch.delenv("GPUMIGRATE_DIST_TIMEOUT", raising=False)
    if value is not None:
        monkeypatch.setenv("GPUMIGRATE_DIST_TIMEOUT", value)
    assert internals(rt)._dist_timeout() == seconds


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "1m"])
def test_a_bad_timeout_is_a_value_error_naming_the_variable(monkeypatch, rt, value):
    monkeypatch.setenv("GPUMIGRATE_DIST_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"^GPUMIGRATE_DIST_TIMEOUT={value!r}: use a positive number of seconds"):
        internals(rt)._dist_timeout()


def test_an_announcement_of_an_earlier_torchrun_attempt_is_ignored(monkeypatch, rt):
    """torchrun's agent keeps its store across restarts (--max-restarts): a restarted rank
    must not be stopped by the failure that ended the attempt before."""
    import torch.distributed as dist

    rd = internals(rt)
    store = dist.HashStore()
    store.set("gpumigrate/0/ended", "1\tRuntimeError: boom")  # attempt 0's announcement
    monkeypatch.setattr(rd.dist, "is_initialized", lambda: True)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = rd._Watch(0, 2, 5.0, store)
    assert restarted._look() and restarted.peer_failure is None  # nothing for attempt 1: look again
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = rd._Watch(0, 2, 5.0, store)
    assert not first._look() and first.peer_failure[:2] == ("1", "RuntimeError: boom")


def test_only_the_exception_that_ends_the_script_is_announced(monkeypatch, rt):
    """A library may show a handled exception with sys.excepthook(...): that is no failure.
    Python sets sys.last_value just before it calls the hook for the one that ends the script."""
    rd = internals(rt)
    printed, failed = [], []

    class Watch:
        pid = os.getpid()
        stalled = None  # no verdict that the ranks wait in collectives that do not match

        def fail(self, exc_type, exc):
            failed.append(exc)

    monkeypatch.setattr(rd, "_watch", Watch())
    monkeypatch.setattr(rd, "_previous_excepthook", lambda *args: printed.append(args[1]))
    handled, ending = ValueError("shown"), RuntimeError("boom")
    rd._excepthook(ValueError, handled, None)
    monkeypatch.setattr(rd.sys, "last_value", ending, raising=False)
    rd._excepthook(RuntimeError, ending, None)
    assert printed == [handled, ending] and failed == [ending]
