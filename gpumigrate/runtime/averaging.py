"""Data parallelism without DistributedDataParallel, for what `wrap_model` does not wrap: the
gradients of each optimizer's parameters averaged across ranks at its step, with torch's own
hook APIs. `setup_distributed()` installs it in a group of more than one process and
`cleanup_distributed()` removes it; in one process none of it exists."""

from __future__ import annotations

import functools
import gc
import inspect
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from gpumigrate.runtime.seeding import part_random_streams
from gpumigrate.runtime.uneven import (AVERAGE, PARAMS, REDUCE, _collective, _shadow_average, agree, remember_layout,
                                      shadow)

# Where DistributedDataParallel cannot be placed (an optimizer built in a helper module, double
# backward, a functional model, a loss module with parameters, two optimizers), the ranks still
# train one model:
#
# - Gradients: torch's global optimizer step pre-hook averages, before each `optimizer.step()`,
#   the gradients of that optimizer's parameters that no DDP averaged during backward (the
#   parameters of models given to `wrap_model`, or of any live DDP), with one flattened
#   all_reduce per (device, dtype). Which parameters that is is cached per optimizer (its
#   `_PLAN`), rebuilt when its param_groups or the set of wrapped models change: for a model
#   that DDP wraps entirely, a step costs one cache check.
# - Before the first forward: each parameter group is broadcast from rank 0 as the optimizer
#   adds it (`Optimizer.add_param_group` wrapped: torch has no hook for an optimizer's
#   construction), and again when the optimizer's plan is built (its first step), which also
#   covers an optimizer made before `setup_distributed()` and weights changed after the
#   optimizer was made; there, step 1 averages gradients computed at different weights. That
#   first broadcast takes in the parameters a DDP averages too, which a forward may have set
#   per rank in place (a data-dependent init, as Glow's ActNorm).
# - Anything that reads gradients before `step()` must see them averaged: GradScaler's
#   inf/nan check (a rank that skips `opt.step()` alone would leave the others waiting in the
#   next collective) and clipping (the norm of the averaged gradient, as under DDP). So the
#   gradients are averaged at the first of `GradScaler._unscale_grads_` (behind `unscale_`,
#   `step` and the fused optimizers' inf check), `clip_grad_norm_`/`clip_grad_value_` and
#   `step()`: these two have no hook API and are wrapped, reversibly, while in a group.
# - Never twice: after averaging, each gradient carries its `_version` (attribute `_MARK`);
#   unscaling and clipping, which change every rank's averaged gradients alike, mark them
#   again. Whether a set is averaged must be decided alike on every rank, or one rank would
#   wait in an all_reduce the others skip: it is averaged whole when any gradient in it has
#   changed since, and a missing gradient counts as a change unless it was missing on every
#   rank at the last average (`_NO_GRAD`). Since an average leaves the same gradients, present
#   or missing, on every rank, and `zero_grad()`/backward change them alike, the ranks agree
#   except where all of an optimizer's parameters were unused on every rank at one average and
#   used on some ranks only afterwards.
# - Unused parameters (DDP's find_unused_parameters problem): each bucket carries, after the
#   gradients, one flag per parameter (1/world if this rank has a gradient). A missing gradient
#   takes part as zeros; afterwards it becomes the average only if some rank had one (the mean
#   over the whole batch, in which this rank's samples contributed nothing), and stays None if
#   no rank had one, so optimizers skip it as they would in one process. Reading the flags is a
#   device sync, only on a step where this rank lacks a gradient.
# - BatchNorm statistics: DDP broadcasts rank 0's buffers at each forward, which keeps rank 0's
#   statistics only. Here the running_mean/running_var of the models an optimizer trains are
#   averaged in the same all_reduce as its gradients: the running mean is an exponential
#   average of batch means, linear in them, so its average over ranks is exactly what one
#   process on the whole batch computes (with equal per-rank batches); the running variance
#   misses the spread of the per-rank means (what DDP without SyncBatchNorm misses too). The
#   models are found once per plan: after `gc.collect()`, the live modules without a parent
#   that hold any of the optimizer's parameters; their BatchNorm-like modules (float buffers
#   `running_mean`/`running_var`), outside any DDP, ordered by (the optimizer's index of the
#   model's first parameter, position in the model), which is the same on every rank.
#   Models that `shard_model` sharded (FSDP2: DTensor parameters, whose gradients FSDP
#   averages) are found the same way, and their statistics averaged at each `step()`: FSDP
#   does not synchronise buffers, and each rank would keep its own. Every rank then holds the
#   same statistics, as under DDP (which keeps rank 0's), here the mean, as for the models above.
# - Clipping sharded (DTensor) parameters: torch's clip_grad_norm_ returns a DTensor norm,
#   and refuses DTensors mixed with plain tensors (a loss module beside a sharded model). The
#   wrapper returns the plain norm, as in one process, and clips a mixed list in two parts
#   with the norm of both.

