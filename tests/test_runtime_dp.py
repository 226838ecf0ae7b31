"""Data parallelism without DDP (gpumigrate/runtime/averaging.py) and `shard_loader`.

Under `torchrun --standalone --nproc_per_node=2` (gloo, CPU) every scenario below trains
models NOT given to `wrap_model`, each rank on its own data and from its own initial weights
(seed 100 + rank, no common seed). After training, the ranks must hold identical parameters,
equal to one process that trains on both ranks' batches concatenated from rank 0's initial
weights: the same scenario function run here with `parts=[0, 1]` (no process group, so none
of the averaging exists in this process). One torchrun run serves every test (module fixture).
DP_TEST_WITHOUT_AVERAGING=1 runs the ranks with `setup_distributed(average_unwrapped=False)`:
every torchrun test but the loader's must then fail.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_  # bound before setup_distributed(), as scripts do
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler,
                              SubsetRandomSampler, TensorDataset, WeightedRandomSampler)
from torch.utils.data.distributed import DistributedSampler

from gpumigrate import runtime
from tests.test_runtime import internals, rt, torchrun  # noqa: F401 (rt: a fixture)

STEPS = 4
BATCH = 4  # per rank
SEED = 100  # rank r initialises with SEED + r; the one-process reference with rank 0's
SCENARIOS: Dict[str, Callable[[List[int], int], Dict[str, torch.Tensor]]] = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def batch(what: str, parts: List[int], step: int, *shape: int) -> torch.Tensor:
    """Rank `part`'s data at `step`, for each part, concatenated (the same on every process)."""
    out = []
    for part in parts:
        g = torch.Generator().manual_seed(zlib.crc32(f"{what}/{step}/{part}".encode()))
        out.append(torch.randn(BATCH, *shape, generator=g))
    return torch.cat(out)


