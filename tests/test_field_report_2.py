"""The second field report's scripts (fixtures/field/report2/P*), each migrated to the target
its row names and run the way the row says, checked against the report's "right" column; then
the report's "Also seen" items; then the idempotence of every fixture of both field reports
(fixtures/field/report1 and report2) for every target.

Most of these behaviours are not implemented yet (issue 18, item 8). Their tests are marked
`xfail(strict=True)`: they pass the suite while the behaviour is missing, and turn into a
failure (XPASS strict) the moment it lands. If you implemented one, remove its mark.

How the runs are checked (no test compares source text where a run can tell):
* `python` runs: the script's output, or a wrapper that patches one torch function to see what
  reached it (BCE inputs, `.numpy()` of autocast values);
* `torchrun --standalone --nproc_per_node=2` runs go through gpumigrate/verify/probe.py (which samples
  each rank drew, what each rank printed and saved) with the STEPS wrapper (below) in between,
  which records every optimizer's parameters right after its LAST step on each rank. "Identical
  weights" is checked there, not only at exit: a DDP wrap made after training (P01) broadcasts
  rank 0's weights over the others at exit and would hide that the ranks trained apart.
* project folders (P06, P09, P10, P13) are migrated with the command line over the folder, as a
  user would (`gpumigrate DIR --to ddp`); single files with tests.conftest.migrate.

Data-parallel, as the report defines it: parameters identical across ranks and each rank drew
about half the samples of each epoch.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from click.testing import CliRunner

from gpumigrate.cli import main as cli
from gpumigrate.verify.runs import clean_env
from tests.conftest import FIXTURES, ROOT, migrate
from tests.probe_runs import NPROC, Run, run_probe

REPORT1 = FIXTURES / "field" / "report1"
REPORT = FIXTURES / "field" / "report2"
TIMEOUT = 90  # seconds per run; a correct one takes < 10 s here
TOL = 1e-6


def todo(missing: str):
    """The behaviour is missing today: remove this mark when the test passes (XPASS strict)."""
    return pytest.mark.xfail(strict=True, reason=f"issue 18: {missing}")


# ---------------------------------------------------------------- migrating

def _findings(result) -> Tuple[List[str], List[str]]:
    """(review items, fixed items) of a migration, as 'CODE message'."""
    review = [f"{f.code} {f.message}" for f in result.findings if not f.fixed]
    fixed = [f"{f.code} {f.message}" for f in result.findings if f.fixed]
    return review, fixed


def _migrated(name: str, target: str, tmp_path: Path) -> Tuple[Path, object]:
    """The migrated script in `tmp_path`, and the migration's FileResult."""
    source = (REPORT / name).read_bytes()
    result = migrate(source, target, name)
    assert result.error is None, result.error
    out = tmp_path / name
    out.write_bytes(result.new_source or source)
    return out, result


def _cli(*args) -> object:
    """The command line, in this process (one job, no cache: the tree under test decides)."""
    return CliRunner().invoke(cli, [str(a) for a in args] + ["--no-cache", "-j", "1"], catch_exceptions=False)


def _migrated_project(folder: str, target: str, tmp_path: Path) -> Tuple[Path, dict]:
    """The project folder copied to `tmp_path` and migrated there with `gpumigrate DIR --to
    target`; the JSON report of that run."""
    project = tmp_path / folder
    shutil.copytree(REPORT / folder, project)
    report = tmp_path / f"{folder}-report.json"
    done = _cli(project, "--to", target, "--report", report)
    assert done.exit_code == 0, done.output
    return project, json.loads(report.read_text())


def _project_review(report: dict, file: Optional[str] = None) -> List[str]:
    return [f"{item['code']} {item['message']}" for entry in report["files"] for item in entry["review"]
            if file is None or Path(entry["path"]).name == file]


def _snapshot(folder: Path) -> Dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.py"))}


# ---------------------------------------------------------------- running

def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = clean_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


