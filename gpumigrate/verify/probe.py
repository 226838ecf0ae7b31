"""Run a training script unchanged and record what DistributedDataParallel must get right.

    torchrun --standalone --nproc_per_node=2 gpumigrate/verify/probe.py [OPTIONS] OUT_DIR SCRIPT [ARGS...]
    python gpumigrate/verify/probe.py [OPTIONS] OUT_DIR SCRIPT [ARGS...]          # one process

SCRIPT runs with `runpy.run_path(run_name="__main__")` and `sys.argv = [SCRIPT, *ARGS]`, as
`python SCRIPT ARGS` would run it; nothing in it is edited. Before it starts, the probe
instruments from the outside:

* `wrap_model` (in `gpumigrate.runtime.distributed` and in `gpumigrate.runtime`, whichever
  name the script imports) records every model it returns;
* `DistributedSampler`, `RandomSampler` and the runtime's `_Shard` record, per `__iter__`
  call (one call per epoch), the dataset indices they yield;
* `torch.save` records every path it writes;
* `sys.stdout` is teed, so each rank's own printing is known;
* every `torch.optim.Optimizer` constructed, with the parameters it trains (`optimizers`:
  class, tensors, num_params, steps, steps that changed a parameter, and the flattened float64
  vectors OUT_DIR/rank{RANK}_optim{i}.pt at the end and ..._optim{i}_init.pt at construction),
  so a test can check every trained parameter without knowing which modules were wrapped;
* `torch.load` calls (`torch_loads`: path, the weights_only argument, what came back),
  `shutil.copyfile`/`copy`/`copy2` destinations (`copies`) and `pickle.dump` files (`pickles`);
* with GPUMIGRATE_PROBE_FORWARDS=1 in the environment, every module forward, counted by class,
  training mode and whether autograd was recording (`forwards`);
* at each optimizer step, a fingerprint (shapes, sums, sums of squares) of the first tensor
  given to each outermost forward in training mode with autograd on since the step before
  (`inputs`): ranks that train on data of their own (an environment each, batches drawn
  without a sampler) differ there.

When SCRIPT ends (also when it raises: the error is recorded, then re-raised) the probe writes
OUT_DIR/rank{RANK}.json, and for each recorded model the flattened float64 parameter vector
(of the user's module, DDP/DataParallel unwrapped) to OUT_DIR/rank{RANK}_model{i}.pt.
rank{RANK}.json holds: rank, local_rank, world_size (torchrun's), process_group_world_size
(what the script joined), script, argv, seconds, error ({type, message, traceback} or null),
exit_code, stdout (what this rank printed), samplers (one entry per __iter__, in time order:
kind, sampler id, call = that sampler's epoch, dataset_len, indices; for DistributedSampler
also num_replicas, sampler_rank, shuffle, drop_last, epoch), wrap_calls, saves ({path, kind,
state_dicts: {entry: sorted keys}}), models ({index, wrapper, module, state_sha256 (params and
buffers), params_sha256, buffers_sha256, num_params, vector}); with the options, loads / eval_swaps.

OPTIONS (used to check a DDP run against the ORIGINAL single-GPU script, run in one process):

--probe-load CKPT       after SCRIPT ends, load every state_dict found in CKPT (the object itself,
                        or a top-level value of a dict) with `load_state_dict(strict=True)` into
                        the module of SCRIPT's run that has exactly its keys; results in "loads".
--probe-eval-with CKPT  whenever SCRIPT switches a module with exactly the keys of CKPT's first
                        state_dict to eval mode, swap CKPT's weights in (and back on `train()`):
                        SCRIPT's own evaluation code then evaluates CKPT, in one process, on
                        the whole evaluation set.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import os
import pickle
import runpy
import signal
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import RandomSampler  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import gpumigrate.runtime as runtime_pkg  # noqa: E402
import gpumigrate.runtime.distributed as runtime_dist  # noqa: E402

TORCH_SAVE = torch.save
USAGE = "usage: probe.py [--probe-load CKPT]... [--probe-eval-with CKPT] OUT_DIR SCRIPT [ARGS...]"


class Recorder:
    def __init__(self) -> None:
        self.models: list = []          # what wrap_model returned, in call order
        self.wrap_calls: list = []
        self.iterations: list = []      # one entry per sampler __iter__, in time order
        self.last_iteration: Optional[dict] = None  # the iteration that yielded last (a step counts for it)
        self._samplers: list = []       # strong refs: keeps id() unique
        self.saves: list = []
        self.modules: dict = {}         # id -> module seen in the run (for --probe-load)
        self.eval_swaps = 0

    def sampler_id(self, sampler) -> int:
        for i, known in enumerate(self._samplers):
            if known is sampler:
                return i
        self._samplers.append(sampler)
        return len(self._samplers) - 1

    def see(self, module) -> None:
        self.modules.setdefault(id(module), module)


REC = Recorder()


class Tee:
    """sys.stdout that also keeps what this process printed."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.parts: list = []
        self.lines: list = []   # [optimizer steps before it, evaluation window or None, text, script line]
        self._partial = ""

    def write(self, text):
        self.parts.append(text)
        if len(self.lines) < MAX_LINES:
            *done, self._partial = (self._partial + text).split("\n")
            at = _script_line(2) if VERIFY.active and done else None
            for line in done:
                self.lines.append([VERIFY.steps_taken, VERIFY.window, line, at])
        return self.stream.write(text)

    def flush(self):
        return self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