def flat(*tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def state(**modules) -> Dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.detach().clone() for name, m in modules.items() for k, v in m.state_dict().items()}


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def count_all_reduce(counts: List[int]):
    """Wrap dist.all_reduce to record the number of elements of each call (DDP's own
    reductions run in C++ and are not seen), but for the int64 rows the ranks exchange
    before each collective (runtime/uneven.py)."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if tensor.dtype != torch.int64:
            counts.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    return lambda: setattr(dist, "all_reduce", original)


@scenario
def sgd(parts, seed):
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, 4)).backward()
        opt.step()
    return {"_init": init, **state(model=model)}


@scenario
def adam_weight_decay(parts, seed):
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, 4)).backward()
        opt.step()
    return {"_init": init, **state(model=model)}


@scenario
def gan(parts, seed):
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    init = flat(*gen.parameters(), *disc.parameters())
    opt_g = torch.optim.Adam(gen.parameters(), lr=0.01, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.01, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        real, z = batch("real", parts, step, 6), batch("z", parts, step, 4)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        opt_d.zero_grad()
        fake = gen(z)
        (bce(disc(real), ones) + bce(disc(fake.detach()), zeros)).backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), ones).backward()  # also accumulates into disc's gradients, zeroed next step
        opt_g.step()
    return {"_init": init, **state(gen=gen, disc=disc)}


@scenario
def gradient_penalty(parts, seed):
    torch.manual_seed(seed)
    critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    init = flat(*critic.parameters())
    opt = torch.optim.Adam(critic.parameters(), lr=0.01, betas=(0.5, 0.9))
    for step in range(STEPS):
        real, fake = batch("real", parts, step, 6), batch("fake", parts, step, 6)
        eps = batch("eps", parts, step, 1).sigmoid()
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)  # DDP cannot do this
        penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        opt.zero_grad()
        (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        opt.step()
    return {"_init": init, **state(critic=critic)}


@scenario
def functional(parts, seed):
    torch.manual_seed(seed)
    w1 = (torch.randn(8, 16) * 0.3).requires_grad_()
    b1 = torch.zeros(16, requires_grad=True)
    w2 = (torch.randn(16, 4) * 0.3).requires_grad_()
    b2 = torch.randn(4).requires_grad_()
    init = flat(w1, b1, w2, b2)
    opt = torch.optim.SGD([w1, b1, w2, b2], lr=0.1, momentum=0.5)
    for step in range(STEPS):
        out = torch.tanh(batch("x", parts, step, 8) @ w1 + b1) @ w2 + b2
        opt.zero_grad()
        F.mse_loss(out, batch("y", parts, step, 4)).backward()
        opt.step()
    return {"_init": init, "w1": w1.detach(), "b1": b1.detach(), "w2": w2.detach(), "b2": b2.detach()}


@scenario
def clipping(parts, seed):
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, 4)).backward()
        if step % 2 == 0:
            norms.append(clip_grad_norm_(model.parameters(), max_norm=0.05))
        else:
            clip_grad_value_(model.parameters(), clip_value=0.01)
        opt.step()
    return {"_init": init, "norms": torch.stack(norms), **state(model=model)}


@scenario
def unused_parameters(parts, seed):
    """Each rank uses one of two heads per step, a third never: a head without a gradient on
    this rank takes the others' (the mean over the whole batch); one without a gradient on
    any rank keeps none, so weight decay and momentum skip it as in one process."""
    torch.manual_seed(seed)
    trunk, heads = nn.Linear(8, 16), nn.ModuleList(nn.Linear(16, 4) for _ in range(3))
    init = flat(*trunk.parameters(), *heads.parameters())
    opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(F.mse_loss(heads[(step + part) % 2](torch.tanh(trunk(batch("x", [part], step, 8)))),
                              batch("y", [part], step, 4)) for part in parts) / len(parts)
        loss.backward()
        opt.step()
    return {"_init": init, "head2_without_grad": torch.tensor(float(heads[2].weight.grad is None)),
            **state(trunk=trunk, heads=heads)}


@scenario
def accumulation_and_closure(parts, seed):
    """Two backward passes per step (gradient accumulation), then LBFGS with a closure, whose
    loss decides its iterations: averaged too."""
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            (F.mse_loss(model(batch(f"x{micro}", parts, step, 8)), batch(f"y{micro}", parts, step, 4)) / 2).backward()
        opt.step()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=3)
    x, y = batch("x", parts, 99, 8), batch("y", parts, 99, 4)

    def closure():
        lbfgs.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    final = lbfgs.step(closure)
    return {"_init": init, "loss": final.detach().reshape(1), **state(model=model)}


@scenario
def manual_norm(parts, seed):
    """A norm computed by hand reads averaged gradients after `average_gradients(opt)`."""
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, 4)).backward()
        runtime.average_gradients(opt)
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        for p in model.parameters():
            p.grad.mul_(min(1.0, 0.05 / float(norm)))
        opt.step()
    return {"_init": init, **state(model=model)}


def scaled(parts, seed, unscale_and_clip):
    model = mlp(seed)
    init = flat(*model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped, reduced = [], []
    undo = count_all_reduce(reduced) if dist.is_initialized() else (lambda: None)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            loss = F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, 4))
            scaler.scale(loss).backward()
            if step == 1 and 1 in parts:  # rank 1 alone overflows at step 1
                model[0].weight.grad[0, 0] = float("inf")
            if unscale_and_clip:
                scaler.unscale_(opt)
                clip_grad_norm_(model.parameters(), max_norm=0.05)
            before = flat(*model.parameters())
            scaler.step(opt)
            scaler.update()
            skipped.append(float(torch.equal(before, flat(*model.parameters()))))
    finally:
        undo()
    return {"_init": init, "skipped": torch.tensor(skipped), "scale": torch.tensor(scaler.get_scale()),
            "_all_reduce_calls": torch.tensor(len(reduced)), **state(model=model)}


@scenario
def scaler_inf(parts, seed):
    return scaled(parts, seed, unscale_and_clip=False)


@scenario
def scaler_unscale_clip(parts, seed):
    return scaled(parts, seed, unscale_and_clip=True)


class ProjectedLoss(nn.Module):
    """A loss with parameters of its own, trained by the model's optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, out, target):
        return F.mse_loss(self.proj(out), target)


