"""What `--to ddp` does to real training scripts: the practice corpus (bench/practice_corpus.json),
each script migrated, run, and classified from what gpumigrate/verify/probe.py recorded.

    python bench/practice.py --python /tmp/venv-tv/bin/python [--at HEAD] [--only NAME[,NAME...]]
                             [--json OUT] [--md OUT] [--corpus DIR] [--scratch DIR] [--timeout 300] [-v]

The corpus lives OUTSIDE the repository (default /work/practice-corpus/<owner>__<repo>/<path>,
the files exactly as fetched; the manifest names repository, commit and path of each). For each
entry, in a scratch copy of its files (the script and the sibling modules it imports):

1. `python -m gpumigrate FILES --to device` and `--to ddp` (FILES: the script and its sibling
   modules, so a trainer class in solver.py is migrated too); the exit status, the "review by
   hand" lines, whether every output compiles, and whether a second `--to ddp` changes anything;
2. the `--to device` output in one process (the baseline: the original `.cuda()` script cannot
   run on a CPU) and the `--to ddp` output under `torch.distributed.run --standalone
   --nproc_per_node=2`, both under gpumigrate/verify/probe.py, with OMP_NUM_THREADS=1, a hard timeout,
   and bench/practice_shim/ on PYTHONPATH (fake datasets, capped loaders and steps: see its
   docstring), with the interpreter given by --python (one that has torchvision);
3. a class, from the probe's records of the ddp run:
   - data-parallel: every optimizer's parameters identical on both ranks at exit, and the work
     split (`work_split`, the definition of the hidden evaluation sets): each rank makes about
     1/N of the optimizer steps (or backward calls) of the one-process run, which must have
     ended by itself, drawing no sample another rank draws; where the one-process run is cut
     by the step cap, a DistributedSampler (or the runtime's shard) dealing N disjoint shards.
     Different random draws per rank alone grow the global batch and do not split the work;
   - sync-only: identical parameters, the work not split (each rank does all of it);
   - independent: the ranks end with different parameters (silently wrong unless a review item
     said so: the notes say which);
   - declined: the ranks end with different parameters, and gpumigrate said it would not make
     the script data-parallel (the reason quoted);
   - crash: the migration or the ddp run failed (the notes say whether the device baseline
     failed too: a crash the original does not have is the bad kind);
   - no training: gpumigrate found no training (evaluation or helper file).

With `--device-only`, only the `--to device` migration runs, in one process: whether an entry
runs and ends by itself under the caps (for tuning a new entry without seeing its ddp outcome).

Practice entries can be sealed (bench/practice_sealed.json): `--sealed` runs them and prints
totals only, `--unsealed` leaves them out; neither prints a sealed entry's name or outcome.

With `--verify`, each entry goes through `gpumigrate verify --to device` and `--to ddp` instead
(verify's own runs, fake data and checks; the table says equivalent, different or could not
judge, with the reason).

Manifest fields used besides repo/commit/path/extra_files: `args` (placeholders {text_file} and
{fake_imagefolder} are filled in), `fake_dirs` ({path: "images" | "imagefolder" | "text" |
"cora" | "dir"}: data made in the scratch copy before the runs), `pythonpath` (folders of the repository
to put on PYTHONPATH, as an installed package would be), `cwd` ("script", the default: the
script's folder, or "root"), `env` (e.g. {"PRACTICE_MAX_BATCHES": "8"} for a script that needs more
batches than the default cap).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpumigrate.verify.runs import LAUNCH_VARS, run_bounded  # noqa: E402

SHIM = ROOT / "bench" / "practice_shim"
SEALED = ROOT / "bench" / "practice_sealed.json"
MANIFEST = ROOT / "bench" / "practice_corpus.json"
CORPUS = Path("/work/practice-corpus")
NPROC = 2
SHIM_ENV = {"PRACTICE_SHIM": "1", "PRACTICE_MAX_BATCHES": "4", "PRACTICE_MAX_STEPS": "150",
            "PRACTICE_MAX_RANGE": "8",
            "PRACTICE_TRAIN_SIZE": "256", "MPLBACKEND": "Agg",
            # old generated protobuf code (tensorboard_logger) fails with today's protobuf otherwise
            "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
# gpumigrate's words for "this training stays single-process on every rank" (evaluation that is not
# sharded is not that: the ranks still train data-parallel)
DECLINED = re.compile(r"training data (NOT sharded|does not come from a DataLoader)|no model is wrapped|made only the device changes", re.I)
REVIEW = re.compile(r":\d+:\d+: GM\d+ review by hand")  # not the summary line's "N to review by hand"
NO_TRAINING = re.compile(r"no training found", re.I)


# ---------------------------------------------------------------- fake data files

def _png(path: Path, size: int, seed: int) -> None:
    import random
    import struct
    import zlib
    rng = random.Random(seed)
    raw = b"".join(b"\x00" + bytes(rng.getrandbits(8) for _ in range(size * 3)) for _ in range(size))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from at which "
         "but have an they you were her she there one all we their been has when who will more no if out "
         "so said what up its about into than them can only other new some could time these two may then "
         "do first any my now such like our over man me even most made after also did many before must "
         "through back years where much your way well down should because each just those people").split()


def make_fake(kind: str, path: Path) -> None:
    """Data files of a generic kind, deterministic, small."""
    import random
    rng = random.Random(0)
    if kind == "images":
        for i in range(16):
            _png(path / f"img{i}.png", 96, i)
    elif kind == "imagefolder":
        for split in ("train", "val"):
            for c in range(2):
                for i in range(8):
                    _png(path / split / f"class{c}" / f"{i}.png", 64, hash((split, c, i)) & 0xFFFF)
    elif kind == "text":
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
                 for _ in range(300)]
        path.write_text("\n".join(lines) + "\n")
    elif kind == "cora":  # Planetoid's cora.content / cora.cites layout, as many papers as Cora (2708)
        path.mkdir(parents=True, exist_ok=True)
        labels = ["Case_Based", "Genetic_Algorithms", "Neural_Networks", "Probabilistic_Methods",
                  "Reinforcement_Learning", "Rule_Learning", "Theory"]
        ids = [1000 + 7 * i for i in range(2708)]
        path.joinpath("cora.content").write_text("".join(
            f"{p}\t" + "\t".join(str(int(rng.random() < 0.05)) for _ in range(64)) + f"\t{rng.choice(labels)}\n"
            for p in ids))
        path.joinpath("cora.cites").write_text("".join(f"{rng.choice(ids)}\t{rng.choice(ids)}\n" for _ in range(5429)))
    elif kind == "dir":  # an empty folder the script expects to exist (a repository's placeholder)
        path.mkdir(parents=True, exist_ok=True)
    else:
        raise SystemExit(f"unknown fake_dirs kind {kind!r}")


# ---------------------------------------------------------------- one entry

def corpus_dir(entry: dict, corpus: Path) -> Path:
    return corpus / entry["repo"].replace("/", "__")


def copy_files(entry: dict, corpus: Path, dest: Path) -> None:
    src = corpus_dir(entry, corpus)
    for rel in [entry["path"], *entry.get("extra_files", [])]:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)


def py_files(entry: dict) -> List[str]:
    return [entry["path"], *[f for f in entry.get("extra_files", []) if f.endswith(".py")]]


def migrate(tool_python: str, folder: Path, files: List[str], target: str, gm_root: Path) -> dict:
    cmd = [tool_python, "-m", "gpumigrate", *files, "--to", target, "--no-cache"]
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(gm_root)
    proc = subprocess.run(cmd, cwd=str(folder), capture_output=True, text=True, timeout=600, env=env)
    review = [line for line in proc.stderr.splitlines() if REVIEW.search(line)]
    errors = [line for line in proc.stderr.splitlines()
              if re.search(r": (cannot parse|internal error|error)", line) and "review by hand" not in line]
    compiles, compile_errors = True, []
    for rel in files:
        try:
            compile((folder / rel).read_bytes(), rel, "exec")
        except SyntaxError as exc:
            compiles = False
            compile_errors.append(f"{rel}:{exc.lineno}: {exc.msg}")
    summary = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    return {"target": target, "exit": proc.returncode, "review": review, "errors": errors, "compiles": compiles,
            "compile_errors": compile_errors, "summary": summary, "seconds": round(time.perf_counter() - start, 2)}


def snapshot(folder: Path, files: List[str]) -> Dict[str, bytes]:
    return {rel: (folder / rel).read_bytes() for rel in files}


def run_env(work: Path, entry: dict, root: Path, gm_root: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_", "PYTHON"))}
    paths = [str(SHIM), str(gm_root), *[str(root / p) for p in entry.get("pythonpath", [])]]
    env.update(SHIM_ENV, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths), TMPDIR=str(work / "tmp"),
               PYTHONHASHSEED="0", HOME=str(work / "home"), PRACTICE_ROOT=str(work))
    env.update(entry.get("env", {}))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(parents=True, exist_ok=True)
    return env


def launch(python: str, root: Path, entry: dict, args: List[str], nproc: int, timeout: float, gm_root: Path) -> dict:
    script = root / entry["path"]
    cwd = root if entry.get("cwd") == "root" else script.parent
    out = root / "_probe"
    launcher = [python] if nproc == 1 else [python, "-m", "torch.distributed.run", "--standalone",
                                            f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(gm_root / "gpumigrate" / "verify" / "probe.py"), str(out), str(script), *args]
    code, stdout, stderr, seconds = run_bounded(cmd, cwd, run_env(root, entry, root, gm_root), timeout)
    ranks = {}
    for report in sorted(out.glob("rank*.json")):
        data = json.loads(report.read_text())
        ranks[data["rank"]] = data
    errors = {r: rep["error"] for r, rep in ranks.items() if rep.get("error")}
    ok = code == 0 and sorted(ranks) == list(range(nproc)) and not errors
    shim = sorted(set(re.findall(r"\[verify\] ([^\n]*)", stderr)))
    return {"nproc": nproc, "cmd": cmd, "returncode": code, "timed_out": code is None, "ok": ok,
            "seconds": round(seconds, 1), "ranks": ranks, "out": str(out),
            "error": _error_line(code, ranks, stderr, timeout), "stderr_tail": stderr[-4000:], "shim": shim,
            "stopped_by_step_cap": "optimizer steps (--steps)" in stderr}


def _error_line(code, ranks, stderr, timeout) -> Optional[str]:
    if code is None:
        return f"timed out after {timeout:.0f} s"
    secondary = re.compile(r"Connection closed by peer|Connection reset|rank \d+ failed|stopping rank")
    # the root cause first: a rank's own error before another rank's "the peer went away"
    def order(item):
        return bool(secondary.search(str((item[1].get("error") or {}).get("message")))), item[0]

    for r, rep in sorted(ranks.items(), key=order):
        err = rep.get("error")
        if err:
            tb = err.get("traceback", "")
            where = re.findall(r'File "([^"]+)", line (\d+)', tb)
            loc = f" at {Path(where[-1][0]).name}:{where[-1][1]}" if where else ""
            return f"rank {r}: {err['type']}: {err['message'][:300]}{loc}"
    if code != 0:
        lines = [ln for ln in stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
        return f"exit {code}: " + (lines[-1][:300] if lines else "(no output)")
    if not ranks:
        return "no probe report"
    return None


# ---------------------------------------------------------------- classification

def _load_vec(out: str, name: str):
    import torch
    return torch.load(Path(out) / name)


def compare_optimizers(run: dict) -> dict:
    import torch
    r0, r1 = run["ranks"].get(0, {}), run["ranks"].get(1, {})
    o0, o1 = r0.get("optimizers", []), r1.get("optimizers", [])
    result = {"count": len(o0), "steps": [o["steps"] for o in o0],
              "changed": [o["steps_that_changed_parameters"] for o in o0],
              "identical": [], "max_abs_diff": [], "moved": []}
    if len(o0) != len(o1):
        result["mismatch"] = f"rank 0 built {len(o0)} optimizers, rank 1 {len(o1)}"
        return result
    for a, b in zip(o0, o1):
        va, vb = _load_vec(run["out"], a["vector"]), _load_vec(run["out"], b["vector"])
        if va.shape != vb.shape:
            result["identical"].append(False)
            result["max_abs_diff"].append(None)
        else:
            result["identical"].append(bool(torch.equal(va, vb)))
            result["max_abs_diff"].append(float((va - vb).abs().max()) if va.numel() else 0.0)
        init = _load_vec(run["out"], a["initial"])
        result["moved"].append(bool(init.shape != va.shape or not torch.equal(init, va)))
    return result


def sharding(run: dict) -> dict:
    """The training sampler of the ddp run: of rank 0's first pass of each sampler, the one most
    optimizer steps followed (the probe counts a step for the sampler that yielded last), then
    the one that drew most indices (a training loop beside a larger evaluation set)."""
    r0, r1 = run["ranks"].get(0, {}), run["ranks"].get(1, {})
    first = lambda rep: {s["sampler"]: s for s in rep.get("samplers", []) if s.get("call") == 0}  # noqa: E731
    s0, s1 = first(r0), first(r1)
    if not s0:
        return {"sharded": False, "why": "no sampler recorded"}
    best = max(s0.values(), key=lambda s: (s.get("steps", 0), len(s["indices"])))
    other = s1.get(best["sampler"])
    info = {"kind": best["kind"], "dataset_len": best.get("dataset_len"), "drawn": [len(best["indices"])]}
    replicas = best.get("num_replicas") or best.get("step") or 1
    info["replicas"] = replicas
    if other is None:
        info.update(sharded=False, why="rank 1 has no matching sampler")
        return info
    a, b = set(best["indices"]), set(other["indices"])
    info["drawn"].append(len(other["indices"]))
    info["overlap"] = len(a & b)
    sharded = (best["kind"] in ("DistributedSampler", "_Shard") and replicas == NPROC
               and len(a & b) <= max(1, len(a) // 50))
    info["sharded"] = bool(sharded and a and b)
    info["why"] = (f"{best['kind']}, {replicas} replica(s), ranks drew {len(a)} and {len(b)} of "
                   f"{best.get('dataset_len')} (overlap {len(a & b)})")
    return info


def _count(run: Optional[dict], rank: int, what: str) -> int:
    rep = (run or {}).get("ranks", {}).get(rank, {})
    if what == "steps":
        return sum(o.get("steps", 0) for o in rep.get("optimizers") or [])
    return int(rep.get("backwards") or 0)


# "about 1/N" of the one-process run's work, for N = NPROC
SPLIT_LOW, SPLIT_HIGH = 0.6 / NPROC, 1.4 / NPROC


def _drawn(run: Optional[dict], rank: int) -> int:
    """Samples the training passes drew: the indices of the sampler passes an optimizer step
    followed (the probe records them as they are yielded)."""
    rep = (run or {}).get("ranks", {}).get(rank, {})
    return sum(len(s.get("indices", ())) for s in rep.get("samplers", []) if s.get("steps"))


def _rows(run: Optional[dict], rank: int) -> float:
    """The mean rows (dim 0) the training forwards took per optimizer step."""
    rows = (run or {}).get("ranks", {}).get(rank, {}).get("rows") or []
    return sum(rows) / len(rows) if rows else 0.0


def work_split(rec: dict) -> dict:
    """Is the training work split between the ranks, as the hidden sets' oracle defines it? With a
    training DataLoader, each rank draws about 1/N of the samples one process draws; without one,
    each rank makes about 1/N of its optimizer steps (or of its backward calls per step, where
    gradient accumulation is split). Counted on complete runs: the one-process run must end by
    itself (not at the step cap; bench/practice_shim caps hard-coded loops and shortens a sharded
    pass in proportion), else only a sampler that deals disjoint shards can tell."""
    dev, ddp = rec.get("device_run"), rec.get("ddp_run")
    sampler = sharding(ddp)
    out = {"sampler": sampler}
    steps_dev, back_dev = _count(dev, 0, "steps"), _count(dev, 0, "backwards")
    comparable = bool(dev and dev["ok"] and not dev.get("stopped_by_step_cap") and steps_dev >= 2)
    if not comparable:
        out["split"] = sampler["sharded"]
        out["why"] = sampler["why"] + ("; steps not comparable: " + (
            "the one-process run stopped at the step cap" if dev and dev.get("stopped_by_step_cap")
            else "the one-process run did not train" if dev and dev["ok"] else "the one-process run failed"))
        return out
    ranks = sorted((ddp or {}).get("ranks", {}))
    about = lambda mine, whole: bool(whole) and SPLIT_LOW <= mine / whole <= SPLIT_HIGH  # noqa: E731
    steps = [_count(ddp, r, "steps") for r in ranks]
    backs = [_count(ddp, r, "backwards") for r in ranks]
    drawn, drawn_dev = [_drawn(ddp, r) for r in ranks], _drawn(dev, 0)
    step_split = bool(steps) and all(about(x, steps_dev) for x in steps)
    # gradient accumulation split: as many steps, each of about 1/N of the backward calls
    back_split = bool(backs) and back_dev >= 2 and all(
        x and about(b / x, back_dev / steps_dev) for b, x in zip(backs, steps))
    sample_split = drawn_dev > 0 and all(about(d, drawn_dev) for d in drawn) and sampler["sharded"]
    # a full batch split by rows (shard_rows): as many steps, each rank's forwards 1/N of the rows
    rows_dev = _rows(dev, 0)
    rows = [_rows(ddp, r) for r in ranks]
    rows_split = rows_dev > 0 and all(about(x, rows_dev) for x in rows)
    overlapping = sampler.get("overlap", 0) > max(1, (sampler.get("drawn") or [0])[0] // 50) \
        and sampler.get("kind") in ("DistributedSampler", "_Shard", "RandomSampler")
    out["split"] = (step_split or back_split or sample_split or rows_split) and not overlapping
    out["why"] = (f"optimizer steps per rank {'/'.join(map(str, steps))} of one process's {steps_dev}"
                  + (f", backward calls {'/'.join(map(str, backs))} of {back_dev}" if back_split and not step_split else "")
                  + (f", samples drawn {'/'.join(map(str, drawn))} of {drawn_dev}" if drawn_dev else "")
                  + (f", rows per step {'/'.join(f'{x:.1f}' for x in rows)} of {rows_dev:.1f}" if rows_split else "")
                  + ("; " + sampler["why"] if sampler.get("kind") else ""))
    return out


def classify(rec: dict) -> None:
    dev, ddp, mig = rec.get("device_run"), rec.get("ddp_run"), rec["migrate_ddp"]
    review = " | ".join(mig["review"])
    base_ok = bool(dev and dev["ok"])
    base_note = "the device baseline runs" if base_ok else f"the device baseline fails too ({dev['error'] if dev else 'not run'})"
    own = [line for line in mig["review"] if line.startswith(rec["path"] + ":")]  # the script's, not a sibling's
    said_no_training = bool(NO_TRAINING.search(" | ".join(own)))
    if mig["exit"] != 0 or not mig["compiles"]:
        rec["outcome"] = "crash"
        rec["reason"] = f"migration failed: exit {mig['exit']}; {'; '.join(mig['errors'] + mig['compile_errors'])[:400]}"
        return
    opt = compare_optimizers(ddp) if ddp and ddp["ranks"] else {"count": 0, "steps": []}
    rec["optimizers"] = opt
    stepped = bool(opt["count"]) and any(opt["steps"])
    base_stepped = any(o["steps"] for o in (dev or {}).get("ranks", {}).get(0, {}).get("optimizers") or [])
    prefix = ("gpumigrate said \"no training found\" (so: device changes only) but the script trains "
              "(in a sibling module?); ") if said_no_training else ""
    sibling_trains = said_no_training and _siblings_train(rec)
    if said_no_training and not stepped and not base_stepped and not sibling_trains:
        rec["outcome"] = "no training"
        rec["reason"] = "gpumigrate found no training"
        if ddp and not ddp["ok"]:
            rec["reason"] += (f"; unverified: the run fails before any optimizer step ({ddp['error']})"
                              + ("" if base_ok else "; so does the device baseline"))
        return
    if ddp is None or not ddp["ok"]:
        rec["outcome"] = "crash"
        rec["reason"] = f"{prefix}{ddp['error'] if ddp else 'not run'}; {base_note}"
        rec["crash_kind"] = "baseline fails too" if not base_ok else "only under ddp"
        if not base_ok and dev and ddp and _same_failure(dev, ddp):
            rec["crash_kind"] = "same failure as the baseline"
        return
    rec["sharding"] = work_split(rec)
    declined = [line for line in mig["review"] if DECLINED.search(line)]
    flagged = [line for line in mig["review"] if re.search(r"optimizer|wrap|shard|sampler", line, re.I)]
    if opt.get("mismatch"):
        rec["outcome"], rec["reason"] = "independent", prefix + opt["mismatch"]
    elif not stepped:
        rec["outcome"] = "no training"
        rec["reason"] = "the run ended without an optimizer step" + ("" if opt["count"] else " (no optimizer built)")
    elif all(opt["identical"]):  # one model on every rank: what gpumigrate said does not change that
        if rec["sharding"]["split"]:
            rec["outcome"], rec["reason"] = "data-parallel", rec["sharding"]["why"]
        else:
            rec["outcome"], rec["reason"] = "sync-only", prefix + rec["sharding"]["why"] + (
                "; review said so: " + _short(declined[0]) if declined else "")
    else:
        diff = [i for i, same in enumerate(opt["identical"]) if not same]
        known = [d for d in opt["max_abs_diff"] if d is not None]
        if declined:
            said = "; review said so: " + _short(declined[0])
        elif flagged:
            said = "; no review item says the ranks train apart; nearest: " + _short(flagged[0])
        else:
            said = "; NO review item says so"
        rec["outcome"] = "declined" if declined else "independent"
        rec["reason"] = (prefix + f"optimizer(s) {diff} of {opt['count']} differ across ranks (max |diff| "
                         f"{max(known) if known else 'shape'})" + said)
    if not base_ok:
        rec["reason"] += f"; {base_note}"


def _siblings_train(rec: dict) -> bool:
    """A sibling module the script imports has `.backward(` or `.step(` (a trainer class)."""
    root = Path(rec["device_run"]["out"]).parent if rec.get("device_run") else None
    for rel in rec.get("extra_files", []):
        path = root / rel if root else None
        if (path and path.suffix == ".py" and path.exists()
                and re.search(r"\.backward\(|\.step\(", path.read_text(errors="replace"))):
            return True
    return False


def _same_failure(dev: dict, ddp: dict) -> bool:
    e1, e2 = dev.get("error") or "", ddp.get("error") or ""
    strip = lambda e: re.sub(r" at [^ ]+:\d+$", "", re.sub(r"^rank \d+: ", "", e))[:120]  # noqa: E731
    return strip(e1) == strip(e2)


def _short(line: str) -> str:
    return re.sub(r"^.*?review by hand: ", "", line)[:300]


def _read_ranks(run: Optional[dict]) -> None:
    if run:
        run["ranks"] = {}
        for report in sorted(Path(run["out"]).glob("rank*.json")):
            data = json.loads(report.read_text())
            run["ranks"][data["rank"]] = data


def _slim(rec: dict) -> None:
    """Keep the JSON readable: the probe's own reports stay in the scratch folder."""
    for key in ("device_run", "ddp_run"):
        run = rec.get(key)
        if run:
            run["ranks"] = {r: {k: rep.get(k) for k in ("error", "exit_code", "seconds", "optimizers", "wrap_calls", "backwards", "rows")}
                            | {"samplers": [{k: v for k, v in s.items() if k != "indices"} | {"drawn": len(s["indices"])}
                                            for s in rep.get("samplers", [])]}
                            for r, rep in run["ranks"].items()}