# ---------------------------------------------------------------- instrumentation

def _patch_wrap_model() -> None:
    original = runtime_dist.wrap_model

    def wrap_model(model, *args, **kwargs):
        wrapped = original(model, *args, **kwargs)
        REC.models.append(wrapped)
        REC.wrap_calls.append({"args": [repr(a) for a in args], "kwargs": {k: repr(v) for k, v in kwargs.items()}})
        return wrapped

    wrap_model.__doc__ = original.__doc__
    wrap_model.__wrapped__ = original
    runtime_dist.wrap_model = wrap_model
    runtime_pkg.wrap_model = wrap_model  # `from gpumigrate.runtime import wrap_model` reads this one


def _describe(sampler, kind):
    info = {"kind": kind, "sampler": REC.sampler_id(sampler)}
    try:
        info["length"] = len(sampler)  # what this rank draws per pass
    except TypeError:
        pass
    if kind == "DistributedSampler":
        info.update(dataset_len=len(sampler.dataset), num_replicas=sampler.num_replicas,
                    sampler_rank=sampler.rank, shuffle=bool(sampler.shuffle), drop_last=bool(sampler.drop_last),
                    epoch=int(sampler.epoch))
    elif kind == "RandomSampler":
        info.update(dataset_len=len(sampler.data_source), replacement=bool(sampler.replacement))
    else:  # _Shard keeps range(rank, len(dataset), world_size)
        rng = sampler.indices
        if isinstance(rng, range):
            info.update(dataset_len=rng.stop, start=rng.start, step=rng.step)
    return info


def _patch_iter(cls, kind) -> None:
    original = cls.__iter__

    def __iter__(self):
        entry = _describe(self, kind)
        entry["call"] = sum(it["sampler"] == entry["sampler"] for it in REC.iterations)  # this sampler's epoch
        entry["indices"] = []
        entry["steps"] = 0  # optimizer steps taken while this iteration was the last to yield
        REC.iterations.append(entry)
        # Lazily, as the original yields: the RNG is drawn at the same moment as without the probe.
        for index in original(self):
            entry["indices"].append(int(index))
            REC.last_iteration = entry
            yield index

    __iter__.__wrapped__ = original
    cls.__iter__ = __iter__


def _patch_save() -> None:
    original = torch.save

    def save(obj, f, *args, **kwargs):
        path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))
        REC.saves.append({"path": os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else str(path),
                          "kind": type(obj).__name__, "state_dicts": {k: sorted(v) for k, v in _state_dicts(obj).items()},
                          "entries": {str(k): _entry_kind(v) for k, v in list(obj.items())[:50]}
                          if isinstance(obj, dict) else {}})
        return original(obj, f, *args, **kwargs)

    save.__wrapped__ = original
    torch.save = save


def _entry_kind(value) -> str:
    if isinstance(value, dict) and {"state", "param_groups"} <= set(value):
        return "optimizer"
    if isinstance(value, dict) and {"scale", "growth_factor"} <= set(value):
        return "scaler"
    if _is_state_dict(value):
        return "state_dict"
    return type(value).__name__


def _patch_module_tracking(eval_with) -> None:
    """Remember the modules the script uses (for --probe-load); swap weights in for eval."""
    original_train = nn.Module.train
    original_state_dict = nn.Module.state_dict
    target = _first_state_dict(eval_with) if eval_with else None
    target_keys = set(target) if target is not None else None
    saved: dict = {}

    def train(self, mode=True):
        REC.see(self)
        VERIFY.mode_change(self, mode, original_state_dict)
        if target_keys is not None and set(original_state_dict(self)) == target_keys:
            if not mode and id(self) not in saved:
                saved[id(self)] = copy.deepcopy(original_state_dict(self))
                self.load_state_dict(target, strict=True)
                REC.eval_swaps += 1
            elif mode and id(self) in saved:
                self.load_state_dict(saved.pop(id(self)), strict=True)
        return original_train(self, mode)

    def state_dict(self, *args, **kwargs):
        REC.see(self)
        return original_state_dict(self, *args, **kwargs)

    nn.Module.train = train
    nn.Module.state_dict = state_dict
    torch.nn.modules.module.register_module_forward_pre_hook(lambda module, inputs: REC.see(module))


# ---------------------------------------------------------------- optimizers, loads, outputs, forwards

