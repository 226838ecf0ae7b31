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
* `sys.stdout` is teed, so each rank's own printing is known.

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
        REC.iterations.append(entry)
        # Lazily, as the original yields: the RNG is drawn at the same moment as without the probe.
        for index in original(self):
            entry["indices"].append(int(index))
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
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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