def reclassify(rec: dict) -> dict:
    """Classify again from the probe reports a previous run left in the scratch folder."""
    for target in ("device", "ddp"):
        rec[f"migrate_{target}"]["review"] = [ln for ln in rec[f"migrate_{target}"]["review"] if REVIEW.search(ln)]
    for key in ("device_run", "ddp_run"):
        run = rec.get(key)
        _read_ranks(run)
        if run:
            run["error"] = _error_line(run["returncode"], run["ranks"], run.get("stderr_tail", ""), 300)
    for key in ("outcome", "reason", "crash_kind", "optimizers", "sharding"):
        rec.pop(key, None)
    classify(rec)
    _slim(rec)
    return rec


def run_entry(entry: dict, args, corpus: Path, scratch: Path) -> dict:
    name = entry["name"]
    start = time.perf_counter()
    base = scratch / name
    if base.exists():
        shutil.rmtree(base)
    rec = {"name": name, "repo": entry["repo"], "path": entry["path"], "kind": entry.get("kind", ""),
           "extra_files": entry.get("extra_files", [])}
    files = py_files(entry)
    folders = {}
    for target in ("device", "ddp"):
        folder = base / target
        copy_files(entry, corpus, folder)
        rec[f"migrate_{target}"] = migrate(args.tool_python, folder, files, target, args.gm_root)
        folders[target] = folder
    # idempotence: migrate the ddp output again
    again = base / "ddp-again"
    shutil.copytree(folders["ddp"], again)
    before = snapshot(again, files)
    second = migrate(args.tool_python, again, files, "ddp", args.gm_root)
    rec["idempotent"] = snapshot(again, files) == before and second["exit"] == 0
    shutil.rmtree(again)
    run_args = prepare_runs(entry, list(folders.values()))
    rec["args"] = run_args
    rec["device_run"] = launch(args.python, folders["device"], entry, run_args, 1, args.timeout, args.gm_root)
    if rec["migrate_ddp"]["exit"] == 0 and rec["migrate_ddp"]["compiles"]:
        rec["ddp_run"] = launch(args.python, folders["ddp"], entry, run_args, NPROC, args.timeout, args.gm_root)
    else:
        rec["ddp_run"] = None
    classify(rec)
    rec["seconds"] = round(time.perf_counter() - start, 1)
    _slim(rec)
    return rec


