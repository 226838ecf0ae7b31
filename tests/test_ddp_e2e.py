"""`--to ddp` end to end: each DDP golden runs once in one process and once under
`torchrun --standalone --nproc_per_node=2` (gloo, CPU), both through gpumigrate/verify/probe.py, and
the two runs must show that the migration is right, not merely that it runs:

1. `python X.py` exits 0;                      2. the torchrun run exits 0 on both ranks;
3. per epoch the ranks train on disjoint shards that together cover the training set
   (DistributedSampler padding aside), in a new order every epoch (`set_epoch`); the
   evaluation shards are disjoint and exact (no padded duplicates in the metrics);
4. after training, the parameters are the same on both ranks;
5. nothing is printed twice: rank 1 prints nothing, and the output has the same kinds of
   lines as the one-process run, and the same number of epoch-level lines;
6. every checkpoint is written once, as in one process, and loads with
   `load_state_dict(strict=True)` into the model of the ORIGINAL script;
7. the test accuracy printed under torchrun equals the ORIGINAL script's own evaluation of the
   saved weights, in one process, over the whole test set;
8. (no golden needed) DDP with two ranks and per-rank batch B/2 reproduces one process with
   batch B, using the runtime helpers directly.

How 6 and 7 reach "the original model": the ORIGINAL fixture (or, when it cannot run on a CPU,
its `--to device` golden; see REFERENCE) is run once in one process under the probe with
`--probe-load CKPT...` and `--probe-eval-with CKPT`. The probe remembers every module the
script uses (`train()`/`state_dict()`/forward), and after the script ends loads each state_dict
of the torchrun checkpoints, strictly, into the module with exactly those keys: the original
class, built by the original code (no AST surgery, no `--epochs 0` needed, and nn.Sequential
models built in a function work too). For 7, each time the original switches that module to
eval mode the probe swaps the DDP weights in (and back on `train()`), so the original's own
evaluate() measures the saved weights; its last printed accuracy must equal torchrun's.

Goldens are read from fixtures/expected/ddp/<name>; a missing golden fails its tests.
`GPUMIGRATE_DDP_GOLDENS=/some/dir` points the tests at other goldens (hand-written ones, say).
Each fixture runs under torchrun once per session (module-scoped cache): ~6-10 s each here.
The `ddp` marker has to be registered in pyproject.toml next to `e2e`.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from tests.conftest import FIXTURES
from tests.probe_runs import NPROC, Run, run_probe

pytestmark = [pytest.mark.e2e, pytest.mark.ddp]

GOLDENS = Path(os.environ.get("GPUMIGRATE_DDP_GOLDENS") or FIXTURES / "expected" / "ddp")
DDP_FIXTURES = ["mnist_2019.py", "resnet_dataparallel.py", "dcgan_gan.py", "checkpoint_resume.py", "local_rank_launch.py"]
PARAM_TOL = 1e-6

# The single-process reference for checks 6 and 7: the original itself, except where the
# original cannot run on a CPU (hard-coded cuda:0); there, its device-target golden.
REFERENCE = {"checkpoint_resume.py": FIXTURES / "expected" / "device" / "checkpoint_resume.py"}
REFERENCE_ARGS = {"mnist_2019.py": ["--no-cuda"]}
# Check 7: the test-set line of each fixture that prints an accuracy.
ACCURACY = {
    "mnist_2019.py": re.compile(r"Average loss: (?P<loss>\d+\.\d+), Accuracy: (?P<correct>\d+)/(?P<total>\d+)"),
    "resnet_dataparallel.py": re.compile(r"test loss (?P<loss>\d+\.\d+) acc (?P<correct>\d+)/(?P<total>\d+)"),
}
# Check 5: lines printed once per epoch (or once per run), whose count must not change under
# DDP. Per-batch lines legitimately become fewer (each rank runs 1/world of the batches).
EPOCH_LINES = {
    "mnist_2019.py": [r"^Test set:"],
    "resnet_dataparallel.py": [r"^Epoch \d+:", r"classifier weight norm", r"^saved to"],
    "dcgan_gan.py": [r"^Namespace\(", r"^\[Epoch \d+/\d+\] \[Batch 0/"],
    "checkpoint_resume.py": [r"^epoch \d+ loss", r"^resumed at", r"^val loss"],
    "local_rank_launch.py": [r"^epoch \d+ \|", r"^checkpoint written"],
}
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf")


# ---------------------------------------------------------------- running

class DDPRuns:
    """Each fixture's runs, made on first use and kept for the whole module."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.cache: Dict[tuple, Run] = {}

    def golden(self, name: str) -> Path:
        path = GOLDENS / name
        if not path.exists():
            pytest.fail(f"no DDP golden {path}: run GPUMIGRATE_UPDATE_GOLDENS=1 pytest tests/test_fixtures.py")
        return path

    def _get(self, key, make) -> Run:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def python(self, name: str) -> Run:
        golden = self.golden(name)
        return self._get(("python", name), lambda: run_probe(golden, self.base / name / "python", 1, kind="python"))

    def torchrun(self, name: str) -> Run:
        golden = self.golden(name)
        return self._get(("torchrun", name),
                         lambda: run_probe(golden, self.base / name / "torchrun", NPROC, kind="torchrun"))

    def torchrun_ok(self, name: str) -> Run:
        run = self.torchrun(name)
        if run.returncode != 0 or sorted(run.ranks) != list(range(NPROC)):
            errors = "; ".join(f"rank {r}: {rep['error']['type']}: {rep['error']['message'][:200]}"
                               for r, rep in sorted(run.ranks.items()) if rep.get("error"))
            pytest.fail(f"the torchrun run failed (details: test_torchrun_run_exits_0[{name}]): "
                        f"{errors or run.why()[-500:]}", pytrace=False)
        return run

    def reference(self, name: str) -> Optional[Run]:
        """The original, in one process, loading (and evaluating) the torchrun checkpoints."""
        run = self.torchrun_ok(name)

        def make() -> Optional[Run]:
            saves = [s for s in run.ranks[0]["saves"] + run.ranks[1]["saves"] if s["state_dicts"]]
            files = sorted({s["path"] for s in saves if os.path.exists(s["path"])})
            if not files and name not in ACCURACY:
                return None
            probe_args: List[str] = []
            for path in files:
                probe_args += ["--probe-load", path]
            if name in ACCURACY:
                if not files:
                    pytest.fail("the torchrun run saved no weights to evaluate", pytrace=False)
                probe_args += ["--probe-eval-with", [s["path"] for s in saves if os.path.exists(s["path"])][-1]]
            original = REFERENCE.get(name, FIXTURES / "scripts" / name)
            return run_probe(original, self.base / name / "reference", 1, REFERENCE_ARGS.get(name, []), probe_args,
                             kind="reference (original, one process)")

        return self._get(("reference", name), make)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    runs = DDPRuns(tmp_path_factory.mktemp("ddp"))
    yield runs
    timings = ", ".join(f"{kind} {name} {run.seconds:.1f}s" for (kind, name), run in runs.cache.items() if run)
    print(f"\nDDP runs: {timings}")


