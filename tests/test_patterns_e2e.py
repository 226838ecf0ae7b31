"""Issue 7's patterns end to end: the migrated fixtures must behave right, not merely run.

Each fixture of issue 7 (fixtures/scripts/<name>, one realistic script per group of patterns of
the field report) is migrated by the tool into fixtures/expected/{ddp,device}/<name> (the
goldens). These tests run the goldens through gpumigrate/verify/probe.py, in one process
(`python X.py`) and, for the DDP ones, under `torchrun --standalone --nproc_per_node=2` (gloo,
CPU), and check what the runs did: what each rank printed, which samples each rank iterated,
the parameters every optimizer trains, the files written and by whom, what torch.load read.
Nothing here compares source text, so any correct migration passes.

| fixture | target | what must hold |
|---|---|---|
| ssd_iterations.py | ddp | iteration-based loop over `iter(loader)`/`next()`: shuffled shards, a new order each time the iterator is rebuilt, no StopIteration, identical weights, step-time lines once (no collective in `Timer`), one checkpoint folder (timestamp from before `parse_args`), each checkpoint written once |
| classifier_meters.py | ddp | AverageMeter metrics: validation reports all 37 samples every epoch, equal to a one-process `--evaluate` of the saved weights; resumes from the DataParallel original's checkpoint (`module.` keys); one CSV writer; checkpoint and model_best written by one rank; the training average is a true average |
| config_finetune.py | ddp | optimizer from `getattr(torch.optim, ...)` with parameter groups, a loss module with trained centers, `model = torch.load(...)` before the optimizer: every trained parameter identical on both ranks; `torch.save([model, optimizer])` loads without a process group and holds the plain module; state-dict and tensor loads keep `weights_only` |
| functional_maml.py | ddp | a dict of tensors as the model (nothing to DDP-wrap): the tasks sharded, the gradients averaged at the optimizer step, identical meta-parameters on both ranks |
| legacy_char_rnn.py | device | 0.3 code in `__main__`: training updates the weights at every step, evaluation and sampling build no graph (`volatile`, `ev = lambda`), logged counts are numbers, not `tensor(...)` |
| wordlm_batches.py | ddp | batchified data without a DataLoader, `init_hidden` on the model, `torch.save(model)` of the best model reloaded at the end: identical weights, lines once, the test perplexity equals a one-process evaluation of the saved file |
| eval_only.py | device, ddp | inference only, DataParallel checkpoint: `python X.py` prints the original's accuracy and writes the same CSV |
| run_dir_main.py | ddp | run directory from `datetime`/`random` in `__main__`, a user function named `wrap_model`, a variable `torch_device`: one run directory, one RUNDIR line, the logger's file has the one-process number of lines, the pickle written once, identical weights, no deadlock |

Goldens are read from fixtures/expected/{ddp,device}/<name>; a missing golden fails its tests.
GPUMIGRATE_DDP_GOLDENS / GPUMIGRATE_DEVICE_GOLDENS point the tests at other migrations (for
instance hand-written ones). Every run is made once per module and cached.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch

from tests.conftest import FIXTURES
from tests.probe_runs import NPROC, Run, probe_env, run_probe

pytestmark = [pytest.mark.e2e]

SCRIPTS = FIXTURES / "scripts"
GOLDENS = {
    "ddp": Path(os.environ.get("GPUMIGRATE_DDP_GOLDENS") or FIXTURES / "expected" / "ddp"),
    "device": Path(os.environ.get("GPUMIGRATE_DEVICE_GOLDENS") or FIXTURES / "expected" / "device"),
}
TIMEOUT = 60      # seconds per run; a correct one takes < 10 s here, a deadlocked one never ends
PARAM_TOL = 1e-6
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|nan|inf")


# ---------------------------------------------------------------- running

class PatternRuns:
    """Every run of this module, made on first use and kept."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.cache: Dict[tuple, object] = {}

    def golden(self, target: str, name: str) -> Path:
        path = GOLDENS[target] / name
        if not path.exists():
            env = "GPUMIGRATE_DDP_GOLDENS" if target == "ddp" else "GPUMIGRATE_DEVICE_GOLDENS"
            pytest.fail(f"no {target} golden {path}: generate it (gpumigrate fixtures/scripts/{name} --to {target} "
                        f"-o {path}), or point {env} at a directory of migrated scripts", pytrace=False)
        return path

    def get(self, key: tuple, make: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def run(self, label: str, script: Path, nproc: int = 1, args: Sequence[str] = (),
            prepare: Optional[Callable[[Path], None]] = None, env: Optional[Dict[str, str]] = None,
            kind: str = "") -> Run:
        def make() -> Run:
            work = self.base / script.stem / label
            work.mkdir(parents=True, exist_ok=True)
            if prepare is not None:
                prepare(work)
            return run_probe(script, work, nproc, args, kind=kind or label, env=env, timeout=TIMEOUT)
        return self.get((script.stem, label), make)

    def original(self, run: Run) -> Run:
        """`run` of an unmigrated fixture, which must succeed: its failure is the fixture's bug."""
        if not run.ok():
            pytest.fail(f"the original fixture itself failed (fix the fixture): {run.summary()}", pytrace=False)
        return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = PatternRuns(tmp_path_factory.mktemp("patterns"))
    yield runs
    timings = ", ".join(f"{stem} {label} {run.seconds:.1f}s" for (stem, label), run in runs.cache.items()
                        if isinstance(run, Run))
    print(f"\npattern runs: {timings}")


def require_ok(run: Run, what: str = "") -> Run:
    if not run.ok():
        pytest.fail(f"the {what or run.kind} run failed, so this cannot be checked: {run.summary()}", pytrace=False)
    return run


# ---------------------------------------------------------------- shared checks

def assert_exits_0(run: Run) -> None:
    assert run.returncode is not None, (
        f"{run.kind}: did not finish within {TIMEOUT} s: the ranks are stuck (a collective reached by one "
        f"rank only, or in a different order)\n{run.why()}")
    assert run.returncode == 0 and run.ok(), f"{run.kind}: the script failed: {run.summary()}\n{run.why()}"
    if run.nproc > 1:
        for rank, report in run.ranks.items():
            assert report["process_group_world_size"] == NPROC, (
                f"rank {rank} never joined the process group (setup_distributed not called?)")


def assert_only_rank0_prints(run: Run) -> None:
    for rank in range(1, run.nproc):
        printed = run.ranks[rank]["stdout"]
        assert printed == "", f"rank {rank} printed too, so every line appears twice:\n{printed[:600]}"


def assert_trained_parameters_identical(run: Run, tol: float = PARAM_TOL) -> None:
    """Every parameter that any optimizer trains ends the same on every rank."""
    problems = [f"rank {r}: {rep['extras_error']}" for r, rep in run.ranks.items() if rep.get("extras_error")]
    assert not problems, f"the probe could not record the optimizers: {problems}"
    per_rank = [run.ranks[r]["optimizers"] for r in range(run.nproc)]
    assert per_rank[0], "no torch.optim optimizer was created: nothing was trained"
    assert len({len(o) for o in per_rank}) == 1, (
        f"the ranks created different numbers of optimizers: {[len(o) for o in per_rank]}")
    for i, entry in enumerate(per_rank[0]):
        base = run.optim_vector(0, i)
        for rank in range(1, run.nproc):
            other = run.optim_vector(rank, i)
            assert other.shape == base.shape, f"optimizer {i} ({entry['class']}) trains different parameters on rank {rank}"
            diff = (other - base).abs().max().item() if base.numel() else 0.0
            assert diff <= tol, (
                f"after training, the parameters of optimizer {i} ({entry['class']}, {entry['tensors']} tensors) differ "
                f"between rank 0 and rank {rank} by up to {diff:.3g}: the ranks trained on different data without "
                f"averaging the gradients of everything the optimizer updates (not all of it is in DDP), or took "
                f"different decisions (learning rate, reloads) from per-rank values")


def lines(text: str, pattern: str) -> List[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


def shapes(text: str) -> Counter:
    return Counter(NUMBER.sub("#", line.rstrip()) for line in text.splitlines())


def writes_by_rank(run: Run, key: str, field_name: str) -> Dict[str, Counter]:
    """{file name: Counter(rank -> times written)} from a per-rank list of records."""
    found: Dict[str, Counter] = {}
    for rank, report in run.ranks.items():
        for item in report.get(key, []):
            found.setdefault(item[field_name], Counter())[rank] += 1
    return found


def saves_by_rank(run: Run) -> Dict[str, Counter]:
    return writes_by_rank(run, "saves", "path")


# ================================================================ 1. ssd_iterations.py (ddp)

SSD = "ssd_iterations.py"
# Per run (--max_iter 40, a line pair every 5 iterations), as one process prints them:
SSD_LINES = {r"^iter \d+ \|\| Loss": 8, r"^timer: ": 8, r"^Finished training": 1}


def ssd_torchrun(runs) -> Run:
    return runs.run("torchrun", runs.golden("ddp", SSD), NPROC)


@pytest.mark.ddp
def test_ssd_torchrun_runs_every_iteration(runs):
    """Iteration-based training: `next(batch_iterator)` must never run dry (StopIteration when the
    epoch size still counts the whole dataset while each rank's loader holds half)."""
    run = ssd_torchrun(runs)
    dry = [r for r, rep in run.ranks.items() if (rep.get("error") or {}).get("type") == "StopIteration"]
    assert not dry, (f"rank(s) {dry}: `next(batch_iterator)` ran dry (StopIteration): the epoch size still counts "
                     f"the whole dataset while each rank's loader holds 1/{NPROC} of it")
    assert_exits_0(run)
    iterations = len(lines(run.stdout, r"^iter \d+ \|\| Loss"))
    assert iterations == 8, f"rank 0 printed {iterations} of the 8 'iter N || Loss' lines of a 40-iteration run"
    consumed = [sum(len(it["indices"]) for it in run.ranks[r]["samplers"]) for r in range(NPROC)]
    assert len(set(consumed)) == 1, f"the ranks drew different numbers of samples: {consumed} (different iteration counts)"


@pytest.mark.ddp
def test_ssd_loader_sharded_and_reshuffled_at_each_rebuild(runs):
    run = require_ok(ssd_torchrun(runs), "torchrun")
    per_rank = []
    for rank in range(NPROC):
        samplers = run.ranks[rank]["samplers"]
        kinds = Counter(it["kind"] for it in samplers)
        assert "RandomSampler" not in kinds, f"rank {rank}: the training loader still shuffles the whole dataset on every rank"
        assert "_Shard" not in kinds, (f"rank {rank}: the training loader got the unshuffled evaluation shard "
                                       f"(the iter()/next() loop was taken for evaluation)")
        dist = [it for it in samplers if it["kind"] == "DistributedSampler"]
        assert dist, f"rank {rank}: the training loader is not sharded (no DistributedSampler iterated)"
        assert all(it["shuffle"] for it in dist), f"rank {rank}: the training shard is not shuffled"
        per_rank.append(dist)
    assert len({len(d) for d in per_rank}) == 1, "the ranks rebuilt their iterator different numbers of times"
    assert len(per_rank[0]) >= 3, "40 iterations over 50-sample shards should rebuild the iterator several times"
    for k, its in enumerate(zip(*per_rank)):
        n = its[0]["dataset_len"]
        shards = [it["indices"] for it in its]
        overlap = set(shards[0]).intersection(*shards[1:])
        assert len(overlap) < NPROC, f"rebuild {k}: the ranks draw the same samples ({len(overlap)} shared)"
        full = math.ceil(n / NPROC)
        if all(len(s) == full for s in shards):
            assert set().union(*shards) == set(range(n)), f"rebuild {k}: some samples are on no rank"
    for rank, its in enumerate(per_rank):
        for a, b in zip(its, its[1:]):
            m = min(len(a["indices"]), len(b["indices"]))
            assert a["indices"][:m] != b["indices"][:m], (
                f"rank {rank}: the rebuilt iterator repeats the previous order (set_epoch not called when "
                f"`iter(data_loader)` is rebuilt)")


@pytest.mark.ddp
def test_ssd_weights_identical_across_ranks(runs):
    assert_trained_parameters_identical(require_ok(ssd_torchrun(runs), "torchrun"))


@pytest.mark.ddp
def test_ssd_step_times_printed_once(runs):
    run = require_ok(ssd_torchrun(runs), "torchrun")
    assert_only_rank0_prints(run)
    for pattern, expected in SSD_LINES.items():
        assert len(lines(run.stdout, pattern)) == expected, (
            f"{pattern!r}: {len(lines(run.stdout, pattern))} lines under torchrun, {expected} in one process")


@pytest.mark.ddp
def test_ssd_one_checkpoint_folder_each_checkpoint_written_once(runs):
    run = require_ok(ssd_torchrun(runs), "torchrun")
    folders = sorted(p.name for p in run.work.iterdir() if p.is_dir() and p.name.startswith("weights_"))
    assert len(folders) == 1, f"{len(folders)} checkpoint folders for one run: {folders} (one per rank's clock)"
    saves = saves_by_rank(run)
    assert saves, "no checkpoint was saved"
    for path, by_rank in saves.items():
        assert sum(by_rank.values()) == 1, f"{os.path.basename(path)} written {dict(by_rank)} times by rank"
        assert Path(path).parent.name == folders[0], f"{path} is not in the run's folder {folders[0]}"
    on_disk = sorted(p.name for p in (run.work / folders[0]).iterdir())
    assert len(on_disk) == len(saves) == 4, f"expected 3 periodic checkpoints and the final one, found {on_disk}"


# ================================================================ 2. classifier_meters.py (ddp)

METERS = "classifier_meters.py"
METERS_VAL = re.compile(r"^ \* Acc@1 (?P<acc>\d+\.\d+) Loss (?P<loss>\d+\.\d+) \((?P<n>\d+) samples\)", re.M)
METERS_TRAIN = re.compile(r"^Epoch: \[(?P<epoch>\d+)\] train loss (?P<loss>\d+\.\d+)", re.M)
METERS_EPOCHS = ["--epochs", "5"]  # resumed at epoch 2: epochs 2, 3, 4
METERS_VAL_SAMPLES = 37


def meters_prep(runs) -> Path:
    """The ORIGINAL (nn.DataParallel, runs on the CPU) trains 2 epochs: its checkpoint has
    `module.` keys, and the migrated script resumes from it."""
    run = runs.original(runs.run("original-2-epochs", SCRIPTS / METERS, 1, ["--epochs", "2"],
                                 kind="original, one process"))
    path = run.work / "checkpoint.pth.tar"
    keys = torch.load(path, weights_only=True)["state_dict"]
    assert all(k.startswith("module.") for k in keys), "the original's checkpoint should have DataParallel keys"
    return path


def meters_args(runs) -> List[str]:
    return [*METERS_EPOCHS, "--resume", str(meters_prep(runs))]


def meters_python(runs) -> Run:
    return runs.run("python", runs.golden("ddp", METERS), 1, meters_args(runs))


def meters_torchrun(runs) -> Run:
    return runs.run("torchrun", runs.golden("ddp", METERS), NPROC, meters_args(runs))


def meters_evaluate(runs) -> Run:
    """One process evaluates the weights torchrun saved last (`--resume CKPT --evaluate`)."""
    run = require_ok(meters_torchrun(runs), "torchrun")
    checkpoint = run.work / "checkpoint.pth.tar"
    if not checkpoint.exists():
        pytest.fail("the torchrun run wrote no checkpoint.pth.tar", pytrace=False)
    return runs.run("evaluate", runs.golden("ddp", METERS), 1, ["--resume", str(checkpoint), "--evaluate"],
                    kind="one-process --evaluate of torchrun's checkpoint")


@pytest.mark.ddp
def test_meters_resume_from_dataparallel_checkpoint(runs):
    """One process and torchrun both resume from the DataParallel original's checkpoint."""
    for run in (meters_python(runs), meters_torchrun(runs)):
        assert_exits_0(run)
        assert "(epoch 2)" in run.stdout, f"{run.kind}: did not resume at epoch 2:\n{run.stdout[:500]}"


@pytest.mark.ddp
def test_meters_validation_counts_every_sample(runs):
    """The AverageMeters are never reduced: sharding validation would report half of it."""
    run = require_ok(meters_torchrun(runs), "torchrun")
    one = require_ok(meters_python(runs), "python")
    ddp, single = list(METERS_VAL.finditer(run.stdout)), list(METERS_VAL.finditer(one.stdout))
    assert len(single) == 3, "one process: expected one validation line per epoch (3)"
    assert len(ddp) == len(single), f"{len(ddp)} validation lines under torchrun, {len(single)} in one process"
    counts = [int(m["n"]) for m in ddp]
    assert counts == [METERS_VAL_SAMPLES] * len(ddp), (
        f"validation under torchrun reports {counts} samples per epoch instead of all {METERS_VAL_SAMPLES}: "
        f"the loader was sharded (or padded) but the meters were not summed over ranks")


@pytest.mark.ddp
def test_meters_validation_equals_single_process_evaluation(runs):
    run = require_ok(meters_torchrun(runs), "torchrun")
    evaluation = meters_evaluate(runs)
    assert_exits_0(evaluation)
    last, own = list(METERS_VAL.finditer(run.stdout)), list(METERS_VAL.finditer(evaluation.stdout))
    assert last and own, "no ' * Acc@1 ... (N samples)' line to compare"
    last, own = last[-1], own[-1]
    assert int(own["n"]) == METERS_VAL_SAMPLES, f"the one-process evaluation saw {own['n']} samples"
    same = (int(last["n"]) == int(own["n"]) and abs(float(last["acc"]) - float(own["acc"])) <= 1e-3
            and abs(float(last["loss"]) - float(own["loss"])) <= 2e-4)
    assert same, (f"torchrun's last validation printed {last.group(0).strip()!r}; one process evaluating the "
                  f"saved weights prints {own.group(0).strip()!r}")


@pytest.mark.ddp
def test_meters_csv_log_has_one_writer(runs):
    run = require_ok(meters_torchrun(runs), "torchrun")
    path = run.work / "log.csv"
    assert path.exists(), "log.csv was not written"
    rows = list(csv.reader(path.read_text().splitlines()))
    header = ["epoch", "train_loss", "val_loss", "val_acc1", "lr"]
    assert rows and rows[0] == header and rows.count(header) == 1, f"log.csv should have one header line:\n{rows[:4]}"
    body = rows[1:]
    assert [r[0] for r in body] == ["2", "3", "4"] and all(len(r) == 5 for r in body), (
        f"log.csv should hold one row per epoch (2, 3, 4), written by one process; it holds:\n{path.read_text()}")
    accs = [float(m["acc"]) for m in METERS_VAL.finditer(run.stdout)]
    assert [round(float(r[3]), 3) for r in body] == [round(a, 3) for a in accs], (
        "the CSV's val_acc1 column differs from the printed validation accuracy")


@pytest.mark.ddp
def test_meters_checkpoint_and_best_written_by_one_rank(runs):
    run = require_ok(meters_torchrun(runs), "torchrun")
    saves = {os.path.basename(p): c for p, c in saves_by_rank(run).items()}
    assert "checkpoint.pth.tar" in saves, "checkpoint.pth.tar was never saved"
    ckpt = saves["checkpoint.pth.tar"]
    assert len(ckpt) == 1 and sum(ckpt.values()) == 3, (
        f"checkpoint.pth.tar should be saved once per epoch (3) by one rank; saves per rank: {dict(ckpt)}")
    # model_best is copied whenever the accuracy beats the best so far (the resumed checkpoint's
    # best_acc1 to start with); accuracies are multiples of 100/37, printed to 3 decimals
    best = float(torch.load(meters_prep(runs), weights_only=True)["best_acc1"])
    expected = 0
    for match in METERS_VAL.finditer(run.stdout):
        if float(match["acc"]) > best + 1e-2:
            expected, best = expected + 1, float(match["acc"])
    copies = {os.path.basename(p): c for p, c in writes_by_rank(run, "copies", "dst").items()}
    best_copies = copies.get("model_best.pth.tar", Counter())
    assert len(best_copies) <= 1, f"model_best.pth.tar copied by several ranks: {dict(best_copies)}"
    assert sum(best_copies.values()) == expected, (
        f"model_best.pth.tar copied {sum(best_copies.values())} times; the printed accuracies improved {expected} times")


@pytest.mark.ddp
def test_meters_weights_identical_and_printed_once(runs):
    run = require_ok(meters_torchrun(runs), "torchrun")
    assert_trained_parameters_identical(run)
    assert_only_rank0_prints(run)


@pytest.mark.ddp
def test_meters_training_average_is_an_average(runs):
    """`running_loss / len(train_loader.dataset)` over a 1/2 shard halves the average (R08).
    Both runs start from the same resumed weights; the first epoch's averages agree within the
    difference that a doubled effective batch makes, far from the factor 2 of the bug."""
    run = require_ok(meters_torchrun(runs), "torchrun")
    one = require_ok(meters_python(runs), "python")
    ddp, single = METERS_TRAIN.search(run.stdout), METERS_TRAIN.search(one.stdout)
    assert ddp and single, "no 'Epoch: [N] train loss' line"
    ratio = float(ddp["loss"]) / float(single["loss"])
    assert 0.75 <= ratio <= 1.35, (
        f"first resumed epoch: training loss {ddp['loss']} under torchrun vs {single['loss']} in one process "
        f"(ratio {ratio:.2f}): a shard's sum divided by the whole dataset's size is not an average")


# ================================================================ 3. config_finetune.py (ddp)

FINETUNE = "config_finetune.py"

CONTAINER_CHECK = r'''
import json, runpy, sys
import torch
import __main__
script, path, out = sys.argv[1:4]
# the classes the pickles name as __main__.X, from the migrated script (its main() does not run)
for name, value in runpy.run_path(script, run_name="finetune_definitions").items():
    if isinstance(value, type):
        setattr(__main__, name, value)
result = {"process_group": torch.distributed.is_available() and torch.distributed.is_initialized()}
try:
    obj = torch.load(path, weights_only=False)
except Exception as exc:
    result["error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    result["types"] = [type(o).__name__ for o in obj] if isinstance(obj, (list, tuple)) else [type(obj).__name__]
    model = obj[0] if isinstance(obj, (list, tuple)) and obj else None
    result["plain_module"] = isinstance(model, torch.nn.Module) and not isinstance(
        model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
    if isinstance(model, torch.nn.Module):
        torch.save(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]), out)
print(json.dumps(result))
'''


def finetune_python(runs) -> Run:
    return runs.run("python", runs.golden("ddp", FINETUNE))


def finetune_torchrun(runs) -> Run:
    one = require_ok(finetune_python(runs), "python")

    def prepare(work: Path) -> None:
        # the pretrained model a user would have: the one the one-process run pickled
        shutil.copy(one.work / "pretrained_embedding.pt", work / "pretrained_embedding.pt")

    return runs.run("torchrun", runs.golden("ddp", FINETUNE), NPROC, prepare=prepare)


@pytest.mark.ddp
def test_finetune_runs(runs):
    assert_exits_0(finetune_python(runs))
    run = finetune_torchrun(runs)
    assert_exits_0(run)
    assert_only_rank0_prints(run)


@pytest.mark.ddp
def test_finetune_every_trained_parameter_identical(runs):
    """The optimizer comes from getattr(torch.optim, cfg[...]) with parameter groups that
    include the CenterLoss centers: all of it must stay in sync (or the data unsharded)."""
    run = require_ok(finetune_torchrun(runs), "torchrun")
    one = require_ok(finetune_python(runs), "python")
    tensors = lambda r: sum(o["tensors"] for o in r.ranks[0]["optimizers"])  # noqa: E731
    assert tensors(run) == tensors(one) == 7, (
        f"the optimizers train {tensors(run)} tensors under torchrun, {tensors(one)} in one process; "
        f"the script trains 7 (backbone 4, head 2, centers 1)")
    assert_trained_parameters_identical(run)


@pytest.mark.ddp
def test_finetune_container_checkpoint_loads_without_process_group(runs):
    run = require_ok(finetune_torchrun(runs), "torchrun")
    saves = {os.path.basename(p): c for p, c in saves_by_rank(run).items()}
    assert sum(saves.get("finetuned.pt", Counter()).values()) == 1, (
        f"finetuned.pt should be saved once; saves per rank: {dict(saves.get('finetuned.pt', {}))}")
    out = run.work / "container_model_vector.pt"
    done = subprocess.run([sys.executable, "-c", CONTAINER_CHECK, str(run.work / FINETUNE), str(run.work / "finetuned.pt"),
                           str(out)], cwd=str(run.work), env=probe_env(run.work), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0 and done.stdout.strip(), f"the checker failed: {done.stderr[-2000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["process_group"]
    assert "error" not in result, (
        f"torch.save([model, optimizer]) wrote something that cannot be loaded without a process group: "
        f"{result.get('error')}")
    assert result["plain_module"], f"the checkpoint holds {result['types']}: the model inside should be the plain module"
    trained = run.optim_vector(0, 0)
    saved = torch.load(out)
    assert saved.numel() <= trained.numel() and torch.allclose(saved, trained[:saved.numel()], atol=1e-7), (
        "the model in finetuned.pt does not hold the trained weights")


@pytest.mark.ddp
def test_finetune_state_dict_loads_keep_weights_only(runs):
    """Only the whole pickled model needs weights_only=False; the state_dict and the tensor
    do not (R11: a needless security downgrade)."""
    for run in (require_ok(finetune_python(runs), "python"), require_ok(finetune_torchrun(runs), "torchrun")):
        loads = [load for report in run.ranks.values() for load in report["torch_loads"]]
        assert any(load["result"] == "module" for load in loads), f"{run.kind}: the pretrained model was never loaded"
        plain = [load for load in loads if load["result"] in ("state_dict", "tensor")]
        assert plain, f"{run.kind}: the backbone state_dict / the probe batch were never loaded"
        unsafe = [f"{os.path.basename(load['path'])} ({load['result']})" for load in plain if load["weights_only"] is False]
        assert not unsafe, f"{run.kind}: weights_only=False where the file holds only tensors: {unsafe}"


# ================================================================ 4. functional_maml.py (ddp)

MAML = "functional_maml.py"


def maml_reference(runs) -> Run:
    return runs.original(runs.run("original", SCRIPTS / MAML, kind="original, one process"))


def maml_torchrun(runs) -> Run:
    return runs.run("torchrun", runs.golden("ddp", MAML), NPROC)


@pytest.mark.ddp
def test_maml_torchrun_runs(runs):
    assert_exits_0(maml_torchrun(runs))


@pytest.mark.ddp
def test_maml_tasks_sharded_and_meta_parameters_identical(runs):
    """A dict of tensors cannot be DDP-wrapped: the runtime averages its gradients at the
    optimizer step, so the tasks are split over the ranks and both end with the same weights."""
    run = require_ok(maml_torchrun(runs), "torchrun")
    assert_trained_parameters_identical(run)
    reference = maml_reference(runs)
    expected = reference.optim_vector(0, 0)
    for rank in range(NPROC):
        got = run.optim_vector(rank, 0)
        assert got.shape == expected.shape, f"rank {rank} trains {got.numel()} parameters, the original {expected.numel()}"
        assert (got - run.optim_vector(rank, 0, initial=True)).abs().max().item() > 0, f"rank {rank} never trained"
    per_rank = [[it for it in run.ranks[rank]["samplers"] if it["kind"] == "DistributedSampler"]
                for rank in range(NPROC)]
    assert all(per_rank), "the tasks are not sharded (no DistributedSampler iterated)"
    for its in zip(*per_rank):
        shards = [set(it["indices"]) for it in its]
        assert len(shards[0] & shards[1]) < NPROC, "both ranks draw the same tasks"


@pytest.mark.ddp
def test_maml_lines_printed_once(runs):
    run = require_ok(maml_torchrun(runs), "torchrun")
    reference = maml_reference(runs)
    assert_only_rank0_prints(run)
    assert shapes(run.stdout) == shapes(reference.stdout), (
        f"the output differs from the one-process run:\n{run.stdout}\n--- one process ---\n{reference.stdout}")


# ================================================================ 5. legacy_char_rnn.py (device)

CHAR_RNN = "legacy_char_rnn.py"
CHAR_EPOCH = re.compile(r"^epoch (?P<epoch>\d+) \| train ce (?P<ce>\d+\.\d+)", re.M)
CHAR_STEPS = 5 * 25  # epochs x steps per epoch


def char_rnn(runs) -> Run:
    return runs.run("python", runs.golden("device", CHAR_RNN), env={"GPUMIGRATE_PROBE_FORWARDS": "1"})


def test_char_rnn_runs(runs):
    assert_exits_0(char_rnn(runs))


def test_char_rnn_every_step_updates_the_weights(runs):
    """No torch.no_grad() around code that reaches .backward() (R01)."""
    run = require_ok(char_rnn(runs), "python")
    (optimizer,) = run.ranks[0]["optimizers"]
    assert optimizer["steps"] == CHAR_STEPS, f"{optimizer['steps']} optimizer steps, expected {CHAR_STEPS}"
    assert optimizer["steps_that_changed_parameters"] == CHAR_STEPS, (
        f"only {optimizer['steps_that_changed_parameters']} of {CHAR_STEPS} optimizer steps changed the weights")
    epochs = list(CHAR_EPOCH.finditer(run.stdout))
    assert len(epochs) == 5 and float(epochs[-1]["ce"]) < float(epochs[0]["ce"]), (
        f"the training loss did not go down:\n{run.stdout[:800]}")


def test_char_rnn_evaluation_and_sampling_build_no_graph(runs):
    """`volatile=True` (the validation in the epoch loop, the `ev` lambda, the 50-step
    generation loop) becomes torch.no_grad() around the code that uses those values (R12)."""
    run = require_ok(char_rnn(runs), "python")
    forwards = [f for f in run.ranks[0]["forwards"] if f["module_of_class"] == "__main__"]
    assert forwards, "the probe saw no forward of the script's own model"
    training = [f for f in forwards if f["training"]]
    evaluation = [f for f in forwards if not f["training"]]
    assert training and evaluation, f"expected forwards in train and in eval mode: {forwards}"
    no_graph = sum(f["calls"] for f in training if not f["grad_enabled"])
    assert no_graph == 0, f"{no_graph} training forwards ran under no_grad"
    graphs = sum(f["calls"] for f in evaluation if f["grad_enabled"])
    total = sum(f["calls"] for f in evaluation)
    assert graphs == 0, (
        f"{graphs} of the {total} evaluation/sampling forwards (model.eval()) recorded an autograd graph: "
        f"the `volatile=True` code is not under torch.no_grad()")
    sample = run.work / "sample.txt"
    assert sample.exists() and len(sample.read_text().strip()) == 54, "the 50-character sample was not written"


def test_char_rnn_logged_counts_are_numbers(runs):
    """0.3's `correct += (pred == y).sum()` was an int; today it is a tensor that str() turns
    into 'tensor(278)' in the log."""
    run = require_ok(char_rnn(runs), "python")
    log = run.work / "char_rnn_log.csv"
    assert log.exists(), "the CSV log was not written"
    text = log.read_text()
    assert "tensor(" not in text, f"the CSV log holds tensors, not numbers:\n{text}"
    assert "tensor(" not in run.stdout, f"the output prints tensors, not numbers:\n{run.stdout[:800]}"
    rows = list(csv.DictReader(text.splitlines()))
    assert len(rows) == 5, f"expected 5 rows in the log:\n{text}"
    for row in rows:
        assert row["val_correct"].isdigit(), f"val_correct {row['val_correct']!r} is not an integer"
        assert 0.0 <= float(row["val_acc"]) <= 1.0


# ================================================================ 6. wordlm_batches.py (ddp)

WORDLM = "wordlm_batches.py"
WORDLM_TEST = re.compile(r"\| End of training \| test loss (?P<loss>\d+\.\d+) \| test ppl\s+(?P<ppl>\d+\.\d+)")


def wordlm_torchrun(runs) -> Run:
    return runs.run("torchrun", runs.golden("ddp", WORDLM), NPROC)


def wordlm_evaluate(runs) -> Run:
    """One process, no training (`--epochs 0`): reload torchrun's best model and evaluate it."""
    run = require_ok(wordlm_torchrun(runs), "torchrun")
    best = run.work / "model.pt"
    if not best.exists():
        pytest.fail("the torchrun run wrote no model.pt", pytrace=False)
    return runs.run("evaluate", runs.golden("ddp", WORDLM), 1, ["--epochs", "0", "--save", str(best)],
                    kind="one-process evaluation of torchrun's model.pt")


@pytest.mark.ddp
def test_wordlm_runs(runs):
    assert_exits_0(wordlm_torchrun(runs))


@pytest.mark.ddp
def test_wordlm_weights_identical_and_lines_once(runs):
    run = require_ok(wordlm_torchrun(runs), "torchrun")
    assert_trained_parameters_identical(run)
    assert_only_rank0_prints(run)
    for pattern, expected in ((r"\| end of epoch", 4), (r"\| End of training", 1)):  # as in one process
        got = len(lines(run.stdout, pattern))
        assert got == expected, f"{pattern!r}: {got} lines under torchrun, {expected} in one process"
    saves = {os.path.basename(p): c for p, c in saves_by_rank(run).items()}
    assert "model.pt" in saves and len(saves["model.pt"]) == 1, (
        f"the best model should be saved by one rank: {dict(saves.get('model.pt', {}))}")


@pytest.mark.ddp
def test_wordlm_test_perplexity_equals_single_process_eval_of_saved_model(runs):
    run = require_ok(wordlm_torchrun(runs), "torchrun")
    evaluation = wordlm_evaluate(runs)
    assert evaluation.ok(), (
        f"the best model torchrun saved does not load back and evaluate in one process: {evaluation.summary()}")
    ddp, own = WORDLM_TEST.search(run.stdout), WORDLM_TEST.search(evaluation.stdout)
    assert ddp, "no '| End of training | test loss' line under torchrun"
    assert own, f"no test line in the one-process evaluation:\n{evaluation.stdout[-500:]}"
    assert abs(float(ddp["loss"]) - float(own["loss"])) <= 1e-4, (
        f"torchrun printed {ddp.group(0)!r}; one process evaluating the saved model prints {own.group(0)!r}")


# ================================================================ 7. eval_only.py (device, ddp)

EVAL_ONLY = "eval_only.py"
EVAL_LINE = re.compile(r"^held-out: .*$", re.M)


def _dataparallel_checkpoint(runs) -> bytes:
    """A checkpoint as the DataParallel training run wrote it ('module.' keys)."""
    def make() -> bytes:
        ns = runpy.run_path(str(SCRIPTS / EVAL_ONLY), run_name="eval_only_definitions")  # main() does not run
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(5)
            net = ns["DefectNet"]()
            data = ns["heldout_set"](120)
            optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
            for _ in range(3):  # a little training: an accuracy between chance and 100 %
                loss = torch.nn.functional.cross_entropy(net(data.tensors[0]), data.tensors[1])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        finally:
            torch.random.set_rng_state(state)
        path = runs.base / "eval_only_checkpoint.pth.tar"
        torch.save({"epoch": 30, "arch": "defectnet", "best_acc": 71.25,
                    "state_dict": torch.nn.DataParallel(net).state_dict()}, path)
        return path.read_bytes()
    return runs.get(("eval_only", "checkpoint"), make)


def eval_only_run(runs, label: str, script: Path) -> Run:
    blob = _dataparallel_checkpoint(runs)
    return runs.run(label, script, prepare=lambda work: (work / "defectnet_dp.pth.tar").write_bytes(blob))


def eval_only_reference(runs) -> Run:
    run = runs.original(eval_only_run(runs, "original", SCRIPTS / EVAL_ONLY))
    assert "loaded checkpoint" in run.stdout
    return run


@pytest.mark.parametrize("target", ["device", "ddp"])
def test_eval_only_prints_original_accuracy_and_writes_same_csv(runs, target):
    reference = eval_only_reference(runs)
    run = eval_only_run(runs, target, runs.golden(target, EVAL_ONLY))
    assert_exits_0(run)
    expected = EVAL_LINE.search(reference.stdout)
    got = EVAL_LINE.search(run.stdout)
    assert expected and 0 < len(expected.group(0)), "the original printed no held-out line"
    assert got, f"no 'held-out:' line in the output:\n{run.stdout[-800:]}"
    assert got.group(0) == expected.group(0), (
        f"the --to {target} script prints {got.group(0)!r}; the original prints {expected.group(0)!r}")
    mine, theirs = run.work / "predictions.csv", reference.work / "predictions.csv"
    assert mine.exists(), "predictions.csv was not written"
    assert mine.read_text() == theirs.read_text(), "predictions.csv differs from the original's"


# ================================================================ 8. run_dir_main.py (ddp)

RUN_DIR = "run_dir_main.py"


def run_dir_reference(runs) -> Run:
    return runs.original(runs.run("original", SCRIPTS / RUN_DIR, kind="original, one process"))


def run_dir_torchrun(runs) -> Run:
    return runs.run("torchrun", runs.golden("ddp", RUN_DIR), NPROC)


def _run_dirs(run: Run) -> List[Path]:
    parent = run.work / "runs"
    return sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []


@pytest.mark.ddp
def test_run_dir_torchrun_finishes(runs):
    assert_exits_0(run_dir_torchrun(runs))


@pytest.mark.ddp
def test_run_dir_one_directory_one_rundir_line(runs):
    run = require_ok(run_dir_torchrun(runs), "torchrun")
    dirs = _run_dirs(run)
    assert len(dirs) == 1, f"{len(dirs)} run directories for one run: {[d.name for d in dirs]}"
    rundir_lines = lines(run.stdout, r"^RUNDIR:")
    assert len(rundir_lines) == 1, f"{len(rundir_lines)} RUNDIR lines: {rundir_lines}"
    assert rundir_lines[0].split()[-1].endswith(dirs[0].name), f"RUNDIR names {rundir_lines[0]!r}, the disk {dirs[0]}"
    assert_only_rank0_prints(run)


@pytest.mark.ddp
def test_run_dir_logger_and_pickle_written_once(runs):
    run = require_ok(run_dir_torchrun(runs), "torchrun")
    reference = run_dir_reference(runs)
    (ref_dir,) = _run_dirs(reference)
    dirs = _run_dirs(run)
    assert dirs, "no run directory"
    logs = [d / "log.txt" for d in dirs if (d / "log.txt").exists()]
    assert len(logs) == 1, f"{len(logs)} log files: {logs}"
    expected = len((ref_dir / "log.txt").read_text().splitlines())
    got = len(logs[0].read_text().splitlines())
    assert got == expected, (
        f"the Logger's file has {got} lines under torchrun, {expected} in one process (every rank appends to it?)")
    pickles = writes_by_rank(run, "pickles", "file")
    history = {p: c for p, c in pickles.items() if p.endswith("history.pkl")}
    assert sum(sum(c.values()) for c in history.values()) == 1, (
        f"history.pkl should be pickled once; pickle.dump calls per file and rank: {history}")


@pytest.mark.ddp
def test_run_dir_weights_identical(runs):
    """The script's own `def wrap_model(model, args)` must not hide the runtime's."""
    assert_trained_parameters_identical(require_ok(run_dir_torchrun(runs), "torchrun"))