def load_manifests(paths: Optional[List[Path]]) -> List[dict]:
    entries: List[dict] = []
    for path in paths or [MANIFEST]:
        entries.extend(json.loads(path.read_text()))
    return entries


def prepare_runs(entry: dict, folders: List[Path]) -> List[str]:
    """Fake data in each run folder, and the entry's arguments with their placeholders filled."""
    for folder in folders:
        for rel, kind in entry.get("fake_dirs", {}).items():
            make_fake(kind, folder / rel)
        make_fake("text", folder / "_practice" / "fake.txt")
        cwd = folder if entry.get("cwd") == "root" else (folder / entry["path"]).parent
        shutil.copy(folder / "_practice" / "fake.txt", cwd / "_practice_text.txt")
    return [a.replace("{text_file}", "_practice_text.txt").replace("{fake_imagefolder}", "_practice_imagenet")
            for a in entry.get("args", [])]


def device_entry(entry: dict, args, corpus: Path, scratch: Path) -> dict:
    """`--device-only`: the entry's device migration, run once in one process."""
    start = time.perf_counter()
    folder = scratch / entry["name"] / "device"
    if folder.exists():
        shutil.rmtree(folder)
    copy_files(entry, corpus, folder)
    mig = migrate(args.tool_python, folder, py_files(entry), "device", args.gm_root)
    rec = {"name": entry["name"], "steps": 0}
    if mig["exit"] != 0 or not mig["compiles"]:
        rec.update(status="MIGRATION", note="; ".join(mig["errors"] + mig["compile_errors"]) or mig["summary"])
    else:
        run = launch(args.python, folder, entry, prepare_runs(entry, [folder]), 1, args.timeout, args.gm_root)
        rec["steps"] = sum(o.get("steps", 0) for o in run["ranks"].get(0, {}).get("optimizers") or [])
        capped = run.get("stopped_by_step_cap")
        rec.update(status="ok" if run["ok"] and not capped else "step-cap" if run["ok"] else "FAILS",
                   note=run["error"] or "; ".join(run["shim"])[:300])
        if not run["ok"] and args.verbose:
            print(run["stderr_tail"][-3000:])
    rec["seconds"] = round(time.perf_counter() - start, 1)
    return rec