# ---------------------------------------------------------------- invariants (shared with test 8)

def check_training_shards(reports: Sequence[dict], single: Optional[dict] = None) -> None:
    """Check 3 on the ranks' sampler records (see the module docstring)."""
    world = len(reports)
    for report in reports:
        whole = [it for it in report["samplers"] if it["kind"] == "RandomSampler"]
        assert not whole, (f"rank {report['rank']}: a loader still shuffles the whole dataset "
                           f"(RandomSampler over {whole[0]['dataset_len']} samples) on every rank")
    per_rank = [[it for it in rep["samplers"] if it["kind"] == "DistributedSampler"] for rep in reports]
    assert per_rank[0], "no DistributedSampler was iterated: every rank trains on the whole dataset"
    assert len({len(its) for its in per_rank}) == 1, f"ranks ran different numbers of epochs: {[len(i) for i in per_rank]}"
    for epoch, its in enumerate(zip(*per_rank)):
        n = its[0]["dataset_len"]
        assert {it["dataset_len"] for it in its} == {n}, f"epoch {epoch}: the ranks iterate different datasets"
        assert sorted(it["sampler_rank"] for it in its) == list(range(world)), f"epoch {epoch}: rank numbers"
        assert all(it["num_replicas"] == world for it in its), f"epoch {epoch}: num_replicas != {world}"
        shards = [it["indices"] for it in its]
        assert len({len(s) for s in shards}) == 1, f"epoch {epoch}: ranks take different numbers of samples"
        counts = Counter(i for shard in shards for i in shard)
        padded = sum(len(s) for s in shards) - n  # DistributedSampler pads to a multiple of world
        if its[0]["drop_last"]:
            assert max(counts.values()) == 1, f"epoch {epoch}: shards overlap"
        else:
            assert set(counts) == set(range(n)), f"epoch {epoch}: {n - len(counts)} training samples on no rank"
            assert 0 <= padded < world and sum(c - 1 for c in counts.values()) == padded, (
                f"epoch {epoch}: shards overlap beyond the {padded} padded duplicates")
    for rank, its in enumerate(per_rank):
        shuffled = [it for it in its if it["shuffle"]]
        for prev, cur in zip(shuffled, shuffled[1:]):
            if prev["dataset_len"] == cur["dataset_len"]:
                assert cur["indices"] != prev["indices"], (
                    f"rank {rank}: epoch order repeats (set_epoch not called? sampler epoch {cur['epoch']})")
    # Evaluation shards (distributed_sampler(pad=False)): exact partition, nothing counted twice.
    evals = [[it for it in rep["samplers"] if it["kind"] == "_Shard"] for rep in reports]
    assert len({len(e) for e in evals}) == 1, "ranks evaluated different numbers of times"
    for its in zip(*evals):
        n = its[0]["dataset_len"]
        counts = Counter(i for it in its for i in it["indices"])
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, "evaluation shards are not a partition"
    if single is not None:  # as many training epochs as in one process, over the same datasets
        one = [it["dataset_len"] for it in single["samplers"] if it["kind"] in ("RandomSampler", "DistributedSampler")]
        assert one == [it["dataset_len"] for it in per_rank[0] if it["shuffle"]], (
            "the training loaders differ from the one-process run (epochs or datasets)")


