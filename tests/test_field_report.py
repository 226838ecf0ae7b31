"""The first field report's scripts (fixtures/field/report1/R*.py, see fixtures/field/README.md),
each migrated to the target its row names and run the way the row says, checked against the
report's "right" column. Where the right answer is "reported", the review item is checked.

These are small scripts written for the report, one pattern each; the realistic fixtures
in fixtures/scripts cover the same patterns in context (tests/test_patterns_e2e.py). The
second report's scripts are tested in tests/test_field_report_2.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from gpumigrate.verify.runs import clean_env
from tests.conftest import FIXTURES, ROOT, migrate

REPORT = FIXTURES / "field" / "report1"
pytestmark = [pytest.mark.e2e]


def _migrated(name: str, target: str, tmp_path: Path) -> Tuple[Path, List[str]]:
    """The migrated script in `tmp_path`, and the review items the migration reported."""
    source = (REPORT / name).read_bytes()
    result = migrate(source, target, name)
    assert result.error is None, result.error
    out = tmp_path / name
    out.write_bytes(result.new_source or source)
    return out, [f"{f.code} {f.message}" for f in result.findings if not f.fixed]


def _run(script: Path, ranks: int = 1, timeout: int = 120) -> subprocess.CompletedProcess:
    env = clean_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return subprocess.run([*launcher, str(script)], cwd=str(script.parent), env=env, capture_output=True,
                          text=True, timeout=timeout)


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _torchrun(name: str, tmp_path: Path) -> Tuple[str, List[str], Path]:
    script, reviews = _migrated(name, "ddp", tmp_path)
    return _ok(_run(script, ranks=2)), reviews, script


# ---------------------------------------------------------------- device target, python

def test_r01_no_grad_only_around_the_volatile_evaluation(tmp_path):
    script, _ = _migrated("R01_nograd_main_block.py", "device", tmp_path)
    lines = _ok(_run(script)).split("\n")
    assert [line.split()[0] for line in lines if line] == ["0", "1"]  # trained both epochs, no autograd error


def test_r02_the_lambda_runs_under_no_grad_not_the_training(tmp_path):
    script, _ = _migrated("R02_nograd_lambda.py", "device", tmp_path)
    assert _ok(_run(script)).startswith("loss ")
    assert "torch.no_grad()(lambda" in script.read_text()


def test_r12_the_generation_loop_runs_under_no_grad(tmp_path):
    script, _ = _migrated("R12_volatile_generate.py", "device", tmp_path)
    assert _ok(_run(script)).strip() == "graph kept: False"


def test_r13_zero_dim_values_read_with_item(tmp_path):
    script, reviews = _migrated("R13_data0.py", "device", tmp_path)
    out = _ok(_run(script)).split()
    assert float(out[0]) >= 0 and out[1].isdigit(), out  # numbers, not tensors
    assert not reviews


def test_r11_weights_only_false_only_for_pickled_objects(tmp_path):
    script, _ = _migrated("R11_weights_only.py", "device", tmp_path)
    assert "weights_only=False" not in script.read_text()
    lint = migrate((REPORT / "R11_weights_only.py").read_bytes(), "device")
    assert "GM106" not in [f.code for f in lint.findings]
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "w.pth")
    _ok(_run(script))  # the state dict loads with weights_only=True


def test_r18_the_else_branch_goes_with_the_guard(tmp_path):
    script, _ = _migrated("R18_mps_guard.py", "device", tmp_path)
    text = script.read_text()
    assert "else" not in text and "\nx = x.to(device)\n" in text
    assert _ok(_run(script)).strip() == "torch.Size([8, 2])"


# ---------------------------------------------------------------- ddp target, torchrun

@pytest.mark.ddp
def test_r03_metric_objects_evaluate_the_whole_set_on_every_rank(tmp_path):
    out, reviews, _ = _torchrun("R03_unreduced_metric.py", tmp_path)
    lines = out.splitlines()
    assert len(lines) == 6 and all(line.endswith("on 33 samples") for line in lines), out
    assert any("evaluation not sharded" in r for r in reviews)


@pytest.mark.ddp
def test_r04_run_stamp_agreed_after_setup(tmp_path):
    out, _, script = _torchrun("R04_bcast_before_setup.py", tmp_path)
    assert out.count("would save to") == 1
    text = script.read_text()
    assert text.index("setup_distributed()") < text.index("broadcast_object(")


@pytest.mark.ddp
def test_r05_iteration_based_loader_sharded_and_reshuffled(tmp_path):
    out, reviews, _ = _torchrun("R05_iter_loader.py", tmp_path)
    rows = [eval(line.split(" ", 1)[1]) for line in out.splitlines()]  # rank 0's batches
    assert len(rows) == 8, out  # every iteration ran: no StopIteration
    epochs = [rows[i] + rows[i + 1] for i in range(0, 8, 2)]  # 2 batches of 4 = this rank's 8 samples
    assert all(len(set(e)) == 8 for e in epochs), "a rank's epoch repeats samples"
    assert len({tuple(e) for e in epochs}) == 4, "every rebuilt iterator has the same order (no set_epoch)"
    assert any("iteration-based" in r for r in reviews)


@pytest.mark.ddp
def test_r06_optimizer_from_getattr_trains_the_wrapped_model(tmp_path):
    _torchrun("R06_optimizer_factory.py", tmp_path)
    weights = [(tmp_path / f"weights_rank{r}.txt").read_text() for r in (0, 1)]
    assert weights[0] == weights[1]


@pytest.mark.ddp
def test_r07_wrapped_after_reaching_its_device(tmp_path):
    _, _, script = _torchrun("R07_reload_after_count.py", tmp_path)
    text = script.read_text()
    assert text.index("model = model.to(device)") < text.index("model = wrap_model(model)") < text.index("optimizer =")
    assert text.count("print(") == 1 and "if is_main_process():\n    print('parameters:'" in text


@pytest.mark.ddp
def test_r08_training_average_is_the_true_one(tmp_path):
    out, _, script = _torchrun("R08_train_avg.py", tmp_path)
    assert out == _ok(_run(script))  # lr 0: the whole-set average, as in one process


@pytest.mark.ddp
@pytest.mark.parametrize("name", ["R09_loss_module.py", "R09b_loss_module_noparam.py"])
def test_r09_loss_modules_are_never_wrapped(name, tmp_path):
    out, _, script = _torchrun(name, tmp_path)
    assert out.strip() == "done"
    assert "wrap_model(criterion" not in script.read_text()
    said = [f.message for f in migrate((REPORT / name).read_bytes(), "ddp", name).findings]
    if name == "R09_loss_module.py":  # its parameters train: averaged at the step, and said so
        assert any("loss module" in m and "averaged across ranks at each optimizer step" in m for m in said)


@pytest.mark.ddp
def test_r10_saved_container_holds_the_plain_model(tmp_path):
    _torchrun("R10_pickled_ddp.py", tmp_path)
    check = tmp_path / "check.py"
    check.write_text("import torch\nm, o = torch.load('ckpt.pt', weights_only=False)\n"
                     "print(type(m).__name__, torch.distributed.is_initialized())\n")
    assert _ok(_run(check)).strip() == "Linear False"


@pytest.mark.ddp
def test_r14_every_output_written_once(tmp_path):
    pytest.importorskip("tqdm")
    out, _, _ = _torchrun("R14_outputs.py", tmp_path)
    assert [line for line in out.splitlines() if "done" in line] == ["epoch 0 done", "epoch 1 done"]
    assert (tmp_path / "log.csv").read_text().split() == ["0,row", "1,row"]


@pytest.mark.ddp
def test_r15_one_run_directory(tmp_path):
    out, _, _ = _torchrun("R15_run_dir.py", tmp_path)
    assert out.count("RUNDIR:") == 1
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.ddp
def test_r16_loader_factory_evaluates_every_sample(tmp_path):
    out, _, _ = _torchrun("R16_loader_factory.py", tmp_path)
    assert re.findall(r"accuracy \d+/(\d+)", out) == ["33", "33"]


def test_r17_wrap_between_statements_joined_by_semicolons(tmp_path):
    script, _ = _migrated("R17_semicolon.py", "ddp", tmp_path)
    assert _ok(_run(script)).strip() == "done"
    assert "model = torch.nn.Linear(4, 1)\nmodel = wrap_model(model)\noptimizer =" in script.read_text()


@pytest.mark.ddp
@pytest.mark.parametrize("name", ["R19_timer.py", "R20_timer_deadlock.py"])
def test_r19_timings_are_per_process_no_collective(name, tmp_path):
    out, _, script = _torchrun(name, tmp_path)
    # the 3 steps sharded by their counter: rank 0 takes steps 0 and 2 (and prints), rank 1 step 1
    assert out.count("step time") == 2
    assert "broadcast_object" not in script.read_text()


@pytest.mark.ddp
def test_r21_second_pass_is_a_no_op(tmp_path):
    script, _ = _migrated("R21_idempotence.py", "ddp", tmp_path)
    again = migrate(script.read_bytes(), "ddp", script.name)
    assert again.error is None and again.new_source is None
    _ok(_run(script, ranks=2))


@pytest.mark.ddp
def test_r22_data_sliced_by_hand_is_sharded_by_its_index_range(tmp_path):
    out, reviews, script = _torchrun("R22_no_loader.py", tmp_path)
    assert out.split() == ["0", "1"]
    assert "for i in shard_batches(range(0, data.size(0), 10), indices=True):" in script.read_text()
    assert not any("does not come from a DataLoader" in r for r in reviews)