class Extras:
    """What the extra instrumentation records (for tests/test_patterns_e2e.py)."""

    def __init__(self) -> None:
        self.active = False
        self.optimizers: list = []      # {"optimizer", "initial", "steps", "changed"}, in construction order
        self.by_id: dict = {}
        self.loads: list = []
        self.copies: list = []
        self.pickles: list = []
        self.forwards: dict = {}        # (class, class module, training, grad enabled) -> count
        # per optimizer step, a fingerprint of the first tensor given to each outermost training
        # forward (grad enabled) since the step before: ranks that train on their own data
        # differ step by step
        self.inputs: list = []
        self.since_step: list = []
        # per step, the rows (dim 0) of those first tensors: a rank training on its share of a
        # full batch gives its forwards 1/N of them
        self.rows: list = []
        self.since_rows = 0
        self.depth = 0
        self.backwards = 0              # outermost backward() calls (gradient accumulation split per rank)
        self.in_backward = False


EXTRA = Extras()


MAX_INPUTS = 2000


def _optimizer_vector(optimizer, sharded: bool = False) -> torch.Tensor:
    """The optimizer's parameters flattened: those every rank holds whole, or (`sharded`) this
    rank's shards of the sharded ones (FSDP2's DTensors), which differ per rank by design."""
    params = [p for group in optimizer.param_groups for p in group["params"] if hasattr(p, "to_local") == sharded]
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([(p.to_local() if sharded else p).detach().to("cpu", torch.float64).reshape(-1) for p in params])


def _entry(optimizer) -> Optional[dict]:
    """The record of `optimizer` (not of another object that reused its id), or None."""
    entry = EXTRA.by_id.get(id(optimizer))
    return entry if entry is not None and entry["optimizer"] is optimizer else None