def check_same_parameters(run: Run, tol: float = PARAM_TOL) -> None:
    """Check 4: every wrapped model has the same parameters on every rank."""
    models = [run.ranks[r]["models"] for r in range(len(run.ranks))]
    assert models[0], "wrap_model was never called"
    assert len({len(m) for m in models}) == 1, "ranks wrapped different numbers of models"
    assert all(m["wrapper"] == "DistributedDataParallel" for ms in models for m in ms), "a model was not wrapped in DDP"
    for i in range(len(models[0])):
        base = run.vector(0, i)
        for rank in range(1, len(models)):
            other = run.vector(rank, i)
            assert other.shape == base.shape, f"model {i}: rank {rank} has a different parameter count"
            diff = (other - base).abs().max().item() if base.numel() else 0.0
            assert diff <= tol, f"model {i} ({models[0][i]['module']}): rank {rank} differs from rank 0 by {diff:g}"


def shapes(text: str) -> Counter:
    return Counter(NUMBER.sub("#", line.rstrip()) for line in text.splitlines())


# ---------------------------------------------------------------- the fixtures

fixture_names = pytest.mark.parametrize("name", DDP_FIXTURES)


@fixture_names
def test_python_run_exits_0(name, ddp_runs):
    run = ddp_runs.python(name)
    assert run.returncode == 0 and run.ranks.get(0, {}).get("error") is None, run.why()
    assert run.ranks[0]["world_size"] == 1 and run.ranks[0]["process_group_world_size"] == 1
    assert run.stdout.strip(), "the script printed nothing"


