"""`shard_batches` (gpumigrate/runtime/batches.py), the ranks' random streams parted at the first
training loop (seeding.py), a finished rank stepping with the others (averaging.py), and a
model trained around its DDP wrapper: one `torchrun --standalone --nproc_per_node=2` (gloo) for
every scenario, each rank's records compared with what one process computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_runtime import torchrun
from tests.test_runtime_uneven import batch, flat, model

RUNNER = """\
import os, random, sys, threading
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset
from tqdm import tqdm
from gpumigrate.runtime import cleanup_distributed, get_rank, setup_distributed, shard_batches, shard_loader, wrap_model
from tests.test_runtime_uneven import batch, flat, model

threading.Thread(target=lambda: (threading.Event().wait(120), os._exit(3)), daemon=True).start()
setup_distributed()
rank = get_rank()
try:  # NumPy is not a test dependency (the runtime works without it); its stream is parted when present
    import numpy
except ImportError:
    numpy = None
draw_numpy = lambda: float(numpy.random.rand()) if numpy else float("nan")
torch.manual_seed(0); random.seed(0)
if numpy:
    numpy.random.seed(0)
before = (torch.rand(1).item(), random.random(), draw_numpy())
rec = {"before": torch.tensor(before)}
ds = TensorDataset(torch.arange(22).float())

def values(it):
    return [b[0].tolist() if isinstance(b, (list, tuple)) else b.tolist() if torch.is_tensor(b) else b for b in it]

shuffled = DataLoader(ds, batch_size=4, shuffle=True)
for epoch in range(2):
    rec[f"shuffled{epoch}"] = values(shard_batches(shuffled))
rec["after"] = torch.tensor((torch.rand(1).item(), random.random(), draw_numpy()))
rec["shuffled_len"] = len(shard_batches(shuffled))
rec["range"] = list(shard_batches(range(3, 13)))
rec["range_len"] = len(shard_batches(range(3, 13)))
for it in shard_batches(range(4)):  # a checkpoint holding a step loads with weights_only=True
    torch.save({"iteration": it, "hist": [it]}, os.path.join(sys.argv[1], "step{}.pt".format(rank)))
rec["indices"] = list(shard_batches(range(0, 23, 4), indices=True))
rec["list"] = list(shard_batches(list("abcdefg")))
rec["list_loader"] = shard_loader(list("abcdefg"))  # kept, to be iterated again
rec["tuple_eval"] = shard_loader(tuple("abc"), pad=False)
rec["generator"] = list(shard_batches(x * x for x in range(7)))

class Buckets(BatchSampler):  # a batch sampler of the project's own: its batches dealt out
    pass

rec["batch_sampler"] = values(shard_batches(DataLoader(ds, batch_sampler=Buckets(SequentialSampler(ds), 5, False))))

class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(9))

rec["iterable"] = values(shard_batches(DataLoader(Stream(), batch_size=2)))
rec["tqdm_inside"] = list(tqdm(shard_batches(range(9)), disable=True))
bar = tqdm(DataLoader(ds, batch_size=4), disable=True)
rec["tqdm_outside"] = values(shard_batches(bar))
rec["tqdm_total"] = bar.total
bar = shard_loader(tqdm(DataLoader(ds, batch_size=4), disable=True))  # a bar handed to shard_loader
rec["tqdm_loader"] = values(bar)
rec["tqdm_loader_total"] = bar.total

# a model stored before the wrap and trained through that reference: DDP never runs
class Holder:
    def __init__(self, m):
        self.model = m

inner = model(11 + rank)
holder = Holder(inner)
wrapped = wrap_model(inner)
sgd = torch.optim.SGD(wrapped.parameters(), lr=0.1)
for k in range(3):
    sgd.zero_grad()
    holder.model(batch(rank, 10 + k)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5)
    sgd.step()
rec["holder"] = flat(inner)

# a data-dependent init (Glow's ActNorm): the first forward sets a parameter from this rank's batch
class ActNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.bias.copy_(-x.mean(0))
            self.initialized = True
        return x + self.bias

flow = wrap_model(torch.nn.Sequential(ActNorm(), torch.nn.Linear(3, 1)))
adam = torch.optim.Adam(flow.parameters(), lr=0.01)
for k in range(2):
    adam.zero_grad()
    flow(batch(rank, 20 + k)[:, :3] + rank).pow(2).mean().backward()
    adam.step()
rec["actnorm"] = flat(flow)