@scenario
def loss_module_beside_ddp(parts, seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    criterion = ProjectedLoss()
    init = flat(*net.parameters(), *criterion.parameters())
    model = runtime.wrap_model(net)  # DDP under torchrun: averages net's gradients during backward
    opt = torch.optim.SGD(list(model.parameters()) + list(criterion.parameters()), lr=0.1)
    reduced: List[int] = []
    undo = count_all_reduce(reduced) if dist.is_initialized() else (lambda: None)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            criterion(model(batch("x", parts, step, 8)), batch("y", parts, step, 4)).backward()
            clip_grad_norm_(list(model.parameters()) + list(criterion.parameters()), max_norm=1e3)
            opt.step()
    finally:
        undo()
    return {"_init": init, "_reduced": torch.tensor(reduced, dtype=torch.long).reshape(-1),
            **state(net=net, criterion=criterion)}


@scenario
def batchnorm(parts, seed):
    """With one part (a rank): plain training. With both (the reference): each part's forward
    from the same statistics, as each rank does, then the statistics' mean, as the runtime
    keeps them; the gradients are the mean over parts."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    init = flat(*model.parameters())
    bn = model[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        start = (bn.running_mean.clone(), bn.running_var.clone())
        ends = []
        for part in parts:
            with torch.no_grad():
                bn.running_mean.copy_(start[0])
                bn.running_var.copy_(start[1])
            out = model(batch("x", [part], step, 8))
            (F.mse_loss(out, batch("y", [part], step, 4)) / len(parts)).backward()
            ends.append((bn.running_mean.clone(), bn.running_var.clone()))
        with torch.no_grad():
            bn.running_mean.copy_(torch.stack([e[0] for e in ends]).mean(0))
            bn.running_var.copy_(torch.stack([e[1] for e in ends]).mean(0))
        opt.step()
    result = {"_init": init, **state(model=model)}
    result.pop("model.1.num_batches_tracked")  # the reference counts a forward per part
    return result


def collate_ids(samples):
    return torch.stack([s[0] for s in samples])


@scenario
def loaders(parts, seed):
    """A loader made by a factory elsewhere, sharded, iterated without set_epoch."""
    data = TensorDataset(torch.arange(11))
    shuffled = runtime.shard_loader(DataLoader(data, batch_size=3, shuffle=True, collate_fn=collate_ids))
    ordered = runtime.shard_loader(DataLoader(data, batch_size=2, collate_fn=collate_ids))
    told = runtime.shard_loader(DataLoader(data, batch_size=3, shuffle=True, collate_fn=collate_ids))
    out = {}
    for epoch in range(3):
        out[f"shuffled{epoch}"] = torch.cat(list(shuffled))
        out[f"ordered{epoch}"] = torch.cat(list(ordered))
        runtime.set_epoch(told, 5)  # told every epoch: always epoch 5's order
        out[f"told{epoch}"] = torch.cat(list(told))
    return out


RUNNER = """\
import os, sys, threading
import torch
from gpumigrate.runtime import get_rank, setup_distributed
from tests.test_runtime_dp import SCENARIOS, SEED

# A rank waiting in a collective the other never joins would wait 30 minutes (gloo): a hang
# here fails the run in 90 s instead.
threading.Thread(target=lambda: (threading.Event().wait(90), os._exit(3)), daemon=True).start()
setup_distributed(average_unwrapped=not os.environ.get("DP_TEST_WITHOUT_AVERAGING"))
rank = get_rank()
for name, fn in SCENARIOS.items():
    torch.save(fn([rank], SEED + rank), os.path.join(sys.argv[1], "{}_rank{}.pt".format(name, rank)))
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    out = tmp_path_factory.mktemp("dp")
    script = out / "run_scenarios.py"
    script.write_text(RUNNER)
    code, _, stderr = torchrun(script, str(out))
    assert code == 0, stderr[-4000:]
    return {name: [torch.load(out / f"{name}_rank{r}.pt") for r in range(2)] for name in SCENARIOS}


def reference(name: str) -> Dict[str, torch.Tensor]:
    """One process, both ranks' batches, rank 0's initial weights; no process group here."""
    assert not dist.is_initialized()
    return SCENARIOS[name]([0, 1], SEED)


def assert_one_model(ranks, name, **tolerance) -> None:
    first, second = ranks[name]
    assert not torch.equal(first["_init"], second["_init"]), "the ranks did not start from different weights"
    expected = reference(name)
    assert torch.equal(expected["_init"], first["_init"])
    for key, value in expected.items():
        if key.startswith("_"):
            continue
        assert torch.equal(first[key], second[key]), f"{name}: {key} differs between the ranks"
        torch.testing.assert_close(first[key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {key}: not what one process on the whole batch gets\n{m}")




@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("name", ["sgd", "adam_weight_decay", "functional", "gradient_penalty", "unused_parameters",
                                  "accumulation_and_closure", "manual_norm"])
def test_unwrapped_training_equals_one_process_on_the_whole_batch(ranks, name):
    assert_one_model(ranks, name)


@pytest.mark.e2e
@pytest.mark.ddp
def test_two_optimizers_gan(ranks):
    assert_one_model(ranks, "gan")


@pytest.mark.e2e
@pytest.mark.ddp
def test_clipping_clips_the_averaged_gradient(ranks):
    """clip_grad_norm_/clip_grad_value_ (imported by name before setup_distributed) see the
    averaged gradients: the same norm on every rank, the norm of the whole batch's gradient."""
    assert_one_model(ranks, "clipping")
    first, second = ranks["clipping"]
    assert torch.equal(first["norms"], second["norms"])
    assert (first["norms"] > 0.05).all(), "clipping did not clip: the test checks nothing"


@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("name", ["scaler_inf", "scaler_unscale_clip"])
def test_grad_scaler_inf_on_one_rank_skips_the_step_on_every_rank(ranks, name):
    assert_one_model(ranks, name)
    first, second = ranks[name]
    assert first["skipped"].tolist() == second["skipped"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert float(first["scale"]) == float(second["scale"]) == 512.0
    # averaged once per step: at unscale_ (explicit, or inside scaler.step), not again at
    # clip_grad_norm_ nor at step()
    assert int(first["_all_reduce_calls"]) == int(second["_all_reduce_calls"]) == STEPS


@pytest.mark.e2e
@pytest.mark.ddp
def test_loss_module_beside_a_ddp_model_only_the_loss_module_is_averaged_by_the_hooks(ranks):
    assert_one_model(ranks, "loss_module_beside_ddp")
    criterion = sum(p.numel() for p in ProjectedLoss().parameters())
    net = 8 * 32 + 32 + 32 * 4 + 4
    for result in ranks["loss_module_beside_ddp"]:
        reduced = result["_reduced"].tolist()
        assert len(reduced) == STEPS, f"one all_reduce per step (clip_grad_norm_'s), got {reduced}"
        assert all(criterion <= n < criterion + net for n in reduced), (
            f"elements all-reduced per step {reduced}: the DDP model's {net} gradients were averaged again")


@pytest.mark.e2e
@pytest.mark.ddp
def test_batchnorm_statistics_are_averaged_across_ranks(ranks):
    assert_one_model(ranks, "batchnorm")
    first, second = ranks["batchnorm"]
    assert torch.equal(first["model.1.running_mean"], second["model.1.running_mean"])
    assert torch.equal(first["model.1.running_var"], second["model.1.running_var"])


@pytest.mark.e2e
@pytest.mark.ddp
def test_shard_loader_partitions_the_data_with_a_new_order_each_epoch(ranks):
    first, second = ranks["loaders"]
    every = list(range(11))
    orders = []
    for epoch in range(3):
        a, b = first[f"shuffled{epoch}"].tolist(), second[f"shuffled{epoch}"].tolist()
        assert len(a) == len(b) == 6  # padded to the same number of samples on both ranks
        assert sorted(set(a) | set(b)) == every and len(set(a) & set(b)) <= 1  # one padded duplicate
        orders.append(a + b)
        # in order: every other sample, padded with the first
        assert first[f"ordered{epoch}"].tolist() == [0, 2, 4, 6, 8, 10]
        assert second[f"ordered{epoch}"].tolist() == [1, 3, 5, 7, 9, 0]
        assert first[f"told{epoch}"].tolist() == first["told0"].tolist()  # set_epoch(5) each time
    assert len({tuple(o) for o in orders}) == 3, "the order did not change between epochs"
    expected = DistributedSampler(range(11), num_replicas=2, rank=0, shuffle=True, seed=0)
    expected.set_epoch(5)
    assert first["told0"].tolist() == list(expected)


# ---------------------------------------------------------------- in one process

def _fake_ranks(monkeypatch, distributed, rank):
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(distributed, "is_main_process", lambda: rank == 0)


def _init_worker(worker_id):
    pass


def test_shard_loader_keeps_every_setting(monkeypatch, rt):
    distributed = internals(rt)
    _fake_ranks(monkeypatch, distributed, 1)
    data = TensorDataset(torch.arange(20))
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate_ids, pin_memory=True,
                        drop_last=True, timeout=7.5, worker_init_fn=_init_worker, multiprocessing_context="spawn",
                        generator=generator, prefetch_factor=3, persistent_workers=True)
    sharded = rt.shard_loader(loader)
    assert sharded is not loader and type(sharded) is DataLoader
    for name in ("dataset", "batch_size", "drop_last", "num_workers", "collate_fn", "pin_memory", "timeout",
                 "worker_init_fn", "generator", "persistent_workers", "prefetch_factor", "multiprocessing_context",
                 "pin_memory_device", "in_order"):
        assert getattr(sharded, name) == getattr(loader, name), name
    sampler = sharded.sampler
    assert isinstance(sampler, DistributedSampler) and sampler.shuffle
    assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 1, 0)
    assert len(sharded) == 2  # 10 samples a rank, 2 full batches of 4
    ordered = rt.shard_loader(DataLoader(data, batch_size=None))  # no batching: one sample at a time
    assert not ordered.sampler.shuffle and ordered.batch_size is None
    assert [int(x[0]) for x in ordered] == list(range(1, 20, 2))


def test_shard_loader_shards_a_plain_batch_sampler(monkeypatch, rt):
    _fake_ranks(monkeypatch, internals(rt), 0)
    data = TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), batch_size=3, drop_last=False))
    sharded = rt.shard_loader(loader)
    assert sharded.batch_size == 3 and not sharded.drop_last and sharded.sampler.shuffle
    assert sorted(int(i) for b in sharded for i in b[0]) != list(range(10))  # half of it
    assert len([i for b in sharded for i in b[0]]) == 5