@fixture_names
def test_torchrun_run_exits_0(name, ddp_runs):
    run = ddp_runs.torchrun(name)
    assert run.returncode == 0, run.why()
    assert sorted(run.ranks) == list(range(NPROC)), f"probe reports from ranks {sorted(run.ranks)} only"
    for rank, report in run.ranks.items():
        assert report["error"] is None, run.why()
        assert report["world_size"] == NPROC and report["process_group_world_size"] == NPROC, (
            f"rank {rank} did not join a process group of {NPROC} (setup_distributed not called?)")


@fixture_names
def test_ranks_train_on_disjoint_shards_each_epoch(name, ddp_runs):
    run = ddp_runs.torchrun_ok(name)
    single = ddp_runs.python(name)
    check_training_shards([run.ranks[r] for r in range(NPROC)], single.ranks.get(0))


@fixture_names
def test_parameters_identical_across_ranks(name, ddp_runs):
    run = ddp_runs.torchrun_ok(name)
    check_same_parameters(run)
    single = ddp_runs.python(name)
    if single.ranks.get(0):
        assert len(single.ranks[0]["models"]) == len(run.ranks[0]["models"]), (
            "wrap_model was called a different number of times in one process")


@fixture_names
def test_nothing_printed_twice(name, ddp_runs):
    run = ddp_runs.torchrun_ok(name)
    single = ddp_runs.python(name)
    assert single.returncode == 0, single.why()
    for rank in range(1, NPROC):
        printed = run.ranks[rank]["stdout"]
        assert printed == "", f"rank {rank} printed (each line appears once per rank):\n{printed[:500]}"
    ddp, one = shapes(run.stdout), shapes(single.stdout)
    assert set(ddp) == set(one), f"kinds of lines differ: only under torchrun {set(ddp) - set(one)}, " \
                                 f"only in one process {set(one) - set(ddp)}"
    more = {line: (ddp[line], one[line]) for line in ddp if ddp[line] > one[line]}
    assert not more, f"lines printed more often under torchrun than in one process: {more}"
    for pattern in EPOCH_LINES.get(name, []):
        count = [sum(bool(re.search(pattern, line)) for line in out.splitlines()) for out in (run.stdout, single.stdout)]
        assert count[0] == count[1], f"{pattern!r}: {count[0]} lines under torchrun, {count[1]} in one process"


@fixture_names
def test_checkpoints_written_once_and_load_into_original(name, ddp_runs):
    run = ddp_runs.torchrun_ok(name)
    single = ddp_runs.python(name)
    assert single.returncode == 0, single.why()
    ddp_saves = Counter(os.path.basename(s["path"]) for r in run.ranks.values() for s in r["saves"])
    one_saves = Counter(os.path.basename(s["path"]) for s in single.ranks[0]["saves"])
    assert ddp_saves == one_saves, f"torch.save calls under torchrun {dict(ddp_saves)}, in one process {dict(one_saves)}"
    on_disk = Counter(p.name for p in run.checkpoint_files())
    for saved in ddp_saves:
        assert on_disk[saved] == 1, f"{saved}: {on_disk[saved]} files (one per rank's temp dir?)"
    for report in run.ranks.values():
        for save in report["saves"]:
            for entry, keys in save["state_dicts"].items():
                prefixed = [k for k in keys if k.startswith("module.")]
                assert not prefixed, f"{save['path']} [{entry!r}]: DDP's 'module.' prefix: {prefixed[:3]}"
    reference = ddp_runs.reference(name)
    if reference is None:
        return  # the script saves no weights
    assert reference.returncode == 0, reference.why()
    loads = reference.ranks[0]["loads"]
    saved_files = {s["path"] for r in run.ranks.values() for s in r["saves"] if s["state_dicts"]}
    assert {load["file"] for load in loads} == saved_files
    for load in loads:
        assert load["loaded_into"], f"{load['file']} [{load['entry']!r}] does not load into the original: {load['error']}"


