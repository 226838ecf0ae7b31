"""`--to fsdp` end to end: each fsdp golden (FSDP_SCRIPTS of tests/test_fixtures.py) runs
under `torchrun --standalone --nproc_per_node=2` (gloo, CPU) through gpumigrate/verify/probe.py,
and so does the same fixture's ddp golden. The fsdp migration is the ddp migration with the
model sharded instead of replicated: the same data per rank in the same order, the same
averaged gradients. So the ddp run, which tests/test_ddp_e2e.py holds to the one-process
semantics, is the oracle here:

1. both runs exit 0 on both ranks;
2. every loss rank 0 prints equals the ddp run's within 1e-5 relative (or one unit of the
   last printed digit);
3. each checkpoint is written once, by rank 0, holds whole tensors (no DTensor shards) with
   the ddp checkpoint's keys, and its values are the ddp checkpoint's within PARAM_ATOL;
4. it loads with `load_state_dict(strict=True)` (a whole pickled model: unpickles) into the
   ORIGINAL script's model, in one process (the probe's `--probe-load`, as in test_ddp_e2e.py,
   on the `--to device` golden: the original's own code, runnable on a CPU).

PARAM_ATOL: without gradient clipping the two runs' weights are bit for bit the same
(transformer_blocks.py with `--clip 1e9`); clipping sums the squared gradients per shard
and then across ranks, an order whose last bit can differ from DDP's, and AdamW's
normalised steps carry that to ~1e-4 after 16 steps.
"""

from __future__ import annotations

import pickle
import re
import types
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.conftest import FIXTURES
from tests.probe_runs import NPROC, Run, run_probe

pytestmark = [pytest.mark.e2e, pytest.mark.ddp]

FSDP_FIXTURES = {"transformer_blocks.py": [], "wordlm_batches.py": [], "mnist_2019.py": [],
                 "resnet_dataparallel.py": [], "local_rank_launch.py": []}
# BatchNorm's running statistics: ddp keeps rank 0's (DDP broadcasts buffers), fsdp their mean
# over the ranks (the runtime averages them at each step; the report says so). Training is the
# same; evaluations and the statistics in the checkpoint differ by design.
EVALUATION = {"resnet_dataparallel.py": re.compile(r"\|\s*test loss.*")}
STATISTICS = ("running_mean", "running_var")
REFERENCE_ARGS = {"mnist_2019.py": ["--no-cuda"]}
PARAM_ATOL = 5e-4
LOSS_RTOL = 1e-5
# timings printed beside the losses, which differ from run to run
_TIMING = re.compile(r"time:\s*\S+|ms/batch\s*\S+")
_NUMBER = re.compile(r"[-+]?\d+\.\d+(?:[eE][-+]?\d+)?")


class Runs:
    def __init__(self, base: Path) -> None:
        self.base, self.cache = base, {}

    def torchrun(self, target: str, name: str) -> Run:
        key = (target, name)
        if key not in self.cache:
            golden = FIXTURES / "expected" / target / name
            if not golden.exists():
                pytest.fail(f"no {target} golden {golden}: run GPUMIGRATE_UPDATE_GOLDENS=1 pytest tests/test_fixtures.py")
            self.cache[key] = run_probe(golden, self.base / target / name, NPROC, kind=f"{target} torchrun")
        run = self.cache[key]
        if not run.ok():
            pytest.fail(f"{target} {name}: {run.summary()}", pytrace=False)
        return run

    def reference(self, name: str, checkpoints: List[str], target: str = "fsdp") -> Run:
        """The original in one process, loading the fsdp checkpoints into its own model."""
        args = [a for path in checkpoints for a in ("--probe-load", path)]
        # the original's model, built by its own code; its device golden, which runs on a CPU
        return run_probe(FIXTURES / "expected" / "device" / name, self.base / "reference" / target / name, 1,
                         REFERENCE_ARGS.get(name, []),
                         args, kind="reference (original, one process)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    yield Runs(tmp_path_factory.mktemp("fsdp"))


def losses(stdout: str, name: str) -> List[str]:
    evaluation = EVALUATION.get(name)
    lines = [evaluation.sub("", line) if evaluation else line for line in stdout.splitlines()]
    return [n for line in lines if "loss" in line.lower() for n in _NUMBER.findall(_TIMING.sub("", line))]


def _close(a: str, b: str) -> bool:
    unit = 10.0 ** -len(a.split(".")[1].split("e")[0].split("E")[0])
    x, y = float(a), float(b)
    return abs(x - y) <= max(LOSS_RTOL * abs(y), unit)


class _ScriptClasses(pickle.Unpickler):
    """Unpickles a whole model pickled by a script: its own classes (`__main__.RNNModel`)
    become bare nn.Module subclasses of the same name, enough to read the state_dict."""

    def find_class(self, module: str, name: str):
        if module == "__main__":
            return type(name, (torch.nn.Module,), {})
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_ScriptClasses, load=pickle.load, __name__="pickle")