def test_shard_loader_splits_a_subset_random_sampler(monkeypatch, rt):
    """A train/valid split by SubsetRandomSampler (recurrent-visual-attention's loaders):
    each rank draws its own half of the subset's indices, none outside it, and the sampler's
    `indices` are what this rank draws this epoch."""
    subset = [3, 5, 7, 11, 13, 17, 19]
    data = TensorDataset(torch.arange(20))
    drawn = []
    for rank in (0, 1):
        _fake_ranks(monkeypatch, internals(rt), rank)
        loader = DataLoader(data, batch_size=2, sampler=SubsetRandomSampler(subset))
        sharded = rt.shard_loader(loader)
        mine = [int(i) for (batch,) in sharded for i in batch]
        assert len(mine) == 4 and set(mine) <= set(subset)
        assert sharded.sampler.indices == mine
        drawn.append(mine)
        whole = rt.shard_loader(DataLoader(data, sampler=SubsetRandomSampler(subset)), pad=False)
        assert [int(x) for (x,) in whole] == subset[rank::2]  # evaluation: each index once
    assert set(drawn[0]) | set(drawn[1]) == set(subset) and len(set(drawn[0]) & set(drawn[1])) <= 1


def test_shard_loader_of_a_phase_that_does_not_train_is_the_loader(monkeypatch, rt):
    _fake_ranks(monkeypatch, internals(rt), 0)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True)
    assert rt.shard_loader(loader, shard=False) is loader
    assert rt.shard_loader(loader, shard=True) is not loader