# ---------------------------------------------------------------- through `gpumigrate verify`

VERIFY_TARGETS = ("device", "ddp")


def verify_entry(entry: dict, args, corpus: Path, scratch: Path) -> dict:
    """`gpumigrate verify SCRIPT --to T` for each target, in a copy of the entry's files with
    its fake data made (verify fakes torchvision datasets itself)."""
    name = entry["name"]
    base = scratch / name / "verify"
    if base.exists():
        shutil.rmtree(base)
    copy_files(entry, corpus, base)
    for rel, kind in entry.get("fake_dirs", {}).items():
        make_fake(kind, base / rel)
    script = base / entry["path"]
    cwd = base if entry.get("cwd") == "root" else script.parent
    make_fake("text", cwd / "_practice_text.txt")
    run_args = [a.replace("{text_file}", "_practice_text.txt").replace("{fake_imagefolder}", "_practice_imagenet")
                for a in entry.get("args", [])]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("PYTHON")}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", MPLBACKEND="Agg", PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python",
               PYTHONPATH=os.pathsep.join([str(args.gm_root), *[str(base / p) for p in entry.get("pythonpath", [])]]))
    rec = {"name": name, "repo": entry["repo"], "path": entry["path"], "kind": entry.get("kind", ""), "targets": {}}
    for target in VERIFY_TARGETS:
        cmd = [args.python, "-m", "gpumigrate", "verify", str(script), "--to", target, "--format", "json",
               "--timeout", str(args.timeout), "--samples", SHIM_ENV["PRACTICE_TRAIN_SIZE"], "--", *run_args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, env=env)
        try:
            data = json.loads(proc.stdout)
        except ValueError:
            data = {"verdict": "error", "reason": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
        rec["targets"][target] = {"exit": proc.returncode, "verdict": data.get("verdict"), "reason": data.get("reason"),
                                  "seconds": round(time.perf_counter() - start, 1),
                                  "failed": [c["name"] for c in data.get("checks", []) if c["status"] == "fail"],
                                  "passed": [c["name"] for c in data.get("checks", []) if c["status"] == "pass"]}
    return rec


def verify_markdown(records: List[dict], header: str) -> str:
    lines = [header, "", "| # | script | " + " | ".join(f"--to {t}" for t in VERIFY_TARGETS) + " |",
             "|---|---|" + "---|" * len(VERIFY_TARGETS)]
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    for i, rec in enumerate(records, 1):
        parts = []
        for t in VERIFY_TARGETS:
            r = rec["targets"][t]
            parts.append(f"**{r['verdict']}** ({r['seconds']:.0f} s): {cell((r['reason'] or '')[:220])}")
        lines.append(f"| {i} | `{rec['name']}` ({rec['repo']}: {rec['path']}) | " + " | ".join(parts) + " |")
    lines.append("")
    for t in VERIFY_TARGETS:
        counts = {v: sum(r["targets"][t]["verdict"] == v for r in records)
                  for v in ("equivalent", "different", "unknown", "error")}
        lines.append(f"--to {t}: " + ", ".join(f"{v} {n}" for v, n in counts.items()) + f" ({len(records)} scripts)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- output

OUTCOMES = ("data-parallel", "sync-only", "independent", "declined", "crash", "no training")


def runnable_training(rec: dict) -> bool:
    """The entries the percentage counts: the one-process (device) run ends without an error and
    makes optimizer steps."""
    dev = rec.get("device_run")
    return bool(dev and dev["ok"] and _count(dev, 0, "steps") > 0)


def markdown(records: List[dict], header: str, totals_only: bool = False) -> str:
    lines = [header, "", "| # | script | kind | review | idem | device baseline | ddp outcome | reason / notes | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    if totals_only:
        lines = [header + " (sealed entries: totals only)"]
    for i, rec in enumerate([] if totals_only else records, 1):
        dev = rec.get("device_run")
        base = "ok" if dev and dev["ok"] else f"FAILS: {(dev or {}).get('error') or 'not run'}"
        cap = " (step cap)" if dev and dev.get("stopped_by_step_cap") else ""
        outcome = rec["outcome"] + (f" ({rec['crash_kind']})" if rec.get("crash_kind") else "")
        cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines.append(f"| {i} | `{rec['name']}` ({rec['repo']}: {rec['path']}) | {cell(rec['kind'])} | "
                     f"{len(rec['migrate_ddp']['review'])} | {'yes' if rec['idempotent'] else '**no**'} | "
                     f"{cell(base[:160])}{cap} | **{outcome}** | {cell(rec['reason'][:400])} | {rec['seconds']:.0f} |")
    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    lines += ["", "Totals: " + ", ".join(f"{o} {n}" for o, n in counts.items()) + f" ({len(records)} scripts)"]
    crashes = [r for r in records if r["outcome"] == "crash"]
    lines.append(f"Crashes: {sum(r.get('crash_kind') == 'only under ddp' for r in crashes)} only under ddp (the "
                 f"device baseline runs), {sum(r.get('crash_kind') != 'only under ddp' for r in crashes)} where the "
                 f"baseline fails too.")
    lines.append(f"Device baseline runs: {sum(bool(r.get('device_run') and r['device_run']['ok']) for r in records)}"
                 f"/{len(records)}. Not idempotent: {sum(not r['idempotent'] for r in records)}.")
    runnable = [r for r in records if runnable_training(r)]
    lines.append(f"Runnable training scripts (the one-process run trains): {len(runnable)}; data-parallel "
                 f"{sum(r['outcome'] == 'data-parallel' for r in runnable)} "
                 f"({100 * sum(r['outcome'] == 'data-parallel' for r in runnable) / max(1, len(runnable)):.0f}%), "
                 + ", ".join(f"{o} {sum(r['outcome'] == o for r in runnable)}" for o in OUTCOMES[1:]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for the runs (needs torch, torchvision, gpumigrate)")
    parser.add_argument("--tool-python", default=sys.executable, help="interpreter that runs gpumigrate")
    parser.add_argument("--manifest", type=Path, action="append",
                        help="a manifest of entries (repeatable; default bench/practice_corpus.json)")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/practice-scratch"))
    parser.add_argument("--only", default="", help="comma-separated entry names")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--at", metavar="REV", help="use gpumigrate (tool, runtime, probe) as committed at REV "
                        "(`git archive` into the scratch folder), not this work tree with its uncommitted edits")
    parser.add_argument("--reclassify", type=Path, metavar="JSON",
                        help="no runs: classify again the records of JSON from the probe reports in the scratch folder")
    parser.add_argument("--verify", action="store_true",
                        help="instead of the probe runs: `gpumigrate verify --to device` and `--to ddp` on each entry")
    parser.add_argument("--sealed", action="store_true",
                        help="only the sealed entries (bench/practice_sealed.json), reported as totals only")
    parser.add_argument("--unsealed", action="store_true", help="leave the sealed entries out")
    parser.add_argument("--device-only", action="store_true",
                        help="only the `--to device` migration, run in one process: does the entry run at all, and "
                             "does it end by itself (the step cap not reached)?")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.reclassify:
        data = json.loads(args.reclassify.read_text())
        manifest = {e["name"]: e for e in load_manifests(args.manifest)}
        for rec in data["records"]:
            rec.setdefault("extra_files", manifest.get(rec["name"], {}).get("extra_files", []))
        records = [reclassify(rec) for rec in data["records"]]
        text = markdown(records, f"gpumigrate at `{data['commit']}`; runs with {args.python}")
        print(text)
        if args.md:
            args.md.write_text(text)
        if args.json:
            args.json.write_text(json.dumps({"commit": data["commit"], "records": records}, indent=1, default=str))
        return 0
    args.gm_root = ROOT
    if args.at:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.at], capture_output=True, text=True,
                             check=True).stdout.strip()
        args.gm_root = args.scratch / f"gpumigrate-{sha[:10]}"
        if not args.gm_root.exists():
            args.gm_root.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(args.gm_root)], input=archive, check=True)
    entries = load_manifests(args.manifest)
    sealed = set(json.loads(SEALED.read_text())["names"]) if SEALED.exists() else set()
    if args.sealed or args.unsealed:
        entries = [e for e in entries if (e["name"] in sealed) == args.sealed]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {e["name"] for e in entries}
        if unknown:
            parser.error(f"no such entries: {', '.join(sorted(unknown))}")
        entries = [e for e in entries if e["name"] in wanted]
    missing = [e["name"] for e in entries if not (corpus_dir(e, args.corpus) / e["path"]).exists()]
    if missing:
        parser.error(f"not in {args.corpus}: {', '.join(missing)} (fetch the corpus first: see the manifest)")
    commit = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s", args.at or "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    if not args.at and subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                      capture_output=True, text=True).stdout.strip():
        commit += " + uncommitted edits of the work tree"
    records = []
    if args.device_only:
        for entry in entries:
            rec = device_entry(entry, args, args.corpus, args.scratch)
            print(f"{rec['name']:28} {rec['status']:10} {rec['seconds']:6.1f}s steps {rec['steps']:4}  {rec['note'][:160]}",
                  flush=True)
        return 0
    if args.verify:
        for entry in entries:
            rec = verify_entry(entry, args, args.corpus, args.scratch)
            records.append(rec)
            print(f"{rec['name']:28} " + "  ".join(f"{t} {r['verdict']} {r['seconds']:.0f}s: {(r['reason'] or '')[:90]}"
                                                   for t, r in rec["targets"].items()), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"commit": commit, "records": records}, indent=1))
        text = verify_markdown(records, f"`gpumigrate verify` at `{commit}`; runs with {args.python}")
        print(text)
        if args.md:
            args.md.write_text(text)
        return 0
    for entry in entries:
        rec = run_entry(entry, args, args.corpus, args.scratch)
        records.append(rec)
        if args.sealed:
            print(f"sealed entry {len(records)}/{len(entries)} done", flush=True)
            continue
        print(f"{rec['name']:28} {rec['outcome']:14} {rec['seconds']:6.1f}s  {rec['reason'][:150]}", flush=True)
        if args.verbose and rec.get("ddp_run") and not rec["ddp_run"]["ok"]:
            print(rec["ddp_run"]["stderr_tail"][-2000:])
        if args.json:  # as it goes: a long run leaves what it has
            args.json.write_text(json.dumps({"commit": commit, "records": records}, indent=1, default=str))
    text = markdown(records, f"gpumigrate at `{commit}`; runs with {args.python}", totals_only=args.sealed)
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
