"""`gpumigrate verify` catches what it must: deliberately wrong migrations of
tests/verify_cases/classify.py, each made from the real migration by a few text edits, must be
reported as a difference naming the quantity (the check) that differs; the real migrations
must pass. Each wrong migration is checked with `verify --against`, through the command line.

The edits are applied to the migration as gpumigrate writes it today: an edit whose text is no
longer there fails its test (the case needs rewriting), so a case can never silently test
nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

from tests.conftest import ROOT, migrate

pytestmark = [pytest.mark.e2e]

CASES = Path(__file__).resolve().parent / "verify_cases"
ORIGINAL = CASES / "classify.py"
Edit = Tuple[str, str]
ARGS = ("--", "--epochs", "2")  # 5 steps end the second epoch: the checkpoint after training is written

# What the ddp migration of classify.py writes, in pieces the wrong migrations change.
WRAP = "model = wrap_model(model)\n"
SET_EPOCH = "    set_epoch(train_loader, epoch)\n"
SAMPLER = "sampler=distributed_sampler(train_dataset)"
EVAL_SAMPLER = "sampler=distributed_sampler(test_dataset, shuffle=False, pad=False)"
REDUCE = "    test_loss, correct, seen = reduce_sum(test_loss, correct, seen)\n"
GUARDED_PRINT = '    if is_main_process():\n        print("epoch'
SAVE = 'if is_main_process():\n    torch.save({"model": unwrap_model(model).state_dict()'
TRAIN_STEP = ("        optimizer.zero_grad()\n        loss = F.cross_entropy(model(data), target)\n"
              "        loss.backward()\n        optimizer.step()\n")

# The runtime averages the gradients of a model no one wrapped (correct by construction): a
# migration by hand, or by another tool, has no such net.
NO_NET = ("device = setup_distributed()", "device = setup_distributed(average_unwrapped=False)")

# name: (target, edits, the check that must fail)
WRONG: Dict[str, Tuple[str, List[Edit], str]] = {
    # the model is not wrapped: the ranks train apart on their shards
    "wrap missing": ("ddp", [(WRAP, ""), NO_NET], "parameters across ranks"),
    # nothing distributed at all but the launch: every rank trains alone on all the data
    "no wrap, no sampler": ("ddp", [(WRAP, ""), NO_NET, (SAMPLER, "shuffle=True")], "samples per rank"),
    # DDP wrapped after training: the first steps are not averaged (the wrap's broadcast hides it at the end)
    "wrap after training": ("ddp", [(WRAP, ""), NO_NET, ("if is_main_process():\n    torch.save",
                                                  "model = wrap_model(model)\nif is_main_process():\n    torch.save")],
                            "parameters across ranks"),
    # a DistributedSampler whose epoch is never set: the same order every epoch
    "sampler without set_epoch": ("ddp", [(SET_EPOCH, ""), (SAMPLER, "sampler=DistributedSampler(train_dataset) "
                                                           "if dist.is_initialized() else None, "
                                                           "shuffle=not dist.is_initialized()"),
                                          ("import torch\n", "import torch\nimport torch.distributed as dist\n"
                                           "from torch.utils.data.distributed import DistributedSampler\n")],
                                  "epoch order"),
    "set_epoch with a constant": ("ddp", [(SET_EPOCH, "    set_epoch(train_loader, 0)\n")], "epoch order"),
    # evaluation sums left per rank: rank 0 prints its half
    "metric not reduced": ("ddp", [(REDUCE, "")], "evaluation metrics"),
    # per-rank means averaged: biased where the shards differ in size (8 and 7 of 15 samples)
    "mean of means": ("ddp", [(REDUCE, "    mean_loss, accuracy = reduce_mean(test_loss / seen, correct / seen)\n"
                                       "    test_loss, correct = mean_loss * seen, int(round(accuracy * seen))\n"),
                              ("reduce_sum,", "reduce_mean, reduce_sum,")], "evaluation metrics"),
    # the evaluation shard padded: a sample counted twice
    "padded evaluation shard": ("ddp", [(EVAL_SAMPLER, "sampler=distributed_sampler(test_dataset, shuffle=False)")],
                                "evaluation metrics"),
    # a collective only rank 0 calls: rank 0 waits for ever
    "collective under a rank-0 branch": ("ddp", [(REDUCE, "    if is_main_process():\n    " + REDUCE)], "collectives"),
    "barrier on rank 0 only": ("ddp", [(GUARDED_PRINT, "    if is_main_process():\n        barrier()\n        print(\"epoch"),
                                       ("import distributed_sampler,", "import barrier, distributed_sampler,")],
                               "collectives"),
    # training only on rank 0: DDP's gradient all-reduce waits for the other ranks
    "training on rank 0 only": ("ddp", [(TRAIN_STEP, "        if not is_main_process():\n            continue\n"
                                         + TRAIN_STEP)], "collectives"),
    # every rank prints, every rank writes the checkpoint
    "print on every rank": ("ddp", [(GUARDED_PRINT, '    if True:\n        print("epoch')], "output on rank 0 only"),
    "save on every rank": ("ddp", [(SAVE, SAVE.replace("if is_main_process():", "if True:"))], "files on rank 0 only"),
    # a DDP wrapper of the script's own (the runtime's hides its level): its 'module.' keys do
    # not load into the original model
    "checkpoint with module. keys": ("ddp", [(WRAP, "model = torch.nn.parallel.DistributedDataParallel(model) "
                                              "if get_world_size() > 1 else model\n"),
                                             ("unwrap_model(model).state_dict()", "model.state_dict()"),
                                             ("from gpumigrate.runtime import ",
                                              "from gpumigrate.runtime import get_world_size, ")],
                                     "checkpoints"),
    # training under no_grad: backward() raises
    "no_grad around training": ("ddp", [(TRAIN_STEP, "        with torch.no_grad():\n"
                                         + TRAIN_STEP.replace("        ", "            "))], "run"),
    # the accumulator keeps every step's graph
    ".item() dropped from an accumulator": ("ddp", [("total_loss += loss.item()", "total_loss += loss")],
                                            "retained graphs"),
    # the same in the device migration
    ".item() dropped (device)": ("device", [("total_loss += loss.item()", "total_loss += loss")], "retained graphs"),
    # the learning rate scaled by the world size without being asked: one process already differs
    "learning rate changed": ("ddp", [("lr=args.lr", "lr=args.lr * 2")], "loss"),
    # a summed loss: other gradients
    "loss reduction changed": ("ddp", [("loss = F.cross_entropy(model(data), target)",
                                        "loss = F.cross_entropy(model(data), target, reduction='sum')")], "loss"),
    # gradients accumulate across steps
    "zero_grad dropped": ("ddp", [("        optimizer.zero_grad()\n", "")], "loss"),
    # after the first evaluation the model trains in eval mode (dropout off)
    "model.train() dropped": ("ddp", [("    model.train()\n", "")], "loss"),
    # the training order no longer shuffled
    "shuffle dropped": ("ddp", [(SAMPLER, "sampler=distributed_sampler(train_dataset, shuffle=False)")], "loss"),
    # evaluation with dropout on
    "model.eval() dropped": ("device", [("    model.eval()\n", "")], "printed output"),
    # fsdp: shards kept in bfloat16 where the script trains in float32: not what ddp trains
    "fsdp shards in low precision": ("fsdp", [("model = shard_model(model)\n",
                                               "model = shard_model(model, mixed_precision=True)\n")],
                                     "evaluation metrics"),
    # amp: the optimizer never steps
    "scaler.step missing": ("amp", [("        scaler.step(optimizer)\n", "")], "optimizer steps"),
    # amp: a resumed run restarts loss scaling
    "scaler state not saved": ("amp", [(', "scaler": scaler.state_dict()}', "}")], "scaler state"),
    # amp: an autocast of its own ignores the switch: the float32 run is not float32
    "autocast that ignores the switch": ("amp", [("        with autocast(model):\n            loss",
                                                  "        with torch.autocast('cpu', dtype=torch.bfloat16):\n"
                                                  "            loss")], "loss"),
}


def _migration(target: str) -> str:
    result = migrate(ORIGINAL.read_bytes(), target, path=str(ORIGINAL))
    assert result.error is None and result.changed, result.error
    return result.new_source.decode()


def _wrong(tmp_path: Path, target: str, edits: Sequence[Edit]) -> Path:
    text = _migration(target)
    for old, new in edits:
        assert text.count(old) == 1, f"the {target} migration no longer has {old!r} once: rewrite this case"
        text = text.replace(old, new)
    path = tmp_path / "wrong" / "classify.py"
    path.parent.mkdir()
    path.write_text(text)
    return path


def verify(*args: str, timeout: float = 600) -> Tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    options = ["--format", "json"] + ([] if "--timeout" in args else ["--timeout", "60"])
    cut = args.index("--") if "--" in args else len(args)  # after `--`, the script's own arguments
    proc = subprocess.run([sys.executable, "-m", "gpumigrate", "verify", *args[:cut], *options, *args[cut:]],
                          capture_output=True, text=True, env=env, timeout=timeout)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = {}
    return proc.returncode, data, proc.stderr


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_migration_is_a_difference_naming_the_quantity(name, tmp_path):
    target, edits, quantity = WRONG[name]
    wrong = _wrong(tmp_path, target, edits)
    code, data, stderr = verify(str(ORIGINAL), "--to", target, "--against", str(wrong), "--fail-fast", *ARGS)
    assert code == 1, f"verify said {data.get('verdict')}: {data.get('reason') or stderr[-2000:]}"
    failed = [c["name"] for c in data["checks"] if c["status"] == "fail"]
    assert quantity in failed, f"failed checks {failed}, not {quantity!r}: {data['reason']}"
    assert data["reason"], data


@pytest.mark.parametrize("target", ["device", "ddp,amp", "fsdp"])
def test_the_real_migration_is_equivalent_and_the_users_files_are_not_touched(target, tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    script = folder / "classify.py"
    script.write_bytes(ORIGINAL.read_bytes())
    before = {p: p.read_bytes() for p in folder.rglob("*")}
    code, data, stderr = verify(str(script), "--to", target, *ARGS)
    assert code == 0, f"{data.get('reason') or stderr[-2000:]}"
    passed = {c["name"] for c in data["checks"] if c["status"] == "pass"}
    assert {"loss", "parameters", "printed output", "retained graphs"} <= passed
    if "ddp" in target:
        assert {"parameters across ranks", "samples per rank", "epoch order", "evaluation metrics",
                "checkpoints", "output on rank 0 only", "files on rank 0 only"} <= passed, data["checks"]
    if "amp" in target:
        assert {"bfloat16 losses", "scaler state"} <= passed, data["checks"]
    if target == "fsdp":
        assert {"parameters across ranks", "evaluation metrics", "checkpoints", "sharded as ddp trains"} <= passed, \
            data["checks"]
    assert {p: p.read_bytes() for p in folder.rglob("*")} == before  # model.pt went to the scratch copies


def test_could_not_judge_an_original_that_fails(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nopen('data/train.csv').read()\n")
    code, data, _ = verify(str(script), "--to", "device")
    assert code == 2 and data["verdict"] == "unknown"
    assert "FileNotFoundError" in data["reason"] and "--data real" in data["reason"]
    # a migrated script that runs past --timeout: too slow to judge, not a difference
    script.write_text("print('hello')\n")
    slow = tmp_path / "slow" / "train.py"
    slow.parent.mkdir()
    slow.write_text("import time\ntime.sleep(60)\nprint('hello')\n")
    code, data, _ = verify(str(script), "--to", "device", "--against", str(slow), "--timeout", "8")
    assert code == 2 and data["verdict"] == "unknown" and "timed out after 8 s" in data["reason"], data


def test_bad_input_is_one_line(tmp_path):
    code, _, stderr = verify(str(tmp_path / "missing.py"), "--to", "ddp")
    assert code == 2 and "no such file" in stderr and "Traceback" not in stderr
    code, _, stderr = verify(str(ORIGINAL), "--to", "tpu")
    assert code == 2 and "unknown target" in stderr and "Traceback" not in stderr
    notebook = tmp_path / "train.ipynb"
    notebook.write_text("{}")
    code, _, stderr = verify(str(notebook), "--to", "device")
    assert code == 2 and "nbconvert" in stderr and "Traceback" not in stderr


HANG = '''\
import time
import torch
import torch.distributed as dist
from gpumigrate.runtime import get_rank, setup_distributed, wrap_model

device = setup_distributed()
model = wrap_model(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
if get_rank() == 0:
    dist.barrier()
else:
    time.sleep(600)
'''


def test_a_hang_is_reported_with_where_each_rank_waits(tmp_path):
    """No error anywhere, rank 0 waits for a barrier rank 1 never reaches: the stall watchdog
    turns the hang into a report (in --stall seconds, not --timeout)."""
    original = tmp_path / "train.py"
    original.write_text("import torch\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                        "for step in range(3):\n    opt.zero_grad()\n    model(torch.randn(8, 4)).sum().backward()\n"
                        "    opt.step()\n")
    wrong = tmp_path / "wrong" / "train.py"
    wrong.parent.mkdir()
    wrong.write_text(HANG)
    code, data, stderr = verify(str(original), "--to", "ddp", "--against", str(wrong), "--stall", "5")
    assert code == 1, data.get("reason") or stderr[-1000:]
    check = next(c for c in data["checks"] if c["name"] == "collectives")
    assert check["status"] == "fail" and "rank 0 waits at train.py:14" in check["detail"], check
    assert "rank 1 waits at train.py:16" in check["detail"], check
    assert data["runs"]["torchrun"]["seconds"] < 40


def test_what_differs_between_two_runs_of_the_original_is_noise(tmp_path):
    """An original seeded from the clock differs from itself: its losses are no evidence."""
    script = tmp_path / "train.py"
    script.write_text("import time\nimport torch\ntorch.manual_seed(time.time_ns() % 100003)\n"
                      "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for step in range(3):\n    opt.zero_grad()\n    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
                      "    loss.backward()\n    opt.step()\n")
    code, data, stderr = verify(str(script), "--to", "device", "--against", str(script))
    assert code == 0, data.get("reason") or stderr[-1000:]
    loss = next(c for c in data["checks"] if c["name"] == "loss")
    assert loss["status"] == "skip" and "differs from run to run" in loss["detail"], loss


TWO_OPTIMIZERS = '''\
import torch
import torch.nn.functional as F

torch.manual_seed(0)
critic, actor = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
opt_c = torch.optim.SGD(critic.parameters(), lr=0.1)
opt_a = torch.optim.SGD(actor.parameters(), lr=0.1)
last_loss = None


def train(x):
    global last_loss
    q_loss = F.mse_loss(critic(x), x.sum(1, keepdim=True))
    opt_c.zero_grad()
    q_loss.backward()
    opt_c.step()
    a_loss = -critic(actor(x)).mean()   # q_loss (the critic's step) is still a local here
    opt_a.zero_grad()
    a_loss.backward()
    opt_a.step()
    last_loss = a_loss                   # one graph kept, not one per step


for step in range(6):
    train(torch.randn(8, 4))
print("done")
'''


def test_a_loss_still_in_a_local_is_not_a_kept_graph(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TWO_OPTIMIZERS)
    code, data, stderr = verify(str(script), "--to", "device", "--against", str(script), "--steps", "12")
    assert code == 0, data.get("reason") or stderr[-1000:]
    check = next(c for c in data["checks"] if c["name"] == "retained graphs")
    assert check["status"] == "pass", check
    leaky = TWO_OPTIMIZERS.replace("    last_loss = a_loss ", "    last_loss = a_loss if last_loss is None else last_loss + a_loss ")
    script.write_text(leaky)
    code, data, stderr = verify(str(script), "--to", "device", "--against", str(script), "--steps", "12")
    assert code == 1 and "`last_loss`" in data["reason"], data.get("reason") or stderr[-1000:]


@pytest.mark.parametrize("name, target, args", [
    # PyTorch 0.3: Variable(volatile=True), loss.data[0] on a 0-dim loss, .cuda() under a flag
    ("mnist_2018.py", "device", ["--no-cuda"]),
    # no optimizer (SGD by hand), type(h) == Variable, CRLF; the ddp migration declines and says so
    ("crlf_rnn.py", "ddp", []),
])
def test_fixtures_written_for_old_torch_verify(name, target, args):
    from tests.conftest import FIXTURES
    code, data, stderr = verify(str(FIXTURES / "scripts" / name), "--to", target, *(["--", *args] if args else []))
    assert code == 0, data.get("reason") or stderr[-1000:]
    if target == "ddp":
        assert "as the migration's report says" in data["reason"], data["reason"]


def test_printed_lines_compare_by_value():
    """Pure comparisons (no runs): numbers to their last printed digit, times ignored, a 0-dim
    tensor printed whole is its number."""
    from gpumigrate.verify.checks import SCALAR_TENSOR, compare_lines
    assert compare_lines(["loss 0.123457"], ["loss 0.123458"]) is None          # the last digit rounds
    assert compare_lines(["loss 0.1235"], ["loss 0.1240"]) is not None
    assert compare_lines(["epoch 1 | 0.1s | acc 12/64"], ["epoch 1 | 0.0s | acc 12/64"]) is None
    assert compare_lines(["acc 12/64"], ["acc 13/64"]) is not None
    assert compare_lines(["best 0.0156"], ["best 0.015625"]) is None               # to the coarser print
    assert compare_lines(["a", "b"], ["a"])[1].startswith("the original prints 1 more")
    assert SCALAR_TENSOR.sub(r"\1", "best tensor(0.5230, grad_fn=<DivBackward0>)") == "best 0.5230"
    assert SCALAR_TENSOR.sub(r"\1", "tensor([1, 2])") == "tensor([1, 2])"


def test_the_sharded_run_is_held_to_the_ddp_run_step_by_step():
    """Pure comparison (no runs): each rank's losses, and the shards' sums over the ranks plus
    the parameters every rank holds whole, against a ddp rank's, step by step."""
    from gpumigrate.verify.checks import sharded_like_replicated
    from gpumigrate.verify.runner import Probed

    def run(*ranks):
        probed = Probed("x", len(ranks), 0, "", "", 1.0, Path("."), Path("x.py"), Path("."), 60.0)
        probed.ranks = {r: {"steps": steps} for r, steps in enumerate(ranks)}
        return probed

    def step(loss, params, sharded=(0.0, 0.0)):
        return {"losses": [loss], "params": list(params), "sharded": list(sharded)}

    ddp = run([step(1.0, (10.0, 30.0)), step(0.9, (11.0, 31.0))], [step(1.2, (10.0, 30.0)), step(1.1, (11.0, 31.0))])
    fsdp = run([step(1.0, (1.0, 2.0), (4.0, 12.0)), step(0.9, (1.0, 2.0), (4.5, 13.0))],
               [step(1.2, (1.0, 2.0), (5.0, 16.0)), step(1.1, (1.0, 2.0), (5.5, 16.0))])
    assert sharded_like_replicated(fsdp, ddp).status == "pass"
    fsdp.ranks[1]["steps"][1]["losses"] = [1.2]
    check = sharded_like_replicated(fsdp, ddp)
    assert check.status == "fail" and "step 2, rank 1" in check.detail
    fsdp.ranks[1]["steps"][1]["losses"] = [1.1]
    fsdp.ranks[0]["steps"][0]["sharded"] = [4.1, 12.0]
    check = sharded_like_replicated(fsdp, ddp)
    assert check.status == "fail" and "after step 1" in check.detail
