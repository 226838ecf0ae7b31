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
  `len(loader)` says so); worker processes are turned off (num_workers=0: 2 cores, 2 ranks).
* torch.optim: after PRACTICE_MAX_STEPS optimizer steps (all optimizers counted together) the
  training pass ends and the next one ends the script with SystemExit(0), for scripts whose
  epochs or episodes are hard-coded. Every rank counts its own steps, so the ranks of a DDP run
  stop at the same step.
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

if ACTIVE:
    from gpumigrate.verify import shim

    shim.fake_data(TRAIN_SIZE, IMAGE_SIZE, CLASSES)
    shim.after_import("numpy", shim.numpy_aliases)
    shim.after_import("torch", lambda torch: shim.cap(MAX_STEPS, MAX_BATCHES))
