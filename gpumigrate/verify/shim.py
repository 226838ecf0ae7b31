"""What a verify run changes around a script, from the outside, so that it runs briefly,
offline, deterministically and on a CPU, without a byte of the script edited.

* `seed`: Python's, torch's and numpy's generators seeded (and gym's environments), the
  kernels' deterministic algorithms, one thread.
* `cap`: at most `steps` optimizer steps (all optimizers counted together): then the training
  pass ends, its evaluation runs, and the next training pass ends the script with
  SystemExit(0), as a script whose epochs are hard-coded needs; and at most `batches` batches
  per pass over a DataLoader, so epochs end and evaluation and checkpoints run. A loader that reads in order (evaluation) takes the samples of its first `batches`
  batches instead, so the ranks of an evaluation sharded under DDP see, together, exactly the
  samples one process sees.
* `fake_data`: torchvision datasets (MNIST and its kin, CIFAR10/100, SVHN, STL10, and an
  ImageFolder whose folder does not exist) become deterministic random data of the same
  shapes and classes: `samples` training samples, a quarter of that for the other splits; no
  pretrained weights are downloaded (the module keeps its random initialisation).
* `emulate` (the original script only): the torch it was written for, on a CPU. `.cuda()`
  and `.to("cuda")` stay on the CPU, `torch.cuda.*Tensor` are the CPU types,
  `torch.cuda.set_device`/`synchronize` do nothing, a 0-dim tensor indexed with `[0]` is
  itself and `type(x) == Variable` holds for a tensor (PyTorch < 0.4), and `torch.load`
  unpickles as before 2.6 (`weights_only=False`); at level 2 (tried where level 1 fails),
  `torch.full` with an integer fill makes a float tensor, as before 1.7.
* where NVIDIA apex is not installed (both runs), its amp passes through in float32.

Each of these says what it did, once, on stderr, as a line starting `[verify]`.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import math
import os
import random
import sys
from typing import Any, Callable, Dict, Optional

_said: set = set()


def say(key: str, text: str) -> None:
    if key not in _said:
        _said.add(key)
        print(f"[verify] {text}", file=sys.stderr, flush=True)


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


# ---------------------------------------------------------------- seeds

def seed_everything(seed: int) -> None:
    import torch
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    # torch.use_deterministic_algorithms also sets inductor's flag, importing torch._dynamo:
    # 1.4 s per run. The kernels' switch alone (a script that compiles keeps inductor's default).
    set_deterministic = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_deterministic is not None:
        set_deterministic(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)
    after_import("numpy", lambda np: np.random.seed(seed))
    for gym in ("gym.utils.seeding", "gymnasium.utils.seeding"):
        after_import(gym, _seeded_environments(seed))
    _seeded_shuffles(seed)


def _seeded_shuffles(seed: int) -> None:
    """A RandomSampler without a generator of its own draws each pass from a generator seeded
    by (seed, its dataset's type and length, the pass), not from the global RNG: runs whose
    training drew other random numbers, or made other samplers (one process against rank 0
    of a DDP run), still shuffle an evaluation set alike."""
    import torch
    from torch.utils.data import RandomSampler

    original_init, original_iter = RandomSampler.__init__, RandomSampler.__iter__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._verify_passes, self._verify_own = 0, self.generator is None

    def __iter__(self: Any) -> Any:
        if getattr(self, "_verify_own", False):
            source = self.data_source
            self.generator = torch.Generator().manual_seed(
                _seed_of(seed, type(source).__name__, len(source), self._verify_passes))
            self._verify_passes += 1
        return original_iter(self)

    RandomSampler.__init__ = __init__
    RandomSampler.__iter__ = __iter__


def _seeded_environments(seed: int) -> Callable[[Any], None]:
    """An environment or action space that draws its own seed from the OS (gym, gymnasium)
    gets `seed` instead: episodes repeat from run to run."""
    def patch(seeding: Any) -> None:
        original = seeding.np_random

        def np_random(seed_: Any = None) -> Any:
            return original(seed if seed_ is None else seed_)

        seeding.np_random = np_random

    return patch


# ---------------------------------------------------------------- caps

class StepCap:
    """Counts optimizer steps. Once `limit` are taken, a shuffled (training) loader ends its
    pass, so the evaluation after it runs, and the next training pass ends the script; a step
    past `limit` anywhere else (a script without a DataLoader) ends it at once."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit, self.taken = limit, 0

    @property
    def spent(self) -> bool:
        return self.limit is not None and self.taken >= self.limit

    def stop(self) -> None:
        say("steps", f"stopped after {self.taken} optimizer steps (--steps)")
        raise SystemExit(0)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.spent:
            self.stop()
        self.taken += 1


STEPS = StepCap(None)


def _in_order(sampler: Any) -> bool:
    """Does `sampler` read its dataset in order (evaluation), alone or as one rank's shard?"""
    from torch.utils.data import SequentialSampler
    from torch.utils.data.distributed import DistributedSampler
    if isinstance(sampler, DistributedSampler):
        return not sampler.shuffle
    return type(sampler) is SequentialSampler or type(sampler).__name__ == "_Shard"


def _share(loader: Any) -> float:
    """The part of its dataset one pass over `loader` reads (a rank's shard: 1/N; a subset)."""
    try:
        return min(1.0, len(loader.batch_sampler.sampler) / len(loader.dataset))
    except Exception:  # unsized, or no batch sampler
        return 1.0


def cap(steps: Optional[int], batches: Optional[int], proportional: bool = False) -> None:
    """`proportional`: a pass over a loader that reads part of its dataset (a rank's shard, a
    subset) stops after that part of `batches` (at least one), so that a sharded run's passes
    are as much shorter than one process's as they are uncapped."""
    from torch.utils.data import BatchSampler, DataLoader

    if steps is not None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        STEPS.limit = steps
        register_optimizer_step_pre_hook(STEPS)
    if batches is None:
        return
    original_iter, original_len = DataLoader.__iter__, DataLoader.__len__
    original_batches = BatchSampler.__iter__

    class Capped:
        def __init__(self, it: Any, left: int) -> None:
            self._it, self._left = it, left

        def __iter__(self) -> "Capped":
            return self

        def __next__(self) -> Any:
            if STEPS.spent:
                raise StopIteration
            if self._left <= 0:
                say("batches", f"each pass over a DataLoader stops after {batches} batches (--batches)")
                raise StopIteration
            self._left -= 1
            return next(self._it)

        next = __next__  # pre-1.0 scripts call it.next()

        def __len__(self) -> int:
            return min(len(self._it), self._left)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._it, name)

    def in_order_limit(loader: Any) -> Optional[int]:
        """A loader that reads in order takes the samples below batches x batch_size: in one
        process its first batches, in a shard of N ranks every rank's part of the same ones."""
        batcher = getattr(loader, "batch_sampler", None)
        if type(batcher) is BatchSampler and _in_order(batcher.sampler):
            return batches * batcher.batch_size
        return None

    def __iter__(self: Any) -> Any:
        limit = in_order_limit(self)
        if limit is not None:
            self.batch_sampler._verify_limit = limit
            return original_iter(self)
        if STEPS.spent:
            STEPS.stop()
        return Capped(original_iter(self), max(1, math.ceil(batches * _share(self))) if proportional else batches)

    def __len__(self: Any) -> int:
        limit = in_order_limit(self)
        if limit is not None:
            own = getattr(self.batch_sampler.sampler, "num_replicas", None) or \
                getattr(getattr(self.batch_sampler.sampler, "indices", None), "step", 1)
            return min(original_len(self), math.ceil(limit / own / self.batch_sampler.batch_size))
        return min(original_len(self), max(1, math.ceil(batches * _share(self))) if proportional else batches)

    def batch_iter(self: Any) -> Any:
        limit = getattr(self, "_verify_limit", None)
        if limit is None:
            yield from original_batches(self)
            return
        say("in-order", f"a DataLoader that reads in order takes its first {batches} batches' samples (--batches)")
        batch: list = []
        for index in self.sampler:  # every index: padding duplicates stay, as in a full pass
            if index < limit:
                batch.append(index)
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
        if batch and not self.drop_last:
            yield batch

    DataLoader.__iter__ = __iter__
    DataLoader.__len__ = __len__
    BatchSampler.__iter__ = batch_iter
    original_init = DataLoader.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.num_workers:  # workers would each import and seed anew: in process, deterministic
            say("workers", f"DataLoader num_workers={self.num_workers} -> 0")
            object.__setattr__(self, "num_workers", 0)
            object.__setattr__(self, "persistent_workers", False)
            object.__setattr__(self, "prefetch_factor", None)

    DataLoader.__init__ = __init__


