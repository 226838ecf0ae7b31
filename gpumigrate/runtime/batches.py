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

from gpumigrate.runtime.distributed import (_Shard, _cached_shard, _progress_bar, _rebuilt_loader, _why_not_sharded,
                                            get_rank, get_world_size, is_distributed)
from gpumigrate.runtime.seeding import part_random_streams
from gpumigrate.runtime.uneven import finish


def shard_batches(iterable: Any, *, indices: bool = False, seed: int = 0) -> Any:
    """This rank's part of what a training loop iterates; in one process, `iterable` itself.

    - A DataLoader: rebuilt for the rank as `shard_loader` rebuilds it (shuffle, drop_last,
      workers, collate_fn, generator and worker_init_fn kept; a new order at each pass, so
      no `set_epoch` is needed), and this rank's last batch dropped where it would be partial
      while the rank has a full one: every rank takes as many batches, each as full as the
      loop may expect. A loader with a batch sampler of its own (or a sampler that yields
      indices one by one) gets its batches dealt out round-robin before they are loaded; an
      IterableDataset or a DataLoader subclass has its batches dealt out as they come.
    - `range(...)`, a loop that counts steps around data made inside it (random draws, a
      generator, an environment's episodes): every rank takes every WORLD_SIZE-th value,
      counted back from the last, the same values on every rank (so every test on the counter
      goes the same way everywhere, and the loop ends on the script's last step). Each value
      is the script's own step number, so schedules computed from it run as they did; `it %
      k` counts this rank's steps and `it == n` holds at the step that stands for the
      script's step n (see `_Step`): `if (it + 1) % 100 == 0:` and `if it == n_iters - 1:`
      still fire.
    - `range(...)` with `indices=True`, a range whose values index the data (`x[i:i + bs]`,
      `get_batch(data, i)`): each rank takes its own contiguous block of the values (batches
      that follow each other, as a hidden state carried from one to the next expects, stay
      together); the values after the last full block are left out.
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
    return _Batches(iterable, seed, indices)


class _Batches:
    """What `shard_batches` returns under torchrun: iterable again at each pass (an epoch loop
    around it starts a new pass, as over a DataLoader)."""

    def __init__(self, iterable: Any, seed: int, indices: bool = False) -> None:
        self.iterable, self.seed, self.indices = iterable, seed, indices
        self.rank, self.world = get_rank(), get_world_size()

    def __iter__(self) -> Iterator[Any]:
        part_random_streams()
        bar = _progress_bar(self.iterable)
        if bar is not None:
            inner = bar.iterable if isinstance(bar.iterable, _Batches) else _Batches(bar.iterable, self.seed,
                                                                                     self.indices)
            bar.iterable = inner
            try:
                bar.total = len(inner)
            except TypeError:
                pass
            return iter(bar)
        return _joined(self._items())

    def __len__(self) -> int:
        source = self.iterable
        bar = _progress_bar(source)
        if bar is not None:
            return len(_Batches(bar.iterable, self.seed, self.indices))
        if isinstance(source, range):
            return len(source) // self.world if self.indices else len(_counter(source, self.world))
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
        if isinstance(source, range) and self.indices:
            share = len(source) // self.world
            return iter(source[self.rank * share:(self.rank + 1) * share])
        if isinstance(source, range):
            return iter(_counter(source, self.world))
        if isinstance(source, DataLoader):
            return iter(self._loader())
        if isinstance(source, (list, tuple)) or (isinstance(source, torch.Tensor) and source.dim() > 0):
            share = len(source) // self.world
            return iter(source[self.rank::self.world][:share])
        return iter(_Dealt(source, self.rank, self.world))


_saving: Optional[Any] = None  # torch.save as it was before _save_steps_as_numbers


def _save_steps_as_numbers() -> None:
    """`torch.save({"iteration": it, ...})` writes a plain int: a `_Step` pickles by calling
    `int`, which `torch.load(weights_only=True)` (torch's default since 2.6) refuses, so a
    checkpoint would not load where gpumigrate is not installed. Once, where a counting loop
    is sharded (under torchrun only: in one process the loop's values are plain ints)."""
    global _saving
    if _saving is not None:
        return
    _saving = original = torch.save

    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        return original(_numbers(obj), *args, **kwargs)

    save.__wrapped__ = original  # type: ignore[attr-defined]
    save.__doc__ = original.__doc__
    torch.save = save


def _numbers(obj: Any, depth: int = 0) -> Any:
    """`obj` with every `_Step` in its dicts, lists and tuples a plain int (the same object
    where there is none: a state dict is not copied)."""
    if isinstance(obj, _Step):
        return int(obj)
    if depth > 4:
        return obj
    if isinstance(obj, dict):
        items = {k: _numbers(v, depth + 1) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        copy = obj.copy()
        copy.update(items)
        return copy
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        items = [_numbers(v, depth + 1) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return obj


def _joined(items: Iterator[Any]) -> Iterator[Any]:
    """The items, then the end of the loop as a meeting point: every rank took as many items,
    but not always as many optimizer steps (an environment's episodes differ in length); a
    rank that ends its pass first takes part in the others' steps, stepping with their mean,
    until every rank has ended it (uneven.py's protocol, as at exit). Every rank then leaves
    the loop with the same parameters, before what follows it (a checkpoint, an evaluation)."""
    yield from items
    finish()


_DEALT: "weakref.WeakKeyDictionary[DataLoader, DataLoader]" = weakref.WeakKeyDictionary()


def _counter(steps: range, world: int) -> List[int]:
    """Every `world`-th value of `steps`, counted back from the last, as `_Step`s: each stands
    for the script's steps since the value before it (the first, for those from the start),
    so the loop ends on the script's last step, and `it == n` finds every step n, without a
    step more than 1/world of them."""
    if not len(steps):
        return []
    values = list(steps[::-1][::world])[::-1]
    # what each value stands for: back to (not including) the value before it
    widths = [-(values[0] - steps[0] + steps.step)] + [-(b - a) for a, b in zip(values, values[1:])]
    _save_steps_as_numbers()
    # this rank's own step count starts where the script's did (`range(1, n + 1)`: at 1), so
    # `it % k == 0` fires at the rank's k-th step as the script's at its k-th
    first = steps.start if steps.step > 0 else 0
    return [_Step(v, first + k, w) for k, (v, w) in enumerate(zip(values, widths))]


def next_step(step: Any) -> Any:
    """`step + 1` in one process; under torchrun, the step counter of a training loop that it
    ends (`it = next_step(it)` for `it += 1`) counts the WORLD_SIZE steps the ranks take
    together, so the loop ends when they have taken the script's steps once; as a `_Step`,
    `it % k` still counts this rank's own steps and `it == n` finds the script's step n."""
    if not is_distributed():
        return step + 1
    part_random_streams()  # a loop counted this way may reach no shard_batches and no step yet
    world = get_world_size()
    local = step.local + 1 if isinstance(step, _Step) else int(step) // world + 1
    _save_steps_as_numbers()
    return _Step(int(step) + world, local, -world)


class _Step(int):
    """One value of a counting range that `shard_batches` strided: the script's own step number
    (every WORLD_SIZE-th: the same on every rank), so progress computed from it (`it / n_iters`,
    `t < start_timesteps`, an lr drop at step 30000) keeps the script's schedule. Each one
    stands for the WORLD_SIZE steps the ranks take together, so:

    - `it % k` counts this rank's own steps from where the script's count starts (`(it + 1) %
      log_every == 0`, `it % n_critic == 0`, a target network copied every 10 episodes: as
      often per step this rank takes as the script did per step, and at the same one of them);
    - `it == n` holds where the script's step `n` is among the steps this one stands for (the
      last step, an lr drop, `if it in lr_steps`);
    - everything else (arithmetic, comparisons, indexing, printing, pickling, JSON) is the
      plain number. `it + c` and `it - c` stay steps.
    """

    def __new__(cls, value: int, local: int, width: int) -> "_Step":
        step = int.__new__(cls, value)
        step.local, step.width = local, width
        return step

    def __add__(self, other: Any) -> Any:
        if type(other) is int:
            return _Step(int(self) + other, self.local + other, self.width)
        return int(self) + other

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if type(other) is int:
            return _Step(int(self) - other, self.local - other, self.width)
        return int(self) - other

    def __mod__(self, other: Any) -> Any:
        if type(other) is int and other > 0:
            return self.local % other
        return int(self) % other

    def __eq__(self, other: Any) -> bool:
        if type(other) is int:  # the script's step `other` is among those this one stands for
            low, high = sorted((int(self), int(self) + self.width))
            return low <= other < high if self.width > 0 else low < other <= high
        return int(self) == other

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    __hash__ = int.__hash__

    def __reduce__(self) -> Any:  # pickled (copied) as a plain int
        return (int, (int(self),))

    def __repr__(self) -> str:
        return int.__repr__(self)

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return int(self).__format__(spec)


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
    return _rebuilt_loader(loader, batch_sampler=_DealtBatches(loader.batch_sampler, rank, world))


def _iterable_dataset(loader: DataLoader) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(loader.dataset, IterableDataset)

