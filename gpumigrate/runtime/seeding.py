"""Each rank its own random numbers from the first training step on.

Under torchrun every rank runs the same script with the same seed, so a model and its copies
(a target network, an EMA, fixed noise for samples) are made alike on every rank, as they
must be; from then on the ranks should draw differently (augmentation, dropout, random
batches, an environment's exploration), or they repeat one another's work. Accelerate's
`set_seed(..., device_specific=True)` is the precedent; here it happens once, at the first
training loop (`shard_batches`) or the first optimizer step, whichever comes first.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
import torch.distributed as dist

_parted = False  # once per process

_STEP = 0x9E3779B97F4A7C15  # odd: the ranks' seeds differ


def part_random_streams() -> None:
    """Reseed torch's (every device's), numpy's and Python's random streams per rank, once, in
    a group of several processes: each from one draw of its own stream plus the rank. A stream
    the script seeded alike on every rank stays reproducible for a given world size; one it
    did not seed was already different on every rank."""
    global _parted
    if _parted or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    _parted = True
    rank = dist.get_rank()

    def seed_of(draw: int) -> int:
        return (draw + _STEP * (rank + 1)) % (2 ** 63)

    torch.manual_seed(seed_of(int(torch.randint(0, 2 ** 62, (1,)).item())))
    random.seed(seed_of(random.getrandbits(62)))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed_of(int(numpy.random.randint(0, 2 ** 31 - 1))) % (2 ** 32))


def rank_seed(seed: Any) -> Any:
    """An environment's seed for this rank (`env.reset(seed=rank_seed(s))`): `seed * world_size
    + rank`, so ranks that seed each episode anew (`s += 1`) never play one another's episodes,
    as `s + rank` would one episode later. In one process the seed itself; None stays None."""
    if seed is None or not dist.is_available() or not dist.is_initialized():
        return seed
    return seed * dist.get_world_size() + dist.get_rank()