# ---------------------------------------------------------------- fake data

def fake_data(samples: int, image_size: int = 64, classes: int = 10) -> None:
    after_import("torch", lambda torch: _offline_hub())
    test_size = max(8, samples // 4)
    after_import("torchvision.datasets", lambda datasets: _patch_datasets(datasets, samples, test_size,
                                                                          image_size, classes))


def _offline_hub() -> None:
    import torch
    import torch.hub

    class AnyStateDict(dict):
        """Stands for downloaded weights: load_state_dict keeps the module as it is."""

    def load_state_dict_from_url(url: str, *args: Any, **kwargs: Any) -> AnyStateDict:
        say("hub", f"not downloading {url}: random weights instead")
        return AnyStateDict()

    def download_url_to_file(url: str, dst: str, *args: Any, **kwargs: Any) -> None:
        raise OSError(f"verify runs offline: not downloading {url} (use --data real with the file in place)")

    torch.hub.load_state_dict_from_url = load_state_dict_from_url
    torch.hub.download_url_to_file = download_url_to_file
    after_import("torch.utils.model_zoo", lambda zoo: setattr(zoo, "load_url", load_state_dict_from_url))
    original_load_state_dict = torch.nn.Module.load_state_dict

    def load_state_dict(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_dict, AnyStateDict):
            from torch.nn.modules.module import _IncompatibleKeys
            return _IncompatibleKeys([], [])
        return original_load_state_dict(self, state_dict, *args, **kwargs)

    torch.nn.Module.load_state_dict = load_state_dict


def _is_train(train: Any = None, split: Any = None) -> bool:
    if split is not None:
        return "train" in str(split) or str(split) == "unlabeled"
    return bool(train) if train is not None else True


def _patch_datasets(datasets: Any, train_size: int, test_size: int, image_size: int, classes_: int) -> None:
    import torch
    from torchvision.datasets.vision import VisionDataset

    def arrays(cls: type, train: bool, shape: tuple, classes: int) -> tuple:
        n = train_size if train else test_size
        gen = torch.Generator().manual_seed(_seed_of(cls.__name__, train))
        data = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen)
        return data, torch.randint(0, classes, (n,), generator=gen)

    def base(self: Any, root: Any, transform: Any, target_transform: Any) -> None:
        VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)

    def mnist_init(self: Any, root: Any, train: bool = True, transform: Any = None, target_transform: Any = None,
                   download: bool = False, **kwargs: Any) -> None:
        base(self, root, transform, target_transform)
        self.train = train
        classes = len(getattr(self, "classes", None) or range(10))
        if type(self).__name__ == "EMNIST":  # its classes depend on the split
            self.split = kwargs.get("split", "balanced")
            self.classes = self.classes_split_dict.get(self.split, self.classes_split_dict["balanced"])
            classes = len(self.classes)
        self.data, targets = arrays(type(self), train, (28, 28), classes)
        self.targets = targets.long()
        say("MNIST", f"{type(self).__name__}: {len(self.data)} fake samples (--data fake)")

    def cifar_init(self: Any, root: Any, train: bool = True, transform: Any = None, target_transform: Any = None,
                   download: bool = False) -> None:
        base(self, root, transform, target_transform)
        self.train = train
        classes = 100 if isinstance(self, datasets.CIFAR100) else 10
        data, targets = arrays(type(self), train, (32, 32, 3), classes)
        self.data, self.targets = data.numpy(), [int(t) for t in targets]
        self.classes = [f"class{i}" for i in range(classes)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        say("CIFAR", f"{type(self).__name__}: {len(self.data)} fake samples (--data fake)")

    def svhn_init(self: Any, root: Any, split: str = "train", transform: Any = None, target_transform: Any = None,
                  download: bool = False) -> None:
        base(self, root, transform, target_transform)
        self.split = split
        data, labels = arrays(type(self), split == "train", (3, 32, 32), 10)
        self.data, self.labels = data.numpy(), labels.numpy()
        say("SVHN", f"SVHN: {len(self.data)} fake samples (--data fake)")

    def stl10_init(self: Any, root: Any, split: str = "train", folds: Any = None, transform: Any = None,
                   target_transform: Any = None, download: bool = False) -> None:
        base(self, root, transform, target_transform)
        self.split, self.folds = split, folds
        data, labels = arrays(type(self), _is_train(split=split), (3, 96, 96), 10)
        self.data, self.labels = data.numpy(), (labels if split != "unlabeled" else torch.full_like(labels, -1)).numpy()
        self.classes = [f"class{i}" for i in range(10)]
        say("STL10", f"STL10: {len(self.data)} fake samples (--data fake)")

    datasets.MNIST.__init__ = mnist_init
    datasets.CIFAR10.__init__ = cifar_init  # CIFAR100 inherits it
    datasets.SVHN.__init__ = svhn_init
    datasets.STL10.__init__ = stl10_init
    folder_init = datasets.DatasetFolder.__init__

    def fake_loader(path: str) -> Any:
        from PIL import Image
        gen = torch.Generator().manual_seed(_seed_of(path))
        pixels = torch.randint(0, 256, (image_size, image_size, 3), dtype=torch.uint8, generator=gen)
        return Image.frombytes("RGB", (image_size, image_size), bytes(pixels.reshape(-1).tolist()))

    def dataset_folder_init(self: Any, root: Any, loader: Any = None, extensions: Any = None, transform: Any = None,
                            target_transform: Any = None, is_valid_file: Any = None, *args: Any, **kwargs: Any) -> None:
        if os.path.isdir(root) and any(os.scandir(root)):
            return folder_init(self, root, loader, extensions, transform, target_transform, is_valid_file,
                               *args, **kwargs)
        base(self, root, transform, target_transform)
        train = "val" not in os.path.basename(os.path.normpath(str(root))).lower()
        n = train_size if train else test_size
        self.classes = [f"class{i}" for i in range(classes_)]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(os.path.join(str(root), f"class{i % classes_}", f"{i}.png"), i % classes_) for i in range(n)]
        self.targets = [t for _, t in self.samples]
        self.imgs = self.samples
        self.loader = fake_loader
        self.extensions = extensions
        say(f"folder:{root}", f"{type(self).__name__}({root!r}): no such folder, {n} fake {image_size}px images")

    datasets.DatasetFolder.__init__ = dataset_folder_init


