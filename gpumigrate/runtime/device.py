"""Which device to run on, and the legacy CUDA tensor types on any device."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

def _accelerator() -> Optional[str]:
    """The type of the accelerator this process can use ("cuda", "mps", "xpu", ...), or None.

    torch >= 2.6 names it (`torch.accelerator`), so XPU and the other backends are found
    too; older torch is asked for CUDA, then Apple's MPS."""
    api = getattr(torch, "accelerator", None)
    if api is not None and hasattr(api, "current_accelerator"):
        found = api.current_accelerator()  # the build's accelerator (None on CPU-only builds) ...
        if found is None:
            return None
        available = getattr(api, "is_available", None)  # ... usable here: a driver and a device
        usable = available() if available is not None else api.device_count() > 0
        return found.type if usable else None
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def accelerator_available() -> bool:
    """Whether `get_device()` picks an accelerator (CUDA, MPS, XPU, ...) rather than the CPU:
    what `torch.cuda.is_available()` meant in a script written for CUDA only, so that
    `args.cuda = not args.no_cuda and accelerator_available()` keeps `--no-cuda`'s meaning
    and still runs on a Mac's GPU."""
    return _accelerator() is not None


def _current_index(kind: str) -> int:
    """This process's device index: LOCAL_RANK's under torchrun, else the current one."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return int(local_rank)
    if kind == "cuda":
        return torch.cuda.current_device()
    api = torch.accelerator
    current = getattr(api, "current_device_index", None) or getattr(api, "current_device_idx", None)
    return current() if current is not None else 0


def _multi_process() -> bool:
    """Launched as one of several processes (torchrun, srun) that will form a group."""
    try:
        return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1) > 1
    except ValueError:
        return False


def _collective_kind(kind: str) -> Optional[str]:
    """The accelerator type a process group can communicate on, or None (the CPU, with
    gloo): CUDA (NCCL), and on torch >= 2.6 whatever has a default backend (XPU's xccl); not
    MPS, which has none, so a DDP model there could not be synchronised."""
    if kind == "cuda":
        return kind
    if kind == "mps":
        return None
    dist = torch.distributed
    backend_for = getattr(dist, "get_default_backend_for_device", None)
    if not dist.is_available() or backend_for is None:
        return None
    try:
        return kind if backend_for(torch.device(kind)) else None
    except (RuntimeError, ValueError, KeyError):
        return None


def get_device(index: Union[int, torch.device, str, None] = None) -> torch.device:
    """The device to run on: the accelerator (CUDA, MPS, XPU, ... as `torch.accelerator`
    finds it on torch >= 2.6; CUDA then MPS on older torch), else the CPU.

    `index` picks the n-th GPU for model-parallel scripts (`encoder.cuda(0)`,
    `decoder.cuda(1)`); with fewer GPUs than asked for, indices wrap around, so a two-GPU
    script still runs on one. Without `index`, a process launched by torchrun (which sets
    `LOCAL_RANK`) gets its own GPU, on an accelerator its process group can communicate on
    (else the CPU: MPS has no collective backend). A device (or its name) is returned as it is.
    """
    if isinstance(index, (torch.device, str)):
        return torch.device(index)  # `.cuda(some_device)` named its device already
    kind = _accelerator()
    if kind is not None and index is None and _multi_process():
        kind = _collective_kind(kind)
    if kind is None:
        return torch.device("cpu")
    if kind == "mps":
        return torch.device("mps")  # one device, no index (as torch names it)
    count = torch.cuda.device_count() if kind == "cuda" else torch.accelerator.device_count()
    if index is None:
        index = _current_index(kind)
    return torch.device(kind, index % max(count, 1))


def get_local_rank() -> int:
    """This process's index among the processes of its machine: torchrun's LOCAL_RANK (srun's
    SLURM_LOCALID in a step of several tasks), 0 in one process. What a worker that
    `mp.spawn` started was given, so that the same worker runs under torchrun."""
    env = os.environ
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    if "SLURM_LOCALID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return int(env["SLURM_LOCALID"])
    return 0


def distributed_backend(device: Optional[torch.device] = None) -> str:
    """The `init_process_group` backend for `device` (default: this process's), in place of a
    hard-coded "nccl": gloo for CPU tensors always, beside NCCL on CUDA and the device's own
    backend on XPU and the like; gloo alone where the model stays on the CPU (a laptop, a Mac,
    a CPU runner, a script's own `--no-cuda`)."""
    device = get_device() if device is None else device
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return f"cpu:gloo,{device.type}:{torch.distributed.get_default_backend_for_device(device)}"


def synchronize(device: Union[int, torch.device, str, None] = None) -> None:
    """Wait for the work queued on the accelerator (what `torch.cuda.synchronize()` did for
    CUDA): on MPS it waits for MPS, on XPU for XPU, and without an accelerator it returns at
    once, where `torch.cuda.synchronize()` raises "Found no NVIDIA driver"."""
    kind = _accelerator()
    if kind is None:
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()
    else:
        torch.accelerator.synchronize(device)


_LEGACY_TYPES = {torch.float32: "FloatTensor", torch.float64: "DoubleTensor", torch.float16: "HalfTensor",
                 torch.bfloat16: "BFloat16Tensor", torch.int64: "LongTensor", torch.int32: "IntTensor",
                 torch.int16: "ShortTensor", torch.int8: "CharTensor", torch.uint8: "ByteTensor",
                 torch.bool: "BoolTensor"}


def tensor_type(dtype: torch.dtype, device: Union[torch.device, str, None] = None) -> Any:
    """The legacy tensor type (`torch.FloatTensor`, `torch.cuda.FloatTensor`, ...) for `dtype`
    on `device` (default: `get_device()`), where the device has one: what the script chose
    between, so `Tensor = tensor_type(torch.float32, device)` works as before in every use:
    `Tensor(3, 4)`, `Tensor([1, 2])`, `x.type(Tensor)`, `isinstance(x, Tensor)`. Elsewhere (MPS,
    XPU, a GPU other than the current one) a stand-in that makes tensors there (sizes, data,
    empty), which `.type()` and `isinstance` do not take."""
    where = torch.device(device) if device is not None else get_device()
    name = _LEGACY_TYPES.get(dtype)
    if name is not None and where.type == "cpu":
        return getattr(torch, name)
    if name is not None and where.type == "cuda" and hasattr(torch.cuda, name) and (
            where.index is None or where.index == torch.cuda.current_device()):
        return getattr(torch.cuda, name)
    return _TensorType(dtype, where)


class _TensorType:
    """A legacy-style tensor constructor on a device without legacy types."""

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