def _patch_optimizers() -> None:
    """Every Optimizer (subclasses call Optimizer.__init__), and whether each step moved it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    original_init = torch.optim.Optimizer.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if EXTRA.active:
            entry = {"optimizer": self, "index": len(EXTRA.optimizers), "initial": _optimizer_vector(self),
                     "steps": 0, "changed": 0, "before": None, "after": None}
            EXTRA.optimizers.append(entry)
            EXTRA.by_id[id(self)] = entry

    def before_step(optimizer, args, kwargs):
        entry = _entry(optimizer)
        if entry is not None:
            entry["before"], entry["after"] = _optimizer_vector(optimizer), None

    def enter(module, inputs):
        EXTRA.depth += 1
        if EXTRA.depth == 1 and EXTRA.active and module.training and torch.is_grad_enabled() \
                and len(EXTRA.inputs) < MAX_INPUTS and len(EXTRA.since_step) < MAX_INPUTS:
            tensor = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
            if tensor is not None:
                values = tensor.detach().to("cpu", torch.float64).reshape(-1)
                EXTRA.since_step.append(f"{tuple(tensor.shape)}:{float(values.sum()):.12g}:"
                                        f"{float(values.square().sum()):.12g}")
                EXTRA.since_rows += int(tensor.shape[0]) if tensor.dim() else 1

    def leave(module, inputs, output):
        EXTRA.depth = max(0, EXTRA.depth - 1)

    def after_step(optimizer, args, kwargs):
        if REC.last_iteration is not None:
            REC.last_iteration["steps"] += 1
        if EXTRA.active and EXTRA.since_step and len(EXTRA.inputs) < MAX_INPUTS:
            EXTRA.inputs.append(hashlib.sha1("|".join(EXTRA.since_step).encode()).hexdigest()[:16])
            EXTRA.rows.append(EXTRA.since_rows)
        EXTRA.since_step, EXTRA.since_rows = [], 0
        entry = _entry(optimizer)
        if entry is not None and entry["before"] is not None:
            entry["after"] = _optimizer_vector(optimizer)  # verify's step record reads it too
            entry["steps"] += 1
            entry["changed"] += int(not torch.equal(entry["before"], entry["after"]))
            entry["before"] = None

    __init__.__wrapped__ = original_init
    torch.optim.Optimizer.__init__ = __init__
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)


def _patch_backward_count() -> None:
    """Count the outermost backward() calls (Tensor.backward calls torch.autograd.backward)."""
    original_method, original_function = torch.Tensor.backward, torch.autograd.backward

    def counted(original):
        def backward(*args, **kwargs):
            if EXTRA.in_backward or not EXTRA.active:
                return original(*args, **kwargs)
            EXTRA.backwards += 1
            EXTRA.in_backward = True
            try:
                return original(*args, **kwargs)
            finally:
                EXTRA.in_backward = False
        backward.__wrapped__ = original
        return backward

    torch.Tensor.backward = counted(original_method)
    torch.autograd.backward = counted(original_function)


def _loaded_kind(obj) -> str:
    if isinstance(obj, nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if _is_state_dict(obj):
        return "state_dict"
    if isinstance(obj, (list, tuple)) and any(isinstance(o, nn.Module) for o in obj):
        return "container with a module"
    return type(obj).__name__


def _patch_loads_and_outputs() -> None:
    import pickle
    import shutil

    original_load = torch.load

    def load(f, *args, **kwargs):
        result = original_load(f, *args, **kwargs)
        if EXTRA.active:
            path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))
            EXTRA.loads.append({"path": os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else str(path),
                                "weights_only": kwargs.get("weights_only", "default"), "result": _loaded_kind(result)})
        return result

    load.__wrapped__ = original_load
    torch.load = load

    for name in ("copyfile", "copy", "copy2"):
        original = getattr(shutil, name)

        def copy(src, dst, *args, _original=original, _name=name, **kwargs):
            if EXTRA.active:
                EXTRA.copies.append({"function": _name, "src": os.path.abspath(os.fspath(src)),
                                     "dst": os.path.abspath(os.fspath(dst))})
            return _original(src, dst, *args, **kwargs)

        copy.__wrapped__ = original
        setattr(shutil, name, copy)

    original_dump = pickle.dump

    def dump(obj, file, *args, **kwargs):
        if EXTRA.active:
            name = getattr(file, "name", None)
            EXTRA.pickles.append({"file": os.path.abspath(name) if isinstance(name, str) else repr(file),
                                  "kind": type(obj).__name__})
        return original_dump(obj, file, *args, **kwargs)

    dump.__wrapped__ = original_dump
    pickle.dump = dump


def _patch_forwards() -> None:
    def hook(module, inputs, output):
        if EXTRA.active:
            cls = type(module)
            key = (cls.__qualname__, cls.__module__, bool(module.training), torch.is_grad_enabled())
            EXTRA.forwards[key] = EXTRA.forwards.get(key, 0) + 1

    torch.nn.modules.module.register_module_forward_hook(hook)


def _patch_extras() -> None:
    """The instrumentation described under `optimizers`, `torch_loads`, `copies`, `pickles`
    and `forwards` in the module docstring; it records while SCRIPT runs."""
    _patch_optimizers()
    _patch_backward_count()
    _patch_loads_and_outputs()
    if os.environ.get("GPUMIGRATE_PROBE_FORWARDS"):
        _patch_forwards()
    EXTRA.active = True


def _describe_extras(out_dir: Path, rank: int) -> dict:
    """Stop recording; the report entries, and the optimizers' vectors as .pt files."""
    EXTRA.active = False
    optimizers = []
    for i, entry in enumerate(EXTRA.optimizers):
        optimizer = entry["optimizer"]
        final = _optimizer_vector(optimizer)
        TORCH_SAVE(final, out_dir / f"rank{rank}_optim{i}.pt")
        TORCH_SAVE(entry["initial"], out_dir / f"rank{rank}_optim{i}_init.pt")
        optimizers.append({
            "index": i,
            "class": type(optimizer).__qualname__,
            "groups": len(optimizer.param_groups),
            "tensors": sum(len(g["params"]) for g in optimizer.param_groups),
            "num_params": int(final.numel()),
            "steps": entry["steps"],
            "steps_that_changed_parameters": entry["changed"],
            "vector": f"rank{rank}_optim{i}.pt",
            "initial": f"rank{rank}_optim{i}_init.pt",
        })
    forwards = [{"module": k[0], "module_of_class": k[1], "training": k[2], "grad_enabled": k[3], "calls": n}
                for k, n in sorted(EXTRA.forwards.items())]
    return {"optimizers": optimizers, "torch_loads": EXTRA.loads, "copies": EXTRA.copies,
            "pickles": EXTRA.pickles, "forwards": forwards, "inputs": EXTRA.inputs, "backwards": EXTRA.backwards,
            "rows": EXTRA.rows}


# ---------------------------------------------------------------- verify: steps, output, files, hangs

MAX_LINES = 20000
MAX_STEP_RECORDS = 2000
GRAPH_SCAN_STEPS = 12      # steps whose live autograd graphs are measured (a leak shows in a few)