def test_shard_loader_of_a_loader_without_workers_takes_no_prefetch_factor(monkeypatch, rt):
    """A loader whose workers were set to 0 after it was made (torch < 2.0 kept a prefetch
    factor of 2 without workers): DataLoader refuses a prefetch factor or persistent workers
    without workers, so the rebuilt loader takes neither."""
    _fake_ranks(monkeypatch, internals(rt), 0)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True, num_workers=2,
                        prefetch_factor=2, persistent_workers=True)
    object.__setattr__(loader, "num_workers", 0)
    sharded = rt.shard_loader(loader)
    assert sharded.num_workers == 0 and sharded.prefetch_factor is None and not sharded.persistent_workers
    assert len([x for (b,) in sharded for x in b]) == 4


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class ListBatches(Sampler):
    def __init__(self):
        pass

    def __iter__(self):
        return iter([[0, 1], [2, 3]])

    def __len__(self):
        return 2


class MyLoader(DataLoader):
    pass


@pytest.mark.parametrize("make, why", [
    (lambda d: DataLoader(Stream()), "IterableDataset"),
    (lambda d: DataLoader(d, sampler=WeightedRandomSampler([1.0] * 8, 8)), "custom sampler (WeightedRandomSampler)"),
    (lambda d: DataLoader(d, batch_sampler=ListBatches()), "custom batch_sampler (ListBatches)"),
    (lambda d: DataLoader(d, sampler=RandomSampler(d, replacement=True)), "replacement"),
    (lambda d: MyLoader(d, shuffle=True), "DataLoader subclass (MyLoader)"),
])
def test_shard_loader_leaves_what_it_cannot_shard_with_one_warning(monkeypatch, rt, make, why):
    _fake_ranks(monkeypatch, internals(rt), 0)
    loader = make(TensorDataset(torch.arange(8)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rt.shard_loader(loader) is loader
    assert len(caught) == 1 and why in str(caught[0].message), [str(w.message) for w in caught]
    assert "\n" not in str(caught[0].message)


def test_shard_loader_leaves_a_sharded_loader_alone(monkeypatch, rt):
    _fake_ranks(monkeypatch, internals(rt), 0)
    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rt.shard_loader(loader) is loader


def test_distributed_sampler_advances_by_itself_unless_told(rt):
    sampler_type = internals(rt)._EpochSampler
    data = list(range(32))

    def plain(epoch):
        s = DistributedSampler(data, num_replicas=2, rank=0, seed=0)
        s.set_epoch(epoch)
        return list(s)

    auto = sampler_type(data, num_replicas=2, rank=0, seed=0)
    assert [list(auto) for _ in range(3)] == [plain(0), plain(1), plain(2)]
    told = sampler_type(data, num_replicas=2, rank=0, seed=0)
    for epoch in (0, 1, 2, 2, 7):  # set_epoch each epoch (the goldens): exactly DistributedSampler
        rt.set_epoch(told, epoch)
        assert list(told) == plain(epoch)
    assert list(told) == plain(8)  # then on by itself
    loader = DataLoader(data, sampler=sampler_type(data, num_replicas=2, rank=0), batch_size=4,
                        num_workers=1, persistent_workers=True)
    assert [[int(i) for b in loader for i in b] for _ in range(2)] == [plain(0), plain(1)]


def test_one_process_is_unchanged(monkeypatch, rt):
    """No group: setup_distributed installs nothing, shard_loader and average_gradients do
    nothing, an optimizer steps as ever."""
    from torch.nn.utils import clip_grad
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    hooks = dict(_global_optimizer_pre_hooks)
    add, unscale = torch.optim.Optimizer.add_param_group, torch.amp.GradScaler._unscale_grads_
    inner = clip_grad.clip_grad_norm_.__closure__[0].cell_contents
    rt.setup_distributed()
    assert dict(_global_optimizer_pre_hooks) == hooks
    assert (torch.optim.Optimizer.add_param_group, torch.amp.GradScaler._unscale_grads_) == (add, unscale)
    assert clip_grad.clip_grad_norm_.__closure__[0].cell_contents is inner
    loader = DataLoader(TensorDataset(torch.arange(4)), shuffle=True)
    assert rt.shard_loader(loader) is loader
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    grad = model.weight.grad.clone()
    rt.average_gradients(opt)
    assert torch.equal(model.weight.grad, grad) and "_gpumigrate_plan" not in opt.__dict__


def test_the_hooks_and_wrappers_are_removed_by_cleanup(monkeypatch):
    """Installed only in a group of several processes; cleanup_distributed restores torch."""
    from torch.nn.utils import clip_grad
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from gpumigrate.runtime import averaging

    hooks = dict(_global_optimizer_pre_hooks)
    add, unscale = torch.optim.Optimizer.add_param_group, torch.amp.GradScaler._unscale_grads_
    cells = {name: getattr(clip_grad, name).__closure__[0].cell_contents
             for name in ("clip_grad_norm_", "clip_grad_value_")}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    try:
        averaging._install_averaging()
        averaging._install_averaging()  # once
        assert len(_global_optimizer_pre_hooks) == len(hooks) + 1
        assert torch.optim.Optimizer.add_param_group is not add
        assert torch.amp.GradScaler._unscale_grads_ is not unscale
        assert all(getattr(clip_grad, n).__closure__[0].cell_contents is not c for n, c in cells.items())
    finally:
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        runtime.cleanup_distributed()
    assert dict(_global_optimizer_pre_hooks) == hooks
    assert (torch.optim.Optimizer.add_param_group, torch.amp.GradScaler._unscale_grads_) == (add, unscale)
    assert all(getattr(clip_grad, n).__closure__[0].cell_contents is c for n, c in cells.items())