@pytest.mark.parametrize("name", sorted(ACCURACY))
def test_accuracy_equals_single_process_eval_of_saved_weights(name, ddp_runs):
    run = ddp_runs.torchrun_ok(name)
    reference = ddp_runs.reference(name)
    assert reference is not None and reference.returncode == 0, reference and reference.why()
    assert reference.ranks[0]["eval_swaps"] >= 1, (
        "no module of the original with the saved keys was ever put in eval mode: "
        + "; ".join(str(load["error"]) for load in reference.ranks[0].get("loads", []) if load["error"]))
    pattern = ACCURACY[name]
    ddp = list(pattern.finditer(run.stdout))
    own = list(pattern.finditer(reference.stdout))
    assert ddp, f"no test-set line ({pattern.pattern}) in the torchrun output"
    assert own, "no test-set line in the original's output"
    last, expected = ddp[-1], own[-1]
    assert (last["correct"], last["total"]) == (expected["correct"], expected["total"]), (
        f"torchrun printed {last.group(0)!r}; the original evaluating the saved weights printed {expected.group(0)!r}")
    assert abs(float(last["loss"]) - float(expected["loss"])) <= 2e-4, (last.group(0), expected.group(0))


# ---------------------------------------------------------------- 8: DDP == one big batch

EQUIVALENCE_SCRIPT = '''\
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpumigrate.runtime import (distributed_sampler, is_main_process, reduce_sum, set_epoch,
                                setup_distributed, wrap_model)

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

device = setup_distributed()
torch.manual_seed(0)
w = torch.randn(5, 2)
x, x_test = torch.randn(64, 5), torch.randn(21, 5)
y, y_test = x @ w + 0.1 * torch.randn(64, 2), x_test @ w
train_set, test_set = TensorDataset(x, y), TensorDataset(x_test, y_test)
train_loader = DataLoader(train_set, batch_size=args.batch_size,
                          sampler=distributed_sampler(train_set, shuffle=False))
test_loader = DataLoader(test_set, batch_size=4, sampler=distributed_sampler(test_set, shuffle=False, pad=False))

model = wrap_model(nn.Linear(5, 2).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(args.epochs):
    set_epoch(train_loader, epoch)
    model.train()
    for xb, yb in train_loader:
        optimizer.zero_grad()
        F.mse_loss(model(xb.to(device)), yb.to(device)).backward()
        optimizer.step()
    model.eval()
    sse, n = 0.0, 0
    with torch.no_grad():
        for xb, yb in test_loader:
            sse += ((model(xb.to(device)) - yb.to(device)) ** 2).sum().item()
            n += xb.size(0)
    sse, n = reduce_sum(sse, n)
    if is_main_process():
        print("epoch {} test mse {:.8f} over {}".format(epoch, sse / n / 2, n))
'''


def test_ddp_with_half_batches_equals_one_process(tmp_path):
    script = tmp_path / "equivalence.py"
    script.write_text(EQUIVALENCE_SCRIPT)
    batch = 8
    one = run_probe(script, tmp_path / "one", 1, ["--batch-size", str(batch)], kind="python")
    two = run_probe(script, tmp_path / "two", NPROC, ["--batch-size", str(batch // NPROC)], kind="torchrun")
    assert one.returncode == 0, one.why()
    assert two.returncode == 0 and sorted(two.ranks) == list(range(NPROC)), two.why()
    assert one.ranks[0]["models"][0]["wrapper"] == "Linear"
    check_same_parameters(two)
    # Per-rank batch k is samples [kB, kB+B) split by parity: the same batch as in one process.
    check_training_shards([two.ranks[r] for r in range(NPROC)])
    reference = one.vector(0, 0)
    for rank in range(NPROC):
        diff = (two.vector(rank, 0) - reference).abs().max().item()
        assert diff <= 1e-5, f"rank {rank} differs from the one-process run by {diff:g}"
    lines_one, lines_two = one.stdout.splitlines(), two.stdout.splitlines()
    assert len(lines_one) == len(lines_two) == 3 and all(" over 21" in line for line in lines_two), two.stdout
    for a, b in zip(lines_one, lines_two):
        assert NUMBER.sub("#", a) == NUMBER.sub("#", b)
        assert math.isclose(float(a.split()[4]), float(b.split()[4]), rel_tol=1e-5, abs_tol=1e-7), (a, b)