class Verify:
    """What `gpumigrate verify` compares, recorded while SCRIPT runs (config in the environment
    variable GPUMIGRATE_VERIFY, a JSON object; see gpumigrate/verify/shim.py for its keys):

    * `steps`: one entry per optimizer step, in order: which optimizer, the values of the
      scalar tensors `backward()` was called on since the step before (a GradScaler's scaled
      loss divided by its scale), and (sum, sum of squares) of its parameters after the step;
    * `windows`: an evaluation window opens when a module an optimizer trains is switched to
      eval mode and closes at its `train()` or the next step; printed lines carry their
      window's number, and at the first one the module's state_dict (DDP unwrapped) is saved
      as OUT_DIR/rank{RANK}_eval.pt, so one process can evaluate the same weights;
    * `retained`: per step (the first few), the names in the script's frames (a tensor, or a
      list or dict of them) that still hold the graphs of two earlier steps: graphs kept
      across steps, which grow until memory runs out;
    * `writes`: files opened for writing with open();
    * a stall watchdog: in a process group, a rank that makes no progress (no forward, no
      step, no batch) for `stall` seconds writes where it waits and exits with status 3.
    """

    def __init__(self) -> None:
        self.config: dict = {}
        self.active = False
        self.steps_taken = 0
        self.records: list = []
        self.losses: list = []
        self.scaled: dict = {}
        self.window = None
        self.windows = 0
        self.retained: list = []
        self.writes: list = []
        self.progress = time.monotonic()
        self.in_backward = False
        self.script_dir = ""
        self.out_dir: Optional[Path] = None
        self.rank = 0
        self.trained_ids: set = set()
        self.trained_count = -1
        self.backward_at: Optional[str] = None
        self.loss_dtypes: set = set()
        self.roots: list = []            # this step's backward() roots
        self.root_history: list = []     # the roots of the steps before, oldest first
        self.stepping: set = set()       # ids of the optimizers that stepped
        self.scalers = 0

    def trained(self, module) -> bool:
        if self.trained_count != len(EXTRA.optimizers):
            self.trained_count = len(EXTRA.optimizers)
            self.trained_ids = {id(p) for e in EXTRA.optimizers for g in e["optimizer"].param_groups
                                for p in g["params"]}
        return any(id(p) in self.trained_ids for p in module.parameters())

    def mode_change(self, module, mode, state_dict) -> None:
        if not self.active:
            return
        if mode and self.window is not None:
            self.window = None
        elif not mode and self.window is None and self.trained(module):
            self.window = self.windows
            self.windows += 1
            if self.window == 0 and self.out_dir is not None:
                inner = runtime_dist.unwrap_model(module)
                # a sharded model's (FSDP2) tensors are gathered whole: every rank is here too
                TORCH_SAVE({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                            for k, v in state_dict(inner).items()}, self.out_dir / f"rank{self.rank}_eval.pt")


VERIFY = Verify()


def _script_line(depth: int = 2) -> Optional[str]:
    """file:line of the innermost frame of the script's own code (its folder) calling us."""
    frame = sys._getframe(depth)
    while frame is not None:
        if frame.f_code.co_filename.startswith(VERIFY.script_dir):
            return f"{os.path.relpath(frame.f_code.co_filename, VERIFY.script_dir)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _record_loss(tensor) -> None:
    if VERIFY.active and not VERIFY.in_backward and isinstance(tensor, torch.Tensor) and tensor.numel() == 1:
        value = float(tensor.detach().reshape(()).to("cpu", torch.float64))
        scale = VERIFY.scaled.pop(id(tensor), None)
        VERIFY.losses.append(value / scale if scale else value)
        VERIFY.loss_dtypes.add(str(tensor.dtype).replace("torch.", ""))
        if tensor.grad_fn is not None and len(VERIFY.retained) < GRAPH_SCAN_STEPS:
            VERIFY.roots.append(tensor.grad_fn)  # kept to the next step's scan: its id stays unique
        if VERIFY.backward_at is None:
            VERIFY.backward_at = _script_line(3)


def _patch_backward() -> None:
    original_method, original_function = torch.Tensor.backward, torch.autograd.backward

    def backward(self, *args, **kwargs):
        _record_loss(self)
        VERIFY.in_backward = True  # Tensor.backward calls torch.autograd.backward: count once
        try:
            return original_method(self, *args, **kwargs)
        finally:
            VERIFY.in_backward = False
            VERIFY.progress = time.monotonic()

    def autograd_backward(tensors, *args, **kwargs):
        _record_loss(tensors if isinstance(tensors, torch.Tensor) else None)
        return original_function(tensors, *args, **kwargs)

    torch.Tensor.backward = backward
    torch.autograd.backward = autograd_backward
    original_scale = torch.amp.GradScaler.scale

    def scale(self, outputs):
        scaled = original_scale(self, outputs)
        if isinstance(scaled, torch.Tensor) and scaled is not outputs and self.is_enabled():
            VERIFY.scaled[id(scaled)] = float(self.get_scale())
        return scaled

    torch.amp.GradScaler.scale = scale
    original_init = torch.amp.GradScaler.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        VERIFY.scalers += 1

    torch.amp.GradScaler.__init__ = __init__


def _reaches(fn, roots: set, limit: int = 5000) -> bool:
    """Does the autograd graph above node `fn` contain one of `roots` (ids of nodes)?"""
    seen, todo = set(), [fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in roots:
            return True
        seen.add(id(node))
        todo.extend(next_fn for next_fn, _ in getattr(node, "next_functions", ()))
    return False


def _holds(value, roots: set, depth: int = 0) -> bool:
    """Does `value` (a tensor, or lists, tuples and dicts of them) keep one of `roots` alive?"""
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None and _reaches(value.grad_fn, roots)
    if depth < 2 and isinstance(value, dict):
        return any(_holds(v, roots, depth + 1) for v in list(value.values())[-100:])
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds(v, roots, depth + 1) for v in value[-100:])
    return False


