"""Fully sharded data parallelism (gpumigrate/runtime/sharding.py: `shard_model` and the full
checkpoints of sharded models).

Under `torchrun --standalone --nproc_per_node=2` (gloo, CPU) every scenario below shards its
model, each rank from its own initial weights (seed 100 + rank) and on its own data, and must
end where one process ends that trains on both ranks' batches concatenated from rank 0's
initial weights: the same scenario function run here with `parts=[0, 1]` (no process group,
so `shard_model` returns the model as it is). One torchrun run serves every test (module
fixture); the tests without torchrun check the one-process behaviour and the choice of blocks.
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib
from typing import Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grad_norm_, clip_grad_value_  # bound before setup_distributed(), as scripts do

from gpumigrate import runtime
from tests.test_runtime import rt, torchrun  # noqa: F401 (rt: a fixture)

STEPS = 5
BATCH = 4  # per rank
SEED = 100  # rank r initialises with SEED + r; the one-process reference with rank 0's
MAX_NORM = 0.3
SCENARIOS: Dict[str, Callable[[List[int], int], Dict[str, object]]] = {}


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


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


class Block(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class ListNet(nn.Module):
    """Blocks in a ModuleList (a transformer's layers); rows that do not split evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 12)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seq_net() -> nn.Module:
    """Blocks in a Sequential inside a Sequential of different layers (a ResNet's stage)."""
    return nn.Sequential(nn.Linear(8, 12), nn.Sequential(*[Block() for _ in range(3)]), nn.Linear(12, 3))


def flat_net() -> nn.Module:
    """No repeated blocks: the root alone; a 1-row weight leaves rank 1 an empty shard."""
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 1))


MODELS = {"list": ListNet, "seq": seq_net, "flat": flat_net}
OUT = {"list": 3, "seq": 3, "flat": 1}


