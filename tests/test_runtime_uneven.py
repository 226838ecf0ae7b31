"""Ranks that take different numbers of optimizer steps (gpumigrate/runtime/uneven.py).

Under `torchrun --standalone --nproc_per_node=2` (gloo, CPU), models NOT given to `wrap_model`:
rank 1 trains longer than rank 0, as a replay buffer that fills later or longer episodes make
it, and calls `reduce_sum`, `barrier` and `broadcast_object` after rank 0 has finished. Both
ranks must exit 0; the shared steps must equal one process on both ranks' batches, and rank 1's
extra steps one process on rank 1's batches alone (the average over the ranks still running).
Ranks that step different optimizers at the same time must both stop with one error that says
what each rank was doing, not hang or average one model's gradients into another's.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import List

import pytest
import torch
from torch import nn

from tests.conftest import FIXTURES
from tests.probe_runs import NPROC, run_probe
from tests.test_runtime import torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.ddp]

SHARED, EXTRA = 3, 4  # steps both ranks take; steps rank 1 takes after rank 0 has finished


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{step}".encode()))
    return torch.randn(4, 6, generator=g)


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()])


def step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


RUNNER = """\
import atexit, os, sys, threading
import torch
from gpumigrate.runtime import barrier, broadcast_object, get_rank, reduce_sum, setup_distributed
from tests.test_runtime_uneven import EXTRA, SHARED, batch, flat, model, step

threading.Thread(target=lambda: (threading.Event().wait(90), os._exit(3)), daemon=True).start()
out = sys.argv[1]
# registered before setup_distributed's cleanup, so run after it: the weights each rank ends with
atexit.register(lambda: torch.save(flat(net), os.path.join(out, "end{}.pt".format(rank))))
setup_distributed()
rank = get_rank()
net = model(100 + rank)  # different weights per rank: the first step must broadcast rank 0's
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
other_net = model(7)
other = torch.optim.SGD(other_net.parameters(), lr=0.1)

def main():
    record = {}
    if sys.argv[2] == "late":  # rank 0 never steps (a replay buffer that never filled there)
        for k in range(SHARED if rank == 1 else 0):
            step(net, opt, batch(rank, k))
        return
    if sys.argv[2] == "phases":  # rank 0 steps `opt` twice more; then both ranks train `other`
        for k in range(SHARED + (2 if rank == 0 else 0)):
            step(net, opt, batch(rank, k))
        for k in range(3):
            step(other_net, other, batch(rank, 10 + k))
        torch.save({"net": flat(net), "other": flat(other_net)}, os.path.join(out, "rank{}.pt".format(rank)))
        return
    if sys.argv[2] == "skew":  # rank 0 steps `opt`, rank 1 `other`: a program whose ranks disagree
        step(net, opt, batch(rank, 0)) if rank == 0 else step(other_net, other, batch(rank, 0))
    for k in range(SHARED + (EXTRA if rank == 1 else 0)):
        step(net, opt, batch(rank, k))
        record["step{}".format(k)] = flat(net)
        if k == SHARED:  # rank 0 has finished by now
            record["sum"] = torch.tensor(reduce_sum(5.0))
            barrier()
            record["object"] = torch.tensor(broadcast_object([rank, 11], src=1))
    torch.save(record, os.path.join(out, "rank{}.pt".format(rank)))

