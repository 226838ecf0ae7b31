"""Sharding where the training loop iterates: `for batch in shard_batches(anything):`.

The migration marks the loop that brings a training loop its data; what that loop iterates
(a DataLoader built anywhere, a batch sampler of the project's, a generator, a list of
batches, `range(n_iters)` around random draws or an environment's episodes) is looked at
here, when it runs, instead of being guessed from how it was built. Every rank yields the
same number of items, so no rank waits in a collective that the others never reach, and the
ranks' random streams part at the first training loop (seeding.py).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterator, List, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from gpumigrate.runtime.distributed import (_Shard, _cached_shard, _why_not_sharded, get_rank, get_world_size,
                                            is_distributed)
from gpumigrate.runtime.seeding import part_random_streams


def shard_batches(iterable: Any, *, seed: int = 0) -> Any:
    """This rank's part of what a training loop iterates; in one process, `iterable` itself.

    - A DataLoader: rebuilt for the rank as `shard_loader` rebuilds it (shuffle, drop_last,
      workers, collate_fn, generator and worker_init_fn kept; a new order at each pass, so
      no `set_epoch` is needed), and this rank's last batch dropped where it would be partial
      while the rank has a full one: every rank takes as many batches, each as full as the
      loop may expect. A loader with a batch sampler of its own (or a sampler that yields
      indices one by one) gets its batches dealt out round-robin before they are loaded; an
      IterableDataset or a DataLoader subclass has its batches dealt out as they come.
    - `range(...)`, a loop that counts steps around data made inside it (random draws, a
      generator, an environment's episodes): every rank takes every WORLD_SIZE-th value, the
      same values on every rank (so a test on the counter, `it % 100 == 0`, goes the same way
      everywhere), and the last value too: the counter still runs from the first to the last
      step of the schedule, in steps of WORLD_SIZE.
    - Anything else (a list of batches, a generator): items dealt out round-robin, rank r
      taking items r, r + N, ...; the items after the last full round are left out, so every
      rank takes the same number.
    - A tqdm progress bar around any of these: the same, with the bar's total adjusted.

    Under torchrun the first iteration of a loop given to `shard_batches` also parts the
    ranks' random streams (torch, numpy, random): each is reseeded from one draw of its own
    plus the rank, so a seeded script still repeats for a given world size.
    """
    if not is_distributed():
        return iterable
    return _Batches(iterable, seed)


class _Batches:
    """What `shard_batches` returns under torchrun: iterable again at each pass (an epoch loop
    around it starts a new pass, as over a DataLoader)."""

    def __init__(self, iterable: Any, seed: int) -> None:
        self.iterable, self.seed = iterable, seed
        self.rank, self.world = get_rank(), get_world_size()

    def __iter__(self) -> Iterator[Any]:
        part_random_streams()
        bar = _progress_bar(self.iterable)
        if bar is not None:
            inner = bar.iterable if isinstance(bar.iterable, _Batches) else _Batches(bar.iterable, self.seed)
            bar.iterable = inner
            try:
                bar.total = len(inner)
            except TypeError:
                pass
            return iter(bar)
        return self._items()

    def __len__(self) -> int:
        source = self.iterable
        bar = _progress_bar(source)
        if bar is not None:
            return len(_Batches(bar.iterable, self.seed))
        if isinstance(source, range):
            return len(_counter(source, self.world))
        if isinstance(source, DataLoader):
            return len(self._loader())
        return len(source) // self.world  # TypeError where unsized, as len() of the iterable

    def _loader(self) -> Any:
        """The loader to iterate: rebuilt for the rank, or one dealing out its batches."""
        loader = self.iterable
        batches = getattr(loader, "batch_sampler", None)
        sampler = batches.sampler if type(batches) is BatchSampler else getattr(loader, "sampler", None)
        if isinstance(sampler, (DistributedSampler, _Shard)):
            return loader  # sharded by the script itself (or an earlier edit)
        if _why_not_sharded(loader, batches, sampler) is None:
            return _cached_shard(loader, self.seed, True, True)
        if type(loader) is DataLoader and batches is not None and not _iterable_dataset(loader):
            dealt = _DEALT.get(loader)
            if dealt is None:
                dealt = _DEALT[loader] = _dealt_loader(loader, self.rank, self.world)
            return dealt
        return _Dealt(loader, self.rank, self.world)

    def _items(self) -> Iterator[Any]:
        source = self.iterable
        if isinstance(source, range):
            return iter(_counter(source, self.world))
        if isinstance(source, DataLoader):
            return iter(self._loader())
        if isinstance(source, (list, tuple)) or (isinstance(source, torch.Tensor) and source.dim() > 0):
            share = len(source) // self.world
            return iter(source[self.rank::self.world][:share])
        return iter(_Dealt(source, self.rank, self.world))


_DEALT: "weakref.WeakKeyDictionary[DataLoader, DataLoader]" = weakref.WeakKeyDictionary()


def _counter(steps: range, world: int) -> List[int]:
    """Every `world`-th value of `steps` from the first, and the last one."""
    values = list(steps[::world])
    if len(steps) and values[-1] != steps[-1]:
        values.append(steps[-1])
    return values


class _Dealt:
    """Items of an iterable dealt out round-robin: rank r takes the r-th of each round of
    `world` items; an incomplete last round is left out on every rank."""

    def __init__(self, source: Any, rank: int, world: int) -> None:
        self.source, self.rank, self.world = source, rank, world

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.source)
        while True:
            round_ = list(itertools.islice(it, self.world))
            if len(round_) < self.world:
                return
            yield round_[self.rank]

    def __len__(self) -> int:
        return len(self.source) // self.world


class _DealtBatches(Sampler):
    """A batch sampler's batches (lists of indices) dealt out round-robin, before any is loaded."""

    def __init__(self, batches: Any, rank: int, world: int) -> None:
        self.batches, self.rank, self.world = batches, rank, world

    def __iter__(self) -> Iterator[Any]:
        return iter(_Dealt(self.batches, self.rank, self.world))

    def __len__(self) -> int:
        return len(self.batches) // self.world


def _dealt_loader(loader: DataLoader, rank: int, world: int) -> DataLoader:
    """`loader` loading only this rank's batches: its batch sampler's batches dealt out."""
    options = {}
    for name in ("pin_memory_device", "in_order"):  # keyword-only, in newer torch
        if hasattr(loader, name):
            options[name] = getattr(loader, name)
    return DataLoader(
        loader.dataset, batch_sampler=_DealtBatches(loader.batch_sampler, rank, world),
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers and loader.num_workers > 0, **options,
    )


def _iterable_dataset(loader: DataLoader) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(loader.dataset, IterableDataset)


def _progress_bar(obj: Any) -> Optional[Any]:
    """A tqdm bar (any of its flavours) wrapping an iterable, else None."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "tqdm" and cls.__module__.startswith("tqdm"):
            return obj if getattr(obj, "iterable", None) is not None else None
    return None