def fsdp_units(model: nn.Module) -> List[str]:
    """The names of the modules fully_shard was applied to ('' is the root)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, fsdp.FSDPModule)]


def train(kind: str, parts: List[int], seed: int, *, before: bool = False, steps: int = STEPS, model=None,
          opt=None, start: int = 0, sgd: bool = False):
    """AdamW with weight decay (or SGD with momentum) and clip_grad_norm_; the optimizer built
    before shard_model (`before`: its parameters are replaced in place) or after."""
    init = None
    if model is None:
        torch.manual_seed(seed)
        model = MODELS[kind]()
        init = flat(model.parameters())
    def make(params):
        if sgd:
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)
        return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)

    if before:
        opt = make(model.parameters())
    model = runtime.shard_model(model)
    if opt is None:
        opt = make(model.parameters())
    losses, norms, plain = [], [], True
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = F.mse_loss(model(batch("x", parts, step, 8)), batch("y", parts, step, OUT[kind]))
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        plain = plain and type(norm) is torch.Tensor
        opt.step()
        losses.append(loss.detach())
        norms.append(norm.detach())
    result = {"losses": torch.stack(losses), "norms": torch.stack(norms), "_plain_norms": plain,
              "_units": fsdp_units(model)}
    return model, opt, result if init is None else {"_init": init, **result}


def gathered(model) -> Dict[str, torch.Tensor]:
    return {f"param.{k}": v.detach().clone() for k, v in runtime.full_state_dict(model, rank0_only=False).items()}


def training(kind: str, before: bool = False):
    def run(parts, seed):
        model, _, result = train(kind, parts, seed, before=before)
        return {**result, **gathered(model)}

    run.__name__ = f"{kind}_{'before' if before else 'after'}"
    return run


for _kind in MODELS:
    scenario(training(_kind))
scenario(training("list", before=True))


def probe() -> torch.Tensor:
    return torch.linspace(-2, 2, 6 * 8).reshape(6, 8)


@scenario
def checkpoint(parts, seed):
    """Rank 0 saves full_state_dict (rank0_only): the file a one-process script loads."""
    model, _, result = train("list", parts, seed, steps=2)
    state = runtime.full_state_dict(model)
    if dist.is_initialized() and dist.get_rank() == 0:
        torch.save(state, os.path.join(os.environ["FSDP_TEST_OUT"], "full.pt"))
    with torch.no_grad():
        outputs = model(probe())
    return {**result, "outputs": outputs, "_state_len": len(state),
            "_tensor_types": sorted({type(v).__name__ for v in state.values()}),
            "_devices": sorted({str(v.device) for v in state.values()})}


def pre_migration_checkpoint() -> Dict[str, torch.Tensor]:
    """What the original script saved from its DataParallel model: `module.` keys."""
    torch.manual_seed(7)
    return {f"module.{k}": v for k, v in ListNet().state_dict().items()}


@scenario
def resume(parts, seed):
    """A pre-migration checkpoint loaded on every rank into the sharded model, then training
    goes on; and a plain `load_state_dict` of a full state into a sharded model."""
    torch.manual_seed(seed)
    model = runtime.shard_model(ListNet())
    saved = pre_migration_checkpoint()
    loaded = runtime.load_full_state_dict(model, saved)
    assert list(saved)[0].startswith("module.")  # the caller's dict is left as it was
    # SGD: Adam's first steps divide by the gradients' own size, so that float32 rounding
    # (the halves' sum, as one process computing them apart gets too) shows 1e-4 in places
    _, _, result = train("list", parts, seed, model=model, steps=3, sgd=True)
    torch.manual_seed(seed + 1)
    other = runtime.shard_model(ListNet())
    plain = {k[len("module."):]: v for k, v in saved.items()}
    other.load_state_dict(plain)  # a full tensor per sharded parameter: sliced locally
    same = all(torch.equal(runtime.full_state_dict(other, rank0_only=False)[k], v) for k, v in plain.items())
    return {**result, **gathered(model), "_missing": list(loaded.missing_keys) + list(loaded.unexpected_keys),
            "_plain_load_exact": same}


@scenario
def optimizer_roundtrip(parts, seed):
    """2 steps, the full model and optimizer states saved, loaded into a new sharded model
    and optimizer (other initial weights), 3 more steps: as 5 steps in one process."""
    model, opt, first = train("list", parts, seed, steps=2)
    state = runtime.full_state_dict(model, rank0_only=False)
    opt_state = runtime.full_optimizer_state_dict(model, opt, rank0_only=False)
    rank0 = runtime.full_optimizer_state_dict(model, opt)
    # cloned now: `optimizer.state_dict()` holds live tensors, which the steps below change
    saved = {f"_opt.{k}.{name}": v.clone() for k, entry in rank0.get("state", {}).items() for name, v in entry.items()}
    torch.manual_seed(seed + 50)
    fresh = runtime.shard_model(ListNet())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.02, weight_decay=0.1)
    runtime.load_full_state_dict(fresh, state)
    runtime.load_full_optimizer_state_dict(fresh, fresh_opt, opt_state)
    _, _, second = train("list", parts, seed, model=fresh, opt=fresh_opt, steps=3, start=2)
    return {"losses": torch.cat([first["losses"], second["losses"]]), **gathered(fresh), **saved,
            "_rank0_keys": sorted(rank0.get("state", {})),
            "_group_params": [g["params"] for g in rank0.get("param_groups", [])]}


class ProjectedLoss(nn.Module):
    """A loss with parameters of its own (not sharded), trained by the model's optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, out, target):
        return F.mse_loss(self.proj(out), target)


@scenario
def mixed_clipping(parts, seed):
    """clip_grad_norm_ and clip_grad_value_ of sharded and plain parameters together."""
    torch.manual_seed(seed)
    model, criterion = ListNet(), ProjectedLoss()
    init = flat([*model.parameters(), *criterion.parameters()])
    model = runtime.shard_model(model)
    opt = torch.optim.SGD([*model.parameters(), *criterion.parameters()], lr=0.1, momentum=0.9)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        criterion(model(batch("x", parts, step, 8)), batch("y", parts, step, 3)).backward()
        params = [*model.parameters(), *criterion.parameters()]
        if step % 2:
            clip_grad_value_(params, clip_value=0.02)
        else:
            norms.append(clip_grad_norm_(params, max_norm=MAX_NORM))
        opt.step()
    return {"_init": init, "norms": torch.stack(norms), **gathered(model),
            **{f"criterion.{k}": v.detach().clone() for k, v in criterion.state_dict().items()}}


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.bn = nn.BatchNorm1d(12)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 12), nn.Sequential(NormBlock(), NormBlock()), nn.Linear(12, 3))