def _run(script: Path, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
         code: Optional[str] = None) -> subprocess.CompletedProcess:
    """`python script args` (or `python -c code`) in the script's folder."""
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=str(script.parent), env=_env(env), capture_output=True, text=True,
                          timeout=TIMEOUT)


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# Run between the probe and the script: every optimizer's parameters right after its last step,
# per rank, in the order of their first step (saved with the unpatched torch.save).
STEPS = '''\
import os, runpy, sys
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

last, order = {}, []

def after_step(optimizer, args, kwargs):
    if id(optimizer) not in last:
        order.append(id(optimizer))
    last[id(optimizer)] = torch.cat([p.detach().to("cpu", torch.float64).reshape(-1)
                                     for group in optimizer.param_groups for p in group["params"]])

register_optimizer_step_post_hook(after_step)
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    save = getattr(torch.save, "__wrapped__", torch.save)
    save([last[i] for i in order], "field_steps_rank%s.pt" % os.environ.get("RANK", "0"))
'''


def _torchrun(script: Path, work: Path, project: bool = False, files: Optional[Dict[str, str]] = None,
              env: Optional[Dict[str, str]] = None) -> Run:
    """`torchrun --standalone --nproc_per_node=2 script` under the probe and the step recorder, in
    `work`: a copy of the script (of its whole folder for a `project`), with `files` written next to it."""
    if project:
        shutil.copytree(script.parent, work)
    else:
        work.mkdir(parents=True)
        shutil.copy(script, work / script.name)
    for name, text in (files or {}).items():
        (work / name).write_text(text)
    steps = work.parent / "field_steps.py"  # run_probe copies it into `work`
    steps.write_text(STEPS)
    return run_probe(steps, work, NPROC, [script.name], env=env, timeout=TIMEOUT)


def _assert_ran(run: Run) -> None:
    assert run.returncode is not None, f"did not finish within {TIMEOUT} s: the ranks are stuck\n{run.why()}"
    assert run.ok(), f"the run failed: {run.summary()}\n{run.why()}"
    for rank, report in run.ranks.items():
        assert report["process_group_world_size"] == NPROC, f"rank {rank} never joined the process group"


def _assert_identical_weights(run: Run) -> None:
    """Every optimizer stepped and changed its parameters, and after its last step they are
    the same on every rank (the ranks trained one model, not one each)."""
    _assert_ran(run)
    last = [torch.load(run.work / f"field_steps_rank{r}.pt") for r in range(NPROC)]
    assert last[0], "no optimizer stepped: nothing was trained"
    assert len({len(vectors) for vectors in last}) == 1, (
        f"the ranks stepped different optimizers: {[len(v) for v in last]}")
    for entry in run.ranks[0]["optimizers"]:
        assert entry["steps_that_changed_parameters"] > 0, f"optimizer {entry['index']} never changed a parameter"
    for i, base in enumerate(last[0]):
        for rank in range(1, NPROC):
            other = last[rank][i]
            assert other.shape == base.shape, f"optimizer {i} trains different parameters on rank {rank}"
            diff = (other - base).abs().max().item() if base.numel() else 0.0
            assert diff <= TOL, (f"after its last step, optimizer {i}'s parameters differ between rank 0 and rank "
                                 f"{rank} by up to {diff:.3g}: each rank trained its own model")


