"""A runtime that never hangs a job whose ranks are all alive: when every rank has waited
GPUMIGRATE_DIST_TIMEOUT seconds in collectives that do not match, every rank says where each
waits and ends. See gpumigrate/runtime/stalls.py.

Each run sets GPUMIGRATE_DIST_TIMEOUT to 5 seconds and waits at most HARD_TIMEOUT for its
processes: without the stall handling gloo waits 30 minutes in these runs.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from gpumigrate import runtime
from tests.test_runtime import internals, rt  # noqa: F401 (rt: a fixture)
from tests.test_runtime_failures import ABORT_SIGNS, HARD_TIMEOUT, run  # noqa: F401 (run: a fixture)

SCRIPT = """\
import sys, time

import torch
import torch.distributed as dist

from gpumigrate.runtime import barrier, get_rank, setup_distributed, wrap_model

mode = sys.argv[1]
setup_distributed()
rank = get_rank()
if mode == "skipped-barrier":  # rank 0 raised, and the handler skipped the barrier
    try:
        if rank == 0:
            raise OSError("no checkpoint to resume from")
        dist.barrier()  # @barrier
    except OSError:
        pass
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))  # @ddp
elif mode == "extra-step":  # rank 0 takes one more step; rank 1 waits at exit (finish())
    model = wrap_model(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3 + (rank == 0)):
        loss = model(torch.randn(8, 16)).pow(2).mean()  # @forward (DDP broadcasts the BatchNorm buffers)
        opt.zero_grad()
        loss.backward()
        opt.step()
elif mode == "all_reduce-barrier":
    if rank == 0:
        dist.all_reduce(torch.ones(3))  # @all_reduce
    else:
        dist.barrier()  # @other-barrier
elif mode == "long-wait":  # rank 0 evaluates or saves for longer than the timeout; rank 1 waits
    if rank == 0:
        time.sleep(12)
    barrier()
sys.stdout.write(f"rank {rank} done\\n")  # one write: two ranks share the pipe
sys.stdout.flush()
"""

STALLED = "gpumigrate.runtime: the ranks wait in collectives that do not match: "


def line(mark: str) -> str:
    """`train.py:N`, N the line of SCRIPT marked `# @mark`."""
    (number,) = [n for n, text in enumerate(SCRIPT.splitlines(), 1) if text.endswith(f"# @{mark}")
                 or f"# @{mark} " in text]
    return f"train.py:{number}"


@pytest.fixture
def stalls_run(tmp_path, run):
    """test_runtime_failures' `run` fixture (HARD_TIMEOUT, SIGTERM first, `.elapsed`) with this
    SCRIPT. A run that stops takes 12 to 20 s here: startup (more under load), the 5 s, a look or two."""
    (tmp_path / "train.py").write_text(SCRIPT)
    return run


# Where each rank of each mode waits, as the line every rank prints names it.
WHERE = {
    "skipped-barrier": f"rank 0 at {line('ddp')} (DistributedDataParallel.__init__), "
                       f"rank 1 at {line('barrier')} (barrier)",
    "extra-step": f"rank 0 at {line('forward')} (DistributedDataParallel.forward), "
                  "rank 1 at the end of train.py (cleanup_distributed)",
    "all_reduce-barrier": f"rank 0 at {line('all_reduce')} (all_reduce), rank 1 at {line('other-barrier')} (barrier)",
}
# The collective of a rank that ends after another fails ("Connection closed by peer"): no
# traceback of it may bury the lines.
TRACEBACKS = re.compile(r"\[rank\d\]:|Connection closed|Traceback \(most recent call last\):\n  File \"/[^\n]*train.py")


@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("mode", ["skipped-barrier", "extra-step"])
def test_under_torchrun_ranks_waiting_in_collectives_that_do_not_match_say_where_and_stop(stalls_run, mode):
    code, stdout, stderr = stalls_run("torchrun", mode)
    assert code is not None, f"torchrun hung (killed after {HARD_TIMEOUT} s)\n{stderr[-3000:]}"
    assert code == 1 and stalls_run.elapsed < 30, stderr[-3000:]
    said = [text for text in stderr.splitlines() if "gpumigrate.runtime" in text]
    assert sorted(said) == [f"{STALLED}{WHERE[mode]}; stopping rank {rank}" for rank in (0, 1)], stderr[-3000:]
    assert "rank 0 done" not in stdout and not ABORT_SIGNS.search(stderr), stderr[-3000:]
    assert not TRACEBACKS.search(stderr), stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.ddp
def test_without_an_agent_every_rank_says_where_and_exits_with_status_1(stalls_run):
    """As under srun: rank 0's process holds the store, and each rank's own status is seen."""
    results = stalls_run("ranks", "all_reduce-barrier")
    assert None not in [code for code, _, _ in results], f"a rank hung (killed after {HARD_TIMEOUT} s)\n{results}"
    assert stalls_run.elapsed < 30, results
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 1 and stdout == "", results
        assert stderr.strip() == f"{STALLED}{WHERE['all_reduce-barrier']}; stopping rank {rank}", results


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_rank_that_works_longer_than_the_timeout_while_the_other_waits_stops_no_one(stalls_run):
    code, stdout, stderr = stalls_run("torchrun", "long-wait")
    assert code == 0, stderr[-3000:]
    assert sorted(stdout.split("\n")) == ["", "rank 0 done", "rank 1 done"]
    assert "gpumigrate.runtime" not in stderr, stderr[-3000:]


# ----------------------------------------------------------------- in one process

# Stand-ins for torch's modules: what matters is the module a frame runs in (its __name__).
FAKE_TORCH = """\
import functools, time

