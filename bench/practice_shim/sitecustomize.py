"""Fake data and short runs for bench/practice.py: makes real training scripts run offline, on a
CPU, on tiny data, without editing them. On PYTHONPATH of the practice runs only, and active
only with PRACTICE_SHIM=1 in the environment (bench/practice.py sets both).

It is gpumigrate verify's shim (gpumigrate/verify/shim.py) with the practice runs' sizes. What
it does, from the outside, as each module is first imported:

* torchvision.datasets: MNIST (and FashionMNIST, KMNIST, EMNIST), CIFAR10/100, SVHN, STL10 get
  a replaced __init__ that never reads or downloads a file and fills the attributes the real
  __getitem__ reads (`data`, `targets`/`labels`, `classes`) with deterministic random images of
  the right shape, dtype and number of classes: PRACTICE_TRAIN_SIZE samples for a training
  split, a quarter of that for any other. Subclasses (a CIFAR10 that returns two views) keep
  working. DatasetFolder/ImageFolder on a folder that does not exist (or is empty) gets
  PRACTICE_CLASSES classes of PRACTICE_IMAGE_SIZE-pixel random RGB images (a folder that
  exists is read as usual).
* torch.utils.data.DataLoader: each iteration stops after PRACTICE_MAX_BATCHES batches (and
  `len(loader)` says so), a pass over part of the dataset (a rank's shard, a subset) after that
  part of them, so a sharded pass is as much shorter as it would be uncapped; worker processes are turned off (num_workers=0: 2 cores, 2 ranks).
* torch.optim: after PRACTICE_MAX_STEPS optimizer steps (all optimizers counted together) the
  training pass ends and the next one ends the script with SystemExit(0), for scripts whose
  epochs or episodes are hard-coded. Every rank counts its own steps, so the ranks of a DDP run
  stop at the same step.
* range: a `for ... in range(...)` header line in a file under PRACTICE_ROOT (the scratch copy of
  the entry) whose range has more than PRACTICE_MAX_RANGE items (default 12; 0: off) takes its
  first PRACTICE_MAX_RANGE, so hard-coded epochs, episodes and iterations end by themselves
  and a run's optimizer steps can be compared with another's (the work split of a data-parallel
  run without a DataLoader is its steps). Comprehensions, `while` loops and ranges built on
  other lines keep their length.
* numpy: `np.bool8` again (numpy 2 removed it; gym 0.26, the last gym, still uses it).
* torch.hub: pretrained weights are never downloaded; `load_state_dict_from_url` returns a
  marker that `load_state_dict` accepts as "keep the random initialisation".

Each of these prints one line `[verify] ...` to stderr the first time it acts.
"""

from __future__ import annotations

import os

ACTIVE = os.environ.get("PRACTICE_SHIM") == "1"
MAX_BATCHES = int(os.environ.get("PRACTICE_MAX_BATCHES", "4"))
MAX_STEPS = int(os.environ.get("PRACTICE_MAX_STEPS", "40"))
TRAIN_SIZE = int(os.environ.get("PRACTICE_TRAIN_SIZE", "256"))  # other splits: a quarter
CLASSES = int(os.environ.get("PRACTICE_CLASSES", "10"))
IMAGE_SIZE = int(os.environ.get("PRACTICE_IMAGE_SIZE", "64"))
MAX_RANGE = int(os.environ.get("PRACTICE_MAX_RANGE", "12"))
PROJECT = os.environ.get("PRACTICE_ROOT", "")


def _cap_loop_ranges(limit: int, root: str) -> None:
    """builtins.range as a class whose calls from a `for` header in the entry's own files give a
    range of at most `limit` items; isinstance(x, range) and everything else stay as they were."""
    import builtins
    import linecache
    import re
    import sys

    real = builtins.range
    header = re.compile(r"^\s*(async\s+)?for\s.*\sin\s")
    root = os.path.realpath(root) + os.sep
    said = set()

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, real)

        def __call__(cls, *args):
            r = real(*args)
            if len(r) <= limit:
                return r
            frame = sys._getframe(1)
            path = frame.f_code.co_filename
            if not os.path.realpath(path).startswith(root) or not header.match(linecache.getline(path, frame.f_lineno)):
                return r
            key = (path, frame.f_lineno)
            if key not in said:
                said.add(key)
                print(f"[verify] range of {len(r)} at {os.path.basename(path)}:{frame.f_lineno} capped at {limit} items",
                      file=sys.stderr, flush=True)
            return r[:limit]

    class range(metaclass=_Meta):  # noqa: A001  (the name scripts see)
        pass

    builtins.range = range

if ACTIVE:
    from gpumigrate.verify import shim

    shim.fake_data(TRAIN_SIZE, IMAGE_SIZE, CLASSES)
    shim.after_import("numpy", shim.numpy_aliases)
    shim.after_import("torch", lambda torch: shim.cap(MAX_STEPS, MAX_BATCHES, proportional=True))
    if MAX_RANGE > 0 and PROJECT:
        _cap_loop_ranges(MAX_RANGE, PROJECT)