def batchnorm_run(parts, seed, mixed):
    """With one part (a rank): plain training. With both (the reference): each part's forward
    from the same statistics, as each rank does, then the statistics' mean, as the runtime
    keeps them; the gradients are the mean over parts."""
    torch.manual_seed(seed)
    model = bn_net()
    dtypes: Dict[str, set] = {"linear": set(), "bn": set(), "bn_input": set()}

    def record(module, args):
        kind = "linear" if isinstance(module, nn.Linear) else "bn"
        dtypes[kind].add(str(module.weight.dtype))
        if kind == "bn":
            dtypes["bn_input"].add(str(args[0].dtype))

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.BatchNorm1d)):
            module.register_forward_pre_hook(record)
    model = runtime.shard_model(model, mixed_precision=mixed)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        start = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
        ends, loss = [], 0.0
        for part in parts:
            with torch.no_grad():
                for bn, (mean, var) in zip(bns, start):
                    bn.running_mean.copy_(mean)
                    bn.running_var.copy_(var)
            part_loss = F.mse_loss(model(batch("x", [part], step, 8)).float(), batch("y", [part], step, 3)) / len(parts)
            part_loss.backward()
            loss += part_loss.detach()
            ends.append([(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns])
        with torch.no_grad():
            for i, bn in enumerate(bns):
                bn.running_mean.copy_(torch.stack([e[i][0] for e in ends]).mean(0))
                bn.running_var.copy_(torch.stack([e[i][1] for e in ends]).mean(0))
        opt.step()
        losses.append(loss)
    result = {"losses": torch.stack(losses), **gathered(model), "_dtypes": {k: sorted(v) for k, v in dtypes.items()}}
    return {k: v for k, v in result.items() if not k.endswith("num_batches_tracked")}  # the reference counts per part


@scenario
def batchnorm(parts, seed):
    return batchnorm_run(parts, seed, mixed=False)


@scenario
def batchnorm_mixed_precision(parts, seed):
    return batchnorm_run(parts, seed, mixed=True)


class Recurrent(nn.Module):
    """An LSTM whose first hidden state a script makes from a parameter (sharded between steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 6, num_layers=2)
        self.head = nn.Linear(6, 3)

    def init_hidden(self, batch_size: int):
        weight = next(self.parameters())
        return weight.new_zeros(2, batch_size, 6), weight.new_zeros(2, batch_size, 6)

    def forward(self, x, hidden):
        out, hidden = self.rnn(x, hidden)
        return self.head(out[-1]), hidden


@scenario
def recurrent_hidden_from_a_parameter(parts, seed):
    torch.manual_seed(seed)
    model = Recurrent()
    init = flat(model.parameters())
    model = runtime.shard_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x = batch("x", parts, step, 5, 8).transpose(0, 1)  # (time, batch, features)
        hidden = model.init_hidden(x.shape[1])
        opt.zero_grad()
        out, hidden = model(x, hidden=hidden)
        loss = F.mse_loss(out, batch("y", parts, step, 3))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"_init": init, "losses": torch.stack(losses), **gathered(model)}


class Pair(nn.Module):
    """Two blocks as attributes (no container): nothing repeated to find."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


@scenario
def environment(parts, seed):
    """GPUMIGRATE_FSDP_BLOCKS and GPUMIGRATE_FSDP_RESHARD win over the arguments."""
    saved = {k: os.environ.get(k) for k in ("GPUMIGRATE_FSDP_BLOCKS", "GPUMIGRATE_FSDP_RESHARD")}
    result: Dict[str, object] = {}
    try:
        for reshard in ("0", "1"):
            os.environ.update(GPUMIGRATE_FSDP_BLOCKS="Block", GPUMIGRATE_FSDP_RESHARD=reshard)
            torch.manual_seed(seed)
            model = runtime.shard_model(Pair(), blocks=nn.Linear, reshard_after_forward=reshard == "0")
            out = model(torch.ones(2, 12))
            result[f"_units{reshard}"] = fsdp_units(model)
            # between forward and backward, a block that does not reshard keeps its gathered (plain) weight
            result[f"_gathered_after_forward{reshard}"] = not isinstance(model.first.fc.weight, DTensor)
            out.sum().backward()
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return result


@scenario
def idempotent_and_frozen(parts, seed):
    torch.manual_seed(seed)
    model = ListNet()
    sharded = runtime.shard_model(model)
    params = [id(p) for p in sharded.parameters()]
    again = runtime.shard_model(sharded, blocks="Linear", mixed_precision=True)
    frozen = ListNet().requires_grad_(False)
    frozen_params = [id(p) for p in frozen.parameters()]
    kept = runtime.shard_model(frozen)
    return {"_twice_same": again is sharded and [id(p) for p in again.parameters()] == params,
            "_frozen_same": kept is frozen and [id(p) for p in kept.parameters()] == frozen_params
            and not fsdp_units(kept)}


@scenario
def optimizer_with_state_refused(parts, seed):
    torch.manual_seed(seed)
    model = ListNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    F.mse_loss(model(batch("x", parts, 0, 8)), batch("y", parts, 0, 3)).backward()
    opt.step()
    try:
        runtime.shard_model(model)
    except RuntimeError as exc:
        return {"_error": str(exc), "_units": fsdp_units(model)}
    return {"_error": "", "_units": fsdp_units(model)}


RUNNER = """\
import os, sys, threading
import torch
from gpumigrate.runtime import get_rank, setup_distributed
from tests.test_runtime_fsdp import SCENARIOS, SEED

# A rank waiting in a collective the other never joins would wait 30 minutes (gloo): a hang
# here fails the run in 120 s instead.
threading.Thread(target=lambda: (threading.Event().wait(120), os._exit(3)), daemon=True).start()
setup_distributed()
rank = get_rank()
os.environ["FSDP_TEST_OUT"] = sys.argv[1]
for name, fn in SCENARIOS.items():
    torch.save(fn([rank], SEED + rank), os.path.join(sys.argv[1], "{}_rank{}.pt".format(name, rank)))
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    script = out / "run_scenarios.py"
    script.write_text(RUNNER)
    code, _, stderr = torchrun(script, str(out))
    assert code == 0, stderr[-4000:]
    results = {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
               for name in SCENARIOS}
    results["_dir"] = out
    return results


_REFERENCES: Dict[str, Dict[str, object]] = {}


def reference(name: str) -> Dict[str, object]:
    """One process, both ranks' batches, rank 0's initial weights; no process group here."""
    assert not dist.is_initialized()
    if name not in _REFERENCES:
        _REFERENCES[name] = SCENARIOS[name]([0, 1], SEED)
    return _REFERENCES[name]


def assert_one_process(ranks, name, loss_rtol=1e-5, atol=1e-6, rtol=1e-5, other_rtol=1e-4) -> None:
    """Each rank's loss is its half's: their mean is the whole batch's. Everything else the
    ranks hold alike, and equal to one process's: the parameters within `atol`/`rtol`, other
    values (gradient norms, outputs) within `other_rtol`."""
    first, second = ranks[name]
    expected = reference(name)
    if "_init" in expected:
        assert not torch.equal(first["_init"], second["_init"]), "the ranks did not start from different weights"
        assert torch.equal(expected["_init"], first["_init"])
    for key, value in expected.items():
        if key.startswith("_"):
            continue
        if key == "losses":
            torch.testing.assert_close((first[key] + second[key]) / 2, value, rtol=loss_rtol, atol=0,
                                       msg=lambda m: f"{name}: losses: not one process's\n{m}")
            continue
        assert torch.equal(first[key], second[key]), f"{name}: {key} differs between the ranks"
        tight = key.startswith(("param.", "criterion."))
        torch.testing.assert_close(first[key], value, rtol=rtol if tight else other_rtol, atol=atol,
                                   msg=lambda m: f"{name}: {key}: not what one process on the whole batch gets\n{m}")


@pytest.mark.e2e
@pytest.mark.ddp
@pytest.mark.parametrize("name, units", [
    ("list_after", ["", "blocks.0", "blocks.1", "blocks.2"]),
    ("seq_after", ["", "1.0", "1.1", "1.2"]),
    ("flat_after", [""]),
    ("list_before", ["", "blocks.0", "blocks.1", "blocks.2"]),
])
def test_sharded_training_equals_one_process_on_the_whole_batch(ranks, name, units):
    assert_one_process(ranks, name)
    for result in ranks[name]:
        assert result["_units"] == units
        assert result["_plain_norms"], "clip_grad_norm_ returned a DTensor"
        assert (result["norms"] > MAX_NORM).any(), "clipping did not clip: the test checks nothing"


@pytest.mark.e2e
@pytest.mark.ddp
def test_an_optimizer_built_before_shard_model_trains_the_sharded_parameters(ranks):
    for before, after in zip(ranks["list_before"], ranks["list_after"]):
        for key, value in after.items():
            if not key.startswith("_"):
                assert torch.equal(before[key], value), key


@pytest.mark.e2e
@pytest.mark.ddp
def test_an_optimizer_with_state_is_refused_before_anything_is_sharded(ranks):
    for result in ranks["optimizer_with_state_refused"]:
        assert "after shard_model" in result["_error"] and "\n" not in result["_error"]
        assert result["_units"] == []


@pytest.mark.e2e
@pytest.mark.ddp
def test_rank0_checkpoint_loads_into_the_original_model_in_one_process(ranks):
    first, second = ranks["checkpoint"]
    assert first["_state_len"] == len(ListNet().state_dict()) and second["_state_len"] == 0  # rank0_only
    assert first["_tensor_types"] == ["Tensor"] and first["_devices"] == ["cpu"]
    state = torch.load(ranks["_dir"] / "full.pt")
    assert list(state) == list(ListNet().state_dict())
    model = ListNet()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        outputs = model(probe())
    expected = reference("checkpoint")
    torch.testing.assert_close(outputs, expected["outputs"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first["outputs"], outputs, rtol=0, atol=0)  # the sharded model's own
    assert_one_process(ranks, "checkpoint")


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_pre_migration_checkpoint_resumes_as_in_one_process(ranks):
    assert_one_process(ranks, "resume")
    for result in ranks["resume"]:
        assert result["_missing"] == []
        assert result["_plain_load_exact"], "model.load_state_dict(full state) on a sharded model"


@pytest.mark.e2e
@pytest.mark.ddp
def test_optimizer_state_round_trip(ranks):
    assert_one_process(ranks, "optimizer_roundtrip")
    first, second = ranks["optimizer_roundtrip"]
    straight = reference("list_after")  # 5 steps without saving
    for key, value in straight.items():
        if key.startswith("param."):
            torch.testing.assert_close(first[key], value, rtol=1e-5, atol=1e-6)
    # rank 0's state is one process's `optimizer.state_dict()`: numbered, plain tensors
    assert first["_rank0_keys"] == list(range(len(list(ListNet().parameters())))) and second["_rank0_keys"] == []
    assert first["_group_params"] == [first["_rank0_keys"]]
    expected = reference("optimizer_roundtrip")
    saved = [k for k in expected if k.startswith("_opt.")]
    assert saved and sorted(saved) == sorted(k for k in first if k.startswith("_opt."))
    for key in saved:
        assert type(first[key]) is torch.Tensor and first[key].device.type == "cpu"
        torch.testing.assert_close(first[key], expected[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}\n{m}")


@pytest.mark.e2e
@pytest.mark.ddp
def test_clipping_sharded_and_plain_parameters_together(ranks):
    assert_one_process(ranks, "mixed_clipping")
    first, _ = ranks["mixed_clipping"]
    assert (first["norms"] > MAX_NORM).all()


@pytest.mark.e2e
@pytest.mark.ddp
def test_batchnorm_statistics_of_a_sharded_model_are_averaged_across_ranks(ranks):
    assert_one_process(ranks, "batchnorm")
    assert ranks["batchnorm"][0]["_dtypes"] == {"linear": ["torch.float32"], "bn": ["torch.float32"],
                                                "bn_input": ["torch.float32"]}


@pytest.mark.e2e
@pytest.mark.ddp
def test_mixed_precision_computes_in_bfloat16_on_the_cpu_with_batchnorm_in_float32(ranks):
    for result in ranks["batchnorm_mixed_precision"]:
        assert result["_dtypes"] == {"linear": ["torch.bfloat16"], "bn": ["torch.float32"],
                                     "bn_input": ["torch.bfloat16"]}
        assert all(v.dtype == torch.float32 for k, v in result.items() if k.startswith("param."))
    # bfloat16 keeps ~3 significant digits: the losses near float32 training's, the weights
    # the same on both ranks (after 5 steps not near float32's)
    first, second = ranks["batchnorm_mixed_precision"]
    expected = reference("batchnorm_mixed_precision")
    torch.testing.assert_close((first["losses"] + second["losses"]) / 2, expected["losses"], rtol=0.1, atol=0)
    assert not torch.equal(first["losses"], second["losses"])
    for key in expected:
        if key.startswith("param."):
            assert torch.equal(first[key], second[key]), key


@pytest.mark.e2e
@pytest.mark.ddp
def test_a_dtensor_input_made_from_a_parameter_is_given_whole(ranks):
    assert_one_process(ranks, "recurrent_hidden_from_a_parameter")


@pytest.mark.e2e
@pytest.mark.ddp
def test_the_environment_overrides_blocks_and_resharding(ranks):
    for result in ranks["environment"]:
        assert result["_units0"] == result["_units1"] == ["", "first", "second"]
        assert result["_gathered_after_forward0"] and not result["_gathered_after_forward1"]


@pytest.mark.e2e
@pytest.mark.ddp
def test_sharding_twice_is_a_no_op_and_a_frozen_model_is_left_alone(ranks):
    for result in ranks["idempotent_and_frozen"]:
        assert result["_twice_same"] and result["_frozen_same"]


# ---------------------------------------------------------------- in one process

def sharding(rt):
    """Where the private helpers live: the package's `sharding` module, or the vendored module."""
    return rt.sharding if rt is runtime else rt


def test_one_process_is_the_plain_behaviour(rt, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model = ListNet()
    params = [id(p) for p in model.parameters()]
    assert rt.shard_model(model, blocks=Block, reshard_after_forward=True, mixed_precision=True) is model
    assert [id(p) for p in model.parameters()] == params
    state = rt.full_state_dict(model)
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    other = ListNet()
    assert rt.load_full_state_dict(other, {f"module.{k}": v for k, v in state.items()}).missing_keys == []
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    saved = rt.full_optimizer_state_dict(model, opt, rank0_only=False)
    assert list(saved["state"]) == list(opt.state_dict()["state"])
    fresh = torch.optim.AdamW(other.parameters(), lr=0.1)
    rt.load_full_optimizer_state_dict(other, fresh, saved)
    assert torch.equal(fresh.state[other.head.weight]["exp_avg"], opt.state[model.head.weight]["exp_avg"])


class Basic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)
        self.bn = nn.BatchNorm2d(4)


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.layer1 = nn.Sequential(Basic(), Basic())
        self.layer2 = nn.Sequential(Basic(), Basic(), Basic())
        self.fc = nn.Linear(4, 2)


def names(model, units):
    return [n for n, m in model.named_modules() if any(m is u for u in units)]


def test_repeated_blocks_are_found_outermost_first(rt, monkeypatch):
    monkeypatch.delenv("GPUMIGRATE_FSDP_BLOCKS", raising=False)
    units = sharding(rt)._fsdp_units
    model = ListNet()
    assert names(model, units(model, None)) == ["blocks.0", "blocks.1", "blocks.2"]
    model = ResNetLike()
    assert names(model, units(model, None)) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]
    model = nn.Sequential(*[Block() for _ in range(2)])  # the root itself holds the blocks
    assert names(model, units(model, None)) == ["0", "1"]
    assert units(flat_net(), None) == [] and units(Pair(), None) == []
    same = Block()
    assert units(nn.ModuleList([same, same]), None) == []  # one module twice: not two blocks
    assert units(nn.ModuleList([nn.ReLU(), nn.ReLU()]), None) == []  # nothing to shard


