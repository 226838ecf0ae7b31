"""gpumigrate.runtime: the public API the rewritten scripts import."""

import subprocess
import sys

import pytest
import torch

from gpumigrate import runtime
from gpumigrate.runtime import get_device, tensor_type


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_cpu_when_no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert get_device() == torch.device("cpu")
    assert get_device(1) == torch.device("cpu")


def test_mps_before_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert get_device() == torch.device("mps")


def test_cuda_first(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert get_device() == torch.device("cuda", 0)
    assert get_device(1) == torch.device("cuda", 1)


def test_index_wraps_on_fewer_gpus(fake_cuda):
    # a two-GPU model-parallel script still runs on a machine with two... or one
    assert get_device(3) == torch.device("cuda", 1)


def test_local_rank_picks_the_gpu(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert get_device() == torch.device("cuda", 1)


def test_tensor_type_legacy_constructor_forms():
    Tensor = tensor_type(torch.float32, "cpu")
    by_size = Tensor(2, 3)
    assert by_size.shape == (2, 3) and by_size.dtype == torch.float32
    assert Tensor(torch.Size([4])).shape == (4,)
    assert Tensor([1, 2]).tolist() == [1.0, 2.0]
    assert Tensor(torch.tensor([1, 2])).dtype == torch.float32
    assert Tensor().numel() == 0
    assert tensor_type(torch.int64, "cpu")([1.0]).dtype == torch.int64
    assert tensor_type(torch.float32).device == get_device()


def test_import_has_no_side_effects_and_no_tool_dependencies():
    code = (
        "import os, sys; before = dict(os.environ); import torch; import gpumigrate.runtime; "
        "assert not torch.cuda.is_initialized(); assert dict(os.environ) == before; "
        "assert 'libcst' not in sys.modules and 'click' not in sys.modules; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_public_names_are_typed_and_documented():
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        assert obj.__doc__, name


def test_keep_batchnorm_fp32_on_a_half_model():
    from torch import nn

    from gpumigrate.runtime import keep_batchnorm_fp32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    model.half()
    assert keep_batchnorm_fp32(model) is model
    keep_batchnorm_fp32(model)  # a second call adds nothing
    bn = model[1]
    assert bn.weight.dtype == torch.float32 and bn.running_var.dtype == torch.float32
    assert len(bn._forward_pre_hooks) == 1 and len(bn._forward_hooks) == 1
    x = torch.randn(8, 1, 6, 6).half()
    out = model(x)
    assert out.dtype == torch.float16  # the layers around BatchNorm still run in half
    out.float().sum().backward()
    assert bn.weight.grad.dtype == torch.float32
    assert bn.running_mean.dtype == torch.float32 and bn.running_mean.abs().sum() > 0


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, (3, 1, 4)),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
      "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, (5, 1, 8)),
    # `python train.py` inside an sbatch job of 8 tasks is one process
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, None),
])
def test_launch_environment(monkeypatch, env, expected):
    from gpumigrate.runtime import distributed
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
                 "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = distributed._launch()
    assert (tuple(launch) if launch else None) == expected


def test_srun_without_master_address_is_one_clear_error(monkeypatch):
    from gpumigrate.runtime import distributed
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        distributed._launch()


def test_single_process_helpers_do_not_communicate(monkeypatch):
    from torch.utils.data import RandomSampler, TensorDataset

    from gpumigrate import runtime
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    model = torch.nn.Linear(2, 2)
    assert runtime.wrap_model(model) is model and runtime.unwrap_model(model) is model
    data = TensorDataset(torch.arange(5))
    assert isinstance(runtime.distributed_sampler(data), RandomSampler)
    assert runtime.distributed_sampler(data, shuffle=False) is None
    assert runtime.reduce_sum(3, 2.5) == (3, 2.5) and runtime.reduce_sum(7) == 7
    assert runtime.broadcast_object({"a": 1}) == {"a": 1}
    assert runtime.is_main_process() and runtime.get_world_size() == 1


def test_helpers_refuse_to_run_before_setup(monkeypatch):
    from torch.utils.data import TensorDataset

    from gpumigrate import runtime
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="setup_distributed"):
        runtime.distributed_sampler(TensorDataset(torch.arange(4)))
