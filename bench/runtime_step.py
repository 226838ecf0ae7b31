"""What the runtime costs per training step: a step as the migrations write it (runtime
helpers) against the same step written by hand with torch alone, measured in one run,
interleaved so that machine noise hits both alike. Prints the ratios; asserts nothing.

    python bench/runtime_step.py [--steps 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from gpumigrate.runtime import autocast, get_device, grad_scaler, set_epoch, unwrap_model, wrap_model


def model_and_data(device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), x, y


def by_hand(device: torch.device, steps: int, amp: bool) -> float:
    model, opt, x, y = model_and_data(device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp and device.type == "cuda")
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return (time.perf_counter() - start) / steps


def migrated(device: torch.device, steps: int, amp: bool) -> float:
    model, opt, x, y = model_and_data(device)
    model = wrap_model(model)  # one process: the model itself
    scaler = grad_scaler()
    start = time.perf_counter()
    for step in range(steps):
        set_epoch(None, step)  # a no-op for a loader without a DistributedSampler
        opt.zero_grad()
        with autocast(model, enabled=amp):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    unwrap_model(model)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = get_device()
    print(f"device {device}, {args.steps} steps x {args.repeats} repeats, interleaved")
    for amp in (False, True):
        hand, ours = [], []
        for _ in range(args.repeats):
            hand.append(by_hand(device, args.steps, amp))
            ours.append(migrated(device, args.steps, amp))
        h, o = statistics.median(hand), statistics.median(ours)
        spread = (max(hand) - min(hand)) / h
        label = "mixed precision" if amp else "full precision"
        print(f"{label:<16} by hand {h * 1e6:8.1f} us/step  migrated {o * 1e6:8.1f} us/step  "
              f"ratio {o / h:.3f}  (by hand's own spread {spread:.1%})")


if __name__ == "__main__":
    main()
