"""Fake data and short runs for bench/practice.py: makes real training scripts run offline, on a
CPU, on tiny data, without editing them. On PYTHONPATH of the practice runs only, and active
only with PRACTICE_SHIM=1 in the environment (bench/practice.py sets both).

What it does, from the outside, as each module is first imported:

* torchvision.datasets: MNIST (and FashionMNIST, KMNIST, EMNIST), CIFAR10/100, SVHN, STL10 get
  a replaced __init__ that never reads or downloads a file and fills the attributes the real
  __getitem__ reads (`data`, `targets`/`labels`, `classes`) with deterministic random images of
  the right shape, dtype and number of classes: PRACTICE_TRAIN_SIZE samples for a training
  split, PRACTICE_TEST_SIZE for any other. Subclasses (a CIFAR10 that returns two views) keep
  working. DatasetFolder/ImageFolder on a folder that does not exist (or is empty) gets
  PRACTICE_CLASSES classes of PRACTICE_IMAGE_SIZE-pixel random RGB images (a folder that
  exists is read as usual).
* torch.utils.data.DataLoader: each iteration stops after PRACTICE_MAX_BATCHES batches (and
  `len(loader)` says so); worker processes are turned off (num_workers=0: 2 cores, 2 ranks).
* torch.optim: the PRACTICE_MAX_STEPS+1-th optimizer step (all optimizers counted together)
  ends the script with SystemExit(0), for scripts whose epochs or episodes are hard-coded.
  Every rank counts its own steps, so the ranks of a DDP run stop at the same step.
* numpy: `np.bool8` again (numpy 2 removed it; gym 0.26, the last gym, still uses it).
* torch.hub: pretrained weights are never downloaded; `load_state_dict_from_url` returns a
  marker that `load_state_dict` accepts as "keep the random initialisation".

Each of these prints one line `[practice-shim] ...` to stderr the first time it acts.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys

ACTIVE = os.environ.get("PRACTICE_SHIM") == "1"
MAX_BATCHES = int(os.environ.get("PRACTICE_MAX_BATCHES", "4"))
MAX_STEPS = int(os.environ.get("PRACTICE_MAX_STEPS", "40"))
TRAIN_SIZE = int(os.environ.get("PRACTICE_TRAIN_SIZE", "256"))
TEST_SIZE = int(os.environ.get("PRACTICE_TEST_SIZE", "64"))
CLASSES = int(os.environ.get("PRACTICE_CLASSES", "10"))
IMAGE_SIZE = int(os.environ.get("PRACTICE_IMAGE_SIZE", "64"))

_said: set = set()


def say(key: str, text: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"[practice-shim] {text}", file=sys.stderr, flush=True)


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


# ---------------------------------------------------------------- torch

def _patch_torch(torch) -> None:
    from torch.utils.data import DataLoader

    original_init = DataLoader.__init__
    original_iter = DataLoader.__iter__
    original_len = DataLoader.__len__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if self.num_workers:
            say("workers", f"DataLoader num_workers={self.num_workers} -> 0")
            object.__setattr__(self, "num_workers", 0)

    class Capped:
        def __init__(self, it, cap):
            self._it, self._left = it, cap

        def __iter__(self):
            return self

        def __next__(self):
            if self._left <= 0:
                say("cap", f"DataLoader iteration capped at {MAX_BATCHES} batches (PRACTICE_MAX_BATCHES)")
                raise StopIteration
            self._left -= 1
            return next(self._it)

        next = __next__  # pre-1.0 scripts call it.next()

        def __len__(self):
            return min(len(self._it), self._left)

        def __getattr__(self, name):
            return getattr(self._it, name)

    def __iter__(self):
        return Capped(original_iter(self), MAX_BATCHES)

    def __len__(self):
        return min(original_len(self), MAX_BATCHES)

    DataLoader.__init__ = __init__
    DataLoader.__iter__ = __iter__
    DataLoader.__len__ = __len__

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    steps = [0]

    def cap_steps(optimizer, args, kwargs):
        if steps[0] >= MAX_STEPS:
            say("steps", f"stopping after {steps[0]} optimizer steps (PRACTICE_MAX_STEPS)")
            raise SystemExit(0)
        steps[0] += 1

    register_optimizer_step_pre_hook(cap_steps)

    class AnyStateDict(dict):
        """Stands for downloaded weights: load_state_dict keeps the module as it is."""

    def load_state_dict_from_url(url, *args, **kwargs):
        say("hub", f"not downloading {url}: random weights instead")
        return AnyStateDict()

    def download_url_to_file(url, dst, *args, **kwargs):
        raise OSError(f"[practice-shim] offline: not downloading {url}")

    import torch.hub

    torch.hub.load_state_dict_from_url = load_state_dict_from_url
    torch.hub.download_url_to_file = download_url_to_file
    zoo = sys.modules.get("torch.utils.model_zoo")
    if zoo is not None:
        zoo.load_url = load_state_dict_from_url

    original_load_state_dict = torch.nn.Module.load_state_dict

    def load_state_dict(self, state_dict, *args, **kwargs):
        if isinstance(state_dict, AnyStateDict):
            from torch.nn.modules.module import _IncompatibleKeys
            return _IncompatibleKeys([], [])
        return original_load_state_dict(self, state_dict, *args, **kwargs)

    torch.nn.Module.load_state_dict = load_state_dict


# ---------------------------------------------------------------- torchvision.datasets

def _is_train(train=None, split=None) -> bool:
    if split is not None:
        return "train" in str(split) or str(split) == "unlabeled"
    return bool(train) if train is not None else True


def _patch_datasets(datasets) -> None:
    import numpy as np
    import torch
    from torchvision.datasets.vision import VisionDataset

    def arrays(cls, train, shape, classes):
        n = TRAIN_SIZE if train else TEST_SIZE
        rng = np.random.default_rng(_seed(cls.__name__, train))
        data = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        return data, rng.integers(0, classes, n)

    def base(self, root, transform, target_transform):
        VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)

    def mnist_init(self, root, train=True, transform=None, target_transform=None, download=False, **kwargs):
        base(self, root, transform, target_transform)
        self.train = train
        classes = len(getattr(self, "classes", None) or range(10))
        if type(self).__name__ == "EMNIST":  # its classes depend on the split
            self.split = kwargs.get("split", "balanced")
            self.classes = self.classes_split_dict.get(self.split, self.classes_split_dict["balanced"])
            classes = len(self.classes)
        data, targets = arrays(type(self), train, (28, 28), classes)
        self.data, self.targets = torch.from_numpy(data), torch.from_numpy(targets).long()
        say("MNIST", f"{type(self).__name__}: {len(self.data)} fake samples")

    def cifar_init(self, root, train=True, transform=None, target_transform=None, download=False):
        base(self, root, transform, target_transform)
        self.train = train
        classes = 100 if isinstance(self, datasets.CIFAR100) else 10
        data, targets = arrays(type(self), train, (32, 32, 3), classes)
        self.data, self.targets = data, [int(t) for t in targets]
        self.classes = [f"class{i}" for i in range(classes)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        say("CIFAR", f"{type(self).__name__}: {len(self.data)} fake samples")

    def svhn_init(self, root, split="train", transform=None, target_transform=None, download=False):
        base(self, root, transform, target_transform)
        self.split = split
        self.data, self.labels = arrays(type(self), split == "train", (3, 32, 32), 10)
        say("SVHN", f"SVHN: {len(self.data)} fake samples")

    def stl10_init(self, root, split="train", folds=None, transform=None, target_transform=None, download=False):
        base(self, root, transform, target_transform)
        self.split, self.folds = split, folds
        self.data, self.labels = arrays(type(self), "train" in split or split == "unlabeled", (3, 96, 96), 10)
        if split == "unlabeled":
            self.labels = np.full(len(self.data), -1)
        self.classes = [f"class{i}" for i in range(10)]
        say("STL10", f"STL10: {len(self.data)} fake samples")

    datasets.MNIST.__init__ = mnist_init
    datasets.CIFAR10.__init__ = cifar_init  # CIFAR100 inherits it
    datasets.SVHN.__init__ = svhn_init
    datasets.STL10.__init__ = stl10_init

    folder_init = datasets.DatasetFolder.__init__

    def fake_loader(path):
        from PIL import Image
        rng = np.random.default_rng(_seed(path))
        return Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8), "RGB")

    def dataset_folder_init(self, root, loader=None, extensions=None, transform=None, target_transform=None,
                            is_valid_file=None, *args, **kwargs):
        real = os.path.isdir(root) and any(os.scandir(root))
        if real:
            return folder_init(self, root, loader, extensions, transform, target_transform, is_valid_file,
                               *args, **kwargs)
        base(self, root, transform, target_transform)
        train = "val" not in os.path.basename(os.path.normpath(str(root))).lower()
        n = TRAIN_SIZE if train else TEST_SIZE
        self.classes = [f"class{i}" for i in range(CLASSES)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(os.path.join(str(root), f"class{i % CLASSES}", f"{i}.png"), i % CLASSES) for i in range(n)]
        self.targets = [t for _, t in self.samples]
        self.imgs = self.samples
        self.loader = fake_loader
        self.extensions = extensions
        say(f"folder:{root}", f"{type(self).__name__}({root!r}): no such folder, {n} fake {IMAGE_SIZE}px images")

    datasets.DatasetFolder.__init__ = dataset_folder_init


# ---------------------------------------------------------------- numpy

def _patch_numpy(np) -> None:
    """Aliases numpy 2 removed that the last gym (0.26) still uses (np.bool8 in its checker)."""
    for alias, target in (("bool8", "bool_"),):
        if not hasattr(np, alias):
            setattr(np, alias, getattr(np, target))


# ---------------------------------------------------------------- post-import hooks

HOOKS = {"torch": _patch_torch, "torchvision.datasets": _patch_datasets, "numpy": _patch_numpy}


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.hook(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        hook = HOOKS.pop(name, None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, hook)
                return spec
        return None


if ACTIVE:
    sys.meta_path.insert(0, _Finder())
