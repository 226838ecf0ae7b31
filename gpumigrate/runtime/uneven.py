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
`reduce_sum`) is preceded by an exchange of one row per rank, (state, kind, key, the optimizers
it has stepped): what this rank is about to do. Ranks still running want the same collective,
or one is ahead of another: it has left the optimizer the other still steps (a longer episode
there, or the script's next phase, a second agent trained after the first) and takes part in
those steps, as a finished rank does (below), until both want the same. Anything else (a rank
stepping a GAN's D while another steps its G, both having stepped both) is a program whose
ranks disagree: each raises one error naming what every rank wanted, not a hang to wait out. A
rank whose script has ended normally calls `finish()` from `cleanup_distributed`: it answers
each exchange as finished and takes part in the collective the others agreed on, with zeros for
an average or a sum (the average divides by the number of ranks still running, so those ranks
step on the mean of their own gradients, as one process on their batches would), until every
rank has finished. This is the protocol of torch's `Join` context (an all_reduce per iteration
that counts the ranks still running), kept in the runtime because here the collectives are the
runtime's own and no context manager has to be placed around a loop.

Only the runtime's collectives take part: a DistributedDataParallel model averages in C++
during backward, which a finished rank cannot shadow, so the migration does not DDP-wrap
models whose data it does not shard.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

AVERAGE, BARRIER, BROADCAST, REDUCE, PARAMS = 1, 2, 3, 4, 5  # kinds of collective; key: below
_NAMES = {AVERAGE: "average the gradients of optimizer #{key}", BARRIER: "wait at a barrier",
          BROADCAST: "receive an object from rank {key}", REDUCE: "sum {key} values",
          PARAMS: "take rank 0's parameters of optimizer #{key} at its first step"}

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


def _exchange(state: int, kind: int, key: int) -> List[Tuple[int, int, int, int]]:
    """Every rank's (state, kind, key, stepped), in rank order (an all_gather as one
    all_reduce); `stepped`: a bit per optimizer this rank has averaged (its number < 63)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.zeros(world, 4, dtype=torch.int64)
    rows[rank, 0], rows[rank, 1], rows[rank, 2] = state, kind, key
    rows[rank, 3] = sum(1 << k for k in _layouts if 0 <= k < 63)
    _collective(rows)
    return [tuple(row) for row in rows.tolist()]  # type: ignore[misc]


def _describe(rows: Sequence[Tuple[int, ...]]) -> str:
    return "; ".join(f"rank {r} " + (_NAMES.get(kind, "kind {kind}").format(key=key, kind=kind) if state else "has finished")
                     for r, (state, kind, key, *_) in enumerate(rows))


def _behind(rows: Sequence[Tuple[int, ...]]) -> Optional[int]:
    """Where the running ranks want different collectives: the optimizer whose average some
    want while every other running rank has averaged it before and moved on (to the next
    optimizer of the script, a barrier, a sum), and whose ranks have averaged none of the
    optimizers the others want (else it is no order of phases: a GAN's D step on one rank and
    G step on another). None where there is no such one optimizer."""
    running = [(kind, key, stepped) for state, kind, key, stepped in rows if state]
    wanted = {key for kind, key, _ in running if kind == AVERAGE and 0 <= key < 63}
    found = [b for b in wanted
             if all(stepped >> b & 1 for kind, key, stepped in running if (kind, key) != (AVERAGE, b))
             and not any(stepped >> k & 1 for kind, key, stepped in running if (kind, key) == (AVERAGE, b)
                         for k in wanted - {b})]
    return found[0] if len(found) == 1 else None


def agree(kind: int, key: int) -> int:
    """Before a collective of the runtime on a running rank: the number of ranks still
    running that are about to call it with this one. Where the running ranks want different
    ones, a rank ahead of another (it has left the optimizer the other still steps: the next
    phase of the script, or the end of an episode) takes part in the other's steps, as a
    finished rank does, until they want the same; otherwise it raises, naming what each wants."""
    global _ahead
    while True:
        rows = _exchange(1, kind, key)
        running = {(k, y) for state, k, y, _ in rows if state}
        if len(running) == 1:
            return sum(1 for state, *_ in rows if state)
        behind = _behind(rows)
        if behind is None:
            raise RuntimeError("gpumigrate.runtime: the ranks are out of step (they took different numbers of steps "
                               f"or different branches): {_describe(rows)}")
        if (kind, key) == (AVERAGE, behind):
            return sum(1 for state, k, y, _ in rows if state and (k, y) == (AVERAGE, behind))
        _shadows[AVERAGE](behind)
        _ahead += 1


_ahead = 0  # collectives this rank took part in for ranks behind it (finish settles after them too)


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
        running = {(k, y) for state, k, y, _ in rows if state}
        if not running:
            break
        if len(running) > 1:
            raise RuntimeError("gpumigrate.runtime: the ranks still running are out of step: " + _describe(rows))
        kind, key = running.pop()
        _shadows[kind](key)
        count += 1
    # A rank that stepped with the others' mean gradients did not do what they did between the
    # average and the step (clip the averaged gradients, change the lr): where any rank took
    # part in others' collectives, every rank takes the state of the first that took part in
    # the fewest (none, unless each was ahead of another once).
    counts = [state for state, *_ in _exchange(count + _ahead, 0, 0)]
    if any(counts):
        for settle in _settlers:
            settle(counts.index(min(counts)))
    return count