_MARK = "_gpumigrate_averaged"  # on a gradient: its _version when it was last averaged
_PLAN = "_gpumigrate_plan"  # on an optimizer: its _Plan

_BY_DDP: Dict[int, "weakref.ref[torch.Tensor]"] = {}  # parameters a DDP averages, by id
_DDP_OF: Dict[int, "weakref.ref[nn.Module]"] = {}  # parameter id -> the DDP that averages it
_FORWARDS = "_gpumigrate_forwards"  # on a DDP: how many forwards with autograd on it has run
_BY_FSDP: Dict[int, "weakref.ref[torch.Tensor]"] = {}  # parameters shard_model sharded, by id
_NO_GRAD: Dict[int, "weakref.ref[torch.Tensor]"] = {}  # without a gradient on any rank at their last average
_OPTIMIZERS: Dict[int, Tuple[int, "weakref.ref[torch.optim.Optimizer]"]] = {}  # by id: (order made, ref)
_CLIP_PLANS: Dict[Any, Tuple[Tuple[Any, ...], Optional["_Plan"]]] = {}  # parameter ids -> (optimizers, rest)
_wrapped_version = 0  # changes when a DDP is noted: the plans are stale
_plans_version = 0  # changes when an optimizer is noted or its plan rebuilt: _CLIP_PLANS are stale
_optimizer_count = 0


def _remember(table: Dict[int, Any], tensor: Any) -> bool:
    """Put `tensor` into an id-keyed weak table; whether it was new. (A WeakSet cannot hold
    tensors: it compares them with ==.)"""
    key = id(tensor)
    ref = table.get(key)
    if ref is not None and ref() is tensor:
        return False
    table[key] = weakref.ref(tensor, lambda _, key=key: table.pop(key, None))
    return True


def _in(table: Dict[int, Any], tensor: Any) -> bool:
    ref = table.get(id(tensor))
    return ref is not None and ref() is tensor


def _note_wrapped(model: nn.Module) -> bool:
    """Record the parameters a DistributedDataParallel averages (all it trains but those it
    was told to ignore); whether any was new."""
    global _wrapped_version
    ignored = getattr(model, "parameters_to_ignore", None) or ()
    new = False
    if _FORWARDS not in model.__dict__:
        model.__dict__[_FORWARDS] = 0
        model.register_forward_pre_hook(_count_forward)
    ref = weakref.ref(model)
    for name, param in model.module.named_parameters():
        if param.requires_grad and name not in ignored:
            new = _remember(_BY_DDP, param) or new
            _DDP_OF[id(param)] = ref
    if new:
        _wrapped_version += 1
    return new


def _count_forward(module: nn.Module, inputs: Any) -> None:
    """A DDP's forward pre-hook: DDP averages in backward only after a forward through it
    with autograd on (a model stored before it was wrapped trains around it)."""
    if torch.is_grad_enabled():
        module.__dict__[_FORWARDS] += 1


def _note_sharded(model: nn.Module) -> None:
    """Record the parameters `shard_model` sharded (their models' BatchNorm statistics are
    averaged at each step), and make every plan stale: it may hold the parameters that
    sharding replaced."""
    global _wrapped_version
    for param in model.parameters():
        if _sharded(param):
            _remember(_BY_FSDP, param)
    _wrapped_version += 1