def test_named_blocks_and_the_environment(rt, monkeypatch):
    mod = sharding(rt)
    monkeypatch.delenv("GPUMIGRATE_FSDP_BLOCKS", raising=False)
    model = ResNetLike()
    assert names(model, mod._fsdp_units(model, mod._blocks_setting(Basic))) == [
        "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]
    assert names(model, mod._fsdp_units(model, mod._blocks_setting(["Sequential"]))) == ["stem", "layer1", "layer2"]
    monkeypatch.setenv("GPUMIGRATE_FSDP_BLOCKS", " Conv2d, Linear ")  # wins over the argument
    assert mod._blocks_setting(Basic) == ("Conv2d", "Linear")
    assert len(mod._fsdp_units(model, mod._blocks_setting(Basic))) == 7
    monkeypatch.setenv("GPUMIGRATE_FSDP_BLOCKS", "Nothing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mod._fsdp_units(model, mod._blocks_setting(None)) == []
    assert len(caught) == 1 and "Nothing" in str(caught[0].message) and "\n" not in str(caught[0].message)


def test_blocks_sharing_parameters_are_left_to_their_parent(rt):
    units = sharding(rt)._fsdp_units
    model = ListNet()
    model.blocks[1].fc = model.blocks[0].fc  # shared between two blocks
    assert names(model, units(model, None)) == ["blocks.2"]
    model = ListNet()
    model.head.weight = model.blocks[2].fc.weight  # tied with a layer outside the blocks
    assert names(model, units(model, None)) == ["blocks.0", "blocks.1"]


def test_resharding_and_mixed_precision_settings(rt, monkeypatch):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mod = sharding(rt)
    monkeypatch.delenv("GPUMIGRATE_FSDP_RESHARD", raising=False)
    monkeypatch.delenv("GPUMIGRATE_AMP", raising=False)
    assert mod._reshard_setting(None) is None and mod._reshard_setting(False) is False
    monkeypatch.setenv("GPUMIGRATE_FSDP_RESHARD", "0")
    assert mod._reshard_setting(True) is False
    monkeypatch.setenv("GPUMIGRATE_FSDP_RESHARD", "yes")
    with pytest.raises(ValueError, match="GPUMIGRATE_FSDP_RESHARD"):
        mod._reshard_setting(None)
    model = nn.Linear(2, 2)
    policy = mod._policy(model, True, MixedPrecisionPolicy)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)  # autocast's on a CPU
    assert mod._policy(model, None, MixedPrecisionPolicy) is None
    assert mod._policy(model, False, MixedPrecisionPolicy) is None
    own = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert mod._policy(model, own, MixedPrecisionPolicy) is own
    monkeypatch.setenv("GPUMIGRATE_AMP", "off")
    assert mod._policy(model, True, MixedPrecisionPolicy) is None
    monkeypatch.setenv("GPUMIGRATE_AMP", "fp16")
    assert mod._policy(model, True, MixedPrecisionPolicy).param_dtype == torch.float16


def test_without_fully_shard_ddp_is_used_with_one_warning(rt, monkeypatch):
    mod = sharding(rt)
    monkeypatch.setattr(mod, "is_distributed", lambda: True)
    monkeypatch.setattr(mod, "is_main_process", lambda: True)
    monkeypatch.setattr(mod, "_fsdp", lambda: None)
    monkeypatch.setattr(mod, "wrap_model", lambda model: ("ddp", model))
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mod.shard_model(model) == ("ddp", model)
    assert len(caught) == 1 and "using DDP instead" in str(caught[0].message)
