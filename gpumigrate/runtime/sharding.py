"""Fully sharded data parallelism (`--to fsdp`): FSDP2's `fully_shard` without the boilerplate,
and checkpoints of sharded models in the plain format one process reads and writes.

Each rank holds 1/world of every parameter, gradient and optimizer state; parameters are
gathered per block for its forward and backward, and gradients averaged as DDP would. In one
process every helper is the plain behaviour (`shard_model` returns the model as it is), so a
migrated script still runs as `python train.py`.

Environment (it wins over the script's arguments, so a run can be tuned without editing the
migrated script):
- `GPUMIGRATE_FSDP_BLOCKS`: comma-separated class names of the modules to shard one by one
  (`Block,Bottleneck`); default: the repeated blocks `shard_model` finds.
- `GPUMIGRATE_FSDP_RESHARD`: `1` frees gathered parameters after each block's forward (less
  memory, one more all-gather per block in backward), `0` keeps them; default: FSDP's own
  (every block but the root).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from gpumigrate.runtime.averaging import _broadcast, _is_dtensor, _note_sharded
from gpumigrate.runtime.distributed import (is_distributed, is_main_process, unwrap_model, without_module_prefix,
                                            wrap_model)
from gpumigrate.runtime.precision import amp_dtype

_BLOCKS_VARIABLE = "GPUMIGRATE_FSDP_BLOCKS"
_RESHARD_VARIABLE = "GPUMIGRATE_FSDP_RESHARD"

Blocks = Union[type, str, Sequence[Union[type, str]], None]


def _fsdp() -> Any:
    """torch.distributed.fsdp (FSDP2's `fully_shard`, torch >= 2.6), or None. Imported only
    when a model is sharded: one process does without its import time."""
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:
        return None
    return fsdp if hasattr(fsdp, "fully_shard") and hasattr(fsdp, "MixedPrecisionPolicy") else None


def _is_sharded(model: nn.Module) -> bool:
    """Whether `model` holds modules FSDP2 sharded, or DTensors; imports nothing. (Not the
    parameters' types alone: after a forward without backward, the root holds its gathered,
    plain parameters.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if kind is not None and any(isinstance(m, kind) for m in model.modules()):
        return True
    return any(_is_dtensor(t) for t in model.parameters()) or any(_is_dtensor(t) for t in model.buffers())


_MESHES: Dict[Tuple[str, int], Any] = {}  # (device type, id of the default group) -> the 1-D mesh of every rank


def shard_model(model: nn.Module, *, blocks: Blocks = None, reshard_after_forward: Optional[Union[bool, int]] = None,
                mixed_precision: Any = None) -> nn.Module:
    """Shard `model` (already on its device) across the ranks with FSDP2; in one process, or
    for a model with nothing to train, `model` itself.

    Rank 0's parameters and buffers are broadcast first (DDP does so, `fully_shard` does not).
    Each repeated block is sharded on its own, then the root: `blocks` (a class, class names,
    or a sequence of them) names them, else the children of every `nn.ModuleList` or
    `nn.Sequential` whose children are of one class and hold parameters, outermost first.
    `GPUMIGRATE_FSDP_BLOCKS` and `GPUMIGRATE_FSDP_RESHARD` override `blocks` and
    `reshard_after_forward` (see the module's docstring). `mixed_precision=True`: parameters
    cast to the dtype `autocast` uses on the model's device (bfloat16 on a CPU, float16 on
    CUDA, `GPUMIGRATE_AMP` honoured), gradients reduced in float32, BatchNorm kept in float32;
    a `MixedPrecisionPolicy` is used as it is; False or None: none.

    Sharding replaces the model's parameters with new (DTensor) ones. An optimizer built
    before is given the new ones in place; if it already has state for the old ones (a step
    taken, a state loaded), this raises: build and load it after `shard_model`. A second call
    on the same model returns it unchanged. Every rank must call it.
    """
    if not is_distributed():
        return model
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError("gpumigrate.runtime: shard_model: give it the model itself, not a "
                        f"{type(model).__name__} wrapper")
    if not any(p.requires_grad for p in model.parameters()):
        return model  # nothing to train: nothing to synchronise
    fsdp = _fsdp()
    if fsdp is None:
        if is_main_process():
            warnings.warn(f"gpumigrate.runtime: shard_model: torch {torch.__version__} has no "
                          "torch.distributed.fsdp.fully_shard (torch >= 2.6); using DDP instead", RuntimeWarning,
                          stacklevel=2)
        return wrap_model(model)
    if isinstance(model, fsdp.FSDPModule):
        return model  # sharded already: a script that calls it twice
    chosen = _blocks_setting(blocks)
    reshard = _reshard_setting(reshard_after_forward)
    policy = _policy(model, mixed_precision, fsdp.MixedPrecisionPolicy)

    # Before anything changes: what holds the parameters that sharding replaces.
    owners = [(module, name, param) for module in model.modules()
              for name, param in module._parameters.items() if param is not None]
    optimizers = _optimizers_holding({id(param) for _, _, param in owners})

    _broadcast([t for t in (*model.parameters(), *model.buffers()) if not _is_dtensor(t)])
    options = {"mesh": _mesh(model), "reshard_after_forward": reshard}
    units = _fsdp_units(model, chosen)
    if policy is not None and policy.param_dtype in (torch.float16, torch.bfloat16):
        # BatchNorm's kernels refuse low-precision weights with float32 running statistics
        # (FSDP1 kept BatchNorm in float32 too): its own unit, in float32, on low-precision input
        for module in model.modules():
            if (isinstance(module, nn.modules.batchnorm._BatchNorm) and module is not model
                    and any(True for _ in module.parameters()) and not isinstance(module, fsdp.FSDPModule)):
                fsdp.fully_shard(module, mp_policy=fsdp.MixedPrecisionPolicy(), **options)
    if policy is not None:
        options["mp_policy"] = policy
    for unit in units:
        if not isinstance(unit, fsdp.FSDPModule):  # a BatchNorm block: sharded just above
            fsdp.fully_shard(unit, **options)
    fsdp.fully_shard(model, **options)

    replaced = {id(param): module._parameters[name] for module, name, param in owners
                if module._parameters.get(name) is not param}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, param in enumerate(params):
                if id(param) in replaced:
                    params[i] = replaced[id(param)]  # same group, same place
    _note_sharded(model)
    model.register_forward_pre_hook(_whole_inputs, with_kwargs=True, prepend=True)  # before FSDP's own
    for module in model.modules():
        shapes = {name: (p.device_mesh, p.placements, p.shape) for name, p in module._parameters.items()
                  if _is_dtensor(p)}
        if shapes:
            module.register_load_state_dict_pre_hook(functools.partial(_shard_full_tensors, shapes))
    return model


def _whole_inputs(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Forward pre-hook of a sharded model: a DTensor among its inputs becomes the whole tensor.
    Scripts make them from a parameter, which is sharded between steps: an RNN's first hidden
    state from `next(self.parameters()).new_zeros(...)` (the word language model's
    `init_hidden`), which the RNN kernels refuse beside plain tensors."""
    if not _holds_dtensor((args, kwargs)):
        return None  # every step of most models: nothing to change
    return _whole(args), _whole(kwargs)


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_dtensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_dtensor(v) for v in value.values())
    return _is_dtensor(value)


def _whole(value: Any) -> Any:
    if _is_dtensor(value):
        return value.full_tensor()  # a collective: every rank runs the same forward
    if isinstance(value, dict):
        return type(value)((k, _whole(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        items = [_whole(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple: by position
    return value


def _blocks_setting(blocks: Blocks) -> Optional[Tuple[Union[type, str], ...]]:
    """The blocks to shard one by one: `GPUMIGRATE_FSDP_BLOCKS`, else the argument; None: find them."""
    raw = os.environ.get(_BLOCKS_VARIABLE, "").strip()
    if raw:
        return tuple(name.strip() for name in raw.split(",") if name.strip())
    if blocks is None:
        return None
    if isinstance(blocks, (type, str)):
        return (blocks,)
    return tuple(blocks)


def _reshard_setting(argument: Optional[Union[bool, int]]) -> Optional[Union[bool, int]]:
    raw = os.environ.get(_RESHARD_VARIABLE, "").strip().lower()
    if not raw:
        return argument
    if raw not in ("0", "1"):
        raise ValueError(f"{_RESHARD_VARIABLE}={raw!r}: use 1 (free gathered parameters after each block's "
                         "forward) or 0 (keep them)")
    return raw == "1"


def _policy(model: nn.Module, mixed_precision: Any, policy_type: type) -> Any:
    """The MixedPrecisionPolicy for `mixed_precision` (see shard_model), or None."""
    if mixed_precision is None or mixed_precision is False:
        return None
    if isinstance(mixed_precision, policy_type):
        return mixed_precision
    if mixed_precision is not True:
        raise TypeError(f"gpumigrate.runtime: shard_model: mixed_precision={mixed_precision!r}: use True, False "
                        "or a torch.distributed.fsdp.MixedPrecisionPolicy")
    dtype = amp_dtype(model)  # what autocast uses there; GPUMIGRATE_AMP=off gives None
    if dtype is None or dtype == torch.float32:
        return None
    return policy_type(param_dtype=dtype, reduce_dtype=torch.float32)


def _mesh(model: nn.Module) -> Any:
    """The 1-D mesh of every rank on the device type of the model's parameters (fully_shard's
    default takes the accelerator's, also for a model a script keeps on the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (next(model.parameters()).device.type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(key[0], (dist.get_world_size(),))
    return _MESHES[key]


def _matches(module: nn.Module, names: Tuple[Union[type, str], ...]) -> bool:
    kind = type(module)
    for name in names:
        if isinstance(name, type):
            if isinstance(module, name):
                return True
        elif name in (kind.__name__, kind.__qualname__, f"{kind.__module__}.{kind.__qualname__}"):
            return True
    return False


def _fsdp_units(model: nn.Module, chosen: Optional[Tuple[Union[type, str], ...]]) -> List[nn.Module]:
    """The blocks to shard one by one, outermost first (none nested in another), in model
    order: those of the classes `chosen` names, else the children of each ModuleList or
    Sequential whose children are distinct modules of one class that hold parameters. A block
    sharing a parameter with anything outside it is left to its parent (FSDP would shard the
    parameter twice)."""
    found: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = [c for c in module._modules.values() if c is not None]
        if chosen is None and isinstance(module, (nn.ModuleList, nn.Sequential)) and _repeated(children):
            found.extend(children)
            return
        for child in children:
            if chosen is not None and _matches(child, chosen) and any(True for _ in child.parameters()):
                found.append(child)
            else:
                visit(child)

    visit(model)
    units = list({id(m): m for m in found}.values())
    if chosen is not None and not units and is_main_process():
        warnings.warn(f"gpumigrate.runtime: shard_model: no module with parameters is a "
                      f"{', '.join(map(_name, chosen))}; the model is sharded as one unit", RuntimeWarning, stacklevel=3)
    return _unshared(model, units)


def _name(block: Union[type, str]) -> str:
    return block.__name__ if isinstance(block, type) else block


def _repeated(children: List[nn.Module]) -> bool:
    """Distinct modules of one class, at least two, each holding parameters."""
    return (len(children) > 1 and len({type(c) for c in children}) == 1
            and len({id(c) for c in children}) == len(children)
            and all(any(True for _ in c.parameters()) for c in children))


def _unshared(model: nn.Module, units: List[nn.Module]) -> List[nn.Module]:
    """`units` without those that share a parameter with another unit or with the rest."""
    inside = [{id(p) for p in unit.parameters()} for unit in units]
    holders: Dict[int, int] = {}  # parameter id -> how many units (and the rest, once) hold it
    for ids in inside:
        for key in ids:
            holders[key] = holders.get(key, 0) + 1
    unit_ids = {id(unit) for unit in units}
    rest: set = set()
    stack = [model]
    while stack:  # the modules outside every unit
        module = stack.pop()
        rest.update(id(p) for p in module._parameters.values() if p is not None)
        stack.extend(c for c in module._modules.values() if c is not None and id(c) not in unit_ids)
    for key in rest:
        holders[key] = holders.get(key, 0) + 1
    return [unit for unit, ids in zip(units, inside) if all(holders[key] == 1 for key in ids)]


def _optimizers_holding(ids: set) -> List[torch.optim.Optimizer]:
    """The live optimizers that hold any parameter in `ids`; raises if one has state for them
    (sharding would leave that state behind)."""
    found = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):
            continue
        held = [p for group in obj.param_groups for p in group["params"] if id(p) in ids]
        if not held:
            continue
        if any(obj.state.get(p) for p in held):
            raise RuntimeError(f"gpumigrate.runtime: shard_model: {type(obj).__name__} already has state for the "
                               "model's parameters (a step was taken or a state loaded), which sharding replaces: "
                               "build the optimizer, and load its state, after shard_model(model)")
        found.append(obj)
    return found


def _shard_full_tensors(shapes: Dict[str, Tuple[Any, Any, torch.Size]], module: nn.Module, state_dict: Dict[str, Any],
                        prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook of a sharded module: a full (plain) tensor for a sharded
    parameter becomes this rank's shard of it, sliced locally, so that a plain
    `model.load_state_dict(full_state)` given on every rank works without communicating.
    `shapes`: each sharded parameter's (mesh, placements, shape) when it was sharded (between
    a forward and a backward the module holds the gathered parameter; FSDP's own pre-hook
    shards it again before it is loaded)."""
    for name, (mesh, placements, shape) in shapes.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not _is_dtensor(value) and value.shape == shape:
            state_dict[prefix + name] = _local_shard(value, mesh, placements)


# ---------------------------------------------------------------------------- checkpoints

def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> Dict[str, Any]:
    """The whole model's plain state_dict (keys as the original model's, no `module.`, no
    DTensors): what `torch.save` should write. For a sharded model every rank must call it;
    with `rank0_only` rank 0 gets it (CPU tensors) and the others an empty dict, else every
    rank gets it. For a model not sharded: `unwrap_model(model).state_dict()`."""
    model = unwrap_model(model)
    if not _is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=rank0_only))


def full_model(model: nn.Module, *, rank0_only: bool = True) -> Optional[nn.Module]:
    """A whole, unsharded copy of `model`, of its own classes: what `torch.save(model, f)`
    should pickle (a sharded module's FSDP class and DTensors unpickle nowhere else). Every
    rank must call it (it gathers the parameters); with `rank0_only` the others get None.
    The copy's tensors are on the CPU; hooks the script registered are kept, FSDP's dropped.
    For a model not sharded: the model itself, as `torch.save(model)` had it."""
    model = unwrap_model(model)
    if not _is_sharded(model):
        return model
    state = full_state_dict(model, rank0_only=rank0_only)
    if rank0_only and dist.get_rank() != 0:
        return None
    return _plain_copy(model, state, "", {})


# attributes fully_shard sets on every module it manages (and its state's keys, by prefix)
_FSDP_ATTRS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")
_FSDP_STATE_PREFIX = "__composable_api_state_key"


def _ours(hook: Any) -> bool:
    """A hook FSDP or this runtime registered (a partial of, or method of, their code)."""
    fn = getattr(hook, "hook", hook)  # torch's _WrappedHook
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    return (getattr(fn, "__module__", None) or "").startswith(("torch.distributed.fsdp", "gpumigrate"))


def _plain_copy(module: nn.Module, state: Dict[str, Any], prefix: str, made: Dict[int, Any]) -> nn.Module:
    """`module` rebuilt as its own class (not FSDP's subclass) around the whole tensors of
    `state`; a parameter shared by several modules stays one (`made`)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = type(module)
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not fsdp.FSDPModule)
    copy = cls.__new__(cls)
    attrs = {k: v for k, v in vars(module).items() if k not in _FSDP_ATTRS and not k.startswith(_FSDP_STATE_PREFIX)}
    for key, value in list(attrs.items()):
        if key.endswith("hooks") and isinstance(value, dict):
            attrs[key] = type(value)((i, h) for i, h in value.items() if not _ours(h))
    for key, hooks in (("_forward_pre_hooks_with_kwargs", "_forward_pre_hooks"),
                       ("_forward_hooks_with_kwargs", "_forward_hooks"),
                       ("_forward_hooks_always_called", "_forward_hooks")):
        if isinstance(attrs.get(key), dict):  # flags by hook id: those of the hooks kept
            attrs[key] = type(attrs[key])((i, f) for i, f in attrs[key].items() if i in attrs.get(hooks, {}))
    copy.__dict__.update(attrs)
    params = {}
    for name, param in module._parameters.items():
        if param is not None and id(param) not in made:
            made[id(param)] = nn.Parameter(state[prefix + name].detach().clone(), requires_grad=param.requires_grad)
        params[name] = None if param is None else made[id(param)]
    copy._parameters = type(module._parameters)(params)
    copy._buffers = type(module._buffers)(
        (name, None if buf is None else state.get(prefix + name, buf).detach().to("cpu").clone())
        for name, buf in module._buffers.items())
    copy._modules = type(module._modules)(
        (name, None if child is None else _plain_copy(child, state, f"{prefix}{name}.", made))
        for name, child in module._modules.items())
    return copy


def load_full_state_dict(model: nn.Module, state: Dict[str, Any], *, strict: bool = True) -> Any:
    """Load a plain state_dict (a checkpoint saved before the migration, `module.` prefixes
    and all, or by `full_state_dict`) given on every rank into `model`, sharded or not; every
    rank must call it. Returns what `load_state_dict` returns."""
    model = unwrap_model(model)
    state = without_module_prefix(state)
    if not _is_sharded(model):
        return model.load_state_dict(state, strict=strict)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # a copy: set_model_state_dict puts this rank's shards into the dict it is given
    return set_model_state_dict(model, dict(state), options=_options(strict=strict))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              rank0_only: bool = True) -> Dict[str, Any]:
    """The optimizer's whole state, as `optimizer.state_dict()` gives it in one process (its
    parameters numbered in its order, plain tensors): one process loads it with
    `optimizer.load_state_dict`. For a sharded model every rank must call it; `rank0_only`
    as in `full_state_dict`. Not sharded: `optimizer.state_dict()`."""
    state = optimizer.state_dict()
    if not _is_sharded(unwrap_model(model)):
        return state
    # Not torch.distributed.checkpoint's get_optimizer_state_dict: it keys the state by
    # parameter name (one process cannot load that) and fails on an optimizer that also
    # trains parameters outside the model (a loss module's). Each tensor is gathered here, in
    # the same order on every rank (parameter number, then the optimizer's own order), and
    # dropped at once where it is not kept.
    keep = not rank0_only or dist.get_rank() == 0
    gathered: Dict[Any, Any] = {}
    for key in sorted(state["state"]):
        values = {}
        for name, value in state["state"][key].items():
            if _is_dtensor(value):
                value = value.full_tensor()  # a collective: on every rank
            if keep:
                values[name] = value.cpu() if rank0_only and isinstance(value, torch.Tensor) else value
        if keep:
            gathered[key] = values
    return {"state": gathered, "param_groups": state["param_groups"]} if keep else {}


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Load an optimizer state saved whole (by `full_optimizer_state_dict`, or by
    `optimizer.state_dict()` in one process before the migration), given on every rank, into
    the optimizer of a sharded `model`: each rank keeps its shard of each state tensor (no
    communication). Not sharded: `optimizer.load_state_dict(state)`."""
    if not _is_sharded(unwrap_model(model)):
        optimizer.load_state_dict(state)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local: Dict[Any, Any] = {}
    for key, entry in state.get("state", {}).items():
        param = params[key] if isinstance(key, int) and 0 <= key < len(params) else None
        local[key] = ({name: _shard_like(value, param) for name, value in entry.items()}
                      if isinstance(entry, dict) else entry)
    optimizer.load_state_dict({**state, "state": local})


def _shard_like(value: Any, param: Any) -> Any:
    """This rank's shard of a full tensor shaped like the sharded `param`; anything else
    (a step count, a state of a parameter not sharded) as it is."""
    if (_is_dtensor(param) and isinstance(value, torch.Tensor) and not _is_dtensor(value)
            and value.shape == param.shape):
        return _local_shard(value, param.device_mesh, param.placements)
    return value


def _local_shard(full: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """The DTensor of this rank's part of `full` (the same on every rank), cut locally."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach().to(mesh.device_type), mesh, placements, src_data_rank=None)