# ---------------------------------------------------------------- the original's torch, on a CPU

def emulate_old_torch(level: int = 1) -> None:
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(device: Any) -> Any:
        if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"):
            say("cuda", "the original's CUDA tensors stay on the CPU")
            return torch.device("cpu")
        return device

    tensor_cuda, tensor_getitem, tensor_type = torch.Tensor.cuda, torch.Tensor.__getitem__, torch.Tensor.type
    torch_full = torch.full

    class OldTorch(TorchFunctionMode):
        def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is tensor_cuda:
                return args[0]
            if func is tensor_getitem and args[0].dim() == 0 and args[1:] == (0,):
                say("0-dim", "a 0-dim tensor indexed with [0] is itself, as in PyTorch < 0.4")
                return args[0]
            if func is tensor_type and len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if level > 1 and func is torch_full and "dtype" not in kwargs and len(args) > 1 \
                    and isinstance(args[1], (int, bool)):
                say("full", "torch.full with an integer fill makes a float tensor, as before PyTorch 1.7")
                kwargs["dtype"] = torch.get_default_dtype()
            if getattr(func, "__name__", "") == "to":
                args = tuple(cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
            return func(*args, **kwargs)

    OldTorch().__enter__()  # for the whole run
    for name in ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                 "ShortTensor", "IntTensor", "LongTensor", "BoolTensor"):
        setattr(torch.cuda, name, getattr(torch, name))
    for name in ("set_device", "synchronize", "manual_seed", "manual_seed_all", "empty_cache", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *args, **kwargs: None)
    torch.cuda.current_device = lambda: 0
    original_module_to = torch.nn.Module.to

    def module_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(cpu(a) if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = cpu(kwargs["device"])
        return original_module_to(self, *args, **kwargs)

    torch.nn.Module.to = module_to
    torch.nn.Module.cuda = lambda self, device=None: self
    original_load = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("weights_only", False)
        if "map_location" not in kwargs and len(args) < 1:
            kwargs["map_location"] = "cpu"
        return original_load(f, *args, **kwargs)

    torch.load = load
    _old_variable(torch)


def _float32_apex() -> None:
    """Where NVIDIA apex is not installed, the parts of it training scripts use, in float32
    (there is no float16 training on a CPU): `amp.initialize` returns what it is given,
    `amp.scale_loss` yields the loss, `amp.master_params` the optimizer's parameters, the amp
    state is empty; `apex.parallel` has torch's DistributedDataParallel and SyncBatchNorm."""
    import contextlib
    import importlib.util
    import types

    import torch

    if importlib.util.find_spec("apex") is not None:
        return
    apex, amp, parallel = (types.ModuleType(n) for n in ("apex", "apex.amp", "apex.parallel"))

    def initialize(models: Any, optimizers: Any = None, *args: Any, **kwargs: Any) -> Any:
        say("apex", "apex is not installed: its amp runs in float32 (initialize and scale_loss pass through)")
        return models if optimizers is None else (models, optimizers)

    @contextlib.contextmanager
    def scale_loss(loss: Any, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        yield loss

    def master_params(optimizer: Any) -> Any:
        for group in optimizer.param_groups:
            yield from group["params"]

    amp.initialize, amp.scale_loss, amp.master_params = initialize, scale_loss, master_params
    amp.state_dict, amp.load_state_dict = (lambda: {}), (lambda state: None)

    class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module: Any, *args: Any, delay_allreduce: bool = False, **kwargs: Any) -> None:
            super().__init__(module)

    parallel.DistributedDataParallel = DistributedDataParallel
    parallel.convert_syncbn_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm
    parallel.SyncBatchNorm = torch.nn.SyncBatchNorm
    apex.amp, apex.parallel = amp, parallel
    sys.modules.update({"apex": apex, "apex.amp": amp, "apex.parallel": parallel})


def _old_variable(torch: Any) -> None:
    """`Variable` as its own type again: `type(h) == Variable` (word_language_model's
    repackage_hidden) is true for a tensor, as it was for a Variable before PyTorch 0.4."""
    import torch.autograd
    import torch.autograd.variable
    modern = torch.autograd.Variable

    class OldVariableMeta(type):
        def __eq__(cls, other: Any) -> bool:
            return other is cls or (isinstance(other, type) and issubclass(other, torch.Tensor))

        def __hash__(cls) -> int:
            return id(cls)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, torch.Tensor)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return modern(*args, **kwargs)

        def __getattr__(cls, name: str) -> Any:  # Variable._execution_engine (torch.utils.checkpoint)
            return getattr(modern, name)

    class Variable(metaclass=OldVariableMeta):
        pass

    torch.autograd.Variable = Variable
    torch.autograd.variable.Variable = Variable