def _scan_graphs(optimizer) -> None:
    """The names in the script's own frames that, after this step, still hold the graphs of
    two earlier steps (the graphs of the losses they called backward() on): `total += loss`
    and `losses.append(loss)` without `.item()`. Steps are counted in cycles of the
    optimizers in use (a GAN's D and G steps are one cycle): the loss of the cycle before,
    still in a local, and a `last_loss = loss` that holds one graph are not leaks."""
    VERIFY.stepping.add(id(optimizer))
    cycle = len(VERIFY.stepping)
    history = VERIFY.root_history
    held: dict = {}
    if len(history) >= 2 * cycle:
        older = [{id(fn) for fn in history[-k * cycle]} for k in (1, 2)]
        frame = sys._getframe(2)
        while all(older) and frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(VERIFY.script_dir):
                names = frame.f_globals if frame.f_code.co_name == "<module>" else frame.f_locals
                for name, value in list(names.items()):
                    if isinstance(value, nn.Module) or name.startswith("__"):
                        continue
                    if all(_holds(value, roots) for roots in older):
                        held[f"{os.path.basename(filename)}:{frame.f_code.co_name}:{name}"] = frame.f_lineno
            frame = frame.f_back
    VERIFY.retained.append(held)
    history.append(VERIFY.roots)
    del history[:-2 * cycle - 1]
    VERIFY.roots = []


def _patch_verify_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer, args, kwargs):
        VERIFY.steps_taken += 1
        VERIFY.window = None
        VERIFY.progress = time.monotonic()
        if len(VERIFY.records) < MAX_STEP_RECORDS:
            entry = _entry(optimizer)
            vector = entry["after"] if entry is not None and entry["after"] is not None \
                else _optimizer_vector(optimizer)
            shards = _optimizer_vector(optimizer, sharded=True)  # their sums over the ranks: the whole's
            VERIFY.records.append({"optimizer": entry["index"] if entry is not None else None, "losses": VERIFY.losses,
                                   "params": [float(vector.sum()), float(vector.square().sum())],
                                   "sharded": [float(shards.sum()), float(shards.square().sum())],
                                   "backward_at": VERIFY.backward_at, "step_at": _script_line(2),
                                   "dtypes": sorted(VERIFY.loss_dtypes | {str(p.dtype).replace("torch.", "")
                                                                          for g in optimizer.param_groups
                                                                          for p in g["params"][:50]})})
        VERIFY.loss_dtypes = set()
        VERIFY.losses, VERIFY.backward_at = [], None
        if len(VERIFY.retained) < GRAPH_SCAN_STEPS:
            _scan_graphs(optimizer)

    register_optimizer_step_post_hook(after_step)

    def progress(*args):
        VERIFY.progress = time.monotonic()

    torch.nn.modules.module.register_module_forward_pre_hook(progress)


def _patch_writes() -> None:
    import builtins
    original_open = builtins.open

    scratch = VERIFY.config.get("scratch")

    def open_(file, mode="r", *args, **kwargs):
        if VERIFY.active and isinstance(mode, str) and any(c in mode for c in "wax+") \
                and isinstance(file, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(file))
            if len(VERIFY.writes) < 1000:
                VERIFY.writes.append(path)
            if scratch:
                _keep_inside(path, scratch)
        return original_open(file, mode, *args, **kwargs)

    open_.__wrapped__ = original_open
    builtins.open = open_


def _keep_inside(path: str, scratch: str) -> None:
    """A verify run writes only inside its scratch folder: a large file of the user's that the
    copy links to is copied before it is written (copy on write); anything else is refused."""
    import shutil
    if os.path.islink(path) and os.path.realpath(path) != path and \
            os.path.abspath(os.path.dirname(path)).startswith(scratch):
        target = os.path.realpath(path)
        os.unlink(path)
        if os.path.exists(target):
            shutil.copyfile(target, path)
    real = os.path.realpath(path)
    if not (real.startswith(scratch) or real.startswith(os.path.realpath(scratch)) or real.startswith("/dev/")):
        raise PermissionError(f"gpumigrate verify: the script writes {path}, outside its scratch copy "
                              f"(verify never writes the user's files: give it a relative path)")