def _logged(fn):  # as c10d wraps its collectives
    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)
    return wrapper

@_logged
def barrier(seconds, busy):
    _wait(seconds, busy)

def _wait(seconds, busy):
    if busy:  # computing: a backward on the CPU
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(i * i for i in range(1000))
    else:  # blocked in C++: the innermost Python frame stays here
        time.sleep(seconds)
"""


def stalls_module(rt):
    """Where the stall handling lives: the package's `stalls` module, or the vendored module."""
    return rt.stalls if rt is runtime else rt


def in_thread(module: str, busy: bool = False) -> threading.Thread:
    """A thread of this file's code that calls `barrier` of a module named `module` for a second."""
    namespace = {"__name__": module}
    exec(compile(FAKE_TORCH, f"/fake/{module.replace('.', '/')}.py", "exec"), namespace)

    def script():
        namespace["barrier"](1.0, busy)  # @script

    thread = threading.Thread(target=script, daemon=True)
    thread.start()
    time.sleep(0.05)
    return thread


def test_the_place_is_the_scripts_line_and_what_it_called(rt):
    place, _ = stalls_module(rt).waiting_place(in_thread("torch.distributed.fake"))
    (number,) = [n for n, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# @script")]
    assert place == (f"test_runtime_stalls.py:{number}", "barrier")


@pytest.mark.parametrize("module", ["torch.nn.modules.module", "torch.distributed.checkpoint.fake", "user"])
def test_no_place_outside_the_calls_that_wait_for_other_ranks(rt, module):
    """A layer's forward, distributed checkpointing (file writes), the script's own sleep."""
    assert stalls_module(rt).waiting_place(in_thread(module)) is None


@pytest.mark.parametrize("busy", [False, True])
def test_a_thread_blocked_in_torch_is_stalled_and_one_computing_is_not(rt, busy):
    stalls = stalls_module(rt).Stalls(0, 2, 5.0, "gpumigrate/0/")
    stalls.main = in_thread("torch.autograd.fake", busy)
    stalls._stalled()
    time.sleep(0.5)
    place, seconds = stalls._stalled()
    assert place is not None and place.call == "barrier"
    assert (seconds < 0.1) if busy else (seconds >= 0.5)


class Stalled:
    """A stand-in for Stalls._stalled: stalled at `place` for `seconds` (0: not stalled)."""

    def __init__(self, place):
        self.place, self.seconds = place, 0.0

    def __call__(self):
        return (self.place if self.seconds else None), self.seconds


def ranks(rt, *places):
    """A Stalls per rank, each stalled at its (where, call) of `places`."""
    out = []
    for rank, place in enumerate(places):
        stalls = stalls_module(rt).Stalls(rank, len(places), 5.0, "gpumigrate/0/")
        stalls._stalled = Stalled(stalls_module(rt).Place(*place))
        out.append(stalls)
    return out


def advance(all_ranks, seconds):
    for stalls in all_ranks:
        stalls._stalled.seconds = seconds


def test_every_rank_stalled_for_the_timeout_at_places_that_differ_is_a_verdict(rt):
    import torch.distributed as dist

    store = dist.HashStore()
    zero, one = ranks(rt, ("train.py:41", "DistributedDataParallel.__init__"), ("train.py:37", "barrier"))
    advance([zero, one], 3.0)
    assert zero.look(store) is None and one.look(store) is None
    assert not store.check(["gpumigrate/0/stalled/0"])  # nothing written long before the timeout
    advance([zero, one], 4.0)
    assert zero.look(store) is None and one.look(store) is None  # published, not yet long enough
    advance([zero, one], 5.0)
    assert zero.look(store) is None  # rank 1 has not said 5 s yet: its value might be stale
    assert one.look(store) == ("rank 0 at train.py:41 (DistributedDataParallel.__init__), "
                               "rank 1 at train.py:37 (barrier)")
    # A rank that goes on clears its key; the other is then not confirmed.
    zero._stalled.seconds = 0.0
    assert zero.look(store) is None and store.get("gpumigrate/0/stalled/0") == b""
    advance([one], 9.0)
    assert one.look(store) is None


def test_ranks_stalled_at_one_place_or_with_a_stale_value_are_no_verdict(rt):
    import torch.distributed as dist

    store = dist.HashStore()
    same = ranks(rt, ("train.py:9", "all_reduce"), ("train.py:9", "all_reduce"))  # a slow collective
    for seconds in (4.0, 5.0, 6.0, 7.0):
        advance(same, seconds)
        assert [s.look(store) for s in same] == [None, None]
    store = dist.HashStore()
    zero, one = ranks(rt, ("train.py:41", "barrier"), ("train.py:37", "all_reduce"))
    advance([zero, one], 6.0)
    one.look(store)  # rank 1 published once, then its watchdog stopped looking
    for seconds in (6.0, 7.0, 8.0):
        zero._stalled.seconds = seconds
        assert zero.look(store) is None


def test_a_verdict_is_posted_where_a_failure_would_be_and_every_rank_sees_it(monkeypatch, rt):
    import torch.distributed as dist

    rd = internals(rt)
    monkeypatch.setattr(rd.dist, "is_initialized", lambda: True)
    store = dist.HashStore()
    zero, one = rd._Watch(0, 2, 5.0, store), rd._Watch(1, 2, 5.0, store)
    one.stalls = None
    zero.stalls = type("Verdict", (), {"look": lambda self, store: "rank 0 at a.py:1 (x), rank 1 at b.py:2 (y)"})()
    assert one._look() and not zero._look()
    assert zero.stalled == "rank 0 at a.py:1 (x), rank 1 at b.py:2 (y)" and zero.peer_failure is None
    assert not one._look() and one.stalled == zero.stalled and one.peer_failure is None
    # A failure announced first wins: the failed rank's traceback says more.
    store = dist.HashStore()
    store.set("gpumigrate/0/ended", "1\tRuntimeError: boom")
    first = rd._Watch(0, 2, 5.0, store)
    first.stalls = zero.stalls
    assert not first._look() and first.stalled is None and first.peer_failure[:2] == ("1", "RuntimeError: boom")