def _sharded(param: torch.Tensor) -> bool:
    """A parameter that differs per rank by design (FSDP's flat parameters, DTensors)."""
    return bool(getattr(param, "_is_flat_param", False)) or _is_dtensor(param)


def _unwrapped(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """`params` without duplicates, without those a DDP averages and without sharded ones."""
    seen, kept = set(), []
    for param in params:
        if id(param) not in seen and not _in(_BY_DDP, param) and not _sharded(param):
            seen.add(id(param))
            kept.append(param)
    return kept


class _Plan:
    """What to average for one optimizer (or one set of clipped parameters): its parameters
    that no DDP averages, in its order, and the BatchNorm statistics of the models it trains.
    For an optimizer, also what it was made from: its param_groups list, each group's params
    list and length, held (not their ids, which a new list could reuse on one rank only)."""

    __slots__ = ("params", "buffers", "ids", "flags", "wrapped", "groups", "lists", "key", "by_ddp")

    def __init__(self, params: List[torch.Tensor], buffers: List[torch.Tensor], key: int) -> None:
        self.key = key  # the same on every rank: the optimizer's number, or -1 - the rest's size
        self.params = params
        self.buffers = buffers
        self.ids = frozenset(map(id, params))
        self.flags: Dict[Any, torch.Tensor] = {}  # (device, dtype, which have a gradient) -> flags
        self.wrapped = _wrapped_version
        self.groups: Any = None
        self.lists: Tuple[Tuple[Any, int], ...] = ()
        # the parameters a DDP averages, per DDP: [DDP ref, their plan, its forwards at the last step]
        self.by_ddp: List[List[Any]] = []

    def fits(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this plan is still the optimizer's (its groups and the wrapped models unchanged)."""
        groups = optimizer.param_groups
        if self.wrapped != _wrapped_version or self.groups is not groups or len(self.lists) != len(groups):
            return False
        for (params, length), group in zip(self.lists, groups):
            if group["params"] is not params or len(params) != length:
                return False
        return True


def _optimizer_plan(optimizer: torch.optim.Optimizer, agreed: bool = False) -> _Plan:
    """The optimizer's plan: cached, rebuilt when stale. When it is first made, the
    optimizer's parameters are broadcast from rank 0, once the ranks agree on it (`agreed`: a
    rank taking part in another's first step, which agreed on it already)."""
    plan = optimizer.__dict__.get(_PLAN)
    if plan is not None and plan.fits(optimizer):
        return plan
    global _plans_version
    first = plan is None
    _note_optimizer(optimizer)
    every = [p for group in optimizer.param_groups for p in group["params"]]
    params = _unwrapped(every)
    sharded = list({id(p): p for p in every if _in(_BY_FSDP, p)}.values())
    buffers: List[torch.Tensor] = []
    if params or sharded:
        modules = _live_modules()
        found = [m for m in modules if isinstance(m, nn.parallel.DistributedDataParallel)]
        if any([_note_wrapped(m) for m in found]):  # a DDP the script made itself
            params = _unwrapped(params)
        buffers = _running_stats(modules, params + sharded)  # the models of both
    plan = _Plan(params, buffers, _OPTIMIZERS[id(optimizer)][0])
    plan.by_ddp = _ddp_groups(every, plan.key)
    plan.groups = optimizer.param_groups
    plan.lists = tuple((group["params"], len(group["params"])) for group in plan.groups)
    optimizer.__dict__[_PLAN] = plan
    _plans_version += 1
    if not first:  # once: add_param_group broadcasts what is added later
        return plan
    # a DDP's parameters too: equal since the wrap, unless a forward changed them in place (a
    # data-dependent init: Glow's ActNorm sets its scale from each rank's first batch)
    owned = [p for p in {id(p): p for p in every}.values() if _in(_BY_DDP, p) and not _sharded(p)]
    if params or owned:
        if not agreed:
            agree(PARAMS, plan.key)  # a rank ahead of another (uneven.py) takes part in its steps first
        _broadcast(params + owned)
    return plan


def _ddp_groups(params: Sequence[torch.Tensor], key: int) -> List[List[Any]]:
    """`_Plan.by_ddp`: the parameters among `params` that a DDP averages, grouped by DDP in
    the optimizer's order, each with a plan keyed alike on every rank."""
    groups: Dict[int, List[Any]] = {}
    for param in params:
        ref = _DDP_OF.get(id(param)) if _in(_BY_DDP, param) else None
        ddp = ref() if ref is not None else None
        if ddp is not None:
            groups.setdefault(id(ddp), [ref, []])[1].append(param)
    out = []
    for i, (ref, members) in enumerate(groups.values()):
        # forwards counted from the wrap: the first step finds the forward before it
        out.append([ref, _Plan(list({id(p): p for p in members}.values()), [], -(2 ** 40) - 64 * key - i), 0])
    return out


def _average_unreduced(plan: _Plan, step: bool) -> None:
    """Average the parameters of a DDP that did not average them: no forward through it with
    autograd on since the optimizer's last step (the script trained a reference to the model
    it held before the wrap). Decided at each step, alike on every rank. `step`: the
    optimizer steps now, and the next check counts from here."""
    for group in plan.by_ddp:
        ddp = group[0]()
        forwards = ddp.__dict__.get(_FORWARDS, 0) if ddp is not None else group[2]
        if forwards == group[2]:
            _average(group[1])
        if step:
            group[2] = forwards


def _note_optimizer(optimizer: torch.optim.Optimizer) -> None:
    global _optimizer_count, _plans_version
    key = id(optimizer)
    entry = _OPTIMIZERS.get(key)
    if entry is not None and entry[1]() is optimizer:
        return
    _optimizer_count += 1
    _OPTIMIZERS[key] = (_optimizer_count, weakref.ref(optimizer, lambda _, key=key: _OPTIMIZERS.pop(key, None)))
    _plans_version += 1


def _live_modules() -> List[nn.Module]:
    """Every live module (after a collection: garbage would differ between ranks)."""
    gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]


def _running_stats(modules: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The float `running_mean`/`running_var` buffers of the models that hold any of `params`
    (outside DDPs), in an order that is the same on every rank (see the comment above)."""
    index = {id(p): i for i, p in enumerate(params)}
    children = {id(c) for m in modules for c in m._modules.values() if c is not None}
    keys: Dict[int, Tuple[Tuple[int, int], torch.Tensor]] = {}
    for root in modules:
        if id(root) in children:
            continue
        first, found, seen, stack = None, [], set(), [root]
        while stack:  # pre-order, as Module.modules(), without what a DDP holds
            module = stack.pop()
            if id(module) in seen or isinstance(module, nn.parallel.DistributedDataParallel):
                continue
            seen.add(id(module))
            for param in module._parameters.values():
                i = index.get(id(param)) if param is not None else None
                if i is not None and (first is None or i < first):
                    first = i
            for name in ("running_mean", "running_var"):
                buffer = module._buffers.get(name)
                if (isinstance(buffer, torch.Tensor) and buffer.is_floating_point()
                        and not nn.parameter.is_lazy(buffer)):
                    found.append(buffer)
            stack.extend(reversed([c for c in module._modules.values() if c is not None]))
        if first is None:
            continue
        for position, buffer in enumerate(found):
            key = (first, position)
            if id(buffer) not in keys or key < keys[id(buffer)][0]:
                keys[id(buffer)] = (key, buffer)
    ordered = sorted(keys.values(), key=lambda kv: kv[0])
    tied = {key for (key, _), (other, _) in zip(ordered, ordered[1:]) if key == other}
    if tied:  # two models share a first parameter, with other statistics at the same place
        warnings.warn("gpumigrate.runtime: some BatchNorm statistics are not averaged across ranks: two models "
                      "share parameters and their order differs by rank", RuntimeWarning, stacklevel=2)
    return [buffer for key, buffer in ordered if key not in tied]


# ---------------------------------------------------------------------------- the average

def _changed(params: Sequence[torch.Tensor]) -> bool:
    """Whether any gradient of `params` changed since it was last averaged (see the comment
    above: the answer is the same on every rank)."""
    for param in params:
        grad = param.grad
        if grad is None:
            if not _in(_NO_GRAD, param):
                return True
        elif getattr(grad, _MARK, None) != grad._version:
            return True
    return False


def _mark(params: Sequence[torch.Tensor]) -> None:
    """Record the gradients of `params` as averaged, as they are now."""
    for param in params:
        grad = param.grad
        if grad is None:
            _remember(_NO_GRAD, param)
        else:
            setattr(grad, _MARK, grad._version)
            _NO_GRAD.pop(id(param), None)


def _average(plan: _Plan, statistics: bool = False, finished: bool = False) -> None:
    """Average the plan's gradients (and statistics) across ranks unless they are averaged;
    `statistics`: a plan of statistics only (sharded models), averaged at every call.
    `finished`: on a rank whose script has ended, in the average the running ranks agreed on
    (uneven.py): it adds nothing, and takes the running ranks' mean as its own gradients and
    statistics, so that its step keeps its parameters theirs."""
    params = [p for p in plan.params if p.requires_grad]
    if not (statistics or finished or _changed(params)) or not dist.is_initialized():
        return
    running = 1 if finished else agree(AVERAGE, plan.key)
    flats = []
    buckets: Dict[Tuple[torch.device, torch.dtype], Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
    for param in params:
        buckets.setdefault((param.device, param.dtype), ([], []))[0].append(param)
    for buffer in plan.buffers:
        buckets.setdefault((buffer.device, buffer.dtype), ([], []))[1].append(buffer)
    with torch.no_grad():
        for (device, dtype), (bucket, buffers) in buckets.items():
            grads = [None for _ in bucket] if finished else [p.grad for p in bucket]
            have = tuple(g is not None for g in grads)
            tensors = [torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g
                       for p, g in zip(bucket, grads)]
            tensors += [torch.zeros_like(b) for b in buffers] if finished else buffers
            tensors.append(_flags(plan, device, dtype, have))
            flat = _flatten(tensors)
            flat.div_(running)  # a rank that has finished adds zeros (uneven.py)
            _collective(flat)
            flats.append(flat)
            views = _unflatten(flat, tensors)
            anyone = have if all(have) else (views[-1] != 0).tolist()
            targets, sources = list(buffers), list(views[len(bucket):-1])
            for param, grad, somewhere, view in zip(bucket, grads, anyone, views):
                if grad is None:
                    if somewhere:
                        param.grad = torch.empty_like(param).copy_(view)
                    elif finished:
                        param.grad = None  # no rank has one: its optimizer skips it, as theirs do
                elif grad.is_sparse:
                    param.grad = view.to_sparse(grad.sparse_dim())
                else:
                    targets.append(grad)
                    sources.append(view)
            _copy(targets, sources)
    remember_layout(plan.key, flats)
    _mark(params)


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values, one after the other, in one new 1-D tensor (as DDP's buckets)."""
    flatten = getattr(torch._utils, "_flatten_dense_tensors", None)  # one C++ call where torch has it
    return flatten(tensors) if flatten is not None else torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Views of `flat` shaped like `tensors` (the inverse of `_flatten`)."""
    unflatten = getattr(torch._utils, "_unflatten_dense_tensors", None)
    if unflatten is not None:
        return unflatten(flat, tensors)
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _copy(targets: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """target.copy_(source) for each pair (one foreach call where torch has it)."""
    if not targets:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(targets, sources)
    else:
        for target, source in zip(targets, sources):
            target.copy_(source)


def _flags(plan: _Plan, device: torch.device, dtype: torch.dtype, have: Tuple[bool, ...]) -> torch.Tensor:
    """One value per parameter, nonzero where this rank has a gradient (cached per pattern)."""
    key = (device, dtype, have)
    flags = plan.flags.get(key)
    if flags is None:
        if len(plan.flags) > 32:
            plan.flags.clear()
        flags = plan.flags[key] = torch.tensor([1.0 if h else 0.0 for h in have], dtype=dtype, device=device)
    return flags


def _broadcast(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Rank `src`'s values of `tensors` on every rank (one broadcast per device and dtype); a
    tensor that already has them is not written (no new _version)."""
    if not dist.is_initialized():
        return
    copy = dist.get_rank() != src
    buckets: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for bucket in buckets.values():
            bucket = [t.detach() for t in bucket]
            flat = _flatten(bucket)
            _collective(flat, broadcast=True, src=src)
            if copy:
                for tensor, view in zip(bucket, _unflatten(flat, bucket)):
                    if not torch.equal(tensor, view):
                        tensor.copy_(view)


def _plans_for(params: Sequence[torch.Tensor]) -> List[_Plan]:
    """The plans that cover `params` (clipped together): those of the known optimizers that
    hold any of them, in the order the optimizers were made, then one for the rest."""
    key = (_plans_version, _wrapped_version, tuple(map(id, params)))
    cached = _CLIP_PLANS.get(key)
    optimizers = [ref() for ref in cached[0]] if cached is not None else [None]
    if cached is None or any(o is None for o in optimizers):
        ids = set(map(id, params))
        optimizers, covered = [], set()
        for _, ref in sorted(_OPTIMIZERS.values(), key=lambda entry: entry[0]):
            optimizer = ref()
            if optimizer is not None and (_optimizer_plan(optimizer).ids & ids or any(
                    group[1].ids & ids for group in optimizer.__dict__[_PLAN].by_ddp)):
                optimizers.append(optimizer)
                covered |= optimizer.__dict__[_PLAN].ids
        rest = _unwrapped(p for p in params if id(p) not in covered)
        if len(_CLIP_PLANS) > 16:
            _CLIP_PLANS.clear()
        key = (_plans_version, _wrapped_version, key[2])  # building the plans may have changed both
        # the rest's key: the same on every rank, and never an optimizer's number
        rest_plan = _Plan(rest, [], -1 - sum(p.numel() for p in rest) % 2**30) if rest else None
        cached = _CLIP_PLANS[key] = (tuple(weakref.ref(o) for o in optimizers), rest_plan)
    plans = [_optimizer_plan(o) for o in optimizers]
    return plans + [cached[1]] if cached[1] is not None else plans


def average_gradients(target: Union[torch.optim.Optimizer, torch.Tensor, Iterable[torch.Tensor]]) -> None:
    """Average now, across ranks, the gradients of an optimizer's parameters (or of these
    parameters) that no `wrap_model` model averages, as `step()` would: for code that reads
    gradients before the step other than `clip_grad_norm_`/`clip_grad_value_` and GradScaler
    (which see averaged gradients already), e.g. a norm computed by hand. Gradients averaged
    since they last changed are not averaged again. A no-op in one process, and on a rank
    unless every rank calls it."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if isinstance(target, torch.optim.Optimizer):
        plans = [_optimizer_plan(target)]
    else:
        plans = _plans_for([target] if isinstance(target, torch.Tensor) else list(target))
    for plan in plans:
        if plan.params:
            _average(plan)


# ----------------------------------------------------------------------- hooks and wrappers

_shadowing = False  # a finished rank steps with the others' mean: no averaging of its own


def _numbered(key: int) -> Optional[torch.optim.Optimizer]:
    """The live optimizer made `key`-th (the same one on every rank), or None."""
    return next((ref() for number, ref in _OPTIMIZERS.values() if number == key), None)


@shadow(PARAMS)
def _shadow_params(key: int) -> None:
    """A rank whose script has ended, where another makes the plan of optimizer #`key`: it
    takes part in the broadcast of that optimizer's parameters."""
    optimizer = _numbered(key)
    if optimizer is None:
        raise RuntimeError(f"gpumigrate.runtime: a rank that has finished cannot take part in the first step of "
                           f"optimizer #{key}, which it no longer has")
    # This rank never stepped it (else the ranks would have agreed on its first step then): its
    # plan is made here, so that taking part in the averages that follow asks for no agreement.
    _optimizer_plan(optimizer, agreed=True)


@shadow(AVERAGE)
def _shadow_step(key: int) -> None:
    """A rank whose script has ended, in the running ranks' average of optimizer #`key`: it
    takes their mean gradients (and BatchNorm statistics) and steps its own optimizer with
    them, so every rank ends with the same parameters however many steps each took. An
    optimizer gone with its script's objects only adds zeros."""
    global _shadowing
    optimizer = _numbered(key)
    if optimizer is None:
        _shadow_average(key)
        return
    _average(_optimizer_plan(optimizer), finished=True)
    _shadowing = True
    try:
        optimizer.step()
    finally:
        _shadowing = False


def _before_step(optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The global optimizer step pre-hook (`args` starts with the optimizer)."""
    if _shadowing:
        return None
    part_random_streams()  # once: a script whose training loop shard_batches did not mark
    plan = _optimizer_plan(optimizer)
    if plan.by_ddp:
        _average_unreduced(plan, step=True)
    if not plan.params:
        if plan.buffers:  # a model shard_model sharded: FSDP averaged the gradients, not the statistics
            _average(plan, statistics=True)
        return None  # everything it trains is DDP's (or FSDP's): the common case costs a few checks
    _average(plan)
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    averaged = _averaging_closure(closure, plan)
    if "closure" in kwargs:
        return args, dict(kwargs, closure=averaged)
    return (args[0], averaged, *args[2:]), kwargs


def _averaging_closure(closure: Callable[[], Any], plan: _Plan) -> Callable[[], Any]:
    """`step(closure)` (LBFGS, SAM): the closure's gradients are averaged, and so is the loss
    it returns, which such optimizers branch on (all ranks must take the same branches)."""

    @functools.wraps(closure)
    def averaged() -> Any:
        loss = closure()
        _average(plan)
        if isinstance(loss, (torch.Tensor, int, float)):
            mean = torch.as_tensor(loss).detach().to(torch.float64).reshape(1).clone()
            running = agree(REDUCE, 1)
            _collective(mean)
            mean /= running
            if isinstance(loss, torch.Tensor):
                return mean.reshape(loss.shape).to(device=loss.device, dtype=loss.dtype)
            return type(loss)(mean.item())
        return loss

    return averaged


def _averaging_clip(clip: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(clip)
    def clip_averaged(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        every = _plans_for(params)
        for plan in every:
            if plan.by_ddp:
                _average_unreduced(plan, step=False)
        plans = [plan for plan in every if plan.params]
        for plan in plans:
            _average(plan)
        dtensors = [p for p in params if _is_dtensor(p)]
        if dtensors and len(dtensors) < len(params):
            result = _clip_apart(clip, dtensors, [p for p in params if not _is_dtensor(p)], args, kwargs)
        else:
            result = clip(params, *args, **kwargs)
        if _is_dtensor(result):  # the norm of sharded gradients: the same on every rank
            result = result.full_tensor()
        for plan in plans:  # clipped alike on every rank: still averaged
            _mark([p for p in plan.params if p.requires_grad])
        for plan in every:
            for group in plan.by_ddp:
                _mark([p for p in group[1].params if p.requires_grad])
        return result

    return clip_averaged


def _is_dtensor(tensor: Any) -> bool:
    """A DTensor (imports nothing: none exists before torch.distributed.tensor is loaded)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, getattr(dtensor, "DTensor", ()))


def _clip_apart(clip: Callable[..., Any], dtensors: List[torch.Tensor], plain: List[torch.Tensor],
                args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """`clip` of DTensors and plain tensors together, which torch refuses (its foreach ops take
    one kind): by value, each part alone; by norm, each part scaled by the norm of both."""
    from torch.nn import utils

    if clip.__name__ != "clip_grad_norm_":
        for part in (dtensors, plain):
            result = clip(part, *args, **kwargs)
        return result
    if not hasattr(utils, "get_total_norm"):  # torch < 2.6: its own error
        return clip(dtensors + plain, *args, **kwargs)
    bound = inspect.signature(clip).bind(dtensors, *args, **kwargs)
    bound.apply_defaults()
    options = bound.arguments
    norm_type, nonfinite, foreach = options["norm_type"], options["error_if_nonfinite"], options["foreach"]
    norms = []
    for part in (dtensors, plain):
        norm = utils.get_total_norm([p.grad for p in part if p.grad is not None], norm_type, nonfinite, foreach)
        norms.append(norm.full_tensor() if _is_dtensor(norm) else norm)
    total = utils.get_total_norm(norms, norm_type, nonfinite, foreach)  # a p-norm of p-norms is the p-norm
    for part in (dtensors, plain):
        utils.clip_grads_with_norm_(part, options["max_norm"], total, foreach)
    return total


def _averaging_unscale(unscale: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(unscale)
    def _unscale_grads_(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        plan = _optimizer_plan(optimizer)
        if plan.by_ddp:
            _average_unreduced(plan, step=False)
        if plan.params:
            _average(plan)  # before the inf/nan check: every rank finds the same and skips alike
        result = unscale(self, optimizer, *args, **kwargs)
        if plan.params:
            _mark([p for p in plan.params if p.requires_grad])
        return result

    return _unscale_grads_


def _broadcasting_add_param_group(add: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(add)
    def add_param_group(self: torch.optim.Optimizer, param_group: Dict[str, Any]) -> None:
        add(self, param_group)
        if _installed is not None and dist.is_initialized():
            _note_optimizer(self)
            _broadcast(_unwrapped(self.param_groups[-1]["params"]))

    return add_param_group


_installed: Optional[List[Callable[[], None]]] = None  # what undoes each hook and wrapper


def _install_averaging() -> None:
    """Install the hooks and wrappers (once) in a group of more than one process."""
    global _installed
    if _installed is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
    except ImportError:  # torch < 2.0
        warnings.warn("gpumigrate.runtime: torch < 2.0 has no optimizer hooks: the gradients of models "
                      "not given to wrap_model are not averaged", RuntimeWarning, stacklevel=3)
        return
    undo: List[Callable[[], None]] = [register_optimizer_step_pre_hook(_before_step).remove]
    _replace(undo, torch.optim.Optimizer, "add_param_group", _broadcasting_add_param_group)
    scaler = getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler
    if hasattr(scaler, "_unscale_grads_"):
        _replace(undo, scaler, "_unscale_grads_", _averaging_unscale)
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        if hasattr(clip_grad, name):
            _wrap_clip(undo, clip_grad, name)
    _installed = undo


def _uninstall_averaging() -> None:
    """Remove what `_install_averaging` installed (safe to call twice)."""
    global _installed
    undo, _installed = _installed, None
    for step in reversed(undo or []):
        step()
    _CLIP_PLANS.clear()  # they hold parameters


def _replace(undo: List[Callable[[], None]], owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    """owner.name = wrapper(owner.name), undone only if nobody replaced it since."""
    original = getattr(owner, name)
    replacement = wrapper(original)
    setattr(owner, name, replacement)

    def restore() -> None:
        if getattr(owner, name, None) is replacement:
            setattr(owner, name, original)

    undo.append(restore)


def _wrap_clip(undo: List[Callable[[], None]], module: Any, name: str) -> None:
    """Wrap a clipping function where scripts find it, also under names bound before
    `setup_distributed()` (`from torch.nn.utils import clip_grad_norm_`): torch's function is a
    no_grad wrapper calling the function in its closure, which is replaced. Elsewhere, the
    module attributes are."""
    outer = getattr(module, name)
    inner = getattr(outer, "__wrapped__", None)
    cell = next((c for c in (getattr(outer, "__closure__", None) or ()) if c.cell_contents is inner), None)
    if inner is None or cell is None:
        _replace(undo, module, name, _averaging_clip)
        utils = sys.modules.get("torch.nn.utils")
        if utils is not None and getattr(utils, name, None) is outer:
            _replace(undo, utils, name, lambda _: getattr(module, name))
        return
    replacement = _averaging_clip(inner)
    cell.cell_contents = replacement

    def restore() -> None:
        if cell.cell_contents is replacement:
            cell.cell_contents = inner

    undo.append(restore)