# ---------------------------------------------------------------- post-import hooks

_HOOKS: Dict[str, list] = {}


def after_import(name: str, hook: Callable[[Any], None]) -> None:
    """`hook(module)` once `name` is imported (now, if it already is)."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _HOOKS.setdefault(name, []).append(hook)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, hooks: list) -> None:
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        for hook in self.hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hooks = _HOOKS.pop(name, None)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, hooks)
                return spec
        return None


def numpy_aliases(np: Any) -> None:
    """Aliases numpy 2 removed that libraries still in use call (gym 0.26's np.bool8)."""
    if not hasattr(np, "bool8"):
        np.bool8 = np.bool_


def install(config: Dict[str, Any]) -> None:
    """Everything `config` (the verify run's settings) asks for."""
    after_import("numpy", numpy_aliases)
    _float32_apex()  # both runs: an environment without apex, not an older torch
    if config.get("seed") is not None:
        # rank r draws from seed + r, as an unseeded script's ranks draw apart under torchrun;
        # rank 0 draws what one process draws (what a script seeds itself stays its own)
        seed_everything(int(config["seed"]) + int(os.environ.get("RANK", 0)))
    if config.get("emulate"):
        emulate_old_torch(int(config["emulate"]))
    if config.get("fake_data"):
        fake_data(int(config.get("samples") or 64))
    cap(config.get("steps"), config.get("batches"))