def _watch_for_stalls(seconds: float, finish) -> None:
    """In a process group: a rank that makes no progress for `seconds` is stuck in a collective
    the other ranks do not call (or in one a finished rank never joins): say where, and exit."""
    import faulthandler
    import threading
    import torch.distributed as dist

    def watch():
        while True:
            time.sleep(min(1.0, seconds / 4))
            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                VERIFY.progress = time.monotonic()
                continue
            if time.monotonic() - VERIFY.progress > seconds:
                path = VERIFY.out_dir / f"rank{VERIFY.rank}_stall.txt"
                with path.open("w") as f:
                    faulthandler.dump_traceback(file=f, all_threads=True)
                stack = path.read_text()
                finish({"type": "Stall", "message": f"no progress for {seconds:g} s (waiting in a collective?)",
                        "traceback": stack}, 3)
                os._exit(3)

    threading.Thread(target=watch, name="verify-stall-watch", daemon=True).start()


def _describe_verify() -> dict:
    return {"steps": VERIFY.records, "retained": VERIFY.retained, "writes": VERIFY.writes,
            "windows": VERIFY.windows, "pending_losses": VERIFY.losses, "scalers": VERIFY.scalers}


def _install_verify(out_dir: Path, rank: int, script: str) -> None:
    from gpumigrate.verify import shim
    VERIFY.config = json.loads(os.environ.get("GPUMIGRATE_VERIFY") or "{}")
    VERIFY.out_dir, VERIFY.rank = out_dir, rank
    VERIFY.script_dir = os.path.dirname(script) + os.sep
    shim.install(VERIFY.config)
    _patch_backward()
    _patch_verify_steps()
    _patch_writes()
    VERIFY.active = True


# ---------------------------------------------------------------- checkpoints

def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _state_dicts(obj) -> dict:
    """The state_dicts inside a saved object: {"": sd} for a bare one, {"model": sd, ...} for a
    dict holding some, {"<module>": sd} for a whole pickled module."""
    if isinstance(obj, nn.Module):
        return {"<module>": obj.state_dict()}
    if _is_state_dict(obj):
        return {"": obj}
    if isinstance(obj, dict):
        return {str(k): v for k, v in obj.items() if _is_state_dict(v)}
    return {}


SCRIPT_GLOBALS: dict = {}  # the script's namespace once it ended: its classes, for whole pickled models


class _ScriptUnpickler(pickle.Unpickler):
    """A model the script pickled whole names its classes `__main__.X`: after the run,
    `__main__` is the probe again, so they are looked up in the script's namespace."""

    def find_class(self, module, name):
        if module == "__main__" and name in SCRIPT_GLOBALS:
            return SCRIPT_GLOBALS[name]
        return super().find_class(module, name)


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False,
                      pickle_module=types.SimpleNamespace(Unpickler=_ScriptUnpickler, load=pickle.load,
                                                          __name__="pickle"))


def _first_state_dict(path):
    found = _state_dicts(_load(path))
    if not found:
        raise SystemExit(f"probe: no state_dict in {path}")
    return next(iter(found.values()))


