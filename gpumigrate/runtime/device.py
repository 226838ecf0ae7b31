"""Which device to run on, and the legacy CUDA tensor types on any device."""

from __future__ import annotations

import os
from typing import Any, Union

import torch

def _accelerator_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 0

def get_device(index: Union[int, torch.device, str, None] = None) -> torch.device:
    """The device to run on: CUDA, then Apple's MPS, then the CPU.

    `index` picks the n-th GPU for model-parallel scripts (`encoder.cuda(0)`,
    `decoder.cuda(1)`); with fewer GPUs than asked for, indices wrap around, so a two-GPU
    script still runs on one. Without `index`, a process launched by torchrun (which sets
    `LOCAL_RANK`) gets its own GPU. A device (or its name) is returned as it is.
    """
    if isinstance(index, (torch.device, str)):
        return torch.device(index)  # `.cuda(some_device)` named its device already
    if torch.cuda.is_available():
        if index is None:
            index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        return torch.device("cuda", index % _accelerator_count())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")

def synchronize(device: Union[int, torch.device, str, None] = None) -> None:
    """Wait for the work queued on the accelerator (what `torch.cuda.synchronize()` did for
    CUDA): on MPS it waits for MPS, and without an accelerator it returns at once, where
    `torch.cuda.synchronize()` raises "Found no NVIDIA driver"."""
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)
        return
    mps = getattr(torch, "mps", None)
    backend = getattr(torch.backends, "mps", None)
    if mps is not None and backend is not None and backend.is_available():
        mps.synchronize()

class tensor_type:  # noqa: N801  (named like the legacy types it replaces)
    """A stand-in for the legacy `torch.cuda.FloatTensor`-style constructors, on any device.

    `Tensor = tensor_type(torch.float32, device)` then, as before:
    `Tensor(3, 4)` (uninitialised, by sizes), `Tensor([1, 2])` or `Tensor(array)` (from data),
    `Tensor()` (empty).
    """

    def __init__(self, dtype: torch.dtype, device: Union[torch.device, str, None] = None) -> None:
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else get_device()

    def __call__(self, *args: Any) -> torch.Tensor:
        if not args:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        if len(args) == 1 and not isinstance(args[0], (int, torch.Size)):
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to(device=self.device, dtype=self.dtype)
            return torch.tensor(data, dtype=self.dtype, device=self.device)
        sizes = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else args
        return torch.empty(*sizes, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"tensor_type({self.dtype}, {self.device})"