main()  # the optimizer and model of rank 0 stay alive, but the finish does not need them
"""


def _reference() -> List[torch.Tensor]:
    """One process: rank 0's initial weights, SHARED steps on both ranks' batches (equal
    halves: the mean of the two means), then EXTRA steps on rank 1's batches alone."""
    net = model(100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = []
    for k in range(SHARED + EXTRA):
        x = torch.cat([batch(0, k), batch(1, k)]) if k < SHARED else batch(1, k)
        step(net, opt, x)
        out.append(flat(net))
    return out


def _run(tmp_path: Path, mode: str):
    script = tmp_path / "uneven.py"
    script.write_text(RUNNER)
    return torchrun(script, str(tmp_path), mode)


def test_a_rank_that_finishes_first_takes_part_until_the_others_finish(tmp_path):
    code, _, stderr = _run(tmp_path, "uneven")
    assert code == 0, stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected = _reference()
    for k in range(SHARED):
        assert torch.equal(ranks[0][f"step{k}"], ranks[1][f"step{k}"]), f"step {k}: the ranks differ"
        torch.testing.assert_close(ranks[0][f"step{k}"], expected[k], rtol=1e-5, atol=1e-6)
    for k in range(SHARED, SHARED + EXTRA):  # rank 1 alone: the average over the ranks still running
        assert f"step{k}" not in ranks[0]
        torch.testing.assert_close(ranks[1][f"step{k}"], expected[k], rtol=1e-5, atol=1e-6)
    assert float(ranks[1]["sum"]) == 5.0  # rank 0, finished, added nothing
    assert ranks[1]["object"].tolist() == [1, 11]


def test_ranks_that_step_different_optimizers_stop_with_one_error(tmp_path):
    code, _, stderr = _run(tmp_path, "skew")
    assert code not in (0, None), "the ranks disagreed and the run passed (or hung)"
    assert "out of step" in stderr, stderr[-3000:]
    # caught at the first step of each, before any parameters are broadcast
    assert "rank 0 take rank 0's parameters of optimizer #1 at its first step; rank 1 take rank 0's parameters " \
        "of optimizer #2 at its first step" in stderr, stderr[-3000:]


def test_a_rank_ahead_takes_part_in_the_steps_of_the_phase_the_others_are_still_in(tmp_path):
    """Episodes of different lengths, then a second agent (DQN, then double DQN): rank 1 takes
    the second optimizer's first step while rank 0 still steps the first. It takes part in
    those steps first (their mean gradients, its own optimizer), so both ranks start and end
    the second phase with the same weights, and the first model is alike too."""
    code, _, stderr = _run(tmp_path, "phases")
    assert code == 0, stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    net = model(100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for k in range(SHARED + 2):  # the last two on rank 0's batches alone
        step(net, opt, torch.cat([batch(0, k), batch(1, k)]) if k < SHARED else batch(0, k))
    other_net = model(7)
    other = torch.optim.SGD(other_net.parameters(), lr=0.1)
    for k in range(3):
        step(other_net, other, torch.cat([batch(0, 10 + k), batch(1, 10 + k)]))
    for name, expected in (("net", flat(net)), ("other", flat(other_net))):
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name}: the ranks differ"
        torch.testing.assert_close(ranks[0][name], expected, rtol=1e-5, atol=1e-6)


def test_a_rank_that_never_stepped_takes_part_in_the_first_step_and_the_rest(tmp_path):
    """Rank 0 ends before rank 1's first step: it takes part in that step's broadcast of rank
    0's weights, then in each average (its optimizer's plan is made there, with no agreement of
    its own that rank 1 would not answer), and both end with one process's weights on rank 1's
    batches alone."""
    code, _, stderr = _run(tmp_path, "late")
    assert code == 0, stderr[-4000:]
    net = model(100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for k in range(SHARED):
        step(net, opt, batch(1, k))
    ends = [torch.load(tmp_path / f"end{r}.pt") for r in range(2)]
    assert torch.equal(ends[0], ends[1]), "the ranks end with different weights"
    torch.testing.assert_close(ends[1], flat(net), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- a migrated script

def test_migrated_replay_buffer_dqn_runs_to_the_end_under_torchrun(tmp_path):
    """fixtures/scripts/rl_replay_dqn.py: episodes of unseeded random length, training from a
    replay buffer once it is full enough, inside the episode loop. The episode loop is sharded
    by its counter (each rank plays every second episode of the 40, ending on the last), so the
    ranks reach the optimizer step a different number of times; the migrated script (no DDP
    wrap, gradients averaged at the step) must end on both ranks with the same weights, print
    once (every 10th of rank 0's 20 episodes: `n_epi % 10 == 9` counts its own), and save once."""
    golden = FIXTURES / "expected" / "ddp" / "rl_replay_dqn.py"
    assert "wrap_model(" not in golden.read_text()
    one = run_probe(golden, tmp_path / "one", 1)
    assert one.ok(), one.why()
    run = run_probe(golden, tmp_path / "ddp", NPROC)
    assert run.ok(), run.why()
    lines = [l for l in run.ranks[0]["stdout"].splitlines() if l.startswith("episode ")]
    assert len(lines) == 2 and run.ranks[1]["stdout"].strip() == ""
    assert [Path(s["path"]).name for r in run.ranks.values() for s in r["saves"]] == ["dqn_q.pt"]
    optimizers = [run.ranks[r]["optimizers"][0] for r in range(NPROC)]
    assert all(o["steps"] > 0 for o in optimizers)
    # a rank that finished first steps with the other (the mean of its gradients): the same weights
    assert optimizers[0]["steps"] == optimizers[1]["steps"]
    first, second = (torch.load(run.out / f"rank{r}_optim0.pt") for r in range(NPROC))
    assert torch.equal(first, second)