# uneven steps, last: rank 1 takes three more, its averaged gradients clipped before each step;
# rank 0, finished, steps with it, and at the end takes rank 1's state (it could not clip)
net = model(5 + rank)
opt = torch.optim.Adam(net.parameters(), lr=0.01)
for k in range(3 + (3 if rank == 1 else 0)):
    opt.zero_grad()
    net(batch(rank, k)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    opt.step()

cleanup_distributed()  # rank 0, finished, takes part in rank 1's last steps here
rec["uneven"] = flat(net)
torch.save(rec, os.path.join(sys.argv[1], "rank{}.pt".format(rank)))
"""


pytestmark = [pytest.mark.e2e, pytest.mark.ddp]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("batches")
    script = folder / "batches.py"
    script.write_text(RUNNER)
    code, _, stderr = torchrun(script, str(folder))
    assert code == 0, stderr[-4000:]
    out = [torch.load(folder / f"rank{r}.pt") for r in range(2)]
    out[0]["_folder"] = folder
    return out


def test_a_shuffled_loader_is_split_with_a_new_order_each_pass_and_full_batches_only(ranks):
    orders = []
    for epoch in range(2):
        a, b = (sum(r[f"shuffled{epoch}"], []) for r in ranks)
        # 22 samples: 11 per rank, two full batches of 4 each; the partial third is left out
        assert [len(x) for x in ranks[0][f"shuffled{epoch}"]] == [4, 4] == [len(x) for x in ranks[1][f"shuffled{epoch}"]]
        assert not set(a) & set(b), "the ranks drew the same samples"
        orders.append(a + b)
    assert orders[0] != orders[1], "the same order in both passes (no set_epoch needed, none called)"
    assert ranks[0]["shuffled_len"] == 2


def test_a_counting_range_takes_every_world_size_th_value_up_to_the_last_on_every_rank(ranks):
    assert ranks[0]["range"] == ranks[1]["range"] == [4, 6, 8, 10, 12]  # no step more than half
    assert ranks[0]["range_len"] == 5
    assert ranks[0]["tqdm_inside"] == [0, 2, 4, 6, 8]  # 9 values: counted back from 8


def test_a_checkpoint_that_holds_a_step_holds_a_plain_number(ranks, tmp_path_factory):
    saved = [torch.load(ranks[0]["_folder"] / f"step{r}.pt", weights_only=True) for r in range(2)]
    assert saved[0] == saved[1] == {"iteration": 3, "hist": [3]}
    assert type(saved[0]["iteration"]) is int


def test_a_range_that_indexes_the_data_is_dealt_out_in_contiguous_blocks(ranks):
    assert (ranks[0]["indices"], ranks[1]["indices"]) == ([0, 4, 8], [12, 16, 20])


def test_other_iterables_are_dealt_out_round_robin_in_equal_numbers(ranks):
    assert (ranks[0]["list"], ranks[1]["list"]) == (["a", "c", "e"], ["b", "d", "f"])
    assert (ranks[0]["list_loader"], ranks[1]["list_loader"]) == (["a", "c", "e"], ["b", "d", "f"])
    assert (ranks[0]["tuple_eval"], ranks[1]["tuple_eval"]) == (("a", "c"), ("b",))  # evaluation: every one
    assert (ranks[0]["generator"], ranks[1]["generator"]) == ([0, 4, 16], [1, 9, 25])
    # five batches of five from the project's batch sampler: two each, the fifth left out
    assert ranks[0]["batch_sampler"] == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    assert ranks[1]["batch_sampler"] == [[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]]
    assert (ranks[0]["iterable"], ranks[1]["iterable"]) == ([[0, 1], [4, 5]], [[2, 3], [6, 7]])


def test_a_progress_bar_around_the_loader_is_sharded_inside(ranks):
    # in order: a DistributedSampler's every other sample; 11 per rank, the partial third batch left out
    assert ranks[0]["tqdm_outside"] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert ranks[1]["tqdm_outside"] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert ranks[0]["tqdm_total"] == 2
    # shard_loader pads as a DistributedSampler does: 11 samples a rank, the last batch partial
    assert ranks[0]["tqdm_loader"] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20]]
    assert ranks[1]["tqdm_loader"] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19, 21]]
    assert ranks[0]["tqdm_loader_total"] == 3


def test_random_streams_part_at_the_first_training_loop_and_repeat_for_a_seed(ranks):
    assert torch.equal(ranks[0]["before"][:2], ranks[1]["before"][:2]), "seeded alike, the ranks drew alike before"
    assert (ranks[0]["after"][:2] != ranks[1]["after"][:2]).all(), "torch and random must each part"
    # Python's stream, recomputed: seeded 0, one draw before; then one draw plus the rank (seeding.py)
    import random

    for rank in range(2):
        state = random.Random(0)
        state.random()
        seed = (state.getrandbits(62) + 0x9E3779B97F4A7C15 * (rank + 1)) % (2 ** 63)
        assert float(ranks[rank]["after"][1]) == pytest.approx(random.Random(seed).random(), rel=1e-6)


def test_a_rank_that_finished_first_ends_with_the_parameters_of_the_last(ranks):
    """Practice corpus (an online actor-critic, episodes of different lengths): the finished rank
    stepped with the mean gradients unclipped and ended 2e-4 away from the other."""
    assert torch.equal(ranks[0]["uneven"], ranks[1]["uneven"])
    # one process: rank 0's weights, three steps on both ranks' batches, three on rank 1's alone
    reference = model(5)
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    for k in range(6):
        opt.zero_grad()
        loss = reference(batch(1, k)).pow(2).mean()
        (loss / 2 + reference(batch(0, k)).pow(2).mean() / 2 if k < 3 else loss).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        opt.step()
    torch.testing.assert_close(ranks[1]["uneven"], flat(reference), rtol=1e-5, atol=1e-6)


def test_a_model_trained_around_its_ddp_wrapper_is_averaged_at_the_step(ranks):
    assert torch.equal(ranks[0]["holder"], ranks[1]["holder"])
    reference = model(11)  # rank 0's weights, the mean gradient of both ranks' batches, clipped
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(3):
        sgd.zero_grad()
        (reference(batch(0, 10 + k)).pow(2).mean() / 2 + reference(batch(1, 10 + k)).pow(2).mean() / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        sgd.step()
    torch.testing.assert_close(ranks[0]["holder"], flat(reference), rtol=1e-5, atol=1e-6)


def test_parameters_a_first_forward_set_per_rank_agree_from_the_first_step(ranks):
    assert torch.equal(ranks[0]["actnorm"], ranks[1]["actnorm"])


def test_in_one_process_shard_batches_is_the_iterable_itself():
    from gpumigrate.runtime import shard_batches

    things = [range(5), [1, 2], iter([3])]
    for thing in things:
        assert shard_batches(thing) is thing


def test_a_strided_step_keeps_the_scripts_schedule_cadence_and_exact_steps():
    """`_Step`: the value is the script's step (progress), `%` counts this rank's steps
    (cadence, whatever the offset), `==` finds the script's step among those a value stands for."""
    import json
    import pickle

    from gpumigrate.runtime.batches import _counter

    steps = _counter(range(0, 40), 2)
    assert [int(s) for s in steps] == [*range(1, 40, 2)]  # ends on the script's last step, no step more
    assert [int(s) for s in steps if s % 10 == 9] == [19, 39]  # every 10th of this rank's steps
    assert [int(s) for s in steps if (s + 1) % 10 == 0] == [19, 39]
    assert [int(s) for s in steps if s % 2 == 0] == [int(s) for s in steps[0::2]]  # alternation per own step
    assert [int(s) for s in steps if s == 39] == [39] and [int(s) for s in steps if s == 6] == [7]
    assert [int(s) for s in steps if s in (10, 11)] == [11] and [int(s) for s in steps if s == 0] == [1]
    assert sum(1 for s in steps if s != 0) == len(steps) - 1
    assert steps[3] / 40 == 0.175 and steps[3] < 8 and steps[3] * 2 == 14 and list(range(9))[steps[2]] == 5
    restored = pickle.loads(pickle.dumps(steps[3]))
    assert restored == 7 and type(restored) is int  # a checkpoint holding a step needs no gpumigrate
    assert json.dumps({"it": steps[3]}) == '{"it": 7}' and f"{steps[3]:3d}" == "  7" and str(steps[3] + 1) == "8"
    assert [int(s) for s in _counter(range(1, 25), 2)][:2] == [2, 4] and _counter(range(1, 25), 2)[0].local == 1
    down = _counter(range(10, 0, -1), 2)
    assert [int(s) for s in down] == [9, 7, 5, 3, 1] and [int(s) for s in down if s == 10] == [9]
    assert [int(s) for s in down if s == 1] == [1]


LAZY = """\
import os, sys, threading
import torch
from gpumigrate.runtime import get_rank, shard_batches, wrap_model

threading.Thread(target=lambda: (threading.Event().wait(60), os._exit(3)), daemon=True).start()
torch.manual_seed(0)
model = wrap_model(torch.nn.Linear(3, 1))  # no setup_distributed(): joins the group here
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
for k in shard_batches(range(6)):
    seen.append(int(k))
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
torch.save({"seen": seen, "w": model.module.weight.detach().clone()}, os.path.join(sys.argv[1], f"lazy{get_rank()}.pt"))
"""


def test_a_module_migrated_without_its_script_joins_the_group_at_first_use(tmp_path):
    script = tmp_path / "lazy.py"
    script.write_text(LAZY)
    code, _, stderr = torchrun(script, str(tmp_path))
    assert code == 0, stderr[-3000:]
    first, second = (torch.load(tmp_path / f"lazy{r}.pt") for r in range(2))
    assert first["seen"] == second["seen"] == [1, 3, 5]
    assert torch.equal(first["w"], second["w"])
    assert stderr.count("joined the process group at the first distributed helper") == 1


def test_numpy_stream_parts_too_where_numpy_is_installed(ranks):
    pytest.importorskip("numpy")
    assert ranks[0]["before"][2] == ranks[1]["before"][2]
    assert ranks[0]["after"][2] != ranks[1]["after"][2]