def _load_into_modules(paths) -> list:
    results = []
    for path in paths:
        for entry, sd in _state_dicts(_load(path)).items():
            result = {"file": path, "entry": entry, "keys": len(sd), "loaded_into": None, "error": None}
            keys = set(sd)
            candidates = [m for m in REC.modules.values() if set(m.state_dict()) == keys]
            for module in candidates:
                try:
                    module.load_state_dict(sd, strict=True)
                except Exception as exc:  # shapes differ: try the next module with these keys
                    result["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                result["loaded_into"] = f"{type(module).__module__}.{type(module).__qualname__}"
                result["error"] = None
                break
            if not candidates:
                closest = max(REC.modules.values(), key=lambda m: len(keys & set(m.state_dict())), default=None)
                if closest is None:
                    result["error"] = "the script used no module"
                else:
                    own = set(closest.state_dict())
                    result["error"] = (f"no module of the script has exactly these keys; closest "
                                       f"{type(closest).__qualname__}: missing {sorted(own - keys)[:5]}, "
                                       f"unexpected {sorted(keys - own)[:5]}")
            results.append(result)
    return results


# ---------------------------------------------------------------- report

def _sha(tensors) -> str:
    digest = hashlib.sha256()
    for name, tensor in tensors:
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # the raw bytes, without numpy (a torch-only venv has none)
            raw = t.reshape(-1).view(torch.uint8)
            digest.update(ctypes.string_at(raw.data_ptr(), raw.numel()))
    return digest.hexdigest()


def _describe_models(out_dir: Path, rank: int) -> list:
    described = []
    for i, wrapped in enumerate(REC.models):
        module = runtime_dist.unwrap_model(wrapped)
        params = list(module.named_parameters())
        vector = (torch.cat([p.detach().to("cpu", torch.float64).reshape(-1) for _, p in params])
                  if params else torch.zeros(0, dtype=torch.float64))
        name = f"rank{rank}_model{i}.pt"
        TORCH_SAVE(vector, out_dir / name)  # the unpatched one: not one of the script's saves
        described.append({
            "index": i,
            "wrapper": type(wrapped).__name__,
            "module": type(module).__qualname__,
            "state_sha256": _sha(module.state_dict().items()),
            "params_sha256": _sha(params),
            "buffers_sha256": _sha(module.named_buffers()),
            "num_params": int(vector.numel()),
            "vector": name,
        })
    return described


def main(argv) -> None:
    load, eval_with = [], None
    while argv and argv[0].startswith("--probe-"):
        if len(argv) < 2:
            raise SystemExit(USAGE)
        option, value, argv = argv[0], argv[1], argv[2:]
        if option == "--probe-load":
            load.append(value)
        elif option == "--probe-eval-with":
            eval_with = value
        else:
            raise SystemExit(f"unknown option {option}\n{USAGE}")
    if len(argv) < 2:
        raise SystemExit(USAGE)
    out_dir, script, args = Path(argv[0]), os.path.abspath(argv[1]), argv[2:]
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    verify = "GPUMIGRATE_VERIFY" in os.environ

    _patch_wrap_model()
    _patch_iter(DistributedSampler, "DistributedSampler")
    _patch_iter(RandomSampler, "RandomSampler")
    _patch_iter(runtime_dist._Shard, "_Shard")
    _patch_save()
    if load or eval_with or verify:  # only where needed: keeps the runs under test as plain as possible
        _patch_module_tracking(eval_with)
    _patch_extras()
    if verify:
        _install_verify(out_dir, rank, script)

    # As `python SCRIPT` would: argv, and the script's own directory first on sys.path.
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    tee = sys.stdout = Tee(sys.stdout)
    start = time.perf_counter()
    written = []

    def finish(error, exit_code) -> None:
        """Write OUT_DIR/rank{RANK}.json (once: also from the stall watchdog's thread)."""
        if written:
            return
        written.append(True)
        if hasattr(signal, "pthread_sigmask"):  # torchrun's SIGTERM waits until the report is written
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        report = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "process_group_world_size": runtime_dist.get_world_size(),
            "script": script,
            "argv": args,
            "seconds": round(time.perf_counter() - start, 3),
            "error": error,
            "exit_code": exit_code,
            "stdout": "".join(tee.parts),
            "samplers": REC.iterations,
            "wrap_calls": REC.wrap_calls,
            "saves": REC.saves,
        }
        if verify:
            VERIFY.active = False
            report.update(_describe_verify(), lines=tee.lines + ([[VERIFY.steps_taken, VERIFY.window, tee._partial, None]]
                                                                 if tee._partial else []))
        try:
            report.update(_describe_extras(out_dir, rank))
        except Exception as exc:  # the report must be written whatever happens here
            report["extras_error"] = f"{type(exc).__name__}: {exc}"
        try:
            report["models"] = _describe_models(out_dir, rank)
        except Exception as exc:
            report["models"] = []
            report["models_error"] = f"{type(exc).__name__}: {exc}"
        if load:
            report["loads"] = _load_into_modules(load)
        if eval_with:
            report["eval_swaps"] = REC.eval_swaps
        path = out_dir / f"rank{rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    if verify and VERIFY.config.get("stall"):
        _watch_for_stalls(float(VERIFY.config["stall"]), finish)
    if verify and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # torchrun stops the other ranks when one fails: where each one was waiting, from C
        # (a rank blocked in a collective runs no Python signal handler)
        import faulthandler
        terminated = (out_dir / f"rank{rank}_terminated.txt").open("w")
        faulthandler.register(signal.SIGTERM, file=terminated, all_threads=True, chain=True)
        faulthandler.enable(file=terminated, all_threads=True)  # gloo aborts on a collective mismatch
        exit_now = runtime_dist._exit_now  # the runtime's own watch stops a rank whose peer failed

        def dump_then_exit(message):
            faulthandler.dump_traceback(file=terminated, all_threads=True)
            terminated.flush()
            exit_now(message)

        runtime_dist._exit_now = dump_then_exit

    error, exit_code, pending = None, 0, None
    try:
        SCRIPT_GLOBALS.update(runpy.run_path(script, run_name="__main__"))
    except SystemExit as exc:
        _keep_globals(exc, script)
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exit_code:
            error = {"type": "SystemExit", "message": str(exc.code), "traceback": traceback.format_exc()}
            pending = exc
    except BaseException as exc:  # recorded, then re-raised below
        _keep_globals(exc, script)
        error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        exit_code, pending = 1, exc
    sys.stdout = tee.stream
    tee.stream.flush()
    finish(error, exit_code)
    if pending is not None:
        raise pending


def _keep_globals(exc: BaseException, script: str) -> None:
    """The namespace of the script's own frame in `exc`'s traceback (it raised or exited)."""
    tb = exc.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(script):
            SCRIPT_GLOBALS.update(tb.tb_frame.f_globals)
            return
        tb = tb.tb_next


if __name__ == "__main__":
    main(sys.argv[1:])
