"""Ranks that take different numbers of steps: which collective each rank is about to call,
agreed before it is called, and a rank that has finished taking part in the others' until
they finish too.

Data the migration does not shard (an environment's rollouts, batches drawn at random) can
make ranks reach the optimizer step a different number of times: a replay buffer that fills
a step later on one rank (`if len(memory) > 2000: train()`), episodes of different lengths
(`while not done: ... update()`). Without this, the rank that finishes first leaves the group
while another waits in an all_reduce, which then fails ("Connection closed by peer"), or a
barrier on one rank meets an all_reduce on another.

So every collective of the runtime (the gradient average, `barrier`, `broadcast_object`,
`reduce_sum`) is preceded by an exchange of one row per rank, (state, kind, key): what this
rank is about to do. Ranks still running must all want the same collective, else each of them
raises one error naming what every rank wanted (a rank stepping the first optimizer while
another steps the second is a program whose ranks disagree, not a hang to wait out). A rank
whose script has ended normally calls `finish()` from `cleanup_distributed`: it answers each
exchange as finished and takes part in the collective the others agreed on, with zeros for
an average or a sum (the average divides by the number of ranks still running, so those
ranks step on the mean of their own gradients, as one process on their batches would), until
every rank has finished. This is the protocol of torch's `Join` context (an all_reduce per
iteration that counts the ranks still running), kept in the runtime because here the
collectives are the runtime's own and no context manager has to be placed around a loop.

Only the runtime's collectives take part: a DistributedDataParallel model averages in C++
during backward, which a finished rank cannot shadow, so the migration does not DDP-wrap
models whose data it does not shard.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

AVERAGE, BARRIER, BROADCAST, REDUCE = 1, 2, 3, 4  # kinds of collective; key: below
_NAMES = {AVERAGE: "average the gradients of optimizer #{key}", BARRIER: "wait at a barrier",
          BROADCAST: "receive an object from rank {key}", REDUCE: "sum {key} values"}

# AVERAGE: the plan's key -> the (device, dtype, number of elements) of each flattened bucket,
# in order, as this rank last averaged it: what a finished rank contributes zeros as. Only
# metadata: a finished rank's optimizers may be gone with the function that made them.
_layouts: Dict[int, List[Tuple[torch.device, torch.dtype, int]]] = {}


def remember_layout(key: int, flats: Sequence[torch.Tensor]) -> None:
    _layouts[key] = [(f.device, f.dtype, f.numel()) for f in flats]


_BACKEND_DEVICES: Dict[str, Tuple[str, ...]] = {}  # backend name -> device types it takes


def _backend_devices() -> Tuple[str, ...]:
    """The device types the default group's backend reduces tensors on, in the order its name
    gives them ("cpu:gloo,cuda:nccl"; "nccl": cuda), parsed once per backend name."""
    backend = str(dist.get_backend())
    types = _BACKEND_DEVICES.get(backend)
    if types is None:
        capability = getattr(dist.Backend, "backend_capability", {"nccl": ["cuda"], "xccl": ["xpu"]})
        found: List[str] = []
        for part in backend.lower().split(","):
            part = part.strip()
            if ":" in part:  # "device:backend"
                found.append(part.split(":", 1)[0].strip())
            elif part:
                found.extend(capability.get(part, ["cpu"]))
        types = _BACKEND_DEVICES[backend] = tuple(dict.fromkeys(found))
    return types


def _collective_device() -> torch.device:
    """Where the tensors of a collective on the default group live: the CPU whenever the
    backend takes CPU tensors (gloo, mpi, ucc, or a "cpu:gloo,cuda:nccl" pair), else the
    current device of the one accelerator it supports (NCCL: this process's GPU)."""
    devices = _backend_devices()
    if not devices or "cpu" in devices:
        return torch.device("cpu")
    kind = devices[0]
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def _collective(flat: torch.Tensor, broadcast: bool = False, src: int = 0) -> None:
    """All-reduce (sum) or broadcast from rank `src` `flat` in place, on a device the backend takes."""
    here = flat if flat.device.type in _backend_devices() else flat.to(_collective_device())
    if broadcast:
        dist.broadcast(here, src=src)
    else:
        dist.all_reduce(here)
    if here is not flat:
        flat.copy_(here)


def _exchange(state: int, kind: int, key: int) -> List[Tuple[int, int, int]]:
    """Every rank's (state, kind, key), in rank order (an all_gather as one all_reduce)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.zeros(world, 3, dtype=torch.int64)
    rows[rank, 0], rows[rank, 1], rows[rank, 2] = state, kind, key
    _collective(rows)
    return [tuple(row) for row in rows.tolist()]  # type: ignore[misc]


def _describe(rows: Sequence[Tuple[int, int, int]]) -> str:
    return "; ".join(f"rank {r} " + (_NAMES.get(kind, "kind {kind}").format(key=key, kind=kind) if state else "has finished")
                     for r, (state, kind, key) in enumerate(rows))


def agree(kind: int, key: int) -> int:
    """Before a collective of the runtime on a running rank: the number of ranks still
    running (every one of which is about to call the same collective). Raises if the running
    ranks are about to call different ones."""
    rows = _exchange(1, kind, key)
    running = {(k, y) for state, k, y in rows if state}
    if len(running) > 1:
        raise RuntimeError("gpumigrate.runtime: the ranks are out of step (they took different numbers of steps "
                           f"or different branches): {_describe(rows)}")
    return sum(1 for state, _, _ in rows if state)


_shadows: Dict[int, Callable[[int], None]] = {}  # kind -> how a finished rank takes part (given the key)


def shadow(kind: int) -> Callable[[Callable[[int], None]], Callable[[int], None]]:
    def register(fn: Callable[[int], None]) -> Callable[[int], None]:
        _shadows[kind] = fn
        return fn

    return register


@shadow(AVERAGE)
def _shadow_average(key: int) -> None:
    layout = _layouts.get(key)
    if layout is None:
        raise RuntimeError(f"gpumigrate.runtime: a rank that has finished cannot take part in the average of "
                           f"optimizer #{key}, which it never stepped")
    for device, dtype, numel in layout:
        _collective(torch.zeros(numel, dtype=dtype, device=device))


@shadow(BARRIER)
def _shadow_barrier(key: int) -> None:
    dist.barrier()


@shadow(REDUCE)
def _shadow_reduce(numel: int) -> None:
    _collective(torch.zeros(numel, dtype=torch.float64))


# Run on every rank once all have finished, given a rank that finished last (and so took
# every step): brings this rank's training state to that rank's (distributed.py registers it).
_settlers: List[Callable[[int], None]] = []


def finish() -> Optional[int]:
    """On a rank whose script has ended normally: take part in the other ranks' collectives
    until every rank has finished. Returns how many collectives it took part in (None when
    there is no group of several processes)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    count = 0
    while True:
        rows = _exchange(0, 0, 0)
        running = {(k, y) for state, k, y in rows if state}
        if not running:
            break
        if len(running) > 1:
            raise RuntimeError("gpumigrate.runtime: the ranks still running are out of step: " + _describe(rows))
        kind, key = running.pop()
        _shadows[kind](key)
        count += 1
    # A rank that stepped with the others' mean gradients did not do what they did between the
    # average and the step (clip the averaged gradients, change the lr): where any rank took
    # part in others' collectives, every rank takes the state of the first that took part in none.
    counts = [state for state, _, _ in _exchange(count, 0, 0)]
    if any(counts):
        for settle in _settlers:
            settle(counts.index(0))
    return count
