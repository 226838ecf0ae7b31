"""What `shard_model` (FSDP2) saves against `wrap_model` (DDP) per rank: the bytes of the
parameters, gradients and optimizer state each rank holds after a few AdamW steps of a model
of repeated transformer-like blocks, once wrapped, once sharded. A DTensor counts its local
shard. Expect fsdp/ddp near 1/world (0.5 with 2 ranks); both are counted between steps (the
gathered parameters FSDP frees after each block, and DDP's gradient buckets, are not).
Prints one line per rank and model; asserts nothing. On a CPU (gloo):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/fsdp_memory.py

Options (defaults): --width 256 --blocks 8 --steps 2 --batch 8.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpumigrate.runtime import barrier, get_rank, get_world_size, setup_distributed, shard_model, wrap_model


class Block(nn.Module):
    """Pre-norm attention-sized and MLP-sized linear layers (12 * width**2 parameters)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        total += local.numel() * local.element_size()
    return total


def train(wrap: Callable[[nn.Module], nn.Module], args: argparse.Namespace) -> Dict[str, float]:
    torch.manual_seed(0)
    net = Net(args.width, args.blocks)
    count = sum(p.numel() for p in net.parameters())
    model = wrap(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(get_rank())
    start = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.batch, 16, 32, generator=generator)
        y = torch.randint(0, 10, (args.batch,), generator=generator)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    seconds = (time.perf_counter() - start) / args.steps
    params = list(model.parameters())
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(v for state in opt.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor)),
        "count": count,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    setup_distributed()
    if get_world_size() < 2:
        raise SystemExit("run it under torchrun with 2 or more processes (see the docstring)")
    ddp = train(wrap_model, args)
    fsdp = train(shard_model, args)
    mb = 1024 * 1024
    for rank in range(get_world_size()):
        if rank == get_rank():
            if rank == 0:
                print(f"{ddp['count'] / 1e6:.2f}M parameters, {args.blocks} blocks of width {args.width}, "
                      f"{get_world_size()} ranks, AdamW, {args.steps} steps; MiB per rank:", flush=True)
            for name, result in (("ddp", ddp), ("fsdp", fsdp)):
                total = result["params"] + result["grads"] + result["optimizer"]
                print(f"rank {rank} {name:<4}  params {result['params'] / mb:7.2f}  grads {result['grads'] / mb:7.2f}  "
                      f"optimizer {result['optimizer'] / mb:7.2f}  total {total / mb:7.2f}  "
                      f"({result['seconds'] * 1000:.0f} ms/step)", flush=True)
            ratios = [fsdp[k] / ddp[k] for k in ("params", "grads", "optimizer")]
            totals = [sum(r[k] for k in ("params", "grads", "optimizer")) for r in (fsdp, ddp)]
            print(f"rank {rank} fsdp/ddp  params {ratios[0]:.3f}  grads {ratios[1]:.3f}  optimizer {ratios[2]:.3f}  "
                  f"total {totals[0] / totals[1]:.3f}", flush=True)
        barrier()


if __name__ == "__main__":
    main()