def _assert_sharded(run: Run, dataset_len: int, epochs: int) -> List[List[List[int]]]:
    """Each rank drew about half the samples of each epoch, and together all of them.
    Returns per rank the indices of each epoch."""
    draws = [[it["indices"] for it in run.ranks[r]["samplers"] if it.get("dataset_len") == dataset_len]
             for r in range(NPROC)]
    half = -(-dataset_len // NPROC)
    for rank, epochs_drawn in enumerate(draws):
        assert len(epochs_drawn) >= epochs, (
            f"rank {rank}: {len(epochs_drawn)} passes over the {dataset_len} training samples were recorded, "
            f"expected {epochs} (a shuffled loader the probe can see)")
        sizes = [len(indices) for indices in epochs_drawn]
        assert all(dataset_len // NPROC <= n <= half for n in sizes), (
            f"rank {rank} drew {sizes} of {dataset_len} samples per epoch: the data is not sharded "
            f"(every rank trains on the whole dataset)")
    assert set(draws[0][0]) | set(draws[1][0]) == set(range(dataset_len)), "the ranks' shards do not cover the dataset"
    return draws


def _printed(run: Run, rank: int) -> str:
    return run.ranks[rank]["stdout"]


def _saves(run: Run, name: str) -> List[int]:
    """The ranks that wrote `name` with torch.save, once per write."""
    return [r for r, report in sorted(run.ranks.items()) for save in report["saves"] if Path(save["path"]).name == name]


# ================================================================ the report's table

# ---------------------------------------------------------------- P01 (ddp, torchrun)

P01 = "P01_wrap_after_training.py"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p01_ranks_train_one_model(tmp_path):
    script, _ = _migrated(P01, "ddp", tmp_path)
    _assert_identical_weights(_torchrun(script, tmp_path / "run"))


@pytest.mark.e2e
def test_p01_importing_the_migrated_module_works(tmp_path):
    script, _ = _migrated(P01, "ddp", tmp_path)
    _ok(_run(script, code=f"import {script.stem}; print('imported')"))


# ---------------------------------------------------------------- P02 (ddp, python and torchrun)

P02 = "P02_global_model_wrap_nameerror.py"


@pytest.mark.e2e
def test_p02_runs_in_one_process(tmp_path):
    script, _ = _migrated(P02, "ddp", tmp_path)
    assert [line.split()[0] for line in _ok(_run(script)).splitlines()] == ["0", "1"]


@pytest.mark.e2e
@pytest.mark.ddp
def test_p02_ranks_train_one_model(tmp_path):
    script, _ = _migrated(P02, "ddp", tmp_path)
    run = _torchrun(script, tmp_path / "run")
    _assert_identical_weights(run)
    assert all(report["wrap_calls"] for report in run.ranks.values()), "the model was never wrapped"


# ---------------------------------------------------------------- P03 (ddp, torchrun)

P03 = "P03_writer_none_on_other_ranks.py"
# tensorboardX is not a test dependency: a stand-in that logs each call, per rank.
TENSORBOARDX = '''\
import os


class SummaryWriter:
    def __init__(self, log_dir=None, **kwargs):
        self.path = "tb_calls_rank%s.txt" % os.environ.get("RANK", "0")

    def _log(self, *words):
        with open(self.path, "a") as f:
            f.write(" ".join(str(w) for w in words) + "\\n")

    def add_histogram(self, tag, values, step=None, **kwargs):
        self._log("histogram", tag, tuple(values.shape))

    def add_scalar(self, tag, value, step=None, **kwargs):
        self._log("scalar", tag, step)

    def close(self):
        self._log("close")
'''


@pytest.mark.e2e
@pytest.mark.ddp
def test_p03_model_call_on_every_rank_writer_call_gated(tmp_path):
    script, _ = _migrated(P03, "ddp", tmp_path)
    run = _torchrun(script, tmp_path / "run", files={"tensorboardX.py": TENSORBOARDX})
    _assert_identical_weights(run)
    calls = (run.work / "tb_calls_rank0.txt").read_text().splitlines()
    assert calls[0] == "histogram initial_output (2, 1)" and calls.count("close") == 1, calls
    # the 5 steps sharded by their counter: rank 0 takes steps 0, 2 and 4 and logs each at its own number
    assert [c for c in calls if c.startswith("scalar")] == [f"scalar loss {s}" for s in (0, 2, 4)], calls


# ---------------------------------------------------------------- P04 (device, --check)

P04 = "P04_star_import_torch_not_idempotent.py"


@pytest.mark.e2e
def test_p04_one_run_gives_the_final_form(tmp_path):
    script, _ = _migrated(P04, "device", tmp_path)
    again = migrate(script.read_bytes(), "device", script.name)
    assert again.error is None
    assert again.new_source is None, (
        "a second --to device run changes the file: `--check` fails right after a migration")
    assert "torch.load('weights.pth', map_location=device)" in script.read_text()
    out = _ok(_run(script)).strip()  # the script writes its helpers.py itself
    assert re.fullmatch(r"(tensor\()?[0-9.]+\)?", out), out


# ---------------------------------------------------------------- P05 (amp: BCELoss under autocast)

P05 = "P05_bceloss_under_autocast.py"
# binary_cross_entropy is unsafe to autocast: CUDA autocast raises for it, CPU autocast (bfloat16)
# does not. This wrapper fails the run where a reduced-precision input reaches it, as CUDA would.
BCE_WRAPPER = '''\
import runpy, sys
import torch
import torch.nn.functional as F

real = F.binary_cross_entropy
calls = []

def binary_cross_entropy(input, target, *args, **kwargs):
    calls.append(input.dtype)
    if input.dtype != torch.float32:
        raise RuntimeError("binary_cross_entropy on a %s input (unsafe to autocast)" % input.dtype)
    return real(input, target, *args, **kwargs)

F.binary_cross_entropy = binary_cross_entropy
runpy.run_path(sys.argv[1], run_name="__main__")
print("binary_cross_entropy calls:", len(calls))
'''


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["bf16", "fp16"])  # fp16: what CUDA's autocast uses
def test_p05_binary_cross_entropy_never_sees_reduced_precision(precision, tmp_path):
    script, _ = _migrated(P05, "amp", tmp_path)
    wrapper = tmp_path / "bce_wrapper.py"
    wrapper.write_text(BCE_WRAPPER)
    out = _ok(_run(wrapper, [script.name], env={"GPUMIGRATE_AMP": precision}))
    assert [line.split()[0] for line in out.splitlines()[:5]] == ["0", "1", "2", "3", "4"], out


