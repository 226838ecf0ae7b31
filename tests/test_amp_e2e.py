"""`--to amp` and `--to ddp,amp` end to end: every amp golden runs on this CPU-only machine
without apex, in one process and under `torchrun --standalone --nproc_per_node=2` (gloo), in
bfloat16 (the CPU's choice) and in float16 with the loss scaler on (`GPUMIGRATE_AMP=fp16`, as
on CUDA), and its training loss goes down. Each epoch line is printed once under torchrun."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from tests.conftest import FIXTURES, ROOT

pytestmark = pytest.mark.e2e

AMP_FIXTURES = sorted(p.name for p in (FIXTURES / "scripts").glob("amp_*.py"))
# Scripts whose reduced precision sat behind their own flag: migrated, the flag still decides.
# Without it, the migrated script prints exactly the float32 losses of the original; with it,
# it runs under autocast (other numbers), and its loss still goes down. Run without the flag,
# GPUMIGRATE_AMP changes nothing, so their one-process runs are those of
# test_the_precision_flag_keeps_its_meaning (which also compares them with the original).
FLAG_FIXTURES = {"amp_apex_fp16_flag.py": "--fp16", "amp_half_flag.py": "--half"}
ONE_PROCESS = [n for n in AMP_FIXTURES if n not in FLAG_FIXTURES]
EPOCH = re.compile(r"^epoch (\d+) loss (\d+\.\d+)$", re.M)


def _run(golden: Path, tmp_path: Path, launcher: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / golden.name
    shutil.copy(golden, script)
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    if "GPUMIGRATE_AMP" not in env:
        full.pop("GPUMIGRATE_AMP", None)
    return subprocess.run([*launcher, str(script)], capture_output=True, text=True, cwd=str(tmp_path), env=full,
                          timeout=240)


def _losses(out: str) -> List[float]:
    epochs = EPOCH.findall(out)
    assert epochs, f"no epoch lines in:\n{out[-1500:]}"
    assert [int(n) for n, _ in epochs] == list(range(1, len(epochs) + 1)), "an epoch line printed twice or missing"
    return [float(loss) for _, loss in epochs]


@pytest.mark.parametrize("precision, name", [("bf16", n) for n in ONE_PROCESS] + [("fp16", n) for n in ONE_PROCESS])
def test_amp_golden_trains_in_one_process(name, precision, tmp_path):
    done = _run(FIXTURES / "expected" / "amp" / name, tmp_path, [sys.executable], {"GPUMIGRATE_AMP": precision})
    assert done.returncode == 0, done.stderr[-2000:]
    losses = _losses(done.stdout)
    assert losses[-1] < losses[0], losses


# float16 (the loss scaler on: both ranks must skip or take the same steps) where scaling has
# something to get wrong: several optimizers, clipping, accumulation, apex's own DDP. These
# four run under torchrun in float16 only: bfloat16 takes the same DDP path with the scaler a
# pass-through (float32 gradients either way), and their bfloat16 autocast runs above.
SCALED_UNDER_TORCHRUN = {"amp_apex_gan.py", "amp_clip_accum.py", "amp_apex_ddp.py", "amp_apex_o2.py"}


@pytest.mark.ddp
@pytest.mark.parametrize("precision, name", [("bf16", n) for n in AMP_FIXTURES if n not in SCALED_UNDER_TORCHRUN] +
                         [("fp16", n) for n in sorted(SCALED_UNDER_TORCHRUN)])
def test_ddp_amp_golden_trains_under_torchrun(name, precision, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = _run(FIXTURES / "expected" / "ddp,amp" / name, tmp_path, torchrun, {"GPUMIGRATE_AMP": precision})
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(done.stdout)
    assert losses[-1] < losses[0], losses


def test_a_pre_migration_checkpoint_resumes_after_migration(tmp_path):
    """The original fp32 script writes a checkpoint with no scaler state; the migrated one
    resumes from it, then writes its own with the scaler's state, and resumes from that."""
    first = tmp_path / "original"
    first.mkdir()
    done = _run(FIXTURES / "scripts" / "amp_fp32_plain.py", first, [sys.executable], {})
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = first / "amp_plain_ckpt.pt"
    assert ckpt.exists()
    second = tmp_path / "migrated"
    second.mkdir()
    script = FIXTURES / "expected" / "amp" / "amp_fp32_plain.py"
    shutil.copy(script, second / script.name)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GPUMIGRATE_AMP="fp16")
    for resume, next_epoch in ((str(ckpt), 5), (str(second / "amp_plain_ckpt.pt"), 9)):
        done = subprocess.run([sys.executable, script.name, "--resume", resume], capture_output=True, text=True,
                              cwd=str(second), env=env, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"(next epoch {next_epoch})" in done.stdout and f"epoch {next_epoch} loss" in done.stdout
    import torch

    saved = torch.load(second / "amp_plain_ckpt.pt", weights_only=False)
    assert saved["scaler"]["scale"] > 0


@pytest.mark.parametrize("name", sorted(FLAG_FIXTURES))
def test_the_precision_flag_keeps_its_meaning(name, tmp_path):
    (tmp_path / "original").mkdir()
    original = _run(FIXTURES / "scripts" / name, tmp_path / "original", [sys.executable], {})
    assert original.returncode == 0, original.stderr[-2000:]
    golden = FIXTURES / "expected" / "amp" / name
    (tmp_path / "off").mkdir()
    off = _run(golden, tmp_path / "off", [sys.executable], {"GPUMIGRATE_AMP": "bf16"})
    assert off.returncode == 0, off.stderr[-2000:]
    assert _losses(off.stdout) == _losses(original.stdout)  # float32, as before
    for precision in ("bf16", "fp16"):
        (tmp_path / precision).mkdir()
        script = tmp_path / precision / name
        shutil.copy(golden, script)
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   GPUMIGRATE_AMP=precision)
        on = subprocess.run([sys.executable, str(script), FLAG_FIXTURES[name]], capture_output=True, text=True,
                            cwd=str(script.parent), env=env, timeout=240)
        assert on.returncode == 0, on.stderr[-2000:]
        losses = _losses(on.stdout)
        assert losses != _losses(original.stdout) and losses[-1] < losses[0], losses
