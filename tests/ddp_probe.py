"""Run a training script unchanged and record what DistributedDataParallel must get right.

    torchrun --standalone --nproc_per_node=2 tests/ddp_probe.py [OPTIONS] OUT_DIR SCRIPT [ARGS...]
    python tests/ddp_probe.py [OPTIONS] OUT_DIR SCRIPT [ARGS...]          # one process

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
import runpy
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import RandomSampler  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import gpumigrate.runtime as runtime_pkg  # noqa: E402
import gpumigrate.runtime.distributed as runtime_dist  # noqa: E402

TORCH_SAVE = torch.save
USAGE = "usage: ddp_probe.py [--probe-load CKPT]... [--probe-eval-with CKPT] OUT_DIR SCRIPT [ARGS...]"


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

    def write(self, text):
        self.parts.append(text)
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
                          "kind": type(obj).__name__, "state_dicts": {k: sorted(v) for k, v in _state_dicts(obj).items()}})
        return original(obj, f, *args, **kwargs)

    save.__wrapped__ = original
    torch.save = save


def _patch_module_tracking(eval_with) -> None:
    """Remember the modules the script uses (for --probe-load); swap weights in for eval."""
    original_train = nn.Module.train
    original_state_dict = nn.Module.state_dict
    target = _first_state_dict(eval_with) if eval_with else None
    target_keys = set(target) if target is not None else None
    saved: dict = {}

    def train(self, mode=True):
        REC.see(self)
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
        self.depth = 0


EXTRA = Extras()


MAX_INPUTS = 2000


def _optimizer_vector(optimizer) -> torch.Tensor:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([p.detach().to("cpu", torch.float64).reshape(-1) for p in params])


def _patch_optimizers() -> None:
    """Every Optimizer (subclasses call Optimizer.__init__), and whether each step moved it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    original_init = torch.optim.Optimizer.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if EXTRA.active:
            entry = {"optimizer": self, "initial": _optimizer_vector(self), "steps": 0, "changed": 0, "before": None}
            EXTRA.optimizers.append(entry)
            EXTRA.by_id[id(self)] = entry

    def before_step(optimizer, args, kwargs):
        entry = EXTRA.by_id.get(id(optimizer))
        if entry is not None and entry["optimizer"] is optimizer:
            entry["before"] = _optimizer_vector(optimizer)

    def enter(module, inputs):
        EXTRA.depth += 1
        if EXTRA.depth == 1 and EXTRA.active and module.training and torch.is_grad_enabled() \
                and len(EXTRA.inputs) < MAX_INPUTS and len(EXTRA.since_step) < MAX_INPUTS:
            tensor = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
            if tensor is not None:
                values = tensor.detach().to("cpu", torch.float64).reshape(-1)
                EXTRA.since_step.append(f"{tuple(tensor.shape)}:{float(values.sum()):.12g}:"
                                        f"{float(values.square().sum()):.12g}")

    def leave(module, inputs, output):
        EXTRA.depth = max(0, EXTRA.depth - 1)

    def after_step(optimizer, args, kwargs):
        if REC.last_iteration is not None:
            REC.last_iteration["steps"] += 1
        if EXTRA.active and EXTRA.since_step and len(EXTRA.inputs) < MAX_INPUTS:
            EXTRA.inputs.append(hashlib.sha1("|".join(EXTRA.since_step).encode()).hexdigest()[:16])
        EXTRA.since_step = []
        entry = EXTRA.by_id.get(id(optimizer))
        if entry is not None and entry["optimizer"] is optimizer and entry["before"] is not None:
            entry["steps"] += 1
            entry["changed"] += int(not torch.equal(entry["before"], _optimizer_vector(optimizer)))
            entry["before"] = None

    __init__.__wrapped__ = original_init
    torch.optim.Optimizer.__init__ = __init__
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)


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
            "pickles": EXTRA.pickles, "forwards": forwards, "inputs": EXTRA.inputs}


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


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _first_state_dict(path):
    found = _state_dicts(_load(path))
    if not found:
        raise SystemExit(f"ddp_probe: no state_dict in {path}")
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

    _patch_wrap_model()
    _patch_iter(DistributedSampler, "DistributedSampler")
    _patch_iter(RandomSampler, "RandomSampler")
    _patch_iter(runtime_dist._Shard, "_Shard")
    _patch_save()
    if load or eval_with:  # only for the reference run: keeps the runs under test as plain as possible
        _patch_module_tracking(eval_with)
    _patch_extras()

    # As `python SCRIPT` would: argv, and the script's own directory first on sys.path.
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    tee = sys.stdout = Tee(sys.stdout)

    error, exit_code, pending = None, 0, None
    start = time.perf_counter()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exit_code:
            error = {"type": "SystemExit", "message": str(exc.code), "traceback": traceback.format_exc()}
            pending = exc
    except BaseException as exc:  # recorded, then re-raised below
        error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        exit_code, pending = 1, exc
    seconds = time.perf_counter() - start
    sys.stdout = tee.stream
    tee.stream.flush()

    report = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "process_group_world_size": runtime_dist.get_world_size(),
        "script": script,
        "argv": args,
        "seconds": round(seconds, 3),
        "error": error,
        "exit_code": exit_code,
        "stdout": "".join(tee.parts),
        "samplers": REC.iterations,
        "wrap_calls": REC.wrap_calls,
        "saves": REC.saves,
    }
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
    if pending is not None:
        raise pending


if __name__ == "__main__":
    main(sys.argv[1:])
