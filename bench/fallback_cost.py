"""What the runtime's gradient averaging (gpumigrate/runtime/averaging.py) costs per training
step, on CPU with 2 gloo ranks: a small MLP, a small CNN (with BatchNorm) and a deep narrow
MLP (200 small tensors) trained

  ddp       wrapped by `wrap_model` (DistributedDataParallel), the averaging hooks installed
            (what `setup_distributed()` leaves) but with nothing to average;
  fallback  not wrapped: gradients (and BatchNorm statistics) averaged at `optimizer.step()`;
  bare ddp  wrapped, hooks removed: DDP alone, as before the hooks existed;

measured in one run, interleaved (every repeat runs each variant in turn, so machine noise hits
all alike). Prints per-step medians and the ratios fallback/ddp and ddp/bare ddp, then the
hooks' own cost per step measured directly (the global pre-hook on a fully wrapped optimizer),
and what the first step of a fallback optimizer costs once (its plan: gc scan, broadcast).
Asserts nothing.

    python bench/fallback_cost.py [--steps 200] [--repeats 7]     # launches torchrun itself
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def relaunch() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.call(cmd, env=env))


if "RANK" not in os.environ:
    relaunch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gpumigrate.runtime import averaging, get_rank, setup_distributed, wrap_model  # noqa: E402


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


def deep() -> nn.Module:
    """Many small tensors (200): the per-tensor cost of each approach."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(99)], nn.Linear(32, 10))


SHAPES = {"mlp": (mlp, (64, 256)), "cnn": (cnn, (32, 3, 32, 32)), "deep": (deep, (16, 32))}


class Run:
    """One model + optimizer + fixed batch, stepped `steps` times per call."""

    def __init__(self, kind: str, wrapped: bool) -> None:
        make, shape = SHAPES[kind]
        torch.manual_seed(0)
        self.model = make()
        if wrapped:
            self.model = wrap_model(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(get_rank())
        self.x = torch.randn(*shape, generator=g)
        self.y = torch.randint(0, 10, (shape[0],), generator=g)
        start = time.perf_counter()
        self.steps(1)
        self.first = time.perf_counter() - start
        self.steps(5)  # warm up

    def steps(self, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            self.opt.zero_grad()
            F.cross_entropy(self.model(self.x), self.y).backward()
            self.opt.step()
        return (time.perf_counter() - start) / n


def hook_cost(run: Run, calls: int = 20000) -> float:
    """Seconds per call of the global pre-hook on `run`'s optimizer (nothing to average)."""
    start = time.perf_counter()
    for _ in range(calls):
        averaging._before_step(run.opt, (run.opt,), {})
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    setup_distributed()
    rank0 = get_rank() == 0
    if rank0:
        print(f"2 gloo ranks on CPU, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch {torch.__version__}, "
              f"{args.steps} steps x {args.repeats} repeats, interleaved")
        print("per-step medians over the repeats; ratios of medians, and of minimums (least disturbed by other load)")
        print(f"{'model':<5} {'ddp':>10} {'fallback':>10} {'bare ddp':>10}   {'fallback/ddp':>12} "
              f"{'ddp/bare':>9}   {'(min)':>6} {'(min)':>6}   spread (ddp)")
    for kind in SHAPES:
        runs = {"ddp": Run(kind, True), "fallback": Run(kind, False), "bare ddp": Run(kind, True)}
        times: dict = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                if name == "bare ddp":
                    averaging._uninstall_averaging()
                times[name].append(run.steps(args.steps))
                if name == "bare ddp":
                    averaging._install_averaging()
        med = {name: statistics.median(t) for name, t in times.items()}
        low = {name: min(t) for name, t in times.items()}
        spread = (max(times["ddp"]) - min(times["ddp"])) / med["ddp"]
        if rank0:
            us = {name: f"{m * 1e6:8.0f}us" for name, m in med.items()}
            print(f"{kind:<5} {us['ddp']} {us['fallback']} {us['bare ddp']}   "
                  f"{med['fallback'] / med['ddp']:12.3f} {med['ddp'] / med['bare ddp']:9.3f}   "
                  f"{low['fallback'] / low['ddp']:6.3f} {low['ddp'] / low['bare ddp']:6.3f}   {spread:.1%}")
        per_call = hook_cost(runs["ddp"])
        if rank0:
            print(f"      hooks on a fully wrapped optimizer: {per_call * 1e6:.2f} us per step "
                  f"({per_call / med['bare ddp']:.2%} of a step); first fallback step "
                  f"{runs['fallback'].first * 1e3:.0f} ms (plan: gc scan, broadcast), then "
                  f"{med['fallback'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
