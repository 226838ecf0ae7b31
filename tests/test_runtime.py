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