# ---------------------------------------------------------------- P06 (ddp, torchrun, project)

P06 = "P06_optimizer_from_helper"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p06_data_parallel_and_one_consistent_report(tmp_path):
    project, report = _migrated_project(P06, "ddp", tmp_path)
    run = _torchrun(project / "train.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    _assert_sharded(run, 64, epochs=2)
    review = _project_review(report)
    assert not [r for r in review if re.search(r"not sharded|cannot tell which module", r, re.I)], review


# ---------------------------------------------------------------- P07 (ddp, torchrun: WGAN-GP)

P07 = "P07_gradient_penalty.py"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p07_gradient_penalty_trains_data_parallel(tmp_path):
    script, result = _migrated(P07, "ddp", tmp_path)
    run = _torchrun(script, tmp_path / "run")
    _assert_identical_weights(run)
    assert len(run.ranks[0]["optimizers"]) == 2
    _assert_sharded(run, 128, epochs=2)
    assert len(re.findall(r"^epoch \d", _printed(run, 0), re.M)) == 2 and _printed(run, 1) == ""
    review, fixed = _findings(result)
    assert any(re.search(r"averag", item, re.I) for item in review + fixed), (
        f"nothing reports the gradient averaging at the optimizer step: {review + fixed}")


# ---------------------------------------------------------------- P09 (ddp, torchrun, project)

P09 = "P09_loader_from_helper"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p09_loader_from_a_helper_sharded_per_rank(tmp_path):
    project, _ = _migrated_project(P09, "ddp", tmp_path)
    run = _torchrun(project / "train.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    draws = _assert_sharded(run, 64, epochs=2)
    assert draws[0][0] != draws[0][1], "the same order in both epochs: no set_epoch"
    assert draws[0][0] != sorted(draws[0][0]), "the shuffle was lost"
    assert re.findall(r"samples (\d+)", _printed(run, 0)) == ["32", "32"], _printed(run, 0)
    assert run.ranks[0]["optimizers"][0]["steps"] == 8, "the batch size changed (32 samples in 4 steps per epoch)"


# ---------------------------------------------------------------- P10 (ddp, --check, project)

P10 = "P10_trainer_module"


def test_p10_one_run_gives_the_final_form(tmp_path):
    project, report = _migrated_project(P10, "ddp", tmp_path)
    first = _snapshot(project)
    assert "setup_distributed(" in first["main.py"] + first["solver.py"], "the program never joins the process group"
    assert re.search(r"wrap_model\(|is_main_process\(", first["solver.py"]), (
        f"the trainer module got no DDP changes: {_project_review(report)}")
    done = _cli(project, "--to", "ddp", "--check")
    assert done.exit_code == 0 and _snapshot(project) == first, f"a second run changes the project:\n{done.output}"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p10_ranks_train_one_model(tmp_path):
    project, _ = _migrated_project(P10, "ddp", tmp_path)
    run = _torchrun(project / "main.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    assert _printed(run, 1) == "" and _saves(run, "generator.pkl") == [0]


# ---------------------------------------------------------------- P11 (device, python)

P11 = "P11_guarded_gpu_index.py"


@pytest.mark.e2e
def test_p11_runs_on_a_machine_without_cuda(tmp_path):
    script, _ = _migrated(P11, "device", tmp_path)
    assert [line.split()[0] for line in _ok(_run(script)).splitlines()] == ["0", "1", "2"]


# ---------------------------------------------------------------- P12 (amp, python, CPU)

P12 = "P12_numpy_of_autocast_value.py"
# NumPy is not a test dependency, and has no bfloat16: `.numpy()` is patched to record the dtype,
# refuse bfloat16 as NumPy does, and hand back a stand-in with `.mean()` when NumPy is missing.
NUMPY_WRAPPER = '''\
import runpy, sys
import torch

real = torch.Tensor.numpy
dtypes = []


class Array:
    def __init__(self, tensor):
        self.tensor = tensor

    def mean(self):
        return float(self.tensor.double().mean())


def numpy(self, *args, **kwargs):
    dtypes.append(str(self.dtype))
    if self.dtype == torch.bfloat16:
        raise TypeError("Got unsupported ScalarType BFloat16")
    try:
        return real(self, *args, **kwargs)
    except RuntimeError:  # Numpy is not available
        return Array(self)


torch.Tensor.numpy = numpy
runpy.run_path(sys.argv[1], run_name="__main__")
print("numpy dtypes:", " ".join(sorted(set(dtypes))))
'''


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["bf16", "fp16"])  # bf16: a CPU; fp16: what a GPU gives, silently
def test_p12_numpy_gets_float32(precision, tmp_path):
    script, _ = _migrated(P12, "amp", tmp_path)
    wrapper = tmp_path / "numpy_wrapper.py"
    wrapper.write_text(NUMPY_WRAPPER)
    out = _ok(_run(wrapper, [script.name], env={"GPUMIGRATE_AMP": precision})).splitlines()
    assert out[-1] == "numpy dtypes: torch.float32", out
    assert len(eval(out[-2])) == 5  # the history of 5 steps


# ---------------------------------------------------------------- P13 (ddp, torchrun, project)

P13 = "P13_driver_and_trainer"


def test_p13_driver_and_trainer_migrated_as_one_program(tmp_path):
    project, report = _migrated_project(P13, "ddp", tmp_path)
    first = _snapshot(project)
    assert "setup_distributed(" in first["main.py"] + first["agent.py"], "the program never joins the process group"
    assert re.search(r"wrap_model\(|is_main_process\(", first["agent.py"]), (
        f"the trainer module got no DDP changes: {_project_review(report)}")
    done = _cli(project, "--to", "ddp", "--check")
    assert done.exit_code == 0 and _snapshot(project) == first, f"a second run changes the project:\n{done.output}"


@pytest.mark.e2e
@pytest.mark.ddp
def test_p13_one_program_under_torchrun(tmp_path):
    project, _ = _migrated_project(P13, "ddp", tmp_path)
    run = _torchrun(project / "main.py", tmp_path / "run", project=True)
    _assert_identical_weights(run)
    assert len(re.findall(r"^epoch \d", _printed(run, 0), re.M)) == 3 and _printed(run, 1) == ""
    assert _saves(run, "actor.pth") == [0], "the checkpoint must have one writer"


# ================================================================ "Also seen"

def _static(source: str, target: str):
    result = migrate(source.encode(), target, "script.py")
    assert result.error is None, result.error
    return (result.new_source or source.encode()).decode(), result


DATAPARALLEL_GP = '''\
import torch
import torch.nn as nn
from torch import autograd, optim
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=16, shuffle=True)
netD = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
netD = nn.DataParallel(netD)
optD = optim.Adam(netD.parameters(), lr=1e-3)
for (x,) in loader:
    x = x.cuda().requires_grad_(True)
    out = netD(x)
    grads = autograd.grad(out.sum(), x, create_graph=True)[0]
    loss = out.mean() + grads.norm()
    optD.zero_grad()
    loss.backward()
    optD.step()
'''


def test_dataparallel_removed_without_a_ddp_wrap_is_reported():
    text, result = _static(DATAPARALLEL_GP, "ddp")
    review, _ = _findings(result)
    if "DataParallel" not in text and "wrap_model(" not in text:
        assert any("DataParallel" in item for item in review), (
            f"the multi-GPU parallelism of `python script.py` is gone and no review item says so: {review}")


ELSE_PASS = '''\
import torch
use_cuda = torch.cuda.is_available()
model = torch.nn.Linear(4, 2)
if use_cuda:
    model.cuda()
else:
    pass
print(model(torch.randn(8, 4)).shape)
'''


def test_no_dead_else_pass_after_a_cuda_guard():
    text, _ = _static(ELSE_PASS, "device")
    assert "pass" not in text and "else" not in text, text
    assert "\nmodel.to(device)\n" in text, text


APEX_FP16_FLAG = '''\
import argparse
import torch
from apex import amp
parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action="store_true")
args = parser.parse_args()
model = torch.nn.Linear(4, 1).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.fp16:
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
for step in range(3):
    loss = model(torch.randn(8, 4).cuda()).pow(2).mean()
    optimizer.zero_grad()
    if args.fp16:
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
    else:
        loss.backward()
    optimizer.step()
'''


def test_no_identical_branches_after_the_apex_migration():
    text, _ = _static(APEX_FP16_FLAG, "amp")
    same = [ast.unparse(node.test) for node in ast.walk(ast.parse(text)) if isinstance(node, ast.If) and node.orelse
            and ast.dump(ast.Module(node.body, [])) == ast.dump(ast.Module(node.orelse, []))]
    assert not same, f"`if {same[0]}:` and its `else:` do the same:\n{text}"


# ================================================================ found while writing these tests

SEMICOLON_BACKWARD = '''\
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
'''


@pytest.mark.parametrize("target", ["amp", "ddp,amp"])
def test_amp_unnamed_loss_in_a_line_of_several_statements(target):
    text, _ = _static(SEMICOLON_BACKWARD, target)
    assert "scaler.scale(" in text and "scaler.step(opt)" in text, text


# ================================================================ idempotence, both reports

TARGETS = ("device", "ddp", "amp", "ddp,amp")
SINGLE_FILES = sorted(p.relative_to(FIXTURES / "field").as_posix() for p in REPORT1.glob("*.py")) + \
    sorted(p.relative_to(FIXTURES / "field").as_posix() for p in REPORT.glob("*.py"))
PROJECT_FOLDERS = sorted(p.relative_to(FIXTURES / "field").as_posix() for p in REPORT.iterdir() if p.is_dir())
# (fixture, target) pairs that fail today, each with its reason (none now).
NOT_IDEMPOTENT: Dict[Tuple[str, str], str] = {}


def _idempotence_cases():
    for fixture in SINGLE_FILES + PROJECT_FOLDERS:
        for target in TARGETS:
            marks = [todo(NOT_IDEMPOTENT[fixture, target])] if (fixture, target) in NOT_IDEMPOTENT else []
            yield pytest.param(fixture, target, id=f"{fixture}-{target}", marks=marks)


@pytest.mark.parametrize("fixture, target", list(_idempotence_cases()))
@pytest.mark.slow
def test_second_migration_changes_nothing(fixture, target, tmp_path):
    path = FIXTURES / "field" / fixture
    if path.is_dir():
        project = tmp_path / path.name
        shutil.copytree(path, project)
        done = _cli(project, "--to", target)
        assert done.exit_code == 0, done.output
        first = _snapshot(project)
        again = _cli(project, "--to", target, "--check")
        assert again.exit_code == 0 and _snapshot(project) == first, f"the second run would change:\n{again.output}"
        return
    first = migrate(path.read_bytes(), target, path.name)
    assert first.error is None, first.error
    again = migrate(first.new_source or path.read_bytes(), target, path.name)
    assert again.error is None, again.error
    assert again.new_source is None, "the second run changes the first run's output"
