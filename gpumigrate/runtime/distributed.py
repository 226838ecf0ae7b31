"""DistributedDataParallel without the boilerplate, correct in one process and under torchrun.

Every helper is a no-op (or the plain single-process behaviour) when the script was not
launched by torchrun or srun, so a rewritten script runs unchanged as `python train.py`.
None adds a synchronisation per training step; only `reduce_sum`/`reduce_mean`/`barrier`
communicate, and only when called.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from gpumigrate.runtime.device import get_device


class _Launch(NamedTuple):
    rank: int
    local_rank: int
    world_size: int


def _launch() -> Optional[_Launch]:
    """How this process was started: torchrun's variables, else SLURM's srun's."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]))
    # SLURM_STEP_NUM_TASKS is set inside an `srun` step; SLURM_NTASKS alone is also set for
    # a plain `python train.py` in an sbatch script, which is one process.
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise RuntimeError(
                "srun without torchrun: set MASTER_ADDR and MASTER_PORT, e.g. "
                "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500"
            )
        return _Launch(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_STEP_NUM_TASKS"]))
    return None


def is_distributed() -> bool:
    """True in a process group of more than one process.

    Raises if a launcher started several processes but `setup_distributed()` has not run
    yet: every rank would silently train on the whole dataset."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    launch = _launch()
    if launch is not None and launch.world_size > 1:
        raise RuntimeError("launched as one of several processes: call setup_distributed() before "
                           "building loaders or wrapping models")
    return False


def setup_distributed(use_accelerator: bool = True, backend: Optional[str] = None) -> torch.device:
    """Join the process group if launched by torchrun (any --nnodes) or srun; return this
    process's device.

    Each process binds its own GPU (`LOCAL_RANK`) before anything is allocated, so nothing
    lands on GPU 0 by accident. The backend is NCCL on CUDA, gloo otherwise. The group is
    destroyed at exit, also when training raises. Without a launcher this is `get_device()`.
    `use_accelerator=False` (a script's `--no-cuda`) keeps every process on the CPU.
    """
    launch = _launch()
    if launch is None or launch.world_size == 1:
        return get_device() if use_accelerator else torch.device("cpu")
    if use_accelerator and torch.cuda.is_available():
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")  # gloo works on CPU tensors; MPS has no collective backend
    if not dist.is_initialized():
        dist.init_process_group(
            backend or ("nccl" if device.type == "cuda" else "gloo"),
            init_method="env://",
            rank=launch.rank,
            world_size=launch.world_size,
        )
        atexit.register(cleanup_distributed)
    return device


def cleanup_distributed() -> None:
    """Leave the process group (safe to call twice, or without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, and in a single process: where printing and saving happen."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank; a no-op in one process. Never call it on rank 0 only."""
    if is_distributed():
        dist.barrier()


def wrap_model(
    model: nn.Module,
    *,
    find_unused_parameters: bool = False,
    sync_batchnorm: bool = False,
) -> nn.Module:
    """Wrap a model (already on its device) in DistributedDataParallel; unchanged in one process.

    `device_ids` is given only for a model on a single GPU; a model spread over several
    devices (model parallelism) or on the CPU is wrapped without it. `sync_batchnorm`
    converts BatchNorm layers to SyncBatchNorm (worth it for small per-GPU batches).
    """
    if not is_distributed() or isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    devices = {p.device for p in model.parameters()}
    if sync_batchnorm and all(d.type == "cuda" for d in devices):
        # SyncBatchNorm works on GPU modules only; on CPU (gloo) BatchNorm stays per process
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = None
    if len(devices) == 1:
        (only,) = devices
        if only.type == "cuda":
            device_ids = [only.index]
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, find_unused_parameters=find_unused_parameters
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside a DDP or DataParallel wrapper: reach custom attributes
    through it, and save its state_dict (no `module.` prefix)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


class _Shard(Sampler):
    """Every rank_th index, without padding: each sample is evaluated exactly once."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.indices = range(rank, len(dataset), world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def distributed_sampler(
    dataset: Dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True
) -> Optional[Sampler]:
    """The sampler a DataLoader needs to give each rank its own part of `dataset`.

    Training (`pad=True`): a DistributedSampler, which pads so every rank runs the same
    number of steps (call `set_epoch` each epoch for a new order; its order follows `seed`,
    the same on every rank, not `torch.manual_seed`). Evaluation (`pad=False`): a plain,
    unshuffled shard, so no sample is counted twice; shards differ in size by at most one,
    so sum the metrics with `reduce_sum` (a `reduce_mean` of per-rank means is biased).
    In one process: what `DataLoader(shuffle=...)` would use, so results do not change.
    """
    if not is_distributed():
        return RandomSampler(dataset) if shuffle else None
    if not pad:
        return _Shard(dataset, get_rank(), get_world_size())
    return DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s value of `obj` on every rank (a run directory from `tempfile.mkdtemp()`,
    a timestamp, a uuid): values that differ per process must agree before they name files.
    In one process it returns `obj`."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader's DistributedSampler the epoch, so each epoch has a new order."""
    sampler = getattr(loader, "sampler", loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        if hasattr(candidate, "set_epoch"):
            candidate.set_epoch(epoch)
            return


Number = Union[int, float, torch.Tensor]


def reduce_sum(*values: Number) -> Any:
    """Sum numbers or tensors over all ranks (one collective for all of them).

    Returns the same types it was given: one value for one argument, else a tuple.
    In one process it returns its arguments unchanged, without communicating."""
    if not is_distributed():
        return values[0] if len(values) == 1 else values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flat = [torch.as_tensor(v, dtype=torch.float64).detach().to(device).reshape(-1) for v in values]
    packed = torch.cat(flat)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    out, start = [], 0
    for value, part in zip(values, flat):
        chunk = packed[start:start + part.numel()]
        start += part.numel()
        out.append(_like(value, chunk))
    return out[0] if len(out) == 1 else tuple(out)


def reduce_mean(*values: Number) -> Any:
    """The mean over ranks of each value (for per-rank averages of equal-sized shards)."""
    summed = reduce_sum(*values)
    world = get_world_size()
    if world == 1:
        return summed
    parts: Sequence[Number] = summed if len(values) > 1 else (summed,)
    means = tuple(p / world for p in parts)
    return means[0] if len(means) == 1 else means


def _like(original: Number, chunk: torch.Tensor) -> Number:
    if isinstance(original, torch.Tensor):
        return chunk.reshape(original.shape).to(device=original.device, dtype=original.dtype)
    if isinstance(original, bool):
        return bool(chunk.item())
    if isinstance(original, int):
        return int(round(chunk.item()))
    return float(chunk.item())