def load_checkpoint(path: str):
    return torch.load(path, weights_only=False, pickle_module=_PICKLE)


def saves(run: Run) -> Dict[int, List[str]]:
    """The files each rank wrote (once each: the best model is written again as it improves)."""
    return {rank: list(dict.fromkeys(s["path"] for s in report["saves"])) for rank, report in run.ranks.items()}


def same_checkpoint(ours, theirs, name: str, where: str = "") -> None:
    """The fsdp checkpoint holds what the ddp one holds: whole tensors, within PARAM_ATOL."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), f"{where}: keys differ"
        for key in theirs:
            same_checkpoint(ours[key], theirs[key], name, f"{where}/{key}")
    elif isinstance(theirs, torch.Tensor):
        assert type(ours) is torch.Tensor, f"{where}: {type(ours).__name__}, not a whole tensor"
        if not (name in EVALUATION and where.endswith(STATISTICS)):
            assert torch.allclose(ours.double(), theirs.double(), atol=PARAM_ATOL, rtol=0), where
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("name", sorted(FSDP_FIXTURES))
def test_fsdp_trains_what_ddp_trains(name, runs):
    fsdp, ddp = runs.torchrun("fsdp", name), runs.torchrun("ddp", name)
    got, want = losses(fsdp.stdout, name), losses(ddp.stdout, name)
    assert want, "the ddp run printed no loss"
    assert len(got) == len(want), f"{len(got)} losses printed under fsdp, {len(want)} under ddp"
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(got, want)) if not _close(a, b)]
    assert not bad, f"losses differ from the ddp run (index, fsdp, ddp): {bad[:5]}"


@pytest.mark.parametrize("name", sorted(FSDP_FIXTURES))
def test_rank0_writes_whole_checkpoints_that_load_into_the_original(name, runs):
    fsdp, ddp = runs.torchrun("fsdp", name), runs.torchrun("ddp", name)
    written = saves(fsdp)
    assert written[0] and not written[1], f"checkpoints by rank: {written}"
    assert [Path(p).name for p in written[0]] == [Path(p).name for r in sorted(saves(ddp)) for p in saves(ddp)[r]]
    for path, twin in zip(written[0], saves(ddp)[0]):
        ours, theirs = load_checkpoint(path), load_checkpoint(twin)
        if isinstance(ours, torch.nn.Module):  # a whole pickled model (the 2018 word language model)
            assert type(ours).__name__ == type(theirs).__name__, "a sharded (FSDP) class was pickled"
            ours, theirs = ours.state_dict(), theirs.state_dict()
        same_checkpoint(ours, theirs, name)
    reference = runs.reference(name, written[0])
    assert reference.returncode == 0, reference.why()
    loads = reference.ranks[0]["loads"]
    assert {load["file"] for load in loads} == set(written[0]), loads
    for load in loads:
        assert load["loaded_into"], f"{load['file']} does not load into the original: {load['error']}"


def test_fsdp_amp_trains_near_float32_and_saves_float32_weights(runs):
    """`--to fsdp,amp`: the shards compute in the autocast precision (bfloat16 on a CPU);
    the losses stay within 1% of the float32 fsdp run's, and the checkpoint holds float32
    weights (the sharded parameters stay float32) that load into the original."""
    name = "transformer_blocks.py"
    amp, full = runs.torchrun("fsdp,amp", name), runs.torchrun("fsdp", name)
    got, want = losses(amp.stdout, name), losses(full.stdout, name)
    assert len(got) == len(want) and got != want, "bfloat16 should change the last digits"
    assert all(abs(float(a) - float(b)) <= 0.01 * abs(float(b)) for a, b in zip(got, want)), (got, want)
    written = saves(amp)[0]
    state = load_checkpoint(written[0])
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    reference = runs.reference(name, written, "fsdp,amp")
    assert reference.returncode == 0 and all(load["loaded_into"] for load in reference.ranks[0]["loads"])
